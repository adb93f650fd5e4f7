"""GRPO on flow trajectories with the closed-form per-step KL (the pure objective)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    FlowModel,
    FlowModelConfig,
    FlowSampler,
    SDEConfig,
    flow_grpo_objective,
    flow_log_prob_fn,
    to_grpo_batch,
)
from artifex.generative_models.training.rl.configs import GRPOConfig
from artifex.generative_models.training.rl.grpo import grpo_objective


def _model(seed: int) -> FlowModel:
    cfg = FlowModelConfig(image_shape=(2, 3), num_classes=2, hidden_dim=8, num_blocks=1)
    model = FlowModel(cfg, rngs=nnx.Rngs(seed))
    model.output.kernel[...] = 0.5 * jax.random.normal(jax.random.key(seed), (8, 6))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_closed_form_kl_term_against_numpy(seed):
    sde = SDEConfig(num_steps=3, noise_level=0.6, train_steps=2)
    policy, reference = _model(seed), _model(seed + 5)
    traj = FlowSampler(sde)(policy, jnp.array([0, 1]), 2, jax.random.key(seed))
    rewards = np.array([0.0, 1.0, 0.3, 0.2], np.float32)
    batch = to_grpo_batch(traj, rewards, group_size=2, config=sde, key=jax.random.key(7))
    beta = 0.3
    cfg = GRPOConfig(num_generations=2, beta=beta, entropy_coeff=0.0)
    total, metrics = flow_grpo_objective(policy, reference, batch, cfg, sde)

    # float64 reference of the KL term at every step, then the sequence mean over the trained
    states = np.asarray(traj.states, np.float64)
    labels = np.asarray(traj.prompts)
    steps = np.asarray(batch.completion_ids)
    grid = 1.0 - np.arange(4) / 3
    kl = np.zeros((4, 3))
    for s in range(3):
        t, dt = grid[s], grid[s + 1] - grid[s]
        sigma = 0.6 * math.sqrt(t / (1 - min(t, grid[1])))
        mus = []
        for m in (policy, reference):
            v = np.asarray(
                m(jnp.asarray(states[:, s], jnp.float32), jnp.full((4,), t), labels), np.float64
            )
            mus.append(states[:, s] + (v + sigma**2 / (2 * t) * (states[:, s] + (1 - t) * v)) * dt)
        kl[:, s] = np.sum((mus[0] - mus[1]) ** 2, axis=1) / (2 * sigma**2 * -dt)
    kl_ref = np.mean(np.take_along_axis(kl, steps, axis=1).mean(axis=1))
    np.testing.assert_allclose(metrics["kl"], kl_ref, rtol=1e-3)
    lp, ent = flow_log_prob_fn(sde)(policy, batch)
    base, _ = grpo_objective(
        lp, ent, batch, GRPOConfig(num_generations=2, beta=0.0, entropy_coeff=0.0)
    )
    np.testing.assert_allclose(float(total), float(base) + beta * kl_ref, rtol=1e-3, atol=1e-6)
    assert kl_ref > 0
