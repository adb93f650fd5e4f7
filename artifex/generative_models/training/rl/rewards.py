"""Reward functions: the protocol, their combination, and built-in verifiable rewards.

A reward function is a plain callable

    ``f(prompts: list[str], completions: list[str], **columns) -> list[float | None]``

called once per rollout batch on the decoded text. ``columns`` are the dataset's other fields
(for example ``answer``), passed as keyword lists already repeated per generation, so row ``i``
of ``prompts``, ``completions`` and of every column belongs to the same sample (prompt-major,
generation-minor, like the rest of the batch). The rollout also passes ``completion_length``,
the number of completion tokens of each row. ``None`` means "no reward for this sample"; it
becomes NaN in the combined reward array, which the advantage stage treats as missing.

Several reward functions are combined with :func:`combine_rewards` (or a
:class:`RewardCombiner` that holds the functions, weights and mode), which validates every
function's output and re-raises any exception as a :class:`RewardFunctionError` naming the
function and the first failing row. The pure array part of the combination is
:func:`combine_reward_columns`.

Built-in rewards, each a factory that returns a reward callable with a descriptive
``__name__``:

- :func:`math_answer_reward`: final-answer correctness with exact rational comparison
  (helpers :func:`extract_answer`, :func:`normalize_number`, :func:`answers_equal`).
- :func:`format_reward`: a regular expression or a sequence of ``<tag>...</tag>`` blocks.
- :func:`soft_overlong_penalty`: DAPO's soft overlong punishment (core :func:`overlong_penalty`).
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "CombinedRewards",
    "RewardCombiner",
    "RewardFunction",
    "RewardFunctionError",
    "answers_equal",
    "combine_reward_columns",
    "combine_rewards",
    "extract_answer",
    "format_reward",
    "math_answer_reward",
    "normalize_number",
    "overlong_penalty",
    "reward_names",
    "soft_overlong_penalty",
]

CombineMode = Literal["sum", "normalized"]

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
    """

    def __init__(
        self, message: str, *, function_name: str, function_index: int, row: int | None
    ) -> None:
        super().__init__(message)
        self.function_name = function_name
        self.function_index = function_index
        self.row = row


def _function_name(func: Callable[..., Any]) -> str:
    """The display name of one callable: ``__name__``, the wrapped function, or its type."""
    if isinstance(func, functools.partial):
        return _function_name(func.func)
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
    """
    names: list[str] = []
    seen: set[str] = set()
    counts: dict[str, int] = {}
    for func in funcs:
        base = _function_name(func)
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
# Combination
# --------------------------------------------------------------------------------------------


class CombinedRewards(NamedTuple):
    """The output of :func:`combine_rewards` (unpacks as ``total, per_function``).

    Attributes:
        total: ``(B,)`` float32 combined reward; NaN where no function gave a reward.
        per_function: ``(B, F)`` float32 raw rewards of each function (unweighted and not
            normalized, for logging); NaN where a function returned ``None``.
    """

    total: np.ndarray
    per_function: np.ndarray


def _check_mode(mode: str) -> None:
    if mode not in ("sum", "normalized"):
        msg = f"mode must be 'sum' or 'normalized', got {mode!r}"
        raise ValueError(msg)


def _check_eps(eps: float) -> None:
    if not (isinstance(eps, numbers.Real) and math.isfinite(eps) and eps > 0):
        msg = f"eps must be a finite number > 0, got {eps!r}"
        raise ValueError(msg)


def _check_weights(weights: Sequence[float] | np.ndarray | None, num_funcs: int) -> np.ndarray:
    """Validates weights and returns them as float64 ``(F,)`` (ones when ``None``)."""
    if weights is None:
        return np.ones(num_funcs, dtype=np.float64)
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        msg = f"weights must be a sequence of {num_funcs} numbers, got {weights!r}"
        raise ValueError(msg) from exc
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

    With ``batch_size=None`` only checks that ``group_size`` is a positive int.
    """
    if group_size is None:
        return max(batch_size or 0, 1)
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        msg = f"group_size must be a positive int or None, got {group_size!r}"
        raise TypeError(msg)
    if group_size <= 0:
        msg = f"group_size must be > 0, got {group_size}"
        raise ValueError(msg)
    if batch_size is not None and batch_size % group_size != 0:
        msg = (
            f"group_size must be a positive divisor of the batch size {batch_size}, "
            f"got {group_size}"
        )
        raise ValueError(msg)
    return int(group_size)


