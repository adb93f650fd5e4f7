"""The whole GRPO training loop: rollouts, ``mu`` iterations, logging, evaluation, checkpoints.

Each step (Algorithm 1 of DeepSeekMath, outer loop):

1. take ``prompts_per_step`` rows of the dataset (shuffled per epoch, deterministically);
2. roll out ``num_generations`` completions per prompt and score them
   (:func:`~artifex.generative_models.training.rl.rollouts.rollout.rollout`); with dynamic sampling
   (DAPO) drop the groups whose rewards are all equal and refill from further rows;
3. normalize rewards within groups over the whole generation batch;
4. run ``num_iterations`` (GRPO's ``mu``) passes over the batch, each split into
   ``num_minibatches`` optimizer updates, each accumulating gradients over
   ``gradient_accumulation_steps`` microbatches (the update does not depend on the split);
5. log the metrics (JSONL every step, the ``report_to`` trackers, a progress bar), evaluate
   pass@1 on held-out prompts every ``eval_every`` steps, checkpoint every ``checkpoint_every``.

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
import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.checkpointing import training_fingerprint
from artifex.generative_models.training.logging import CompletionLog, is_primary_process
from artifex.generative_models.training.rl.batch import GRPOBatch
from artifex.generative_models.training.rl.core.advantages import nonconstant_groups
from artifex.generative_models.training.rl.core.objective import _reward_metrics, compute_advantages
from artifex.generative_models.training.rl.rewards import RewardCombiner
from artifex.generative_models.training.rl.rollouts.dataset_rows import EVAL_SPLITS, as_rows
from artifex.generative_models.training.rl.rollouts.reward_scale import check_reward_scale
from artifex.generative_models.training.rl.rollouts.rollout import (
    Policy,
    Rollout,
    RolloutConfig,
    SupportsPolicy,
    as_policy,
    check_engine_rollout,
    rollout,
    rollout_batch_like,
    sample_completions,
    spans_processes,
)
from artifex.generative_models.training.rl.rollouts.step_rewards import StepRewards
from artifex.generative_models.training.rl.run.evaluation_metrics import (
    check_sampled_eval,
    evaluate_sampled,
)
from artifex.generative_models.training.rl.run.preflight import check_writable_dir, open_run_outputs
from artifex.generative_models.training.rl.update.optimizer_split import interrupt_scope
from artifex.generative_models.training.rl.update.state import NonFiniteUpdateError
from artifex.generative_models.training.sharding import host_array, process_row_range
from artifex.generative_models.training.trackers import check_report_to
from artifex.generative_models.utils.validation import check_int

if TYPE_CHECKING:  # annotations only: the trainer's module sits above the loop
    from artifex.generative_models.training.rl.update.trainer import GRPOTrainer

_log = logging.getLogger(__name__)

__all__ = [
    "EVAL_BATCH_SIZE",
    "DataIterator",
    "TrainConfig",
    "TrainResult",
    "check_eval_row_groups",
    "check_tokenizer_fits",
    "check_writable_dir",
    "concat_batches",
    "dataset_fingerprint",
    "evaluate",
    "reward_signal_diagnosis",
    "train",
]


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


class DataIterator:
    """Deterministic, resumable pass over a dataset of rows, epoch after epoch.

    The order of epoch ``e`` is a permutation drawn from ``(seed, e)``; the position is
    ``(epoch, index)`` and can be saved and restored.

    Across processes every process builds the same iterator (same dataset, seed, order) and
    keeps the same global position; :meth:`take` with ``part=(start, stop)`` (the process's
    :func:`~artifex.generative_models.training.sharding.process_row_range` of the step's
    prompts) returns only that process's rows of the step while the position advances by the
    whole step. Each process's rows are therefore a deterministic function of the step and its
    process index, and restoring the saved ``(epoch, index)`` restores every process's position.

    Args:
        dataset: Rows (mappings), indexable.
        seed: Seeds the per-epoch permutations.
        shuffle: Shuffle each epoch.

    Examples:
        >>> from artifex.generative_models.training.rl import DataIterator
        >>> rows = [{"prompt": str(i)} for i in range(5)]
        >>> data = DataIterator(rows, seed=0, shuffle=False)
        >>> [r["prompt"] for r in data.take(3)], data.state()
        (['0', '1', '2'], {'epoch': 0, 'index': 3})
        >>> [r["prompt"] for r in data.take(3)], data.state()  # crosses into epoch 1
        (['3', '4', '0'], {'epoch': 1, 'index': 1})
        >>> data.restore({"epoch": 0, "index": 3})
        >>> [r["prompt"] for r in data.take(2)]
        ['3', '4']
    """

    def __init__(self, dataset: Sequence[Mapping[str, Any]], *, seed: int, shuffle: bool):
        if len(dataset) == 0:
            msg = "the dataset is empty"
            raise ValueError(msg)
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def take(self, n: int, *, part: tuple[int, int] | None = None) -> list[Mapping[str, Any]]:
        """The next ``n`` rows (crossing into the next epoch as needed).

        Args:
            n: How many rows the position advances by (the global step).
            part: Return only rows ``[start, stop)`` of those ``n`` (this process's share);
                ``None``: all of them.

        Returns:
            The rows.

        Raises:
            ValueError: ``part`` is not a range inside ``[0, n]``.
        """
        if part is not None:
            start, stop = part
            if not 0 <= start <= stop <= n:
                msg = f"DataIterator.take: part must satisfy 0 <= start <= stop <= {n}, got {part}"
                raise ValueError(msg)
            return self.take(n)[start:stop]
        rows = []
        while len(rows) < n:
            if self.index == len(self.dataset):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            rows.append(self.dataset[int(self._order[self.index])])
            self.index += 1
        return rows

    def state(self) -> dict[str, int]:
        """The position, JSON-able.

        Returns:
            ``{"epoch": ..., "index": ...}``.
        """
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: Mapping[str, int]) -> None:
        """Moves to a saved position.

        Args:
            state: What :meth:`state` returned.
        """
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = self._permutation(self.epoch)


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

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


# ------------------------------------------------------------------------------ batches
def concat_batches(batches: Sequence[GRPOBatch]) -> GRPOBatch:
    """Concatenates batches row-wise, left-padding prompts to a common width.

    Args:
        batches: Batches with the same completion width and the same optional fields.

    Returns:
        One batch (group size of the first).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import GRPOBatch, concat_batches
        >>> def batch(prompt_width):
        ...     return GRPOBatch(prompt_ids=jnp.ones((2, prompt_width), jnp.int32),
        ...                      prompt_mask=jnp.ones((2, prompt_width), jnp.int32),
        ...                      completion_ids=jnp.ones((2, 3), jnp.int32),
        ...                      completion_mask=jnp.ones((2, 3)), rewards=jnp.zeros(2),
        ...                      group_size=2)
        >>> both = concat_batches([batch(2), batch(4)])
        >>> both.batch_size, both.prompt_ids.shape, both.prompt_mask[0].tolist()
        (4, (4, 4), [0, 0, 1, 1])
    """
    width = max(b.prompt_ids.shape[1] for b in batches)

    def left_pad(x: jax.Array | None) -> jax.Array | None:
        if x is None or x.shape[1] == width:
            return x
        return jnp.pad(x, ((0, 0), (width - x.shape[1], 0)))

    padded = [
        b.replace(prompt_ids=left_pad(b.prompt_ids), prompt_mask=left_pad(b.prompt_mask))
        for b in batches
    ]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *padded)


def _take_rows(batch: GRPOBatch, rows: np.ndarray) -> GRPOBatch:
    """Rows ``rows`` of every per-row field (shuffled rows: prompts are not shared)."""
    idx = jnp.asarray(rows)
    return jax.tree.map(lambda x: x[idx], batch).replace(shared_prompts=False)


# ------------------------------------------------------------------------------ evaluation
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


# ------------------------------------------------------------------------------ reliability
def check_tokenizer_fits(tokenizer: Any, model: Any) -> None:
    """Checks that every id the tokenizer can produce is in the model's vocabulary.

    A tokenizer with more ids than the model's embedding table would produce token ids the
    gathers clamp silently. Models without a ``config.vocab_size`` (or tokenizers without a
    ``vocab_size``) are not checked.

    Args:
        tokenizer: The tokenizer (``vocab_size``, added tokens included).
        model: The policy (``config.vocab_size``).

    Raises:
        ValueError: The tokenizer has more ids than the model's vocabulary.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training.rl.run.loop import check_tokenizer_fits
        >>> tok = Tokenizer.for_characters("0123456789+=")  # 16 ids
        >>> cfg = CausalLMConfig(vocab_size=12, hidden_size=8, intermediate_size=16, num_layers=1,
        ...                      num_heads=2)
        >>> check_tokenizer_fits(tok, CausalLM(cfg, rngs=nnx.Rngs(0)))
        Traceback (most recent call last):
            ...
        ValueError: the tokenizer has 16 token ids but the model's vocabulary has only 12 ...
        >>> check_tokenizer_fits(tok, CausalLM(cfg.replace(vocab_size=16), rngs=nnx.Rngs(0)))
    """
    tok_size = getattr(tokenizer, "vocab_size", None)
    model_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(tok_size, int) or not isinstance(model_size, int):
        return
    if tok_size > model_size:
        msg = (
            f"the tokenizer has {tok_size} token ids but the model's vocabulary has only "
            f"{model_size} (config.vocab_size): use the tokenizer saved with this model"
        )
        raise ValueError(msg)


def dataset_fingerprint(dataset: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The size and a content hash of a dataset (what a resumed run must train on).

    Each row is hashed as canonical JSON (sorted keys; values JSON cannot hold by ``repr``).

    Args:
        dataset: The rows.

    Returns:
        ``{"size": len(dataset), "sha256": hex digest}``.

    Examples:
        >>> from artifex.generative_models.training.rl.run.loop import dataset_fingerprint
        >>> rows = [{"prompt": "1+1=", "answer": "2"}]
        >>> fp = dataset_fingerprint(rows)
        >>> fp["size"], len(fp["sha256"]), fp == dataset_fingerprint([dict(r) for r in rows])
        (1, 64, True)
        >>> fp == dataset_fingerprint([{"prompt": "1+1=", "answer": "3"}])
        False
    """
    digest = hashlib.sha256()
    for row in dataset:
        text = json.dumps(row, sort_keys=True, default=repr, ensure_ascii=True)
        digest.update(text.encode("utf-8"))
        digest.update(b"\n")
    return {"size": len(dataset), "sha256": digest.hexdigest()}


class _StopSignals:
    """Records SIGTERM/SIGINT so the loop can finish its step, checkpoint and return.

    A second signal of the same kind while the first is pending behaves as if no handler was
    installed (SIGINT raises ``KeyboardInterrupt``), so a stuck run can still be stopped.
    """

    def __init__(self, *, enabled: bool):
        self.enabled = enabled
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            self.uninstall()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
            return
        self.received = name
        _log.warning(
            f"{name} received: finishing the current step, then saving a checkpoint "
            "(send it again to stop at once)"
        )

    def install(self) -> None:
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


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


# ------------------------------------------------------------------------------ the loop
def reward_signal_diagnosis(rewards: Sequence[float] | Any, group_size: int) -> str | None:
    """One line saying why a generation batch cannot teach the policy anything, or ``None``.

    GRPO learns from differences between the rewards of one prompt's completions (groups are
    tested by :func:`~artifex.generative_models.training.rl.core.advantages.nonconstant_groups`): a
    batch whose rewards are all 0, or whose every group of ``group_size`` completions got one
    same reward, has advantages that are all 0 and gives no gradient. The training loop prints
    this line after its first step.

    Args:
        rewards: The ``(B,)`` rewards of a batch, row ``i`` of prompt ``i // group_size``
            (NaN or None: no reward).
        group_size: Completions per prompt ``G``; ``B`` must be a multiple of it.

    Returns:
        ``"no reward signal: ..."`` with what to check, or ``None`` when some group's rewards
        differ.

    Raises:
        ValueError: ``group_size`` is not a positive int that divides the number of rewards.

    Examples:
        >>> from artifex.generative_models.training.rl.run.loop import reward_signal_diagnosis
        >>> print(reward_signal_diagnosis([0.0, 0.0, 0.0, 0.0], group_size=2))
        no reward signal: every reward is 0 (4 completions of 2 prompts)...
        >>> print(reward_signal_diagnosis([1.0, 1.0, 0.0, 0.0], group_size=2))
        no reward signal: every group of 2 completions has the same reward ...
        >>> reward_signal_diagnosis([1.0, 0.0, 0.0, 0.0], group_size=2) is None
        True
    """
    r = np.asarray([np.nan if v is None else v for v in np.asarray(rewards, object).ravel()], float)
    group_size = check_int("group_size", group_size, minimum=1)
    if r.size % group_size:
        msg = f"{r.size} rewards do not split into groups of group_size={group_size}"
        raise ValueError(msg)
    prompts = r.size // group_size
    where = f"({r.size} completions of {prompts} prompts)"
    valid = ~np.isnan(r)
    if not valid.any():
        return (
            f"no reward signal: no completion got a reward {where}, every reward function "
            "returned None: check that the dataset has the columns the reward functions read"
        )
    if np.all(r[valid] == 0):
        return (
            f"no reward signal: every reward is 0 {where}, so every advantage is 0 and "
            "nothing is learned: look at a few completions (log_completions_every, "
            "--log-completions-every 1) and check the reward functions and the answer column, "
            "or use easier prompts or a reward that gives partial credit (e.g. format)"
        )
    if bool(np.any(nonconstant_groups(jnp.asarray(r, jnp.float32), group_size))):
        return None
    values = ", ".join(f"{v:g}" for v in np.unique(r[valid])[:5])
    return (
        f"no reward signal: every group of {group_size} completions has the same reward "
        f"{where}, rewards seen: {values} (all advantages are 0): raise num_generations or the "
        "sampling temperature for more varied completions, or use a reward that grades "
        "partial success"
    )


def _learning_rate(opt_state: Any) -> float | None:
    """The current learning rate when the optimizer uses ``optax.inject_hyperparams``."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
        hp = getattr(node, "hyperparams", None)
        if isinstance(hp, Mapping) and "learning_rate" in hp:
            return float(jnp.asarray(hp["learning_rate"]))
    return None


def _rollout_step(
    policy: Policy,
    tokenizer: Any,
    data: DataIterator,
    rewards: RewardCombiner,
    rcfg: RolloutConfig,
    cfg: TrainConfig,
    key: jax.Array,
    placement: Any = None,
    rollout_fn: Callable[..., Rollout] = rollout,
) -> tuple[Rollout, GRPOBatch, dict[str, float]]:
    need_old = cfg.num_iterations > 1 or cfg.num_minibatches > 1
    g = policy.config.num_generations
    n = cfg.prompts_per_step
    mesh = policy.mesh
    part = process_row_range(n, mesh) if spans_processes(mesh) else None
    first = rollout_fn(
        policy,
        tokenizer,
        data.take(n, part=part),
        rewards,
        rcfg,
        key=jax.random.fold_in(key, 0),
        need_old_log_probs=need_old,
        **({} if placement is None else {"placement": placement}),
    )
    info: dict[str, float] = {}
    if not cfg.dynamic_sampling:
        return first, first.batch, info
    kept: list[GRPOBatch] = []
    dropped: list[GRPOBatch] = []
    rollouts = [first]
    kept_groups = 0
    total_groups = 0
    for round_ in range(cfg.max_resample_rounds + 1):
        if round_ > 0:
            if kept_groups >= n:
                break
            rollouts.append(
                rollout_fn(
                    policy,
                    tokenizer,
                    data.take(n),
                    rewards,
                    rcfg,
                    key=jax.random.fold_in(key, round_),
                    need_old_log_probs=need_old,
                    **({} if placement is None else {"placement": placement}),
                )
            )
        ro = rollouts[-1]
        good = np.asarray(nonconstant_groups(jnp.asarray(host_array(ro.batch.rewards)), g))
        total_groups += good.size
        for i, ok in enumerate(good):
            rows = np.arange(i * g, (i + 1) * g)
            (kept if ok else dropped).append(_take_rows(ro.batch, rows))
        kept_groups = len(kept)
    groups = (kept + dropped)[:n]
    batch = concat_batches(groups)
    batch = batch.replace(group_ids=jnp.repeat(jnp.arange(n, dtype=jnp.int32), g))
    info = {
        "dynamic_sampling/rounds": float(len(rollouts)),
        "dynamic_sampling/kept_fraction": float(kept_groups / max(total_groups, 1)),
        "dynamic_sampling/zero_std_filled": float(max(n - kept_groups, 0)),
    }
    return first, batch, info


def _compile_first_update(
    trainer: GRPOTrainer,
    policy: Policy,
    tokenizer: Any,
    data: DataIterator,
    rcfg: RolloutConfig,
    cfg: TrainConfig,
) -> None:
    """Starts compiling the update for the next step's batches in a background thread.

    The example is the batch the next rollout will build (its rows read without moving the
    data position), with the loop's advantages, cut to one minibatch and placed as the loop
    places its batches, so the first update finds its program compiled (or compiling). The
    caller makes sure the library's own rollout runs on one process, with no placement and no
    dynamic sampling (other layouts are not known before sampling).
    """
    saved = data.state()
    rows = data.take(cfg.prompts_per_step)
    data.restore(saved)
    need_old = cfg.num_iterations > 1 or cfg.num_minibatches > 1
    example = rollout_batch_like(policy, tokenizer, rows, rcfg, need_old_log_probs=need_old)
    example = example.replace(advantages=jnp.zeros((example.batch_size,), jnp.float32))
    if cfg.num_minibatches > 1:
        example = _take_rows(example, np.arange(example.batch_size // cfg.num_minibatches))
    steps = cfg.gradient_accumulation_steps or trainer.auto_microbatches(example)
    step = trainer.compiled_step(steps)
    step.compile_ahead(trainer.state, trainer.place_batch(example))


@functools.partial(jax.jit, static_argnums=1)
def _advantages(batch: GRPOBatch, config: Any) -> jax.Array:
    return compute_advantages(batch, config)


@jax.jit
def _batch_metrics(batch: GRPOBatch) -> dict[str, jax.Array]:
    """Reward and advantage metrics of a whole generation batch (groups contiguous)."""
    return _reward_metrics(batch, batch.advantages)


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
        trainer: A :class:`~artifex.generative_models.training.rl.update.trainer.GRPOTrainer` on a
        causal
            LM.
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
    rcfg = RolloutConfig() if rollout_config is None else rollout_config
    dataset = as_rows(dataset)
    if eval_dataset is not None:
        eval_dataset = as_rows(eval_dataset, default_splits=EVAL_SPLITS, what="eval_dataset")
    if not isinstance(rewards, RewardCombiner):
        funcs = list(rewards) if isinstance(rewards, Sequence) else [rewards]
        rewards = RewardCombiner(funcs)
    if eval_reward is None:
        eval_reward = rewards.funcs[0]
    policy = trainer.policy()
    rows_per_batch = config.prompts_per_step * policy.config.num_generations
    per_update = rows_per_batch // config.num_minibatches
    if rows_per_batch % config.num_minibatches or per_update % (
        config.gradient_accumulation_steps or 1
    ):
        msg = (
            f"the {rows_per_batch} rows of a generation batch (prompts_per_step * "
            f"num_generations) must split into num_minibatches={config.num_minibatches} "
            f"updates of gradient_accumulation_steps={config.gradient_accumulation_steps} "
            "equal microbatches"
        )
        raise ValueError(msg)
    if rollout_fn is None and rcfg.row_groups is not None:
        if config.prompts_per_step % rcfg.row_groups:
            msg = (
                f"RolloutConfig.row_groups={rcfg.row_groups} must divide the prompts of a step "
                f"(TrainConfig.prompts_per_step={config.prompts_per_step})"
            )
            raise ValueError(msg)
        sampling_mesh = policy.mesh if rollout_placement is None else rollout_placement.mesh
        if rcfg.row_groups > 1 and sampling_mesh is not None and sampling_mesh.devices.size > 1:
            msg = (
                f"RolloutConfig.row_groups={rcfg.row_groups} needs the prompts on one device; "
                f"the rollout samples on a mesh of {sampling_mesh.devices.size} devices, which "
                "spreads the rows over them already (leave it None or 1)"
            )
            raise ValueError(msg)
    if eval_dataset is not None and evaluate_fn is None:
        check_eval_row_groups(rcfg, len(eval_dataset), EVAL_BATCH_SIZE)
    if config.eval_num_samples > 1 and eval_dataset is None:
        msg = f"TrainConfig.eval_num_samples={config.eval_num_samples} needs an eval_dataset"
        raise ValueError(msg)
    check_sampled_eval(
        config.eval_num_samples,
        custom_evaluate=evaluate_fn is not None,
        mesh=policy.mesh,
        rollout_config=rcfg,
    )
    length = policy.config.max_completion_length
    if rollout_fn is None and length is not None and length != rcfg.max_new_tokens:
        msg = (
            f"GRPOConfig.max_completion_length={length} and RolloutConfig.max_new_tokens="
            f"{rcfg.max_new_tokens} describe one length (the completions' width): leave "
            "max_completion_length unset (it is derived from the batch) or make them equal"
        )
        raise ValueError(msg)
    prompt_column = rcfg.prompt_column
    for i, row in enumerate(dataset):
        if not isinstance(row, Mapping) or prompt_column not in row:
            msg = f"dataset row {i} has no prompt column {prompt_column!r}"
            raise ValueError(msg)

    check_tokenizer_fits(tokenizer, policy.model)
    if rollout_engine is not None:  # an external engine samples (inference/engines)
        if rollout_fn is not None or rollout_placement is not None:
            msg = (
                "train(rollout_engine=...) samples the single-turn rollout with the engine; it "
                "does not combine with a custom rollout_fn (multi-turn) or a rollout_placement"
            )
            raise ValueError(msg)
        check_engine_rollout(rcfg, policy.mesh)
    if step_rewards is not None:  # the single-turn rollout with step rewards (step_rewards.py)
        if rollout_fn is not None:
            msg = (
                "train(step_rewards=...) scores the single-turn rollout's text; a custom "
                "rollout_fn (multi-turn) places its own (MultiTurnConfig.turn_rewards_as_step_"
                "rewards)"
            )
            raise ValueError(msg)
        rollout_fn = functools.partial(rollout, step_rewards=step_rewards)
    if rollout_engine is not None:
        rollout_fn = functools.partial(rollout_fn or rollout, engine=rollout_engine)
    if spans_processes(policy.mesh) and config.dynamic_sampling:
        msg = (
            "TrainConfig.dynamic_sampling is not supported on a mesh spanning several processes "
            "yet (its group filtering is host-side); got dynamic_sampling=True"
        )
        raise ValueError(msg)
    data = DataIterator(dataset, seed=config.seed, shuffle=config.shuffle)
    # The run's PRNG key lives in the train state (and so in every checkpoint): each step's
    # sampling key is ``fold_in(rng, step)``.
    trainer.rng = jax.random.key(config.seed)
    weights = getattr(rewards, "weights", None)
    fingerprint = training_fingerprint(
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
        **({} if fingerprint_extra is None else {"run": dict(fingerprint_extra)}),
    )
    # Pre-flight: every output location is checked and locked, and a checkpoint restored,
    # before the first (expensive) step.
    outputs = open_run_outputs(config, trainer, fingerprint)
    manager, start_step = outputs.manager, outputs.start_step
    logger, samples = outputs.logger, outputs.samples
    if outputs.record is not None:
        data.restore(outputs.record["data"])
    history: list[dict[str, float]] = []
    evaluations: list[tuple[int, dict[str, float]]] = []

    def run_eval(step: int) -> None:
        if eval_dataset is None:
            return
        metrics = (evaluate if evaluate_fn is None else evaluate_fn)(
            policy,
            tokenizer,
            eval_dataset,
            eval_reward,
            rcfg,
            pass_threshold=config.pass_threshold,
            **({} if rollout_placement is None else {"placement": rollout_placement}),
        )
        if config.eval_num_samples > 1:  # pass@k, maj@n (evaluation_metrics.py)
            metrics = metrics | evaluate_sampled(
                policy,
                tokenizer,
                eval_dataset,
                eval_reward,
                rcfg,
                num_samples=config.eval_num_samples,
                key=jax.random.fold_in(jax.random.fold_in(trainer.rng, 2**31 - 1), step),
                pass_threshold=config.pass_threshold,
                **({} if rollout_placement is None else {"placement": rollout_placement}),
            )
        evaluations.append((step, metrics))
        logger.log(step, metrics, advance=False)

    def save(step: int) -> None:
        if manager is None or manager.latest_step() == step:
            return
        manager.save(
            step,
            trainer.checkpoint_state(),
            {"step": step, "data": data.state(), "fingerprint": fingerprint},
        )

    stop = _StopSignals(enabled=config.handle_signals)
    interrupted = None
    try:
        if (
            config.compile_ahead
            and start_step < config.num_steps
            and rollout_fn is None
            and rollout_placement is None
            and not config.dynamic_sampling
            and not spans_processes(policy.mesh)
        ):
            # The first update compiles while the sampler compiles and generates (and while
            # the step-0 evaluation runs), not after them.
            _compile_first_update(trainer, policy, tokenizer, data, rcfg, config)
        stop.install()
        if start_step == 0:
            run_eval(0)
        for step in range(start_step + 1, config.num_steps + 1):
            t0 = time.perf_counter()
            key = jax.random.fold_in(trainer.rng, step)
            ro, batch, info = _rollout_step(
                policy,
                tokenizer,
                data,
                rewards,
                rcfg,
                config,
                key,
                rollout_placement,
                rollout_fn or rollout,
            )
            t_rollout = time.perf_counter() - t0
            # Advantages once per generation batch, by the one kernel, stored in the batch
            # (the updates below read them); the reward metrics once, from the same statistics.
            batch = trainer.place_batch(batch)
            # Placed again with its advantages, which then lie as the other fields do (as in
            # the example the first update was compiled ahead for).
            batch = trainer.place_batch(
                batch.replace(advantages=_advantages(batch, trainer.config))
            )
            batch_metrics = _batch_metrics(batch)
            check_reward_scale(
                host_array(batch.rewards),
                batch.group_size,
                group_ids=None if batch.group_ids is None else host_array(batch.group_ids),
                step=step,
            )
            # A run that cannot learn is told so at once (a distilled one learns from its
            # teacher whatever the rewards).
            if step == start_step + 1 and trainer.config.distillation_coeff == 0.0:
                note = reward_signal_diagnosis(host_array(ro.batch.rewards), ro.batch.group_size)
                if note is not None and is_primary_process():
                    _log.warning(note)
            if config.log_completions_every and step % config.log_completions_every == 0:
                # The first rollout's rows (with dynamic sampling the batch holds other rows).
                logged = batch if ro.batch is batch or not config.dynamic_sampling else None
                adv = (
                    logged.advantages
                    if logged is not None
                    else _advantages(trainer.place_batch(ro.batch), trainer.config)
                )
                _log_completions(samples, step, ro, adv, policy.mesh, config)
            # The mu x minibatch updates run on the train state itself: the compiled step
            # feeds on its own output, and the model sees the result once, before the next
            # rollout. The batch was built here: no host validation before the compiled step.
            updates: list[dict[str, float]] = []
            rows = batch.batch_size
            steps = config.gradient_accumulation_steps
            if steps is None:  # the trainer's choice for one minibatch's rows
                part = rows // config.num_minibatches
                like = batch
                if config.num_minibatches > 1:  # _take_rows' shapes, without tracing it
                    like = jax.tree.map(
                        lambda x, n=part: jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype), batch
                    ).replace(shared_prompts=False)
                steps = trainer.auto_microbatches(like)
            update_fn = trainer.compiled_step(steps)
            state = trainer.state
            # A Ctrl-C while the optimizer runs group by group is delivered after the store
            # below (the old arrays are donated by then).
            with interrupt_scope():
                try:
                    for it in range(config.num_iterations):
                        order = np.arange(rows)
                        if config.num_minibatches > 1:
                            perm_key = jax.random.fold_in(jax.random.fold_in(key, 1000), it)
                            order = np.asarray(jax.random.permutation(perm_key, rows))
                        for part in np.split(order, config.num_minibatches):
                            mb = batch if config.num_minibatches == 1 else _take_rows(batch, part)
                            if config.num_minibatches > 1:
                                mb = trainer.place_batch(mb)
                            mb = trainer.maybe_pack(mb, steps)  # rows without padding, if it pays
                            state, step_metrics = update_fn(state, mb)
                            updates.append(trainer.host_metrics(step_metrics, step=state.step))
                            state = trainer.maybe_sync_reference(state, step_metrics)
                except NonFiniteUpdateError as err:
                    msg = (
                        f"training step {step} (update {len(updates) + 1} of "
                        f"{config.num_iterations * config.num_minibatches}): {err}; no "
                        "checkpoint holds this state (the last one is from an earlier step)"
                    )
                    raise NonFiniteUpdateError(msg, err.metrics) from err
                finally:  # the last finite state (a rejected update returned the state before it)
                    trainer.store_update(state)
            metrics = {k: float(np.mean([u[k] for u in updates])) for k in updates[0]}
            metrics.update({k: float(v) for k, v in jax.device_get(batch_metrics).items()})
            metrics.update(ro.metrics())
            metrics.update(info)
            lr = _learning_rate(trainer.optimizer.opt_state)
            if lr is not None:
                metrics["learning_rate"] = lr
            metrics["rollout_time"] = t_rollout
            metrics["step_time"] = time.perf_counter() - t0
            history.append(metrics)
            logger.log(step, metrics)
            if config.eval_every and step % config.eval_every == 0 and step != config.num_steps:
                run_eval(step)
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                save(step)
            if stop.received is not None and step < config.num_steps:
                interrupted = stop.received
                save(step)
                _log.warning(
                    f"{interrupted} received: stopped after step {step}"
                    + (
                        f", checkpoint saved in {manager.directory}; run again to resume"
                        if manager is not None
                        else " (no checkpoint_dir: nothing was saved)"
                    ),
                )
                break
        if interrupted is None and start_step < config.num_steps:
            run_eval(config.num_steps)
            save(config.num_steps)
    finally:
        stop.uninstall()
        outputs.close()
    return TrainResult(
        history=history, evaluations=evaluations, start_step=start_step, interrupted=interrupted
    )


def _log_completions(
    log: CompletionLog,
    step: int,
    ro: Rollout,
    advantages: jax.Array,
    mesh: Any,
    config: TrainConfig,
) -> None:
    """Logs this process's rows of the step's (first) rollout with their advantages."""
    g = ro.batch.group_size
    adv = host_array(advantages)
    if adv.ndim == 2:  # per-token advantages: their mean over the completion tokens
        mask = host_array(ro.batch.completion_mask)
        adv = (adv * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1)
    lo = process_row_range(config.prompts_per_step, mesh)[0] * g if spans_processes(mesh) else 0
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
