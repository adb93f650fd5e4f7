"""How many microbatches an update runs in, and the checks of that number.

An update may accumulate its gradient over equal row slices of the batch (inside the compiled
step): the same update with smaller temporaries. :func:`auto_num_microbatches` is the trainer's
default on the CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["MIN_MICROBATCH_TOKENS", "auto_num_microbatches", "check_microbatches"]


# On the CPU the update runs, by default, in the most microbatches of whole prompt groups that
# keep at least this many token positions each (see ``auto_num_microbatches``).
MIN_MICROBATCH_TOKENS = 512


def auto_num_microbatches(
    rows: int,
    group_size: int,
    prompt_width: int,
    completion_width: int,
    *,
    shared_prompts: bool = True,
    min_tokens: int = MIN_MICROBATCH_TOKENS,
) -> int:
    """The most microbatches of a batch's rows that keep ``min_tokens`` token positions each.

    A microbatch is a slice of whole prompt groups when the prompts are shared (so each group's
    prompt is still encoded once), any equal slice of rows otherwise; its token positions are
    ``r * completion_width + (r / group_size) * prompt_width`` for ``r`` rows with shared
    prompts, ``r * (prompt_width + completion_width)`` without. Splitting changes nothing in
    the update (advantages and the loss normalizer come from the whole batch) but the size of
    the step's temporaries, which on the CPU are mapped anew at every run of the step; slices
    below ``min_tokens`` positions are slower again (matrix products of too few rows).

    Args:
        rows: The batch's rows.
        group_size: Rows per prompt group.
        prompt_width: Prompt tokens per row (the padded width).
        completion_width: Completion tokens per row (the padded width).
        shared_prompts: Whether the rows of a group share their prompt (encoded once).
        min_tokens: The fewest token positions a microbatch may have.

    Returns:
        The number of microbatches, >= 1 (1 when even two would be too small).

    Raises:
        ValueError: If an argument is not an int >= 1 (``prompt_width``: >= 0), or
            ``group_size`` does not divide ``rows`` with ``shared_prompts``.

    Examples:
        >>> from artifex.generative_models.training.rl import auto_num_microbatches
        >>> auto_num_microbatches(32, 4, 32, 96)  # 4 slices of 2 groups, 832 positions each
        4
        >>> auto_num_microbatches(16, 4, 64, 64)  # 2 slices of 640 positions
        2
        >>> auto_num_microbatches(8, 4, 16, 32)   # 320 positions in all: one piece
        1
    """
    for name, value, least in (
        ("rows", rows, 1),
        ("group_size", group_size, 1),
        ("prompt_width", prompt_width, 0),
        ("completion_width", completion_width, 1),
        ("min_tokens", min_tokens, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
            msg = f"auto_num_microbatches: {name} must be an int >= {least}, got {value!r}"
            raise ValueError(msg)
    if shared_prompts and rows % group_size:
        msg = (
            f"auto_num_microbatches: group_size={group_size} must divide rows={rows} when the "
            "prompts are shared"
        )
        raise ValueError(msg)
    best = 1
    for m in range(2, rows + 1):
        if rows % m:
            continue
        r = rows // m
        if shared_prompts:
            if r % group_size:
                continue
            tokens = r * completion_width + (r // group_size) * prompt_width
        else:
            tokens = r * (prompt_width + completion_width)
        if tokens >= min_tokens:
            best = m
    return best


def check_microbatches(num_microbatches: Any, rows: int) -> None:
    """Raises unless ``num_microbatches`` is an int >= 1 that divides ``rows``.

    Args:
        num_microbatches: The number of microbatches asked for.
        rows: The batch's rows.

    Raises:
        ValueError: Naming the value and the rows.

    Examples:
        >>> from artifex.generative_models.training.rl.update.microbatches import (
        ...     check_microbatches)
        >>> check_microbatches(2, 8)
        >>> check_microbatches(3, 8)
        Traceback (most recent call last):
            ...
        ValueError: num_microbatches must be an int >= 1 dividing the 8 batch rows, got 3
    """
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or num_microbatches < 1
        or rows % num_microbatches
    ):
        msg = (
            f"num_microbatches must be an int >= 1 dividing the {rows} batch rows, "
            f"got {num_microbatches!r}"
        )
        raise ValueError(msg)