def _standardize(per_function: np.ndarray, group_size: int, eps: float) -> np.ndarray:
    """Standardizes each column over its non-NaN entries within groups of ``group_size`` rows.

    ``z = (r - mean) / (std + eps)``, population std; exactly 0 where all the group's values of
    that column are equal; NaN stays NaN.
    """
    batch, num_funcs = per_function.shape
    r = per_function.reshape(batch // group_size, group_size, num_funcs)
    valid = ~np.isnan(r)
    count = np.maximum(valid.sum(axis=1, keepdims=True), 1)
    filled = np.where(valid, r, 0.0)
    mean = filled.sum(axis=1, keepdims=True) / count
    centered = np.where(valid, r - mean, 0.0)
    std = np.sqrt((centered * centered).sum(axis=1, keepdims=True) / count)
    high = np.where(valid, r, -np.inf).max(axis=1, keepdims=True)
    low = np.where(valid, r, np.inf).min(axis=1, keepdims=True)
    constant = high <= low  # also true for an all-NaN group (-inf <= inf)
    z = np.where(constant, 0.0, centered / (std + eps))
    z = np.where(valid, z, np.nan)
    return z.reshape(batch, num_funcs)


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
    The arithmetic is float64; the result is float32.

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
        TypeError: if ``group_size`` is not an int.

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
        raise ValueError(msg)
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

    Each function is called once as ``f(prompts, completions, **columns)`` (all as lists, so a
    function may not mutate what the next one sees). Its output must hold ``B`` finite real
    numbers or ``None``; ``None`` and NaN both mean "no reward for this sample". The columns are
    then combined by :func:`combine_reward_columns`:

    - ``"sum"``: ``total_i = sum_{f : r_if not NaN} w_f * r_if``;
    - ``"normalized"``: ``total_i = sum_{f : r_if not NaN} w_f * (r_if - mean_f) /
      (std_f + eps)`` with each function's mean and std taken over its non-NaN entries in the
      batch (or in each group of ``group_size`` rows), and 0 for a constant column.

    ``total_i`` is NaN when every function returned ``None`` for row ``i``.

    Args:
        funcs: the reward functions (see :class:`RewardFunction`), at least one.
        prompts: ``B`` decoded prompts.
        completions: ``B`` decoded completions.
        weights: one finite weight per function; ``None`` means all ones.
        mode: ``"sum"`` or ``"normalized"``.
        columns: dataset columns passed as keyword arguments, each with ``B`` entries. The
            rollout passes ``completion_length`` (completion token counts) among them.
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
        ValueError: if a function returns the wrong number of rewards, something other than a
            list, tuple or 1-D array, a non-numeric value or an infinity (the message names the
            function, the expected and the got value); or if ``funcs`` is empty, the batch
            lengths disagree, a column is named ``prompts``/``completions``, ``weights`` has
            the wrong length or non-finite entries, or ``mode``/``eps``/``group_size`` are
            invalid.
        TypeError: if an entry of ``funcs`` is not callable.

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
    ``combiner(prompts, completions, **columns) -> CombinedRewards``.

    Example:
        >>> combiner = RewardCombiner([math_answer_reward(), format_reward()], weights=[1, 0.2])
        >>> completions = ["<think>1 + 1</think><answer>2</answer>"]
        >>> total, per_function = combiner(["1 + 1?"], completions, answer=["2"])
        >>> total, per_function.shape
        (array([1.2], dtype=float32), (1, 2))

    Args:
        funcs: the reward functions, at least one.
        weights: one finite weight per function; ``None`` means all ones.
        mode: ``"sum"`` or ``"normalized"`` (see :func:`combine_reward_columns`).
        group_size: ``"normalized"`` mode only: standardize within groups of this many rows.
        eps: positive constant added to the standard deviation.
        locate_failing_row: re-run a failing function row by row to name the failing row.

    Raises:
        ValueError: if ``funcs`` is empty, ``weights`` has the wrong length or non-finite
            entries, or ``mode``/``eps``/``group_size`` are invalid.
        TypeError: if an entry of ``funcs`` is not callable or ``group_size`` is not an int.
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
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
    ) -> CombinedRewards:
        """Scores a batch with every function and combines the rewards.

        Args:
            prompts: ``B`` decoded prompts.
            completions: ``B`` decoded completions.
            **columns: dataset columns with ``B`` entries each.

        Returns:
            ``CombinedRewards(total, per_function)``, see :func:`combine_rewards`.

        Raises:
            RewardFunctionError: if a function raises.
            ValueError: if a function's output or the batch is malformed.
        """
        return combine_rewards(
            self.funcs,
            prompts,
            completions,
            weights=self.weights,
            mode=self.mode,
            columns=columns,
            group_size=self.group_size,
            eps=self.eps,
            locate_failing_row=self.locate_failing_row,
        )


