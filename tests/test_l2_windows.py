"""L2's window packer: the compiled core (_C.l2_pack_windows) equals its Python reference.

Equal means every packing (groups, placement, loads, entries: the same unit objects, the same
recomputed paths, floats exact; and the compiled packing's own ``estimate_step``) and the
``bound`` flag, on whole and split units, several slot
counts and targets; the packer's variants (leveled, light microbatches dissolved, both) and its
split windows' slot order are all compared, and the seeded cases must reach each of them.
"""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_harts.planner import l2_windows
from megatron_harts.planner.cost_model import CostModel, ForestIndex
from megatron_harts.planner.l1 import plan_l1
from megatron_harts.planner.l2_packing import _estimate_step_python, estimate_step
from megatron_harts.planner.l2_units import split_windows, unit_arrays, window_units
from test_microbatch_planner import _l2_forests, random_prefix_forest

pytestmark = pytest.mark.skipif(l2_windows.pack_windows.fast is None, reason="the compiled extension is not built")


def _key(out):
    packings, bound = out
    return bound, [(g, p, l, [[(id(u), tuple(ex), c) for u, ex, c in es] for es in e]) for g, p, l, e in packings]


def _unit_sets(ix, l1, model, dp):
    units = window_units(ix, l1, model, model.chunk_size)
    return [units] + [x for x in (split_windows(ix, units, model, dp, sh) for sh in (0.5, 0.35)) if x is not None]


def _compare(ix, us, dp, M, epsilons=(0.01, 0.05)):
    """Compiled and reference packings of ``us`` at three slot counts and ``epsilons``; returns
    the reference's outputs."""
    S0 = max(1, math.ceil(math.ceil(sum(u.rows for u in us) / M) / dp))
    arrays = unit_arrays(us)
    outs = []
    for S in (S0, S0 + 1, S0 + 2):
        for eps in epsilons:
            ref = l2_windows._pack_windows_python(ix, us, dp, M, S, eps)
            fast = l2_windows.pack_windows(ix, us, dp, M, S, eps, arrays)
            assert _key(fast) == _key(ref)
            assert _key(l2_windows.pack_windows(ix, us, dp, M, S, eps)) == _key(ref)
            for packed, packed_ref in zip(fast[0], ref[0]):  # the compiled packing's own estimate
                for overhead in (0.0, 1.7):
                    assert packed.estimate_step(overhead) == estimate_step(packed_ref, dp, overhead)
                    assert estimate_step(packed, dp, overhead) == _estimate_step_python(packed_ref, dp, overhead)
            outs.append(ref)
    return outs


def test_compiled_pack_windows_matches_python():
    # the seeded L2 forests (Step-wise 256, a small Tree-Step batch, random rollouts) on DP 2, 3,
    # 4 and 8: every variant and the split windows' order are reached
    n = variants = bound = split = 0
    for f, M, model in _l2_forests():
        ix = ForestIndex(f)
        for dp in (2, 3, 4, 8):
            l1 = plan_l1(f, dp, M, cost_model=model, index=ix)
            for us in _unit_sets(ix, l1, model, dp):
                for packings, b in _compare(ix, us, dp, M):
                    n += 1
                    variants += len(packings) > 1
                    bound += b
                    split += any(u.upper >= 0 for u in us)
    assert n > 150 and variants > 20 and bound > 20 and split > 20


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([2, 3, 4, 8]), st.sampled_from([1, 4, 16]),
       st.floats(1.0, 3.0))
def test_compiled_pack_windows_random_forests(seed, dp, chunk, slack):
    rng = np.random.default_rng(seed)
    f = random_prefix_forest(rng, trajectories=(6, 40), extension=60, root=120)
    model = CostModel(chunk_size=chunk)
    M = int(math.ceil(int(f.traj_length.max()) * slack))
    ix = ForestIndex(f)
    l1 = plan_l1(f, dp, M, cost_model=model, index=ix)
    for us in _unit_sets(ix, l1, model, dp):
        _compare(ix, us, dp, M, (0.0, 0.01, 0.3))


def _dp2_units():
    """(index, row budget, window units) of the second L2 forest planned by L1 for 2 replicas."""
    f, M, model = _l2_forests()[1]
    ix = ForestIndex(f)
    l1 = plan_l1(f, 2, M, cost_model=model, index=ix)
    return ix, M, window_units(ix, l1, model, model.chunk_size)


