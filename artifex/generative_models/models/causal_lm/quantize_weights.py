"""Blockwise weight quantization: int8, int4 and NF4 codes with float32 scales, and their product.

:func:`quantize_weight` stores a kernel ``W`` (in, out) as integer codes and one float32 scale
per block of ``block_size`` input rows of each output column, :func:`dequantize_weight` gives
``deq(q, s)`` back within :func:`error_bound` of the block's absmax, and
:func:`quantized_matmul` computes ``x @ deq(q, s)`` with a backward pass that dequantizes again
instead of keeping the kernel. The formats and formulas are in
:mod:`~artifex.generative_models.models.causal_lm.quantize`, which builds quantized models from
these pieces; the quantization itself is qwix's (the ``quantize`` extra).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from artifex.generative_models.models.causal_lm._products import f32_products

__all__ = [
    "QTYPES",
    "dequantize_weight",
    "error_bound",
    "quantize_weight",
    "quantized_matmul",
]

#: The storage formats: 8-bit integers, 4-bit integers, 4-bit NormalFloat.
QTYPES = ("int8", "int4", "nf4")
BITS = {"int8": 8, "int4": 4, "nf4": 4}
# Half the widest gap between adjacent NF4 levels (-1 and -0.6961928009986877).
_ERROR_BOUNDS = {"int8": 1.0 / 255.0, "int4": 1.0 / 15.0, "nf4": (1.0 - 0.6961928009986877) / 2}
_EXTRA = "pip install 'artifex-grpo[quantize]'"


def _qwix() -> Any:
    try:
        import qwix
    except ImportError as err:
        msg = f"quantized bases need the qwix package: {_EXTRA}"
        raise ImportError(msg) from err
    return qwix


def _qwix_qtype(qtype: str) -> Any:
    return {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}[qtype]


def check_qtype(qtype: Any, where: str = "qtype") -> None:
    if qtype not in QTYPES:
        msg = f"{where} must be one of {QTYPES}, got {qtype!r}"
        raise ValueError(msg)


def check_block_size(block_size: Any, where: str = "block_size") -> None:
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        msg = f"{where} must be an int >= 2 or None (one scale per output column), got "
        raise ValueError(msg + repr(block_size))
    if block_size % 2:
        msg = f"{where} must be even (two 4-bit codes share a byte), got {block_size}"
        raise ValueError(msg)


def error_bound(qtype: str) -> float:
    """The largest `|W - deq(q(W))|` of a format, as a fraction of its block's absmax.

    Args:
        qtype: One of `QTYPES`.

    Returns:
        1/255 (int8), 1/15 (int4) or 0.15190 (NF4).

    Raises:
        ValueError: If `qtype` is not one of `QTYPES`.

    Examples:
        >>> from artifex.generative_models.models.causal_lm.quantize import error_bound
        >>> round(error_bound("int8") * 255, 6), round(error_bound("nf4"), 4)
        (1.0, 0.1519)
    """
    check_qtype(qtype)
    return _ERROR_BOUNDS[qtype]


def _pack(codes: jax.Array) -> jax.Array:
    """(in, out) codes in [-8, 15] -> (in / 2, out) uint8, row 2i in the low nibble."""
    n = codes.astype(jnp.int8).astype(jnp.uint8) & 0xF
    return n[0::2] | (n[1::2] << 4)


def _unpack(packed: jax.Array, signed: bool) -> jax.Array:
    """The inverse of `_pack`: (in / 2, out) uint8 -> (in, out) int8 (signed) or uint8."""
    nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=1)
    nibbles = nibbles.reshape(2 * packed.shape[0], *packed.shape[1:])
    if signed:
        return (nibbles.astype(jnp.int8) ^ 8) - 8
    return nibbles


def quantize_weight(
    weight: jax.Array, qtype: str, block_size: int | None = 64
) -> tuple[jax.Array, jax.Array]:
    """Quantizes a kernel (in, out) with qwix: absmax scales per block of input rows.

    Args:
        weight: A floating (in, out) kernel (computed in float32).
        qtype: One of `QTYPES`.
        block_size: Input rows per scale; None: one scale per column.

    Returns:
        `(codes, scale)`: int8 codes (in, out) for int8, else two 4-bit codes per uint8
        (in / 2, out), row 2i in the low nibble; float32 scales (in / block_size, out).

    Raises:
        ValueError: For a weight that is not a 2-D floating array, a bad `qtype` or
            `block_size`, or an input width that is not a multiple of `block_size` (or odd).
        ImportError: Without qwix (the `quantize` extra).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm.quantize import (
        ...     dequantize_weight, error_bound, quantize_weight)
        >>> w = jax.random.normal(jax.random.key(0), (128, 8))
        >>> codes, scale = quantize_weight(w, "int4", block_size=64)
        >>> codes.shape, codes.dtype, scale.shape
        ((64, 8), dtype('uint8'), (2, 8))
        >>> err = jnp.abs(dequantize_weight(codes, scale, "int4") - w)
        >>> bool((err <= error_bound("int4") * jnp.abs(w).max() * 1.0001).all())
        True
    """
    check_qtype(qtype)
    check_block_size(block_size)
    shape = tuple(getattr(weight, "shape", ()))
    dtype = getattr(weight, "dtype", None)
    if len(shape) != 2 or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        msg = f"weight must be a 2-D floating array (in, out), got shape {shape} dtype {dtype}"
        raise ValueError(msg)
    if block_size is not None and shape[0] % block_size:
        msg = f"input width {shape[0]} is not a multiple of block_size {block_size}"
        raise ValueError(msg)
    if BITS[qtype] == 4 and shape[0] % 2:
        msg = f"{qtype} packs two input rows per byte: the input width must be even, got {shape[0]}"
        raise ValueError(msg)
    _qwix()  # the extra's error before tracing
    return _quantize(jnp.asarray(weight), qtype, block_size)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(weight: jax.Array, qtype: str, block_size: int | None) -> tuple[jax.Array, ...]:
    tiles = {} if block_size is None else {0: block_size}
    q = _qwix().quantize(
        weight.astype(jnp.float32), _qwix_qtype(qtype), channelwise_axes=(1,), tiled_axes=tiles
    )
    if qtype == "int8":
        return q.qvalue, q.scale
    return _pack(q.qvalue), q.scale


def dequantize_weight(
    codes: jax.Array, scale: jax.Array, qtype: str, dtype: Any = jnp.float32
) -> jax.Array:
    """The kernel that `codes` and `scale` stand for (qwix's dequantization).

    Args:
        codes: Codes from `quantize_weight` (int8 (in, out), or packed uint8 (in / 2, out)).
        scale: float32 scales (blocks, out).
        qtype: The format they were made with.
        dtype: The result's dtype.

    Returns:
        The (in, out) kernel, `scale * value(code)` broadcast over each block, in `dtype`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm.quantize import (
        ...     dequantize_weight, quantize_weight)
        >>> w = jnp.array([[1.0], [-0.5]])
        >>> deq = dequantize_weight(*quantize_weight(w, "nf4", block_size=2), "nf4")
        >>> [round(float(v), 4) for v in deq.ravel()]  # the NF4 levels 1 and -0.5251
        [1.0, -0.5251]
    """
    check_qtype(qtype)
    qwix = _qwix()
    values = codes if qtype == "int8" else _unpack(codes, signed=qtype == "int4")
    array = qwix.QArray(values, scale, None, _qwix_qtype(qtype))
    return qwix.dequantize(array).astype(dtype)


def _product(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` as `Linear` computes it (float32 results for 16-bit operands on the CPU)."""
    if f32_products(x.dtype):
        return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.matmul(x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def quantized_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, qtype: str) -> jax.Array:
    """`x @ deq(codes, scale)` whose backward pass dequantizes again (no saved kernel).

    The gradient flows to `x` only: the codes and scales are frozen storage (their cotangents
    are zero).

    Args:
        x: Input (N, in), in the dtype the kernel is dequantized to.
        codes: Codes from `quantize_weight`.
        scale: Its scales.
        qtype: The format.

    Returns:
        (N, out) in the dtype of `x`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm.quantize import (
        ...     dequantize_weight, quantize_weight, quantized_matmul)
        >>> w = jax.random.normal(jax.random.key(0), (4, 3))
        >>> codes, scale = quantize_weight(w, "int8", block_size=None)
        >>> x = jnp.arange(8.0).reshape(2, 4)
        >>> w_hat = dequantize_weight(codes, scale, "int8")
        >>> bool(jnp.allclose(quantized_matmul(x, codes, scale, "int8"), x @ w_hat))
        True
        >>> dx = jax.grad(lambda x: quantized_matmul(x, codes, scale, "int8").sum())(x)
        >>> bool(jnp.allclose(dx[0], w_hat.sum(1)))  # d sum(x W) / dx = W 1
        True
    """
    return _product(x, dequantize_weight(codes, scale, qtype, x.dtype))


def _qmm_fwd(
    x: jax.Array, codes: jax.Array, scale: jax.Array, qtype: str
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    y = _product(x, dequantize_weight(codes, scale, qtype, x.dtype))
    return y, (codes, scale, jnp.zeros((0,), x.dtype))


def _qmm_bwd(
    qtype: str, res: tuple[jax.Array, jax.Array, jax.Array], ct: jax.Array
) -> tuple[jax.Array, None, jax.Array]:
    codes, scale, like = res
    w = dequantize_weight(codes, scale, qtype, like.dtype)
    return _product(ct.astype(like.dtype), w.T), None, jnp.zeros_like(scale)


quantized_matmul.defvjp(_qmm_fwd, _qmm_bwd)
