"""Decoder layers stored stacked, sliced one module per layer for the unrolled samplers.

:func:`~artifex.generative_models.inference.sampling.generate`, the continuous-batching and
the multi-turn decoders run a model's layers one by one; for a model whose layers are stored
stacked (``CausalLM.stack_layers()``) and not scanned, ``_per_layer_split`` slices them once
per call with one small compiled program (``_layer_slice``), so the samplers compile the same
program as for per-layer storage.

Moved out of :mod:`~artifex.generative_models.inference.sampling` unchanged; it still imports
these names, so they stay importable from there.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.utils.compile_options import jit


def _per_layer_split(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split(model)``, with decoder layers stored stacked sliced one module per layer.

    For the unrolled samplers (:func:`~artifex.generative_models.inference.sampling.generate`,
    the multi-turn rollout): a model whose layers are stored stacked
    (``CausalLM.stack_layers()``) and not scanned runs its layers one by one, so the sampler
    needs them sliced. They are sliced here, one layer per call of one small
    compiled program (a dynamic index into each stack), and the sampler then compiles the same
    program as for per-layer storage (slicing inside the sampler's program, or all layers in one
    program of its own, compiles longer; ``docs/benchmarks.md``). The model itself is left as
    it is; the slices are copies, made once per call.

    Args:
        model: The model to sample from.

    Returns:
        ``(graphdef, state)`` to merge inside the sampler's program.
    """
    graphdef, state = nnx.split(model)
    if not _runs_stacked_layers_unrolled(model):
        return graphdef, state
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    key = (graphdef, tuple((np.shape(x), jnp.result_type(x)) for _, x in leaves))
    plan = _PER_LAYER_PLANS.get(key)
    if plan is None:
        plan = _per_layer_plan(graphdef, state, [path for path, _ in leaves])
        if len(_PER_LAYER_PLANS) >= 16:  # a few model shapes per process at most
            _PER_LAYER_PLANS.clear()
        _PER_LAYER_PLANS[key] = plan
    per_layer_graphdef, treedef, sources, stacked_at, num_layers = plan
    stacks = tuple(leaves[j][1] for j in stacked_at)
    layers = [_layer_slice(stacks, np.int32(i)) for i in range(num_layers)]
    layers = [tuple(map(_sharded_like_stack, stacks, layer)) for layer in layers]
    out = [leaves[j][1] if layer is None else layers[layer][j] for layer, j in sources]
    return per_layer_graphdef, jax.tree_util.tree_unflatten(treedef, out)


def per_layer_model(model: nnx.Module) -> nnx.Module:
    """``model``, or for stacked, unrolled layers the same model with one module per layer.

    The layers are sliced once (:func:`_per_layer_split`); the other arrays are shared, not
    copied. For callers that run the samplers several times on unchanged weights (the
    multi-turn rollout calls them twice per turn), so that each call does not slice again.
    """
    return nnx.merge(*_per_layer_split(model)) if _runs_stacked_layers_unrolled(model) else model


def _runs_stacked_layers_unrolled(model: nnx.Module) -> bool:
    """Layers stored stacked (``CausalLM.stack_layers()``) and run one by one (not scanned)."""
    stacked = bool(getattr(model, "layers_stacked", False))
    return stacked and not getattr(model, "scan_layers", False)


def _sharded_like_stack(stack: jax.Array, piece: jax.Array) -> jax.Array:
    """``piece``, one layer of ``stack``, with the stack's partition spec less its layer axis.

    The slicing program hands back an equivalent sharding under another spec (``P()`` for a
    replicated vector, where a per-layer model's weight has ``P(None,)``); relabelled, the slices
    match a per-layer model's weights and the sampler reuses its program. Where the spec is
    only relabelled, ``device_put`` moves no data.
    """
    sharding = getattr(stack, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return piece
    spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:])
    want = jax.sharding.NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
    return piece if piece.sharding == want else jax.device_put(piece, want)


# (graphdef, leaf shapes and dtypes) -> (per-layer graphdef, its state's treedef, where each of
# its leaves comes from: (None, leaf index) or (layer, stack index), the stacked leaves, number
# of layers)
_PER_LAYER_PLANS: dict[Any, tuple[Any, ...]] = {}


def _per_layer_plan(graphdef: nnx.GraphDef, state: nnx.State, paths: list[Any]) -> tuple:
    """How the per-layer state is assembled from the stacked one (shapes only, traced once)."""
    abstract = nnx.eval_shape(lambda s: nnx.merge(graphdef, s).unstack_layers(), state)
    per_layer_graphdef, abstract_state = nnx.split(abstract)
    out, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    index = {path: j for j, path in enumerate(paths)}
    stacked_at: list[int] = []  # leaf indices of the stacked layer weights, in order of use
    sources = []
    layer_key = jax.tree_util.DictKey("layers")
    num_layers = 0
    for path, _ in out:
        index_key = path[1] if len(path) > 2 and path[0] == layer_key else None
        if isinstance(index_key, jax.tree_util.DictKey) and isinstance(index_key.key, int):
            source = index[(path[0], *path[2:])]  # the stacked weight this slice comes from
            if source not in stacked_at:
                stacked_at.append(source)
            sources.append((index_key.key, stacked_at.index(source)))
            num_layers = max(num_layers, index_key.key + 1)
        else:
            sources.append((None, index[path]))
    return per_layer_graphdef, treedef, tuple(sources), tuple(stacked_at), num_layers


@jit
def _layer_slice(stacks: tuple[jax.Array, ...], layer: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) for x in stacks)
