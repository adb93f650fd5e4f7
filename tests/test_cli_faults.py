"""`artifex-grpo train` against bad input and lost work: each test is one case of a hostile sweep.

Losing: a failed export or a SIGTERM without ``--checkpoint-dir`` keeps the trained state (a
default checkpoint directory beside ``--output``, announced at start) and the messages say
exactly how to continue. Two runs into one directory at once: the second is refused, naming
the first one's pid. Corrupting: a resume with another model, learning rate or reward is
refused; ``--output`` may not be ``--model``. Hangs: a bad coordinator address fails at once, a
missing process within ``--distributed-timeout``. Silent: repeated keys, ignored flags and a
``--num-steps`` below the checkpoint's are errors or notices.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from artifex.cli import EXIT_INTERRUPTED, build_parser, load_rows, main
from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.models.causal_lm import CausalLM, hf_io
from artifex.generative_models.training.checkpointing import CheckpointManager
from artifex.generative_models.training.rl import loop as loop_lib
from artifex.generative_models.training.run_lock import LOCK_NAME, RunLock
from tests.processes import free_port

REWARDS = textwrap.dedent(
    """
    import os, signal

    def by_length(prompts, completions, **columns):
        return [float(len(c)) for c in completions]  # differs within groups: weights move

    def sigterm_once(prompts, completions, **columns):
        marker = os.environ["FAULTS_SIGNAL_MARKER"]
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)
        return [float(len(c)) for c in completions]
    """
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A model directory, a data file and a reward module shared by the tests of this file."""
    root = tmp_path_factory.mktemp("faults")
    tok = demo_tokenizer()
    for name, seed in (("model", 0), ("other_model", 1)):  # same shapes, other weights
        demo_model(tok, seed=seed).save_pretrained(str(root / name))
        tok.save_pretrained(str(root / name))
    rows, _ = addition_dataset(num_eval=8)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:16]))
    (root / "fault_rewards.py").write_text(REWARDS)
    return root


@pytest.fixture()
def env(base, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(base))
    monkeypatch.setenv("FAULTS_SIGNAL_MARKER", str(tmp_path / "signalled"))
    return base


STEP = [
    "--prompts-per-step",
    "2",
    "--num-generations",
    "4",
    "--max-new-tokens",
    "4",
    "--progress",
    "false",
    "--beta",
    "0",
    "--learning-rate",
    "1e-2",
]


def args_for(base, out, *extra, reward="fault_rewards:by_length", steps=1, model="model"):
    return [
        "train",
        "--model",
        str(base / model),
        "--data",
        str(base / "train.jsonl"),
        "--output",
        str(out),
        "--reward",
        reward,
        "--num-steps",
        str(steps),
        *STEP,
        *extra,
    ]


