"""Environments of multi-turn rollouts: the protocol, tools as an environment, its reward.

An :class:`Environment` gives a dataset row's opening messages and answers each model turn
with observation messages, an optional reward and whether the episode is over
(:func:`~artifex.generative_models.training.rl.rollouts.multiturn.episodes.run_episodes`
drives it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from artifex.generative_models.training.rl.rollouts.multiturn.tools import (
    DEFAULT_MAX_TOOL_THREADS,
    ToolRunner,
    parse_tool_calls,
)
from artifex.generative_models.utils.validation import (
    check_choice,
)

__all__ = ["Environment", "Message", "ToolEnvironment", "environment_reward"]

Message = dict[str, Any]


@runtime_checkable
class Environment(Protocol):
    """What a multi-turn rollout talks to; one instance per episode.

    ``reset(row)`` returns the opening chat messages for a dataset row. ``step(text)`` receives
    the model's turn (decoded, special tokens removed) and returns
    ``(observation, reward, done)``: the messages to append (``None`` or empty when there are
    none), a reward for this turn (``None``: none) and whether the episode is over. Episode
    rewards are summed into the ``env_reward`` column reward functions receive
    (:func:`environment_reward` reads it). Optional attributes read by the rollout:
    ``tool_schemas`` (passed to the chat template as ``tools``), ``tool_calls`` and
    ``tool_errors`` (counters for the metrics).

    Examples:
        >>> class Countdown:  # two turns, then done; any object with reset/step will do
        ...     def reset(self, row):
        ...         self.left = 2
        ...         return [{"role": "user", "content": row["prompt"]}]
        ...     def step(self, text):
        ...         self.left -= 1
        ...         if self.left == 0:
        ...             return None, 1.0, True
        ...         return [{"role": "user", "content": "again"}], 0.0, False
        >>> env = Countdown()
        >>> env.reset({"prompt": "go"})
        [{'role': 'user', 'content': 'go'}]
        >>> env.step("1")
        ([{'role': 'user', 'content': 'again'}], 0.0, False)
        >>> env.step("2")
        (None, 1.0, True)
    """

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """Opening messages for a row.

        Args:
            row: The dataset row.

        Returns:
            Chat messages.
        """
        ...

    def step(self, completion: str) -> tuple[list[Message] | None, float | None, bool]:
        """Answers one model turn.

        Args:
            completion: The model's turn as text.

        Returns:
            ``(observation messages or None, reward or None, done)``.
        """
        ...


class ToolEnvironment:
    """The environment of tool use: run the turn's tool calls, end on a turn without any.

    Args:
        tools: The tools (callables with type hints and Google docstrings).
        tool_format: How calls are written: ``"qwen"`` (``<tool_call>`` JSON) or ``"llama3"``.
        timeout: Seconds per tool call.
        prompt_column: The row's prompt column (a string becomes one user message; a list of
            messages is used as is).
        system_prompt: Optional system message put first.
        max_threads: Most tool threads alive in the process at once, calls abandoned after
            their timeout included (see :class:`ToolRunner`); beyond it a call is not run and
            the model gets an error.

    Attributes:
        tool_calls: Calls in the current episode.
        tool_errors: Failed calls (malformed, unknown tool, bad arguments, exception,
            timeout, not text, overloaded).
        tool_timeouts: Calls that timed out (their threads were abandoned).

    Examples:
        >>> from artifex.generative_models.training.rl import ToolEnvironment
        >>> def multiply(a: int, b: int) -> int:
        ...     '''Multiplies two integers.
        ...
        ...     Args:
        ...         a: The first factor.
        ...         b: The second factor.
        ...     '''
        ...     return a * b
        >>> env = ToolEnvironment([multiply], tool_format="qwen")
        >>> env.reset({"prompt": "What is 6*7?"})
        [{'role': 'user', 'content': 'What is 6*7?'}]
        >>> obs, reward, done = env.step(
        ...     '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>')
        >>> obs, done, env.tool_calls
        ([{'role': 'tool', 'name': 'multiply', 'content': '42'}], False, 1)
        >>> env.step("42")  # a turn without a tool call ends the episode
        (None, None, True)
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        *,
        tool_format: Literal["qwen", "llama3"] = "qwen",
        timeout: float = 10.0,
        prompt_column: str = "prompt",
        system_prompt: str | None = None,
        max_threads: int = DEFAULT_MAX_TOOL_THREADS,
    ):
        check_choice("ToolEnvironment.tool_format", tool_format, ("qwen", "llama3"))
        self.runner = ToolRunner(tools, timeout=timeout, max_threads=max_threads)
        self.tool_schemas = self.runner.schemas
        self.tool_format = tool_format
        self.prompt_column = prompt_column
        self.system_prompt = system_prompt
        self.tool_calls = 0
        self.tool_errors = 0
        self.tool_timeouts = 0

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """Opening messages: the optional system prompt and the row's prompt.

        Args:
            row: The dataset row.

        Returns:
            Chat messages.

        Raises:
            ValueError: The row has no prompt column.
            TypeError: The prompt is neither a string nor a list of messages.
        """
        if self.prompt_column not in row:
            msg = f"dataset row has no prompt column {self.prompt_column!r} (it has {sorted(row)})"
            raise ValueError(msg)
        prompt = row[self.prompt_column]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
            messages = [dict(m) for m in prompt]
        else:
            msg = (
                f"column {self.prompt_column!r} must hold a string or chat messages, "
                f"got {type(prompt).__name__}"
            )
            raise TypeError(msg)
        if self.system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        self.tool_calls = 0
        self.tool_errors = 0
        self.tool_timeouts = 0
        return messages

    def step(self, completion: str) -> tuple[list[Message] | None, float | None, bool]:
        """Runs the turn's tool calls; a turn without calls ends the episode.

        Args:
            completion: The model's turn.

        Returns:
            ``(tool messages, None, False)`` after calls, ``(None, None, True)`` otherwise.
        """
        calls = parse_tool_calls(completion, self.tool_format)
        if not calls:
            return None, None, True
        results = self.runner.run_all(calls)
        self.tool_calls += len(results)
        self.tool_errors += sum(r.error is not None for r in results)
        self.tool_timeouts += sum(r.error == "timeout" for r in results)
        # The name is rendered by the template as its own text: only a known tool's name is
        # used (the model's spelling of an unknown one stays in the error message's content).
        known = self.runner.tools
        messages = [
            {"role": "tool", "name": r.name if r.name in known else "unknown", "content": r.content}
            for r in results
        ]
        return messages, None, False


def environment_reward(
    prompts: list[str], completions: list[str], env_reward: list[float], **columns: Any
) -> list[float | None]:
    """The environment's summed episode reward (``None`` where it gave none).

    Args:
        prompts: The prompts (unused).
        completions: Final model turns (unused).
        env_reward: The ``env_reward`` column of a multi-turn rollout (NaN: none).
        **columns: Other columns (unused).

    Returns:
        One reward (or ``None``) per row.

    Examples:
        >>> from artifex.generative_models.training.rl import environment_reward
        >>> environment_reward(["q", "q"], ["a", "b"], env_reward=[1.0, float("nan")])
        [1.0, None]
    """
    return [None if v is None or math.isnan(v) else float(v) for v in env_reward]
