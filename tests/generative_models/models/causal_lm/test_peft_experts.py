"""Per-expert LoRA adapters in PEFT's format (`target_parameters` on transformers' fused experts).

Fixtures (tests/fixtures/make_peft_fixtures.py): `peft/qwen3_moe_experts_lora/`, saved by PEFT
0.21.2 on transformers 5.23.0's Qwen3-MoE with its logits; `peft/artifex_qwen3_moe_lora/`, saved
by us and loaded by PEFT, with PEFT's logits.
"""

from __future__ import annotations

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
)
from artifex.generative_models.models.causal_lm.peft_experts import (
    _from_peft,
    _to_peft,
    expert_target,
)
from artifex.generative_models.models.causal_lm.peft_io import (
    load_peft_adapter,
    read_peft_adapter,
    save_peft_adapter,
)

from ._helpers import adapter_variant
from .test_peft_io import FIXTURES, PEFT, TOL, _inputs, _script

BASE = "qwen3_moe_tiny"
THEIRS = os.path.join(PEFT, "qwen3_moe_experts_lora")
OURS = os.path.join(PEFT, "artifex_qwen3_moe_lora")
EXPERTS = ("gate_proj", "up_proj", "down_proj")


def _model(stacked=False):
    model = CausalLM.from_pretrained(os.path.join(FIXTURES, BASE))
    return model.stack_layers() if stacked else model


def _real():
    return np.asarray(_inputs(BASE)[1]).astype(bool)


def _randomize(model, seed=5):
    state = lora_state(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, new))


def test_the_layouts_are_peft_s():
    """PEFT's `lora_A` (R E, in): row `e R + j` is A_e[j]; `lora_B` (out, R E): column
    `j E + e` is B_e[:, j] (its ParamWrapper's reshapes), against our (E, in, R) / (E, R, out).
    """
    rng = np.random.default_rng(0)
    e, n_in, n_out, r = 3, 5, 4, 2
    a, b = rng.normal(size=(e, n_in, r)), rng.normal(size=(e, r, n_out))
    peft_a, peft_b = _to_peft(a, b)
    for ex in range(e):
        for j in range(r):
            np.testing.assert_array_equal(peft_a[ex * r + j], a[ex, :, j])
            np.testing.assert_array_equal(peft_b[:, j * e + ex], b[ex, j])
    back_a, back_b = _from_peft(peft_a, peft_b, e)
    np.testing.assert_array_equal(back_a, a)
    np.testing.assert_array_equal(back_b, b)


def test_target_parameter_entries():
    assert expert_target("mlp.experts.gate_up_proj") == "gate_up_proj"
    assert expert_target("experts.down_proj") == "down_proj"
    assert expert_target("down_proj") == "down_proj"
    for entry in ("mlp.experts.gate_proj", "self_attn.q_proj.weight", "xperts.down_proj"):
        assert expert_target(entry) is None


@pytest.mark.parametrize("stacked", [False, True])
def test_an_expert_adapter_saved_by_peft_gives_peft_logits(stacked):
    model = _model(stacked)
    base_logits = np.asarray(model(*_inputs(BASE)))
    load_peft_adapter(model, THEIRS)
    expected = np.load(os.path.join(THEIRS, "expected.npz"))["logits"]
    got = np.asarray(model(*_inputs(BASE)))
    real = _real()
    np.testing.assert_allclose(got[real], expected[real], atol=TOL, rtol=0)
    assert np.abs(base_logits - expected)[real].max() > 0.1  # the adapter matters
    if stacked:
        model.unstack_layers()
    lora = model.layers[0].mlp.experts.lora  # PEFT's fused gate/up: one A for both
    assert lora.gate_proj.lora_a.shape == (8, 32, 2) and lora.down_proj.lora_b.shape == (8, 2, 32)
    np.testing.assert_array_equal(lora.gate_proj.lora_a[...], lora.up_proj.lora_a[...])
    assert model.layers[0].attn.q_proj.lora is not None and model.layers[0].attn.k_proj.lora is None


def test_a_loaded_expert_adapter_is_written_back_as_peft_wrote_it(tmp_path):
    config, _ = read_peft_adapter(THEIRS)
    assert config.rank == 2 and config.alpha == 8.0
    assert config.target_modules == ("down_proj", "gate_proj", "o_proj", "q_proj", "up_proj")
    model = load_peft_adapter(_model(), THEIRS)
    save_peft_adapter(model, tmp_path, config=config, base_model_name_or_path=BASE)
    new = load_file(tmp_path / "adapter_model.safetensors")
    old = load_file(os.path.join(THEIRS, "adapter_model.safetensors"))
    assert sorted(new) == sorted(old)
    for key in old:
        np.testing.assert_array_equal(new[key], old[key])
    with open(tmp_path / "adapter_config.json") as f, open(os.path.join(THEIRS,
              "adapter_config.json")) as g:  # fmt: skip
        ours, theirs = json.load(f), json.load(g)
    for key in ("r", "lora_alpha", "target_modules", "target_parameters", "use_rslora"):
        mine, peft = ours[key], theirs[key]
        if isinstance(mine, list):
            mine, peft = sorted(mine), sorted(peft)
        assert mine == peft, key


