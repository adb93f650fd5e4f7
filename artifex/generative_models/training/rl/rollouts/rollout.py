"""Rollouts: dataset rows -> K sampled completions per prompt -> rewards -> a ``GRPOBatch``.

``rollout(policy, tokenizer, rows, rewards, config, key=...)`` tokenizes each row's prompt
(a string, or a list of chat messages rendered with the tokenizer's chat template), left-pads the
prompts, samples ``num_generations`` completions per prompt with the compiled KV-cache sampler,
decodes them, scores them with the reward functions (dataset columns repeated per generation,
plus ``completion_length`` in tokens), and assembles the ``GRPOBatch``, whose row ``i`` is
generation ``i % G`` of prompt ``i // G``.

Old log-probs (needed when the policy changes between updates on one generation batch, i.e.
``num_iterations > 1`` or several minibatches) come from the sampler when its distribution is
the one the loss scores (no top-k/top-p truncation, float32 parameters, no routing replay),
and are otherwise recomputed by the training graph. With ``GRPOConfig.routing_replay`` a
mixture-of-experts policy's sampler records each token's experts into
``GRPOBatch.routed_experts``, which the update and the recomputed old log-probs route to.
Reference log-probs are computed once per batch in that case
(``beta > 0``, a frozen reference model or the LoRA-disabled base); with a single update per
batch the trainer computes them inside its compiled step instead.

The settings and the sampling step (``RolloutConfig``, ``encode_prompts``,
``sample_completions``, ``Completions``, ``spans_processes``, ``check_engine_rollout``) are in
:mod:`~artifex.generative_models.training.rl.rollouts.sampling`; this module imports them, so
they stay importable from it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.inference.engines.base import RolloutEngine, SamplerEngine
from artifex.generative_models.inference.sampling import bucket_length, check_fits_positions
from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.core.policy import Policy
from artifex.generative_models.training.rl.rewards import RewardCombiner
from artifex.generative_models.training.rl.rollouts._routing import records_routing, routed_like

# The settings and the sampling step moved to sampling.py; imported here so that every import
# path stays (the names below that this module does not use itself are re-exported).
from artifex.generative_models.training.rl.rollouts.sampling import (  # noqa: F401
    _COMPLETION_LENGTH_CLASH,
    Completions,
    RolloutConfig,
    check_engine_rollout,
    encode_prompts,
    sample_completions,
    spans_processes,
)
from artifex.generative_models.training.rl.rollouts.step_rewards import StepRewards
from artifex.generative_models.training.rl.rollouts.truncation import mask_truncated_completions
from artifex.generative_models.training.sharding import host_array, local_rows, rows_to_global

__all__ = [
    "Policy",
    "Rollout",
    "SupportsPolicy",
    "rollout",
    "rollout_batch_like",
]


@runtime_checkable
class SupportsPolicy(Protocol):
    """Anything that can present itself as a :class:`Policy` (e.g. ``GRPOTrainer``).

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl import GRPOConfig, Policy
        >>> from artifex.generative_models.training.rl.rollouts.rollout import (
        ...     SupportsPolicy,
        ...     as_policy,
        ... )
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> class Holder:  # e.g. a trainer: anything with a policy() method
        ...     def policy(self):
        ...         return Policy(CausalLM(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=2))
        >>> isinstance(Holder(), SupportsPolicy), as_policy(Holder()).config.num_generations
        (True, 2)
    """

    def policy(self) -> Policy:
        """The policy view of this object."""
        ...


def as_policy(policy: Policy | SupportsPolicy) -> Policy:
    """``policy`` itself, or the :class:`Policy` view of an object that has one.

    Args:
        policy: A :class:`Policy` or an object with a ``policy()`` method (a ``GRPOTrainer``).

    Returns:
        The :class:`Policy`.

    Raises:
        TypeError: Neither (an object with only a ``model`` attribute is still read as
            ``Policy(model, GRPOConfig())``, with a ``DeprecationWarning``).
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, SupportsPolicy):
        view = policy.policy()
        if isinstance(view, Policy):
            return view
    if hasattr(policy, "model"):  # an object holding a model (the form earlier versions took)
        warnings.warn(
            "pass a rollout Policy (Policy(model, config)) or a GRPOTrainer; objects that merely "
            "hold a .model are read as Policy(model, GRPOConfig()) for compatibility",
            DeprecationWarning,
            stacklevel=3,
        )
        return Policy(model=policy.model, config=GRPOConfig(), mesh=getattr(policy, "mesh", None))
    msg = (
        "policy must be a rollout Policy or have a policy() method returning one (a "
        f"GRPOTrainer), got {type(policy).__name__}"
    )
    raise TypeError(msg)


