"""The Flow-GRPO samplers: transition densities, the ODE limit, the GRPO hook and the KL."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.inference.flow_sampling import (
    FlowSampler,
    SDEConfig,
    flow_kl,
    flow_log_prob_fn,
    gaussian_kl,
    gaussian_log_prob,
    sample_flow,
    time_grid,
    to_grpo_batch,
)
from artifex.generative_models.models.flow import FlowModel, FlowModelConfig
from artifex.generative_models.training.rl.configs import GRPOConfig
from artifex.generative_models.training.rl.grpo import GRPOTrainer

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


def _reference_sde(model, labels, noise, num_steps, a):
    """Float64 NumPy Euler-Maruyama of the Flow-GRPO SDE and its Gaussian log-densities."""
    grid = 1.0 - np.arange(num_steps + 1, dtype=np.float64) / num_steps
    x = np.asarray(noise[:, 0], np.float64)
    states, lps = [x], []
    for s in range(num_steps):
        t, dt = grid[s], grid[s + 1] - grid[s]
        v = _velocity(model, x, t, labels)
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


def test_log_prob_hook_recovers_sampler_log_probs():
    model = _model(4)
    cfg = SDEConfig(num_steps=4, noise_level=0.5)
    traj = FlowSampler(cfg)(model, jnp.array([0, 2]), 3, jax.random.key(0))
    batch = to_grpo_batch(traj, np.arange(6.0), group_size=3, config=cfg).validate()
    lp, ent = flow_log_prob_fn(cfg)(model, batch)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(traj.log_probs), rtol=1e-5, atol=1e-4)
    # entropy of N(mu, std^2 I): D/2 log(2 pi e std^2)
    grid = time_grid(4).astype(np.float64)
    sigma = 0.5 * np.sqrt(grid[:-1] / (1 - np.minimum(grid[:-1], grid[1])))
    std = sigma * np.sqrt(grid[:-1] - grid[1:])
    np.testing.assert_allclose(
        np.asarray(ent[0]), 0.5 * D * np.log(2 * np.pi * np.e * std**2), rtol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(traj.labels), [0, 0, 0, 2, 2, 2])


@pytest.mark.parametrize("seed", [0, 1])
def test_closed_form_kl(seed):
    rng = np.random.default_rng(seed)
    mu, mu_ref = rng.standard_normal((2, 3, 5, D))
    std = rng.uniform(0.2, 1.0, size=(3, 5, 1))
    ref = np.sum((mu - mu_ref) ** 2, axis=-1) / (2 * std[..., 0] ** 2)
    np.testing.assert_allclose(np.asarray(gaussian_kl(mu, mu_ref, std)), ref, rtol=1e-5)
    # KL of the transitions: zero against itself, the formula against another model
    cfg = SDEConfig(num_steps=3, noise_level=0.8)
    policy, other = _model(seed), _model(seed + 10)
    traj = FlowSampler(cfg)(policy, jnp.array([1]), 2, jax.random.key(seed))
    batch = to_grpo_batch(traj, np.zeros(2), group_size=2, config=cfg)
    np.testing.assert_allclose(np.asarray(flow_kl(policy, policy, batch, cfg)), 0.0, atol=1e-6)
    states = np.asarray(traj.states, np.float64)
    grid = 1.0 - np.arange(4) / 3
    want = np.zeros((2, 3))
    for s in range(3):
        t, dt = grid[s], grid[s + 1] - grid[s]
        sigma = 0.8 * math.sqrt(t / (1 - min(t, grid[1])))
        x = states[:, s]
        mus = []
        for m in (policy, other):
            v = _velocity(m, x, t, np.array([1, 1]))
            mus.append(x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt)
        want[:, s] = np.sum((mus[0] - mus[1]) ** 2, axis=1) / (2 * sigma**2 * -dt)
    got = np.asarray(flow_kl(policy, other, batch, cfg))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)


def test_train_steps_mask_and_validation():
    cfg = SDEConfig(num_steps=6, noise_level=0.7, train_steps=2)
    traj = FlowSampler(cfg)(_model(0), jnp.array([0, 1]), 2, jax.random.key(1))
    batch = to_grpo_batch(traj, np.zeros(4), group_size=2, config=cfg, key=jax.random.key(2))
    mask = np.asarray(batch.completion_mask)
    np.testing.assert_array_equal(mask.sum(axis=1), 2)
    assert len({tuple(r) for r in mask}) > 1  # the steps differ between rows
    with pytest.raises(ValueError, match="needs a key"):
        to_grpo_batch(traj, np.zeros(4), group_size=2, config=cfg)
    for bad in (
        dict(num_steps=1),
        dict(noise_level=-0.1),
        dict(train_steps=0),
        dict(train_steps=7),
    ):
        with pytest.raises(ValueError, match="SDEConfig"):
            SDEConfig(**{"num_steps": 6, **bad})
    with pytest.raises(ValueError, match="noise must have shape"):
        sample_flow(_model(0), jnp.zeros(2, jnp.int32), jnp.zeros((2, 3, D)), cfg)


def _hand_surrogate_loss(model, batch, cfg, old_lp, rewards, g):
    """-mean_i mean_s min(rho A, clip(rho) A) written out (sequence-mean GRPO, beta = 0)."""
    r = rewards.reshape(-1, g)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    states = batch.prompt_ids
    b, s1, _ = states.shape
    grid = jnp.asarray(time_grid(s1 - 1))
    total = 0.0
    for s in range(s1 - 1):
        t, dt = grid[s], grid[s + 1] - grid[s]
        x = states[:, s]
        v = model(x, jnp.full((b,), t), batch.completion_ids[:, s])
        sigma = cfg.noise_level * jnp.sqrt(t / (1 - jnp.minimum(t, grid[1])))
        mu = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt
        std = sigma * jnp.sqrt(-dt)
        lp = jnp.sum(
            -((states[:, s + 1] - mu) ** 2) / (2 * std**2)
            - jnp.log(std)
            - 0.5 * jnp.log(2 * jnp.pi),
            axis=1,
        )
        rho = jnp.exp(lp - old_lp[:, s])
        term = jnp.minimum(rho * adv, jnp.clip(rho, 0.8, 1.2) * adv)
        total = total + term
    return -jnp.mean(total / (s1 - 1))


@pytest.mark.slow
def test_trainer_update_matches_hand_surrogate_on_two_step_toy():
    cfg = SDEConfig(num_steps=2, noise_level=0.9)
    model = _model(5)
    sampler = FlowSampler(cfg)
    traj = sampler(model, jnp.array([0, 1]), 3, jax.random.key(3))
    rewards = np.array([0.1, 0.7, 0.4, 0.9, 0.2, 0.5], np.float32)
    batch = to_grpo_batch(traj, rewards, group_size=3, config=cfg)
    # off-policy: the stored old log-probs differ from the policy's, so the ratio is not 1
    old = np.asarray(traj.log_probs) + np.array([[0.1, -0.05]] * 6, np.float32)
    batch = batch.replace(old_log_probs=jnp.asarray(old))
    grpo = GRPOConfig(
        num_generations=3, beta=0.0, entropy_coeff=0.0, max_grad_norm=None, advantage_eps=1e-4
    )
    lr = 0.05
    hand_model = nnx.clone(model)
    loss_hand, grads = nnx.value_and_grad(_hand_surrogate_loss)(
        hand_model, batch, cfg, jnp.asarray(old), rewards.astype(np.float64), 3
    )
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param),
        grpo,
        log_prob_fn=flow_log_prob_fn(cfg),
    )
    loss_fn_value = trainer.grpo_loss(trainer.params, batch)[0]
    np.testing.assert_allclose(float(loss_fn_value), float(loss_hand), rtol=1e-4, atol=1e-6)
    expected = jax.tree.map(lambda p, g: p - lr * g, nnx.state(hand_model, nnx.Param), grads)
    metrics = trainer.train_step(batch)
    np.testing.assert_allclose(metrics["policy_loss"], float(loss_hand), rtol=1e-4, atol=1e-6)
    got = nnx.state(model, nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_compiles_once_per_shape():
    cfg = SDEConfig(num_steps=3, noise_level=0.7, train_steps=2)
    model = _model(6)
    reference = nnx.clone(model)
    sampler = FlowSampler(cfg)
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
        GRPOConfig(num_generations=2, beta=0.05, entropy_coeff=0.0),
        reference_model=reference,
        log_prob_fn=flow_log_prob_fn(cfg),
    )
    for i in range(3):
        traj = sampler(model, jnp.array([0, 1]), 2, jax.random.key(i))
        rewards = np.asarray(jnp.mean(traj.images, axis=1))
        batch = to_grpo_batch(traj, rewards, group_size=2, config=cfg, key=jax.random.key(9 + i))
        metrics = trainer.train_step(batch)
        assert np.isfinite(metrics["total_loss"])
    assert trainer.num_compilations == 1
    assert sampler.num_compilations == 1
    sampler(model, jnp.array([0, 1, 2]), 2, jax.random.key(0))  # a new shape compiles again
    assert sampler.num_compilations == 2
