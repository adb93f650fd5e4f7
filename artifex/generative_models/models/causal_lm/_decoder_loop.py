"""How `CausalLM` runs its decoder layers: the layers' inputs and the loop over them.

`_check_cache` checks the KV cache a pass gets. `_DecoderLoop`, a base of `CausalLM`, builds
what every layer takes (the routing inputs of mixture-of-experts layers; the RoPE tables and
masks, those of sliding-window layers included) and runs the layers: as one `jax.lax.scan`
over their stacked weights (`_scan_layers`), unrolled with every n-th layer rematerialized in
the backward pass (`_remat_layers`), or unrolled, each layer through one jitted layer function
traced once.

Moved out of :mod:`~artifex.generative_models.models.causal_lm.model` unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.models.causal_lm.attention_ops import SharedPrefixMask
from artifex.generative_models.models.causal_lm.cache import KVCache
from artifex.generative_models.models.causal_lm.config import CausalLMConfig
from artifex.generative_models.models.causal_lm.layer_storage import LayerStack
from artifex.generative_models.models.causal_lm.moe import RouterTrace
from artifex.generative_models.models.causal_lm.positions import _inv_freq, _rope_tables

KVPairs = tuple[tuple[jax.Array, ...] | jax.Array, tuple[jax.Array, ...] | jax.Array]


def _check_cache(cache: KVCache, cfg: CausalLMConfig, batch: int) -> None:
    """Raises ValueError unless ``cache`` fits this model and a batch of ``batch`` rows."""
    values_shape = (batch, cfg.num_kv_heads, cache.max_length, cfg.head_dim)
    keys_shape = (batch, cfg.num_kv_heads, cfg.head_dim, cache.max_length)  # slots last
    shapes = {"keys": keys_shape, "values": values_shape}
    if cache.stacked:
        for name, x in (("keys", cache.keys), ("values", cache.values)):
            expected = (cfg.num_layers, *shapes[name])
            if not isinstance(x, jax.Array | np.ndarray) or x.shape != expected:
                got = getattr(x, "shape", type(x).__name__)
                msg = f"cache.{name} (stacked) must have shape {expected}, got {got}"
                raise ValueError(msg)
        return
    if not isinstance(cache.values, tuple):
        msg = "cache.keys and cache.values must both be stacked arrays or both tuples"
        raise ValueError(msg)
    if len(cache.keys) != cfg.num_layers or len(cache.values) != cfg.num_layers:
        msg = (
            f"cache.keys and cache.values must hold one array per layer "
            f"({cfg.num_layers}), got {len(cache.keys)} and {len(cache.values)}"
        )
        raise ValueError(msg)
    for name in ("keys", "values"):
        for x in getattr(cache, name):
            if getattr(x, "shape", None) != shapes[name]:
                got = getattr(x, "shape", type(x).__name__)
                msg = f"cache.{name} must be {shapes[name]} per layer, got {got}"
                raise ValueError(msg)


class _DecoderLoop:
    """`CausalLM`'s layer loop and the inputs of its layers (a base class of `CausalLM`).

    The methods read the model's `config`, `dtype` and layers (`layer_stack()`,
    `_layer_states()`).
    """

    def _routing_input(
        self, routing: jax.Array | bool | None, valid: jax.Array
    ) -> tuple[jax.Array | None, jax.Array] | None:
        """The layers' `(replay, valid)` for a mixture-of-experts model (None for dense ones)."""
        cfg = self.config
        if not cfg.is_moe:
            if routing is not None and routing is not False:
                msg = (
                    f"routing: only mixture-of-experts models route tokens (model_type "
                    f"'qwen3_moe'); this model is {cfg.model_type!r}"
                )
                raise ValueError(msg)
            return None
        if routing is None or isinstance(routing, bool):
            return None, valid
        expected = (cfg.num_layers, *valid.shape, cfg.num_experts_per_tok)
        if jnp.shape(routing) != expected:
            msg = (
                f"routing: replayed experts must have shape (L, B, T, k) = {expected}, got "
                f"{jnp.shape(routing)}"
            )
            raise ValueError(msg)
        if not jnp.issubdtype(jnp.result_type(routing), jnp.integer):
            msg = f"routing: replayed experts must be integers, got {jnp.result_type(routing)}"
            raise ValueError(msg)
        return jnp.asarray(routing, jnp.int32), valid

    def _attention_inputs(
        self,
        positions: jax.Array,
        bound: int | None,
        mask: Any,
        query_slots: jax.Array,
        key_slots: jax.Array,
    ) -> tuple[tuple[jax.Array, jax.Array, Any], tuple[jax.Array, jax.Array, Any] | None]:
        """The layers' `(cos, sin, mask)`, and those of the sliding-window layers if they differ.

        A sliding-window layer's mask also requires `query_slot - key_slot < sliding_window`
        (slots: (T,) and (S,), or per row (B, T) and (B, S)); a `SharedPrefixMask` gets the
        window as its `window`. Gemma 3's sliding-window layers take RoPE tables of base
        `rope_local_theta`, unscaled. When every layer is of one kind the first element holds
        that kind's inputs and the second is None; when they mix (Gemma 3), the first holds the
        full-attention layers' inputs and the second the sliding-window layers'.
        """
        cfg = self.config
        inv_freq = _inv_freq(cfg.head_dim, float(cfg.rope_theta), cfg.rope_scaling)
        cos, sin = _rope_tables(positions, inv_freq, self.dtype, bound)
        kinds = set(cfg.sliding_layers)
        if True not in kinds:
            return (cos, sin, mask), None
        if cfg.model_type == "gemma3_text":
            local_freq = _inv_freq(cfg.head_dim, float(cfg.rope_local_theta), None)
            local_cos, local_sin = _rope_tables(positions, local_freq, self.dtype, bound)
        else:
            local_cos, local_sin = cos, sin
        window = cfg.sliding_window
        if isinstance(mask, SharedPrefixMask):
            local_mask = dataclasses.replace(mask, window=jnp.asarray(window, jnp.int32))
            # one structure for both kinds (scanned layers select between them)
            no_window = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
            mask = dataclasses.replace(mask, window=no_window)
        else:
            band = (query_slots[..., :, None] - key_slots[..., None, :]) < window
            local_mask = mask & (band[None] if band.ndim == 2 else band)
        sliding = (local_cos, local_sin, local_mask)
        if kinds == {True}:
            return sliding, None
        return (cos, sin, mask), sliding

    def _run_layers(
        self,
        h: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: Any,
        kv: KVPairs | None,
        index: jax.Array | None,
        remat: bool | int,
        layer_stack: LayerStack | None,
        sliding: tuple[jax.Array, jax.Array, Any] | None = None,
        routing: tuple[jax.Array | None, jax.Array] | None = None,
    ) -> tuple[jax.Array, KVPairs | None, RouterTrace | None]:
        """Runs the decoder layers: scanned, rematerialized or unrolled (see `hidden_states`).

        With `sliding` (see `_attention_inputs`), the layers `config.sliding_layers` marks take
        those `(cos, sin, mask)` instead. Mixture-of-experts layers take `routing` (`(replay
        (L, B, T, k) or None, valid (B, T))`) and their traces are returned stacked (None for
        dense layers).
        """
        flags = None if sliding is None else self.config.sliding_layers
        if layer_stack is None and getattr(self, "scan_layers", False):
            layer_stack = self.layer_stack()
        if layer_stack is not None:
            if remat is not True and remat > 1:
                msg = (
                    f"remat={remat} (one layer in {remat}) needs unrolled layers; scanned "
                    "layers rematerialize all of them or none (remat=True or False)"
                )
                raise ValueError(msg)
            return _scan_layers(
                layer_stack, h, cos, sin, mask, kv, index, remat=bool(remat),
                sliding=sliding, flags=flags, routing=routing,
            )  # fmt: skip
        layers = self._layer_states()
        if remat:
            every = 1 if remat is True else int(remat)
            return _remat_layers(
                layers, h, cos, sin, mask, kv, index, every, sliding, flags, routing
            )
        new_kv, traces = [], []
        for i, (graphdef, state) in enumerate(layers):
            layer_kv = None if kv is None else (kv[0][i], kv[1][i])
            c, s, m = sliding if flags is not None and flags[i] else (cos, sin, mask)
            out = _traced_once_layer_step(
                graphdef, state, h, c, s, m, layer_kv, index, _layer_routing(routing, i)
            )
            h, layer_kv = out[0], out[1]
            new_kv.append(layer_kv)
            traces.append(out[2] if len(out) > 2 else None)
        return h, None if kv is None else _unzip(new_kv), _stack_traces(traces)


