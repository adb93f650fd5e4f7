"""Reliability of the training loop: pre-flight checks, preemption, data fingerprint, guard."""

from __future__ import annotations

import json
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.checkpointing import (
    CheckpointManager,
    IncompatibleCheckpointError,
)
from artifex.generative_models.training.rl import NonFiniteUpdateError
from artifex.generative_models.training.rl.loop import (
    TrainConfig,
    check_writable_dir,
    dataset_fingerprint,
    train,
)
from artifex.generative_models.training.rl.rewards import math_answer_reward
from artifex.generative_models.training.rl.rollout import RolloutConfig
from tests.spread_reward import text_reward

TRAIN, _ = addition_dataset(seed=0, num_eval=4)
TRAIN = TRAIN[:32]
REWARD = math_answer_reward(last_number_fallback=True)
ROLLOUT = RolloutConfig(max_new_tokens=4)
LOOP = dict(prompts_per_step=2, progress=False, seed=3)


def make_trainer(seed=0, tx=None):
    tok = demo_tokenizer()
    model = demo_model(tok, seed=seed)
    opt = nnx.Optimizer(
        model, tx or optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), wrt=nnx.Param
    )
    return GRPOTrainer(model, opt, GRPOConfig(num_generations=4)), tok


def leaves(trainer):
    return [
        np.asarray(x)
        for o in (trainer.model, trainer.optimizer)
        for x in jax.tree.leaves(nnx.state(o))
    ]


def run(trainer, tok, rewards=(REWARD,), dataset=TRAIN, **cfg):
    return train(trainer, tok, dataset, list(rewards), TrainConfig(**{**LOOP, **cfg}), ROLLOUT)


