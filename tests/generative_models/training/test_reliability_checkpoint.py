"""Reliability of checkpoints: verified restores, fallback, full disk, kills, refused saves."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from artifex.demos.addition import demo_model, demo_tokenizer
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.checkpointing import (
    CheckpointManager,
    CorruptCheckpointError,
    _saveable,
    array_digests,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def make_trainer(seed=0):
    model = demo_model(demo_tokenizer(), seed=seed)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return GRPOTrainer(model, opt, GRPOConfig(num_generations=4))


def state(trainer):
    return [
        np.asarray(x)
        for o in (trainer.model, trainer.optimizer)
        for x in jax.tree.leaves(nnx.state(o))
    ]


def assert_state(trainer, expected):
    for x, y in zip(state(trainer), expected, strict=True):
        np.testing.assert_array_equal(x, y)


def bump(trainer, seed):
    """Changes every parameter (as a training step would)."""
    params = nnx.state(trainer.model, nnx.Param)
    noise = jax.tree.map(lambda x: x + 0.01 * seed, params)
    nnx.update(trainer.model, noise)


def restore(manager, trainer, **kwargs):
    """Restores a checkpoint into ``trainer`` (what the loop does); returns the record."""
    restored, meta = manager.restore(trainer.state, **kwargs)
    trainer.load_state(restored)
    return meta


def largest_file(directory):
    files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
    return max(files, key=os.path.getsize)


@pytest.fixture()
def saved(tmp_path):
    """A manager with checkpoints at steps 1 and 2, and the states they hold."""
    trainer = make_trainer()
    manager = CheckpointManager(tmp_path / "ckpt", max_to_keep=3)
    states = {}
    for step in (1, 2):
        bump(trainer, step)
        manager.save(step, trainer.state, {"step": step})
        states[step] = state(trainer)
    yield manager, states
    manager.close()


def test_checksums_are_recorded_and_a_clean_restore_verifies(saved):
    manager, states = saved
    meta = manager.read_metadata(2)
    assert meta["integrity"] and all(len(d["sha256"]) == 64 for d in meta["integrity"].values())
    fresh = make_trainer(seed=5)
    assert restore(manager, fresh)["step"] == 2
    assert_state(fresh, states[2])


@pytest.mark.parametrize("damage", ["flip_bytes", "truncate", "delete_metadata"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(saved, damage):
    manager, states = saved
    step_dir = os.path.join(manager.directory, "2")
    if damage == "delete_metadata":
        target = next(
            os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if r.endswith("meta")
        )
        os.remove(target)
    else:
        target = largest_file(step_dir)
        with open(target, "rb") as fh:
            data = bytearray(fh.read())
        if damage == "flip_bytes":
            for i in range(len(data) // 3, len(data) // 3 + 64):
                data[i] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        with open(target, "wb") as fh:
            fh.write(bytes(data))
    fresh = make_trainer(seed=5)
    before = state(fresh)
    with pytest.warns(RuntimeWarning, match=r"checkpoint 2 in .* is damaged.*falling back"):
        meta = restore(manager, fresh)
    assert meta["step"] == 1
    assert_state(fresh, states[1])
    with pytest.raises(CorruptCheckpointError, match="checkpoint 2"):
        restore(manager, make_trainer(seed=5), step=2)
    del before


def test_checksum_mismatch_is_detected_even_when_the_arrays_read_fine(saved):
    manager, _states = saved
    meta_dir = [
        r for r, _, fs in os.walk(os.path.join(manager.directory, "2")) if r.endswith("meta")
    ]
    meta_file = next(os.path.join(meta_dir[0], f) for f in os.listdir(meta_dir[0]))
    with open(meta_file) as fh:
        record = json.load(fh)
    name = next(iter(record["integrity"]))
    record["integrity"][name]["sha256"] = "0" * 64
    with open(meta_file, "w") as fh:
        json.dump(record, fh)
    fresh = make_trainer(seed=5)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        restore(manager, fresh, step=2)
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        assert restore(manager, fresh)["step"] == 1


def test_a_checkpoint_holding_nan_is_never_restored(tmp_path):
    trainer = make_trainer()
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, trainer.state, {"step": 1})
    good = state(trainer)
    nan_params = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), trainer.state.params)
    poisoned = _saveable(trainer.state.replace(params=nan_params))
    # Written behind the manager's back (as an older version or a bit flip could have).
    manager._manager.save(
        2,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(poisoned), meta=ocp.args.JsonSave({"step": 2})
        ),
    )
    manager._manager.wait_until_finished()
    fresh = make_trainer(seed=5)
    with pytest.warns(RuntimeWarning, match="holds NaN or Inf"):
        assert restore(manager, fresh)["step"] == 1
    assert_state(fresh, good)
    manager.close()


def test_non_finite_state_is_never_saved(tmp_path):
    trainer = make_trainer()
    manager = CheckpointManager(tmp_path / "ckpt")
    params = nnx.state(trainer.model, nnx.Param)
    nnx.update(trainer.model, jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.inf), params))
    with pytest.raises(FloatingPointError, match="refusing to save checkpoint 1"):
        manager.save(1, trainer.state, {"step": 1})
    assert manager.all_steps() == [] and os.listdir(manager.directory) == []
    manager.close()


def test_a_save_orbax_would_skip_is_an_error(saved):
    manager, _ = saved
    with pytest.raises(ValueError, match="already holds step 2"):
        manager.save(2, make_trainer().state, {"step": 2})
    with pytest.raises(ValueError, match="already holds step 2"):
        manager.save(1, make_trainer().state, {"step": 1})


def test_digests_cover_every_array():
    tree = {"a": jnp.arange(3.0), "b": [jnp.ones((2, 2), jnp.int32)], "k": jax.random.key(0)}
    d = array_digests(tree)
    assert set(d) == {"['a']", "['b'][0]", "['k']"}
    assert d["['a']"]["shape"] == [3] and d["['b'][0]"]["dtype"] == "int32"
    assert (
        d["['a']"]["finite"] and not array_digests({"x": jnp.array([jnp.nan])})["['x']"]["finite"]
    )
    assert d["['a']"]["sha256"] != array_digests({"a": jnp.arange(3.0) + 1})["['a']"]["sha256"]


# ------------------------------------------------------------------ full disk
def test_simulated_full_disk_during_save_cleans_up_and_keeps_older_checkpoints(saved, monkeypatch):
    manager, states = saved

    def full_disk(self, step, *args, **kwargs):
        os.makedirs(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp-123"))
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    trainer = make_trainer()
    with pytest.raises(OSError, match="No space"):
        manager.save(3, trainer.state, {"step": 3})
    monkeypatch.undo()
    assert sorted(os.listdir(manager.directory)) == ["1", "2"]
    fresh = make_trainer(seed=5)
    assert restore(manager, fresh)["step"] == 2
    assert_state(fresh, states[2])
    manager.save(3, trainer.state, {"step": 3})  # once there is room again, saving works
    assert manager.all_steps() == [1, 2, 3]


def test_a_failed_save_waits_for_writers_still_running_before_cleaning_up(saved, monkeypatch):
    """One writer thread fails (the save raises at once) while another is still writing."""
    manager, _ = saved

    class Writer(threading.Thread):  # stands in for Orbax's own writer threads
        pass

    Writer.__module__ = "orbax.checkpoint.stand_in"

    def late_write(directory):
        time.sleep(0.3)
        os.makedirs(os.path.join(directory, "3.orbax-checkpoint-tmp", "state"), exist_ok=True)
        with open(os.path.join(directory, "3.orbax-checkpoint-tmp", "state", "d"), "w") as f:
            f.write("late")

    def full_disk(self, step, *args, **kwargs):
        os.makedirs(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp"))
        Writer(target=late_write, args=(str(self.directory),)).start()
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(OSError, match="No space"):
        manager.save(3, make_trainer().state, {"step": 3})
    time.sleep(0.5)  # the writer has ended either way
    assert sorted(os.listdir(manager.directory)) == ["1", "2"]


@contextlib.contextmanager
def small_tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs root to mount a tmpfs (the simulated case runs)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_real_full_disk_during_save_cleans_up_and_keeps_older_checkpoints(tmp_path):
    trainer = make_trainer()
    probe = CheckpointManager(tmp_path / "probe")
    probe.save(1, trainer.state, {"step": 1})
    size = sum(
        os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(probe.directory) for f in fs
    )
    probe.close()
    with small_tmpfs(tmp_path / "disk", f"{int(size * 1.5) // 1024}k") as disk:
        manager = CheckpointManager(disk / "ckpt", max_to_keep=3)
        manager.save(1, trainer.state, {"step": 1})
        good = state(trainer)
        bump(trainer, 1)
        with pytest.raises(OSError):
            manager.save(2, trainer.state, {"step": 2})
        assert os.listdir(manager.directory) == ["1"]  # no stale temporary directory
        fresh = make_trainer(seed=5)
        assert restore(manager, fresh)["step"] == 1
        assert_state(fresh, good)
        manager.close()


# ------------------------------------------------------------------ kill during a save
KILL_DURING_CHECKPOINT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import optax
    from flax import nnx
    from artifex.demos.addition import demo_model, demo_tokenizer
    from artifex.generative_models.training import GRPOConfig, GRPOTrainer
    from artifex.generative_models.training.checkpointing import CheckpointManager

    directory = sys.argv[1]
    model = demo_model(demo_tokenizer(), seed=0)
    trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
                          GRPOConfig(num_generations=4))
    manager = CheckpointManager(directory)
    manager.save(1, trainer.state, {"step": 1})

    def killer():  # SIGKILL as soon as the step-2 temporary directory appears
        while True:
            if any(n.startswith("2.orbax-checkpoint-tmp") for n in os.listdir(directory)):
                open(directory + ".killed", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0005)

    threading.Thread(target=killer, daemon=True).start()
    params = nnx.state(model, nnx.Param)
    nnx.update(model, __import__("jax").tree.map(lambda x: x + 1.0, params))
    for step in range(2, 1000):
        manager.save(step, trainer.state, {"step": step})
    """
)


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_save_keeps_the_previous_one(tmp_path):
    directory = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", KILL_DURING_CHECKPOINT, str(directory)],
        env=env,
        capture_output=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert os.path.exists(str(directory) + ".killed")
    manager = CheckpointManager(directory)  # cleans the unfinished temporary directory
    assert manager.all_steps() == [1]
    assert not [n for n in os.listdir(directory) if "tmp" in n]
    fresh = make_trainer(seed=5)
    assert restore(manager, fresh)["step"] == 1
    assert_state(fresh, state(make_trainer()))
    manager.close()


