"""Sharing windows on compaction traces: a consumer's rows see exactly the context keys (producer
rows) and own keys that no event on their path evicts, whether the event sits on a producer row or
on a consumer row.  Layout level against the per-trajectory definition ``j <= i and not any(start <=
j < end and at <= i)`` (every backend's key sets against the dense mask), and through the hybrid
model: windows (producer + consumers, planned or drawn, recomputed producers too) == whole tree
(within) == expanded, fp64, 1e-10."""
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_harts.layout import build_layout
from megatron_harts.models.model import build_hybrid_model
from megatron_harts.models.packed import ExportSpec
from megatron_harts.ops.key_paths import build_key_paths
from megatron_harts.planner.cost_model import CostModel
from megatron_harts.planner.l2 import plan_harts
from megatron_harts.schedules.windows import WindowedMicrobatch, forward_backward_windows, windowed_microbatches
from megatron_harts.tree_data import build_forest

from hybrid_tiny import VOCAB, randomize_, tiny_config
from test_compaction_layout import brute_mask, trees_with_events
from test_compaction_model import forest_with_events
from test_layout import outermost
from test_windows_schedule import assert_same, coef_of, owned_outside, run_step

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def combined_dense(lay):
    """Boolean [R, Rc + R]: the layout's rows over its context keys, then its own keys."""
    own = lay.visibility.validate().dense().numpy()
    if not lay.num_context_rows:
        return own
    ctx = lay.context_visibility.validate("context_visibility").dense().numpy()
    return np.concatenate([ctx, own], axis=1)


def check_against_trajectories(forest, lay):
    """Every row's visible set (context and own keys) is its trajectories' mask over their rows, and
    nothing else is visible; returns the combined dense mask."""
    dense = combined_dense(lay)
    Rc = lay.num_context_rows
    col = {r: i for i, r in enumerate(lay.ctx_forest_rows.tolist())}
    col.update({r: Rc + i for i, r in enumerate(lay.forest_rows.tolist())})
    want = np.zeros_like(dense)
    for t, tid in enumerate(lay.traj_ids):
        tr = forest.expand(tid)
        held = lay.trajectory_rows(t).numpy()
        s, n = int(lay.traj_start[t]), held.shape[0]
        frows = forest.trajectory_rows(int(lay.traj_forest[t]))[:s + n]
        cols = np.array([col[int(r)] for r in frows], dtype=np.int64)
        assert np.array_equal(cols[s:], Rc + held)
        m = brute_mask(len(tr), tr.compactions)[s:s + n, :s + n]
        np.testing.assert_array_equal(dense[np.ix_(held, cols)], m, err_msg=f"trajectory {tid!r}")
        want[np.ix_(held, cols)] |= m
    np.testing.assert_array_equal(dense, want)
    return dense


def check_key_paths(lay, dense):
    """The varlen runs (built as the model builds them) hold exactly the dense mask's pairs, where the
    model takes them (else it runs the block-mask backends, which read the visibility itself)."""
    Rc = lay.num_context_rows
    paths = build_key_paths(lay.visibility, lay.context_visibility if Rc else None,
                            prev=lay.prev if lay.num_events else None)
    got = np.zeros_like(dense)
    q_off, k_off = paths.q_offsets.tolist(), paths.k_offsets.tolist()
    for g in range(paths.num_runs):
        lq, lk = q_off[g + 1] - q_off[g], k_off[g + 1] - k_off[g]
        keys = paths.key_index[k_off[g]:k_off[g + 1]].numpy()
        assert list(keys[lk - lq:]) == list(range(Rc + q_off[g], Rc + q_off[g + 1]))
        for i in range(lq):
            got[q_off[g] + i, keys[:lk - (lq - 1 - i)]] = True
    np.testing.assert_array_equal(got, dense)
    assert paths.pairs == int(dense.sum())


def window_layouts(forest, data):
    """Layouts of drawn consumer subtrees over a whole-forest producer, and a planned step's layouts
    (producers of computed segment sets, consumers reading them, microbatches recomputing context)."""
    producer = build_layout(forest)
    inner = [s for s in range(forest.num_segments) if forest.seg_parent[s] >= 0]
    out = [producer]
    if inner:
        picked = data.draw(st.lists(st.sampled_from(inner), min_size=1, max_size=4, unique=True), label="roots")
        out.append(build_layout(forest, roots=outermost(forest, picked), context=producer))
    longest = int(forest.traj_length.max())
    budget = data.draw(st.integers(longest, longest + 3), label="row budget")
    _, plan = plan_harts(forest, 1, budget, cost_model=CostModel(chunk_size=4), min_producer_rows=1)
    out += [it.layout for it in windowed_microbatches(forest, plan)]
    return out


@settings(max_examples=25, deadline=None)
@given(trees_with_events(max_traj=7, max_len=12), st.data())
def test_consumer_visibility_equals_every_trajectorys_mask(trajs, data):
    f = build_forest(trajs)
    for lay in window_layouts(f, data):
        dense = check_against_trajectories(f, lay)
        check_key_paths(lay, dense)


