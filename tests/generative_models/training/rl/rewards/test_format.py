"""Tests for artifex.generative_models.training.rl.rewards.format."""

from __future__ import annotations

import re

import pytest

from artifex.generative_models.training.rl.rewards import (
    format_reward,
)

# ------------------------------------------------------------------------------------------
# Format reward
# ------------------------------------------------------------------------------------------

FORMAT_CASES = [
    ("<think>reasoning</think><answer>42</answer>", 1.0),
    ("<think>\nreasoning\n</think>\n<answer>\n42\n</answer>\n", 1.0),
    ("  <think>a</think>  <answer>b</answer>", 1.0),
    ("<think>a</think><answer>b</answer> trailing text", 0.0),
    ("leading <think>a</think><answer>b</answer>", 0.0),
    ("<answer>b</answer><think>a</think>", 0.0),
    ("<think>a</think>", 0.0),
    ("<think></think><answer>b</answer>", 0.0),
    ("<think>a</think><answer>  </answer>", 0.0),
    ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),
    ("<think>a<think>b</think><answer>c</answer>", 0.0),
    ("<think>a</think>text<answer>b</answer>", 0.0),
    ("", 0.0),
]


@pytest.mark.parametrize(("completion", "expected"), FORMAT_CASES)
def test_format_reward_tags_fullmatch(completion, expected):
    reward = format_reward()
    assert reward(["q"], [completion]) == [expected]


def test_format_reward_search_and_values():
    reward = format_reward(match="search", correct_reward=0.5, incorrect_reward=-0.5)
    completions = [
        "leading <think>a</think><answer>b</answer> trailing",
        "<think>a</think> and then <answer>b</answer>",
        "<answer>b</answer>",
    ]
    assert reward(["q"] * 3, completions) == [0.5, -0.5, -0.5]


def test_format_reward_custom_tags_and_patterns():
    answer_only = format_reward(tags=("answer",), name="answer_format")
    two = ["<answer>1</answer>", "<think>x</think><answer>1</answer>"]
    assert answer_only(["q", "q"], two) == [1.0, 0.0]
    assert answer_only.__name__ == "answer_format"

    boxed_full = format_reward(r".*\\boxed\{.+\}\s*")
    boxed_search = format_reward(r"\\boxed\{.+\}", match="search")
    compiled = format_reward(re.compile(r"ANSWER: \d+"), match="search")
    completions = ["work\nmore\n\\boxed{3}", "\\boxed{3} and more", "ANSWER: 12", "nothing"]
    assert boxed_full(["q"] * 4, completions) == [1.0, 0.0, 0.0, 0.0]
    assert boxed_search(["q"] * 4, completions) == [1.0, 1.0, 0.0, 0.0]
    assert compiled(["q"] * 4, completions) == [0.0, 0.0, 1.0, 0.0]
    assert format_reward().__name__ == "format_reward"


def test_format_reward_errors():
    with pytest.raises(ValueError, match="match"):
        format_reward(match="prefix")
    with pytest.raises(ValueError, match="tags"):
        format_reward(tags=())
    with pytest.raises(ValueError, match="tags"):
        format_reward(tags=("a b",))
    with pytest.raises(ValueError, match="pattern"):
        format_reward("(unclosed")
    with pytest.raises(ValueError, match="incorrect_reward"):
        format_reward(incorrect_reward=float("nan"))
    with pytest.raises(TypeError, match="completion 1 must be a str"):
        format_reward()(["q", "q"], ["x", None])
    with pytest.raises(TypeError, match="match must be one of"):
        format_reward(match=1)
    with pytest.raises(TypeError, match=r"tags\[1\] must be a str"):
        format_reward(tags=("think", 3))
    with pytest.raises(TypeError, match="pattern must be a str"):
        format_reward(pattern=3)


def test_format_reward_is_linear_time_on_long_completions():
    long = "<think>" + "x" * 200_000 + "</think><answer>1</answer>"
    assert format_reward()(["q"], [long]) == [1.0]
    assert format_reward()(["q"], ["<think>" * 20_000]) == [0.0]
