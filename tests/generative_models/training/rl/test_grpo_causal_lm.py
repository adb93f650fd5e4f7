"""GRPOTrainer on the library's causal LM: LoRA (base as reference), bfloat16 parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import (
    CausalLM,
    CausalLMConfig,
    LoRAConfig,
    apply_lora,
    zero_lora_state,
)
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch, causal_lm_log_probs

CFG = CausalLMConfig.tiny(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    head_dim=8,
    max_position_embeddings=64,
)


def batch(seed=0, g=4, n=2, p=5, t=6):
    rng = np.random.default_rng(seed)
    prompts = np.repeat(rng.integers(4, 64, size=(n, p)), g, 0).astype(np.int32)
    comp = rng.integers(4, 64, size=(n * g, t)).astype(np.int32)
    lengths = rng.integers(2, t + 1, size=n * g)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
    return GRPOBatch(
        prompt_ids=jnp.asarray(prompts),
        prompt_mask=jnp.ones_like(prompts),
        completion_ids=jnp.asarray(comp),
        completion_mask=jnp.asarray(mask),
        rewards=jnp.asarray(rng.normal(size=n * g), jnp.float32),
        group_size=g,
    )


def flat(state):
    return {
        jax.tree_util.keystr(p): np.asarray(v)
        for p, v in jax.tree_util.tree_flatten_with_path(state)[0]
    }


def test_lora_trains_only_adapters_with_the_base_as_reference():
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(1))
    base_before = flat(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    lora_before = flat(nnx.state(model, nnx.LoRAParam))
    trainer = GRPOTrainer(
        model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam), GRPOConfig(beta=0.1)
    )
    assert trainer.has_reference  # the LoRA-disabled base, without a second copy of the weights
    b = batch()
    first = trainer.train_step(b)
    assert first["kl"] == 0.0  # adapters start at B = 0: the policy is the base
    second = trainer.train_step(b)
    assert second["kl"] > 0.0
    # Reference log-probs are exactly the base model's.
    ref = trainer.compute_log_probs(b).ref_log_probs
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    base = nnx.merge(graphdef, zero_lora_state(lora), rest)
    want, _ = causal_lm_log_probs(base, b.prompt_ids, b.completion_ids, prompt_mask=b.prompt_mask)
    np.testing.assert_allclose(ref, want, atol=1e-6)
    # Only adapter parameters changed.
    for k, v in flat(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))).items():
        np.testing.assert_array_equal(v, base_before[k], err_msg=k)
    after = flat(nnx.state(model, nnx.LoRAParam))
    assert any(not np.array_equal(after[k], lora_before[k]) for k in after)
    # The pure loss still works after steps (frozen base weights are read at call time).
    loss, metrics = trainer.grpo_loss(trainer.params, b.replace(ref_log_probs=ref))
    np.testing.assert_allclose(float(loss), float(metrics["total_loss"]))
    assert np.isfinite(float(loss)) and float(metrics["kl"]) > 0


def test_bfloat16_model_trains_with_float32_loss_math():
    model16 = CausalLM(CFG, rngs=nnx.Rngs(0), dtype="bfloat16")
    model32 = CausalLM(CFG, rngs=nnx.Rngs(0))
    nnx.update(model32, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(model16)))
    b = batch(1)
    metrics = {}
    for name, model in (("bf16", model16), ("fp32", model32)):
        trainer = GRPOTrainer(
            model, nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param), GRPOConfig(beta=0.0)
        )
        lp, _ = trainer.log_prob_fn(model, trainer.prepare_batch(b))
        assert lp.dtype == jnp.float32
        metrics[name] = trainer.train_step(b)
    assert all(np.isfinite(v) for v in metrics["bf16"].values())
    for key in ("total_loss", "entropy", "grad_norm"):
        np.testing.assert_allclose(
            metrics["bf16"][key], metrics["fp32"][key], rtol=3e-2, atol=3e-2, err_msg=key
        )
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(model16, nnx.Param)))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mu_iterations_move_the_ratio_and_clip(level):
    """With old log-probs fixed, repeated updates on one batch move the ratio off 1 and the
    surrogate starts clipping (the PPO mechanism GRPO keeps)."""
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param),
        GRPOConfig(beta=0.0, clip_param=0.05, importance_sampling_level=level),
    )
    b = trainer.compute_log_probs(batch(2))
    history = [trainer.train_step(b) for _ in range(6)]
    assert history[0]["approx_kl"] < 1e-6 and history[0]["clip_fraction"] == 0.0
    assert history[-1]["approx_kl"] > 1e-4
    assert max(h["clip_fraction"] for h in history) > 0.0
