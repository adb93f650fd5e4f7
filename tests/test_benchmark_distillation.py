"""benchmarks/distillation_addition.py at a tiny size, so that the script keeps running.

The measured run (hundreds of steps, tens of minutes) is in docs/algorithm.md; here every stage
(teacher, student warm-up, the three arms, the record and the plot) runs for a step or two, on
batches of a few prompts and a one-layer student: most of the time is compiling the four
trainers, hence the slow mark.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from benchmarks import distillation_addition


@pytest.mark.slow
def test_every_stage_runs_and_is_recorded(tmp_path, monkeypatch):
    # The demo's settings at their smallest: 2 prompts x 2 completions a step, 8 held-out
    # problems (the script reads them from DEMO), and a one-layer teacher of width 32 (the
    # script's own student builder) in place of the demo's three-layer model, whose update
    # took a third of the time to compile; the stages and the record are the script's.
    tiny = dataclasses.replace(
        distillation_addition.DEMO, prompts_per_step=2, num_generations=2, num_eval=8
    )
    monkeypatch.setattr(distillation_addition, "DEMO", tiny)

    def small_teacher(tokenizer, seed):
        return distillation_addition._student(tokenizer, 32, 1, seed)

    monkeypatch.setattr(distillation_addition, "demo_model", small_teacher)
    out = str(tmp_path / "run")
    argv = ["--out", out, "--teacher-steps", "1", "--steps", "2", "--eval-every", "1"]
    argv += ["--warmup-max-steps", "2", "--student-width", "16", "--student-layers", "1"]
    record = distillation_addition.main(argv)

    assert set(record["arms"]) == {"grpo", "distill", "grpo+distill"}
    for arm, data in record["arms"].items():
        assert [step for step, _ in data["curve"]] == [0, 1, 2], arm
        assert all(0.0 <= value <= 1.0 for _, value in data["curve"]), arm
        # every arm starts from the same warmed-up student
        assert data["curve"][0][1] == record["student"]["pass@1"], arm
    teacher = record["teacher"]
    assert teacher["grpo_steps"] == 1 and 0.0 <= teacher["pass@1"] <= 1.0
    assert teacher["parameters"] > record["student"]["parameters"]
    with open(os.path.join(out, "record.json")) as fh:
        assert json.load(fh)["arms"].keys() == record["arms"].keys()
    with open(os.path.join(out, "curves.png"), "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.isfile(os.path.join(out, "teacher", "teacher.json"))


def test_an_unknown_arm_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        distillation_addition.main(["--out", str(tmp_path), "--arms", "sft"])
    assert "invalid choice: 'sft'" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_first_step_at_a_level():
    curve = [(0, 0.2), (40, 0.5), (80, 0.45), (120, 0.8)]
    assert distillation_addition._first_at(curve, 0.5) == 40
    assert distillation_addition._first_at(curve, 0.8) == 120
    assert distillation_addition._first_at(curve, 0.81) is None


def test_the_plot_is_written(tmp_path):
    record = {
        "args": {"learning_rate": 1e-3, "divergence": "reverse_kl"},
        "teacher": {"pass@1": 0.8},
        "arms": {arm: {"curve": [[0, 0.2], [10, 0.4]]} for arm in distillation_addition.ARMS},
    }
    path = str(tmp_path / "curves.png")
    distillation_addition._plot(record, path)
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
