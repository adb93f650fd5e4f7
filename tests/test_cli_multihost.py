"""`artifex-grpo train` as two real processes on 127.0.0.1 (gloo CPU collectives).

The same command line in both processes, as a cluster launcher runs it (a shared file system:
one ``--output``, one ``--checkpoint-dir``), with only ``--process-id`` differing. Process 0
writes the metrics and the model, all processes write the checkpoints together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from artifex.demos.addition import addition_dataset, demo_tokenizer
from artifex.generative_models.models.causal_lm import CausalLM
from tests.generative_models.training.multihost_worker import make_model
from tests.processes import free_port, wait_for, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600  # a hang fails the test instead of stalling CI

pytestmark = pytest.mark.slow


def _launch(tmp_path, name: str, args: list[str]) -> None:
    """Runs ``artifex-grpo train ARGS`` as processes 0 and 1; fails the test on a non-zero exit."""
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=xla_flags(2),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    port = free_port()
    procs, logs = [], []
    for pid in range(2):
        cmd = [sys.executable, "-m", "artifex.cli", "train", *args]
        cmd += ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2"]
        cmd += ["--process-id", str(pid)]
        log = open(tmp_path / f"{name}-p{pid}.txt", "w")  # noqa: SIM115
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log))
    try:
        codes = wait_for(procs, name, TIMEOUT_S)
    finally:
        for log in logs:
            log.close()
    if codes != [0, 0]:
        tails = [(tmp_path / f"{name}-p{i}.txt").read_text()[-2000:] for i in range(2)]
        pytest.fail(f"{name}: exit codes {codes}\n--- p0\n{tails[0]}\n--- p1\n{tails[1]}")


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_train_command_runs_and_resumes_across_two_processes(tmp_path):
    tok = demo_tokenizer()
    model_dir = str(tmp_path / "model")
    base = make_model(tok)  # one layer: the programs compile in about half the demo model's time
    base.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows, _ = addition_dataset(num_eval=8)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    ckpt = tmp_path / "ckpt"
    common = ["--model", model_dir, "--data", str(data), "--checkpoint-dir", str(ckpt)]
    common += ["--checkpoint-every", "1", "--prompts-per-step", "4"]
    # rewards that differ in groups (not --reward math: math-verify takes a second to import in
    # each of the four processes, and what is checked here does not depend on the reward)
    common += ["--reward", "tests.spread_reward:text_reward"]
    common += ["--num-generations", "4", "--max-new-tokens", "4", "--progress", "false"]
    common += ["--learning-rate", "1e-3", "--mesh-fsdp", "2"]
    out = tmp_path / "run" / "model"
    _launch(tmp_path, "run", [*common, "--num-steps", "2", "--output", str(out)])
    # One metrics log, written by process 0 only: each step once (no duplicate lines).
    assert _steps(tmp_path / "run" / "logs" / "metrics.jsonl") == [1, 2]
    # Checkpoints of both steps, written by the two processes together.
    assert {"1", "2"} <= set(os.listdir(ckpt))
    # The model process 0 saved (parameters gathered from both processes) loads and moved.
    trained = CausalLM.from_pretrained(str(out))
    ids = np.array([[1, 5, 6, 14, 7, 15]], np.int32)
    assert not np.allclose(np.asarray(trained(ids)), np.asarray(base(ids)))
    # Both processes restore step 2 together and train step 3 only.
    more = tmp_path / "resumed" / "model"
    _launch(tmp_path, "resumed", [*common, "--num-steps", "3", "--resume", "--output", str(more)])
    assert _steps(tmp_path / "resumed" / "logs" / "metrics.jsonl") == [3]
    assert "3" in os.listdir(ckpt)
    resumed = CausalLM.from_pretrained(str(more))
    assert not np.allclose(np.asarray(resumed(ids)), np.asarray(trained(ids)))