EVALS = [{"prompt": "1+2=", "answer": "3"}]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished two-step run: checkpoints of steps 1 and 2, its logs (evaluations included).

    Tests that need an earlier run's output copy it (``earlier_run``) instead of training one.
    """
    root = tmp_path_factory.mktemp("finished")
    trainer, tok = make_trainer()
    kw = {"checkpoint_dir": str(root / "ckpt"), "log_dir": str(root / "logs")}
    config = TrainConfig(**{**LOOP, "num_steps": 2, "checkpoint_every": 1,
                            "log_completions_every": 1, **kw})  # fmt: skip
    train(trainer, tok, TRAIN, [REWARD], config, ROLLOUT, eval_dataset=EVALS)
    return root


def earlier_run(finished_run, tmp_path):
    """A copy of ``finished_run``: its checkpoint directory and its log directory."""
    shutil.copytree(finished_run, tmp_path / "run")
    return str(tmp_path / "run" / "ckpt"), str(tmp_path / "run" / "logs")


# ------------------------------------------------------------------ pre-flight checks
def test_resume_off_into_a_directory_with_checkpoints_is_refused_before_any_step(
    finished_run, tmp_path
):
    ckpt, _ = earlier_run(finished_run, tmp_path)
    other, tok = make_trainer(seed=1)
    before = leaves(other)
    with pytest.raises(FileExistsError, match=r"already holds checkpoints.*--overwrite"):
        # rewards that differ within groups: a step, had one run, would change the parameters
        run(other, tok, rewards=(text_reward,), num_steps=2, checkpoint_dir=ckpt, resume=False)
    for x, y in zip(before, leaves(other), strict=True):  # nothing trained
        np.testing.assert_array_equal(x, y)


def test_overwrite_starts_over_and_writes_its_own_checkpoints(finished_run, tmp_path):
    ckpt, _ = earlier_run(finished_run, tmp_path)  # checkpoints of steps 1 and 2
    other, tok = make_trainer(seed=1)
    result = run(other, tok, num_steps=1, checkpoint_dir=ckpt, overwrite=True)
    assert result.start_step == 0
    manager = CheckpointManager(ckpt)
    assert manager.all_steps() == [1]
    restored, _ = make_trainer(seed=7)
    state, _ = manager.restore(restored.state)
    restored.load_state(state)
    for x, y in zip(leaves(other), leaves(restored), strict=True):
        np.testing.assert_array_equal(x, y)
    manager.close()


def test_overwrite_starts_the_logs_over_too(finished_run, tmp_path):
    # The old run's records (its step-0 evaluation included) must not stay beside the new run's.
    ckpt, logs = earlier_run(finished_run, tmp_path)  # two steps, logged and evaluated
    with open(os.path.join(logs, "completions.jsonl")) as fh:
        assert {json.loads(line)["step"] for line in fh} == {1, 2}
    other, tok = make_trainer(seed=1)
    kw = {"checkpoint_dir": ckpt, "log_dir": logs, "log_completions_every": 1}
    config = TrainConfig(**{**LOOP, "num_steps": 1, "overwrite": True, **kw})
    train(other, tok, TRAIN, [REWARD], config, ROLLOUT, eval_dataset=EVALS)
    with open(os.path.join(logs, "metrics.jsonl")) as fh:
        steps = [json.loads(line)["step"] for line in fh]
    assert steps == [0, 1, 1]  # evaluation before, step 1, evaluation after: the new run only
    with open(os.path.join(logs, "completions.jsonl")) as fh:
        assert {json.loads(line)["step"] for line in fh} == {1}


@pytest.mark.parametrize("field", ["checkpoint_dir", "log_dir"])
def test_output_that_is_a_file_fails_before_the_first_step(tmp_path, field):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    trainer, tok = make_trainer()
    calls = []

    def counting(prompts, completions, **kw):
        calls.append(1)
        return REWARD(prompts, completions, **kw)

    with pytest.raises(NotADirectoryError, match=f"TrainConfig.{field}"):
        run(trainer, tok, rewards=[counting], num_steps=1, **{field: str(blocker)})
    with pytest.raises(NotADirectoryError, match=f"TrainConfig.{field}"):
        run(trainer, tok, rewards=[counting], num_steps=1, **{field: str(blocker / "sub")})
    assert calls == []  # no rollout happened


def test_check_writable_dir_creates_and_probes(tmp_path):
    path = check_writable_dir(tmp_path / "new" / "dir", "--output")
    assert os.path.isdir(path) and os.listdir(path) == []


def test_boolean_settings_must_be_booleans():
    for name in ("shuffle", "resume", "overwrite", "progress", "dynamic_sampling"):
        with pytest.raises(TypeError, match=f"TrainConfig.{name} must be a bool"):
            TrainConfig(num_steps=1, **{name: "false"})


# ------------------------------------------------------------------ the dataset fingerprint
def test_resume_on_other_data_of_the_same_size_is_refused_unless_allowed(finished_run, tmp_path):
    ckpt, _ = earlier_run(finished_run, tmp_path)  # checkpoints of steps 1 and 2, on TRAIN
    other_data = [dict(r, answer=str(r["answer"]) + "0") for r in TRAIN]
    assert len(other_data) == len(TRAIN)
    resumed, tok = make_trainer()
    with pytest.raises(IncompatibleCheckpointError, match=r"dataset\.sha256"):
        run(resumed, tok, dataset=other_data, num_steps=3, checkpoint_dir=ckpt)
    result = run(
        resumed,
        tok,
        dataset=other_data,
        num_steps=2,  # resumed at its last step: checked and restored, nothing to train
        checkpoint_dir=ckpt,
        allow_dataset_change=True,
    )
    assert result.start_step == 2 and result.history == []


def test_dataset_fingerprint_sees_content_and_size():
    a = dataset_fingerprint(TRAIN)
    assert a == dataset_fingerprint([dict(r) for r in TRAIN])
    assert a["size"] == len(TRAIN)
    assert a["sha256"] != dataset_fingerprint(TRAIN[::-1])["sha256"]
    assert dataset_fingerprint(TRAIN[:-1])["size"] == len(TRAIN) - 1


# ------------------------------------------------------------------ the non-finite guard
def test_loop_never_checkpoints_a_non_finite_update_and_names_the_step(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # A schedule that overflows after the first update: step 1 trains, step 2 overflows.
    tx = optax.sgd(lambda count: jnp.where(count >= 1, 1e39, 1e-3))
    trainer, tok = make_trainer(tx=tx)
    # rewards that differ within groups: a batch of zero advantages would not be applied
    with pytest.raises(NonFiniteUpdateError, match=r"training step 2 .*updated parameters"):
        run(
            trainer,
            tok,
            rewards=(text_reward,),
            num_steps=3,
            checkpoint_dir=ckpt,
            checkpoint_every=1,
        )
    manager = CheckpointManager(ckpt)
    assert manager.all_steps() == [1]
    after_step_1, _ = make_trainer(seed=9, tx=tx)
    state, _ = manager.restore(after_step_1.state)
    after_step_1.load_state(state)
    manager.close()
    for x, y in zip(leaves(after_step_1), leaves(trainer), strict=True):  # nothing moved
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------ preemption
def signal_at_step(sig, step, base=REWARD):
    """A reward function that sends ``sig`` to this process during step ``step``'s rewards."""
    calls = []

    def reward(prompts, completions, **kw):
        calls.append(1)
        if len(calls) == step:
            os.kill(os.getpid(), sig)
        return base(prompts, completions, **kw)

    reward.__name__ = base.__name__  # the same reward (a resume compares the names)
    return reward


