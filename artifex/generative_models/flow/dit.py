r"""A small class-conditioned diffusion transformer (DiT) velocity network for flow matching.

The image (flattened, as the flow sampler and trainer pass it) is cut into ``p x p`` patches;
each patch is linearly embedded to ``D`` features and a fixed 2-D sine-cosine position
embedding is added, giving ``T = (H / p) (W / p)`` tokens (16 for an 8x8 digit with
``p = 2``). The conditioning vector is the sum of an MLP of the sinusoidal time features and a
class embedding, ``c = MLP(phi(t)) + E[y]``. Every transformer block is pre-norm multi-head
self-attention and an MLP, each modulated by adaLN-Zero:

    ``h <- h + g_1 * Attn(LN(h) (1 + s_1) + b_1)``,
    ``h <- h + g_2 * MLP(LN(h) (1 + s_2) + b_2)``,

where ``(b_1, s_1, g_1, b_2, s_2, g_2) = W silu(c) + w`` is a zero-initialized linear map of
the conditioning, so every block starts as the identity. A final adaptive LayerNorm and a
zero-initialized linear layer map each token back to its ``p x p`` patch of velocity, so the
untrained network predicts zero velocity.

The call is the one the flow sampler, the log-prob hook, the Flow-GRPO objective and
``train_flow_matching`` use: ``model(x, t, labels)`` with ``x`` ``(B, H * W * C)``.

References:
    Peebles and Xie, 2023, "Scalable Diffusion Models with Transformers" (DiT, adaLN-Zero),
    arXiv:2212.09748; Vaswani et al., 2017, "Attention Is All You Need", arXiv:1706.03762.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from artifex.generative_models.flow.io import register_flow_model
from artifex.generative_models.flow.model import check_class_labels, timestep_features
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "FlowDiT",
    "FlowDiTConfig",
    "patchify",
    "sincos_position_embeddings",
    "unpatchify",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FlowDiTConfig:
    """Shape of a :class:`FlowDiT`.

    Attributes:
        image_shape: ``(H, W)`` or ``(H, W, C)`` of one image; ``H`` and ``W`` divisible by
            ``patch_size``. The network takes and returns it flattened.
        num_classes: Number of class prompts ``y in [0, num_classes)``.
        patch_size: Side ``p`` of the square patches (one token each).
        hidden_dim: Token width ``D`` (a multiple of ``4`` and of ``num_heads``).
        num_blocks: Transformer blocks.
        num_heads: Attention heads ``N`` (head width ``D / N``).
        mlp_ratio: Hidden width of each block's MLP, in multiples of ``D``.
        time_features: Number of sinusoidal time features (even) fed to the time MLP.

    Examples:
        >>> from artifex.generative_models.flow import FlowDiTConfig
        >>> FlowDiTConfig(image_shape=(8, 8), patch_size=2).num_tokens
        16
    """

    image_shape: tuple[int, ...] = (8, 8)
    num_classes: int = 10
    patch_size: int = 2
    hidden_dim: int = 64
    num_blocks: int = 3
    num_heads: int = 4
    mlp_ratio: int = 2
    time_features: int = 64

    def __post_init__(self) -> None:
        shape = tuple(self.image_shape)
        if len(shape) not in (2, 3):
            msg = f"FlowDiTConfig.image_shape must be (H, W) or (H, W, C), got {shape}"
            raise ValueError(msg)
        for i, s in enumerate(shape):
            check_int(f"FlowDiTConfig.image_shape[{i}]", s, minimum=1)
        for name in (
            "num_classes",
            "patch_size",
            "hidden_dim",
            "num_blocks",
            "num_heads",
            "mlp_ratio",
            "time_features",
        ):
            check_int(f"FlowDiTConfig.{name}", getattr(self, name), minimum=1)
        p = self.patch_size
        if shape[0] % p or shape[1] % p:
            msg = f"FlowDiTConfig.image_shape {shape} must have H and W divisible by patch_size {p}"
            raise ValueError(msg)
        if self.hidden_dim % 4 or self.hidden_dim % self.num_heads:
            msg = (
                f"FlowDiTConfig.hidden_dim must be a multiple of 4 and of num_heads "
                f"({self.num_heads}), got {self.hidden_dim}"
            )
            raise ValueError(msg)
        if self.time_features % 2:
            msg = f"FlowDiTConfig.time_features must be even, got {self.time_features}"
            raise ValueError(msg)

    @property
    def data_dim(self) -> int:
        """Number of values in one image (``H * W * C``)."""
        return math.prod(self.image_shape)

    @property
    def channels(self) -> int:
        """``C`` (1 for ``(H, W)`` images)."""
        return self.image_shape[2] if len(self.image_shape) == 3 else 1

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per column and per row, ``(H / p, W / p)``."""
        return self.image_shape[0] // self.patch_size, self.image_shape[1] // self.patch_size

    @property
    def num_tokens(self) -> int:
        """``T = (H / p) (W / p)``."""
        return self.grid[0] * self.grid[1]

    @property
    def patch_dim(self) -> int:
        """Values in one patch, ``p * p * C``."""
        return self.patch_size * self.patch_size * self.channels


