"""The training loop: bitwise resume, dynamic sampling, logging, evaluation, bad input."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.models.causal_lm import CausalLM
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.checkpointing import (
    CheckpointManager,
    IncompatibleCheckpointError,
)
from artifex.generative_models.training.rl.loop import DataIterator, TrainConfig, train
from artifex.generative_models.training.rl.rewards import math_answer_reward
from artifex.generative_models.training.rl.rollout import RolloutConfig
from artifex.generative_models.training.sharding import make_mesh
from tests.generative_models.training.rl.compiles import CompileCounter, registered

TRAIN, EVAL = addition_dataset(seed=0, num_eval=16)
TRAIN = TRAIN[:64]
REWARD = math_answer_reward(last_number_fallback=True)
ROLLOUT = RolloutConfig(max_new_tokens=4)


def digit_count(prompts, completions, **columns):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


# The untrained model's answers are all wrong: with the answer reward alone every advantage is 0
# and no update moves anything. Where parameters are compared, this reward differs within groups.
SIGNAL = [REWARD, digit_count]


@functools.cache
def one_layer():
    """The demo model's tokens and sizes with one decoder layer: the loop does not depend on the
    depth, and its programs compile in about two thirds of the time."""
    return demo_model(demo_tokenizer()).config.replace(num_layers=1)


def make_trainer(seed=0, mesh=None, **cfg):
    tok = demo_tokenizer()
    model = CausalLM(one_layer(), rngs=nnx.Rngs(seed))
    ref = CausalLM(one_layer(), rngs=nnx.Rngs(seed + 100))
    opt = nnx.Optimizer(
        model, optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), wrt=nnx.Param
    )
    config = GRPOConfig(num_generations=4, beta=0.05, **cfg)
    return GRPOTrainer(model, opt, config, reference_model=ref, mesh=mesh), tok


def params(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model))]


LOOP = dict(prompts_per_step=4, num_iterations=2, num_minibatches=2, progress=False, seed=3)


@pytest.fixture(scope="module")
def one_step_checkpoint(tmp_path_factory):
    """A run of LOOP's settings checkpointed after its first step: ``(directory, trainer,
    tokenizer, parameters before, parameters after)``."""
    ckpt = str(tmp_path_factory.mktemp("loop") / "ckpt")
    trainer, tok = make_trainer()
    before = params(trainer)
    config = TrainConfig(num_steps=1, checkpoint_dir=ckpt, **LOOP)
    train(trainer, tok, TRAIN, SIGNAL, config, ROLLOUT)
    return ckpt, trainer, tok, before, params(trainer)


@pytest.mark.slow
def test_resume_reaches_the_same_parameters_bitwise(tmp_path, one_step_checkpoint):
    saved, _, _, initial, after_one = one_step_checkpoint
    full, tok = make_trainer()
    train(full, tok, TRAIN, SIGNAL, TrainConfig(num_steps=2, **LOOP), ROLLOUT)
    # both steps moved the parameters (the comparison below is not of untouched weights)
    for before, after in ((initial, after_one), (after_one, params(full))):
        assert any((a != b).any() for a, b in zip(before, after, strict=True))

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)  # resumed here: the module's checkpoint stays as it was
    resumed, tok = make_trainer()  # a fresh process would start from the same initial model
    result = train(
        resumed,
        tok,
        TRAIN,
        SIGNAL,
        TrainConfig(num_steps=2, checkpoint_dir=ckpt, **LOOP),
        ROLLOUT,
    )
    assert result.start_step == 1 and len(result.history) == 1
    for a, b in zip(params(full), params(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    opt_full = jax.tree.leaves(nnx.state(full.optimizer))
    opt_res = jax.tree.leaves(nnx.state(resumed.optimizer))
    for a, b in zip(opt_full, opt_res, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_incompatible_resume_is_an_error_and_writes_nothing(one_step_checkpoint):
    ckpt, trainer, tok, _, _ = one_step_checkpoint
    before = sorted(os.listdir(ckpt))
    other, tok = make_trainer(clip_param=0.1)
    with pytest.raises(IncompatibleCheckpointError, match="clip_param"):
        train(
            other,
            tok,
            TRAIN,
            SIGNAL,
            TrainConfig(num_steps=3, checkpoint_dir=ckpt, **LOOP),
            ROLLOUT,
        )
    with pytest.raises(IncompatibleCheckpointError, match="prompts_per_step"):
        train(
            trainer,
            tok,
            TRAIN,
            SIGNAL,
            TrainConfig(num_steps=3, checkpoint_dir=ckpt, **{**LOOP, "prompts_per_step": 8}),
            ROLLOUT,
        )
    assert sorted(os.listdir(ckpt)) == before


def test_a_resume_may_split_its_updates_differently(resumed_after_accumulation):
    """``gradient_accumulation_steps`` changes how an update is computed, not its value: a run
    checkpointed with 2 microbatches resumes with the trainer's own choice (``None``)."""
    result, _ = resumed_after_accumulation
    assert result.start_step == 1 and len(result.history) == 1