# --------------------------------------------------------------------------------------------
# Math answers: extraction, number normalization, comparison
# --------------------------------------------------------------------------------------------

_MAX_ANSWER_CHARS = 512  # longer "answers" are compared as text only
_MAX_EXPONENT = 400  # |k| in 1e{k} or \times 10^{k}
_MAX_DEPTH = 8

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BOXED_TOKEN_RE = re.compile(r"[^\s$]+")
_HASH_RE = re.compile(r"####[ \t]*([-+\u2212$\\(.*0-9][^\n]*)")
_NUMBER_IN_TEXT_RE = re.compile(
    r"(?:(?<![0-9A-Za-z])[-+\u2212])?"
    r"(?:(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+(?:\.[0-9]+)?)?|\.[0-9]+)"
)
_DECIMAL_RE = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?")
_THOUSANDS_RE = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]*)?")
_TIMES_TEN_RE = re.compile(r"(.+)\\(?:times|cdot)10\^(?:\{([+-]?[0-9]+)\}|([0-9]))")
_TEXT_UNIT_RE = re.compile(
    r"^(.*?[0-9}.])\s*\\(?:text|textrm|mbox|mathrm)\{\s*[A-Za-z][A-Za-z\s.]*\}\s*$"
)
_TEXT_WRAP_RE = re.compile(
    r"\\(?:text|textrm|textbf|textit|mbox|mathrm|mathbf|boxed|fbox)\{([^{}]*)\}"
)
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_WIDE_SPACE_RE = re.compile(r"\\(?:qquad|quad)(?![A-Za-z])|\\[;: ]|~")
_DEGREES_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_VARIABLE_RE = re.compile(r"^[A-Za-z]\s*=\s*")
_SPACES_NOT_BETWEEN_DIGITS_RE = re.compile(r"(?<![0-9])\s+|\s+(?![0-9])")
_CLOSING = {"(": ")", "[": "]", "{": "}"}


def _match_brace(text: str, start: int) -> int | None:
    r"""Index of the ``}`` closing the ``{`` at ``start`` (``\{``/``\}`` escaped), else None."""
    return _brace_pairs(text, start).get(start)


def _brace_pairs(text: str, start: int) -> dict[int, int]:
    r"""Maps each ``{`` at or after ``start`` to its closing ``}`` (one pass, escapes skipped)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def _last_boxed(text: str) -> tuple[int, str] | None:
    r"""Start and content of the last well-formed, non-empty ``\boxed``/``\fbox``."""
    matches = list(_BOXED_RE.finditer(text))
    pairs = _brace_pairs(text, matches[0].start()) if matches else {}
    for match in reversed(matches):
        i = match.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            close = pairs.get(i)
            if close is None:
                continue
            content = text[i + 1 : close].strip()
        else:
            token = _BOXED_TOKEN_RE.match(text, i)
            content = token.group(0) if token else ""
        if content:
            return match.start(), content
    return None


def _last_hash(text: str) -> tuple[int, str] | None:
    """Start and content of the last ``#### answer`` line (cut at a closing tag)."""
    for match in reversed(list(_HASH_RE.finditer(text))):
        content = match.group(1).split("</", 1)[0].strip()
        if content:
            return match.start(), content
    return None


