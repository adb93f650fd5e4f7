"""Configuration of the decoder-only causal LMs (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma 3).

`CausalLMConfig` is the one description of an architecture. It converts to and from the
`config.json` dictionaries that Hugging Face transformers reads and writes, so a checkpoint saved by
either library loads in the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

__all__ = [
    "ACTIVATIONS",
    "LAYER_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "CausalLMConfig",
    "RopeScaling",
    "resolve_dtype",
]

#: model_type -> Hugging Face architecture class name.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

#: MLP activations (transformers' names): SiLU, and GELU with its tanh approximation.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
#: Attention kinds of a layer (transformers' `layer_types`).
LAYER_TYPES = ("full_attention", "sliding_attention")
#: Gemma 3's default layer pattern: five sliding-window layers, then one global layer.
_GEMMA3_PATTERN = 6

_DTYPES = ("float32", "bfloat16")
_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: Any) -> jnp.dtype:
    """Turns "float32" / "bfloat16" / a NumPy or JAX dtype into a supported `jnp.dtype`.

    Args:
        dtype: The dtype or its name.

    Returns:
        `jnp.float32` or `jnp.bfloat16` as a `jnp.dtype`.

    Raises:
        ValueError: If the dtype is not float32 or bfloat16.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import resolve_dtype
        >>> resolve_dtype("bfloat16").name
        'bfloat16'
    """
    try:
        resolved = jnp.dtype(_DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    except TypeError as err:
        msg = f"dtype must be 'float32' or 'bfloat16', got {dtype!r}"
        raise ValueError(msg) from err
    if resolved not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        msg = f"dtype must be 'float32' or 'bfloat16', got {dtype!r}"
        raise ValueError(msg)
    return resolved


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        msg = f"{name} must be a positive int, got {value!r}"
        raise ValueError(msg)


def _require_token_id(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        msg = f"{name} must be a non-negative int or None, got {value!r}"
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling: Llama 3.1's (`rope_type="llama3"`) or linear (`"linear"`).

    `"llama3"`: inverse frequencies with wavelength `2π/f` longer than
    `original_max_position_embeddings / low_freq_factor` are divided by `factor`; those shorter
    than `original_max_position_embeddings / high_freq_factor` are kept; the ones in between are
    interpolated with `s = (L_orig / wavelen - low) / (high - low)`:
    `f' = (1 - s) f / factor + s f`. This matches transformers' `_compute_llama3_parameters`.

    `"linear"` (position interpolation; Gemma 3's global layers from 4B up): every inverse
    frequency is divided by `factor`, `f' = f / factor`, as transformers'
    `_compute_linear_scaling_rope_parameters`; the other fields stay None.

    Attributes:
        factor: Scaling factor (8 for Llama 3.1, 32 for Llama 3.2, 8 for Gemma 3 4B).
        low_freq_factor: Low-frequency boundary factor (1 in Llama 3.1); "llama3" only.
        high_freq_factor: High-frequency boundary factor (4 in Llama 3.1); "llama3" only.
        original_max_position_embeddings: Context length of the original pretraining (8192);
            "llama3" only.
        rope_type: "llama3" or "linear".

    Raises:
        ValueError: If a field is out of range, missing for "llama3", set for "linear", or
            `rope_type` is neither.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import RopeScaling
        >>> scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        ...                       original_max_position_embeddings=8192)
        >>> scaling.to_dict()["rope_type"], RopeScaling.from_dict(scaling.to_dict()) == scaling
        ('llama3', True)
        >>> RopeScaling(factor=8.0, rope_type="linear").to_dict()
        {'rope_type': 'linear', 'factor': 8.0}
    """

    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear"):
            msg = (
                "rope_scaling.rope_type: only 'llama3' and 'linear' are supported, got "
                f"{self.rope_type!r}"
            )
            raise ValueError(msg)
        value = self.factor
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            msg = f"rope_scaling.factor must be a positive number, got {value!r}"
            raise ValueError(msg)
        extra = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if self.rope_type == "linear":
            given = [name for name in extra if getattr(self, name) is not None]
            if given:
                msg = f"rope_scaling: rope_type 'linear' takes only factor, got {given} too"
                raise ValueError(msg)
            return
        for name in ("low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                msg = f"rope_scaling.{name} must be a positive number, got {value!r}"
                raise ValueError(msg)
        if self.high_freq_factor <= self.low_freq_factor:
            msg = (
                "rope_scaling.high_freq_factor must be greater than low_freq_factor, got "
                f"high_freq_factor={self.high_freq_factor}, low_freq_factor={self.low_freq_factor}"
            )
            raise ValueError(msg)
        _require_positive_int(
            "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RopeScaling:
        """Builds the scaling from a Hugging Face `rope_scaling` / `rope_parameters` mapping.

        Args:
            d: Mapping with `rope_type` (or the legacy `type`) and `factor`; for "llama3" also
                `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings`;
                other keys (such as `rope_theta`) are ignored.

        Returns:
            The scaling.

        Raises:
            ValueError: If the type is neither "llama3" nor "linear", or a key is missing.
        """
        rope_type = d.get("rope_type", d.get("type"))
        if rope_type not in ("llama3", "linear"):
            msg = (
                "rope_scaling: only rope_type 'llama3' and 'linear' are supported, got "
                f"{rope_type!r}"
            )
            raise ValueError(msg)
        keys = ("factor",)
        if rope_type == "llama3":
            keys += ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in d]
        if missing:
            msg = f"rope_scaling: missing keys {missing} for rope_type {rope_type!r}, got {dict(d)}"
            raise ValueError(msg)
        if rope_type == "linear":
            return cls(factor=float(d["factor"]), rope_type="linear")
        return cls(
            factor=float(d["factor"]),
            low_freq_factor=float(d["low_freq_factor"]),
            high_freq_factor=float(d["high_freq_factor"]),
            original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """Returns the Hugging Face `rope_scaling` dictionary.

        Returns:
            A JSON-serialisable dict with `rope_type` and the type's parameters.
        """
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {
            "rope_type": self.rope_type,
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CausalLMConfig:
    """Architecture of a decoder-only transformer (Llama, Qwen2, Qwen3(-MoE), Mistral, Gemma 3).

    Each layer is `h += Attn(RMSNorm(h)); h += SwiGLU(RMSNorm(h))` with grouped-query attention
    and rotate-half RoPE. The families differ in switches (docs/models.md); Gemma 3
    (`"gemma3_text"`) also scales the embeddings, multiplies its RMSNorms by `1 + w`,
    normalizes the block outputs and mixes sliding-window and global layers. A sliding-window
    layer lets the query in slot `q` (column or KV-cache slot) see key slots `s` with
    `q - s < sliding_window`, as transformers' masks do.

    Attributes:
        model_type: "llama", "qwen2", "qwen3", "mistral", "gemma3_text" or "qwen3_moe".
        vocab_size: Number of token embeddings.
        hidden_size: Model width D.
        intermediate_size: Hidden width F of the MLP.
        num_layers: Number of decoder layers L.
        num_heads: Number of query heads N.
        num_kv_heads: Number of key/value heads K (dividing N); None means N.
        head_dim: Per-head width H; None means `hidden_size // num_heads`.
        rope_theta: RoPE base (Gemma 3: of the global layers).
        rope_scaling: None or a `RopeScaling` (a mapping is converted).
        rms_norm_eps: Epsilon of every RMSNorm.
        tie_word_embeddings: The output projection is the transposed input embedding.
        attention_bias: q/k/v biases (and o_proj's, but for Qwen2); always for Qwen2.
        qk_norm: Per-head RMSNorm of q and k (Qwen3, Qwen3-MoE, Gemma 3).
        hidden_act: "silu" or "gelu_pytorch_tanh" (Gemma 3's).
        sliding_window: Window of the sliding-window layers (Mistral, Gemma 3), or None.
        layer_types: Gemma 3: "full_attention" / "sliding_attention" per layer; None means
            every sixth layer global. Mistral: every layer slides when there is a window.
        rope_local_theta: Gemma 3: RoPE base of the sliding layers; None means 10000.
        query_pre_attn_scalar: Gemma 3: scores are `q k^T / sqrt(query_pre_attn_scalar)`; None
            means `head_dim`.
        final_logit_softcapping: Gemma 3: logits become `c tanh(z / c)`; None: not capped.
        num_experts: Qwen3-MoE: experts per layer E.
        num_experts_per_tok: Qwen3-MoE: experts per token k.
        moe_intermediate_size: Qwen3-MoE: expert MLP width.
        norm_topk_prob: Qwen3-MoE: renormalize the k routing weights.
        router_aux_loss_coef: Qwen3-MoE: load-balancing loss weight.
        max_position_embeddings: Longest context.
        initializer_range: Standard deviation of the initial weights.
        bos_token_id: Beginning-of-sequence id or None.
        eos_token_id: End-of-sequence id, a tuple of ids (a list is converted), or None.
        pad_token_id: Padding id or None.
        param_dtype: "float32" or "bfloat16", of the parameters and the compute.

    Raises:
        ValueError: Naming the field, if a field or their combination is invalid.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import CausalLMConfig
        >>> config = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                         num_layers=1, num_heads=2)
        >>> config.head_dim, config.num_kv_heads, config.num_params()
        (4, 2, 920)
        >>> CausalLMConfig.tiny().num_layers
        2
        >>> config.replace(num_heads=3)
        Traceback (most recent call last):
            ...
        ValueError: num_heads must be a multiple of num_kv_heads, got num_heads=3, num_kv_heads=2
    """

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            msg = (
                f"model_type must be one of {sorted(SUPPORTED_MODEL_TYPES)}, "
                f"got {self.model_type!r}"
            )
            raise ValueError(msg)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            _require_positive_int(name, getattr(self, name))
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _require_positive_int("num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            msg = (
                f"num_heads must be a multiple of num_kv_heads, got num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}"
            )
            raise ValueError(msg)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                msg = (
                    "head_dim: hidden_size must be divisible by num_heads when head_dim is None, "
                    f"got hidden_size={self.hidden_size}, num_heads={self.num_heads}"
                )
                raise ValueError(msg)
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _require_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            msg = f"head_dim must be even for rotary embeddings, got {self.head_dim}"
            raise ValueError(msg)
        if not (isinstance(self.rope_theta, int | float) and self.rope_theta > 0):
            msg = f"rope_theta must be a positive number, got {self.rope_theta!r}"
            raise ValueError(msg)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            msg = f"rope_scaling must be None or a RopeScaling, got {self.rope_scaling!r}"
            raise ValueError(msg)
        if not (isinstance(self.rms_norm_eps, int | float) and self.rms_norm_eps > 0):
            msg = f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}"
            raise ValueError(msg)
        if not (isinstance(self.initializer_range, int | float) and self.initializer_range > 0):
            msg = f"initializer_range must be a positive number, got {self.initializer_range!r}"
            raise ValueError(msg)
        _require_positive_int("max_position_embeddings", self.max_position_embeddings)
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                msg = f"{name} must be a bool, got {getattr(self, name)!r}"
                raise ValueError(msg)
        if self.model_type == "qwen2" and not self.attention_bias:
            msg = (
                "attention_bias: model_type 'qwen2' always has q/k/v biases; "
                "expected True, got False"
            )
            raise ValueError(msg)
        wants_qk_norm = self.model_type in ("qwen3", "gemma3_text", "qwen3_moe")
        if self.qk_norm != wants_qk_norm:
            msg = (
                f"qk_norm: model_type {self.model_type!r} requires qk_norm="
                f"{wants_qk_norm}, got {self.qk_norm}"
            )
            raise ValueError(msg)
        self._check_family_fields()
        self._check_moe_fields()
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None:
                _require_token_id(name, getattr(self, name))
        eos = self.eos_token_id
        if isinstance(eos, list | tuple):
            eos = tuple(eos)
            object.__setattr__(self, "eos_token_id", eos)
            if not eos:
                msg = "eos_token_id must be an int, a non-empty tuple of ints or None, got ()"
                raise ValueError(msg)
            for e in eos:
                _require_token_id("eos_token_id", e)
        elif eos is not None:
            _require_token_id("eos_token_id", eos)
        if self.param_dtype not in _DTYPES:
            msg = f"param_dtype must be one of {_DTYPES}, got {self.param_dtype!r}"
            raise ValueError(msg)

    def _check_family_fields(self) -> None:
        """Validates (and completes) the Mistral and Gemma 3 fields."""
        gemma = self.model_type == "gemma3_text"
        if self.hidden_act not in ACTIVATIONS:
            msg = f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}"
            raise ValueError(msg)
        if self.model_type == "mistral" and self.attention_bias:
            msg = "attention_bias: model_type 'mistral' has no attention biases; expected False"
            raise ValueError(msg)
        if self.sliding_window is not None:
            if self.model_type not in ("mistral", "gemma3_text"):
                msg = (
                    f"sliding_window: model_type {self.model_type!r} has no sliding-window "
                    f"attention (only 'mistral' and 'gemma3_text'); expected None, got "
                    f"{self.sliding_window!r}"
                )
                raise ValueError(msg)
            _require_positive_int("sliding_window", self.sliding_window)
        for name in ("layer_types", "rope_local_theta", "query_pre_attn_scalar"):
            if not gemma and getattr(self, name) is not None:
                msg = (
                    f"{name}: only model_type 'gemma3_text' takes it; expected None for "
                    f"{self.model_type!r}, got {getattr(self, name)!r}"
                )
                raise ValueError(msg)
        if not gemma and self.final_logit_softcapping is not None:
            msg = (
                f"final_logit_softcapping: only model_type 'gemma3_text' takes it; expected None "
                f"for {self.model_type!r}, got {self.final_logit_softcapping!r}"
            )
            raise ValueError(msg)
        for name in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
            ):
                msg = f"{name} must be a positive number or None, got {value!r}"
                raise ValueError(msg)
        if not gemma:
            return
        if self.rope_local_theta is None:
            object.__setattr__(self, "rope_local_theta", 10_000.0)
        if self.query_pre_attn_scalar is None:
            object.__setattr__(self, "query_pre_attn_scalar", float(self.head_dim))
        types = self.layer_types
        if types is None:
            types = tuple(
                "full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention"
                for i in range(self.num_layers)
            )
        if not isinstance(types, list | tuple):
            msg = f"layer_types must be a tuple of {LAYER_TYPES} per layer, got {types!r}"
            raise ValueError(msg)
        types = tuple(types)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
            msg = (
                f"layer_types must name one of {LAYER_TYPES} for each of the {self.num_layers} "
                f"layers, got {types!r}"
            )
            raise ValueError(msg)
        if "sliding_attention" in types and self.sliding_window is None:
            msg = (
                "sliding_window: model_type 'gemma3_text' with sliding_attention layers needs a "
                "window (transformers' default is 4096), got None"
            )
            raise ValueError(msg)

    def _check_moe_fields(self) -> None:
        """Validates the Qwen3-MoE fields (and that dense families leave them unset)."""
        names = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if self.model_type != "qwen3_moe":
            given = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
            if given or self.norm_topk_prob:
                msg = (
                    f"num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob: "
                    f"only model_type 'qwen3_moe' takes them; expected None / False for "
                    f"{self.model_type!r}, got {given or {'norm_topk_prob': True}}"
                )
                raise ValueError(msg)
        else:
            for name in names:
                _require_positive_int(name, getattr(self, name))
            if self.num_experts_per_tok > self.num_experts:
                msg = (
                    "num_experts_per_tok must be at most num_experts, got "
                    f"num_experts_per_tok={self.num_experts_per_tok}, "
                    f"num_experts={self.num_experts}"
                )
                raise ValueError(msg)
            if not isinstance(self.norm_topk_prob, bool):
                msg = f"norm_topk_prob must be a bool, got {self.norm_topk_prob!r}"
                raise ValueError(msg)
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, int | float) or coef < 0:
            msg = f"router_aux_loss_coef must be a number >= 0, got {coef!r}"
            raise ValueError(msg)

    # ------------------------------------------------------------------ derived values

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are sparse mixtures of experts (Qwen3-MoE)."""
        return self.model_type == "qwen3_moe"

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends through the sliding window (see the class docstring)."""
        if self.model_type == "gemma3_text":
            return tuple(t == "sliding_attention" for t in self.layer_types)
        return (self.sliding_window is not None,) * self.num_layers

    @property
    def attention_scale(self) -> float:
        """The factor of `q k^T`: `query_pre_attn_scalar^-1/2` (Gemma 3), else `head_dim^-1/2`."""
        scalar = self.query_pre_attn_scalar
        return float((self.head_dim if scalar is None else scalar) ** -0.5)

    @property
    def norm_unit_offset(self) -> bool:
        """Whether every RMSNorm multiplies by `1 + w` (Gemma 3) instead of `w`."""
        return self.model_type == "gemma3_text"

    @property
    def embed_scale(self) -> float | None:
        """Factor of the input embeddings, `sqrt(hidden_size)` for Gemma 3, else None."""
        return float(self.hidden_size**0.5) if self.model_type == "gemma3_text" else None

    @property
    def post_norms(self) -> bool:
        """Whether the attention and MLP outputs are normalized before the residual (Gemma 3)."""
        return self.model_type == "gemma3_text"

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head, G = N / K."""
        return self.num_heads // self.num_kv_heads

    @property
    def attention_out_bias(self) -> bool:
        """Whether o_proj has a bias (Llama/Qwen3: `attention_bias`; Qwen2: never)."""
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All end-of-sequence ids as a tuple (empty when none is set)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, tuple):
            return self.eos_token_id
        return (self.eos_token_id,)

    def num_params(self) -> int:
        """Counts the parameters of the model this config describes.

        Returns:
            The number of scalar parameters (without LoRA adapters).
        """
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        n, k = self.num_heads, self.num_kv_heads
        attn = d * n * h * 2 + d * k * h * 2
        if self.attention_bias:
            attn += (n + 2 * k) * h
        if self.attention_out_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * h
        if self.is_moe:  # router (D, E) and E experts of width moe_intermediate_size
            mlp = d * self.num_experts + self.num_experts * 3 * d * self.moe_intermediate_size
        else:
            mlp = 3 * d * f
        layer = attn + mlp + (4 if self.post_norms else 2) * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * layer + d + head

    def replace(self, **changes: Any) -> CausalLMConfig:
        """Returns a copy with some fields changed (validated again).

        Args:
            **changes: Field names and their new values.

        Returns:
            The new config.
        """
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets

    @classmethod
    def tiny(cls, **overrides: Any) -> CausalLMConfig:
        """A ~525k-parameter Llama-style model for tests and demos.

        vocab 512, width 128, 2 layers, 4 query / 2 kv heads of width 32, MLP 384, untied, fp32.

        Args:
            **overrides: Fields to change (for example `vocab_size` to fit a tokenizer).

        Returns:
            The config.
        """
        fields: dict[str, Any] = {
            "model_type": "llama",
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 32,
            "rope_theta": 10_000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 512,
        }
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def qwen2_w1(cls, **overrides: Any) -> CausalLMConfig:
        """The model of the first benchmark workload (W1 in ``docs/benchmarks.md``): a Qwen2 shape.

        vocab 4096, width 256, 4 layers, 4 query / 2 kv heads of width 64, MLP 768, q/k/v biases,
        tied embeddings, fp32, RoPE base 1e6 (as Qwen2.5).

        Args:
            **overrides: Fields to change.

        Returns:
            The config.
        """
        fields: dict[str, Any] = {
            "model_type": "qwen2",
            "vocab_size": 4096,
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "max_position_embeddings": 2048,
            "param_dtype": "float32",
        }
        fields.update(overrides)
        return cls(**fields)

    # ------------------------------------------------------------------ Hugging Face

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> CausalLMConfig:
        """Builds a config from a Hugging Face `config.json` dictionary.

        Reads the legacy keys (`rope_theta`, `rope_scaling`; Gemma 3's `rope_local_base_freq`
        and `sliding_window_pattern`) and the transformers 5 form (`rope_parameters`, for Gemma 3
        one entry per layer type). Missing Gemma 3 keys take transformers' defaults. The
        parameter dtype is `bfloat16` when the checkpoint says so (`torch_dtype` or `dtype`) and
        `float32` otherwise (float16 checkpoints load as float32).

        Args:
            d: The parsed `config.json`.

        Returns:
            The config.

        Raises:
            ValueError: Naming the key, for an unsupported `model_type`, activation, sliding-window
                attention (Qwen's `use_sliding_window`), MLP bias, RoPE type, Gemma 3's
                bidirectional attention or `attn_logit_softcapping` (which transformers' Gemma 3
                does not apply), Qwen3-MoE's dense layers among the sparse ones
                (`mlp_only_layers`, `decoder_sparse_step` other than 1), or a missing required key.
        """
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = (
                " (multimodal Gemma 3, Gemma3ForConditionalGeneration; only the text-only "
                "'gemma3_text' is supported)"
                if model_type == "gemma3"
                else ""
            )
            msg = (
                f"model_type: unsupported architecture {model_type!r}{hint}; expected one of "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )
            raise ValueError(msg)
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in d:
                msg = f"config.json ({model_type}): missing required key {key!r}"
                raise ValueError(msg)
        gemma = model_type == "gemma3_text"
        if gemma:
            act_key = "hidden_activation" if "hidden_activation" in d else "hidden_act"
            act = d.get(act_key) or "gelu_pytorch_tanh"
        else:
            act_key, act = "hidden_act", d.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            msg = f"{act_key}: only {ACTIVATIONS} are supported, got {act!r}"
            raise ValueError(msg)
        if d.get("mlp_bias", False):
            msg = "mlp_bias: MLP biases are not supported, got True"
            raise ValueError(msg)
        if d.get("use_sliding_window", False):
            msg = "use_sliding_window: sliding-window attention is not supported, got True"
            raise ValueError(msg)
        if d.get("pretraining_tp", 1) not in (1, None):
            msg = f"pretraining_tp: only 1 is supported, got {d.get('pretraining_tp')!r}"
            raise ValueError(msg)

        family: dict[str, Any] = {}
        rope_params = d.get("rope_parameters")
        if gemma:
            for key in ("use_bidirectional_attention", "attn_logit_softcapping"):
                if d.get(key):
                    msg = (
                        f"{key}: not supported, got {d[key]!r} (transformers' Gemma3ForCausalLM "
                        "does not apply attn_logit_softcapping; bidirectional attention is for "
                        "embedding models)"
                    )
                    raise ValueError(msg)
            if isinstance(rope_params, Mapping) and any(t in rope_params for t in LAYER_TYPES):
                global_d = rope_params.get("full_attention") or {}
                local_d = rope_params.get("sliding_attention") or {}
            else:
                global_d = {"rope_theta": d.get("rope_theta"), **(d.get("rope_scaling") or {})}
                local_d = {"rope_theta": d.get("rope_local_base_freq")}
            rope_theta, rope_scaling = _rope_entry(global_d, 1_000_000.0, "rope_parameters")
            local_theta, local_scaling = _rope_entry(local_d, 10_000.0, "rope_parameters")
            if local_scaling is not None:
                msg = (
                    "rope_parameters['sliding_attention']: RoPE scaling of the sliding-window "
                    f"layers is not supported, got {dict(local_d)}"
                )
                raise ValueError(msg)
            layer_types = d.get("layer_types")
            if layer_types is None:
                pattern = int(d.get("sliding_window_pattern") or _GEMMA3_PATTERN)
                layer_types = [
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                    for i in range(int(d["num_hidden_layers"]))
                ]
            scalar = d.get("query_pre_attn_scalar", 256)
            family = {
                "sliding_window": d.get("sliding_window", 4096),
                "layer_types": tuple(layer_types),
                "rope_local_theta": float(local_theta),
                "query_pre_attn_scalar": None if scalar is None else float(scalar),
                "final_logit_softcapping": d.get("final_logit_softcapping"),
            }
        else:
            legacy = {"rope_theta": d.get("rope_theta"), **(d.get("rope_scaling") or {})}
            if isinstance(rope_params, Mapping):
                legacy = {**legacy, **rope_params}
            rope_theta, rope_scaling = _rope_entry(legacy, 10_000.0, "rope_scaling")
            if model_type == "mistral":
                family = {"sliding_window": d.get("sliding_window")}
            elif model_type == "qwen3_moe":
                family = _moe_fields(d)

        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // num_heads
        dtype_name = d.get("torch_dtype", d.get("dtype"))
        param_dtype = "bfloat16" if dtype_name == "bfloat16" else "float32"
        # Qwen2 hard-codes q/k/v biases and Mistral none; the others read attention_bias.
        attention_bias = model_type == "qwen2" or (
            model_type != "mistral" and bool(d.get("attention_bias", False))
        )
        eos = d.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            hidden_act=act,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            initializer_range=float(d.get("initializer_range", 0.02)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"),
            param_dtype=param_dtype,
            **family,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """Returns a `config.json` dictionary that transformers reads back.

        RoPE is written in the legacy form (`rope_theta`, `rope_scaling`; for Gemma 3 also
        `rope_local_base_freq`), which transformers 4 and 5 both read.

        Returns:
            A JSON-serialisable dict with `architectures` and `model_type` set.
        """
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        out: dict[str, Any] = {
            "architectures": [SUPPORTED_MODEL_TYPES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_dict(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
            out["pretraining_tp"] = 1
        elif self.model_type == "qwen2":
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["max_window_layers"] = self.num_layers
        elif self.model_type == "qwen3":
            out["attention_bias"] = self.attention_bias
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["max_window_layers"] = self.num_layers
        elif self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        elif self.model_type == "qwen3_moe":
            out["attention_bias"] = self.attention_bias
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["max_window_layers"] = self.num_layers
            out["num_experts"] = self.num_experts
            out["num_experts_per_tok"] = self.num_experts_per_tok
            out["moe_intermediate_size"] = self.moe_intermediate_size
            out["norm_topk_prob"] = self.norm_topk_prob
            out["router_aux_loss_coef"] = self.router_aux_loss_coef
            out["decoder_sparse_step"] = 1
            out["mlp_only_layers"] = []
            out["output_router_logits"] = False
        else:  # gemma3_text
            out["hidden_activation"] = out.pop("hidden_act")
            out["attention_bias"] = self.attention_bias
            out["rope_local_base_freq"] = self.rope_local_theta
            out["sliding_window"] = self.sliding_window
            out["layer_types"] = list(self.layer_types)
            scalar = self.query_pre_attn_scalar  # transformers' field is an int
            out["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
            out["final_logit_softcapping"] = self.final_logit_softcapping
            out["attn_logit_softcapping"] = None
            out["use_bidirectional_attention"] = False
        return out


def _moe_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """The Qwen3-MoE fields of a `config.json`; refuses dense layers among the sparse ones.

    The expert count is `num_experts` (Hub checkpoints) or `num_local_experts` (transformers 5).
    """
    mlp_only = d.get("mlp_only_layers") or []
    step = d.get("decoder_sparse_step", 1)
    if mlp_only or step not in (1, None):
        msg = (
            "mlp_only_layers / decoder_sparse_step: only models whose every layer is sparse are "
            f"supported (mlp_only_layers=[], decoder_sparse_step=1), got mlp_only_layers="
            f"{list(mlp_only)}, decoder_sparse_step={step!r}"
        )
        raise ValueError(msg)
    experts = d.get("num_experts", d.get("num_local_experts"))
    for key, value in (
        ("num_experts", experts),
        ("num_experts_per_tok", d.get("num_experts_per_tok")),
        ("moe_intermediate_size", d.get("moe_intermediate_size")),
    ):
        if value is None:
            msg = f"config.json (qwen3_moe): missing required key {key!r}"
            raise ValueError(msg)
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(d["num_experts_per_tok"]),
        "moe_intermediate_size": int(d["moe_intermediate_size"]),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "router_aux_loss_coef": float(d.get("router_aux_loss_coef", 0.001)),
    }


def _rope_entry(
    d: Mapping[str, Any], default_theta: float, key: str
) -> tuple[float, RopeScaling | None]:
    """`(theta, scaling)` of one RoPE parameter mapping (legacy keys merged into it)."""
    theta = d.get("rope_theta")
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type in (None, "default"):
        scaling = None
    elif rope_type in ("llama3", "linear"):
        scaling = RopeScaling.from_dict(d)
    else:
        msg = f"{key}: unsupported rope_type {rope_type!r}; supported: 'llama3', 'linear'"
        raise ValueError(msg)
    return float(default_theta if theta is None else theta), scaling
