"""Combining several reward functions into one reward per sample.

:func:`combine_rewards` (or a :class:`RewardCombiner` that holds the functions, weights and
mode) calls every reward function, validates its output and re-raises any exception as a
:class:`~artifex.generative_models.training.rl.rewards.base.RewardFunctionError` naming the
function and the first failing row. The pure array part of the combination is
:func:`combine_reward_columns`.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.rl.core.advantages import group_stats
from artifex.generative_models.training.rl.rewards.base import (
    RewardFunctionError,
    reward_names,
)
from artifex.generative_models.utils.validation import check_choice, check_float, check_int

__all__ = [
    "CombineMode",
    "CombinedRewards",
    "RewardCombiner",
    "combine_reward_columns",
    "combine_rewards",
]

CombineMode = Literal["sum", "normalized"]

# --------------------------------------------------------------------------------------------
# Combination
# --------------------------------------------------------------------------------------------


class CombinedRewards(NamedTuple):
    """The output of :func:`combine_rewards` (unpacks as ``total, per_function``).

    Attributes:
        total: ``(B,)`` float32 combined reward; NaN where no function gave a reward.
        per_function: ``(B, F)`` float32 raw rewards of each function (unweighted and not
            normalized, for logging); NaN where a function returned ``None``.

    Examples:
        >>> from artifex.generative_models.training.rl import combine_rewards
        >>> total, per_function = combine_rewards(
        ...     [lambda prompts, completions, **c: [1.0, None]], ["q", "q"], ["a", "b"]
        ... )
        >>> total.tolist(), per_function.shape
        ([1.0, nan], (2, 1))
    """

    total: np.ndarray
    per_function: np.ndarray


def _check_mode(mode: str) -> None:
    check_choice("mode", mode, ("sum", "normalized"))


def _check_eps(eps: float) -> None:
    check_float("eps", eps, greater_than=0.0)


def _check_weights(weights: Sequence[float] | np.ndarray | None, num_funcs: int) -> np.ndarray:
    """Validates weights and returns them as float64 ``(F,)`` (ones when ``None``)."""
    if weights is None:
        return np.ones(num_funcs, dtype=np.float64)
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        msg = f"weights must be a sequence of {num_funcs} numbers, got {weights!r}"
        raise TypeError(msg) from exc
    if w.ndim != 1 or w.shape[0] != num_funcs:
        msg = (
            f"weights must have one entry per reward function ({num_funcs}), "
            f"got shape {w.shape}: {weights!r}"
        )
        raise ValueError(msg)
    if not np.all(np.isfinite(w)):
        msg = f"weights must be finite, got {weights!r}"
        raise ValueError(msg)
    return w


def _check_group_size(group_size: int | None, batch_size: int | None) -> int:
    """Returns the normalization group size (the whole batch when ``None``).

    With ``batch_size=None`` only checks that ``group_size`` is a positive int or ``None``.
    """
    size = check_int("group_size", group_size, minimum=1, allow_none=True)
    if size is None:
        return max(batch_size or 0, 1)
    if batch_size is not None and batch_size % size != 0:
        msg = f"group_size must be a positive divisor of the batch size {batch_size}, got {size}"
        raise ValueError(msg)
    return size


@functools.partial(jax.jit, static_argnames=("group_size",))
def _standardized_columns(columns: jax.Array, group_size: int, eps: float) -> jax.Array:
    """``(F, B)`` columns standardized within groups by the shared group-statistics kernel."""
    stats = jax.vmap(lambda column: group_stats(column, group_size, ddof=0))(columns)
    z = stats.centered / (stats.std + eps)
    return jnp.where(jnp.isnan(columns), jnp.nan, z)


def _standardize(per_function: np.ndarray, group_size: int, eps: float) -> np.ndarray:
    """Standardizes each column over its non-NaN entries within groups of ``group_size`` rows.

    ``z = (r - mean) / (std + eps)`` with the population std, computed in float32 by
    :func:`~artifex.generative_models.training.rl.core.group_statistics.group_stats` (the same
    statistics as the advantages): exactly 0 where all the group's values of that column are
    equal; NaN (no reward) stays NaN and is left out of the group's mean and std.
    """
    if per_function.shape[0] == 0:
        return per_function.copy()
    columns = jnp.asarray(per_function.T, jnp.float32)
    z = _standardized_columns(columns, group_size, jnp.float32(eps))
    return np.asarray(z, dtype=np.float64).T


def combine_reward_columns(
    per_function: np.ndarray,
    *,
    weights: Sequence[float] | np.ndarray | None = None,
    mode: CombineMode = "sum",
    group_size: int | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """Combines per-function rewards ``(B, F)`` (NaN = no reward) into one reward per row.

    ``"sum"`` mode is the weighted sum over the functions that gave a value:

        ``total_i = sum_{f : r_if not NaN} w_f * r_if``

    ``"normalized"`` mode (decoupled normalization, as in GDPO) first standardizes each
    function's column ``f`` over the rows ``S`` of a normalization group (the whole batch, or
    each prompt's ``group_size`` consecutive rows), using only its non-NaN entries:

        ``z_if = (r_if - mean_S(r_f)) / (std_S(r_f) + eps)``  (population std)

    with ``z_if = 0`` exactly when all non-NaN ``r_f`` in ``S`` are equal (a constant column
    carries no signal), then ``total_i = sum_{f : r_if not NaN} w_f * z_if``. Standardizing
    each reward before summing keeps a high-variance reward from drowning the others and keeps
    distinct reward combinations distinct. GDPO follows the sum with a batch-wise
    normalization; here that is left to the advantage stage.

    In both modes ``total_i`` is NaN when every function returned ``None`` for row ``i``.
    The group statistics of ``"normalized"`` mode are those of the advantage stage
    (:func:`~artifex.generative_models.training.rl.core.group_statistics.group_stats`, float32,
    NaN left out); the weighted sum is float64; the result is float32.

    Args:
        per_function: ``(B, F)`` rewards, NaN where a function gave no reward.
        weights: ``F`` finite weights (negative weights are allowed); ``None`` means all ones.
        mode: ``"sum"`` or ``"normalized"``.
        group_size: only for ``"normalized"``: standardize within consecutive groups of this
            many rows (a prompt's generations) instead of over the whole batch.
        eps: positive constant added to the standard deviation.

    Returns:
        ``(B,)`` float32 combined rewards.

    Raises:
        ValueError: if ``per_function`` is not 2-D or holds infinities, ``weights`` does not
            have ``F`` finite entries, ``mode`` is unknown, ``eps`` is not positive, or
            ``group_size`` does not divide ``B``.
        TypeError: if ``group_size`` is not an int, ``eps`` not a number, ``mode`` not a
            string or ``weights`` not numbers.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl import combine_reward_columns
        >>> per_function = np.array([[1.0, 0.5], [0.0, np.nan], [np.nan, np.nan]])
        >>> combine_reward_columns(per_function, weights=[1.0, 2.0]).tolist()
        [2.0, 0.0, nan]
        >>> z = combine_reward_columns(np.array([[1.0], [0.0], [1.0], [1.0]]), mode="normalized",
        ...                            group_size=2)
        >>> z.round(3).tolist()  # per group: standardized; a constant group gives 0
        [1.0, -1.0, 0.0, 0.0]

    References:
        Liu et al., "GDPO: Group reward-Decoupled Normalization Policy Optimization for
        Multi-reward RL Optimization", arXiv:2601.05242, 2026.
    """
    _check_mode(mode)
    _check_eps(eps)
    r = np.asarray(per_function, dtype=np.float64)
    if r.ndim != 2:
        msg = f"per_function must have shape (B, F), got shape {r.shape}"
        raise ValueError(msg)
    if np.any(np.isinf(r)):
        msg = "per_function must not contain infinities (use NaN for 'no reward')"
        raise ValueError(msg)
    w = _check_weights(weights, r.shape[1])
    if mode == "normalized":
        r = _standardize(r, _check_group_size(group_size, r.shape[0]), eps)
    valid = ~np.isnan(r)
    total = np.where(valid, r * w, 0.0).sum(axis=1)
    total = np.where(valid.any(axis=1), total, np.nan)
    return total.astype(np.float32)


def _as_batch_list(values: Any, field: str) -> list[Any]:
    if (
        isinstance(values, (str, bytes, Mapping))
        or not hasattr(values, "__len__")
        or not hasattr(values, "__iter__")
    ):
        msg = f"{field} must be a list with one entry per sample, got {type(values).__name__}"
        raise TypeError(msg)
    return list(values)


def _snippet(text: Any, limit: int = 80) -> str:
    s = repr(text)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _locate_failing_row(
    func: Callable[..., Any],
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list[Any]],
) -> int | None:
    """The first row on which ``func`` raises when called on that row alone, else ``None``."""
    for i in range(len(completions)):
        row_columns = {key: value[i : i + 1] for key, value in columns.items()}
        try:
            func(prompts[i : i + 1], completions[i : i + 1], **row_columns)
        except Exception:
            return i
    return None


def _reward_column(values: Any, name: str, batch_size: int) -> np.ndarray:
    """Validates one function's output and converts it to float64 ``(B,)`` with NaN for None."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            msg = (
                f"reward function {name!r} must return a 1-D list or array of {batch_size} "
                f"rewards, got an array of shape {values.shape}"
            )
            raise ValueError(msg)
        items = values.tolist()
    elif isinstance(values, (list, tuple)):
        items = values
    else:
        msg = (
            f"reward function {name!r} must return a list or 1-D array of {batch_size} "
            f"rewards, got {type(values).__name__}"
        )
        raise ValueError(msg)
    if len(items) != batch_size:
        msg = (
            f"reward function {name!r} returned {len(items)} rewards, expected {batch_size} "
            "(one per completion)"
        )
        raise ValueError(msg)
    out = np.empty(batch_size, dtype=np.float64)
    for i, value in enumerate(items):
        if value is None:
            out[i] = np.nan
            continue
        if not isinstance(value, numbers.Real):
            msg = (
                f"reward function {name!r} returned {value!r} ({type(value).__name__}) at row "
                f"{i}, expected a real number or None"
            )
            raise ValueError(msg)
        try:
            x = float(value)
        except OverflowError:
            x = math.inf
        if math.isinf(x):
            msg = (
                f"reward function {name!r} returned a non-finite reward {value!r} at row {i}, "
                "expected a finite number or None ('no reward')"
            )
            raise ValueError(msg)
        out[i] = x  # NaN is kept: it means "no reward", like None
    return out