@dataclasses.dataclass
class Rollout:
    """One generation batch and what the loop logs about it.

    On a mesh spanning several processes, ``batch`` is global while ``rows``, ``prompts`` and
    ``completions`` are this process's (its rows of the batch); ``rewards_per_function`` and
    ``truncated`` are all-gathered, so :meth:`metrics` is the same in every process.

    Attributes:
        batch: The ``GRPOBatch``: ``num_prompts * G`` rows, row ``i`` of prompt ``i // G``.
        rows: The dataset rows, one per prompt.
        prompts: The prompt texts as the model saw them (after the chat template).
        completions: The decoded completions, one per batch row.
        rewards_per_function: ``(B, F)`` raw rewards of each function (NaN: none).
        reward_names: The functions' names.
        truncated: ``(B,)`` rows that hit ``max_new_tokens`` without EOS.
        lengths: ``(B,)`` completion lengths in tokens before
            ``GRPOConfig.mask_truncated_completions`` zeroed any mask row (``None``: read them
            from the batch's completion mask).

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import (
        ...     GRPOConfig, RewardCombiner, RolloutConfig)
        >>> from artifex.generative_models.training.rl import Policy, rollout
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> policy = Policy(CausalLM(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=2))
        >>> def is_short(prompts, completions, **columns):
        ...     return [float(len(c) < 3) for c in completions]
        >>> ro = rollout(policy, tok, [{"prompt": "1+1="}], RewardCombiner([is_short]),
        ...              RolloutConfig(max_new_tokens=3), key=jax.random.key(0))
        >>> ro.batch.batch_size, len(ro.completions), ro.reward_names
        (2, 2, ['is_short'])
        >>> sorted(ro.metrics())
        ['completion_length_max', 'rewards/is_short', 'truncated_fraction']
    """

    batch: GRPOBatch
    rows: list[Mapping[str, Any]]
    prompts: list[str]
    completions: list[str]
    rewards_per_function: np.ndarray
    reward_names: list[str]
    truncated: np.ndarray
    lengths: np.ndarray | None = None

    def metrics(self) -> dict[str, float]:
        """Per-rollout statistics: each reward function's mean, truncation rate, lengths.

        Returns:
            Scalar metrics.
        """
        out = {}
        for name, column in zip(self.reward_names, self.rewards_per_function.T, strict=True):
            valid = ~np.isnan(column)
            out[f"rewards/{name}"] = float(column[valid].mean()) if valid.any() else float("nan")
        lengths = self.lengths
        if lengths is None:
            lengths = host_array(self.batch.completion_mask).sum(axis=1)
        out["completion_length_max"] = float(lengths.max())
        out["truncated_fraction"] = float(np.mean(self.truncated))
        return out


def _needs_sampler_log_probs(grpo: GRPOConfig) -> bool:
    """Whether the loss reads ``GRPOBatch.sampler_log_probs`` (correction or off-policy mask)."""
    return grpo.sampler_correction != "none" or grpo.off_policy_mask_threshold is not None


