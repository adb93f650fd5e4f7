"""Gemma 3 (text) specifics: soft-capped logits, the Gemma-style tokenizer and chat template,
config.json in its Hub and transformers 5 forms, and the pieces against float64 NumPy.

The shared paths (forward, KV cache, sampler, GRPO, LoRA, checkpoints) are in test_families.py.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import jinja2
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

from artifex.generative_models.inference.sampling import generate
from artifex.generative_models.models.causal_lm import (
    MLP,
    CausalLM,
    CausalLMConfig,
    Embed,
    RMSNorm,
    RopeScaling,
    Tokenizer,
    convert_gguf,
    from_pretrained,
    gguf_config,
    load_gguf,
    read_gguf,
    rope_inv_frequencies,
)
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import (
    GRPOBatch,
    causal_lm_log_probs,
    pack_batch,
    packed_causal_lm_log_probs,
)

from ._family_reference import load_checkpoint, reference_logits
from ._helpers import FIXTURES, load_expected

NAME = "gemma3_tiny"
SOFTCAP = 2.0  # make_causal_lm_fixtures.SOFTCAP

#: google/gemma-3-1b-it's config.json (transformers 4.50 form).
HUB_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 262144,
}


@nnx.jit
def _fwd(m, ids, mask):
    return m(ids, mask)


def _softcapped():
    model = from_pretrained(FIXTURES / NAME)
    capped = CausalLM(model.config.replace(final_logit_softcapping=SOFTCAP), rngs=nnx.Rngs(0))
    nnx.update(capped, nnx.state(model))
    return capped


def test_final_logit_softcapping_matches_transformers_and_numpy():
    model = _softcapped()
    e = load_expected(NAME)
    real = e["attention_mask"].astype(bool)
    got = np.asarray(_fwd(model, jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"])))
    assert float(np.abs(got - e["logits_softcap"])[real].max()) <= 1e-4
    config, tensors = load_checkpoint(FIXTURES / NAME)
    want = reference_logits(config, tensors, e["input_ids"], e["attention_mask"], softcap=SOFTCAP)
    assert float(np.abs(got - want)[real].max()) <= 1e-4
    assert float(np.abs(got).max()) < SOFTCAP < float(np.abs(e["logits"]).max())


def test_softcapped_log_probs_of_the_sampler_and_the_update_agree():
    """The cap comes before the temperature in the sampler and in the GRPO scoring alike."""
    model = _softcapped()
    e = load_expected(NAME)
    temperature = 0.7
    out = generate(
        model,
        e["input_ids"],
        e["attention_mask"],
        key=jax.random.key(2),
        num_generations=2,
        max_new_tokens=6,
        temperature=temperature,
        eos_ids=(),
    )
    ids, mask = np.repeat(e["input_ids"], 2, 0), np.repeat(e["attention_mask"], 2, 0)
    completion = np.asarray(out.completion_ids)
    seq = np.concatenate([ids, completion], 1)
    full = np.concatenate([mask, np.ones_like(completion)], 1)
    logits = np.asarray(_fwd(model, jnp.asarray(seq), jnp.asarray(full)), np.float64)
    z = logits[:, ids.shape[1] - 1 : -1] / temperature
    z = z - z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = np.take_along_axis(lp, completion[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.log_probs), want, atol=1e-4)
    for group in (None, 2):
        got, _ = causal_lm_log_probs(
            model,
            jnp.asarray(ids),
            jnp.asarray(completion),
            prompt_mask=jnp.asarray(mask),
            temperature=temperature,
            shared_prompt_group=group,
        )
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)
    batch = GRPOBatch(
        prompt_ids=jnp.asarray(ids),
        prompt_mask=jnp.asarray(mask),
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        rewards=jnp.zeros(ids.shape[0]),
        group_size=2,
    )
    packed, _ = packed_causal_lm_log_probs(model, pack_batch(batch), temperature=temperature)
    np.testing.assert_allclose(np.asarray(packed), want, atol=1e-4)


def test_tokenizer_and_chat_template_match_transformers():
    tok = Tokenizer.from_pretrained(FIXTURES / NAME)
    expected = json.loads((FIXTURES / NAME / "tokenizer_expected.json").read_text())
    assert (tok.bos_id, tok.eos_ids[0], tok.pad_id) == (
        expected["bos_id"],
        expected["eos_id"],
        expected["pad_id"],
    )
    assert len(tok) == expected["vocab_size"]
    assert tok.eos_ids == (1, 5)  # <eos> and <end_of_turn> (generation_config.json)
    for case in expected["encode"]:
        got = tok.encode(case["text"], add_special_tokens=case["add_special_tokens"])
        assert got == case["ids"], case["text"]
    for case in expected["decode"]:
        text = tok.decode(case["ids"], skip_special_tokens=case["skip_special_tokens"])
        assert text == case["text"], case["ids"]
    assert "<start_of_turn>" in tok.chat_template
    for case in expected["chat"]:
        gen = case["add_generation_prompt"]
        text = tok.apply_chat_template(case["messages"], add_generation_prompt=gen, tokenize=False)
        assert text == case["text"]
        assert tok.apply_chat_template(case["messages"], add_generation_prompt=gen) == case["ids"]
    bad = expected["alternation_error"]
    with pytest.raises(jinja2.exceptions.TemplateError, match="must alternate"):
        tok.apply_chat_template(bad["messages"], tokenize=False)


def test_a_chat_prompt_generates_until_end_of_turn():
    tok = Tokenizer.from_pretrained(FIXTURES / NAME)
    model = from_pretrained(FIXTURES / NAME)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True
    )
    text = tok.decode(prompt, skip_special_tokens=False)
    assert prompt[0] == tok.bos_id and text.endswith("<start_of_turn>model\n")
    out = generate(
        model,
        np.array([prompt], np.int32),
        key=jax.random.key(0),
        max_new_tokens=8,
        temperature=0.0,
    )
    assert model.config.eos_token_ids == (1, 5)
    tokens, keep = np.asarray(out.completion_ids[0]), np.asarray(out.completion_mask[0])
    ended = [i for i, t in enumerate(tokens) if t in (1, 5)]
    assert keep.sum() == (ended[0] + 1 if ended else len(tokens))


def test_config_from_the_hub_form():
    config = CausalLMConfig.from_hf_config(HUB_1B)
    assert config.model_type == "gemma3_text" and config.param_dtype == "bfloat16"
    assert config.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(26))
    assert (config.sliding_window, config.rope_theta, config.rope_local_theta) == (
        512,
        1_000_000.0,
        10_000.0,
    )
    assert config.tie_word_embeddings and config.qk_norm and config.eos_token_id == (1, 106)
    assert config.hidden_act == "gelu_pytorch_tanh" and config.attention_scale == 256**-0.5
    assert config.embed_scale == math.sqrt(1152)
    # transformers' Gemma3ForCausalLM of this config has 999,885,952 parameters
    assert config.num_params() == 999_885_952
    # the transformers 5 form (what the fixture's config.json holds) reads the same
    again = CausalLMConfig.from_hf_config(config.to_hf_config())
    assert again == config
    new_form = dict(HUB_1B, layer_types=list(config.layer_types))
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern"):
        new_form.pop(key)
    new_form["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    assert CausalLMConfig.from_hf_config(new_form) == config
    fixture = json.loads((FIXTURES / NAME / "config.json").read_text())
    scaled = CausalLMConfig.from_hf_config(fixture)
    assert scaled.rope_scaling == RopeScaling(factor=4.0, rope_type="linear")
    assert scaled.query_pre_attn_scalar == 24.0 and scaled.head_dim == 16
    assert scaled.sliding_layers == (True, False, True)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"model_type": "gemma3"}, "Gemma3ForConditionalGeneration"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"sliding_window": None}, "sliding_window"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"layer_types": ["local"] * 26}, "layer_types"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
    ],
)
def test_config_errors_name_the_key(changes, match):
    with pytest.raises(ValueError, match=match):
        CausalLMConfig.from_hf_config({**HUB_1B, **changes})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_type": "llama", "qk_norm": False}, "sliding_window"),
        ({"model_type": "llama", "qk_norm": False, "sliding_window": None}, "layer_types"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        ({"qk_norm": False}, "qk_norm"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_config_validation(changes, match):
    base = CausalLMConfig.from_hf_config(HUB_1B)
    with pytest.raises(ValueError, match=match):
        base.replace(**changes)


def test_linear_rope_scaling_matches_numpy():
    for head_dim, theta, factor in ((16, 1e6, 4.0), (256, 1e6, 8.0), (8, 1e4, 0.5)):
        want = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim) / factor
        got = rope_inv_frequencies(head_dim, theta, RopeScaling(factor=factor, rope_type="linear"))
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match="takes only factor"):
        RopeScaling(factor=2.0, low_freq_factor=1.0, rope_type="linear")


def test_unit_offset_rmsnorm_gelu_mlp_and_embedding_scale_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 32)).astype(np.float32)
    w = (0.3 * rng.normal(size=32)).astype(np.float32)
    norm = RMSNorm(32, eps=1e-6, dtype=jnp.float32, unit_offset=True)
    np.testing.assert_array_equal(np.asarray(norm.scale[...]), 0.0)  # (1 + 0) at init
    norm.scale.set_value(jnp.asarray(w))
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * (1.0 + w)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)

    config = CausalLMConfig.from_hf_config(
        {**HUB_1B, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
    )
    mlp = MLP(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    g, u, d = (
        np.asarray(p.kernel[...], np.float64) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    )
    a = x64 @ g
    gelu = 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x))), (gelu * (x64 @ u)) @ d, atol=1e-5)

    embed = Embed(16, 32, std=1.0, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), scale=config.embed_scale)
    rows = np.asarray(embed.embedding[...][jnp.array([3, 7])], np.float64)
    scale = float(jnp.asarray(math.sqrt(32), jnp.bfloat16))  # rounded to bfloat16 first
    want = np.asarray(jnp.asarray(rows * scale, jnp.bfloat16), np.float64)
    got = np.asarray(embed(jnp.array([[3, 7]]))[0], np.float64)
    assert scale == 5.65625
    np.testing.assert_array_equal(got, want)


def test_bfloat16_load():
    model = from_pretrained(FIXTURES / NAME, dtype="bfloat16")
    assert model.dtype == jnp.bfloat16
    e = load_expected(NAME)
    got = np.asarray(_fwd(model, jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"])))
    real = e["attention_mask"].astype(bool)
    err = float(np.abs(got - e["logits"])[real].max())
    assert err < 0.05 * float(np.abs(e["logits"]).max()), err


def test_one_set_of_layer_inputs_is_refused_for_mixed_layers():
    model = from_pretrained(FIXTURES / NAME)
    ids = jnp.ones((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="mix sliding-window and global"):
        model.layer_inputs(ids, ids, jnp.ones((2, 3), jnp.int32), group=None)
    with pytest.raises(ValueError, match="layerwise_update"):
        GRPOTrainer(
            model,
            nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
            GRPOConfig(layerwise_update=True),
        )


GGUF = FIXTURES / NAME / "gemma3_tiny.Q8_0.gguf"


def test_gguf_reads_as_transformers_reads_it():
    """gemma3_tiny as llama.cpp writes Gemma 3 (norms 1 + w, Q8_0 matrices, SentencePiece)."""
    model, tok = load_gguf(GGUF)
    config = model.config
    assert config.model_type == "gemma3_text" and config.vocab_size == 387
    # what the file leaves out, llama.cpp's way: every sixth layer global (none of 3 here),
    # local base 10000, the scale 1/sqrt(head_dim); the file's window and linear scaling
    assert config.sliding_layers == (True, True, True) and config.sliding_window == 4
    assert config.rope_local_theta == 10_000.0 and config.query_pre_attn_scalar == 16.0
    assert config.rope_scaling == RopeScaling(factor=4.0, rope_type="linear")
    norm = load_file(str(FIXTURES / NAME / "model.safetensors"))["model.norm.weight"]
    np.testing.assert_allclose(np.asarray(model.final_norm.scale[...]), norm, atol=1e-6)
    e = load_expected(NAME)
    with np.load(FIXTURES / NAME / "gguf_expected.npz") as data:
        want = data["logits"]
    got = np.asarray(_fwd(model, jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"])))
    real = e["attention_mask"].astype(bool)
    assert float(np.abs(got - want)[real].max()) <= 1e-4
    expected = json.loads((FIXTURES / NAME / "gguf_expected.json").read_text())
    for case in expected["encode"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    assert any(386 in case["ids"] for case in expected["encode"])  # the respelled "  " token
    for case in expected["decode"]:
        assert tok.decode(case["ids"]) == case["text"]
    chat = expected["chat"]
    text = tok.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
    assert text == chat["text"]
    assert tok.apply_chat_template(chat["messages"], add_generation_prompt=True) == chat["ids"]
    assert tok.eos_ids == (1, 5)  # <eos> and the file's eot, <end_of_turn>


def test_gguf_converts_to_a_checkpoint_that_loads_the_same(tmp_path):
    out = convert_gguf(GGUF, tmp_path / "converted")
    model, tok = load_gguf(GGUF)
    again, again_tok = from_pretrained(out), Tokenizer.from_pretrained(out)
    assert again.config == model.config
    ids = jnp.asarray(load_expected(NAME)["input_ids"])
    np.testing.assert_array_equal(
        np.asarray(_fwd(again, ids, None)), np.asarray(_fwd(model, ids, None))
    )
    for text in ("a  b   c", "Héllo <start_of_turn>"):
        assert again_tok.encode(text) == tok.encode(text)


def test_gguf_attention_scale_of_the_27b_layout(monkeypatch):
    """llama.cpp gives the 62-layer model 1/sqrt(hidden / heads) (its query_pre_attn_scalar)."""
    monkeypatch.setattr(gguf_config, "_GEMMA3_27B_LAYERS", 3)
    config = read_gguf(GGUF).config
    assert config.query_pre_attn_scalar == 32 / 4
