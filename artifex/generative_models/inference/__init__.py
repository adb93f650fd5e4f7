"""Inference: a compiled KV-cache sampler for causal language models."""

# Multi-turn: KV-cache continuation across turns
from artifex.generative_models.inference.multiturn import (
    DEFAULT_APPEND_BUCKETS,
    TurnOutput,
    append_tokens,
    decode_turn,
)
from artifex.generative_models.inference.sampling import (
    DEFAULT_PROMPT_BUCKETS,
    Sampler,
    SamplerOutput,
    bucket_length,
    generate,
    sample_logits,
)

__all__ = [
    "DEFAULT_APPEND_BUCKETS",
    "DEFAULT_PROMPT_BUCKETS",
    "Sampler",
    "SamplerOutput",
    "TurnOutput",
    "append_tokens",
    "bucket_length",
    "decode_turn",
    "generate",
    "sample_logits",
]
