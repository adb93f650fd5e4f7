"""The Flow-GRPO demo: GRPO fine-tunes a tiny flow-matching digit generator.

A small class-conditioned diffusion transformer
(:class:`~artifex.generative_models.flow.FlowDiT`; the residual-MLP
:class:`~artifex.generative_models.flow.FlowModel` with ``architecture="mlp"``) is
pretrained briefly with rectified flow matching on scikit-learn's 8x8 digits, so it draws
recognizable but imperfect digits. GRPO then samples ``K`` images per requested class with the
Flow-GRPO SDE sampler, scores them with a small digit classifier's confidence in the requested class
(combined with a small brightness term, to show how image rewards combine), and updates the
model with the library's ``GRPOTrainer`` through the flow log-prob hook: each denoising step is
a "token" whose log-prob is the exact Gaussian transition density. The reference for the KL
penalty is the pretrained model, and the penalty is the exact per-step KL between the two
Gaussian transitions (``GRPOConfig(kl_estimator="exact")``). Run it with
``artifex-grpo demo --task flow``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.flow import (
    DigitClassifier,
    FlowDiT,
    FlowDiTConfig,
    FlowModel,
    FlowModelConfig,
    FlowSampler,
    FlowTrainConfig,
    SDEConfig,
    brightness_reward,
    classifier_reward,
    combine_image_rewards,
    flow_log_prob_fn,
    load_digits_images,
    to_grpo_batch,
    train_classifier,
    train_flow_matching,
)
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.update.trainer import GRPOTrainer
from artifex.generative_models.utils.atomic import atomic_write, atomic_write_json
from artifex.generative_models.utils.validation import check_choice, check_int

__all__ = [
    "FlowDemoConfig",
    "FlowDemoResult",
    "build_flow_model",
    "plot_flow_rewards",
    "plot_image_grid",
    "run_flow_demo",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FlowDemoConfig:
    """Settings of the Flow-GRPO demo (the defaults are those of ``artifex-grpo demo --task flow``).

    Attributes:
        seed: Seeds everything.
        architecture: ``"dit"`` (:class:`FlowDiT`, 2x2 patches) or ``"mlp"``
            (:class:`FlowModel`).
        hidden_dim: Width of the flow model.
        num_blocks: Transformer (or residual) blocks of the flow model.
        num_heads: Attention heads of the DiT (unused by the MLP).
        pretrain_steps: Flow-matching steps (short on purpose: GRPO has room to improve).
        pretrain_learning_rate: Peak Adam learning rate of the flow-matching pretraining.
        classifier_steps: Steps of the reward classifier.
        grpo_steps: GRPO updates (one fresh batch of trajectories each).
        classes: The class prompts of every GRPO batch.
        num_generations: Images per class prompt ``K`` (the group size).
        num_sampling_steps: Denoising steps ``S``.
        noise_level: SDE noise level ``a``.
        window_size: SDE window ``W`` (MixGRPO / Flow-GRPO-Fast: ``W`` consecutive SDE steps
            at a random position, the rest ODE steps; ``None``: every step is an SDE step).
        train_steps: Steps trained per trajectory (``None``: every SDE step).
        learning_rate: Adam learning rate of GRPO.
        beta: KL coefficient (per-step KL to the pretrained model).
        brightness_weight: Weight of the brightness reward added to the classifier reward.
        num_eval: Images per class for the before/after evaluation (SDE sampler, fixed noise).
        out_dir: Where the metrics (JSON) and figures go; ``None`` writes nothing.

    Examples:
        >>> from artifex.demos.flow import FlowDemoConfig
        >>> config = FlowDemoConfig(grpo_steps=20, classes=(0, 1), out_dir=None)
        >>> config.grpo_steps, config.classes, config.num_generations
        (20, (0, 1), 8)
    """

    seed: int = 0
    architecture: str = "dit"
    hidden_dim: int = 64
    num_blocks: int = 2
    num_heads: int = 4
    pretrain_steps: int = 300
    pretrain_learning_rate: float = 4e-3
    classifier_steps: int = 400
    grpo_steps: int = 40
    classes: tuple[int, ...] = tuple(range(10))
    num_generations: int = 8
    num_sampling_steps: int = 10
    noise_level: float = 0.7
    window_size: int | None = None
    train_steps: int | None = None
    learning_rate: float = 3e-4
    beta: float = 0.05
    brightness_weight: float = 0.0
    num_eval: int = 16
    out_dir: str | None = "runs/flow_demo"

    def __post_init__(self) -> None:
        for name in (
            "hidden_dim",
            "num_blocks",
            "num_heads",
            "pretrain_steps",
            "classifier_steps",
            "num_generations",
            "num_eval",
        ):
            check_int(f"FlowDemoConfig.{name}", getattr(self, name), minimum=1)
        check_int("FlowDemoConfig.grpo_steps", self.grpo_steps, minimum=0)
        if not self.classes or any(not 0 <= int(c) < 10 for c in self.classes):
            msg = f"FlowDemoConfig.classes must be digits 0..9, got {self.classes}"
            raise ValueError(msg)
        if self.num_generations < 2:
            msg = f"FlowDemoConfig.num_generations must be >= 2, got {self.num_generations}"
            raise ValueError(msg)
        check_choice("FlowDemoConfig.architecture", self.architecture, ("dit", "mlp"))
        if not self.pretrain_learning_rate > 0:
            msg = (
                f"FlowDemoConfig.pretrain_learning_rate must be > 0, got "
                f"{self.pretrain_learning_rate}"
            )
            raise ValueError(msg)
        if not self.learning_rate > 0 or self.beta < 0:
            msg = (
                f"FlowDemoConfig needs learning_rate > 0 and beta >= 0, got "
                f"{self.learning_rate} and {self.beta}"
            )
            raise ValueError(msg)
        SDEConfig(
            num_steps=self.num_sampling_steps,
            noise_level=self.noise_level,
            window_size=self.window_size,
            train_steps=self.train_steps,
        )  # validates the sampler fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowDemoResult:
    """What the demo measured.

    Attributes:
        reward_before: Mean reward of the evaluation images before GRPO.
        reward_after: The same after GRPO (same noise).
        accuracy_before: Fraction of evaluation images classified as the requested class.
        accuracy_after: The same after GRPO.
        reward_curve: Mean training reward of every GRPO batch.
        kl_curve: Mean closed-form per-step KL to the reference on every batch (before its
            update).
        images_before: ``(classes, num_eval, 8, 8)`` evaluation images before GRPO.
        images_after: The same after GRPO.
        classifier_accuracy: The reward classifier's accuracy on the digits.
        pretrain_loss: Final flow-matching loss (mean of the last 50 steps).
        seconds: Wall-clock time of each phase (``pretrain``, ``classifier``, ``grpo``,
            ``total``).
        num_compilations: Traces of the GRPO step (1: one batch shape).

    Examples:
        >>> import dataclasses
        >>> from artifex.demos.flow import FlowDemoResult
        >>> [f.name for f in dataclasses.fields(FlowDemoResult)][:4]
        ['reward_before', 'reward_after', 'accuracy_before', 'accuracy_after']
    """

    reward_before: float
    reward_after: float
    accuracy_before: float
    accuracy_after: float
    reward_curve: list[float]
    kl_curve: list[float]
    images_before: np.ndarray
    images_after: np.ndarray
    classifier_accuracy: float
    pretrain_loss: float
    seconds: dict[str, float]
    num_compilations: int

    def summary(self) -> dict[str, Any]:
        """The scalar results as a JSON-able dict.

        Returns:
            Everything but the images.
        """
        out = dataclasses.asdict(self)
        out.pop("images_before")
        out.pop("images_after")
        return out


def _evaluate(
    sampler: FlowSampler,
    model: FlowDiT | FlowModel,
    classes: np.ndarray,
    num: int,
    key: jax.Array,
    reward_fn: Any,
    classifier: DigitClassifier,
) -> tuple[float, float, np.ndarray]:
    traj = sampler(model, classes, num, key)
    images = np.asarray(traj.images)
    labels = np.asarray(traj.prompts)
    reward = float(np.mean(reward_fn(images, labels)))
    pred = np.asarray(jnp.argmax(classifier(jnp.asarray(images)), axis=-1))
    return reward, float(np.mean(pred == labels)), images.reshape(len(classes), num, 8, 8)


def build_flow_model(config: FlowDemoConfig) -> FlowDiT | FlowModel:
    """The untrained flow model the demo pretrains (8x8 digits, 10 classes).

    Args:
        config: The demo settings (``architecture``, ``hidden_dim``, ``num_blocks``,
            ``num_heads``, ``seed``).

    Returns:
        A :class:`FlowDiT` (``architecture="dit"``) or a :class:`FlowModel` (``"mlp"``).

    Examples:
        >>> from artifex.demos.flow import FlowDemoConfig, build_flow_model
        >>> build_flow_model(FlowDemoConfig(hidden_dim=16, num_blocks=1)).config.num_tokens
        16
    """
    rngs = nnx.Rngs(config.seed)
    if config.architecture == "mlp":
        return FlowModel(
            FlowModelConfig(hidden_dim=config.hidden_dim, num_blocks=config.num_blocks), rngs=rngs
        )
    dit = FlowDiTConfig(
        hidden_dim=config.hidden_dim, num_blocks=config.num_blocks, num_heads=config.num_heads
    )
    return FlowDiT(dit, rngs=rngs)


def run_flow_demo(config: FlowDemoConfig | None = None, *, verbose: bool = True) -> FlowDemoResult:
    """Pretrains the tiny flow model, then raises its reward with GRPO.

    Args:
        config: Settings; defaults to ``FlowDemoConfig()``.
        verbose: Print progress.

    Returns:
        The :class:`FlowDemoResult` (also written to ``out_dir`` with the figures).

    Examples:
        Not run with the other docstring examples: the default settings train the whole demo,
        and settings small enough for a docstring do not raise the reward. The slow test
        ``tests/test_flow_demo.py::test_short_flow_demo_writes_results`` runs a 3-step version
        end to end.

        >>> from artifex.demos.flow import FlowDemoConfig, run_flow_demo
        >>> result = run_flow_demo(FlowDemoConfig(out_dir="runs/flow_demo"))  # doctest: +SKIP
        >>> result.reward_after > result.reward_before  # doctest: +SKIP
        True
    """
    config = FlowDemoConfig() if config is None else config
    log = print if verbose else (lambda *a, **k: None)
    t_start = time.perf_counter()
    seconds: dict[str, float] = {}
    images, labels = load_digits_images()
    keys = jax.random.split(jax.random.key(config.seed), 4)

    t0 = time.perf_counter()
    model = build_flow_model(config)
    losses = train_flow_matching(
        model,
        images,
        labels,
        FlowTrainConfig(
            num_steps=config.pretrain_steps,
            learning_rate=config.pretrain_learning_rate,
            seed=config.seed,
        ),
    )
    seconds["pretrain"] = time.perf_counter() - t0
    pretrain_loss = float(np.mean(losses[-50:]))
    log(
        f"flow matching ({config.architecture}): {config.pretrain_steps} steps, "
        f"loss {pretrain_loss:.4f}"
    )

    t0 = time.perf_counter()
    classifier = DigitClassifier(rngs=nnx.Rngs(config.seed + 1))
    acc = train_classifier(
        classifier, images, labels, num_steps=config.classifier_steps, seed=config.seed + 1
    )
    seconds["classifier"] = time.perf_counter() - t0
    log(f"reward classifier: accuracy {acc:.3f}")
    conf = classifier_reward(classifier)
    funcs = [conf]
    weights = [1.0]
    if config.brightness_weight:
        funcs.append(brightness_reward)
        weights.append(config.brightness_weight)

    def reward_fn(imgs: np.ndarray, labs: np.ndarray) -> np.ndarray:
        return combine_image_rewards(funcs, imgs, labs, weights=weights)

    sde = SDEConfig(
        num_steps=config.num_sampling_steps,
        noise_level=config.noise_level,
        window_size=config.window_size,
        train_steps=config.train_steps,
    )
    sampler = FlowSampler(sde)
    eval_sampler = FlowSampler(dataclasses.replace(sde, window_size=None, train_steps=None))
    classes = np.asarray(config.classes, np.int32)
    before = _evaluate(
        eval_sampler, model, classes, config.num_eval, keys[1], reward_fn, classifier
    )
    log(f"before GRPO: reward {before[0]:.3f}, class accuracy {before[1]:.3f}")

    t0 = time.perf_counter()
    reference = nnx.clone(model)
    optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
    grpo = GRPOConfig(
        num_generations=config.num_generations,
        beta=config.beta,
        kl_estimator="exact",
        entropy_coeff=0.0,
        max_grad_norm=1.0,
    )
    trainer = GRPOTrainer(
        model, optimizer, grpo, reference_model=reference, log_prob_fn=flow_log_prob_fn(sde)
    )
    reward_curve: list[float] = []
    kl_curve: list[float] = []
    key = keys[2]
    for step in range(config.grpo_steps):
        key, k_sample, k_mask = jax.random.split(key, 3)
        traj = sampler(model, classes, config.num_generations, k_sample)
        rewards = reward_fn(np.asarray(traj.images), np.asarray(traj.prompts))
        batch = to_grpo_batch(traj, rewards, group_size=config.num_generations, key=k_mask)
        metrics = trainer.train_step(batch)
        kl_curve.append(metrics["kl"])  # the exact KL before this update
        reward_curve.append(float(np.mean(rewards)))
        if step % 10 == 0 or step == config.grpo_steps - 1:
            log(f"GRPO step {step:3d}: reward {reward_curve[-1]:.3f}, KL {kl_curve[-1]:.4f}")
    seconds["grpo"] = time.perf_counter() - t0

    after = _evaluate(eval_sampler, model, classes, config.num_eval, keys[1], reward_fn, classifier)
    log(f"after GRPO:  reward {after[0]:.3f}, class accuracy {after[1]:.3f}")
    seconds["total"] = time.perf_counter() - t_start
    result = FlowDemoResult(
        reward_before=before[0],
        reward_after=after[0],
        accuracy_before=before[1],
        accuracy_after=after[1],
        reward_curve=reward_curve,
        kl_curve=kl_curve,
        images_before=before[2],
        images_after=after[2],
        classifier_accuracy=acc,
        pretrain_loss=pretrain_loss,
        seconds=seconds,
        num_compilations=trainer.num_compilations,
    )
    if config.out_dir:
        os.makedirs(config.out_dir, exist_ok=True)
        atomic_write_json(os.path.join(config.out_dir, "metrics.json"), result.summary(), indent=2)
        plot_image_grid(
            result.images_before,
            result.images_after,
            os.path.join(config.out_dir, "images.png"),
        )
        plot_flow_rewards(result, os.path.join(config.out_dir, "rewards.png"))
        log(f"wrote {config.out_dir}/metrics.json, images.png, rewards.png")
    return result


def plot_image_grid(
    before: np.ndarray, after: np.ndarray, path: str | None = None, *, columns: int = 8
) -> Any:
    """Draws the first ``columns`` images of each class before (left) and after (right) GRPO.

    Args:
        before: ``(C, N, H, W)`` images in ``[-1, 1]``.
        after: The same shape.
        path: PNG file to write, or ``None``.
        columns: Images per class and side.

    Returns:
        The matplotlib figure.

    Examples:
        >>> import numpy as np
        >>> from artifex.demos.flow import plot_image_grid
        >>> before = np.zeros((2, 3, 8, 8))  # 2 classes, 3 images each
        >>> fig = plot_image_grid(before, before + 0.5, columns=3)
        >>> type(fig).__name__
        'Figure'
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    n = min(columns, before.shape[1])

    def tile(x: np.ndarray) -> np.ndarray:
        rows = [
            np.concatenate(
                list(np.pad(x[c, :n], ((0, 0), (1, 1), (1, 1)), constant_values=-1)), axis=1
            )
            for c in range(x.shape[0])
        ]
        return np.concatenate(rows, axis=0)

    fig, axes = plt.subplots(1, 2, figsize=(10, 0.6 * before.shape[0] + 1))
    for ax, x, title in ((axes[0], before, "before GRPO"), (axes[1], after, "after GRPO")):
        ax.imshow(tile(x), cmap="gray_r", vmin=-1, vmax=1)
        ax.set_title(title)
        ax.axis("off")
    fig.tight_layout()
    if path is not None:
        with atomic_write(path, "wb") as fh:
            fig.savefig(fh, format="png", dpi=100)
    return fig


