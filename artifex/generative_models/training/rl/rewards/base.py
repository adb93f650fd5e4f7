"""The reward-function protocol, its error type, and helpers shared by the built-in rewards.

A reward function is a plain callable

    ``f(prompts: list[str], completions: list[str], **columns) -> list[float | None]``

called once per rollout batch on the decoded text. ``columns`` are the dataset's other fields
(for example ``answer``), passed as keyword lists already repeated per generation, so row ``i``
of ``prompts``, ``completions`` and of every column belongs to the same sample: generation
``i % G`` of prompt ``i // G``, as in the rest of the batch. The rollout also passes
``completion_length``, the number of completion tokens of each row. ``None`` means "no reward
for this sample"; it becomes NaN in the combined reward array, which the advantage stage treats
as missing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from artifex.generative_models.utils.validation import check_float, check_str

__all__ = ["RewardFunction", "RewardFunctionError", "reward_names"]

# --------------------------------------------------------------------------------------------
# Protocol and errors
# --------------------------------------------------------------------------------------------


@runtime_checkable
class RewardFunction(Protocol):
    """A reward function: decoded prompts and completions (plus dataset columns) to rewards.

    Any callable with this signature is a reward function; nothing needs to subclass this
    protocol. All lists have the same length ``B`` and row ``i`` of each belongs to the same
    sample. The function returns ``B`` rewards (a list, tuple or 1-D NumPy array) where ``None``
    (or NaN) means "no reward for this sample": it is left out of the combination. Infinite
    rewards are rejected. A function's name in logs and errors is its ``__name__`` (see
    :func:`reward_names`).

    Examples:
        >>> def exact_match(prompts, completions, answer, **columns):
        ...     return [float(c.strip() == a) for c, a in zip(completions, answer)]
        >>> exact_match(["1+1=", "1+1="], ["2", " 3"], answer=["2", "2"])
        [1.0, 0.0]
    """

    def __call__(
        self, prompts: list[str], completions: list[str], **columns: Any
    ) -> Sequence[float | None] | np.ndarray:
        """Scores a batch of completions.

        Args:
            prompts: ``B`` decoded prompts (each repeated once per generation).
            completions: ``B`` decoded completions.
            **columns: dataset columns, each a list of ``B`` values aligned with ``completions``.

        Returns:
            ``B`` rewards, ``None`` where the sample gets no reward.
        """
        ...


class RewardFunctionError(RuntimeError):
    """An exception raised inside a reward function, re-raised with the function and row.

    The original exception is chained as ``__cause__``.

    Args:
        message: The error message.
        function_name: Name of the failing reward function.
        function_index: Its position in the list of reward functions.
        row: The first failing row, or ``None``.

    Attributes:
        function_name: name of the failing reward function (see :func:`reward_names`).
        function_index: its position in the list of reward functions.
        row: the first batch row on which the function fails when called on that row alone,
            or ``None`` when the failure could not be traced to a single row.

    Examples:
        >>> from artifex.generative_models.training.rl import RewardFunctionError
        >>> err = RewardFunctionError("exact_match failed", function_name="exact_match",
        ...                           function_index=0, row=3)
        >>> isinstance(err, RuntimeError), err.function_name, err.row
        (True, 'exact_match', 3)
    """

    def __init__(
        self, message: str, *, function_name: str, function_index: int, row: int | None
    ) -> None:
        super().__init__(message)
        self.function_name = function_name
        self.function_index = function_index
        self.row = row


def callable_name(func: Callable[..., Any]) -> str:
    """The display name of one callable: ``__name__``, the wrapped function, or its type."""
    if isinstance(func, functools.partial):
        return callable_name(func.func)
    name = getattr(func, "__name__", None)
    if isinstance(name, str) and name:
        return name
    return type(func).__name__


def reward_names(funcs: Sequence[Callable[..., Any]]) -> list[str]:
    """Unique display names of reward functions, for logging and error messages.

    A function's name is its ``__name__`` (the wrapped function's for a ``functools.partial``,
    the class name for a callable object without one). Repeated names get a suffix: the second
    ``"format_reward"`` becomes ``"format_reward_2"``, the third ``"format_reward_3"``.

    Args:
        funcs: the reward functions, in order.

    Returns:
        One unique name per function, in the same order.

    Examples:
        >>> import functools
        >>> from artifex.generative_models.training.rl import reward_names
        >>> def score(prompts, completions, scale=1.0, **columns):
        ...     return [scale] * len(completions)
        >>> reward_names([score, functools.partial(score, scale=2.0), score])
        ['score', 'score_2', 'score_3']
    """
    names: list[str] = []
    seen: set[str] = set()
    counts: dict[str, int] = {}
    for func in funcs:
        base = callable_name(func)
        name = base
        counts[base] = counts.get(base, 0) + 1
        suffix = counts[base]
        while name in seen:
            name = f"{base}_{suffix}"
            suffix += 1
        seen.add(name)
        names.append(name)
    return names


# --------------------------------------------------------------------------------------------
# Helpers of the built-in reward factories
# --------------------------------------------------------------------------------------------


def _column(columns: Mapping[str, Any], key: str, size: int, func_name: str) -> Sequence[Any]:
    if key not in columns:
        msg = f"{func_name} needs the dataset column {key!r}, got columns {sorted(columns)}"
        raise ValueError(msg)
    values = columns[key]
    if len(values) != size:
        msg = f"{func_name}: column {key!r} has {len(values)} entries, expected {size}"
        raise ValueError(msg)
    return values


def _check_reward_value(value: float, field: str) -> float:
    return check_float(field, value)


def _check_name(name: str) -> str:
    return check_str("name", name)
