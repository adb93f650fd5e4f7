"""Qwen3-MoE in CausalLM against transformers and a float64 NumPy reference.

The fixture `qwen3_moe_tiny` (tests/fixtures/make_moe_fixtures.py) is a random
`Qwen3MoeForCausalLM` with 8 experts, top-2 routing and `norm_topk_prob`; it holds
transformers' logits, router logits, routed experts, load-balancing loss and greedy generation
for left-padded rows. The router's k-th and (k+1)-th probabilities are at least 1e-3 apart on
every real token, so both libraries route every token alike.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.inference.sampling import generate
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig, from_pretrained
from artifex.generative_models.models.causal_lm.moe import (
    RouterTrace,
    expert_mlp,
    load_balancing_loss,
    route_tokens,
    routing_agreement,
)
from artifex.generative_models.training.rl import causal_lm_log_probs

from ._family_reference import _rms_norm, _rope, _silu, load_checkpoint
from ._helpers import FIXTURES, load_expected

NAME = "qwen3_moe_tiny"
TOL = 1e-4

#: Qwen/Qwen3-30B-A3B's config.json.
HUB_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@nnx.jit
def _fwd(m, ids, mask):
    return m(ids, mask)


@pytest.fixture(scope="module")
def model():
    return from_pretrained(FIXTURES / NAME)


@pytest.fixture(scope="module")
def expected():
    return load_expected(NAME)


def _real_max_err(got, want, mask):
    real = np.asarray(mask).astype(bool)
    return float(np.abs(np.asarray(got) - want)[real].max())


def reference_logits(config: dict, tensors: dict, ids: np.ndarray, mask: np.ndarray, *, norm_topk):
    """float64 logits and routed experts of a Qwen3-MoE checkpoint, from modeling_qwen3_moe.py."""
    eps = config["rms_norm_eps"]
    b, t = ids.shape
    n, k, h = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    e_num, top = config["num_local_experts"], config["num_experts_per_tok"]
    theta = config["rope_parameters"]["rope_theta"]
    inv_freq = 1.0 / theta ** (np.arange(0, h, 2, dtype=np.float64) / h)
    positions = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    slots = np.arange(t)
    x = tensors["model.embed_tokens.weight"][ids]
    routed = []
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."

        def w(name, pre=pre):
            return tensors[pre + name]

        hn = _rms_norm(x, w("input_layernorm.weight"), eps, False)
        q = _rms_norm((hn @ w("self_attn.q_proj.weight").T).reshape(b, t, n, h),
                      w("self_attn.q_norm.weight"), eps, False)  # fmt: skip
        key = _rms_norm((hn @ w("self_attn.k_proj.weight").T).reshape(b, t, k, h),
                        w("self_attn.k_norm.weight"), eps, False)  # fmt: skip
        value = (hn @ w("self_attn.v_proj.weight").T).reshape(b, t, k, h)
        q, key = _rope(q, positions, inv_freq), _rope(key, positions, inv_freq)
        allowed = (slots[None, :] <= slots[:, None])[None] & mask.astype(bool)[:, None, :]
        out = np.zeros((b, t, n, h))
        for head in range(n):
            kv = head // (n // k)
            scores = np.einsum("btd,bsd->bts", q[:, :, head], key[:, :, kv]) * h**-0.5
            scores = np.where(allowed, scores, -np.inf)
            top_s = np.max(scores, -1, keepdims=True)
            ex = np.where(allowed, np.exp(scores - np.where(np.isfinite(top_s), top_s, 0)), 0)
            probs = ex / np.maximum(ex.sum(-1, keepdims=True), 1e-300)
            out[:, :, head] = np.einsum("bts,bsd->btd", probs, value[:, :, kv])
        x = x + out.reshape(b, t, n * h) @ w("self_attn.o_proj.weight").T
        hn = _rms_norm(x, w("post_attention_layernorm.weight"), eps, False)
        logits = hn @ w("mlp.gate.weight").T  # (B, T, E)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
        chosen = np.argsort(-p, axis=-1, kind="stable")[..., :top]
        routed.append(chosen)
        weights = np.take_along_axis(p, chosen, -1)
        if norm_topk:
            weights = weights / weights.sum(-1, keepdims=True)
        moe = np.zeros_like(x)
        for bi in range(b):
            for ti in range(t):
                for j, e in enumerate(chosen[bi, ti]):
                    ex_pre = f"mlp.experts.{e}."
                    v = hn[bi, ti]
                    act = _silu(v @ w(ex_pre + "gate_proj.weight").T)
                    y = (act * (v @ w(ex_pre + "up_proj.weight").T)) @ w(
                        ex_pre + "down_proj.weight"
                    ).T
                    moe[bi, ti] += weights[bi, ti, j] * y
        assert e_num == p.shape[-1]
        x = x + moe
    x = _rms_norm(x, tensors["model.norm.weight"], eps, False)
    return x @ tensors["lm_head.weight"].T, np.stack(routed)


def test_config_from_the_hub_forms():
    config = CausalLMConfig.from_hf_config(HUB_30B_A3B)
    assert config.is_moe and config.num_experts == 128 and config.num_experts_per_tok == 8
    assert config.moe_intermediate_size == 768 and config.norm_topk_prob and config.qk_norm
    # transformers' Qwen3MoeForCausalLM of this config has 30,532,122,624 parameters
    assert config.num_params() == 30_532_122_624
    assert CausalLMConfig.from_hf_config(config.to_hf_config()) == config
    # transformers 5 writes num_local_experts
    local = {k: v for k, v in HUB_30B_A3B.items() if k != "num_experts"}
    assert CausalLMConfig.from_hf_config({**local, "num_local_experts": 128}) == config


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"num_experts_per_tok": 129}, "num_experts_per_tok must be at most"),
        ({"num_experts": None}, "missing required key 'num_experts'"),
    ],
)
def test_config_refusals(changes, match):
    with pytest.raises(ValueError, match=match):
        CausalLMConfig.from_hf_config({**HUB_30B_A3B, **changes})


def test_dense_configs_refuse_expert_fields():
    with pytest.raises(ValueError, match="only model_type 'qwen3_moe' takes them"):
        CausalLMConfig.tiny(num_experts=4)


def test_logits_and_routing_match_transformers(model, expected):
    e = expected
    ids, mask = jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"])
    assert _real_max_err(_fwd(model, ids, mask), e["logits"], mask) <= TOL
    _, _, trace = nnx.jit(lambda m, i, k: m.hidden_states(i, k, routing=True))(model, ids, mask)
    real = np.asarray(mask).astype(bool)
    got = np.sort(np.asarray(trace.experts), -1)[:, real]
    np.testing.assert_array_equal(got, np.sort(e["routed_experts"], -1)[:, real])
    # the load-balancing loss with the attention mask, as transformers computes it
    aux = float(load_balancing_loss(trace))
    np.testing.assert_allclose(aux, float(e["aux_loss"]), rtol=1e-5)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_logits_match_the_float64_numpy_reference(model, expected, norm_topk):
    config, tensors = load_checkpoint(FIXTURES / NAME)
    e = expected
    want, _ = reference_logits(
        config, tensors, e["input_ids"], e["attention_mask"], norm_topk=norm_topk
    )
    if norm_topk:  # the reference follows transformers
        assert _real_max_err(e["logits"], want, e["attention_mask"]) <= TOL
    m = CausalLM(model.config.replace(norm_topk_prob=norm_topk), rngs=nnx.Rngs(0))
    nnx.update(m, nnx.state(model))
    got = _fwd(m, jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"]))
    assert _real_max_err(got, want, e["attention_mask"]) <= TOL


def test_scanned_stacked_and_rematerialized_layers_agree(model, expected):
    ids, mask = jnp.asarray(expected["input_ids"]), jnp.asarray(expected["attention_mask"])
    want = np.asarray(_fwd(model, ids, mask))
    scanned = from_pretrained(FIXTURES / NAME)
    scanned.scan_layers = True
    np.testing.assert_allclose(np.asarray(_fwd(scanned, ids, mask)), want, atol=1e-5)
    stacked = from_pretrained(FIXTURES / NAME).stack_layers()
    np.testing.assert_allclose(np.asarray(_fwd(stacked, ids, mask)), want, atol=1e-5)
    for m in (model, scanned):
        hidden, _ = nnx.jit(lambda m, i, k: m.hidden_states(i, k, remat=True))(m, ids, mask)
        np.testing.assert_allclose(np.asarray(model.logits_from_hidden(hidden)), want, atol=1e-5)


@pytest.mark.parametrize("path", ["ragged", "dense"])
def test_gradients_equal_a_dense_computation_of_the_experts(path, monkeypatch):
    """Both expert paths (ragged batches; on the CPU, every local expert on every token with the
    routing weights as the combination) give the values and gradients of a one-hot formulation.
    """
    from artifex.generative_models.models.causal_lm import moe_dispatch

    monkeypatch.setattr(moe_dispatch, "_use_dense", lambda x, gate: path == "dense")
    keys = jax.random.split(jax.random.key(0), 5)
    n, d, i, e, k = 7, 6, 5, 4, 2
    x = jax.random.normal(keys[0], (n, d))
    gate, up = jax.random.normal(keys[1], (e, d, i)), jax.random.normal(keys[2], (e, d, i))
    down = jax.random.normal(keys[3], (e, i, d))
    experts, weights, _, _ = route_tokens(jax.random.normal(keys[4], (n, e)), k)

    def dense(x, gate, up, down):
        all_out = jnp.einsum(
            "nei,eid->ned",
            jax.nn.silu(jnp.einsum("nd,edi->nei", x, gate)) * jnp.einsum("nd,edi->nei", x, up),
            down,
        )
        comb = jnp.sum(jax.nn.one_hot(experts, e) * weights[..., None], axis=1)  # (N, E)
        return jnp.einsum("ne,ned->nd", comb, all_out)

    def ragged(x, gate, up, down):
        return expert_mlp(x, experts, weights, gate, up, down)

    np.testing.assert_allclose(
        jax.jit(ragged)(x, gate, up, down), jax.jit(dense)(x, gate, up, down), atol=1e-5
    )

    def grads(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2, 3)))

    got, want = grads(ragged)(x, gate, up, down), grads(dense)(x, gate, up, down)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)


def test_save_reload_identical_and_same_layout_as_transformers(model, expected, tmp_path):
    model.save_pretrained(tmp_path)
    from safetensors.numpy import load_file

    ours, theirs = (
        load_file(str(tmp_path / "model.safetensors")),
        load_file(str(FIXTURES / NAME / "model.safetensors")),
    )
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3MoeForCausalLM"] and saved["num_experts"] == 8
    assert CausalLMConfig.from_hf_config(saved) == model.config
    stacked = from_pretrained(FIXTURES / NAME).stack_layers()
    stacked.save_pretrained(tmp_path / "stacked")
    again = load_file(str(tmp_path / "stacked" / "model.safetensors"))
    assert all(np.array_equal(again[k], theirs[k]) for k in theirs)


def test_kv_cache_decoding_and_greedy_generate_match_transformers(model, expected):
    e = expected
    ids, mask = jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"])
    new = jnp.asarray(e["generate_ids"])
    b, p = ids.shape
    steps = new.shape[1]

    @nnx.jit
    def decode(m, ids, mask, new):
        cache = m.init_cache(b, p + steps)
        hidden, cache = m.hidden_states(ids, mask, cache=cache)
        outs = [m.logits_from_hidden(hidden[:, -1])]
        for s in range(steps - 1):
            hidden, cache = m.hidden_states(
                new[:, s : s + 1], jnp.ones((b, 1), jnp.int32), cache=cache
            )
            outs.append(m.logits_from_hidden(hidden[:, -1]))
        return jnp.stack(outs)

    decoded = np.asarray(decode(model, ids, mask, new))
    assert float(np.abs(decoded - e["generate_logits"]).max()) <= TOL
    kwargs = dict(key=jax.random.key(0), max_new_tokens=steps, temperature=0.0, eos_ids=())
    out = generate(model, e["input_ids"], e["attention_mask"], **kwargs)
    np.testing.assert_array_equal(np.asarray(out.completion_ids), e["generate_ids"])


def test_shared_prefix_pass_equals_per_row_scoring(model, expected):
    e = expected
    g, t = 2, 5
    rng = np.random.default_rng(0)
    prompts, pmask = np.repeat(e["input_ids"], g, 0), np.repeat(e["attention_mask"], g, 0)
    completions = jnp.asarray(rng.integers(3, 128, size=(3 * g, t)), jnp.int32)
    prompts, pmask = jnp.asarray(prompts), jnp.asarray(pmask)
    per_row, _ = causal_lm_log_probs(model, prompts, completions, prompt_mask=pmask)
    shared, _ = causal_lm_log_probs(
        model, prompts, completions, prompt_mask=pmask, shared_prompt_group=g
    )
    np.testing.assert_allclose(np.asarray(shared), np.asarray(per_row), atol=1e-5)


def test_replaying_the_routers_choice_changes_nothing_and_another_choice_does(model, expected):
    ids, mask = jnp.asarray(expected["input_ids"]), jnp.asarray(expected["attention_mask"])
    run = nnx.jit(lambda m, i, k, r: m.hidden_states(i, k, routing=r))
    hidden, _, trace = nnx.jit(lambda m, i, k: m.hidden_states(i, k, routing=True))(
        model, ids, mask
    )
    again, _, replayed = run(model, ids, mask, trace.experts)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(hidden))
    assert float(routing_agreement(replayed)) == 1.0
    # another expert for one token of layer 0: that token (and what attends to it) changes
    other = np.asarray(trace.experts).copy()
    row, col = 0, ids.shape[1] - 4
    other[0, row, col] = (other[0, row, col] + 1) % model.config.num_experts
    while len(set(other[0, row, col])) < other.shape[-1]:  # keep k distinct experts
        other[0, row, col, 0] = (other[0, row, col, 0] + 1) % model.config.num_experts
    changed, _, trace2 = run(model, ids, mask, jnp.asarray(other))
    diff = np.abs(np.asarray(changed) - np.asarray(hidden)).max(-1)
    assert diff[row, col] > 1e-3 and diff[row, :col].max() == 0.0
    assert np.asarray(trace2.agreement)[0, row, col] == 0.0
    assert float(routing_agreement(trace2, mask)) < 1.0
    # -1 keeps the router's own choice
    unknown = jnp.full_like(trace.experts, -1)
    same, _, _ = run(model, ids, mask, unknown)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(hidden))


def test_routing_refusals(model, expected):
    ids = jnp.asarray(expected["input_ids"])
    with pytest.raises(ValueError, match=r"replayed experts must have shape"):
        model.hidden_states(ids, routing=jnp.zeros((2, 3, 4, 2), jnp.int32))
    dense = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="only mixture-of-experts models route tokens"):
        dense.hidden_states(ids, routing=True)
    with pytest.raises(ValueError, match="layer-by-layer update does not run them"):
        model.layer_inputs(ids, ids[:, :2], jnp.ones_like(ids), group=None)


def test_router_trace_is_a_pytree():
    trace = RouterTrace(
        experts=jnp.zeros((1, 2, 1), jnp.int32), agreement=jnp.ones((1, 2)),
        load=jnp.zeros(3), importance=jnp.zeros(3), tokens=jnp.array(2.0),
    )  # fmt: skip
    assert len(jax.tree.leaves(trace)) == 5
