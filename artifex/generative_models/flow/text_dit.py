r"""A text-conditioned diffusion transformer (DiT) velocity network for flow matching.

The prompt is a row of ``L`` token ids (id 0 pads). A small text encoder embeds the tokens,
adds learned position embeddings and runs ``text_layers`` pre-norm transformer layers with
padding masked out, giving text tokens ``e_1..e_L``. The image is cut into ``p x p`` patches as
in :class:`~artifex.generative_models.flow.dit.FlowDiT`. Every block conditions on the
text twice:

- **adaLN-Zero** on ``c = MLP(phi(t)) + W mean_l(e_l)`` (time and the pooled prompt), as the
  class-conditioned DiT does with a class embedding;
- **cross-attention** from the image tokens to the text tokens (queries from the image,
  keys and values from the text, padding masked), whose output projection starts at zero:

    ``h <- h + g_1 * SelfAttn(LN(h) (1 + s_1) + b_1)``,
    ``h <- h + CrossAttn(LN(h), e)``,
    ``h <- h + g_2 * MLP(LN(h) (1 + s_2) + b_2)``.

Cross-attention lets each image region read the words that concern it (which shape goes
left, which colour above), the binding a compositional caption needs. The call is the flow
models' ``model(x, t, tokens)`` with ``x`` ``(B, H * W * C)`` and ``tokens`` ``(B, L)``.

References:
    Peebles and Xie, 2023, "Scalable Diffusion Models with Transformers", arXiv:2212.09748;
    Chen et al., 2023, "PixArt-alpha" (cross-attention DiT), arXiv:2310.00426.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.flow.dit import (
    _modulate,
    _SelfAttention,
    _zeros_linear,
    patchify,
    sincos_position_embeddings,
    unpatchify,
)
from artifex.generative_models.flow.io import register_flow_model
from artifex.generative_models.flow.model import timestep_features
from artifex.generative_models.flow.shapes import SHAPES_VOCABULARY, WordTokenizer
from artifex.generative_models.utils.validation import check_int

__all__ = ["TextFlowDiT", "TextFlowDiTConfig", "check_token_ids"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TextFlowDiTConfig:
    """Shape of a :class:`TextFlowDiT`.

    Attributes:
        image_shape: ``(H, W, C)`` or ``(H, W)``; ``H`` and ``W`` divisible by ``patch_size``.
        vocabulary: The prompt words; the first is the padding token (id 0).
        max_prompt_length: ``L``, token ids per prompt.
        patch_size: Side ``p`` of the square patches.
        hidden_dim: Token width ``D`` (a multiple of 4 and of ``num_heads``).
        num_blocks: Transformer blocks of the image.
        num_heads: Attention heads.
        mlp_ratio: MLP width in multiples of ``D``.
        time_features: Sinusoidal time features (even).
        text_layers: Transformer layers of the text encoder.

    Raises:
        TypeError: A field of the wrong type.
        ValueError: A field out of range or inconsistent with another.

    Examples:
        >>> from artifex.generative_models.flow import TextFlowDiTConfig
        >>> cfg = TextFlowDiTConfig()
        >>> cfg.num_tokens, cfg.vocab_size, cfg.data_dim
        (64, 20, 3072)
    """

    image_shape: tuple[int, ...] = (32, 32, 3)
    vocabulary: tuple[str, ...] = SHAPES_VOCABULARY
    max_prompt_length: int = 8
    patch_size: int = 4
    hidden_dim: int = 96
    num_blocks: int = 3
    num_heads: int = 4
    mlp_ratio: int = 2
    time_features: int = 64
    text_layers: int = 1

    def __post_init__(self) -> None:
        shape = tuple(self.image_shape)
        if len(shape) not in (2, 3):
            msg = f"TextFlowDiTConfig.image_shape must be (H, W) or (H, W, C), got {shape}"
            raise ValueError(msg)
        for i, s in enumerate(shape):
            check_int(f"TextFlowDiTConfig.image_shape[{i}]", s, minimum=1)
        for name in (
            "max_prompt_length",
            "patch_size",
            "hidden_dim",
            "num_blocks",
            "num_heads",
            "mlp_ratio",
            "time_features",
        ):
            check_int(f"TextFlowDiTConfig.{name}", getattr(self, name), minimum=1)
        check_int("TextFlowDiTConfig.text_layers", self.text_layers, minimum=0)
        WordTokenizer(self.vocabulary, self.max_prompt_length)  # validates the vocabulary
        p = self.patch_size
        if shape[0] % p or shape[1] % p:
            msg = f"TextFlowDiTConfig.image_shape {shape} must have H and W divisible by {p}"
            raise ValueError(msg)
        if self.hidden_dim % 4 or self.hidden_dim % self.num_heads:
            msg = (
                f"TextFlowDiTConfig.hidden_dim must be a multiple of 4 and of num_heads "
                f"({self.num_heads}), got {self.hidden_dim}"
            )
            raise ValueError(msg)
        if self.time_features % 2:
            msg = f"TextFlowDiTConfig.time_features must be even, got {self.time_features}"
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
        """Patches per column and per row."""
        return self.image_shape[0] // self.patch_size, self.image_shape[1] // self.patch_size

    @property
    def num_tokens(self) -> int:
        """Image tokens ``(H / p) (W / p)``."""
        return self.grid[0] * self.grid[1]

    @property
    def patch_dim(self) -> int:
        """Values in one patch, ``p * p * C``."""
        return self.patch_size * self.patch_size * self.channels

    @property
    def vocab_size(self) -> int:
        """Number of prompt words (padding included)."""
        return len(self.vocabulary)

    def tokenizer(self) -> WordTokenizer:
        """The :class:`~artifex.generative_models.flow.shapes.WordTokenizer` of the prompts.

        Returns:
            A tokenizer over ``vocabulary`` with ``max_prompt_length`` ids per prompt.
        """
        return WordTokenizer(self.vocabulary, self.max_prompt_length)


def check_token_ids(tokens: jax.Array, vocab_size: int, length: int) -> None:
    """Raises for token ids that are not ``(B, length)`` integers in ``[0, vocab_size)``.

    Traced arrays (inside ``jit``) are not checked; the samplers check theirs on the host.

    Args:
        tokens: The prompts.
        vocab_size: The vocabulary size.
        length: Ids per prompt.

    Raises:
        TypeError: Ids that are not integers.
        ValueError: Wrong shape, or an id out of range.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.flow import check_token_ids
        >>> check_token_ids(jnp.array([[1, 2, 0]]), 5, 3)
        >>> check_token_ids(jnp.array([[1, 7, 0]]), 5, 3)
        Traceback (most recent call last):
            ...
        ValueError: token ids must be in [0, 5), got 7 at row 0
    """
    if isinstance(tokens, jax.core.Tracer):
        return
    host = np.asarray(tokens)
    if not np.issubdtype(host.dtype, np.integer):
        msg = f"token ids must be integers, got dtype {host.dtype}"
        raise TypeError(msg)
    if host.ndim != 2 or host.shape[1] != length:
        msg = f"token ids must have shape (B, {length}), got {host.shape}"
        raise ValueError(msg)
    bad = np.argwhere((host < 0) | (host >= vocab_size))
    if bad.size:
        msg = (
            f"token ids must be in [0, {vocab_size}), got {host[tuple(bad[0])]} at row {bad[0][0]}"
        )
        raise ValueError(msg)


class _Attention(nnx.Module):
    """Multi-head attention of queries ``(B, T, D)`` over keys/values ``(B, S, D)`` with a mask."""

    def __init__(self, dim: int, num_heads: int, *, zero_out: bool, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.q = nnx.Linear(dim, dim, rngs=rngs)
        self.kv = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.out = _zeros_linear(dim, dim, rngs) if zero_out else nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, h: jax.Array, context: jax.Array, mask: jax.Array) -> jax.Array:
        b, t, d = h.shape
        s = context.shape[1]
        n = self.num_heads
        q = self.q(h).reshape(b, t, n, d // n)
        kv = self.kv(context).reshape(b, s, 2, n, d // n)
        k, v = kv[:, :, 0], kv[:, :, 1]
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(d // n)
        logits = jnp.where(mask[:, None, None, :], logits, -1e9)
        weights = jax.nn.softmax(logits, axis=-1)
        return self.out(jnp.einsum("BNTS,BSNH->BTNH", weights, v).reshape(b, t, d))


class _TextLayer(nnx.Module):
    """A pre-norm transformer encoder layer over the prompt tokens (padding masked)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = _Attention(dim, num_heads, zero_out=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, mlp_ratio * dim, rngs=rngs)
        self.fc2 = nnx.Linear(mlp_ratio * dim, dim, rngs=rngs)

    def __call__(self, e: jax.Array, mask: jax.Array) -> jax.Array:
        z = self.norm1(e)
        e = e + self.attn(z, z, mask)
        return e + self.fc2(nnx.gelu(self.fc1(self.norm2(e))))