def combine_rewards(
    funcs: Sequence[Callable[..., Any]],
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    weights: Sequence[float] | np.ndarray | None = None,
    mode: CombineMode = "sum",
    columns: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
    group_size: int | None = None,
    eps: float = 1e-6,
    locate_failing_row: bool = True,
) -> CombinedRewards:
    """Calls every reward function on a batch and combines their rewards.

    Each function is called once as ``f(prompts, completions, **columns)`` and must return
    ``B`` finite numbers or ``None`` ("no reward for this sample", like NaN). The columns are
    combined by :func:`combine_reward_columns`: ``"sum"``,
    ``total_i = sum_{f : r_if not NaN} w_f * r_if``, or ``"normalized"``, the same sum of
    ``(r_if - mean_f) / (std_f + eps)`` over each function's non-NaN entries in the batch (or
    in each group of ``group_size`` rows). ``total_i`` is NaN when every function returned
    ``None`` for row ``i``.

    Args:
        funcs: the reward functions (see :class:`RewardFunction`), at least one.
        prompts: ``B`` decoded prompts.
        completions: ``B`` decoded completions.
        weights: one finite weight per function; ``None`` means all ones.
        mode: ``"sum"`` or ``"normalized"``.
        columns: dataset columns passed as keyword arguments, each with ``B`` entries (the
            rollout adds ``completion_length``, the completion token counts).
        group_size: ``"normalized"`` mode only: standardize within each prompt's group of
            generations rather than over the whole batch.
        eps: positive constant added to the standard deviation in ``"normalized"`` mode.
        locate_failing_row: when a function raises, call it again row by row to find the first
            failing row for the error message. Turn off for expensive or stateful functions.

    Returns:
        ``CombinedRewards(total, per_function)``: ``(B,)`` float32 combined rewards and the
        ``(B, F)`` float32 raw rewards of each function (NaN = no reward).

    Raises:
        RewardFunctionError: if a function raises; the message names the function and the first
            failing row, and the original exception is chained as ``__cause__``.
        ValueError: if a function's output has the wrong length, is not a sequence of finite
            numbers or ``None`` (the message names the function), or if the arguments are out
            of range or disagree in length.
        TypeError: if a function is not callable, ``prompts``, ``completions`` or a column is
            not a list, or an argument has the wrong type.

    Examples:
        >>> from artifex.generative_models.training.rl import combine_rewards
        >>> def correct(prompts, completions, answer, **columns):
        ...     return [float(c == a) for c, a in zip(completions, answer)]
        >>> def short(prompts, completions, **columns):
        ...     return [1.0 if len(c) <= 1 else None for c in completions]
        >>> total, per_function = combine_rewards(
        ...     [correct, short], ["1+1="] * 3, ["2", "3", "22"], weights=[1.0, 0.5],
        ...     columns={"answer": ["2", "2", "2"]})
        >>> total.tolist()
        [1.5, 0.5, 0.0]
        >>> per_function.tolist()
        [[1.0, 1.0], [0.0, 1.0], [0.0, nan]]

    References:
        Liu et al., "GDPO: Group reward-Decoupled Normalization Policy Optimization for
        Multi-reward RL Optimization", arXiv:2601.05242, 2026 (``"normalized"`` mode).
    """
    funcs = list(funcs)
    if not funcs:
        msg = "funcs must contain at least one reward function, got none"
        raise ValueError(msg)
    for j, func in enumerate(funcs):
        if not callable(func):
            msg = f"funcs[{j}] must be a callable reward function, got {type(func).__name__}"
            raise TypeError(msg)
    _check_mode(mode)
    _check_eps(eps)
    w = _check_weights(weights, len(funcs))
    prompt_list = _as_batch_list(prompts, "prompts")
    completion_list = _as_batch_list(completions, "completions")
    batch_size = len(completion_list)
    if len(prompt_list) != batch_size:
        msg = (
            f"prompts and completions must have the same length, got {len(prompt_list)} "
            f"prompts and {batch_size} completions"
        )
        raise ValueError(msg)
    column_lists: dict[str, list[Any]] = {}
    for key, value in (columns or {}).items():
        if key in ("prompts", "completions"):
            msg = f"columns must not be named {key!r}: it is a positional argument"
            raise ValueError(msg)
        column_lists[key] = _as_batch_list(value, f"columns[{key!r}]")
        if len(column_lists[key]) != batch_size:
            msg = (
                f"columns[{key!r}] must have one entry per completion ({batch_size}), "
                f"got {len(column_lists[key])}"
            )
            raise ValueError(msg)
    if mode == "normalized":
        _check_group_size(group_size, batch_size)

    names = reward_names(funcs)
    per_function = np.empty((batch_size, len(funcs)), dtype=np.float64)
    for j, (func, name) in enumerate(zip(funcs, names, strict=True)):
        call_columns = {key: list(value) for key, value in column_lists.items()}
        try:
            values = func(list(prompt_list), list(completion_list), **call_columns)
        except Exception as exc:
            row = None
            if locate_failing_row:
                row = _locate_failing_row(func, prompt_list, completion_list, column_lists)
            where = (
                f"at row {row} (completion {_snippet(completion_list[row])})"
                if row is not None
                else "(not traced to a single row)"
            )
            msg = f"reward function {name!r} raised {type(exc).__name__} {where}: {exc}"
            raise RewardFunctionError(msg, function_name=name, function_index=j, row=row) from exc
        per_function[:, j] = _reward_column(values, name, batch_size)

    total = combine_reward_columns(
        per_function, weights=w, mode=mode, group_size=group_size, eps=eps
    )
    return CombinedRewards(total=total, per_function=per_function.astype(np.float32))


