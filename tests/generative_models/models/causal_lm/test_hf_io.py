"""Tests for artifex/generative_models/models/causal_lm/hf_io.py against transformers fixtures."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from artifex.generative_models.models.causal_lm import (
    CausalLM,
    CausalLMConfig,
    from_pretrained,
    hf_tensor_map,
    save_pretrained,
)
from artifex.generative_models.models.causal_lm.hf_io import parse_size

from ._helpers import FIXTURES, MODEL_FIXTURES, load_expected


@nnx.jit
def _fwd(m, ids, mask, positions=None):
    return m(ids, mask, positions)


def _max_err(model, name):
    e = load_expected(name)
    logits = _fwd(model, jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"]))
    real = e["attention_mask"].astype(bool)
    return float(np.abs(np.asarray(logits) - e["logits"])[real].max()), e


def _tensors(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(k)
                out[k] = (t.shape, t.dtype)
    return out


@pytest.mark.parametrize("name", MODEL_FIXTURES)
def test_matches_transformers_logits(name):
    model = from_pretrained(FIXTURES / name, dtype="float32")
    err, e = _max_err(model, name)
    assert err <= 1e-4, err
    # the explicit positions HF used are the default ones derived from the mask
    pos = _fwd(
        model,
        jnp.asarray(e["input_ids"]),
        jnp.asarray(e["attention_mask"]),
        jnp.asarray(e["position_ids"]),
    )
    real = e["attention_mask"].astype(bool)
    assert float(np.abs(np.asarray(pos) - e["logits"])[real].max()) <= 1e-4


def test_bf16_checkpoint_loads_in_its_dtype():
    name = "llama_tiny_sharded_bf16"
    assert (FIXTURES / name / "model.safetensors.index.json").exists()
    model = from_pretrained(FIXTURES / name)
    assert model.config.param_dtype == "bfloat16"
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    err, e = _max_err(model, name)
    assert err < 0.05 * np.abs(e["logits"]).max(), err


@pytest.mark.parametrize("name", MODEL_FIXTURES)
def test_save_reload_identical_and_same_layout_as_hf(name, tmp_path):
    model = CausalLM.from_pretrained(FIXTURES / name)
    model.save_pretrained(tmp_path)
    ours, theirs = _tensors(tmp_path), _tensors(FIXTURES / name)
    assert ours == theirs
    again = from_pretrained(tmp_path)
    e = load_expected(name)
    args = jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"])
    np.testing.assert_array_equal(np.asarray(_fwd(again, *args)), np.asarray(_fwd(model, *args)))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (
        saved["model_type"]
        == json.loads((FIXTURES / name / "config.json").read_text())["model_type"]
    )
    assert CausalLMConfig.from_hf_config(saved) == model.config


def test_save_sharded(tmp_path):
    model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
    save_pretrained(model, tmp_path, max_shard_size="300KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    assert not (tmp_path / "model.safetensors").exists()
    for f in files:
        shard = load_file(str(tmp_path / f))
        assert len(shard) == 1 or sum(x.nbytes for x in shard.values()) <= 300_000
    assert index["metadata"]["total_size"] == model.config.num_params() * 4
    again = from_pretrained(tmp_path)
    ids = jnp.arange(1, 9, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(
        np.asarray(_fwd(again, ids, None)), np.asarray(_fwd(model, ids, None))
    )
    # saving again unsharded removes the stale shards
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2MiB") == 2 * 2**20
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _edit_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_error_missing_tensor(tmp_path):
    d = _copy("qwen2_tiny", tmp_path)
    _edit_tensors(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(
        ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"
    ):
        from_pretrained(d)


def test_error_unexpected_tensor(tmp_path):
    d = _copy("qwen2_tiny", tmp_path)
    _edit_tensors(d, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        from_pretrained(d)


def test_error_shape_mismatch(tmp_path):
    d = _copy("qwen3_tiny", tmp_path)

    def edit(t):
        t["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)

    _edit_tensors(d, edit)
    with pytest.raises(ValueError, match=r"q_norm\.weight'.*expected shape \(16,\), got \(8,\)"):
        from_pretrained(d)


def test_error_unsupported_model_type(tmp_path):
    d = _copy("llama3_tiny", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gpt_neox"):
        from_pretrained(d)


def test_tied_lm_head_accepted_if_equal_else_error(tmp_path):
    d = _copy("qwen2_tiny", tmp_path)
    _edit_tensors(d, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    from_pretrained(d)
    _edit_tensors(d, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        from_pretrained(d)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        from_pretrained(tmp_path)
    shutil.copy(FIXTURES / "qwen2_tiny" / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        from_pretrained(tmp_path)


def test_hf_tensor_map_covers_every_parameter():
    for cfg in (
        CausalLMConfig.tiny(),
        CausalLMConfig.qwen2_w1(),
        CausalLMConfig.tiny(model_type="qwen3", qk_norm=True, attention_bias=True),
    ):
        model = nnx.eval_shape(lambda cfg=cfg: CausalLM(cfg, rngs=nnx.Rngs(0)))
        paths = {tuple(p) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        mapped = [p for p, _ in hf_tensor_map(cfg).values()]
        assert len(mapped) == len(set(mapped)) and set(mapped) == paths


def test_mesh_and_rules_place_each_parameter():
    devices = np.array(jax.devices()[:2])
    if devices.size < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(devices, ("model",))
    seen = {}

    def rules(path, shape):
        seen[path] = shape
        if path.endswith(("q_proj.kernel", "gate_proj.kernel", "up_proj.kernel")):
            return PartitionSpec(None, "model")
        return PartitionSpec()

    model = from_pretrained(FIXTURES / "llama3_tiny", mesh=mesh, rules=rules)
    assert seen["layers.0.attn.q_proj.kernel"] == (64, 64)
    assert seen["embed.embedding"] == (128, 64)
    q = model.layers[0].attn.q_proj.kernel[...]
    assert q.sharding.spec == PartitionSpec(None, "model")
    assert model.embed.embedding[...].sharding.is_fully_replicated
    err, _ = _max_err(model, "llama3_tiny")
    assert err <= 1e-4


def test_rules_without_mesh_is_an_error():
    with pytest.raises(TypeError, match="mesh"):
        from_pretrained(FIXTURES / "llama3_tiny", rules=lambda p, s: PartitionSpec())


def test_save_refuses_lora(tmp_path):
    from artifex.generative_models.models.causal_lm import LoRAConfig, apply_lora

    model = apply_lora(
        CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0)), LoRAConfig(rank=2, alpha=4), nnx.Rngs(1)
    )
    with pytest.raises(ValueError, match="merge_lora"):
        save_pretrained(model, tmp_path)


def test_transformers_reads_our_checkpoint(tmp_path):
    """Optional: transformers loads what we write and computes the same logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    rng = np.random.default_rng(0)
    configs = {
        "llama": CausalLMConfig.tiny(
            vocab_size=96,
            initializer_range=0.1,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 8.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen2": CausalLMConfig.qwen2_w1(vocab_size=96, num_layers=2, initializer_range=0.1),
        "qwen3": CausalLMConfig.tiny(
            model_type="qwen3", qk_norm=True, vocab_size=96, head_dim=16, initializer_range=0.1
        ),
    }
    e = load_expected("llama3_tiny")
    ids, mask = e["input_ids"] % 96, e["attention_mask"]
    for i, (kind, cfg) in enumerate(configs.items()):
        model = CausalLM(cfg, rngs=nnx.Rngs(i))
        # randomise norms so a wrong mapping would show
        for layer in model.layers:
            layer.attn_norm.scale.set_value(
                jnp.asarray(1 + 0.2 * rng.normal(size=cfg.hidden_size), jnp.float32)
            )
        out = tmp_path / kind
        save_pretrained(model, out)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
        assert type(hf).__name__ == cfg.to_hf_config()["architectures"][0]
        with torch.no_grad():
            ref = hf(
                input_ids=torch.from_numpy(ids.astype(np.int64)),
                attention_mask=torch.from_numpy(mask.astype(np.int64)),
                position_ids=torch.from_numpy(e["position_ids"].astype(np.int64)),
            ).logits.numpy()
        got = np.asarray(_fwd(model, jnp.asarray(ids), jnp.asarray(mask)))
        real = mask.astype(bool)
        assert np.abs(got - ref)[real].max() <= 1e-4, kind
