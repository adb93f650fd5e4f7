"""GGUF metadata -> `CausalLMConfig`: the architectures read and the conventions files leave out.

`GGUF_ARCHITECTURES` names the `general.architecture` values `read_gguf` (in
`artifex.generative_models.models.causal_lm.gguf`) reads. The config is built from the
`{arch}.*` metadata keys and the tensor shapes; a Llama 3.1 / 3.2 `rope_freqs.weight` tensor is
matched against the RoPE scalings those releases use, and Gemma 3 gets what llama.cpp fixes in
its code (every sixth layer global, RoPE base 10000 on the sliding layers, the 27B model's
attention scale; see the `gguf` module docstring).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from artifex.generative_models.models.causal_lm.config import CausalLMConfig, RopeScaling
from artifex.generative_models.models.causal_lm.rope import rope_inv_frequencies

__all__ = ["GGUF_ARCHITECTURES"]

#: GGUF `general.architecture` -> `CausalLMConfig.model_type`.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
}

#: llama.cpp's Gemma 3 conventions the file does not state (see the module docstring).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10_000.0
_GEMMA3_27B_LAYERS = 62
_ROPE_FREQS = "rope_freqs.weight"

#: Llama 3.1 / 3.2 RoPE scalings, matched against a file's `rope_freqs.weight`.
_LLAMA3_SCALINGS = (
    RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
    RopeScaling(
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)


def _match_rope_scaling(factors: np.ndarray, head_dim: int, theta: float, path: str) -> RopeScaling:
    """The Llama 3.x scaling whose frequency divisors are `factors` (`rope_freqs.weight`)."""
    base = rope_inv_frequencies(head_dim, theta, None)
    factors = np.asarray(factors, np.float64).reshape(-1)
    if factors.shape == base.shape:
        for scaling in _LLAMA3_SCALINGS:
            scaled = rope_inv_frequencies(head_dim, theta, scaling)
            if np.allclose(base / scaled, factors, rtol=1e-3, atol=1e-4):
                return scaling
    msg = (
        f"{path}: tensor {_ROPE_FREQS!r} holds RoPE frequency factors that match no supported "
        "scaling (Llama 3.1 / 3.2 'llama3' rope scaling); convert the original checkpoint instead"
    )
    raise ValueError(msg)


def _get(scalars: Mapping[str, Any], key: str, path: str, default: Any = None) -> Any:
    if key in scalars:
        return scalars[key]
    if default is None:
        msg = f"{path}: missing GGUF metadata key {key!r}"
        raise ValueError(msg)
    return default


def _config(
    scalars: Mapping[str, Any],
    arrays: Mapping[str, list[Any]],
    shapes: Mapping[str, tuple[int, ...]],
    rope_factors: np.ndarray | None,
    dtype_name: str,
    path: str,
) -> CausalLMConfig:
    arch = scalars["general.architecture"]
    hidden = int(_get(scalars, f"{arch}.embedding_length", path))
    num_heads = int(_get(scalars, f"{arch}.attention.head_count", path))
    kv_key = f"{arch}.attention.head_count_kv"
    kv = arrays.get(kv_key, scalars.get(kv_key))
    if isinstance(kv, list):  # per-layer counts: only uniform ones are supported
        if len(set(kv)) != 1:
            msg = f"{path}: {arch}.attention.head_count_kv differs between layers ({kv[:8]})"
            raise ValueError(msg)
        kv = kv[0]
    num_kv = num_heads if kv is None else int(kv)
    head_dim = int(scalars.get(f"{arch}.attention.key_length", hidden // num_heads))
    value_dim = int(scalars.get(f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        msg = (
            f"{path}: {arch}.attention.value_length={value_dim} differs from key_length="
            f"{head_dim}; only equal key and value widths are supported"
        )
        raise ValueError(msg)
    rotary = int(scalars.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        msg = (
            f"{path}: {arch}.rope.dimension_count={rotary} is not the head width {head_dim}; "
            "partial rotary embeddings are not supported"
        )
        raise ValueError(msg)
    gemma = arch == "gemma3"
    scaling_type = scalars.get(f"{arch}.rope.scaling.type", "none")
    linear = None
    if gemma and scaling_type == "linear":  # Gemma 3 4B+: the global layers' positions
        linear = RopeScaling(
            factor=float(_get(scalars, f"{arch}.rope.scaling.factor", path)), rope_type="linear"
        )
    elif scaling_type not in ("none", ""):
        msg = (
            f"{path}: {arch}.rope.scaling.type={scaling_type!r} is not supported (only Llama 3.x "
            "scaling, stored as rope_freqs.weight, and Gemma 3's linear scaling)"
        )
        raise ValueError(msg)
    if f"{arch}.expert_count" in scalars:
        msg = f"{path}: mixture-of-experts models ({arch}.expert_count) are not supported"
        raise ValueError(msg)
    theta = float(scalars.get(f"{arch}.rope.freq_base", 10_000.0))
    rope_scaling = (
        None if rope_factors is None else _match_rope_scaling(rope_factors, head_dim, theta, path)
    )
    vocab_size = shapes["model.embed_tokens.weight"][0]
    eos = scalars.get("tokenizer.ggml.eos_token_id")
    num_layers = int(_get(scalars, f"{arch}.block_count", path))
    family: dict[str, Any] = {}
    if gemma:
        rope_scaling = linear
        scalar = hidden / num_heads if num_layers == _GEMMA3_27B_LAYERS else head_dim
        family = {
            "hidden_act": "gelu_pytorch_tanh",
            "sliding_window": int(_get(scalars, f"{arch}.attention.sliding_window", path)),
            "layer_types": tuple(
                "full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention"
                for i in range(num_layers)
            ),
            "rope_local_theta": _GEMMA3_LOCAL_THETA,
            "query_pre_attn_scalar": float(scalar),
        }
    return CausalLMConfig(
        model_type=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(_get(scalars, f"{arch}.feed_forward_length", path)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(_get(scalars, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        tie_word_embeddings="lm_head.weight" not in shapes,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in shapes,
        qk_norm=arch in ("qwen3", "gemma3"),
        max_position_embeddings=int(scalars.get(f"{arch}.context_length", 2048)),
        bos_token_id=_opt_int(scalars.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(eos),
        pad_token_id=_opt_int(scalars.get("tokenizer.ggml.padding_token_id")),
        param_dtype=dtype_name,
        **family,
    )


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
