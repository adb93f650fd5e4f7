"""The distillation divergences against float64 NumPy: per position, chunked, sampled, aggregated.

References are written here from the formulas (GKD, arXiv:2306.13649): forward KL
``KL(T || S)``, reverse KL ``KL(S || T)``, the generalized JSD with ``M = beta T + (1 - beta) S``,
and their gradients with respect to the student's logits (checked themselves against central
differences). The sampled reverse-KL estimator is checked for its value and gradient token by
token, through ``grpo_objective``'s aggregations with masks, and for unbiasedness by taking its
exact expectation over the vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.training.rl import GRPOBatch, GRPOConfig, grpo_objective
from artifex.generative_models.training.rl.distillation import (
    DIVERGENCES,
    chunked_distillation,
    logits_divergence,
    sampled_reverse_kl,
)


# ---------------------------------------------------------------------------------- NumPy
def np_log_softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def np_divergence(zs: np.ndarray, zt: np.ndarray, divergence: str, beta: float) -> np.ndarray:
    ls, lt = np_log_softmax(zs), np_log_softmax(zt)
    ps, pt = np.exp(ls), np.exp(lt)
    if divergence == "forward_kl":
        return (pt * (lt - ls)).sum(-1)
    if divergence == "reverse_kl":
        return (ps * (ls - lt)).sum(-1)
    m = beta * pt + (1 - beta) * ps
    return beta * (pt * np.log(pt / m)).sum(-1) + (1 - beta) * (ps * np.log(ps / m)).sum(-1)


def np_divergence_grad(zs: np.ndarray, zt: np.ndarray, divergence: str, beta: float) -> np.ndarray:
    """d divergence / d student logits, per row: S_k (g_k - sum_v S_v g_v) with g = dD/dS."""
    ls, lt = np_log_softmax(zs), np_log_softmax(zt)
    ps, pt = np.exp(ls), np.exp(lt)
    if divergence == "forward_kl":
        return ps - pt
    if divergence == "reverse_kl":
        g = ls - lt + 1.0
    else:
        g = (1 - beta) * (ls - np.log(beta * pt + (1 - beta) * ps))
    return ps * (g - (ps * g).sum(-1, keepdims=True))


def np_token_log_probs(z: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ls = np_log_softmax(z)
    logp = np.take_along_axis(ls, y[..., None], -1)[..., 0]
    return logp, -(np.exp(ls) * ls).sum(-1)


def _logits(seed: int, shape: tuple[int, ...], scale: float = 2.0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape) * scale


# ---------------------------------------------------------------------------------- per position
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_numpy_gradients_agree_with_finite_differences(seed):
    zs, zt = _logits(seed, (3, 6)), _logits(seed + 10, (3, 6))
    for divergence in DIVERGENCES:
        analytic = np_divergence_grad(zs, zt, divergence, 0.3)
        numeric = np.zeros_like(zs)
        for k in range(zs.shape[-1]):
            e = np.zeros_like(zs)
            e[:, k] = 1e-6
            hi = np_divergence(zs + e, zt, divergence, 0.3)
            lo = np_divergence(zs - e, zt, divergence, 0.3)
            numeric[:, k] = (hi - lo) / 2e-6
        np.testing.assert_allclose(analytic, numeric, atol=1e-7, err_msg=divergence)


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logits_divergence_and_gradient_match_numpy(divergence, seed):
    beta = [0.5, 0.1, 0.9][seed]
    zs, zt = _logits(seed, (5, 11)), _logits(seed + 100, (5, 11))
    weights = np.random.default_rng(seed + 7).uniform(0.5, 2.0, 5)
    got = logits_divergence(
        jnp.asarray(zs, jnp.float32), jnp.asarray(zt, jnp.float32), divergence, beta=beta
    )
    np.testing.assert_allclose(got, np_divergence(zs, zt, divergence, beta), rtol=2e-5, atol=1e-6)

    def weighted(z_s, z_t):
        return jnp.sum(
            jnp.asarray(weights, jnp.float32) * logits_divergence(z_s, z_t, divergence, beta=beta)
        )

    grad_s, grad_t = jax.grad(weighted, argnums=(0, 1))(
        jnp.asarray(zs, jnp.float32), jnp.asarray(zt, jnp.float32)
    )
    expected = weights[:, None] * np_divergence_grad(zs, zt, divergence, beta)
    np.testing.assert_allclose(grad_s, expected, atol=2e-6)
    assert not np.any(grad_t), "the teacher gets no gradient"


def test_divergences_are_zero_for_equal_distributions_and_positive_otherwise():
    z = jnp.asarray(_logits(0, (4, 9)), jnp.float32)
    other = jnp.asarray(_logits(1, (4, 9)), jnp.float32)
    for divergence in DIVERGENCES:
        np.testing.assert_allclose(logits_divergence(z, z + 3.0, divergence), 0.0, atol=1e-6)
        assert (logits_divergence(z, other, divergence) > 1e-3).all()


def test_jsd_tends_to_scaled_forward_and_reverse_kl():
    zs, zt = _logits(3, (4, 7), 1.0), _logits(4, (4, 7), 1.0)
    fwd = np_divergence(zs, zt, "forward_kl", 0.5)
    rev = np_divergence(zs, zt, "reverse_kl", 0.5)
    for beta in (1e-4, 1e-3):
        np.testing.assert_allclose(np_divergence(zs, zt, "jsd", beta) / beta, fwd, rtol=5e-3)
        low = np.asarray(logits_divergence(jnp.asarray(zs), jnp.asarray(zt), "jsd", beta=beta))
        np.testing.assert_allclose(low / beta, fwd, rtol=2e-2)
        np.testing.assert_allclose(np_divergence(zs, zt, "jsd", 1 - beta) / beta, rev, rtol=5e-3)


def test_logits_divergence_refuses():
    z = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="divergence"):
        logits_divergence(z, z, "tv")
    with pytest.raises(ValueError, match="beta"):
        logits_divergence(z, z, "jsd", beta=1.0)
    with pytest.raises(ValueError, match="same shape"):
        logits_divergence(z, jnp.zeros((2, 4)), "forward_kl")


# ---------------------------------------------------------------------------------- chunked
def _chunk_case(seed: int, *, transposed: bool, teacher_transposed: bool):
    rng = np.random.default_rng(seed)
    b, t, d, dt, v = 3, 5, 4, 6, 13
    h = rng.normal(size=(b, t, d))
    w = rng.normal(size=(d, v)) * 0.7
    ht = rng.normal(size=(b, t, dt))
    wt = rng.normal(size=(dt, v)) * 0.7
    y = rng.integers(0, v, (b, t))
    ws = w.T if transposed else w
    wts = wt.T if teacher_transposed else wt
    return h, w, ht, wt, y, ws, wts


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize(
    ("chunk_size", "transposed", "teacher_transposed"),
    [(None, False, False), (1, False, True), (4, True, False), (7, True, True), (64, False, False)],
)
def test_chunked_distillation_matches_numpy(divergence, chunk_size, transposed, teacher_transposed):
    h, w, ht, wt, y, ws, wts = _chunk_case(
        5, transposed=transposed, teacher_transposed=teacher_transposed
    )
    temperature, beta = 0.7, 0.35
    zs, zt = h @ w / temperature, ht @ wt / temperature
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def run(h_, w_):
        return chunked_distillation(
            h_,
            w_,
            f32(ht),
            f32(wts),
            jnp.asarray(y),
            divergence=divergence,
            beta=beta,
            chunk_size=chunk_size,
            transposed=transposed,
            teacher_transposed=teacher_transposed,
            temperature=temperature,
        )

    logp, ent, div = run(f32(h), f32(ws))
    ref_logp, ref_ent = np_token_log_probs(zs, y)
    np.testing.assert_allclose(logp, ref_logp, atol=2e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=2e-5)
    np.testing.assert_allclose(div, np_divergence(zs, zt, divergence, beta), atol=2e-5)

    # Gradient of sum(c * div + a * logp) with respect to the student's hidden states and weight.
    rng = np.random.default_rng(9)
    c, a = rng.normal(size=y.shape), rng.normal(size=y.shape)

    def objective(h_, w_):
        lp, _, dv = run(h_, w_)
        return jnp.sum(f32(c) * dv + f32(a) * lp)

    g_h, g_w = jax.grad(objective, argnums=(0, 1))(f32(h), f32(ws))
    onehot = np.eye(zs.shape[-1])[y]
    g_z = c[..., None] * np_divergence_grad(zs, zt, divergence, beta)
    g_z += a[..., None] * (onehot - np.exp(np_log_softmax(zs)))
    g_z /= temperature  # z = h W / tau
    ref_gh = g_z @ w.T
    ref_gw = np.einsum("btd,btv->dv", h, g_z)
    np.testing.assert_allclose(g_h, ref_gh, atol=5e-5)
    np.testing.assert_allclose(g_w, ref_gw.T if transposed else ref_gw, atol=5e-5)


def test_chunked_distillation_softcap():
    h, w, ht, wt, y, _, _ = _chunk_case(6, transposed=False, teacher_transposed=False)
    cap, tcap = 2.0, 3.0
    zs, zt = cap * np.tanh(h @ w / cap), tcap * np.tanh(ht @ wt / tcap)
    _, _, div = chunked_distillation(
        jnp.asarray(h, jnp.float32),
        jnp.asarray(w, jnp.float32),
        jnp.asarray(ht, jnp.float32),
        jnp.asarray(wt, jnp.float32),
        jnp.asarray(y),
        divergence="forward_kl",
        chunk_size=4,
        softcap=cap,
        teacher_softcap=tcap,
    )
    np.testing.assert_allclose(div, np_divergence(zs, zt, "forward_kl", 0.5), atol=2e-5)


def test_chunked_distillation_refuses_other_vocabularies():
    with pytest.raises(ValueError, match="same vocabulary"):
        chunked_distillation(
            jnp.zeros((2, 4)),
            jnp.zeros((4, 5)),
            jnp.zeros((2, 3)),
            jnp.zeros((3, 6)),
            jnp.zeros(2, jnp.int32),
            divergence="jsd",
        )
    with pytest.raises(ValueError, match="leading shape"):
        chunked_distillation(
            jnp.zeros((2, 4)),
            jnp.zeros((4, 5)),
            jnp.zeros((3, 3)),
            jnp.zeros((3, 5)),
            jnp.zeros(2, jnp.int32),
            divergence="jsd",
        )
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_distillation(
            jnp.zeros((2, 4)),
            jnp.zeros((4, 5)),
            jnp.zeros((2, 3)),
            jnp.zeros((3, 5)),
            jnp.zeros(2, jnp.int32),
            divergence="jsd",
            chunk_size=0,
        )


def test_chunked_distillation_keeps_one_chunk_of_logits():
    """The backward pass holds no (N, V) buffer: only (chunk, V) blocks are live at a time."""
    n, d, v, chunk = 512, 8, 1024, 16
    h = jnp.ones((n, d))
    w = jnp.ones((d, v))

    def loss(h_):
        _, _, div = chunked_distillation(
            h_, w, h, w, jnp.zeros(n, jnp.int32), divergence="forward_kl", chunk_size=chunk
        )
        return jnp.sum(div)

    text = jax.jit(jax.grad(loss)).lower(h).as_text()
    assert f"{n}x{v}" not in text and f"{chunk}x{v}" in text


# ---------------------------------------------------------------------------------- sampled
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("off_policy", [False, True])
def test_sampled_reverse_kl_value_and_gradient(seed, off_policy):
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.05, 3.0, (4, 6))
    tlp = -rng.uniform(0.05, 3.0, (4, 6))
    old = lp + rng.normal(scale=0.2, size=lp.shape) if off_policy else None
    mask = (rng.uniform(size=(4, 6)) > 0.3).astype(np.float64)
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)  # noqa: E731
    weights = rng.normal(size=lp.shape)

    def total(lp_):
        tok = sampled_reverse_kl(lp_, f32(tlp), f32(mask), old_log_probs=f32(old))
        return jnp.sum(f32(weights) * tok), tok

    (_, tok), grad = jax.value_and_grad(total, has_aux=True)(f32(lp))
    ratio = np.ones_like(lp) if old is None else np.exp(lp - old)
    np.testing.assert_allclose(tok, mask * ratio * (lp - tlp), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, weights * mask * ratio * (lp - tlp), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_reverse_kl_is_unbiased_for_the_kl_and_its_gradient(seed):
    """E_{y ~ S}[value] = KL(S || T) and E_{y ~ S}[d value / d z] = d KL(S || T) / d z."""
    zs, zt = _logits(seed, (7,)), _logits(seed + 50, (7,))
    probs = np.exp(np_log_softmax(zs))

    def surrogate(z, y):
        lp = jax.nn.log_softmax(z)[y][None, None]
        tlp = jax.nn.log_softmax(jnp.asarray(zt, jnp.float32))[y][None, None]
        return sampled_reverse_kl(lp, tlp, jnp.ones((1, 1)))[0, 0]

    z32 = jnp.asarray(zs, jnp.float32)
    values = np.array([float(surrogate(z32, y)) for y in range(7)])
    grads = np.stack([np.asarray(jax.grad(surrogate)(z32, y)) for y in range(7)])
    np.testing.assert_allclose(probs @ values, np_divergence(zs, zt, "reverse_kl", 0.5), atol=1e-5)
    np.testing.assert_allclose(
        probs @ grads, np_divergence_grad(zs, zt, "reverse_kl", 0.5), atol=1e-5
    )


def _np_aggregate(x: np.ndarray, mask: np.ndarray, mode: str, max_length: int) -> float:
    if mode == "sequence_mean":
        return float(np.mean((x * mask).sum(-1) / np.maximum(mask.sum(-1), 1)))
    if mode == "token_mean":
        return float((x * mask).sum() / max(mask.sum(), 1))
    if mode == "constant_length":
        return float((x * mask).sum() / (x.shape[0] * max_length))
    return float((x * mask).sum() / x.shape[0])


@pytest.mark.parametrize(
    "aggregation", ["sequence_mean", "token_mean", "constant_length", "sequence_sum"]
)
def test_objective_adds_the_aggregated_term(aggregation):
    rng = np.random.default_rng(3)
    b, t = 4, 5
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], float)
    lp = -rng.uniform(0.1, 2.0, (b, t))
    tlp = -rng.uniform(0.1, 2.0, (b, t))
    batch = GRPOBatch(
        prompt_ids=np.ones((b, 2), np.int32),
        completion_ids=np.ones((b, t), np.int32),
        completion_mask=mask,
        rewards=np.array([1.0, 0.0, 0.5, 0.0]),
        group_size=2,
    )
    coeff = 0.7
    common = dict(
        num_generations=2,
        beta=0.0,
        entropy_coeff=0.0,
        loss_aggregation=aggregation,
        max_completion_length=8,
    )
    config = GRPOConfig(distillation_coeff=coeff, **common)

    def loss(lp_):
        term = sampled_reverse_kl(lp_, jnp.asarray(tlp, jnp.float32), jnp.asarray(mask))
        return grpo_objective(lp_, None, batch, config, distillation=term)

    (total, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(lp, jnp.float32))
    base, base_metrics = grpo_objective(
        jnp.asarray(lp, jnp.float32), None, batch, GRPOConfig(**common)
    )
    expected = _np_aggregate(lp - tlp, mask, aggregation, 8)
    np.testing.assert_allclose(metrics["distill/reverse_kl"], expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["distill/penalty"], coeff * expected, rtol=1e-5)
    np.testing.assert_allclose(total, float(base) + coeff * expected, rtol=1e-5, atol=1e-6)
    base_grad = jax.grad(lambda x: grpo_objective(x, None, batch, GRPOConfig(**common))[0])(
        jnp.asarray(lp, jnp.float32)
    )
    # d agg(x) / d x_it, from the NumPy aggregation applied to unit vectors.
    unit = np.zeros((b, t))
    dagg = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            unit[i, j] = 1.0
            dagg[i, j] = _np_aggregate(unit, mask, aggregation, 8)
            unit[i, j] = 0.0
    np.testing.assert_allclose(
        np.asarray(grad) - np.asarray(base_grad), coeff * dagg * (lp - tlp), rtol=1e-5, atol=1e-6
    )
    assert metrics["policy_loss"] == base_metrics["policy_loss"]


def test_policy_loss_coeff_scales_the_policy_term_only():
    rng = np.random.default_rng(4)
    lp = jnp.asarray(-rng.uniform(0.1, 2.0, (4, 3)), jnp.float32)
    batch = GRPOBatch(
        prompt_ids=np.ones((4, 2), np.int32),
        completion_ids=np.ones((4, 3), np.int32),
        completion_mask=np.ones((4, 3)),
        rewards=np.array([1.0, 0.0, 0.5, 0.0]),
        group_size=2,
        old_log_probs=np.asarray(lp) + rng.normal(scale=0.1, size=(4, 3)),
    )
    term = jnp.asarray(rng.uniform(0, 1, (4, 3)), jnp.float32)
    common = dict(num_generations=2, beta=0.0, entropy_coeff=0.0, distillation_coeff=2.0)
    one, m1 = grpo_objective(lp, None, batch, GRPOConfig(**common), distillation=term)
    half, _ = grpo_objective(
        lp, None, batch, GRPOConfig(policy_loss_coeff=0.5, **common), distillation=term
    )
    zero, m0 = grpo_objective(
        lp, None, batch, GRPOConfig(policy_loss_coeff=0.0, **common), distillation=term
    )
    assert abs(float(m1["policy_loss"])) > 1e-3
    np.testing.assert_allclose(float(one) - float(half), 0.5 * float(m1["policy_loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(zero), float(m0["distill/penalty"]), rtol=1e-6)


def test_objective_refuses_a_missing_or_unexpected_term():
    batch = GRPOBatch(
        prompt_ids=np.ones((2, 1), np.int32),
        completion_ids=np.ones((2, 2), np.int32),
        completion_mask=np.ones((2, 2)),
        rewards=np.array([1.0, 0.0]),
        group_size=2,
    )
    lp = jnp.full((2, 2), -0.5)
    with pytest.raises(ValueError, match="distillation_coeff"):
        grpo_objective(
            lp,
            None,
            batch,
            GRPOConfig(num_generations=2, entropy_coeff=0.0, distillation_coeff=1.0),
        )
    with pytest.raises(ValueError, match="distillation_coeff"):
        grpo_objective(
            lp,
            None,
            batch,
            GRPOConfig(num_generations=2, entropy_coeff=0.0),
            distillation=jnp.zeros((2, 2)),
        )


def test_config_validates_the_distillation_fields():
    GRPOConfig(distillation_coeff=1.0, distillation_divergence="jsd", jsd_beta=0.1)
    GRPOConfig(distillation_coeff=1.0, policy_loss_coeff=0.0)
    with pytest.raises(ValueError, match="jsd_beta"):
        GRPOConfig(distillation_coeff=1.0, jsd_beta=0.3)  # reverse_kl has no beta
    with pytest.raises(ValueError, match="jsd_beta"):
        GRPOConfig(distillation_coeff=1.0, distillation_divergence="jsd", jsd_beta=1.0)
    with pytest.raises(ValueError, match="distillation_divergence"):
        GRPOConfig(distillation_divergence="forward_kl")  # coefficient 0
    with pytest.raises(ValueError, match="distillation_divergence"):
        GRPOConfig(distillation_coeff=1.0, distillation_divergence="tv")
    with pytest.raises(ValueError, match="policy_loss_coeff"):
        GRPOConfig(policy_loss_coeff=0.0)  # nothing to train
    with pytest.raises(ValueError, match="distillation_coeff"):
        GRPOConfig(distillation_coeff=-1.0)
    with pytest.raises(TypeError, match="distillation_coeff"):
        GRPOConfig(distillation_coeff="1")
    with pytest.raises(ValueError, match="layerwise_update"):
        GRPOConfig(distillation_coeff=1.0, remat=True, layerwise_update=True)
