"""The KV-cache sampler against full forward passes, teacher forcing and known distributions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.inference import sampling
from artifex.generative_models.inference.sampling import Sampler, generate, sample_logits
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig


@pytest.fixture(scope="module")
def model():
    cfg = CausalLMConfig.tiny(
        vocab_size=64, hidden_size=64, intermediate_size=128, max_position_embeddings=64
    )
    return CausalLM(cfg, rngs=nnx.Rngs(0))


def prompts():
    ids = np.array([[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 9]], np.int32)
    mask = (ids != 0).astype(np.int32)
    return ids, mask


def np_logsoftmax(z):
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@jax.jit
def _forward(state, graphdef, seq, mask):
    return nnx.merge(graphdef, state)(seq, attention_mask=mask)


def forward(model, seq, mask):
    """Full cache-free forward pass (jitted; one compile per shape)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(state, graphdef, jnp.asarray(seq), jnp.asarray(mask)))


def teacher_forced(model, ids, mask, completion, temperature=1.0):
    """Log-probs of ``completion`` under one full (cache-free) forward pass."""
    completion = np.asarray(completion)
    seq = np.concatenate([ids, completion], axis=1)
    full_mask = np.concatenate([mask, np.ones(completion.shape, np.int32)], 1)
    logits = forward(model, seq, full_mask)
    p = ids.shape[1]
    lp = np_logsoftmax(logits[:, p - 1 : -1] / temperature)
    return np.take_along_axis(lp, completion[..., None], -1)[..., 0]


def test_greedy_equals_argmax_of_full_forward_passes(model):
    ids, mask = prompts()
    n, p = 10, ids.shape[1]
    out = generate(
        model,
        ids,
        mask,
        key=jax.random.key(0),
        num_generations=2,
        max_new_tokens=n,
        temperature=0.0,
        eos_ids=(),
    )
    # Step-by-step argmax of full forward passes over a fixed-width, right-padded sequence
    # (causal attention: padding to the right never changes earlier positions).
    seq = np.concatenate([np.repeat(ids, 2, 0), np.zeros((6, n), np.int32)], 1)
    msk = np.concatenate([np.repeat(mask, 2, 0), np.ones((6, n), np.int32)], 1)
    for t in range(n):
        logits = forward(model, seq, msk)[:, p + t - 1]
        seq[:, p + t] = np.argmax(logits, -1)
    np.testing.assert_array_equal(np.asarray(out.completion_ids), seq[:, p:])
    assert np.asarray(out.completion_mask).all() and np.asarray(out.truncated).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_teacher_forced(model, temperature):
    ids, mask = prompts()
    out = generate(
        model,
        ids,
        mask,
        key=jax.random.key(3),
        num_generations=4,
        max_new_tokens=12,
        temperature=temperature,
        eos_ids=(),
    )
    want = teacher_forced(
        model, np.repeat(ids, 4, 0), np.repeat(mask, 4, 0), out.completion_ids, temperature
    )
    np.testing.assert_allclose(np.asarray(out.log_probs), want, atol=1e-4)
    # Sampling really happened: generations of a prompt differ.
    comp = np.asarray(out.completion_ids).reshape(3, 4, -1)
    assert any(len({tuple(r) for r in comp[i]}) > 1 for i in range(3))


def test_eos_ends_its_row_and_masks_the_rest(model):
    ids, mask = prompts()
    greedy = generate(
        model, ids, mask, key=jax.random.key(0), max_new_tokens=8, temperature=0.0, eos_ids=()
    )
    toks = np.asarray(greedy.completion_ids)
    eos = int(toks[0, 3])  # row 0 emits this token at step 3 (maybe earlier too)
    first = int(np.argmax(toks[0] == eos))
    out = generate(
        model,
        ids,
        mask,
        key=jax.random.key(0),
        max_new_tokens=8,
        temperature=0.0,
        eos_ids=(eos, 63),
        pad_id=0,
    )
    c, m = np.asarray(out.completion_ids), np.asarray(out.completion_mask)
    assert m[0, : first + 1].all() and not m[0, first + 1 :].any()
    assert (c[0, first + 1 :] == 0).all() and c[0, first] == eos
    assert not bool(out.truncated[0])
    assert int(out.lengths[0]) == first + 1
    np.testing.assert_array_equal(np.asarray(out.log_probs)[0, first + 1 :], 0.0)
    for r in range(1, 3):  # rows without that EOS are unaffected
        hit = np.flatnonzero(np.isin(toks[r], (eos, 63)))
        end = hit[0] + 1 if hit.size else 8
        np.testing.assert_array_equal(c[r, :end], toks[r, :end])
        assert bool(out.truncated[r]) == (hit.size == 0)


