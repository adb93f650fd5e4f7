"""Shared helpers for the causal LM tests: fixture paths and expected outputs."""

from __future__ import annotations

import pathlib

import numpy as np

FIXTURES = pathlib.Path(__file__).resolve().parents[3] / "fixtures"
MODEL_FIXTURES = ("llama3_tiny", "qwen2_tiny", "qwen3_tiny", "llama_tiny_sharded_bf16")


def load_expected(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "expected.npz") as data:
        return {k: data[k] for k in data.files}