def _last_answer_tag(text: str) -> tuple[int, str] | None:
    """Start and content of the last complete ``<answer>...</answer>`` block."""
    close = text.rfind("</answer>")
    if close < 0:
        return None
    start = text.rfind("<answer>", 0, close)
    if start < 0:
        return None
    content = text[start + len("<answer>") : close].strip()
    return (start, content) if content else None


def extract_answer(text: str, *, last_number_fallback: bool = False) -> str | None:
    r"""Extracts the final answer from a solution or completion.

    Three markers are recognized; the one that starts last in the text wins (so a ``\boxed``
    inside an ``<answer>`` block wins over the block, and the last of several boxes wins):

    - LaTeX ``\boxed{...}`` / ``\fbox{...}`` with nested braces, or the brace-less
      ``\boxed 5`` form (the next whitespace-free token). Unclosed boxes are skipped.
    - GSM8K ``#### 42``: the rest of the line, which must start like a number (a digit, sign,
      ``$``, ``\``, ``(``, ``.`` or Markdown bold ``**``), so a Markdown heading
      ``#### Step 2`` is not an answer.
    - ``<answer>...</answer>`` (the R1-style format): the last complete block's content.

    When no marker is found, ``last_number_fallback=True`` returns the last number in the text
    (integers, decimals, ``1,234``-style thousands and ``a/b`` fractions, with a sign);
    otherwise ``None``. The fallback is off by default: it rewards unformatted answers and
    can pick up a number that is not the answer.

    Args:
        text: the completion or reference solution.
        last_number_fallback: fall back to the last number when no marker is present.

    Returns:
        The answer string as written (not normalized), or ``None`` when there is none.

    Raises:
        TypeError: if ``text`` is not a string.

    References:
        Cobbe et al., "Training Verifiers to Solve Math Word Problems" (GSM8K),
        arXiv:2110.14168, 2021; Hendrycks et al., "Measuring Mathematical Problem Solving With
        the MATH Dataset", arXiv:2103.03874, 2021.
    """
    if not isinstance(text, str):
        msg = f"text must be a str, got {type(text).__name__}"
        raise TypeError(msg)
    candidates = [
        c for c in (_last_boxed(text), _last_hash(text), _last_answer_tag(text)) if c is not None
    ]
    if candidates:
        return max(candidates, key=lambda c: c[0])[1]
    if last_number_fallback:
        numbers_found = _NUMBER_IN_TEXT_RE.findall(text)
        if numbers_found:
            return numbers_found[-1]
    return None


