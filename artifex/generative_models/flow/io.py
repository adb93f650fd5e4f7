"""Saving and loading flow models: ``config.json`` plus ``model.safetensors``, atomically.

A flow model directory holds

- ``model.safetensors``: every variable of the model under its dotted path
  (``blocks.0.attn.qkv.kernel``), in its stored dtype; the safetensors metadata carries the
  model type and its config as JSON, so the weights file describes itself;
- ``config.json``: ``{"model_type": ..., "config": {...}}``, the same config, for people and
  tools to read.

Writes are atomic per file and keep the previous save loadable until the new one is complete:
both files are written under temporary names first, then renamed into place (weights first,
``config.json`` last), as :func:`~artifex.generative_models.models.causal_lm.save_pretrained`
does. :func:`load_flow_model` refuses a directory whose two configs disagree (a save torn
between the two renames), and weights whose names, shapes or dtypes are not the model's.

Model classes register themselves under a ``model_type`` with :func:`register_flow_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from artifex.generative_models.utils.atomic import commit_file, remove_temp_files, temp_path

__all__ = ["load_flow_model", "register_flow_model", "save_flow_model"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

# model_type -> (model class, config class)
_REGISTRY: dict[str, tuple[type, type]] = {}


def register_flow_model(model_type: str, config_class: type) -> Callable[[type], type]:
    """Class decorator: saves and loads the model class under ``model_type``.

    Args:
        model_type: The name written to ``config.json``.
        config_class: The model's frozen config dataclass (``model.config``).

    Returns:
        The decorator (it returns the class unchanged).

    Examples:
        >>> from artifex.generative_models.flow import io
        >>> sorted(t for t in io._REGISTRY if t.startswith("flow_"))[:2]
        ['flow_dit', 'flow_mlp']
    """

    def register(cls: type) -> type:
        _REGISTRY[model_type] = (cls, config_class)
        cls.model_type = model_type
        return cls

    return register


def _config_dict(config: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _config_from_dict(config_class: type, values: dict[str, Any], path: str) -> Any:
    names = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(values) - names)
    if unknown:
        msg = f"{path}: unknown {config_class.__name__} fields {unknown}"
        raise ValueError(msg)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return config_class(**kwargs)


def _tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    out = {}
    for path, value in nnx.to_flat_state(nnx.state(model)):
        name = ".".join(str(p) for p in path)
        out[name] = np.asarray(jax.device_get(value.get_value()))
    return out


def save_flow_model(model: nnx.Module, path: str | os.PathLike[str]) -> None:
    """Writes a flow model as ``config.json`` plus ``model.safetensors`` in ``path``.

    Args:
        model: A registered flow model (``FlowDiT``, ``FlowModel``, ``TextFlowDiT``).
        path: The directory (created if needed).

    Raises:
        TypeError: ``model`` is not a registered flow model.
        OSError: Writing failed (the previous save, if any, is left loadable).

    Examples:
        >>> import os, tempfile
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import (
        ...     FlowDiT, FlowDiTConfig, load_flow_model, save_flow_model)
        >>> model = FlowDiT(FlowDiTConfig(hidden_dim=16, num_blocks=1), rngs=nnx.Rngs(0))
        >>> path = tempfile.mkdtemp()
        >>> save_flow_model(model, path)
        >>> sorted(os.listdir(path))
        ['config.json', 'model.safetensors']
        >>> loaded = load_flow_model(path)
        >>> x, t = jnp.ones((2, 64)), jnp.full((2,), 0.5)
        >>> bool(jnp.array_equal(loaded(x, t, jnp.array([1, 2])), model(x, t, jnp.array([1, 2]))))
        True
    """
    model_type = getattr(type(model), "model_type", None)
    if model_type not in _REGISTRY or not isinstance(model, _REGISTRY[model_type][0]):
        msg = f"save_flow_model needs a registered flow model, got {type(model).__name__}"
        raise TypeError(msg)
    config = {"model_type": model_type, "config": _config_dict(model.config)}
    tensors = _tensors(model)
    directory = os.fspath(path)
    os.makedirs(directory, exist_ok=True)
    remove_temp_files(directory)  # left by an earlier save that was killed
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    written: list[tuple[str, str]] = []
    try:
        tmp = temp_path(os.path.join(directory, WEIGHTS_NAME))
        written.append((tmp, WEIGHTS_NAME))
        try:
            save_file(tensors, tmp, metadata={"artifex_flow_config": text})
        except OSError:
            raise
        except Exception as err:  # safetensors reports I/O errors as its own type
            code = re.search(r"os error (\d+)", str(err))
            msg = f"cannot write {os.path.join(directory, WEIGHTS_NAME)}: {err}"
            raise (OSError(int(code.group(1)), msg) if code else OSError(msg)) from err
        tmp = temp_path(os.path.join(directory, CONFIG_NAME))
        written.append((tmp, CONFIG_NAME))
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    except BaseException:
        for tmp, _ in written:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise
    for tmp, name in written:  # weights first, config.json last
        commit_file(tmp, os.path.join(directory, name))


def load_flow_model(path: str | os.PathLike[str]) -> nnx.Module:
    """Reads a flow model written by :func:`save_flow_model`.

    Args:
        path: The directory.

    Returns:
        The model (its class from ``model_type``), with the saved weights.

    Raises:
        FileNotFoundError: A file is missing.
        ValueError: An unknown ``model_type`` or config field, ``config.json`` different from
            the config stored with the weights, or weights whose names, shapes or dtypes are
            not the model's.

    Examples:
        >>> import tempfile
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import (
        ...     FlowModel, FlowModelConfig, load_flow_model, save_flow_model)
        >>> path = tempfile.mkdtemp()
        >>> save_flow_model(FlowModel(FlowModelConfig(hidden_dim=8), rngs=nnx.Rngs(0)), path)
        >>> type(load_flow_model(path)).__name__, load_flow_model(path).config.hidden_dim
        ('FlowModel', 8)
    """
    directory = os.fspath(path)
    config_path = os.path.join(directory, CONFIG_NAME)
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            msg = f"not a flow model directory: {p} is missing"
            raise FileNotFoundError(msg)
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    with safe_open(weights_path, framework="numpy") as f:
        stored = (f.metadata() or {}).get("artifex_flow_config")
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    if stored is None or json.loads(stored) != config:
        msg = (
            f"{config_path} does not match the config stored with {weights_path} "
            "(an interrupted save, or files from different models)"
        )
        raise ValueError(msg)
    model_type = config.get("model_type")
    if model_type not in _REGISTRY:
        msg = (
            f"{config_path}: unknown model_type {model_type!r}, expected one of {sorted(_REGISTRY)}"
        )
        raise ValueError(msg)
    cls, config_class = _REGISTRY[model_type]
    model = cls(
        _config_from_dict(config_class, config.get("config", {}), config_path), rngs=nnx.Rngs(0)
    )
    flat = nnx.to_flat_state(nnx.state(model))
    expected = {".".join(str(p) for p in path): v for path, v in flat}
    if set(expected) != set(tensors):
        wrong = sorted(set(expected) ^ set(tensors))
        msg = f"{weights_path}: weight names differ from the model's: {wrong[:8]}"
        raise ValueError(msg)
    for name, var in expected.items():
        want = np.asarray(var.get_value())
        got = tensors[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            msg = (
                f"{weights_path}: {name} has shape {got.shape} and dtype {got.dtype}, the model "
                f"expects {want.shape} and {want.dtype}"
            )
            raise ValueError(msg)
        var.set_value(jax.numpy.asarray(got))
    return model
