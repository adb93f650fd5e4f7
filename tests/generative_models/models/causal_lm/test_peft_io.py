"""LoRA adapters in PEFT's format, against adapters saved and logits computed by PEFT itself.

Fixtures: tests/fixtures/peft/, made by tests/fixtures/make_peft_fixtures.py (its docstring
says the order: our adapter first, then PEFT's fixtures and PEFT's check of ours).
"""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from artifex.generative_models.models.causal_lm import (
    CausalLM,
    LoRAConfig,
    apply_lora,
    lora_state,
    merge_lora,
)
from artifex.generative_models.models.causal_lm.peft_io import (
    load_peft_adapter,
    peft_adapter_config,
    read_peft_adapter,
    save_peft_adapter,
)

from ._helpers import adapter_variant

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "fixtures")
PEFT = os.path.join(FIXTURES, "peft")
TOL = 1e-4


def _inputs(base: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    e = np.load(os.path.join(FIXTURES, base, "expected.npz"))
    return tuple(jnp.asarray(e[k]) for k in ("input_ids", "attention_mask", "position_ids"))


def _script():
    path = os.path.join(FIXTURES, "make_peft_fixtures.py")
    spec = importlib.util.spec_from_file_location("make_peft_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "base"), [("qwen2_lora", "qwen2_tiny"), ("llama3_rslora", "llama3_tiny")]
)
def test_an_adapter_saved_by_peft_gives_peft_logits(name, base):
    model = CausalLM.from_pretrained(os.path.join(FIXTURES, base))
    base_logits = np.asarray(model(*_inputs(base)))
    load_peft_adapter(model, os.path.join(PEFT, name))
    expected = np.load(os.path.join(PEFT, name, "expected.npz"))["logits"]
    got = np.asarray(model(*_inputs(base)))
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
    assert np.abs(expected - base_logits).max() > 100 * TOL  # the adapter matters


def test_rslora_scale_is_alpha_over_sqrt_rank():
    config, _ = read_peft_adapter(os.path.join(PEFT, "llama3_rslora"))
    assert config.use_rslora and config.rank == 8 and config.alpha == 4.0
    assert config.scale == pytest.approx(4.0 / np.sqrt(8.0), rel=1e-12)
    assert LoRAConfig(rank=8, alpha=4.0).scale == 0.5  # PEFT's default lora_alpha / r
    assert set(config.target_modules) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip


def test_our_saved_adapter_gives_peft_logits():
    """PEFT loaded the committed adapter and computed peft_logits.npz (the script's step 2)."""
    model = CausalLM.from_pretrained(os.path.join(FIXTURES, "qwen3_tiny"))
    load_peft_adapter(model, os.path.join(PEFT, "artifex_qwen3_lora"))
    peft_logits = np.load(os.path.join(PEFT, "artifex_qwen3_lora", "peft_logits.npz"))["logits"]
    np.testing.assert_allclose(np.asarray(model(*_inputs("qwen3_tiny"))), peft_logits, atol=TOL)


def test_the_committed_adapter_is_what_our_code_writes(tmp_path):
    ours = np.asarray(_script().write_artifex_adapter(str(tmp_path)))
    committed = os.path.join(PEFT, "artifex_qwen3_lora")
    with (
        open(tmp_path / "adapter_config.json") as f,
        open(os.path.join(committed, "adapter_config.json")) as g,
    ):
        assert json.load(f) == json.load(g)
    new, old = (
        load_file(tmp_path / "adapter_model.safetensors"),
        load_file(os.path.join(committed, "adapter_model.safetensors")),
    )
    assert sorted(new) == sorted(old)
    for key in old:
        np.testing.assert_allclose(new[key], old[key], atol=1e-6, rtol=0)
    peft_logits = np.load(os.path.join(committed, "peft_logits.npz"))["logits"]
    np.testing.assert_allclose(ours, peft_logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_save_then_load_round_trip(tmp_path, stacked, use_rslora):
    model = CausalLM.from_pretrained(os.path.join(FIXTURES, "qwen2_tiny"))
    config = LoRAConfig(rank=2, alpha=3.0, target_modules=("v_proj", "gate_proj"),
                        use_rslora=use_rslora)  # fmt: skip
    apply_lora(model, config, nnx.Rngs(3))
    state = lora_state(model)
    keys = jax.random.split(jax.random.key(1), len(jax.tree.leaves(state)))
    leaves = [0.3 * jax.random.normal(k, x.shape) for k, x in
              zip(keys, jax.tree.leaves(state), strict=True)]  # fmt: skip
    nnx.update(model, jax.tree.unflatten(jax.tree.structure(state), leaves))
    ids = _inputs("qwen2_tiny")
    expected = np.asarray(model(*ids))
    if stacked:
        model.stack_layers()
    save_peft_adapter(model, tmp_path, config=config)
    assert model.layers_stacked == stacked  # restacked after saving
    with open(tmp_path / "adapter_config.json") as f:
        written = json.load(f)
    assert written == json.loads(json.dumps(peft_adapter_config(config)))
    assert written["use_rslora"] is use_rslora and written["lora_alpha"] == 3.0
    names = sorted(load_file(tmp_path / "adapter_model.safetensors"))
    assert names[0] == "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
    assert len(names) == 2 * 2 * 2  # layers x targets x (A, B)
    fresh = CausalLM.from_pretrained(os.path.join(FIXTURES, "qwen2_tiny"))
    if stacked:
        fresh.stack_layers()
    load_peft_adapter(fresh, tmp_path)
    np.testing.assert_allclose(np.asarray(fresh(*ids)), expected, atol=1e-5, rtol=0)
    merged = merge_lora(fresh)  # a loaded adapter merges like a trained one
    np.testing.assert_allclose(np.asarray(merged(*ids)), expected, atol=1e-4, rtol=0)


def test_unsupported_adapters_are_refused_by_name(tmp_path):
    src = os.path.join(PEFT, "qwen2_lora")

    def variant(name, edit_config=None, edit_tensors=None):
        return adapter_variant(src, tmp_path / name, edit_config, edit_tensors)

    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        read_peft_adapter(variant("dora", lambda d: d.update(use_dora=True)))
    with pytest.raises(ValueError, match="modules_to_save"):
        read_peft_adapter(variant("save", lambda d: d.update(modules_to_save=["lm_head"])))
    with pytest.raises(ValueError, match="rank_pattern"):
        read_peft_adapter(variant("rank", lambda d: d.update(rank_pattern={"q_proj": 2})))
    with pytest.raises(ValueError, match="peft_type must be 'LORA'"):
        read_peft_adapter(variant("ia3", lambda d: d.update(peft_type="IA3")))
    with pytest.raises(ValueError, match=r"unsupported tensor.*lora_embedding_A"):
        read_peft_adapter(variant("emb", edit_tensors=lambda t: t.update(
            {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 8), np.float32)}
        )))  # fmt: skip
    missing = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    with pytest.raises(ValueError, match=r"missing tensor.*layers\.1\.self_attn\.q_proj\.lora_B"):
        read_peft_adapter(variant("gap", edit_tensors=lambda t: t.pop(missing)))
    with pytest.raises(FileNotFoundError, match=r"no adapter_config\.json"):
        read_peft_adapter(tmp_path)
    wrong_base = CausalLM.from_pretrained(os.path.join(FIXTURES, "qwen3_tiny"))
    with pytest.raises(ValueError, match="expected shape"):
        load_peft_adapter(wrong_base, src)
    assert wrong_base.layers[0].attn.q_proj.lora is None  # refused before any change


def test_save_refuses_a_model_without_adapters_or_a_wrong_config(tmp_path):
    model = CausalLM.from_pretrained(os.path.join(FIXTURES, "qwen2_tiny"))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_peft_adapter(model, tmp_path)
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",)), nnx.Rngs(0))
    with pytest.raises(ValueError, match="disagrees with the model's adapters"):
        save_peft_adapter(model, tmp_path, config=LoRAConfig(rank=2, alpha=8.0))
    save_peft_adapter(model, tmp_path)  # no config: lora_alpha = scale * r
    with open(tmp_path / "adapter_config.json") as f:
        assert json.load(f)["lora_alpha"] == 4.0
