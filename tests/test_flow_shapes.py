"""The shapes task on disk: a pretrained text-conditioned model and disjoint prompt files."""

from __future__ import annotations

import json

import pytest

from artifex.flow_shapes import ShapesTaskConfig, main
from artifex.generative_models.flow import TextFlowDiT, load_flow_model, split_captions


def _rows(path):
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


def test_the_task_directory(tmp_path):
    out = tmp_path / "shapes"
    argv = ["--out", str(out), "--num-images", "16", "--hidden-dim", "16", "--num-blocks", "1",
            "--num-heads", "2", "--pretrain-steps", "3", "--batch-size", "4"]  # fmt: skip
    assert main(argv) == 0
    model = load_flow_model(out / "model")
    assert isinstance(model, TextFlowDiT) and model.config.image_shape == (32, 32, 3)
    train, held = split_captions(0.2, seed=0)
    assert _rows(out / "train.jsonl") == train and _rows(out / "heldout.jsonl") == held
    summary = json.loads((out / "pretrain.json").read_text())
    assert summary["config"]["pretrain_steps"] == 3 and summary["held_out_captions"] == len(held)
    assert summary["loss_first"] > 0 and summary["seconds"] > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("held_out_fraction", 1.0), ("layout", "ring"), ("pretrain_steps", 0), ("learning_rate", 0.0)],
)
def test_bad_settings(field, value):
    with pytest.raises(ValueError, match=field):
        ShapesTaskConfig(**{field: value})