def sincos_position_embeddings(grid_h: int, grid_w: int, dim: int) -> jax.Array:
    r"""Fixed 2-D sine-cosine position embeddings of a ``grid_h x grid_w`` grid of tokens.

    Token ``(i, j)`` (row-major index ``i * grid_w + j``) gets ``[e(i), e(j)]``, with
    ``e(u) = [sin(u w_k), cos(u w_k)]_{k < dim / 4}`` and ``w_k = 10000^{-k / (dim / 4)}``:
    the first half of the features encodes the row, the second half the column.

    Args:
        grid_h: Rows of tokens.
        grid_w: Columns of tokens.
        dim: Feature width (a multiple of 4).

    Returns:
        ``(grid_h * grid_w, dim)`` float32 embeddings.

    Raises:
        ValueError: ``dim`` is not a multiple of 4.

    Examples:
        >>> from artifex.generative_models.flow import sincos_position_embeddings
        >>> sincos_position_embeddings(4, 4, 64).shape
        (16, 64)
    """
    if dim % 4:
        msg = f"sincos_position_embeddings: dim must be a multiple of 4, got {dim}"
        raise ValueError(msg)
    quarter = dim // 4
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(quarter, dtype=jnp.float32) / quarter)

    def encode(u: jax.Array) -> jax.Array:
        angles = u[:, None] * freqs[None, :]
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)

    rows, cols = jnp.meshgrid(
        jnp.arange(grid_h, dtype=jnp.float32), jnp.arange(grid_w, dtype=jnp.float32), indexing="ij"
    )
    return jnp.concatenate([encode(rows.reshape(-1)), encode(cols.reshape(-1))], axis=-1)


