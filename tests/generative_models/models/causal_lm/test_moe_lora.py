"""LoRA on the Qwen3-MoE fixture: attention adapters train, merge, save and load; a dense model's
feed-forward adapter is refused by name on loading (the experts' adapters: test_lora_experts.py,
test_peft_experts.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.inference.sampling import generate
from artifex.generative_models.models.causal_lm import (
    LoRAConfig,
    apply_lora,
    from_pretrained,
    merge_lora,
)
from artifex.generative_models.models.causal_lm.peft_io import (
    load_peft_adapter,
    save_peft_adapter,
)
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch

from ._helpers import FIXTURES, load_expected

NAME = "qwen3_moe_tiny"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _inputs():
    e = load_expected(NAME)
    return jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"])


def test_attention_adapters_train_merge_save_and_load(tmp_path):
    ids, mask = _inputs()
    base = from_pretrained(FIXTURES / NAME)
    plain = np.asarray(base(ids, mask))
    model = from_pretrained(FIXTURES / NAME)
    config = LoRAConfig(rank=2, alpha=4.0, target_modules=ATTENTION)
    apply_lora(model, config, nnx.Rngs(1))
    np.testing.assert_array_equal(np.asarray(model(ids, mask)), plain)  # B = 0
    experts = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model.layers[0].mlp)))

    out = generate(
        base, ids[:2], mask[:2], key=jax.random.key(0), num_generations=2, max_new_tokens=4,
        eos_ids=(),
    )  # fmt: skip
    batch = GRPOBatch(
        prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask,
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        rewards=jnp.array([1.0, 0.0, 0.5, 0.0]),
        group_size=2,
    )
    optimizer = nnx.Optimizer(model, optax.adam(5e-2), wrt=nnx.LoRAParam)
    trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2, beta=0.1))
    assert trainer.has_reference  # the model with its adapters zeroed
    for _ in range(2):
        metrics = trainer.train_step(batch)
    assert np.isfinite(metrics["policy_loss"]) and metrics["kl"] > 0.0
    adapted = np.asarray(model(ids, mask))
    assert np.abs(adapted - plain).max() > 1e-4
    # only the adapters moved: the router and the experts are the fixture's
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model.layers[0].mlp)))
    jax.tree.map(np.testing.assert_array_equal, after, experts)

    save_peft_adapter(model, tmp_path / "adapter", config=config)
    loaded = load_peft_adapter(from_pretrained(FIXTURES / NAME), tmp_path / "adapter")
    np.testing.assert_array_equal(np.asarray(loaded(ids, mask)), adapted)

    merged = merge_lora(model)
    np.testing.assert_allclose(np.asarray(merged(ids, mask)), adapted, atol=1e-5, rtol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    again = from_pretrained(tmp_path / "merged")
    np.testing.assert_array_equal(np.asarray(again(ids, mask)), np.asarray(merged(ids, mask)))


def test_an_adapter_of_feed_forward_projections_is_refused_on_loading(tmp_path):
    """A dense model's adapter with MLP targets, loaded into the MoE model: a clear error."""
    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig

    moe = from_pretrained(FIXTURES / NAME)
    c = moe.config
    dense = CausalLM(
        CausalLMConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=16,
            num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
        ),
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    config = LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj", "up_proj"))
    save_peft_adapter(apply_lora(dense, config, nnx.Rngs(1)), tmp_path, config=config)
    with pytest.raises(ValueError, match=r"\['up_proj'\] are expert projections.*of Linear"):
        load_peft_adapter(moe, tmp_path)
    assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(moe))
