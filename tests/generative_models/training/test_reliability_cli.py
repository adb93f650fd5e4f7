"""Reliability of the command line: one-line errors for every error class, pre-flight, flags."""

from __future__ import annotations

import errno
import json
import os

import pytest

from artifex.cli import EXIT_INTERRUPTED, build_parser, load_rows, main
from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.training.checkpointing import CorruptCheckpointError
from artifex.generative_models.training.rl import loop as loop_lib
from artifex.generative_models.training.rl.grpo import NonFiniteUpdateError
from artifex.generative_models.training.rl.rewards import RewardFunctionError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = demo_tokenizer()
    path = tmp_path_factory.mktemp("cli") / "model"
    demo_model(tok).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


@pytest.fixture()
def data_file(tmp_path):
    rows, _ = addition_dataset(num_eval=8)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:16]))
    return str(path)


ARGS = [
    "--reward",
    "math",
    "--num-steps",
    "1",
    "--prompts-per-step",
    "2",
    "--num-generations",
    "4",
    "--max-new-tokens",
    "4",
    "--progress",
    "false",
]


def train_args(model_dir, data_file, tmp_path, *extra):
    return [
        "train",
        "--model",
        model_dir,
        "--data",
        data_file,
        "--output",
        str(tmp_path / "out" / "model"),
        *ARGS,
        *extra,
    ]


def one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("artifex-grpo: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------ flags
@pytest.mark.parametrize(
    "flag,value",
    [
        ("--learning-rate", "-1e-3"),
        ("--warmup-steps", "-1"),
        ("--weight-decay", "-0.1"),
        ("--lora-rank", "-4"),
        ("--learning-rate", "nan"),
        ("--shuffle", "flase"),
        ("--resume", "maybe"),
    ],
)
def test_bad_flag_values_are_rejected(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(
            ["train", "--model", "m", "--data", "d", "--reward", "math", flag, value]
        )
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_boolean_flags_work_bare_and_with_a_value():
    base = ["train", "--model", "m", "--data", "d", "--reward", "math"]
    assert getattr(build_parser().parse_args([*base, "--overwrite"]), "TrainConfig.overwrite")
    args = build_parser().parse_args([*base, "--shuffle", "off", "--debug"])
    assert getattr(args, "TrainConfig.shuffle") is False and args.debug


# ------------------------------------------------------------------ parse errors
def test_jsonl_parse_error_names_the_file_and_the_right_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c",}\n')
    with pytest.raises(ValueError, match=rf"{path}:4: invalid JSON"):
        load_rows(str(path))


def test_json_array_file_reads_and_its_errors_name_the_line(tmp_path):
    good = tmp_path / "rows.json"
    good.write_text('[\n {"prompt": "a"},\n {"prompt": "b"}\n]\n')
    assert load_rows(str(good)) == [{"prompt": "a"}, {"prompt": "b"}]
    bad = tmp_path / "bad.json"
    bad.write_text('[\n {"prompt": "a"},\n {"prompt": "b"\n]\n')
    with pytest.raises(ValueError, match=rf"{bad}:4: invalid JSON"):
        load_rows(str(bad))


def test_cli_parse_error_is_one_line(tmp_path, model_dir, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{oops}\n')
    assert main(train_args(model_dir, str(data), tmp_path)) == 2
    assert f"{data}:2: invalid JSON" in one_line_error(capsys)


# ------------------------------------------------------------------ pre-flight
def test_output_that_is_a_file_fails_before_loading_anything(tmp_path, data_file, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    empty_model = tmp_path / "empty"  # never read: the output is checked first
    empty_model.mkdir()
    args = train_args(str(empty_model), data_file, tmp_path)
    args[args.index("--output") + 1] = str(blocker / "model")
    assert main(args) == 2
    line = one_line_error(capsys)
    assert "--output" in line and str(blocker) in line


def test_checkpoint_dir_of_another_run_needs_resume_or_overwrite(
    tmp_path, model_dir, data_file, capsys, monkeypatch
):
    ckpt = tmp_path / "ckpt"
    (ckpt / "3").mkdir(parents=True)  # looks like a finished Orbax step to the manager
    (ckpt / "3" / "_CHECKPOINT_METADATA").write_text("{}")
    rc = main(
        train_args(
            model_dir, data_file, tmp_path, "--checkpoint-dir", str(ckpt), "--resume", "false"
        )
    )
    assert rc == 2
    line = one_line_error(capsys)
    assert "already holds checkpoints" in line and "--overwrite" in line


# ------------------------------------------------------------------ every error class
@pytest.mark.parametrize(
    "error,expected",
    [
        (NonFiniteUpdateError("non-finite grad_norm=nan at optimizer step 3", {}), "grad_norm=nan"),
        (
            RewardFunctionError(
                "reward function 'math' failed on row 2",
                function_name="math",
                function_index=0,
                row=2,
            ),
            "row 2",
        ),
        (OSError(errno.ENOSPC, "No space left on device", "/ckpt/5"), "No space left"),
        (
            CorruptCheckpointError("no intact checkpoint in /ckpt:\n  checkpoint 2 is damaged"),
            "checkpoint 2 is damaged",
        ),
        (RuntimeError("orbax: something failed\nwith details"), "something failed"),
        (KeyError("prompt"), "KeyError"),
    ],
)
def test_every_library_error_is_one_line_and_non_zero(
    tmp_path, model_dir, data_file, capsys, monkeypatch, error, expected
):
    def failing_train(*args, **kwargs):
        raise error

    monkeypatch.setattr(loop_lib, "train", failing_train)
    rc = main(train_args(model_dir, data_file, tmp_path))
    assert rc != 0
    line = one_line_error(capsys)
    assert expected in line and "--debug" in line
    with pytest.raises(type(error)):
        main(["--debug", *train_args(model_dir, data_file, tmp_path)])
    with pytest.raises(type(error)):
        main([*train_args(model_dir, data_file, tmp_path), "--debug"])


def test_corrupt_model_weights_name_the_directory(tmp_path, model_dir, data_file, capsys):
    bad = tmp_path / "bad_model"
    bad.mkdir()
    for name in os.listdir(model_dir):
        (bad / name).write_bytes((tmp_path / model_dir / name).read_bytes())
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(train_args(str(bad), data_file, tmp_path)) == 2
    line = one_line_error(capsys)
    assert f"cannot load the model from {bad}" in line


def test_preempted_run_exits_75_and_does_not_export(
    tmp_path, model_dir, data_file, capsys, monkeypatch
):
    def preempted(*args, **kwargs):
        return loop_lib.TrainResult(history=[], evaluations=[], start_step=0, interrupted="SIGTERM")

    monkeypatch.setattr(loop_lib, "train", preempted)
    assert main(train_args(model_dir, data_file, tmp_path)) == EXIT_INTERRUPTED
    assert "stopped by SIGTERM" in capsys.readouterr().err
    assert not (tmp_path / "out" / "model" / "model.safetensors").exists()
