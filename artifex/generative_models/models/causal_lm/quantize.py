"""Quantized frozen bases (QLoRA): int8, int4 or NF4 storage of the projections of `CausalLM`.

`quantize_base` replaces the targeted projections of every layer by `QuantizedLinear`: its
kernel `W` (in, out) is stored as integer codes `q` and a float32 scale `s` per block of
`block_size` input rows of each output column (`a` = the block's absmax), and each call
computes `y = x deq(q, s) + b + lora(x)` with

- int8: `s = a / 127.5`, `q = clip(round(W / s), -128, 127)`, `deq = s q`;
- int4: `s = a / 7.5`, `q = clip(round(W / s), -8, 7)`, `deq = s q`;
- NF4: `s = a`, `q` the nearest of the 16 NormalFloat levels `c_k` to `W / s`, `deq = s c_q`.

Every weight lies within `error_bound(qtype) * a` of its original (1/255, 1/15, 0.1519). The
quantization and dequantization are qwix's (`qwix.quantize`, `qwix.dequantize`; the `quantize`
extra); two 4-bit codes are packed per byte here (XLA:CPU stores `int4` one byte per element),
and the product's backward pass dequantizes again instead of keeping the kernel. Codes and
scales are `QuantizedWeight` variables, not `nnx.Param`: never trained. `dequantize_base` gives
a full-precision copy for `merge_lora` and `save_pretrained`. docs/models.md says more.

References:
    Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from artifex.generative_models.models.causal_lm.lora import _MLP_TARGETS, LORA_TARGETS
from artifex.generative_models.models.causal_lm.model import CausalLM
from artifex.generative_models.models.causal_lm.modules import Linear
from artifex.generative_models.models.causal_lm.quantize_weights import (  # noqa: F401 (old path)
    BITS,
    QTYPES,
    check_block_size,
    check_qtype,
    dequantize_weight,
    error_bound,
    quantize_weight,
    quantized_matmul,
)

__all__ = [
    "QuantizeConfig",
    "QuantizedLinear",
    "QuantizedWeight",
    "dequantize_base",
    "is_quantized",
    "quantize_base",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QuantizeConfig:
    """How `quantize_base` stores the frozen base.

    Attributes:
        qtype: "int8", "int4" or "nf4".
        block_size: Input rows per scale (QLoRA's 64); None: one scale per output column.
            Every targeted projection's input width must be a multiple of it.
        target_modules: Projection names among `LORA_TARGETS` (default: all seven).

    Raises:
        ValueError: Naming the field, for an unknown qtype or projection, or a block size
            that is not an even int >= 2 (nor None).

    Examples:
        >>> from artifex.generative_models.models.causal_lm.quantize import QuantizeConfig
        >>> config = QuantizeConfig(qtype="nf4")
        >>> config.block_size, config.bits_per_weight  # 4 bits + a float32 scale per 64
        (64, 4.5)
    """

    qtype: str
    block_size: int | None = 64
    target_modules: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        check_qtype(self.qtype)
        check_block_size(self.block_size)
        if isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", (self.target_modules,))
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown or not self.target_modules:
            msg = f"target_modules: expected names in {LORA_TARGETS}, got {self.target_modules}"
            raise ValueError(msg)

    @property
    def bits_per_weight(self) -> float | None:
        """Storage bits per weight, scales included (None when `block_size` is None)."""
        if self.block_size is None:
            return None
        return BITS[self.qtype] + 32 / self.block_size


class QuantizedWeight(nnx.Variable):
    """Frozen quantized storage (codes or scales): not an `nnx.Param`, so never trained.

    Args:
        value: The array.
        **kwargs: As for `nnx.Variable` (``hijax``, ``ref``, ``eager_sharding``, metadata).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm.quantize import QuantizedWeight
        >>> isinstance(QuantizedWeight(jnp.zeros((2, 2), jnp.uint8)), nnx.Param)
        False
    """

    def __init__(self, value: Any, **kwargs: Any):
        super().__init__(value, **kwargs)


class QuantizedLinear(Linear):
    """`Linear` whose kernel is stored quantized: `y = x deq(q, s) + b + lora(x)`.

    Built by `quantize_base` (or `from_linear`). `kernel_codes` and `kernel_scale` are
    `QuantizedWeight` variables; the bias stays an `nnx.Param` of the model's dtype; `lora`
    works as on `Linear`. There is no `kernel`: `dequantized_kernel()` computes it.

    Args:
        codes: Codes from `quantize_weight`.
        scale: Their scales.
        bias: Bias (out,) or None.
        qtype: The format.
        in_features: Input width.
        out_features: Output width.
        dtype: The dtype the kernel is dequantized to and computed in (the model's).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import Linear
        >>> from artifex.generative_models.models.causal_lm.quantize import QuantizedLinear
        >>> proj = Linear(64, 4, use_bias=False, std=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> q = QuantizedLinear.from_linear(proj, "int8", block_size=32)
        >>> q.kernel_codes.shape, q.kernel_scale.shape
        ((64, 4), (2, 4))
        >>> x = jnp.ones((2, 64))
        >>> bool(jnp.allclose(q(x), proj(x), atol=64 * 0.1 / 255))  # sum |x| absmax / 255
        True
    """

    def __init__(
        self,
        codes: jax.Array,
        scale: jax.Array,
        bias: jax.Array | None,
        *,
        qtype: str,
        in_features: int,
        out_features: int,
        dtype: Any,
    ) -> None:
        check_qtype(qtype)
        rows = in_features if qtype == "int8" else in_features // 2
        if tuple(codes.shape) != (rows, out_features) or scale.shape[-1] != out_features:
            msg = (
                f"{qtype} codes of a ({in_features}, {out_features}) kernel must be "
                f"({rows}, {out_features}) with scales (blocks, {out_features}), got "
                f"{tuple(codes.shape)} and {tuple(scale.shape)}"
            )
            raise ValueError(msg)
        self.in_features = in_features
        self.out_features = out_features
        self.qtype = qtype
        self.dtype = jnp.dtype(dtype)
        self.kernel_codes = QuantizedWeight(codes)
        self.kernel_scale = QuantizedWeight(scale)
        self.bias = None if bias is None else nnx.Param(bias)
        self.lora: Any = nnx.data(None)

    @classmethod
    def from_linear(
        cls, linear: Linear, qtype: str, block_size: int | None = 64
    ) -> QuantizedLinear:
        """Quantizes a `Linear` (its adapter, if any, is moved over unchanged).

        Args:
            linear: The projection.
            qtype: One of `QTYPES`.
            block_size: Input rows per scale (None: one per column).

        Returns:
            The quantized projection.

        Examples:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import Linear
            >>> from artifex.generative_models.models.causal_lm.quantize import QuantizedLinear
            >>> lin = Linear(8, 2, use_bias=True, std=0.1, dtype=jnp.float32, rngs=nnx.Rngs(0))
            >>> QuantizedLinear.from_linear(lin, "nf4", block_size=None).kernel_codes.shape
            (4, 2)
        """
        kernel = linear.kernel[...]
        codes, scale = quantize_weight(kernel, qtype, block_size)
        bias = None if linear.bias is None else linear.bias[...]
        out = cls(
            codes,
            scale,
            bias,
            qtype=qtype,
            in_features=linear.in_features,
            out_features=linear.out_features,
            dtype=kernel.dtype,
        )
        out.lora = linear.lora
        return out

    @property
    def kernel(self) -> Any:
        """Not stored: raises `AttributeError` (see `dequantized_kernel`, `dequantize_base`)."""
        msg = (
            f"this projection's kernel is stored quantized ({self.qtype}); "
            "dequantized_kernel() computes it and dequantize_base(model) gives a "
            "full-precision copy of the model (for merge_lora and save_pretrained)"
        )
        raise AttributeError(msg)

    def dequantized_kernel(self) -> jax.Array:
        """The kernel the codes stand for.

        Returns:
            The (in, out) kernel in the projection's dtype.
        """
        return dequantize_weight(
            self.kernel_codes[...], self.kernel_scale[...], self.qtype, self.dtype
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Projects the last axis: `x deq(q, s) + b + lora(x)`.

        Args:
            x: Array (..., in).

        Returns:
            Array (..., out) in the dtype of `x` promoted with the projection's.
        """
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        xc = x2.astype(jnp.promote_types(x.dtype, self.dtype))
        y = quantized_matmul(xc, self.kernel_codes[...], self.kernel_scale[...], self.qtype)
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora is not None:
            y = y + self.lora(x2).astype(y.dtype)
        return y.reshape(*lead, y.shape[-1])


def _projections(model: CausalLM, names: tuple[str, ...]) -> list[tuple[str, Any, str]]:
    out = []
    for i, layer in enumerate(model.layers):
        for part in ("attn", "mlp"):
            parent = getattr(layer, part, None)
            for name in names:
                if isinstance(getattr(parent, name, None), Linear):
                    out.append((f"layers.{i}.{part}.{name}", parent, name))
    return out


def is_quantized(model: nnx.Module) -> bool:
    """Whether `model` holds any `QuantizedLinear`.

    Args:
        model: Any module.

    Returns:
        True if some projection is stored quantized.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.models.causal_lm.quantize import is_quantized
        >>> is_quantized(CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0)))
        False
    """
    return any(isinstance(node, QuantizedLinear) for _, node in nnx.iter_graph(model))


def quantize_base(model: CausalLM, config: QuantizeConfig) -> CausalLM:
    """Stores the targeted projections of every layer quantized, in place (QLoRA's base).

    Adapters already applied are kept (unquantized); `apply_lora` may also come after. Build
    the optimizer afterwards, with `wrt=nnx.LoRAParam`. A stacked model is unstacked, quantized
    layer by layer and stacked again. In a mixture-of-experts model only `Linear` projections
    are stored quantized: the experts' stacked weights stay in full precision (name the
    attention projections in `target_modules`), and expert adapters (`apply_lora` with
    `gate_proj`, `up_proj`, `down_proj`) train on top of them.

    Args:
        model: The model (modified in place and returned).
        config: The format, block size and targets.

    Returns:
        The same model object, its targets now `QuantizedLinear`.

    Raises:
        TypeError: If `model` is not a `CausalLM` or `config` not a `QuantizeConfig`.
        ValueError: If the model is already quantized, a target's input width is not a
            multiple of `block_size` (the message names the projection), or `target_modules`
            names feed-forward projections of a mixture-of-experts model (its experts'
            stacked weights, which are not stored quantized).
        ImportError: Without qwix (the `quantize` extra).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, LoRAConfig, apply_lora)
        >>> from artifex.generative_models.models.causal_lm.quantize import (
        ...     QuantizeConfig, quantize_base)
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> ids = jnp.array([[1, 2, 3]])
        >>> before = model(ids)
        >>> model = quantize_base(model, QuantizeConfig(qtype="int8"))
        >>> model.layers[0].mlp.up_proj.kernel_codes.dtype
        dtype('int8')
        >>> model = apply_lora(model, LoRAConfig(rank=4, alpha=8.0), nnx.Rngs(1))
        >>> float(jnp.abs(model(ids) - before).max()) < 0.01  # int8 error, B = 0
        True
    """
    if not isinstance(model, CausalLM):
        msg = f"quantize_base: model must be a CausalLM, got {type(model).__name__}"
        raise TypeError(msg)
    if not isinstance(config, QuantizeConfig):
        msg = f"quantize_base: config must be a QuantizeConfig, got {type(config).__name__}"
        raise TypeError(msg)
    if is_quantized(model):
        msg = "quantize_base: the model is already quantized"
        raise ValueError(msg)
    experts = sorted(n for n in config.target_modules if n in _MLP_TARGETS)
    if experts and model.config.is_moe:
        attention = tuple(n for n in LORA_TARGETS if n not in _MLP_TARGETS)
        msg = (
            f"quantize_base: target_modules {experts} are the experts' stacked weights in this "
            f"mixture-of-experts model ({model.config.model_type}), which are not stored "
            f"quantized (only Linear projections are); expected attention projections only: "
            f"QuantizeConfig(target_modules={attention}). Expert LoRA adapters (apply_lora) "
            "train on top of the experts' full-precision weights"
        )
        raise ValueError(msg)
    stacked = getattr(model, "layers_stacked", False)
    if stacked:
        model.unstack_layers()
    try:
        targets = _projections(model, config.target_modules)
        for path, parent, name in targets:  # check every width before changing anything
            width = getattr(parent, name).in_features
            if config.block_size is not None and width % config.block_size:
                msg = (
                    f"quantize_base: {path} has input width {width}, not a multiple of "
                    f"block_size {config.block_size}; choose a block size that divides every "
                    "target's input width, or None (one scale per output column)"
                )
                raise ValueError(msg)
            if BITS[config.qtype] == 4 and width % 2:
                msg = f"quantize_base: {path} has an odd input width {width} ({config.qtype})"
                raise ValueError(msg)
        for _, parent, name in targets:
            proj = getattr(parent, name)
            setattr(
                parent, name, QuantizedLinear.from_linear(proj, config.qtype, config.block_size)
            )
    finally:
        if stacked:
            model.stack_layers()
    return model


def dequantize_base(model: CausalLM) -> CausalLM:
    """A copy of `model` whose quantized projections are `Linear` again (dequantized kernels).

    The copy computes the same function as `model` (the same kernels, now stored in the
    model's dtype); adapters are kept, so `merge_lora(dequantize_base(model))` is the trained
    model as one full-precision checkpoint. `model` is left unchanged.

    Args:
        model: A model, quantized or not.

    Returns:
        A `CausalLM` without `QuantizedLinear`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.models.causal_lm.quantize import (
        ...     QuantizeConfig, dequantize_base, is_quantized, quantize_base)
        >>> model = quantize_base(CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0)),
        ...                       QuantizeConfig(qtype="nf4"))
        >>> full = dequantize_base(model)
        >>> is_quantized(full), is_quantized(model)
        (False, True)
        >>> ids = jnp.array([[1, 2, 3]])
        >>> bool(jnp.allclose(full(ids), model(ids), atol=1e-5))
        True
    """
    out = nnx.clone(model)
    stacked = getattr(out, "layers_stacked", False)
    if stacked:
        out.unstack_layers()
    for _, parent, name in _projections(out, LORA_TARGETS):
        proj = getattr(parent, name)
        if not isinstance(proj, QuantizedLinear):
            continue
        linear = Linear(
            proj.in_features,
            proj.out_features,
            use_bias=proj.bias is not None,
            std=0.0,
            dtype=proj.dtype,
            rngs=nnx.Rngs(0),
        )
        linear.kernel.set_value(proj.dequantized_kernel())
        if proj.bias is not None:
            linear.bias.set_value(proj.bias[...])
        linear.lora = proj.lora
        setattr(parent, name, linear)
    if stacked:
        out.stack_layers()
    return out
