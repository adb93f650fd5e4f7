"""Configuration of the decoder-only causal language models (Llama 3, Qwen2/2.5, Qwen3).

`CausalLMConfig` is the one description of an architecture. It converts to and from the
`config.json` dictionaries that Hugging Face transformers reads and writes, so a checkpoint saved by
either library loads in the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLMConfig", "RopeScaling", "resolve_dtype"]

#: model_type -> Hugging Face architecture class name.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

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
    """Llama 3.1-style RoPE frequency scaling (`rope_type="llama3"`).

    Inverse frequencies with wavelength `2π/f` longer than
    `original_max_position_embeddings / low_freq_factor` are divided by `factor`; those shorter
    than `original_max_position_embeddings / high_freq_factor` are kept; the ones in between are
    interpolated with `s = (L_orig / wavelen - low) / (high - low)`:
    `f' = (1 - s) f / factor + s f`. This matches transformers' `_compute_llama3_parameters`.

    Attributes:
        factor: Scaling factor for the low frequencies (8 for Llama 3.1, 32 for Llama 3.2).
        low_freq_factor: Low-frequency boundary factor (1 in Llama 3.1).
        high_freq_factor: High-frequency boundary factor (4 in Llama 3.1).
        original_max_position_embeddings: Context length of the original pretraining (8192).
        rope_type: Only "llama3" is supported.

    Raises:
        ValueError: If a field is out of range or `rope_type` is not "llama3".

    Examples:
        >>> from artifex.generative_models.models.causal_lm import RopeScaling
        >>> scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        ...                       original_max_position_embeddings=8192)
        >>> scaling.to_dict()["rope_type"], RopeScaling.from_dict(scaling.to_dict()) == scaling
        ('llama3', True)
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            msg = f"rope_scaling.rope_type: only 'llama3' is supported, got {self.rope_type!r}"
            raise ValueError(msg)
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
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
            d: Mapping with `rope_type` (or the legacy `type`), `factor`, `low_freq_factor`,
                `high_freq_factor` and `original_max_position_embeddings`; other keys (such as
                `rope_theta`) are ignored.

        Returns:
            The scaling.

        Raises:
            ValueError: If the type is not "llama3" or a key is missing.
        """
        rope_type = d.get("rope_type", d.get("type"))
        if rope_type != "llama3":
            msg = f"rope_scaling: only rope_type 'llama3' is supported, got {rope_type!r}"
            raise ValueError(msg)
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in d]
        if missing:
            msg = f"rope_scaling: missing keys {missing} for rope_type 'llama3', got {dict(d)}"
            raise ValueError(msg)
        return cls(
            factor=float(d["factor"]),
            low_freq_factor=float(d["low_freq_factor"]),
            high_freq_factor=float(d["high_freq_factor"]),
            original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """Returns the Hugging Face `rope_scaling` dictionary.

        Returns:
            A JSON-serialisable dict with `rope_type` and the four parameters.
        """
        return {
            "rope_type": self.rope_type,
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CausalLMConfig:
    """Architecture of a decoder-only transformer (Llama 3, Qwen2/2.5, Qwen3).

    Each layer is `h += Attn(RMSNorm(h)); h += SwiGLU(RMSNorm(h))`, attention is grouped-query
    with rotate-half RoPE, and the logits are `RMSNorm(h) @ W_out` with `W_out = E^T` when the
    embeddings are tied. The families differ in a few switches: Qwen2 has q/k/v biases (no o_proj
    bias); Qwen3 applies an RMSNorm over the head dimension to q and k before RoPE and usually sets
    `head_dim` explicitly; Llama 3.1+ scales the RoPE frequencies (`rope_scaling`).

    Attributes:
        model_type: "llama", "qwen2" or "qwen3" (decides the Hugging Face architecture).
        vocab_size: Number of token embeddings.
        hidden_size: Model width D.
        intermediate_size: Hidden width F of the SwiGLU MLP.
        num_layers: Number of decoder layers L.
        num_heads: Number of query heads N.
        num_kv_heads: Number of key/value heads K (N must be a multiple of K); None means N.
        head_dim: Per-head width H; None means `hidden_size // num_heads`.
        rope_theta: RoPE base.
        rope_scaling: None or a `RopeScaling` (a mapping is converted).
        rms_norm_eps: Epsilon of every RMSNorm.
        tie_word_embeddings: Whether the output projection is the transposed input embedding.
        attention_bias: Whether q/k/v projections have biases (Llama and Qwen3 then also give o_proj
            a bias, as transformers does; Qwen2 always has q/k/v biases and no o_proj bias).
        qk_norm: Whether q and k get a per-head RMSNorm before RoPE (True exactly for Qwen3).
        max_position_embeddings: Longest context the model is meant for (written to config.json).
        initializer_range: Standard deviation of the normal initialisation of weights.
        bos_token_id: Beginning-of-sequence id or None.
        eos_token_id: End-of-sequence id, a tuple of ids (a list is converted), or None.
        pad_token_id: Padding id or None.
        param_dtype: "float32" or "bfloat16"; parameters are stored and computed in this dtype.

    Raises:
        ValueError: Naming the field, if a field is invalid or the combination cannot be written as
            a Hugging Face config of `model_type`.

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
        if self.qk_norm != (self.model_type == "qwen3"):
            msg = (
                f"qk_norm: model_type {self.model_type!r} requires qk_norm="
                f"{self.model_type == 'qwen3'}, got {self.qk_norm}"
            )
            raise ValueError(msg)
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

    # ------------------------------------------------------------------ derived values

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
        layer = attn + 3 * d * f + 2 * d
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

        Reads the legacy keys (`rope_theta`, `rope_scaling`) and the transformers 5 form
        (`rope_parameters`). The parameter dtype is `bfloat16` when the checkpoint says so
        (`torch_dtype` or `dtype`) and `float32` otherwise (float16 checkpoints load as float32).

        Args:
            d: The parsed `config.json`.

        Returns:
            The config.

        Raises:
            ValueError: Naming the key, for an unsupported `model_type`, activation, sliding-window
                attention, MLP bias, RoPE type, or a missing required key.
        """
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            msg = (
                f"model_type: unsupported architecture {model_type!r}; expected one of "
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
        act = d.get("hidden_act", "silu")
        if act != "silu":
            msg = f"hidden_act: only 'silu' is supported, got {act!r}"
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

        rope_params = d.get("rope_parameters")
        rope_theta = d.get("rope_theta")
        rope_scaling_d = d.get("rope_scaling")
        if isinstance(rope_params, Mapping):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            rope_scaling_d = rope_params
        if rope_theta is None:
            rope_theta = 10_000.0
        rope_scaling = None
        if rope_scaling_d:
            rope_type = rope_scaling_d.get("rope_type", rope_scaling_d.get("type", "default"))
            if rope_type == "llama3":
                rope_scaling = RopeScaling.from_dict(rope_scaling_d)
            elif rope_type != "default":
                msg = f"rope_scaling: unsupported rope_type {rope_type!r}; supported: 'llama3'"
                raise ValueError(msg)

        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // num_heads
        dtype_name = d.get("torch_dtype", d.get("dtype"))
        param_dtype = "bfloat16" if dtype_name == "bfloat16" else "float32"
        # Qwen2 hard-codes q/k/v biases; Llama and Qwen3 read attention_bias.
        attention_bias = model_type == "qwen2" or bool(d.get("attention_bias", False))
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
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            initializer_range=float(d.get("initializer_range", 0.02)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"),
            param_dtype=param_dtype,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """Returns a `config.json` dictionary that transformers reads back.

        RoPE is written in the legacy form (`rope_theta`, `rope_scaling`), which transformers 4 and
        5 both read.

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
            "hidden_act": "silu",
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
        else:  # qwen3
            out["attention_bias"] = self.attention_bias
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["max_window_layers"] = self.num_layers
        return out
