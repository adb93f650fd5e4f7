"""Flow-GRPO through the main loop: logs, images, checkpoints, resume, refusals."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    SDEConfig,
    TextFlowDiT,
    TextFlowDiTConfig,
    compositional,
    flow_trainer,
    train_flow,
)
from artifex.generative_models.training import IncompatibleCheckpointError
from artifex.generative_models.training.rl import GRPOConfig, TrainConfig

CFG = TextFlowDiTConfig(
    image_shape=(8, 8, 3), patch_size=4, hidden_dim=16, num_blocks=1, num_heads=2, time_features=8
)
ROWS = [{"prompt": p} for p in ("a red square", "two blue circles", "a green triangle")]
SDE = SDEConfig(num_steps=4, noise_level=0.8, window_size=2)


def _trainer(sde=SDE, beta=0.01):
    model = TextFlowDiT(CFG, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(state))))
    nnx.update(
        model, jax.tree.map(lambda p: p + 0.2 * jax.random.normal(next(keys), p.shape), state)
    )
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    grpo = GRPOConfig(num_generations=4, beta=beta, kl_estimator="exact", entropy_coeff=0.0)
    return flow_trainer(model, optimizer, grpo, sde)


def _loop(tmp_path, num_steps, **kw):
    return TrainConfig(
        num_steps=num_steps,
        prompts_per_step=2,
        num_iterations=2,
        log_dir=str(tmp_path / "logs"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        log_completions_every=1,
        completions_to_print=0,
        progress=False,
        handle_signals=False,
        **kw,
    )


def _advantages(rewards, g):
    """Float64 group normalization: (r - mean) / (std (ddof 1) + 1e-4)."""
    r = np.asarray(rewards, np.float64).reshape(-1, g)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).ravel()


def test_train_flow_logs_images_and_resumes(tmp_path):
    trainer = _trainer()
    before = jax.tree.map(np.asarray, nnx.state(trainer.model, nnx.Param))
    result = train_flow(
        trainer, ROWS, compositional, _loop(tmp_path, 2), SDE, eval_dataset=ROWS[:2]
    )
    assert len(result.history) == 2 and [s for s, _ in result.evaluations] == [0, 2]
    last = result.history[-1]
    for key in ("rewards/compositional", "kl", "policy_loss", "flow/window_start", "reward_mean"):
        assert np.isfinite(last[key]), key
    after = nnx.state(trainer.model, nnx.Param)
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(b) - a).max()), before, after)
    assert max(jax.tree.leaves(moved)) > 0
    logs = tmp_path / "logs"
    metrics = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/pass@1" in m for m in metrics)
    rows = [json.loads(x) for x in (logs / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {r["step"] for r in rows} == {1, 2}
    for step in (1, 2):
        mine = [r for r in rows if r["step"] == step]
        rewards = [r["rewards"]["compositional"] for r in mine]
        assert [r["reward"] for r in mine] == pytest.approx(rewards)
        np.testing.assert_allclose(
            [r["advantage"] for r in mine], _advantages(rewards, 4), rtol=1e-4, atol=1e-4
        )
        # the completion is what the detector sees in the image: the shapes in words
        assert all(isinstance(r["completion"], str) and r["completion"] for r in mine)
    step2 = [r for r in rows if r["step"] == 2]
    assert last["reward_mean"] == pytest.approx(np.mean([r["reward"] for r in step2]), rel=1e-5)
    images = sorted(p.name for p in (logs / "images").iterdir())
    assert images == [
        "eval_000000.jsonl",
        "eval_000000.png",
        "eval_000002.jsonl",
        "eval_000002.png",
    ]


@pytest.mark.slow
def test_train_flow_resumes_and_refuses_other_sampler_settings(tmp_path):
    train_flow(_trainer(), ROWS, compositional, _loop(tmp_path, 2), SDE, eval_dataset=ROWS[:2])
    logs = tmp_path / "logs"
    # the third step continues from the checkpoint of step 2
    resumed = train_flow(
        _trainer(), ROWS, compositional, _loop(tmp_path, 3), SDE, eval_dataset=ROWS[:2]
    )
    assert resumed.start_step == 2 and len(resumed.history) == 1
    assert "eval_000003.png" in {p.name for p in (logs / "images").iterdir()}
    # other sampler settings are another run
    other = SDEConfig(num_steps=4, noise_level=0.8, window_size=3)
    with pytest.raises(IncompatibleCheckpointError):
        train_flow(_trainer(other), ROWS, compositional, _loop(tmp_path, 4), other)


def test_train_flow_refusals(tmp_path):
    trainer = _trainer(beta=0.0)
    loop = TrainConfig(num_steps=1, prompts_per_step=2, progress=False)
    with pytest.raises(TypeError, match="sde must be an SDEConfig"):
        train_flow(trainer, ROWS, compositional, loop, {"num_steps": 4})
    with pytest.raises(ValueError, match="eval_num_samples must be 1 for a flow model"):
        train_flow(
            trainer,
            ROWS,
            compositional,
            TrainConfig(num_steps=1, eval_num_samples=2),
            SDE,
            eval_dataset=ROWS,
        )
    with pytest.raises(ValueError, match="eval_images_per_prompt must be"):
        train_flow(trainer, ROWS, compositional, loop, SDE, eval_images_per_prompt=0)
    with pytest.raises(ValueError, match="dataset row 0 has no prompt column 'prompt'"):
        train_flow(trainer, [{"text": "a red square"}], compositional, loop, SDE)
    # a trainer whose log-prob hook was built for other settings is refused when traced
    with pytest.raises(ValueError, match="sampled with num_steps=6"):
        train_flow(trainer, ROWS, compositional, loop, SDEConfig(num_steps=6))