def test_generation_stops_early_when_every_row_is_done(model):
    ids, mask = prompts()
    toks = np.asarray(
        generate(
            model, ids, mask, key=jax.random.key(0), max_new_tokens=2, temperature=0.0, eos_ids=()
        ).completion_ids
    )
    eos = tuple(int(t) for t in toks[:, 0])
    out = generate(
        model, ids, mask, key=jax.random.key(0), max_new_tokens=30, temperature=0.0, eos_ids=eos
    )
    assert np.asarray(out.lengths).max() == 1
    assert not np.asarray(out.completion_mask)[:, 1:].any()


def test_deterministic_for_a_key(model):
    ids, mask = prompts()
    a = generate(model, ids, mask, key=jax.random.key(7), num_generations=3, max_new_tokens=6)
    b = generate(model, ids, mask, key=jax.random.key(7), num_generations=3, max_new_tokens=6)
    c = generate(model, ids, mask, key=jax.random.key(8), num_generations=3, max_new_tokens=6)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.log_probs, b.log_probs)
    assert not np.array_equal(np.asarray(a.completion_ids), np.asarray(c.completion_ids))


def test_shared_prefill_gives_the_same_completions(model):
    ids, mask = prompts()
    kw = dict(key=jax.random.key(1), num_generations=4, max_new_tokens=8)
    a = generate(model, ids, mask, share_prefill=True, **kw)
    b = generate(model, ids, mask, share_prefill=False, **kw)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-5)


def test_compiled_once_per_bucket(model):
    before = sampling._generate._cache_size()
    for width in (5, 9, 16):  # all in the 16 bucket
        ids = np.ones((2, width), np.int32)
        generate(model, ids, key=jax.random.key(0), num_generations=2, max_new_tokens=4)
    assert sampling._generate._cache_size() == before + 1
    generate(
        model,
        np.ones((2, 17), np.int32),
        key=jax.random.key(0),
        num_generations=2,
        max_new_tokens=4,
    )
    assert sampling._generate._cache_size() == before + 2


def test_bucket_padding_does_not_change_results(model):
    ids, mask = prompts()
    kw = dict(key=jax.random.key(2), num_generations=2, max_new_tokens=6)
    a = generate(model, ids, mask, prompt_buckets=None, **kw)
    b = generate(model, ids, mask, prompt_buckets=(32,), **kw)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-5)
    assert b.prompt_ids.shape == (6, 32)


# ------------------------------------------------------------------ top-k / top-p statistics
LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))


def draw_many(n=8000, **kw):
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.size))
    tokens, logp = jax.jit(lambda k: sample_logits(logits, k, **kw))(jax.random.key(0))
    return np.asarray(tokens), np.asarray(logp)


@pytest.mark.parametrize(
    "kw,allowed",
    [
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_p=0.5), [0, 1]),  # 0.4 < 0.5, then 0.65 >= 0.5
        (dict(top_p=0.8), [0, 1, 2, 3]),  # 0.4, 0.65, 0.8 (< 0.8? no: 0.8 reached at 3)
        (dict(top_k=2, top_p=0.3), [0]),
        (dict(top_p=1e-6), [0]),
    ],
)
def test_top_k_top_p_never_sample_outside_the_allowed_set(kw, allowed):
    tokens, logp = draw_many(**kw)
    assert set(np.unique(tokens)) <= set(allowed)
    probs = np.exp(LOGITS.astype(np.float64))[allowed]
    probs /= probs.sum()
    freq = np.bincount(tokens, minlength=LOGITS.size)[allowed] / tokens.size
    # 8k draws: standard error <= 0.0056; allow ~5 sigma.
    np.testing.assert_allclose(freq, probs, atol=0.028)
    np.testing.assert_allclose(logp, np.log(probs)[np.searchsorted(allowed, tokens)], atol=1e-5)


