"""Planners (pure Python + C++, no torch).

- ``calls``: the KDA call planner (C++ core in ``csrc/``), with its brute-force judge and baselines.
- ``cost_model``, ``l1``, ``l2``, ``microbatch``, ``metrics``, ``packing_baselines``: the two-level
  microbatch planner, its plan objects and one metrics function, and the packing baselines.
"""
from megatron_harts.planner.calls import CallPlan, check_inputs, plan_calls
from megatron_harts.planner.cost_model import CostModel, load_calibration
from megatron_harts.planner.l1 import plan_l1
from megatron_harts.planner.l2 import plan_harts, plan_l2
from megatron_harts.planner.metrics import plan_metrics
from megatron_harts.planner.microbatch import (ExternalContext, Microbatch, MicrobatchPlan, PlanningError,
                                               SharingWindow)

__all__ = ["CallPlan", "check_inputs", "plan_calls", "CostModel", "load_calibration", "plan_l1", "plan_l2",
           "plan_harts", "plan_metrics", "ExternalContext", "Microbatch", "MicrobatchPlan", "PlanningError",
           "SharingWindow"]
