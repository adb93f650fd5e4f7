"""Group-normalization kernel vs. an independent float64 NumPy reference, plus properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from artifex.generative_models.training.rl import (
    GRPOConfig,
    advantages_from_config,
    group_advantages,
    group_stats,
    process_advantages,
    segment_advantages,
)


# ------------------------------------------------------------------ NumPy reference (float64)
def np_group_advantages(r, groups, *, scale="group", ddof=1, eps=1e-4, baseline="group_mean"):
    """``groups`` is a list of index arrays, one per group."""
    r = np.asarray(r, np.float64)
    out = np.zeros_like(r)
    all_valid = r[~np.isnan(r)]
    batch_std = all_valid.std(ddof=ddof) if all_valid.size > ddof else 0.0
    for idx in groups:
        x = r[idx]
        keep = ~np.isnan(x)
        xv = x[keep]
        n = xv.size
        if n == 0:
            continue
        if baseline == "group_mean":
            a = xv - xv.mean()
        else:
            a = xv - (xv.sum() - xv) / (n - 1) if n > 1 else np.zeros_like(xv)
        if scale == "group":
            std = xv.std(ddof=ddof) if n > ddof else 0.0
            a = a / (std + eps)
        elif scale == "batch":
            a = a / (batch_std + eps)
        sel = np.asarray(idx)[keep]
        out[sel] = a
    return out


def fixed_groups(b, g):
    return [np.arange(i * g, (i + 1) * g) for i in range(b // g)]


def random_rewards(rng, b, *, nan_frac=0.15, discrete=True):
    r = rng.choice([0.0, 0.5, 1.0, 2.0], size=b) if discrete else rng.normal(size=b) * 3 + 1
    r[rng.random(b) < nan_frac] = np.nan
    return r.astype(np.float32)


OPTIONS = [
    dict(scale="group", ddof=1, baseline="group_mean"),
    dict(scale="group", ddof=0, baseline="group_mean"),
    dict(scale="batch", ddof=1, baseline="group_mean"),
    dict(scale="batch", ddof=0, baseline="group_mean"),
    dict(scale="none", ddof=1, baseline="group_mean"),
    dict(scale="none", ddof=1, baseline="leave_one_out"),
    dict(scale="group", ddof=1, baseline="leave_one_out"),
]


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("g", [2, 4, 8])
def test_group_advantages_match_numpy(opts, seed, g):
    rng = np.random.default_rng(seed)
    b = g * 6
    r = random_rewards(rng, b, discrete=seed % 2 == 0)
    got = np.asarray(group_advantages(r, g, eps=1e-4, **opts))
    want = np_group_advantages(r, fixed_groups(b, g), eps=1e-4, **opts)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_segment_advantages_match_numpy_with_unequal_groups(opts, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 7, size=7)
    ids = np.repeat(np.arange(sizes.size), sizes)
    perm = rng.permutation(ids.size)  # rows need not be sorted by group
    ids = ids[perm]
    r = random_rewards(rng, ids.size, discrete=False)
    got = np.asarray(segment_advantages(r, ids, **opts))
    groups = [np.flatnonzero(ids == k) for k in range(sizes.size)]
    want = np_group_advantages(r, groups, **opts)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_segment_form_equals_fixed_form_for_equal_groups():
    rng = np.random.default_rng(3)
    r = random_rewards(rng, 24)
    ids = np.repeat(np.arange(6), 4)
    np.testing.assert_allclose(
        segment_advantages(r, ids), group_advantages(r, 4), rtol=1e-6, atol=1e-6
    )


def test_seed_004_example_population_std():
    # Seed 004: rewards [1.0, 0.5, 0.5, 0.0] -> about [+1.414, 0, 0, -1.414] with population std.
    adv = np.asarray(group_advantages(np.array([1.0, 0.5, 0.5, 0.0]), 4, ddof=0, eps=0.0))
    np.testing.assert_allclose(adv, [np.sqrt(2), 0, 0, -np.sqrt(2)], rtol=1e-6)
    # With Bessel's correction (the default, as TRL and Tunix): std = sqrt(1/6).
    adv1 = np.asarray(group_advantages(np.array([1.0, 0.5, 0.5, 0.0]), 4, eps=0.0))
    np.testing.assert_allclose(adv1, [0.5 * np.sqrt(6), 0, 0, -0.5 * np.sqrt(6)], rtol=1e-6)


def test_nan_rewards_are_left_out_and_get_zero():
    r = np.array([1.0, np.nan, 0.0, 0.0, np.nan, np.nan, np.nan, np.nan], np.float32)
    adv = np.asarray(group_advantages(r, 4, ddof=0, eps=0.0))
    # Group 0 stats over {1, 0, 0}: mean 1/3, std sqrt(2)/3.
    mean, std = 1 / 3, np.sqrt(2) / 3
    np.testing.assert_allclose(adv[:4], [(1 - mean) / std, 0, -mean / std, -mean / std], rtol=1e-5)
    assert np.all(adv[4:] == 0.0)  # an all-missing group gives zeros, not NaN
    stats = group_stats(r, 4, ddof=0)
    np.testing.assert_array_equal(np.asarray(stats.count), [3, 3, 3, 3, 0, 0, 0, 0])


def test_single_valid_reward_with_bessel_gives_zero_not_nan():
    r = np.array([2.0, np.nan, np.nan, np.nan], np.float32)
    for baseline in ("group_mean", "leave_one_out"):
        adv = np.asarray(group_advantages(r, 4, baseline=baseline))
        assert np.all(adv == 0.0)


def test_batch_size_not_multiple_of_group_size_raises():
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        group_advantages(np.zeros(6, np.float32), 4)


def test_advantages_from_config_reads_every_option():
    rng = np.random.default_rng(7)
    r = random_rewards(rng, 12, discrete=False)
    cfg = GRPOConfig(
        num_generations=3,
        scale_rewards="batch",
        std_ddof=0,
        advantage_eps=0.1,
        baseline="leave_one_out",
    )
    got = np.asarray(advantages_from_config(r, cfg))
    want = np_group_advantages(
        r, fixed_groups(12, 3), scale="batch", ddof=0, eps=0.1, baseline="leave_one_out"
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


# ------------------------------------------------------------------ process supervision
def np_process_advantages(step_rewards, g, gamma, eps=1e-4, ddof=1):
    b, t = step_rewards.shape
    out = np.zeros((b, t))
    for k in range(b // g):
        block = step_rewards[k * g : (k + 1) * g].astype(np.float64)
        vals = block[~np.isnan(block)]
        if vals.size == 0:
            continue
        std = vals.std(ddof=ddof) if vals.size > ddof else 0.0
        norm = np.where(np.isnan(block), 0.0, (block - vals.mean()) / (std + eps))
        for i in range(g):
            for s in range(t):
                out[k * g + i, s] = sum(gamma ** (u - s) * norm[i, u] for u in range(s, t))
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("seed", [0, 1])
def test_process_advantages_match_numpy(gamma, seed):
    rng = np.random.default_rng(seed)
    sr = rng.normal(size=(8, 6)).astype(np.float32)
    sr[rng.random(sr.shape) < 0.6] = np.nan
    got = np.asarray(process_advantages(sr, 4, gamma=gamma))
    want = np_process_advantages(sr, 4, gamma)
    np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5)


# ------------------------------------------------------------------ properties (hypothesis)
finite_reward = st.floats(-100, 100, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(-20, 20), min_size=8, max_size=8),
    st.integers(-50, 50),
    st.sampled_from([0.25, 0.5, 1.5, 2.0, 3.0, 10.0]),
    st.sampled_from(["group", "batch"]),
)
def test_shift_and_positive_scale_invariance(rewards, shift, scale, mode):
    # Integer-valued rewards keep the transform exact in float32, so a group that is constant
    # stays constant and the comparison is about the kernel, not about rounding.
    r = np.asarray(rewards, np.float32)
    base = np.asarray(group_advantages(r, 4, eps=0.0, scale=mode))
    moved = np.asarray(
        group_advantages((r * scale + shift).astype(np.float32), 4, eps=0.0, scale=mode)
    )
    np.testing.assert_allclose(moved, base, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite_reward, min_size=12, max_size=12), st.sampled_from(OPTIONS))
def test_each_group_sums_to_zero(rewards, opts):
    r = np.asarray(rewards, np.float32)
    adv = np.asarray(group_advantages(r, 4, **opts), np.float64).reshape(3, 4)
    scale = np.abs(adv).max() + 1.0
    np.testing.assert_allclose(adv.sum(axis=1) / scale, 0.0, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(finite_reward, st.sampled_from(OPTIONS), st.integers(2, 8))
def test_constant_group_gives_exact_zeros(value, opts, g):
    r = np.full(2 * g, value, np.float32)
    r[g:] = np.float32(value) * np.float32(0.1)  # another constant group, inexact in binary
    adv = np.asarray(group_advantages(r, g, **(opts | {"scale": "group"})))
    assert np.all(adv == 0.0)
    adv = np.asarray(segment_advantages(r, np.repeat(np.arange(2), g), **opts))
    assert np.all(adv == 0.0)
