"""A small class-conditioned velocity network for flow matching on tiny images.

The network predicts the rectified-flow velocity ``v_theta(x_t, t, y)`` of a flattened image
``x_t`` at time ``t`` (``t = 0`` data, ``t = 1`` noise) for class ``y``. It is a residual MLP:
the input is projected to ``D`` features, the time (sinusoidal features) and class
(embedding table) are added as a conditioning vector inside every block, and a zero-initialized
output layer makes the untrained network predict zero velocity.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.flow.io import register_flow_model
from artifex.generative_models.utils.validation import check_int

__all__ = ["FlowModel", "FlowModelConfig", "check_class_labels", "timestep_features"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FlowModelConfig:
    """Shape of a :class:`FlowModel`.

    Attributes:
        image_shape: ``(H, W)`` or ``(H, W, C)`` of one image; the network sees it flattened.
        num_classes: Number of class prompts ``y in [0, num_classes)``.
        hidden_dim: Width ``D`` of the residual blocks.
        num_blocks: Number of residual blocks.
        time_features: Number of sinusoidal time features (even).

    Examples:
        >>> from artifex.generative_models.flow import FlowModelConfig
        >>> config = FlowModelConfig(image_shape=(8, 8), num_classes=10, hidden_dim=64)
        >>> config.data_dim, config.num_blocks
        (64, 3)
        >>> FlowModelConfig(time_features=7)
        Traceback (most recent call last):
            ...
        ValueError: FlowModelConfig.time_features must be even, got 7
    """

    image_shape: tuple[int, ...] = (8, 8)
    num_classes: int = 10
    hidden_dim: int = 256
    num_blocks: int = 3
    time_features: int = 32

    def __post_init__(self) -> None:
        shape = tuple(self.image_shape)
        if len(shape) not in (2, 3):
            msg = f"FlowModelConfig.image_shape must be (H, W) or (H, W, C), got {shape}"
            raise ValueError(msg)
        for i, s in enumerate(shape):
            check_int(f"FlowModelConfig.image_shape[{i}]", s, minimum=1)
        for name in ("num_classes", "hidden_dim", "num_blocks", "time_features"):
            check_int(f"FlowModelConfig.{name}", getattr(self, name), minimum=1)
        if self.time_features % 2:
            msg = f"FlowModelConfig.time_features must be even, got {self.time_features}"
            raise ValueError(msg)

    @property
    def data_dim(self) -> int:
        """Number of values in one image (``H * W * C``)."""
        return math.prod(self.image_shape)


def check_class_labels(labels: jax.Array, num_classes: int) -> None:
    """Raises ``ValueError`` for class labels outside ``[0, num_classes)`` (concrete arrays only).

    An embedding lookup would clamp them silently. Traced labels (inside ``jit``) are not
    checked; the samplers check theirs on the host.

    Args:
        labels: ``(B,)`` int labels.
        num_classes: The number of classes.

    Raises:
        TypeError: Labels that are not integers.
        ValueError: A label out of range, or labels that are not ``(B,)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.flow import check_class_labels
        >>> check_class_labels(jnp.array([0, 9]), 10)
        >>> check_class_labels(jnp.array([10]), 10)
        Traceback (most recent call last):
            ...
        ValueError: class labels must be in [0, 10), got 10 at row 0
    """
    if isinstance(labels, jax.core.Tracer):
        return
    host = np.asarray(labels)
    if not np.issubdtype(host.dtype, np.integer):
        msg = f"class labels must be integers, got dtype {host.dtype}"
        raise TypeError(msg)
    if host.ndim != 1:
        msg = f"class labels must have shape (B,), got {host.shape}"
        raise ValueError(msg)
    bad = np.flatnonzero((host < 0) | (host >= num_classes))
    if bad.size:
        msg = f"class labels must be in [0, {num_classes}), got {host[bad[0]]} at row {bad[0]}"
        raise ValueError(msg)


def timestep_features(t: jax.Array, num_features: int) -> jax.Array:
    r"""Sinusoidal features of times ``t in [0, 1]``.

    ``phi(t) = [sin(1000 t w_k), cos(1000 t w_k)]_k`` with ``w_k = 10000^{-k / (F/2)}``, the
    transformer position encoding applied to ``1000 t``.

    Args:
        t: ``(N,)`` times.
        num_features: ``F`` (even).

    Returns:
        ``(N, F)`` float32 features.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.flow import timestep_features
        >>> phi = timestep_features(jnp.array([0.0, 0.5]), 8)
        >>> phi.shape, phi[0].tolist()  # t = 0: sines 0, cosines 1
        ((2, 8), [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    """
    half = num_features // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = 1000.0 * jnp.asarray(t, jnp.float32)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class _Block(nnx.Module):
    """``h + W2 silu(W1 LN(h) + c)``: a pre-norm residual MLP block with additive conditioning."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.cond = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.fc2 = nnx.Linear(2 * dim, dim, rngs=rngs)

    def __call__(self, h: jax.Array, c: jax.Array) -> jax.Array:
        z = self.fc1(self.norm(h)) + self.cond(c)
        return h + self.fc2(nnx.silu(z))


@register_flow_model("flow_mlp", FlowModelConfig)
class FlowModel(nnx.Module):
    """Class-conditioned velocity field ``v_theta(x, t, y)`` for rectified flow on tiny images.

    Args:
        config: The network's shape.
        rngs: Initialization randomness.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig
        >>> model = FlowModel(FlowModelConfig(), rngs=nnx.Rngs(0))  # 8x8 images, 10 classes
        >>> x_t, t, labels = jnp.zeros((2, 64)), jnp.array([0.5, 0.9]), jnp.array([3, 7])
        >>> v = model(x_t, t, labels)
        >>> v.shape, float(jnp.abs(v).max())  # the output layer starts at zero
        ((2, 64), 0.0)
    """

    def __init__(self, config: FlowModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, FlowModelConfig):
            msg = f"config must be a FlowModelConfig, got {type(config).__name__}"
            raise TypeError(msg)
        self.config = config
        d = config.hidden_dim
        self.input = nnx.Linear(config.data_dim, d, rngs=rngs)
        self.time = nnx.Linear(config.time_features, d, rngs=rngs)
        self.label = nnx.Embed(config.num_classes, d, rngs=rngs)
        self.blocks = nnx.List([_Block(d, rngs=rngs) for _ in range(config.num_blocks)])
        self.out_norm = nnx.LayerNorm(d, rngs=rngs)
        self.output = nnx.Linear(
            d, config.data_dim, kernel_init=nnx.initializers.zeros_init(), rngs=rngs
        )

    def __call__(self, x: jax.Array, t: jax.Array, labels: jax.Array) -> jax.Array:
        """Velocity at flattened images ``x`` ``(B, data_dim)``, times ``t`` ``(B,)``.

        Args:
            x: ``(B, data_dim)`` noisy images (flattened).
            t: ``(B,)`` times in ``[0, 1]`` (1 = pure noise).
            labels: ``(B,)`` int class prompts.

        Returns:
            ``(B, data_dim)`` float32 velocities ``dx/dt``.

        Raises:
            ValueError: Concrete labels out of ``[0, num_classes)``.
        """
        check_class_labels(labels, self.config.num_classes)
        c = nnx.silu(
            self.time(timestep_features(t, self.config.time_features))
            + self.label(jnp.asarray(labels, jnp.int32))
        )
        h = self.input(jnp.asarray(x, jnp.float32))
        for block in self.blocks:
            h = block(h, c)
        return self.output(nnx.silu(self.out_norm(h)))
