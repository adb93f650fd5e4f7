"""The trainer's own number of microbatches (``GRPOTrainer.auto_microbatches``).

On the CPU a causal LM's update runs, unless told otherwise, in the most slices of whole prompt
groups that keep at least ``MIN_MICROBATCH_TOKENS`` token positions each; the update is the
same as in one piece. Elsewhere (other models, other precisions, a mesh, the options that make
slices cost more) it runs in one piece.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch, TrainConfig
from artifex.generative_models.training.rl.grpo import (
    MIN_MICROBATCH_TOKENS,
    auto_num_microbatches,
)

TINY = CausalLMConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2)


def _positions(rows: int, group: int, prompt: int, completion: int, m: int, shared: bool) -> int:
    """Token positions of one of ``m`` slices, counted independently of the library."""
    r = rows // m
    return r * completion + (r // group) * prompt if shared else r * (prompt + completion)


def _brute_force(rows: int, group: int, prompt: int, completion: int, shared: bool) -> int:
    ok = [
        m
        for m in range(1, rows + 1)
        if rows % m == 0
        and (not shared or (rows // m) % group == 0)
        and (m == 1 or _positions(rows, group, prompt, completion, m, shared) >= 512)
    ]
    return max(ok)


@pytest.mark.parametrize(
    ("rows", "group", "prompt", "completion", "shared", "expected"),
    [
        (32, 4, 32, 96, True, 4),  # W1: 832 positions a slice (8 slices: 416)
        (16, 4, 64, 64, True, 2),  # W2's shape: 640 (4 slices: 320)
        (8, 4, 16, 32, True, 1),  # 320 positions in all
        (12, 4, 64, 128, True, 3),  # slices of whole groups only: 1 or 3
        (8, 4, 0, 64, True, 1),  # no prompt: 512 in all, two slices would be 256
        (16, 4, 0, 64, True, 2),  # exactly 512 a slice is enough
        (32, 4, 32, 96, False, 8),  # unshared prompts: 4 rows of 128 = 512 a slice
        (6, 3, 100, 100, False, 2),  # unshared: any divisor (3 slices: 400 positions)
    ],
)
def test_auto_num_microbatches_is_the_most_slices_of_enough_positions(
    rows, group, prompt, completion, shared, expected
):
    got = auto_num_microbatches(rows, group, prompt, completion, shared_prompts=shared)
    assert got == expected == _brute_force(rows, group, prompt, completion, shared)
    if got > 1:
        assert _positions(rows, group, prompt, completion, got, shared) >= MIN_MICROBATCH_TOKENS


def test_auto_num_microbatches_against_brute_force_on_many_shapes():
    rng = np.random.default_rng(0)
    for _ in range(300):
        group = int(rng.integers(1, 9))
        rows = group * int(rng.integers(1, 17))
        prompt, completion = int(rng.integers(0, 300)), int(rng.integers(1, 300))
        shared = bool(rng.integers(2))
        want = _brute_force(rows, group, prompt, completion, shared)
        got = auto_num_microbatches(rows, group, prompt, completion, shared_prompts=shared)
        assert got == want, (rows, group, prompt, completion, shared)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rows": 0}, "rows"),
        ({"group_size": 0}, "group_size"),
        ({"prompt_width": -1}, "prompt_width"),
        ({"completion_width": 0}, "completion_width"),
        ({"rows": 8.0}, "rows"),
        ({"rows": True}, "rows"),
        ({"min_tokens": 0}, "min_tokens"),
    ],
)
def test_auto_num_microbatches_names_a_bad_argument(kwargs, field):
    args = {"rows": 8, "group_size": 4, "prompt_width": 8, "completion_width": 8, **kwargs}
    with pytest.raises(ValueError, match=f"{field} must be an int"):
        auto_num_microbatches(**args)


def test_auto_num_microbatches_wants_whole_groups_with_shared_prompts():
    with pytest.raises(ValueError, match="group_size=4 must divide rows=6"):
        auto_num_microbatches(6, 4, 8, 8)
    assert auto_num_microbatches(6, 4, 100, 100, shared_prompts=False) == 2


def _trainer(config: GRPOConfig | None = None, dtype=jnp.float32, **kwargs) -> GRPOTrainer:
    model = CausalLM(TINY, rngs=nnx.Rngs(0), dtype=dtype)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    config = GRPOConfig(num_generations=4, beta=0.0) if config is None else config
    return GRPOTrainer(model, optimizer, config, **kwargs)


def _lm_batch(num_prompts: int, prompt: int, completion: int, seed: int = 0) -> GRPOBatch:
    """``num_prompts`` groups of 4 rows sharing their prompt, random completions and rewards."""
    rng = np.random.default_rng(seed)
    prompts = np.repeat(rng.integers(1, 32, (num_prompts, prompt)), 4, axis=0)
    rows = num_prompts * 4
    return GRPOBatch(
        prompt_ids=jnp.asarray(prompts, jnp.int32),
        prompt_mask=jnp.ones((rows, prompt), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(0, 32, (rows, completion)), jnp.int32),
        completion_mask=jnp.ones((rows, completion), jnp.int32),
        rewards=jnp.asarray(rng.random(rows), jnp.float32),
        group_size=4,
    )


def test_the_trainer_slices_a_large_enough_cpu_batch_and_the_update_is_the_same():
    batch = _lm_batch(8, 16, 48)  # 32 rows, 8 * 16 + 32 * 48 = 1664 positions: 2 slices
    sliced, whole = _trainer(), _trainer()
    prepared = sliced.prepare_batch(batch)
    assert prepared.shared_prompts and sliced.auto_microbatches(prepared) == 2
    m_sliced = sliced.train_step(batch)  # num_microbatches not given: the trainer's choice
    m_whole = whole.train_step(batch, num_microbatches=1)
    assert set(sliced._steps) == {2} and set(whole._steps) == {1}
    chex.assert_trees_all_close(
        nnx.state(sliced.model, nnx.Param),
        nnx.state(whole.model, nnx.Param),
        rtol=1e-5,
        atol=1e-7,
    )
    np.testing.assert_allclose(m_sliced["total_loss"], m_whole["total_loss"], rtol=1e-5)
    np.testing.assert_allclose(m_sliced["grad_norm"], m_whole["grad_norm"], rtol=1e-5)
    # compile_ahead and apply_prepared make the same choice: nothing else compiles.
    sliced.compile_ahead(batch).result()
    sliced.apply_prepared(prepared)
    assert set(sliced._steps) == {2} and sliced.num_compilations == 1


def test_a_small_batch_runs_in_one_piece():
    trainer = _trainer()
    batch = trainer.prepare_batch(_lm_batch(2, 8, 16))
    assert trainer.auto_microbatches(batch) == 1
    trainer.train_step(batch)
    assert set(trainer._steps) == {1}


def test_where_slices_are_not_chosen():
    large = _lm_batch(8, 16, 48)
    trainer = _trainer()
    assert trainer.auto_microbatches(trainer.prepare_batch(large)) == 2
    # Lower-precision parameters: the slices' gradients would be summed in that precision.
    bf16 = _trainer(dtype=jnp.bfloat16)
    assert bf16.auto_microbatches(bf16.prepare_batch(large)) == 1
    # A further forward pass per slice for the entropy quantile.
    cfg = GRPOConfig(num_generations=4, beta=0.0, top_entropy_quantile=0.5)
    entropy = _trainer(cfg)
    assert entropy.auto_microbatches(entropy.prepare_batch(large)) == 1
    # Groups of different sizes.
    ids = jnp.repeat(jnp.arange(8), 4)
    assert trainer.auto_microbatches(large.replace(group_ids=ids)) == 1
    # On a mesh (one CPU device is enough to make one).
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    meshed = _trainer(mesh=mesh)
    assert meshed.auto_microbatches(meshed.prepare_batch(large)) == 1
    # A policy that is not a causal LM.
    linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    plain = GRPOTrainer(
        linear,
        nnx.Optimizer(linear, optax.sgd(0.1), wrt=nnx.Param),
        GRPOConfig(num_generations=4, beta=0.0),
    )
    obs = {
        "observations": jnp.ones((4096, 4)),
        "actions": jnp.zeros(4096, jnp.int32),
        "rewards": jnp.arange(4096.0) % 2,
    }
    assert plain.auto_microbatches(plain.prepare_batch(obs)) == 1


def test_an_explicit_number_is_used_and_checked():
    trainer = _trainer()
    batch = _lm_batch(8, 16, 48)
    trainer.train_step(batch, num_microbatches=4)
    assert set(trainer._steps) == {4}
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1 dividing"):
        trainer.train_step(batch, num_microbatches=3)


def test_train_config_leaves_the_choice_to_the_trainer_by_default():
    assert TrainConfig(num_steps=1).gradient_accumulation_steps is None
    two = TrainConfig(num_steps=1, gradient_accumulation_steps=2)
    assert two.gradient_accumulation_steps == 2
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        TrainConfig(num_steps=1, gradient_accumulation_steps=0)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_the_loop_compiles_ahead_and_runs_the_trainers_choice(minibatches):
    """``TrainConfig.gradient_accumulation_steps=None``: the update the loop compiles ahead
    and the one it runs are the trainer's choice for one minibatch's rows (the shuffled rows of
    a minibatch do not share prompts), compiled once."""
    from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
    from artifex.generative_models.inference import sampling
    from artifex.generative_models.training.rl.loop import train
    from artifex.generative_models.training.rl.rewards import math_answer_reward
    from artifex.generative_models.training.rl.rollout import RolloutConfig

    tok = demo_tokenizer()
    model = demo_model(tok, seed=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    trainer = GRPOTrainer(model, opt, GRPOConfig(num_generations=4, beta=0.0))
    rows, _ = addition_dataset(seed=0, num_eval=4)
    rollout = RolloutConfig(max_new_tokens=24)  # the demo model has 32 positions
    config = TrainConfig(
        num_steps=1, prompts_per_step=32, num_minibatches=minibatches, progress=False, seed=1
    )
    train(trainer, tok, rows[:64], [math_answer_reward()], config, rollout)
    (slices,) = trainer._steps  # one update program, compiled once
    assert trainer.num_compilations == 1
    # 128 rows of 24 completion tokens in groups of 4 sharing their prompt; a minibatch of 64
    # shuffled rows does not share prompts.
    width = sampling.bucket_length(max(len(tok.encode(r["prompt"])) for r in rows[:64]))
    rows_per_update = 128 // minibatches
    want = auto_num_microbatches(rows_per_update, 4, width, 24, shared_prompts=minibatches == 1)
    assert slices == want > 1


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_slices_report_the_sampler_metrics_of_the_whole_batch(level):
    """The sampler means have their own denominators (tokens the sampler scored; tokens or
    completions): slices are combined by them, so the metrics equal the whole batch's even
    with unscored tokens and an empty row."""
    rng = np.random.default_rng(1)
    batch = _lm_batch(8, 16, 48)
    mask = np.asarray(batch.completion_mask).copy()
    mask[3] = 0  # an empty row
    mask[:, 30:] = rng.random((32, 18)) < 0.5
    sampler = -rng.random((32, 48)) * 3 - 1
    sampler[rng.random((32, 48)) < 0.1] = np.nan  # tokens the sampler could not score
    batch = batch.replace(
        completion_mask=jnp.asarray(mask, jnp.int32),
        sampler_log_probs=jnp.asarray(sampler, jnp.float32),
    )
    cfg = GRPOConfig(
        num_generations=4,
        beta=0.0,
        sampler_correction="truncate",
        sampler_correction_level=level,
    )
    sliced, whole = _trainer(cfg), _trainer(cfg)
    assert sliced.auto_microbatches(sliced.prepare_batch(batch)) == 2
    got, want = sliced.train_step(batch), whole.train_step(batch, num_microbatches=1)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert want["sampler_scored_tokens"] < want["num_tokens"]  # some tokens were not scored


def test_a_custom_log_prob_fn_runs_in_one_piece():
    from artifex.generative_models.training.rl import causal_lm_log_probs_fn

    trainer = _trainer(log_prob_fn=causal_lm_log_probs_fn())
    assert trainer.auto_microbatches(trainer.prepare_batch(_lm_batch(8, 16, 48))) == 1
