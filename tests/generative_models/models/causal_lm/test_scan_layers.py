"""Scanned decoder layers (`CausalLM.scan_layers`) against the unrolled layers.

The scan runs the same layer computation over the stacked layer weights, so every output must
equal the unrolled model's to float32 rounding: logits, cached prefill and decode, sampled tokens,
gradients with and without rematerialization, and a whole GRPO step. Models whose layers differ
in structure fall back to the unrolled loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.inference import generate
from artifex.generative_models.models.causal_lm import (
    CausalLM,
    CausalLMConfig,
    LoRAConfig,
    apply_lora,
)
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch

CONFIGS = {
    "llama": CausalLMConfig.tiny(num_layers=3),
    "qwen2_bias_tied": CausalLMConfig.tiny(
        model_type="qwen2", num_layers=3, attention_bias=True, tie_word_embeddings=True
    ),
    "qwen3_qk_norm": CausalLMConfig.tiny(model_type="qwen3", num_layers=3, qk_norm=True),
}


def _model(name: str, scan: bool, seed: int = 0) -> CausalLM:
    return CausalLM(CONFIGS[name], rngs=nnx.Rngs(seed), scan_layers=scan)


def _ids(b: int = 2, t: int = 7, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(1, 512, (b, t)), jnp.int32)
    mask = np.ones((b, t), np.int32)
    mask[0, :2] = 0  # left padding on one row
    return ids, jnp.asarray(mask)


def test_default_is_unrolled_and_flag_is_checked():
    model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
    assert model.scan_layers is False
    with pytest.raises(TypeError, match="scan_layers must be a bool, got str"):
        CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0), scan_layers="yes")


def test_layer_stack_shapes_and_values():
    model = _model("llama", scan=True)
    stack = model.layer_stack()
    kernel = stack.state["attn"]["q_proj"]["kernel"]
    assert kernel.shape == (3, 128, 128)
    for i, layer in enumerate(model.layers):
        np.testing.assert_array_equal(kernel[i], layer.attn.q_proj.kernel[...])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_equal_unrolled(name):
    ids, mask = _ids()
    scanned = _model(name, scan=True)(ids, mask)
    unrolled = _model(name, scan=False)(ids, mask)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_prefill_and_decode_equal_unrolled(name):
    ids, mask = _ids(t=6)
    outs = {}
    for scan in (True, False):
        model = _model(name, scan=scan)
        cache = model.init_cache(2, 10)
        h1, cache = model.hidden_states(ids[:, :4], mask[:, :4], cache=cache)
        h2, cache = model.hidden_states(ids[:, 4:5], mask[:, 4:5], cache=cache)  # decode
        h3, cache = model.hidden_states(ids[:, 5:], mask[:, 5:], cache=cache)
        outs[scan] = (h1, h2, h3, cache.keys, cache.values, cache.valid, cache.index)
    for a, b in zip(outs[True], outs[False], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_generate_draws_the_same_tokens():
    ids, mask = _ids(t=5)
    outs = []
    for scan in (True, False):
        out = generate(
            _model("qwen2_bias_tied", scan=scan),
            ids,
            mask,
            key=jax.random.key(3),
            num_generations=3,
            max_new_tokens=6,
            eos_ids=(),
        )
        outs.append(out)
    np.testing.assert_array_equal(outs[0].completion_ids, outs[1].completion_ids)
    np.testing.assert_allclose(outs[0].log_probs, outs[1].log_probs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("with_cache", [False, True])
def test_gradients_equal_unrolled(remat, with_cache):
    ids, mask = _ids()

    def loss(model):
        if with_cache:  # prompt through a cache, then the rest attending to it
            cache = model.init_cache(2, 7)
            _, cache = model.hidden_states(ids[:, :3], mask[:, :3], cache=cache, remat=remat)
            h, _ = model.hidden_states(ids[:, 3:], mask[:, 3:], cache=cache, remat=remat)
        else:
            h, _ = model.hidden_states(ids, mask, remat=remat)
        return jnp.mean(model.logits_from_hidden(h) ** 2)

    grads = {}
    for scan in (True, False):
        # jitted: one program per model (run eagerly, every piece of the backward pass compiles)
        g = jax.jit(nnx.grad(loss))(_model("qwen3_qk_norm", scan=scan))
        grads[scan] = jax.tree.leaves(nnx.state(g))
    assert len(grads[True]) == len(grads[False])
    for a, b in zip(grads[True], grads[False], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_lora_layers_stack_and_match():
    ids, mask = _ids()
    logits = {}
    for scan in (True, False):
        model = _model("llama", scan=scan)
        apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(5))
        for layer in model.layers:  # nonzero adapters, so they change the output
            layer.attn.q_proj.lora.lora_b[...] = jnp.full_like(
                layer.attn.q_proj.lora.lora_b[...], 0.01
            )
        if scan:
            assert "lora" in model.layer_stack().state["attn"]["q_proj"]
        logits[scan] = model(ids, mask)
    np.testing.assert_allclose(logits[True], logits[False], rtol=1e-5, atol=1e-5)


def test_layers_of_different_structure_run_unrolled():
    ids, mask = _ids()
    model = _model("llama", scan=True)
    expected = _model("llama", scan=False)
    # LoRA on the first layer's q_proj only: nothing to stack, the layers run unrolled.
    for m in (model, expected):
        apply_lora(m, LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",)), nnx.Rngs(5))
        m.layers[1].attn.q_proj.lora = None
        m.layers[2].attn.q_proj.lora = None
        lora_b = m.layers[0].attn.q_proj.lora.lora_b
        lora_b[...] = jnp.full_like(lora_b[...], 0.01)
    assert model.layer_stack() is None
    np.testing.assert_allclose(model(ids, mask), expected(ids, mask), rtol=1e-6, atol=1e-6)


def test_grpo_step_equals_unrolled():
    ids, mask = _ids(b=2, t=5)
    results = []
    for scan in (True, False):
        policy = _model("llama", scan=scan)
        reference = _model("llama", scan=scan)
        # SGD: the parameters move by the gradient itself. (AdamW's first step is about
        # lr * sign(g), which turns float32 rounding in a gradient of ~1e-8 into a full step.)
        optimizer = nnx.Optimizer(policy, optax.sgd(0.1), wrt=nnx.Param)
        trainer = GRPOTrainer(
            policy, optimizer, GRPOConfig(num_generations=2, beta=0.04), reference_model=reference
        )
        rows_ids = jnp.repeat(ids, 2, axis=0)
        rows_mask = jnp.repeat(mask, 2, axis=0)
        completion = jnp.asarray(np.random.default_rng(4).integers(1, 512, (4, 6)), jnp.int32)
        batch = GRPOBatch(
            prompt_ids=rows_ids,
            prompt_mask=rows_mask,
            completion_ids=completion,
            completion_mask=jnp.ones((4, 6), jnp.int32),
            rewards=jnp.array([1.0, 0.0, 0.5, 0.25]),
            group_size=2,
        )
        metrics = trainer.train_step(batch)
        results.append((metrics, jax.tree.leaves(nnx.state(policy, nnx.Param))))
    for key in ("total_loss", "kl", "grad_norm"):
        np.testing.assert_allclose(results[0][0][key], results[1][0][key], rtol=1e-5, atol=1e-7)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("stacked", [False, True])
def test_cache_forms_give_the_same_values_with_either_kind_of_layers(scan, stacked):
    """Stacked and per-layer caches, scanned and unrolled layers: prefill then one token."""
    model = CausalLM(CausalLMConfig.tiny(num_layers=3), rngs=nnx.Rngs(0))
    ids = jnp.array([[1, 2, 3], [4, 5, 6]])
    model.scan_layers = False
    ref_cache = model.init_cache(2, 8)
    _, ref_cache = model.hidden_states(ids, cache=ref_cache)
    ref, ref_cache = model.hidden_states(jnp.array([[7], [8]]), cache=ref_cache)
    model.scan_layers = scan
    cache = model.init_cache(2, 8, stacked=stacked)
    assert cache.stacked == stacked
    _, cache = model.hidden_states(ids, cache=cache)
    got, cache = model.hidden_states(jnp.array([[7], [8]]), cache=cache)
    assert cache.stacked == stacked  # the form is kept
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6)
    keys = cache.keys if stacked else jnp.stack(cache.keys)
    np.testing.assert_allclose(np.asarray(keys), np.asarray(jnp.stack(ref_cache.keys)), atol=2e-6)
    assert model.init_cache(1, 4).stacked == scan  # the default follows model.scan_layers
