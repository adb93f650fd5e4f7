"""benchmarks/distillation_addition.py at a tiny size, so that the script keeps running.

The measured run (hundreds of steps, tens of minutes) is in docs/algorithm.md; here every stage
(teacher, student warm-up, the three arms, the record and the plot) runs for a step or two:
about a minute of CPU time, most of it compiling the four trainers, hence the slow mark.
"""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import distillation_addition


@pytest.mark.slow
def test_every_stage_runs_and_is_recorded(tmp_path):
    out = str(tmp_path / "run")
    argv = ["--out", out, "--teacher-steps", "1", "--steps", "2", "--eval-every", "1"]
    record = distillation_addition.main([*argv, "--warmup-max-steps", "2"])

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
