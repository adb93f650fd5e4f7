"""Tests for artifex/generative_models/models/causal_lm/model.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import (
    CausalLM,
    CausalLMConfig,
    KVCache,
    positions_from_mask,
)


@nnx.jit
def _fwd(m, ids, mask=None, positions=None):
    return m(ids, mask, positions)


def _left_padded(rng, vocab, lengths, width):
    ids = rng.integers(1, vocab, size=(len(lengths), width)).astype(np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for b, n in enumerate(lengths):
        mask[b, width - n :] = 1
        ids[b, : width - n] = 0
    return jnp.asarray(ids), jnp.asarray(mask)


@pytest.fixture(scope="module")
def model():
    cfg = CausalLMConfig.tiny(vocab_size=64, initializer_range=0.1)
    return CausalLM(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def qwen3():
    cfg = CausalLMConfig.tiny(
        model_type="qwen3",
        qk_norm=True,
        vocab_size=64,
        head_dim=16,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    return CausalLM(cfg, rngs=nnx.Rngs(1))


def test_positions_from_mask():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    np.testing.assert_array_equal(
        np.asarray(positions_from_mask(mask)), [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        np.asarray(positions_from_mask(mask[:, -1:], jnp.array([3, 5, 1]))), [[3], [5], [1]]
    )


def test_forward_shapes_dtypes(model):
    ids = jnp.ones((2, 7), jnp.int32)
    logits = model(ids)
    assert logits.shape == (2, 7, 64) and logits.dtype == jnp.float32
    hidden, cache = model.hidden_states(ids)
    assert hidden.shape == (2, 7, 128) and hidden.dtype == jnp.float32 and cache is None
    np.testing.assert_array_equal(np.asarray(model.logits_from_hidden(hidden)), np.asarray(logits))
    assert model.output_embedding().shape == (128, 64)


def test_tied_output_embedding(qwen3):
    np.testing.assert_array_equal(
        np.asarray(qwen3.output_embedding()), np.asarray(qwen3.embed.embedding[...]).T
    )
    assert qwen3.lm_head is None


def test_init_like_hf(model):
    state = nnx.state(model, nnx.Param)
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
    assert float(jnp.std(flat["layers.0.mlp.up_proj.kernel"])) == pytest.approx(0.1, rel=0.05)
    np.testing.assert_array_equal(np.asarray(flat["final_norm.scale"]), 1.0)
    assert set(flat) >= {"embed.embedding", "lm_head.kernel", "layers.1.attn.q_proj.kernel"}
    assert sum(v.size for v in flat.values()) == model.config.num_params()


def test_left_padding_invariance(model):
    """A left-padded row gives the same logits on its real tokens as the unpadded row."""
    rng = np.random.default_rng(0)
    ids, mask = _left_padded(rng, 64, [5, 3], 8)
    padded = _fwd(model, ids, mask)
    assert np.all(np.isfinite(np.asarray(padded)))
    for b, n in enumerate([5, 3]):
        alone = _fwd(model, ids[b : b + 1, 8 - n :])
        np.testing.assert_allclose(
            np.asarray(padded[b, 8 - n :]), np.asarray(alone[0]), rtol=1e-5, atol=1e-5
        )


def test_explicit_positions(model):
    ids = jnp.arange(1, 6, dtype=jnp.int32)[None]
    default = model(ids)
    same = model(ids, positions=jnp.arange(5, dtype=jnp.int32)[None])
    shifted = model(ids, positions=jnp.arange(5, dtype=jnp.int32)[None] + 3)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(same))
    assert not np.allclose(np.asarray(default), np.asarray(shifted))


def test_shape_errors(model):
    with pytest.raises(ValueError, match="input_ids"):
        model(jnp.ones((5,), jnp.int32))
    with pytest.raises(ValueError, match="attention_mask"):
        model(jnp.ones((2, 5), jnp.int32), jnp.ones((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"cache\.keys"):
        model.hidden_states(jnp.ones((2, 5), jnp.int32), cache=model.init_cache(3, 8))
    short = model.init_cache(2, 8)
    short = short.replace(keys=short.keys[:1])
    with pytest.raises(ValueError, match=r"one array per layer \(2\), got 1 and 2"):
        model.hidden_states(jnp.ones((2, 5), jnp.int32), cache=short)
    stacked = model.init_cache(3, 8, stacked=True)
    with pytest.raises(ValueError, match=r"cache\.keys \(stacked\) must have shape \(2, 2,"):
        model.hidden_states(jnp.ones((2, 5), jnp.int32), cache=stacked)
    # keys in the values' (B, K, S, H) layout (the layout before keys moved slots-last)
    cache = model.init_cache(2, 8)
    old_layout = cache.replace(keys=tuple(jnp.swapaxes(k, 2, 3) for k in cache.keys))
    want = r"cache\.keys must be \(2, 2, 32, 8\) per layer, got \(2, 2, 8, 32\)"
    with pytest.raises(ValueError, match=want):
        model.hidden_states(jnp.ones((2, 5), jnp.int32), cache=old_layout)


def test_bf16_params_give_fp32_logits(model):
    cfg = model.config
    bf = CausalLM(cfg, rngs=nnx.Rngs(0), dtype="bfloat16")
    assert bf.config.param_dtype == "bfloat16" and bf.dtype == jnp.bfloat16
    # copy the fp32 weights, rounded to bf16
    state = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param))
    nnx.update(bf, state)
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(nnx.state(bf, nnx.Param)))
    rng = np.random.default_rng(1)
    ids, mask = _left_padded(rng, 64, [6, 2], 6)
    ref = np.asarray(_fwd(model, ids, mask))
    got = _fwd(bf, ids, mask)
    hidden, _ = bf.hidden_states(ids, mask)
    assert got.dtype == jnp.float32 and hidden.dtype == jnp.bfloat16
    real = np.asarray(mask, bool)
    err = np.abs(np.asarray(got) - ref)[real].max()
    assert err < 0.05 * np.abs(ref).max(), err


def _decode_all(m, ids, mask, new_tokens, max_length, repeat=1):
    """Prefill the prompts, optionally repeat the cache, then feed new_tokens one by one."""
    graphdef, state = nnx.split(m)

    @jax.jit
    def run(state, ids, mask, new_tokens):
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(ids.shape[0], max_length)
        hidden, cache = model.hidden_states(ids, mask, cache=cache)
        prefill = model.logits_from_hidden(hidden)
        cache = cache.repeat(repeat)
        steps = new_tokens.shape[1]
        out = jnp.zeros((new_tokens.shape[0], steps, m.config.vocab_size), jnp.float32)

        def body(carry):
            i, cache, out = carry
            tok = jax.lax.dynamic_slice_in_dim(new_tokens, i, 1, axis=1)
            h, cache = model.hidden_states(tok, jnp.ones_like(tok), cache=cache)
            out = jax.lax.dynamic_update_slice_in_dim(out, model.logits_from_hidden(h), i, axis=1)
            return i + 1, cache, out

        _, cache, out = jax.lax.while_loop(lambda c: c[0] < steps, body, (0, cache, out))
        return prefill, out, cache

    return run(state, ids, mask, new_tokens)


@pytest.mark.parametrize("which", ["model", "qwen3"])
def test_cache_prefill_then_decode_matches_full_forward(which, request):
    m = request.getfixturevalue(which)
    rng = np.random.default_rng(2)
    t, steps = 7, 5
    ids, mask = _left_padded(rng, 64, [7, 4, 1], t)
    new = jnp.asarray(rng.integers(1, 64, size=(3, steps)), jnp.int32)
    prefill, decoded, cache = _decode_all(m, ids, mask, new, max_length=t + steps + 2)
    full = _fwd(m, jnp.concatenate([ids, new], 1), jnp.concatenate([mask, jnp.ones_like(new)], 1))
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(prefill)[real], np.asarray(full[:, :t])[real], atol=1e-5)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full[:, t:]), atol=1e-5)
    assert int(cache.index) == t + steps
    np.testing.assert_array_equal(np.asarray(cache.valid[:, :t]), np.asarray(mask, bool))
    assert bool(cache.valid[:, t : t + steps].all()) and not bool(cache.valid[:, t + steps :].any())


def test_cache_repeat_shares_prefill(model):
    rng = np.random.default_rng(3)
    t, steps, k = 6, 3, 2
    ids, mask = _left_padded(rng, 64, [6, 3], t)
    new = jnp.asarray(rng.integers(1, 64, size=(2 * k, steps)), jnp.int32)
    _, decoded, _ = _decode_all(model, ids, mask, new, max_length=t + steps, repeat=k)
    full_ids = jnp.concatenate([jnp.repeat(ids, k, 0), new], 1)
    full_mask = jnp.concatenate([jnp.repeat(mask, k, 0), jnp.ones_like(new)], 1)
    full = _fwd(model, full_ids, full_mask)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full[:, t:]), atol=1e-5)


def test_cache_decode_with_padding_tokens(model):
    """A masked decode step (e.g. after EOS) leaves later real tokens unaffected."""
    rng = np.random.default_rng(4)
    ids, mask = _left_padded(rng, 64, [4, 4], 4)
    step = nnx.jit(lambda m, ids, mask, cache: m.hidden_states(ids, mask, cache=cache))
    cache = model.init_cache(2, 8)
    _, cache = step(model, ids, mask, cache)
    step_mask = jnp.array([[1], [0]], jnp.int32)
    _, cache = step(model, jnp.array([[5], [0]], jnp.int32), step_mask, cache)
    h, cache = step(model, jnp.array([[9], [9]], jnp.int32), jnp.ones((2, 1), jnp.int32), cache)
    got = model.logits_from_hidden(h)[:, 0]
    ref0 = _fwd(model, jnp.concatenate([ids[:1], jnp.array([[5, 9]])], 1))[0, -1]
    ref1 = _fwd(model, jnp.concatenate([ids[1:], jnp.array([[9]])], 1))[0, -1]
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref0), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref1), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.valid[:, 4:6]), [[True, True], [False, True]])


def test_init_cache_dtype(model):
    c = model.init_cache(2, 4)
    assert isinstance(c, KVCache) and len(c.keys) == len(c.values) == 2
    assert all(x.shape == (2, 2, 32, 4) and x.dtype == jnp.float32 for x in c.keys)  # slots last
    assert all(x.shape == (2, 2, 4, 32) and x.dtype == jnp.float32 for x in c.values)
    assert model.init_cache(1, 4, dtype=jnp.bfloat16).values[1].dtype == jnp.bfloat16


def test_jit_compiles_once(model):
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def f(state, ids, mask):
        traces.append(1)
        return nnx.merge(graphdef, state)(ids, mask)

    for seed in range(3):
        ids, mask = _left_padded(np.random.default_rng(seed), 64, [3, 5], 5)
        f(state, ids, mask)
    assert len(traces) == 1


def test_out_of_range_ids_do_not_poison_other_rows(model):
    ids = jnp.array([[-1, 3, 4], [1, 3, 4]], jnp.int32)
    mask = jnp.array([[0, 1, 1], [1, 1, 1]], jnp.int32)
    out = _fwd(model, ids, mask)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(
        np.asarray(out[0, 1:]), np.asarray(_fwd(model, ids[:1, 1:])[0]), atol=1e-5
    )
