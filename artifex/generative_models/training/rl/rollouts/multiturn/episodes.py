"""Multi-turn episodes: their settings, the episode runner and its per-turn rewards.

:func:`run_episodes` runs ``G`` episodes per dataset row with the KV cache carried across turns
(see :mod:`~artifex.generative_models.training.rl.rollouts.multiturn.rollout` for the layout of the
batch they become).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.inference.multiturn import append_tokens, decode_turn
from artifex.generative_models.inference.sampling import (
    DEFAULT_PROMPT_BUCKETS,
    bucket_length,
    per_layer_model,
)
from artifex.generative_models.inference.stop_strings import stop_string_table
from artifex.generative_models.training.rl.rollouts.multiturn.chat_segments import (
    _appended_segments,
    _check_plain_encoding,
    _encode_segments,
    _render,
    _truncated,
)
from artifex.generative_models.training.rl.rollouts.multiturn.environments import (
    Environment,
    Message,
)
from artifex.generative_models.training.rl.rollouts.multiturn.tools import (
    live_tool_threads,
)
from artifex.generative_models.utils.validation import (
    check_bool,
    check_int,
    check_str,
)

__all__ = ["Episodes", "MultiTurnConfig", "run_episodes", "turn_step_rewards"]


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
        (:func:`~artifex.generative_models.training.rl.rollouts.multiturn.tools.live_tool_threads`),
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
    model = per_layer_model(model)
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
