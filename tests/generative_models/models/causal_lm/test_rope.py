"""Tests for artifex/generative_models/models/causal_lm/rope.py."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.models.causal_lm import (
    RopeScaling,
    apply_rope,
    rope_cos_sin,
    rope_inv_frequencies,
)


def _np_llama3(head_dim, theta, factor, low, high, old_len):
    """Float64 transcription of the Llama 3.1 reference (meta-llama `apply_scaling`)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


@pytest.mark.parametrize("head_dim", [8, 16, 64, 128])
def test_default_frequencies(head_dim):
    got = rope_inv_frequencies(head_dim, 10000.0)
    want = 1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    ("head_dim", "theta", "factor", "low", "high", "old_len"),
    [
        (128, 500000.0, 8.0, 1.0, 4.0, 8192),
        (64, 500000.0, 32.0, 1.0, 4.0, 8192),
        (16, 1e4, 4.0, 1.0, 8.0, 64),
    ],
)
def test_llama3_frequencies(head_dim, theta, factor, low, high, old_len):
    scaling = RopeScaling(
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=old_len,
    )
    got = rope_inv_frequencies(head_dim, theta, scaling)
    want = _np_llama3(head_dim, theta, factor, low, high, old_len)
    np.testing.assert_allclose(got, want, rtol=2e-6)


def test_llama3_frequencies_cover_three_regimes():
    scaling = RopeScaling(
        factor=4.0, low_freq_factor=1.0, high_freq_factor=8.0, original_max_position_embeddings=64
    )
    got = rope_inv_frequencies(16, 1e4, scaling)
    base = rope_inv_frequencies(16, 1e4)
    kept = np.isclose(got, base, rtol=1e-7)
    divided = np.isclose(got, base / 4.0, rtol=1e-7)
    between = ~kept & ~divided
    assert kept.any() and divided.any() and between.any()
    assert np.all((got[between] < base[between]) & (got[between] > base[between] / 4.0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_apply_rope_matches_rotate_half(seed):
    rng = np.random.default_rng(seed)
    b, t, n, h = 2, 5, 3, 8
    x = rng.normal(size=(b, t, n, h))
    pos = rng.integers(0, 50, size=(b, t))
    inv = rope_inv_frequencies(h, 10000.0)
    cos, sin = rope_cos_sin(jnp.asarray(pos), inv, jnp.float32)
    got = np.asarray(apply_rope(jnp.asarray(x, jnp.float32), cos, sin))
    ang = pos[..., None].astype(np.float64) * inv.astype(np.float64)
    c = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, :, None]
    s = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, :, None]
    rot = np.concatenate([-x[..., h // 2 :], x[..., : h // 2]], -1)
    np.testing.assert_allclose(got, x * c + rot * s, atol=2e-5)


def test_rope_preserves_norm_and_relative_positions():
    rng = np.random.default_rng(0)
    h = 16
    inv = rope_inv_frequencies(h, 10000.0)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, h)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, h)), jnp.float32)

    def dot(pq, pk):
        cq, sq = rope_cos_sin(jnp.array([[pq]]), inv, jnp.float32)
        ck, sk = rope_cos_sin(jnp.array([[pk]]), inv, jnp.float32)
        return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

    assert dot(3, 1) == pytest.approx(dot(10, 8), rel=1e-4)
    cq, sq = rope_cos_sin(jnp.array([[7]]), inv, jnp.float32)
    assert float(jnp.linalg.norm(apply_rope(q, cq, sq))) == pytest.approx(
        float(jnp.linalg.norm(q)), rel=1e-5
    )
