"""Mistral specifics: Llama plus a sliding window, config.json in its Hub forms, the layer-by-layer
update with windowed inputs.

The shared paths (forward, KV cache, sampler, GRPO, LoRA, checkpoints) are in test_families.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig, from_pretrained
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch

from ._helpers import FIXTURES, load_expected

NAME = "mistral_tiny"

#: mistralai/Mistral-7B-v0.1's config.json.
HUB_7B = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}


@nnx.jit
def _fwd(m, ids, mask):
    return m(ids, mask)


def test_without_a_window_it_is_llama():
    mistral = from_pretrained(FIXTURES / NAME)
    e = load_expected(NAME)
    ids, mask = jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"])
    state = nnx.state(mistral)
    full = CausalLM(mistral.config.replace(sliding_window=None), rngs=nnx.Rngs(0))
    llama = CausalLM(
        mistral.config.replace(model_type="llama", sliding_window=None), rngs=nnx.Rngs(0)
    )
    nnx.update(full, state)
    nnx.update(llama, state)
    assert full.config.sliding_layers == (False, False)
    np.testing.assert_array_equal(
        np.asarray(_fwd(full, ids, mask)), np.asarray(_fwd(llama, ids, mask))
    )
    windowed = np.asarray(_fwd(mistral, ids, mask))
    assert np.abs(windowed[0, -1] - np.asarray(_fwd(llama, ids, mask))[0, -1]).max() > 0.1


def test_config_from_the_hub_forms():
    config = CausalLMConfig.from_hf_config(HUB_7B)
    assert config.model_type == "mistral" and config.sliding_window == 4096
    assert config.sliding_layers == (True,) * 32 and not config.attention_bias
    assert config.attention_scale == 128**-0.5 and config.param_dtype == "bfloat16"
    # transformers' MistralForCausalLM of this config has 7,241,732,096 parameters
    assert config.num_params() == 7_241_732_096
    assert CausalLMConfig.from_hf_config(config.to_hf_config()) == config
    assert config.to_hf_config()["architectures"] == ["MistralForCausalLM"]
    # v0.2 / v0.3 have no window; transformers 5 writes rope_parameters
    v3 = {**HUB_7B, "sliding_window": None, "vocab_size": 32768}
    v3.pop("rope_theta")
    v3["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    config = CausalLMConfig.from_hf_config(v3)
    assert config.sliding_window is None and config.sliding_layers == (False,) * 32
    assert config.rope_theta == 1e6
    assert CausalLMConfig.from_hf_config({**HUB_7B, "attention_bias": True}).attention_bias is False


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": "4"}, "sliding_window"),
        ({"layer_types": ("full_attention",) * 2}, "layer_types"),
        ({"rope_local_theta": 1e4}, "rope_local_theta"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"model_type": "llama"}, "sliding_window"),
        ({"model_type": "qwen3", "qk_norm": True}, "sliding_window"),
    ],
)
def test_config_validation(changes, match):
    config = from_pretrained(FIXTURES / NAME).config
    with pytest.raises(ValueError, match=match):
        config.replace(**changes)


def test_qwen_configs_with_an_unused_window_still_load():
    """Qwen2.5 configs carry sliding_window with use_sliding_window false: no window."""
    d = {
        "model_type": "qwen2",
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "sliding_window": 131072,
        "use_sliding_window": False,
    }
    config = CausalLMConfig.from_hf_config(d)
    assert config.sliding_window is None and config.sliding_layers == (False, False)


def test_layerwise_update_uses_the_window():
    """The layer-by-layer update (every layer given the windowed inputs) equals the one program."""
    e = load_expected(NAME)
    g = 2
    rng = np.random.default_rng(0)
    prompts = np.repeat(e["input_ids"][:2], g, 0)
    batch = GRPOBatch(
        prompt_ids=jnp.asarray(prompts),
        prompt_mask=jnp.asarray(np.repeat(e["attention_mask"][:2], g, 0)),
        completion_ids=jnp.asarray(rng.integers(3, 128, size=(4, 6)), jnp.int32),
        completion_mask=jnp.ones((4, 6), jnp.int32),
        rewards=jnp.asarray([1.0, 0.0, 0.5, -1.0]),
        group_size=g,
    )
    results = []
    for layerwise in (False, True):
        model = from_pretrained(FIXTURES / NAME)
        trainer = GRPOTrainer(
            model,
            nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
            GRPOConfig(beta=0.0, layerwise_update=layerwise, remat=layerwise),
        )
        metrics = trainer.train_step(batch)
        results.append((metrics["policy_loss"], nnx.state(model, nnx.Param)))
    (loss0, p0), (loss1, p1) = results
    assert loss0 == pytest.approx(loss1, abs=1e-5)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    ids, *_ = from_pretrained(FIXTURES / NAME).layer_inputs(
        batch.prompt_ids[::g], batch.completion_ids, batch.prompt_mask[::g], group=g
    )
    assert ids.shape == (2, 12 + g * 6)