def test_temperature_sharpens_the_distribution():
    tokens, _ = draw_many(temperature=0.5)
    p = np.exp(LOGITS.astype(np.float64) / 0.5)
    p /= p.sum()
    freq = np.bincount(tokens, minlength=LOGITS.size) / tokens.size
    np.testing.assert_allclose(freq, p, atol=0.028)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_generations=0), "num_generations"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(top_k=0), "top_k"),
        (dict(max_new_tokens=60), "prompt too long"),
    ],
)
def test_bad_arguments_name_the_argument(model, kw, match):
    ids, mask = prompts()
    with pytest.raises(ValueError, match=match):
        generate(model, ids, mask, key=jax.random.key(0), **kw)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_generations=2.0), r"num_generations must be an int, got 2.0 \(float\)"),
        (dict(num_generations=True), "num_generations must be an int"),
        (dict(top_k=1.5), "top_k must be an int or None"),
        (dict(temperature="1"), "temperature must be a real number"),
        (dict(top_p=None), "top_p must be a real number"),
    ],
)
def test_arguments_of_the_wrong_type_are_type_errors(model, kw, match):
    ids, mask = prompts()
    with pytest.raises(TypeError, match=match):
        generate(model, ids, mask, key=jax.random.key(0), **kw)


def test_empty_prompt_row_is_an_error(model):
    ids, mask = prompts()
    mask[1] = 0
    with pytest.raises(ValueError, match="empty prompt: row 1"):
        generate(model, ids, mask, key=jax.random.key(0))


def test_sampler_object_sees_model_updates(model):
    m = CausalLM(model.config, rngs=nnx.Rngs(1))
    sampler = Sampler(m, num_generations=2, max_new_tokens=4, temperature=0.0)
    ids, mask = prompts()
    a = sampler(ids, mask, key=jax.random.key(0))
    nnx.update(m, jax.tree.map(lambda x: x * 1.5, nnx.state(m, nnx.Param)))
    b = sampler(ids, mask, key=jax.random.key(0))
    assert not np.array_equal(np.asarray(a.log_probs), np.asarray(b.log_probs))


# ------------------------------------------------------------------ two-level inverse CDF
def test_inverse_cdf_matches_float64_search_over_several_blocks():
    from artifex.generative_models.inference.sampling import _inverse_cdf

    rng = np.random.default_rng(0)
    rows, v = 64, 300  # 5 blocks of 64, the last one padded
    probs = rng.random((rows, v)) ** 4
    probs[rng.random((rows, v)) < 0.5] = 0.0  # zero-probability tokens everywhere
    probs[:8, :] = 0.0
    probs[:8, 257] = 1.0  # one token, in the padded last block
    probs[8:16, :] = 0.0
    probs[8:16, [3, 70]] = 0.5  # two tokens, far apart
    uniform = rng.random((rows, 1))
    uniform[0] = uniform[8] = np.nextafter(np.float32(1), np.float32(0))  # largest draw
    uniform[1] = uniform[9] = np.finfo(np.float32).tiny  # smallest draw
    got = np.asarray(
        _inverse_cdf(jnp.asarray(probs, jnp.float32), jnp.asarray(uniform, jnp.float32))
    )
    cdf = np.cumsum(probs.astype(np.float32).astype(np.float64), axis=-1)
    u = uniform[:, 0] * cdf[:, -1]
    want = np.array([np.searchsorted(cdf[r], u[r], side="left") for r in range(rows)])
    assert np.all(probs[np.arange(rows), got] > 0)  # never a zero-probability token or padding
    assert np.all(got[:8] == 257)
    assert got[8] == 70 and got[9] == 3
    assert np.mean(got == want) >= 0.98  # float32 partial sums may differ at a boundary


def test_inverse_cdf_frequencies_over_a_large_vocabulary():
    from artifex.generative_models.inference.sampling import _inverse_cdf

    v, n = 1000, 20000
    p = np.zeros(v)
    p[[0, 63, 64, 500, 999]] = [0.1, 0.2, 0.3, 0.15, 0.25]
    uniform = jax.random.uniform(
        jax.random.key(3), (n, 1), jnp.float32, minval=np.finfo(np.float32).tiny
    )
    got = np.asarray(
        jax.jit(_inverse_cdf)(jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, v)), uniform)
    )
    freq = np.bincount(got, minlength=v) / n
    # 20k draws: standard error <= 0.0036; allow ~5 sigma.
    np.testing.assert_allclose(freq, p, atol=0.018)
