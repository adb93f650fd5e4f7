"""Tests for artifex.generative_models.training.rl.rewards.base."""

from __future__ import annotations

import functools

from artifex.generative_models.training.rl.rewards import (
    RewardFunction,
    format_reward,
    math_answer_reward,
    reward_names,
    soft_overlong_penalty,
)

# ------------------------------------------------------------------------------------------
# Names, protocol, combiner
# ------------------------------------------------------------------------------------------


class LengthReward:
    def __call__(self, prompts, completions, **columns):
        return [float(len(c)) for c in completions]


def named_reward(prompts, completions, **columns):
    return [0.0] * len(completions)


def test_reward_names():
    funcs = [
        format_reward(),
        format_reward(),
        named_reward,
        functools.partial(named_reward),
        LengthReward(),
        lambda p, c, **k: c,
        format_reward(),
    ]
    assert reward_names(funcs) == [
        "format_reward",
        "format_reward_2",
        "named_reward",
        "named_reward_2",
        "LengthReward",
        "<lambda>",
        "format_reward_3",
    ]
    assert reward_names([]) == []


def test_builtin_rewards_satisfy_the_protocol():
    for func in (
        math_answer_reward(),
        format_reward(),
        soft_overlong_penalty(4, 2),
        LengthReward(),
    ):
        assert isinstance(func, RewardFunction)
