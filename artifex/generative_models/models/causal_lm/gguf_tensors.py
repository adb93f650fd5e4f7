"""GGUF files at the tensor level: the magic bytes, the metadata fields, llama.cpp's tensor names.

What `read_gguf` (in `artifex.generative_models.models.causal_lm.gguf`) builds on: `is_gguf_file`
recognises a GGUF file, the `gguf` package (an optional dependency) is imported on first use,
the file's metadata splits into scalars and arrays, llama.cpp's tensor names (`blk.0.attn_q.weight`,
...) map to Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...) and back, and the
tensors are dequantized on access, with Llama's q/k rows un-interleaved and Gemma 3's `1 + w`
norms put back to `w` (see the `gguf` module docstring).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from artifex.generative_models.models.causal_lm.config import CausalLMConfig

__all__ = ["is_gguf_file"]

_MAGIC = b"GGUF"

#: llama.cpp block tensor suffix -> Hugging Face name inside `model.layers.{i}.`.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
#: Gemma 3's four norms per layer (ffn_norm is the norm before the MLP there).
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _gguf_package() -> Any:
    """The `gguf` package, or an ImportError that says how to install it."""
    try:
        import gguf as package
    except ImportError as err:
        msg = (
            "reading GGUF files needs the gguf package: pip install 'artifex-grpo[gguf]' "
            "(or pip install gguf)"
        )
        raise ImportError(msg) from err
    return package


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is an existing file that starts with the GGUF magic bytes.

    Args:
        path: Any path.

    Returns:
        True for a GGUF file, False otherwise (directories, missing files, other files).

    Examples:
        >>> from artifex.generative_models.models.causal_lm.gguf_tensors import is_gguf_file
        >>> is_gguf_file("tests/fixtures/qwen2_tiny")  # a checkpoint directory (repo root)
        False
        >>> is_gguf_file("tests/fixtures/qwen2_tiny.Q8_0.gguf")
        True
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        return False
    with open(p, "rb") as f:
        return f.read(4) == _MAGIC


def _metadata(reader: Any) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """`(scalars, arrays)`: the file's metadata fields by key."""
    package = _gguf_package()
    scalars: dict[str, Any] = {}
    arrays: dict[str, list[Any]] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types and field.types[0] == package.GGUFValueType.ARRAY:
            arrays[key] = list(value)
        else:
            scalars[key] = value
    return scalars, arrays


def _unpermute_rotary(w: np.ndarray, num_heads: int, name: str) -> np.ndarray:
    """Undoes llama.cpp's per-head row interleaving of a Llama q/k weight or bias."""
    rows = w.shape[0]
    if rows % (2 * num_heads):
        msg = f"tensor {name!r}: {rows} rows cannot be split into {num_heads} rotary heads"
        raise ValueError(msg)
    half = rows // num_heads // 2
    x = w.reshape(num_heads, half, 2, *w.shape[1:])
    return np.ascontiguousarray(x.swapaxes(1, 2).reshape(w.shape))


def _block_names(arch: str) -> dict[str, str]:
    return _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES


def _hf_name(name: str, path: str, arch: str = "llama") -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    blocks = _block_names(arch)
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in blocks:
        return f"model.layers.{parts[1]}.{blocks[parts[2]]}"
    msg = f"{path}: unsupported tensor {name!r} (not part of a {arch} model)"
    raise ValueError(msg)


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    """The llama.cpp name of a Hugging Face tensor name (the inverse of `_hf_name`)."""
    for gguf_name, name in _GLOBAL_NAMES.items():
        if name == hf_name:
            return gguf_name
    _, _, layer, rest = hf_name.split(".", 3)
    suffix = next(k for k, v in _block_names(arch).items() if v == rest)
    return f"blk.{layer}.{suffix}"


def _dequantize(package: Any, t: Any, data: np.ndarray, source: str) -> np.ndarray:
    try:
        x = np.asarray(package.quants.dequantize(data, t.tensor_type))
    except NotImplementedError as err:
        msg = (
            f"{source}: tensor {t.name!r} has type {t.tensor_type.name}, which the installed "
            f"gguf package cannot dequantize ({err})"
        )
        raise ValueError(msg) from err
    if not np.issubdtype(x.dtype, np.floating):
        msg = (
            f"{source}: tensor {t.name!r} has type {t.tensor_type.name}; weights must be "
            "floating point or quantized"
        )
        raise ValueError(msg)
    return x


class _GGUFTensors(Mapping[str, np.ndarray]):
    """Hugging Face name -> tensor, dequantized from the memory-mapped file on each access."""

    def __init__(
        self,
        package: Any,
        reader: Any,
        sources: dict[str, Any],
        shapes: dict[str, tuple[int, ...]],
        config: CausalLMConfig,
        dtype_name: str,
        source: str,
    ) -> None:
        self._package = package
        self._reader = reader  # keeps the memory map open
        self._sources = sources
        self._shapes = shapes
        self._config = config
        self._target = np.dtype(ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.float32)
        self._source = source

    def __getitem__(self, hf_name: str) -> np.ndarray:
        t = self._sources[hf_name]
        x = _dequantize(self._package, t, t.data, self._source).reshape(self._shapes[hf_name])
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        if bad:
            msg = (
                f"{self._source}: tensor {t.name!r} holds {bad} NaN or infinite values (of "
                f"{x.size}): the file is damaged or was written from a diverged model"
            )
            raise ValueError(msg)
        if self._config.norm_unit_offset and hf_name.endswith("norm.weight"):
            x = x.astype(np.float32) - np.float32(1.0)  # llama.cpp stores Gemma's 1 + w
        if self._config.model_type == "llama":
            if ".self_attn.q_proj." in hf_name:
                x = _unpermute_rotary(x, self._config.num_heads, t.name)
            elif ".self_attn.k_proj." in hf_name:
                x = _unpermute_rotary(x, self._config.num_kv_heads, t.name)
        return x.astype(self._target, copy=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __repr__(self) -> str:
        return f"<{len(self)} GGUF tensors of {self._source}, dequantized on access>"
