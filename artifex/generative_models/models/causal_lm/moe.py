r"""Sparse mixture-of-experts MLP (Qwen3-MoE): top-k routing, dropless experts, expert parallelism.

A router ``z = x W_r`` (``W_r`` (D, E)) scores the ``E`` experts of a layer for each token;
``p = softmax(z)`` in float32; the token goes to the ``k`` experts of largest ``p`` (its routed
experts ``S``) with weights ``g_e = p_e`` or, with ``norm_topk_prob``,
``g_e = p_e / \sum_{j \in S} p_j``; the layer's output is

.. math::

    y = \sum_{e \in S} g_e\, \mathrm{down}_e\big(\mathrm{act}(x W^g_e) \odot x W^u_e\big),

transformers' ``Qwen3MoeSparseMoeBlock``. The experts are **dropless**: every token is computed
by all of its ``k`` experts, whatever the load (no capacity, nothing is dropped). The ``N k``
(token, expert) assignments are sorted by expert and the experts run as ragged batches
(``jax.lax.ragged_dot``, one group of rows per expert); on the CPU they run densely, every
expert on every token weighted by its routing weight (``k`` times less work than XLA:CPU's
ragged product; :mod:`~artifex.generative_models.models.causal_lm.moe_dispatch`).

**Expert parallelism.** When the expert weights live on a mesh with an ``"expert"`` axis of size
``n > 1`` (``make_mesh(expert=n)`` and the rules ``MOE_RULES`` of
``artifex.generative_models.training.sharding``), each device holds ``E / n`` experts and the
experts run under ``jax.shard_map``: the tokens of the ``n`` devices of an expert group are
all-gathered, each device computes the assignments to its own experts, and a reduce-scatter
sums the partial outputs back onto each device's tokens (Megatron-LM's all-gather token
dispatcher). With a ``"tensor"`` axis each expert is also split Megatron-style (gate/up by
columns, down by rows, one all-reduce); FSDP-sharded expert weights are all-gathered where they
are used. The values are those of one device, up to the order of float additions.

**Routing traces and replay.** Each layer reports a :class:`RouterTrace`: the experts every
token was sent to, whether the router's own choice agrees with them, and the load statistics of
the load-balancing loss (:func:`load_balancing_loss`). Passing recorded experts back
(``replay``) makes the layer use them instead of its own top-k, with weights recomputed from
the current router (so the router still gets gradients): rollout routing replay (R3).

References:
    Shazeer et al., 2017, "Outrageously Large Neural Networks: The Sparsely-Gated
    Mixture-of-Experts Layer", arXiv:1701.06538. Fedus et al., 2021, "Switch Transformers",
    arXiv:2101.03961 (the load-balancing loss). Gale et al., 2022, "MegaBlocks: Efficient
    Sparse Training with Mixture-of-Experts", arXiv:2211.15841 (dropless experts). Shoeybi et
    al., 2019, arXiv:1909.08053 (Megatron-LM). Ma et al., 2025, "Stabilizing MoE Reinforcement
    Learning by Aligning Training and Inference Routers", arXiv:2510.11370 (rollout routing
    replay).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from artifex.generative_models.models.causal_lm.config import CausalLMConfig
from artifex.generative_models.models.causal_lm.modules import (
    Attention,
    DecoderLayer,
    Linear,
    RMSNorm,
    _normal,
)
from artifex.generative_models.models.causal_lm.moe_dispatch import (
    ExpertDelta,
    delta_specs,
    dispatch_experts,
)

__all__ = [
    "EXPERT_AXIS",
    "Experts",
    "MoEDecoderLayer",
    "RouterTrace",
    "SparseMoeBlock",
    "expert_mlp",
    "load_balancing_loss",
    "route_tokens",
    "routing_agreement",
]

#: Mesh axis the experts are sharded over.
EXPERT_AXIS = "expert"
#: Mesh axes a batch's rows may be split over, in the order tried (see `_token_axes`).
_TOKEN_AXES = ("data", "fsdp", EXPERT_AXIS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterTrace:
    """What the router of each sparse layer did, for a batch of tokens.

    Leading axes ``...`` are ``(B, T)`` for one layer and ``(L, B, T)`` for a model's ``L``
    layers stacked (as ``CausalLM.hidden_states(..., routing=True)`` returns it).

    Attributes:
        experts: ``(..., k)`` int32, the experts each token was computed by (replayed or the
            router's own top-k, largest probability first for the latter).
        agreement: ``(...)`` float32, 1 where the router's own top-k is the same set of
            experts as ``experts`` (always 1 without replay).
        load: ``(L?, E)`` float32, assignments of valid tokens to each expert (each valid token
            counts once for each of its ``k`` experts).
        importance: ``(L?, E)`` float32, the router probabilities of valid tokens summed per
            expert.
        tokens: ``(L?,)`` float32, the number of valid tokens.

    Examples:
        >>> import dataclasses
        >>> from artifex.generative_models.models.causal_lm.moe import RouterTrace
        >>> [f.name for f in dataclasses.fields(RouterTrace)]
        ['experts', 'agreement', 'load', 'importance', 'tokens']
    """

    experts: jax.Array
    agreement: jax.Array
    load: jax.Array
    importance: jax.Array
    tokens: jax.Array


def route_tokens(
    logits: jax.Array,
    top_k: int,
    *,
    norm_topk_prob: bool = False,
    replay: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Top-k routing of tokens from their router logits, or the replay of recorded experts.

    ``p = softmax(logits)`` in float32; the routed experts are the ``k`` largest ``p`` (ties to
    the lower index), or ``replay`` where its row holds ``k`` expert ids (rows with a negative
    entry keep the router's own choice); their weights are ``p_e``, renormalized over the
    routed experts with ``norm_topk_prob``.

    Args:
        logits: ``(..., E)`` router logits.
        top_k: ``k``, experts per token.
        norm_topk_prob: Renormalize the weights to sum to 1.
        replay: Optional ``(..., k)`` int expert ids to route to instead (-1 where not known).

    Returns:
        ``(experts (..., k) int32, weights (..., k) float32, probs (..., E) float32,
        agreement (...) float32)``; ``agreement`` is 1 where the router's own top-k is the set
        ``experts``.

    Raises:
        ValueError: If ``replay`` does not have shape ``(..., k)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm.moe import route_tokens
        >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
        >>> experts, weights, _, _ = route_tokens(logits, 2, norm_topk_prob=True)
        >>> experts.tolist(), [round(w, 3) for w in weights[0].tolist()]
        ([[1, 2]], [0.667, 0.333])
        >>> experts, weights, _, agree = route_tokens(logits, 2, replay=jnp.array([[0, 1]]))
        >>> experts.tolist(), [round(w, 3) for w in weights[0].tolist()], agree.tolist()
        ([[0, 1]], [0.1, 0.6], [0.0])
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    _, own = jax.lax.top_k(probs, top_k)
    own = own.astype(jnp.int32)
    if replay is None:
        experts = own
        agreement = jnp.ones(own.shape[:-1], jnp.float32)
    else:
        if replay.shape != own.shape:
            msg = f"replay must have shape {own.shape} (..., k), got {replay.shape}"
            raise ValueError(msg)
        replay = replay.astype(jnp.int32)
        known = jnp.all(replay >= 0, axis=-1, keepdims=True)
        experts = jnp.where(known, replay, own)
        same = jnp.sort(experts, axis=-1) == jnp.sort(own, axis=-1)
        agreement = jnp.all(same, axis=-1).astype(jnp.float32)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights, probs, agreement


def load_balancing_loss(trace: RouterTrace) -> jax.Array:
    r"""The load-balancing loss of a model's router traces (Switch Transformer; transformers').

    With ``f_e`` the share of the valid tokens' assignments that went to expert ``e`` and
    ``P_e`` the mean router probability of ``e``, both over the tokens of all layers,

    .. math::

        \mathcal{L}_{aux} = E \sum_e f_e P_e, \quad
        f_e = \frac{\sum_l \mathrm{load}_{l,e}}{\sum_l N_l}, \quad
        P_e = \frac{\sum_l \mathrm{importance}_{l,e}}{\sum_l N_l},

    transformers' ``load_balancing_loss_func`` with an attention mask (``f`` sums to ``k``, so
    a uniform router gives ``k``). It is differentiable through ``P`` (the router).

    Args:
        trace: A :class:`RouterTrace` of one layer or of stacked layers.

    Returns:
        The float32 scalar loss (0 when there is no valid token).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm.moe import (
        ...     RouterTrace, load_balancing_loss)
        >>> uniform = RouterTrace(experts=jnp.zeros((1, 4, 2), jnp.int32),
        ...     agreement=jnp.ones((1, 4)), load=jnp.full((4,), 2.0),
        ...     importance=jnp.full((4,), 1.0), tokens=jnp.array(4.0))
        >>> float(load_balancing_loss(uniform))  # 4 tokens, 2 of 4 experts each, even load
        2.0
    """
    tokens = jnp.maximum(jnp.sum(trace.tokens), 1.0)
    load = jnp.sum(trace.load.reshape(-1, trace.load.shape[-1]), axis=0) / tokens
    importance = jnp.sum(trace.importance.reshape(-1, trace.importance.shape[-1]), axis=0)
    num_experts = trace.load.shape[-1]
    return num_experts * jnp.sum(jax.lax.stop_gradient(load) * importance / tokens)


def routing_agreement(trace: RouterTrace, mask: jax.Array | None = None) -> jax.Array:
    """The fraction of (token, layer) pairs whose router chose the experts the trace used.

    Under routing replay this is how often the current router agrees with the rollout's
    choice; without replay it is 1.

    Args:
        trace: A :class:`RouterTrace` with ``agreement`` of shape ``(L, B, T)`` or ``(B, T)``.
        mask: Optional ``(B, T)`` weights of the tokens that count (1 on completion tokens).

    Returns:
        A float32 scalar in [0, 1] (1 when no token counts).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm.moe import (
        ...     RouterTrace, routing_agreement)
        >>> trace = RouterTrace(experts=jnp.zeros((2, 1, 2, 1), jnp.int32),
        ...     agreement=jnp.array([[[1.0, 0.0]], [[1.0, 1.0]]]), load=jnp.zeros((2, 3)),
        ...     importance=jnp.zeros((2, 3)), tokens=jnp.zeros((2,)))
        >>> float(routing_agreement(trace))
        0.75
        >>> float(routing_agreement(trace, mask=jnp.array([[1, 0]])))
        1.0
    """
    agree = trace.agreement.astype(jnp.float32)
    weights = jnp.ones(agree.shape[-2:], jnp.float32) if mask is None else mask
    weights = jnp.broadcast_to(jnp.asarray(weights, jnp.float32), agree.shape)
    total = jnp.sum(weights)
    return jnp.where(total > 0, jnp.sum(agree * weights) / jnp.maximum(total, 1e-30), 1.0)


def _token_axes(sizes: dict[str, int], rows: int) -> tuple[str, ...]:
    """The mesh axes (of ``_TOKEN_AXES``, in order) the ``rows`` tokens are split over."""
    axes: list[str] = []
    count = 1
    for name in _TOKEN_AXES:
        size = sizes.get(name, 1)
        if size > 1 and rows % (count * size) == 0:
            axes.append(name)
            count *= size
    return tuple(axes)


def _expert_mesh(w: jax.Array) -> Any:
    """The (abstract) mesh of ``w`` when it has an ``"expert"`` axis of size > 1, else None."""
    try:
        mesh = jax.typeof(w).sharding.mesh
    except AttributeError:  # no sharding in the type
        return None
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return None
    size = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[EXPERT_AXIS]
    return mesh if size > 1 and w.shape[0] % size == 0 else None


def expert_mlp(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    activation: str = "silu",
    deltas: dict[str, ExpertDelta] | None = None,
) -> jax.Array:
    """The weighted sum of each token's routed experts, dropless, sharded over experts if placed so.

    ``y_n = sum_j weights[n, j] * down_e(act(x_n gate_e) * x_n up_e)`` with ``e =
    experts[n, j]``. On one device (or a mesh without an ``"expert"`` axis) the assignments are
    sorted by expert and run as ragged batches. When ``gate`` lives on a mesh whose
    ``"expert"`` axis has size ``n > 1`` dividing ``E``, the experts run under
    ``jax.shard_map``: tokens split over the batch axes (``"data"``, ``"fsdp"``,
    ``"expert"``, those that divide the rows) are all-gathered over ``"expert"``, each device
    computes its ``E / n`` experts' assignments and a reduce-scatter returns the sums (see the
    module docstring); a ``"tensor"`` axis dividing ``I`` splits every expert by columns
    (gate, up) and rows (down).

    Args:
        x: Tokens ``(..., D)``.
        experts: ``(..., k)`` int expert ids.
        weights: ``(..., k)`` routing weights.
        gate: ``(E, D, I)`` gate kernels.
        up: ``(E, D, I)`` up kernels.
        down: ``(E, I, D)`` down kernels.
        activation: ``"silu"`` or ``"gelu_pytorch_tanh"``.
        deltas: Optional per-expert LoRA updates by projection name (``"gate_proj"``,
            ``"up_proj"``, ``"down_proj"``), split over ``"expert"`` like the weights.

    Returns:
        ``(..., D)`` in the dtype of ``x``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm.moe import expert_mlp
        >>> kx, kg, ku, kd = jax.random.split(jax.random.key(0), 4)
        >>> x = jax.random.normal(kx, (3, 4))
        >>> gate, up = jax.random.normal(kg, (2, 4, 5)), jax.random.normal(ku, (2, 4, 5))
        >>> down = jax.random.normal(kd, (2, 5, 4))
        >>> experts, weights = jnp.array([[1], [0], [1]]), jnp.ones((3, 1))
        >>> y = expert_mlp(x, experts, weights, gate, up, down)
        >>> one = (jax.nn.silu(x[0] @ gate[1]) * (x[0] @ up[1])) @ down[1]  # token 0, expert 1
        >>> bool(jnp.allclose(y[0], one, atol=1e-5))
        True
    """
    lead, d = x.shape[:-1], x.shape[-1]
    k = experts.shape[-1]
    x2 = x.reshape(-1, d)
    e2, w2 = experts.reshape(-1, k), weights.reshape(-1, k)
    mesh = _expert_mesh(gate)
    deltas = deltas or {}
    if mesh is None:
        y = dispatch_experts(x2, e2, w2, gate, up, down, activation, 0, deltas)
        return y.reshape(*lead, d)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    rows = x2.shape[0]
    token_axes = _token_axes(sizes, rows)
    split = sizes.get("tensor", 1) > 1 and gate.shape[-1] % sizes["tensor"] == 0
    tensor = "tensor" if split else None
    batch = PartitionSpec(token_axes or None, None)
    column = PartitionSpec(EXPERT_AXIS, None, tensor)
    row = PartitionSpec(EXPERT_AXIS, tensor, None)
    gathered = EXPERT_AXIS in token_axes

    def local(x, experts, weights, gate, up, down, deltas):
        if gathered:
            x = jax.lax.all_gather(x, EXPERT_AXIS, axis=0, tiled=True)
            experts = jax.lax.all_gather(experts, EXPERT_AXIS, axis=0, tiled=True)
            weights = jax.lax.all_gather(weights, EXPERT_AXIS, axis=0, tiled=True)
        first = jax.lax.axis_index(EXPERT_AXIS) * gate.shape[0]
        out = dispatch_experts(x, experts, weights, gate, up, down, activation, first, deltas)
        if tensor is not None:
            out = jax.lax.psum(out, tensor)
        if gathered:
            return jax.lax.psum_scatter(out, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.psum(out, EXPERT_AXIS)

    adapters = delta_specs(deltas, EXPERT_AXIS, tensor)  # split like the weights they adapt
    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(batch, batch, batch, column, column, row, adapters),
        out_specs=batch,
        check_vma=False,
    )
    return run(x2, e2, w2, gate, up, down, deltas).reshape(*lead, d)


class Experts(nnx.Module):
    """The ``E`` SwiGLU experts of a sparse layer, stored stacked.

    ``gate_proj``, ``up_proj`` ``(E, D, I)`` and ``down_proj`` ``(E, I, D)`` (each expert's
    kernel as ``Linear`` stores it, ``(in, out)``), initialised N(0, std^2). ``lora``, set by
    ``apply_lora``, holds per-expert adapters (anything with a ``deltas()`` method giving
    :class:`~artifex.generative_models.models.causal_lm.moe_dispatch.ExpertDelta` by projection).

    Args:
        config: A Qwen3-MoE configuration.
        dtype: Parameter and compute dtype.
        rngs: Random streams (``params``).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLMConfig
        >>> from artifex.generative_models.models.causal_lm.moe import Experts
        >>> cfg = CausalLMConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8,
        ...     intermediate_size=16, num_layers=1, num_heads=2, qk_norm=True, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=6)
        >>> Experts(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)).down_proj.shape
        (4, 6, 8)
    """

    def __init__(self, config: CausalLMConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        e, d, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        std = config.initializer_range
        self.gate_proj = nnx.Param(_normal(rngs, (e, d, i), std, dtype))
        self.up_proj = nnx.Param(_normal(rngs, (e, d, i), std, dtype))
        self.down_proj = nnx.Param(_normal(rngs, (e, i, d), std, dtype))
        self.activation = config.hidden_act
        self.lora: Any = nnx.data(None)

    def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
        """Applies each token's experts (see :func:`expert_mlp`).

        Args:
            x: Tokens ``(..., D)``.
            experts: ``(..., k)`` expert ids.
            weights: ``(..., k)`` routing weights.

        Returns:
            ``(..., D)``.
        """
        return expert_mlp(
            x,
            experts,
            weights,
            self.gate_proj[...],
            self.up_proj[...],
            self.down_proj[...],
            activation=self.activation,
            deltas=None if self.lora is None else self.lora.deltas(),
        )


class SparseMoeBlock(nnx.Module):
    """Router and experts of a Qwen3-MoE layer (transformers' ``Qwen3MoeSparseMoeBlock``).

    Args:
        config: A Qwen3-MoE configuration.
        dtype: Parameter and compute dtype.
        rngs: Random streams (``params``).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLMConfig
        >>> from artifex.generative_models.models.causal_lm.moe import SparseMoeBlock
        >>> cfg = CausalLMConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8,
        ...     intermediate_size=16, num_layers=1, num_heads=2, qk_norm=True, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=6)
        >>> block = SparseMoeBlock(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> y, trace = block(jnp.ones((1, 3, 8)))
        >>> y.shape, trace.experts.shape, trace.load.shape
        ((1, 3, 8), (1, 3, 2), (4,))
    """

    def __init__(self, config: CausalLMConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, e = config.hidden_size, config.num_experts
        self.gate = Linear(
            d, e, use_bias=False, std=config.initializer_range, dtype=dtype, rngs=rngs
        )
        self.experts = Experts(config, dtype=dtype, rngs=rngs)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def __call__(
        self,
        x: jax.Array,
        *,
        replay: jax.Array | None = None,
        valid: jax.Array | None = None,
    ) -> tuple[jax.Array, RouterTrace]:
        """Routes and computes the tokens.

        Args:
            x: Normalised hidden states ``(B, T, D)``.
            replay: Optional ``(B, T, k)`` experts to use instead of the router's top-k (-1
                where not known).
            valid: Optional ``(B, T)`` bool, the tokens that count in the load statistics
                (default: all).

        Returns:
            ``(y (B, T, D), trace)`` with the layer's :class:`RouterTrace`.
        """
        logits = self.gate(x)
        experts, weights, probs, agreement = route_tokens(
            logits, self.top_k, norm_topk_prob=self.norm_topk_prob, replay=replay
        )
        y = self.experts(x, experts, weights.astype(x.dtype))
        v = jnp.ones(x.shape[:-1], jnp.float32) if valid is None else valid.astype(jnp.float32)
        num = probs.shape[-1]
        load = jnp.einsum(
            "...k,...ke->e", jnp.broadcast_to(v[..., None], experts.shape),
            jax.nn.one_hot(experts, num, dtype=jnp.float32),
        )  # fmt: skip
        trace = RouterTrace(
            experts=experts,
            agreement=agreement,
            load=load,
            importance=jnp.einsum("...,...e->e", v, probs),
            tokens=jnp.sum(v),
        )
        return y, trace


class MoEDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is a :class:`SparseMoeBlock` (Qwen3-MoE).

    ``h = x + attn(attn_norm(x)); y = h + moe(mlp_norm(h))``. Called like
    :class:`~artifex.generative_models.models.causal_lm.modules.DecoderLayer`, with an optional
    ``routing = (replay, valid)``, it returns ``(y, kv, trace)``.

    Args:
        config: A Qwen3-MoE configuration.
        dtype: Parameter and compute dtype.
        rngs: Random streams (``params``).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLMConfig
        >>> from artifex.generative_models.models.causal_lm.moe import MoEDecoderLayer
        >>> cfg = CausalLMConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8,
        ...     intermediate_size=16, num_layers=1, num_heads=2, qk_norm=True, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=6)
        >>> type(MoEDecoderLayer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)).mlp).__name__
        'SparseMoeBlock'
    """

    def __init__(self, config: CausalLMConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        if not config.is_moe:
            msg = f"MoEDecoderLayer needs a mixture-of-experts config, got {config.model_type!r}"
            raise ValueError(msg)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.attn_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.attn = Attention(config, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = SparseMoeBlock(config, dtype=dtype, rngs=rngs)
        self.post_attn_norm = None
        self.post_mlp_norm = None

    def __call__(  # type: ignore[override]
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
        routing: tuple[jax.Array | None, jax.Array | None] | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, RouterTrace]:
        """Applies the layer.

        Args:
            x: Hidden states (B, T, D).
            cos: RoPE cosines (B, T, H/2).
            sin: RoPE sines (B, T, H/2).
            mask: Attention mask, as for ``DecoderLayer``.
            kv: Optional cache ``(keys, values)`` of this layer.
            index: First slot to write (with ``kv``).
            routing: Optional ``(replay (B, T, k) or None, valid (B, T) or None)``.

        Returns:
            ``(y, kv, trace)``.
        """
        replay, valid = (None, None) if routing is None else routing
        attn_out, kv = self.attn(self.attn_norm(x), cos, sin, mask, kv, index)
        h = x + attn_out
        out, trace = self.mlp(self.mlp_norm(h), replay=replay, valid=valid)
        return h + out, kv, trace