def _clean(answer: str) -> str:
    r"""Removes LaTeX presentation and units so that equal answers are written alike.

    Drops ``\left``/``\right``, spacing commands, ``$``, ``%``, degree marks, a leading
    ``x =``, Markdown bold, a trailing period, a trailing ``\text{unit}`` after a number (the MATH
    convention), unwraps ``\text{...}``, maps ``\dfrac``/``\tfrac`` to ``\frac``, the
    unicode minus to ``-`` and ``{,}`` to ``,``, and removes whitespace except between digits.
    """
    s = answer.strip().replace("\u2212", "-")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT_RE.sub("", s)
    s = s.replace("{,}", ",").replace("\\,", "").replace("\\!", "")
    s = _WIDE_SPACE_RE.sub(" ", s)
    s = _DEGREES_RE.sub("", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.strip()
    unit = _TEXT_UNIT_RE.match(s)
    if unit:
        s = unit.group(1)
    for _ in range(_MAX_DEPTH):
        unwrapped = _TEXT_WRAP_RE.sub(r"\1", s)
        if unwrapped == s:
            break
        s = unwrapped
    s = s.strip().strip("*").strip().rstrip(".").strip()
    s = _VARIABLE_RE.sub("", s)
    return _SPACES_NOT_BETWEEN_DIGITS_RE.sub("", s)


def _latex_args(s: str, start: int, count: int) -> tuple[list[str], int] | None:
    """Reads ``count`` LaTeX arguments (``{...}`` groups or single characters) from ``start``."""
    args: list[str] = []
    i = start
    for _ in range(count):
        if i >= len(s):
            return None
        if s[i] == "{":
            close = _match_brace(s, i)
            if close is None:
                return None
            args.append(s[i + 1 : close])
            i = close + 1
        elif s[i] == "\\":
            command = re.match(r"\\[A-Za-z]+|\\.", s[i:])
            if command is None:
                return None
            args.append(command.group(0))
            i += len(command.group(0))
        else:
            args.append(s[i])
            i += 1
    return args, i


def _parse_decimal(s: str) -> Fraction | None:
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    match = _DECIMAL_RE.fullmatch(s)
    if match is None:
        return None
    if match.group(1) is not None and abs(int(match.group(1))) > _MAX_EXPONENT:
        return None
    try:
        return Fraction(s)
    except ValueError:  # more digits than int() converts
        return None


def _parse_number(s: str, depth: int = 0) -> Fraction | None:
    """Parses a cleaned answer into an exact rational, or ``None``."""
    if depth > _MAX_DEPTH or not s:
        return None
    if s[0] in _CLOSING and s[-1] == _CLOSING[s[0]]:
        if s[0] == "{":
            close = _match_brace(s, 0)
        else:  # parentheses and brackets: the first opener must close at the very end
            level, close = 0, None
            for i, char in enumerate(s):
                level += char == s[0]
                level -= char == _CLOSING[s[0]]
                if level == 0:
                    close = i
                    break
        if close == len(s) - 1:
            return _parse_number(s[1:-1], depth + 1)
    if s[0] in "+-":
        if len(s) > 1 and s[1] in "+-":
            return None
        value = _parse_number(s[1:], depth + 1)
        if value is None:
            return None
        return -value if s[0] == "-" else value
    if s.startswith("\\frac"):
        parsed = _latex_args(s, len("\\frac"), 2)
        if parsed is None or parsed[1] != len(s):
            return None
        numerator = _parse_number(parsed[0][0], depth + 1)
        denominator = _parse_number(parsed[0][1], depth + 1)
        if numerator is None or not denominator:
            return None
        return numerator / denominator
    times_ten = _TIMES_TEN_RE.fullmatch(s)
    if times_ten:
        exponent = int(times_ten.group(2) or times_ten.group(3))
        mantissa = _parse_number(times_ten.group(1), depth + 1)
        if mantissa is None or abs(exponent) > _MAX_EXPONENT:
            return None
        return mantissa * Fraction(10) ** exponent
    if s.count("/") == 1:
        top, bottom = s.split("/")
        numerator = _parse_number(top, depth + 1)
        denominator = _parse_number(bottom, depth + 1)
        if numerator is None or not denominator:
            return None
        return numerator / denominator
    return _parse_decimal(s)


def normalize_number(answer: str) -> Fraction | None:
    r"""Parses an answer string into an exact rational number.

    Accepted forms (after removing LaTeX presentation, see below): integers and decimals
    (``72``, ``72.``, ``5.00``, ``.5``), scientific notation (``1.5e3``, ``1.5\times10^{3}``),
    thousands separators in groups of exactly three (``1,234,567.5``; ``1,2`` is *not* a
    number), fractions ``a/b``, ``\frac{a}{b}``, ``\dfrac``, ``\tfrac``, ``\frac12`` (also
    nested), a sign (``-``, ``+``, the unicode minus ``−``) and enclosing parentheses.

    Removed before parsing: ``$`` and ``\$``, ``%`` and ``\%`` (the number is kept, not divided
    by 100), ``^\circ``/``°``, ``\left``/``\right``, LaTeX spacing (``\,`` ``\!`` ``\;``
    ``\quad`` ``~``), ``{,}``, a trailing ``\text{unit}`` after a number (``5\text{ cm}``),
    ``\text{...}`` wrappers, Markdown bold ``**``, a leading single-letter ``x =``, a trailing
    period, and whitespace (except between two digits: ``1 2`` is not ``12``). Plain unit words
    are *not* removed (``18 dollars`` is not a number): that would also turn ``3 million`` into
    ``3``.
    Mixed numbers (``2\frac{1}{2}``), irrational forms (``\sqrt2``, ``\pi``), division by zero,
    exponents beyond ±400 and answers longer than 512 characters give ``None``.

    Args:
        answer: an extracted answer (see :func:`extract_answer`), not a whole solution.

    Returns:
        The value as a ``fractions.Fraction``, or ``None`` if the answer is not a number.

    Raises:
        TypeError: if ``answer`` is not a string.
    """
    if not isinstance(answer, str):
        msg = f"answer must be a str, got {type(answer).__name__}"
        raise TypeError(msg)
    if len(answer) > _MAX_ANSWER_CHARS:
        return None
    return _parse_number(_clean(answer))


def _normalize_text(answer: str) -> str:
    return re.sub(r"\s+", "", _clean(answer))


def answers_equal(a: str, b: str) -> bool:
    r"""Whether two extracted answers are the same.

    If both parse as numbers (:func:`normalize_number`) they are compared exactly as
    rationals, with no float tolerance (``0.75 == 3/4 == \frac{3}{4}``, ``0.333 != 1/3``). If
    exactly one parses, they differ. Otherwise the answers are compared as text after the same
    LaTeX clean-up with all whitespace removed (``\text{Monday}`` equals ``Monday``,
    ``\left( 1, 2 \right)`` equals ``(1,2)``); empty answers never match. The relation is
    symmetric.

    Args:
        a: an extracted answer.
        b: another extracted answer.

    Returns:
        ``True`` if the answers are equivalent.

    Raises:
        TypeError: if ``a`` or ``b`` is not a string.
    """
    x, y = normalize_number(a), normalize_number(b)
    if x is not None and y is not None:
        return x == y
    if x is not None or y is not None:
        return False
    ta, tb = _normalize_text(a), _normalize_text(b)
    return bool(ta) and ta == tb


def _reference_answer(reference: Any) -> str | None:
    """The answer of a dataset reference: a solution, a bare answer or a number."""
    if reference is None:
        return None
    if isinstance(reference, np.generic):
        reference = reference.item()
    if isinstance(reference, bool):
        msg = f"reference answer must be a str or a number, got bool {reference!r}"
        raise TypeError(msg)
    if isinstance(reference, (int, Fraction)):
        return str(reference)
    if isinstance(reference, float):
        return repr(reference) if math.isfinite(reference) else None
    if not isinstance(reference, str):
        msg = f"reference answer must be a str or a number, got {type(reference).__name__}"
        raise TypeError(msg)
    answer = extract_answer(reference)
    if answer is None:
        answer = reference.strip()
    return answer or None


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
    if not (isinstance(value, numbers.Real) and math.isfinite(value)):
        msg = f"{field} must be a finite number, got {value!r}"
        raise ValueError(msg)
    return float(value)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        msg = f"name must be a non-empty str, got {name!r}"
        raise ValueError(msg)
    return name


def math_answer_reward(
    answer_column: str = "answer",
    *,
    correct_reward: float = 1.0,
    incorrect_reward: float = 0.0,
    last_number_fallback: bool = False,
    name: str = "math_answer_reward",
) -> RewardFunction:
    r"""Final-answer correctness reward for math problems (GSM8K, MATH).

    For each row the reference is read from ``columns[answer_column]``: a full GSM8K solution
    (``... #### 72``), a bare or boxed answer, or a number. The completion's answer is found by
    :func:`extract_answer` (``\boxed{}``, ``####`` or ``<answer>`` tags; the last number only
    with ``last_number_fallback``) and compared with :func:`answers_equal` (exact rationals,
    else cleaned text):

        ``R = correct_reward   if answers_equal(extract(completion), extract(reference))``
        ``R = incorrect_reward otherwise (including when the completion has no answer)``

    The reward is ``None`` ("no reward") only when the reference itself is missing: ``None``,
    NaN or empty. A non-numeric reference (``\text{Monday}``) is still graded as text.

    Args:
        answer_column: name of the dataset column with the reference answers.
        correct_reward: reward for a correct answer.
        incorrect_reward: reward for a wrong or missing answer.
        last_number_fallback: use the completion's last number when it has no answer marker.
        name: the returned function's ``__name__`` (used in logs and errors).

    Returns:
        A reward function ``f(prompts, completions, **columns) -> list[float | None]``.

    Raises:
        ValueError: (here) if ``answer_column`` or ``name`` is empty or a reward value is not
            finite; (when called) if the column is missing or has the wrong length.
        TypeError: (when called) if a completion is not a string or a reference is neither a
            string nor a number.

    References:
        Cobbe et al., "Training Verifiers to Solve Math Word Problems" (GSM8K),
        arXiv:2110.14168, 2021; Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical
        Reasoning in Open Language Models", arXiv:2402.03300, 2024 (rule-based accuracy
        rewards for GRPO).
    """
    if not isinstance(answer_column, str) or not answer_column:
        msg = f"answer_column must be a non-empty str, got {answer_column!r}"
        raise ValueError(msg)
    correct = _check_reward_value(correct_reward, "correct_reward")
    incorrect = _check_reward_value(incorrect_reward, "incorrect_reward")
    func_name = _check_name(name)
    fallback = bool(last_number_fallback)

    def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        references = _column(columns, answer_column, len(completions), func_name)
        rewards: list[float | None] = []
        for i, (completion, reference) in enumerate(zip(completions, references, strict=True)):
            if not isinstance(completion, str):
                msg = f"{func_name}: completion {i} must be a str, got {type(completion).__name__}"
                raise TypeError(msg)
            expected = _reference_answer(reference)
            if expected is None:
                rewards.append(None)
                continue
            predicted = extract_answer(completion, last_number_fallback=fallback)
            ok = predicted is not None and answers_equal(predicted, expected)
            rewards.append(correct if ok else incorrect)
        return rewards

    reward.__name__ = reward.__qualname__ = func_name
    return reward


# --------------------------------------------------------------------------------------------
# Format reward
# --------------------------------------------------------------------------------------------

_TAG_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]*")