@pytest.mark.slow
def test_signal_mid_run_saves_and_resume_is_bitwise_equal(tmp_path):
    # SIGTERM during step 2, then SIGINT during step 3 of the resumed run: each run finishes
    # the step in flight, saves it and puts the previous handler back, and the last resume ends
    # where an uninterrupted run does, bit for bit. One chain for both signals (one handler
    # serves both; the chain also resumes a resumed run) instead of a run per signal. Rewards
    # that differ within groups: every step trains (all-zero advantages would skip updates).
    loop = dict(num_iterations=2, num_minibatches=2, rewards=(text_reward,))
    full, tok = make_trainer()
    before = leaves(full)
    run(full, tok, num_steps=4, **loop)
    assert not all(np.array_equal(a, b) for a, b in zip(before, leaves(full), strict=True))

    ckpt = str(tmp_path / "ckpt")
    logs = str(tmp_path / "logs")
    kw = dict(num_steps=4, checkpoint_dir=ckpt, log_dir=logs, **loop)
    first, tok = make_trainer()
    result = run(first, tok, **kw | {"rewards": [signal_at_step(signal.SIGTERM, 2, text_reward)]})
    assert result.interrupted == "SIGTERM"
    assert len(result.history) == 2  # the step in flight finished
    assert CheckpointManager(ckpt).all_steps() == [2]
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back
    with open(os.path.join(logs, "metrics.jsonl"), "a") as fh:
        fh.write('{"step": 3, "torn')  # as if the process died mid-line after step 2

    second, tok = make_trainer()
    # the signal during this run's first step, step 3
    result = run(second, tok, **kw | {"rewards": [signal_at_step(signal.SIGINT, 1, text_reward)]})
    assert result.start_step == 2 and result.interrupted == "SIGINT"
    assert len(result.history) == 1  # the step in flight finished
    assert CheckpointManager(ckpt).all_steps() == [2, 3]
    assert signal.getsignal(signal.SIGINT) is not None  # the previous handler is back

    resumed, tok = make_trainer()
    result = run(resumed, tok, **kw)
    assert result.start_step == 3 and result.interrupted is None
    for a, b in zip(leaves(full), leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    with open(os.path.join(logs, "metrics.jsonl")) as fh:
        steps = [json.loads(line)["step"] for line in fh]
    assert [s for s in steps if s > 0] == [1, 2, 3, 4]


def test_signal_handling_can_be_turned_off(tmp_path):
    trainer, tok = make_trainer()
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        result = run(
            trainer,
            tok,
            rewards=[signal_at_step(signal.SIGTERM, 1)],
            num_steps=2,
            handle_signals=False,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.interrupted is None and len(result.history) == 2 and seen == [signal.SIGTERM]
