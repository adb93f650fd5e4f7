"""The compiled device programs of continuous batching: the prompt store, the slots, decoding.

:func:`~artifex.generative_models.inference.continuous.generate_continuous` runs the host side
(requests, the prompt store's rows, the buckets) and calls these programs:

- :func:`init_store` and :func:`prefill`: the prompt store, one row per prompt (its keys,
  values and last hidden state), filled in power-of-two groups of prompts;
- :func:`init_slots`: the decode slots (a one-row ``KVCache`` per slot, stacked, and each slot's
  request, token count, budget and stop-match state);
- :func:`decode_chunk`: up to ``steps`` decoding steps of every slot in one ``lax.while_loop``,
  refilling ended slots on the device from a queue of waiting requests (each refill copies its
  prompt's row of the store into the slot);
- :func:`relayout`: a new slot bucket (slots compacted) or width bucket (columns cut or padded).

Each is compiled once per shape (slot bucket, width bucket, number of prompts), not per call.
Internal: the module declares no ``__all__``; ``continuous`` imports the programs under their
former private names (``_decode_chunk``, ``_prefill``, ``_relayout``...), the same jitted
objects.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from artifex.generative_models.inference.token_sampling import sample_logits
from artifex.generative_models.utils.compile_options import jit


def _layer_kwargs(model: Any) -> dict[str, Any]:
    stack = model.layer_stack() if getattr(model, "scan_layers", False) else None
    return {} if stack is None else {"layer_stack": stack}


def _hidden_type(model: Any) -> jax.ShapeDtypeStruct:
    """Shape ``(1, D)`` and dtype of the model's last hidden state (traced, not run)."""
    hidden = jax.eval_shape(lambda: model.hidden_states(jnp.zeros((1, 1), jnp.int32))[0])
    return jax.ShapeDtypeStruct((1, hidden.shape[-1]), hidden.dtype)


@jit(static_argnames=("graphdef", "rows", "width"))
def init_store(graphdef: nnx.GraphDef, state: nnx.State, *, rows: int, width: int):
    """An empty prompt store of ``rows`` rows of ``width`` columns, and their hidden states."""
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(rows, width)
    return cache, jnp.zeros((rows, *_hidden_type(model).shape[1:]), _hidden_type(model).dtype)


@jit(static_argnames=("graphdef", "slots", "width", "window"))
def init_slots(graphdef: nnx.GraphDef, state: nnx.State, *, slots: int, width: int, window: int):
    """``slots`` empty decode slots of ``width`` cache columns (``window``: stop-sequence tail)."""
    model = nnx.merge(graphdef, state)
    one = model.init_cache(1, width)
    cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (slots, *x.shape)), one)
    zeros = jnp.zeros((slots,), jnp.int32)
    return {
        "cache": cache,
        "first": jnp.zeros((slots, *_hidden_type(model).shape[1:]), _hidden_type(model).dtype),
        "req": jnp.full((slots,), -1, jnp.int32),
        "fresh": jnp.zeros((slots,), jnp.bool_),
        "ngen": zeros,
        "limit": zeros,
        "last": zeros,
        "stop_state": zeros,
        "recent": jnp.full((slots, window), -1, jnp.int32),
    }


@jit(static_argnames=("graphdef",), donate_argnames=("store", "hidden_store"))
def prefill(graphdef, state, store, hidden_store, ids, mask, rows):
    """Prefills prompts ``ids`` into rows ``rows`` of the prompt store."""
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(ids.shape[0], ids.shape[1], stacked=store.stacked)
    hidden, cache = model.hidden_states(
        ids, attention_mask=mask, cache=cache, **_layer_kwargs(model)
    )
    axis = 1 if store.stacked else 0

    def put(dst: jax.Array, src: jax.Array, ax: int) -> jax.Array:
        return dst.at[(slice(None),) * ax + (rows,)].set(src)

    if store.stacked:
        keys, values = put(store.keys, cache.keys, axis), put(store.values, cache.values, axis)
    else:
        keys = tuple(put(d, s, 0) for d, s in zip(store.keys, cache.keys, strict=True))
        values = tuple(put(d, s, 0) for d, s in zip(store.values, cache.values, strict=True))
    store = store.replace(keys=keys, values=values, valid=put(store.valid, cache.valid, 0))
    return store, hidden_store.at[rows].set(hidden[:, -1])