def _unzip(pairs: list[tuple[jax.Array, jax.Array]]) -> KVPairs:
    """Per-layer `(keys, values)` pairs as the cache's `(keys per layer, values per layer)`."""
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _layer_routing(
    routing: tuple[jax.Array | None, jax.Array] | None, i: int
) -> tuple[jax.Array | None, jax.Array] | None:
    """Layer `i`'s `(replay, valid)` of the model's `(replay (L, ...) or None, valid)`."""
    if routing is None:
        return None
    replay, valid = routing
    return (None if replay is None else replay[i]), valid


def _stack_traces(traces: list[RouterTrace | None]) -> RouterTrace | None:
    """The layers' router traces stacked on a new axis 0 (None for dense layers)."""
    if not traces or traces[0] is None:
        return None
    return jax.tree.map(lambda *xs: jnp.stack(xs), *traces)


def _scan_layers(
    stack: LayerStack,
    h: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    mask: jax.Array,
    kv: KVPairs | None,
    index: jax.Array | None,
    *,
    remat: bool,
    sliding: tuple[jax.Array, jax.Array, Any] | None = None,
    flags: tuple[bool, ...] | None = None,
    routing: tuple[jax.Array | None, jax.Array] | None = None,
) -> tuple[jax.Array, KVPairs | None, RouterTrace | None]:
    """Runs the decoder layers as one `lax.scan` over the stacked layer states (and caches).

    With `sliding`, layer `i` takes `sliding` for its `(cos, sin, mask)` where `flags[i]`,
    selected inside the scan (one layer body for both kinds). Mixture-of-experts layers take
    their slice of `routing`'s replay and return traces, stacked by the scan.
    """
    graphdef, stacked = stack
    step = functools.partial(_remat_layer_step if remat else _layer_step, graphdef)
    inputs = (cos, sin, mask)
    kinds = None if sliding is None else jnp.asarray(flags, jnp.bool_)
    replay = None if routing is None else routing[0]

    def pick(flag):
        if sliding is None:
            return inputs
        return jax.tree.map(lambda a, b: jnp.where(flag, a, b), sliding, inputs)

    def layer_routing(r):
        return None if routing is None else (r, routing[1])

    if kv is None:

        def body(h, xs):
            state, flag, r = xs
            out = step(state, h, *pick(flag), None, index, layer_routing(r))
            return out[0], (out[2] if len(out) > 2 else None)

        h, traces = jax.lax.scan(body, h, (stacked, kinds, replay))
        return h, None, traces

    def body_kv(h, xs):
        state, layer_keys, layer_values, flag, r = xs
        out = step(state, h, *pick(flag), (layer_keys, layer_values), index, layer_routing(r))
        return out[0], (out[1], out[2] if len(out) > 2 else None)

    keys, values = kv
    if isinstance(keys, tuple):  # per-layer arrays: stacked here, a copy per call
        keys, values = jnp.stack(keys), jnp.stack(values)
    h, ((keys, values), traces) = jax.lax.scan(body_kv, h, (stacked, keys, values, kinds, replay))
    return h, (keys, values), traces


