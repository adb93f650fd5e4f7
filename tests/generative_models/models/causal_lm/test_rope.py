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


# --------------------------------------------------------------------- the model's angle table
# CausalLM looks its cosines and sines up in a table of positions [0, bound) computed once per
# trace (model._rope_tables), instead of evaluating them inside every layer's rotation.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_table_is_rope_cos_sin(dtype):
    from artifex.generative_models.models.causal_lm.model import _rope_tables

    inv_freq = rope_inv_frequencies(16, 10000.0)
    positions = jnp.array([[0, 5, 17, 3], [2, 2, 9, 0]])
    cos, sin = _rope_tables(positions, inv_freq, dtype, 18)
    want_cos, want_sin = rope_cos_sin(positions, inv_freq, dtype)
    assert cos.dtype == want_cos.dtype == dtype and cos.shape == (2, 4, 8)
    np.testing.assert_array_equal(np.asarray(cos, np.float32), np.asarray(want_cos, np.float32))
    np.testing.assert_array_equal(np.asarray(sin, np.float32), np.asarray(want_sin, np.float32))
    # and against float64 NumPy
    angles = np.asarray(positions, np.float64)[..., None] * inv_freq.astype(np.float64)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(cos, np.float64), np.cos(angles), atol=tol)
    np.testing.assert_allclose(np.asarray(sin, np.float64), np.sin(angles), atol=tol)


def test_rope_table_out_of_range_is_nan_not_another_position():
    from artifex.generative_models.models.causal_lm.model import _rope_tables

    inv_freq = rope_inv_frequencies(8, 10000.0)
    cos, sin = _rope_tables(jnp.array([[0, 4, 7]]), inv_freq, jnp.float32, 4)
    assert np.isfinite(np.asarray(cos[0, 0])).all()
    assert np.isnan(np.asarray(cos[0, 1:])).all() and np.isnan(np.asarray(sin[0, 1:])).all()


def test_rope_table_falls_back_without_a_bound_or_when_too_large():
    from artifex.generative_models.models.causal_lm import model as model_lib

    inv_freq = rope_inv_frequencies(8, 10000.0)
    positions = jnp.array([[0, 1_000_000]])  # caller-given positions: any value
    too_big = model_lib._ROPE_TABLE_MAX_ENTRIES // 4 + 1
    for bound in (None, too_big):
        cos, sin = model_lib._rope_tables(positions, inv_freq, jnp.float32, bound)
        want_cos, want_sin = rope_cos_sin(positions, inv_freq, jnp.float32)
        np.testing.assert_array_equal(np.asarray(cos), np.asarray(want_cos))
        np.testing.assert_array_equal(np.asarray(sin), np.asarray(want_sin))


def test_model_with_derived_positions_matches_given_positions():
    """The table path (positions derived from the mask) against rope_cos_sin in place."""
    from flax import nnx

    from artifex.generative_models.models.causal_lm import (
        CausalLM,
        CausalLMConfig,
        positions_from_mask,
    )

    model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
    ids = jnp.array([[0, 0, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    mask = jnp.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    table, _ = model.hidden_states(ids, attention_mask=mask)
    given, _ = model.hidden_states(ids, attention_mask=mask, positions=positions_from_mask(mask))
    np.testing.assert_allclose(np.asarray(table), np.asarray(given), rtol=1e-5, atol=1e-5)
    # decoding with a cache (bound = the cache's slots) agrees with the full pass too
    cache = model.init_cache(batch_size=2, max_length=8)
    prefix, cache = model.hidden_states(ids[:, :5], attention_mask=mask[:, :5], cache=cache)
    last, _ = model.hidden_states(ids[:, 5:], attention_mask=mask[:, 5:], cache=cache)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(given[:, 5]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(prefix[1]), np.asarray(given[1, :5]), atol=1e-4)
