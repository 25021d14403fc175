"""Planners: the KDA call planner (``calls``; C++ core in ``csrc/``) and its baselines."""
from megatron_harts.planner.calls import CallPlan, check_inputs, plan_calls

__all__ = ["CallPlan", "check_inputs", "plan_calls"]
