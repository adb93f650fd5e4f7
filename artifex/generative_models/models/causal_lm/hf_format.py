"""The Hugging Face checkpoint format: file names, the tensor-name map, config and file index.

What :mod:`~artifex.generative_models.models.causal_lm.hf_io` reads and writes with:
:func:`hf_tensor_map` maps each Hugging Face tensor name to a parameter path of ``CausalLM``
(and whether it is stored transposed), :func:`param_path_str` spells a path the way the
sharding rules see it, :func:`read_hf_config` reads ``config.json``, and the checkpoint's
files (``model.safetensors``, or shards listed in ``model.safetensors.index.json``) are found
and checked here. Everything is importable from ``hf_io`` as well.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec
from safetensors import safe_open

from artifex.generative_models.models.causal_lm.config import CausalLMConfig

__all__ = ["hf_tensor_map", "param_path_str", "read_hf_config"]

PathParts = tuple[Any, ...]
Rules = Callable[[str, tuple[int, ...]], PartitionSpec]

SAFE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: Buffers some old checkpoints carry that are recomputed from the config.
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")


def param_path_str(path: PathParts) -> str:
    """Joins an NNX state path into the dotted string used by partition rules.

    Args:
        path: Path parts, e.g. `("layers", 0, "attn", "q_proj", "kernel")`.

    Returns:
        The dotted path, e.g. `"layers.0.attn.q_proj.kernel"`.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import param_path_str
        >>> param_path_str(("layers", 0, "attn", "q_proj", "kernel"))
        'layers.0.attn.q_proj.kernel'
    """
    return ".".join(str(p) for p in path)


def hf_tensor_map(config: CausalLMConfig) -> dict[str, tuple[PathParts, bool]]:
    """Maps every Hugging Face tensor name of `config`'s model to our parameter path.

    Args:
        config: The architecture.

    Returns:
        `{hf_name: (path, transpose)}`, where `transpose` is True for linear weights
        (HF stores (out, in); our kernels are (in, out)). `lm_head.weight` is absent when the
        embeddings are tied. For Gemma 3, `post_attention_layernorm` is the norm after the
        attention block (`post_attn_norm`), `pre_feedforward_layernorm` the one before the MLP
        (`mlp_norm`) and `post_feedforward_layernorm` the one after it (`post_mlp_norm`). For
        Qwen3-MoE the router `mlp.gate.weight` is `mlp.gate.kernel` and each expert's
        `mlp.experts.j.{gate,up,down}_proj.weight` is row `j` of the stacked
        `mlp.experts.{gate,up,down}_proj`: its path ends with the expert index `j`.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import CausalLMConfig, hf_tensor_map
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> mapping = hf_tensor_map(cfg)
        >>> mapping["model.layers.0.self_attn.q_proj.weight"]
        (('layers', 0, 'attn', 'q_proj', 'kernel'), True)
        >>> mapping["model.embed_tokens.weight"]
        (('embed', 'embedding'), False)
    """
    out: dict[str, tuple[PathParts, bool]] = {
        "model.embed_tokens.weight": (("embed", "embedding"), False),
        "model.norm.weight": (("final_norm", "scale"), False),
    }
    for i in range(config.num_layers):
        hf = f"model.layers.{i}"
        ours: PathParts = ("layers", i)
        out[f"{hf}.input_layernorm.weight"] = ((*ours, "attn_norm", "scale"), False)
        if config.post_norms:  # Gemma 3: a norm after each block, and one before the MLP
            for name, norm in (
                ("post_attention_layernorm", "post_attn_norm"),
                ("pre_feedforward_layernorm", "mlp_norm"),
                ("post_feedforward_layernorm", "post_mlp_norm"),
            ):
                out[f"{hf}.{name}.weight"] = ((*ours, norm, "scale"), False)
        else:
            out[f"{hf}.post_attention_layernorm.weight"] = ((*ours, "mlp_norm", "scale"), False)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{hf}.self_attn.{proj}.weight"] = ((*ours, "attn", proj, "kernel"), True)
        if config.attention_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                out[f"{hf}.self_attn.{proj}.bias"] = ((*ours, "attn", proj, "bias"), False)
        if config.attention_out_bias:
            out[f"{hf}.self_attn.o_proj.bias"] = ((*ours, "attn", "o_proj", "bias"), False)
        if config.qk_norm:
            out[f"{hf}.self_attn.q_norm.weight"] = ((*ours, "attn", "q_norm", "scale"), False)
            out[f"{hf}.self_attn.k_norm.weight"] = ((*ours, "attn", "k_norm", "scale"), False)
        if config.is_moe:
            out[f"{hf}.mlp.gate.weight"] = ((*ours, "mlp", "gate", "kernel"), True)
            for j in range(config.num_experts):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    path = (*ours, "mlp", "experts", proj, j)
                    out[f"{hf}.mlp.experts.{j}.{proj}.weight"] = (path, True)
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{hf}.mlp.{proj}.weight"] = ((*ours, "mlp", proj, "kernel"), True)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (("lm_head", "kernel"), True)
    return out


def variables_by_path(model: nnx.Module) -> dict[PathParts, nnx.Variable]:
    return {
        tuple(path): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)
    }


def read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def weight_files(directory: str) -> dict[str, list[str]]:
    """Returns `{file: [tensor names]}` for the checkpoint in `directory`."""
    index_path = os.path.join(directory, INDEX_NAME)
    single_path = os.path.join(directory, SAFE_NAME)
    if os.path.exists(index_path):
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            msg = f"{index_path}: expected a 'weight_map' object, got {weight_map!r}"
            raise ValueError(msg)
        files: dict[str, list[str]] = {}
        root = os.path.realpath(directory)
        for name, fname in weight_map.items():
            full = os.path.realpath(os.path.join(directory, str(fname)))
            if not isinstance(fname, str) or os.path.dirname(full) != root:
                msg = (
                    f"{index_path}: weight_map[{name!r}] = {fname!r} must name a file inside "
                    f"the model directory {directory!r}"
                )
                raise ValueError(msg)
            files.setdefault(os.path.join(directory, fname), []).append(name)
        for fname, names in files.items():
            with safe_open(fname, framework="numpy") as f:
                keys = set(f.keys())
            absent = [n for n in names if n not in keys]
            if absent:
                msg = f"tensor {absent[0]!r} is listed in {INDEX_NAME} but missing from {fname}"
                raise ValueError(msg)
        return files
    if os.path.exists(single_path):
        with safe_open(single_path, framework="numpy") as f:
            return {single_path: list(f.keys())}
    msg = f"no {SAFE_NAME} or {INDEX_NAME} in {directory!r} (only safetensors are supported)"
    raise FileNotFoundError(msg)


def as_dtype(x: np.ndarray, dtype: jnp.dtype) -> np.ndarray:
    target = np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)
    return x if x.dtype == target else x.astype(target)


def read_hf_config(path: str | os.PathLike[str]) -> CausalLMConfig:
    """Reads the `config.json` of a Hugging Face checkpoint directory.

    Args:
        path: Checkpoint directory.

    Returns:
        The config (`CausalLMConfig.from_hf_config`).

    Raises:
        FileNotFoundError: If there is no config.json in `path`.
        ValueError: For an unsupported model_type or setting (see `CausalLMConfig.from_hf_config`).

    Examples:
        >>> from artifex.generative_models.models.causal_lm.hf_io import read_hf_config
        >>> config = read_hf_config("tests/fixtures/qwen2_tiny")  # from the repository root
        >>> config.model_type, config.num_layers, config.hidden_size
        ('qwen2', 2, 32)
    """
    directory = os.fspath(path)
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        msg = f"no config.json in {directory!r}"
        raise FileNotFoundError(msg)
    return CausalLMConfig.from_hf_config(read_json(config_path))
