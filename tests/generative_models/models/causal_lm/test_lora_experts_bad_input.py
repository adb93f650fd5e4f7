"""Bad input to the expert LoRA entry points: refused by name, before the model changes.

`apply_lora`/`merge_lora` on Qwen3-MoE's experts, `add_expert_adapters`, and PEFT adapters with
`target_parameters` (`read_peft_adapter`, `load_peft_adapter`, `save_peft_adapter`): a bad `r`
or `lora_alpha`, a `target_parameters` that is not a list, a file without tensors, expert tensors
of impossible shapes, non-float or mixed dtypes, and layers adapted unlike the others.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
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
from artifex.generative_models.models.causal_lm.lora_experts import add_expert_adapters
from artifex.generative_models.models.causal_lm.peft_io import (
    load_peft_adapter,
    read_peft_adapter,
    save_peft_adapter,
)

from ._helpers import FIXTURES, adapter_variant

BASE = FIXTURES / "qwen3_moe_tiny"  # E = 8, D = 32, I = 16, 2 layers
EXPERTS = ("gate_proj", "up_proj", "down_proj")
DOWN_A = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
DOWN_B = "base_model.model.model.layers.0.mlp.experts.lora_B.weight"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _model(stacked=False):
    model = CausalLM.from_pretrained(BASE)
    return model.stack_layers() if stacked else model


def _randomize(model, seed=5):
    state = lora_state(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, new))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An adapter of `down_proj` (experts only, rank 2) and one of `q_proj` + `down_proj`."""
    out = {}
    for name, targets in (("down", ("down_proj",)), ("q_down", ("q_proj", "down_proj"))):
        model = apply_lora(_model(), LoRAConfig(rank=2, alpha=4.0, target_modules=targets),
                           nnx.Rngs(0))  # fmt: skip
        _randomize(model)
        out[name] = tmp_path_factory.mktemp(name)
        save_peft_adapter(model, out[name])
    return out





# --------------------------------------------------------------------------- adapter_config.json
@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("r", None, "None"),
        ("r", "2", "'2'"),
        ("r", 2.5, "2.5"),  # was read as r=2 (int(2.5)) for an experts-only adapter
        ("r", True, "True"),
        ("lora_alpha", None, "None"),
        ("lora_alpha", "4", "'4'"),
    ],
)
@pytest.mark.parametrize("which", ["down", "q_down"])
def test_r_and_lora_alpha_are_checked_by_key(saved, tmp_path, key, value, shown, which):
    bad = adapter_variant(saved[which], tmp_path / "bad", lambda d: d.update({key: value}))
    with pytest.raises(ValueError, match=rf"adapter_config\.json: {key} must be .*got {shown}"):
        read_peft_adapter(bad)
    model = _model()
    with pytest.raises(ValueError, match=rf"{key} must be"):
        load_peft_adapter(model, bad)
    assert model.layers[0].mlp.experts.lora is None


def test_target_parameters_must_be_a_list_of_names(saved, tmp_path):
    # a string was iterated by character: "target_parameters entry 'm' is not supported"
    one = "mlp.experts.down_proj"
    bad = adapter_variant(
        saved["down"], tmp_path / "str", lambda d: d.update(target_parameters=one)
    )
    with pytest.raises(ValueError, match=r"target_parameters must be a list .*got 'mlp\.experts"):
        read_peft_adapter(bad)


def test_an_expert_adapter_without_tensors_is_refused(saved, tmp_path):
    # was StopIteration (the expert targets came from target_parameters, not from tensors)
    empty = adapter_variant(saved["down"], tmp_path / "empty", edit_tensors=lambda t: t.clear())
    with pytest.raises(ValueError, match="no LoRA tensors"):
        read_peft_adapter(empty)
    model = _model()
    with pytest.raises(ValueError, match="no LoRA tensors"):
        load_peft_adapter(model, empty)
    assert model.layers[0].mlp.experts.lora is None


# --------------------------------------------------------------------------- expert tensor shapes
def _flat(t):
    t[DOWN_B] = t[DOWN_B].reshape(-1)


def _transposed(t):
    t[DOWN_B] = np.ascontiguousarray(t[DOWN_B].T)


def _rows(t):  # 15 rows of A: not (r E) for any E with r = 2
    t[DOWN_A] = t[DOWN_A][:15]


