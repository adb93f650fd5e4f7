"""``artifex-grpo train --report-to``: parsing, errors before anything runs, real trackers."""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest

from artifex.cli import build_parser, main
from artifex.demos.addition import demo_model, demo_tokenizer
from artifex.generative_models.training import trackers
from tests.generative_models.training.test_trackers import (
    same,
    tensorboard_events,
    wandb_env,
    wandb_history,
)

BASE = ["train", "--model", "m", "--data", "d.jsonl", "--reward", "math"]


def _report_to(*extra):
    args = build_parser().parse_args([*BASE, *extra])
    return getattr(args, "TrainConfig.report_to", None)


def test_report_to_takes_comma_lists_and_repeats(monkeypatch):
    monkeypatch.setattr(trackers, "_installed", lambda module: True)
    assert _report_to() is None  # TrainConfig's default: metrics.jsonl only
    assert _report_to("--report-to", "TensorBoard,wandb", "--report-to", "trackio") == [
        "tensorboard", "wandb", "trackio",
    ]  # fmt: skip
    assert _report_to("--report-to", "none") == ["none"]


def test_report_to_in_a_config_file(monkeypatch, tmp_path):
    from artifex.cli import _expand_config

    monkeypatch.setattr(trackers, "_installed", lambda module: True)
    config = tmp_path / "run.yaml"
    config.write_text("report_to: [wandb, tensorboard]\n")
    argv = _expand_config(build_parser(), [*BASE, "--config", str(config)])
    args = build_parser().parse_args(argv)
    assert getattr(args, "TrainConfig.report_to") == ["wandb", "tensorboard"]


@pytest.mark.parametrize(
    ("value", "installed", "message"),
    [
        ("comet", True, "argument --report-to: unknown tracker 'comet': use jsonl, tensorboard"),
        ("wandb", False, "argument --report-to: the option names 'wandb', but wandb is not "
                         "installed: pip install 'artifex-grpo[wandb]'"),
        ("all", True, "argument --report-to: 'all' is not accepted"),
    ],
)  # fmt: skip
def test_bad_report_to_is_a_one_line_error_before_anything_runs(
    monkeypatch, capsys, tmp_path, value, installed, message
):
    monkeypatch.setattr(trackers, "_installed", lambda module: installed)
    with pytest.raises(SystemExit) as exit_info:
        main([*BASE, "--num-steps", "1", "--output", str(tmp_path / "out"), "--report-to", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "out")


def test_none_beside_a_tracker_is_an_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(trackers, "_installed", lambda module: True)
    model = tmp_path / "model"
    os.makedirs(model)
    rc = main(["train", "--model", str(model), "--data", "d.jsonl", "--reward", "math",
               "--num-steps", "1", "--output", str(tmp_path / "out" / "m"),
               "--report-to", "none", "--report-to", "wandb"])  # fmt: skip
    assert rc == 2
    assert "'none' means no tracker and cannot stand beside others" in capsys.readouterr().err


@pytest.mark.skipif(
    not (importlib.util.find_spec("tensorboardX") and importlib.util.find_spec("wandb")),
    reason="needs tensorboardX and wandb (the [tensorboard] and [wandb] extras)",
)
def test_train_reports_to_tensorboard_and_wandb_offline(tmp_path, monkeypatch):
    for name, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    tok = demo_tokenizer()
    model_dir = tmp_path / "model"
    demo_model(tok).save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                            for a in range(4)))  # fmt: skip
    out = tmp_path / "run"
    rc = main(
        ["train", "--model", str(model_dir), "--data", str(data), "--output", str(out / "model"),
         "--reward", "tests.spread_reward:text_reward", "--num-steps", "1",
         "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "3",
         "--progress", "false", "--log-completions-every", "1", "--completions-to-print", "0",
         "--report-to", "tensorboard,wandb"]
    )  # fmt: skip
    assert rc == 0
    logs = out / "logs"
    expected = {}
    for line in (logs / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        expected.setdefault(record.pop("step"), {}).update(record)
    assert 1 in expected and len(expected[1]) > 10
    values, _ = tensorboard_events(logs / "tb")
    (run_dir,) = glob.glob(str(logs / "wandb" / "offline-run-*"))
    history = wandb_history(run_dir)
    for step, metrics in expected.items():
        for key, value in metrics.items():
            assert same(value, values[step][key]), ("tensorboard", step, key)
            assert same(value, history[step][key]), ("wandb", step, key)
    assert "completions" in values[1] and "completions/path" in history[1]
