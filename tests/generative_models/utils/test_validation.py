"""Tests for artifex.generative_models.utils.validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from artifex.generative_models.utils.validation import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_str,
)


def test_check_int_accepts_ints_and_numpy_ints():
    assert check_int("n", 3, minimum=1) == 3
    value = check_int("n", np.int64(5), minimum=1, maximum=5)
    assert value == 5 and type(value) is int
    assert check_int("n", None, allow_none=True) is None


@pytest.mark.parametrize("value", [2.0, "2", True, np.bool_(True), None, [2]])
def test_check_int_wrong_type_is_a_type_error(value):
    with pytest.raises(TypeError, match=r"^Cfg\.n must be an int, got .* \(\w+\)$"):
        check_int("Cfg.n", value, minimum=1)


def test_check_int_out_of_range_is_a_value_error():
    with pytest.raises(ValueError, match=r"^Cfg\.n must be an int >= 2, got 1$"):
        check_int("Cfg.n", 1, minimum=2)
    with pytest.raises(ValueError, match=r"must be an int in \[0, 1\], got 2"):
        check_int("ddof", 2, minimum=0, maximum=1)
    with pytest.raises(ValueError, match=r"must be an int >= 1 or None, got 0"):
        check_int("max_len", 0, minimum=1, allow_none=True)
    with pytest.raises(TypeError, match="an int or None"):
        check_int("max_len", 1.5, allow_none=True)


def test_check_float():
    assert check_float("x", 1) == 1.0 and type(check_float("x", 1)) is float
    assert check_float("x", np.float32(0.5), greater_than=0, less_than=1) == 0.5
    assert check_float("x", None, allow_none=True) is None
    for value in ("0.1", True, None, object()):
        with pytest.raises(TypeError, match=r"x must be a real number, got"):
            check_float("x", value)
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="x must be a finite number"):
            check_float("x", value)
    with pytest.raises(ValueError, match=r"clip must be a number in \(0, 1\), got 1.0"):
        check_float("clip", 1.0, greater_than=0, less_than=1)
    with pytest.raises(ValueError, match=r"gamma must be a number in \(0, 1\], got 1.5"):
        check_float("gamma", 1.5, greater_than=0, maximum=1)
    with pytest.raises(ValueError, match=r"beta must be a number >= 0, got -1.0"):
        check_float("beta", -1.0, minimum=0)
    with pytest.raises(ValueError, match=r"t must be a number > 0, got 0.0"):
        check_float("t", 0.0, greater_than=0)
    with pytest.raises(ValueError, match=r"q must be a number <= 1, got 2.0"):
        check_float("q", 2.0, maximum=1)


def test_check_bool_str_choice_callable():
    assert check_bool("flag", np.bool_(False)) is False
    with pytest.raises(TypeError, match=r"flag must be a bool, got 1 \(int\)"):
        check_bool("flag", 1)
    assert check_str("col", "answer") == "answer"
    assert check_str("col", "", allow_empty=True) == ""
    with pytest.raises(TypeError, match=r"col must be a str, got 3 \(int\)"):
        check_str("col", 3)
    with pytest.raises(ValueError, match="col must be a non-empty str"):
        check_str("col", "")
    assert check_choice("mode", "sum", ("sum", "normalized")) == "sum"
    with pytest.raises(ValueError, match=r"mode must be one of \('sum', 'normalized'\), got 'max'"):
        check_choice("mode", "max", ("sum", "normalized"))
    with pytest.raises(TypeError, match=r"mode must be one of .* \(str\), got 1 \(int\)"):
        check_choice("mode", 1, ("sum", "normalized"))
    assert check_callable("fn", len) is len
    assert check_callable("fn", None, allow_none=True) is None
    with pytest.raises(TypeError, match=r"fn must be callable, got 3 \(int\)"):
        check_callable("fn", 3)
