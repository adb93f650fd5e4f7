"""Tests for artifex.generative_models.training.rl.rewards.combine."""

from __future__ import annotations

import math

import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from artifex.generative_models.training.rl.rewards import (
    CombinedRewards,
    RewardCombiner,
    RewardFunctionError,
    combine_reward_columns,
    combine_rewards,
    format_reward,
    math_answer_reward,
    soft_overlong_penalty,
)

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)


def named_reward(prompts, completions, **columns):
    return [0.0] * len(completions)


# ------------------------------------------------------------------------------------------
# Combination
# ------------------------------------------------------------------------------------------


def _reference_combine(values, weights, mode, group_size=None, eps=1e-6):
    """Independent float64 version of the combination, row by row and column by column."""
    values = np.asarray(values, dtype=np.float64)
    batch, num_funcs = values.shape
    group = group_size or batch
    z = values.copy()
    if mode == "normalized":
        for f in range(num_funcs):
            for g0 in range(0, batch, group):
                col = values[g0 : g0 + group, f]
                present = col[~np.isnan(col)]
                if present.size == 0:
                    continue
                if np.all(present == present[0]):
                    z[g0 : g0 + group, f] = np.where(np.isnan(col), np.nan, 0.0)
                else:
                    z[g0 : g0 + group, f] = (col - present.mean()) / (present.std() + eps)
    total = np.full(batch, np.nan)
    for i in range(batch):
        terms = [weights[f] * z[i, f] for f in range(num_funcs) if not np.isnan(z[i, f])]
        if terms:
            total[i] = math.fsum(terms)
    return total


def _random_rewards(rng, batch, num_funcs, missing=0.25):
    values = rng.normal(size=(batch, num_funcs)) * rng.uniform(0.1, 10, size=num_funcs)
    values[:, 0] = rng.integers(0, 2, size=batch)  # a 0/1 correctness reward
    values[rng.uniform(size=values.shape) < missing] = np.nan
    values[rng.integers(batch), :] = np.nan  # one row with no reward at all
    return values


