"""Rectified-flow pretraining."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    FlowModel,
    FlowModelConfig,
    FlowTrainConfig,
    flow_matching_loss,
    load_digits_images,
    pretraining,
    train_flow_matching,
)
from artifex.generative_models.flow.pretraining import shift_times


def _model(seed: int = 0) -> FlowModel:
    cfg = FlowModelConfig(image_shape=(8, 8), hidden_dim=32, num_blocks=1)
    model = FlowModel(cfg, rngs=nnx.Rngs(seed))
    model.output.kernel[...] = 0.2 * jax.random.normal(jax.random.key(seed), (32, 64))
    return model


def test_load_digits_images():
    images, labels = load_digits_images()
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    assert images.min() == -1.0 and images.max() == 1.0
    assert set(np.unique(labels)) == set(range(10))


@pytest.mark.parametrize("seed", [0, 1])
def test_flow_matching_loss_against_numpy(seed):
    model = _model(seed)
    rng = np.random.default_rng(seed)
    x0 = rng.uniform(-1, 1, size=(6, 8, 8))
    x1 = rng.standard_normal((6, 8, 8))
    t = rng.uniform(size=6)
    labels = rng.integers(0, 10, size=6)
    xt = (1 - t[:, None]) * x0.reshape(6, -1) + t[:, None] * x1.reshape(6, -1)
    v = np.asarray(
        model(jnp.asarray(xt, jnp.float32), jnp.asarray(t, jnp.float32), labels), np.float64
    )
    ref = np.mean((v - (x1 - x0).reshape(6, -1)) ** 2)
    got = flow_matching_loss(
        model, jnp.asarray(x0), jnp.asarray(labels), jnp.asarray(x1), jnp.asarray(t)
    )
    np.testing.assert_allclose(float(got), ref, rtol=1e-4)


@pytest.mark.slow
def test_training_lowers_the_loss():
    images, labels = load_digits_images()
    model = FlowModel(
        FlowModelConfig(hidden_dim=32, num_blocks=1, time_features=8), rngs=nnx.Rngs(0)
    )
    losses = train_flow_matching(
        model, images, labels, FlowTrainConfig(num_steps=150, batch_size=64, seed=1)
    )
    assert len(losses) == 150
    assert np.mean(losses[-20:]) < 0.8 * np.mean(losses[:5])


@pytest.mark.parametrize("bad", ["3", True, None])
def test_time_shift_must_be_a_number(bad):
    with pytest.raises(TypeError, match=r"FlowTrainConfig\.time_shift"):
        FlowTrainConfig(time_shift=bad)


def test_shift_times_refusals():
    with pytest.raises(ValueError, match=r"shift_times\.shift"):
        shift_times(jnp.array([0.5]), 0.0)
    with pytest.raises(ValueError, match=r"shift_times.u must hold times in \[0, 1\], got 2.0"):
        shift_times(jnp.array([0.5, 2.0]), 3.0)


def test_shift_times_properties():
    """Endpoints fixed, increasing, and P(t > 1/2) = s / (1 + s) for uniform u."""
    u = np.linspace(0.0, 1.0, 100_001)
    for shift in (0.25, 3.0, 10.0):
        t = np.asarray(shift_times(jnp.asarray(u), shift), np.float64)
        assert t[0] == 0.0 and abs(t[-1] - 1.0) < 1e-6
        assert np.all(np.diff(t) >= 0)
        assert abs(np.mean(t > 0.5) - shift / (1 + shift)) < 1e-3


def test_shift_times_against_numpy():
    u = np.linspace(0.0, 1.0, 101)
    for shift in (0.5, 1.0, 3.0):
        ref = shift * u / (1.0 + (shift - 1.0) * u)
        np.testing.assert_allclose(np.asarray(shift_times(jnp.asarray(u), shift)), ref, atol=1e-6)


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_training_draws_the_shifted_times(monkeypatch, shift):
    """The times train_flow_matching trains on have the shifted law's mean (float64 reference)."""

    def mean_time(model, x0, labels, noise, t):  # the "loss" is the batch's mean time
        del x0, labels, noise
        return jnp.mean(t) + 0.0 * jnp.sum(model.output.kernel[...])

    monkeypatch.setattr(pretraining, "flow_matching_loss", mean_time)
    steps, batch = 40, 256
    means = train_flow_matching(
        _model(),
        np.zeros((4, 8, 8), np.float32),
        np.zeros(4, np.int32),
        FlowTrainConfig(num_steps=steps, batch_size=batch, time_shift=shift),
    )
    u = (np.arange(200_000) + 0.5) / 200_000
    expected = float(np.mean(shift * u / (1.0 + (shift - 1.0) * u)))  # E[t], midpoint rule
    spread = float(np.std(shift * u / (1.0 + (shift - 1.0) * u))) / np.sqrt(steps * batch)
    assert abs(np.mean(means) - expected) < 5 * spread
    if shift == 3.0:
        assert expected > 0.6  # the law is not the uniform one (mean 0.5)


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_steps=0),
        dict(batch_size=-2),
        dict(learning_rate=0.0),
        dict(time_shift=0.0),
        dict(time_shift=float("inf")),
        dict(time_shift=float("nan")),
    ],
)
def test_train_config_validation(bad):
    with pytest.raises(ValueError, match="FlowTrainConfig"):
        FlowTrainConfig(**bad)


def test_train_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="same number of rows"):
        train_flow_matching(_model(), np.zeros((3, 8, 8)), np.zeros(2, np.int32))
