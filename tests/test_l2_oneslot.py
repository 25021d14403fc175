"""L2's one-slot packer (``l2_oneslot.pack_one_slot``): the compiled search equals its Python reference unit for
unit; its descent never ends worse than its start; its packings assemble into valid plans that read nothing
(one slot: no producer runs before a consumer) and run as planned; within ``plan_l2`` a one-slot batch gets a
plan no longer than the packing's and never more tokens than L1."""
import math

import numpy as np
import pytest

from test_l2_executed import CASES, _swe, check_executes_as_planned

import megatron_harts.planner.l2 as l2
import megatron_harts.planner.l2_oneslot as one
from megatron_harts.planner.cost_model import CostModel, ForestIndex
from megatron_harts.planner.l1 import plan_l1
from megatron_harts.planner.l2 import plan_l2, step_cost, window_key, window_plan
from megatron_harts.planner.l2_units import unit_arrays, window_units


def _one_slot_cases():
    """Step-wise and Tree-Step batches whose units fit in one slot of DP 4 and 8 (a budget of an eighth of
    the forest's L1 rows, at least its longest trajectory)."""
    out = []
    for scheme in ("step-wise", "tree-step"):
        for seed in (3, 5):
            f = _swe(scheme, seed, tasks=4)
            for dp in (4, 8):
                M = max(int(f.traj_length.max()), int(f.seg_length.sum() * 1.5 / dp))
                out.append((f"{scheme}{seed}dp{dp}", f, M, CostModel(chunk_size=64), dp))
    return out


ONE_SLOT = _one_slot_cases()


def _setup(f, M, model, dp):
    ix = ForestIndex(f)
    l1 = plan_l1(f, dp, M, cost_model=model, index=ix)
    return ix, l1, window_units(ix, l1, model, model.chunk_size)


def _search_args(ix, units, model):
    ints, flts, _, _, _, _, path_off, path = unit_arrays(units)
    c = model.coefficients
    body = c.row * ix.length + c.attention_pair * ix.seg_pairs
    return ints[:, 0], ints[:, 2], flts[:, 0], ints[:, 7], flts[:, 1], path_off, path, ix.length, body


def _python(args, dp, M, max_rows, steps=one.ONE_SLOT_STEPS, S=1, start=None):
    return one._search_python(*(a.tolist() for a in args), dp, S, M, max_rows, steps, start)


def _compiled(args, dp, M, max_rows, S=1, start=None):
    off, units = one._SEARCH(*args, dp, S, M, max_rows, one.ONE_SLOT_STEPS,
                             np.asarray([] if start is None else start, dtype=np.int64))
    off, units = off.tolist(), units.tolist()
    return None if len(off) == 1 else [units[off[b]:off[b + 1]] for b in range(len(off) - 1)]


ALL = [(n, f, M, model, dp) for n, f, M, model in CASES for dp in (2, 8)] + ONE_SLOT


@pytest.mark.parametrize("name,forest,M,model,dp", ALL, ids=[c[0] + f"dp{c[4]}" for c in ALL])
def test_compiled_equals_reference(name, forest, M, model, dp):
    if one._SEARCH is None:
        pytest.skip("megatron_harts._C not built")
    ix, l1, units = _setup(forest, M, model, dp)
    args = _search_args(ix, units, model)
    # L1's tokens, and a budget the start passes (the search then lowers its rows first)
    for max_rows in (l1.tokens_computed, int(ix.length.sum())):
        assert _compiled(args, dp, M, max_rows) == _python(args, dp, M, max_rows), name
    # a budget of the largest unit's rows: items away from their core fit nowhere with their path
    small = max(u.rows for u in units)
    assert _compiled(args, dp, small, l1.tokens_computed) == _python(args, dp, small, l1.tokens_computed)


def _key(args, ent, max_rows):
    """(rows over max_rows, step, sum of squares) of a one-slot assignment, as the reference measures it."""
    kind, win, cost, rows, _, path_off, path, length, body = (a.tolist() for a in args)
    loads, total = [], 0
    for lst in ent:
        cores = {win[u] for u in lst if kind[u] == 0}
        c = sum(cost[u] for u in lst)
        r = sum(rows[u] for u in lst)
        need = {path[q] for u in lst if kind[u] == 1 and win[u] not in cores for q in range(path_off[u], path_off[u + 1])}
        loads.append(c + sum(body[s] for s in need))
        total += r + sum(length[s] for s in need)
    return max(total - max_rows, 0), max(loads), sum(v * v for v in loads)


@pytest.mark.parametrize("name,forest,M,model,dp", ONE_SLOT, ids=[c[0] for c in ONE_SLOT])
def test_descent_never_ends_worse_than_its_start(name, forest, M, model, dp):
    ix, l1, units = _setup(forest, M, model, dp)
    args = _search_args(ix, units, model)
    start = _python(args, dp, M, l1.tokens_computed, steps=0)
    end = _python(args, dp, M, l1.tokens_computed)
    assert start is not None and end is not None
    assert sorted(u for lst in end for u in lst) == list(range(len(units)))  # every unit placed once
    k0, k1 = _key(args, start, l1.tokens_computed), _key(args, end, l1.tokens_computed)
    assert k1[0] <= k0[0]
    if k1[0] == k0[0]:
        assert k1[1] <= k0[1] + 1e-9
    assert k1 != k0 or start == end