def _tags_pattern(tags: Sequence[str]) -> re.Pattern[str]:
    blocks = []
    for tag in tags:
        t = re.escape(tag)
        blocks.append(f"<{t}>((?:(?!</?{t}>).)*)</{t}>")
    return re.compile(r"\s*" + r"\s*".join(blocks) + r"\s*", re.DOTALL)


def format_reward(
    pattern: str | re.Pattern[str] | None = None,
    *,
    tags: Sequence[str] = ("think", "answer"),
    match: Literal["fullmatch", "search"] = "fullmatch",
    flags: int = re.DOTALL,
    correct_reward: float = 1.0,
    incorrect_reward: float = 0.0,
    name: str = "format_reward",
) -> RewardFunction:
    """Reward for following an output format: a regular expression or tagged blocks in order.

    With ``pattern``, a completion is well formatted when ``re.fullmatch`` (or ``re.search``
    with ``match="search"``) finds the pattern. Without it the format is the ``tags`` in order,
    each as one non-empty ``<tag>...</tag>`` block, separated only by whitespace; with the
    default tags that is ``<think>...</think><answer>...</answer>``. A block may not contain
    its own tag again, so ``<answer>1</answer><answer>2</answer>`` does not pass. With
    ``match="fullmatch"`` only whitespace may surround the blocks; with ``"search"`` the blocks
    may appear anywhere.

        ``R = correct_reward if the completion matches, else incorrect_reward``

    Args:
        pattern: a regular expression (string or compiled); when given, ``tags`` is ignored.
        tags: tag names required in order when ``pattern`` is ``None``.
        match: ``"fullmatch"`` (the whole completion) or ``"search"`` (anywhere).
        flags: ``re`` flags for a string ``pattern`` (default ``re.DOTALL``, so ``.`` spans
            lines).
        correct_reward: reward for a well-formatted completion.
        incorrect_reward: reward otherwise.
        name: the returned function's ``__name__``.

    Returns:
        A reward function ``f(prompts, completions, **columns) -> list[float]``.

    Raises:
        ValueError: if ``match`` is unknown, ``tags`` is empty or holds an invalid tag name
            (without ``pattern``), ``pattern`` does not compile, or a reward is not finite.
        TypeError: (when called) if a completion is not a string.

    References:
        DeepSeek-AI, "DeepSeek-R1: Incentivizing Reasoning Capability in LLMs via
        Reinforcement Learning", arXiv:2501.12948, 2025 (format rewards).
    """
    if match not in ("fullmatch", "search"):
        msg = f"match must be 'fullmatch' or 'search', got {match!r}"
        raise ValueError(msg)
    correct = _check_reward_value(correct_reward, "correct_reward")
    incorrect = _check_reward_value(incorrect_reward, "incorrect_reward")
    func_name = _check_name(name)
    check_blocks = pattern is None
    if pattern is None:
        tags = tuple(tags)
        if not tags:
            msg = "tags must name at least one tag when pattern is None, got ()"
            raise ValueError(msg)
        for tag in tags:
            if not isinstance(tag, str) or not _TAG_NAME_RE.fullmatch(tag):
                msg = f"tags must be XML-like tag names, got {tag!r}"
                raise ValueError(msg)
        compiled = _tags_pattern(tags)
    elif isinstance(pattern, re.Pattern):
        compiled = pattern
    else:
        try:
            compiled = re.compile(pattern, flags)
        except re.error as exc:
            msg = f"pattern must be a valid regular expression, got {pattern!r}: {exc}"
            raise ValueError(msg) from exc
    finder = compiled.fullmatch if match == "fullmatch" else compiled.search

    def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        rewards = []
        for i, completion in enumerate(completions):
            if not isinstance(completion, str):
                msg = f"{func_name}: completion {i} must be a str, got {type(completion).__name__}"
                raise TypeError(msg)
            found = finder(completion)
            ok = found is not None and (
                not check_blocks or all(group.strip() for group in found.groups())
            )
            rewards.append(correct if ok else incorrect)
        return rewards

    reward.__name__ = reward.__qualname__ = func_name
    return reward


# --------------------------------------------------------------------------------------------
# DAPO soft overlong punishment
# --------------------------------------------------------------------------------------------


def _check_lengths_config(max_length: int, cache_length: int) -> None:
    for field, value in (("max_length", max_length), ("cache_length", cache_length)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            msg = f"{field} must be an int, got {value!r}"
            raise TypeError(msg)
    if max_length <= 0:
        msg = f"max_length must be > 0, got {max_length}"
        raise ValueError(msg)
    if not 0 <= cache_length <= max_length:
        msg = f"cache_length must be in [0, max_length={max_length}], got {cache_length}"
        raise ValueError(msg)


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
        TypeError: if ``max_length``/``cache_length`` are not ints or ``length_fn`` is not
            callable.

    References:
        Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
        arXiv:2503.14476, 2025, Eq. (13).
    """
    _check_lengths_config(max_length, cache_length)
    if not isinstance(length_column, str) or not length_column:
        msg = f"length_column must be a non-empty str, got {length_column!r}"
        raise ValueError(msg)
    if length_fn is not None and not callable(length_fn):
        msg = f"length_fn must be callable or None, got {type(length_fn).__name__}"
        raise TypeError(msg)
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
