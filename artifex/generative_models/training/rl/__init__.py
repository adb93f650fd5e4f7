"""Reinforcement learning for language models: GRPO and its variants.

The numeric core (advantages, losses, log-probs) is a set of pure functions; the trainer holds
the model, optimizer and step and calls them.
"""

from artifex.generative_models.training.rl.core.advantages import (
    GroupStats,
    advantages_from_config,
    group_advantages,
    group_stats,
    process_advantages,
    segment_advantages,
    segment_stats,
)
from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.core.logprobs import (
    auto_chunk_size,
    categorical_log_probs,
    causal_lm_log_probs,
    causal_lm_log_probs_fn,
    chunked_token_log_probs,
    default_log_prob_fn,
    token_log_probs,
)
from artifex.generative_models.training.rl.core.losses import (
    aggregate_loss,
    approx_kl_old,
    clipped_surrogate,
    entropy_from_logits,
    kl_divergence,
    log_importance_ratio,
    loss_normalizer,
    masked_mean,
)
from artifex.generative_models.training.rl.rewards import (
    CombinedRewards,
    RewardCombiner,
    RewardFunction,
    RewardFunctionError,
    answers_equal,
    combine_reward_columns,
    combine_rewards,
    extract_answer,
    format_reward,
    math_answer_reward,
    normalize_number,
    overlong_penalty,
    reward_names,
    soft_overlong_penalty,
)

# Multi-turn rollouts: tools and environments
from artifex.generative_models.training.rl.rollouts.multiturn import (
    Environment,
    Episodes,
    MultiTurnConfig,
    MultiTurnRollout,
    MultiTurnRolloutResult,
    ToolEnvironment,
    environment_reward,
    run_episodes,
    turn_step_rewards,
)
from artifex.generative_models.training.rl.rollouts.multiturn.tools import (
    ToolCall,
    ToolResult,
    ToolRunner,
    parse_tool_calls,
    tool_schema,
)
from artifex.generative_models.training.rl.rollouts.rollout import (
    Completions,
    Policy,
    Rollout,
    RolloutConfig,
    encode_prompts,
    rollout,
    rollout_batch_like,
    sample_completions,
)
from artifex.generative_models.training.rl.run.loop import (
    DataIterator,
    TrainConfig,
    TrainResult,
    concat_batches,
    evaluate,
    train,
)

# The functional step: the train state and the pure update
from artifex.generative_models.training.rl.update.state import (
    GRPOTrainState,
    init_train_state,
    make_grpo_log_probs,
    make_grpo_train_step,
    write_train_state,
)
from artifex.generative_models.training.rl.update.trainer import (
    MIN_MICROBATCH_TOKENS,
    GRPOTrainer,
    NonFiniteUpdateError,
    as_grpo_batch,
    auto_num_microbatches,
    compute_advantages,
    grpo_objective,
    make_grpo_loss,
    split_microbatches,
)

__all__ = [
    "MIN_MICROBATCH_TOKENS",
    "CombinedRewards",
    "Completions",
    "DataIterator",
    "Environment",
    "Episodes",
    "GRPOBatch",
    "GRPOConfig",
    "GRPOTrainState",
    "GRPOTrainer",
    "GroupStats",
    "MultiTurnConfig",
    "MultiTurnRollout",
    "MultiTurnRolloutResult",
    "NonFiniteUpdateError",
    "Policy",
    "RewardCombiner",
    "RewardFunction",
    "RewardFunctionError",
    "Rollout",
    "RolloutConfig",
    "ToolCall",
    "ToolEnvironment",
    "ToolResult",
    "ToolRunner",
    "TrainConfig",
    "TrainResult",
    "advantages_from_config",
    "aggregate_loss",
    "answers_equal",
    "approx_kl_old",
    "as_grpo_batch",
    "auto_chunk_size",
    "auto_num_microbatches",
    "categorical_log_probs",
    "causal_lm_log_probs",
    "causal_lm_log_probs_fn",
    "chunked_token_log_probs",
    "clipped_surrogate",
    "combine_reward_columns",
    "combine_rewards",
    "compute_advantages",
    "concat_batches",
    "default_log_prob_fn",
    "encode_prompts",
    "entropy_from_logits",
    "environment_reward",
    "evaluate",
    "extract_answer",
    "format_reward",
    "group_advantages",
    "group_stats",
    "grpo_objective",
    "init_train_state",
    "kl_divergence",
    "log_importance_ratio",
    "loss_normalizer",
    "make_grpo_log_probs",
    "make_grpo_loss",
    "make_grpo_train_step",
    "masked_mean",
    "math_answer_reward",
    "normalize_number",
    "overlong_penalty",
    "parse_tool_calls",
    "process_advantages",
    "reward_names",
    "rollout",
    "rollout_batch_like",
    "run_episodes",
    "sample_completions",
    "segment_advantages",
    "segment_stats",
    "soft_overlong_penalty",
    "split_microbatches",
    "token_log_probs",
    "tool_schema",
    "train",
    "turn_step_rewards",
    "write_train_state",
]