@pytest.mark.parametrize("name,forest,M,model,dp", ONE_SLOT, ids=[c[0] for c in ONE_SLOT])
def test_one_slot_packing_is_a_valid_plan(name, forest, M, model, dp):
    ix, l1, units = _setup(forest, M, model, dp)
    packed = one.pack_one_slot(ix, units, dp, M, model, l1.tokens_computed)
    assert packed is not None
    groups, placement, loads, entries = packed
    assert all(k == 0 for _, k in placement) and len({r for r, _ in placement}) == len(placement) <= dp
    owned = sorted(s for own, _ in groups for s in own)
    assert owned == list(range(forest.num_segments))  # every segment owned once
    plan = window_plan(ix, packed, dp=dp, M=M, model=model)
    assert plan is not None and plan.num_slots == 1
    plan.validate(forest)
    assert not plan.windows and all(not m.external for m in plan.microbatches)
    check_executes_as_planned(forest, plan)
    assert window_key(ix, packed, dp=dp, M=M, model=model) == (step_cost(plan), plan.tokens_computed)
    # the loads are the search's estimates: each entry's cost, its path counted once per microbatch
    assert [sum(l) for l in loads if l] == pytest.approx([sum(c for _, _, c in es) for es in entries])


@pytest.mark.parametrize("name,forest,M,model,dp", ONE_SLOT, ids=[c[0] for c in ONE_SLOT])
def test_plan_l2_takes_the_one_slot_packing_when_shorter(name, forest, M, model, dp):
    ix, l1, units = _setup(forest, M, model, dp)
    assert math.ceil(math.ceil(sum(u.rows for u in units) / M) / dp) == 1  # a one-slot batch
    l2 = plan_l2(forest, l1, cost_model=model, index=ix)
    l2.validate(forest)
    check_executes_as_planned(forest, l2)
    assert l2.tokens_computed <= l1.tokens_computed and step_cost(l2) <= step_cost(l1)
    packed = one.pack_one_slot(ix, units, dp, M, model, l1.tokens_computed)
    key = window_key(ix, packed, dp=dp, M=M, model=model)
    if key is not None and key[1] <= l1.tokens_computed:
        assert (step_cost(l2), l2.tokens_computed) <= key


def _captured_search(forest, M, model, dp, monkeypatch):
    """plan_l2's call of search_slots on this batch (its arguments; None where the chosen plan has other than
    2..SEARCH_SLOTS slots) and plan_l2's plan."""
    got = {}
    real = l2.search_slots

    def spy(*args):
        got["args"] = args
        return real(*args)

    monkeypatch.setattr(l2, "search_slots", spy)
    ix = ForestIndex(forest)
    l1 = plan_l1(forest, dp, M, cost_model=model, index=ix)
    plan = plan_l2(forest, l1, cost_model=model, index=ix)
    monkeypatch.undo()
    return got.get("args"), l1, plan


FEW = [(n, f, M, model, dp) for n, f, M, model in CASES for dp in (2, 4, 8)] + \
      [(n, f, M, model, dp // 2) for n, f, M, model, dp in ONE_SLOT]


@pytest.mark.parametrize("name,forest,M,model,dp", FEW, ids=[c[0] + f"dp{c[4]}" for c in FEW])
def test_search_slots_compiled_equals_reference_and_runs_as_planned(name, forest, M, model, dp, monkeypatch):
    args, l1, plan = _captured_search(forest, M, model, dp, monkeypatch)
    plan.validate(forest)
    check_executes_as_planned(forest, plan)
    assert plan.tokens_computed <= l1.tokens_computed and step_cost(plan) <= step_cost(l1)
    if args is None:
        return
    ix, units, chosen, _, max_rows, _ = args
    assert 1 < chosen.num_slots <= l2.SEARCH_SLOTS
    out = one.search_slots(*args)
    if one._SEARCH is not None:
        monkeypatch.setattr(one, "_SEARCH", None)
        assert one.search_slots(*args) == out, name  # the reference, from the wrapper down
        monkeypatch.undo()
    if out is None:
        return
    got = window_plan(ix, out, dp=dp, M=M, model=model)
    assert got is not None
    got.validate(forest)
    check_executes_as_planned(forest, got)  # every read the search counted is a window the schedule runs
    assert sorted(s for own, _ in out[0] for s in own) == list(range(forest.num_segments))
    key = window_key(ix, out, dp=dp, M=M, model=model)
    if key[1] <= l1.tokens_computed:  # a candidate: plan_l2 keeps the better of it and the plan it refines
        assert (step_cost(plan), plan.tokens_computed) <= min(key, (step_cost(chosen), chosen.tokens_computed))


def test_search_slots_runs_on_some_cases(monkeypatch):
    """The cases above reach the few-slot search, and it changes some plans (else its tests would pass idly)."""
    ran = changed = 0
    for name, forest, M, model, dp in FEW:
        args, _, _ = _captured_search(forest, M, model, dp, monkeypatch)
        if args is not None:
            ran += 1
            changed += one.search_slots(*args) is not None
    assert ran >= 3 and changed >= 1
