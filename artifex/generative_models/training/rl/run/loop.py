"""The whole GRPO training loop: rollouts, ``mu`` iterations, logging, evaluation, checkpoints.

Each step (Algorithm 1 of DeepSeekMath, outer loop) is a sequence of named stages:

1. **collect** (:mod:`~artifex.generative_models.training.rl.run.data`): take
   ``prompts_per_step`` rows of the dataset (shuffled per epoch, deterministically), roll out
   ``num_generations`` completions per prompt and score them with the rewards
   (:func:`~artifex.generative_models.training.rl.rollouts.rollout.rollout`); with dynamic
   sampling (DAPO) drop the groups whose rewards are all equal and refill from further rows;
2. **place** the generation batch on the trainer's mesh, once;
3. **score old log-probs** when several updates share the batch
   (:mod:`~artifex.generative_models.training.rl.run.steps`);
4. **advantages**: normalize rewards within groups over the whole generation batch, once;
5. **update**: ``num_iterations`` (GRPO's ``mu``) passes over the batch, each split into
   ``num_minibatches`` optimizer updates (``GRPOTrainer.apply_prepared``), each accumulating
   gradients over ``gradient_accumulation_steps`` microbatches (the update does not depend on
   the split);
6. **record**: log the metrics (JSONL every step, the ``report_to`` trackers, a progress bar),
   evaluate pass@1 on held-out prompts every ``eval_every`` steps
   (:mod:`~artifex.generative_models.training.rl.run.evaluation`), checkpoint every
   ``checkpoint_every``, and stop cleanly on SIGTERM/SIGINT
   (:class:`~artifex.generative_models.training.rl.update.signals.StopSignals`).

Everything random derives from ``seed`` and the step number, and the data position is saved in
checkpoints, so a run interrupted at step ``k`` and resumed reaches the same parameters at step
``n`` as the uninterrupted run.

References:
    Shao et al., 2024, "DeepSeekMath", arXiv:2402.03300, Algorithm 1.
    Yu et al., 2025, "DAPO", arXiv:2503.14476 (dynamic sampling).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.checkpointing import training_fingerprint
from artifex.generative_models.training.logging import is_primary_process
from artifex.generative_models.training.rl.rewards import RewardCombiner
from artifex.generative_models.training.rl.rollouts.dataset_rows import EVAL_SPLITS, as_rows
from artifex.generative_models.training.rl.rollouts.reward_scale import check_reward_scale
from artifex.generative_models.training.rl.rollouts.rollout import (
    Policy,
    Rollout,
    RolloutConfig,
    rollout,
    rollout_batch_like,
    spans_processes,
)
from artifex.generative_models.training.rl.rollouts.step_rewards import StepRewards
from artifex.generative_models.training.rl.run.checks import (
    check_tokenizer_fits,
    check_train_settings,
    reward_signal_diagnosis,
)
from artifex.generative_models.training.rl.run.data import (
    DataIterator,
    GenerationBatch,
    collect_generation_batch,
    concat_batches,
    dataset_fingerprint,
    take_rows,
)
from artifex.generative_models.training.rl.run.evaluation import (
    EVAL_BATCH_SIZE,
    RunEvaluation,
    check_eval_row_groups,
    evaluate,
)
from artifex.generative_models.training.rl.run.preflight import check_writable_dir, open_run_outputs
from artifex.generative_models.training.rl.run.settings import TrainConfig, TrainResult
from artifex.generative_models.training.rl.run.steps import (
    add_advantages,
    learning_rate,
    log_completions,
    run_updates,
    score_old_log_probs,
    step_metrics,
)
from artifex.generative_models.training.rl.update.signals import StopSignals
from artifex.generative_models.training.sharding import host_array

if TYPE_CHECKING:  # annotations only: the trainer's module sits below the loop
    from artifex.generative_models.training.rl.update.trainer import GRPOTrainer

_log = logging.getLogger(__name__)

__all__ = [
    "EVAL_BATCH_SIZE",
    "DataIterator",
    "check_eval_row_groups",
    "check_tokenizer_fits",
    "check_writable_dir",
    "concat_batches",
    "dataset_fingerprint",
    "evaluate",
    "reward_signal_diagnosis",
    "train",
]


# ------------------------------------------------------------------------------ set-up
def _rollout_function(
    rollout_fn: Callable[..., Rollout] | None,
    step_rewards: StepRewards | None,
    engine: Any,
) -> Callable[..., Rollout]:
    """The rollout the loop calls: ``rollout_fn``, or the library's with its options bound."""
    if step_rewards is not None:  # the single-turn rollout with step rewards (step_rewards.py)
        rollout_fn = functools.partial(rollout, step_rewards=step_rewards)
    if engine is not None:  # an external engine samples (inference/engines)
        rollout_fn = functools.partial(rollout_fn or rollout, engine=engine)
    return rollout if rollout_fn is None else rollout_fn


