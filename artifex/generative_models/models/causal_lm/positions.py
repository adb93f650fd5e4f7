"""Positions of left-padded rows, and the RoPE tables `CausalLM` looks positions up in.

`positions_from_mask` numbers each row's tokens in the Hugging Face convention. When the model
derives the positions itself (below a known bound), it reads the rotary cosines and sines from
a table of positions `[0, bound)` computed once per trace (`_rope_tables`) instead of
evaluating them inside every layer.

Moved out of :mod:`~artifex.generative_models.models.causal_lm.model` unchanged; it still
imports these names, so they stay importable from there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.models.causal_lm.config import RopeScaling
from artifex.generative_models.models.causal_lm.rope import rope_cos_sin, rope_inv_frequencies

__all__ = ["positions_from_mask"]


def positions_from_mask(attention_mask: jax.Array, offset: jax.Array | int = 0) -> jax.Array:
    """Positions of left-padded rows: `p_t = offset + cumsum(mask)_t - 1`, clipped at 0.

    This is the Hugging Face convention: the first real token of each row gets position
    `offset` whatever the amount of left padding; padding gets position 0 (or the position of the
    last real token before it).

    Args:
        attention_mask: (B, T), 1 on real tokens, 0 on padding.
        offset: (B,) or scalar number of real tokens already seen (e.g. in a KV cache).

    Returns:
        int32 positions (B, T).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import positions_from_mask
        >>> positions_from_mask(jnp.array([[0, 0, 1, 1], [1, 1, 1, 1]])).tolist()
        [[0, 0, 0, 1], [0, 1, 2, 3]]
        >>> positions_from_mask(jnp.array([[1, 1]]), offset=3).tolist()
        [[3, 4]]
    """
    mask = attention_mask.astype(jnp.int32)
    offset = jnp.asarray(offset, jnp.int32)
    if offset.ndim == 1:
        offset = offset[:, None]
    return jnp.maximum(offset + jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)


@functools.lru_cache(maxsize=32)
def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    return rope_inv_frequencies(head_dim, theta, scaling)


_ROPE_TABLE_MAX_ENTRIES = 1 << 18  # positions x H/2; above it the angles are computed in place


def _rope_tables(
    positions: jax.Array, inv_freq: np.ndarray, dtype: jnp.dtype, bound: int | None
) -> tuple[jax.Array, jax.Array]:
    """``rope_cos_sin(positions, ...)``, looked up in a table of positions ``[0, bound)``.

    Computed in place, XLA fuses the cosines and sines into every layer's query and key
    rotation (forward and backward) and evaluates them there again, per head and per use. The
    table is computed once, when the program is traced, by the same XLA operations, so the
    values are the same. ``bound`` is None when the positions come from the caller (any
    value): then they are computed in place.
    """
    if bound is None or bound * inv_freq.shape[0] > _ROPE_TABLE_MAX_ENTRIES:
        return rope_cos_sin(positions, inv_freq, dtype)
    table_cos, table_sin = _rope_table(bound, inv_freq.tobytes(), jnp.dtype(dtype).name)
    # An out-of-range position would read NaN ("fill"), never another position's angles.
    cos = jnp.take(table_cos, positions, axis=0, mode="fill")
    sin = jnp.take(table_sin, positions, axis=0, mode="fill")
    return cos, sin


@functools.lru_cache(maxsize=64)
def _rope_table(bound: int, inv_freq: bytes, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The cosines and sines of positions ``[0, bound)``: (bound, H/2) host arrays."""
    freqs = np.frombuffer(inv_freq, np.float32)
    # Evaluated now, by XLA, even inside a trace: compiled as one program and called with
    # host arrays (under `ensure_compile_time_eval` each of its operations would be compiled
    # and run alone, five programs); its own small transfer to the host.
    with jax.transfer_guard("allow"):
        cos, sin = _rope_table_program.lower(bound, freqs, dtype).compile()(freqs)
        return np.asarray(cos), np.asarray(sin)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _rope_table_program(bound: int, inv_freq: jax.Array, dtype: str) -> tuple[jax.Array, jax.Array]:
    cos, sin = rope_cos_sin(jnp.arange(bound, dtype=jnp.int32)[None], inv_freq, jnp.dtype(dtype))
    return cos[0], sin[0]