def test_our_expert_adapter_gives_peft_logits():
    """PEFT loaded the committed adapter and computed peft_logits.npz (the script's step 2)."""
    model = load_peft_adapter(_model(), OURS)
    peft_logits = np.load(os.path.join(OURS, "peft_logits.npz"))["logits"]
    real = _real()
    got = np.asarray(model(*_inputs(BASE)))
    np.testing.assert_allclose(got[real], peft_logits[real], atol=TOL, rtol=0)


def test_the_committed_expert_adapter_is_what_our_code_writes(tmp_path):
    ours = np.asarray(_script().write_artifex_adapter(str(tmp_path), "artifex_qwen3_moe_lora"))
    with open(tmp_path / "adapter_config.json") as f, open(os.path.join(OURS,
              "adapter_config.json")) as g:  # fmt: skip
        written = json.load(f)
        assert written == json.load(g)
    # gate and up with different A: PEFT's fused adapter at rank 2r, the rest padded to it
    assert written["r"] == 4 and written["lora_alpha"] == 8.0 and not written["use_rslora"]
    new = load_file(tmp_path / "adapter_model.safetensors")
    old = load_file(os.path.join(OURS, "adapter_model.safetensors"))
    assert sorted(new) == sorted(old)
    for key in old:
        np.testing.assert_allclose(new[key], old[key], atol=1e-6, rtol=0)
    real = _real()
    peft_logits = np.load(os.path.join(OURS, "peft_logits.npz"))["logits"]
    np.testing.assert_allclose(ours[real], peft_logits[real], atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "targets",
    [("gate_proj",), ("up_proj", "down_proj"), ("q_proj", "gate_proj", "up_proj", "down_proj")],
    ids=["gate", "up+down", "all"],
)
def test_save_then_load_round_trip(tmp_path, targets):
    ids = _inputs(BASE)
    model = apply_lora(_model(), LoRAConfig(rank=2, alpha=4.0, target_modules=targets),
                       nnx.Rngs(0))  # fmt: skip
    _randomize(model)
    want = np.asarray(model(*ids))
    save_peft_adapter(model, tmp_path)
    names = sorted(load_file(tmp_path / "adapter_model.safetensors"))
    nested = any("base_layer" in n for n in names)
    assert nested == ("down_proj" in targets and ("gate_proj" in targets or "up_proj" in targets))
    config, _ = read_peft_adapter(tmp_path)
    both = "gate_proj" in targets and "up_proj" in targets
    assert config.rank == (4 if both else 2)  # different A's: rank 2r
    loaded = load_peft_adapter(_model(), tmp_path)
    np.testing.assert_allclose(np.asarray(loaded(*ids)), want, atol=1e-5, rtol=0)


def test_unsupported_expert_adapters_are_refused_by_name(tmp_path):
    def variant(name, edit_config=None, edit_tensors=None):
        return adapter_variant(THEIRS, tmp_path / name, edit_config, edit_tensors)

    bad = variant("entry", lambda d: d.update(target_parameters=["mlp.experts.gate_proj"]))
    with pytest.raises(ValueError, match=r"target_parameters entry 'mlp\.experts\.gate_proj'"):
        read_peft_adapter(bad)
    one = variant("one", lambda d: d.update(target_parameters=["mlp.experts.down_proj"]))
    with pytest.raises(ValueError, match=r"unsupported tensor .*experts\.base_layer"):
        read_peft_adapter(one)  # one parameter: no base_layer nesting
    missing = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"
    with pytest.raises(ValueError, match=r"missing tensor .*layers\.1\.mlp\.experts\.base_layer"):
        read_peft_adapter(variant("gap", edit_tensors=lambda t: t.pop(missing)))
    with pytest.raises(ValueError, match=r"unsupported tensor .*mlp\.experts\."):
        read_peft_adapter(variant("plain", lambda d: d.update(target_parameters=None)))

    def shrink(t):  # an adapter of 4 experts
        for key in [k for k in t if ".experts." in k]:
            t[key] = t[key][:8] if "lora_A" in key else t[key][:, :8]

    model = _model()
    with pytest.raises(ValueError, match=r"experts\.base_layer\.lora_A\.weight' \(gate_up_proj\)"):
        load_peft_adapter(model, variant("experts", edit_tensors=shrink))
    assert model.layers[0].mlp.experts.lora is None  # refused before any change
    dense = CausalLM.from_pretrained(os.path.join(FIXTURES, "qwen3_tiny"))
    with pytest.raises(ValueError, match="need a mixture-of-experts model"):
        load_peft_adapter(dense, THEIRS)


def test_bfloat16_expert_adapters_round_trip(tmp_path):
    model = apply_lora(_model(), LoRAConfig(rank=2, alpha=4.0, target_modules=EXPERTS,
                                            param_dtype="bfloat16"), nnx.Rngs(0))  # fmt: skip
    _randomize(model)
    save_peft_adapter(model, tmp_path)
    loaded = load_peft_adapter(_model(), tmp_path)
    assert loaded.layers[1].mlp.experts.lora.down_proj.lora_a.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(loaded(*_inputs(BASE))), np.asarray(model(*_inputs(BASE))), atol=1e-5
    )