def _copy_prompt(cache: Any, store: Any, slot: jax.Array, row: jax.Array) -> Any:
    """Writes prompt-store row ``row`` into columns ``[0, P)`` of slot ``slot``."""
    zero = jnp.zeros((), jnp.int32)
    p = store.valid.shape[-1]
    w = cache.valid.shape[-1]

    def one(dst: jax.Array, src: jax.Array) -> jax.Array:
        # dst (S, 1, K, *, *) per layer or (S, L, 1, K, *, *) stacked; src (C, K, *, *) or
        # (L, C, K, *, *).
        if store.stacked:
            piece = jax.lax.dynamic_index_in_dim(src, row, axis=1, keepdims=False)
            piece = piece[None, :, None]
        else:
            piece = jax.lax.dynamic_index_in_dim(src, row, axis=0, keepdims=True)[None]
        start = (slot,) + (zero,) * (dst.ndim - 1)
        return jax.lax.dynamic_update_slice(dst, piece.astype(dst.dtype), start)

    if store.stacked:
        keys, values = one(cache.keys, store.keys), one(cache.values, store.values)
    else:
        keys = tuple(one(d, s) for d, s in zip(cache.keys, store.keys, strict=True))
        values = tuple(one(d, s) for d, s in zip(cache.values, store.values, strict=True))
    prompt_valid = jax.lax.dynamic_index_in_dim(store.valid, row, axis=0, keepdims=False)
    valid_row = jnp.concatenate([prompt_valid, jnp.zeros((w - p,), jnp.bool_)])
    valid = jax.lax.dynamic_update_slice(cache.valid, valid_row[None, None], (slot, zero, zero))
    index = cache.index.at[slot].set(p)
    return cache.replace(keys=keys, values=values, valid=valid, index=index)


_DECODE_STATIC = (
    "graphdef",
    "steps",
    "greedy",
    "top_k",
    "use_top_p",
    "eos_ids",
    "stop_sequences",
    "pad_id",
)


