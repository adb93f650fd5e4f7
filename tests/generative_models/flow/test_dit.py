"""The DiT velocity network."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    FlowDiT,
    FlowDiTConfig,
    FlowSampler,
    FlowTrainConfig,
    SDEConfig,
    flow_log_prob_fn,
    load_digits_images,
    patchify,
    sincos_position_embeddings,
    to_grpo_batch,
    train_flow_matching,
    unpatchify,
)

# One small shape for the tests that call the network, so they share its compilations.
_CFG = FlowDiTConfig(
    image_shape=(8, 8), num_classes=3, hidden_dim=16, num_blocks=1, num_heads=2, time_features=8
)


@jax.jit
def _jitter(params: nnx.State, key: jax.Array) -> nnx.State:
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    leaves = [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, leaves)


@nnx.jit
def _velocity(model: FlowDiT, x: jax.Array, t: jax.Array, labels: jax.Array) -> jax.Array:
    return model(x, t, labels)


def _perturbed(cfg: FlowDiTConfig, seed: int = 0) -> FlowDiT:
    """A DiT whose parameters (the zero-initialized ones included) are all nonzero."""
    model = FlowDiT(cfg, rngs=nnx.Rngs(seed))
    nnx.update(model, _jitter(nnx.state(model, nnx.Param), jax.random.key(seed + 100)))
    return model


@pytest.mark.parametrize("shape", [(8, 8), (4, 6, 3)])
def test_patchify_against_numpy_and_roundtrip(shape):
    p = 2
    x = np.random.default_rng(0).standard_normal((3, math.prod(shape))).astype(np.float32)
    img = x.reshape(3, shape[0], shape[1], -1)
    ref = np.stack(
        [
            img[:, i * p : (i + 1) * p, j * p : (j + 1) * p].reshape(3, -1)
            for i in range(shape[0] // p)
            for j in range(shape[1] // p)
        ],
        axis=1,
    )
    tokens = patchify(jnp.asarray(x), shape, p)
    np.testing.assert_array_equal(np.asarray(tokens), ref)
    np.testing.assert_array_equal(np.asarray(unpatchify(tokens, shape, p)), x)


def test_sincos_position_embeddings_against_numpy():
    gh, gw, dim = 3, 4, 16
    q = dim // 4
    freqs = np.exp(-math.log(10000.0) * np.arange(q) / q)

    def enc(u):
        return np.concatenate([np.sin(u * freqs), np.cos(u * freqs)])

    ref = np.stack([np.concatenate([enc(i), enc(j)]) for i in range(gh) for j in range(gw)])
    got = sincos_position_embeddings(gh, gw, dim)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of 4"):
        sincos_position_embeddings(2, 2, 6)


def test_shapes_and_adaln_zero_init():
    assert (_CFG.data_dim, _CFG.num_tokens, _CFG.patch_dim) == (64, 16, 4)
    model = FlowDiT(_CFG, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (5, 64))
    t = jnp.linspace(0.1, 0.9, 5)
    labels = jnp.array([0, 1, 2, 0, 1])
    v = _velocity(model, x, t, labels)
    assert v.shape == (5, 64) and v.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(v), 0.0)  # adaLN-Zero: zero velocity at init
    # Every block is the identity at init: its gates are zero.
    for block in model.blocks:
        np.testing.assert_array_equal(np.asarray(block.modulation.kernel[...]), 0.0)


def test_output_depends_on_class_time_and_only_its_own_row():
    model = _perturbed(_CFG)
    x = jax.random.normal(jax.random.key(1), (4, 64))
    t = jnp.array([0.2, 0.4, 0.6, 0.8])
    v = np.asarray(_velocity(model, x, t, jnp.array([0, 1, 2, 0])))
    v2 = np.asarray(_velocity(model, x, t, jnp.array([1, 1, 2, 0])))
    assert v.shape == (4, 64) and np.all(np.isfinite(v))
    assert not np.allclose(v[0], v2[0], atol=1e-3)  # the class matters
    np.testing.assert_allclose(v[1:], v2[1:], rtol=1e-5, atol=1e-6)  # rows are independent
    v3 = np.asarray(_velocity(model, x, t.at[0].set(0.9), jnp.array([0, 1, 2, 0])))
    assert not np.allclose(v[0], v3[0], atol=1e-3)  # so does the time


def test_sampler_and_log_prob_hook_accept_the_dit():
    model = _perturbed(_CFG)
    sde = SDEConfig(num_steps=3, noise_level=0.7)
    traj = FlowSampler(sde)(model, np.array([0, 1]), 2, jax.random.key(0))
    assert traj.states.shape == (4, 4, 64) and traj.log_probs.shape == (4, 3)
    batch = to_grpo_batch(traj, np.arange(4.0), group_size=2, config=sde)
    log_probs, _ = nnx.jit(flow_log_prob_fn(sde))(model, batch)
    np.testing.assert_allclose(np.asarray(log_probs), np.asarray(traj.log_probs), rtol=1e-4)


@pytest.mark.slow
def test_pretraining_lowers_the_flow_matching_loss_on_digits():
    images, labels = load_digits_images()
    model = FlowDiT(
        FlowDiTConfig(hidden_dim=32, num_blocks=1, num_heads=2, time_features=16),
        rngs=nnx.Rngs(0),
    )
    losses = train_flow_matching(
        model,
        images,
        labels,
        FlowTrainConfig(num_steps=60, batch_size=32, learning_rate=4e-3, seed=1),
    )
    assert len(losses) == 60 and np.all(np.isfinite(losses))
    assert np.mean(losses[-20:]) < 0.8 * np.mean(losses[:5])


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (dict(image_shape=(8,)), ValueError),
        (dict(image_shape=(7, 8)), ValueError),
        (dict(hidden_dim=18), ValueError),
        (dict(hidden_dim=20, num_heads=8), ValueError),
        (dict(num_blocks=0), ValueError),
        (dict(time_features=7), ValueError),
        (dict(num_heads=2.0), TypeError),
    ],
)
def test_config_validation(bad, error):
    with pytest.raises(error, match="FlowDiTConfig"):
        FlowDiTConfig(**bad)


def test_model_rejects_wrong_config_type():
    with pytest.raises(TypeError, match="FlowDiTConfig"):
        FlowDiT({"hidden_dim": 8}, rngs=nnx.Rngs(0))
