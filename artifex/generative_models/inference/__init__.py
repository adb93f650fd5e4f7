"""Inference: a compiled KV-cache sampler for causal language models.

The SDE/ODE samplers of flow-matching image models are in the Flow-GRPO package,
:mod:`artifex.generative_models.flow` (``FlowSampler``, ``SDEConfig``, ``sample_flow``, ...);
this package no longer re-exports them, since it sits below that package.
``artifex.generative_models.inference.flow_sampling`` is a deprecated alias of their modules.
"""

# Continuous batching: decode slots refilled as completions end
from artifex.generative_models.inference.continuous import (
    DEFAULT_MAX_SLOTS,
    generate_continuous,
    slot_buckets,
    width_bucket,
)

# Multi-turn: KV-cache continuation across turns
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
    "ROW_GROUP_MAX_MATRIX_SIZE",
    "Sampler",
    "SamplerOutput",
    "TurnOutput",
    "append_tokens",
    "auto_row_groups",
    "bucket_length",
    "decode_turn",
    "generate",
    "generate_continuous",
    "sample_logits",
    "slot_buckets",
    "width_bucket",
]
