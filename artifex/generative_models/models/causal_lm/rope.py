"""Rotary position embeddings (RoPE), rotate-half convention as in Hugging Face transformers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.models.causal_lm.config import RopeScaling

__all__ = ["apply_rope", "rope_cos_sin", "rope_inv_frequencies"]


def rope_inv_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> np.ndarray:
    """Inverse frequencies `f_i = theta^(-2i/H)`, optionally with Llama 3.1 or linear scaling.

    Computed in float32 with the same operations as transformers
    (`_compute_default_rope_parameters` / `_compute_llama3_parameters` /
    `_compute_linear_scaling_rope_parameters`), so the frequencies agree bit for bit up to the
    platform's `pow`. Linear scaling divides every frequency by `factor`.

    Args:
        head_dim: Head width H (even).
        theta: RoPE base.
        scaling: Optional `RopeScaling` (rope_type "llama3" or "linear").

    Returns:
        A float32 NumPy array of shape (H/2,).

    Examples:
        >>> from artifex.generative_models.models.causal_lm import rope_inv_frequencies
        >>> [round(float(f), 6) for f in rope_inv_frequencies(8, 10000.0)]  # theta^(-2i/H)
        [1.0, 0.1, 0.01, 0.001]

    References:
        Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021;
        Meta, "The Llama 3 Herd of Models", 2024.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    factor = np.float32(scaling.factor)
    if scaling.rope_type == "linear":
        return (inv_freq / factor).astype(np.float32)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)).astype(
        np.float32
    )
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(
    positions: jax.Array, inv_freq: jax.Array | np.ndarray, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """Cosines and sines of the rotation angles `theta_{t,i} = p_t f_i`.

    The angles are computed in float32 and the results cast to the compute dtype, as
    transformers does.

    Args:
        positions: Integer positions (B, T).
        inv_freq: Inverse frequencies (H/2,).
        dtype: Dtype of the returned arrays.

    Returns:
        `(cos, sin)`, each (B, T, H/2).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import (
        ...     rope_cos_sin, rope_inv_frequencies)
        >>> cos, sin = rope_cos_sin(jnp.array([[0, 1]]), rope_inv_frequencies(4, 10000.0),
        ...                         jnp.float32)
        >>> cos.shape, cos[0, 0].tolist(), sin[0, 0].tolist()  # position 0: no rotation
        ((1, 2, 2), [1.0, 1.0], [0.0, 0.0])
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the two halves of each head: `[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]`.

    This is transformers' `x * cos + rotate_half(x) * sin` with `cos = cat(c, c)`,
    `sin = cat(s, s)`, without building the concatenated tables.

    Args:
        x: Queries or keys (B, T, N, H).
        cos: Cosines (B, T, H/2).
        sin: Sines (B, T, H/2).

    Returns:
        The rotated array, same shape and dtype as `x`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import (
        ...     apply_rope, rope_cos_sin, rope_inv_frequencies)
        >>> x = jax.random.normal(jax.random.key(0), (1, 3, 2, 4))  # (B, T, N, H)
        >>> cos, sin = rope_cos_sin(jnp.array([[0, 1, 2]]), rope_inv_frequencies(4, 10000.0),
        ...                         jnp.float32)
        >>> y = apply_rope(x, cos, sin)
        >>> bool(jnp.allclose(y[:, 0], x[:, 0]))  # position 0 is unchanged
        True
        >>> norm = lambda a: jnp.linalg.norm(a, axis=-1)
        >>> bool(jnp.allclose(norm(y), norm(x)))  # a rotation keeps lengths
        True
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
