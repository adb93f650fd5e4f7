r"""Continuous batching: decode slots refilled as completions end, over a length-bucketed cache.

:func:`~artifex.generative_models.inference.sampling.generate` decodes a batch until its
longest row ends, so when completion lengths differ widely most of its decoding steps go to
rows that have finished. :func:`generate_continuous` returns the same
:class:`~artifex.generative_models.inference.batch_layout.SamplerOutput` and keeps a fixed number
of *slots* busy instead:

1. *Requests.* Output row ``i`` (prompt ``i // K``, generation ``i % K``) is one request with
   its own token budget; requests start in row order.
2. *Prefill once per prompt*, when its first request is about to start; each of its ``K``
   requests copies the prompt's keys, values and last hidden state into its slot.
3. *Decoding.* One compiled program runs up to ``steps_per_call`` decoding steps of all slots;
   a slot whose request ends is refilled at that step, on the device, from a queue of waiting
   requests. Between calls the host collects tokens, queues requests and prefills prompts.
4. *The cache.* Each slot holds its left-padded prompt and its tokens in ``W`` columns: the
   prompt width plus a power-of-two bucket of the longest live completion (grown and cut as
   that changes). Once no request waits, the live slots are compacted into the smallest slot
   bucket (:func:`slot_buckets`) that holds them. A decoding step is the model's
   ``hidden_states`` mapped (``jax.vmap``) over slots, each a one-row ``KVCache``.

Buckets rather than pages: without a paged-attention kernel, XLA attention over pages first
gathers each slot's pages into one array, every layer and step; a bucketed cache avoids that.

Randomness: token ``t`` of request ``i`` is drawn with ``fold_in(fold_in(key, i), t)``, so the
output does not depend on the number of slots or on when requests end. For a fixed key, greedy
decoding gives :func:`~artifex.generative_models.inference.sampling.generate`'s tokens; sampled
decoding draws from the same distribution with other random numbers.

Compiled programs: decoding once per (slot bucket, width bucket), prefill once per
power-of-two number of prompts, relayout once per pair of buckets; for a given model, prompt
width, ``steps_per_call`` and decoding settings, not per call or per request. The programs live
in :mod:`~artifex.generative_models.inference.continuous_programs`; this module holds the host
side (checks, requests, the prompt store's rows, the buckets) and imports the programs under
their former names (``_decode_chunk``, ``_prefill``, ``_relayout``, ``_init_store``,
``_init_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.inference.continuous_programs import (
    decode_chunk as _decode_chunk,
)
from artifex.generative_models.inference.continuous_programs import (
    init_slots as _init_slots,
)
from artifex.generative_models.inference.continuous_programs import (
    init_store as _init_store,
)
from artifex.generative_models.inference.continuous_programs import prefill as _prefill
from artifex.generative_models.inference.continuous_programs import relayout as _relayout
from artifex.generative_models.inference.sampling import (
    DEFAULT_PROMPT_BUCKETS,
    SamplerOutput,
    _local_rows,
    _per_layer_split,
    bucket_length,
    check_fits_positions,
)
from artifex.generative_models.utils.validation import check_float, check_int

__all__ = ["DEFAULT_MAX_SLOTS", "generate_continuous", "slot_buckets", "width_bucket"]

#: Slots :func:`generate_continuous` uses when not told: all requests, up to this many.
DEFAULT_MAX_SLOTS = 64

# The smallest bucket of completion columns in a slot's cache (fewer buckets, fewer programs).
_MIN_COMPLETION_COLUMNS = 128


def slot_buckets(num_slots: int, levels: int = 3) -> tuple[int, ...]:
    """The slot counts the decoder runs with: ``num_slots`` and its halves, rounded up.

    Args:
        num_slots: The most slots.
        levels: How many sizes, the largest first.

    Returns:
        Decreasing distinct slot counts, the first ``num_slots``, all >= 1.

    Raises:
        ValueError: ``num_slots`` or ``levels`` below 1.
        TypeError: Either is not an int.

    Examples:
        >>> from artifex.generative_models.inference import slot_buckets
        >>> slot_buckets(64), slot_buckets(6), slot_buckets(1)
        ((64, 32, 16), (6, 3, 2), (1,))
    """
    check_int("num_slots", num_slots, minimum=1)
    check_int("levels", levels, minimum=1)
    sizes = [-(-num_slots // 2**i) for i in range(levels)]
    return tuple(sorted(set(sizes), reverse=True))


def width_bucket(tokens: int, max_new_tokens: int, minimum: int) -> int:
    """Cache columns for completions of up to ``tokens`` tokens: a power of two, capped.

    Args:
        tokens: The longest completion the cache must hold.
        max_new_tokens: The cap (no completion is longer).
        minimum: The smallest bucket.

    Returns:
        ``min(max_new_tokens, max(minimum, 2 ** ceil(log2(tokens))))``.

    Examples:
        >>> from artifex.generative_models.inference import width_bucket
        >>> width_bucket(5, 1000, 32), width_bucket(100, 1000, 32), width_bucket(900, 1000, 32)
        (32, 128, 1000)
    """
    power = 1 << max(int(tokens) - 1, 0).bit_length()
    return int(min(max_new_tokens, max(minimum, power)))


# ---------------------------------------------------------------------------------- the host
def _check_prompts(model: Any, prompt_ids: Any, prompt_mask: Any) -> tuple[np.ndarray, ...]:
    """Host copies of the prompts and their mask, checked as ``generate`` checks them."""
    ids = _local_rows(prompt_ids)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        msg = f"prompt_ids must have shape (B, P) with B, P >= 1, got {ids.shape}"
        raise ValueError(msg)
    if not np.issubdtype(ids.dtype, np.integer):
        msg = f"prompt_ids must hold integer token ids, got dtype {ids.dtype}"
        raise TypeError(msg)
    mask = np.ones(ids.shape, np.int32) if prompt_mask is None else _local_rows(prompt_mask)
    if mask.shape != ids.shape:
        msg = f"prompt_mask must have the shape of prompt_ids {ids.shape}, got {mask.shape}"
        raise ValueError(msg)
    lengths = mask.astype(bool).sum(axis=1)
    if (lengths == 0).any():
        msg = f"empty prompt: row {int(np.argmin(lengths))} of prompt_mask has no real token"
        raise ValueError(msg)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        real = np.where(mask.astype(bool), ids, 0)
        if real.min() < 0 or real.max() >= vocab:
            row = int(np.argwhere((real < 0) | (real >= vocab))[0][0])
            msg = (
                f"prompt_ids must hold token ids in [0, {vocab}) (the model's vocabulary), got "
                f"[{int(real.min())}, {int(real.max())}] (first bad row {row})"
            )
            raise ValueError(msg)
    return ids.astype(np.int32), mask.astype(np.int32), lengths


def _request_limits(limits: Any, rows: int, group: int, max_new_tokens: int) -> np.ndarray:
    """Per-request token budgets ``(B * K,)`` from ``None``, ``(B,)`` or ``(B * K,)``."""
    if limits is None:
        return np.full((rows,), max_new_tokens, np.int64)
    arr = np.asarray(limits)
    if not np.issubdtype(arr.dtype, np.integer):
        msg = f"max_new_tokens_per_request must hold ints, got dtype {arr.dtype}"
        raise TypeError(msg)
    if arr.shape == (rows // group,):
        arr = np.repeat(arr, group)
    if arr.shape != (rows,):
        msg = (
            f"max_new_tokens_per_request must have shape ({rows // group},) (per prompt) or "
            f"({rows},) (per completion), got {arr.shape}"
        )
        raise ValueError(msg)
    if arr.min() < 1 or arr.max() > max_new_tokens:
        msg = (
            f"max_new_tokens_per_request must lie in [1, max_new_tokens={max_new_tokens}], got "
            f"[{int(arr.min())}, {int(arr.max())}]"
        )
        raise ValueError(msg)
    return arr.astype(np.int64)


def _eos_and_pad(model: Any, eos_ids: Any, pad_id: int | None) -> tuple[tuple[int, ...], int]:
    config = getattr(model, "config", None)
    if eos_ids is None:
        eos_ids = getattr(config, "eos_token_id", None)
    if eos_ids is None:
        eos: tuple[int, ...] = ()
    elif isinstance(eos_ids, int | np.integer):
        eos = (int(eos_ids),)
    else:
        eos = tuple(int(e) for e in eos_ids)
    if pad_id is None:
        pad_id = getattr(config, "pad_token_id", None)
        if pad_id is None:
            pad_id = eos[0] if eos else 0
    return eos, int(pad_id)


def _checked_stop_table(table: Any, vocab: int | None) -> jax.Array | None:
    if table is None:
        return None
    shape, kind = getattr(table, "shape", None), getattr(table, "dtype", None)
    if shape is None or len(shape) != 2 or kind is None or not np.issubdtype(kind, np.integer):
        msg = (
            "stop_table must be a 2-D integer array (states, vocabulary), got "
            f"{type(table).__name__} of shape {shape} and dtype {kind}"
        )
        raise TypeError(msg)
    if shape[0] < 2 or (vocab is not None and shape[1] != vocab):
        msg = f"stop_table must have shape (S >= 2, {vocab}), got {tuple(shape)}"
        raise ValueError(msg)
    return jnp.asarray(table, jnp.int32)


class _PromptStore:
    """Which prompt sits in which row of the device store; prefills the missing ones."""

    def __init__(self, run_prefill: Any, ids: np.ndarray, mask: np.ndarray, rows: int) -> None:
        self.run_prefill = run_prefill
        self.ids, self.mask = ids, mask
        self.row_of: dict[int, int] = {}
        self.free = list(range(rows))
        self.rows = rows

    def hold(self, prompts: list[int]) -> None:
        """Keeps exactly ``prompts`` (distinct, at most ``rows``) in the store."""
        wanted = set(prompts)
        for p in [p for p in self.row_of if p not in wanted]:
            self.free.append(self.row_of.pop(p))
        new = [p for p in prompts if p not in self.row_of]
        for p in new:
            self.row_of[p] = self.free.pop()
        while new:  # prefill in power-of-two groups (one program per group size)
            size = 1 << (len(new).bit_length() - 1)
            group, new = new[:size], new[size:]
            self.run_prefill(self.ids[group], self.mask[group], [self.row_of[p] for p in group])


def generate_continuous(
    model: nnx.Module,
    prompt_ids: jax.Array | np.ndarray,
    prompt_mask: jax.Array | np.ndarray | None = None,
    *,
    key: jax.Array,
    num_generations: int = 1,
    max_new_tokens: int = 128,
    max_new_tokens_per_request: Any = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    eos_ids: Sequence[int] | int | None = None,
    pad_id: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    stop_table: jax.Array | np.ndarray | None = None,
    prompt_buckets: Sequence[int] | None = DEFAULT_PROMPT_BUCKETS,
    num_slots: int | None = None,
    slot_levels: int = 3,
    steps_per_call: int = 32,
) -> SamplerOutput:
    """Generates ``num_generations`` completions per prompt with continuous batching.

    Arguments shared with :func:`~artifex.generative_models.inference.sampling.generate` mean
    the same; so does the output. A completion ends at an end-of-sequence id, a stop sequence,
    the match state of ``stop_table`` or its token budget (the ending token included;
    ``truncated``: the budget, without another end). Arguments are checked on the host first.

    Args:
        model: A causal LM, as for ``generate``.
        prompt_ids: ``(B, P)`` int token ids, left-padded.
        prompt_mask: ``(B, P)`` 1 on real tokens (``None``: no padding).
        key: PRNG key; the output is a deterministic function of it.
        num_generations: ``K >= 1`` completions per prompt.
        max_new_tokens: ``N >= 1``, the output width and the largest token budget.
        max_new_tokens_per_request: Optional budgets in ``[1, N]``, ``(B,)`` or ``(B * K,)``.
        temperature: ``tau >= 0``; 0 is greedy.
        top_k: Sample among the ``top_k`` most likely tokens only (``None``: all).
        top_p: Nucleus mass in (0, 1]; 1 disables nucleus sampling.
        eos_ids: Token id(s) that end a completion (default: the model config's).
        pad_id: As for ``generate``.
        stop_sequences: Token-id sequences that end a completion.
        stop_table: ``(S, V)`` int automaton of stop strings (``stop_string_table``), from
            state 0.
        prompt_buckets: As for ``generate``.
        num_slots: Completions decoded at once (default: all, at most
            :data:`DEFAULT_MAX_SLOTS`).
        slot_levels: Slot counts to shrink through once no request waits
            (:func:`slot_buckets`).
        steps_per_call: The most decoding steps per device call (static).

    Returns:
        A ``SamplerOutput`` of ``B * K`` rows (row ``i``: prompt ``i // K``).

    Raises:
        ValueError: As for ``generate``, and for an empty stop sequence or a ``stop_table``
            of another vocabulary.
        TypeError: Non-integer ids or budgets, a ``stop_table`` that is not a 2-D integer
            array, or another argument of the wrong type.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.inference import generate, generate_continuous
        >>> config = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                         num_layers=1, num_heads=2, eos_token_id=2)
        >>> model = CausalLM(config, rngs=nnx.Rngs(0))
        >>> prompts = jnp.array([[0, 5, 6], [7, 8, 9]])  # left-padded
        >>> mask = jnp.array([[0, 1, 1], [1, 1, 1]])
        >>> kw = dict(key=jax.random.key(0), num_generations=2, max_new_tokens=6,
        ...           temperature=0.0)
        >>> out = generate_continuous(model, prompts, mask, num_slots=2, **kw)
        >>> out.completion_ids.shape
        (4, 6)
        >>> bool((out.completion_ids == generate(model, prompts, mask, **kw).completion_ids).all())
        True
    """
    ids, mask, lengths = _check_prompts(model, prompt_ids, prompt_mask)
    k = check_int("num_generations", num_generations, minimum=1)
    n_max = check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_int("top_k", top_k, minimum=1, allow_none=True)
    check_float("top_p", top_p, greater_than=0.0, maximum=1.0)
    check_float("temperature", temperature, minimum=0.0)
    check_int("num_slots", num_slots, minimum=1, allow_none=True)
    steps = check_int("steps_per_call", steps_per_call, minimum=1)
    check_fits_positions(model, int(lengths.max()), n_max)
    stops = tuple(tuple(int(t) for t in s) for s in stop_sequences)
    if any(len(s) == 0 for s in stops):
        msg = "stop_sequences must not contain an empty sequence"
        raise ValueError(msg)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    table = _checked_stop_table(stop_table, vocab)
    b = ids.shape[0]
    rows = b * k
    limits = _request_limits(max_new_tokens_per_request, rows, k, n_max)
    eos, pad = _eos_and_pad(model, eos_ids, pad_id)
    buckets = slot_buckets(min(rows, DEFAULT_MAX_SLOTS) if num_slots is None else num_slots)
    buckets = slot_buckets(buckets[0], slot_levels)
    s_max = buckets[0]
    width = ids.shape[1] if prompt_buckets is None else bucket_length(ids.shape[1], prompt_buckets)
    extra = width - ids.shape[1]
    ids = np.pad(ids, ((0, 0), (extra, 0)), constant_values=pad)
    mask = np.pad(mask, ((0, 0), (extra, 0)))
    greedy = temperature == 0

    graphdef, state = _per_layer_split(model)
    store_rows = 1 << (-(-s_max // k)).bit_length()  # a power of two >= ceil(S / K) + 1
    store, hidden_store = _init_store(graphdef, state, rows=store_rows, width=width)
    held = {"store": store, "hidden": hidden_store}

    def run_prefill(p_ids: np.ndarray, p_mask: np.ndarray, p_rows: list[int]) -> None:
        held["store"], held["hidden"] = _prefill(
            graphdef,
            state,
            held["store"],
            held["hidden"],
            jnp.asarray(p_ids),
            jnp.asarray(p_mask),
            jnp.asarray(p_rows, jnp.int32),
        )

    prompts = _PromptStore(run_prefill, ids, mask, store_rows)
    g_min = width_bucket(max(steps, _MIN_COMPLETION_COLUMNS), n_max, 1)
    gen_width = width_bucket(min(n_max, steps), n_max, g_min)
    window = max((len(s) for s in stops), default=1)
    slots = _init_slots(graphdef, state, slots=s_max, width=width + gen_width, window=window)
    n_slots = s_max

    tokens = np.full((rows, n_max), pad, np.int32)
    log_probs = np.zeros((rows, n_max), np.float32)
    completion_mask = np.zeros((rows, n_max), np.int32)
    truncated = np.zeros((rows,), bool)
    settings = dict(
        steps=steps,
        greedy=greedy,
        top_k=top_k,
        use_top_p=top_p < 1.0,
        eos_ids=eos,
        stop_sequences=stops,
        pad_id=pad,
    )
    temp = jnp.asarray(1.0 if greedy else temperature, jnp.float32)
    nucleus = jnp.asarray(top_p, jnp.float32)
    queue: list[int] = []
    next_request, finished = 0, 0
    live_req = np.full((n_slots,), -1)
    live_ngen = np.zeros((n_slots,), np.int64)
    while finished < rows:
        while len(queue) < s_max and next_request < rows:
            queue.append(next_request)
            next_request += 1
        prompts.hold(list(dict.fromkeys(r // k for r in queue)))
        more = next_request < rows
        # Shapes for this call: slots compacted once nothing waits, columns for the longest.
        live = live_req >= 0
        target_slots = n_slots
        if not queue and not more:
            target_slots = min(s for s in buckets if s >= max(int(live.sum()), 1))
        longest = int(live_ngen[live].max()) if live.any() else 0
        want = width_bucket(min(n_max, longest + steps), n_max, g_min)
        if want > gen_width or 2 * want <= gen_width or target_slots != n_slots:
            take = np.flatnonzero(live) if target_slots != n_slots else np.arange(n_slots)
            take = np.concatenate([take, np.full(target_slots - take.size, -1)])
            gen_width = max(want, gen_width) if want > gen_width else want
            slots = _relayout(slots, jnp.asarray(take, jnp.int32), width=width + gen_width)
            live_req = np.where(take >= 0, live_req[np.maximum(take, 0)], -1)
            live_ngen = live_ngen[np.maximum(take, 0)]
            n_slots = target_slots
        smaller = [s for s in buckets if s < n_slots]
        pending = {
            "req": jnp.asarray(_padded(queue, s_max), jnp.int32),
            "row": jnp.asarray(_padded([prompts.row_of[r // k] for r in queue], s_max), jnp.int32),
            "limit": jnp.asarray(_padded([int(limits[r]) for r in queue], s_max), jnp.int32),
            "count": jnp.asarray(len(queue), jnp.int32),
        }
        slots, out, summary = _decode_chunk(
            graphdef,
            state,
            slots,
            held["store"],
            held["hidden"],
            pending,
            key,
            temp,
            nucleus,
            table,
            jnp.asarray(more),
            jnp.asarray(smaller[0] if smaller else -1, jnp.int32),
            **settings,
        )
        out, summary = jax.device_get((out, summary))
        emitted = out["req"] >= 0
        r, t = out["req"][emitted], out["pos"][emitted]
        tokens[r, t] = out["token"][emitted]
        log_probs[r, t] = out["logp"][emitted]
        completion_mask[r, t] = 1
        ended = emitted & out["end"]
        truncated[out["req"][ended]] = out["truncated"][ended]
        finished += int(ended.sum())
        queue = queue[int(summary["consumed"]) :]
        live_req, live_ngen = summary["req"], summary["ngen"]

    rep_ids, rep_mask = np.repeat(ids, k, axis=0), np.repeat(mask, k, axis=0)
    return SamplerOutput(
        prompt_ids=jnp.asarray(rep_ids),
        prompt_mask=jnp.asarray(rep_mask),
        completion_ids=jnp.asarray(tokens),
        completion_mask=jnp.asarray(completion_mask),
        log_probs=jnp.asarray(log_probs),
        truncated=jnp.asarray(truncated),
        lengths=jnp.asarray(completion_mask.sum(axis=1, dtype=np.int32)),
    )


def _padded(values: list[int], size: int) -> np.ndarray:
    out = np.zeros((size,), np.int64)
    out[: len(values)] = values
    return out
