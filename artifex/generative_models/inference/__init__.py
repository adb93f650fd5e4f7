"""Inference: a compiled KV-cache sampler for causal language models."""

from artifex.generative_models.inference.sampling import (
    DEFAULT_PROMPT_BUCKETS,
    Sampler,
    SamplerOutput,
    bucket_length,
    generate,
    sample_logits,
)

__all__ = [
    "DEFAULT_PROMPT_BUCKETS",
    "Sampler",
    "SamplerOutput",
    "bucket_length",
    "generate",
    "sample_logits",
]
