"""The flow-matching velocity network."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.flow import FlowModel, FlowModelConfig, timestep_features


@pytest.mark.parametrize("seed", [0, 1])
def test_timestep_features_against_numpy(seed):
    t = np.random.default_rng(seed).uniform(size=5)
    half = 4
    freqs = np.exp(-math.log(10000.0) * np.arange(half) / half)
    ang = 1000.0 * t[:, None] * freqs
    ref = np.concatenate([np.sin(ang), np.cos(ang)], axis=1)
    got = timestep_features(jnp.asarray(t, jnp.float32), 8)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-3, atol=1e-3)


def test_shapes_zero_init_and_conditioning():
    cfg = FlowModelConfig(image_shape=(4, 4), num_classes=3, hidden_dim=16, num_blocks=2)
    assert cfg.data_dim == 16
    model = FlowModel(cfg, rngs=nnx.Rngs(0))
    x = jnp.ones((5, 16))
    t = jnp.linspace(0.1, 0.9, 5)
    labels = jnp.array([0, 1, 2, 0, 1])
    np.testing.assert_array_equal(np.asarray(model(x, t, labels)), 0.0)  # zero-init output
    model.output.kernel[...] = jnp.ones_like(model.output.kernel[...])
    v = model(x, t, labels)
    assert v.shape == (5, 16) and v.dtype == jnp.float32
    v2 = model(x, t, jnp.array([1, 1, 2, 0, 1]))
    assert not np.allclose(np.asarray(v[0]), np.asarray(v2[0]))  # the class matters
    np.testing.assert_allclose(np.asarray(v[1:]), np.asarray(v2[1:]), rtol=1e-6)


@pytest.mark.parametrize(
    "bad",
    [dict(image_shape=(8,)), dict(num_classes=0), dict(hidden_dim=-1), dict(time_features=7)],
)
def test_config_validation(bad):
    with pytest.raises(ValueError, match="FlowModelConfig"):
        FlowModelConfig(**bad)


def test_model_rejects_wrong_config_type():
    with pytest.raises(TypeError, match="FlowModelConfig"):
        FlowModel({"hidden_dim": 8}, rngs=nnx.Rngs(0))
