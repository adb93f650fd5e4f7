"""Training: the GRPO trainer and its numeric core.

``from artifex.generative_models.training import GRPOConfig, GRPOTrainer`` is the entry point;
every RL name is also available from :mod:`artifex.generative_models.training.rl`.
"""

from artifex.generative_models.training.rl import (
    GRPOBatch,
    GRPOConfig,
    GRPOTrainer,
    NonFiniteUpdateError,
    group_advantages,
    grpo_objective,
    make_grpo_loss,
    segment_advantages,
)

__all__ = [
    "GRPOBatch",
    "GRPOConfig",
    "GRPOTrainer",
    "NonFiniteUpdateError",
    "group_advantages",
    "grpo_objective",
    "make_grpo_loss",
    "segment_advantages",
]
