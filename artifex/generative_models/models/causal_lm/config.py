"""Configuration of the decoder-only causal LMs (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma 3).

`CausalLMConfig` is the one description of an architecture. It converts to and from the
`config.json` dictionaries that Hugging Face transformers reads and writes, so a checkpoint saved by
either library loads in the other.

`CausalLMConfig` is defined here; the types and vocabularies of its fields (`RopeScaling`,
`SUPPORTED_MODEL_TYPES`, `ACTIVATIONS`, `LAYER_TYPES`, `resolve_dtype`) are in
:mod:`~artifex.generative_models.models.causal_lm.config_types` and the `config.json` mapping in
`_hf_config`. Their names stay importable from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from artifex.generative_models.models.causal_lm import _hf_config
from artifex.generative_models.models.causal_lm._hf_config import (  # noqa: F401  (old imports)
    _moe_fields,
    _rope_entry,
)
from artifex.generative_models.models.causal_lm.config_types import (  # noqa: F401  (old imports)
    _DTYPE_NAMES,
    _DTYPES,
    _GEMMA3_PATTERN,
    ACTIVATIONS,
    LAYER_TYPES,
    SUPPORTED_MODEL_TYPES,
    RopeScaling,
    _require_positive_int,
    _require_token_id,
    resolve_dtype,
)

__all__ = ["CausalLMConfig"]


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
        return _hf_config.from_hf_config(cls, d)

    def to_hf_config(self) -> dict[str, Any]:
        """Returns a `config.json` dictionary that transformers reads back.

        RoPE is written in the legacy form (`rope_theta`, `rope_scaling`; for Gemma 3 also
        `rope_local_base_freq`), which transformers 4 and 5 both read.

        Returns:
            A JSON-serialisable dict with `architectures` and `model_type` set.
        """
        return _hf_config.to_hf_config(self)
