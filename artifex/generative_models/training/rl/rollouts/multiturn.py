r"""Multi-turn rollouts: episodes with tools or environments, flattened into a ``GRPOBatch``.

Each of the ``G`` members of a group runs its own episode. An environment (see
:class:`Environment`) gives the opening messages of a dataset row; the model generates a turn
until an end-of-sequence id or a stop sequence (for tools, the end of a ``<tool_call>``
block); the environment answers the turn with observation messages (tool results, a game's
next state, a simulated user), an optional reward and whether the episode is over; the answer is
rendered through the tokenizer's chat template and appended, and the model continues, up to
``max_turns`` model turns and ``max_completion_tokens`` tokens after the prompt.

The KV cache carries across turns (:mod:`artifex.generative_models.inference.multiturn`): only the
appended tokens are prefilled, nothing already encoded is encoded again, and the compiled pieces
have static shapes (length buckets); the host loop runs between turns only.

The batch stays flat (row ``i`` is episode ``i % G`` of dataset row ``i // G``), so the trainer and
the loss are those of single-turn GRPO. A row's completion is everything after the prompt, in order:
the model's turns, the appended scaffolding and observations. The completion mask is 1 exactly on
the tokens the model generated, and the sampler's log-probs cover those tokens, so old-policy ratios
and the KL penalty apply to model tokens only while the whole conversation stays in context for the
log-prob pass.

Appended text is found from the chat template itself: with ``history`` the conversation up to
and including the model's last turn (as an assistant message) and ``obs`` the environment's
messages, the appended text is the part of the template's closing of the assistant message
that the model did not write itself (for example ``<|im_end|>\n`` after a ``</tool_call>``
stop), followed by ``render(history + obs, add_generation_prompt=True)`` minus
``render(history)``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.inference.multiturn import append_tokens, decode_turn
from artifex.generative_models.inference.sampling import (
    DEFAULT_PROMPT_BUCKETS,
    _per_layer_model,
    bucket_length,
)
from artifex.generative_models.inference.stop_strings import stop_string_table
from artifex.generative_models.training.rl.batch import GRPOBatch
from artifex.generative_models.training.rl.rewards import RewardCombiner
from artifex.generative_models.training.rl.rollouts.rollout import (
    Policy,
    Rollout,
    RolloutConfig,
    SupportsPolicy,
    _needs_sampler_log_probs,
    _sampler_matches_loss,
    as_policy,
)
from artifex.generative_models.training.rl.rollouts.tools import (
    DEFAULT_MAX_TOOL_THREADS,
    ToolRunner,
    live_tool_threads,
    parse_tool_calls,
)
from artifex.generative_models.training.rl.rollouts.truncation import mask_truncated_completions
from artifex.generative_models.utils.validation import (
    check_bool,
    check_callable,
    check_choice,
    check_int,
    check_str,
)

__all__ = [
    "Environment",
    "Episodes",
    "MultiTurnConfig",
    "MultiTurnRollout",
    "MultiTurnRolloutResult",
    "ToolEnvironment",
    "environment_reward",
    "run_episodes",
    "turn_step_rewards",
]

Message = dict[str, Any]
_SENTINEL = "\x00ARTIFEX-ASSISTANT-CONTENT\x00"


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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MultiTurnConfig:
    """Limits and settings of multi-turn episodes.

    Attributes:
        max_turns: Most model turns per episode; at most ``max_completion_tokens`` (every
            model turn writes at least one token, so more turns could never run).
        max_new_tokens: Most tokens per model turn (static shape of the turn program).
        max_completion_tokens: Most tokens after the prompt (model turns plus appended text);
            an episode that would exceed it ends ("token limit").
        stop_strings: Texts that end a model turn besides EOS (the default ends a Qwen-style
            tool call). They are matched on the turn's decoded text (special tokens written
            out), not on one tokenization: the turn ends at the token that completes the first
            occurrence, whichever tokens wrote it (``" </tool_call>"`` and ``"}</tool_call>"``
            included; see :mod:`~artifex.generative_models.inference.stop_strings`).
        max_observation_chars: Most characters of one observation message's content (a tool
            result, an environment's message). A longer content is cut to this many
            characters and a notice saying how long it was is appended to the text the model
            sees; the cuts are counted (``multiturn/truncated_observations_mean``). Cutting
            before tokenizing keeps a runaway tool output from stalling the rollout.
        completion_buckets: Completion widths the batch is padded to (fewer recompiles).
        turn_rewards_as_step_rewards: Put the environment's per-turn rewards in the batch's
            ``step_rewards`` at the last model token of each turn, so that token advantages
            come from process supervision (DeepSeekMath sec. 4.1.3) instead of the summed
            episode reward; ``False`` (default): per-turn rewards are only summed into
            ``env_reward`` and logged.

    Raises:
        TypeError: A field of the wrong type (``max_turns=2.0``, ``stop_strings`` as a list).
        ValueError: A field out of range, ``max_new_tokens > max_completion_tokens`` or
            ``max_turns > max_completion_tokens``.

    Examples:
        >>> from artifex.generative_models.training.rl import MultiTurnConfig
        >>> config = MultiTurnConfig(max_turns=3, max_new_tokens=32, max_completion_tokens=128)
        >>> config.max_turns, config.stop_strings
        (3, ('</tool_call>',))
        >>> MultiTurnConfig(max_turns=0)
        Traceback (most recent call last):
            ...
        ValueError: MultiTurnConfig.max_turns must be an int >= 1, got 0
    """

    max_turns: int = 4
    max_new_tokens: int = 128
    max_completion_tokens: int = 512
    stop_strings: tuple[str, ...] = ("</tool_call>",)
    completion_buckets: tuple[int, ...] = DEFAULT_PROMPT_BUCKETS
    turn_rewards_as_step_rewards: bool = False
    max_observation_chars: int = 8192

    def __post_init__(self) -> None:
        # Wrong type: TypeError; right type, out of range: ValueError (utils.validation).
        for name in (
            "max_turns",
            "max_new_tokens",
            "max_completion_tokens",
            "max_observation_chars",
        ):
            check_int(f"MultiTurnConfig.{name}", getattr(self, name), minimum=1)
        for name in ("max_new_tokens", "max_turns"):
            if getattr(self, name) > self.max_completion_tokens:
                msg = (
                    f"MultiTurnConfig.{name} ({getattr(self, name)}) must be <= "
                    f"max_completion_tokens ({self.max_completion_tokens})"
                )
                if name == "max_turns":
                    msg += ": every model turn writes at least one token"
                raise ValueError(msg)
        for name in ("stop_strings", "completion_buckets"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                msg = f"MultiTurnConfig.{name} must be a tuple, got {value!r}"
                raise TypeError(msg)
        for j, stop in enumerate(self.stop_strings):
            check_str(f"MultiTurnConfig.stop_strings[{j}]", stop)
        check_bool(
            "MultiTurnConfig.turn_rewards_as_step_rewards", self.turn_rewards_as_step_rewards
        )
        if not self.completion_buckets:
            msg = (
                "MultiTurnConfig.completion_buckets must be a non-empty tuple of ints >= 1, got ()"
            )
            raise ValueError(msg)
        for j, width in enumerate(self.completion_buckets):
            check_int(f"MultiTurnConfig.completion_buckets[{j}]", width, minimum=1)


@dataclasses.dataclass
class Episodes:
    """Finished episodes, one per batch row (row ``i``: episode ``i % G`` of prompt ``i // G``).

    Attributes:
        prompt_ids: ``(R, P)`` left-padded prompt ids (repeated per generation).
        prompt_mask: ``(R, P)`` 1 on real prompt tokens.
        completion_ids: ``(R, T)`` everything after the prompt, right-padded.
        completion_mask: ``(R, T)`` 1 exactly on tokens the model generated.
        log_probs: ``(R, T)`` sampler log-probs on model tokens (0 elsewhere).
        prompts: Rendered prompt texts, one per row.
        final_turns: The model's last turn as text, one per row.
        transcripts: Everything after the prompt as text (special tokens kept), one per row.
        messages: The whole conversation of each episode (chat messages).
        turns: ``(R,)`` model turns.
        tool_calls: ``(R,)`` tool calls (from the environment's ``tool_calls`` counter).
        tool_errors: ``(R,)`` failed tool calls.
        turn_limit: ``(R,)`` episodes stopped by ``max_turns``.
        token_limit: ``(R,)`` episodes stopped by a token limit (per turn or in total).
        env_reward: ``(R,)`` summed environment rewards (NaN: none given).
        turn_rewards: ``(R, max_turns)`` per-turn environment rewards (NaN: none).
        model_tokens: ``(R,)`` tokens the model generated.
        turn_ends: ``(R, max_turns)`` completion index of the last model token of each turn
            (-1: no such turn).
        tool_timeouts: ``(R,)`` tool calls that timed out (from the environment's
            ``tool_timeouts`` counter); ``None``: not counted.
        truncated_observations: ``(R,)`` observation messages cut to
            ``MultiTurnConfig.max_observation_chars``; ``None``: not counted.

    Examples:
        >>> import dataclasses
        >>> from artifex.generative_models.training.rl import Episodes
        >>> [f.name for f in dataclasses.fields(Episodes)][:5]
        ['prompt_ids', 'prompt_mask', 'completion_ids', 'completion_mask', 'log_probs']
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    log_probs: np.ndarray
    prompts: list[str]
    final_turns: list[str]
    transcripts: list[str]
    messages: list[list[Message]]
    turns: np.ndarray
    tool_calls: np.ndarray
    tool_errors: np.ndarray
    turn_limit: np.ndarray
    token_limit: np.ndarray
    env_reward: np.ndarray
    turn_rewards: np.ndarray
    model_tokens: np.ndarray
    turn_ends: np.ndarray
    tool_timeouts: np.ndarray | None = None
    truncated_observations: np.ndarray | None = None

    def metrics(self) -> dict[str, float]:
        """Episode statistics: turns, tool calls and errors, limits, per-turn rewards.

        ``multiturn/tool_threads_alive`` is read when this is called: the tool threads alive in
        the process
        (:func:`~artifex.generative_models.training.rl.rollouts.tools.live_tool_threads`),
        which grows while hung tools are abandoned.

        Returns:
            Scalar metrics under ``multiturn/``.
        """
        out = {
            "multiturn/turns_mean": float(self.turns.mean()),
            "multiturn/tool_calls_mean": float(self.tool_calls.mean()),
            "multiturn/tool_errors_mean": float(self.tool_errors.mean()),
            "multiturn/tool_call_rate": float((self.tool_calls > 0).mean()),
            "multiturn/turn_limit_fraction": float(self.turn_limit.mean()),
            "multiturn/token_limit_fraction": float(self.token_limit.mean()),
            "multiturn/model_tokens_mean": float(self.model_tokens.mean()),
            "multiturn/tool_threads_alive": float(live_tool_threads()),
        }
        if self.tool_timeouts is not None:
            out["multiturn/tool_timeouts_mean"] = float(np.mean(self.tool_timeouts))
        if self.truncated_observations is not None:
            out["multiturn/truncated_observations_mean"] = float(
                np.mean(self.truncated_observations)
            )
        given = ~np.isnan(self.turn_rewards)
        for t in np.flatnonzero(given.any(axis=0)):  # only the turns with a reward
            col = self.turn_rewards[:, t]
            out[f"multiturn/turn_reward_{t + 1}"] = float(np.nanmean(col))
        return out


def _render(tokenizer: Any, messages: list[Message], tools: Any, *, generation_prompt: bool) -> str:
    extra = {} if tools is None else {"tools": tools}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False, **extra
    )


def _appended_segments(
    tokenizer: Any, history: list[Message], obs: list[Message], tools: Any, generated: str
) -> list[tuple[str, bool]]:
    """Text to append after the model's turn ``generated`` (which ends ``history``), in pieces.

    Each piece is ``(text, plain)``: ``plain`` marks the content of an observation message as
    the template rendered it, which is encoded with special-token strings split into plain
    text (a tool's output cannot write special tokens); the rest is the template's own text.
    The content's rendering is found by rendering the observations with random markers in
    place of their contents, then each content alone, so that no content can pass itself off
    as template text.
    """
    probe = _render(
        tokenizer,
        [*history[:-1], {"role": "assistant", "content": _SENTINEL}],
        tools,
        generation_prompt=False,
    )
    closing = probe[probe.index(_SENTINEL) + len(_SENTINEL) :] if _SENTINEL in probe else ""
    overlap = 0
    for k in range(len(closing), 0, -1):
        if generated.endswith(closing[:k]):
            overlap = k
            break
    base = _render(tokenizer, history, tools, generation_prompt=False)

    def appended(messages: list[Message]) -> str:
        full = _render(tokenizer, [*history, *messages], tools, generation_prompt=True)
        if not full.startswith(base):
            msg = (
                "the chat template does not render the conversation as a prefix of its "
                "continuation, so turns cannot be appended; got "
                f"{base[-80:]!r} vs {full[len(base) - 80 : len(base)]!r}"
            )
            raise ValueError(msg)
        return full[len(base) :]

    text = appended(obs)
    nonce = secrets.token_hex(8)
    marks = {
        i: f"ARTIFEX{nonce}OBS{i}END"
        for i, m in enumerate(obs)
        if isinstance(m.get("content"), str) and m["content"]
    }
    if not marks:
        return [(closing[overlap:] + text, False)]

    def marked(real: int | None) -> str:
        return appended(
            [
                dict(m, content=marks[i]) if i in marks and i != real else m
                for i, m in enumerate(obs)
            ]
        )

    skeleton = marked(None)
    rendered: dict[int, str] = {}
    for i, mark in marks.items():
        count = skeleton.count(mark)
        if count:
            alone = marked(i)
            width = len(mark) + (len(alone) - len(skeleton)) // count
            start = skeleton.index(mark)
            rendered[i] = alone[start : start + width]
    pieces: list[tuple[str, bool]] = [(closing[overlap:], False)]
    last = 0
    by_mark = {mark: i for i, mark in marks.items()}
    for found in re.finditer("|".join(map(re.escape, by_mark)), skeleton):
        pieces += [(skeleton[last : found.start()], False), (rendered[by_mark[found[0]]], True)]
        last = found.end()
    pieces.append((skeleton[last:], False))
    if "".join(t for t, _ in pieces[1:]) != text:
        msg = (
            "the chat template renders an observation's content differently depending on the "
            "other messages' contents, so the content cannot be kept apart from the template's "
            "text (and encoded as plain text)"
        )
        raise ValueError(msg)
    merged: list[tuple[str, bool]] = []
    for piece, plain in pieces:
        if merged and merged[-1][1] == plain:
            merged[-1] = (merged[-1][0] + piece, plain)
        elif piece:
            merged.append((piece, plain))
    return merged


def _appended_text(
    tokenizer: Any, history: list[Message], obs: list[Message], tools: Any, generated: str
) -> str:
    """Text to append after the model's turn ``generated`` (which ends ``history``)."""
    return "".join(t for t, _ in _appended_segments(tokenizer, history, obs, tools, generated))


def _encode_segments(tokenizer: Any, segments: list[tuple[str, bool]]) -> list[int]:
    """Ids of the appended pieces: the template's text as usual, contents as plain text."""
    ids: list[int] = []
    for text, plain in segments:
        if plain:
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        else:
            ids += tokenizer.encode(text, add_special_tokens=False)
    return ids


def _check_plain_encoding(tokenizer: Any) -> None:
    """The tokenizer can encode text with special-token strings as plain text."""
    try:
        params = inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):
        return
    if "split_special_tokens" not in params and not any(
        p.kind is p.VAR_KEYWORD for p in params.values()
    ):
        msg = (
            f"run_episodes: {type(tokenizer).__name__}.encode has no split_special_tokens "
            "option; observations are encoded with it so that a tool's output cannot write "
            "special tokens (the library's Tokenizer has it)"
        )
        raise TypeError(msg)


