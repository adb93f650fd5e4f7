"""Continuous batching against ``generate``, teacher forcing and the model's exact distribution."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.inference import continuous, generate, generate_continuous
from artifex.generative_models.inference.continuous import slot_buckets, width_bucket
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig

CONFIG = CausalLMConfig.tiny(
    vocab_size=64, hidden_size=64, intermediate_size=128, max_position_embeddings=64
)


@pytest.fixture(scope="module")
def model():
    # One layer: what these tests check (refills, budgets, stops, sampling, programs) does not
    # depend on the depth; each layer's cache is checked with two layers in
    # test_scanned_and_stacked_layers_match_generate and test_on_a_mesh_matches_unsharded_greedy.
    return CausalLM(CONFIG.replace(num_layers=1), rngs=nnx.Rngs(0))


def prompts():
    ids = np.array(
        [[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 9], [0, 0, 8, 8, 3, 2]], np.int32
    )
    return ids, (ids != 0).astype(np.int32)


def np_logsoftmax(z):
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@jax.jit
def _forward(state, graphdef, seq, mask):
    return nnx.merge(graphdef, state)(seq, attention_mask=mask)


def forward(model, seq, mask):
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(state, graphdef, jnp.asarray(seq), jnp.asarray(mask)))


def teacher_forced(model, ids, mask, completion, temperature=1.0):
    """Float64 log-probs of ``completion`` under one cache-free forward pass."""
    completion = np.asarray(completion)
    seq = np.concatenate([ids, completion], axis=1)
    full_mask = np.concatenate([mask, np.ones(completion.shape, np.int32)], 1)
    logits = forward(model, seq, full_mask)
    p = ids.shape[1]
    lp = np_logsoftmax(logits[:, p - 1 : -1] / temperature)
    return np.take_along_axis(lp, completion[..., None], -1)[..., 0]


def assert_same_output(got, want, atol=1e-5):
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    np.testing.assert_array_equal(got.truncated, want.truncated)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_allclose(got.log_probs, want.log_probs, atol=atol)


# Greedy settings of two tests: their first ``generate`` run is one compiled program.
GREEDY = dict(key=jax.random.key(0), max_new_tokens=12, temperature=0.0)


# ------------------------------------------------------------------ against generate
@pytest.mark.parametrize("num_slots,steps", [(3, 4), (8, 32)])
def test_greedy_equals_generate_with_refills(model, num_slots, steps):
    ids, mask = prompts()
    greedy = generate(model, ids, mask, eos_ids=(), **GREEDY)
    # Two EOS ids the greedy rows emit at different steps: rows end at different lengths, and
    # the last prompt's rows (without either) run on after the others, so slots are compacted.
    toks = np.asarray(greedy.completion_ids)
    eos = (int(toks[0, 3]), int(toks[1, 4]))
    kw = dict(GREEDY, num_generations=2, eos_ids=eos)
    want = generate(model, ids, mask, **kw)
    got = generate_continuous(model, ids, mask, num_slots=num_slots, steps_per_call=steps, **kw)
    assert len(set(np.asarray(want.lengths).tolist())) > 2  # ragged
    assert_same_output(got, want)


# Sampled settings shared by two tests (the temperature is not part of a program).
SAMPLED = dict(key=jax.random.key(3), num_generations=3, max_new_tokens=10, num_slots=5,
               steps_per_call=3)  # fmt: skip


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_teacher_forced(model, temperature):
    ids, mask = prompts()
    out = generate_continuous(model, ids, mask, temperature=temperature, eos_ids=(), **SAMPLED)
    want = teacher_forced(
        model, np.repeat(ids, 3, 0), np.repeat(mask, 3, 0), out.completion_ids, temperature
    )
    np.testing.assert_allclose(np.asarray(out.log_probs), want, atol=1e-4)
    comp = np.asarray(out.completion_ids).reshape(4, 3, -1)
    assert any(len({tuple(r) for r in comp[i]}) > 1 for i in range(4))  # it sampled


def test_output_does_not_depend_on_slots_or_call_length(model):
    ids, mask = prompts()
    kw = dict(key=jax.random.key(5), num_generations=3, max_new_tokens=9, eos_ids=(7, 11))
    a = generate_continuous(model, ids, mask, num_slots=2, steps_per_call=2, **kw)
    b = generate_continuous(model, ids, mask, num_slots=12, steps_per_call=16, **kw)
    c = generate_continuous(model, ids, mask, num_slots=2, steps_per_call=2, **kw)
    assert_same_output(a, b)
    assert_same_output(a, c)
    d = generate_continuous(
        model, ids, mask, num_slots=2, steps_per_call=2, **kw | {"key": jax.random.key(6)}
    )
    assert not np.array_equal(np.asarray(a.completion_ids), np.asarray(d.completion_ids))


def test_scanned_and_stacked_layers_match_generate():
    model = CausalLM(CONFIG, rngs=nnx.Rngs(0))  # two layers
    ids, mask = prompts()
    kw = dict(key=jax.random.key(0), num_generations=2, max_new_tokens=6, temperature=0.0)
    want = generate(model, ids, mask, **kw)
    scanned = nnx.clone(model)
    scanned.scan_layers = True
    assert_same_output(generate_continuous(scanned, ids, mask, num_slots=3, **kw), want)
    stacked = nnx.clone(model).stack_layers()
    assert_same_output(generate_continuous(stacked, ids, mask, num_slots=3, **kw), want)


# ------------------------------------------------------------------ the distribution
def _chi2_quantile(df: int, q_z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal ``q_z``."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + q_z * math.sqrt(a)) ** 3


def test_first_two_tokens_follow_the_model_distribution():
    """Chi-square over the joint of the first two tokens (prefill draw, then a cached step)."""
    cfg = CausalLMConfig.tiny(
        vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=8, initializer_range=0.3,
    )  # fmt: skip
    model = CausalLM(cfg, rngs=nnx.Rngs(1))
    prompt = np.array([[3, 1, 4]], np.int32)
    draws = 3000
    out = generate_continuous(
        model, prompt, key=jax.random.key(0), num_generations=draws, max_new_tokens=2,
        eos_ids=(), temperature=0.8, num_slots=64, steps_per_call=8,
    )  # fmt: skip
    tokens = np.asarray(out.completion_ids)
    # Exact float64 probabilities of every (t1, t2) from full forward passes.
    v = cfg.vocab_size
    seq = np.concatenate([np.repeat(prompt, v, 0), np.arange(v)[:, None]], 1).astype(np.int32)
    logits = forward(model, seq, np.ones_like(seq))
    first = np.exp(np_logsoftmax(logits[0, 2] / 0.8))
    second = np.exp(np_logsoftmax(logits[:, 3] / 0.8))  # row t1: p(t2 | t1)
    expected = draws * first[:, None] * second
    observed = np.zeros((v, v))
    np.add.at(observed, (tokens[:, 0], tokens[:, 1]), 1)
    keep = expected >= 5  # pool the rare cells
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    rest_o, rest_e = observed[~keep].sum(), expected[~keep].sum()
    cells = int(keep.sum())
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    assert cells > 15
    assert stat < _chi2_quantile(cells - 1, 3.09), (stat, cells)  # p > 0.001
    # A distribution it does not follow is rejected: the empirical one against a flat one.
    flat = np.full((v, v), draws / v**2)
    assert ((observed - flat) ** 2 / flat).sum() > _chi2_quantile(v * v - 1, 3.09)


# ------------------------------------------------------------------ ends and budgets
def test_per_request_budgets_and_stop_sequences(model):
    ids, mask = prompts()
    # `full`: the first greedy run of test_greedy_equals_generate_with_refills (its program).
    kw = dict(GREEDY, eos_ids=())
    full = np.asarray(generate(model, ids, mask, **kw).completion_ids)
    # A stop sequence taken from row 1's greedy tokens ends row 1 right after it, and the
    # budgets end the others first. One run: a budget and a stop sequence are separate parts of
    # a decoding step (each row ends at whichever comes first), so it shows both.
    stop = (int(full[1, 3]), int(full[1, 4]))
    hits = np.array(
        [
            next((t + 1 for t in range(1, 12) if tuple(full[r, t - 1 : t + 1]) == stop), 12)
            for r in range(4)
        ]
    )
    budgets = np.array([3, 10, 1, 7])
    assert hits[1] <= 5 < budgets[1] and hits[2] > budgets[2]  # the stop ends row 1
    out = generate_continuous(
        model, ids, mask, max_new_tokens_per_request=budgets, stop_sequences=[stop],
        num_slots=3, **kw,
    )  # fmt: skip
    lengths = np.minimum(budgets, hits)
    np.testing.assert_array_equal(np.asarray(out.lengths), lengths)
    np.testing.assert_array_equal(np.asarray(out.truncated), budgets < hits)
    for r, n in enumerate(lengths):
        np.testing.assert_array_equal(np.asarray(out.completion_ids)[r, :n], full[r, :n])
        assert not np.asarray(out.completion_mask)[r, n:].any()


def test_stop_table_ends_like_an_eos_id(model):
    ids, mask = prompts()
    # SAMPLED's settings: `full` is test_log_probs_equal_teacher_forced[1.0]'s output, by the
    # programs that test compiled; only the table's and the EOS id's runs compile their own.
    kw = dict(SAMPLED, temperature=1.0, pad_id=0)
    full = generate_continuous(model, ids, mask, eos_ids=(), **kw).completion_ids
    token = int(np.asarray(full)[0, 2])
    table = np.zeros((2, 64), np.int32)
    table[0, token] = 1  # state 1 (the last) is the match state
    table[1, :] = 1
    a = generate_continuous(model, ids, mask, eos_ids=(), stop_table=table, **kw)
    b = generate_continuous(model, ids, mask, eos_ids=(token,), **kw)
    assert_same_output(a, b)
    assert int(np.asarray(a.lengths)[0]) <= 3


# ------------------------------------------------------------------ programs
def test_compiled_once_per_bucket(model):
    names = ("_decode_chunk", "_prefill", "_relayout")

    def sizes():
        return {name: getattr(continuous, name)._cache_size() for name in names}

    ids, mask = prompts()
    kw = dict(num_generations=2, max_new_tokens=8, eos_ids=(5,), num_slots=4, slot_levels=2)
    before = sizes()
    generate_continuous(model, ids, mask, key=jax.random.key(0), **kw)
    for seed in range(3):  # new prompts, new keys, other prompt widths in the same bucket
        rng = np.random.default_rng(seed)
        other = rng.integers(1, 64, (3 + seed, 4 + seed)).astype(np.int32)
        generate_continuous(model, other, key=jax.random.key(seed + 1), **kw)
    mid = sizes()
    # One width bucket (max_new_tokens is below the smallest) and two slot buckets: at most
    # two decoding programs; prefill groups of 1, 2 and 4 prompts.
    assert mid["_decode_chunk"] - before["_decode_chunk"] <= 2
    assert mid["_prefill"] - before["_prefill"] <= 3
    for seed in range(3, 6):  # every shape seen: nothing new compiles
        rng = np.random.default_rng(seed)
        other = rng.integers(1, 64, (4, 6)).astype(np.int32)
        generate_continuous(model, other, key=jax.random.key(seed), **kw)
    assert sizes()["_decode_chunk"] == mid["_decode_chunk"]
    assert sizes()["_prefill"] == mid["_prefill"]


def test_bucket_helpers():
    assert slot_buckets(64) == (64, 32, 16)
    assert slot_buckets(5, levels=4) == (5, 3, 2, 1)
    assert width_bucket(1, 1000, 128) == 128
    assert width_bucket(129, 1000, 128) == 256
    assert width_bucket(999, 1000, 128) == 1000
    with pytest.raises(ValueError, match="num_slots"):
        slot_buckets(0)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "kw,error,match",
    [
        (dict(num_slots=0), ValueError, "num_slots"),
        (dict(steps_per_call=0), ValueError, "steps_per_call"),
        (dict(max_new_tokens_per_request=[1, 2]), ValueError, "max_new_tokens_per_request"),
        (dict(max_new_tokens_per_request=[1, 2, 3, 99]), ValueError, r"\[1, max_new_tokens=4\]"),
        (dict(max_new_tokens_per_request=[1.0, 2, 3, 4]), TypeError, "max_new_tokens_per_req"),
        (dict(stop_sequences=[[]]), ValueError, "empty sequence"),
        (dict(stop_table=np.zeros((2, 5), np.int32)), ValueError, "stop_table"),
        (dict(stop_table=np.zeros((2, 64))), TypeError, "stop_table"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(num_generations=2.0), TypeError, "num_generations"),
    ],
)
def test_bad_arguments_name_the_argument(model, kw, error, match):
    ids, mask = prompts()
    with pytest.raises(error, match=match):
        generate_continuous(model, ids, mask, key=jax.random.key(0), max_new_tokens=4, **kw)


def test_bad_prompts_are_refused(model):
    with pytest.raises(ValueError, match="empty prompt"):
        generate_continuous(
            model, np.zeros((2, 3), np.int32), np.zeros((2, 3)), key=jax.random.key(0)
        )
    with pytest.raises(ValueError, match="vocabulary"):
        generate_continuous(model, np.full((1, 3), 99, np.int32), key=jax.random.key(0))
    with pytest.raises(ValueError, match="positions"):
        generate_continuous(
            model, np.ones((1, 3), np.int32), key=jax.random.key(0), max_new_tokens=62
        )


# ------------------------------------------------------------------ on a mesh
def test_on_a_mesh_matches_unsharded_greedy():
    from artifex.generative_models.training import make_mesh, shard_batch, shard_model

    cfg = CausalLMConfig.tiny(
        model_type="qwen2", attention_bias=True, vocab_size=128, hidden_size=32,
        intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        eos_token_id=1,
    )  # fmt: skip
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 128, (8, 5)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[::2, :2] = 0
    kw = dict(key=jax.random.key(0), num_generations=2, max_new_tokens=6, temperature=0.0)
    want = generate(CausalLM(cfg, rngs=nnx.Rngs(0)), ids, mask, prompt_buckets=None, **kw)
    mesh = make_mesh(2, 2, 2)
    sharded = shard_model(CausalLM(cfg, rngs=nnx.Rngs(0)), mesh)
    p_ids, p_mask = shard_batch((jnp.asarray(ids), jnp.asarray(mask)), mesh)
    got = generate_continuous(sharded, p_ids, p_mask, prompt_buckets=None, num_slots=8, **kw)
    assert_same_output(got, want)