def test_checkpoints_keep_the_last_n(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    trainer, tok = make_trainer()
    train(
        trainer,
        tok,
        TRAIN,
        [REWARD],
        TrainConfig(
            num_steps=3,
            checkpoint_dir=ckpt,
            checkpoint_every=1,
            keep_checkpoints=2,
            prompts_per_step=4,
            progress=False,
        ),
        ROLLOUT,
    )
    assert CheckpointManager(ckpt).all_steps() == [2, 3]  # the first was removed
    meta = CheckpointManager(ckpt).read_metadata()
    assert meta["step"] == 3 and meta["data"] == {"epoch": 0, "index": 12}


def test_logs_jsonl_every_step_and_evaluates(tmp_path):
    trainer, tok = make_trainer()
    result = train(
        trainer,
        tok,
        TRAIN,
        [REWARD],
        TrainConfig(
            num_steps=3, prompts_per_step=4, eval_every=2, log_dir=str(tmp_path), progress=False
        ),
        ROLLOUT,
        eval_dataset=EVAL,
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "total_loss" in r]
    assert [r["step"] for r in train_records] == [1, 2, 3]
    for key in (
        "reward_mean",
        "kl",
        "approx_kl",
        "entropy",
        "grad_norm",
        "step_time",
        "rewards/math_answer_reward",
        "learning_rate",
        "clip_fraction_high",
    ):
        assert key in train_records[0], key
    assert [s for s, _ in result.evaluations] == [0, 2, 3]
    for _, ev in result.evaluations:
        assert 0.0 <= ev["eval/pass@1"] <= 1.0


def test_dynamic_sampling_drops_constant_groups_and_uses_segments():
    trainer, tok = make_trainer()
    seen = []

    def reward(prompts, completions, id_, **k):
        seen.append(list(id_))
        # Rows of even ids get constant rewards (no signal); odd ids get varied ones.
        return [0.0 if i % 2 == 0 else float(j % 2) for j, i in enumerate(id_)]

    rows = [{"prompt": f"{i}+1=", "id_": i} for i in range(40)]
    result = train(
        trainer,
        tok,
        rows,
        [reward],
        TrainConfig(
            num_steps=1, prompts_per_step=4, dynamic_sampling=True, shuffle=False, progress=False
        ),
        ROLLOUT,
    )
    m = result.history[0]
    assert m["dynamic_sampling/rounds"] == 2.0  # 2 of 4 groups kept per round -> one refill
    assert m["dynamic_sampling/zero_std_filled"] == 0.0
    assert m["dynamic_sampling/kept_fraction"] == 0.5
    assert m["frac_reward_zero_std"] == 0.0  # only groups with signal were trained on


def test_data_iterator_is_deterministic_and_resumable():
    rows = [{"prompt": str(i)} for i in range(5)]
    a = DataIterator(rows, seed=1, shuffle=True)
    first = [r["prompt"] for r in a.take(7)]
    state = a.state()
    rest = [r["prompt"] for r in a.take(6)]
    b = DataIterator(rows, seed=1, shuffle=True)
    b.restore(state)
    assert [r["prompt"] for r in b.take(6)] == rest
    assert sorted(first[:5]) == sorted(str(i) for i in range(5))  # an epoch is a permutation


def test_bad_loop_settings():
    trainer, tok = make_trainer()
    with pytest.raises(ValueError, match="num_minibatches=3"):
        train(
            trainer,
            tok,
            TRAIN,
            [REWARD],
            TrainConfig(num_steps=1, prompts_per_step=4, num_minibatches=3, progress=False),
            ROLLOUT,
        )
    with pytest.raises(ValueError, match="row 0 has no prompt column 'prompt'"):
        train(
            trainer,
            tok,
            [{"question": "1+1="}],
            [REWARD],
            TrainConfig(num_steps=1, progress=False),
            ROLLOUT,
        )
    with pytest.raises(ValueError, match="num_steps"):
        TrainConfig(num_steps=0)


def test_the_trainer_leaves_the_loop_to_train():
    # The loop drives the trainer (train(trainer, ...)); the trainer does not import the loop.
    trainer, _ = make_trainer()
    assert not hasattr(trainer, "train")


def test_minibatch_metrics_describe_the_whole_generation_batch():
    trainer, tok = make_trainer()

    def reward(prompts, completions, id_, **k):
        # Groups of even ids are constant (no signal), odd ids vary within the group.
        return [0.0 if i % 2 == 0 else float(j % 2) for j, i in enumerate(id_)]

    rows = [{"prompt": f"{i}+1=", "id_": i} for i in range(4)]
    result = train(
        trainer,
        tok,
        rows,
        [reward],
        TrainConfig(
            num_steps=1, prompts_per_step=4, num_minibatches=4, shuffle=False, progress=False
        ),
        ROLLOUT,
    )
    m = result.history[0]
    assert m["frac_reward_zero_std"] == 0.5
    np.testing.assert_allclose(m["reward_mean"], 4 / 16)
    np.testing.assert_allclose(m["advantage_mean"], 0.0, atol=1e-6)
    # Odd groups [0, 1, 0, 1]: advantages +-0.5 / (std_ddof1 + 1e-4); even groups 0. Over all 16
    # rows the std is that value times sqrt(1/2) (the old per-minibatch average gave 0.45-0.57).
    a = 0.5 / (np.sqrt(1 / 3) + 1e-4)
    np.testing.assert_allclose(m["advantage_std"], a * np.sqrt(0.5), rtol=1e-5)


def test_one_completion_length_setting():
    """max_completion_length, when set, must be the rollout's max_new_tokens (one length)."""
    trainer, tok = make_trainer(max_completion_length=8)
    with pytest.raises(ValueError, match=r"max_completion_length=8 and .*max_new_tokens=4"):
        train(trainer, tok, TRAIN, [REWARD], TrainConfig(num_steps=1, **LOOP), ROLLOUT)


def test_row_groups_that_do_not_divide_the_prompts_fail_before_the_first_step():
    trainer, tok = make_trainer()
    rollout = RolloutConfig(max_new_tokens=4, row_groups=3)
    with pytest.raises(ValueError, match=r"row_groups=3 must divide .*prompts_per_step=4\)"):
        train(trainer, tok, TRAIN, [REWARD], TrainConfig(num_steps=1, **LOOP), rollout)
    with pytest.raises(ValueError, match=r"RolloutConfig\.row_groups must be an int >= 1"):
        RolloutConfig(row_groups=0)
    # The evaluation's batches too: 3 held-out rows, row_groups=2.
    rollout = RolloutConfig(max_new_tokens=4, row_groups=2)
    cfg = TrainConfig(num_steps=1, eval_every=1, **LOOP)
    with pytest.raises(
        ValueError, match=r"3 evaluation rows in batches of 64 give batches of \[3\]"
    ):
        train(trainer, tok, TRAIN, [REWARD], cfg, rollout, eval_dataset=EVAL[:3])
    assert trainer.state.step == 0  # nothing ran


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [("num_steps", 0, ValueError), ("num_steps", 2.0, TypeError), ("seed", -1, ValueError)],
)
def test_train_config_errors_follow_the_one_rule(field, value, error):
    kwargs = {"num_steps": 1, field: value}
    with pytest.raises(error, match=f"TrainConfig.{field}"):
        TrainConfig(**kwargs)


