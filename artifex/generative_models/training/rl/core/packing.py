r"""Packing a GRPO batch's sequences into rows without padding, for the update.

A :class:`~artifex.generative_models.training.rl.core.batch.GRPOBatch` pads every completion to the
longest one; when completion lengths run from tens to thousands of tokens most of the update's
token positions are padding. :func:`pack_batch` lays the real tokens of a batch out in ``R``
rows of ``L`` tokens instead, and :func:`packed_causal_lm_log_probs` computes the per-token
log-probs and entropies of the padded ``(B, T)`` layout from one pass over the packed rows, so
the objective (and every metric) is computed exactly as for the padded batch.

Layout. A *unit* is a prompt's real tokens followed by one or more of its completions (each
completion up to its last counted token): with prompts shared within groups
(``GRPOBatch.shared_prompts``), a unit holds as many of a group's completions as fit in the
row, so a prompt is encoded once per row its group spans instead of once per completion.
Units are placed first-fit into rows. In each row, ``segment_ids`` number the units (0 on
padding) and ``branch_ids`` mark a unit's prompt (0) and its completions (1, 2, ...); a token
attends to the earlier tokens of its unit's prompt and of its own completion only
(``CausalLM.packed_hidden_states``), at the positions it has in the padded batch (prompt
positions from 0, a completion's from the prompt's length), so each token's hidden state is
the padded batch's, up to rounding. The log-prob of completion token ``t`` comes from the
hidden state of token ``t - 1`` (of the prompt's last token for ``t = 0``), as in
:func:`~artifex.generative_models.training.rl.core.logprobs.causal_lm_log_probs`.

Shapes. ``L`` is the padded width ``P + T`` unless given, so every sequence fits; ``R``, the
rows needed, is rounded up to :func:`row_bucket` (a quarter of a power of two), so one
compiled update serves many batches. With ``num_microbatches = A`` each of the ``A`` equal row
slices is packed into its own ``R / A`` rows, so that the update's microbatch split cuts the
packed rows where it cuts the batch.

:func:`padding_fraction` and :func:`should_pack` are the rule a trainer uses to choose:
pack when the padding would be more than a threshold of the padded batch's positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.logprobs import (
    LogProbFn,
    causal_lm_log_probs_fn,
    chunked_token_log_probs,
)
from artifex.generative_models.utils.validation import check_float, check_int, check_remat

__all__ = [
    "DEFAULT_PACKING_THRESHOLD",
    "PackedGRPOBatch",
    "PackedLayout",
    "pack_batch",
    "packed_causal_lm_log_probs",
    "packed_log_prob_fn",
    "padding_fraction",
    "row_bucket",
    "should_pack",
]

#: Pack when more than this fraction of the padded batch's token positions is padding.
DEFAULT_PACKING_THRESHOLD = 0.5


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each token of a batch sits in the packed rows, and what each position predicts.

    Flat indices: into ``concatenate([prompt_ids, completion_ids], 1)`` flattened (sources),
    into ``completion_ids`` flattened (targets), into the packed rows flattened (``R * L``
    positions), or into those positions followed by one position per batch row (log-probs).

    Attributes:
        input_source: ``(R, L)`` int32, the token at each packed position (0 on padding).
        positions: ``(R, L)`` int32 RoPE positions (the padded batch's).
        segment_ids: ``(R, L)`` int32 unit number within the row, from 1; 0 on padding.
        branch_ids: ``(R, L)`` int32, 0 on a unit's prompt, ``k`` on its ``k``-th completion.
        target_source: ``(R, L)`` int32, the completion token a packed position predicts (0
            where it predicts none that is kept).
        first_source: ``(B,)`` int32, the packed position of the last prompt token before
            completion ``i`` (its first token's predictor).
        token_source: ``(B, T)`` int32, where completion token ``(i, t)``'s log-prob is: packed
            position ``p < R * L``, or ``R * L + i`` for ``t = 0``; -1 after the completion's
            last counted token (log-prob and entropy 0 there).

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl import GRPOBatch, pack_batch
        >>> batch = GRPOBatch(prompt_ids=np.array([[0, 7], [0, 7]]),
        ...                   prompt_mask=np.array([[0, 1], [0, 1]]),
        ...                   completion_ids=np.array([[3, 4, 0], [5, 0, 0]]),
        ...                   completion_mask=np.array([[1, 1, 0], [1, 0, 0]]),
        ...                   rewards=np.zeros(2), group_size=2, shared_prompts=True)
        >>> layout = pack_batch(batch).layout
        >>> layout.input_source[0, :4].tolist(), layout.branch_ids[0, :4].tolist()
        ([1, 2, 3, 7], [0, 1, 1, 2])
    """

    input_source: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    branch_ids: jax.Array
    target_source: jax.Array
    first_source: jax.Array
    token_source: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedGRPOBatch(GRPOBatch):
    """A :class:`GRPOBatch` with the :class:`PackedLayout` of its tokens.

    Every field and method is the batch's; a log-prob function built by
    :func:`packed_log_prob_fn` reads ``layout`` and runs the model over the packed rows.

    Attributes:
        prompt_ids: As in :class:`GRPOBatch`.
        completion_ids: As in :class:`GRPOBatch`.
        completion_mask: As in :class:`GRPOBatch`.
        rewards: As in :class:`GRPOBatch`.
        prompt_mask: As in :class:`GRPOBatch`.
        old_log_probs: As in :class:`GRPOBatch`.
        ref_log_probs: As in :class:`GRPOBatch`.
        advantages: As in :class:`GRPOBatch`.
        step_rewards: As in :class:`GRPOBatch`.
        group_ids: As in :class:`GRPOBatch`.
        sampler_log_probs: As in :class:`GRPOBatch`.
        teacher_log_probs: As in :class:`GRPOBatch`.
        conditioning: As in :class:`GRPOBatch`.
        routed_experts: As in :class:`GRPOBatch` (not replayed in packed rows).
        group_size: As in :class:`GRPOBatch`.
        shared_prompts: As in :class:`GRPOBatch`.
        layout: The packing (:func:`pack_batch`).

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl import GRPOBatch, pack_batch
        >>> batch = GRPOBatch(prompt_ids=np.array([[5], [5]]), completion_ids=np.ones((2, 4)),
        ...                   completion_mask=np.array([[1, 1, 0, 0], [1, 0, 0, 0]]),
        ...                   rewards=np.zeros(2), group_size=2)
        >>> packed = pack_batch(batch)
        >>> type(packed).__name__, packed.layout.input_source.shape  # 1 row of P + T = 5
        ('PackedGRPOBatch', (1, 5))
    """

    layout: PackedLayout | None = None


