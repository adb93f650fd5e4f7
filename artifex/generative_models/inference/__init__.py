"""Inference: a compiled KV-cache sampler for causal language models; SDE/ODE samplers for flows."""

# Continuous batching: decode slots refilled as completions end
from artifex.generative_models.inference.continuous import (
    DEFAULT_MAX_SLOTS,
    generate_continuous,
    slot_buckets,
    width_bucket,
)

# Multi-turn: KV-cache continuation across turns
# flow-matching image models (Flow-GRPO)
from artifex.generative_models.inference.flow_sampling import (
    MAX_NOISE_LEVEL,
    FlowSampler,
    FlowTrajectory,
    SDEConfig,
    check_prompts,
    gaussian_kl,
    gaussian_log_prob,
    sample_flow,
    sde_step,
    sde_transition,
    time_grid,
)
from artifex.generative_models.inference.multiturn import (
    DEFAULT_APPEND_BUCKETS,
    TurnOutput,
    append_tokens,
    decode_turn,
)
from artifex.generative_models.inference.sampling import (
    DEFAULT_PROMPT_BUCKETS,
    ROW_GROUP_MAX_MATRIX_SIZE,
    Sampler,
    SamplerOutput,
    auto_row_groups,
    bucket_length,
    generate,
    sample_logits,
)

__all__ = [
    "DEFAULT_APPEND_BUCKETS",
    "DEFAULT_MAX_SLOTS",
    "DEFAULT_PROMPT_BUCKETS",
    "MAX_NOISE_LEVEL",
    "ROW_GROUP_MAX_MATRIX_SIZE",
    "FlowSampler",
    "FlowTrajectory",
    "SDEConfig",
    "Sampler",
    "SamplerOutput",
    "TurnOutput",
    "append_tokens",
    "auto_row_groups",
    "bucket_length",
    "check_prompts",
    "decode_turn",
    "gaussian_kl",
    "gaussian_log_prob",
    "generate",
    "generate_continuous",
    "sample_flow",
    "sample_logits",
    "sde_step",
    "sde_transition",
    "slot_buckets",
    "time_grid",
    "width_bucket",
]
