"""Length penalties: DAPO's soft overlong punishment."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from artifex.generative_models.training.rl.rewards.base import (
    RewardFunction,
    _check_name,
    _column,
)
from artifex.generative_models.utils.validation import check_callable, check_int, check_str

__all__ = ["overlong_penalty", "soft_overlong_penalty"]

# --------------------------------------------------------------------------------------------
# DAPO soft overlong punishment
# --------------------------------------------------------------------------------------------


def _check_lengths_config(max_length: int, cache_length: int) -> None:
    check_int("max_length", max_length, minimum=1)
    check_int("cache_length", cache_length, minimum=0, maximum=max_length)


def overlong_penalty(
    lengths: Sequence[float] | np.ndarray, max_length: int, cache_length: int
) -> np.ndarray:
    """DAPO's soft overlong punishment of completion lengths.

    With ``L`` the completion length in tokens, ``L_max = max_length`` and
    ``L_cache = cache_length``:

        ``R(L) = 0                                 if L <= L_max - L_cache``
        ``R(L) = ((L_max - L_cache) - L) / L_cache if L_max - L_cache < L <= L_max``
        ``R(L) = -1                                if L > L_max``

    The penalty falls linearly from 0 to -1 over the last ``L_cache`` tokens. With
    ``cache_length=0`` it is a hard -1 beyond ``L_max``. A completion cut off at
    ``L_max`` tokens gets -1.

    Args:
        lengths: ``(B,)`` non-negative completion lengths in tokens.
        max_length: ``L_max``, a positive int (usually the generation limit).
        cache_length: ``L_cache``, the soft punishment interval, in ``[0, max_length]``.

    Returns:
        ``(B,)`` float64 penalties in ``[-1, 0]``.

    Raises:
        ValueError: if ``lengths`` is not 1-D, negative or not finite, ``max_length <= 0``, or
            ``cache_length`` is outside ``[0, max_length]``.
        TypeError: if ``max_length`` or ``cache_length`` is not an int.

    Examples:
        >>> from artifex.generative_models.training.rl import overlong_penalty
        >>> overlong_penalty([10, 18, 20, 25], max_length=20, cache_length=4).tolist()
        [0.0, -0.5, -1.0, -1.0]

    References:
        Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
        arXiv:2503.14476, 2025, Eq. (13).
    """
    _check_lengths_config(max_length, cache_length)
    try:
        length = np.asarray(lengths, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        msg = f"lengths must be numbers, got {lengths!r}"
        raise ValueError(msg) from exc
    if length.ndim != 1:
        msg = f"lengths must have shape (B,), got shape {length.shape}"
        raise ValueError(msg)
    if not np.all(np.isfinite(length)) or np.any(length < 0):
        msg = f"lengths must be finite and >= 0, got {length.tolist()}"
        raise ValueError(msg)
    start = float(max_length - cache_length)
    ramp = (start - length) / max(cache_length, 1)
    return np.where(length <= start, 0.0, np.where(length <= max_length, ramp, -1.0))


def soft_overlong_penalty(
    max_length: int,
    cache_length: int,
    *,
    length_column: str = "completion_length",
    length_fn: Callable[[str], int] | None = None,
    name: str = "soft_overlong_penalty",
) -> RewardFunction:
    """DAPO's soft overlong punishment as a reward function.

    Each row's reward is :func:`overlong_penalty` of its completion length: 0 up to
    ``max_length - cache_length`` tokens, then falling linearly to -1 at ``max_length``, and
    -1 beyond. Lengths are read from the dataset column ``length_column``; the rollout passes
    ``completion_length``, the number of completion tokens (EOS included, padding excluded).
    Outside the rollout, pass ``length_fn(completion) -> int`` (for example a tokenizer's
    token count); it takes precedence over the column.

    Args:
        max_length: ``L_max``, a positive int.
        cache_length: ``L_cache`` in ``[0, max_length]``.
        length_column: name of the column with completion token counts.
        length_fn: optional ``completion -> length`` used instead of the column.
        name: the returned function's ``__name__``.

    Returns:
        A reward function ``f(prompts, completions, **columns) -> list[float]``.

    Raises:
        ValueError: (here) if ``max_length``/``cache_length`` are out of range or
            ``length_column``/``name`` is empty; (when called) if the column is missing or the
            lengths are invalid.
        TypeError: if ``max_length``/``cache_length`` are not ints, ``length_column``/``name``
            are not strings or ``length_fn`` is not callable.

    Examples:
        >>> from artifex.generative_models.training.rl import soft_overlong_penalty
        >>> reward = soft_overlong_penalty(20, 4)
        >>> reward(["q"] * 3, ["a", "b", "c"], completion_length=[10, 18, 30])
        [0.0, -0.5, -1.0]
        >>> soft_overlong_penalty(4, 2, length_fn=len)(["q", "q"], ["ab", "abc"])
        [0.0, -0.5]

    References:
        Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
        arXiv:2503.14476, 2025, Eq. (13).
    """
    _check_lengths_config(max_length, cache_length)
    check_str("length_column", length_column)
    check_callable("length_fn", length_fn, allow_none=True)
    func_name = _check_name(name)

    def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        if length_fn is not None:
            lengths = [length_fn(completion) for completion in completions]
        elif length_column in columns:
            lengths = list(_column(columns, length_column, len(completions), func_name))
        else:
            msg = (
                f"{func_name} needs the column {length_column!r} of completion token counts "
                f"(or a length_fn), got columns {sorted(columns)}"
            )
            raise ValueError(msg)
        return overlong_penalty(lengths, max_length, cache_length).tolist()

    reward.__name__ = reward.__qualname__ = func_name
    return reward
