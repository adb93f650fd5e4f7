"""Tests for artifex/generative_models/models/causal_lm/config.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from artifex.generative_models.models.causal_lm import CausalLMConfig, RopeScaling

from ._helpers import FIXTURES


def test_presets_shapes():
    w1 = CausalLMConfig.qwen2_w1()
    assert (w1.model_type, w1.vocab_size, w1.hidden_size, w1.num_layers) == ("qwen2", 4096, 256, 4)
    assert (w1.num_heads, w1.num_kv_heads, w1.head_dim, w1.intermediate_size) == (4, 2, 64, 768)
    assert w1.tie_word_embeddings and w1.attention_bias and not w1.attention_out_bias
    assert w1.param_dtype == "float32"
    tiny = CausalLMConfig.tiny()
    assert 100_000 < tiny.num_params() < 1_000_000
    assert CausalLMConfig.tiny(vocab_size=20).vocab_size == 20


def test_defaults_resolved():
    cfg = CausalLMConfig(
        vocab_size=10, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=4
    )
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 8 and cfg.num_groups == 1
    assert cfg.eos_token_ids == ()


def test_frozen_keyword_only_slotted():
    cfg = CausalLMConfig.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.vocab_size = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        CausalLMConfig("llama", 1, 2, 3, 4, 5)  # type: ignore[misc]
    assert not hasattr(cfg, "__dict__")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"param_dtype": "float16"}, "param_dtype"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"eos_token_id": (1, -2)}, "eos_token_id"),
        ({"qk_norm": True}, "qk_norm"),
        ({"model_type": "qwen2", "attention_bias": False}, "attention_bias"),
        ({"model_type": "qwen3"}, "qk_norm"),
    ],
)
def test_validation_names_field(changes, field):
    with pytest.raises(ValueError, match=field):
        CausalLMConfig.tiny(**changes)


def test_eos_list_becomes_tuple():
    cfg = CausalLMConfig.tiny(eos_token_id=[3, 4])
    assert cfg.eos_token_id == (3, 4) and cfg.eos_token_ids == (3, 4)
    assert CausalLMConfig.tiny(eos_token_id=5).eos_token_ids == (5,)


def test_rope_scaling_validation_and_mapping():
    d = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = CausalLMConfig.tiny(rope_scaling=d)
    assert isinstance(cfg.rope_scaling, RopeScaling) and cfg.rope_scaling.factor == 8.0
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling(
            factor=8, low_freq_factor=4, high_freq_factor=1, original_max_position_embeddings=8
        )
    with pytest.raises(ValueError, match="rope_type"):
        RopeScaling.from_dict({**d, "rope_type": "yarn"})


@pytest.mark.parametrize(
    "name", ["llama3_tiny", "qwen2_tiny", "qwen3_tiny", "llama_tiny_sharded_bf16"]
)
def test_from_hf_config_reads_fixtures(name):
    d = json.loads((FIXTURES / name / "config.json").read_text())
    cfg = CausalLMConfig.from_hf_config(d)
    assert cfg.model_type == d["model_type"]
    assert cfg.num_layers == d["num_hidden_layers"]
    assert cfg.num_kv_heads == d["num_key_value_heads"]
    assert cfg.tie_word_embeddings == d["tie_word_embeddings"]
    if name == "llama3_tiny":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 4.0
        assert cfg.rope_scaling.original_max_position_embeddings == 64
    if name == "qwen3_tiny":
        assert cfg.qk_norm and cfg.head_dim == 16 and cfg.hidden_size == 32
    if name == "qwen2_tiny":
        assert cfg.attention_bias and cfg.eos_token_id == (2, 3)
    if name == "llama_tiny_sharded_bf16":
        assert cfg.param_dtype == "bfloat16" and cfg.attention_out_bias


@pytest.mark.parametrize("preset", ["tiny", "qwen2_w1"])
def test_to_from_hf_roundtrip(preset):
    cfg = getattr(CausalLMConfig, preset)(
        eos_token_id=(2, 7),
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    d = json.loads(json.dumps(cfg.to_hf_config()))
    assert d["architectures"] and d["model_type"] == cfg.model_type
    assert CausalLMConfig.from_hf_config(d) == cfg


def test_legacy_rope_keys_and_qwen3_roundtrip():
    d = {
        "model_type": "llama",
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    cfg = CausalLMConfig.from_hf_config(d)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.factor == 32.0
    assert cfg.num_kv_heads == 2
    q3 = CausalLMConfig.tiny(model_type="qwen3", qk_norm=True, head_dim=64)
    assert CausalLMConfig.from_hf_config(q3.to_hf_config()) == q3


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model_type": "gpt2"}, "gpt2"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ],
)
def test_from_hf_config_rejects(changes, key):
    d = {**CausalLMConfig.tiny().to_hf_config(), **changes}
    with pytest.raises(ValueError, match=key):
        CausalLMConfig.from_hf_config(d)