class _TextDiTBlock(nnx.Module):
    """Self-attention (adaLN-Zero), cross-attention to the text, MLP (adaLN-Zero)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
        ln = dict(epsilon=1e-6, use_scale=False, use_bias=False, rngs=rngs)
        self.norm1 = nnx.LayerNorm(dim, **ln)
        self.attn = _SelfAttention(dim, num_heads, rngs=rngs)
        self.norm_cross = nnx.LayerNorm(dim, rngs=rngs)
        self.cross = _Attention(dim, num_heads, zero_out=True, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, **ln)
        self.fc1 = nnx.Linear(dim, mlp_ratio * dim, rngs=rngs)
        self.fc2 = nnx.Linear(mlp_ratio * dim, dim, rngs=rngs)
        self.modulation = _zeros_linear(dim, 6 * dim, rngs)

    def __call__(self, h: jax.Array, c: jax.Array, text: jax.Array, mask: jax.Array):
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(
            self.modulation(nnx.silu(c)), 6, axis=-1
        )
        h = h + gate1[:, None, :] * self.attn(_modulate(self.norm1(h), shift1, scale1))
        h = h + self.cross(self.norm_cross(h), text, mask)
        z = self.fc2(nnx.gelu(self.fc1(_modulate(self.norm2(h), shift2, scale2))))
        return h + gate2[:, None, :] * z


@register_flow_model("flow_text_dit", TextFlowDiTConfig)
class TextFlowDiT(nnx.Module):
    """Text-conditioned DiT velocity field ``v_theta(x, t, prompt)`` for rectified flow.

    A text encoder (token and position embeddings, ``text_layers`` transformer layers) feeds
    every block through cross-attention and, pooled, through adaLN-Zero with the time. The
    modulations, the cross-attention outputs and the output layer start at zero, so the untrained
    network predicts zero velocity. Same call as the class-conditioned models, with ``(B, L)``
    token ids in place of labels, so the flow sampler, the GRPO log-prob hook and
    ``train_flow_matching`` take it unchanged.

    Args:
        config: The network's shape.
        rngs: Initialization randomness.

    Raises:
        TypeError: ``config`` is not a :class:`TextFlowDiTConfig`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import TextFlowDiT, TextFlowDiTConfig
        >>> model = TextFlowDiT(TextFlowDiTConfig(hidden_dim=32, num_blocks=1), rngs=nnx.Rngs(0))
        >>> tokens = model.config.tokenizer().encode(["two red squares left of a blue circle"])
        >>> v = model(jnp.zeros((1, 3072)), jnp.array([0.5]), tokens)
        >>> v.shape, float(jnp.abs(v).max())  # zero at initialization
        ((1, 3072), 0.0)
    """

    def __init__(self, config: TextFlowDiTConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, TextFlowDiTConfig):
            msg = f"config must be a TextFlowDiTConfig, got {type(config).__name__}"
            raise TypeError(msg)
        self.config = config
        d = config.hidden_dim
        self.word = nnx.Embed(config.vocab_size, d, rngs=rngs)
        self.word_position = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (config.max_prompt_length, d))
        )
        self.text_layers = nnx.List(
            [
                _TextLayer(d, config.num_heads, config.mlp_ratio, rngs=rngs)
                for _ in range(config.text_layers)
            ]
        )
        self.text_norm = nnx.LayerNorm(d, rngs=rngs)
        self.pooled = nnx.Linear(d, d, rngs=rngs)
        self.patch_embed = nnx.Linear(config.patch_dim, d, rngs=rngs)
        self.time_in = nnx.Linear(config.time_features, d, rngs=rngs)
        self.time_out = nnx.Linear(d, d, rngs=rngs)
        self.blocks = nnx.List(
            [
                _TextDiTBlock(d, config.num_heads, config.mlp_ratio, rngs=rngs)
                for _ in range(config.num_blocks)
            ]
        )
        self.final_norm = nnx.LayerNorm(d, epsilon=1e-6, use_scale=False, use_bias=False, rngs=rngs)
        self.final_modulation = _zeros_linear(d, 2 * d, rngs)
        self.output = _zeros_linear(d, config.patch_dim, rngs)

    def encode_text(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Text tokens ``(B, L, D)`` and the padding mask ``(B, L)`` of prompts.

        Args:
            tokens: ``(B, L)`` token ids (0 pads).

        Returns:
            ``(text, mask)``.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        mask = tokens != 0
        e = self.word(tokens) + self.word_position[...][None]
        for layer in self.text_layers:
            e = layer(e, mask)
        return self.text_norm(e), mask

    def __call__(self, x: jax.Array, t: jax.Array, tokens: jax.Array) -> jax.Array:
        """Velocity at flattened images ``x`` ``(B, data_dim)``, times ``t`` ``(B,)``.

        Args:
            x: ``(B, data_dim)`` noisy images (flattened).
            t: ``(B,)`` times in ``[0, 1]`` (1 = pure noise).
            tokens: ``(B, L)`` prompt token ids.

        Returns:
            ``(B, data_dim)`` float32 velocities ``dx/dt``.

        Raises:
            ValueError: Concrete token ids out of ``[0, vocab_size)`` or not ``(B, L)``.
        """
        cfg = self.config
        check_token_ids(tokens, cfg.vocab_size, cfg.max_prompt_length)
        text, mask = self.encode_text(tokens)
        weights = mask.astype(jnp.float32)[..., None]
        pooled = jnp.sum(text * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
        phi = timestep_features(t, cfg.time_features)
        c = self.time_out(nnx.silu(self.time_in(phi))) + self.pooled(pooled)
        patches = patchify(jnp.asarray(x, jnp.float32), cfg.image_shape, cfg.patch_size)
        h = self.patch_embed(patches) + sincos_position_embeddings(*cfg.grid, cfg.hidden_dim)
        for block in self.blocks:
            h = block(h, c, text, mask)
        shift, scale = jnp.split(self.final_modulation(nnx.silu(c)), 2, axis=-1)
        out = self.output(_modulate(self.final_norm(h), shift, scale))
        return unpatchify(out, cfg.image_shape, cfg.patch_size)
