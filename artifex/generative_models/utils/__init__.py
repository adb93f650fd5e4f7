"""Small utilities shared by the models and the training code."""

from __future__ import annotations

from artifex.generative_models.utils.atomic import (
    atomic_write,
    atomic_write_json,
    commit_file,
    remove_temp_files,
    temp_path,
)
from artifex.generative_models.utils.host_memory import (
    release_freed_host_memory,
    release_memory_after_compilation,
    reuse_host_memory,
)
from artifex.generative_models.utils.validation import (
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_str,
)

__all__ = [  # noqa: RUF022 - grouped by module, sorted within each group
    # atomic files
    "atomic_write",
    "atomic_write_json",
    "commit_file",
    "remove_temp_files",
    "temp_path",
    # host memory
    "release_freed_host_memory",
    "release_memory_after_compilation",
    "reuse_host_memory",
    # validation (wrong type: TypeError; out of range: ValueError)
    "check_bool",
    "check_callable",
    "check_choice",
    "check_float",
    "check_int",
    "check_str",
]
