"""The shapes task on disk: a pretrained text-conditioned model and disjoint prompt files."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from artifex.flow_shapes import ShapesTaskConfig, main
from artifex.generative_models.flow import TextFlowDiT, load_flow_model, split_captions
from artifex.generative_models.flow.text_encoder import (
    TEXT_ENCODER,
    TextPretrainConfig,
    pretrain_text_encoder,
)


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


def test_a_pretrained_text_encoder_is_kept_frozen(tmp_path):
    out = tmp_path / "shapes"
    argv = ["--out", str(out), "--num-images", "16", "--hidden-dim", "16", "--num-blocks", "1",
            "--num-heads", "2", "--pretrain-steps", "3", "--batch-size", "4",
            "--text-pretrain-steps", "5"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "pretrain.json").read_text())
    assert summary["config"]["text_pretrain_steps"] == 5
    assert summary["text_loss_last"] > 0 and 0.0 <= summary["text_layout_held_out"] <= 1.0
    # the flow steps left the encoder as the text pretraining made it: retrain it from the same
    # seed and compare
    config = ShapesTaskConfig(num_images=16, hidden_dim=16, num_blocks=1, num_heads=2)
    fresh = TextFlowDiT(config.model_config(), rngs=nnx.Rngs(0))
    pretrain_text_encoder(fresh, split_captions(0.2, seed=0)[0], TextPretrainConfig(num_steps=5))
    saved = load_flow_model(out / "model")
    for a, b in zip(
        jax.tree.leaves(nnx.state(saved, TEXT_ENCODER)),
        jax.tree.leaves(nnx.state(fresh, TEXT_ENCODER)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_text_pretraining_needs_held_out_captions(tmp_path):
    argv = ["--out", str(tmp_path / "t"), "--held-out-fraction", "0.0001",
            "--text-pretrain-steps", "2"]  # fmt: skip
    with pytest.raises(ValueError, match=r"held_out_fraction 0\.0001 holds out no caption"):
        main(argv)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("held_out_fraction", 1.0),
        ("layout", "ring"),
        ("pretrain_steps", 0),
        ("learning_rate", 0.0),
        ("text_pretrain_steps", -1),
    ],
)
def test_bad_settings(field, value):
    with pytest.raises(ValueError, match=field):
        ShapesTaskConfig(**{field: value})