def _sampler_matches_loss(policy: Policy, config: RolloutConfig) -> bool:
    """Whether the sampler's log-probs are the ones the loss scores."""
    dtype = getattr(policy.model, "dtype", jnp.float32)
    return config.top_k is None and config.top_p >= 1.0 and jnp.dtype(dtype) == jnp.float32


def rollout(
    policy: Policy | SupportsPolicy,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    rewards: RewardCombiner,
    config: RolloutConfig,
    *,
    key: jax.Array,
    need_old_log_probs: bool = False,
    placement: Any = None,
    step_rewards: StepRewards | None = None,
    engine: RolloutEngine | None = None,
) -> Rollout:
    """Samples ``num_generations`` completions per row, scores them and builds the batch.

    Args:
        policy: The :class:`Policy` (its model samples; its config gives
            ``num_generations`` and ``temperature``; the training mesh; the scorer of old
            log-probs), or an object
            with a ``policy()`` method such as a ``GRPOTrainer``.
        tokenizer: The tokenizer (encode, decode, pad, chat template, EOS/pad ids).
        rows: Dataset rows, one per prompt.
        rewards: The reward functions and how they combine.
        config: Rollout settings.
        key: PRNG key for sampling.
        need_old_log_probs: Fill ``old_log_probs`` (and ``ref_log_probs`` when the policy
            has a reference and ``beta > 0``): needed when the policy changes between updates
            on this batch. The sampler's log-probs serve where they are the loss's
            (``RolloutConfig.old_log_probs``; ``"auto"`` recomputes them under routing
            replay, so that the first ratio of an update is 1); the rest is the policy's
            ``score``, or, for a policy without one, left to the caller (the training loop
            scores them as a stage of its own, ``GRPOTrainer.fill_log_probs``).
        placement: A :class:`~artifex.generative_models.training.placement.RolloutPlacement`
            to sample on a mesh of its own (weights resharded onto it first, the batch moved
            back to the trainer's mesh); ``None`` samples with the trainer's model where it is.
        step_rewards: A ``StepRewards``
            (:mod:`~artifex.generative_models.training.rl.rollouts.step_rewards`) whose
            per-step rewards fill ``step_rewards`` (process supervision); ``None``: none.
        engine: A :class:`~artifex.generative_models.inference.engines.RolloutEngine` that
            samples (given the policy's weights first, when they changed): its per-token
            log-probs fill ``sampler_log_probs`` when the loss reads them; old log-probs are
            recomputed by the training graph under ``old_log_probs="auto"`` unless the engine is
            the library's own ``SamplerEngine``. ``None``: the library's sampler.

    Returns:
        A :class:`Rollout`.

    Raises:
        ValueError: Missing prompt column, empty or too-long prompts, a reward function with
            the wrong output (see the rewards module), or an ``engine`` with a ``placement``
            (see
            :func:`~artifex.generative_models.training.rl.rollouts.sampling.check_engine_rollout`
            for the rest).

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import (
        ...     GRPOConfig, RewardCombiner, RolloutConfig)
        >>> from artifex.generative_models.training.rl import Policy, rollout
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> policy = Policy(CausalLM(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=4))
        >>> def has_digit(prompts, completions, **columns):
        ...     return [float(any(ch.isdigit() for ch in c)) for c in completions]
        >>> ro = rollout(policy, tok, [{"prompt": "1+1="}, {"prompt": "2+3="}],
        ...              RewardCombiner([has_digit]), RolloutConfig(max_new_tokens=3),
        ...              key=jax.random.key(0))
        >>> ro.batch.batch_size, ro.batch.group_size, ro.batch.completion_ids.shape
        (8, 4, (8, 3))
        >>> ro.batch.rewards.shape, ro.rewards_per_function.shape
        ((8,), (8, 1))
    """
    if not rows:
        msg = "rollout needs at least one dataset row"
        raise ValueError(msg)
    if step_rewards is not None and not isinstance(step_rewards, StepRewards):
        msg = f"rollout: step_rewards must be a StepRewards, got {type(step_rewards).__name__}"
        raise TypeError(msg)
    policy = as_policy(policy)
    grpo = policy.config
    k = grpo.num_generations
    mesh = policy.mesh
    if engine is not None and placement is not None:
        msg = "rollout: a rollout placement is for the library's sampler, not for an engine"
        raise ValueError(msg)
    sampler_model, sampler_mesh = policy.model, mesh
    replay = records_routing(policy, engine)  # GRPOConfig.routing_replay (mixture of experts)
    if placement is not None:  # the sampler on its own mesh: sync the weights onto it
        sampler_model, sampler_mesh = placement.sampler_model(policy.model), placement.mesh
    sampled = sample_completions(
        sampler_model,
        tokenizer,
        rows,
        config,
        key=key,
        num_generations=k,
        temperature=grpo.temperature,
        mesh=sampler_mesh,
        engine=engine,
        record_routing=replay,
    )
    out = sampled.output
    combined = rewards(sampled.prompts, sampled.completions, group_size=k, **sampled.columns)
    batch = GRPOBatch(
        prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask,
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        rewards=_rewards_array(combined.total, mesh),
        group_size=k,
        shared_prompts=True,
        routed_experts=out.routed_experts if replay else None,
    )
    if grpo.mask_truncated_completions:  # DAPO's overlong filtering (truncation.py)
        batch = mask_truncated_completions(batch, out.truncated)
    if step_rewards is not None:  # process supervision from the text (step_rewards.py)
        across = spans_processes(sampler_mesh)
        ids = (local_rows if across else host_array)(out.completion_ids)
        per_token = step_rewards.token_rewards(
            tokenizer, sampled.prompts, sampled.completions, ids, sampled.lengths,
            **sampled.columns,
        )  # fmt: skip
        batch = batch.replace(step_rewards=_rewards_array(per_token, mesh))
    if _needs_sampler_log_probs(grpo):
        batch = batch.replace(sampler_log_probs=out.log_probs)
    if placement is not None:  # back onto the training mesh
        batch = placement.to_training(batch, mesh)
    if need_old_log_probs:
        use_sampler = config.old_log_probs == "sampler" or (
            config.old_log_probs == "auto"
            and _sampler_matches_loss(policy, config)
            and (engine is None or type(engine) is SamplerEngine)  # its numbers are the loss's
            and not replay  # recomputed under the recorded routing: the first ratio is 1
        )
        if use_sampler:
            old = out.log_probs
            if placement is not None:
                old = placement.to_training(old, mesh)
            batch = batch.replace(old_log_probs=old)
        if policy.score is not None:  # else the caller scores (the training loop does)
            batch = policy.score(batch)
    return Rollout(
        batch=batch,
        rows=list(rows),
        prompts=sampled.prompts[::k],
        completions=sampled.completions,
        rewards_per_function=_all_rows(combined.per_function, mesh),
        reward_names=list(rewards.names),
        truncated=_all_rows(sampled.truncated, mesh),
        lengths=_all_rows(sampled.lengths, mesh),
    )