def patchify(x: jax.Array, image_shape: tuple[int, ...], patch_size: int) -> jax.Array:
    """Cuts flattened images into row-major ``p x p`` patches.

    Args:
        x: ``(B, H * W * C)`` flattened images.
        image_shape: ``(H, W)`` or ``(H, W, C)``.
        patch_size: ``p`` (divides ``H`` and ``W``).

    Returns:
        ``(B, (H / p) (W / p), p * p * C)`` patches; patch ``(i, j)`` is row ``i * W / p + j``,
        its values ordered ``(row in patch, column in patch, channel)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.flow import patchify
        >>> patchify(jnp.zeros((5, 64)), (8, 8), 2).shape
        (5, 16, 4)
    """
    h, w = image_shape[0], image_shape[1]
    c = image_shape[2] if len(image_shape) == 3 else 1
    p = patch_size
    b = x.shape[0]
    x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(tokens: jax.Array, image_shape: tuple[int, ...], patch_size: int) -> jax.Array:
    """Inverse of :func:`patchify`: patches back to flattened images.

    Args:
        tokens: ``(B, (H / p) (W / p), p * p * C)`` patches.
        image_shape: ``(H, W)`` or ``(H, W, C)``.
        patch_size: ``p``.

    Returns:
        ``(B, H * W * C)`` flattened images.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.flow import unpatchify
        >>> unpatchify(jnp.zeros((5, 16, 4)), (8, 8), 2).shape
        (5, 64)
    """
    h, w = image_shape[0], image_shape[1]
    c = image_shape[2] if len(image_shape) == 3 else 1
    p = patch_size
    b = tokens.shape[0]
    x = tokens.reshape(b, h // p, w // p, p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h * w * c)


def _modulate(h: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """``h (1 + scale) + shift`` with per-example ``(B, D)`` shift and scale on ``(B, T, D)``."""
    return h * (1.0 + scale[:, None, :]) + shift[:, None, :]


def _zeros_linear(d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        kernel_init=nnx.initializers.zeros_init(),
        bias_init=nnx.initializers.zeros_init(),
        rngs=rngs,
    )


class _SelfAttention(nnx.Module):
    """Multi-head self-attention over the tokens (B batch, T/S token, N head, H head dim)."""

    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.out = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        b, t, d = h.shape
        n = self.num_heads
        qkv = self.qkv(h).reshape(b, t, 3, n, d // n)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(d // n)
        weights = jax.nn.softmax(logits, axis=-1)
        mixed = jnp.einsum("BNTS,BSNH->BTNH", weights, v)
        return self.out(mixed.reshape(b, t, d))


class _DiTBlock(nnx.Module):
    """Self-attention and MLP, each with adaLN-Zero modulation by the conditioning ``c``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, epsilon=1e-6, use_scale=False, use_bias=False, rngs=rngs)
        self.attn = _SelfAttention(dim, num_heads, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, epsilon=1e-6, use_scale=False, use_bias=False, rngs=rngs)
        self.fc1 = nnx.Linear(dim, mlp_ratio * dim, rngs=rngs)
        self.fc2 = nnx.Linear(mlp_ratio * dim, dim, rngs=rngs)
        self.modulation = _zeros_linear(dim, 6 * dim, rngs)

    def __call__(self, h: jax.Array, c: jax.Array) -> jax.Array:
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(
            self.modulation(nnx.silu(c)), 6, axis=-1
        )
        h = h + gate1[:, None, :] * self.attn(_modulate(self.norm1(h), shift1, scale1))
        z = self.fc2(nnx.gelu(self.fc1(_modulate(self.norm2(h), shift2, scale2))))
        return h + gate2[:, None, :] * z


@register_flow_model("flow_dit", FlowDiTConfig)
class FlowDiT(nnx.Module):
    """Class-conditioned DiT velocity field ``v_theta(x, t, y)`` for rectified flow.

    Patch embedding, fixed 2-D sine-cosine positions, ``num_blocks`` adaLN-Zero transformer
    blocks conditioned on ``MLP(phi(t)) + E[y]``, a final adaptive LayerNorm and a linear
    unpatchify (Peebles and Xie, 2023, arXiv:2212.09748). The modulation maps and the output
    layer start at zero, so the untrained network predicts zero velocity. A drop-in for
    :class:`~artifex.generative_models.flow.model.FlowModel`: same call, same
    ``config.data_dim``.

    Args:
        config: The network's shape.
        rngs: Initialization randomness.

    Raises:
        TypeError: ``config`` is not a :class:`FlowDiTConfig`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowDiT, FlowDiTConfig
        >>> model = FlowDiT(FlowDiTConfig(hidden_dim=32, num_blocks=1), rngs=nnx.Rngs(0))
        >>> x_t, t, labels = jnp.ones((3, 64)), jnp.full((3,), 0.5), jnp.array([0, 1, 2])
        >>> v = model(x_t, t, labels)  # the untrained network predicts zero velocity
        >>> v.shape, float(jnp.abs(v).max())
        ((3, 64), 0.0)
    """

    def __init__(self, config: FlowDiTConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, FlowDiTConfig):
            msg = f"config must be a FlowDiTConfig, got {type(config).__name__}"
            raise TypeError(msg)
        self.config = config
        d = config.hidden_dim
        self.patch_embed = nnx.Linear(config.patch_dim, d, rngs=rngs)
        self.time_in = nnx.Linear(config.time_features, d, rngs=rngs)
        self.time_out = nnx.Linear(d, d, rngs=rngs)
        self.label = nnx.Embed(config.num_classes, d, rngs=rngs)
        self.blocks = nnx.List(
            [
                _DiTBlock(d, config.num_heads, config.mlp_ratio, rngs=rngs)
                for _ in range(config.num_blocks)
            ]
        )
        self.final_norm = nnx.LayerNorm(d, epsilon=1e-6, use_scale=False, use_bias=False, rngs=rngs)
        self.final_modulation = _zeros_linear(d, 2 * d, rngs)
        self.output = _zeros_linear(d, config.patch_dim, rngs)

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
        cfg = self.config
        phi = timestep_features(t, cfg.time_features)
        c = self.time_out(nnx.silu(self.time_in(phi))) + self.label(jnp.asarray(labels, jnp.int32))
        tokens = patchify(jnp.asarray(x, jnp.float32), cfg.image_shape, cfg.patch_size)
        h = self.patch_embed(tokens) + sincos_position_embeddings(*cfg.grid, cfg.hidden_dim)
        for block in self.blocks:
            h = block(h, c)
        shift, scale = jnp.split(self.final_modulation(nnx.silu(c)), 2, axis=-1)
        out = self.output(_modulate(self.final_norm(h), shift, scale))
        return unpatchify(out, cfg.image_shape, cfg.patch_size)
