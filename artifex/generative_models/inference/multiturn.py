r"""KV-cache continuation for multi-turn generation: append tokens, then decode a turn.

A multi-turn episode alternates model turns with appended text (tool results, environment
messages, chat-template scaffolding). The cache carries across turns, with the invariant

    *every token of the conversation so far is encoded in the cache, and ``logits`` holds the
    next-token logits after the last one.*

:func:`append_tokens` prefills new tokens into an existing cache (nothing already encoded is
encoded again) and :func:`decode_turn` samples one turn, feeding each sampled token back into the
cache, until every active row has produced an end-of-sequence id or a stop sequence, or the
turn's token limit. Both are compiled programs with static shapes: appended chunks are
left-padded to a width bucket (padding slots are marked invalid in the cache and never attended
to; positions count valid slots only, so a conversation with padding in the middle has the same
logits as the unpadded conversation), and a turn has a static maximum length with a traced
per-call limit. The host loop only runs between turns.

Sampling is :func:`~artifex.generative_models.inference.token_sampling.sample_logits`: the returned
log-probs are ``log pi(token)`` under the sampling distribution
``pi(v) \propto exp(z_v / tau)`` (restricted by top-k / top-p when set).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.inference.sampling import (
    _per_layer_split,
    bucket_length,
    sample_logits,
)
from artifex.generative_models.models.causal_lm.cache import KVCache
from artifex.generative_models.utils.compile_options import jit
from artifex.generative_models.utils.validation import check_float, check_int

__all__ = [
    "DEFAULT_APPEND_BUCKETS",
    "TurnOutput",
    "append_tokens",
    "decode_turn",
]

DEFAULT_APPEND_BUCKETS: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TurnOutput:
    """One decoded turn for every row.

    Attributes:
        tokens: ``(R, N)`` sampled ids; ``pad_id`` after a row stopped or for inactive rows.
        mask: ``(R, N)`` int32, 1 on the tokens the model generated this turn.
        log_probs: ``(R, N)`` float32 log-prob of each token under the sampling distribution.
        eos: ``(R,)`` bool, the row ended with an end-of-sequence id.
        stopped: ``(R,)`` bool, the row ended with one of the stop sequences.
        cache: The cache with every generated token encoded.
        logits: ``(R, V)`` float32 next-token logits after each row's last token.

    Examples:
        >>> import dataclasses
        >>> from artifex.generative_models.inference import TurnOutput
        >>> [f.name for f in dataclasses.fields(TurnOutput)]
        ['tokens', 'mask', 'log_probs', 'eos', 'stopped', 'cache', 'logits']
    """

    tokens: jax.Array
    mask: jax.Array
    log_probs: jax.Array
    eos: jax.Array
    stopped: jax.Array
    cache: KVCache
    logits: jax.Array


@jit(static_argnames=("graphdef",))
def _append(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache: KVCache,
    ids: jax.Array,
    mask: jax.Array,
    logits: jax.Array,
) -> tuple[KVCache, jax.Array]:
    model = nnx.merge(graphdef, state)
    hidden, cache = model.hidden_states(ids, attention_mask=mask, cache=cache)
    new = model.logits_from_hidden(hidden[:, -1])
    has_tokens = jnp.any(mask.astype(jnp.bool_), axis=-1)
    return cache, jnp.where(has_tokens[:, None], new, logits)


def append_tokens(
    model: nnx.Module,
    cache: KVCache,
    sequences: Sequence[Sequence[int]],
    logits: jax.Array | None = None,
    *,
    pad_id: int = 0,
    buckets: Sequence[int] | None = DEFAULT_APPEND_BUCKETS,
) -> tuple[KVCache, jax.Array]:
    """Prefills each row's new tokens into the cache and returns the next-token logits.

    The rows' token lists are left-padded to a common width (a bucket), so the last column is
    every non-empty row's last new token. A row with no new tokens keeps its ``logits``.

    Args:
        model: The causal LM (``hidden_states(..., cache=)``, ``logits_from_hidden``).
        cache: The cache holding the conversation so far (``batch_size`` = number of rows).
        sequences: One list of new token ids per row (may be empty).
        logits: ``(R, V)`` current next-token logits, kept for rows without new tokens;
            ``None`` is allowed only when every row has new tokens.
        pad_id: Filler id for padding slots.
        buckets: Widths to pad to (``None``: the longest row's length).

    Returns:
        ``(cache, logits)``: the cache advanced by the padded width, and ``(R, V)`` float32
        next-token logits.

    Raises:
        ValueError: The number of rows differs from the cache's, there is no new token at all,
            the cache has no room for the chunk, or ``logits`` is missing for an empty row.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.inference import append_tokens
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> model = CausalLM(cfg, rngs=nnx.Rngs(0))
        >>> cache = model.init_cache(batch_size=2, max_length=32)
        >>> cache, logits = append_tokens(model, cache, [[3, 4, 5], [6, 7]])  # padded to a bucket
        >>> logits.shape, int(cache.index)
        ((2, 16), 8)
    """
    rows = cache.batch_size
    if len(sequences) != rows:
        msg = f"append_tokens: got {len(sequences)} token lists for a cache of {rows} rows"
        raise ValueError(msg)
    longest = max((len(s) for s in sequences), default=0)
    if longest == 0:
        msg = "append_tokens: every row's token list is empty"
        raise ValueError(msg)
    width = longest if buckets is None else bucket_length(longest, buckets)
    index = int(cache.index)
    if index + width > cache.max_length:
        msg = (
            f"append_tokens: the cache has {cache.max_length - index} free slots, "
            f"the chunk needs {width}"
        )
        raise ValueError(msg)
    if logits is None:
        if any(len(s) == 0 for s in sequences):
            msg = "append_tokens: logits are needed when some rows have no new tokens"
            raise ValueError(msg)
        logits = jnp.zeros((rows, model.config.vocab_size), jnp.float32)
    ids = np.full((rows, width), pad_id, np.int32)
    mask = np.zeros((rows, width), np.int32)
    for r, seq in enumerate(sequences):
        if len(seq):
            ids[r, width - len(seq) :] = np.asarray(seq, np.int32)
            mask[r, width - len(seq) :] = 1
    graphdef, state = _per_layer_split(model)
    return _append(graphdef, state, cache, jnp.asarray(ids), jnp.asarray(mask), logits)


@jit(
    static_argnames=(
        "graphdef",
        "max_new_tokens",
        "top_k",
        "use_top_p",
        "greedy",
        "eos_ids",
        "stop_sequences",
        "pad_id",
    ),
)
def _decode(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache: KVCache,
    logits: jax.Array,
    active: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    limit: jax.Array,
    stop_table: jax.Array | None,
    *,
    max_new_tokens: int,
    top_k: int | None,
    use_top_p: bool,
    greedy: bool,
    eos_ids: tuple[int, ...],
    stop_sequences: tuple[tuple[int, ...], ...],
    pad_id: int,
) -> TurnOutput:
    model = nnx.merge(graphdef, state)
    # Scanned layers: stack the layer weights once, outside the decode loop (no copy when the
    # model stores them stacked). Unrolled layers stored stacked arrive sliced per layer
    # (`append_tokens` and `decode_turn` slice them before this program, `_per_layer_split`).
    stack = model.layer_stack() if getattr(model, "scan_layers", False) else None
    layers = {} if stack is None else {"layer_stack": stack}
    rows, n = active.shape[0], max_new_tokens
    width = max((len(s) for s in stop_sequences), default=1)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def stop_hit(recent: jax.Array) -> jax.Array:
        hit = jnp.zeros((rows,), jnp.bool_)
        for seq in stop_sequences:
            tail = recent[:, width - len(seq) :]
            hit = hit | jnp.all(tail == jnp.asarray(seq, jnp.int32)[None, :], axis=-1)
        return hit

    def cond(c: dict[str, Any]) -> jax.Array:
        return (c["step"] < limit) & ~jnp.all(c["done"])

    def body(c: dict[str, Any]) -> dict[str, Any]:
        step = c["step"]
        token, logp = sample_logits(
            c["logits"],
            jax.random.fold_in(key, step),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p if use_top_p else None,
            greedy=greedy,
        )
        alive = ~c["done"]
        token = jnp.where(alive, token, pad_id)
        recent = jnp.concatenate([c["recent"][:, 1:], token[:, None]], axis=1)
        recent = jnp.where(alive[:, None], recent, c["recent"])
        is_eos = alive & jnp.any(token[:, None] == eos[None, :], axis=-1)
        hit = stop_hit(recent)
        state = c["stop_state"]
        if stop_table is not None:  # stop strings: one automaton step per token
            state = jnp.where(alive, stop_table[state, token], state)
            hit = hit | (state == stop_table.shape[0] - 1)
        is_stop = alive & ~is_eos & hit
        hidden, new_cache = model.hidden_states(
            token[:, None],
            attention_mask=alive[:, None].astype(jnp.int32),
            cache=c["cache"],
            **layers,
        )
        new_logits = model.logits_from_hidden(hidden[:, 0])
        return dict(
            c,
            tokens=c["tokens"].at[:, step].set(token),
            mask=c["mask"].at[:, step].set(alive.astype(jnp.int32)),
            logps=c["logps"].at[:, step].set(jnp.where(alive, logp, 0.0)),
            done=c["done"] | is_eos | is_stop,
            eos=c["eos"] | is_eos,
            stopped=c["stopped"] | is_stop,
            stop_state=state,
            recent=recent,
            cache=new_cache,
            logits=jnp.where(alive[:, None], new_logits, c["logits"]),
            step=step + 1,
        )

    carry = {
        "tokens": jnp.full((rows, n), pad_id, jnp.int32),
        "mask": jnp.zeros((rows, n), jnp.int32),
        "logps": jnp.zeros((rows, n), jnp.float32),
        "done": ~active.astype(jnp.bool_),
        "eos": jnp.zeros((rows,), jnp.bool_),
        "stopped": jnp.zeros((rows,), jnp.bool_),
        "recent": jnp.full((rows, width), -1, jnp.int32),
        "stop_state": jnp.zeros((rows,), jnp.int32),
        "cache": cache,
        "logits": logits.astype(jnp.float32),
        "step": jnp.zeros((), jnp.int32),
    }
    c = jax.lax.while_loop(cond, body, carry)
    return TurnOutput(
        tokens=c["tokens"],
        mask=c["mask"],
        log_probs=c["logps"],
        eos=c["eos"],
        stopped=c["stopped"],
        cache=c["cache"],
        logits=c["logits"],
    )


def _checked_stop_table(table: jax.Array | np.ndarray, vocab_size: int) -> jax.Array:
    """``table`` as an int32 device array, its shape (and, on the host, values) checked."""
    shape = getattr(table, "shape", None)
    kind = getattr(table, "dtype", None)
    if shape is None or len(shape) != 2 or kind is None or not np.issubdtype(kind, np.integer):
        msg = (
            "decode_turn: stop_table must be a 2-D integer array (states, vocabulary), got "
            f"{type(table).__name__} of shape {shape} and dtype {kind}"
        )
        raise TypeError(msg)
    if shape[0] < 2 or shape[1] != vocab_size:
        msg = (
            f"decode_turn: stop_table must have shape (S >= 2, {vocab_size}) for logits over "
            f"{vocab_size} ids, got {tuple(shape)}"
        )
        raise ValueError(msg)
    if isinstance(table, np.ndarray) and (table.min() < 0 or table.max() >= shape[0]):
        msg = f"decode_turn: stop_table holds states outside [0, {shape[0]})"
        raise ValueError(msg)
    return jnp.asarray(table, jnp.int32)


def decode_turn(
    model: nnx.Module,
    cache: KVCache,
    logits: jax.Array,
    active: jax.Array | np.ndarray,
    *,
    key: jax.Array,
    max_new_tokens: int,
    limit: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    eos_ids: Sequence[int] = (),
    stop_sequences: Sequence[Sequence[int]] = (),
    stop_table: jax.Array | np.ndarray | None = None,
    pad_id: int = 0,
) -> TurnOutput:
    """Samples one turn for the active rows, continuing the cache.

    At each step every active row draws a token from its logits, the token is written to the
    cache (so the cache always holds the whole conversation) and the row stops after an
    end-of-sequence id, when its last tokens equal one of ``stop_sequences``, or when its
    ``stop_table`` automaton reaches the match state. Inactive rows write invalid slots only.
    The loop ends when every row stopped or after ``limit`` steps.

    Args:
        model: The causal LM.
        cache: The conversation so far; must have ``limit`` free slots.
        logits: ``(R, V)`` next-token logits after each row's last token.
        active: ``(R,)`` bool, rows that generate this turn.
        key: PRNG key (the output is a deterministic function of it).
        max_new_tokens: Static width of the output (one compiled program per value).
        limit: Most steps this call (``<= max_new_tokens``; ``None``: ``max_new_tokens``).
        temperature: ``tau >= 0``; 0 is greedy.
        top_k: Optional top-k.
        top_p: Nucleus mass in (0, 1].
        eos_ids: Ids that end the turn (and, usually, the episode).
        stop_sequences: Token-id sequences that end the turn (exact ids: one tokenization).
        stop_table: ``(S, V)`` automaton of stop strings
            (:func:`~artifex.generative_models.inference.stop_strings.stop_string_table`):
            a row stops when its turn's text contains one, however it was tokenized.
        pad_id: Filler id.

    Returns:
        A :class:`TurnOutput`.

    Raises:
        ValueError: ``limit`` outside ``[1, max_new_tokens]``, the cache has fewer free slots
            than ``limit``, an empty stop sequence, a negative temperature, or a
            ``stop_table`` of another width than the logits (or with states out of range).
        TypeError: ``max_new_tokens`` or ``limit`` not an int, ``temperature`` not a number,
            or ``stop_table`` not a 2-D integer array.

    Examples:
        >>> import jax, numpy as np
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.inference import append_tokens, decode_turn
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> model = CausalLM(cfg, rngs=nnx.Rngs(0))
        >>> cache, logits = append_tokens(model, model.init_cache(2, 32), [[3, 4, 5], [6, 7]])
        >>> out = decode_turn(model, cache, logits, np.array([True, False]), key=jax.random.key(0),
        ...                   max_new_tokens=4, eos_ids=(2,))
        >>> out.tokens.shape, out.mask[1].tolist()  # row 1 is inactive this turn
        ((2, 4), [0, 0, 0, 0])
        >>> cache, logits = append_tokens(model, out.cache, [[9], [9]], out.logits)  # next turn
    """
    max_new_tokens = check_int("decode_turn: max_new_tokens", max_new_tokens, minimum=1)
    limit = max_new_tokens if limit is None else limit
    limit = check_int("decode_turn: limit", limit, minimum=1, maximum=max_new_tokens)
    free = cache.max_length - int(cache.index)
    if free < limit:
        msg = f"decode_turn: the cache has {free} free slots, the turn may need {limit}"
        raise ValueError(msg)
    stops = tuple(tuple(int(t) for t in s) for s in stop_sequences)
    if stop_table is not None:
        stop_table = _checked_stop_table(stop_table, logits.shape[-1])
    if any(len(s) == 0 for s in stops):
        msg = "decode_turn: stop_sequences must not contain an empty sequence"
        raise ValueError(msg)
    check_float("decode_turn: temperature", temperature, minimum=0.0)
    greedy = temperature == 0
    graphdef, state = _per_layer_split(model)
    return _decode(
        graphdef,
        state,
        cache,
        logits,
        jnp.asarray(active, jnp.bool_),
        key,
        jnp.asarray(1.0 if greedy else temperature, jnp.float32),
        jnp.asarray(top_p, jnp.float32),
        jnp.asarray(limit, jnp.int32),
        stop_table,
        max_new_tokens=int(max_new_tokens),
        top_k=top_k,
        use_top_p=top_p < 1.0,
        greedy=greedy,
        eos_ids=tuple(int(e) for e in eos_ids),
        stop_sequences=stops,
        pad_id=int(pad_id),
    )
