"""RL objectives over tree targets (PPO/GRPO variants, KL), equal to their expanded forms."""
from .objectives import (KL_ESTIMATORS, LOSS_AGG_MODES, OBJECTIVE_KINDS, BatchNormalizer, ObjectiveConfig, ObjectiveDataError,
                         batch_normalizer, forest_normalizer, layout_target_scale, objective_loss,
                         objective_loss_reference, target_scale, validate_targets)

__all__ = ["OBJECTIVE_KINDS", "LOSS_AGG_MODES", "KL_ESTIMATORS", "ObjectiveConfig", "ObjectiveDataError", "BatchNormalizer",
           "batch_normalizer", "forest_normalizer", "target_scale", "layout_target_scale", "validate_targets",
           "objective_loss", "objective_loss_reference"]
