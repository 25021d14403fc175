"""megatron_harts: train hybrid-attention MoE models on agentic-RL rollout trees with Megatron.

Data flows one way, and lower layers never import higher ones:
trajectories -> forest (tree_data) -> plan (planner) -> layout -> model/ops -> loss (rl) -> schedule.
"""
__version__ = "0.1.0"
