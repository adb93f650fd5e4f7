"""The stages of a training step after its rollout: score, advantages, updates, records.

The loop (:func:`~artifex.generative_models.training.rl.run.loop.train`) runs them in this
order on the step's generation batch, placed once on the trainer's mesh:

1. :func:`score_old_log_probs`: old and reference log-probs, when several updates share the
   batch (``mu > 1`` or several minibatches), by the trainer's compiled forward pass;
2. :func:`add_advantages`: the advantages, once per generation batch, by the one group kernel,
   stored in the batch, with the reward metrics from the same statistics;
3. :func:`run_updates`: ``num_iterations`` passes, each ``num_minibatches`` updates, each one
   ``GRPOTrainer.apply_prepared``;
4. :func:`step_metrics` and :func:`log_completions`: what the step records.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.completions import CompletionLog
from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.objective import (
    batch_reward_metrics,
    compute_advantages,
)
from artifex.generative_models.training.rl.rollouts.rollout import spans_processes
from artifex.generative_models.training.rl.run.data import GenerationBatch, take_rows
from artifex.generative_models.training.rl.update.state import NonFiniteUpdateError
from artifex.generative_models.training.sharding import host_array, process_row_range

if TYPE_CHECKING:
    from artifex.generative_models.training.rl.update.trainer import GRPOTrainer

__all__ = [
    "add_advantages",
    "learning_rate",
    "log_completions",
    "run_updates",
    "score_old_log_probs",
    "step_metrics",
]


def score_old_log_probs(trainer: GRPOTrainer, batch: GRPOBatch) -> GRPOBatch:
    """The batch with the old and reference log-probs the rollout left to the loop.

    The rollout fills ``old_log_probs`` from the sampler where its numbers are the loss's;
    this stage fills the rest with the trainer's graph
    (:meth:`~artifex.generative_models.training.rl.update.trainer_batches.TrainerBatches.fill_log_probs`):
    the old log-probs when missing, the reference's when ``beta > 0`` and a reference exists.

    Args:
        trainer: The trainer (its current policy is the one that sampled the batch).
        batch: The generation batch, placed on the trainer's mesh.

    Returns:
        The scored batch.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import GRPOConfig, GRPOTrainer
        >>> from artifex.generative_models.training.rl.run.steps import score_old_log_probs
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2, beta=0.04),
        ...                       reference_model=nnx.clone(model))
        >>> batch = trainer.prepare_batch({"observations": jnp.ones((2, 4)),
        ...     "actions": jnp.array([0, 2]), "rewards": jnp.array([1.0, 0.0])})
        >>> batch.old_log_probs is None, batch.ref_log_probs is None
        (True, True)
        >>> scored = score_old_log_probs(trainer, trainer.place_batch(batch))
        >>> scored.old_log_probs.shape, bool(jnp.allclose(scored.old_log_probs,
        ...                                               scored.ref_log_probs))  # same weights
        ((2, 1), True)
    """
    return trainer.fill_log_probs(batch)


@functools.partial(jax.jit, static_argnums=1)
def _advantages(batch: GRPOBatch, config: Any) -> jax.Array:
    return compute_advantages(batch, config)


@jax.jit
def _batch_metrics(batch: GRPOBatch) -> dict[str, jax.Array]:
    """Reward and advantage metrics of a whole generation batch (groups contiguous)."""
    return batch_reward_metrics(batch, batch.advantages)


def add_advantages(batch: GRPOBatch, config: Any) -> tuple[GRPOBatch, dict[str, jax.Array]]:
    """The batch with its advantages, and its reward and advantage metrics.

    Computed once per generation batch by the one kernel
    (:func:`~artifex.generative_models.training.rl.core.objective.compute_advantages`) and laid
    out as the batch's rows are (as the example the first update was compiled ahead for), so
    every update and every record reads these.

    Args:
        batch: The placed generation batch.
        config: The run's ``GRPOConfig``.

    Returns:
        ``(batch, metrics)``: the metrics as device scalars.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import GRPOBatch, GRPOConfig
        >>> from artifex.generative_models.training.rl.run.steps import add_advantages
        >>> batch = GRPOBatch.zeros(2, 2, 3, 4).replace(rewards=jnp.array([1.0, 0.0, 2.0, 2.0]))
        >>> batch, metrics = add_advantages(batch, GRPOConfig(num_generations=2))
        >>> [round(a, 3) for a in batch.advantages.tolist()]  # the second group's are equal
        [0.707, -0.707, 0.0, 0.0]
        >>> float(metrics["reward_mean"]), float(metrics["frac_reward_zero_std"])
        (1.25, 0.5)
    """
    adv = _advantages(batch, config)
    like = batch.rewards if adv.ndim == 1 else batch.completion_mask
    sharding = getattr(like, "sharding", None)
    if sharding is not None and adv.sharding != sharding:
        adv = jax.device_put(adv, sharding)
    batch = batch.replace(advantages=adv)
    return batch, _batch_metrics(batch)


def run_updates(
    trainer: GRPOTrainer, batch: GRPOBatch, config: Any, *, key: jax.Array, step: int
) -> list[dict[str, float]]:
    """GRPO's ``mu`` passes over the batch, each ``num_minibatches`` updates of the trainer.

    Each pass shuffles the rows (from ``key``) when there are several minibatches; each update
    is one :meth:`~artifex.generative_models.training.rl.update.trainer.GRPOTrainer.apply_prepared`
    with ``gradient_accumulation_steps`` microbatches (``None``: the trainer's choice).

    Args:
        trainer: The trainer.
        batch: The scored generation batch with its advantages.
        config: The ``TrainConfig``.
        key: The step's key.
        step: The step (for the error message).

    Returns:
        Each update's metrics, as floats.

    Raises:
        NonFiniteUpdateError: An update was rejected, naming the step and the update; the
            trainer keeps the last finite state.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import (
        ...     GRPOConfig, GRPOTrainer, TrainConfig)
        >>> from artifex.generative_models.training.rl.run.steps import (
        ...     add_advantages, run_updates)
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> grpo = GRPOConfig(num_generations=2, beta=0.0)
        >>> trainer = GRPOTrainer(model, optimizer, grpo)
        >>> batch = trainer.prepare_batch({"observations": jnp.ones((4, 4)),
        ...     "actions": jnp.array([0, 2, 1, 1]), "rewards": jnp.array([1.0, 0.0, 0.0, 1.0])})
        >>> batch, _ = add_advantages(trainer.fill_log_probs(batch), grpo)
        >>> config = TrainConfig(num_steps=1, prompts_per_step=2, num_iterations=2)
        >>> updates = run_updates(trainer, batch, config, key=jax.random.key(0), step=1)
        >>> len(updates), int(optimizer.step[...]), "total_loss" in updates[0]
        (2, 2, True)
    """
    rows = batch.batch_size
    updates: list[dict[str, float]] = []
    try:
        for it in range(config.num_iterations):
            order = np.arange(rows)
            if config.num_minibatches > 1:
                perm_key = jax.random.fold_in(jax.random.fold_in(key, 1000), it)
                order = np.asarray(jax.random.permutation(perm_key, rows))
            for part in np.split(order, config.num_minibatches):
                mb = batch
                if config.num_minibatches > 1:
                    mb = trainer.place_batch(take_rows(batch, part))
                updates.append(
                    trainer.apply_prepared(mb, num_microbatches=config.gradient_accumulation_steps)
                )
    except NonFiniteUpdateError as err:
        msg = (
            f"training step {step} (update {len(updates) + 1} of "
            f"{config.num_iterations * config.num_minibatches}): {err}; no "
            "checkpoint holds this state (the last one is from an earlier step)"
        )
        raise NonFiniteUpdateError(msg, err.metrics) from err
    return updates


def learning_rate(opt_state: Any) -> float | None:
    """The current learning rate when the optimizer uses ``optax.inject_hyperparams``.

    Args:
        opt_state: The optimizer's state.

    Returns:
        The learning rate, or ``None`` when the state does not hold one.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from artifex.generative_models.training.rl.run.steps import learning_rate
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
        >>> learning_rate(tx.init(jnp.zeros(2))), learning_rate(optax.sgd(0.5).init(jnp.zeros(2)))
        (0.5, None)
    """
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
        hp = getattr(node, "hyperparams", None)
        if isinstance(hp, Mapping) and "learning_rate" in hp:
            return float(jnp.asarray(hp["learning_rate"]))
    return None


def step_metrics(
    updates: Sequence[Mapping[str, float]],
    batch_metrics: Mapping[str, jax.Array],
    generation: GenerationBatch,
    **extra: float | None,
) -> dict[str, float]:
    """The step's record: the updates' mean metrics, the batch's, the rollout's and ``extra``.

    Args:
        updates: The updates' metrics.
        batch_metrics: The generation batch's reward and advantage metrics.
        generation: The generation batch (its first rollout's metrics and the dynamic-sampling
            ones are recorded).
        **extra: Further scalars (``None`` values are left out).

    Returns:
        One flat dict of floats.

    Examples:
        >>> import jax.numpy as jnp, numpy as np
        >>> from artifex.generative_models.training.rl import GRPOBatch, Rollout
        >>> from artifex.generative_models.training.rl.run.data import GenerationBatch
        >>> from artifex.generative_models.training.rl.run.steps import step_metrics
        >>> batch = GRPOBatch.zeros(1, 2, prompt_length=4, completion_length=1)
        >>> ro = Rollout(batch, [{"prompt": "1+1="}], ["1+1="], ["2", "3"],
        ...              np.array([[1.0], [0.0]]), ["correct"], np.zeros(2, bool))
        >>> step_metrics([{"total_loss": 1.0}, {"total_loss": 3.0}],
        ...              {"reward_mean": jnp.float32(0.5)}, GenerationBatch(batch, [ro]),
        ...              learning_rate=0.1, eval_reward=None)
        {'total_loss': 2.0, 'reward_mean': 0.5, 'rewards/correct': 0.5,
         'completion_length_max': 1.0, 'truncated_fraction': 0.0, 'learning_rate': 0.1}
    """
    metrics = {k: float(np.mean([u[k] for u in updates])) for k in updates[0]}
    metrics.update({k: float(v) for k, v in jax.device_get(dict(batch_metrics)).items()})
    metrics.update(generation.rollouts[0].metrics())
    metrics.update(generation.info)
    metrics.update({k: float(v) for k, v in extra.items() if v is not None})
    return metrics


def _token_mean(adv: np.ndarray, mask: Any) -> np.ndarray:
    """Per-row advantages; per-token ones as their mean over the completion tokens."""
    if adv.ndim != 2:
        return adv
    mask = host_array(mask)
    return (adv * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1)


def log_completions(
    log: CompletionLog,
    step: int,
    generation: GenerationBatch,
    mesh: Any,
    prompts_per_step: int,
) -> None:
    """Logs this process's rows of the step's batch with the advantages the updates used.

    Args:
        log: The completion log.
        step: The step.
        generation: The generation batch (its advantages set).
        mesh: The training mesh.
        prompts_per_step: Prompts per step (this process's rows of a mesh spanning processes).

    Examples:
        >>> import json, os, tempfile
        >>> import jax.numpy as jnp, numpy as np
        >>> from artifex.generative_models.training.completions import CompletionLog
        >>> from artifex.generative_models.training.rl import GRPOBatch, Rollout
        >>> from artifex.generative_models.training.rl.run.data import GenerationBatch
        >>> from artifex.generative_models.training.rl.run.steps import log_completions
        >>> batch = GRPOBatch.zeros(1, 2, prompt_length=4, completion_length=1).replace(
        ...     rewards=jnp.array([1.0, 0.0]), advantages=jnp.array([0.5, -0.5]))
        >>> ro = Rollout(batch, [{"prompt": "1+1="}], ["1+1="], ["2", "3"],
        ...              np.array([[1.0], [0.0]]), ["correct"], np.zeros(2, bool))
        >>> path = os.path.join(tempfile.mkdtemp(), "completions.jsonl")
        >>> log = CompletionLog(path, print_rows=0)
        >>> log_completions(log, 3, GenerationBatch(batch, [ro]), None, prompts_per_step=1)
        >>> log.close()
        >>> with open(path) as fh:
        ...     records = [json.loads(line) for line in fh]
        >>> [(r["step"], r["completion"], r["reward"], r["advantage"]) for r in records]
        [(3, '2', 1.0, 0.5), (3, '3', 0.0, -0.5)]
    """
    batch = generation.batch
    g = batch.group_size
    adv = _token_mean(host_array(batch.advantages), batch.completion_mask)
    if generation.groups is None:  # the first rollout's rows, this process's part
        ro = generation.rollouts[0]
        lo = process_row_range(prompts_per_step, mesh)[0] * g if spans_processes(mesh) else 0
        rows = slice(lo, lo + len(ro.completions))
        log.log(
            step,
            prompts=[p for p in ro.prompts for _ in range(g)],
            completions=ro.completions,
            rewards={n: ro.rewards_per_function[rows, j] for j, n in enumerate(ro.reward_names)},
            advantages=adv[rows],
            total_rewards=host_array(ro.batch.rewards)[rows],
            group_size=g,
            first_index=lo,
        )
        return
    # Dynamic sampling (one process): the groups the batch kept, from their rollouts.
    prompts, completions, per_function, total = [], [], [], []
    for r, i in generation.groups:
        ro = generation.rollouts[r]
        rows = slice(i * g, (i + 1) * g)
        prompts += [ro.prompts[i]] * g
        completions += list(ro.completions[rows])
        per_function.append(ro.rewards_per_function[rows])
        total.append(host_array(ro.batch.rewards)[rows])
    names = generation.rollouts[0].reward_names
    per_function_rows = np.concatenate(per_function)
    log.log(
        step,
        prompts=prompts,
        completions=completions,
        rewards={n: per_function_rows[:, j] for j, n in enumerate(names)},
        advantages=adv,
        total_rewards=np.concatenate(total),
        group_size=g,
        first_index=0,
    )
