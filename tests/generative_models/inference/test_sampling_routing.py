"""The sampler records the routed experts of mixture-of-experts models (Qwen3-MoE).

`generate(..., record_routing=True)` returns, per row, the experts every layer computed each
prompt and completion token by (-1 where a token did not go through the model as a real token),
for routing replay in the update (tests/generative_models/training/rl/test_routing_replay.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.inference.sampling import generate
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig, from_pretrained

from ..models.causal_lm._helpers import FIXTURES, load_expected

NAME = "qwen3_moe_tiny"
G, N = 4, 8


@pytest.fixture(scope="module")
def policy():
    return from_pretrained(FIXTURES / NAME)


def _rollout(model):
    e = load_expected(NAME)
    return generate(
        model,
        e["input_ids"][:2],
        e["attention_mask"][:2],
        key=jax.random.key(0),
        num_generations=G,
        max_new_tokens=N,
        eos_ids=(),
        record_routing=True,
    )


def test_the_sampler_records_every_tokens_routed_experts(policy):
    out = _rollout(policy)
    p = out.prompt_ids.shape[1]
    cfg = policy.config
    assert out.routed_experts.shape == (2 * G, p + N, cfg.num_layers, cfg.num_experts_per_tok)
    routed = np.asarray(out.routed_experts)
    recorded = routed[..., 0] >= 0  # (B, P + T, L)
    prompt_real = np.asarray(out.prompt_mask).astype(bool)
    np.testing.assert_array_equal(recorded[:, :p], np.repeat(prompt_real[:, :, None], 2, -1))
    assert recorded[:, p : p + N - 1].all() and not recorded[:, p + N - 1].any()  # last: not fed
    # the routers of one teacher-forced pass over prompt and completion choose the same experts
    ids = jnp.concatenate([out.prompt_ids, out.completion_ids], 1)
    mask = jnp.concatenate([out.prompt_mask, out.completion_mask], 1)
    _, _, trace = nnx.jit(lambda m, i, k: m.hidden_states(i, k, routing=True))(policy, ids, mask)
    own = np.moveaxis(np.asarray(trace.experts), 0, 2)
    np.testing.assert_array_equal(np.sort(own, -1)[recorded], np.sort(routed, -1)[recorded])
    # with a prefill per row the same experts are recorded
    again = generate(
        policy, out.prompt_ids[::G], out.prompt_mask[::G], key=jax.random.key(0),
        num_generations=G, max_new_tokens=N, eos_ids=(), record_routing=True,
        share_prefill=False, prompt_buckets=None,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(again.routed_experts), routed)


def test_after_eos_nothing_is_recorded(policy):
    e = load_expected(NAME)
    greedy = [int(x) for x in e["generate_ids"][2]]  # transformers' greedy tokens of row 2
    j = 2  # the third token ends the completion
    out = generate(
        policy, e["input_ids"][2:], e["attention_mask"][2:], key=jax.random.key(0),
        max_new_tokens=6, temperature=0.0, eos_ids=(greedy[j],), record_routing=True,
    )  # fmt: skip
    p = out.prompt_ids.shape[1]
    assert int(out.lengths[0]) == j + 1  # the EOS is token j
    recorded = np.asarray(out.routed_experts)[0, p:, 0, 0] >= 0
    # tokens 0 .. j - 1 went through the model as real tokens; the EOS and the padding did not
    np.testing.assert_array_equal(recorded, np.arange(6) < j)


def test_record_routing_refusals():
    dense = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="record_routing: only mixture-of-experts models"):
        generate(dense, np.array([[1, 2]]), key=jax.random.key(0), record_routing=True)
    with pytest.raises(TypeError, match="record_routing must be a bool"):
        generate(dense, np.array([[1, 2]]), key=jax.random.key(0), record_routing=1)
