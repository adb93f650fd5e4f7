"""The expert MLPs of a sparse layer on one device: dense on the CPU, ragged batches elsewhere.

:func:`dispatch_experts` computes ``y_n = sum_j w_nj down_e(act(x_n gate_e) * x_n up_e)`` for
the assignments of tokens to the local experts (what
:func:`~artifex.generative_models.models.causal_lm.moe.expert_mlp` runs on one device, or on
each device under ``shard_map``). The assignments are sorted by expert and run as ragged batches
(``jax.lax.ragged_dot``, ``N k`` rows). XLA:CPU computes a ragged product as one masked product
per expert over all ``N k`` rows, ``E`` times the work of the routed rows, so on the CPU backend
every local expert runs densely on every token instead (``E N`` rows, ``k`` times fewer), each
output weighted by the token's routing weight to that expert (zero where it was not routed), as
long as the ``(E, N, I)`` activations stay under :data:`DENSE_EXPERTS_MAX_BYTES`. Both give the
same values up to the order of float additions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from artifex.generative_models.models.causal_lm._products import f32_products

__all__ = ["DENSE_EXPERTS_MAX_BYTES", "dispatch_experts"]


def _activation(name: str, x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True) if name == "gelu_pytorch_tanh" else jax.nn.silu(x)


def _grouped(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """``x`` rows (sorted into groups of ``sizes``) times their group's matrix ``w[g]``."""
    f32 = jnp.float32 if f32_products(x.dtype) or x.dtype == jnp.float32 else None
    out = jax.lax.ragged_dot(x, w.astype(x.dtype), sizes, preferred_element_type=f32)
    return out.astype(x.dtype)


#: The largest ``(E, N, I)`` expert activations (in bytes) the CPU's dense expert path holds;
#: above it the experts run as ragged batches there too.
DENSE_EXPERTS_MAX_BYTES = 256 * 2**20


def _use_dense(x: jax.Array, gate: jax.Array) -> bool:
    """Whether the experts of ``x`` run densely: the CPU backend and activations that fit."""
    n, (e, _, i) = x.shape[0], gate.shape
    size = e * n * i * max(jnp.dtype(x.dtype).itemsize, 4)
    return jax.default_backend() == "cpu" and size <= DENSE_EXPERTS_MAX_BYTES


def _dense_dispatch(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    activation: str,
    first: jax.Array | int = 0,
) -> jax.Array:
    """:func:`dispatch_experts`'s value with every local expert run on every token (``E N`` rows).

    Each token's output is the sum over the local experts weighted by its routing weight to
    that expert (zero where it was not routed there, or routed to another device's expert).
    """
    n = x.shape[0]
    local_experts = gate.shape[0]
    flat = experts - first
    local = (flat >= 0) & (flat < local_experts)
    combine = (
        jnp.zeros((n, local_experts), jnp.float32)
        .at[jnp.arange(n)[:, None], jnp.where(local, flat, 0)]
        .add(jnp.where(local, weights, 0.0).astype(jnp.float32))
        .astype(x.dtype)
    )
    f32 = jnp.float32 if f32_products(x.dtype) or x.dtype == jnp.float32 else None

    def product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.einsum(spec, a, b.astype(a.dtype), preferred_element_type=f32).astype(x.dtype)

    hidden = _activation(activation, product("nd,edi->eni", x, gate))
    hidden = hidden * product("nd,edi->eni", x, up)
    out = product("eni,eid->end", hidden, down)
    return jnp.einsum("end,ne->nd", out, combine, preferred_element_type=f32).astype(x.dtype)


def dispatch_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    activation: str,
    first: jax.Array | int = 0,
) -> jax.Array:
    """Dropless expert MLPs of ``x`` (N, D) for the experts ``[first, first + E_local)``.

    ``y_n = sum_j weights[n, j] * down_e(act(x_n gate_e) * x_n up_e)`` over the assignments
    ``e = experts[n, j] - first`` that are local.

    Assignments to other experts contribute nothing (they are sorted after the local groups,
    where `ragged_dot` writes zeros). On the CPU, :func:`_dense_dispatch` where it fits.

    Args:
        x: Tokens (N, D).
        experts: (N, k) int expert ids.
        weights: (N, k) routing weights.
        gate: (E_local, D, I) gate kernels.
        up: (E_local, D, I) up kernels.
        down: (E_local, I, D) down kernels.
        activation: ``"silu"`` or ``"gelu_pytorch_tanh"``.
        first: The first local expert's id.

    Returns:
        (N, D) in the dtype of ``x``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm.moe_dispatch import dispatch_experts
        >>> x, w = jnp.ones((2, 3)), jnp.ones((2, 3, 4))
        >>> y = dispatch_experts(x, jnp.array([[0], [1]]), jnp.ones((2, 1)), w, w,
        ...                      jnp.ones((2, 4, 3)), "silu")
        >>> y.shape
        (2, 3)
    """
    if _use_dense(x, gate):
        return _dense_dispatch(x, experts, weights, gate, up, down, activation, first)
    return _ragged_dispatch(x, experts, weights, gate, up, down, activation, first)


def _ragged_dispatch(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    activation: str,
    first: jax.Array | int = 0,
) -> jax.Array:
    """:func:`dispatch_experts` as ragged batches, the assignments sorted by expert (N k rows)."""
    n, d = x.shape
    k = experts.shape[-1]
    local_experts = gate.shape[0]
    flat = experts.reshape(-1) - first
    local = (flat >= 0) & (flat < local_experts)
    key = jnp.where(local, flat, local_experts)
    order = jnp.argsort(key, stable=True)
    token = order // k
    sizes = jnp.bincount(key, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    rows = jnp.take(x, token, axis=0)
    hidden = _activation(activation, _grouped(rows, gate, sizes)) * _grouped(rows, up, sizes)
    out = _grouped(hidden, down, sizes)
    w = jnp.where(local, weights.reshape(-1), 0.0)[order].astype(x.dtype)
    return jnp.zeros((n, d), x.dtype).at[token].add(out * w[:, None])
