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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.rewards import RewardCombiner
from artifex.generative_models.training.rl.rollouts.multiturn.environments import (
    Environment,
    ToolEnvironment,
    environment_reward,
)
from artifex.generative_models.training.rl.rollouts.multiturn.episodes import (
    Episodes,
    MultiTurnConfig,
    run_episodes,
    turn_step_rewards,
)
from artifex.generative_models.training.rl.rollouts.rollout import (
    Policy,
    Rollout,
    RolloutConfig,
    SupportsPolicy,
    _needs_sampler_log_probs,
    _sampler_matches_loss,
    as_policy,
)
from artifex.generative_models.training.rl.rollouts.truncation import mask_truncated_completions
from artifex.generative_models.utils.validation import (
    check_callable,
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
    ``rollout_fn``) and its :meth:`evaluate` like
    :func:`~artifex.generative_models.training.rl.run.evaluation.evaluate` (``evaluate_fn``).
    Reward functions receive the model's final turn as ``completions`` and the columns
    ``completion_length`` (model tokens), ``env_reward``, ``turns``, ``tool_calls`` and
    ``transcript`` besides the dataset's.

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
            need_old_log_probs: Fill ``old_log_probs`` from the sampler where its numbers are
                the loss's, and the rest with ``policy.score`` when the policy has one (a
                ``GRPOTrainer`` does; the training loop's policy does not: it scores them
                itself, as for the single-turn rollout).

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
            if policy.score is not None:  # else the caller scores (the training loop does)
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
