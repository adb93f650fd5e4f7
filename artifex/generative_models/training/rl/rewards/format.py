"""The format reward: a regular expression or a sequence of ``<tag>...</tag>`` blocks."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from artifex.generative_models.training.rl.rewards.base import (
    RewardFunction,
    _check_name,
    _check_reward_value,
)
from artifex.generative_models.utils.validation import check_choice, check_str

__all__ = ["format_reward"]

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
        TypeError: if an argument has the wrong type (``match=1``, a tag that is not a string,
            a reward that is not a number); (when called) if a completion is not a string.

    Examples:
        >>> from artifex.generative_models.training.rl import format_reward
        >>> reward = format_reward()  # <think>...</think><answer>...</answer>
        >>> reward(["q", "q"], ["<think>2+2</think> <answer>4</answer>", "<answer>4</answer>"])
        [1.0, 0.0]
        >>> format_reward("[0-9]+")(["q", "q"], ["42", "forty-two"])
        [1.0, 0.0]

    References:
        DeepSeek-AI, "DeepSeek-R1: Incentivizing Reasoning Capability in LLMs via
        Reinforcement Learning", arXiv:2501.12948, 2025 (format rewards).
    """
    check_choice("match", match, ("fullmatch", "search"))
    correct = _check_reward_value(correct_reward, "correct_reward")
    incorrect = _check_reward_value(incorrect_reward, "incorrect_reward")
    func_name = _check_name(name)
    check_blocks = pattern is None
    if pattern is None:
        tags = tuple(tags)
        if not tags:
            msg = "tags must name at least one tag when pattern is None, got ()"
            raise ValueError(msg)
        for j, tag in enumerate(tags):
            check_str(f"tags[{j}]", tag)
            if not _TAG_NAME_RE.fullmatch(tag):
                msg = f"tags must be XML-like tag names, got {tag!r}"
                raise ValueError(msg)
        compiled = _tags_pattern(tags)
    elif isinstance(pattern, re.Pattern):
        compiled = pattern
    elif not isinstance(pattern, str):
        msg = (
            "pattern must be a str, a compiled re.Pattern or None, "
            f"got {pattern!r} ({type(pattern).__name__})"
        )
        raise TypeError(msg)
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
