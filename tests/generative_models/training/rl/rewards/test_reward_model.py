"""reward_model_reward: a sequence-classification model as a reward function.

The expected scores come from transformers, scoring the texts the way TRL's GRPO trainer does
(tests/fixtures/make_reward_model_fixtures.py writes them to qwen2_rm/expected.json).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from artifex.generative_models.training.rl.rewards import (
    RewardCombiner,
    RewardModelReward,
    combine_rewards,
    reward_model_reward,
)
from artifex.generative_models.training.sharding import make_mesh

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "fixtures")
RM = os.path.join(FIXTURES, "reward_models", "qwen2_rm")
TOL = 1e-4

with open(os.path.join(RM, "expected.json"), encoding="utf-8") as _f:
    EXPECTED = json.load(_f)


@pytest.fixture(scope="module")
def rm() -> RewardModelReward:
    return reward_model_reward(RM, batch_size=3)


@pytest.mark.parametrize("kind", ["chat", "plain"])
def test_scores_equal_transformers_scoring_as_trl_does(rm, kind):
    case = EXPECTED[kind]
    ids = rm.encode(case["prompts"], case["completions"])
    for ours, theirs in zip(ids, case["input_ids"], strict=True):  # right-padded with 0 there
        assert theirs[: len(ours)] == ours and set(theirs[len(ours) :]) <= {0}
    scores = rm(case["prompts"], case["completions"])
    np.testing.assert_allclose(scores, case["scores"], atol=TOL, rtol=0)
    assert np.ptp(case["scores"]) > 100 * TOL  # distinct scores: a mix-up of rows would show


def test_scores_do_not_depend_on_batch_size_or_batch_neighbours(rm):
    case = EXPECTED["chat"]
    prompts = case["prompts"] * 3
    completions = [c + "!" * k for k in range(3) for c in case["completions"]]
    reference = np.asarray(reward_model_reward(RM, batch_size=1)(prompts, completions))
    for batch_size in (2, 5, 12, 16):
        got = reward_model_reward(RM, batch_size=batch_size)(prompts, completions)
        np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)
    order = np.random.default_rng(0).permutation(len(prompts))
    shuffled = rm([prompts[i] for i in order], [completions[i] for i in order])
    np.testing.assert_allclose(shuffled, reference[order], atol=1e-5, rtol=0)


def test_messages_column_is_read_instead_of_the_rendered_prompts(rm):
    case = EXPECTED["chat"]
    rendered = ["<rendered by the policy>"] * len(case["prompts"])
    plain = rm(rendered, case["completions"])
    column = reward_model_reward(RM, batch_size=3, messages_column="messages")
    got = column(rendered, case["completions"], messages=case["prompts"], answer=["x"] * 4)
    np.testing.assert_allclose(got, case["scores"], atol=TOL, rtol=0)
    assert not np.allclose(plain, case["scores"], atol=TOL)
    with pytest.raises(ValueError, match="needs the dataset column 'messages'"):
        column(rendered, case["completions"], answer=["x"] * 4)


def test_inside_combine_rewards_with_a_rule_reward_by_weight(rm):
    case = EXPECTED["plain"]

    def has_digit(prompts, completions, **columns):
        return [float(any(ch.isdigit() for ch in c)) for c in completions]

    total, per_function = combine_rewards(
        [rm, has_digit], case["prompts"], case["completions"], weights=[0.5, 2.0]
    )
    rule = np.array([float(any(ch.isdigit() for ch in c)) for c in case["completions"]])
    expected = 0.5 * np.asarray(case["scores"], np.float64) + 2.0 * rule
    np.testing.assert_allclose(total, expected, atol=TOL, rtol=0)
    np.testing.assert_allclose(per_function[:, 0], case["scores"], atol=TOL, rtol=0)
    combiner = RewardCombiner([rm, has_digit], weights=[0.5, 2.0])
    assert combiner.names == ["reward_model", "has_digit"]
    again = combiner(case["prompts"], case["completions"], group_size=2)
    np.testing.assert_allclose(again.total, total, atol=1e-6, rtol=0)


def test_affine_normalization(rm):
    case = EXPECTED["plain"]
    affine = reward_model_reward(RM, normalize="affine", scale=-2.0, shift=0.25)
    got = affine(case["prompts"], case["completions"])
    expected = -2.0 * np.asarray(case["scores"], np.float64) + 0.25
    np.testing.assert_allclose(got, expected, atol=2 * TOL, rtol=0)


def test_running_normalization_against_float64_statistics():
    running = reward_model_reward(RM, batch_size=4, normalize="running", eps=1e-6)
    raw = reward_model_reward(RM, batch_size=4)
    rng = np.random.default_rng(1)
    seen: list[float] = []
    for step in range(3):
        completions = ["".join(rng.choice(list("0123456789 abc!"), size=5)) for _ in range(4)]
        prompts = ["What is 12 + 30? "] * 4
        scores = np.asarray(raw(prompts, completions), np.float64)
        seen.extend(scores)
        mean, std = np.mean(seen), np.std(seen)  # population std of every score so far
        got = running(prompts, completions)
        np.testing.assert_allclose(got, (scores - mean) / (std + 1e-6), atol=1e-4, rtol=0)
        assert running.count == 4 * (step + 1)
    state = running.state_dict()
    fresh = reward_model_reward(RM, batch_size=4, normalize="running")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    running.reset()
    assert running.count == 0


def test_too_long_texts_raise_or_get_no_reward():
    strict = reward_model_reward(RM, max_length=8)
    long_text = "What is 12 + 30? The answer is 42."
    with pytest.raises(ValueError, match=r"row 1 has \d+ tokens, more than max_length=8"):
        strict(["", ""], ["42", long_text])
    lenient = reward_model_reward(RM, max_length=8, on_too_long="none")
    with pytest.warns(UserWarning, match="1 of 2 rows are longer than max_length=8"):
        got = lenient(["", ""], ["42", long_text])
    assert got[1] is None and isinstance(got[0], float)


def test_argument_errors():
    with pytest.raises(ValueError, match="label must be below the model's num_labels=1"):
        reward_model_reward(RM, label=1)
    with pytest.raises(ValueError, match="max_length must be at most"):
        reward_model_reward(RM, max_length=10_000)
    with pytest.raises(ValueError, match="normalize"):
        reward_model_reward(RM, normalize="zscore")
    with pytest.raises(ValueError, match="batch_size"):
        reward_model_reward(RM, batch_size=0)
    with pytest.raises(TypeError, match="model must be a checkpoint directory"):
        reward_model_reward(3)
    rm = reward_model_reward(RM)
    with pytest.raises(TypeError, match="must be a string or a list of chat messages"):
        rm([3], ["a"])
    with pytest.raises(ValueError, match="same length"):
        rm(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="encodes to no tokens"):
        rm([""], [""])


def test_runs_on_its_own_mesh():
    devices = jax.devices()
    if len(devices) < 3:
        pytest.skip("needs 3 devices")
    mesh = make_mesh(data=2, devices=devices[1:3])  # not the default device
    placed = reward_model_reward(RM, batch_size=4, mesh=mesh)
    kernel = placed.model.score.kernel[...]
    assert set(kernel.sharding.device_set) == set(devices[1:3])
    case = EXPECTED["chat"]
    np.testing.assert_allclose(
        placed(case["prompts"], case["completions"]), case["scores"], atol=TOL, rtol=0
    )


def test_one_compilation_per_padded_width():
    rm = reward_model_reward(RM, batch_size=4)
    case = EXPECTED["plain"]
    rm(case["prompts"], case["completions"])
    rm(case["prompts"][:3], ["1", "22", "333"])  # shorter texts, a partial batch: same width
    assert rm._forward._cache_size() == 1
    rm(["x" * 40], ["y"])  # a longer text: the next power-of-two width
    assert rm._forward._cache_size() == 2
