"""Evaluation in the training loop: greedy pass@1 on held-out rows, and sampled pass@k.

:func:`evaluate` is the greedy evaluation (one completion per prompt at temperature 0), on one
process or across the processes of a mesh. :class:`RunEvaluation` is the loop's evaluation
stage: the greedy figures of ``evaluate`` (or a custom ``evaluate_fn``), plus pass@k, mean@n
and maj@n (:mod:`~artifex.generative_models.training.rl.run.evaluation_metrics`) when several
samples per prompt are asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from artifex.generative_models.training.rl.core.policy import Policy
from artifex.generative_models.training.rl.rollouts.rollout import (
    RolloutConfig,
    SupportsPolicy,
    as_policy,
    sample_completions,
    spans_processes,
)
from artifex.generative_models.training.rl.run.evaluation_metrics import evaluate_sampled
from artifex.generative_models.training.sharding import process_row_range

__all__ = ["EVAL_BATCH_SIZE", "RunEvaluation", "check_eval_row_groups", "evaluate"]

#: Prompts per generation call of :func:`evaluate` (and so of the training loop's evaluation).
EVAL_BATCH_SIZE = 64


def evaluate(
    policy: Policy | SupportsPolicy,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    reward_fn: Callable[..., Sequence[float | None]],
    rollout_config: RolloutConfig,
    *,
    pass_threshold: float = 1.0,
    batch_size: int = EVAL_BATCH_SIZE,
    placement: Any = None,
) -> dict[str, float]:
    """Greedy pass@1 and mean reward on held-out rows.

    One greedy completion per prompt; ``pass@1`` is the fraction of prompts whose completion
    scores at least ``pass_threshold`` (rows without a reward count as failures).

    Args:
        policy: The rollout :class:`~artifex.generative_models.training.rl.rollouts.rollout.Policy`
            (its model generates, on its mesh), or a ``GRPOTrainer``.
        tokenizer: The tokenizer.
        rows: Evaluation rows.
        reward_fn: Scores completions like a training reward function.
        rollout_config: Prompt column, ``max_new_tokens``, prompt length limit.
        pass_threshold: Reward needed to pass.
        batch_size: Prompts per generation call.
        placement: Sample on this
            :class:`~artifex.generative_models.training.placement.RolloutPlacement`'s mesh
            (``None``: on the policy's).

    Returns:
        ``{"eval/pass@1": ..., "eval/reward_mean": ...}``.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import GRPOConfig, RolloutConfig
        >>> from artifex.generative_models.training.rl import Policy, evaluate
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> policy = Policy(CausalLM(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=2))
        >>> def always(prompts, completions, **columns):
        ...     return [1.0] * len(completions)
        >>> evaluate(policy, tok, [{"prompt": "1+1="}, {"prompt": "2+2="}], always,
        ...          RolloutConfig(max_new_tokens=2))
        {'eval/pass@1': 1.0, 'eval/reward_mean': 1.0}
    """
    policy = as_policy(policy)
    check_eval_row_groups(rollout_config, len(rows), batch_size)
    model, mesh = policy.model, policy.mesh
    if placement is not None:
        model, mesh = placement.sampler_model(policy.model), placement.mesh
    if spans_processes(mesh):
        return _evaluate_across_processes(
            model, tokenizer, rows, reward_fn, rollout_config, pass_threshold, batch_size, mesh
        )
    scores: list[float] = []
    for start in range(0, len(rows), batch_size):
        chunk = list(rows[start : start + batch_size])
        sampled = sample_completions(
            model,
            tokenizer,
            chunk,
            rollout_config,
            key=jax.random.key(0),
            num_generations=1,
            temperature=0.0,
            mesh=mesh,
        )
        values = reward_fn(sampled.prompts, sampled.completions, **sampled.columns)
        scores += [float("nan") if v is None else float(v) for v in values]
    return _pass_metrics(np.asarray(scores, np.float64), pass_threshold)


def check_eval_row_groups(rollout_config: RolloutConfig, num_rows: int, batch_size: int) -> None:
    """Raises unless ``RolloutConfig.row_groups`` divides every batch :func:`evaluate` samples.

    Args:
        rollout_config: The rollout settings (``row_groups=None`` passes).
        num_rows: Evaluation rows.
        batch_size: Prompts per generation call.

    Raises:
        ValueError: Naming the setting and the batch sizes.

    Examples:
        >>> from artifex.generative_models.training import RolloutConfig
        >>> from artifex.generative_models.training.rl.run.loop import check_eval_row_groups
        >>> check_eval_row_groups(RolloutConfig(row_groups=2), 130, 64)  # 64, 64 and 2
        >>> check_eval_row_groups(RolloutConfig(row_groups=2), 67, 64)  # 64 and 3
        Traceback (most recent call last):
            ...
        ValueError: RolloutConfig.row_groups=2 must divide every evaluation batch: ...
    """
    groups = rollout_config.row_groups
    if groups is None or groups == 1 or num_rows == 0:
        return
    sizes = sorted({min(batch_size, num_rows), num_rows % batch_size} - {0}, reverse=True)
    if any(size % groups for size in sizes):
        msg = (
            f"RolloutConfig.row_groups={groups} must divide every evaluation batch: {num_rows} "
            f"evaluation rows in batches of {batch_size} give batches of {sizes}"
        )
        raise ValueError(msg)


def _pass_metrics(s: np.ndarray, pass_threshold: float) -> dict[str, float]:
    valid = ~np.isnan(s)
    return {
        "eval/pass@1": float(np.mean(np.where(valid, s, -np.inf) >= pass_threshold)),
        "eval/reward_mean": float(s[valid].mean()) if valid.any() else float("nan"),
    }


def _evaluate_across_processes(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    reward_fn: Callable[..., Sequence[float | None]],
    rollout_config: RolloutConfig,
    pass_threshold: float,
    batch_size: int,
    mesh: Any,
) -> dict[str, float]:
    """:func:`evaluate` on a mesh spanning processes: each scores its rows, scores gathered.

    Each chunk of prompts is padded (repeating its last row) to a multiple of the data shards,
    each process generates and scores its contiguous part, and the scores are all-gathered so
    every process returns the same figures; the padding rows are dropped.
    """
    from jax.experimental import multihost_utils

    from artifex.generative_models.training.sharding import num_data_shards

    shards = num_data_shards(mesh)
    step = max(shards, batch_size - batch_size % shards)
    scores: list[float] = []
    for begin in range(0, len(rows), step):
        chunk = list(rows[begin : begin + step])
        real = len(chunk)
        chunk += [chunk[-1]] * (-real % shards)
        lo, hi = process_row_range(len(chunk), mesh)
        sampled = sample_completions(
            model,
            tokenizer,
            chunk[lo:hi],
            rollout_config,
            key=jax.random.key(0),
            num_generations=1,
            temperature=0.0,
            mesh=mesh,
        )
        values = reward_fn(sampled.prompts, sampled.completions, **sampled.columns)
        local = np.asarray([np.nan if v is None else float(v) for v in values], np.float64)
        every = np.asarray(multihost_utils.process_allgather(local, tiled=True), np.float64)
        scores += every[:real].tolist()
    return _pass_metrics(np.asarray(scores, np.float64), pass_threshold)


class RunEvaluation:
    """The training loop's evaluation stage: ``metrics = evaluation(step)``.

    Greedy pass@1 and mean reward (:func:`evaluate`, or ``evaluate_fn`` with its signature),
    and with ``num_samples > 1`` the sampled metrics of
    :func:`~artifex.generative_models.training.rl.run.evaluation_metrics.evaluate_sampled`,
    drawn with ``fold_in(fold_in(rng, 2**31 - 1), step)``.

    Args:
        policy: What generates.
        tokenizer: The tokenizer.
        rows: The evaluation rows (``None``: no evaluation; calls return ``None``).
        reward_fn: Scores the completions.
        rollout_config: Prompt column, lengths, sampling settings.
        rng: The run's PRNG key.
        pass_threshold: Reward needed to pass.
        num_samples: Samples per prompt for the sampled metrics (1: greedy only).
        evaluate_fn: Replaces :func:`evaluate` (``None``: :func:`evaluate`).
        placement: A rollout placement to sample on (``None``: the policy's mesh).

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import GRPOConfig, RolloutConfig
        >>> from artifex.generative_models.training.rl import Policy
        >>> from artifex.generative_models.training.rl.run.evaluation import RunEvaluation
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> policy = Policy(CausalLM(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=2))
        >>> evaluation = RunEvaluation(policy, tok, [{"prompt": "1+1="}],
        ...                            lambda prompts, completions, **c: [1.0] * len(completions),
        ...                            RolloutConfig(max_new_tokens=2), rng=jax.random.key(0))
        >>> evaluation(0)
        {'eval/pass@1': 1.0, 'eval/reward_mean': 1.0}
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer: Any,
        rows: Sequence[Mapping[str, Any]] | None,
        reward_fn: Callable[..., Sequence[float | None]],
        rollout_config: RolloutConfig,
        *,
        rng: jax.Array,
        pass_threshold: float = 1.0,
        num_samples: int = 1,
        evaluate_fn: Callable[..., dict[str, float]] | None = None,
        placement: Any = None,
    ):
        self.policy = policy
        self.tokenizer = tokenizer
        self.rows = rows
        self.reward_fn = reward_fn
        self.rollout_config = rollout_config
        self.rng = rng
        self.pass_threshold = pass_threshold
        self.num_samples = num_samples
        self.evaluate_fn = evaluate if evaluate_fn is None else evaluate_fn
        self.extra = {} if placement is None else {"placement": placement}

    def __call__(self, step: int) -> dict[str, float] | None:
        """The evaluation metrics at ``step`` (``None`` without evaluation rows).

        Args:
            step: The training step (keys the sampled metrics' draws).

        Returns:
            The metrics, or ``None``.
        """
        if self.rows is None:
            return None
        metrics = self.evaluate_fn(
            self.policy,
            self.tokenizer,
            self.rows,
            self.reward_fn,
            self.rollout_config,
            pass_threshold=self.pass_threshold,
            **self.extra,
        )
        if self.num_samples > 1:  # pass@k, maj@n (evaluation_metrics.py)
            metrics = metrics | evaluate_sampled(
                self.policy,
                self.tokenizer,
                self.rows,
                self.reward_fn,
                self.rollout_config,
                num_samples=self.num_samples,
                key=jax.random.fold_in(jax.random.fold_in(self.rng, 2**31 - 1), step),
                pass_threshold=self.pass_threshold,
                **self.extra,
            )
        return metrics
