"""The packed update against the padded one and float64 NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training.rl import (
    GRPOBatch,
    GRPOConfig,
    GRPOTrainer,
    PackedGRPOBatch,
    causal_lm_log_probs,
    make_grpo_loss,
    pack_batch,
    packed_causal_lm_log_probs,
    packed_log_prob_fn,
    padding_fraction,
    row_bucket,
    should_pack,
)
from tests.generative_models.training.rl.test_variants import VARIANTS, np_objective

V = 48


@pytest.fixture(scope="module")
def model():
    cfg = CausalLMConfig.tiny(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
        head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    return CausalLM(cfg, rngs=nnx.Rngs(0))


def ragged_batch(seed, *, b=8, g=4, p=5, t=9, shared=True, holes=False, empty_row=False):
    """Left-padded prompts (shared within groups when ``shared``), ragged completions."""
    rng = np.random.default_rng(seed)
    n_groups = b // g
    plen = rng.integers(1, p + 1, size=n_groups if shared else b)
    prompt_ids = rng.integers(1, V, size=(len(plen), p))
    prompt_mask = (np.arange(p)[None] >= (p - plen)[:, None]).astype(np.int32)
    prompt_ids = prompt_ids * prompt_mask
    if shared:
        prompt_ids = np.repeat(prompt_ids, g, 0)
        prompt_mask = np.repeat(prompt_mask, g, 0)
    lengths = rng.integers(1, t + 1, size=b)
    lengths[1] = t
    if empty_row:
        lengths[2] = 0
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    if holes:  # a masked-out token inside a completion (a tool's output, say)
        mask[1, 2] = 0.0
    completion_ids = rng.integers(0, V, size=(b, t))
    old = (-2.0 + 0.3 * rng.normal(size=(b, t))).astype(np.float32)
    return GRPOBatch(
        prompt_ids=jnp.asarray(prompt_ids, jnp.int32),
        prompt_mask=jnp.asarray(prompt_mask),
        completion_ids=jnp.asarray(completion_ids, jnp.int32),
        completion_mask=jnp.asarray(mask),
        rewards=jnp.asarray(rng.normal(size=b), jnp.float32),
        old_log_probs=jnp.asarray(old),
        sampler_log_probs=jnp.asarray(old + 0.2 * rng.normal(size=(b, t)), jnp.float32),
        ref_log_probs=jnp.asarray(old + 0.3 * rng.normal(size=(b, t)), jnp.float32),
        group_size=g,
        shared_prompts=shared,
    )


def np_logsoftmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def teacher_forced(model, batch, temperature=1.0):
    """Float64 log-probs and entropies of each row's completion, without packing or padding.

    Each row's real prompt tokens and completion (up to its last counted token) start at
    position 0, as alone; the rows run in one causal forward, right-filled with token 0 to a
    common width (a causal model's logits at a position do not depend on the tokens after it),
    so that the reference compiles once, not once per row length.
    """
    prompt_ids, prompt_mask = np.asarray(batch.prompt_ids), np.asarray(batch.prompt_mask)
    completion_ids = np.asarray(batch.completion_ids)
    mask = np.asarray(batch.completion_mask) > 0
    b, t = completion_ids.shape
    lengths = np.where(mask.any(1), t - np.argmax(mask[:, ::-1], 1), 0)
    seqs = [
        np.concatenate([prompt_ids[i][prompt_mask[i] > 0], completion_ids[i, : lengths[i]]])
        for i in range(b)
    ]
    ids = np.zeros((b, prompt_ids.shape[1] + t), np.int32)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = seq
    logits = np.asarray(model(jnp.asarray(ids)))
    logp, ent = np.zeros((b, t)), np.zeros((b, t))
    for i, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
        if n == 0:
            continue
        lp = np_logsoftmax(logits[i, len(seq) - n - 1 : len(seq) - 1] / temperature)
        logp[i, :n] = lp[np.arange(n), completion_ids[i, :n]]
        ent[i, :n] = -(np.exp(lp) * lp).sum(-1)
    return logp, ent


# ------------------------------------------------------------------ the layout
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("micro", [1, 2])
def test_layout_places_every_token_once_where_it_belongs(seed, shared, micro):
    batch = ragged_batch(seed, shared=shared, holes=True, empty_row=True)
    packed = pack_batch(batch, num_microbatches=micro)
    lay = jax.tree.map(np.asarray, packed.layout)
    prompt_mask = np.asarray(batch.prompt_mask) > 0
    mask = np.asarray(batch.completion_mask) > 0
    b, p = prompt_mask.shape
    t = mask.shape[1]
    size, rows = b // micro, lay.input_source.shape[0] // micro
    width = lay.input_source.shape[1]
    assert width == p + t and rows == row_bucket(rows)
    last = np.where(mask.any(1), t - np.argmax(mask[:, ::-1], 1), 0)
    for m in range(micro):
        src = lay.input_source[m * rows : (m + 1) * rows]
        seg = lay.segment_ids[m * rows : (m + 1) * rows]
        br = lay.branch_ids[m * rows : (m + 1) * rows]
        pos = lay.positions[m * rows : (m + 1) * rows]
        tgt = lay.target_source[m * rows : (m + 1) * rows]
        real = seg > 0
        # Every completion token up to the last counted one appears once, at its position.
        comp = real & (br > 0)
        for li in range(size):
            i = m * size + li
            where = np.argwhere(comp & (src // (p + t) == li))
            cols = src[tuple(where.T)] % (p + t) - p
            assert sorted(cols.tolist()) == list(range(last[i]))
            if last[i] == 0:
                continue
            r = where[0, 0]
            assert (where[:, 0] == r).all()  # one row, contiguous, in order
            order = np.argsort(where[:, 1])
            np.testing.assert_array_equal(cols[order], np.arange(last[i]))
            assert np.ptp(where[:, 1]) == last[i] - 1
            plen = int(prompt_mask[i].sum())
            np.testing.assert_array_equal(pos[r, where[order, 1]], plen + np.arange(last[i]))
            u, k = seg[r, where[0, 1]], br[r, where[0, 1]]
            assert (seg[r, where[:, 1]] == u).all() and (br[r, where[:, 1]] == k).all()
            # Its unit's prompt: the row's real prompt tokens, positions 0.., before it.
            head = np.flatnonzero((seg[r] == u) & (br[r] == 0))
            assert head.size == plen and head.max() < where[:, 1].min()
            pcols = src[r, head] % (p + t)
            prow = m * size + src[r, head[0]] // (p + t)
            np.testing.assert_array_equal(pcols, np.flatnonzero(prompt_mask[i]))
            np.testing.assert_array_equal(pos[r, head], np.arange(plen))
            assert prow == i or (shared and prow // batch.group_size == i // batch.group_size)
            # Who predicts what.
            first = lay.first_source[i]
            assert first == r * width + head[-1]
            assert lay.token_source[i, 0] == rows * width + li
            for s in range(1, last[i]):
                q = lay.token_source[i, s]
                assert src.reshape(-1)[q] == li * (p + t) + p + s - 1
                assert tgt.reshape(-1)[q] == li * t + s
            assert (lay.token_source[i, last[i] :] == -1).all()
        # Padding is padding.
        assert (src[~real] == 0).all() and (br[~real] == 0).all()
    # Packed, the batch takes no more positions than padded.
    assert rows * width * micro <= b * (p + t)


def test_shared_prompts_are_stored_once_per_row_they_span():
    batch = ragged_batch(3, b=8, g=4, shared=True)
    shared = pack_batch(batch).layout
    alone = pack_batch(batch.replace(shared_prompts=False)).layout

    def prompt_tokens(lay):
        return int(((np.asarray(lay.segment_ids) > 0) & (np.asarray(lay.branch_ids) == 0)).sum())

    plen = np.asarray(batch.prompt_mask).sum(1)
    assert prompt_tokens(alone) == plen.sum()
    assert prompt_tokens(shared) < plen.sum()


def test_row_buckets_and_the_packing_rule():
    assert [row_bucket(n) for n in (1, 8, 9, 10, 11, 13, 16, 17, 25, 100)] == [
        1, 8, 10, 10, 12, 14, 16, 20, 28, 112,
    ]  # fmt: skip
    batch = ragged_batch(0, t=40)
    frac = padding_fraction(batch)
    prompt_mask = np.asarray(batch.prompt_mask)
    mask = np.asarray(batch.completion_mask) > 0
    last = np.where(mask.any(1), 40 - np.argmax(mask[:, ::-1], 1), 0)
    want = 1 - (prompt_mask[::4].sum() + last.sum()) / (2 * 5 + 8 * 40)
    np.testing.assert_allclose(frac, want)
    assert should_pack(batch, 0.2) and not should_pack(batch, 0.3)
    assert not should_pack(pack_batch(batch))
    with pytest.raises(ValueError, match="threshold"):
        should_pack(batch, 1.5)


@pytest.mark.parametrize(
    "change,kw,error,match",
    [
        (dict(group_ids=jnp.zeros(8, jnp.int32)), {}, ValueError, "group_ids"),
        ({}, dict(row_length=6), ValueError, "row_length=6"),
        ({}, dict(num_microbatches=3), ValueError, "num_microbatches=3"),
        ({}, dict(row_multiple=0), ValueError, "row_multiple"),
        (dict(prompt_mask=jnp.zeros((8, 5), jnp.int32)), {}, ValueError, "no real prompt token"),
        (dict(prompt_ids=jnp.ones((8, 3), jnp.float32)), {}, ValueError, "integer prompt_ids"),
    ],
)
def test_bad_batches_are_refused(change, kw, error, match):
    batch = ragged_batch(0).replace(**change)
    with pytest.raises(error, match=match):
        pack_batch(batch, **kw)
    with pytest.raises(TypeError, match="packed already"):
        pack_batch(pack_batch(ragged_batch(0)))


# ------------------------------------------------------------------ the forward pass
def test_packed_rows_give_each_sequence_its_own_hidden_states(model):
    a, b_, c = [5, 6, 7], [8, 9], [10, 11, 12, 13]
    ids = jnp.array([a + b_ + c + [0]])
    # [a ; b] shares a (branch 0) with b (branch 1); c is a unit of its own; then padding.
    seg = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 0]])
    br = jnp.array([[0, 0, 0, 1, 1, 0, 0, 0, 0, 0]])
    pos = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0]])
    packed = np.asarray(model.packed_hidden_states(ids, pos, seg, br))
    for lo, hi, seq in ((0, 5, a + b_), (5, 9, c)):
        alone, _ = model.hidden_states(jnp.array([seq]))
        np.testing.assert_allclose(packed[0, lo:hi], np.asarray(alone[0]), atol=2e-5)
    assert np.isfinite(packed).all()
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        model.packed_hidden_states(ids, pos, seg[:, :3])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shared", [True, False])
def test_packed_log_probs_match_float64_teacher_forcing(model, seed, shared):
    batch = ragged_batch(seed, shared=shared, holes=True, empty_row=True)
    want_lp, want_ent = teacher_forced(model, batch, temperature=0.7)
    packed = pack_batch(batch)
    lp, ent = jax.jit(
        lambda m, bt: packed_causal_lm_log_probs(m, bt, temperature=0.7, chunk_size=16)
    )(model, packed)
    np.testing.assert_allclose(np.asarray(lp), want_lp, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent), want_ent, atol=2e-5)
    # And those of the padded computation on every counted token.
    mask = np.asarray(batch.completion_mask)
    padded, _ = causal_lm_log_probs(
        model, batch.prompt_ids, batch.completion_ids, prompt_mask=batch.prompt_mask,
        temperature=0.7, shared_prompt_group=4 if shared else None,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(lp) * mask, np.asarray(padded) * mask, atol=2e-5)


def test_scanned_and_rematerialized_layers_give_the_same_log_probs(model):
    batch = pack_batch(ragged_batch(4))
    want, _ = packed_causal_lm_log_probs(model, batch)
    for kw in (dict(scan_layers=True), dict(remat=True), dict(remat=2)):
        got, _ = packed_causal_lm_log_probs(model, batch, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_log_prob_fn_runs_plain_batches_as_before(model):
    batch = ragged_batch(5)
    fn = packed_log_prob_fn()
    got, _ = fn(model, batch)
    want, _ = causal_lm_log_probs(
        model, batch.prompt_ids, batch.completion_ids, prompt_mask=batch.prompt_mask,
        shared_prompt_group=4,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(TypeError, match="PackedGRPOBatch"):
        packed_causal_lm_log_probs(model, batch)


# ------------------------------------------------------------------ the loss and its gradient
LOSS_VARIANTS = {
    "clip_token_mean": dict(VARIANTS["clip"], loss_aggregation="token_mean"),
    "cispo": dict(VARIANTS["cispo"]),
    "sapo_sequence_sum": dict(VARIANTS["sapo"], loss_aggregation="sequence_sum"),
    "vespo": dict(VARIANTS["vespo"], loss_aggregation="token_mean"),
    "gspo": dict(VARIANTS["gspo"], loss_aggregation="constant_length"),
    "everything": dict(VARIANTS["everything"]),
    "sequence_is": dict(VARIANTS["sequence_is"]),
}


@pytest.mark.parametrize("variant", sorted(LOSS_VARIANTS))
def test_loss_gradient_and_metrics_equal_the_padded_update(model, variant):
    cfg = GRPOConfig(
        num_generations=4, beta=0.04, entropy_coeff=0.01, max_completion_length=12,
        **LOSS_VARIANTS[variant],
    )  # fmt: skip
    batch = ragged_batch(6, holes=True)
    packed = pack_batch(batch)
    params = nnx.state(model, nnx.Param)
    padded_loss = make_grpo_loss(model, cfg)
    packed_loss = make_grpo_loss(model, cfg, log_prob_fn=packed_log_prob_fn())
    (want, want_m), want_g = jax.value_and_grad(padded_loss, has_aux=True)(params, batch)
    (got, got_m), got_g = jax.value_and_grad(packed_loss, has_aux=True)(params, packed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert set(got_m) == set(want_m)
    for key in want_m:
        np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-4, atol=2e-6, err_msg=key)
    flat_want, flat_got = jax.tree.leaves(want_g), jax.tree.leaves(got_g)
    assert max(float(jnp.abs(x).max()) for x in flat_want) > 0
    for x, y in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=2e-6)
    # And the float64 objective of the float64 teacher-forced log-probs.
    logp, ent = teacher_forced(model, batch)
    from artifex.generative_models.training.rl import compute_advantages

    adv = np.asarray(compute_advantages(batch, cfg), np.float64)
    mask = np.asarray(batch.completion_mask, np.float64)
    ref = np_objective(
        logp, np.asarray(batch.old_log_probs), np.asarray(batch.sampler_log_probs),
        np.asarray(batch.ref_log_probs), ent, mask, adv, cfg,
    )  # fmt: skip
    np.testing.assert_allclose(float(got), ref, rtol=1e-4, atol=1e-6)


def test_one_compilation_per_row_bucket(model):
    cfg = GRPOConfig(num_generations=4, beta=0.0)
    loss = jax.jit(make_grpo_loss(model, cfg, log_prob_fn=packed_log_prob_fn()))
    params = nnx.state(model, nnx.Param)
    shapes = set()
    for seed in range(4):
        packed = pack_batch(ragged_batch(seed, t=9))
        shapes.add(packed.layout.input_source.shape)
        loss(params, packed)
    assert loss._cache_size() == len(shapes) < 4


# ------------------------------------------------------------------ in the trainer
def own_copy(model):
    """A copy of ``model`` with buffers of its own (a trainer donates the policy's)."""
    copy = nnx.clone(model)
    nnx.update(copy, jax.tree.map(lambda x: jnp.array(x, copy=True), nnx.state(copy)))
    return copy


# The trainer's update (KL to a reference, token_mean) and the batch both test_trainer_* use.
TRAINER_CONFIG = GRPOConfig(num_generations=4, beta=0.04, loss_aggregation="token_mean")


def trainer_batch() -> GRPOBatch:
    return ragged_batch(7, t=12)


def test_trainer_update_is_the_padded_update(model):
    """Two microbatches of a packed batch (each packed on its own rows); the unsliced packed
    update is the loss's (test_loss_gradient_and_metrics_equal_the_padded_update) and the
    training loop's (test_the_loop_packs_and_trains_as_it_would_padded)."""
    cfg, micro = TRAINER_CONFIG, 2
    results = []
    for pack in (False, True):
        policy = own_copy(model)
        trainer = GRPOTrainer(
            policy,
            nnx.Optimizer(policy, optax.sgd(0.5), wrt=nnx.Param),
            cfg,
            reference_model=own_copy(model),
            log_prob_fn=packed_log_prob_fn(),
        )
        batch = trainer_batch()
        if pack:
            batch = pack_batch(batch, num_microbatches=micro)
            assert isinstance(batch, PackedGRPOBatch)
        metrics = trainer.train_step(batch, num_microbatches=micro)
        results.append((metrics, [np.asarray(x) for x in jax.tree.leaves(nnx.state(policy))]))
    (want_m, want_p), (got_m, got_p) = results
    assert set(got_m) == set(want_m)
    for key in want_m:
        np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-4, atol=2e-6, err_msg=key)
    for x, y in zip(got_p, want_p, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_trainer_packs_when_padding_is_above_its_threshold(model):
    # the update and batch of test_trainer_update_is_the_padded_update (the programs it compiled)
    cfg = TRAINER_CONFIG
    results = []
    for threshold in (None, 0.2):
        policy = own_copy(model)
        trainer = GRPOTrainer(
            policy,
            nnx.Optimizer(policy, optax.sgd(0.5), wrt=nnx.Param),
            cfg,
            reference_model=own_copy(model),
            packing_threshold=threshold,
        )
        batch = trainer_batch()
        assert padding_fraction(batch) > 0.2
        packed = trainer.maybe_pack(trainer.prepare_batch(batch))
        assert isinstance(packed, PackedGRPOBatch) == (threshold is not None)
        assert trainer.maybe_pack(trainer.prepare_batch(batch), 2) is not packed
        metrics = trainer.train_step(batch, num_microbatches=2)
        results.append((metrics, [np.asarray(x) for x in jax.tree.leaves(nnx.state(policy))]))
    (want_m, want_p), (got_m, got_p) = results
    for key in want_m:
        np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-4, atol=2e-6, err_msg=key)
    for x, y in zip(got_p, want_p, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    # Above the threshold only; never for a custom log-prob function.
    policy = own_copy(model)
    opt = nnx.Optimizer(policy, optax.sgd(0.5), wrt=nnx.Param)
    high = GRPOTrainer(policy, opt, cfg, packing_threshold=0.99)
    assert not isinstance(high.maybe_pack(high.prepare_batch(ragged_batch(8))), PackedGRPOBatch)
    custom = GRPOTrainer(policy, opt, cfg, packing_threshold=0.0, log_prob_fn=packed_log_prob_fn())
    assert not isinstance(custom.maybe_pack(custom.prepare_batch(ragged_batch(8))), PackedGRPOBatch)
    with pytest.raises(ValueError, match="packing_threshold"):
        GRPOTrainer(policy, opt, cfg, packing_threshold=1.5)


def test_the_loop_packs_and_trains_as_it_would_padded(monkeypatch):
    from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
    from artifex.generative_models.training.rl import RolloutConfig, TrainConfig, train
    from artifex.generative_models.training.rl.rewards import math_answer_reward

    rows, _ = addition_dataset(seed=0, num_eval=4)
    tok = demo_tokenizer()
    packed_batches = []
    original = GRPOTrainer.maybe_pack

    def spy(self, batch, num_microbatches=1):
        out = original(self, batch, num_microbatches)
        packed_batches.append(isinstance(out, PackedGRPOBatch))
        return out

    monkeypatch.setattr(GRPOTrainer, "maybe_pack", spy)
    final = []
    # the demo model's tokens and sizes with one decoder layer (the packed forward's layers are
    # checked against float64 above): the loop's two runs compile a third less
    one_layer = demo_model(tok, seed=0).config.replace(num_layers=1)
    for threshold in (None, 0.0):
        model = CausalLM(one_layer, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        trainer = GRPOTrainer(
            model, opt, GRPOConfig(num_generations=4, beta=0.0), packing_threshold=threshold
        )
        train(
            trainer, tok, rows[:16], [math_answer_reward(last_number_fallback=True)],
            TrainConfig(num_steps=2, prompts_per_step=4, num_minibatches=2, progress=False),
            RolloutConfig(max_new_tokens=6),
        )  # fmt: skip
        final.append([np.asarray(x) for x in jax.tree.leaves(nnx.state(model))])
    assert packed_batches == [False] * 4 + [True] * 4
    for x, y in zip(final[1], final[0], strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
