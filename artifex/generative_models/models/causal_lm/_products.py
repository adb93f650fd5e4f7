"""Matrix products in the model's dtype, with a float32 result for 16-bit operands on the CPU.

:func:`matmul` is the product of every projection (``Linear``); :func:`f32_products` says
whether a dtype's products are computed that way, for the attention and MoE kernels that call
``einsum`` themselves.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` in their dtype; on the CPU, 16-bit operands get a float32 product.

    On the CPU a bfloat16 product is computed with a float32 result and rounded once to
    bfloat16: the values of a bfloat16 product that accumulates in float32, which XLA:CPU runs
    on the CPU's matrix units where it has them (AMX), faster than a product with a bfloat16
    result (docs/benchmarks.md). Elsewhere (GPUs accumulate bfloat16 products in float32
    anyway) it is ``x @ w``.
    """
    if x.dtype == w.dtype and f32_products(x.dtype):
        return _matmul_f32_accumulate(x, w)
    return jnp.matmul(x, w)


def f32_products(dtype: Any) -> bool:
    """Whether products of ``dtype`` operands are computed with a float32 result (see ``matmul``).

    True for 16-bit floats on the CPU backend.
    """
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and jax.default_backend() == "cpu"


@jax.custom_vjp
def _matmul_f32_accumulate(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _matmul_f32_accumulate_fwd(x: jax.Array, w: jax.Array):
    return _matmul_f32_accumulate(x, w), (x, w)


def _matmul_f32_accumulate_bwd(res: tuple[jax.Array, jax.Array], ct: jax.Array):
    # The gradients as a product with a 16-bit cotangent would compute them (the cotangent of a
    # 16-bit result is 16-bit), accumulated in float32: without this rule JAX would multiply in
    # float32, converting the operands, and not use the matrix units.
    x, w = res
    ct = ct.astype(x.dtype)
    dx = jnp.matmul(ct, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.matmul(x.T, ct, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


_matmul_f32_accumulate.defvjp(_matmul_f32_accumulate_fwd, _matmul_f32_accumulate_bwd)