def _more_experts(t):  # layer 0 of 16 experts, layer 1 of 8: no one E
    t[DOWN_A] = np.concatenate([t[DOWN_A], t[DOWN_A]])
    t[DOWN_B] = np.concatenate([t[DOWN_B], t[DOWN_B]], axis=1)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_flat, r"lora_B\.weight' has shape \(512,\), expected 2 dimensions"),
        (_transposed, r"lora_B\.weight' has shape \(16, 32\), expected 16 columns"),
        (_rows, r"lora_A\.weight' has shape \(15, 16\), expected .*multiple of r=2"),
        (_more_experts, r"counts: .*layers\.0\..* holds 16, .*layers\.1\..* holds 8"),
    ],
    ids=["1-d", "transposed", "rows", "experts"],
)
def test_read_checks_expert_tensor_shapes(saved, tmp_path, edit, match):
    """`read_peft_adapter` (which knows no model) checks what the file itself implies."""
    bad = adapter_variant(saved["down"], tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(ValueError, match=match):
        read_peft_adapter(bad)


# --------------------------------------------------------------------------- dtypes
def test_integer_tensors_are_refused_by_name(saved, tmp_path):
    def ints(t):
        t[DOWN_A] = t[DOWN_A].astype(np.int32)

    bad = adapter_variant(saved["down"], tmp_path / "int", edit_tensors=ints)
    with pytest.raises(ValueError, match=r"lora_A\.weight' has dtype int32, expected a float"):
        read_peft_adapter(bad)


def test_mixed_dtypes_are_read_without_rounding(saved, tmp_path):
    """One bfloat16 tensor made every tensor bfloat16 (the first tensor's dtype decided)."""

    def mixed(t):
        t[sorted(t)[0]] = t[sorted(t)[0]].astype(ml_dtypes.bfloat16)

    src = adapter_variant(saved["q_down"], tmp_path / "mixed", edit_tensors=mixed)
    config, _ = read_peft_adapter(src)
    assert config.param_dtype == "float32"
    model = load_peft_adapter(_model(), src)
    q_a = model.layers[0].attn.q_proj.lora.lora_a[...]
    np.testing.assert_array_equal(np.asarray(q_a), load_file(src / "adapter_model.safetensors")
                                  [Q_A].T)  # fmt: skip


# --------------------------------------------------------------------------- save, apply, stack
def test_save_names_the_layers_adapted_unlike_the_others(tmp_path):
    model = apply_lora(_model(), LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",
                       "gate_proj")), nnx.Rngs(0))  # fmt: skip
    model.layers[1].mlp.experts.lora = None  # layer 1: attention only
    with pytest.raises(ValueError, match=r"layer 0: \['gate_proj', 'q_proj'\].*layer 1: \['q_"):
        save_peft_adapter(model, tmp_path)
    model.layers[1].attn.q_proj.lora = None  # layer 1: nothing
    with pytest.raises(ValueError, match=r"layer 1: \[\]"):
        save_peft_adapter(model, tmp_path)
    assert not os.listdir(tmp_path)


def test_add_expert_adapters_refuses_names_that_are_not_expert_projections():
    model = _model()
    experts = model.layers[0].mlp.experts
    for names in (("gate",), ("q_proj", "up_proj"), ()):
        with pytest.raises(ValueError, match=r"names must be expert projections .*got"):
            add_expert_adapters(experts, names, rank=2, scale=1.0, dtype=jnp.float32,
                                rngs=nnx.Rngs(0))  # fmt: skip
        assert experts.lora is None


@pytest.mark.parametrize("stacked", [False, True])
def test_a_second_apply_or_load_is_refused_and_changes_nothing(saved, stacked):
    model = apply_lora(_model(stacked), LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",
                       "down_proj")), nnx.Rngs(0))  # fmt: skip
    before = jax.tree.map(np.asarray, nnx.state(model))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, LoRAConfig(rank=4, alpha=4.0, target_modules=EXPERTS), nnx.Rngs(1))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        load_peft_adapter(model, saved["down"])
    assert model.layers_stacked == stacked
    after = jax.tree.map(np.asarray, nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, after, before)


def test_layers_adapted_unlike_the_others_cannot_be_stacked():
    model = apply_lora(_model(), LoRAConfig(rank=2, alpha=4.0, target_modules=("up_proj",)),
                       nnx.Rngs(0))  # fmt: skip
    model.layers[0].mlp.experts.lora = None
    with pytest.raises(ValueError, match="differ in structure"):
        model.stack_layers()
