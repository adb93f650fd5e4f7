"""Flow-GRPO through the main training loop: one call from a flow model to a trained one.

:func:`flow_trainer` builds the ``GRPOTrainer`` of a flow model (its log-prob hook is
:func:`~artifex.generative_models.flow.batch.flow_log_prob_fn`, the closed-form KL
by default); :func:`train_flow` runs :func:`~artifex.generative_models.training.rl.train` with
the flow rollout and evaluation stages
(:mod:`~artifex.generative_models.flow.rollout`), so a flow run has what a language-model run
has: data order, rewards, advantages, several updates per batch, evaluation, the metrics and
completions logs, checkpoints and resume, and a mesh. The sampler settings join the run's
fingerprint: a run resumed with other settings is refused.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax import nnx

from artifex.generative_models.flow.batch import flow_log_prob_fn
from artifex.generative_models.flow.images import describe_shapes
from artifex.generative_models.flow.rollout import FlowEvaluator, FlowRollout
from artifex.generative_models.flow.sde import SDEConfig
from artifex.generative_models.training.rl import (
    GRPOConfig,
    GRPOTrainer,
    RolloutConfig,
    TrainConfig,
    TrainResult,
    train,
)
from artifex.generative_models.utils.validation import check_int

__all__ = ["eval_steps", "flow_trainer", "train_flow"]


def flow_trainer(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    config: GRPOConfig,
    sde: SDEConfig,
    *,
    reference_model: nnx.Module | None = None,
    mesh: Any = None,
) -> GRPOTrainer:
    """The ``GRPOTrainer`` of a flow model sampled with ``sde``.

    Args:
        model: The velocity network (a model of :mod:`~artifex.generative_models.flow`).
        optimizer: Its ``nnx.Optimizer``.
        config: The GRPO settings (``kl_estimator="exact"``: the closed-form per-step KL).
        sde: The sampler settings of the run's rollouts.
        reference_model: A frozen copy for the KL (``None`` with ``beta > 0``: a clone of
            ``model`` as it is now).
        mesh: A ``jax.sharding.Mesh`` to train on (``None``: one device).

    Returns:
        The trainer.

    Raises:
        TypeError: ``sde`` is not an ``SDEConfig``.
        ValueError: ``noise_level`` 0.

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import SDEConfig, flow_trainer
        >>> from artifex.generative_models.flow import TextFlowDiT, TextFlowDiTConfig
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> model = TextFlowDiT(TextFlowDiTConfig(hidden_dim=16, num_blocks=1, num_heads=2),
        ...                     rngs=nnx.Rngs(0))
        >>> trainer = flow_trainer(model, nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param),
        ...                        GRPOConfig(num_generations=4, beta=0.01, kl_estimator="exact"),
        ...                        SDEConfig(num_steps=8, window_size=2))
        >>> trainer.has_reference
        True
    """
    log_prob_fn = flow_log_prob_fn(sde)
    if reference_model is None and config.beta > 0.0:
        reference_model = nnx.clone(model)
    return GRPOTrainer(
        model,
        optimizer,
        config,
        reference_model=reference_model,
        log_prob_fn=log_prob_fn,
        mesh=mesh,
    )


def _is_shapes_model(model: Any) -> bool:
    cfg = getattr(model, "config", None)
    vocabulary = getattr(cfg, "vocabulary", None)
    return vocabulary is not None and "circle" in vocabulary and cfg.image_shape[-1] == 3


def _start_step(config: TrainConfig) -> int:
    """The step a run starts from: its newest complete checkpoint's when it resumes, else 0."""
    directory = config.checkpoint_dir
    if directory is None or not config.resume or config.overwrite or not os.path.isdir(directory):
        return 0
    steps = [
        int(name)
        for name in os.listdir(directory)
        if name.isdigit() and os.path.isdir(os.path.join(directory, name))
    ]
    return max(steps, default=0)


def eval_steps(config: TrainConfig, start_step: int = 0) -> list[int]:
    """The steps the loop evaluates at: 0 (a fresh run), every ``eval_every``, the last.

    Args:
        config: The loop settings (``num_steps``, ``eval_every``).
        start_step: The step the run starts from (a resumed run skips the evaluations before).

    Returns:
        The steps, ascending.

    Examples:
        >>> from artifex.generative_models.flow.train import eval_steps
        >>> from artifex.generative_models.training.rl import TrainConfig
        >>> eval_steps(TrainConfig(num_steps=10, eval_every=4))
        [0, 4, 8, 10]
        >>> eval_steps(TrainConfig(num_steps=10, eval_every=4), start_step=4)
        [8, 10]
    """
    if start_step >= config.num_steps:
        return []
    steps = [0] if start_step == 0 else []
    if config.eval_every:
        steps += [s for s in range(start_step + 1, config.num_steps) if s % config.eval_every == 0]
    return [*steps, config.num_steps]


