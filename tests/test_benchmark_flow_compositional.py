"""benchmarks/flow_compositional.py on a tiny task, so that the script keeps running.

The measured runs (hundreds of steps) are in docs/flow-grpo.md; here a shapes model of width 16
pretrained for 3 steps goes through 2 GRPO steps with each training reward. The per-check
rates the script prints are checked against the loop's own evaluations of the same images:
its "fraction" and "correct" before and after training are the evaluation's mean reward and
compositional accuracy (pass@1) at steps 0 and 2, which FlowEvaluator computes through the
reward function, not through the script's scene_checks loop. The tiny model's images pass
some checks (the mean reward is above 0), so the comparison is not of zeros.
"""

from __future__ import annotations

import json

import pytest

from artifex.flow_shapes import main as prepare
from artifex.generative_models.flow import TextFlowDiT, load_flow_model
from benchmarks import flow_compositional


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("task") / "shapes"
    argv = ["--out", str(out), "--num-images", "16", "--hidden-dim", "16", "--num-blocks", "1",
            "--num-heads", "2", "--pretrain-steps", "3", "--batch-size", "4"]  # fmt: skip
    assert prepare(argv) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["fraction", "correct", "counts"])
def test_the_script_trains_records_and_saves(task, tmp_path, reward):
    out = tmp_path / "grpo"
    argv = ["--task", str(task), "--out", str(out), "--grpo-steps", "2", "--eval-every", "2",
            "--prompts-per-step", "2", "--generations", "2", "--sde-steps", "3",
            "--reward", reward, "--beta", "0"]  # fmt: skip
    summary = flow_compositional.main(argv)
    assert json.loads((out / "results.json").read_text()) == summary
    assert [e["step"] for e in summary["evaluations"]] == [0, 2]
    assert len(summary["train_reward"]) == 2
    before, after = summary["checks"]["before"], summary["checks"]["after"]
    assert set(before) == set(after) >= {"present_0", "count_0", "no_extra", "correct"}
    for rates in (before, after):
        for name, value in rates.items():
            assert name == "shapes_over" or 0.0 <= value <= 1.0
    first, last = summary["evaluations"][0], summary["evaluations"][-1]
    assert first["eval/reward_mean"] > 0
    assert before["fraction"] == pytest.approx(first["eval/reward_mean"], rel=1e-6)
    assert after["fraction"] == pytest.approx(last["eval/reward_mean"], rel=1e-6)
    assert before["correct"] == pytest.approx(first["eval/pass@1"])
    assert after["correct"] == pytest.approx(last["eval/pass@1"])
    for probe in summary["relation_probe"].values():
        assert probe["gain"] == pytest.approx(probe["loss_flipped"] - probe["loss_true"])
        assert probe["loss_true"] > 0 and probe["loss_flipped"] > 0
    model = load_flow_model(out / "model")
    assert isinstance(model, TextFlowDiT) and model.config.hidden_dim == 16
