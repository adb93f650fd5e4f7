"""Rollout engines: what samples a rollout's completions, behind one interface.

``RolloutEngine`` is the interface (``sync_weights(model)``, ``generate(...) ->
SamplerOutput``); ``SamplerEngine`` is the library's own sampler behind it and ``VLLMEngine``
a colocated vLLM (an optional extra: ``pip install "artifex-grpo[vllm]"``; vLLM and torch are
imported when one is built, never by this package).
"""

# The interface and what engines share
from artifex.generative_models.inference.engines.base import (
    RolloutEngine,
    SamplerEngine,
    WeightVersion,
    assemble_output,
    check_sampling,
    hf_weights,
    prompt_token_lists,
    resolve_special_ids,
)

# vLLM (imported lazily inside the engine)
from artifex.generative_models.inference.engines.vllm import VLLMEngine, torch_weights

__all__ = [
    "RolloutEngine",
    "SamplerEngine",
    "VLLMEngine",
    "WeightVersion",
    "assemble_output",
    "check_sampling",
    "hf_weights",
    "prompt_token_lists",
    "resolve_special_ids",
    "torch_weights",
]
