"""Small utilities shared by the models and the training code."""

from __future__ import annotations

from artifex.generative_models.utils.atomic import (
    atomic_write,
    atomic_write_json,
    commit_file,
    remove_temp_files,
    temp_path,
)

__all__ = [
    # atomic files
    "atomic_write",
    "atomic_write_json",
    "commit_file",
    "remove_temp_files",
    "temp_path",
]
