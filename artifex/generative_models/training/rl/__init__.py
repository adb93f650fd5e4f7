"""Reinforcement learning for language models: GRPO and its variants.

The numeric core (advantages, losses, log-probs) is a set of pure functions; the trainer holds
the model, optimizer and step and calls them.
"""

from artifex.generative_models.training.rl.advantages import (
    GroupStats,
    advantages_from_config,
    group_advantages,
    group_stats,
    process_advantages,
    segment_advantages,
    segment_stats,
)
from artifex.generative_models.training.rl.batch import GRPOBatch
from artifex.generative_models.training.rl.configs import GRPOConfig
from artifex.generative_models.training.rl.grpo import (
    GRPOTrainer,
    NonFiniteUpdateError,
    as_grpo_batch,
    compute_advantages,
    grpo_objective,
    make_grpo_loss,
)
from artifex.generative_models.training.rl.logprobs import (
    auto_chunk_size,
    categorical_log_probs,
    causal_lm_log_probs,
    causal_lm_log_probs_fn,
    chunked_token_log_probs,
    default_log_prob_fn,
    token_log_probs,
)
from artifex.generative_models.training.rl.losses import (
    aggregate_loss,
    approx_kl_old,
    clipped_surrogate,
    entropy_from_logits,
    kl_divergence,
    log_importance_ratio,
    loss_normalizer,
    masked_mean,
)

__all__ = [
    # config, batch, trainer
    "GRPOBatch",
    "GRPOConfig",
    "GRPOTrainer",
    "GroupStats",
    "NonFiniteUpdateError",
    "advantages_from_config",
    "aggregate_loss",
    "approx_kl_old",
    "as_grpo_batch",
    "auto_chunk_size",
    "categorical_log_probs",
    "causal_lm_log_probs",
    "causal_lm_log_probs_fn",
    "chunked_token_log_probs",
    "clipped_surrogate",
    "compute_advantages",
    "default_log_prob_fn",
    "entropy_from_logits",
    "group_advantages",
    "group_stats",
    "grpo_objective",
    "kl_divergence",
    "log_importance_ratio",
    "loss_normalizer",
    "make_grpo_loss",
    "masked_mean",
    "process_advantages",
    "segment_advantages",
    "segment_stats",
    "token_log_probs",
]
