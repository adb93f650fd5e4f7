"""Saving and loading flow models: round trips, atomic overwrites, refused directories."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    FlowDiT,
    FlowDiTConfig,
    FlowModel,
    FlowModelConfig,
    load_flow_model,
    save_flow_model,
)
from artifex.generative_models.flow import io as flow_io


def _perturbed(model: nnx.Module, seed: int) -> nnx.Module:
    """Every parameter nonzero (the zero-initialized output layers included)."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


def _models():
    return [
        _perturbed(
            FlowModel(FlowModelConfig(image_shape=(4, 4, 3), hidden_dim=8), rngs=nnx.Rngs(1)), 1
        ),
        _perturbed(
            FlowDiT(
                FlowDiTConfig(
                    image_shape=(8, 4),
                    num_classes=3,
                    hidden_dim=16,
                    num_blocks=2,
                    num_heads=2,
                    time_features=8,
                ),
                rngs=nnx.Rngs(2),
            ),
            2,
        ),
    ]


def _flat(model):
    return {
        ".".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model))
    }


@pytest.mark.parametrize("index", [0, 1], ids=["mlp", "dit"])
def test_round_trip_is_exact(tmp_path, index):
    model = _models()[index]
    save_flow_model(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    loaded = load_flow_model(tmp_path)
    assert type(loaded) is type(model) and loaded.config == model.config
    want, got = _flat(model), _flat(loaded)
    assert set(want) == set(got) and len(want) > 5
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    d = model.config.data_dim
    x = jax.random.normal(jax.random.key(0), (3, d))
    t, y = jnp.array([0.1, 0.5, 0.9]), jnp.array([0, 1, 2])
    np.testing.assert_array_equal(np.asarray(loaded(x, t, y)), np.asarray(model(x, t, y)))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == type(model).model_type
    assert tuple(saved["config"]["image_shape"]) == model.config.image_shape


def test_overwrite_and_a_failed_save_keep_a_loadable_directory(tmp_path, monkeypatch):
    first, second = _models()
    save_flow_model(first, tmp_path)
    save_flow_model(second, tmp_path)  # another model type and shape over it
    assert type(load_flow_model(tmp_path)) is FlowDiT

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(flow_io, "save_file", broken)
    with pytest.raises(OSError, match="No space left"):
        save_flow_model(first, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]  # no temporaries
    loaded = load_flow_model(tmp_path)  # the previous save, untouched
    assert type(loaded) is FlowDiT
    np.testing.assert_array_equal(_flat(loaded)["output.kernel"], _flat(second)["output.kernel"])


def test_refused_directories(tmp_path):
    first, second = _models()
    a, b = tmp_path / "a", tmp_path / "b"
    save_flow_model(first, a)
    save_flow_model(second, b)
    with pytest.raises(FileNotFoundError, match="not a flow model directory"):
        load_flow_model(tmp_path / "missing")
    # a save torn between its two renames: the weights of one, config.json of the other
    (a / "config.json").write_text((b / "config.json").read_text())
    with pytest.raises(ValueError, match="does not match the config stored with"):
        load_flow_model(a)
    bad = json.loads((b / "config.json").read_text())
    bad["model_type"] = "unet"
    (b / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="does not match"):
        load_flow_model(b)
    with pytest.raises(TypeError, match="needs a registered flow model, got Linear"):
        save_flow_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tmp_path / "c")


def test_unknown_type_and_mismatched_weights_are_refused(tmp_path, monkeypatch):
    model = _models()[0]
    save_flow_model(model, tmp_path)
    monkeypatch.setitem(flow_io._REGISTRY, "flow_mlp", (FlowModel, FlowModelConfig))
    cfg = json.loads((tmp_path / "config.json").read_text())
    monkeypatch.delitem(flow_io._REGISTRY, "flow_mlp")
    with pytest.raises(ValueError, match="unknown model_type 'flow_mlp'"):
        load_flow_model(tmp_path)
    monkeypatch.setitem(flow_io._REGISTRY, "flow_mlp", (FlowModel, FlowModelConfig))
    # a model whose weights have other shapes than its config says
    other = FlowModel(FlowModelConfig(image_shape=(4, 4, 3), hidden_dim=16), rngs=nnx.Rngs(0))
    other.config = model.config  # claims the saved config, holds other shapes
    save_flow_model(other, tmp_path)
    with pytest.raises(ValueError, match=r"has shape .* the model expects"):
        load_flow_model(tmp_path)
    assert cfg["config"]["hidden_dim"] == 8
