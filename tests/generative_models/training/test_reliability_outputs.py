"""Reliability of the loop's outputs: logs of one run only, held directories, reward scale."""

from __future__ import annotations

import json
import os
import socket

import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.training.rl.advantages import reward_statistics
from artifex.generative_models.training.rl.preflight import (
    LOG_OWNER_NAME,
    LogDirectoryInUseError,
    check_log_owner,
)
from artifex.generative_models.training.rl.reward_scale import FLOAT32_MAX, check_reward_scale
from artifex.generative_models.training.run_lock import LOCK_NAME, DirectoryInUseError
from tests.generative_models.training.test_reliability_loop import REWARD, make_trainer, run


def read(path):
    with open(path) as fh:
        return fh.read()


def steps_of(path):
    return [json.loads(line)["step"] for line in read(path).splitlines()]


# ------------------------------------------------------------------ 4: logs per run
def test_a_run_never_appends_to_or_cuts_another_runs_log(tmp_path):
    logs = str(tmp_path / "shared_logs")
    first, tok = make_trainer()
    run(first, tok, num_steps=2, checkpoint_dir=str(tmp_path / "a"), log_dir=logs)
    metrics = os.path.join(logs, "metrics.jsonl")
    before = read(metrics)
    assert [s for s in steps_of(metrics) if s > 0] == [1, 2]

    second, tok = make_trainer()
    with pytest.raises(LogDirectoryInUseError, match=r"holds the logs .* of another run"):
        run(second, tok, num_steps=1, checkpoint_dir=str(tmp_path / "b"), log_dir=logs)
    assert read(metrics) == before  # neither appended to nor cut back
    assert not os.path.exists(tmp_path / "b" / "1")  # refused before the first step

    # The run that owns the logs resumes and extends them; overwrite gives them to another.
    again, tok = make_trainer()
    run(again, tok, num_steps=3, checkpoint_dir=str(tmp_path / "a"), log_dir=logs)
    assert [s for s in steps_of(metrics) if s > 0] == [1, 2, 3]
    other, tok = make_trainer()
    run(other, tok, num_steps=1, checkpoint_dir=str(tmp_path / "b"), log_dir=logs, overwrite=True)
    assert [s for s in steps_of(metrics) if s > 0] == [1]
    owner = json.loads(read(os.path.join(logs, LOG_OWNER_NAME)))
    assert owner == {"checkpoint_dir": str(tmp_path / "b")}


def test_log_owner_claims_unowned_and_empty_directories(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"step": 1}\n')  # written before owners were recorded
    check_log_owner(logs, tmp_path / "a", overwrite=False)
    owner = json.loads((logs / LOG_OWNER_NAME).read_text())
    assert owner["checkpoint_dir"] == str(tmp_path / "a")
    with pytest.raises(LogDirectoryInUseError):
        check_log_owner(logs, None, overwrite=False)
    (logs / "metrics.jsonl").unlink()
    check_log_owner(logs, None, overwrite=False)  # no logs left to protect: claimed
    assert json.loads((logs / LOG_OWNER_NAME).read_text()) == {"checkpoint_dir": None}


# ------------------------------------------------------------------ 3: held directories
@pytest.mark.parametrize("field", ["checkpoint_dir", "log_dir"])
def test_train_refuses_a_directory_another_run_holds(tmp_path, field):
    held = tmp_path / "held"
    held.mkdir()
    # Another run's lock: this host, a pid that is alive (init), no start time to compare.
    record = {"pid": 1, "host": socket.gethostname(), "started": None, "token": "another-run"}
    (held / LOCK_NAME).write_text(json.dumps(record))
    trainer, tok = make_trainer()
    with pytest.raises(DirectoryInUseError, match=rf"TrainConfig.{field} .* pid 1 on this host"):
        run(trainer, tok, num_steps=1, **{field: str(held)})
    assert int(trainer.optimizer.step[...]) == 0
    assert json.loads((held / LOCK_NAME).read_text())["token"] == "another-run"  # left alone


def test_train_releases_its_locks_when_it_fails_before_the_first_step(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    (logs / "metrics.jsonl").parent.mkdir()
    (logs / "metrics.jsonl").write_text('{"step": 1}\n')
    (logs / LOG_OWNER_NAME).write_text(json.dumps({"checkpoint_dir": "/another/run"}))
    trainer, tok = make_trainer()
    with pytest.raises(LogDirectoryInUseError):
        run(trainer, tok, num_steps=1, checkpoint_dir=str(ckpt), log_dir=str(logs))
    assert not (ckpt / ".artifex-run.lock").exists() and not (logs / ".artifex-run.lock").exists()


# ------------------------------------------------------------------ 10: reward scale
def float32_std(x):
    """The float32 standard deviation as the kernels compute it (NumPy, float32 throughout)."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sqrt(np.mean((x - x.mean(dtype=np.float32)) ** 2, dtype=np.float32))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", [1.0, 1e6, 1e15, 1e21, 1e30])
def test_check_reward_scale_refuses_exactly_when_float32_statistics_overflow(seed, scale):
    rng = np.random.default_rng(seed)
    rewards = rng.standard_normal(16) * scale
    overflows = not np.isfinite(float32_std(rewards)) or any(
        not np.isfinite(float32_std(g)) for g in rewards.reshape(4, 4)
    )
    kernel = reward_statistics(jnp.asarray(rewards, jnp.float32), 4)["reward_std"]
    assert np.isfinite(float(kernel)) == (not overflows)  # the kernel shows the problem
    if overflows:
        with pytest.raises(ValueError, match="training step 7: the rewards' spread overflows"):
            check_reward_scale(rewards, 4, step=7)
    else:
        check_reward_scale(rewards, 4, step=7)


def test_check_reward_scale_names_rewards_beyond_float32_and_reads_group_ids():
    with pytest.raises(ValueError, match="reward inf at row 1 is beyond float32's range"):
        check_reward_scale(np.array([0.0, np.inf, 0.0, 1.0]), 2)  # float32(1e39)
    check_reward_scale([np.nan, np.nan, 1.0, 2.0], 2)  # no reward is not an error
    big = np.sqrt(FLOAT32_MAX)  # deviations of +-big: a sum of squares of 2 * FLOAT32_MAX
    with pytest.raises(ValueError, match="overflows float32"):
        check_reward_scale([big, -big, 0.0, 0.0], 2, group_ids=[0, 0, 1, 1])
    check_reward_scale([1e18, -1e18, 0.0, 0.0], 2, group_ids=[0, 0, 1, 1])


def test_training_on_rewards_whose_spread_overflows_float32_stops_naming_the_step():
    def huge(prompts, completions, **columns):
        return [1e30 if i % 2 else -1e30 for i in range(len(completions))]

    trainer, tok = make_trainer()
    with pytest.raises(ValueError, match="training step 1: the rewards' spread overflows"):
        run(trainer, tok, rewards=[huge], num_steps=1)
    assert int(trainer.optimizer.step[...]) == 0  # refused before the update
    run(make_trainer()[0], tok, rewards=[REWARD], num_steps=1)  # ordinary rewards still train