def plot_flow_rewards(result: FlowDemoResult, path: str | None = None) -> Any:
    """Plots the training reward and the closed-form KL per GRPO step.

    Args:
        result: From :func:`run_flow_demo`.
        path: PNG file to write, or ``None``.

    Returns:
        The matplotlib figure.

    Examples:
        >>> import numpy as np
        >>> from artifex.demos.flow import FlowDemoResult, plot_flow_rewards
        >>> images = np.zeros((1, 2, 8, 8))
        >>> result = FlowDemoResult(reward_before=0.2, reward_after=0.6, accuracy_before=0.2,
        ...                         accuracy_after=0.6, reward_curve=[0.2, 0.4, 0.6],
        ...                         kl_curve=[0.0, 0.01, 0.02], images_before=images,
        ...                         images_after=images, classifier_accuracy=0.95,
        ...                         pretrain_loss=0.3, seconds={}, num_compilations=1)
        >>> type(plot_flow_rewards(result)).__name__
        'Figure'
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(result.reward_curve)
    ax1.set_xlabel("GRPO step")
    ax1.set_ylabel("mean reward")
    ax1.set_title("reward (classifier confidence)")
    ax2.plot(result.kl_curve, color="C1")
    ax2.set_xlabel("GRPO step")
    ax2.set_ylabel("per-step KL")
    ax2.set_title("closed-form KL to the reference")
    fig.tight_layout()
    if path is not None:
        with atomic_write(path, "wb") as fh:
            fig.savefig(fh, format="png", dpi=100)
    return fig
