"""Flow trajectories as GRPO batches: the layout, the log-prob hook, the exact KL, windows."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    FlowConditioning,
    FlowModel,
    FlowModelConfig,
    FlowSampler,
    SDEConfig,
    flow_grpo_objective,
    flow_kl,
    flow_log_prob_fn,
    time_grid,
    to_grpo_batch,
)
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


def _velocity(model, x: np.ndarray, t: float, labels: np.ndarray) -> np.ndarray:
    tt = jnp.full((x.shape[0],), t, jnp.float32)
    return np.asarray(model(jnp.asarray(x, jnp.float32), tt, jnp.asarray(labels)), np.float64)


def _np_means(model, states, labels, steps, num_steps, a):
    """Float64 transition means and stds at the given steps: ``(B, K, D)``, ``(K,)`` per row."""
    grid = 1.0 - np.arange(num_steps + 1, dtype=np.float64) / num_steps
    b, k = steps.shape
    mus = np.zeros((b, k, states.shape[-1]))
    stds = np.zeros((b, k))
    for i in range(b):
        for j in range(k):
            s = int(steps[i, j])
            t, dt = grid[s], grid[s + 1] - grid[s]
            x = states[i : i + 1, s]
            v = _velocity(model, x, t, labels[i : i + 1])
            sigma = a * math.sqrt(t / (1 - min(t, grid[1])))
            mus[i, j] = (x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt)[0]
            stds[i, j] = sigma * math.sqrt(-dt)
    return mus, stds


def test_hook_recovers_sampler_log_probs_and_entropy():
    model = _model(4)
    cfg = SDEConfig(num_steps=4, noise_level=0.5)
    traj = FlowSampler(cfg)(model, jnp.array([0, 2]), 3, jax.random.key(0))
    batch = to_grpo_batch(traj, np.arange(6.0), group_size=3, config=cfg).validate()
    np.testing.assert_array_equal(np.asarray(batch.completion_ids), [[0, 1, 2, 3]] * 6)
    lp, ent = flow_log_prob_fn(cfg)(model, batch)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(traj.log_probs), rtol=1e-5, atol=1e-4)
    # entropy of N(mu, std^2 I): D/2 log(2 pi e std^2)
    grid = time_grid(4).astype(np.float64)
    sigma = 0.5 * np.sqrt(grid[:-1] / (1 - np.minimum(grid[:-1], grid[1])))
    std = sigma * np.sqrt(grid[:-1] - grid[1:])
    np.testing.assert_allclose(
        np.asarray(ent[0]), 0.5 * D * np.log(2 * np.pi * np.e * std**2), rtol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(batch.conditioning.prompts), [0, 0, 0, 2, 2, 2])
    assert batch.conditioning.sde == cfg


@pytest.mark.parametrize(
    "cfg",
    [
        SDEConfig(num_steps=6, noise_level=0.7, window_size=2),
        SDEConfig(num_steps=6, noise_level=0.7, train_steps=2),
        SDEConfig(num_steps=6, noise_level=0.7, window_size=3, train_steps=2),
    ],
    ids=["window", "subset", "window-subset"],
)
def test_only_trained_steps_reach_the_model(cfg):
    """The hook evaluates the model on B * K transitions, never on the other S - K steps."""
    model = _model(1)
    traj = FlowSampler(cfg)(model, jnp.array([0, 1]), 2, jax.random.key(3))
    batch = to_grpo_batch(traj, np.arange(4.0), group_size=2, key=jax.random.key(5))
    steps = np.asarray(batch.completion_ids)
    k = cfg.num_trained_steps
    stochastic = np.asarray(traj.stochastic)
    assert steps.shape == (4, k) and (np.diff(steps, axis=1) > 0).all()
    assert all(stochastic[i, steps[i]].all() for i in range(4))  # SDE steps only
    if cfg.train_steps is not None:
        assert len({tuple(r) for r in steps}) > 1  # the subset differs between rows
    seen = []

    def counting(x, t, labels):
        seen.append(x.shape)
        return model(x, t, labels)

    counting.config = model.config
    lp, _ = flow_log_prob_fn(cfg)(counting, batch)
    assert seen == [(4 * k, D)]  # one call on the trained transitions only
    want = np.take_along_axis(np.asarray(traj.log_probs), steps, axis=1)
    np.testing.assert_allclose(np.asarray(lp), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(batch.old_log_probs), want, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_exact_kl_against_float64(seed):
    cfg = SDEConfig(num_steps=5, noise_level=0.8, window_size=3)
    policy, other = _model(seed), _model(seed + 10)
    traj = FlowSampler(cfg)(policy, jnp.array([1, 2]), 2, jax.random.key(seed))
    batch = to_grpo_batch(traj, np.zeros(4), group_size=2)
    np.testing.assert_allclose(np.asarray(flow_kl(policy, policy, batch, cfg)), 0.0, atol=1e-6)
    states = np.asarray(traj.states, np.float64)
    labels = np.asarray(traj.prompts)
    steps = np.asarray(batch.completion_ids)
    mu, std = _np_means(policy, states, labels, steps, 5, 0.8)
    mu_ref, _ = _np_means(other, states, labels, steps, 5, 0.8)
    want = np.sum((mu - mu_ref) ** 2, axis=-1) / (2 * std**2)
    got = flow_log_prob_fn(cfg).log_probs_and_kl(policy, other, batch)
    np.testing.assert_allclose(np.asarray(got[2]), want, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(np.asarray(flow_kl(policy, other, batch, cfg)), want, rtol=1e-3)
    assert want.min() > 0


def _trainer(model, reference, grpo, cfg, lr=0.05):
    return GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param),
        grpo,
        reference_model=reference,
        log_prob_fn=flow_log_prob_fn(cfg),
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_trainer_exact_kl_is_the_float64_gaussian_kl(seed):
    """GRPOConfig(kl_estimator="exact"): the step's KL metric and loss use the closed form."""
    cfg = SDEConfig(num_steps=4, noise_level=0.6, window_size=2)
    policy, reference = _model(seed), _model(seed + 5)
    traj = FlowSampler(cfg)(policy, jnp.array([0, 1]), 2, jax.random.key(seed))
    rewards = np.array([0.0, 1.0, 0.3, 0.2], np.float32)
    batch = to_grpo_batch(traj, rewards, group_size=2)
    beta = 0.3
    grpo = GRPOConfig(
        num_generations=2, beta=beta, kl_estimator="exact", entropy_coeff=0.0, max_grad_norm=None
    )
    states = np.asarray(traj.states, np.float64)
    steps = np.asarray(batch.completion_ids)
    mu, std = _np_means(policy, states, np.asarray(traj.prompts), steps, 4, 0.6)
    mu_ref, _ = _np_means(reference, states, np.asarray(traj.prompts), steps, 4, 0.6)
    kl_ref = np.mean(np.mean(np.sum((mu - mu_ref) ** 2, axis=-1) / (2 * std**2), axis=1))
    # the pure objective and the trainer's loss and gradient agree
    loss, metrics = flow_grpo_objective(policy, reference, batch, grpo, cfg)
    np.testing.assert_allclose(float(metrics["kl"]), kl_ref, rtol=1e-3)
    grads = nnx.grad(lambda m: flow_grpo_objective(m, reference, batch, grpo, cfg)[0])(policy)
    expected = jax.tree.map(lambda p, g: p - 0.05 * g, nnx.state(policy, nnx.Param), grads)
    trainer = _trainer(policy, reference, grpo, cfg)
    step_metrics = trainer.train_step(batch)
    np.testing.assert_allclose(step_metrics["kl"], kl_ref, rtol=1e-3)
    np.testing.assert_allclose(step_metrics["kl_penalty"], beta * kl_ref, rtol=1e-3)
    np.testing.assert_allclose(step_metrics["total_loss"], float(loss), rtol=1e-4, atol=1e-6)
    got = nnx.state(policy, nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    # k3 on the same batch is a different (sampled) number: the option changes the KL
    k3 = _trainer(_model(seed), _model(seed + 5), grpo.replace(kl_estimator="k3"), cfg)
    assert abs(k3.train_step(batch)["kl"] - kl_ref) > 1e-4


@pytest.mark.slow
def test_exact_kl_gradient_vanishes_at_the_reference():
    sde = SDEConfig(num_steps=2, noise_level=0.8)
    policy = _model(3)
    traj = FlowSampler(sde)(policy, jnp.array([1]), 2, jax.random.key(0))
    batch = to_grpo_batch(traj, np.array([0.0, 0.0]), group_size=2)
    cfg = GRPOConfig(num_generations=2, beta=1.0, entropy_coeff=0.0)
    # equal rewards: advantages 0, so the gradient is the KL's; at the reference it is 0
    grads = nnx.grad(lambda m: flow_grpo_objective(m, _model(3), batch, cfg, sde)[0])(policy)
    assert all(float(jnp.max(jnp.abs(g))) < 1e-6 for g in jax.tree.leaves(grads))
    grads = nnx.grad(lambda m: flow_grpo_objective(m, _model(4), batch, cfg, sde)[0])(policy)
    assert any(float(jnp.max(jnp.abs(g))) > 1e-4 for g in jax.tree.leaves(grads))
    _, m0 = flow_grpo_objective(policy, None, batch, cfg, sde)
    assert float(m0["kl"]) == 0.0


def _hand_surrogate_loss(model, batch, cfg, old_lp, rewards, g):
    """-mean_i mean_s min(rho A, clip(rho) A) written out (sequence-mean GRPO, beta = 0)."""
    r = rewards.reshape(-1, g)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    states = batch.prompt_ids
    labels = batch.conditioning.prompts
    b, s1, _ = states.shape
    grid = jnp.asarray(time_grid(s1 - 1))
    total = 0.0
    for s in range(s1 - 1):
        t, dt = grid[s], grid[s + 1] - grid[s]
        x = states[:, s]
        v = model(x, jnp.full((b,), t), labels)
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
    traj = FlowSampler(cfg)(model, jnp.array([0, 1]), 3, jax.random.key(3))
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
    trainer = _trainer(model, None, grpo, cfg, lr)
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
def test_compiles_once_per_shape_with_a_window():
    cfg = SDEConfig(num_steps=4, noise_level=0.7, window_size=2)
    model = _model(6)
    sampler = FlowSampler(cfg)
    grpo = GRPOConfig(num_generations=2, beta=0.05, kl_estimator="exact", entropy_coeff=0.0)
    trainer = _trainer(model, nnx.clone(model), grpo, cfg, 1e-3)
    for i in range(3):  # the window moves; the shapes do not
        traj = sampler(model, jnp.array([0, 1]), 2, jax.random.key(i))
        rewards = np.asarray(jnp.mean(traj.images, axis=1))
        metrics = trainer.train_step(to_grpo_batch(traj, rewards, group_size=2))
        assert np.isfinite(metrics["total_loss"])
    assert trainer.num_compilations == 1
    assert sampler.num_compilations == 1


def test_to_grpo_batch_validation():
    cfg = SDEConfig(num_steps=4, noise_level=0.7, train_steps=2)
    traj = FlowSampler(cfg)(_model(0), jnp.array([0, 1]), 2, jax.random.key(1))
    with pytest.raises(ValueError, match="needs a key"):
        to_grpo_batch(traj, np.zeros(4), group_size=2)
    for bad in (np.zeros(3), np.zeros(5), np.zeros((4, 1)), [0.0, 1.0]):
        with pytest.raises(ValueError, match=r"rewards must have shape \(4,\) \(one per traj"):
            to_grpo_batch(traj, bad, group_size=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="rewards must be finite or NaN"):
        to_grpo_batch(traj, [0.0, np.inf, 0.0, 0.0], group_size=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="not a multiple of group_size 3"):
        to_grpo_batch(traj, np.zeros(4), group_size=3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="differs from the settings the trajectory"):
        to_grpo_batch(traj, np.zeros(4), group_size=2, config=SDEConfig(num_steps=4))
    with pytest.raises(TypeError, match="trajectory must be a FlowTrajectory"):
        to_grpo_batch((traj.states, traj.log_probs), np.zeros(4), group_size=2)
    ode = FlowSampler(SDEConfig(num_steps=4, noise_level=0.0))(
        _model(0), jnp.array([0]), 2, jax.random.key(0)
    )
    with pytest.raises(ValueError, match="needs SDE trajectories"):
        to_grpo_batch(ode, np.zeros(2), group_size=2)
    with pytest.raises(ValueError, match="noise_level > 0"):
        flow_log_prob_fn(SDEConfig(noise_level=0.0))
    # NaN rewards are "no reward", kept
    batch = to_grpo_batch(traj, [0.0, np.nan, 1.0, 0.0], group_size=2, key=jax.random.key(0))
    assert np.isnan(np.asarray(batch.rewards)[1])


def test_objective_told_other_sampler_settings_is_refused():
    sampled = SDEConfig(num_steps=3, noise_level=0.7)
    model = _model(0)
    batch = to_grpo_batch(
        FlowSampler(sampled)(model, jnp.array([0]), 2, jax.random.key(0)), [0.0, 1.0], group_size=2
    )
    grpo = GRPOConfig(num_generations=2, beta=0.1)
    for told in (SDEConfig(num_steps=3, noise_level=0.5), SDEConfig(num_steps=4, noise_level=0.7)):
        match = r"sampled with num_steps=3, noise_level=0.7, but this log-prob function"
        with pytest.raises(ValueError, match=match):
            flow_log_prob_fn(told)(model, batch)
        with pytest.raises(ValueError, match=match):
            flow_grpo_objective(model, nnx.clone(model), batch, grpo, told)
        trainer = _trainer(model, None, grpo.replace(beta=0.0), told)
        with pytest.raises(ValueError, match=match):  # refused when the step is traced
            trainer.train_step(batch)
    with pytest.raises(TypeError, match=r"needs GRPOBatch\.conditioning = FlowConditioning"):
        flow_log_prob_fn(sampled)(model, batch.replace(conditioning=batch.conditioning.prompts))
    with pytest.raises(ValueError, match="conditioning arrays must have 2 rows"):
        batch.replace(
            conditioning=FlowConditioning(prompts=jnp.zeros(3, jnp.int32), sde=sampled)
        ).validate()


def test_exact_kl_needs_a_hook_with_a_closed_form():
    model = _model(0)
    grpo = GRPOConfig(num_generations=2, beta=0.1, kl_estimator="exact")
    with pytest.raises(ValueError, match="kl_estimator='exact' needs a log_prob_fn with a closed"):
        GRPOTrainer(
            model,
            nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
            grpo,
            log_prob_fn=lambda m, b: (None, None),
        )
    lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="got categorical_log_probs"):
        GRPOTrainer(lin, nnx.Optimizer(lin, optax.sgd(0.1), wrt=nnx.Param), grpo)
