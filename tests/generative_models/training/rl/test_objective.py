"""The whole GRPO objective vs. an independent float64 NumPy implementation, every option."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.training.rl import GRPOBatch, GRPOConfig, grpo_objective


# ------------------------------------------------------------------ independent reference
def np_objective(logp, ent, old, ref, mask, rewards, cfg: GRPOConfig, g: int):
    """Written loop-by-loop from the formulas, without reusing library code."""
    logp = np.asarray(logp, np.float64)
    b, t = logp.shape
    # advantages
    adv = np.zeros(b)
    all_valid = rewards[~np.isnan(rewards)].astype(np.float64)
    batch_std = all_valid.std(ddof=cfg.std_ddof) if all_valid.size > cfg.std_ddof else 0.0
    for k in range(b // g):
        rows = [i for i in range(k * g, (k + 1) * g) if not np.isnan(rewards[i])]
        vals = np.array([rewards[i] for i in rows], np.float64)
        n = len(rows)
        for j, i in enumerate(rows):
            if cfg.baseline == "group_mean":
                a = vals[j] - vals.mean()
            else:
                a = vals[j] - (vals.sum() - vals[j]) / (n - 1) if n > 1 else 0.0
            if cfg.scale_rewards == "group":
                std = vals.std(ddof=cfg.std_ddof) if n > cfg.std_ddof else 0.0
                a /= std + cfg.advantage_eps
            elif cfg.scale_rewards == "batch":
                a /= batch_std + cfg.advantage_eps
            adv[i] = a
    lo, hi = cfg.clip_param, cfg.clip_param if cfg.clip_param_high is None else cfg.clip_param_high
    per_tok = np.zeros((b, t))
    for i in range(b):
        valid = [s for s in range(t) if mask[i, s] > 0]
        if old is None:
            diffs = {s: 0.0 for s in valid}
        else:
            diffs = {s: logp[i, s] - old[i, s] for s in valid}
        seq = np.mean(list(diffs.values())) if valid else 0.0
        for s in valid:
            lr = diffs[s] if cfg.importance_sampling_level == "token" else seq
            r = np.exp(lr)
            a = adv[i]
            obj = min(r * a, np.clip(r, 1 - lo, 1 + hi) * a)
            if cfg.dual_clip is not None and a < 0:
                obj = max(obj, cfg.dual_clip * a)
            loss = -obj
            if cfg.beta > 0 and ref is not None:
                x = ref[i, s] - logp[i, s]
                kl = {"k1": -x, "k2": 0.5 * x * x, "k3": np.exp(x) - x - 1}[cfg.kl_estimator]
                loss += cfg.beta * kl
            loss -= cfg.entropy_coeff * ent[i, s]
            per_tok[i, s] = loss
    if cfg.loss_aggregation == "sequence_mean":
        return np.mean([per_tok[i][mask[i] > 0].mean() if mask[i].sum() else 0.0 for i in range(b)])
    if cfg.loss_aggregation == "token_mean":
        return per_tok.sum() / max(mask.sum(), 1)
    length = t if cfg.max_completion_length is None else cfg.max_completion_length
    return per_tok.sum() / (b * length)


def make_case(seed, g=4, prompts=3, t=6):
    rng = np.random.default_rng(seed)
    b = g * prompts
    lengths = rng.integers(1, t + 1, size=b)
    lengths[2] = 0  # an empty completion
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    logp = (-rng.gamma(2.0, 0.7, size=(b, t))).astype(np.float32)
    old = (logp + rng.normal(scale=0.25, size=(b, t))).astype(np.float32)
    ref = (logp + rng.normal(scale=0.4, size=(b, t))).astype(np.float32)
    ent = rng.uniform(0.1, 3.0, size=(b, t)).astype(np.float32)
    rewards = rng.choice([0.0, 0.25, 1.0], size=b).astype(np.float32)
    rewards[5] = np.nan
    rewards[g * 2 : g * 3] = 1.0  # a constant group
    return logp, ent, old, ref, mask, rewards


CONFIGS = {
    "grpo_default": GRPOConfig(),
    "population_std": GRPOConfig(std_ddof=0),
    "batch_std": GRPOConfig(scale_rewards="batch"),
    "dr_grpo": GRPOConfig(scale_rewards="none", loss_aggregation="constant_length", beta=0.0),
    "dr_grpo_fixed_len": GRPOConfig(
        scale_rewards="none", loss_aggregation="constant_length", max_completion_length=10
    ),
    "dapo": GRPOConfig(clip_param_high=0.28, loss_aggregation="token_mean", beta=0.0),
    "gspo": GRPOConfig(importance_sampling_level="sequence", clip_param=3e-4, clip_param_high=4e-4),
    "gspo_wide": GRPOConfig(importance_sampling_level="sequence", clip_param=0.1),
    "rloo": GRPOConfig(baseline="leave_one_out", scale_rewards="none"),
    "dual_clip": GRPOConfig(dual_clip=2.0, clip_param=0.1),
    "k1": GRPOConfig(kl_estimator="k1", beta=0.1),
    "k2": GRPOConfig(kl_estimator="k2", beta=0.1),
    "no_entropy": GRPOConfig(entropy_coeff=0.0),
    "eps_large": GRPOConfig(advantage_eps=0.5),
}


def batch_of(logp, old, ref, mask, rewards, g, *, with_old=True, with_ref=True):
    b, t = logp.shape
    return GRPOBatch(
        prompt_ids=jnp.zeros((b, 2), jnp.int32),
        completion_ids=jnp.zeros((b, t), jnp.int32),
        completion_mask=jnp.asarray(mask),
        rewards=jnp.asarray(rewards),
        old_log_probs=jnp.asarray(old) if with_old else None,
        ref_log_probs=jnp.asarray(ref) if with_ref else None,
        group_size=g,
    )


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_old", [True, False])
def test_objective_matches_numpy(name, seed, with_old):
    cfg = CONFIGS[name]
    logp, ent, old, ref, mask, rewards = make_case(seed)
    batch = batch_of(logp, old, ref, mask, rewards, 4, with_old=with_old)
    loss, metrics = jax.jit(lambda lp, e, bt: grpo_objective(lp, e, bt, cfg))(logp, ent, batch)
    want = np_objective(logp, ent, old if with_old else None, ref, mask, rewards, cfg, 4)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=2e-6)
    # The reported parts add up to the total.
    parts = metrics["policy_loss"] + metrics["kl_penalty"] - cfg.entropy_coeff * metrics["entropy"]
    np.testing.assert_allclose(float(parts), float(metrics["total_loss"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["total_loss"]), float(loss), rtol=1e-6)


@pytest.mark.parametrize("name", ["grpo_default", "dapo", "gspo_wide", "dual_clip", "k2", "rloo"])
@pytest.mark.parametrize("seed", [0, 1])
def test_objective_gradient_matches_finite_differences(name, seed):
    cfg = CONFIGS[name]
    logp, ent, old, ref, mask, rewards = make_case(seed)
    batch = batch_of(logp, old, ref, mask, rewards, 4)
    grad = np.asarray(jax.grad(lambda lp: grpo_objective(lp, ent, batch, cfg)[0])(logp))
    h = 1e-6
    num = np.zeros(logp.shape)
    for idx in np.ndindex(logp.shape):
        up, dn = logp.astype(np.float64), logp.astype(np.float64)
        up[idx] += h
        dn[idx] -= h
        num[idx] = (
            np_objective(up, ent, old, ref, mask, rewards, cfg, 4)
            - np_objective(dn, ent, old, ref, mask, rewards, cfg, 4)
        ) / (2 * h)
    np.testing.assert_allclose(grad, num, rtol=2e-3, atol=2e-5)
    assert np.all(grad[mask == 0] == 0.0)


def test_metrics_against_numpy():
    cfg = GRPOConfig(clip_param=0.1)
    logp, ent, old, ref, mask, rewards = make_case(5)
    batch = batch_of(logp, old, ref, mask, rewards, 4)
    _, m = grpo_objective(logp, ent, batch, cfg)
    valid = ~np.isnan(rewards)
    np.testing.assert_allclose(m["reward_mean"], rewards[valid].mean(), rtol=1e-6)
    np.testing.assert_allclose(m["reward_std"], rewards[valid].std(), rtol=1e-5)
    groups = [rewards[k * 4 : (k + 1) * 4] for k in range(3)]
    zero_std = np.mean([np.nanstd(gr) == 0 for gr in groups])
    np.testing.assert_allclose(m["frac_reward_zero_std"], zero_std)
    r = np.exp(logp.astype(np.float64) - old)
    adv = np.zeros(12)
    for k in range(3):
        gr = rewards[k * 4 : (k + 1) * 4]
        v = ~np.isnan(gr)
        a = np.zeros(4)
        a[v] = (gr[v] - gr[v].mean()) / (gr[v].std(ddof=1) + 1e-4)
        adv[k * 4 : (k + 1) * 4] = a
    np.testing.assert_allclose(m["advantage_mean"], adv[valid].mean(), atol=1e-6)
    np.testing.assert_allclose(m["advantage_std"], adv[valid].std(), rtol=1e-5)
    a2 = np.broadcast_to(adv[:, None], r.shape)
    mk = mask > 0
    np.testing.assert_allclose(m["clip_fraction_low"], ((r < 0.9) & (a2 < 0))[mk].mean(), rtol=1e-6)
    np.testing.assert_allclose(
        m["clip_fraction_high"], ((r > 1.1) & (a2 > 0))[mk].mean(), rtol=1e-6
    )
    np.testing.assert_allclose(m["approx_kl"], (r - 1 - np.log(r))[mk].mean(), rtol=1e-4)
    np.testing.assert_allclose(m["completion_length"], mask.sum(1).mean(), rtol=1e-6)


def test_kl_skipped_without_reference_and_at_beta_zero():
    logp, ent, old, ref, mask, rewards = make_case(0)
    with_ref = batch_of(logp, old, ref, mask, rewards, 4)
    no_ref = batch_of(logp, old, ref, mask, rewards, 4, with_ref=False)
    _, m = grpo_objective(logp, ent, no_ref, GRPOConfig(beta=0.5))
    assert float(m["kl"]) == 0.0
    _, m = grpo_objective(logp, ent, with_ref, GRPOConfig(beta=0.0))
    assert float(m["kl"]) == 0.0
    _, m = grpo_objective(logp, ent, with_ref, GRPOConfig(beta=0.5))
    assert float(m["kl"]) > 0.0
    np.testing.assert_allclose(float(m["kl_penalty"]), 0.5 * float(m["kl"]), rtol=1e-6)


def test_precomputed_and_token_advantages_are_used():
    logp, ent, old, ref, mask, rewards = make_case(1)
    cfg = GRPOConfig(beta=0.0, entropy_coeff=0.0)
    adv_tok = np.random.default_rng(0).normal(size=logp.shape).astype(np.float32)
    batch = batch_of(logp, old, ref, mask, rewards, 4).replace(advantages=jnp.asarray(adv_tok))
    loss, _ = grpo_objective(logp, ent, batch, cfg)
    r = np.exp(logp.astype(np.float64) - old)
    per = -np.minimum(r * adv_tok, np.clip(r, 0.8, 1.2) * adv_tok)
    want = np.mean([per[i][mask[i] > 0].mean() if mask[i].sum() else 0 for i in range(12)])
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_entropy_required_when_coefficient_positive():
    logp, _, old, ref, mask, rewards = make_case(0)
    batch = batch_of(logp, old, ref, mask, rewards, 4)
    with pytest.raises(ValueError, match="entropy_coeff"):
        grpo_objective(logp, None, batch, GRPOConfig())
    loss, _ = grpo_objective(logp, None, batch, GRPOConfig(entropy_coeff=0.0))
    assert np.isfinite(float(loss))


def test_every_policy_loss_setting_has_its_loss_and_no_other():
    """The objective picks the policy loss from a table: one entry per accepted setting."""
    from artifex.generative_models.training.rl.core.configs import _CHOICES
    from artifex.generative_models.training.rl.core.objective import POLICY_LOSSES

    assert set(POLICY_LOSSES) == set(_CHOICES["policy_loss"])
