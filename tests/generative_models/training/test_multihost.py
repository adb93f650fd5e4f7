"""Two real JAX processes on 127.0.0.1 (gloo CPU collectives, 2 CPU devices each, one mesh).

Two launches of two processes each (see ``multihost_worker.py``): ``first`` (three
``train_step`` calls, the whole loop uninterrupted, then the loop again SIGKILLed right after its
step-2 checkpoint) and ``resume`` (the loop again, resuming from that checkpoint), run once per
test session (under pytest-xdist by the first worker that needs them; see ``runs``). A
compilation cache shared by the launches keeps the test inside the CI budget; every subprocess
has a hard timeout, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.generative_models.training import multihost_worker as worker
from tests.generative_models.training.test_trackers import tensorboard_events
from tests.processes import free_port, wait_for, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TIMEOUT_S = 600  # per launch; a hang fails the test instead of stalling CI

pytestmark = pytest.mark.slow


def _start(mode: str, out: str, cache: str) -> list[subprocess.Popen]:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=xla_flags(2),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        JAX_COMPILATION_CACHE_DIR=cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    port = free_port()
    procs = []
    for pid in range(2):
        cmd = [sys.executable, "-m", "tests.generative_models.training.multihost_worker"]
        cmd += [mode, out, "--coordinator", f"127.0.0.1:{port}"]
        cmd += ["--num-processes", "2", "--process-id", str(pid)]
        log = open(os.path.join(out, f"{mode}-stdout-p{pid}.txt"), "w")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log))
    return procs


def _wait(procs: list[subprocess.Popen], out: str, mode: str) -> list[int]:
    codes = wait_for(procs, mode, TIMEOUT_S)
    expected = [-signal.SIGKILL] * 2 if mode == "first" else [0, 0]
    if codes != expected:
        with open(os.path.join(out, f"{mode}-stdout-p0.txt")) as fh:
            tail = fh.read()[-3000:]
        pytest.fail(f"{mode}: exit codes {codes}\n{tail}")
    return codes


def _launches(out: str) -> list[int]:
    """Both launches, writing into ``out``; returns the exit codes of the killed launch."""
    cache = os.path.join(out, "jax-cache")
    killed_codes = _wait(_start("first", out, cache), out, "first")
    _wait(_start("resume", out, cache), out, "resume")
    return killed_codes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(out, killed_codes)`` of the two launches, run once per test session.

    pytest-xdist gives the module's tests to different workers, and a module fixture runs once
    in each: the first worker to get here runs the launches while holding a lock in the
    session's temporary directory (which its workers share), the others wait for the lock and
    read the same files, or fail with the same message. A worker that crashed midway left no
    result (its lock was released with its process): the next one starts again.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's, shared by its workers
    out, result = root / "multihost", root / "multihost-result.json"
    with open(root / "multihost.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not result.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            try:
                outcome = {"killed_codes": _launches(str(out))}
            except pytest.fail.Exception as e:
                outcome = {"error": str(e)}
            result.write_text(json.dumps(outcome))
    outcome = json.loads(result.read_text())
    if "error" in outcome:
        pytest.fail(outcome["error"], pytrace=False)
    return str(out), outcome["killed_codes"]


def _load(out: str, name: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(out, name)) as f:
        return dict(f)


def _jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_train_step_across_two_processes_equals_one_process(runs):
    out, _ = runs
    two = _load(out, "first-p0.npz")
    other = _load(out, "first-p1.npz")
    for key in two:  # both processes hold the same (global) values
        np.testing.assert_array_equal(two[key], other[key])
    # One process with 4 devices (of this test process's 8), the same mesh shape.
    mesh = worker.make_mesh_for_test(jax.devices()[:4])
    trainer, _ = worker.make_trainer(mesh)
    initial = {k: v.copy() for k, v in worker.flat_params(trainer).items()}  # before the steps
    history = worker.run_steps(trainer, mesh)
    one = worker.flat_params(trainer)
    assert len(one) > 10
    worst = max(_rel(two[f"steps/{k}"], v) for k, v in one.items())
    params = max(_rel(two[f"steps/{k}"], v) for k, v in one.items() if "model" in k)
    # The figures docs/sharding.md quotes (pytest -s shows them).
    print(f"\ntwo processes vs one after 3 train_steps: max relative difference {params:.2g} "
          f"(parameters), {worst:.2g} (parameters and optimizer state)")  # fmt: skip
    # float32 sums reduced in another order (2 processes x 2 devices against 1 x 4): with the
    # 3-layer demo model, parameters 3.9e-7-8.3e-7 apart on the Intel machine, 4.6e-7 on the AMD
    # one; Adam's second moment (squared gradients summed) up to 1.04e-6 there. With the one-layer
    # model of multihost_worker.make_model (2026-11-29, Intel): 6.6e-8 and 6.0e-7. A wrong
    # reduction across the processes would be off by a whole factor.
    assert params <= 1e-6, params
    assert worst <= 4e-6, worst
    np.testing.assert_allclose(two["steps/loss"], [h["total_loss"] for h in history], rtol=1e-6)
    # The parameters did move (the comparison is not between two initial models).
    moved = max(_rel(v, initial[k]) for k, v in one.items() if "model" in k)
    assert moved > 1e-4


def test_killed_and_resumed_loop_matches_the_uninterrupted_run(runs):
    out, killed_codes = runs
    assert killed_codes == [-signal.SIGKILL, -signal.SIGKILL]
    with open(os.path.join(out, "first-stdout-p0.txt"), encoding="utf-8") as fh:
        assert "the killed run was not killed" not in fh.read()
    full, resumed = _load(out, "first-p0.npz"), _load(out, "resume-p0.npz")
    assert int(resumed["loop/start_step"]) == 2 and int(full["loop/start_step"]) == 0
    keys = [k for k in full if k.startswith("loop/model/") or k.startswith("loop/opt/")]
    assert len(keys) > 10
    for key in keys:
        np.testing.assert_array_equal(full[key], resumed[key], err_msg=key)
    # The step the resumed run trained is the uninterrupted run's step 3.
    np.testing.assert_array_equal(full["loop/reward_mean"][-1:], resumed["loop/reward_mean"])
    assert sorted(os.listdir(os.path.join(out, "ckpt-killed"))) == ["1", "2", "3"]
    other = _load(out, "resume-p1.npz")
    for key in keys:
        np.testing.assert_array_equal(resumed[key], other[key])


def test_only_process_zero_writes_logs_and_the_model(runs):
    out, _ = runs
    names = set(os.listdir(out))
    for run in ("full", "killed", "resume"):
        assert f"logs-{run}-p0" in names
        assert f"logs-{run}-p1" not in names  # process 1 never created its log directory
    assert "model-full-p0" in names and "model-full-p1" not in names
    if importlib.util.find_spec("tensorboardX"):  # the runs report to TensorBoard as well
        events, _ = tensorboard_events(os.path.join(out, "logs-full-p0", "tb"))
        assert sorted(events) == [0, 1, 2, 3] and "reward_mean" in events[3]
    steps = [r["step"] for r in _jsonl(os.path.join(out, "logs-full-p0", "metrics.jsonl"))]
    assert steps == [0, 1, 2, 3, 3]  # eval at 0, three steps, eval at the end
    resumed = _jsonl(os.path.join(out, "logs-resume-p0", "metrics.jsonl"))
    assert [r["step"] for r in resumed] == [3, 3]
    # Every logged metric of the resumed step 3 equals the uninterrupted run's (timings aside).
    full_step3 = next(r for r in _jsonl(os.path.join(out, "logs-full-p0", "metrics.jsonl"))
                      if r["step"] == 3)  # fmt: skip
    timings = {"rollout_time", "step_time"}
    assert set(resumed[0]) == set(full_step3)
    for key, value in full_step3.items():
        if key not in timings:
            np.testing.assert_array_equal(resumed[0][key], value, err_msg=key)
    # The completions log: process 0 writes its own rows (its 2 prompts x 4 completions) of
    # every step, and the resumed run's step 3 wrote exactly what the uninterrupted run did.
    samples = _jsonl(os.path.join(out, "logs-full-p0", "completions.jsonl"))
    assert sorted({r["step"] for r in samples}) == [1, 2, 3]
    for step in (1, 2, 3):
        rows = [r for r in samples if r["step"] == step]
        assert [r["index"] for r in rows] == list(range(8))
        assert [r["group"] for r in rows] == [i // 4 for i in range(8)]
        for r in rows:
            assert set(r["rewards"]) == {"math_answer_reward", "digit_reward"}
            assert r["reward"] == pytest.approx(sum(r["rewards"].values()))
        for g in range(2):  # group-standardized advantages sum to zero within a group
            assert abs(sum(r["advantage"] for r in rows if r["group"] == g)) < 1e-4
    resumed_samples = _jsonl(os.path.join(out, "logs-resume-p0", "completions.jsonl"))
    assert resumed_samples == [r for r in samples if r["step"] == 3]
    # save_pretrained from process 0 wrote the gathered (FSDP-sharded) parameters.
    from flax import nnx

    from artifex.generative_models.models.causal_lm import from_pretrained

    saved = from_pretrained(os.path.join(out, "model-full-p0"))
    full = _load(out, "first-p0.npz")
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(saved, nnx.Param))[0]
    assert len(leaves) > 5
    for path, x in leaves:
        key = "loop/model/" + jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), full[key])
