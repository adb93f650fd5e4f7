"""Rollout and training on separate meshes (4 + 4 of the 8 simulated CPU devices)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.placement import RolloutPlacement
from artifex.generative_models.training.rl.loop import TrainConfig, train
from artifex.generative_models.training.rl.rewards import RewardCombiner
from artifex.generative_models.training.rl.rollout import RolloutConfig, rollout
from artifex.generative_models.training.sharding import make_mesh

TRAIN, EVAL = addition_dataset(seed=0, num_eval=4)
ROLLOUT = RolloutConfig(max_new_tokens=4)


def digit_reward(prompts, completions, **columns):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def meshes():
    devices = jax.devices()
    assert len(devices) == 8
    train_mesh = make_mesh(data=2, fsdp=2, devices=devices[:4])
    sample_mesh = make_mesh(data=2, tensor=2, devices=devices[4:])
    return train_mesh, sample_mesh


def make_trainer(mesh):
    tok = demo_tokenizer()
    model = demo_model(tok, seed=0)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return GRPOTrainer(model, opt, GRPOConfig(num_generations=4, beta=0.0), mesh=mesh), tok


def devices_of(tree) -> set:
    return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def test_sampler_model_is_a_resharded_copy_on_the_sampler_mesh():
    train_mesh, sample_mesh = meshes()
    trainer, _ = make_trainer(train_mesh)
    placement = RolloutPlacement(sample_mesh)
    copy = placement.sampler_model(trainer.model)
    assert devices_of(nnx.state(copy)) == set(sample_mesh.devices.flat)
    assert devices_of(nnx.state(trainer.model)) == set(train_mesh.devices.flat)
    # Tensor-parallel on the sampler mesh, FSDP on the training mesh: different layouts.
    q_train = trainer.model.layers[0].attn.q_proj.kernel.get_value()
    q_copy = copy.layers[0].attn.q_proj.kernel.get_value()
    assert q_copy.sharding.spec != q_train.sharding.spec
    for a, b in zip(
        jax.tree.leaves(nnx.state(trainer.model)), jax.tree.leaves(nnx.state(copy)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The sync sees updates: change the trainer's weights, take a new copy.
    kernel = trainer.model.layers[0].attn.q_proj.kernel
    kernel.set_value(kernel.get_value() + 1.0)
    fresh = placement.sampler_model(trainer.model)
    np.testing.assert_array_equal(
        np.asarray(fresh.layers[0].attn.q_proj.kernel.get_value()), np.asarray(q_copy) + 1.0
    )


def test_placed_rollout_equals_the_colocated_one_and_lands_on_the_training_mesh():
    train_mesh, sample_mesh = meshes()
    trainer, tok = make_trainer(train_mesh)
    rewards = RewardCombiner([digit_reward])
    key = jax.random.key(5)
    together = rollout(trainer, tok, TRAIN[:4], rewards, ROLLOUT, key=key)
    apart = rollout(
        trainer, tok, TRAIN[:4], rewards, ROLLOUT, key=key, placement=RolloutPlacement(sample_mesh)
    )
    assert apart.completions == together.completions
    np.testing.assert_array_equal(
        np.asarray(apart.batch.completion_ids), np.asarray(together.batch.completion_ids)
    )
    np.testing.assert_array_equal(
        np.asarray(apart.batch.rewards), np.asarray(together.batch.rewards)
    )
    assert devices_of(apart.batch) == set(train_mesh.devices.flat)


def test_placement_without_a_training_mesh_is_an_error():
    _, sample_mesh = meshes()
    tok = demo_tokenizer()
    model = demo_model(tok, seed=0)
    trainer = GRPOTrainer(
        model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), GRPOConfig(num_generations=4)
    )
    with pytest.raises(ValueError, match="mesh"):
        rollout(
            trainer,
            tok,
            TRAIN[:2],
            RewardCombiner([digit_reward]),
            ROLLOUT,
            key=jax.random.key(0),
            placement=RolloutPlacement(sample_mesh),
        )
    with pytest.raises(TypeError, match="Mesh"):
        RolloutPlacement("not a mesh")


@pytest.mark.slow
def test_loop_with_roles_apart_matches_the_colocated_loop():
    train_mesh, sample_mesh = meshes()
    cfg = TrainConfig(num_steps=2, prompts_per_step=4, num_iterations=2, progress=False, seed=1)
    together, tok = make_trainer(train_mesh)
    r1 = train(together, tok, TRAIN[:32], [digit_reward], cfg, ROLLOUT, eval_dataset=EVAL)
    apart, tok = make_trainer(train_mesh)
    r2 = train(
        apart,
        tok,
        TRAIN[:32],
        [digit_reward],
        cfg,
        ROLLOUT,
        eval_dataset=EVAL,
        rollout_placement=RolloutPlacement(sample_mesh),
    )
    assert [h["reward_mean"] for h in r1.history] == [h["reward_mean"] for h in r2.history]
    assert r1.evaluations == r2.evaluations
    # Same samples and rewards; the parameters agree to float32 round-off (the sampler's old
    # log-probs come from a tensor-parallel layout, the colocated ones from FSDP).
    worst = 0.0
    for a, b in zip(
        jax.tree.leaves(nnx.state(together.model)),
        jax.tree.leaves(nnx.state(apart.model)),
        strict=True,
    ):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
    print(f"roles apart vs colocated: max relative parameter difference {worst:.2e}")
    assert worst <= 1e-4
    assert devices_of(nnx.state(apart.model)) == set(train_mesh.devices.flat)