# 2025-2026 GRPO variants (see docs/algorithm.md, "Variants as settings").
from artifex.generative_models.training.rl.core.advantages import (
    pass_at_k_advantages,
    reinforce_pp_advantages,
)

# On-policy distillation: a teacher's divergence on the student's own samples.
from artifex.generative_models.training.rl.core.distillation import (
    chunked_distillation,
    logits_divergence,
    sampled_reverse_kl,
)
from artifex.generative_models.training.rl.core.losses import (
    cispo_surrogate,
    entropy_quantile_threshold,
    high_entropy_mask,
    off_policy_sequence_mask,
    sampler_importance_weights,
    sapo_surrogate,
    vespo_weights,
)

# Packed updates: a batch's sequences in rows without padding.
from artifex.generative_models.training.rl.core.packing import (
    DEFAULT_PACKING_THRESHOLD,
    PackedGRPOBatch,
    PackedLayout,
    pack_batch,
    packed_causal_lm_log_probs,
    packed_log_prob_fn,
    padding_fraction,
    row_bucket,
    should_pack,
)
from artifex.generative_models.training.rl.core.teacher import make_distillation_terms

# Training options around the loss (see docs/algorithm.md).
from artifex.generative_models.training.rl.rollouts.truncation import mask_truncated_completions

__all__ += [
    "cispo_surrogate",
    "entropy_quantile_threshold",
    "high_entropy_mask",
    "off_policy_sequence_mask",
    "pass_at_k_advantages",
    "reinforce_pp_advantages",
    "sampler_importance_weights",
    "sapo_surrogate",
    "vespo_weights",
]

__all__ += ["mask_truncated_completions"]
__all__ += [
    "chunked_distillation",
    "logits_divergence",
    "make_distillation_terms",
    "sampled_reverse_kl",
]
__all__ += [
    "DEFAULT_PACKING_THRESHOLD",
    "PackedGRPOBatch",
    "PackedLayout",
    "pack_batch",
    "packed_causal_lm_log_probs",
    "packed_log_prob_fn",
    "padding_fraction",
    "row_bucket",
    "should_pack",
]


# Modules that moved into the layer sub-packages keep their old import paths: each old name is
# the same module object as the new one (private names and monkeypatching included).
def _alias_moved_modules() -> None:
    import importlib
    import sys

    moved = {
        "advantages": "core.advantages",
        "batch": "core.batch",
        "packing": "core.packing",
        "compat": "core.compat",
        "configs": "core.configs",
        "distillation": "core.distillation",
        "logprobs": "core.logprobs",
        "losses": "core.losses",
        "objective": "core.objective",
        "teacher": "core.teacher",
        "grpo": "update.trainer",
        "layerwise": "update.layerwise",
        "optimizer_split": "update.optimizer_split",
        "ref_sync": "update.ref_sync",
        "state": "update.state",
        "dataset_rows": "rollouts.dataset_rows",
        "multiturn": "rollouts.multiturn",
        "reward_scale": "rollouts.reward_scale",
        "rollout": "rollouts.rollout",
        "step_rewards": "rollouts.step_rewards",
        "tools": "rollouts.multiturn.tools",
        "truncation": "rollouts.truncation",
        "evaluation_metrics": "run.evaluation_metrics",
        "loop": "run.loop",
        "preflight": "run.preflight",
        # multi-turn, gathered into rollouts/multiturn/
        "rollouts.episodes": "rollouts.multiturn.episodes",
        "rollouts.environments": "rollouts.multiturn.environments",
        "rollouts.tools": "rollouts.multiturn.tools",
        "rollouts._chat_segments": "rollouts.multiturn.chat_segments",
    }
    for old, new in moved.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules.setdefault(f"{__name__}.{old}", module)
        parent_name, _, attr = f"{__name__}.{old}".rpartition(".")
        parent = sys.modules[parent_name]
        if attr not in vars(parent):  # a function of the same name (rollout) keeps its name
            setattr(parent, attr, module)


_alias_moved_modules()