@pytest.fixture(scope="module")
def update_compiles():
    yield from registered(CompileCounter("split_step"))  # the update's compilations


@pytest.mark.parametrize(
    ("loop", "grpo"),
    [
        ({}, {}),  # one update per batch: the reference is scored inside the update
        ({"num_iterations": 2, "num_minibatches": 2}, {}),  # old and reference log-probs
        ({"gradient_accumulation_steps": 2}, {"sampler_correction": "truncate"}),
        ({"num_iterations": 2}, {"mesh": "data=2,fsdp=2"}),  # batches sharded over a mesh
    ],
    ids=["one-update", "minibatches", "accumulation-sampler-log-probs", "mesh"],
)
def test_the_first_update_compiles_during_the_first_rollout(loop, grpo, update_compiles):
    """The loop compiles the update ahead for the batch the first rollout builds: one trace
    and one XLA compilation (a second would mean the example's layout or placement missed
    the real batch), and the same update as without it (bitwise: the same program)."""
    settings = dict(num_steps=1, prompts_per_step=4, progress=False, seed=3, **loop)
    if "mesh" in grpo:
        grpo = dict(grpo, mesh=make_mesh(data=2, fsdp=2, devices=jax.devices()[:4]))
    ahead, tok = make_trainer(**grpo)
    update_compiles.during(
        lambda: train(ahead, tok, TRAIN, [REWARD], TrainConfig(**settings), ROLLOUT)
    )
    assert (ahead.num_compilations, update_compiles.count) == (1, 1)
    plain, tok = make_trainer(**grpo)
    train(plain, tok, TRAIN, [REWARD], TrainConfig(compile_ahead=False, **settings), ROLLOUT)
    assert plain.num_compilations == 1
    for a, b in zip(params(ahead), params(plain), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def resumed_after_accumulation(tmp_path_factory, update_compiles):
    """One step checkpointed with 2 microbatches, then a second step resumed from it with the
    trainer's own choice (one): ``(its result, (its num_compilations, its update's
    compilations))``."""
    settings = dict(
        prompts_per_step=4,
        progress=False,
        seed=3,
        checkpoint_dir=str(tmp_path_factory.mktemp("loop") / "ckpt"),
    )
    first, tok = make_trainer()
    config = TrainConfig(num_steps=1, gradient_accumulation_steps=2, **settings)
    train(first, tok, TRAIN, [REWARD], config, ROLLOUT)
    resumed, tok = make_trainer()
    result = update_compiles.during(
        lambda: train(resumed, tok, TRAIN, [REWARD], TrainConfig(num_steps=2, **settings), ROLLOUT)
    )
    return result, (resumed.num_compilations, update_compiles.count)


def test_a_resumed_run_compiles_its_first_update_once(resumed_after_accumulation):
    """Restored weights are committed to their device; the example batch is placed as the
    rollout's batches are, so the compiled-ahead program is the one the update runs."""
    result, compilations = resumed_after_accumulation
    assert result.start_step == 1
    assert compilations == (1, 1)


@pytest.mark.parametrize(
    "contexts",
    [
        # Two thread-local settings in one run (one set of programs to compile instead of two):
        # an update traced without either one is another program, and shows as a second trace.
        lambda: [jax.default_matmul_precision("highest"), jax.default_device(jax.devices()[1])],
        lambda: [jax.set_mesh(make_mesh(data=2, devices=jax.devices()[:2]))],
    ],
    ids=["matmul-precision-and-default-device", "set-mesh"],
)
def test_compile_ahead_traces_under_the_callers_jax_context(contexts, update_compiles):
    """Per-thread JAX settings (a ``with`` block around the run) reach the program compiled
    ahead: it is traced in the caller's thread."""
    settings = dict(num_steps=1, prompts_per_step=4, progress=False, seed=3)
    with contextlib.ExitStack() as stack:
        for context in contexts():
            stack.enter_context(context)
        trainer, tok = make_trainer()
        update_compiles.during(
            lambda: train(trainer, tok, TRAIN, [REWARD], TrainConfig(**settings), ROLLOUT)
        )
    assert (trainer.num_compilations, update_compiles.count) == (1, 1)


def test_a_compile_ahead_example_that_misses_the_batch_shows_as_a_second_trace(monkeypatch):
    """The check above can fail: an example one prompt column too wide compiles a program
    the first update cannot use, and the update traces again."""
    from artifex.generative_models.training.rl import loop as loop_module

    real = loop_module.rollout_batch_like

    def too_wide(*args, **kwargs):
        like = real(*args, **kwargs)
        wide = np.zeros((like.batch_size, like.prompt_ids.shape[1] + 1), np.int32)
        return like.replace(
            prompt_ids=jax.numpy.asarray(wide), prompt_mask=jax.numpy.asarray(wide + 1)
        )

    monkeypatch.setattr(loop_module, "rollout_batch_like", too_wide)
    trainer, tok = make_trainer()
    train(
        trainer,
        tok,
        TRAIN,
        [REWARD],
        TrainConfig(num_steps=1, prompts_per_step=4, progress=False),
        ROLLOUT,
    )
    assert trainer.num_compilations == 2
