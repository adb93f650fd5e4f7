"""The Flow-GRPO demo runs end to end (a very short configuration)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from artifex.demos.flow import FlowDemoConfig, build_flow_model, run_flow_demo
from artifex.generative_models.flow import FlowDiT, FlowModel


@pytest.mark.slow
def test_short_flow_demo_writes_results(tmp_path):
    cfg = FlowDemoConfig(
        hidden_dim=16,
        num_blocks=1,
        pretrain_steps=20,
        classifier_steps=20,
        grpo_steps=3,
        classes=(0, 1),
        num_generations=2,
        num_sampling_steps=3,
        train_steps=2,
        num_eval=2,
        out_dir=str(tmp_path),
    )
    result = run_flow_demo(cfg, verbose=False)
    assert len(result.reward_curve) == 3 and len(result.kl_curve) == 3
    assert result.kl_curve[0] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    assert result.images_before.shape == (2, 2, 8, 8) == result.images_after.shape
    assert not np.allclose(result.images_before, result.images_after)  # the policy moved
    assert result.num_compilations == 1
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["reward_curve"] == pytest.approx(result.reward_curve)
    assert (tmp_path / "images.png").stat().st_size > 0
    assert (tmp_path / "rewards.png").stat().st_size > 0


@pytest.mark.parametrize(
    "bad",
    [
        dict(classes=(10,)),
        dict(num_generations=1),
        dict(noise_level=-1.0),
        dict(beta=-0.1),
        dict(architecture="unet"),
        dict(pretrain_learning_rate=0.0),
    ],
)
def test_flow_demo_config_validation(bad):
    with pytest.raises(ValueError):
        FlowDemoConfig(**bad)


def test_build_flow_model_picks_the_architecture():
    dit = build_flow_model(FlowDemoConfig(hidden_dim=16, num_blocks=1, num_heads=2))
    assert isinstance(dit, FlowDiT)
    assert (dit.config.hidden_dim, dit.config.num_heads, dit.config.num_tokens) == (16, 2, 16)
    mlp = build_flow_model(FlowDemoConfig(architecture="mlp", hidden_dim=16, num_blocks=1))
    assert isinstance(mlp, FlowModel) and mlp.config.hidden_dim == 16
    assert dit.config.data_dim == mlp.config.data_dim == 64
