"""`CausalLM.shared_prefix_hidden_states`: prompts and their completions in one pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.models.causal_lm.modules import SharedPrefixMask
from tests.generative_models.models.causal_lm._helpers import FIXTURES


def grouped(b=3, p=6, g=4, t=5, seed=0):
    """Left-padded prompts of lengths 6, 2, 4 and ``g`` completions of each."""
    rng = np.random.default_rng(seed)
    lengths = np.array([p, 2, 4])[:b]
    mask = (np.arange(p)[None] >= (p - lengths)[:, None]).astype(np.int32)
    prompts = (rng.integers(4, 64, (b, p)) * mask).astype(np.int32)
    completions = rng.integers(4, 64, (b * g, t)).astype(np.int32)
    return prompts, mask, completions


def per_row(model, prompts, mask, completions):
    """Each completion after its own copy of the prompt, through `hidden_states`."""
    g = len(completions) // len(prompts)
    ids = np.concatenate([np.repeat(prompts, g, 0), completions], 1)
    full_mask = np.concatenate([np.repeat(mask, g, 0), np.ones_like(completions)], 1)
    hidden, _ = model.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(full_mask))
    return np.asarray(hidden)


@pytest.mark.parametrize("name", ["llama3_tiny", "qwen2_tiny", "qwen3_tiny"])
def test_one_pass_equals_each_completion_after_its_prompt(name):
    # Llama 3 (GQA, RoPE scaling), Qwen2 (q/k/v biases), Qwen3 (q/k norms): real HF layouts.
    model = CausalLM.from_pretrained(FIXTURES / name, dtype="float32")
    prompts, mask, completions = grouped()
    hp, hc = model.shared_prefix_hidden_states(
        jnp.asarray(prompts), jnp.asarray(completions), prompt_mask=jnp.asarray(mask)
    )
    want = per_row(model, prompts, mask, completions)
    p, g = prompts.shape[1], 4
    assert hp.shape == (3, p, want.shape[-1]) and hc.shape == (12, 5, want.shape[-1])
    np.testing.assert_allclose(np.asarray(hc), want[:, p:], atol=2e-5, rtol=1e-5)
    # the prompt's real tokens (padding rows attend to nothing real; their values are unused)
    real = np.repeat(mask, g, 0) == 1
    np.testing.assert_allclose(np.repeat(np.asarray(hp), g, 0)[real], want[:, :p][real], atol=2e-5)


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_and_rematerialized_layers_give_the_same_values_and_gradients(remat):
    config = CausalLMConfig.tiny(vocab_size=64, num_layers=3, max_position_embeddings=64)
    model = CausalLM(config, rngs=nnx.Rngs(0))
    prompts, mask, completions = (jnp.asarray(x) for x in grouped(g=2))
    graphdef, state = nnx.split(model)

    def loss(state, scan):
        m = nnx.merge(graphdef, state)
        stack = m.layer_stack() if scan else None
        hp, hc = m.shared_prefix_hidden_states(
            prompts, completions, prompt_mask=mask, remat=remat, layer_stack=stack
        )
        weights = jnp.arange(hc.size, dtype=jnp.float32).reshape(hc.shape) / hc.size
        return jnp.sum(hc * weights) + jnp.sum(hp[:, -1] ** 2)

    unrolled = jax.value_and_grad(loss)(state, False)
    scanned = jax.value_and_grad(loss)(state, True)
    np.testing.assert_allclose(scanned[0], unrolled[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(scanned[1]), jax.tree.leaves(unrolled[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_bad_shapes_are_refused_by_name():
    model = CausalLM(CausalLMConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    prompts, mask, completions = (jnp.asarray(x) for x in grouped())
    with pytest.raises(ValueError, match="multiple of the prompts"):
        model.shared_prefix_hidden_states(prompts, completions[:-1])
    with pytest.raises(ValueError, match=r"must be \(B, P\) and \(B \* G, T\)"):
        model.shared_prefix_hidden_states(prompts[0], completions)
    with pytest.raises(ValueError, match="P >= 1"):
        model.shared_prefix_hidden_states(prompts[:, :0], completions)
    with pytest.raises(ValueError, match=r"prompt_mask must have shape \(3, 6\)"):
        model.shared_prefix_hidden_states(prompts, completions, prompt_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="T >= 1 completion columns"):
        model.shared_prefix_hidden_states(prompts, completions[:, :0])
    with pytest.raises(ValueError, match="positive multiple"):
        model.shared_prefix_hidden_states(prompts, completions[:0])
    with pytest.raises(ValueError, match="completion_ids must hold integer token ids"):
        model.shared_prefix_hidden_states(prompts, completions + 0.5)
    with pytest.raises(ValueError, match="prompt_ids must hold integer token ids"):
        model.shared_prefix_hidden_states(prompts.astype(jnp.float32), completions)


def test_a_prompt_without_real_tokens_does_not_read_its_completions():
    # The last position of an all-padding prompt attends to nothing real: here it mixes the
    # prompt's (padding) keys only, so the first completion token's log-prob cannot depend on
    # the completion's later tokens (per-row encoding mixes those in).
    from artifex.generative_models.training.rl import causal_lm_log_probs

    model = CausalLM(CausalLMConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    prompts = jnp.array([[5, 6, 7], [0, 0, 0]]).repeat(2, 0)
    mask = jnp.array([[1, 1, 1], [0, 0, 0]]).repeat(2, 0)
    completions = jnp.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    first = causal_lm_log_probs(
        model, prompts, completions, prompt_mask=mask, shared_prompt_group=2
    )
    changed = completions.at[2, 2].set(30)
    second = causal_lm_log_probs(model, prompts, changed, prompt_mask=mask, shared_prompt_group=2)
    assert first[0][2, 0] == second[0][2, 0]
    assert np.all(np.isfinite(np.asarray(first[0])))


def test_a_shared_prefix_mask_refuses_a_kv_cache():
    model = CausalLM(CausalLMConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    attn = model.layers[0].attn
    cache = model.init_cache(1, 4)
    x = jnp.ones((1, 3, model.config.hidden_size))
    cos = sin = jnp.ones((1, 3, model.config.head_dim // 2))
    valid = jnp.ones((1, 1), bool)
    mask = SharedPrefixMask(valid[:, None], valid, group_size=2, prompt_length=1)
    with pytest.raises(ValueError, match="without a KV cache"):
        attn(x, cos, sin, mask, (cache.keys[0], cache.values[0]), cache.index)
    # rows of 4 tokens cannot hold a 1-token prompt and 2 completions of equal length
    x4, cos4 = jnp.ones((1, 4, model.config.hidden_size)), jnp.ones((1, 4, cos.shape[-1]))
    with pytest.raises(ValueError, match=r"group_size=2\) needs rows .* got rows of 4 tokens"):
        attn(x4, cos4, cos4, mask)
