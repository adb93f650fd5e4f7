"""Tests for artifex/generative_models/models/causal_lm/cache.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.models.causal_lm import KVCache


def _cache(b=2, s=5):
    return KVCache.create(num_layers=3, batch_size=b, max_length=s, num_kv_heads=2, head_dim=4)


def test_create_shapes_and_dtypes():
    c = _cache()
    assert len(c.keys) == len(c.values) == 3
    assert all(x.shape == (2, 2, 4, 5) for x in c.keys)  # (B, K, H, S): slots last
    assert all(x.shape == (2, 2, 5, 4) for x in c.values)  # (B, K, S, H)
    assert c.valid.shape == (2, 5) and c.valid.dtype == jnp.bool_ and not bool(c.valid.any())
    assert c.index.shape == () and c.index.dtype == jnp.int32 and int(c.index) == 0
    assert (c.num_layers, c.batch_size, c.max_length) == (3, 2, 5)
    bf = KVCache.create(
        num_layers=1, batch_size=1, max_length=2, num_kv_heads=1, head_dim=2, dtype=jnp.bfloat16
    )
    assert bf.keys[0].dtype == bf.values[0].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "name", ["num_layers", "batch_size", "max_length", "num_kv_heads", "head_dim"]
)
def test_create_validates(name):
    kwargs = {"num_layers": 1, "batch_size": 1, "max_length": 1, "num_kv_heads": 1, "head_dim": 2}
    kwargs[name] = 0
    with pytest.raises(ValueError, match=name):
        KVCache.create(**kwargs)


def test_is_pytree_with_one_leaf_per_layer_array():
    c = _cache()
    leaves, treedef = jax.tree.flatten(c)
    assert len(leaves) == 2 * 3 + 2
    again = jax.tree.unflatten(treedef, leaves)
    assert isinstance(again, KVCache)


def test_repeat_rows_consecutively():
    rng = np.random.default_rng(0)
    c = _cache(b=3).replace(
        keys=tuple(jnp.asarray(rng.normal(size=(3, 2, 4, 5)), jnp.float32) for _ in range(3)),
        values=tuple(jnp.asarray(rng.normal(size=(3, 2, 5, 4)), jnp.float32) for _ in range(3)),
        valid=jnp.asarray(rng.random((3, 5)) > 0.5),
        index=jnp.int32(4),
    )
    r = c.repeat(2)
    assert r.keys[0].shape == (6, 2, 4, 5) and r.values[0].shape == (6, 2, 5, 4)
    assert r.valid.shape == (6, 5) and int(r.index) == 4
    for row in range(6):
        for layer in range(3):
            np.testing.assert_array_equal(
                np.asarray(r.keys[layer][row]), np.asarray(c.keys[layer][row // 2])
            )
            np.testing.assert_array_equal(
                np.asarray(r.values[layer][row]), np.asarray(c.values[layer][row // 2])
            )
        np.testing.assert_array_equal(np.asarray(r.valid[row]), np.asarray(c.valid[row // 2]))
    assert c.repeat(1) is c
    with pytest.raises(ValueError, match="k must be"):
        c.repeat(0)


def test_carried_through_while_loop():
    c = _cache()

    def body(carry):
        cache = carry
        keys = tuple(  # slots are the last axis of the keys
            jax.lax.dynamic_update_slice(k, jnp.ones((2, 2, 4, 1)), (0, 0, 0, cache.index))
            for k in cache.keys
        )
        return cache.replace(keys=keys, index=cache.index + 1)

    out = jax.jit(lambda c: jax.lax.while_loop(lambda x: x.index < 3, body, c))(c)
    assert int(out.index) == 3
    for k in out.keys:
        np.testing.assert_array_equal(np.asarray(k[0, 0, 0, :]), [1, 1, 1, 0, 0])


def test_stacked_form_create_and_repeat():
    c = KVCache.create(
        num_layers=3, batch_size=2, max_length=5, num_kv_heads=2, head_dim=4, stacked=True
    )
    assert c.stacked and not _cache().stacked
    assert c.keys.shape == (3, 2, 2, 4, 5) and c.values.shape == (3, 2, 2, 5, 4)
    assert (c.num_layers, c.batch_size, c.max_length) == (3, 2, 5)
    rng = np.random.default_rng(1)
    c = c.replace(keys=jnp.asarray(rng.normal(size=c.keys.shape), jnp.float32))
    r = c.repeat(2)
    assert r.keys.shape == (3, 4, 2, 4, 5) and r.stacked
    for row in range(4):
        np.testing.assert_array_equal(np.asarray(r.keys[:, row]), np.asarray(c.keys[:, row // 2]))


def test_default_cache_dtype_of_a_16bit_model_on_cpu_is_float32_with_the_same_values():
    """On the CPU a bfloat16 model's default cache is float32; it decodes as a bfloat16 one."""
    import jax
    from flax import nnx

    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig

    if jax.default_backend() != "cpu":
        pytest.skip("the float32 default is for the CPU backend")
    model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0), dtype="bfloat16")
    assert model.init_cache(1, 4).keys[0].dtype == jnp.float32
    ids = jnp.array([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    outs = []
    for dtype in (None, jnp.bfloat16):
        cache = model.init_cache(2, 8, dtype=dtype)
        hidden, cache = model.hidden_states(ids[:, :3], cache=cache)
        steps = [hidden]
        for i in range(3, 5):
            h, cache = model.hidden_states(ids[:, i : i + 1], cache=cache)
            steps.append(h)
        assert cache.keys[0].dtype == (jnp.float32 if dtype is None else jnp.bfloat16)
        outs.append(np.concatenate([np.asarray(s, np.float32) for s in steps], axis=1))
    # the cache holds bfloat16 values either way: the same hidden states up to the
    # order of float32 sums
    np.testing.assert_allclose(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    full, _ = model.hidden_states(ids)
    np.testing.assert_allclose(outs[0], np.asarray(full, np.float32), rtol=5e-2, atol=5e-2)


def test_hidden_states_refuses_tokens_beyond_the_cache():
    """A concrete cache index is checked: tokens past the last slot are an error, not clamped."""
    from flax import nnx

    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig

    model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
    cache = model.init_cache(1, 4)
    _, cache = model.hidden_states(jnp.array([[1, 2, 3]]), cache=cache)
    with pytest.raises(ValueError, match="1 free slots of 4, 2 tokens do not fit"):
        model.hidden_states(jnp.array([[4, 5]]), cache=cache)
    _, full = model.hidden_states(jnp.array([[4]]), cache=cache)  # the last slot fits
    assert int(full.index) == 4