@jit(static_argnames=_DECODE_STATIC, donate_argnames=("slots",))
def decode_chunk(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    slots: dict[str, Any],
    store: Any,
    hidden_store: jax.Array,
    pending: dict[str, jax.Array],
    key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    stop_table: jax.Array | None,
    more_on_host: jax.Array,
    shrink_at: jax.Array,
    *,
    steps: int,
    greedy: bool,
    top_k: int | None,
    use_top_p: bool,
    eos_ids: tuple[int, ...],
    stop_sequences: tuple[tuple[int, ...], ...],
    pad_id: int,
):
    """Up to ``steps`` decoding steps of every slot, refilling ended slots from ``pending``."""
    model = nnx.merge(graphdef, state)
    layers = _layer_kwargs(model)
    n_slots = slots["req"].shape[0]
    width = slots["cache"].valid.shape[-1]
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    window = slots["recent"].shape[1]

    def refill(c: dict[str, Any]) -> dict[str, Any]:
        free = c["req"] < 0
        order = jnp.argsort(~free, stable=True)  # free slots first
        take = jnp.minimum(jnp.sum(free, dtype=jnp.int32), pending["count"] - c["consumed"])

        def one(i: jax.Array, c: dict[str, Any]) -> dict[str, Any]:
            slot, q = order[i], c["consumed"] + i
            row = pending["row"][q]
            return dict(
                c,
                cache=_copy_prompt(c["cache"], store, slot, row),
                first=c["first"].at[slot].set(hidden_store[row]),
                req=c["req"].at[slot].set(pending["req"][q]),
                limit=c["limit"].at[slot].set(pending["limit"][q]),
                fresh=c["fresh"].at[slot].set(True),
                ngen=c["ngen"].at[slot].set(0),
                stop_state=c["stop_state"].at[slot].set(0),
                recent=c["recent"].at[slot].set(-1),
            )

        c = jax.lax.fori_loop(0, take, one, c)
        return dict(c, consumed=c["consumed"] + take)

    def forward_one(cache: Any, token: jax.Array, fed: jax.Array) -> tuple[jax.Array, Any]:
        hidden, cache = model.hidden_states(
            token.reshape(1, 1), attention_mask=fed.reshape(1, 1).astype(jnp.int32), cache=cache,
            **layers,
        )  # fmt: skip
        return hidden[0, 0], cache

    def draw(logits: jax.Array, request: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        token, logp = sample_logits(
            logits[None],
            jax.random.fold_in(jax.random.fold_in(key, request), t),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p if use_top_p else None,
            greedy=greedy,
        )
        return token[0], logp[0]

    def cond(c: dict[str, Any]) -> jax.Array:
        active = c["req"] >= 0
        fed = active & ~c["fresh"]
        room = jnp.all(~fed | (c["cache"].index < width))
        waiting = c["consumed"] < pending["count"]
        n_active = jnp.sum(active, dtype=jnp.int32)
        want_more = more_on_host & ~waiting & (n_active < n_slots)
        shrink = ~waiting & ~more_on_host & (n_active <= shrink_at)
        return (c["j"] < steps) & room & (n_active > 0) & ~want_more & ~shrink

    def body(c: dict[str, Any]) -> dict[str, Any]:
        active = c["req"] >= 0
        fed = active & ~c["fresh"]
        hidden, cache = jax.vmap(forward_one)(c["cache"], c["last"], fed)
        cache = cache.replace(index=jnp.where(fed, cache.index, c["cache"].index))
        hidden = jnp.where(c["fresh"][:, None], c["first"], hidden)
        token, logp = jax.vmap(draw)(
            model.logits_from_hidden(hidden), jnp.maximum(c["req"], 0), c["ngen"]
        )
        token = jnp.where(active, token, pad_id)
        ngen = c["ngen"] + active.astype(jnp.int32)
        is_eos = active & jnp.any(token[:, None] == eos[None, :], axis=-1)
        recent = jnp.concatenate([c["recent"][:, 1:], token[:, None]], axis=1)
        hit = jnp.zeros_like(active)
        for seq in stop_sequences:
            tail = recent[:, window - len(seq) :]
            hit = hit | jnp.all(tail == jnp.asarray(seq, jnp.int32)[None, :], axis=-1)
        stop_state = c["stop_state"]
        if stop_table is not None:
            stop_state = jnp.where(active, stop_table[stop_state, token], stop_state)
            hit = hit | (stop_state == stop_table.shape[0] - 1)
        is_stop = active & ~is_eos & hit
        at_limit = active & (ngen >= c["limit"])
        ended = is_eos | is_stop | at_limit
        j = c["j"]
        out = c["out"]
        out = {
            "req": out["req"].at[j].set(jnp.where(active, c["req"], -1)),
            "pos": out["pos"].at[j].set(c["ngen"]),
            "token": out["token"].at[j].set(token),
            "logp": out["logp"].at[j].set(jnp.where(active, logp, 0.0)),
            "end": out["end"].at[j].set(ended),
            "truncated": out["truncated"].at[j].set(at_limit & ~is_eos & ~is_stop),
        }
        c = dict(
            c,
            cache=cache,
            last=token,
            fresh=jnp.zeros_like(c["fresh"]),
            ngen=ngen,
            recent=recent,
            stop_state=stop_state,
            req=jnp.where(ended, -1, c["req"]),
            out=out,
            j=j + 1,
        )
        return refill(c)

    out = {
        "req": jnp.full((steps, n_slots), -1, jnp.int32),
        "pos": jnp.zeros((steps, n_slots), jnp.int32),
        "token": jnp.zeros((steps, n_slots), jnp.int32),
        "logp": jnp.zeros((steps, n_slots), jnp.float32),
        "end": jnp.zeros((steps, n_slots), jnp.bool_),
        "truncated": jnp.zeros((steps, n_slots), jnp.bool_),
    }
    carry = dict(slots, out=out, j=jnp.zeros((), jnp.int32), consumed=jnp.zeros((), jnp.int32))
    carry = jax.lax.while_loop(cond, body, refill(carry))
    out, consumed = carry.pop("out"), carry.pop("consumed")
    carry.pop("j")
    summary = {"req": carry["req"], "ngen": carry["ngen"], "consumed": consumed}
    return carry, out, summary


@jit(static_argnames=("width",))
def relayout(slots: dict[str, Any], take: jax.Array, *, width: int) -> dict[str, Any]:
    """Slots ``take`` (-1: an empty slot) of ``slots``, their caches cut or padded to ``width``."""
    keep = take >= 0
    index = jnp.maximum(take, 0)
    cache = slots["cache"]
    old = cache.valid.shape[-1]

    def resize(x: jax.Array, axis: int) -> jax.Array:
        x = jnp.take(x, index, axis=0)
        if width <= old:
            return jax.lax.slice_in_dim(x, 0, width, axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - old)
        return jnp.pad(x, pad)

    # keys (S, [L,] 1, K, H, W): columns last; values (S, [L,] 1, K, W, H): columns second last
    if cache.stacked:
        keys, values = resize(cache.keys, -1), resize(cache.values, -2)
    else:
        keys = tuple(resize(x, -1) for x in cache.keys)
        values = tuple(resize(x, -2) for x in cache.values)
    new_cache = cache.replace(
        keys=keys,
        values=values,
        valid=resize(cache.valid, -1) & keep[:, None, None],
        index=jnp.take(cache.index, index),
    )
    out = {k: jnp.take(v, index, axis=0) for k, v in slots.items() if k != "cache"}
    out["req"] = jnp.where(keep, out["req"], -1)
    return {**out, "cache": new_cache}
