"""``packed_rows`` of the compiled packers' packings (``_C.L2Packing.rows``) against the Python sum."""
import pytest

from megatron_harts.planner.cost_model import CostModel, ForestIndex
from megatron_harts.planner.l1 import plan_l1
from megatron_harts.planner.l2_packing import _packed_rows_python, packed_rows
from megatron_harts.planner.l2_spread import pack_spread
from megatron_harts.planner.l2_units import unit_arrays, window_units
from megatron_harts.planner.l2_windows import pack_windows
from megatron_harts.tree_data import build_forest
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe


def test_compiled_packing_rows_match_python():
    checked = 0
    for scheme, samples in (("tree-step", 4), ("step-wise", 8)):
        forest = build_forest(synthesize_swe(SweConfig(scheme=scheme, num_tasks=3, samples_per_task=samples, seed=2)))
        ix = ForestIndex(forest)
        M = int(ix.tree_max_path.max()) + 4000
        for dp in (2, 4):
            l1 = plan_l1(forest, dp, M, index=ix)
            units = window_units(ix, l1, CostModel(), 64)
            arrays = unit_arrays(units)
            for packer in (pack_windows, pack_spread):
                for S in (1, 2, 3):
                    for packed in packer(ix, units, dp, M, S, 0.01, arrays)[0]:
                        if isinstance(packed, tuple):
                            pytest.skip("the compiled packers are not built")
                        expect = _packed_rows_python(ix, tuple(packed))
                        assert packed_rows(ix, packed) == expect > 0
                        checked += 1
    assert checked >= 8
