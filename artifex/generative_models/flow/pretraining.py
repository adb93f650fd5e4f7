r"""Flow-matching pretraining: the rectified-flow objective and a compiled training loop.

With data ``x_0``, noise ``x_1 ~ N(0, I)`` and ``t ~ U(0, 1)``, rectified flow interpolates
``x_t = (1 - t) x_0 + t x_1`` and regresses the velocity of that straight path:

    ``L(theta) = E_{x_0, x_1, t} || v_theta(x_t, t, y) - (x_1 - x_0) ||^2``

(conditional flow matching with the optimal-transport path). Sampling integrates
``dx/dt = v_theta`` from ``t = 1`` (noise) to ``t = 0`` (data).

References:
    Lipman et al., 2022, "Flow Matching for Generative Modeling", arXiv:2210.02747;
    Liu et al., 2022, "Flow Straight and Fast: Learning to Generate and Transfer Data with
    Rectified Flow", arXiv:2209.03003.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.flow.dit import FlowDiT
from artifex.generative_models.flow.model import FlowModel
from artifex.generative_models.flow.text_dit import TextFlowDiT
from artifex.generative_models.flow.text_encoder import trained_parameters
from artifex.generative_models.utils.validation import check_float

__all__ = [
    "FlowTrainConfig",
    "flow_matching_loss",
    "load_digits_images",
    "shift_times",
    "train_flow_matching",
]


def load_digits_images() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 8x8 handwritten digits that scikit-learn ships, scaled to ``[-1, 1]``.

    Nothing is downloaded: the data set is part of the scikit-learn package (the ``flow``
    extra).

    Returns:
        ``(images, labels)``: ``(1797, 8, 8)`` float32 in ``[-1, 1]`` and ``(1797,)`` int32.

    Raises:
        ImportError: scikit-learn is not installed (``pip install 'artifex[flow]'``).

    Examples:
        >>> from artifex.generative_models.flow import load_digits_images
        >>> images, labels = load_digits_images()
        >>> images.shape, labels.shape, float(images.min()), float(images.max())
        ((1797, 8, 8), (1797,), -1.0, 1.0)
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        msg = "the digits data set needs scikit-learn: pip install 'artifex[flow]'"
        raise ImportError(msg) from err
    digits = load_digits()
    images = np.asarray(digits.images, np.float32) / 8.0 - 1.0
    return images, np.asarray(digits.target, np.int32)


def flow_matching_loss(
    model: FlowDiT | FlowModel | TextFlowDiT,
    x0: jax.Array,
    labels: jax.Array,
    noise: jax.Array,
    t: jax.Array,
) -> jax.Array:
    r"""Rectified-flow matching loss on a batch.

    ``mean_b mean_d (v_theta((1 - t_b) x0_b + t_b x1_b, t_b, y_b) - (x1_b - x0_b))_d^2``.

    Args:
        model: The velocity network ``model(x, t, labels)`` on flattened images.
        x0: ``(B, ...)`` data images (flattened inside).
        labels: ``(B,)`` int class labels or ``(B, L)`` prompt token ids.
        noise: ``(B, ...)`` standard normal noise ``x_1`` (shape of ``x0``).
        t: ``(B,)`` times in ``[0, 1]``.

    Returns:
        Scalar float32 loss.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import (
        ...     FlowModel, FlowModelConfig, flow_matching_loss)
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> x0, noise = jnp.zeros((2, 4, 4)), jnp.ones((2, 4, 4))
        >>> t = jnp.array([0.3, 0.7])
        >>> float(flow_matching_loss(model, x0, jnp.array([0, 1]), noise, t))  # v = 0, x1 - x0 = 1
        1.0
    """
    b = x0.shape[0]
    x0 = jnp.asarray(x0, jnp.float32).reshape(b, -1)
    x1 = jnp.asarray(noise, jnp.float32).reshape(b, -1)
    t = jnp.asarray(t, jnp.float32)
    xt = (1.0 - t[:, None]) * x0 + t[:, None] * x1
    v = model(xt, t, labels)
    return jnp.mean(jnp.square(v - (x1 - x0)))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FlowTrainConfig:
    """Settings of :func:`train_flow_matching`.

    Attributes:
        num_steps: Optimizer steps.
        batch_size: Images per step (sampled with replacement).
        learning_rate: Peak Adam learning rate (cosine decay to 10% of it).
        seed: Seeds batches, noise and times.
        time_shift: Where the training times fall: ``t = s u / (1 + (s - 1) u)`` with
            ``u ~ U(0, 1)`` and ``s = time_shift`` (the shift of Stable Diffusion 3, Esser et
            al. 2024, sec. 5.3.2). ``1`` is uniform; ``s > 1`` puts more of the steps at high
            noise (``s = 3``: median ``t = 0.75``), where the layout of an image is decided.
        freeze_text_encoder: Keep a
            :class:`~artifex.generative_models.flow.TextFlowDiT`'s text encoder (its
            embeddings, text layers and text norm) as it is and train the rest, as
            text-to-image models train on a frozen pretrained encoder (see
            :mod:`~artifex.generative_models.flow.text_encoder`).

    Examples:
        >>> from artifex.generative_models.flow import FlowTrainConfig
        >>> config = FlowTrainConfig(num_steps=500, batch_size=64)
        >>> config.num_steps, config.learning_rate
        (500, 0.002)
    """

    num_steps: int = 2000
    batch_size: int = 128
    learning_rate: float = 2e-3
    seed: int = 0
    time_shift: float = 1.0
    freeze_text_encoder: bool = False

    def __post_init__(self) -> None:
        check_float("FlowTrainConfig.time_shift", self.time_shift, greater_than=0.0)
        if not isinstance(self.freeze_text_encoder, bool):
            msg = (
                f"FlowTrainConfig.freeze_text_encoder must be a bool, got "
                f"{self.freeze_text_encoder!r}"
            )
            raise TypeError(msg)
        for name in ("num_steps", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                msg = f"FlowTrainConfig.{name} must be a positive int, got {value!r}"
                raise ValueError(msg)
        if not self.learning_rate > 0:
            msg = f"FlowTrainConfig.learning_rate must be > 0, got {self.learning_rate}"
            raise ValueError(msg)
        if not isinstance(self.seed, int):
            msg = f"FlowTrainConfig.seed must be an int, got {self.seed!r}"
            raise ValueError(msg)


def shift_times(u: jax.Array, shift: float) -> jax.Array:
    """Maps uniform times ``u`` to ``shift u / (1 + (shift - 1) u)`` (1 stays uniform).

    The map is increasing from ``[0, 1]`` onto itself; ``shift > 1`` moves the times toward 1
    (noise): the probability that ``t > 1/2`` is ``shift / (1 + shift)``.

    Args:
        u: Times in ``[0, 1]``.
        shift: A finite number ``> 0``.

    Returns:
        The shifted times, float32.

    Raises:
        ValueError: ``shift`` is not a finite number ``> 0``, or (when ``u`` is concrete) a
            time is outside ``[0, 1]``.
        TypeError: ``shift`` is not a number.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.flow.pretraining import shift_times
        >>> [round(float(t), 3) for t in shift_times(jnp.array([0.0, 0.5, 1.0]), 3.0)]
        [0.0, 0.75, 1.0]
    """
    check_float("shift_times.shift", shift, greater_than=0.0)
    u = jnp.asarray(u, jnp.float32)
    if not isinstance(u, jax.core.Tracer):
        host = np.asarray(u)
        if host.size and not (np.all(host >= 0.0) and np.all(host <= 1.0)):
            bad = host[~((host >= 0.0) & (host <= 1.0))].ravel()[0]
            msg = f"shift_times.u must hold times in [0, 1], got {bad}"
            raise ValueError(msg)
    return shift * u / (1.0 + (shift - 1.0) * u)


def train_flow_matching(
    model: FlowDiT | FlowModel | TextFlowDiT,
    images: np.ndarray | jax.Array,
    labels: np.ndarray | jax.Array,
    config: FlowTrainConfig | None = None,
) -> list[float]:
    """Trains ``model`` in place with :func:`flow_matching_loss` (Adam, one compiled scan).

    The whole run is one ``lax.scan`` over steps (compiled once), reporting the loss of every
    step.

    Args:
        model: The velocity network (updated in place).
        images: ``(N, ...)`` training images in ``[-1, 1]``.
        labels: ``(N,)`` int labels, or ``(N, L)`` prompt token ids for a text-conditioned
            model.
        config: Settings; defaults to ``FlowTrainConfig()``.

    Returns:
        The per-step losses.

    Raises:
        ValueError: ``images`` and ``labels`` have different numbers of rows, images of
            another size than the model's, or ``freeze_text_encoder`` for a model without a
            text encoder.

    Examples:
        >>> import numpy as np
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import (
        ...     FlowModel, FlowModelConfig, FlowTrainConfig, train_flow_matching)
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> images = np.full((32, 4, 4), 0.5, np.float32)  # one flat gray image
        >>> losses = train_flow_matching(model, images, np.zeros(32, np.int32),
        ...                              FlowTrainConfig(num_steps=60, batch_size=16))
        >>> len(losses), bool(np.mean(losses[-10:]) < np.mean(losses[:10]))
        (60, True)
    """
    config = FlowTrainConfig() if config is None else config
    images = jnp.asarray(images, jnp.float32)
    labels = jnp.asarray(labels, jnp.int32)
    if images.shape[0] != labels.shape[0] or labels.ndim not in (1, 2):
        msg = (
            f"images and labels must have the same number of rows (labels (N,) or token ids "
            f"(N, L)), got {images.shape} and {labels.shape}"
        )
        raise ValueError(msg)
    if images.reshape(images.shape[0], -1).shape[1] != model.config.data_dim:
        msg = (
            f"images must have {model.config.data_dim} values each (the model's image_shape "
            f"{model.config.image_shape}), got shape {images.shape}"
        )
        raise ValueError(msg)
    trained = trained_parameters(
        model, config.freeze_text_encoder, "FlowTrainConfig.freeze_text_encoder"
    )
    n = images.shape[0]
    schedule = optax.cosine_decay_schedule(config.learning_rate, config.num_steps, alpha=0.1)
    optimizer = nnx.Optimizer(model, optax.adam(schedule), wrt=trained)
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def run(state: nnx.State, key: jax.Array) -> tuple[nnx.State, jax.Array]:
        def step(state: nnx.State, key: jax.Array) -> tuple[nnx.State, jax.Array]:
            mdl, opt = nnx.merge(graphdef, state)
            k_idx, k_noise, k_t = jax.random.split(key, 3)
            idx = jax.random.randint(k_idx, (config.batch_size,), 0, n)
            x0 = images[idx]
            noise = jax.random.normal(k_noise, x0.shape)
            t = shift_times(jax.random.uniform(k_t, (config.batch_size,)), config.time_shift)
            grad_fn = nnx.value_and_grad(flow_matching_loss, argnums=nnx.DiffState(0, trained))
            loss, grads = grad_fn(mdl, x0, labels[idx], noise, t)
            opt.update(mdl, grads)
            return nnx.state((mdl, opt)), loss

        keys = jax.random.split(key, config.num_steps)
        return jax.lax.scan(step, state, keys)

    state, losses = run(state, jax.random.key(config.seed))
    nnx.update((model, optimizer), state)
    return [float(x) for x in np.asarray(losses)]