def rollout_batch_like(
    policy: Policy | SupportsPolicy,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    config: RolloutConfig,
    *,
    need_old_log_probs: bool = False,
) -> GRPOBatch:
    """Zeros laid out as the batch :func:`rollout` returns for ``rows``, without sampling.

    The same fields, shapes, dtypes and static flags: the prompts encoded and padded to the
    sampler's length bucket, ``max_new_tokens`` completion columns, the sampler's log-probs when
    the loss reads them, and with ``need_old_log_probs`` what the policy's scorer fills (its
    shapes traced, nothing computed). This is the example
    :meth:`~artifex.generative_models.training.rl.update.trainer.GRPOTrainer.compile_ahead` needs to
    compile the update while the first rollout samples. For one process and the trainer's own
    mesh (a rollout placement moves the batch between meshes).

    Args:
        policy: As for :func:`rollout`.
        tokenizer: As for :func:`rollout`.
        rows: The dataset rows the rollout will read.
        config: As for :func:`rollout`.
        need_old_log_probs: As for :func:`rollout`.

    Returns:
        A :class:`GRPOBatch` of zeros (ones in the masks).

    Raises:
        ValueError: The rows are empty, their prompts are missing, empty or too long for
            ``max_prompt_length`` or the model's positions, a row has a ``completion_length``
            column (as :func:`rollout` would say), the mesh spans several processes, or
            ``need_old_log_probs`` without a scorer.
        TypeError: ``config`` is not a
            :class:`~artifex.generative_models.training.rl.rollouts.sampling.RolloutConfig`,
            ``need_old_log_probs`` not a bool, or ``rows`` not a sequence.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import GRPOConfig, RolloutConfig
        >>> from artifex.generative_models.training.rl import Policy, rollout_batch_like
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> policy = Policy(CausalLM(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=4))
        >>> like = rollout_batch_like(policy, tok, [{"prompt": "1+1="}, {"prompt": "2+3="}],
        ...                           RolloutConfig(max_new_tokens=3))
        >>> like.prompt_ids.shape, like.completion_ids.shape, like.shared_prompts
        ((8, 16), (8, 3), True)
    """
    if not isinstance(config, RolloutConfig):
        msg = f"rollout_batch_like: config must be a RolloutConfig, got {type(config).__name__}"
        raise TypeError(msg)
    if not isinstance(need_old_log_probs, bool):
        msg = f"rollout_batch_like: need_old_log_probs must be a bool, got {need_old_log_probs!r}"
        raise TypeError(msg)
    if isinstance(rows, str | bytes | Mapping) or not isinstance(rows, Sequence):
        msg = f"rollout_batch_like: rows must be a sequence of rows, got {type(rows).__name__}"
        raise TypeError(msg)
    if not rows:
        msg = "rollout_batch_like needs at least one dataset row"
        raise ValueError(msg)
    policy = as_policy(policy)
    if spans_processes(policy.mesh):
        msg = "rollout_batch_like: the mesh spans several processes (their prompt widths differ)"
        raise ValueError(msg)
    # The rollout's own checks of these rows, so that a batch it would refuse is refused here.
    _, ids, mask = encode_prompts(
        tokenizer,
        rows,
        prompt_column=config.prompt_column,
        max_prompt_length=config.max_prompt_length,
    )
    check_fits_positions(policy.model, int(mask.sum(axis=1).max()), config.max_new_tokens)
    if any(isinstance(row, Mapping) and "completion_length" in row for row in rows):
        raise ValueError(_COMPLETION_LENGTH_CLASH)
    k, n = policy.config.num_generations, config.max_new_tokens
    batch = GRPOBatch.zeros(len(rows), k, bucket_length(ids.shape[1]), n)
    batch = batch.replace(shared_prompts=True)
    batch = routed_like(policy, batch)  # GRPOConfig.routing_replay: the recorded experts
    if _needs_sampler_log_probs(policy.config):
        batch = batch.replace(sampler_log_probs=jnp.zeros((batch.batch_size, n), jnp.float32))
    if need_old_log_probs:
        if policy.score is None:
            msg = "rollout_batch_like(need_old_log_probs=True) needs a Policy with a score function"
            raise ValueError(msg)
        shapes = jax.eval_shape(policy.score, batch)
        batch = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return batch


def _rewards_array(total: Any, mesh: Any) -> jax.Array:
    """The ``(B,)`` float32 rewards; across processes, global from each process's rows."""
    total = np.asarray(total, np.float32)
    return rows_to_global(total, mesh) if spans_processes(mesh) else jnp.asarray(total)


def _all_rows(local: Any, mesh: Any) -> np.ndarray:
    """Every process's rows of a host array, in row order (the array itself in one process)."""
    local = np.asarray(local)
    if not spans_processes(mesh):
        return local
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local, tiled=True))
