"""Token log-probs: chunked vs naive, causal-LM scoring, shared prompts, temperature."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import (
    GRPOBatch,
    auto_chunk_size,
    categorical_log_probs,
    causal_lm_log_probs,
    chunked_token_log_probs,
    token_log_probs,
)


def np_log_probs(z, y):
    z = z.astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    p = np.exp(z - lse[..., None])
    return np.take_along_axis(z, y[..., None], -1)[..., 0] - lse, lse - (p * z).sum(-1)


@pytest.mark.parametrize("shift", [0.0, 1000.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_log_probs_match_numpy(seed, shift):
    # Shifted logits (the same distribution): the entropy is computed from the logits minus
    # their maximum, so it does not lose digits to a large common offset.
    rng = np.random.default_rng(seed)
    z = (rng.normal(scale=3, size=(5, 7, 33)) + shift).astype(np.float32)
    y = rng.integers(0, 33, size=(5, 7))
    lp, ent = token_log_probs(z, y)
    want_lp, want_ent = np_log_probs(z, y)
    np.testing.assert_allclose(lp, want_lp, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)


def test_masked_and_overflowing_logits_give_a_finite_entropy_and_gradient():
    # -inf logits (masked actions) and finite logits further apart than float32 can subtract
    # are probability 0: their entropy term is 0 (not 0 * -inf), and so is their gradient.
    z = jnp.array([[0.0, 1.0, -jnp.inf, 2.0], [3e38, -3e38, 0.0, 1.0]], jnp.float32)
    y = jnp.array([1, 0])
    lp, ent = token_log_probs(z, y)
    want_lp, want_ent = np_log_probs(np.array([[0.0, 1.0, 2.0]]), np.array([1]))  # without it
    np.testing.assert_allclose(lp[0], want_lp[0], atol=1e-6)
    np.testing.assert_allclose(ent[0], want_ent[0], atol=1e-6)
    assert float(lp[1]) == 0.0 and float(ent[1]) == 0.0
    grad = jax.grad(lambda z: jnp.sum(token_log_probs(z, y)[0] + token_log_probs(z, y)[1]))(z)
    assert bool(jnp.all(jnp.isfinite(grad)))
    assert float(grad[0, 2]) == 0.0


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, None])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_equals_naive_with_matching_gradients(chunk, seed):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (3, 13, 16))  # 39 rows: not a multiple of most chunk sizes
    w = jax.random.normal(k[1], (16, 50)) * 0.3
    bias = jax.random.normal(k[2], (50,)) * 0.1
    y = jax.random.randint(k[3], (3, 13), 0, 50)

    def naive(h, w, bias):
        return token_log_probs(jnp.einsum("btd,dv->btv", h, w) + bias, y)

    def chunked(h, w, bias):
        return chunked_token_log_probs(h, w, y, bias=bias, chunk_size=chunk)

    for a, b in zip(naive(h, w, bias), chunked(h, w, bias), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)

    def loss(fn):
        def f(h, w, bias):
            lp, ent = fn(h, w, bias)
            return jnp.sum(lp * jnp.arange(13)) + 0.3 * jnp.sum(ent)

        return jax.grad(f, argnums=(0, 1, 2))(h, w, bias)

    for a, b in zip(loss(naive), loss(chunked), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _dot_products(jaxpr):
    """The matrix products in a jaxpr, counting those inside loop bodies and nested programs."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _dot_products(sub)
    return count