def _layer_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    h: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    mask: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    index: jax.Array | None,
    routing: tuple[jax.Array | None, jax.Array] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None] | tuple[Any, ...]:
    layer = nnx.merge(graphdef, state)
    if routing is None:  # dense layers (MoE layers get at least their valid tokens)
        return layer(h, cos, sin, mask, kv, index)
    return layer(h, cos, sin, mask, kv, index, routing)


# The unrolled layers call one jitted layer function: JAX traces (and differentiates) a layer
# once per distinct structure and shapes and reuses that trace for every layer and every call
# of the same shapes, instead of tracing all of them; XLA inlines the calls, so the compiled
# program is that of the plain unrolled loop. Tracing was about a quarter of the time to
# compile SmolLM2-135M's update (30 layers).
_traced_once_layer_step = jax.jit(_layer_step, static_argnums=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _remat_layer_step(graphdef, state, h, cos, sin, mask, kv, index, routing=None):
    """`_layer_step` that keeps only its inputs and recomputes the layer in the backward pass."""
    return _layer_step(graphdef, state, h, cos, sin, mask, kv, index, routing)


def _remat_layer_fwd(graphdef, state, h, cos, sin, mask, kv, index, routing=None):
    out = _layer_step(graphdef, state, h, cos, sin, mask, kv, index, routing)
    return out, (state, h, cos, sin, mask, kv, index, routing)


def _remat_layer_bwd(graphdef, residuals, cotangent):
    state, h, cos, sin, mask, kv, index, routing = residuals
    # The recomputation must not start before this layer's cotangent exists. Under
    # `jax.checkpoint` (or `nnx.remat`) XLA:CPU schedules each layer's recomputation right after
    # its forward pass (the optimization barrier meant to order it is gone from the optimized
    # program), so every layer's activations stay alive until the backward pass and no memory
    # is saved. A data dependence cannot be reordered: `h - 0 * |dh|`, with `dh` the cotangent
    # of the layer's output (same shape and sharding as `h`; XLA does not fold a float `0 * x`,
    # which is NaN for infinite x). It is exactly `h` where `dh` is finite; where it is not,
    # the gradient is not finite either way.
    h = h - jnp.zeros((), h.dtype) * jnp.abs(cotangent[0])
    _, vjp = jax.vjp(
        functools.partial(_layer_step, graphdef), state, h, cos, sin, mask, kv, index, routing
    )
    return vjp(cotangent)


_remat_layer_step.defvjp(_remat_layer_fwd, _remat_layer_bwd)


_traced_once_remat_layer_step = jax.jit(_remat_layer_step, static_argnums=0)


def _remat_layers(
    layers: list[tuple[nnx.GraphDef, nnx.State]],
    h: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    mask: jax.Array,
    kv: KVPairs | None,
    index: jax.Array | None,
    every: int = 1,
    sliding: tuple[jax.Array, jax.Array, Any] | None = None,
    flags: tuple[bool, ...] | None = None,
    routing: tuple[jax.Array | None, jax.Array] | None = None,
) -> tuple[jax.Array, KVPairs | None, RouterTrace | None]:
    """Runs the decoder layers, every `every`-th one (0, every, ...) rematerialized.

    A rematerialized layer keeps its inputs for the backward pass: its hidden states and, with
    a cache, its own keys and values. The other layers keep their activations. Layer `i` takes
    `sliding` for its `(cos, sin, mask)` where `flags[i]`, and its part of `routing`.
    """
    new_kv, traces = [], []
    for i, (graphdef, state) in enumerate(layers):
        layer_kv = None if kv is None else (kv[0][i], kv[1][i])
        step = _traced_once_remat_layer_step if i % every == 0 else _traced_once_layer_step
        c, s, m = sliding if flags is not None and flags[i] else (cos, sin, mask)
        out = step(graphdef, state, h, c, s, m, layer_kv, index, _layer_routing(routing, i))
        h, layer_kv = out[0], out[1]
        new_kv.append(layer_kv)
        traces.append(out[2] if len(out) > 2 else None)
    return h, None if kv is None else _unzip(new_kv), _stack_traces(traces)