def error_line(capsys):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("artifex-grpo: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def weights(path):
    model = CausalLM.from_pretrained(str(path))
    ids = np.array([[1, 5, 6, 14, 7, 15]], np.int32)
    return np.asarray(model(ids))


# ------------------------------------------------------------------ 1, 2: losing work
def test_a_failed_export_keeps_the_trained_state_and_the_same_command_exports_it(
    env, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "runs" / "model"
    real = hf_io.write_hf_checkpoint

    def full_disk(tensors, config, path, **kw):
        if os.path.abspath(path) == str(out):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(tensors, config, path, **kw)

    monkeypatch.setattr(hf_io, "write_hf_checkpoint", full_disk)
    args = args_for(env, out, steps=2)
    assert main(args) == 2
    err = capsys.readouterr().err
    ckpt = tmp_path / "runs" / "checkpoints"
    assert f"checkpoints go to {ckpt}" in err  # announced at start
    line = next(x for x in err.splitlines() if x.startswith("artifex-grpo: error:"))
    assert "No space left on device" in line
    assert f"the checkpoint of step 2 in {ckpt}" in line and "run the same command again" in line
    assert CheckpointManager(str(ckpt)).all_steps() == [2]

    monkeypatch.setattr(hf_io, "write_hf_checkpoint", real)  # space freed
    assert main(args) == 0
    assert "nothing was trained" in capsys.readouterr().err
    assert not np.allclose(weights(out), weights(env / "model"))  # the trained weights


def test_sigterm_without_checkpoint_dir_saves_and_the_same_command_resumes(env, tmp_path, capsys):
    out = tmp_path / "runs" / "model"
    args = args_for(env, out, reward="fault_rewards:sigterm_once", steps=2)
    assert main(args) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    ckpt = tmp_path / "runs" / "checkpoints"
    assert f"step 1 is saved as a checkpoint in {ckpt}" in err
    assert "run the same command again to resume" in err
    assert CheckpointManager(str(ckpt)).all_steps() == [1]
    assert not (out / "model.safetensors").exists()

    assert main(args) == 0  # the same command: resumes at step 1, trains step 2, exports
    steps = [json.loads(x)["step"] for x in (tmp_path / "runs" / "logs" / "metrics.jsonl").open()]
    assert steps == [1, 2]
    assert (out / "model.safetensors").exists()


def test_a_run_whose_export_and_checkpoint_cannot_fit_is_refused_before_its_first_step(
    env, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "runs" / "model"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    assert main(args_for(env, out)) == 2
    line = error_line(capsys)
    assert "not enough free space: the export to" in line and "a checkpoint in" in line
    assert "100 KiB" in line or "0.1 MiB" in line
    assert not (tmp_path / "runs" / "logs" / "metrics.jsonl").exists()  # no step ran


def test_a_last_checkpoint_that_cannot_be_written_still_exports_the_model(
    env, tmp_path, capsys, monkeypatch
):
    import orbax.checkpoint as ocp

    def full_disk(self, step, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    out = tmp_path / "runs" / "model"
    assert main(args_for(env, out)) == 2
    line = error_line(capsys)
    assert "writing checkpoint 1 in" in line and "No space left on device" in line
    assert f"the trained model (step 1) was exported to {out}" in line
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize(
    "extra,expected",
    [
        ((), "run the same command again to resume"),
        (("--resume", "false"), "run the same command again with --resume true to resume"),
        (("--overwrite",), "run the same command again without --overwrite to resume"),
        (("--checkpoint-dir", "none"), "nothing was saved (--checkpoint-dir none)"),
    ],
)
def test_the_interrupted_message_is_true(env, tmp_path, capsys, monkeypatch, extra, expected):
    def preempted(*args, **kwargs):
        return loop_lib.TrainResult(
            history=[{}], evaluations=[], start_step=0, interrupted="SIGTERM"
        )

    monkeypatch.setattr(loop_lib, "train", preempted)
    assert main(args_for(env, tmp_path / "out" / "model", *extra)) == EXIT_INTERRUPTED
    assert expected in capsys.readouterr().err


# ------------------------------------------------------------------ 3: one run per directory
HOLD = textwrap.dedent(
    """
    import sys, time
    from artifex.generative_models.training.run_lock import RunLock
    lock = RunLock(sys.argv[1], "test").acquire()
    print("held", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture()
def holder():
    procs = []

    def hold(directory):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc.pid

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("which", ["output", "checkpoints", "logs"])
def test_a_second_run_into_a_held_directory_is_refused_naming_the_first(
    env, tmp_path, capsys, holder, which
):
    out = tmp_path / "runs" / "model"
    directory = out if which == "output" else tmp_path / "runs" / which
    pid = holder(directory)
    assert main(args_for(env, out)) == 2
    line = error_line(capsys)
    assert f"is in use by another run: pid {pid} on this host" in line
    assert str(directory) in line
    assert not (out / "model.safetensors").exists()
    assert os.path.exists(directory / LOCK_NAME)  # the other run's lock is left alone


def test_a_stale_lock_is_taken_over_with_a_notice(env, tmp_path, caplog, monkeypatch):
    out = tmp_path / "runs" / "model"
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out.mkdir(parents=True)
    with RunLock(out):  # a lock file of this host, then its pid made a dead one
        record = json.loads((out / LOCK_NAME).read_text())
    record.update(pid=int(gone), token="killed-run")
    (out / LOCK_NAME).write_text(json.dumps(record))

    def finished(*args, **kwargs):
        return loop_lib.TrainResult(history=[{}], evaluations=[], start_step=0)

    monkeypatch.setattr(loop_lib, "train", finished)
    assert main(args_for(env, out)) == 0
    assert f"took over the lock of pid {gone}" in caplog.text
    assert not (out / LOCK_NAME).exists()  # released at the end


# ------------------------------------------------------------------ 6, 7, 10: resume checks
@pytest.fixture(scope="module")
def finished_run(base, tmp_path_factory):
    """A finished 2-step run with its checkpoints (copied by each test that resumes it)."""
    root = tmp_path_factory.mktemp("finished")
    sys.path.insert(0, str(base))
    try:
        rc = main(args_for(base, root / "run" / "model", steps=2))
    finally:
        sys.path.remove(str(base))
    assert rc == 0
    return root / "run"


@pytest.mark.parametrize(
    "change,difference",
    [
        (("--model", "other_model"), "run.model.files.model.safetensors.sha256"),
        (("--learning-rate", "3e-2"), "run.optimizer.learning_rate"),
        (("--reward", "math"), "rewards.names"),
        (("--extra-reward",), "rewards.names: checkpoint has ['by_length'], this run has"),
    ],
)
def test_a_resume_that_changes_what_the_run_computes_is_refused(
    env, finished_run, tmp_path, capsys, change, difference
):
    run = tmp_path / "run"
    shutil.copytree(finished_run / "checkpoints", run / "checkpoints")
    args = args_for(env, run / "model", steps=3)
    if change == ("--extra-reward",):
        args += ["--reward", "format"]
    elif change[0] == "--model":
        args[args.index("--model") + 1] = str(env / change[1])
    elif change[0] == "--reward":
        args[args.index("--reward") + 1] = change[1]
    else:
        args[args.index(change[0]) + 1] = change[1]
    assert main(args) == 2
    line = error_line(capsys)
    assert "is incompatible with this run" in line and difference in line
    assert not (run / "model" / "model.safetensors").exists()


def test_num_steps_below_the_checkpoint_is_said(env, finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run / "checkpoints", run / "checkpoints")
    assert main(args_for(env, run / "model", steps=1)) == 0
    err = capsys.readouterr().err
    assert "is at step 2 (--num-steps 1): nothing was trained" in err
    assert "the exported model is step 2's" in err
    np.testing.assert_array_equal(weights(run / "model"), weights(finished_run / "model"))


def test_output_equal_to_model_is_refused_before_loading(env, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(env / "model", model)
    before = (model / "model.safetensors").read_bytes()
    assert main(args_for(env, str(model) + "/", model=str(model))) == 2
    line = error_line(capsys)
    assert "--output" in line and "is the --model directory" in line
    assert (model / "model.safetensors").read_bytes() == before


# ------------------------------------------------------------------ 8, 9: bounded start
@pytest.mark.parametrize(
    "address,expected",
    [
        ("not_a_host:99999", "port 99999 is outside 1-65535"),
        ("not_a_host:1234", "'not_a_host' is not an IP address or a valid host name"),
        ("localhost", "expected host:port"),
        ("no-such-host.invalid:1234", "cannot resolve the host 'no-such-host.invalid'"),
    ],
)
def test_a_bad_coordinator_address_fails_at_once(env, tmp_path, capsys, address, expected):
    args = args_for(env, tmp_path / "out" / "model")
    args += ["--coordinator-address", address, "--num-processes", "1", "--process-id", "0"]
    start = time.monotonic()
    assert main(args) == 2
    assert time.monotonic() - start < 40
    line = error_line(capsys)
    assert expected in line and address in line


@pytest.mark.parametrize("present", [0, 1])
def test_a_process_that_never_comes_is_named_within_the_timeout(env, tmp_path, capsys, present):
    port = free_port()
    args = args_for(env, tmp_path / "out" / "model")
    args += ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2"]
    args += ["--process-id", str(present), "--distributed-timeout", "3"]
    start = time.monotonic()
    assert main(args) == 2
    assert time.monotonic() - start < 30
    line = error_line(capsys)
    assert f"127.0.0.1:{port}" in line and "--distributed-timeout" in line
    if present == 0:
        assert "process 1 did not join" in line
    else:
        assert "no answer from process 0" in line


# ------------------------------------------------------------------ 10: nothing silent
@pytest.mark.parametrize("value", ["0", "-2"])
@pytest.mark.parametrize("flag", ["--mesh-fsdp", "--mesh-tensor"])
def test_mesh_sizes_below_one_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(
            ["train", "--model", "m", "--data", "d", "--reward", "math", flag, value]
        )
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,expected",
    [
        (("--max-turns", "0"), "--max-turns: expected an int >= 1"),
        (("--tool-timeout", "-5"), "--tool-timeout: expected a finite number > 0"),
        (("--stop-string", ""), "--stop-string: expected a non-empty text"),
        (("--max-completion-tokens", "0"), "--max-completion-tokens: expected an int >= 1"),
    ],
)
def test_bad_multi_turn_values_are_refused(flags, expected, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["train", "--model", "m", "--data", "d", "--reward", "math", *flags]
        )
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,expected",
    [
        (("--max-turns", "3"), "--max-turns applies to multi-turn episodes only"),
        (("--tool-timeout", "5"), "--tool-timeout applies to --tools only"),
        (("--tool-format", "llama3"), "--tool-format applies to --tools only"),
        (("--stop-string", "</x>"), "--stop-string applies to multi-turn episodes only"),
    ],
)
def test_multi_turn_flags_without_tools_are_refused(env, tmp_path, capsys, flags, expected):
    assert main(args_for(env, tmp_path / "out" / "model", *flags)) == 2
    assert expected in error_line(capsys)


def test_repeated_keys_in_config_files_are_refused_naming_file_line_and_key(tmp_path, capsys):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("num_steps: 2\nlearning_rate: 1e-3\nnum_steps: 5\n")
    assert main(["train", "--config", str(yaml_file), "--model", "m", "--data", "d"]) == 2
    line = error_line(capsys)
    assert f"{yaml_file}:3: key 'num_steps' appears twice" in line
    json_file = tmp_path / "run.json"
    json_file.write_text('{\n  "num_steps": 2,\n  "num_steps": 5\n}\n')
    assert main(["train", "--config", str(json_file), "--model", "m", "--data", "d"]) == 2
    assert f"{json_file}:3: key 'num_steps' appears twice" in error_line(capsys)


def test_repeated_keys_in_datasets_are_refused_naming_file_line_and_key(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4", "answer": "5"}\n'
    )
    with pytest.raises(ValueError, match=rf"{rows}:2: key 'answer' appears twice"):
        load_rows(str(rows))
    array = tmp_path / "rows.json"
    array.write_text('[\n {"prompt": "a", "answer": "1"},\n {"prompt": "b",\n  "prompt": "c"}\n]\n')
    with pytest.raises(ValueError, match=rf"{array}:4: key 'prompt' appears twice"):
        load_rows(str(array))
