"""Tests for artifex.generative_models.training.rl.rewards.length."""

from __future__ import annotations

import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from artifex.generative_models.training.rl.rewards import (
    overlong_penalty,
    soft_overlong_penalty,
)

# ------------------------------------------------------------------------------------------
# Soft overlong punishment
# ------------------------------------------------------------------------------------------


def _dapo_reference(length: float, l_max: int, l_cache: int) -> float:
    """DAPO Eq. (13), written out case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize(("l_max", "l_cache"), [(20480, 4096), (100, 20), (16, 16), (7, 3)])
def test_overlong_penalty_boundaries(l_max, l_cache):
    start = l_max - l_cache
    lengths = [0, start - 1, start, start + 1, (start + l_max) // 2, l_max - 1, l_max, l_max + 1]
    lengths = [x for x in lengths if x >= 0]
    got = overlong_penalty(lengths, l_max, l_cache)
    want = np.array([_dapo_reference(x, l_max, l_cache) for x in lengths])
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    assert got[lengths.index(start)] == 0.0
    assert got[lengths.index(start + 1)] == pytest.approx(-1.0 / l_cache, abs=1e-15)
    assert got[lengths.index(l_max)] == -1.0
    assert got[lengths.index(l_max + 1)] == -1.0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_overlong_penalty_matches_formula_on_random_lengths(seed):
    rng = np.random.default_rng(seed)
    l_max = int(rng.integers(1, 5000))
    l_cache = int(rng.integers(0, l_max + 1))
    lengths = rng.integers(0, 2 * l_max + 2, size=257)
    got = overlong_penalty(lengths, l_max, l_cache)
    chex.assert_shape(got, (257,))
    chex.assert_type(got, np.float64)
    want = np.array([_dapo_reference(float(x), l_max, l_cache) for x in lengths])
    chex.assert_trees_all_close(got, want, rtol=1e-15, atol=1e-15)
    assert np.all((got <= 0) & (got >= -1))


def test_overlong_penalty_hard_cutoff_with_zero_cache():
    np.testing.assert_array_equal(overlong_penalty([0, 9, 10, 11], 10, 0), [0, 0, 0, -1])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10_000), st.data())
def test_overlong_penalty_is_monotone_and_continuous_in_the_ramp(l_max, data):
    l_cache = data.draw(st.integers(0, l_max))
    lengths = np.arange(0, l_max + 3)
    penalty = overlong_penalty(lengths, l_max, l_cache)
    assert np.all(np.diff(penalty) <= 0)
    if l_cache > 0:  # steps of 1/L_cache inside the ramp, no jump at its ends
        assert np.all(np.abs(np.diff(penalty[: l_max + 1])) <= 1.0 / l_cache + 1e-12)


def test_soft_overlong_penalty_reads_the_completion_length_column():
    reward = soft_overlong_penalty(10, 4)
    assert reward.__name__ == "soft_overlong_penalty"
    got = reward(["q"] * 6, ["c"] * 6, completion_length=[0, 6, 7, 9, 10, 11])
    assert got == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert all(type(x) is float for x in got)
    other = soft_overlong_penalty(10, 4, length_column="n_tokens")
    assert other(["q"], ["c"], n_tokens=np.array([8])) == [-0.5]


def test_soft_overlong_penalty_length_fn_takes_precedence():
    reward = soft_overlong_penalty(8, 4, length_fn=lambda text: len(text.split()))
    completions = ["a b c d", "a b c d e", "a b c d e f g h i"]
    assert reward(["q"] * 3, completions, completion_length=[0, 0, 0]) == [0.0, -0.25, -1.0]


def test_soft_overlong_penalty_errors():
    reward = soft_overlong_penalty(10, 4)
    with pytest.raises(ValueError, match=r"'completion_length'.*length_fn"):
        reward(["q"], ["c"], answer=["1"])
    with pytest.raises(ValueError, match="lengths must be finite and >= 0"):
        reward(["q"], ["c"], completion_length=[-1])
    with pytest.raises(ValueError, match="expected 1"):
        reward(["q"], ["c"], completion_length=[1, 2])
    with pytest.raises(ValueError, match="max_length"):
        soft_overlong_penalty(0, 0)
    with pytest.raises(ValueError, match="cache_length"):
        soft_overlong_penalty(10, 11)
    with pytest.raises(ValueError, match="cache_length"):
        soft_overlong_penalty(10, -1)
    with pytest.raises(TypeError, match="max_length"):
        soft_overlong_penalty(10.0, 4)
    with pytest.raises(TypeError, match="length_fn"):
        soft_overlong_penalty(10, 4, length_fn=3)
    with pytest.raises(TypeError, match="length_column must be a str"):
        soft_overlong_penalty(10, 4, length_column=None)
    with pytest.raises(ValueError, match=r"cache_length must be an int in \[0, 10\], got 11"):
        soft_overlong_penalty(10, 11)
    with pytest.raises(ValueError, match="shape"):
        overlong_penalty([[1, 2]], 10, 4)


def test_equals_trl_get_soft_overlong_punishment():
    """TRL 1.16's own ``trl.rewards.get_soft_overlong_punishment`` on a grid of lengths,
    recorded by ``tests/fixtures/make_trl_variant_fixtures.py`` in TRL's environment (TRL reads
    ``len(completion_ids)``, the rollout's ``completion_length``: EOS included)."""
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[4] / "fixtures" / "trl_variants" / "overlong.json"
    record = json.loads(path.read_text())
    assert record["trl"] == "1.16.0" and len(record["cases"]) >= 5
    for case in record["cases"]:
        l_max, cache = case["max_completion_len"], case["soft_punish_cache"]
        reward = soft_overlong_penalty(l_max, cache)
        n = len(case["lengths"])
        ours = reward(["q"] * n, ["c"] * n, completion_length=case["lengths"])
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(case["rewards"]))
        assert min(case["rewards"]) == -1.0  # the grid reaches past L_max
