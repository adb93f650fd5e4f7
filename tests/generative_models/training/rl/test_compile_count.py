"""Compile count of a whole GRPO step: one program per shape bucket, nothing recompiled later.

A step is what the benchmarks time (``benchmarks/ours_worker.py``): ``generate`` K completions
per prompt, a host-side reward, ``GRPOTrainer.train_step``. The first step compiles the sampler
and the update once each; later steps with other prompts of the same width, other sampled tokens
and other rewards must compile nothing at all (counted through JAX's backend compile event, so a
stray jit anywhere in the step shows up). Another width in the same bucket reuses both programs
(only the two small left-padding ops of ``generate`` compile, once per new width). A prompt width
in the next bucket compiles the sampler and the update once more.

Shapes: W1's model (Qwen2, vocab 4096, width 256, 4 layers) with its 8 prompts x 4 and 32-token
prompts (buckets 32, then 64), 32 new tokens instead of 96: the update still runs as several
microbatches (2 slices, a ``lax.scan``; 4 with 96 tokens). W2's model (SmolLM2-135M's shape:
Llama, vocab 49152, width 576, 9 q / 3 kv heads, MLP 1536, tied) with 2 layers instead of 30,
4 prompts x 4 of 16 tokens (buckets 16, then 32) and 8 new tokens instead of 64 (one slice):
the time of its steps is the vocabulary-49152 head's arithmetic, which grows with the tokens,
not the programs. The layer count, the completion length and the prompt bucket do not change
which programs are built; the prompt widths do, and each case crosses a bucket boundary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.inference import generate, sampling
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch
from tests.generative_models.training.rl.compiles import CompileCounter, registered

W1_MODEL = CausalLMConfig.qwen2_w1()
W2_MODEL_2_LAYERS = CausalLMConfig(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=2,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100_000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)


@pytest.fixture(scope="module")
def counter():
    yield from registered(CompileCounter())


def _trainer(cfg, k):
    """A GRPO trainer (AdamW, beta 0.04) of a fresh model, its reference a copy of it.

    The reference is ``nnx.clone`` of the initial model (the trainer gives it arrays of its own):
    the same weights as a second ``CausalLM(cfg, rngs=nnx.Rngs(0))``, without drawing them again
    (about 10 s for W2's 49152 x 576 embedding at the tests' optimization level).
    """
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.Param)
    return GRPOTrainer(
        model, optimizer, GRPOConfig(num_generations=k, beta=0.04), reference_model=nnx.clone(model)
    )


def _rollout(trainer, ids, mask, key, k, n):
    """Samples K completions per prompt and scores them (fraction of even ids): a batch."""
    out = generate(
        trainer.model, ids, mask, key=key, num_generations=k, max_new_tokens=n, eos_ids=()
    )
    comp = np.asarray(jax.device_get(out.completion_ids))
    rewards = (comp % 2 == 0).mean(axis=1).astype(np.float32)
    batch = GRPOBatch(
        prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask,
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        rewards=jnp.asarray(rewards),
        group_size=k,
    )
    return batch, comp


def _step(trainer, ids, mask, key, k, n):
    batch, comp = _rollout(trainer, ids, mask, key, k, n)
    metrics = trainer.train_step(batch)
    jax.block_until_ready(metrics)
    return comp


def _prompts(rng, num, width, filled, vocab):
    """``num`` prompts left-padded to ``width`` with ``filled`` real tokens each."""
    ids = np.zeros((num, width), np.int32)
    mask = np.zeros((num, width), np.int32)
    ids[:, width - filled :] = rng.integers(2, vocab, (num, filled))
    mask[:, width - filled :] = 1
    return jnp.asarray(ids), jnp.asarray(mask)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cfg", "num_prompts", "k", "p", "n", "same_bucket", "next_bucket", "slices"),
    [
        (W1_MODEL, 8, 4, 32, 32, 20, 33, 2),  # bucket 32, then 64
        (W2_MODEL_2_LAYERS, 4, 4, 16, 8, 10, 17, 1),  # bucket 16, then 32
    ],
    ids=["W1", "W2-2-layers"],
)
def test_one_compile_per_shape_bucket(
    counter, cfg, num_prompts, k, p, n, same_bucket, next_bucket, slices
):
    trainer = _trainer(cfg, k)
    rng = np.random.default_rng(0)
    keys = iter(jax.random.split(jax.random.key(0), 32))
    gen_before = sampling._generate._cache_size()
    # The update train_step runs: in the trainer's own number of microbatches for these shapes
    # (on the CPU W1's 32 rows of 32 + 32 positions run as 2 slices, W2's 16 rows of 16 + 8 as
    # one), the same in both buckets.
    for width in (p, next_bucket):
        like = GRPOBatch.zeros(num_prompts, k, sampling.bucket_length(width), n)
        assert trainer.auto_microbatches(trainer.prepare_batch(like)) == slices
    update = trainer.compiled_step(slices)

    ids, mask = _prompts(rng, num_prompts, p, p, cfg.vocab_size)
    comp = _step(trainer, ids, mask, next(keys), k, n)  # first step: compiles
    assert comp.shape == (num_prompts * k, n)
    assert sampling._generate._cache_size() == gen_before + 1
    assert update._cache_size() == 1

    counter.count, counter.active = 0, True
    try:
        # Same prompt width: other prompts, other sampled tokens, other rewards, and the state
        # the first update returned (a changed type or placement would compile again here)
        # compile nothing.
        ids, mask = _prompts(rng, num_prompts, p, p // 2, cfg.vocab_size)
        _step(trainer, ids, mask, next(keys), k, n)
        assert counter.count == 0, f"{counter.count} compilations in a step of a compiled shape"

        # Another width in the same bucket: the sampler and the update are not compiled again;
        # only the left-padding to the bucket (two small device ops in ``generate``) compiles.
        ids, mask = _prompts(rng, num_prompts, same_bucket, same_bucket // 2, cfg.vocab_size)
        _step(trainer, ids, mask, next(keys), k, n)
        assert sampling._generate._cache_size() == gen_before + 1
        assert update._cache_size() == 1
        assert counter.count <= 2, f"{counter.count} compilations"
        # A width seen before compiles nothing, not even the padding.
        seen = counter.count
        ids, mask = _prompts(rng, num_prompts, same_bucket, same_bucket // 4, cfg.vocab_size)
        _step(trainer, ids, mask, next(keys), k, n)
        assert counter.count == seen, f"{counter.count - seen} compilations at a width seen before"

        # The next bucket: the sampler and the update compile once more, and only once.
        for _ in range(2):
            ids, mask = _prompts(rng, num_prompts, next_bucket, next_bucket, cfg.vocab_size)
            _step(trainer, ids, mask, next(keys), k, n)
        assert sampling._generate._cache_size() == gen_before + 2
        assert update._cache_size() == 2
    finally:
        counter.active = False


@pytest.mark.slow
def test_compile_ahead_compiles_the_update_once_for_the_first_rollout(counter):
    """``compile_ahead`` with a zero example in the sampler's layout: the first real update
    compiles nothing, and it is the same update as without it (bitwise: the same program)."""
    # W1's first bucket as in test_one_compile_per_shape_bucket (the same programs: in one
    # test run the compilation cache may already hold them).
    cfg, num_prompts, k, p, n = W1_MODEL, 8, 4, 32, 32
    ahead, plain = _trainer(cfg, k), _trainer(cfg, k)
    example = GRPOBatch.zeros(num_prompts, k, sampling.bucket_length(p), n)
    assert example.batch_size == num_prompts * k
    future = ahead.compile_ahead(example)
    ids, mask = _prompts(np.random.default_rng(0), num_prompts, p, p, cfg.vocab_size)
    # The sampler compiles and runs while the update compiles.
    batch, _ = _rollout(ahead, ids, mask, jax.random.key(0), k, n)
    assert future.result() is None
    counter.count, counter.active = 0, True
    try:
        got = ahead.train_step(batch)
    finally:
        counter.active = False
    assert counter.count == 0, f"{counter.count} compilations after compile_ahead"
    assert ahead.num_compilations == 1
    want = plain.train_step(batch)
    assert got == want
    for a, b in zip(
        jax.tree.leaves(nnx.state(ahead.model, nnx.Param)),
        jax.tree.leaves(nnx.state(plain.model, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_compile_ahead_checks_its_example_at_once():
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param),
                          GRPOConfig(num_generations=2, beta=0.0))  # fmt: skip
    example = {"observations": jnp.zeros((4, 4)), "actions": jnp.zeros(4, jnp.int32),
               "rewards": jnp.zeros(4)}  # fmt: skip
    with pytest.raises(ValueError, match="num_microbatches"):
        trainer.compile_ahead(example, num_microbatches=3)
    with pytest.raises(ValueError, match="group size"):
        trainer.compile_ahead({**example, "rewards": jnp.zeros(3)})
    assert trainer.num_compilations == 0
    # A differently shaped example: the real batch compiles its own program, and says so.
    trainer.compile_ahead(
        {
            **example,
            "observations": jnp.zeros((6, 4)),
            "actions": jnp.zeros(6, jnp.int32),
            "rewards": jnp.zeros(6),
        }
    ).result()
    trainer.train_step({**example, "rewards": jnp.array([1.0, 0.0, 0.0, 1.0])})
    assert trainer.num_compilations == 2


def test_zero_batch_has_the_sampler_layout_and_checks_its_sizes():
    batch = GRPOBatch.zeros(3, 4, 16, 5)
    assert (batch.batch_size, batch.group_size, batch.completion_length) == (12, 4, 5)
    assert batch.prompt_ids.shape == batch.prompt_mask.shape == (12, 16)
    assert batch.prompt_ids.dtype == batch.completion_mask.dtype == jnp.int32
    assert batch.rewards.dtype == jnp.float32 and batch.rewards.shape == (12,)
    assert batch.prompts_shared_within_groups()  # encoded once per group, as the sampler's
    batch.validate()
    with pytest.raises(ValueError, match="completion_length must be an int >= 1, got 0"):
        GRPOBatch.zeros(3, 4, 16, 0)
    with pytest.raises(TypeError, match="num_prompts must be an int"):
        GRPOBatch.zeros(3.0, 4, 16, 5)