def test_the_trainer_form_of_earlier_versions_still_saves_and_restores(tmp_path):
    trainer = make_trainer()
    bump(trainer, 3)
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, trainer, {"step": 1})  # a trainer, as earlier versions took
    expected = state(trainer)
    fresh = make_trainer(seed=5)
    meta = manager.restore(fresh)  # loads into the trainer and returns the record
    assert meta["step"] == 1
    assert_state(fresh, expected)
    manager.close()


def test_a_run_may_resume_with_other_memory_settings_but_not_other_math(tmp_path):
    # remat, remat_every and scan_layers change memory and speed, not the values: a run that
    # ran out of memory may resume with more layers rematerialized. A checkpoint written before
    # remat_every existed (its fingerprint lacks the field) resumes too. Any other field of
    # the config still has to match.
    from artifex.generative_models.training.checkpointing import (
        IncompatibleCheckpointError,
        training_fingerprint,
    )

    trainer = make_trainer()
    params = trainer.state.params
    old = training_fingerprint(GRPOConfig(num_generations=4), params)
    del old["grpo_config"]["remat_every"]
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, trainer.state, {"fingerprint": old})
    resumed = training_fingerprint(GRPOConfig(num_generations=4, remat=True, remat_every=2), params)
    restored, _ = manager.restore(trainer.state, fingerprint=resumed)
    assert int(restored.step) == int(trainer.state.step)
    other = training_fingerprint(GRPOConfig(num_generations=4, clip_param=0.1), params)
    with pytest.raises(IncompatibleCheckpointError, match=r"grpo_config\.clip_param"):
        manager.restore(trainer.state, fingerprint=other)
    manager.close()


def test_a_fingerprint_of_a_config_with_numpy_numbers_is_json():
    from artifex.generative_models.training.checkpointing import training_fingerprint

    trainer = make_trainer()
    config = GRPOConfig(num_generations=np.int64(4), beta=np.float32(0.5))
    fp = training_fingerprint(config, trainer.state.params)
    assert json.loads(json.dumps(fp))["grpo_config"]["num_generations"] == 4


def test_a_fingerprint_equals_its_saved_json_copy():
    """What the checkpoint records (JSON: lists, Python numbers) compares equal to the
    fingerprint it was written from, whatever tuples or NumPy numbers went in.
    """
    from artifex.generative_models.training.checkpointing import (
        _comparable,
        _diff,
        training_fingerprint,
    )

    trainer = make_trainer()
    config = GRPOConfig(num_generations=np.int64(4))
    fp = training_fingerprint(
        config, trainer.state.params, batch_shape=(np.int64(8), 16), nested={"k": (1, (2, 3))}
    )
    saved = json.loads(json.dumps(fp))
    assert _diff(_comparable(saved), _comparable(fp)) == []
    assert fp["batch_shape"] == [8, 16] and type(fp["batch_shape"][0]) is int