def row_bucket(rows: int) -> int:
    """``rows`` rounded up to 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, ...

    Four sizes per power of two: at most a quarter more rows than needed.

    Args:
        rows: Rows needed (>= 1).

    Returns:
        The bucket.

    Raises:
        ValueError: ``rows < 1``.

    Examples:
        >>> from artifex.generative_models.training.rl import row_bucket
        >>> [row_bucket(n) for n in (1, 7, 9, 17, 33)]
        [1, 7, 10, 20, 40]
    """
    check_int("rows", rows, minimum=1)
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def _host(x: Any, name: str) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        msg = f"pack_batch needs {name} on this host; it is spread over several processes"
        raise ValueError(msg)
    return np.asarray(x)


def _lengths(batch: GRPOBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Real prompt-token columns (as a mask), prompt lengths and completion lengths."""
    comp = _host(batch.completion_mask, "completion_mask") > 0
    t = comp.shape[1]
    ids_shape = np.shape(batch.prompt_ids)
    if len(ids_shape) != 2 or not np.issubdtype(np.dtype(batch.prompt_ids.dtype), np.integer):
        msg = f"pack_batch needs (B, P) integer prompt_ids (a causal LM batch), got {ids_shape}"
        raise ValueError(msg)
    if batch.prompt_mask is None:
        prompt = np.ones(ids_shape, bool)
    else:
        prompt = _host(batch.prompt_mask, "prompt_mask") > 0
    # A completion runs up to its last counted token (tokens inside it stay as context).
    last = np.where(comp.any(axis=1), t - np.argmax(comp[:, ::-1], axis=1), 0)
    plen = prompt.sum(axis=1)
    empty = np.flatnonzero((plen == 0) & (last > 0))
    if empty.size:
        msg = (
            f"pack_batch: row {int(empty[0])} has completion tokens but no real prompt token "
            "to predict the first one from"
        )
        raise ValueError(msg)
    return prompt, plen, last


def padding_fraction(batch: GRPOBatch) -> float:
    """The fraction of the padded update's token positions that hold no real token.

    Counts ``B * (P + T)`` positions (``P * B / G + T * B`` with prompts shared within
    groups) against the real prompt tokens and the completion tokens up to each row's last
    counted one.

    Args:
        batch: A causal-LM batch whose masks are on this host.

    Returns:
        A number in ``[0, 1)``.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl import GRPOBatch, padding_fraction
        >>> batch = GRPOBatch(prompt_ids=np.ones((2, 2), np.int32),
        ...                   completion_ids=np.ones((2, 6), np.int32),
        ...                   completion_mask=np.array([[1] * 6, [1, 0, 0, 0, 0, 0]]),
        ...                   rewards=np.zeros(2), group_size=2)
        >>> padding_fraction(batch)  # 4 + 7 real of 16
        0.3125
    """
    prompt, plen, last = _lengths(batch)
    b, p = prompt.shape
    t = np.shape(batch.completion_ids)[1]
    g = batch.group_size
    if batch.shared_prompts:
        total, real = (b // g) * p + b * t, plen[::g].sum() + last.sum()
    else:
        total, real = b * (p + t), plen.sum() + last.sum()
    return float(1.0 - real / total)


def should_pack(batch: GRPOBatch, threshold: float = DEFAULT_PACKING_THRESHOLD) -> bool:
    """Whether to pack ``batch``: a causal-LM batch with more padding than ``threshold``.

    Args:
        batch: The batch (its masks must be on this host).
        threshold: Fraction of padding positions in ``[0, 1]`` above which packing pays.

    Returns:
        The decision; False for batches that cannot be packed (non-token prompts, groups given
        by ``group_ids``, masks spread over processes).

    Raises:
        ValueError: ``threshold`` outside ``[0, 1]``.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl import GRPOBatch, should_pack
        >>> batch = GRPOBatch(prompt_ids=np.ones((2, 2), np.int32),
        ...                   completion_ids=np.ones((2, 6), np.int32),
        ...                   completion_mask=np.array([[1] * 6, [1, 0, 0, 0, 0, 0]]),
        ...                   rewards=np.zeros(2), group_size=2)
        >>> should_pack(batch), should_pack(batch, threshold=0.25)
        (False, True)
    """
    check_float("threshold", threshold, minimum=0.0, maximum=1.0)
    if isinstance(batch, PackedGRPOBatch) or batch.group_ids is not None:
        return False
    if np.ndim(batch.prompt_ids) != 2 or not np.issubdtype(batch.prompt_ids.dtype, np.integer):
        return False
    leaves = (batch.completion_mask, batch.prompt_mask)
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
        return False
    return padding_fraction(batch) > threshold


def _place(
    units: list[tuple[int, list[int]]], plen: np.ndarray, last: np.ndarray, width: int
) -> list[list[tuple[int, list[int]]]]:
    """First-fit of ``units`` (prompt row, completion rows) into rows of ``width`` tokens.

    A completion joins its group's latest unit when that row has room for it; otherwise it
    starts a unit of its own (a copy of the prompt) in the first row with room for both.

    Returns:
        The rows, each a list of ``(prompt row, completion rows)`` units.
    """
    rows: list[list[tuple[int, list[int]]]] = []
    room: list[int] = []
    for prow, completions in units:
        open_row, members = -1, None
        for i in completions:
            n = int(last[i])
            if members is not None and room[open_row] >= n:
                members.append(i)
                room[open_row] -= n
                continue
            need = int(plen[prow]) + n
            r = next((k for k, free in enumerate(room) if free >= need), None)
            if r is None:
                rows.append([])
                room.append(width)
                r = len(rows) - 1
            open_row, members = r, [i]
            rows[r].append((prow, members))
            room[r] -= need
    return rows


def pack_batch(
    batch: GRPOBatch,
    *,
    row_length: int | None = None,
    num_microbatches: int = 1,
    row_multiple: int = 1,
) -> PackedGRPOBatch:
    """Packs the real tokens of ``batch`` into rows (see the module docstring).

    Args:
        batch: A causal-LM :class:`GRPOBatch` whose masks are on this host (its arrays stay
            where they are).
        row_length: ``L``; ``None``: ``P + T``. Must hold the longest prompt plus completion.
        num_microbatches: Pack each of this many equal row slices separately (for an update
            that accumulates over them).
        row_multiple: The rows of each slice are a multiple of this (the data shards of a
            mesh).

    Returns:
        A :class:`PackedGRPOBatch`: the batch and its :class:`PackedLayout`.

    Raises:
        ValueError: A batch with ``group_ids``, non-token prompts, a row with completion
            tokens and no real prompt token, a sequence longer than ``row_length``, or
            ``num_microbatches`` that does not divide ``B``.
        TypeError: An argument of the wrong type.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl import GRPOBatch, pack_batch
        >>> batch = GRPOBatch(prompt_ids=np.array([[1, 2]] * 4),
        ...                   completion_ids=np.ones((4, 6), np.int32),
        ...                   completion_mask=(np.arange(6) < np.array([[6], [1], [2], [1]])),
        ...                   rewards=np.zeros(4), group_size=2, shared_prompts=True)
        >>> layout = pack_batch(batch).layout
        >>> layout.segment_ids.shape  # [p p 6 tokens], [p p 1 token | p p 2 tokens 1 token]
        (2, 8)
        >>> layout.segment_ids[1].tolist(), layout.branch_ids[1].tolist()
        ([1, 1, 1, 2, 2, 2, 2, 2], [0, 0, 1, 0, 0, 1, 1, 2])
    """
    if isinstance(batch, PackedGRPOBatch):
        msg = "pack_batch: the batch is packed already"
        raise TypeError(msg)
    if batch.group_ids is not None:
        msg = "pack_batch: batches with group_ids (groups of different sizes) are not supported"
        raise ValueError(msg)
    a = check_int("num_microbatches", num_microbatches, minimum=1)
    check_int("row_multiple", row_multiple, minimum=1)
    prompt, plen, last = _lengths(batch)
    b, p = prompt.shape
    t = int(np.shape(batch.completion_ids)[1])
    width = p + t if row_length is None else check_int("row_length", row_length, minimum=1)
    longest = int((plen + last).max())
    if longest > width:
        msg = f"pack_batch: row_length={width} is shorter than the longest sequence ({longest})"
        raise ValueError(msg)
    if b % a:
        msg = f"pack_batch: num_microbatches={a} must divide the {b} batch rows"
        raise ValueError(msg)
    size, g = b // a, batch.group_size
    shared = bool(batch.shared_prompts) and size % g == 0
    slices = []
    for m in range(a):
        rows = range(m * size, (m + 1) * size)
        if shared:
            units = [(j, [i for i in range(j, j + g) if last[i] > 0]) for j in rows[::g]]
        else:
            units = [(i, [i]) for i in rows if last[i] > 0]
        slices.append(_place([u for u in units if u[1]], plen, last, width))
    per = max(max((len(s) for s in slices), default=1), 1)
    per = -(-row_bucket(per) // row_multiple) * row_multiple
    layout = _fill(slices, prompt, plen, last, size, per, width, p, t)
    return PackedGRPOBatch(
        **{f.name: getattr(batch, f.name) for f in dataclasses.fields(GRPOBatch)},
        layout=PackedLayout(**{k: jnp.asarray(v) for k, v in layout.items()}),
    )


def _fill(
    slices: list[list[list[tuple[int, list[int]]]]],
    prompt: np.ndarray,
    plen: np.ndarray,
    last: np.ndarray,
    size: int,
    per: int,
    width: int,
    p: int,
    t: int,
) -> dict[str, np.ndarray]:
    """The layout arrays of the placed units; indices local to each microbatch slice."""
    a = len(slices)
    shape = (a * per, width)
    out = {
        name: np.zeros(shape, np.int32)
        for name in ("input_source", "positions", "segment_ids", "branch_ids", "target_source")
    }
    first = np.zeros((a * size,), np.int32)
    token = np.full((a * size, t), -1, np.int32)
    for m, rows in enumerate(slices):
        base = m * size  # the slice's first batch row
        for r, units in enumerate(rows):
            row = m * per + r
            col = 0
            for u, (prow, completions) in enumerate(units, start=1):
                local = prow - base
                n_p = int(plen[prow])
                cols = np.flatnonzero(prompt[prow])
                span = slice(col, col + n_p)
                out["input_source"][row, span] = local * (p + t) + cols
                out["positions"][row, span] = np.arange(n_p)
                out["segment_ids"][row, span] = u
                prompt_last = r * width + col + n_p - 1  # flat, within the slice
                col += n_p
                for k, i in enumerate(completions, start=1):
                    n = int(last[i])
                    span = slice(col, col + n)
                    li = i - base
                    out["input_source"][row, span] = li * (p + t) + p + np.arange(n)
                    out["positions"][row, span] = n_p + np.arange(n)
                    out["segment_ids"][row, span] = u
                    out["branch_ids"][row, span] = k
                    # position of token s predicts token s + 1 (the last predicts nothing kept)
                    out["target_source"][row, col : col + n - 1] = li * t + np.arange(1, n)
                    first[base + li] = prompt_last
                    token[base + li, 0] = per * width + li
                    token[base + li, 1:n] = r * width + col + np.arange(n - 1)
                    col += n
    return {**out, "first_source": first, "token_source": token}


def packed_causal_lm_log_probs(
    model: Any,
    batch: PackedGRPOBatch,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    remat: bool | int = False,
    scan_layers: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs and entropies ``(B, T)`` of a packed batch's completions.

    The values of :func:`~artifex.generative_models.training.rl.core.logprobs.causal_lm_log_probs`
    on the padded batch up to rounding (0 after each completion's last counted token), from one
    pass of ``model.packed_hidden_states`` over the ``R x L`` packed rows and the output
    projection of their positions plus one per row (the first completion token's predictor).

    Args:
        model: A causal LM with ``packed_hidden_states`` and ``output_embedding`` (and
            optionally ``output_embedding_rows``).
        batch: A :class:`PackedGRPOBatch`.
        chunk_size: Rows per logits chunk (see ``chunked_token_log_probs``).
        temperature: Logits are divided by it.
        remat: Rematerialize the decoder layers (see ``causal_lm_log_probs``).
        scan_layers: Run the layers as one ``lax.scan`` (see ``causal_lm_log_probs``).

    Returns:
        ``(log_probs, entropy)``, each ``(B, T)`` float32.

    Raises:
        TypeError: A batch without a layout, or a model without ``packed_hidden_states``.

    Examples:
        >>> import numpy as np, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl import (
        ...     GRPOBatch, causal_lm_log_probs, pack_batch, packed_causal_lm_log_probs)
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> batch = GRPOBatch(prompt_ids=jnp.array([[0, 3, 4], [5, 6, 7]]),
        ...                   prompt_mask=jnp.array([[0, 1, 1], [1, 1, 1]]),
        ...                   completion_ids=jnp.array([[1, 2, 9], [3, 0, 0]]),
        ...                   completion_mask=jnp.array([[1, 1, 1], [1, 0, 0]]),
        ...                   rewards=jnp.zeros(2), group_size=2)
        >>> packed, _ = packed_causal_lm_log_probs(model, pack_batch(batch))
        >>> padded, _ = causal_lm_log_probs(model, batch.prompt_ids, batch.completion_ids,
        ...                                 prompt_mask=batch.prompt_mask)
        >>> bool(jnp.allclose(packed * batch.completion_mask, padded * batch.completion_mask,
        ...                   atol=1e-5))
        True
    """
    layout = getattr(batch, "layout", None)
    if layout is None:
        msg = "packed_causal_lm_log_probs needs a PackedGRPOBatch (pack_batch)"
        raise TypeError(msg)
    if not callable(getattr(model, "packed_hidden_states", None)):
        msg = f"packed log-probs need a model with packed_hidden_states; got {type(model).__name__}"
        raise TypeError(msg)
    remat = check_remat("remat", remat)
    options: dict[str, Any] = {"remat": remat} if remat else {}
    if scan_layers and callable(getattr(model, "layer_stack", None)):
        stack = model.layer_stack()
        if stack is not None:
            options["layer_stack"] = stack
    prompt_ids = jnp.asarray(batch.prompt_ids, jnp.int32)
    completion_ids = jnp.asarray(batch.completion_ids, jnp.int32)
    tokens = jnp.concatenate([prompt_ids, completion_ids], axis=1).reshape(-1)
    ids = jnp.take(tokens, layout.input_source, axis=0)
    hidden = model.packed_hidden_states(
        ids, layout.positions, layout.segment_ids, layout.branch_ids, **options
    )
    flat = hidden.reshape(-1, hidden.shape[-1])
    hidden = jnp.concatenate([flat, jnp.take(flat, layout.first_source, axis=0)], axis=0)
    targets = jnp.concatenate(
        [
            jnp.take(completion_ids.reshape(-1), layout.target_source.reshape(-1)),
            completion_ids[:, 0],
        ]
    )
    rows = getattr(model, "output_embedding_rows", None)
    weight = rows() if callable(rows) else None
    transposed = weight is not None
    if weight is None:
        weight = model.output_embedding()
    # Soft-capped logits (Gemma): the cap first, the temperature after, as the sampler does.
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if temperature != 1.0 and softcap is None:
        hidden = hidden / jnp.asarray(temperature, hidden.dtype)
    log_probs, entropy = chunked_token_log_probs(
        hidden,
        weight,
        targets,
        chunk_size=chunk_size,
        transposed=transposed,
        softcap=softcap,
        temperature=1.0 if softcap is None else temperature,
    )
    kept = layout.token_source >= 0
    where = jnp.maximum(layout.token_source, 0)
    log_probs = jnp.where(kept, jnp.take(log_probs, where), 0.0)
    return log_probs, jnp.where(kept, jnp.take(entropy, where), 0.0)


def packed_log_prob_fn(
    base: LogProbFn | None = None,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    remat: bool | int = False,
    scan_layers: bool = False,
) -> LogProbFn:
    """A log-prob function that runs packed batches packed and every other batch as ``base``.

    Args:
        base: The log-prob function of unpacked batches (``None``:
            :func:`~artifex.generative_models.training.rl.core.logprobs.causal_lm_log_probs_fn`
            with these options).
        chunk_size: Rows per logits chunk.
        temperature: The sampling temperature (logits are divided by it).
        remat: Rematerialize the decoder layers (True) or every n-th one.
        scan_layers: Run the decoder layers as one ``lax.scan``.

    Returns:
        ``fn(model, batch) -> (log_probs, entropy)``.

    Examples:
        >>> import numpy as np
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl import (
        ...     GRPOBatch, pack_batch, packed_log_prob_fn)
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> batch = GRPOBatch(prompt_ids=np.array([[5, 6]] * 2),
        ...                   completion_ids=np.array([[1, 2, 3], [4, 0, 0]]),
        ...                   completion_mask=np.array([[1, 1, 1], [1, 0, 0]]),
        ...                   rewards=np.zeros(2), group_size=2)
        >>> fn = packed_log_prob_fn()
        >>> a, _ = fn(model, batch)  # padded
        >>> b, _ = fn(model, pack_batch(batch))  # packed
        >>> bool(np.allclose(a * batch.completion_mask, b * batch.completion_mask, atol=1e-5))
        True
    """
    remat = check_remat("remat", remat)
    if base is None:
        base = causal_lm_log_probs_fn(
            chunk_size=chunk_size, temperature=temperature, remat=remat, scan_layers=scan_layers
        )

    def fn(model: Any, batch: GRPOBatch) -> tuple[jax.Array, jax.Array]:
        if getattr(batch, "layout", None) is None:
            return base(model, batch)
        return packed_causal_lm_log_probs(
            model,
            batch,
            chunk_size=chunk_size,
            temperature=temperature,
            remat=remat,
            scan_layers=scan_layers,
        )

    return fn