def test_compiled_pack_windows_refuses_bad_arrays():
    # bad input is a ValueError naming what is wrong, never a crash; one replica is the reference's
    ix, M, us = _dp2_units()
    ints, flts, oo, o, ro, r, po, p = unit_arrays(us)
    with pytest.raises(ValueError, match="dp must be"):
        l2_windows.pack_windows.fast(us, ix.length, ints, flts, oo, o, ro, r, po, p, 1, M, 1, 0.01)
    with pytest.raises(ValueError, match="one row per unit"):
        l2_windows.pack_windows.fast(us[:-1], ix.length, ints, flts, oo, o, ro, r, po, p, 2, M, 1, 0.01)
    bad = o.copy()
    bad[0] = ix.num_segments
    with pytest.raises(ValueError, match="own: segment out of range"):
        l2_windows.pack_windows.fast(us, ix.length, ints, flts, oo, bad, ro, r, po, p, 2, M, 1, 0.01)
    assert _key(l2_windows.pack_windows(ix, us, 1, M, 1)) == _key(l2_windows._pack_windows_python(ix, us, 1, M, 1))


def test_compiled_unit_array_checks_are_shared():
    # the balance pass and both packers check unit_arrays with one routine: the same errors everywhere
    from megatron_harts.planner import l2_balance, l2_spread
    ix, M, us = _dp2_units()
    ints, flts, oo, o, ro, r, po, p = unit_arrays(us)
    packers = (l2_windows.pack_windows.fast, l2_spread.pack_spread.fast)
    for fn in packers:
        with pytest.raises(ValueError, match=r"ints must be int64\[units, 8\]"):
            fn(us, ix.length, ints[:, :7], flts, oo, o, ro, r, po, p, 2, M, 1, 0.01)
        with pytest.raises(ValueError, match="one entry per unit plus one"):
            fn(us, ix.length, ints, flts, oo[:-1], o, ro, r, po, p, 2, M, 1, 0.01)
        with pytest.raises(ValueError, match="path: offsets do not match"):
            fn(us, ix.length, ints, flts, oo, o, ro, r, po, p[:-1], 2, M, 1, 0.01)
    reb = l2_balance._REBALANCE
    n = 2
    args = (np.zeros(n, dtype=np.int64), np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64), 2, M, 0.0, 10, 4, 1.0, 64, 0, 0, False)
    with pytest.raises(ValueError, match=r"ints must be int64\[units, 7\]"):
        reb(ix.length, ints, flts, oo, o, ro, r, po, p, *args)
    bad = o.copy()
    bad[0] = -1
    with pytest.raises(ValueError, match="own: segment out of range"):
        reb(ix.length, np.ascontiguousarray(ints[:, :7]), flts, oo, bad, ro, r, po, p, *args)


def test_compiled_pack_many_matches_its_loop():
    # CompiledPacker.many (one call of _C.l2_pack_windows_many / _C.l2_pack_spread_many) gives the
    # packings of its reference loop (every slot count, a larger tolerance only while a placement
    # was turned away), the same packings in the same order, on the seeded L2 forests
    from megatron_harts.planner import l2_spread
    n = 0
    for f, M, model in _l2_forests()[:4]:
        ix = ForestIndex(f)
        for dp in (2, 4, 8):
            for us in _unit_sets(ix, plan_l1(f, dp, M, cost_model=model, index=ix), model, dp):
                S0 = max(1, math.ceil(math.ceil(sum(u.rows for u in us) / M) / dp))
                arrays = unit_arrays(us)
                for packer in (l2_windows.pack_windows, l2_spread.pack_spread):
                    assert packer.fast_many is not None
                    slots, epss = range(S0, S0 + 3), (0.01, 0.05)
                    fast = packer.many(ix, us, dp, M, slots, epss, arrays)
                    saved = packer.fast_many
                    try:
                        packer.fast_many = None
                        ref = packer.many(ix, us, dp, M, slots, epss, arrays)
                    finally:
                        packer.fast_many = saved
                    assert _key((fast, True)) == _key((ref, True))
                    n += len(ref)
    assert n > 50