def _column_function(column, name):
    """A reward function returning a fixed column, with None where the column is NaN."""

    def reward(prompts, completions, **columns):
        assert len(prompts) == len(completions) == len(column)
        return [None if np.isnan(x) else float(x) for x in column]

    reward.__name__ = name
    return reward


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["sum", "normalized"])
def test_combine_rewards_matches_float64_reference(seed, mode):
    rng = np.random.default_rng(seed)
    batch, num_funcs = 24, 4
    values = _random_rewards(rng, batch, num_funcs)
    weights = rng.uniform(-2, 2, size=num_funcs)
    funcs = [_column_function(values[:, f], f"r{f}") for f in range(num_funcs)]
    total, per_function = combine_rewards(
        funcs, ["p"] * batch, ["c"] * batch, weights=list(weights), mode=mode
    )
    want = _reference_combine(values, weights, mode)
    assert total.dtype == np.float32 and total.shape == (batch,)
    assert per_function.dtype == np.float32 and per_function.shape == (batch, num_funcs)
    np.testing.assert_array_equal(np.isnan(total), np.isnan(want))
    np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(per_function, values, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_combine_reward_columns_group_normalization_matches_reference(seed):
    rng = np.random.default_rng(seed)
    num_prompts, group, num_funcs = 5, 6, 3
    values = _random_rewards(rng, num_prompts * group, num_funcs, missing=0.3)
    values[0:group, 1] = 3.0  # one constant group
    values[group : 2 * group, 2] = np.nan  # one group where a function never answers
    weights = rng.uniform(0.5, 2, size=num_funcs)
    got = combine_reward_columns(values, weights=weights, mode="normalized", group_size=group)
    want = _reference_combine(values, weights, "normalized", group_size=group)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got.dtype == np.float32


def test_combine_rewards_none_handling_in_sum_mode():
    a = lambda prompts, completions, **columns: [1.0, None, None, 0.5]  # noqa: E731
    b = lambda prompts, completions, **columns: [2.0, 3.0, None, float("nan")]  # noqa: E731
    total, per_function = combine_rewards(
        [a, b], ["p"] * 4, ["c"] * 4, weights=[1.0, 10.0], mode="sum"
    )
    np.testing.assert_array_equal(total[:2], [21.0, 30.0])
    assert np.isnan(total[2])  # every function returned None
    assert total[3] == 0.5  # NaN is "no reward", like None
    assert np.isnan(per_function[1, 0]) and per_function[1, 1] == 3.0


def test_combine_rewards_normalized_mode_by_hand():
    correct = lambda prompts, completions, **columns: [1, 0, 1, 0]  # noqa: E731
    length = lambda prompts, completions, **columns: [0.0, -0.5, None, -1.0]  # noqa: E731
    constant = lambda prompts, completions, **columns: [0.2, 0.2, 0.2, None]  # noqa: E731
    total, _ = combine_rewards(
        [correct, length, constant], ["p"] * 4, ["c"] * 4, mode="normalized", eps=1e-3
    )
    z_correct = np.array([0.5, -0.5, 0.5, -0.5]) / (0.5 + 1e-3)  # mean 0.5, std 0.5
    z_length = (np.array([0.0, -0.5, -1.0]) + 0.5) / (np.std([0.0, -0.5, -1.0]) + 1e-3)
    want = z_correct + np.array([z_length[0], z_length[1], 0.0, z_length[2]])
    np.testing.assert_allclose(total, want, rtol=1e-6)


def test_combine_rewards_constant_column_becomes_exact_zeros():
    tenth = lambda prompts, completions, **columns: [0.1] * 7  # noqa: E731
    total, _ = combine_rewards([tenth], ["p"] * 7, ["c"] * 7, mode="normalized")
    np.testing.assert_array_equal(total, np.zeros(7, np.float32))


def test_combine_rewards_default_weights_and_one_function():
    f = lambda prompts, completions, **columns: np.array([1.0, 2.0, 3.0])  # noqa: E731
    result = combine_rewards([f], ["p"] * 3, ["c"] * 3)
    assert isinstance(result, CombinedRewards)
    np.testing.assert_array_equal(result.total, [1.0, 2.0, 3.0])


def test_combine_rewards_passes_aligned_columns_as_lists():
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(columns, prompts=prompts, completions=completions)
        columns["answer"].append("mutated")  # must not leak into the next function
        return [float(n) for n in columns["completion_length"]]

    def check(prompts, completions, **columns):
        assert columns["answer"] == ["a0", "a0", "a1", "a1"]
        return [None] * 4

    prompts = ["p0", "p0", "p1", "p1"]
    total, _ = combine_rewards(
        [spy, check],
        prompts,
        ("c0", "c1", "c2", "c3"),
        columns={"answer": ("a0", "a0", "a1", "a1"), "completion_length": np.array([1, 2, 3, 4])},
    )
    assert isinstance(seen["completion_length"], list) and isinstance(seen["completions"], list)
    assert seen["completions"] == ["c0", "c1", "c2", "c3"]
    np.testing.assert_array_equal(total, [1, 2, 3, 4])


def test_combine_rewards_reraises_exceptions_naming_function_and_row():
    def parse_rows(prompts, completions, **columns):
        return [float(c) for c in completions]

    with pytest.raises(RewardFunctionError) as info:
        combine_rewards(
            [lambda p, c, **k: [0.0] * len(c), parse_rows], ["p"] * 4, ["1", "2", "oops", "x"]
        )
    err = info.value
    assert isinstance(err, RuntimeError)
    assert "'parse_rows'" in str(err) and "row 2" in str(err) and "'oops'" in str(err)
    assert "ValueError" in str(err)
    assert err.function_name == "parse_rows" and err.function_index == 1 and err.row == 2
    assert isinstance(err.__cause__, ValueError)


def test_combine_rewards_exception_without_row_tracing():
    calls = []

    def flaky(prompts, completions, **columns):
        calls.append(len(completions))
        raise KeyError("model server down")

    with pytest.raises(RewardFunctionError, match="flaky") as info:
        combine_rewards([flaky], ["p"] * 3, ["c"] * 3, locate_failing_row=False)
    assert info.value.row is None and calls == [3]
    assert isinstance(info.value.__cause__, KeyError)


def test_combine_rewards_batch_level_failure_has_no_row():
    def needs_two(prompts, completions, **columns):
        if len(completions) < 2:  # every row alone is fine
            return [0.0] * len(completions)
        raise ZeroDivisionError("whole batch")

    with pytest.raises(RewardFunctionError, match="not traced to a single row") as info:
        combine_rewards([needs_two], ["p"] * 2, ["c"] * 2)
    assert info.value.row is None
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_combine_rewards_wraps_builtin_reward_errors():
    with pytest.raises(RewardFunctionError, match=r"math_answer_reward.*row 0") as info:
        combine_rewards([math_answer_reward()], ["p"], ["\\boxed{1}"], columns={"sol": ["1"]})
    assert "needs the dataset column 'answer'" in str(info.value)


@pytest.mark.parametrize(
    ("output", "pattern"),
    [
        ([1.0, 2.0], "'bad' returned 2 rewards, expected 3"),
        ([1.0, 2.0, 3.0, 4.0], "'bad' returned 4 rewards, expected 3"),
        ({"a": 1.0}, "'bad' must return a list.*got dict"),
        (1.0, "'bad' must return a list.*got float"),
        ("1.0", "'bad' must return a list.*got str"),
        ((x for x in [1.0, 2.0, 3.0]), "'bad' must return a list.*got generator"),
        (np.ones((3, 1)), r"'bad' must return a 1-D .*shape \(3, 1\)"),
        ([1.0, "2.0", 3.0], r"'bad' returned '2.0' \(str\) at row 1"),
        ([1.0, 2.0, float("inf")], "'bad' returned a non-finite reward inf at row 2"),
        (np.array([1.0, -np.inf, 0.0]), "'bad' returned a non-finite reward -inf at row 1"),
        ([1.0, 10**400, 0.0], "'bad' returned a non-finite reward"),
    ],
)
def test_combine_rewards_validates_outputs(output, pattern):
    def bad(prompts, completions, **columns):
        return output

    with pytest.raises(ValueError, match=pattern):
        combine_rewards([bad], ["p"] * 3, ["c"] * 3)


def test_combine_rewards_accepts_tuples_arrays_and_numpy_scalars():
    f = lambda p, c, **k: (np.float32(0.5), None, True)  # noqa: E731
    g = lambda p, c, **k: np.array([1, 2, 3], dtype=np.int64)  # noqa: E731
    h = lambda p, c, **k: np.array([None, 1.0, None], dtype=object)  # noqa: E731
    total, per_function = combine_rewards([f, g, h], ["p"] * 3, ["c"] * 3)
    np.testing.assert_array_equal(total, [1.5, 3.0, 4.0])
    assert np.isnan(per_function[1, 0]) and np.isnan(per_function[0, 2])


def test_combine_rewards_argument_errors():
    f = lambda p, c, **k: [0.0] * len(c)  # noqa: E731
    with pytest.raises(ValueError, match=r"weights.*2.*got shape \(3,\)"):
        combine_rewards([f, f], ["p"], ["c"], weights=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="weights"):
        combine_rewards([f], ["p"], ["c"], weights=[float("nan")])
    with pytest.raises(TypeError, match="weights"):
        combine_rewards([f], ["p"], ["c"], weights=["heavy"])
    with pytest.raises(ValueError, match="mode"):
        combine_rewards([f], ["p"], ["c"], mode="mean")
    with pytest.raises(ValueError, match="at least one"):
        combine_rewards([], ["p"], ["c"])
    with pytest.raises(TypeError, match=r"funcs\[1\]"):
        combine_rewards([f, "not a function"], ["p"], ["c"])
    with pytest.raises(ValueError, match="1 prompts and 2 completions"):
        combine_rewards([f], ["p"], ["c", "d"])
    with pytest.raises(ValueError, match=r"columns\['answer'\].*\(2\), got 1"):
        combine_rewards([f], ["p", "p"], ["c", "d"], columns={"answer": ["a"]})
    with pytest.raises(TypeError, match=r"columns\['answer'\] must be a list"):
        combine_rewards([f], ["p"], ["c"], columns={"answer": "a"})
    with pytest.raises(TypeError, match="completions must be a list"):
        combine_rewards([f], ["p"], "c")
    with pytest.raises(ValueError, match="must not be named 'prompts'"):
        combine_rewards([f], ["p"], ["c"], columns={"prompts": ["p"]})
    with pytest.raises(ValueError, match="group_size"):
        combine_rewards([f], ["p"] * 4, ["c"] * 4, mode="normalized", group_size=3)
    with pytest.raises(TypeError, match="group_size"):
        combine_rewards([f], ["p"] * 4, ["c"] * 4, mode="normalized", group_size=2.0)
    with pytest.raises(ValueError, match="eps"):
        combine_rewards([f], ["p"], ["c"], eps=0.0)
    # Wrong types are TypeErrors, values of the right type out of range ValueErrors.
    with pytest.raises(TypeError, match=r"eps must be a real number, got '1e-6' \(str\)"):
        combine_rewards([f], ["p"], ["c"], eps="1e-6")
    with pytest.raises(TypeError, match="mode must be one of"):
        combine_rewards([f], ["p"], ["c"], mode=None)
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        combine_rewards([f], ["p"] * 4, ["c"] * 4, mode="normalized", group_size=0)


def test_combine_reward_columns_errors():
    with pytest.raises(ValueError, match="shape"):
        combine_reward_columns(np.zeros(3))
    with pytest.raises(ValueError, match="infinities"):
        combine_reward_columns(np.array([[np.inf]]))
    with pytest.raises(ValueError, match="weights"):
        combine_reward_columns(np.zeros((2, 2)), weights=[1.0])


def test_combine_rewards_empty_batch():
    f = lambda p, c, **k: []  # noqa: E731
    total, per_function = combine_rewards([f, f], [], [], mode="normalized")
    assert total.shape == (0,) and per_function.shape == (0, 2)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 4),
    st.floats(-100, 100),
    st.floats(0.01, 100),
    st.integers(0, 2**32 - 1),
)
def test_normalized_mode_is_invariant_to_shift_and_positive_scale(
    num_prompts, group, shift, scale, seed
):
    rng = np.random.default_rng(seed)
    # The group statistics are float32 (those of the advantages). Rewards on a grid of 1/8 are
    # equal or at least 1/8 apart, so float32 never merges two different transformed rewards
    # (which would turn a +-1 into a 0); rounding ``values * scale + shift`` to float32 still
    # moves a standardized value by about eps32 * |shift| / scale per unit of the group's std.
    values = np.round(_random_rewards(rng, num_prompts * group, 3) * 8) / 8
    kwargs = {"mode": "normalized", "group_size": group, "eps": 1e-12}
    base = combine_reward_columns(values, **kwargs)
    moved = combine_reward_columns(values * scale + shift, **kwargs)
    tol = 1e-4 + 64 * np.finfo(np.float32).eps * abs(shift) / scale
    np.testing.assert_allclose(moved, base, rtol=1e-4, atol=tol)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_sum_mode_equals_nansum_of_weighted_columns(batch, num_funcs, seed):
    rng = np.random.default_rng(seed)
    values = _random_rewards(rng, batch, num_funcs, missing=0.4)
    weights = rng.uniform(-3, 3, size=num_funcs)
    got = combine_reward_columns(values, weights=weights)
    all_missing = np.isnan(values).all(axis=1)
    want = np.where(all_missing, np.nan, np.nansum(values * weights, axis=1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_reward_combiner_matches_combine_rewards():
    rng = np.random.default_rng(7)
    values = _random_rewards(rng, 12, 3)
    funcs = [_column_function(values[:, f], f"r{f}") for f in range(3)]
    combiner = RewardCombiner(funcs, weights=[1.0, 0.5, -1.0], mode="normalized")
    total, per_function = combiner(["p"] * 12, ["c"] * 12, group_size=4, answer=["a"] * 12)
    chex.assert_shape(total, (12,))
    chex.assert_shape(per_function, (12, 3))
    chex.assert_type([total, per_function], np.float32)
    want = combine_rewards(
        funcs,
        ["p"] * 12,
        ["c"] * 12,
        weights=[1.0, 0.5, -1.0],
        mode="normalized",
        group_size=4,
        columns={"answer": ["a"] * 12},
    )
    np.testing.assert_array_equal(total, want.total)
    np.testing.assert_array_equal(per_function, want.per_function)
    assert combiner.names == ["r0", "r1", "r2"]
    assert "RewardCombiner(funcs=['r0', 'r1', 'r2']" in repr(combiner)


def test_reward_combiner_validates_at_construction():
    with pytest.raises(ValueError, match="weights"):
        RewardCombiner([named_reward], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="mode"):
        RewardCombiner([named_reward], mode="max")
    with pytest.raises(ValueError, match="group_size"):
        RewardCombiner([named_reward], group_size=0)
    with pytest.raises(ValueError, match="at least one"):
        RewardCombiner([])
    with pytest.raises(TypeError, match="callable"):
        RewardCombiner([None])


def test_end_to_end_gsm8k_style_batch():
    """Two prompts, three generations each, three rewards combined as the rollout would."""
    prompts = ["Natalia ..."] * 3 + ["Weng ..."] * 3
    completions = [
        "<think>48/2 = 24, 48 + 24 = 72</think><answer>\\boxed{72}</answer>",
        "<think>48 + 48 = 96</think><answer>96</answer>",
        "48/2 = 24 and 48 + 24 = 72\n#### 72",
        "<think>12/60 * 50</think><answer>$10.00</answer>",
        "<think>" + "hmm " * 50,
        "<think>0.2 per minute</think><answer>\\boxed{10}</answer>",
    ]
    columns = {
        "answer": [GSM8K_SOLUTION] * 3 + ["Weng earns ...\n#### 10"] * 3,
        "completion_length": [30, 20, 25, 28, 64, 60],
    }
    combiner = RewardCombiner(
        [math_answer_reward(), format_reward(), soft_overlong_penalty(64, 8)],
        weights=[1.0, 0.5, 1.0],
    )
    total, per_function = combiner(prompts, completions, **columns)
    np.testing.assert_array_equal(per_function[:, 0], [1, 0, 1, 1, 0, 1])
    np.testing.assert_array_equal(per_function[:, 1], [1, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(per_function[:, 2], [0, 0, 0, 0, -1, -0.5])
    np.testing.assert_array_equal(total, [1.5, 0.5, 1.0, 1.5, -1.0, 1.0])


def test_reward_combiner_takes_the_group_size_when_called():
    rng = np.random.default_rng(11)
    values = _random_rewards(rng, 12, 2)
    funcs = [_column_function(values[:, f], f"r{f}") for f in range(2)]
    prompts, completions = ["p"] * 12, ["c"] * 12
    per_group = _reference_combine(values, np.ones(2), "normalized", group_size=3)
    whole_batch = _reference_combine(values, np.ones(2), "normalized")

    combiner = RewardCombiner(funcs, mode="normalized")
    chex.assert_trees_all_close(
        combiner(prompts, completions, group_size=3).total, per_group, rtol=1e-5, atol=1e-5
    )
    # Without a group size anywhere, the whole batch is one normalization group.
    chex.assert_trees_all_close(
        combiner(prompts, completions).total, whole_batch, rtol=1e-5, atol=1e-5
    )
    # The deprecated constructor argument is a default for calls that pass none ...
    legacy = RewardCombiner(funcs, mode="normalized", group_size=3)
    chex.assert_trees_all_close(legacy(prompts, completions).total, per_group, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        legacy(prompts, completions, group_size=3).total, legacy(prompts, completions).total
    )
    # ... and a call may not contradict it.
    with pytest.raises(ValueError, match=r"group_size=4 passed when calling differs"):
        legacy(prompts, completions, group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        combiner(prompts, completions, group_size=5)
    with pytest.raises(TypeError, match="group_size"):
        combiner(prompts, completions, group_size=3.0)
    # "sum" mode does not depend on the group size.
    summed = RewardCombiner(funcs)
    np.testing.assert_array_equal(
        summed(prompts, completions, group_size=3).total, summed(prompts, completions).total
    )
