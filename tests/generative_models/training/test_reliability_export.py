"""Reliability of model exports: atomic writes, a kill or a full disk keeps the previous export."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from artifex.demos.addition import demo_model, demo_tokenizer
from artifex.generative_models.models.causal_lm import from_pretrained, hf_io
from artifex.generative_models.utils import atomic
from artifex.generative_models.utils.atomic import atomic_write_json

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def weights(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def assert_same(a, b):
    for x, y in zip(weights(a), weights(b), strict=True):
        np.testing.assert_array_equal(x, y)


@contextlib.contextmanager
def small_tmpfs(path, size):
    """A real file system of ``size`` bytes at ``path`` (root only), else skip."""
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


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device (simulated)")


# ------------------------------------------------------------------ the helper
def test_atomic_write_replaces_or_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    atomic_write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(RuntimeError), atomic.atomic_write(path) as fh:
        fh.write("{torn")
        raise RuntimeError("interrupted")
    assert json.loads(path.read_text()) == {"a": 1}
    monkeypatch.setattr(atomic.os, "replace", _no_space)
    with pytest.raises(OSError, match="No space"):
        atomic_write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["x.json"]  # the temporary file was removed


def test_remove_temp_files_cleans_only_temporaries(tmp_path):
    import subprocess
    import sys

    # a temporary whose writer has exited is removed; one of a running writer (pid 1) is kept
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    (tmp_path / "keep.json").write_text("{}")
    (tmp_path / f".keep.json{atomic.TEMP_MARKER}{gone}-ab").write_text("{")
    (tmp_path / f".keep.json{atomic.TEMP_MARKER}1-cd").write_text("{")
    assert atomic.remove_temp_files(tmp_path) == [f".keep.json{atomic.TEMP_MARKER}{gone}-ab"]
    assert sorted(os.listdir(tmp_path)) == [f".keep.json{atomic.TEMP_MARKER}1-cd", "keep.json"]


# ------------------------------------------------------------------ save_pretrained
@pytest.fixture(scope="module")
def models():
    tok = demo_tokenizer()
    return demo_model(tok, seed=0), demo_model(tok, seed=1)


def test_full_disk_during_save_keeps_the_previous_export(tmp_path, monkeypatch, models):
    old, new = models
    out = tmp_path / "model"
    old.save_pretrained(out)
    monkeypatch.setattr(hf_io, "save_file", _no_space)
    with pytest.raises(OSError, match="No space"):
        new.save_pretrained(out)
    assert_same(from_pretrained(out), old)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("max_shard_size", [None, 100_000])
def test_full_disk_while_writing_config_keeps_the_previous_export(
    tmp_path, monkeypatch, models, max_shard_size
):
    old, new = models
    out = tmp_path / "model"
    old.save_pretrained(out, max_shard_size=50_000)  # a sharded previous export
    real_dump = json.dump

    def failing_dump(obj, fh, **kw):
        if "model_type" in obj:  # config.json, the last file written
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real_dump(obj, fh, **kw)

    monkeypatch.setattr(hf_io.json, "dump", failing_dump)
    with pytest.raises(OSError, match="No space"):
        new.save_pretrained(out, max_shard_size=max_shard_size)
    monkeypatch.undo()
    assert_same(from_pretrained(out), old)
    assert not [n for n in os.listdir(out) if atomic.TEMP_MARKER in n]


def test_real_full_disk_during_save_keeps_the_previous_export(tmp_path, models):
    old, new = models
    with small_tmpfs(tmp_path / "disk", "900k") as disk:
        out = disk / "model"
        old.save_pretrained(out)  # about 0.6 MB: a second copy does not fit
        with pytest.raises(OSError) as info:
            new.save_pretrained(out)
        assert info.value.errno == errno.ENOSPC or "No space" in str(info.value)
        assert_same(from_pretrained(out), old)
        new_small = tmp_path / "elsewhere"
        new.save_pretrained(new_small)  # the directory is intact: a later save to it works
        assert_same(from_pretrained(new_small), new)


def test_switching_layouts_leaves_no_stale_files(tmp_path, models):
    old, new = models
    out = tmp_path / "model"
    old.save_pretrained(out, max_shard_size=50_000)
    new.save_pretrained(out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert_same(from_pretrained(out), new)
    old.save_pretrained(out, max_shard_size=50_000)
    assert "model.safetensors" not in os.listdir(out)
    assert_same(from_pretrained(out), old)


KILL_DURING_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from artifex.demos.addition import demo_model, demo_tokenizer
    from artifex.generative_models.models.causal_lm import hf_io

    out, shard = sys.argv[1], sys.argv[2]
    tok = demo_tokenizer()
    demo_model(tok, seed=0).save_pretrained(out)
    real = hf_io.save_file

    def killed_midway(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as fh:  # a torn file, then the process dies
            fh.truncate(os.path.getsize(filename) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    hf_io.save_file = killed_midway
    demo_model(tok, seed=1).save_pretrained(out, max_shard_size=None if shard == "0" else 50_000)
    """
)


@pytest.mark.parametrize("sharded", ["0", "1"])
@pytest.mark.slow
def test_sigkill_during_save_pretrained_keeps_the_previous_export(tmp_path, models, sharded):
    out = tmp_path / "model"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SAVE, str(out), sharded],
        env=env,
        capture_output=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert_same(from_pretrained(out), models[0])
    models[1].save_pretrained(out)  # the next save cleans the temporaries
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert_same(from_pretrained(out), models[1])


def test_index_pointing_outside_the_directory_is_rejected(tmp_path, models):
    out = tmp_path / "model"
    models[0].save_pretrained(out, max_shard_size=50_000)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(out / index["weight_map"][name], outside)
    index["weight_map"][name] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"must name a file inside the model directory"):
        from_pretrained(out)
