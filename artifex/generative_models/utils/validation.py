"""Argument and config validation: one rule, one message format.

The rule: a value of the wrong **type** raises ``TypeError``; a value of the right type that is
out of range (or not one of the allowed choices) raises ``ValueError``. Every message names the
field, says what was expected and shows what came::

    GRPOConfig.num_generations must be an int, got 4.0 (float)
    GRPOConfig.num_generations must be an int >= 2, got 1

``bool`` is not accepted where a number is expected (``True`` is an ``int`` to Python, but
``num_generations=True`` is a mistake), and ``int`` is not accepted where a ``bool`` is.
NumPy scalars are accepted like the Python numbers they stand for. Each helper returns the
value converted to the plain Python type, so a caller can write
``self.k = check_int("k", k, minimum=1)``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "check_bool",
    "check_callable",
    "check_choice",
    "check_float",
    "check_int",
    "check_remat",
    "check_str",
]

T = TypeVar("T")


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _range_text(
    minimum: float | None,
    maximum: float | None,
    greater_than: float | None,
    less_than: float | None,
) -> str:
    """``">= 1"``, ``"in (0, 1]"``, ``"> 0"`` ... ("" without bounds)."""
    low = (minimum, "[") if minimum is not None else (greater_than, "(")
    high = (maximum, "]") if maximum is not None else (less_than, ")")
    if low[0] is not None and high[0] is not None:
        return f"in {low[1]}{low[0]}, {high[0]}{high[1]}"
    if low[0] is not None:
        return f"{'>=' if low[1] == '[' else '>'} {low[0]}"
    if high[0] is not None:
        return f"{'<=' if high[1] == ']' else '<'} {high[0]}"
    return ""


def _check_range(
    name: str,
    value: float,
    kind: str,
    minimum: float | None,
    maximum: float | None,
    greater_than: float | None,
    less_than: float | None,
    allow_none: bool,
) -> None:
    inside = (
        (minimum is None or value >= minimum)
        and (maximum is None or value <= maximum)
        and (greater_than is None or value > greater_than)
        and (less_than is None or value < less_than)
    )
    if not inside:
        expected = " ".join(
            part for part in (kind, _range_text(minimum, maximum, greater_than, less_than)) if part
        )
        expected += " or None" if allow_none else ""
        msg = f"{name} must be {expected}, got {value!r}"
        raise ValueError(msg)


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
) -> int | None:
    """Checks that ``value`` is an int (not a bool) in ``[minimum, maximum]``.

    Args:
        name: The field or argument, as the message should name it.
        value: The value to check (a Python or NumPy integer).
        minimum: Smallest allowed value, or ``None``.
        maximum: Largest allowed value, or ``None``.
        allow_none: Accept ``None`` (and return it).

    Returns:
        ``value`` as a Python ``int`` (or ``None``).

    Raises:
        TypeError: If ``value`` is not an integer (floats and bools are not).
        ValueError: If it is out of range.

    Examples:
        >>> from artifex.generative_models.utils import check_int
        >>> check_int("num_generations", 8, minimum=2)
        8
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        expected = "an int or None" if allow_none else "an int"
        msg = f"{name} must be {expected}, got {_got(value)}"
        raise TypeError(msg)
    value = int(value)
    _check_range(name, value, "an int", minimum, maximum, None, None, allow_none)
    return value


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    greater_than: float | None = None,
    less_than: float | None = None,
    allow_none: bool = False,
) -> float | None:
    """Checks that ``value`` is a finite real number (int or float, not a bool) within bounds.

    ``minimum``/``maximum`` are inclusive bounds, ``greater_than``/``less_than`` exclusive ones.
    NaN and infinities are out of range (``ValueError``).

    Args:
        name: The field or argument, as the message should name it.
        value: The value to check.
        minimum: Inclusive lower bound, or ``None``.
        maximum: Inclusive upper bound, or ``None``.
        greater_than: Exclusive lower bound, or ``None``.
        less_than: Exclusive upper bound, or ``None``.
        allow_none: Accept ``None`` (and return it).

    Returns:
        ``value`` as a Python ``float`` (or ``None``).

    Raises:
        TypeError: If ``value`` is not a real number.
        ValueError: If it is not finite or out of range.

    Examples:
        >>> from artifex.generative_models.utils import check_float
        >>> check_float("clip_param", 0.2, greater_than=0.0, less_than=1.0)
        0.2
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        expected = "a real number or None" if allow_none else "a real number"
        msg = f"{name} must be {expected}, got {_got(value)}"
        raise TypeError(msg)
    value = float(value)
    if not math.isfinite(value):
        msg = f"{name} must be a finite number, got {value!r}"
        raise ValueError(msg)
    _check_range(name, value, "a number", minimum, maximum, greater_than, less_than, allow_none)
    return value


def check_bool(name: str, value: Any) -> bool:
    """Checks that ``value`` is a bool (``0`` and ``1`` are not).

    Args:
        name: The field or argument, as the message should name it.
        value: The value to check (a Python or NumPy bool).

    Returns:
        ``value`` as a Python ``bool``.

    Raises:
        TypeError: If ``value`` is not a bool.

    Examples:
        >>> from artifex.generative_models.utils import check_bool
        >>> check_bool("shuffle", True)
        True
    """
    if not isinstance(value, bool | np.bool_):
        msg = f"{name} must be a bool, got {_got(value)}"
        raise TypeError(msg)
    return bool(value)


def check_remat(name: str, value: Any) -> bool | int:
    """Checks a rematerialization option: a bool (every layer or none) or an int n >= 1.

    An int ``n`` rematerializes one decoder layer in ``n``; ``1`` is every layer.

    Args:
        name: The field or argument, as the message should name it.
        value: The value to check (a Python or NumPy bool or int).

    Returns:
        ``value`` as a Python ``bool`` or ``int``.

    Raises:
        TypeError: If ``value`` is neither a bool nor an int.
        ValueError: If ``value`` is an int below 1.

    Examples:
        >>> from artifex.generative_models.utils.validation import check_remat
        >>> check_remat("remat", 2), check_remat("remat", True)
        (2, True)
    """
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if not isinstance(value, int | np.integer):
        msg = f"{name} must be a bool or an int >= 1 (one layer in n), got {_got(value)}"
        raise TypeError(msg)
    if value < 1:
        msg = f"{name} as an int is the interval of rematerialized layers, >= 1; got {_got(value)}"
        raise ValueError(msg)
    return int(value)


def check_str(name: str, value: Any, *, allow_empty: bool = False) -> str:
    """Checks that ``value`` is a string, by default a non-empty one.

    Args:
        name: The field or argument, as the message should name it.
        value: The value to check.
        allow_empty: Accept ``""``.

    Returns:
        ``value``.

    Raises:
        TypeError: If ``value`` is not a string.
        ValueError: If it is empty and ``allow_empty`` is false.

    Examples:
        >>> from artifex.generative_models.utils import check_str
        >>> check_str("answer_column", "answer")
        'answer'
    """
    if not isinstance(value, str):
        msg = f"{name} must be a str, got {_got(value)}"
        raise TypeError(msg)
    if not value and not allow_empty:
        msg = f"{name} must be a non-empty str, got ''"
        raise ValueError(msg)
    return value


def check_choice(name: str, value: T, choices: Collection[T]) -> T:
    """Checks that ``value`` is one of ``choices``.

    A value whose type none of the choices has (``scale_rewards=1`` where the choices are
    strings) is a ``TypeError``; an unknown value of the right type a ``ValueError``.

    Args:
        name: The field or argument, as the message should name it.
        value: The value to check.
        choices: The allowed values.

    Returns:
        ``value``.

    Raises:
        TypeError: If ``value``'s type is not the type of any choice.
        ValueError: If it is not one of ``choices``.

    Examples:
        >>> from artifex.generative_models.utils import check_choice
        >>> check_choice("mode", "sum", ("sum", "normalized"))
        'sum'
    """
    options = tuple(choices)
    if not any(type(value) is type(choice) for choice in options):
        kinds = sorted({type(choice).__name__ for choice in options})
        msg = f"{name} must be one of {options} ({' or '.join(kinds)}), got {_got(value)}"
        raise TypeError(msg)
    if value not in options:
        msg = f"{name} must be one of {options}, got {value!r}"
        raise ValueError(msg)
    return value


def check_callable(name: str, value: Any, *, allow_none: bool = False) -> Callable[..., Any] | None:
    """Checks that ``value`` is callable.

    Args:
        name: The field or argument, as the message should name it.
        value: The value to check.
        allow_none: Accept ``None`` (and return it).

    Returns:
        ``value`` (or ``None``).

    Raises:
        TypeError: If ``value`` is not callable.

    Examples:
        >>> from artifex.generative_models.utils import check_callable
        >>> check_callable("length_fn", len)
        <built-in function len>
    """
    if value is None and allow_none:
        return None
    if not callable(value):
        expected = "callable or None" if allow_none else "callable"
        msg = f"{name} must be {expected}, got {_got(value)}"
        raise TypeError(msg)
    return value
