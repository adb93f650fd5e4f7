"""The training loop's settings and what a run returns: ``TrainConfig``, ``TrainResult``.

:func:`~artifex.generative_models.training.rl.run.loop.train` reads them; the objective's own
settings are in :class:`~artifex.generative_models.training.rl.core.configs.GRPOConfig` and the
generation's in ``RolloutConfig``.
Both are importable from ``artifex.generative_models.training`` and from
``artifex.generative_models.training.rl.run.loop`` as well.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from artifex.generative_models.training.trackers import check_report_to
from artifex.generative_models.utils.validation import check_int

__all__ = ["TrainConfig", "TrainResult"]


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    check_int(f"TrainConfig.{name}", value, minimum=minimum)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Settings of the training loop (the objective's are in ``GRPOConfig``).

    Attributes:
        num_steps: Generation batches to train on (outer steps).
        prompts_per_step: Prompts per generation batch; the batch has
            ``prompts_per_step * num_generations`` rows.
        num_iterations: GRPO's ``mu``: optimization passes over each generation batch.
        num_minibatches: Optimizer updates per pass, each on an equal slice of the batch rows
            (shuffled per pass); advantages are computed on the whole batch first.
        gradient_accumulation_steps: Microbatches accumulated into each update inside the
            compiled step (same update, less memory). ``None``: the trainer's choice
            (``GRPOTrainer.auto_microbatches``).
        shuffle: Shuffle the dataset each epoch (deterministically from ``seed``).
        seed: Seeds the data order and every PRNG key of the run.
        dynamic_sampling: Drop groups whose rewards are all equal and refill from further
            prompts (DAPO); groups are then handled by the segment form of the kernel.
        max_resample_rounds: Extra rollouts allowed per step to refill; if the batch is still
            short, zero-variance groups fill it (their advantages are 0).
        eval_every: Evaluate every this many steps (0: only before and after training, when
            an evaluation set is given).
        pass_threshold: A greedy completion passes (pass@1) when its evaluation reward is at
            least this.
        eval_num_samples: Samples per evaluation prompt for pass@k, mean@n and maj@n
            (:mod:`~artifex.generative_models.training.rl.run.evaluation_metrics`); 1: greedy only.
        log_dir: Directory for ``metrics.jsonl`` and the trackers' files (``None``: no files).
        report_to: Trackers (:mod:`~artifex.generative_models.training.trackers`).
        checkpoint_dir: Orbax checkpoint directory (``None``: no checkpoints).
        checkpoint_every: Save every this many steps (0: only at the end).
        keep_checkpoints: Keep the newest this many checkpoints.
        resume: Continue from the newest checkpoint in ``checkpoint_dir`` if there is one.
        progress: Show a progress bar.
        overwrite: With ``resume`` off, delete the existing checkpoints and log files and
            start from step 0 instead of refusing a non-empty directory.
        allow_dataset_change: Resume even if the dataset's size or content hash differs from
            the checkpointed run's.
        handle_signals: On SIGTERM or SIGINT, finish the current step, save a checkpoint and
            return (``TrainResult.interrupted``); main thread only.
        log_completions_every: Every this many steps, append the step's completions, rewards
            and advantages to ``log_dir/completions.jsonl`` and print some (0: never).
        completions_to_print: Rows printed of those (0: the file only).
        compile_ahead: Compile the first update in a background thread while the first
            rollout samples (``GRPOTrainer.compile_ahead``); only for the library's own rollout
            on one process without dynamic sampling or a rollout placement.

    Examples:
        >>> from artifex.generative_models.training import TrainConfig
        >>> config = TrainConfig(num_steps=100, prompts_per_step=8, num_iterations=2)
        >>> config.num_steps, config.num_iterations, config.log_dir
        (100, 2, None)
        >>> config.fingerprint["prompts_per_step"]  # what a resumed run must match
        8
    """

    num_steps: int
    prompts_per_step: int = 8
    num_iterations: int = 1
    num_minibatches: int = 1
    gradient_accumulation_steps: int | None = None
    shuffle: bool = True
    seed: int = 0
    dynamic_sampling: bool = False
    max_resample_rounds: int = 4
    eval_every: int = 0
    pass_threshold: float = 1.0
    eval_num_samples: int = 1
    log_dir: str | None = None
    report_to: tuple[str, ...] = ("jsonl",)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = True
    progress: bool = True
    overwrite: bool = False
    allow_dataset_change: bool = False
    handle_signals: bool = True
    log_completions_every: int = 0
    completions_to_print: int = 4
    compile_ahead: bool = True

    def __post_init__(self) -> None:
        for name in (
            "shuffle",
            "dynamic_sampling",
            "resume",
            "progress",
            "overwrite",
            "allow_dataset_change",
            "handle_signals",
            "compile_ahead",
        ):
            if not isinstance(getattr(self, name), bool | np.bool_):
                msg = f"TrainConfig.{name} must be a bool, got {getattr(self, name)!r}"
                raise TypeError(msg)
        for name in ("log_dir", "checkpoint_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str | os.PathLike):
                msg = f"TrainConfig.{name} must be a path or None, got {value!r}"
                raise TypeError(msg)
        for name in (
            "num_steps",
            "prompts_per_step",
            "num_iterations",
            "num_minibatches",
            "gradient_accumulation_steps",
            "keep_checkpoints",
            "eval_num_samples",
        ):
            if name == "gradient_accumulation_steps" and self.gradient_accumulation_steps is None:
                continue
            _positive_int(name, getattr(self, name))
        for name in (
            "max_resample_rounds",
            "eval_every",
            "checkpoint_every",
            "seed",
            "log_completions_every",
            "completions_to_print",
        ):
            _positive_int(name, getattr(self, name), minimum=0)
        if not isinstance(self.pass_threshold, int | float) or not math.isfinite(
            self.pass_threshold
        ):
            msg = f"TrainConfig.pass_threshold must be a finite number, got {self.pass_threshold!r}"
            raise ValueError(msg)
        object.__setattr__(self, "report_to", check_report_to(self.report_to))
        if "tensorboard" in self.report_to and self.log_dir is None:
            msg = (
                "TrainConfig.report_to names 'tensorboard', which writes to log_dir/tb, but "
                "log_dir is None: set log_dir"
            )
            raise ValueError(msg)

    @property
    def fingerprint(self) -> dict[str, Any]:
        """The settings a resumed run must share (they shape batches and the data order)."""
        return {
            "prompts_per_step": self.prompts_per_step,
            "num_iterations": self.num_iterations,
            "num_minibatches": self.num_minibatches,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "dynamic_sampling": self.dynamic_sampling,
            "max_resample_rounds": self.max_resample_rounds,
        }


@dataclasses.dataclass
class TrainResult:
    """What :func:`~artifex.generative_models.training.rl.run.loop.train` returns.

    Attributes:
        history: One metrics dict per step trained in this call.
        evaluations: ``(step, metrics)`` of each evaluation.
        start_step: The step the call started from (0, or the resumed checkpoint's).
        interrupted: The signal's name (``"SIGTERM"``, ``"SIGINT"``) when the run stopped early
            on one (after saving a checkpoint of the last finished step); ``None`` otherwise.

    Examples:
        >>> from artifex.generative_models.training.rl import TrainResult
        >>> result = TrainResult(history=[{"reward_mean": 0.5}], evaluations=[], start_step=0,
        ...                      interrupted=None)
        >>> result.history[-1]["reward_mean"], result.interrupted
        (0.5, None)
    """

    history: list[dict[str, float]]
    evaluations: list[tuple[int, dict[str, float]]]
    start_step: int
    interrupted: str | None = None