def _truncated(content: str, limit: int) -> str:
    """``content`` cut to ``limit`` characters, with a notice the model sees."""
    return (
        content[:limit] + f"\n[truncated: the output has {len(content)} characters; the first "
        f"{limit} are shown]"
    )


def _checked_step(env: Any, result: Any, row: int, turn: int) -> tuple[list, float | None, bool]:
    """An environment's ``step`` result, checked: ``(observation, reward, done)``."""
    where = f"{type(env).__name__}.step (episode {row}, turn {turn + 1})"
    if not isinstance(result, tuple | list) or len(result) != 3:
        msg = (
            f"{where} must return (observation, reward, done), got "
            f"{type(result).__name__} {str(result)[:80]}"
        )
        raise TypeError(msg)
    obs, reward, done = result
    if not isinstance(done, bool | np.bool_):
        msg = f"{where} returned done={done!r} ({type(done).__name__}); expected a bool"
        raise TypeError(msg)
    if reward is not None:
        if isinstance(reward, bool | np.bool_) or not isinstance(reward, numbers.Real):
            msg = (
                f"{where} returned reward={reward!r} ({type(reward).__name__}); expected a "
                "real number or None (no reward)"
            )
            raise TypeError(msg)
        if not math.isfinite(float(reward)):
            msg = (
                f"{where} returned reward={reward!r}; expected a finite number or None "
                "(None is how an environment gives no reward)"
            )
            raise ValueError(msg)
        reward = float(reward)
    if obs is None:
        obs = []
    if not isinstance(obs, list | tuple):
        msg = (
            f"{where} returned observation of type {type(obs).__name__}; expected a list of "
            "chat messages or None"
        )
        raise TypeError(msg)
    for j, message in enumerate(obs):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            msg = (
                f"{where} returned observation[{j}]={str(message)[:80]!r}; expected a chat "
                "message (a mapping with a 'role' string)"
            )
            raise TypeError(msg)
    return list(obs), reward, bool(done)