def _run_fingerprint(
    trainer: GRPOTrainer,
    config: TrainConfig,
    rcfg: RolloutConfig,
    dataset: Sequence[Mapping[str, Any]],
    rewards: RewardCombiner,
    step_rewards: StepRewards | None,
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote the checkpoint."""
    weights = getattr(rewards, "weights", None)
    return training_fingerprint(
        trainer.config,
        trainer.state.params,
        loop=config.fingerprint,
        max_new_tokens=rcfg.max_new_tokens,
        dataset=dataset_fingerprint(dataset),
        rewards={
            "names": list(rewards.names),
            "weights": None if weights is None else [float(w) for w in np.ravel(weights)],
            "mode": rewards.mode,
            **({} if step_rewards is None else {"step": step_rewards.fingerprint}),
        },
        **({} if extra is None else {"run": dict(extra)}),
    )


def _compile_first_update(
    trainer: GRPOTrainer,
    policy: Policy,
    tokenizer: Any,
    data: DataIterator,
    rcfg: RolloutConfig,
    cfg: TrainConfig,
    *,
    scored: bool,
) -> None:
    """Starts compiling the update for the next step's batches in a background thread.

    The example is the batch the next rollout will build (its rows read without moving the
    data position), scored (``scored``) and with advantages as the loop's stages leave it, cut
    to one minibatch and placed as the loop places its batches, so the first update finds its
    program compiled (or compiling). The caller makes sure the library's own rollout runs on
    one process, with no placement and no dynamic sampling (other layouts are not known
    before sampling).
    """
    example = rollout_batch_like(policy, tokenizer, data.peek(cfg.prompts_per_step), rcfg)
    if scored:  # the fields score_old_log_probs fills (shapes only)
        shapes = jax.eval_shape(trainer.fill_log_probs, example)
        example = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    example = example.replace(advantages=jnp.zeros((example.batch_size,), jnp.float32))
    if cfg.num_minibatches > 1:
        example = take_rows(example, np.arange(example.batch_size // cfg.num_minibatches))
    steps = cfg.gradient_accumulation_steps or trainer.auto_microbatches(example)
    trainer.compiled_step(steps).compile_ahead(trainer.state, trainer.place_batch(example))


def _check_rewards(
    trainer: GRPOTrainer, generation: GenerationBatch, *, step: int, first: bool
) -> None:
    """Warns about rewards on very different scales, and about a first batch with no signal.

    A distilled run learns from its teacher whatever the rewards: no diagnosis then.
    """
    batch = generation.batch
    check_reward_scale(
        host_array(batch.rewards),
        batch.group_size,
        group_ids=None if batch.group_ids is None else host_array(batch.group_ids),
        step=step,
    )
    if first and trainer.config.distillation_coeff == 0.0:
        ro = generation.rollouts[0]
        note = reward_signal_diagnosis(host_array(ro.batch.rewards), ro.batch.group_size)
        if note is not None and is_primary_process():
            _log.warning(note)


# ------------------------------------------------------------------------------ the loop
def train(
    trainer: GRPOTrainer,
    tokenizer: Any,
    dataset: Sequence[Mapping[str, Any]],
    rewards: RewardCombiner | Callable[..., Any] | Sequence[Callable[..., Any]],
    config: TrainConfig,
    rollout_config: RolloutConfig | None = None,
    *,
    eval_dataset: Sequence[Mapping[str, Any]] | None = None,
    eval_reward: Callable[..., Sequence[float | None]] | None = None,
    rollout_placement: Any = None,
    rollout_fn: Callable[..., Rollout] | None = None,
    evaluate_fn: Callable[..., dict[str, float]] | None = None,
    fingerprint_extra: Mapping[str, Any] | None = None,
    step_rewards: StepRewards | None = None,
    rollout_engine: Any = None,
) -> TrainResult:
    """Trains ``trainer``'s policy with GRPO on prompts from ``dataset``.

    Args:
        trainer: A :class:`~artifex.generative_models.training.rl.update.trainer.GRPOTrainer`
            on a causal LM.
        tokenizer: Its tokenizer.
        dataset: Rows (mappings, or a Hugging Face dataset:
            :func:`~artifex.generative_models.training.rl.rollouts.dataset_rows.as_rows`) with a
            prompt
            column and whatever the rewards read.
        rewards: A :class:`RewardCombiner`, one reward function or a list of them (summed).
        config: Loop settings.
        rollout_config: Generation settings (``None``: ``RolloutConfig()``).
        eval_dataset: Held-out rows for pass@1 (optional).
        eval_reward: Scores evaluation completions (``None``: the first reward function).
        rollout_placement: A
            :class:`~artifex.generative_models.training.placement.RolloutPlacement`: sample
            (rollouts and evaluation) on a mesh of its own; ``None``: on the trainer's mesh.
        rollout_fn: Replaces :func:`~artifex.generative_models.training.rl.rollouts.rollout.rollout`
            (same signature), e.g. a
            :class:`~artifex.generative_models.training.rl.rollouts.multiturn.MultiTurnRollout`.
        evaluate_fn: Replaces :func:`evaluate` (same signature), e.g.
            ``MultiTurnRollout.evaluate``.
        fingerprint_extra: JSON-able settings outside the trainer that change the results
            (``artifex-grpo train`` passes the weights' identity and the optimizer's settings),
            recorded in every checkpoint under ``"run"``; a resumed run must match them, as it
            must match the configs, the reward functions and the dataset.
        step_rewards: Per-step rewards
            (:mod:`~artifex.generative_models.training.rl.rollouts.step_rewards`), single-turn only.
        rollout_engine: A :class:`~artifex.generative_models.inference.engines.RolloutEngine`
            that samples rollouts, given the policy's weights after each update.

    Returns:
        A :class:`TrainResult`.

    Raises:
        ValueError: Bad dataset rows, reward outputs or settings (before any update).
        IncompatibleCheckpointError: Resuming from a checkpoint written by another setup (or
            on another dataset, unless ``allow_dataset_change``).
        FileExistsError: ``checkpoint_dir`` holds checkpoints while ``resume`` and
            ``overwrite`` are off, or ``log_dir`` holds the logs of a run with another
            ``checkpoint_dir`` (checked before the first step).
        DirectoryInUseError: Another run, still running, holds ``checkpoint_dir`` or
            ``log_dir`` (:mod:`~artifex.generative_models.training.run_lock`).
        NotADirectoryError: An output directory is an existing file (before the first step).
        PermissionError: An output directory is not writable (before the first step).
        NonFiniteUpdateError: An update was not finite (the step and metric are named; the
            model keeps its last finite state and no checkpoint of a bad state is written).

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import (
        ...     GRPOConfig, GRPOTrainer, RolloutConfig, TrainConfig, train)
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> model = CausalLM(cfg, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2, beta=0.0))
        >>> def first_better(prompts, completions, **columns):  # differs within each group
        ...     return [float(i % 2 == 0) for i in range(len(completions))]
        >>> dataset = [{"prompt": f"{a}+{a}="} for a in range(4)]
        >>> result = train(trainer, tok, dataset, first_better,
        ...                TrainConfig(num_steps=2, prompts_per_step=1, progress=False),
        ...                RolloutConfig(max_new_tokens=2))
        >>> len(result.history), "reward_mean" in result.history[-1], int(optimizer.step[...])
        (2, True, 2)
    """
    # Inputs, and the checks that need no sampling or compiling.
    rcfg = RolloutConfig() if rollout_config is None else rollout_config
    dataset = as_rows(dataset)
    if eval_dataset is not None:
        eval_dataset = as_rows(eval_dataset, default_splits=EVAL_SPLITS, what="eval_dataset")
    if not isinstance(rewards, RewardCombiner):
        rewards = RewardCombiner(list(rewards) if isinstance(rewards, Sequence) else [rewards])
    eval_reward = rewards.funcs[0] if eval_reward is None else eval_reward
    # The library's rollout gets a policy without a scorer: the loop scores old log-probs as
    # a stage of its own. A custom rollout_fn gets the trainer's scorer (Policy.score), as
    # rollout functions written for it expect.
    policy = dataclasses.replace(trainer.policy(), score=None)
    check_train_settings(
        config,
        rcfg,
        policy,
        tokenizer,
        dataset,
        eval_dataset=eval_dataset,
        rollout_fn=rollout_fn,
        evaluate_fn=evaluate_fn,
        rollout_placement=rollout_placement,
        rollout_engine=rollout_engine,
        step_rewards=step_rewards,
    )
    own_rollout = rollout_fn is None
    plain_rollout = own_rollout and step_rewards is None and rollout_engine is None
    rollout_policy = policy  # no scorer: scoring is the loop's stage (score_old_log_probs)
    rollout_fn = _rollout_function(rollout_fn, step_rewards, rollout_engine)
    several_updates = config.num_iterations > 1 or config.num_minibatches > 1

    # The run's state: data order, PRNG key (each step samples with fold_in(rng, step)), and
    # its outputs, checked, locked and restored before the first (expensive) step.
    data = DataIterator(dataset, seed=config.seed, shuffle=config.shuffle)
    trainer.seed_rng(config.seed)
    fingerprint = _run_fingerprint(
        trainer, config, rcfg, dataset, rewards, step_rewards, fingerprint_extra
    )
    outputs = open_run_outputs(config, trainer, fingerprint)
    manager, start_step, logger = outputs.manager, outputs.start_step, outputs.logger
    if outputs.record is not None:
        data.restore(outputs.record["data"])
    evaluation = RunEvaluation(
        policy,
        tokenizer,
        eval_dataset,
        eval_reward,
        rcfg,
        rng=trainer.rng,
        pass_threshold=config.pass_threshold,
        num_samples=config.eval_num_samples,
        evaluate_fn=evaluate_fn,
        placement=rollout_placement,
    )
    result = TrainResult(history=[], evaluations=[], start_step=start_step)

    def run_eval(step: int) -> None:
        metrics = evaluation(step)
        if metrics is not None:
            result.evaluations.append((step, metrics))
            logger.log(step, metrics, advance=False)

    def save(step: int) -> None:
        if manager is None or manager.latest_step() == step:
            return
        record = {"step": step, "data": data.state(), "fingerprint": fingerprint}
        manager.save(step, trainer.checkpoint_state(), record)

    stop = StopSignals(enabled=config.handle_signals)
    try:
        if (
            config.compile_ahead
            and start_step < config.num_steps
            and plain_rollout
            and rollout_placement is None
            and not config.dynamic_sampling
            and not spans_processes(policy.mesh)
        ):
            # The first update compiles while the sampler compiles and generates (and while
            # the step-0 evaluation runs), not after them.
            _compile_first_update(
                trainer, policy, tokenizer, data, rcfg, config, scored=several_updates
            )
        stop.install()
        if start_step == 0:
            run_eval(0)
        for step in range(start_step + 1, config.num_steps + 1):
            t0 = time.perf_counter()
            key = jax.random.fold_in(trainer.rng, step)
            generation = collect_generation_batch(
                rollout_fn,
                rollout_policy,
                tokenizer,
                data,
                rewards,
                rcfg,
                prompts=config.prompts_per_step,
                key=key,
                need_old_log_probs=several_updates,
                dynamic_sampling=config.dynamic_sampling,
                max_resample_rounds=config.max_resample_rounds,
                placement=rollout_placement,
            )
            t_rollout = time.perf_counter() - t0
            batch = trainer.place_batch(generation.batch)
            if several_updates:
                batch = score_old_log_probs(trainer, batch)
            batch, batch_metrics = add_advantages(batch, trainer.config)
            generation.batch = batch
            _check_rewards(trainer, generation, step=step, first=step == start_step + 1)
            if config.log_completions_every and step % config.log_completions_every == 0:
                log_completions(
                    outputs.samples, step, generation, policy.mesh, config.prompts_per_step
                )
            updates = run_updates(trainer, batch, config, key=key, step=step)
            metrics = step_metrics(
                updates,
                batch_metrics,
                generation,
                learning_rate=learning_rate(trainer.optimizer.opt_state),
                rollout_time=t_rollout,
                step_time=time.perf_counter() - t0,
            )
            result.history.append(metrics)
            logger.log(step, metrics)
            if config.eval_every and step % config.eval_every == 0 and step != config.num_steps:
                run_eval(step)
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                save(step)
            if stop.received is not None and step < config.num_steps:
                result.interrupted = stop.received
                save(step)
                _log.warning(
                    f"{stop.received} received: stopped after step {step}"
                    + (
                        f", checkpoint saved in {manager.directory}; run again to resume"
                        if manager is not None
                        else " (no checkpoint_dir: nothing was saved)"
                    ),
                )
                break
        if result.interrupted is None and start_step < config.num_steps:
            run_eval(config.num_steps)
            save(config.num_steps)
    finally:
        stop.uninstall()
        outputs.close()
    return result
