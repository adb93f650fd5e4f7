"""Reference sync (TR-DPO, TRL ``sync_ref_model``): the mix against float64 NumPy over several
steps, the KL reading the synced reference, meshes, checkpoint and resume, refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.models.causal_lm import LoRAConfig, apply_lora
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import init_train_state
from artifex.generative_models.training.rl.loop import TrainConfig, train
from artifex.generative_models.training.rl.ref_sync import reference_sync_due, sync_reference
from artifex.generative_models.training.rl.rollout import RolloutConfig
from artifex.generative_models.training.sharding import make_mesh

SYNC = dict(sync_ref_model=True, ref_model_mixup_alpha=0.3, ref_model_sync_steps=2)


def _f64(tree):
    return {jax.tree_util.keystr(p): np.asarray(x, np.float64)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}  # fmt: skip


@pytest.mark.parametrize("alpha", [0.0, 0.37, 1.0])
def test_sync_reference_matches_numpy(alpha):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    reference = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
    state = init_train_state(
        model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), reference_model=reference
    )
    new = sync_reference(state, alpha)
    pol, ref = _f64(state.params), _f64(state.reference)
    for path, got in _f64(new.reference).items():
        np.testing.assert_allclose(got, alpha * pol[path] + (1 - alpha) * ref[path], rtol=1e-6)
    # Only the reference changes.
    assert new.params is state.params and new.opt_state is state.opt_state


def test_sync_keeps_dtypes_and_leaves_integers_alone():
    params = {"w": jnp.asarray([1.0, 2.0], jnp.float32)}
    frozen = {"b": jnp.asarray([4.0], jnp.bfloat16), "count": jnp.asarray([7], jnp.int32)}
    reference = {"w": jnp.zeros(2), "b": jnp.zeros(1, jnp.bfloat16), "count": jnp.asarray([1])}
    model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    state = init_train_state(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    state = state.replace(params=params, frozen=frozen, reference=reference)
    new = sync_reference(state, 0.5).reference
    assert new["b"].dtype == jnp.bfloat16 and float(new["b"][0]) == 2.0
    assert new["count"].tolist() == [1]  # not mixed
    np.testing.assert_array_equal(new["w"], [0.5, 1.0])


def test_sync_reference_errors():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    state = init_train_state(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    with pytest.raises(ValueError, match="no reference"):
        sync_reference(state, 0.5)
    other = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kernel"):
        sync_reference(state.replace(reference=nnx.as_pure(nnx.state(other))), 0.5)
    with pytest.raises(ValueError, match="ref_model_mixup_alpha"):
        sync_reference(state.replace(reference=state.params), 1.5)


def test_config_refusals():
    with pytest.raises(ValueError, match="needs beta > 0"):
        GRPOConfig(beta=0.0, sync_ref_model=True)
    with pytest.raises(ValueError, match="only used with sync_ref_model=True"):
        GRPOConfig(ref_model_sync_steps=8)
    with pytest.raises(ValueError, match="ref_model_mixup_alpha"):
        GRPOConfig(beta=0.1, sync_ref_model=True, ref_model_mixup_alpha=-0.1)
    with pytest.raises(TypeError, match="ref_model_sync_steps"):
        GRPOConfig(beta=0.1, sync_ref_model=True, ref_model_sync_steps=2.0)
    config = GRPOConfig(beta=0.1, **SYNC)
    assert [reference_sync_due(n, config) for n in range(5)] == [False, False, True, False, True]
    assert not reference_sync_due(2, GRPOConfig())


def test_trainer_refuses_what_it_cannot_sync():
    tok = demo_tokenizer()
    model = demo_model(tok)
    config = GRPOConfig(num_generations=2, beta=0.1, **SYNC)
    with pytest.raises(ValueError, match="needs a reference_model"):
        GRPOTrainer(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), config)
    lora = demo_model(tok)
    apply_lora(lora, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(0))
    with pytest.raises(ValueError, match="LoRA"):
        GRPOTrainer(lora, nnx.Optimizer(lora, optax.sgd(0.1), wrt=nnx.LoRAParam), config)
    small = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="architecture"):
        GRPOTrainer(
            small,
            nnx.Optimizer(small, optax.sgd(0.1), wrt=nnx.Param),
            config,
            reference_model=nnx.Linear(3, 3, rngs=nnx.Rngs(0)),
        )


def _policy_batch(seed):
    rng = np.random.default_rng(seed)
    return {
        "observations": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
        "actions": jnp.asarray(rng.integers(0, 3, 8)),
        "rewards": jnp.asarray(rng.normal(size=8), jnp.float32),
    }


def _numpy_log_probs(params, batch):
    logits = np.asarray(batch["observations"], np.float64) @ params["['kernel']"]
    logits = logits + params["['bias']"]
    top = logits.max(1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
    return logp[np.arange(len(logp)), np.asarray(batch["actions"])]


@pytest.mark.parametrize("mesh", [False, True], ids=["one-device", "mesh"])
def test_trainer_syncs_every_n_updates_as_numpy_says(mesh):
    """Five updates, a sync after updates 2 and 4 (alpha 0.3): the reference after each update
    equals the float64 NumPy recursion on the recorded policies, and the KL of update 3 is the
    KL to the synced reference."""
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    reference = nnx.Linear(4, 3, rngs=nnx.Rngs(1))
    config = GRPOConfig(num_generations=4, beta=0.5, entropy_coeff=0.0, **SYNC)
    kwargs = {"mesh": make_mesh(data=2, devices=jax.devices()[:2])} if mesh else {}
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param),
        config,
        reference_model=reference,
        **kwargs,
    )
    shardings = [x.sharding for x in jax.tree.leaves(trainer.state.reference)]
    expected = _f64(nnx.as_pure(nnx.state(reference, nnx.Param)))
    for step in range(1, 6):
        before = _f64(nnx.as_pure(nnx.state(model, nnx.Param)))
        batch = _policy_batch(step)
        metrics = trainer.train_step(batch, num_microbatches=2)
        # The KL of this update is to the reference as it was before it (float64 k3 mean).
        log_r = _numpy_log_probs(expected, batch) - _numpy_log_probs(before, batch)
        np.testing.assert_allclose(metrics["kl"], np.mean(np.exp(log_r) - log_r - 1), rtol=1e-4)
        after = _f64(nnx.as_pure(nnx.state(model, nnx.Param)))
        if step % 2 == 0:
            expected = {k: 0.3 * after[k] + 0.7 * expected[k] for k in expected}
        got = _f64(nnx.as_pure(nnx.state(reference, nnx.Param)))
        for k in expected:
            np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=1e-7)
        state_ref = _f64(trainer.state.reference)
        for k in expected:
            np.testing.assert_array_equal(state_ref[k], got[k])
    assert [x.sharding for x in jax.tree.leaves(trainer.state.reference)] == shardings
    assert trainer.num_compilations == 1  # the synced reference reuses the compiled step


TRAIN = addition_dataset(seed=0, num_eval=4)[0][:32]
LOOP = dict(prompts_per_step=2, num_iterations=2, num_minibatches=1, progress=False, seed=3)


def _loop_trainer():
    tok = demo_tokenizer()
    model, ref = demo_model(tok, seed=0), demo_model(tok, seed=100)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    config = GRPOConfig(num_generations=4, beta=0.05, sync_ref_model=True,
                        ref_model_mixup_alpha=0.5, ref_model_sync_steps=3)  # fmt: skip
    return GRPOTrainer(model, opt, config, reference_model=ref), tok


def test_the_loop_syncs_and_a_resumed_run_has_the_same_reference(tmp_path):
    """Two updates per step, a sync every 3 updates: syncs after updates 3 and 6, one before
    the checkpoint at step 2 (update 4) and one after. The resumed run restores the synced
    reference and ends where the uninterrupted one does, bit for bit."""
    def reward(prompts, completions, **columns):
        return [float(sum(ch.isdigit() for ch in c)) for c in completions]

    rollout = RolloutConfig(max_new_tokens=4)
    full, tok = _loop_trainer()
    start = [np.asarray(x) for x in jax.tree.leaves(nnx.state(full.reference_model))]
    train(full, tok, TRAIN, [reward], TrainConfig(num_steps=3, **LOOP), rollout)
    ckpt = str(tmp_path / "ckpt")
    first, tok = _loop_trainer()
    train(first, tok, TRAIN, [reward], TrainConfig(num_steps=2, checkpoint_dir=ckpt, **LOOP),
          rollout)  # fmt: skip
    resumed, tok = _loop_trainer()
    result = train(resumed, tok, TRAIN, [reward],
                   TrainConfig(num_steps=3, checkpoint_dir=ckpt, **LOOP), rollout)  # fmt: skip
    assert result.start_step == 2
    for a, b, _ in zip(
        jax.tree.leaves(nnx.state(full.reference_model)),
        jax.tree.leaves(nnx.state(resumed.reference_model)),
        start,
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(
        not np.array_equal(np.asarray(a), s)
        for a, s in zip(jax.tree.leaves(nnx.state(full.reference_model)), start, strict=True)
    )
    for a, b in zip(
        jax.tree.leaves(nnx.state(full.model)), jax.tree.leaves(nnx.state(resumed.model)),
        strict=True,
    ):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
