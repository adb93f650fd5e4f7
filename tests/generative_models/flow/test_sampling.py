"""The Flow-GRPO samplers: transition densities, the ODE limit, SDE windows, input checks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    MAX_NOISE_LEVEL,
    FlowDiT,
    FlowDiTConfig,
    FlowModel,
    FlowModelConfig,
    FlowSampler,
    SDEConfig,
    check_prompts,
    flow_log_prob_fn,
    gaussian_kl,
    gaussian_log_prob,
    sample_flow,
    time_grid,
)

D = 16  # 4x4 images


def _model(seed: int) -> FlowModel:
    """A tiny flow model with a random (not zero) output layer, so velocities are nonzero."""
    cfg = FlowModelConfig(image_shape=(4, 4), num_classes=3, hidden_dim=16, num_blocks=1)
    model = FlowModel(cfg, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 100)
    model.output.kernel[...] = 0.3 * jax.random.normal(key, model.output.kernel[...].shape)
    return model


def _velocity(model: FlowModel, x: np.ndarray, t: float, labels: np.ndarray) -> np.ndarray:
    tt = jnp.full((x.shape[0],), t, jnp.float32)
    return np.asarray(model(jnp.asarray(x, jnp.float32), tt, labels), np.float64)


def _reference_sde(model, labels, noise, num_steps, a, window=None):
    """Float64 NumPy Euler-Maruyama of the Flow-GRPO SDE and its Gaussian log-densities.

    ``window = (w, W)``: SDE steps ``[w, w + W)`` only, Euler ODE steps elsewhere (log-prob 0).
    """
    grid = 1.0 - np.arange(num_steps + 1, dtype=np.float64) / num_steps
    x = np.asarray(noise[:, 0], np.float64)
    states, lps = [x], []
    for s in range(num_steps):
        t, dt = grid[s], grid[s + 1] - grid[s]
        v = _velocity(model, x, t, labels)
        if window is not None and not window[0] <= s < window[0] + window[1]:
            x = x + v * dt
            states.append(x)
            lps.append(np.zeros(x.shape[0]))
            continue
        sigma = a * math.sqrt(t / (1.0 - min(t, grid[1])))
        mu = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt
        std = sigma * math.sqrt(-dt)
        x_next = mu + std * np.asarray(noise[:, s + 1], np.float64) if a > 0 else mu
        if a > 0:
            d = x.shape[1]
            lp = (
                -np.sum((x_next - mu) ** 2, axis=1) / (2 * std**2)
                - d * math.log(std)
                - 0.5 * d * math.log(2 * math.pi)
            )
            lps.append(lp)
        states.append(x_next)
        x = x_next
    return np.stack(states, 1), (np.stack(lps, 1) if lps else None)


def test_time_grid():
    np.testing.assert_allclose(time_grid(4), [1.0, 0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sde_log_probs_match_float64_gaussian(seed):
    model = _model(seed)
    cfg = SDEConfig(num_steps=5, noise_level=0.7)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, size=6)
    noise = rng.standard_normal((6, 6, D)).astype(np.float32)
    traj = sample_flow(model, jnp.asarray(labels), jnp.asarray(noise), cfg)
    ref_states, ref_lps = _reference_sde(model, labels, noise, 5, 0.7)
    np.testing.assert_allclose(np.asarray(traj.states), ref_states, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(traj.log_probs), ref_lps, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("seed", [0, 3])
def test_gaussian_log_prob_against_numpy(seed):
    rng = np.random.default_rng(seed)
    x, mu = rng.standard_normal((2, 5, 7))
    std = rng.uniform(0.1, 2.0, size=(5, 1))
    ref = np.sum(-((x - mu) ** 2) / (2 * std**2) - np.log(std) - 0.5 * np.log(2 * np.pi), axis=-1)
    got = gaussian_log_prob(jnp.asarray(x), jnp.asarray(mu), jnp.asarray(std))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_noise_level_zero_is_the_euler_ode(seed):
    model = _model(seed)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, size=4)
    noise = rng.standard_normal((4, 7, D)).astype(np.float32)
    traj = sample_flow(
        model, jnp.asarray(labels), jnp.asarray(noise), SDEConfig(num_steps=6, noise_level=0.0)
    )
    # plain Euler: x_{s+1} = x_s + v(x_s, t_s) (t_{s+1} - t_s), same start, noise ignored
    x = noise[:, 0].astype(np.float64)
    grid = 1.0 - np.arange(7) / 6
    for s in range(6):
        x = x + _velocity(model, x, grid[s], labels) * (grid[s + 1] - grid[s])
    np.testing.assert_allclose(np.asarray(traj.images), x, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(traj.log_probs), 0.0)
    with pytest.raises(ValueError, match="noise_level > 0"):
        flow_log_prob_fn(SDEConfig(noise_level=0.0))


@pytest.mark.parametrize("seed", [0, 1])
def test_gaussian_kl_against_numpy(seed):
    rng = np.random.default_rng(seed)
    mu, mu_ref = rng.standard_normal((2, 3, 5, D))
    std = rng.uniform(0.2, 1.0, size=(3, 5, 1))
    ref = np.sum((mu - mu_ref) ** 2, axis=-1) / (2 * std[..., 0] ** 2)
    np.testing.assert_allclose(np.asarray(gaussian_kl(mu, mu_ref, std)), ref, rtol=1e-5)


@pytest.mark.parametrize(("seed", "start"), [(0, 0), (1, 2), (2, 4)])
def test_sde_window_matches_float64_mixed_ode_sde(seed, start):
    """MixGRPO / Flow-GRPO-Fast: SDE steps [w, w + W), exact Euler ODE steps elsewhere."""
    model = _model(seed)
    cfg = SDEConfig(num_steps=6, noise_level=0.8, window_size=2)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, size=4)
    noise = rng.standard_normal((4, 7, D)).astype(np.float32)
    traj = sample_flow(model, jnp.asarray(labels), jnp.asarray(noise), cfg, window_start=start)
    ref_states, ref_lps = _reference_sde(model, labels, noise, 6, 0.8, window=(start, 2))
    np.testing.assert_allclose(np.asarray(traj.states), ref_states, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(traj.log_probs), ref_lps, rtol=1e-4, atol=1e-3)
    want = np.zeros((4, 6), bool)
    want[:, start : start + 2] = True
    np.testing.assert_array_equal(np.asarray(traj.stochastic), want)


def test_sde_window_per_row_and_sampler_draw():
    model = _model(0)
    cfg = SDEConfig(num_steps=5, noise_level=0.7, window_size=2)
    noise = np.random.default_rng(0).standard_normal((3, 6, D)).astype(np.float32)
    traj = sample_flow(model, jnp.array([0, 1, 2]), jnp.asarray(noise), cfg, jnp.array([0, 3, 1]))
    np.testing.assert_array_equal(
        np.asarray(traj.stochastic).nonzero()[1].reshape(3, 2), [[0, 1], [3, 4], [1, 2]]
    )
    sampler = FlowSampler(cfg)
    starts = set()
    for i in range(6):
        stoch = np.asarray(sampler(model, [0, 1], 2, jax.random.key(i)).stochastic)
        assert (stoch.sum(axis=1) == 2).all() and (stoch == stoch[:1]).all()  # one window
        starts.add(int(stoch[0].argmax()))
    assert len(starts) > 1 and starts <= {0, 1, 2, 3}
    fixed = sampler(model, [1, 0], 2, jax.random.key(0), window_start=3)  # same shape
    assert np.asarray(fixed.stochastic)[:, 3:].all() and sampler.num_compilations == 1
    with pytest.raises(ValueError, match=r"window_start must be an int or \(2,\) ints in \[0, 3\]"):
        sampler(model, [0], 2, jax.random.key(0), window_start=4)
    with pytest.raises(ValueError, match="needs a window_start"):
        sample_flow(model, jnp.array([0, 1, 2]), jnp.asarray(noise), cfg)
    with pytest.raises(ValueError, match=r"only used with SDEConfig\.window_size"):
        FlowSampler(SDEConfig(num_steps=5))(model, [0], 2, jax.random.key(0), window_start=1)


def test_sde_config_validation():
    assert SDEConfig(num_steps=6, window_size=3, train_steps=2).num_trained_steps == 2
    assert SDEConfig(num_steps=6, window_size=3).num_trained_steps == 3
    assert SDEConfig(num_steps=6).num_stochastic_steps == 6
    assert SDEConfig(noise_level=MAX_NOISE_LEVEL).noise_level == math.sqrt(2)
    for bad, match in (
        (dict(num_steps=1), "num_steps must be an int >= 2"),
        (dict(noise_level=-0.1), "noise_level must be a number >= 0"),
        (dict(noise_level=1e6), r"noise_level must be in \[0, sqrt\(2\)\].*got 1000000.0"),
        (dict(noise_level=1.5), r"negative above sqrt\(2\)"),
        (dict(noise_level=float("nan")), "noise_level must be a finite number"),
        (dict(train_steps=0), "train_steps must be an int in"),
        (dict(train_steps=7), "train_steps must be an int in"),
        (dict(window_size=7), "window_size must be an int in"),
        (dict(window_size=2, train_steps=3), r"train_steps must be an int in \[1, 2\]"),
    ):
        with pytest.raises(ValueError, match=match):
            SDEConfig(**{"num_steps": 6, **bad})
    with pytest.raises(TypeError, match="noise_level must be a real number"):
        SDEConfig(noise_level="0.7")


def test_noise_must_have_the_right_shape_and_be_finite():
    cfg = SDEConfig(num_steps=3)
    model = _model(0)
    with pytest.raises(ValueError, match=r"noise must have shape \(B, 4, 16\)"):
        sample_flow(model, jnp.zeros(2, jnp.int32), jnp.zeros((2, 3, D)), cfg)
    with pytest.raises(ValueError, match=r"noise must have shape \(B, 4, 16\), got \(2, 4, 9\)"):
        sample_flow(model, jnp.zeros(2, jnp.int32), jnp.zeros((2, 4, 9)), cfg)
    noise = np.zeros((2, 4, D), np.float32)
    noise[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match=r"finite, got 1 NaN or infinite values \(row 1\)"):
        sample_flow(model, jnp.zeros(2, jnp.int32), jnp.asarray(noise), cfg)
    noise[1, 2, 3] = np.inf
    with pytest.raises(ValueError, match="noise must be finite"):
        sample_flow(model, jnp.zeros(2, jnp.int32), noise, cfg)


@pytest.mark.parametrize("kind", ["mlp", "dit"])
def test_prompts_out_of_range_or_not_integers_are_refused(kind):
    if kind == "mlp":
        model = _model(0)  # 3 classes
    else:
        model = FlowDiT(
            FlowDiTConfig(
                image_shape=(4, 4),
                num_classes=3,
                hidden_dim=8,
                num_blocks=1,
                num_heads=2,
                time_features=8,
            ),
            rngs=nnx.Rngs(0),
        )
    sampler = FlowSampler(SDEConfig(num_steps=2))
    noise = jnp.zeros((2, 3, D))
    for bad in ([0, 3], [-1, 0]):
        with pytest.raises(ValueError, match=r"prompts must be class labels in \[0, 3\)"):
            sampler(model, bad, 2, jax.random.key(0))
        with pytest.raises(ValueError, match=r"prompts must be class labels in \[0, 3\)"):
            sample_flow(model, jnp.asarray(bad), noise, SDEConfig(num_steps=2))
        with pytest.raises(ValueError, match=r"class labels must be in \[0, 3\)"):
            model(jnp.zeros((2, D)), jnp.ones(2), jnp.asarray(bad))  # the model itself, eager
    for bad in ([1.5], np.array([1.0, 2.0]), ["a"]):
        with pytest.raises(TypeError, match="prompts must be integer class labels or token ids"):
            sampler(model, bad, 2, jax.random.key(0))
    with pytest.raises(ValueError, match=r"prompts must be class labels of shape \(B,\)"):
        check_prompts(model, [[0, 1]])
    with pytest.raises(ValueError, match="prompts must have 3 rows"):
        sample_flow(model, jnp.array([0, 1]), jnp.zeros((3, 3, D)), SDEConfig(num_steps=2))
    with pytest.raises(TypeError, match="num_generations must be an int"):
        sampler(model, [0], 2.0, jax.random.key(0))


def test_non_integer_image_shapes_are_refused():
    for cls in (FlowModelConfig, FlowDiTConfig):
        with pytest.raises(TypeError, match=r"image_shape\[0\] must be an int, got 8.5"):
            cls(image_shape=(8.5, 8))
        with pytest.raises(ValueError, match=r"image_shape\[1\] must be an int >= 1, got 0"):
            cls(image_shape=(8, 0))