# ---- through the hybrid model ----------------------------------------------------------------

def expanded_with_events(model, forest):
    """Expanded training of the forest (each trajectory on its own, its events' visibility)."""
    from test_compaction_model import expanded_inputs
    model.zero_grad(set_to_none=True)
    lay = build_layout(forest)
    ids, pos, psp, rows, tokens, _ = expanded_inputs(lay, forest)
    lp = model(ids, pos, packed_seq_params=psp, pair_row=rows, pair_token=tokens)
    keys = list(zip(lay.traj_forest[lay.target_traj.numpy()].tolist(), lay.target_position.tolist()))
    (torch.tensor([coef_of(k) for k in keys], dtype=lp.dtype) * lp).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(zip(keys, lp.detach().tolist())), grads


def run_windows(model, mbs, recompute_producers=False):
    return run_step(model, mbs, recompute_producers)[:2]


def drawn_windows(forest, roots):
    """Per tree a whole-tree producer and one consumer per given root segment in it."""
    order = []
    for t in range(forest.num_trees):
        lo, hi = int(forest.tree_offsets[t]), int(forest.tree_offsets[t + 1])
        prod = build_layout(forest, trees=[t])
        cons = [build_layout(forest, roots=[r], context=prod) for r in roots if lo <= r < hi]
        p = len(order)
        order.append(WindowedMicrobatch(prod, owned_outside(prod, cons) if cons else None))
        order += [WindowedMicrobatch(c, producer=p) for c in cons]
    return order


#: consumer roots of forest_with_events (segments: tree 0's 1 and 2 fork at 4, tree 1's 4 and 10 at 6,
#: 5 and 9 at 7): deep ones read context evicted by a producer row's event (at 6) and hold events
#: evicting context keys only (at 4, 7, 11) and context and own keys (at 8, 9, 11); shallow ones start
#: at an event row (6)
DEEP, SHALLOW = [1, 2, 5, 9], [1, 2, 4, 10]


def test_fixed_consumers_cover_every_kind_of_eviction():
    """forest_with_events' consumers below position 7: an event on a producer row evicting context keys
    (at 6), consumer-row events evicting context keys only (at 7, at 11) and context and own keys (at
    9); each consumer's visibility is its trajectories' masks; the export holds only seen context rows."""
    f = forest_with_events()
    mbs = drawn_windows(f, DEEP)
    cons = [mb.layout for mb in mbs if mb.producer is not None]
    assert len(cons) == 4
    for lay in cons + [mb.layout for mb in mbs]:
        check_key_paths(lay, check_against_trajectories(f, lay))
    holes = [c for c in cons if c.context_visibility.num_intervals != c.num_context_rows]
    assert holes
    # segment 9's first row evicts every context row: it reads none; MLA exports only seen context rows
    assert not (mbs[-1].layout.ctx_vis_offsets[1:] - mbs[-1].layout.ctx_vis_offsets[:-1]).any()
    for p in (0, 3):
        readers = [mb.layout for mb in mbs if mb.producer == p]
        spec = ExportSpec.for_consumers(mbs[p].layout, readers, chunk_size=4)
        seen = set()
        for c in readers:
            counts = (c.ctx_vis_offsets[1:] - c.ctx_vis_offsets[:-1]).numpy()
            seen |= set(c.ctx_source_rows.numpy()[counts > 0].tolist())
        assert set(spec.rows.tolist()) == seen
        assert len(seen) < len(set(np.concatenate([c.ctx_source_rows.numpy() for c in readers]).tolist()))


@pytest.mark.parametrize("backend,recompute,roots", [("sdpa", False, DEEP), ("varlen", True, DEEP),
                                                    ("reference", True, SHALLOW)],
                         ids=["sdpa", "varlen_recomputed_producers", "shallow_recomputed_producers"])
def test_windows_equal_within_and_expanded_fp64(cpu_world, backend, recompute, roots):
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                      tree_attention_backend=backend)
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 2)
    forest = forest_with_events()
    mbs = drawn_windows(forest, roots)
    assert sum(mb.producer is not None for mb in mbs) == 4
    win = run_windows(model, mbs, recompute)
    within = run_windows(model, [WindowedMicrobatch(build_layout(forest))])
    expanded = expanded_with_events(model, forest)
    assert_same(win, within, "windows vs within")
    assert_same(win, expanded, "windows vs expanded")


def test_planned_windows_equal_expanded_fp64(cpu_world):
    """A planner's step (producers of computed segment sets, consumers, recomputed context) on a
    forest with events == expanded training, with and without recomputed producers."""
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 4)
    forest = forest_with_events()
    _, plan = plan_harts(forest, 1, 20, cost_model=CostModel(chunk_size=cfg.kda_chunk_size), min_producer_rows=1)
    items = windowed_microbatches(forest, plan)
    assert any(it.producer is not None for it in items)
    expanded = expanded_with_events(model, forest)
    for recompute in (False, True):
        assert_same(run_windows(model, items, recompute), expanded, f"planned windows (recompute={recompute})")
