"""The rollout and evaluation stages of the training loop for flow-matching image models.

:class:`FlowRollout` is a ``rollout_fn`` of
:func:`~artifex.generative_models.training.rl.train`: for each dataset row it samples
``num_generations`` images with the Flow-GRPO SDE sampler
(:class:`~artifex.generative_models.flow.sampling.FlowSampler`, with an SDE window
if the settings have one), scores them with the run's reward functions (each row's completion
is its image ``(H, W, C)``; the other dataset columns are passed as for text) and packs the
trajectories into the flow ``GRPOBatch``
(:func:`~artifex.generative_models.flow.batch.to_grpo_batch`), whose update runs
the model on the trained steps only. :class:`FlowEvaluator` is an ``evaluate_fn``: the
deterministic ODE sampler from the same noise at every evaluation, the evaluation reward's
mean and pass rate, and an image grid (PNG) with a JSONL file of the images' prompts, rewards
and descriptions per evaluation.

Prompts: a text-conditioned model (``config.vocab_size``) takes captions, encoded by the
tokenizer given to the loop (or the model's own, ``config.tokenizer()``); a class-conditioned
one (``config.num_classes``) takes integer class labels (or their decimal strings).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from artifex.generative_models.flow.batch import to_grpo_batch
from artifex.generative_models.flow.images import as_images, image_grid, write_png
from artifex.generative_models.flow.sampling import FlowSampler
from artifex.generative_models.flow.sde import SDEConfig
from artifex.generative_models.training.logging import is_primary_process
from artifex.generative_models.training.rl import Rollout
from artifex.generative_models.utils.atomic import atomic_write
from artifex.generative_models.utils.validation import check_int

__all__ = ["FlowEvaluator", "FlowRollout", "FlowRolloutResult", "encode_flow_prompts"]


def encode_flow_prompts(model: Any, tokenizer: Any, prompts: Sequence[Any]) -> np.ndarray:
    """The prompts of dataset rows as the flow model's inputs.

    Args:
        model: The flow model (``config.vocab_size``: text-conditioned; else class labels).
        tokenizer: Encodes captions to ``(N, L)`` ids (``encode``); ``None`` takes the model's
            ``config.tokenizer()``. Unused for class labels.
        prompts: Captions, or integer class labels (ints or decimal strings).

    Returns:
        ``(N, L)`` int32 token ids or ``(N,)`` int32 labels.

    Raises:
        TypeError: Captions for a class-conditioned model, labels for a text model, or no
            tokenizer for a text model.
        ValueError: A word outside the vocabulary, a label out of range.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.flow.rollout import encode_flow_prompts
        >>> from artifex.generative_models.flow import TextFlowDiT, TextFlowDiTConfig
        >>> model = TextFlowDiT(TextFlowDiTConfig(image_shape=(8, 8, 3), hidden_dim=8,
        ...                     num_blocks=1, num_heads=2, time_features=8), rngs=nnx.Rngs(0))
        >>> encode_flow_prompts(model, None, ["a red square"])[0, :4].tolist()
        [1, 5, 9, 0]
    """
    cfg = getattr(model, "config", None)
    if getattr(cfg, "vocab_size", None) is not None:
        bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
        if bad:
            msg = (
                f"a text-conditioned flow model takes captions (strings), got "
                f"{type(prompts[bad[0]]).__name__} at row {bad[0]}"
            )
            raise TypeError(msg)
        if tokenizer is None:
            tokenizer = getattr(cfg, "tokenizer", None)
            if not callable(tokenizer):
                msg = "a text-conditioned flow model needs a tokenizer (encode(captions))"
                raise TypeError(msg)
            tokenizer = tokenizer()
        return np.asarray(tokenizer.encode(list(prompts)), np.int32)
    labels = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) and p.strip().lstrip("-").isdigit():
            p = int(p)
        if isinstance(p, bool) or not isinstance(p, int | np.integer):
            msg = (
                f"a class-conditioned flow model takes integer class labels, got "
                f"{type(p).__name__} {p!r} at row {i}"
            )
            raise TypeError(msg)
        labels.append(int(p))
    classes = getattr(cfg, "num_classes", None)
    bad = [i for i, p in enumerate(labels) if p < 0 or (classes is not None and p >= classes)]
    if bad:
        msg = f"class labels must be in [0, {classes}), got {labels[bad[0]]} at row {bad[0]}"
        raise ValueError(msg)
    return np.asarray(labels, np.int32)


def _columns(rows: Sequence[Mapping[str, Any]], k: int, exclude: str) -> dict[str, list[Any]]:
    names = [n for n in rows[0] if n != exclude] if rows else []
    return {n: [row.get(n) for row in rows for _ in range(k)] for n in names}


@dataclasses.dataclass
class FlowRolloutResult(Rollout):
    """A :class:`~artifex.generative_models.training.rl.Rollout` of images.

    ``completions`` hold one line per image (the ``describe`` function's words) for the
    completions log; ``images`` the images themselves.

    Attributes:
        batch: As in ``Rollout``.
        rows: As in ``Rollout``.
        prompts: As in ``Rollout``.
        completions: As in ``Rollout``.
        rewards_per_function: As in ``Rollout``.
        reward_names: As in ``Rollout``.
        truncated: As in ``Rollout``.
        lengths: As in ``Rollout``.
        images: ``(B, H, W, C)`` float32 final samples in ``[-1, 1]``.
        window_start: The first SDE step of the batch's window (``None``: no window).

    Examples:
        >>> import dataclasses
        >>> from artifex.generative_models.flow.rollout import FlowRolloutResult
        >>> [f.name for f in dataclasses.fields(FlowRolloutResult)][-2:]
        ['images', 'window_start']
    """

    images: np.ndarray | None = None
    window_start: int | None = None

    def metrics(self) -> dict[str, float]:
        """Each reward function's mean (``rewards/<name>``) and the window's first step.

        Returns:
            Scalar metrics.
        """
        out = {}
        for name, column in zip(self.reward_names, self.rewards_per_function.T, strict=True):
            valid = ~np.isnan(column)
            out[f"rewards/{name}"] = float(column[valid].mean()) if valid.any() else float("nan")
        if self.window_start is not None:
            out["flow/window_start"] = float(self.window_start)
        return out


def _default_description(image: np.ndarray) -> str:
    return f"image {'x'.join(map(str, image.shape))}, mean {float(image.mean()):+.3f}"


class FlowRollout:
    """``rollout_fn`` of the training loop for flow models: SDE samples, rewards, flow batch.

    Called as the loop calls :func:`~artifex.generative_models.training.rl.rollout`:
    ``fn(policy, tokenizer, rows, rewards, rollout_config, *, key, need_old_log_probs)``.
    Row ``i`` of the batch is prompt ``i // K``'s generation ``i % K``. With
    ``need_old_log_probs`` (several updates per batch) the old log-probs are the sampler's own
    transition log-densities; otherwise none (the ratio of the single update is 1).

    Args:
        sde: The sampler settings (``noise_level > 0``; ``window_size``/``train_steps`` train
            a window or a subset of the steps).
        describe: ``image (H, W, C) -> str`` for the completions log (default: its shape and
            mean; :func:`~artifex.generative_models.flow.images.describe_shapes` for shapes).
        window_start: With ``sde.window_size``: the window's first step in every batch (0:
            the first, high-noise steps, where the layout is decided, as Flow-GRPO-Fast
            trains); ``None`` draws it uniformly per batch.

    Raises:
        TypeError: ``sde`` is not an ``SDEConfig``, or ``describe`` not callable.
        ValueError: ``noise_level`` 0 (ODE trajectories have no density), or a
            ``window_start`` without a window or past ``num_steps - window_size``.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowRollout, SDEConfig, compositional
        >>> from artifex.generative_models.flow import TextFlowDiT, TextFlowDiTConfig
        >>> from artifex.generative_models.training.rl import GRPOConfig, Policy, RewardCombiner
        >>> from artifex.generative_models.training.rl import RolloutConfig
        >>> cfg = TextFlowDiTConfig(hidden_dim=16, num_blocks=1, num_heads=2, time_features=8)
        >>> policy = Policy(TextFlowDiT(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=2))
        >>> ro = FlowRollout(SDEConfig(num_steps=4, window_size=2))(
        ...     policy, None, [{"prompt": "a red square"}], RewardCombiner([compositional]),
        ...     RolloutConfig(), key=jax.random.key(0))
        >>> ro.batch.batch_size, ro.batch.completion_ids.shape, ro.images.shape
        (2, (2, 2), (2, 32, 32, 3))
    """

    def __init__(
        self,
        sde: SDEConfig,
        *,
        describe: Callable[[np.ndarray], str] | None = None,
        window_start: int | None = None,
    ):
        if not isinstance(sde, SDEConfig):
            msg = f"sde must be an SDEConfig, got {type(sde).__name__}"
            raise TypeError(msg)
        if sde.noise_level == 0.0:
            msg = "FlowRollout needs SDEConfig.noise_level > 0 (ODE trajectories have no density)"
            raise ValueError(msg)
        if describe is not None and not callable(describe):
            msg = f"describe must be callable image -> str, got {type(describe).__name__}"
            raise TypeError(msg)
        if window_start is not None:
            if sde.window_size is None:
                msg = "window_start needs SDEConfig.window_size (every step is an SDE step)"
                raise ValueError(msg)
            check_int(
                "window_start", window_start, minimum=0, maximum=sde.num_steps - sde.window_size
            )
        self.window_start = window_start
        self.sde = sde
        self.sampler = FlowSampler(sde)
        self.describe = _default_description if describe is None else describe

    def __call__(
        self,
        policy: Any,
        tokenizer: Any,
        rows: Sequence[Mapping[str, Any]],
        rewards: Any,
        config: Any,
        *,
        key: jax.Array,
        need_old_log_probs: bool = False,
        placement: Any = None,
    ) -> FlowRolloutResult:
        """Samples, scores and packs one generation batch.

        Args:
            policy: The loop's ``Policy`` (``model``, ``config.num_generations``).
            tokenizer: Encodes captions (``None``: the model's own).
            rows: Dataset rows, one per prompt.
            rewards: The loop's ``RewardCombiner``.
            config: The ``RolloutConfig`` (its ``prompt_column``).
            key: PRNG key of the step.
            need_old_log_probs: Keep the sampler's log-probs as ``old_log_probs``.
            placement: Not supported (``None``).

        Returns:
            A :class:`FlowRolloutResult`.

        Raises:
            ValueError: A ``placement``, rows without the prompt column, bad rewards.
            TypeError: Prompts of the wrong kind for the model.
        """
        if placement is not None:
            msg = "FlowRollout samples with the trainer's model: a placement is not supported"
            raise ValueError(msg)
        column = config.prompt_column
        for i, row in enumerate(rows):
            if column not in row:
                msg = f"row {i} has no prompt column {column!r}"
                raise ValueError(msg)
        model = policy.model
        k = policy.config.num_generations
        prompts = [row[column] for row in rows]
        encoded = encode_flow_prompts(model, tokenizer, prompts)
        k_sample, k_steps = jax.random.split(key)
        traj = self.sampler(model, encoded, k, k_sample, window_start=self.window_start)
        images = as_images(jax.device_get(traj.images), model.config.image_shape)
        repeated = [p for p in prompts for _ in range(k)]
        total, per_function = rewards(
            repeated, list(images), group_size=k, **_columns(rows, k, column)
        )
        batch = to_grpo_batch(traj, np.asarray(total, np.float32), group_size=k, key=k_steps)
        if not need_old_log_probs:
            batch = batch.replace(old_log_probs=None)
        b = batch.batch_size
        start = None
        if self.sde.window_size is not None:
            stochastic = np.asarray(jax.device_get(traj.stochastic[0]))
            start = int(np.argmax(stochastic))
        return FlowRolloutResult(
            batch=batch,
            rows=list(rows),
            prompts=[str(p) for p in prompts],
            completions=[self.describe(image) for image in images],
            rewards_per_function=np.asarray(per_function, np.float32),
            reward_names=list(rewards.names),
            truncated=np.zeros((b,), bool),
            lengths=np.full((b,), batch.completion_ids.shape[1]),
            images=images,
            window_start=start,
        )


class FlowEvaluator:
    """``evaluate_fn`` of the training loop for flow models: ODE samples, rewards, an image grid.

    Every evaluation samples ``images_per_prompt`` images per held-out row with the Euler ODE
    sampler (``noise_level`` 0) from the same noise (``seed``), so evaluations differ only by
    the weights. ``eval/pass@1`` is the fraction of images whose evaluation reward reaches
    ``pass_threshold`` (with the compositional reward and a threshold of 1: the compositional
    accuracy), ``eval/reward_mean`` their mean reward.

    With ``image_dir``, each evaluation writes ``eval_<step>.png`` (a grid of the first
    ``grid_images`` images, ``images_per_prompt`` per prompt) and ``eval_<step>.jsonl`` (per
    image: row, prompt, reward and description), on the primary process.

    Args:
        num_steps: ODE steps.
        images_per_prompt: Images per held-out row.
        image_dir: Where the grids go (``None``: nowhere).
        step_fn: ``() -> int``, the loop step an evaluation belongs to (for the file names);
            ``None`` numbers evaluations 0, 1, ...
        seed: Seeds the evaluation noise.
        batch_size: Prompts per sampler call (the last call is padded: one compilation).
        grid_images: Images in each grid.
        describe: ``image -> str`` for the JSONL file (``None``: no description).

    Raises:
        ValueError: A bad count or ``num_steps`` under 2.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowEvaluator, compositional
        >>> from artifex.generative_models.flow import TextFlowDiT, TextFlowDiTConfig
        >>> from artifex.generative_models.training.rl import GRPOConfig, Policy, RolloutConfig
        >>> cfg = TextFlowDiTConfig(hidden_dim=16, num_blocks=1, num_heads=2, time_features=8)
        >>> policy = Policy(TextFlowDiT(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=2))
        >>> FlowEvaluator(num_steps=4)(policy, None, [{"prompt": "a red square"}],
        ...                           compositional, RolloutConfig())  # untrained: noise
        {'eval/pass@1': 0.0, 'eval/reward_mean': 0.0}
    """

    def __init__(
        self,
        num_steps: int,
        *,
        images_per_prompt: int = 1,
        image_dir: str | os.PathLike[str] | None = None,
        step_fn: Callable[[], int] | None = None,
        seed: int = 0,
        batch_size: int = 64,
        grid_images: int = 64,
        describe: Callable[[np.ndarray], str] | None = None,
    ):
        check_int("num_steps", num_steps, minimum=2)
        self.images_per_prompt = check_int("images_per_prompt", images_per_prompt, minimum=1)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.grid_images = check_int("grid_images", grid_images, minimum=1)
        self.seed = check_int("seed", seed)
        self.sampler = FlowSampler(SDEConfig(num_steps=num_steps, noise_level=0.0))
        self.image_dir = None if image_dir is None else os.fspath(image_dir)
        self.step_fn = step_fn
        self.describe = describe
        self.calls = 0

    def sample(self, model: Any, tokenizer: Any, prompts: Sequence[Any]) -> np.ndarray:
        """``images_per_prompt`` ODE samples per prompt, prompt-major: ``(N K, H, W, C)``.

        Args:
            model: The flow model.
            tokenizer: Encodes captions (``None``: the model's own).
            prompts: Captions or class labels.

        Returns:
            The images.
        """
        k = self.images_per_prompt
        encoded = encode_flow_prompts(model, tokenizer, prompts)
        out = []
        for i, start in enumerate(range(0, len(encoded), self.batch_size)):
            chunk = encoded[start : start + self.batch_size]
            n = len(chunk)
            if n < self.batch_size and len(encoded) > self.batch_size:  # one shape: pad
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], self.batch_size - n, 0)])
            key = jax.random.fold_in(jax.random.key(self.seed), i)
            traj = self.sampler(model, chunk, k, key)
            images = as_images(jax.device_get(traj.images), model.config.image_shape)
            out.append(images[: n * k])
        return np.concatenate(out)

    def __call__(
        self,
        policy: Any,
        tokenizer: Any,
        rows: Sequence[Mapping[str, Any]],
        reward_fn: Callable[..., Sequence[float | None]],
        config: Any,
        *,
        pass_threshold: float = 1.0,
        placement: Any = None,
    ) -> dict[str, float]:
        """Samples and scores the held-out rows (and writes the grid).

        Args:
            policy: The loop's ``Policy`` (or anything with a ``model``).
            tokenizer: Encodes captions (``None``: the model's own).
            rows: Held-out rows.
            reward_fn: The evaluation reward ``f(prompts, completions, **columns)``.
            config: The ``RolloutConfig`` (its ``prompt_column``).
            pass_threshold: Reward an image needs to pass.
            placement: Not supported (``None``).

        Returns:
            ``{"eval/pass@1": ..., "eval/reward_mean": ...}``.

        Raises:
            ValueError: A ``placement``, rows without the prompt column.
        """
        if placement is not None:
            msg = "FlowEvaluator samples with the trainer's model: a placement is not supported"
            raise ValueError(msg)
        column = config.prompt_column
        for i, row in enumerate(rows):
            if column not in row:
                msg = f"eval row {i} has no prompt column {column!r}"
                raise ValueError(msg)
        k = self.images_per_prompt
        prompts = [row[column] for row in rows]
        images = self.sample(policy.model, tokenizer, prompts)
        repeated = [p for p in prompts for _ in range(k)]
        values = reward_fn(repeated, list(images), **_columns(rows, k, column))
        scores = np.asarray([np.nan if v is None else float(v) for v in values], np.float64)
        valid = ~np.isnan(scores)
        metrics = {
            "eval/pass@1": float(np.mean(np.where(valid, scores, -np.inf) >= pass_threshold)),
            "eval/reward_mean": float(scores[valid].mean()) if valid.any() else float("nan"),
        }
        step = self.calls if self.step_fn is None else int(self.step_fn())
        self.calls += 1
        if self.image_dir is not None and is_primary_process():
            self._write(step, repeated, images, scores)
        return metrics

    def _write(self, step: int, prompts: list[Any], images: np.ndarray, scores: np.ndarray):
        os.makedirs(self.image_dir, exist_ok=True)
        stem = os.path.join(self.image_dir, f"eval_{step:06d}")
        n = min(self.grid_images, len(images))
        columns = self.images_per_prompt if self.images_per_prompt > 1 else 8
        write_png(stem + ".png", image_grid(images[:n], columns=max(columns, 1)))
        lines = []
        for i, (prompt, image, score) in enumerate(zip(prompts, images, scores, strict=True)):
            entry = {
                "step": step,
                "row": i // self.images_per_prompt,
                "prompt": prompt if isinstance(prompt, str | int) else str(prompt),
                "reward": None if np.isnan(score) else float(score),
                "in_grid": i < n,
            }
            if self.describe is not None:
                entry["description"] = self.describe(image)
            lines.append(json.dumps(entry))
        with atomic_write(stem + ".jsonl", "w") as fh:
            fh.write("\n".join(lines) + "\n")