@pytest.mark.parametrize("keep", [True, False])
def test_chunk_logits_are_kept_for_the_gradient_within_the_budget(keep, monkeypatch):
    # Within the budget the backward pass reads the chunks' logits instead of computing them
    # again: three products with the output matrix (logits, d hidden, d weight), not four.
    from artifex.generative_models.training.rl import logprobs

    k = jax.random.split(jax.random.key(4), 3)
    h = jax.random.normal(k[0], (3, 13, 16))
    w = jax.random.normal(k[1], (50, 16)) * 0.3
    y = jax.random.randint(k[2], (3, 13), 0, 50)
    size = 40 * 50 * 4  # the logits of the 39 rows, padded to 5 chunks of 8
    monkeypatch.setattr(logprobs, "_SAVED_LOGITS_BYTES", size if keep else size - 1)

    def loss(h, w):
        lp, ent = chunked_token_log_probs(h, w, y, chunk_size=8, transposed=True)
        return jnp.sum(lp * jnp.arange(13)) + 0.3 * jnp.sum(ent)

    grad = jax.grad(loss, argnums=(0, 1))
    assert _dot_products(jax.make_jaxpr(grad)(h, w).jaxpr) == (3 if keep else 4)
    rng_h, rng_w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    z = rng_h @ rng_w.T
    # float64 reference gradient of the same loss through the softmax
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) + z.max(
        -1, keepdims=True
    )
    p = np.exp(z - lse)
    weight = np.broadcast_to(np.arange(13, dtype=np.float64), y.shape)[..., None]
    onehot = np.eye(50)[np.asarray(y)]
    ent_dz = -p * (z - (p * z).sum(-1, keepdims=True))  # d entropy / d z
    dz = weight * (onehot - p) + 0.3 * ent_dz
    want_h, want_w = dz @ rng_w, np.einsum("btv,btd->vd", dz, rng_h)
    got_h, got_w = grad(h, w)
    np.testing.assert_allclose(got_h, want_h, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(got_w, want_w, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [7, None])
def test_transposed_weight_gives_the_float64_values_and_its_own_gradient(chunk):
    """`transposed=True` takes the (V, D) matrix (a tied embedding): logits `h @ w.T`."""
    rng = np.random.default_rng(3)
    h = rng.normal(size=(3, 13, 16)).astype(np.float32)
    rows = (rng.normal(size=(50, 16)) * 0.3).astype(np.float32)  # (V, D)
    y = rng.integers(0, 50, size=(3, 13))
    lp, ent = chunked_token_log_probs(h, rows, y, chunk_size=chunk, transposed=True)
    want_lp, want_ent = np_log_probs(h.astype(np.float64) @ rows.T.astype(np.float64), y)
    np.testing.assert_allclose(lp, want_lp, atol=2e-5)
    np.testing.assert_allclose(ent, want_ent, atol=2e-5)

    def loss(w, transposed):
        lp, ent = chunked_token_log_probs(h, w, y, chunk_size=chunk, transposed=transposed)
        return jnp.sum(lp) + 0.3 * jnp.sum(ent)

    g_rows = jax.grad(loss)(jnp.asarray(rows), True)
    g_cols = jax.grad(loss)(jnp.asarray(rows.T), False)
    assert g_rows.shape == (50, 16)
    np.testing.assert_allclose(g_rows, g_cols.T, atol=1e-5, rtol=1e-5)


def test_tied_models_score_with_the_embedding_as_stored(lm):
    # The small model of the tests below, tied; its vocabulary (96) is no other dimension of
    # the model, so a (D, V) array in the gradient's program can only be the embedding's view.
    tied = CausalLM(LM_CONFIG.replace(vocab_size=96, tie_word_embeddings=True), rngs=nnx.Rngs(0))
    assert tied.output_embedding_rows() is tied.embed.embedding[...]
    assert lm.output_embedding_rows() is None  # untied
    prompts = jnp.array([[3, 4, 5], [6, 7, 8]])
    completions = jnp.array([[1, 2], [9, 10]])

    @nnx.jit  # one program, not op by op
    def scored_and_full_forward(model):
        lp, _ = causal_lm_log_probs(model, prompts, completions)
        logits = model(jnp.concatenate([prompts, completions], axis=1))[:, 2:4]
        return lp, token_log_probs(logits, completions)[0]

    lp, want = scored_and_full_forward(tied)
    np.testing.assert_allclose(lp, want, atol=1e-5)

    # A gradient through chunked log-probs (a loop over chunks, as in the update) reads the
    # embedding in place: no (D, V) array anywhere (the transposed view put 42 in this program).
    def loss(model):
        return jnp.sum(causal_lm_log_probs(model, prompts, completions, chunk_size=2)[0])

    v, d = tied.embed.embedding.shape
    hlo = jax.jit(nnx.grad(loss)).lower(tied).compile().as_text()
    assert f"f32[{d},{v}]" not in hlo


def _scan_unrolls(jaxpr):
    """How many iterations every scan in a jaxpr unrolls (its length when fully), nested too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            unroll = eqn.params["unroll"]
            found.append(eqn.params["length"] if unroll is True else int(unroll))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _scan_unrolls(sub)
    return found


@pytest.mark.parametrize(
    ("rows", "keep", "unrolled"),
    [(24, True, True), (32, True, True), (40, True, False), (24, False, False)],
)
def test_a_few_kept_chunks_run_unrolled_with_the_loops_values(rows, keep, unrolled, monkeypatch):
    # At most _MAX_UNROLLED_CHUNKS chunks whose logits are kept: the scan is unrolled (one
    # buffer per chunk's logits); more chunks, or recomputed logits: a loop. Either way the
    # log-probs, entropies and both gradients are those of the loop.
    from artifex.generative_models.training.rl import logprobs

    k = jax.random.split(jax.random.key(7), 3)
    h = jax.random.normal(k[0], (rows, 16))
    w = jax.random.normal(k[1], (50, 16)) * 0.3
    y = jax.random.randint(k[2], (rows,), 0, 50)
    size = rows * 50 * 4
    monkeypatch.setattr(logprobs, "_SAVED_LOGITS_BYTES", size if keep else size - 1)

    def gradient():  # a new function each time: traced with the module's current limits
        def run(h, w):
            lp, ent = chunked_token_log_probs(h, w, y, chunk_size=8, transposed=True)
            return jnp.sum(lp * jnp.arange(rows)) + 0.3 * jnp.sum(ent), (lp, ent)

        return jax.value_and_grad(run, argnums=(0, 1), has_aux=True)

    unrolls = _scan_unrolls(jax.make_jaxpr(gradient())(h, w).jaxpr)
    assert unrolls and all((u == rows // 8) if unrolled else (u == 1) for u in unrolls)
    (_, got), got_grads = jax.jit(gradient())(h, w)
    monkeypatch.setattr(logprobs, "_MAX_UNROLLED_CHUNKS", 0)  # always a loop
    assert all(u == 1 for u in _scan_unrolls(jax.make_jaxpr(gradient())(h, w).jaxpr))
    (_, want), want_grads = jax.jit(gradient())(h, w)
    for a, b in zip((*got, *got_grads), (*want, *want_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
    monkeypatch.setattr(logprobs, "_MAX_UNROLLED_CHUNKS", 4)
    # an output matrix whose float32 gradient is over the limit: a loop (one accumulator)
    monkeypatch.setattr(logprobs, "_UNROLLED_WEIGHT_GRAD_BYTES", 50 * 16 * 4 - 1)
    assert all(u == 1 for u in _scan_unrolls(jax.make_jaxpr(gradient())(h, w).jaxpr))
    monkeypatch.setattr(logprobs, "_UNROLLED_WEIGHT_GRAD_BYTES", 50 * 16 * 4)
    assert unrolls == _scan_unrolls(jax.make_jaxpr(gradient())(h, w).jaxpr)
    # and the values are the naive ones
    lp, ent = np_log_probs(np.asarray(h @ w.T), np.asarray(y))
    np.testing.assert_allclose(got[0], lp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], ent, atol=1e-5, rtol=1e-5)


def test_auto_chunk_size_bounds_the_logits_block():
    for v in (4096, 32_000, 151_936):
        c = auto_chunk_size(v)
        assert c & (c - 1) == 0 and c >= 16
        assert c * v * 4 <= 64 * 2**20 or c == 16


LM_CONFIG = CausalLMConfig.tiny(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    head_dim=8,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def lm():
    return CausalLM(LM_CONFIG, rngs=nnx.Rngs(0))


def grouped_batch(g=3, n=2, p=6, t=5, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, p + 1, size=n)
    mask = (np.arange(p)[None] >= (p - lens)[:, None]).astype(np.int32)
    ids = rng.integers(4, 64, size=(n, p)) * mask
    return (
        np.repeat(ids, g, 0).astype(np.int32),
        np.repeat(mask, g, 0),
        rng.integers(4, 64, size=(n * g, t)).astype(np.int32),
    )


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_causal_lm_log_probs_equal_full_forward(lm, temperature):
    ids, mask, comp = grouped_batch()
    score = nnx.jit(causal_lm_log_probs, static_argnames="temperature")  # compiled, not op by op
    lp, ent = score(lm, ids, comp, prompt_mask=mask, temperature=temperature)
    seq = np.concatenate([ids, comp], 1)
    full_mask = np.concatenate([mask, np.ones_like(comp)], 1)
    logits = np.asarray(nnx.jit(lambda m, s, a: m(s, attention_mask=a))(lm, seq, full_mask))
    want_lp, want_ent = np_log_probs(logits[:, 5:-1] / temperature, comp)
    np.testing.assert_allclose(lp, want_lp, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _scores_and_gradient(graphdef, state, group):
    """Log-probs, entropies and a loss's gradient for ``grouped_batch(g=3, n=3)``.

    Compiled, as the update runs it (op by op it is ~150 small programs, slower to build), and
    shared by the two tests below: one program per group.
    """
    ids, mask, comp = grouped_batch(g=3, n=3)

    def loss(state):
        model = nnx.merge(graphdef, state)
        lp, ent = causal_lm_log_probs(model, ids, comp, prompt_mask=mask, shared_prompt_group=group)
        return jnp.sum(lp * jnp.arange(5)) + 0.1 * jnp.sum(ent), (lp, ent)

    (_, (lp, ent)), grad = jax.value_and_grad(loss, has_aux=True)(state)
    return lp, ent, grad


def test_shared_prompt_encoding_equals_per_row_encoding(lm):
    lp1, e1, g1 = _scores_and_gradient(*nnx.split(lm), None)
    lp2, e2, g2 = _scores_and_gradient(*nnx.split(lm), 3)
    np.testing.assert_allclose(lp1, lp2, atol=1e-5)
    np.testing.assert_allclose(e1, e2, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


class CacheOnlyLM:
    """A causal LM with a KV cache but no one-pass shared-prefix forward (a custom model)."""

    def __init__(self, model):
        self.model = model

    def hidden_states(self, *args, **kwargs):
        return self.model.hidden_states(*args, **kwargs)

    def init_cache(self, *args, **kwargs):
        return self.model.init_cache(*args, **kwargs)

    def output_embedding(self):
        return self.model.output_embedding()


def test_models_without_the_one_pass_forward_share_prompts_through_a_kv_cache(lm):
    ids, mask, comp = grouped_batch(g=3, n=3)
    assert not hasattr(CacheOnlyLM(lm), "shared_prefix_hidden_states")
    cached = nnx.jit(
        lambda lm: causal_lm_log_probs(
            CacheOnlyLM(lm), ids, comp, prompt_mask=mask, shared_prompt_group=3
        )
    )(lm)
    # The one-pass and per-row values: the test above's (its programs).
    one_pass = _scores_and_gradient(*nnx.split(lm), 3)
    per_row = _scores_and_gradient(*nnx.split(lm), None)
    for got in (cached, one_pass):
        np.testing.assert_allclose(got[0], per_row[0], atol=1e-5)
        np.testing.assert_allclose(got[1], per_row[1], atol=1e-5)


def test_mismatched_completions_and_masks_are_refused_by_name(lm):
    ids, mask, comp = (jnp.asarray(x) for x in grouped_batch(g=2, n=2))
    with pytest.raises(ValueError, match=r"prompt_mask must have the shape of prompt_ids \(4, 6\)"):
        causal_lm_log_probs(lm, ids, comp, prompt_mask=mask[::2], shared_prompt_group=2)
    with pytest.raises(ValueError, match=r"completion_ids must be \(4, T\)"):
        causal_lm_log_probs(lm, ids, comp[:3], prompt_mask=mask)
    with pytest.raises(ValueError, match=r"completion_ids must be \(4, T\)"):
        causal_lm_log_probs(lm, ids, comp[0], prompt_mask=mask)


def test_trainer_detects_shared_prompts_and_updates_identically():
    # One layer: the trainer's detection and its microbatches are what is tested here; sharing
    # through deeper layers is the two tests above. Each microbatch count is its own program.
    lm = CausalLM(LM_CONFIG.replace(num_layers=1), rngs=nnx.Rngs(0))
    ids, mask, comp = grouped_batch(g=4, n=2)
    kw = dict(
        prompt_ids=jnp.asarray(ids),
        prompt_mask=jnp.asarray(mask),
        completion_ids=jnp.asarray(comp),
        completion_mask=jnp.ones(comp.shape, jnp.int32),
        rewards=jnp.arange(8, dtype=jnp.float32),
        group_size=4,
    )
    results = []
    for micro in (1, 2, 4):  # 4 microbatches of 2 rows cut through the groups: no sharing
        model = nnx.clone(lm)
        nnx.update(model, jax.tree.map(lambda x: jnp.array(x, copy=True), nnx.state(model)))
        trainer = GRPOTrainer(
            model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), GRPOConfig(beta=0.0)
        )
        assert trainer.prepare_batch(GRPOBatch(**kw)).shared_prompts
        trainer.train_step(GRPOBatch(**kw), num_microbatches=micro)
        results.append([np.asarray(x) for x in jax.tree.leaves(nnx.state(model))])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_wrong_shared_prompts_flag_is_an_error(lm):
    ids, mask, comp = grouped_batch(g=2, n=2)
    ids[1, -1] += 1  # row 1 differs from row 0 of its group
    batch = GRPOBatch(
        prompt_ids=jnp.asarray(ids),
        prompt_mask=jnp.asarray(mask),
        completion_ids=jnp.asarray(comp),
        completion_mask=jnp.ones(comp.shape),
        rewards=jnp.zeros(4),
        group_size=2,
        shared_prompts=True,
    )
    assert batch.replace(shared_prompts=False).prompts_shared_within_groups() is False
    with pytest.raises(ValueError, match="shared_prompts"):
        batch.validate()


def test_categorical_log_probs_shapes():
    class Policy(nnx.Module):
        def __call__(self, x):
            return jnp.zeros((x.shape[0], 3, 5))

    batch = GRPOBatch(
        prompt_ids=jnp.zeros((4, 2)),
        completion_ids=jnp.zeros((4, 3), jnp.int32),
        completion_mask=jnp.ones((4, 3)),
        rewards=jnp.zeros(4),
        group_size=2,
    )
    lp, ent = categorical_log_probs(Policy(), batch)
    np.testing.assert_allclose(lp, np.log(1 / 5), rtol=1e-6)
    np.testing.assert_allclose(ent, np.log(5), rtol=1e-6)
    with pytest.raises(ValueError, match="do not fit actions"):
        categorical_log_probs(
            Policy(),
            batch.replace(
                completion_ids=jnp.zeros((4, 2), jnp.int32), completion_mask=jnp.ones((4, 2))
            ),
        )
