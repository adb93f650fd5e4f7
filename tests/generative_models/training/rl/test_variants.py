"""The 2025-2026 variants vs. float64 NumPy references; split invariance; bf16; mesh; ragged.

Each pure function is checked against an independent float64 reference written here, on
random inputs with padding, several seeds. TRL parity of the whole objective is in
``test_trl_parity.py``.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.training.rl import (
    GRPOBatch,
    GRPOConfig,
    GRPOTrainer,
    advantages_from_config,
    aggregate_loss,
    cispo_surrogate,
    entropy_quantile_threshold,
    grpo_objective,
    high_entropy_mask,
    log_importance_ratio,
    loss_normalizer,
    off_policy_sequence_mask,
    pass_at_k_advantages,
    reinforce_pp_advantages,
    sampler_importance_weights,
    sapo_surrogate,
    vespo_weights,
)

SEEDS = [0, 1, 2]


def make_inputs(seed, b=8, t=6):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    lengths[0] = t
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    logp = rng.uniform(-3.0, -0.05, (b, t)).astype(np.float32)
    old = (logp + rng.normal(0, 0.4, (b, t))).astype(np.float32)
    sampler = (old + rng.normal(0, 0.4, (b, t))).astype(np.float32)
    ent = rng.uniform(0, 3, (b, t)).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    # Garbage at padding must not leak.
    old = np.where(mask > 0, old, 1e30).astype(np.float32)
    sampler = np.where(mask > 0, sampler, -1e30).astype(np.float32)
    return logp, old, sampler, ent, mask, adv


def rows(mask):
    for i in range(mask.shape[0]):
        yield i, mask[i] > 0


# ------------------------------------------------------------------ surrogates
@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_matches_numpy(seed):
    logp, old, _, _, mask, adv = make_inputs(seed)
    lr = np.where(mask > 0, logp.astype(np.float64) - old, 0.0)
    cap = 1.2
    loss, clipped = cispo_surrogate(jnp.asarray(lr, jnp.float32), logp, adv, mask, max_weight=cap)
    ref = np.zeros(logp.shape)
    ref_clip = np.zeros(logp.shape)
    for i, m in rows(mask):
        r = np.exp(lr[i, m])
        ref[i, m] = -np.minimum(r, cap) * adv[i] * logp[i, m]
        ref_clip[i, m] = (r > cap) & (adv[i] > 0)
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(clipped, ref_clip)
    # The weight is a constant: the gradient w.r.t. log-probs is -w * A (the ratio gets none).
    g_lp = jax.grad(lambda x: jnp.sum(cispo_surrogate(lr, x, adv, mask, max_weight=cap)[0]))(logp)
    g_lr = jax.grad(lambda x: jnp.sum(cispo_surrogate(x, logp, adv, mask, max_weight=cap)[0]))(
        jnp.asarray(lr, jnp.float32)
    )
    want = np.where(mask > 0, -np.minimum(np.exp(lr), cap) * adv[:, None], 0.0)
    np.testing.assert_allclose(g_lp, want, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g_lr).max()) == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_sapo_matches_numpy(seed):
    logp, old, _, _, mask, adv = make_inputs(seed)
    lr = np.where(mask > 0, logp.astype(np.float64) - old, 0.0)
    tp, tn = 0.7, 1.6
    loss = sapo_surrogate(lr, adv, mask, temperature_pos=tp, temperature_neg=tn)
    ref = np.zeros(logp.shape)
    for i, m in rows(mask):
        tau = tp if adv[i] > 0 else tn
        r = np.exp(lr[i, m])
        ref[i, m] = -(4.0 / tau) / (1.0 + np.exp(-tau * (r - 1.0))) * adv[i]
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-6)

    # At ratio 1 the gate's slope is 1: the same gradient as the unclipped surrogate.
    def total(x):
        return jnp.sum(sapo_surrogate(x, adv, mask, temperature_pos=tp, temperature_neg=tn))

    g = jax.grad(total)(jnp.zeros_like(logp))
    np.testing.assert_allclose(g, -adv[:, None] * mask, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("with_sampler", [False, True])
def test_vespo_weights_match_numpy(seed, with_sampler):
    logp, old, sampler, _, mask, adv = make_inputs(seed)
    lr = np.where(mask > 0, logp.astype(np.float64) - old, 0.0) * 0.3
    d = np.where(mask > 0, 0.5 * (old.astype(np.float64) - sampler), 0.0)
    lw = np.where(mask > 0, np.minimum(d, np.log(2.0)), 0.0)
    phi = vespo_weights(
        jnp.asarray(lr, jnp.float32),
        adv,
        mask,
        sampler_log_weights=jnp.asarray(lw, jnp.float32) if with_sampler else None,
        k_pos=2.0,
        lambda_pos=3.0,
        k_neg=3.0,
        lambda_neg=2.0,
    )
    ref = np.zeros(logp.shape)
    for i, m in rows(mask):
        s = np.sum(np.clip(lr[i, m], -20, 20))
        if with_sampler:
            s += np.sum(np.clip(lw[i, m], math.log(1e-8), 20))
        log_w = np.clip(s, math.log(1e-8), 20)
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        ref[i, m] = np.exp(lam + k * log_w - lam * np.exp(log_w))
    np.testing.assert_allclose(phi, ref, rtol=1e-4, atol=1e-6)
    # phi(1) = 1
    one = vespo_weights(jnp.zeros_like(logp), adv, mask)
    np.testing.assert_allclose(one, mask, rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_token_ratio_value_and_gradient(seed):
    logp, old, _, _, mask, adv = make_inputs(seed)
    seq = log_importance_ratio(logp, old, mask, level="sequence")
    tok = log_importance_ratio(logp, old, mask, level="sequence_token")
    np.testing.assert_allclose(tok, seq, rtol=1e-6, atol=1e-7)
    # d log s_{i,t} / d log pi_{i,u} = [t == u]: each token's own gradient, scaled by s_i.
    weights = np.random.default_rng(seed).normal(size=logp.shape).astype(np.float32)
    g = jax.grad(
        lambda x: jnp.sum(log_importance_ratio(x, old, mask, level="sequence_token") * weights)
    )(logp)
    np.testing.assert_allclose(g, weights * mask, rtol=1e-6)
    # With equal token advantages and per-sequence token means, GSPO-token == GSPO (gradients).
    from artifex.generative_models.training.rl import clipped_surrogate

    def loss(x, level):
        lr = log_importance_ratio(x, old, mask, level=level)
        pg, _, _ = clipped_surrogate(lr, adv, mask, epsilon_low=0.2, epsilon_high=0.2)
        return aggregate_loss(pg, mask, "sequence_mean")

    np.testing.assert_allclose(
        jax.grad(loss)(logp, "sequence_token"), jax.grad(loss)(logp, "sequence"), atol=1e-6
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_sum_aggregation(seed):
    logp, _, _, _, mask, _ = make_inputs(seed)
    x = np.where(mask > 0, logp, 1e30)
    got = aggregate_loss(x, mask, "sequence_sum")
    want = np.sum(np.where(mask > 0, logp.astype(np.float64), 0.0)) / mask.shape[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(loss_normalizer(mask, "sequence_sum")) == mask.shape[0]


# ------------------------------------------------------------------ sampler correction
def np_sampler(train, sampler, mask, mode, level, lo, hi):
    d = np.where(mask > 0, train.astype(np.float64) - sampler, 0.0)
    if level == "token":
        lr = d
    else:
        s = d.sum(-1, keepdims=True)
        if level == "geometric":
            s = s / np.maximum(mask.sum(-1, keepdims=True), 1)
        lr = np.broadcast_to(s, d.shape)
    r = np.exp(lr)
    lo_ = -np.inf if lo is None else lo
    hi_ = np.inf if hi is None else hi
    out = (r < lo_) | (r > hi_)
    w = np.clip(r, lo_, hi_) if mode == "truncate" else np.where(out, 0.0, r)
    return w * mask, r * mask, out * mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("bounds", [(None, 1.5), (0.6, 1.4), (0.5, None)])
def test_sampler_weights_match_numpy(seed, mode, level, bounds):
    _, old, sampler, _, mask, _ = make_inputs(seed)
    w, r, out = sampler_importance_weights(
        old, sampler, mask, mode=mode, level=level, ratio_min=bounds[0], ratio_max=bounds[1]
    )
    rw, rr, rout = np_sampler(old, sampler, mask, mode, level, *bounds)
    np.testing.assert_allclose(w, rw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r, rr, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out, rout)


def test_sampler_nan_log_probs_count_as_ratio_one():
    _, old, sampler, _, mask, _ = make_inputs(0)
    sampler = sampler.copy()
    sampler[0, 0] = np.nan
    w, _, _ = sampler_importance_weights(old, sampler, mask, mode="mask", ratio_max=1e9)
    assert float(w[0, 0]) == 1.0 and np.isfinite(np.asarray(w)).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_sampler_metrics_match_numpy(seed):
    logp, old, sampler, _, mask, adv = make_inputs(seed)
    cfg = GRPOConfig(
        beta=0.0,
        entropy_coeff=0.0,
        sampler_correction="mask",
        sampler_ratio_min=0.5,
        sampler_ratio_max=2.0,
    )
    batch = _batch(mask, adv, old=old, sampler=sampler)
    _, m = grpo_objective(logp, None, batch, cfg, reward_metrics=False)
    w, _, out = np_sampler(old, sampler, mask, "mask", "token", 0.5, 2.0)
    d = (old.astype(np.float64) - sampler)[mask > 0]
    np.testing.assert_allclose(m["sampler_ratio_mean"], w[mask > 0].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["sampler_ratio_max"], w[mask > 0].max(), rtol=1e-5)
    np.testing.assert_allclose(m["sampler_ratio_min"], w[mask > 0].min(), atol=1e-7)
    np.testing.assert_allclose(m["sampler_corrected_fraction"], out[mask > 0].mean(), rtol=1e-6)
    np.testing.assert_allclose(m["sampler_logp_diff_mean"], np.abs(d).mean(), rtol=1e-5)
    np.testing.assert_allclose(m["sampler_logp_diff_max"], np.abs(d).max(), rtol=1e-5)
    np.testing.assert_allclose(m["sampler_kl"], np.mean(np.expm1(d) - d), rtol=1e-4)


# ------------------------------------------------------------------ masks
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("threshold", [-0.1, 0.0, 0.2])
def test_off_policy_mask_matches_numpy(seed, threshold):
    logp, _, sampler, _, mask, adv = make_inputs(seed)
    keep = off_policy_sequence_mask(adv, logp, sampler, mask, threshold=threshold)
    for i, m in rows(mask):
        kl = np.mean(sampler[i, m].astype(np.float64) - logp[i, m])
        want = float(adv[i] >= 0 or kl <= threshold)
        np.testing.assert_array_equal(np.asarray(keep[i]), want)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.77, 1.0])
def test_entropy_quantile_matches_numpy(seed, q):
    _, _, _, ent, mask, _ = make_inputs(seed)
    got = entropy_quantile_threshold(np.where(mask > 0, ent, -5.0), mask, q)
    want = np.quantile(ent[mask > 0].astype(np.float64), q)  # linear, as torch.quantile
    np.testing.assert_allclose(got, want, rtol=1e-6)
    keep = high_entropy_mask(ent, mask, 1.0 - q)
    np.testing.assert_array_equal(keep, ((ent >= np.float32(got)) & (mask > 0)).astype(np.float32))
    assert float(entropy_quantile_threshold(ent, np.zeros_like(mask), q)) == np.inf


# ------------------------------------------------------------------ advantages
def np_pass_at_k(rewards, g, k):
    """Brute force: average, over the k-subsets containing a sample, of the subset's
    normalized pass@k reward (max over the subset), std over all subsets of its group."""
    out = np.zeros(len(rewards))
    for start in range(0, len(rewards), g):
        idx = [i for i in range(start, start + g) if not np.isnan(rewards[i])]
        if len(idx) < k:
            continue
        subsets = list(itertools.combinations(idx, k))
        vals = np.array([max(rewards[i] > 0.5 for i in s) for s in subsets], np.float64)
        mean, std = vals.mean(), vals.std()
        if std == 0:
            continue
        for i in idx:
            mine = [(v - mean) / (std + 1e-4) for s, v in zip(subsets, vals, strict=True) if i in s]
            out[i] = np.mean(mine)
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_pass_at_k_matches_subset_enumeration(seed, k):
    rng = np.random.default_rng(seed)
    g = 6
    rewards = (rng.random(4 * g) < 0.4).astype(np.float32)
    rewards[:g] = 0.0  # all wrong: 0
    rewards[rng.random(4 * g) < 0.1] = np.nan  # ragged groups
    got = pass_at_k_advantages(rewards, g, k=k)
    np.testing.assert_allclose(got, np_pass_at_k(rewards, g, k), rtol=1e-4, atol=1e-5)
    ids = jnp.repeat(jnp.arange(4), g)
    np.testing.assert_allclose(pass_at_k_advantages(rewards, g, k=k, group_ids=ids), got, atol=1e-6)


def test_pass_at_1_is_grpo_with_population_std():
    rewards = np.array([1, 0, 0, 1, 1, 1, 0, 1], np.float32)
    cfg = GRPOConfig(advantage_estimator="pass_at_k", pass_at_k=1)
    grpo = GRPOConfig(std_ddof=0)
    np.testing.assert_allclose(
        advantages_from_config(rewards, cfg), advantages_from_config(rewards, grpo), atol=1e-6
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_matches_numpy(seed, baseline):
    rng = np.random.default_rng(seed)
    g = 4
    rewards = rng.normal(size=5 * g).astype(np.float32)
    rewards[rng.random(5 * g) < 0.15] = np.nan
    got = reinforce_pp_advantages(rewards, g, subtract_group_mean=baseline)
    x = rewards.astype(np.float64)
    valid = ~np.isnan(x)
    if baseline:
        for s in range(0, len(x), g):
            v = valid[s : s + g]
            x[s : s + g][v] -= x[s : s + g][v].mean()
    mu, sd = x[valid].mean(), x[valid].std(ddof=1)
    want = np.where(valid, (x - mu) / (sd + 1e-4), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    ids = jnp.repeat(jnp.arange(5), g)
    np.testing.assert_allclose(
        reinforce_pp_advantages(rewards, g, group_ids=ids, subtract_group_mean=baseline),
        got,
        atol=1e-6,
    )
    cfg = GRPOConfig(advantage_estimator="reinforce_pp_baseline" if baseline else "reinforce_pp")
    np.testing.assert_allclose(advantages_from_config(rewards, cfg, group_size=g), got, atol=1e-6)


# ------------------------------------------------------------------ the objective
def _batch(mask, adv, *, old=None, sampler=None, ref=None, rewards=None, g=4):
    b, t = mask.shape
    return GRPOBatch(
        prompt_ids=jnp.zeros((b, 2), jnp.int32),
        completion_ids=jnp.zeros((b, t), jnp.int32),
        completion_mask=jnp.asarray(mask),
        rewards=jnp.zeros((b,), jnp.float32) if rewards is None else jnp.asarray(rewards),
        old_log_probs=None if old is None else jnp.asarray(old),
        sampler_log_probs=None if sampler is None else jnp.asarray(sampler),
        ref_log_probs=None if ref is None else jnp.asarray(ref),
        advantages=None if adv is None else jnp.asarray(adv),
        group_size=g,
    )


VARIANTS = {
    "clip": dict(),
    "cispo": dict(policy_loss="cispo", cispo_max_weight=1.3),
    "sapo": dict(policy_loss="sapo"),
    "vespo": dict(policy_loss="vespo", sampler_correction="truncate"),
    "gspo_token": dict(importance_sampling_level="sequence_token"),
    "gspo": dict(importance_sampling_level="sequence"),
    "everything": dict(
        kl_importance_weighted=True,
        sampler_correction="mask",
        sampler_correction_level="geometric",
        sampler_ratio_min=0.5,
        sampler_ratio_max=2.0,
        off_policy_mask_threshold=0.0,
        top_entropy_quantile=0.3,
    ),
    "sequence_is": dict(sampler_correction="truncate", sampler_correction_level="sequence"),
}
AGGREGATIONS = ["sequence_mean", "token_mean", "constant_length", "sequence_sum"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_objective_is_split_invariant(variant, agg):
    """Summing microbatch losses (global normalizer, advantages, entropy quantile) gives the
    full-batch loss and gradient, whatever the split."""
    logp, old, sampler, ent, mask, _ = make_inputs(3, b=8, t=6)
    ref = (logp + 0.3).astype(np.float32)
    rewards = np.random.default_rng(3).normal(size=8).astype(np.float32)
    cfg = GRPOConfig(
        loss_aggregation=agg, beta=0.04, entropy_coeff=0.01, max_completion_length=9,
        **VARIANTS[variant],
    )  # fmt: skip
    batch = _batch(mask, None, old=old, sampler=sampler, ref=ref, rewards=rewards)
    from artifex.generative_models.training.rl import compute_advantages, losses

    adv = compute_advantages(batch, cfg)
    norm = losses.loss_normalizer(mask, agg, max_length=9)
    thr = losses.entropy_quantile_threshold(ent, mask, 1.0 - cfg.top_entropy_quantile)

    def full(x):
        return grpo_objective(x, ent, batch, cfg)[0]

    def split(x, n):
        total = 0.0
        size = 8 // n
        for j in range(n):
            sl = slice(j * size, (j + 1) * size)
            mb = jax.tree.map(lambda a, sl=sl: a[sl], batch)
            total += grpo_objective(
                x[sl], ent[sl], mb, cfg, normalizer=norm, advantages=adv[sl],
                entropy_threshold=thr, reward_metrics=False,
            )[0]  # fmt: skip
        return total

    want, want_g = jax.value_and_grad(full)(jnp.asarray(logp))
    assert float(jnp.abs(want_g).max()) > 0
    # One-row slices (8): a term taken over the slice instead of the batch (its rows, tokens,
    # groups or entropy quantile) shows there. Four-row slices (2): the rows' inputs given to a
    # slice (its advantages) must line up with its rows, which one row cannot show. Two-row
    # slices (a split into 4) would add nothing to these two (and a second of eager runs).
    for n in (2, 8):
        got, got_g = jax.value_and_grad(split)(jnp.asarray(logp), n)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(got_g, want_g, rtol=2e-5, atol=1e-7)


def test_objective_accepts_bf16_inputs():
    logp, old, sampler, ent, mask, adv = make_inputs(1)
    cfg = GRPOConfig(**VARIANTS["everything"])
    ref = logp + 0.2
    f32 = _batch(mask, adv, old=old, sampler=sampler, ref=ref)
    as_bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, f32)
    lp16 = jnp.asarray(logp, jnp.bfloat16)
    ent16 = jnp.asarray(ent, jnp.bfloat16)
    loss16, m16 = grpo_objective(lp16, ent16, as_bf16, cfg)
    # Same as float32 on the bf16-rounded values (loss math runs in float32).
    rounded = jax.tree.map(
        lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, as_bf16
    )
    loss32, _ = grpo_objective(lp16.astype(jnp.float32), ent16.astype(jnp.float32), rounded, cfg)
    assert loss16.dtype == jnp.float32 and np.isfinite(float(loss16))
    np.testing.assert_allclose(loss16, loss32, rtol=1e-6)
    assert all(np.isfinite(float(v)) for v in m16.values())


def test_top_entropy_needs_entropy():
    logp, _, _, _, mask, adv = make_inputs(0)
    cfg = GRPOConfig(entropy_coeff=0.0, top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        grpo_objective(logp, None, _batch(mask, adv), cfg)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        (dict(policy_loss="ppo"), ValueError),
        (dict(cispo_max_weight=0.0), ValueError),
        (dict(sapo_temperature_neg=-1.0), ValueError),
        (dict(vespo_k_pos=-1.0), ValueError),
        (dict(sampler_ratio_min=2.0, sampler_ratio_max=1.0), ValueError),
        (dict(sampler_correction_level="tok"), ValueError),
        (dict(top_entropy_quantile=1.5), ValueError),
        (dict(pass_at_k=0), ValueError),
        (dict(pass_at_k=4), ValueError),  # without advantage_estimator="pass_at_k"
        (dict(pass_at_k=2.0, advantage_estimator="pass_at_k"), TypeError),
        (dict(kl_importance_weighted=1), TypeError),
        (dict(loss_aggregation="sum"), ValueError),
        (
            dict(
                policy_loss="vespo", sampler_correction="mask", sampler_correction_level="sequence"
            ),
            ValueError,
        ),
    ],
)
def test_variant_config_validation(changes, error):
    with pytest.raises(error):
        GRPOConfig(**changes)


# ------------------------------------------------------------------ the trainer
class BigramLM(nnx.Module):
    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, rngs=rngs)
        self.head = nnx.Param(jax.random.normal(rngs.params(), (dim, vocab)) * 0.5)

    def hidden_states(self, ids, attention_mask=None, positions=None, cache=None):
        return jnp.tanh(self.proj(self.embed(ids))), None

    def output_embedding(self):
        return self.head[...]

    def __call__(self, ids, attention_mask=None):
        return self.hidden_states(ids)[0] @ self.head[...]


def trainer_batch(seed=0, b=8, t=5, g=4, ragged=False):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    old = -1.8 + 0.3 * rng.normal(size=(b, t))
    rewards = (rng.random(b) < 0.5).astype(np.float32)
    return GRPOBatch(
        prompt_ids=jnp.asarray(rng.integers(0, 6, size=(b, 3)), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(0, 6, size=(b, t)), jnp.int32),
        completion_mask=jnp.asarray(mask),
        rewards=jnp.asarray(rewards),
        old_log_probs=jnp.asarray(old, jnp.float32),
        sampler_log_probs=jnp.asarray(old + 0.3 * rng.normal(size=(b, t)), jnp.float32),
        group_ids=jnp.asarray([0, 0, 0, 1, 1, 2, 2, 2], jnp.int32) if ragged else None,
        group_size=g,
    )


TRAINER_VARIANTS = {
    "cispo_token_mean": dict(policy_loss="cispo", loss_aggregation="token_mean"),
    "sapo_sequence_mean": dict(policy_loss="sapo"),
    "vespo_token_mean": dict(
        policy_loss="vespo", loss_aggregation="token_mean", sampler_correction="mask"
    ),
    "luspo": dict(importance_sampling_level="sequence", loss_aggregation="sequence_sum"),
    "everything_pass_at_k": dict(
        VARIANTS["everything"],
        loss_aggregation="constant_length",
        advantage_estimator="pass_at_k",
        pass_at_k=2,
    ),
    "everything_reinforce_pp": dict(
        VARIANTS["everything"],
        loss_aggregation="token_mean",
        importance_sampling_level="sequence_token",
        advantage_estimator="reinforce_pp_baseline",
    ),
}


@pytest.fixture(scope="module")
def trainer_update():
    """``(variant, ragged, micro, mesh=None) -> (metrics, parameters)`` after one update of a
    fresh model; each run once per module (the mesh test compares with a split test's run)."""
    done = {}

    def update(variant, ragged, micro, mesh=None):
        key = (variant, ragged, micro, mesh)
        if key not in done:
            cfg = GRPOConfig(beta=0.0, clip_param=0.1, **TRAINER_VARIANTS[variant])
            model = BigramLM(6, 8, nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
            if mesh is not None:
                from artifex.generative_models.training.sharding import make_mesh

                mesh = make_mesh(data=mesh)
            trainer = GRPOTrainer(model, optimizer, cfg, mesh=mesh)
            metrics = trainer.train_step(trainer_batch(ragged=ragged), num_microbatches=micro)
            done[key] = (metrics, [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))])
        return done[key]

    return update


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(TRAINER_VARIANTS))
@pytest.mark.parametrize("ragged", [False, True])
def test_trainer_update_does_not_depend_on_the_split(variant, ragged, trainer_update):
    """GRPOTrainer.train_step with 1 and 4 microbatches: the same update and metrics (the
    entropy quantile, advantages and normalizer come from the whole batch).

    Four microbatches of 2 rows cut every group (of 4, or of 2 and 3 rows when ragged) and
    every boundary of a split into 2, so a statistic taken per microbatch instead of over the
    batch shows here; a run with 2 microbatches (a third program to compile) would add nothing.
    """
    m1, p1 = trainer_update(variant, ragged, 1)
    start = [np.asarray(x) for x in jax.tree.leaves(nnx.state(BigramLM(6, 8, nnx.Rngs(0))))]
    assert any(np.abs(a - b).max() > 1e-4 for a, b in zip(p1, start, strict=True))
    m, p = trainer_update(variant, ragged, 4)
    for x, y in zip(p1, p, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    assert set(m) == set(m1)
    for key in m1:
        np.testing.assert_allclose(m[key], m1[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_trainer_on_a_mesh_matches_single_device_with_variants(trainer_update):
    # one row per device; the single-device update is the split test's (one microbatch)
    one = trainer_update("everything_reinforce_pp", False, 1)
    mesh = trainer_update("everything_reinforce_pp", False, 1, mesh=8)
    for x, y in zip(one[1], mesh[1], strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    for key in one[0]:
        np.testing.assert_allclose(one[0][key], mesh[0][key], rtol=1e-5, atol=1e-6)


class Bf16BigramLM(BigramLM):
    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)
        head = jax.random.normal(rngs.params(), (dim, vocab)) * 0.5
        self.head = nnx.Param(head.astype(jnp.bfloat16))


@pytest.mark.slow
def test_bf16_model_with_every_variant_trains_finitely_and_split_invariantly():
    cfg = GRPOConfig(beta=0.0, clip_param=0.1, **TRAINER_VARIANTS["everything_pass_at_k"])
    out = []
    for micro in (1, 2):
        model = Bf16BigramLM(6, 8, nnx.Rngs(0))
        trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param), cfg)
        metrics = trainer.train_step(trainer_batch(ragged=True), num_microbatches=micro)
        assert all(np.isfinite(v) for v in metrics.values())
        assert {jnp.dtype(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
            jnp.dtype(jnp.bfloat16)
        }
        out.append(
            (metrics, [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(model))])
        )
    for x, y in zip(out[0][1], out[1][1], strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(
        out[0][0]["total_loss"], out[1][0]["total_loss"], rtol=1e-2, atol=1e-3
    )


# ------------------------------------------------------------------ whole objective vs NumPy
def np_objective(logp, old, sampler, ref, ent, mask, adv, cfg):
    """float64 reference of grpo_objective's total loss with the variant options."""
    logp, old, sampler, ref, ent = (
        np.asarray(a, np.float64) for a in (logp, old, sampler, ref, ent)
    )
    b, t = mask.shape
    m = mask > 0
    n = np.maximum(mask.sum(-1), 1)
    a = np.broadcast_to(adv[:, None], (b, t)).astype(np.float64)
    d = np.where(m, logp - old, 0.0)
    seq = d.sum(-1, keepdims=True) / n[:, None]
    lr = d if cfg.importance_sampling_level == "token" else np.broadcast_to(seq, (b, t))
    r = np.exp(lr)
    if cfg.policy_loss == "clip":
        lo, hi = cfg.epsilon_low, cfg.epsilon_high
        pg = -np.minimum(r * a, np.clip(r, 1 - lo, 1 + hi) * a)
    elif cfg.policy_loss == "cispo":
        pg = -np.minimum(r, cfg.cispo_max_weight) * a * logp
    elif cfg.policy_loss == "sapo":
        tau = np.where(a > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        pg = -(4 / tau) / (1 + np.exp(-tau * (r - 1))) * a
    w = np.ones((b, t))
    if cfg.sampler_correction != "none":
        w, _, _ = np_sampler(
            old, sampler, mask, cfg.sampler_correction, cfg.sampler_correction_level,
            cfg.sampler_ratio_min, cfg.sampler_ratio_max,
        )  # fmt: skip
    if cfg.policy_loss == "vespo":
        s = np.where(m, np.clip(d, -20, 20), 0).sum(-1, keepdims=True)
        if cfg.sampler_correction != "none":
            with np.errstate(divide="ignore"):
                s = s + np.where(m, np.clip(np.log(w), math.log(1e-8), 20), 0).sum(
                    -1, keepdims=True
                )
        log_w = np.clip(s, math.log(1e-8), 20)
        k = np.where(a >= 0, cfg.vespo_k_pos, cfg.vespo_k_neg)
        lam = np.where(a >= 0, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)
        pg = -np.exp(lam + k * log_w - lam * np.exp(log_w)) * a * logp
        w = np.ones((b, t))
    if cfg.off_policy_mask_threshold is not None:
        kl = np.where(m, sampler - logp, 0).sum(-1) / n
        keep = (adv >= 0) | (kl <= cfg.off_policy_mask_threshold)
        pg = pg * keep[:, None]
    if cfg.top_entropy_quantile < 1:
        thr = np.quantile(ent[m], 1 - cfg.top_entropy_quantile)
        pg = pg * (ent >= thr)
    pg = pg * w
    kl = np.exp(ref - logp) - (ref - logp) - 1
    if cfg.kl_importance_weighted:
        kl = kl * r
    per_token = np.where(m, pg + cfg.beta * kl - cfg.entropy_coeff * ent, 0.0)
    agg = cfg.loss_aggregation
    if agg == "sequence_mean":
        return np.mean(per_token.sum(-1) / n)
    if agg == "token_mean":
        return per_token.sum() / max(mask.sum(), 1)
    if agg == "constant_length":
        return per_token.sum() / (b * cfg.max_completion_length)
    return per_token.sum() / b


NP_VARIANTS = {
    **VARIANTS,
    "vespo_plain": dict(policy_loss="vespo"),
    "cispo_sequence_is": dict(
        policy_loss="cispo",
        sampler_correction="mask",
        sampler_correction_level="sequence",
        sampler_ratio_min=0.2,
        sampler_ratio_max=5.0,
    ),
    "sapo_everything": dict(VARIANTS["everything"], policy_loss="sapo"),
}
NP_VARIANTS.pop("gspo_token")  # its value equals "gspo"'s (tested above)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("variant", sorted(NP_VARIANTS))
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_objective_matches_numpy(seed, variant, agg):
    logp, old, sampler, ent, mask, adv = make_inputs(seed)
    old = np.where(mask > 0, old, 0.0).astype(np.float32)
    sampler = np.where(mask > 0, sampler, 0.0).astype(np.float32)
    ref = (logp + np.random.default_rng(seed + 7).normal(0, 0.3, logp.shape)).astype(np.float32)
    cfg = GRPOConfig(
        loss_aggregation=agg, beta=0.04, entropy_coeff=0.01, max_completion_length=9,
        **NP_VARIANTS[variant],
    )  # fmt: skip
    batch = _batch(mask, adv, old=old, sampler=sampler, ref=ref)
    got, _ = grpo_objective(logp, ent, batch, cfg)
    want = np_objective(logp, old, sampler, ref, ent, mask, adv, cfg)
    np.testing.assert_allclose(float(got), want, rtol=2e-5, atol=2e-6)
