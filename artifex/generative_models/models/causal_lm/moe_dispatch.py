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

Expert LoRA adapters (:class:`ExpertDelta`, one per adapted projection) add
``s (u A_e) B_e`` to expert ``e``'s projection of ``u`` in both paths, before the activation
for gate and up: a batched product over the experts in the dense path, ragged products with the
same groups in the ragged one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from artifex.generative_models.models.causal_lm._products import f32_products

__all__ = [
    "DENSE_EXPERTS_MAX_BYTES",
    "EXPERT_PROJECTIONS",
    "ExpertDelta",
    "delta_specs",
    "dispatch_experts",
]

#: The expert projections an :class:`ExpertDelta` can adapt.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertDelta:
    """A per-expert low-rank update of one stacked expert projection: ``s (u A_e) B_e``.

    Attributes:
        a: ``(E, in, r)``, each expert's ``A``.
        b: ``(E, r, out)``, each expert's ``B``.
        scale: ``s``, ``alpha / r`` (static).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm.moe_dispatch import ExpertDelta
        >>> delta = ExpertDelta(a=jnp.ones((2, 4, 1)), b=jnp.ones((2, 1, 3)), scale=0.5)
        >>> delta.apply("nd,edr->enr", jnp.ones((5, 4)), jnp.float32).shape  # (E, N, out)
        (2, 5, 3)
    """

    a: jax.Array
    b: jax.Array
    scale: float = dataclasses.field(metadata={"static": True})

    def apply(self, spec: str, u: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """``s (u A_e) B_e`` for every expert, ``u`` contracted with ``A`` by ``spec``.

        The products run in the adapter's dtype (``u`` is cast to it), the result is cast to
        ``dtype``.

        Args:
            spec: The einsum of ``u`` and ``A`` giving ``(E, N, r)``: ``"nd,edr->enr"`` for
                tokens shared by all experts, ``"eni,eir->enr"`` for each expert's own rows.
            u: The projection's input.
            dtype: The dtype of the result.

        Returns:
            ``(E, N, out)``.
        """
        a = self.a
        f32 = jnp.float32 if f32_products(a.dtype) or a.dtype == jnp.float32 else None
        z = jnp.einsum(spec, u.astype(a.dtype), a, preferred_element_type=f32).astype(a.dtype)
        z = z * jnp.asarray(self.scale, a.dtype)
        out = jnp.einsum("enr,ero->eno", z, self.b, preferred_element_type=f32)
        return out.astype(dtype)

    def apply_grouped(self, rows: jax.Array, sizes: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """``s (u A_e) B_e`` of rows sorted into the experts' groups (``ragged_dot``).

        Args:
            rows: ``(M, in)``, the first ``sizes[0]`` rows expert 0's, and so on (rows after
                the groups give zeros).
            sizes: ``(E,)`` int32 group sizes.
            dtype: The dtype of the result.

        Returns:
            ``(M, out)``.
        """
        z = _grouped(rows.astype(self.a.dtype), self.a, sizes)
        z = z * jnp.asarray(self.scale, z.dtype)
        return _grouped(z, self.b, sizes).astype(dtype)


def delta_specs(
    deltas: Mapping[str, ExpertDelta], expert_axis: str, tensor: str | None
) -> dict[str, ExpertDelta]:
    """``shard_map`` specs of expert adapters laid out like their experts' weights.

    Gate and up are split by columns over ``tensor`` (``B`` by its output), down by rows
    (``A`` by its input); every array is split over ``expert_axis`` by expert.

    Args:
        deltas: The adapters, by projection name.
        expert_axis: The mesh axis of the experts.
        tensor: The tensor-parallel mesh axis, or None.

    Returns:
        The same structure with ``PartitionSpec`` leaves.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm.moe_dispatch import (
        ...     ExpertDelta, delta_specs)
        >>> d = ExpertDelta(a=jnp.ones((2, 4, 1)), b=jnp.ones((2, 1, 3)), scale=1.0)
        >>> spec = delta_specs({"down_proj": d}, "expert", "tensor")["down_proj"]
        >>> spec.a, spec.b
        (P('expert', 'tensor', None), P('expert', None, None))
    """
    out = {}
    for name, delta in deltas.items():
        if name == "down_proj":
            a, b = PartitionSpec(expert_axis, tensor, None), PartitionSpec(expert_axis, None, None)
        else:
            a, b = PartitionSpec(expert_axis, None, None), PartitionSpec(expert_axis, None, tensor)
        out[name] = dataclasses.replace(delta, a=a, b=b)
    return out


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
    deltas: Mapping[str, ExpertDelta] | None = None,
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

    deltas = deltas or {}
    gate_out = product("nd,edi->eni", x, gate)
    up_out = product("nd,edi->eni", x, up)
    if "gate_proj" in deltas:
        gate_out = gate_out + deltas["gate_proj"].apply("nd,edr->enr", x, x.dtype)
    if "up_proj" in deltas:
        up_out = up_out + deltas["up_proj"].apply("nd,edr->enr", x, x.dtype)
    hidden = _activation(activation, gate_out) * up_out
    out = product("eni,eid->end", hidden, down)
    if "down_proj" in deltas:
        out = out + deltas["down_proj"].apply("eni,eir->enr", hidden, x.dtype)
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
    deltas: Mapping[str, ExpertDelta] | None = None,
) -> jax.Array:
    """Dropless expert MLPs of ``x`` (N, D) for the experts ``[first, first + E_local)``.

    ``y_n = sum_j weights[n, j] * down_e(act(x_n gate_e) * x_n up_e)`` over the assignments
    ``e = experts[n, j] - first`` that are local; with ``deltas``, each adapted projection
    ``u W_e`` is ``u W_e + s (u A_e) B_e``.

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
        deltas: Optional expert adapters by projection name (``"gate_proj"``, ``"up_proj"``,
            ``"down_proj"``), each of the local experts.

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
        return _dense_dispatch(x, experts, weights, gate, up, down, activation, first, deltas)
    return _ragged_dispatch(x, experts, weights, gate, up, down, activation, first, deltas)


def _ragged_dispatch(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    activation: str,
    first: jax.Array | int = 0,
    deltas: Mapping[str, ExpertDelta] | None = None,
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
    deltas = deltas or {}
    gate_out, up_out = _grouped(rows, gate, sizes), _grouped(rows, up, sizes)
    if "gate_proj" in deltas:
        gate_out = gate_out + deltas["gate_proj"].apply_grouped(rows, sizes, x.dtype)
    if "up_proj" in deltas:
        up_out = up_out + deltas["up_proj"].apply_grouped(rows, sizes, x.dtype)
    hidden = _activation(activation, gate_out) * up_out
    out = _grouped(hidden, down, sizes)
    if "down_proj" in deltas:
        out = out + deltas["down_proj"].apply_grouped(hidden, sizes, x.dtype)
    w = jnp.where(local, weights.reshape(-1), 0.0)[order].astype(x.dtype)
    return jnp.zeros((n, d), x.dtype).at[token].add(out * w[:, None])
