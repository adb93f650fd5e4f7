"""The value types and vocabularies of the causal LM config's fields.

The supported model types (:data:`SUPPORTED_MODEL_TYPES`), MLP activations (:data:`ACTIVATIONS`),
attention kinds of a layer (:data:`LAYER_TYPES`), the parameter dtypes (:func:`resolve_dtype`) and
RoPE frequency scaling (:class:`RopeScaling`), with the field checks they share with
:class:`~artifex.generative_models.models.causal_lm.config.CausalLMConfig`.

Moved out of :mod:`~artifex.generative_models.models.causal_lm.config` unchanged; the names stay
importable from there.
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
