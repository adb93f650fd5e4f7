"""Shared helpers for the causal LM tests: fixture paths and expected outputs."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np

FIXTURES = pathlib.Path(__file__).resolve().parents[3] / "fixtures"
MODEL_FIXTURES = ("llama3_tiny", "qwen2_tiny", "qwen3_tiny", "llama_tiny_sharded_bf16")


def load_expected(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "expected.npz") as data:
        return {k: data[k] for k in data.files}


def adapter_variant(src, dst, edit_config=None, edit_tensors=None) -> pathlib.Path:
    """A copy of the PEFT adapter folder ``src`` at ``dst``, its config and tensors edited.

    ``edit_config(dict)`` changes ``adapter_config.json`` in place, ``edit_tensors(dict)`` the
    arrays of ``adapter_model.safetensors``.
    """
    from safetensors.numpy import load_file, save_file

    dst = pathlib.Path(dst)
    shutil.copytree(src, dst)
    if edit_config:
        with open(dst / "adapter_config.json") as f:
            d = json.load(f)
        edit_config(d)
        with open(dst / "adapter_config.json", "w") as f:
            json.dump(d, f)
    if edit_tensors:
        tensors = load_file(dst / "adapter_model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "adapter_model.safetensors")
    return dst
