"""Loss pieces vs. independent float64 NumPy references, with padding and several seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.training.rl import (
    aggregate_loss,
    approx_kl_old,
    clipped_surrogate,
    entropy_from_logits,
    kl_divergence,
    log_importance_ratio,
    loss_normalizer,
    masked_mean,
)

SEEDS = [0, 1, 2]


def make_inputs(seed, b=6, t=7):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, size=b)
    lengths[0] = t  # one full row
    lengths[1] = 0  # one empty row
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    logp = (-rng.gamma(2.0, 1.0, size=(b, t))).astype(np.float32)
    old = (logp + rng.normal(scale=0.3, size=(b, t))).astype(np.float32)
    ref = (logp + rng.normal(scale=0.5, size=(b, t))).astype(np.float32)
    # Garbage at padded positions must never leak into results.
    old = np.where(mask > 0, old, 1e30).astype(np.float32)
    ref = np.where(mask > 0, ref, -1e30).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    return logp, old, ref, mask, adv


# ------------------------------------------------------------------ references
def np_log_ratio(logp, old, mask, level):
    out = np.zeros(logp.shape)
    for i in range(logp.shape[0]):
        idx = mask[i] > 0
        d = logp[i, idx].astype(np.float64) - old[i, idx]
        out[i, idx] = d if level == "token" else (d.mean() if d.size else 0.0)
    return out


def np_surrogate(log_ratio, adv, mask, lo, hi, dual):
    out = np.zeros(log_ratio.shape)
    for i in range(log_ratio.shape[0]):
        for t in range(log_ratio.shape[1]):
            if mask[i, t] == 0:
                continue
            a = adv[i] if adv.ndim == 1 else adv[i, t]
            r = np.exp(log_ratio[i, t])
            obj = min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
            if dual is not None and a < 0:
                obj = max(obj, dual * a)
            out[i, t] = -obj
    return out


def np_kl(logp, ref, mask, est):
    lr = np.where(mask > 0, ref.astype(np.float64) - logp, 0.0)
    k = {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - lr - 1}[est]
    return np.where(mask > 0, k, 0.0)


def np_aggregate(x, mask, mode, max_length=None):
    b, t = x.shape
    if mode == "sequence_mean":
        rows = [x[i][mask[i] > 0].mean() if mask[i].sum() else 0.0 for i in range(b)]
        return float(np.mean(rows))
    total = float(np.sum(np.where(mask > 0, x, 0.0)))
    if mode == "token_mean":
        return total / max(mask.sum(), 1)
    return total / (b * (t if max_length is None else max_length))


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_log_importance_ratio(seed, level):
    logp, old, _, mask, _ = make_inputs(seed)
    got = np.asarray(log_importance_ratio(logp, old, mask, level=level))
    np.testing.assert_allclose(got, np_log_ratio(logp, old, mask, level), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_ratio_is_one_with_gradient_of_log_pi(level):
    logp, _, _, mask, _ = make_inputs(0)
    lr = log_importance_ratio(logp, None, mask, level=level)
    assert np.all(np.asarray(lr) == 0.0)
    grad = jax.grad(
        lambda lp: jnp.sum(jnp.exp(log_importance_ratio(lp, None, mask, level=level)) * mask)
    )(jnp.asarray(logp))
    if level == "token":
        np.testing.assert_allclose(grad, mask, atol=1e-6)
    else:  # d/dlogp_t of sum_t exp(mean(logp - sg)) = n_i * (1/n_i) for valid tokens
        np.testing.assert_allclose(grad, mask, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "lo,hi,dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0), (3e-4, 4e-4, None)]
)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_clipped_surrogate(seed, lo, hi, dual, per_token_adv):
    logp, old, _, mask, adv = make_inputs(seed)
    if per_token_adv:
        adv = np.random.default_rng(seed + 10).normal(size=logp.shape).astype(np.float32)
    lr = np_log_ratio(logp, old, mask, "token").astype(np.float32)
    loss, low, high = clipped_surrogate(
        lr, adv, mask, epsilon_low=lo, epsilon_high=hi, dual_clip=dual
    )
    np.testing.assert_allclose(
        loss, np_surrogate(lr, adv, mask, lo, hi, dual), rtol=1e-5, atol=1e-6
    )
    a = adv[:, None] if adv.ndim == 1 else adv
    r = np.exp(lr.astype(np.float64))
    np.testing.assert_array_equal(low, ((r < 1 - lo) & (a < 0) & (mask > 0)).astype(np.float32))
    np.testing.assert_array_equal(high, ((r > 1 + hi) & (a > 0) & (mask > 0)).astype(np.float32))


def test_dual_clip_bounds_loss_for_negative_advantages():
    lr = np.log(np.array([[100.0, 0.5, 2.0]], np.float32))
    adv = np.array([-1.0], np.float32)
    mask = np.ones((1, 3), np.float32)
    loss, _, _ = clipped_surrogate(lr, adv, mask, epsilon_low=0.2, epsilon_high=0.2, dual_clip=3)
    np.testing.assert_allclose(loss, [[3.0, 0.8, 2.0]], rtol=1e-6)
    loss, _, _ = clipped_surrogate(lr, adv, mask, epsilon_low=0.2, epsilon_high=0.2)
    np.testing.assert_allclose(loss, [[100.0, 0.8, 2.0]], rtol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators(seed, est):
    logp, _, ref, mask, _ = make_inputs(seed)
    got = np.asarray(kl_divergence(logp, ref, mask, estimator=est))
    np.testing.assert_allclose(got, np_kl(logp, ref, mask, est), rtol=1e-5, atol=1e-6)
    if est == "k3":
        assert np.all(got >= 0)


def test_kl_estimators_are_unbiased_on_known_distributions():
    # Sample from p, estimate KL[p || q] for two categoricals; compare with the exact value.
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.3, 0.3, 0.4])
    exact = float(np.sum(p * np.log(p / q)))
    x = rng.choice(3, size=200_000, p=p)
    logp = np.log(p[x])[None, :].astype(np.float32)
    logq = np.log(q[x])[None, :].astype(np.float32)
    mask = np.ones_like(logp)
    for est in ("k1", "k3"):
        est_value = float(jnp.mean(kl_divergence(logp, logq, mask, estimator=est)))
        assert abs(est_value - exact) < 3e-3, (est, est_value, exact)


@pytest.mark.parametrize("seed", SEEDS)
def test_approx_kl_old(seed):
    logp, old, _, mask, _ = make_inputs(seed)
    lr = np_log_ratio(logp, old, mask, "token")
    want = np.where(mask > 0, np.exp(lr) - 1 - lr, 0.0)
    np.testing.assert_allclose(
        approx_kl_old(lr.astype(np.float32), mask), want, rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_from_logits(seed):
    z = np.random.default_rng(seed).normal(scale=3, size=(4, 5, 11)).astype(np.float32)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -np.sum(p * np.log(p), axis=-1)
    np.testing.assert_allclose(entropy_from_logits(z), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["sequence_mean", "token_mean", "constant_length"])
@pytest.mark.parametrize("max_length", [None, 12])
def test_aggregate_loss(seed, mode, max_length):
    x, _, _, mask, _ = make_inputs(seed)
    x = np.where(mask > 0, x, np.nan).astype(np.float32)  # NaN padding must not leak
    got = float(aggregate_loss(x, mask, mode, max_length=max_length))
    want = np_aggregate(np.nan_to_num(x), mask, mode, max_length)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("mode", ["sequence_mean", "token_mean", "constant_length"])
def test_aggregation_splits_over_microbatches_exactly(mode):
    x, _, _, mask, _ = make_inputs(4, b=8)
    full = float(aggregate_loss(x, mask, mode))
    norm = loss_normalizer(mask, mode)
    parts = sum(
        float(aggregate_loss(x[i : i + 2], mask[i : i + 2], mode, normalizer=norm))
        for i in range(0, 8, 2)
    )
    np.testing.assert_allclose(parts, full, rtol=1e-6)


def test_empty_mask_gives_finite_zero():
    x = np.full((2, 3), np.inf, np.float32)
    mask = np.zeros((2, 3), np.float32)
    for mode in ("sequence_mean", "token_mean", "constant_length"):
        assert float(aggregate_loss(x, mask, mode)) == 0.0
    assert float(masked_mean(x, mask)) == 0.0