def run_episodes(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    environment_factory: Callable[[], Environment],
    config: MultiTurnConfig,
    *,
    key: jax.Array,
    num_generations: int = 1,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> Episodes:
    """Runs ``num_generations`` episodes per row with one KV cache carried across turns.

    A turn ends at an end-of-sequence id or where its decoded text first contains one of
    ``config.stop_strings``. Each ``step`` result is checked (``done`` a bool, the reward a
    finite real number or ``None``, the observation a list of chat messages or ``None``).
    Observation contents longer than ``config.max_observation_chars`` are cut, with a notice
    the model reads; they are encoded with special-token strings split into plain text, so a
    tool's output (or anything it read) cannot open or close a turn of the conversation.

    Args:
        model: The causal LM.
        tokenizer: Its tokenizer (with a chat template).
        rows: Dataset rows.
        environment_factory: Builds one environment per episode (``factory()``).
        config: Turn and token limits, stop strings.
        key: PRNG key.
        num_generations: Episodes per row ``G``.
        temperature: Sampling temperature (0: greedy).
        top_k: Optional top-k.
        top_p: Nucleus mass.

    Returns:
        The :class:`Episodes`.

    Raises:
        ValueError: No rows, ``num_generations < 1``, the ``G`` episodes of a row open with
            different messages, the prompt does not fit the model's positions, or an
            environment's ``step`` returned a reward that is NaN or infinite.
        TypeError: ``num_generations`` is not an int, the tokenizer's ``encode`` has no
            ``split_special_tokens`` option, or an environment's ``step`` returned something
            other than ``(list of messages or None, real number or None, bool)`` (a string
            ``done`` or reward, say); the message names the environment, the episode, the
            turn and the field.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training.rl import MultiTurnConfig, run_episodes
        >>> template = "{% for m in messages %}{{ m.content }}={% endfor %}"
        >>> tok = Tokenizer.for_characters("0123456789+=goaein", chat_template=template)
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> class Countdown:
        ...     def reset(self, row):
        ...         self.left = 2
        ...         return [{"role": "user", "content": row["prompt"]}]
        ...     def step(self, text):
        ...         self.left -= 1
        ...         done = self.left == 0
        ...         return (None if done else [{"role": "user", "content": "again"}]), 1.0, done
        >>> episodes = run_episodes(CausalLM(cfg, rngs=nnx.Rngs(0)), tok, [{"prompt": "go"}],
        ...                         Countdown, MultiTurnConfig(max_turns=3, max_new_tokens=2,
        ...                         max_completion_tokens=64), key=jax.random.key(0),
        ...                         num_generations=2)
        >>> episodes.turns.tolist(), episodes.env_reward.tolist(), episodes.token_limit.tolist()
        ([2, 1], [2.0, nan], [False, True])
        >>> episodes.metrics()["multiturn/turns_mean"]
        1.5
    """
    if not rows:
        msg = "run_episodes needs at least one row"
        raise ValueError(msg)
    g = check_int("run_episodes: num_generations", num_generations, minimum=1)
    _check_plain_encoding(tokenizer)
    envs = [environment_factory() for _ in range(len(rows) * g)]
    histories: list[list[Message]] = []
    for i, env in enumerate(envs):
        histories.append(list(env.reset(rows[i // g])))
        if i % g and histories[-1] != histories[i - i % g]:
            msg = f"row {i // g}: the environment opened episodes of one group differently"
            raise ValueError(msg)
    tools = [getattr(env, "tool_schemas", None) for env in envs]
    prompt_texts = [
        _render(tokenizer, histories[i * g], tools[i * g], generation_prompt=True)
        for i in range(len(rows))
    ]
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in prompt_texts]
    p_ids, p_mask = tokenizer.pad_batch(encoded, side="left")
    width = bucket_length(p_ids.shape[1])
    p_ids, p_mask = tokenizer.pad_batch(encoded, length=width, side="left")
    cfg_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    longest = max(len(e) for e in encoded)
    if cfg_pos is not None and longest + config.max_completion_tokens > cfg_pos:
        msg = (
            f"the longest prompt has {longest} tokens and max_completion_tokens="
            f"{config.max_completion_tokens}, but the model has {cfg_pos} positions"
        )
        raise ValueError(msg)

    rows_n = len(envs)
    slots = width + 2 * config.max_completion_tokens + config.max_new_tokens
    # Layers stored stacked are sliced once for the whole rollout, not at every call below.
    model = _per_layer_model(model)
    cache = model.init_cache(len(rows), slots)
    # The prompts are prefilled at their bucketed width (one compiled program per bucket).
    cache, logits = append_tokens(
        model, cache, encoded, pad_id=tokenizer.pad_id, buckets=DEFAULT_PROMPT_BUCKETS
    )
    cache = cache.repeat(g)
    logits = jnp.repeat(logits, g, axis=0)

    eos = tuple(tokenizer.eos_ids)
    # Stop strings are matched on the decoded text of each turn, whatever its tokenization.
    stop_table = (
        jnp.asarray(stop_string_table(tokenizer, config.stop_strings, logits.shape[-1]))
        if config.stop_strings
        else None
    )
    comp_ids: list[list[int]] = [[] for _ in range(rows_n)]
    comp_mask: list[list[int]] = [[] for _ in range(rows_n)]
    comp_logp: list[list[float]] = [[] for _ in range(rows_n)]
    final = [""] * rows_n
    turns = np.zeros(rows_n, np.int32)
    turn_limit = np.zeros(rows_n, bool)
    token_limit = np.zeros(rows_n, bool)
    turn_rewards = np.full((rows_n, config.max_turns), np.nan)
    turn_ends = np.full((rows_n, config.max_turns), -1, np.int32)
    active = np.ones(rows_n, bool)
    truncations = np.zeros(rows_n, np.int32)
    budget = config.max_completion_tokens

    for turn in range(config.max_turns):
        free = cache.max_length - int(cache.index)
        room = max(budget - len(comp_ids[r]) for r in range(rows_n) if active[r])
        limit = min(config.max_new_tokens, room, free)
        if limit < 1:
            token_limit |= active
            break
        out = decode_turn(
            model,
            cache,
            logits,
            active,
            key=jax.random.fold_in(key, turn),
            max_new_tokens=config.max_new_tokens,
            limit=limit,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_ids=eos,
            stop_table=stop_table,
            pad_id=tokenizer.pad_id,
        )
        cache, logits = out.cache, out.logits
        toks, mask, logps = (np.asarray(x) for x in (out.tokens, out.mask, out.log_probs))
        ended = np.asarray(out.eos) | np.asarray(out.stopped)
        appends: list[list[int]] = [[] for _ in range(rows_n)]
        for r in np.flatnonzero(active):
            n = int(mask[r].sum())
            gen = [int(t) for t in toks[r, :n]]
            lp = [float(x) for x in logps[r, :n]]
            keep = min(n, budget - len(comp_ids[r]))
            comp_ids[r] += gen[:keep]
            comp_mask[r] += [1] * keep
            comp_logp[r] += lp[:keep]
            turn_ends[r, turn] = len(comp_ids[r]) - 1
            turns[r] += 1
            text = tokenizer.decode(gen[:keep], skip_special_tokens=True)
            final[r] = text
            histories[r].append({"role": "assistant", "content": text})
            if keep < n or not ended[r]:
                token_limit[r] = True
                active[r] = False
                continue
            obs, reward, done = _checked_step(envs[r], envs[r].step(text), r, turn)
            if reward is not None:
                turn_rewards[r, turn] = reward
            if done:
                active[r] = False
                continue
            if turn + 1 == config.max_turns:
                turn_limit[r] = True
                active[r] = False
                continue
            cap = config.max_observation_chars
            for j, message in enumerate(obs):
                content = message.get("content")
                if isinstance(content, str) and len(content) > cap:
                    obs[j] = dict(message, content=_truncated(content, cap))
                    truncations[r] += 1
            generated = tokenizer.decode(gen, skip_special_tokens=False)
            segments = _appended_segments(tokenizer, histories[r], obs, tools[r], generated)
            new = _encode_segments(tokenizer, segments)
            if len(comp_ids[r]) + len(new) + 1 > budget:
                token_limit[r] = True
                active[r] = False
                continue
            histories[r].extend(obs)
            appends[r] = new
            comp_ids[r] += new
            comp_mask[r] += [0] * len(new)
            comp_logp[r] += [0.0] * len(new)
        if not active.any():
            break
        longest_new = max(len(a) for a in appends)
        free = cache.max_length - int(cache.index)
        if bucket_length(longest_new, (8, 16, 32, 64, 128, 256, 512, 1024)) + 1 > free:
            for r in np.flatnonzero(active):  # no room left: these episodes end here
                k = len(appends[r])
                if k:
                    del comp_ids[r][-k:], comp_mask[r][-k:], comp_logp[r][-k:]
            token_limit |= active
            break
        cache, logits = append_tokens(
            model,
            cache,
            [a if active[r] else [] for r, a in enumerate(appends)],
            logits,
            pad_id=tokenizer.pad_id,
        )

    width_c = bucket_length(max(len(c) for c in comp_ids), config.completion_buckets)
    c_ids = np.full((rows_n, width_c), tokenizer.pad_id, np.int32)
    c_mask = np.zeros((rows_n, width_c), np.int32)
    c_logp = np.zeros((rows_n, width_c), np.float32)
    for r in range(rows_n):
        n = len(comp_ids[r])
        c_ids[r, :n], c_mask[r, :n], c_logp[r, :n] = comp_ids[r], comp_mask[r], comp_logp[r]
    rep = np.repeat(np.arange(len(rows)), g)
    return Episodes(
        prompt_ids=np.asarray(p_ids, np.int32)[rep],
        prompt_mask=np.asarray(p_mask, np.int32)[rep],
        completion_ids=c_ids,
        completion_mask=c_mask,
        log_probs=c_logp,
        prompts=[prompt_texts[i] for i in rep],
        final_turns=final,
        transcripts=[tokenizer.decode(c, skip_special_tokens=False) for c in comp_ids],
        messages=histories,
        turns=turns,
        tool_calls=np.asarray([getattr(e, "tool_calls", 0) for e in envs], np.int32),
        tool_errors=np.asarray([getattr(e, "tool_errors", 0) for e in envs], np.int32),
        turn_limit=turn_limit,
        token_limit=token_limit,
        env_reward=np.where(
            np.isnan(turn_rewards).all(axis=1), np.nan, np.nansum(turn_rewards, axis=1)
        ),
        turn_rewards=turn_rewards,
        model_tokens=c_mask.sum(axis=1).astype(np.int32),
        turn_ends=turn_ends,
        tool_timeouts=np.asarray([getattr(e, "tool_timeouts", 0) for e in envs], np.int32),
        truncated_observations=truncations,
    )


def turn_step_rewards(episodes: Episodes) -> np.ndarray:
    """Per-turn rewards placed at the last model token of each turn, NaN elsewhere.

    Args:
        episodes: Finished episodes.

    Returns:
        ``(R, T)`` float32 step rewards (the batch's ``step_rewards``).

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> import numpy as np
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training.rl import (
        ...     MultiTurnConfig, run_episodes, turn_step_rewards)
        >>> template = "{% for m in messages %}{{ m.content }}={% endfor %}"
        >>> tok = Tokenizer.for_characters("0123456789+=goaein", chat_template=template)
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> class OneTurn:
        ...     def reset(self, row):
        ...         return [{"role": "user", "content": row["prompt"]}]
        ...     def step(self, text):
        ...         return None, 0.5, True
        >>> episodes = run_episodes(CausalLM(cfg, rngs=nnx.Rngs(0)), tok, [{"prompt": "go"}],
        ...                         OneTurn, MultiTurnConfig(max_turns=1, max_new_tokens=2,
        ...                         max_completion_tokens=8), key=jax.random.key(0))
        >>> step = turn_step_rewards(episodes)
        >>> np.nansum(step).item(), int((~np.isnan(step)).sum())  # one reward, at the turn's end
        (0.5, 1)
    """
    out = np.full(episodes.completion_ids.shape, np.nan, np.float32)
    rows, turns = np.nonzero((episodes.turn_ends >= 0) & ~np.isnan(episodes.turn_rewards))
    out[rows, episodes.turn_ends[rows, turns]] = episodes.turn_rewards[rows, turns]
    return out


def _columns(rows: Sequence[Mapping[str, Any]], g: int, exclude: str, ep: Episodes) -> dict:
    names = sorted({n for row in rows for n in row} - {exclude})
    columns = {n: [row.get(n) for row in rows for _ in range(g)] for n in names}
    own = {
        "completion_length": [int(x) for x in ep.model_tokens],
        "env_reward": [float(x) for x in ep.env_reward],
        "turns": [int(x) for x in ep.turns],
        "tool_calls": [int(x) for x in ep.tool_calls],
        "transcript": ep.transcripts,
    }
    clash = sorted(set(own) & set(columns))
    if clash:
        msg = f"dataset columns {clash} clash with the multi-turn rollout's own columns"
        raise ValueError(msg)
    columns.update(own)
    return columns


@dataclasses.dataclass
class MultiTurnRolloutResult(Rollout):
    """A :class:`~artifex.generative_models.training.rl.rollouts.rollout.Rollout` with its episodes.

    Attributes:
        batch: The ``GRPOBatch`` (row ``i`` of prompt ``i // G``).
        rows: The dataset rows, one per prompt.
        prompts: The rendered prompts, one per prompt.
        completions: The model's final turn of each episode.
        rewards_per_function: ``(B, F)`` raw rewards of each function (NaN: none).
        reward_names: The functions' names.
        truncated: ``(B,)`` episodes stopped by the turn or token limit.
        lengths: ``(B,)`` model tokens of each episode (before ``mask_truncated_completions``).
        episodes: The :class:`Episodes` (turns, tool calls, limits, per-turn rewards).

    Examples:
        >>> from artifex.generative_models.training.rl import MultiTurnRolloutResult, Rollout
        >>> issubclass(MultiTurnRolloutResult, Rollout)  # the loop reads it like a Rollout
        True
    """

    episodes: Episodes | None = None

    def metrics(self) -> dict[str, float]:
        """The single-turn metrics plus the episodes' (see :meth:`Episodes.metrics`).

        Returns:
            Scalar metrics.
        """
        out = Rollout.metrics(self)
        if self.episodes is not None:
            out.update(self.episodes.metrics())
        return out


class MultiTurnRollout:
    """A rollout function for :func:`~artifex.generative_models.training.rl.run.loop.train`.

    ``MultiTurnRollout(factory, config)`` is called like
    :func:`~artifex.generative_models.training.rl.rollouts.rollout.rollout` (pass it as
    ``rollout_fn``)
    and its :meth:`evaluate` like :func:`~artifex.generative_models.training.rl.run.loop.evaluate`
    (``evaluate_fn``). Reward functions receive the model's final turn as ``completions`` and
    the columns ``completion_length`` (model tokens), ``env_reward``, ``turns``, ``tool_calls``
    and ``transcript`` besides the dataset's.

    Args:
        environment_factory: Builds one :class:`Environment` per episode.
        config: The :class:`MultiTurnConfig`.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import (
        ...     GRPOConfig, RewardCombiner, RolloutConfig)
        >>> from artifex.generative_models.training.rl import (
        ...     MultiTurnConfig, MultiTurnRollout, Policy, environment_reward)
        >>> template = "{% for m in messages %}{{ m.content }}={% endfor %}"
        >>> tok = Tokenizer.for_characters("0123456789+=goaein", chat_template=template)
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> policy = Policy(CausalLM(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=2))
        >>> class OneTurn:
        ...     def reset(self, row):
        ...         return [{"role": "user", "content": row["prompt"]}]
        ...     def step(self, text):
        ...         return None, 1.0, True
        >>> rollout_fn = MultiTurnRollout(OneTurn, MultiTurnConfig(max_turns=1, max_new_tokens=2,
        ...                                                        max_completion_tokens=8))
        >>> rewards = RewardCombiner([environment_reward])
        >>> result = rollout_fn(policy, tok, [{"prompt": "go"}], rewards, RolloutConfig(),
        ...                     key=jax.random.key(0))
        >>> type(result).__name__, result.batch.batch_size, result.episodes.turns.tolist()
        ('MultiTurnRolloutResult', 2, [1, 1])
        >>> result.metrics()["multiturn/turns_mean"]
        1.0
    """

    def __init__(self, environment_factory: Callable[[], Environment], config: MultiTurnConfig):
        check_callable("MultiTurnRollout: environment_factory", environment_factory)
        self.environment_factory = environment_factory
        self.config = config

    def __call__(
        self,
        policy: Policy | SupportsPolicy,
        tokenizer: Any,
        rows: Sequence[Mapping[str, Any]],
        rewards: RewardCombiner,
        config: RolloutConfig,
        *,
        key: jax.Array,
        need_old_log_probs: bool = False,
    ) -> MultiTurnRolloutResult:
        """Runs ``G`` episodes per row, scores them and builds the batch.

        Args:
            policy: The rollout :class:`Policy` (its model samples; ``num_generations`` and
                ``temperature`` from its config), or a ``GRPOTrainer``.
            tokenizer: The tokenizer.
            rows: Dataset rows.
            rewards: The reward functions.
            config: The single-turn settings read here: ``top_k``, ``top_p``,
                ``prompt_column`` (excluded from the columns), ``old_log_probs``.
            key: PRNG key.
            need_old_log_probs: Fill ``old_log_probs`` (see the single-turn rollout).

        Returns:
            A :class:`MultiTurnRolloutResult`.
        """
        policy = as_policy(policy)
        k = policy.config.num_generations
        ep = run_episodes(
            policy.model,
            tokenizer,
            rows,
            self.environment_factory,
            self.config,
            key=key,
            num_generations=k,
            temperature=policy.config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
        )
        columns = _columns(rows, k, config.prompt_column, ep)
        combined = rewards(ep.prompts, ep.final_turns, group_size=k, **columns)
        batch = GRPOBatch(
            prompt_ids=jnp.asarray(ep.prompt_ids),
            prompt_mask=jnp.asarray(ep.prompt_mask),
            completion_ids=jnp.asarray(ep.completion_ids),
            completion_mask=jnp.asarray(ep.completion_mask),
            rewards=jnp.asarray(combined.total, jnp.float32),
            group_size=k,
            shared_prompts=True,
        )
        if policy.config.mask_truncated_completions:  # a model turn cut by a token limit
            batch = mask_truncated_completions(batch, np.asarray(ep.token_limit, bool))
        if self.config.turn_rewards_as_step_rewards:
            batch = batch.replace(step_rewards=jnp.asarray(turn_step_rewards(ep)))
        if _needs_sampler_log_probs(policy.config):
            # The sampler's log-probs of the model's tokens (0 on tool and environment tokens,
            # which the completion mask leaves out), as the single-turn rollout does.
            batch = batch.replace(sampler_log_probs=jnp.asarray(ep.log_probs))
        if need_old_log_probs:
            use_sampler = config.old_log_probs == "sampler" or (
                config.old_log_probs == "auto" and _sampler_matches_loss(policy, config)
            )
            if use_sampler:
                batch = batch.replace(old_log_probs=jnp.asarray(ep.log_probs))
            if policy.score is None:
                msg = "need_old_log_probs=True needs a Policy with a score function"
                raise ValueError(msg)
            batch = policy.score(batch)
        return MultiTurnRolloutResult(
            batch=batch,
            rows=list(rows),
            prompts=ep.prompts[::k],
            completions=ep.final_turns,
            rewards_per_function=np.asarray(combined.per_function),
            reward_names=list(rewards.names),
            truncated=ep.token_limit | ep.turn_limit,
            lengths=np.asarray(ep.completion_mask).sum(axis=1),
            episodes=ep,
        )

    def evaluate(
        self,
        policy: Policy | SupportsPolicy,
        tokenizer: Any,
        rows: Sequence[Mapping[str, Any]],
        reward_fn: Callable[..., Sequence[float | None]],
        rollout_config: RolloutConfig,
        *,
        pass_threshold: float = 1.0,
        batch_size: int = 64,
    ) -> dict[str, float]:
        """Greedy pass@1 of one episode per row, with the tool-call rate.

        Args:
            policy: The rollout :class:`Policy` (its model plays greedily), or a
                ``GRPOTrainer``.
            tokenizer: The tokenizer.
            rows: Evaluation rows.
            reward_fn: Scores the final turns like a training reward function.
            rollout_config: Its ``prompt_column`` is excluded from the columns.
            pass_threshold: Reward needed to pass.
            batch_size: Rows per batch of episodes.

        Returns:
            ``eval/pass@1``, ``eval/reward_mean``, ``eval/tool_call_rate``, ``eval/turns_mean``.
        """
        model = as_policy(policy).model
        scores: list[float] = []
        calls: list[int] = []
        turns: list[int] = []
        for start in range(0, len(rows), batch_size):
            chunk = list(rows[start : start + batch_size])
            ep = run_episodes(
                model,
                tokenizer,
                chunk,
                self.environment_factory,
                self.config,
                key=jax.random.key(0),
                num_generations=1,
                temperature=0.0,
            )
            columns = _columns(chunk, 1, rollout_config.prompt_column, ep)
            values = reward_fn(ep.prompts, ep.final_turns, **columns)
            scores += [float("nan") if v is None else float(v) for v in values]
            calls += [int(c) for c in ep.tool_calls]
            turns += [int(t) for t in ep.turns]
        s = np.asarray(scores, np.float64)
        valid = ~np.isnan(s)
        return {
            "eval/pass@1": float(np.mean(np.where(valid, s, -np.inf) >= pass_threshold)),
            "eval/reward_mean": float(s[valid].mean()) if valid.any() else float("nan"),
            "eval/tool_call_rate": float(np.mean(np.asarray(calls) > 0)),
            "eval/turns_mean": float(np.mean(turns)),
        }
