"""Tests for artifex/generative_models/models/causal_lm/modules.py against float64 NumPy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import (
    MLP,
    Attention,
    CausalLMConfig,
    Linear,
    RMSNorm,
    rope_cos_sin,
    rope_inv_frequencies,
)


def _np(x):
    return np.asarray(x, np.float64)


def _np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * w


def _np_rope(x, pos, inv):
    ang = pos[..., None].astype(np.float64) * inv.astype(np.float64)
    c = np.concatenate([np.cos(ang)] * 2, -1)[:, :, None]
    s = np.concatenate([np.sin(ang)] * 2, -1)[:, :, None]
    h = x.shape[-1] // 2
    return x * c + np.concatenate([-x[..., h:], x[..., :h]], -1) * s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rmsnorm(seed):
    rng = np.random.default_rng(seed)
    norm = RMSNorm(6, eps=1e-5, dtype=jnp.float32)
    norm.scale.set_value(jnp.asarray(rng.normal(size=6), jnp.float32))
    x = rng.normal(size=(3, 4, 6)) * 3
    got = norm(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(
        _np(got), _np_rms(x, _np(norm.scale[...]), 1e-5), rtol=1e-5, atol=1e-6
    )


def test_rmsnorm_bf16_keeps_dtype():
    norm = RMSNorm(8, eps=1e-6, dtype=jnp.bfloat16)
    y = norm(jnp.ones((2, 8), jnp.bfloat16) * 1000)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(_np(y.astype(jnp.float32)), 1.0, rtol=1e-2)


def test_linear_with_bias():
    rng = np.random.default_rng(0)
    lin = Linear(5, 3, use_bias=True, std=0.5, dtype=jnp.float32, rngs=nnx.Rngs(0))
    lin.bias.set_value(jnp.asarray(rng.normal(size=3), jnp.float32))
    x = rng.normal(size=(2, 5))
    want = x @ _np(lin.kernel[...]) + _np(lin.bias[...])
    np.testing.assert_allclose(_np(lin(jnp.asarray(x, jnp.float32))), want, rtol=1e-5, atol=1e-6)
    assert lin.kernel[...].shape == (5, 3)


def test_linear_init_statistics():
    lin = Linear(256, 256, use_bias=False, std=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert abs(float(jnp.std(lin.kernel[...])) - 0.02) < 1e-3
    assert lin.bias is None


@pytest.mark.parametrize("seed", [0, 1])
def test_mlp_swiglu(seed):
    cfg = CausalLMConfig.tiny(
        hidden_size=16, intermediate_size=24, num_heads=2, num_kv_heads=1, head_dim=8
    )
    mlp = MLP(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    x = np.random.default_rng(seed).normal(size=(2, 3, 16))
    g = x @ _np(mlp.gate_proj.kernel[...])
    u = x @ _np(mlp.up_proj.kernel[...])
    want = (g / (1 + np.exp(-g)) * u) @ _np(mlp.down_proj.kernel[...])
    np.testing.assert_allclose(_np(mlp(jnp.asarray(x, jnp.float32))), want, rtol=1e-4, atol=1e-7)


def _np_attention(attn, x, pos, key_mask, inv, qk_norm_eps=None):
    """Naive multi-head attention with explicitly repeated key/value heads."""
    b, t, _ = x.shape
    n, k, h = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def proj(p):
        y = x @ _np(p.kernel[...])
        return y + _np(p.bias[...]) if p.bias is not None else y

    q = proj(attn.q_proj).reshape(b, t, n, h)
    kk = proj(attn.k_proj).reshape(b, t, k, h)
    v = proj(attn.v_proj).reshape(b, t, k, h)
    if qk_norm_eps is not None:
        q = _np_rms(q, _np(attn.q_norm.scale[...]), qk_norm_eps)
        kk = _np_rms(kk, _np(attn.k_norm.scale[...]), qk_norm_eps)
    q, kk = _np_rope(q, pos, inv), _np_rope(kk, pos, inv)
    kk = np.repeat(kk, n // k, axis=2)
    v = np.repeat(v, n // k, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(h)
    allowed = np.tril(np.ones((t, t), bool))[None, None] & key_mask[:, None, None, :].astype(bool)
    scores = np.where(allowed, scores, -1e30)
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", p, v).reshape(b, t, n * h)
    return out @ _np(attn.o_proj.kernel[...])


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"model_type": "qwen2", "attention_bias": True},
        {"model_type": "qwen3", "qk_norm": True, "head_dim": 16},
        {"num_kv_heads": 1},
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_attention_matches_naive_gqa(overrides, seed):
    fields = {"hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, **overrides}
    cfg = CausalLMConfig.tiny(**fields)
    attn = Attention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    if attn.q_proj.bias is not None:
        for p in (attn.q_proj, attn.k_proj, attn.v_proj):
            p.bias.set_value(jnp.asarray(rng.normal(size=p.bias[...].shape), jnp.float32))
    b, t = 3, 6
    x = rng.normal(size=(b, t, 32))
    lengths = np.array([6, 4, 1])
    key_mask = (np.arange(t)[None] >= (t - lengths)[:, None]).astype(np.int32)
    pos = np.clip(np.cumsum(key_mask, -1) - 1, 0, None)
    inv = rope_inv_frequencies(cfg.head_dim, cfg.rope_theta)
    cos, sin = rope_cos_sin(jnp.asarray(pos), inv, jnp.float32)
    mask = jnp.tril(jnp.ones((t, t), bool))[None] & jnp.asarray(key_mask, bool)[:, None, :]
    got, kv = attn(jnp.asarray(x, jnp.float32), cos, sin, mask)
    assert kv is None
    want = _np_attention(attn, x, pos, key_mask, inv, cfg.rms_norm_eps if cfg.qk_norm else None)
    real = key_mask.astype(bool)
    np.testing.assert_allclose(_np(got)[real], want[real], rtol=1e-4, atol=1e-5)
    assert np.all(np.isfinite(_np(got)))  # padding query rows stay finite


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize(("n", "k"), [(4, 2), (4, 1), (6, 3), (2, 2)])
@pytest.mark.parametrize("keys_transposed", [False, True])
def test_grouped_attention_on_cache_layout_matches_numpy(n, k, t, keys_transposed):
    """Values (B, K, S, H), keys (B, K, S, H) or as the cache holds them (B, K, H, S);
    decoding (T=1) and prefill shapes."""
    from artifex.generative_models.models.causal_lm.attention_ops import grouped_attention

    rng = np.random.default_rng(n * 10 + k + t)
    b, s, h = 3, 7, 8
    q = rng.normal(size=(b, t, n, h))
    keys = rng.normal(size=(b, k, s, h))
    values = rng.normal(size=(b, k, s, h))
    mask = rng.random((b, t, s)) > 0.4
    mask[2] = False  # row 2 sees nothing
    mask[0, :, 0] = mask[1, :, 0] = True
    got = grouped_attention(
        jnp.asarray(q, jnp.float32),
        jnp.asarray(keys.swapaxes(2, 3) if keys_transposed else keys, jnp.float32),
        jnp.asarray(values, jnp.float32),
        jnp.asarray(mask),
        keys_transposed=keys_transposed,
    )
    assert got.shape == (b, t, n, h)
    kk = np.repeat(keys, n // k, axis=1)  # query head n reads kv head n // G
    vv = np.repeat(values, n // k, axis=1)
    scores = np.einsum("btnh,bnsh->bnts", q, kk) / np.sqrt(h)
    scores = np.where(mask[:, None], scores, -np.inf)
    with np.errstate(invalid="ignore"):  # row 2's all -inf scores give NaN, not compared
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
    want = np.einsum("bnts,bnsh->btnh", p, vv)
    # rows that see at least one slot agree; a row that sees nothing only has to stay finite
    np.testing.assert_allclose(np.asarray(got[:2]), want[:2], rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(np.asarray(got)))


# ------------------------------------------------------------ 16-bit products and cache writes


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_matmul_16bit_is_the_float32_product_rounded_once(dtype):
    import jax

    from artifex.generative_models.models.causal_lm._products import matmul

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 48)), dtype)
    w = jnp.asarray(rng.standard_normal((48, 7)), dtype)
    y = matmul(x, w)
    assert y.dtype == dtype
    if jax.default_backend() == "cpu":  # the float32-result form, with its own backward rule
        jaxpr = str(jax.make_jaxpr(matmul)(x, w))
        assert "custom_vjp" in jaxpr and "preferred_element_type=float32" in jaxpr
    want = (_np(x) @ _np(w)).astype(np.float32)  # exact products, rounded to float32
    np.testing.assert_allclose(_np(y), _np(jnp.asarray(want).astype(dtype)), rtol=1e-2, atol=1e-2)

    # the gradient: a 16-bit cotangent, products accumulated in float32, rounded once
    ct = jnp.asarray(rng.standard_normal((5, 7)), dtype)
    dx, dw = jax.vjp(matmul, x, w)[1](ct)
    assert dx.dtype == dw.dtype == dtype
    np.testing.assert_allclose(_np(dx), _np(ct) @ _np(w).T, rtol=2e-2, atol=5e-2)
    np.testing.assert_allclose(_np(dw), _np(x).T @ _np(ct), rtol=2e-2, atol=5e-2)


def test_matmul_float32_is_plain_matmul():
    import jax

    from artifex.generative_models.models.causal_lm._products import matmul

    x = jnp.arange(12.0).reshape(3, 4) / 7
    w = jnp.arange(8.0).reshape(4, 2) / 3
    np.testing.assert_array_equal(np.asarray(matmul(x, w)), np.asarray(x @ w))
    jaxpr = str(jax.make_jaxpr(matmul)(x, w))
    assert "custom_vjp" not in jaxpr and "dot_general" in jaxpr


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_write_slots_is_dynamic_update_slice(dtype):
    import jax

    from artifex.generative_models.models.causal_lm.attention_ops import write_slots

    rng = np.random.default_rng(1)
    cache = jnp.asarray(rng.standard_normal((2, 3, 6, 4)), dtype)
    update = jnp.asarray(rng.standard_normal((2, 3, 2, 4)), jnp.float32)  # cast on write
    start = (0, 0, jnp.asarray(3), 0)
    got = jax.jit(write_slots)(cache, update, start)
    want = jax.lax.dynamic_update_slice(cache, update.astype(dtype), start)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