class RewardCombiner:
    """Holds reward functions with their weights and mode, and combines their rewards.

    A thin shell over :func:`combine_rewards`: the arguments are validated once, and calling
    the combiner mirrors the reward-function protocol,
    ``combiner(prompts, completions, group_size=G, **columns) -> CombinedRewards``.

    The group size is passed when calling (the rollout passes its ``num_generations``):
    ``"normalized"`` mode standardizes each function's rewards within each prompt's group of
    ``group_size`` rows, or over the whole batch without one; ``"sum"`` mode ignores it. The
    constructor's ``group_size`` is only a deprecated default for calls that pass none; a call
    that passes a different one raises ``ValueError``.

    Args:
        funcs: the reward functions, at least one.
        weights: one finite weight per function; ``None`` means all ones.
        mode: ``"sum"`` or ``"normalized"`` (see :func:`combine_reward_columns`).
        group_size: deprecated default group size for calls that pass none; pass
            ``group_size`` when calling instead.
        eps: positive constant added to the standard deviation.
        locate_failing_row: re-run a failing function row by row to name the failing row.

    Raises:
        ValueError: if ``funcs`` is empty, ``weights`` has the wrong length or non-finite
            entries, or ``mode``/``eps``/``group_size`` are out of range.
        TypeError: if an entry of ``funcs`` is not callable, or ``group_size``, ``eps`` or
            ``mode`` has the wrong type.

    Examples:
        >>> from artifex.generative_models.training import RewardCombiner
        >>> from artifex.generative_models.training.rl import format_reward, math_answer_reward
        >>> combiner = RewardCombiner([math_answer_reward(), format_reward()], weights=[1, 0.2])
        >>> completions = ["<think>1 + 1</think><answer>2</answer>"]
        >>> total, per_function = combiner(["1 + 1?"], completions, group_size=1, answer=["2"])
        >>> total, per_function.shape
        (array([1.2], dtype=float32), (1, 2))
    """

    def __init__(
        self,
        funcs: Sequence[Callable[..., Any]],
        *,
        weights: Sequence[float] | np.ndarray | None = None,
        mode: CombineMode = "sum",
        group_size: int | None = None,
        eps: float = 1e-6,
        locate_failing_row: bool = True,
    ) -> None:
        self.funcs = tuple(funcs)
        if not self.funcs:
            msg = "funcs must contain at least one reward function, got none"
            raise ValueError(msg)
        for j, func in enumerate(self.funcs):
            if not callable(func):
                msg = f"funcs[{j}] must be a callable reward function, got {type(func).__name__}"
                raise TypeError(msg)
        _check_mode(mode)
        _check_eps(eps)
        _check_group_size(group_size, None)
        self.weights = _check_weights(weights, len(self.funcs))
        self.mode = mode
        self.group_size = group_size
        self.eps = float(eps)
        self.locate_failing_row = bool(locate_failing_row)
        self.names = reward_names(self.funcs)

    def __repr__(self) -> str:
        return (
            f"RewardCombiner(funcs={self.names}, weights={self.weights.tolist()}, "
            f"mode={self.mode!r}, group_size={self.group_size})"
        )

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        *,
        group_size: int | None = None,
        **columns: Any,
    ) -> CombinedRewards:
        """Scores a batch with every function and combines the rewards.

        Args:
            prompts: ``B`` decoded prompts.
            completions: ``B`` decoded completions.
            group_size: generations per prompt ``G`` (rows ``i`` with the same ``i // G`` share
                a prompt), used by ``"normalized"`` mode; ``None`` falls back to the
                constructor's ``group_size``, then to the whole batch. ``group_size`` is
                therefore not available as a dataset column name.
            **columns: dataset columns with ``B`` entries each.

        Returns:
            ``CombinedRewards(total, per_function)``, see :func:`combine_rewards`.

        Raises:
            RewardFunctionError: if a function raises.
            ValueError: if a function's output or the batch is malformed, ``group_size`` does
                not divide ``B``, or it differs from the constructor's ``group_size``.
            TypeError: if ``group_size`` is not an int.
        """
        return combine_rewards(
            self.funcs,
            prompts,
            completions,
            weights=self.weights,
            mode=self.mode,
            columns=columns,
            group_size=self._group_size(group_size),
            eps=self.eps,
            locate_failing_row=self.locate_failing_row,
        )

    def _group_size(self, group_size: int | None) -> int | None:
        """The call's group size: the caller's, else the constructor's (they must agree)."""
        if group_size is None:
            return self.group_size
        _check_group_size(group_size, None)
        if self.group_size is not None and group_size != self.group_size:
            msg = (
                f"group_size={group_size} passed when calling differs from the combiner's "
                f"group_size={self.group_size}; pass it in one place (when calling)"
            )
            raise ValueError(msg)
        return int(group_size)
