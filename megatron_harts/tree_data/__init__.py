"""Rollout-tree data: trajectories -> validated forest -> indexed on-disk dataset.

Imports no torch: the planner and tools use it on machines without one.
"""
from .errors import TreeFormatError
from .trajectory import Trajectory, make_trajectory, default_loss_mask
from .forest import Forest, build_forest
from .readers import read_trajectories, write_jsonl, trajectory_record, UnknownFieldsWarning
from .dataset import TreeDataset, write_dataset, load_forest, is_dataset

__all__ = ["TreeFormatError", "Trajectory", "make_trajectory", "default_loss_mask", "Forest", "build_forest",
           "read_trajectories", "write_jsonl", "trajectory_record", "UnknownFieldsWarning", "TreeDataset",
           "write_dataset", "load_forest", "is_dataset"]