def train_flow(
    trainer: GRPOTrainer,
    dataset: Sequence[Mapping[str, Any]],
    rewards: Any,
    config: TrainConfig,
    sde: SDEConfig,
    *,
    tokenizer: Any = None,
    rollout_config: RolloutConfig | None = None,
    eval_dataset: Sequence[Mapping[str, Any]] | None = None,
    eval_reward: Callable[..., Sequence[float | None]] | None = None,
    eval_images_per_prompt: int = 1,
    eval_num_steps: int | None = None,
    describe: Callable[[Any], str] | None = None,
    window_start: int | None = None,
    fingerprint_extra: Mapping[str, Any] | None = None,
) -> TrainResult:
    """Trains a flow model with GRPO through the main loop.

    Rows hold a prompt column (captions for a text-conditioned model, class labels for a
    class-conditioned one) and whatever the rewards read; rewards follow the loop's protocol
    with images as completions (:mod:`~artifex.generative_models.flow.rewards`). Evaluations
    (at step 0, every ``eval_every`` steps and at the end) sample the held-out rows with the
    ODE from fixed noise; with ``config.log_dir`` they write an image grid and a JSONL file to
    ``<log_dir>/images`` (:class:`~artifex.generative_models.flow.rollout.FlowEvaluator`).

    Args:
        trainer: From :func:`flow_trainer` (its log-prob hook built for ``sde``).
        dataset: Training rows.
        rewards: A ``RewardCombiner``, one reward function or a list of them.
        config: Loop settings (``eval_num_samples`` must be 1).
        sde: The rollout sampler's settings.
        tokenizer: Encodes captions (``None``: the model's own ``config.tokenizer()``).
        rollout_config: Its ``prompt_column`` (``None``: ``"prompt"``).
        eval_dataset: Held-out rows.
        eval_reward: Scores evaluation images (``None``: the first reward function).
        eval_images_per_prompt: ODE images per held-out row.
        eval_num_steps: ODE steps of the evaluation (``None``: ``sde.num_steps``).
        describe: ``image -> str`` for the logs (``None``: the detected shapes for a model
            of the shapes vocabulary, else the image's shape and mean).
        window_start: With ``sde.window_size``: the window's first step in every batch
            (``None``: drawn uniformly per batch;
            :class:`~artifex.generative_models.flow.rollout.FlowRollout`).
        fingerprint_extra: Further settings recorded in checkpoints (see ``train``).

    Returns:
        The loop's ``TrainResult``.

    Raises:
        TypeError: ``sde`` is not an ``SDEConfig``.
        ValueError: ``eval_num_samples > 1``, or as ``train``.

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import compositional, flow_trainer, train_flow
        >>> from artifex.generative_models.flow import SDEConfig, TextFlowDiT, TextFlowDiTConfig
        >>> from artifex.generative_models.training.rl import GRPOConfig, TrainConfig
        >>> model = TextFlowDiT(TextFlowDiTConfig(hidden_dim=16, num_blocks=1, num_heads=2,
        ...                                       time_features=8), rngs=nnx.Rngs(0))
        >>> sde = SDEConfig(num_steps=4, window_size=2)
        >>> trainer = flow_trainer(model, nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param),
        ...                        GRPOConfig(num_generations=2, beta=0.0), sde)
        >>> rows = [{"prompt": "a red square"}, {"prompt": "two blue circles"}]
        >>> result = train_flow(trainer, rows, compositional,
        ...                     TrainConfig(num_steps=2, prompts_per_step=2, progress=False), sde)
        >>> len(result.history), "rewards/compositional" in result.history[-1]
        (2, True)
    """
    if not isinstance(sde, SDEConfig):
        msg = f"sde must be an SDEConfig, got {type(sde).__name__}"
        raise TypeError(msg)
    if config.eval_num_samples != 1:
        msg = (
            "TrainConfig.eval_num_samples must be 1 for a flow model (its evaluation samples "
            f"eval_images_per_prompt ODE images per row), got {config.eval_num_samples}"
        )
        raise ValueError(msg)
    check_int("eval_images_per_prompt", eval_images_per_prompt, minimum=1)
    ode_steps = sde.num_steps if eval_num_steps is None else eval_num_steps
    check_int("eval_num_steps", ode_steps, minimum=2)
    model = trainer.model
    if describe is None and _is_shapes_model(model):
        describe = describe_shapes
    # The evaluator names its files by the loop step: the loop evaluates at the steps
    # eval_steps lists (counted from the checkpoint a resumed run starts from).
    schedule = iter(eval_steps(config, _start_step(config)))
    evaluator = FlowEvaluator(
        ode_steps,
        images_per_prompt=eval_images_per_prompt,
        image_dir=None if config.log_dir is None else os.path.join(config.log_dir, "images"),
        step_fn=lambda: next(schedule, -1),
        seed=config.seed,
        describe=describe,
    )
    flow = {
        "sde": dataclasses.asdict(sde),
        "eval_images_per_prompt": eval_images_per_prompt,
        "eval_num_steps": ode_steps,
        "window_start": window_start,
    }
    return train(
        trainer,
        tokenizer,
        dataset,
        rewards,
        config,
        rollout_config,
        eval_dataset=eval_dataset,
        eval_reward=eval_reward,
        rollout_fn=FlowRollout(sde, describe=describe, window_start=window_start),
        evaluate_fn=evaluator,
        fingerprint_extra={"flow": flow, **dict(fingerprint_extra or {})},
    )
