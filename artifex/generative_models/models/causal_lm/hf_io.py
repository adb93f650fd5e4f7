"""Hugging Face checkpoints in and out: config.json + safetensors <-> a model's parameters.

This module knows the checkpoint format, not the model class: `CausalLM.from_pretrained` (in
`model.py`) builds the model abstractly (`nnx.eval_shape`, no random weights are drawn) and
`load_hf_weights` / `place_tensors` put each tensor of the checkpoint straight into its variable,
optionally sharded over a mesh. `save_pretrained` writes the same file layout transformers writes
(`model.safetensors`, or shards with `model.safetensors.index.json`), so either library reads the
other's checkpoints.

Sharding hook: `rules(param_path, shape) -> PartitionSpec` receives the dotted parameter path
(e.g. `"layers.0.attn.q_proj.kernel"`, see `model.py` for the table) and the parameter's shape in
our layout; each tensor is then placed with `jax.device_put(x, NamedSharding(mesh, spec))`.
Without `rules`, every parameter is replicated over the mesh.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save_file

from artifex.generative_models.models.causal_lm.config import CausalLMConfig, resolve_dtype
from artifex.generative_models.models.causal_lm.hf_format import (  # noqa: F401 (old path)
    IGNORED,
    INDEX_NAME,
    SAFE_NAME,
    PathParts,
    Rules,
    as_dtype,
    hf_tensor_map,
    param_path_str,
    read_hf_config,
    read_json,
    variables_by_path,
    weight_files,
)
from artifex.generative_models.utils.atomic import commit_file, remove_temp_files, temp_path

__all__ = [
    "load_hf_weights",
    "parse_size",
    "place_tensors",
    "save_pretrained",
    "to_hf_tensors",
    "write_hf_checkpoint",
]

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def place_tensors(
    model: nnx.Module,
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
    source: str = "the checkpoint",
) -> None:
    """Puts Hugging Face-named tensors into the variables of an abstract model, in place.

    `model` is typically `nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))`, whose
    variables hold shapes only. Every tensor of `hf_tensor_map(model.config)` must come exactly
    once: it is checked against the expected shape, cast to the model's parameter dtype,
    transposed for linear weights and placed (replicated / default device without `mesh`, else
    `jax.device_put(x, NamedSharding(mesh, rules(path, shape)))`). A tied model may also receive
    `lm_head.weight`, which must then equal the embedding.

    Args:
        model: The (abstract) model; it needs a `config` (a `CausalLMConfig`).
        tensors: `(hf_name, array)` pairs, arrays in Hugging Face layout ((out, in) for linear
            weights).
        mesh: Optional `jax.sharding.Mesh` to place parameters on.
        rules: Optional `rules(param_path, shape) -> PartitionSpec`, used with `mesh`.
        source: Name of where the tensors come from, used in error messages.

    Raises:
        ValueError: Naming the tensor, for an unexpected, duplicated, missing or misshapen tensor,
            or an `lm_head.weight` of a tied model that differs from the embedding.
        TypeError: If `rules` is given without `mesh`.

    Examples:
        >>> from flax import nnx
        >>> from safetensors.numpy import load_file
        >>> from artifex.generative_models.models.causal_lm import CausalLM
        >>> from artifex.generative_models.models.causal_lm.hf_io import (
        ...     place_tensors, read_hf_config)
        >>> config = read_hf_config("tests/fixtures/qwen2_tiny")  # from the repository root
        >>> model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))  # shapes only
        >>> tensors = load_file("tests/fixtures/qwen2_tiny/model.safetensors")
        >>> place_tensors(model, tensors.items(), source="qwen2_tiny")
        >>> w = tensors["model.layers.0.mlp.up_proj.weight"]  # (out, in) in the file
        >>> bool((model.layers[0].mlp.up_proj.kernel[...] == w.T).all())  # transposed, placed
        True
    """
    if rules is not None and mesh is None:
        msg = "rules were given without a mesh; pass mesh= as well"
        raise TypeError(msg)
    if getattr(model, "layers_stacked", False):
        msg = (
            "place_tensors: the model stores its layers stacked; load into a model with "
            "per-layer storage and call stack_layers() after"
        )
        raise ValueError(msg)
    config: CausalLMConfig = model.config
    dt = resolve_dtype(config.param_dtype)
    mapping = hf_tensor_map(config)
    variables = variables_by_path(model)
    seen: set[str] = set()
    tied_head: np.ndarray | None = None
    # Stacked expert weights, filled one expert at a time on the host: {path: (array, filled)}.
    stacks: dict[PathParts, tuple[np.ndarray, int]] = {}

    def put(target_path: PathParts, var: nnx.Variable, x: np.ndarray) -> None:
        shape = tuple(var.get_value().shape)
        if mesh is None:
            arr = jax.device_put(x)
        else:
            spec = PartitionSpec() if rules is None else rules(param_path_str(target_path), shape)
            arr = jax.device_put(x, NamedSharding(mesh, spec))
        var.set_value(arr)

    for name, x in tensors:
        if name in seen:
            msg = f"tensor {name!r} appears twice in {source}"
            raise ValueError(msg)
        seen.add(name)
        if name not in mapping:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                tied_head = x
                continue
            if IGNORED.match(name):
                continue
            msg = f"unexpected tensor {name!r} in {source}"
            raise ValueError(msg)
        target_path, transpose = mapping[name]
        expert = target_path[-1] if isinstance(target_path[-1], int) else None
        var = variables[target_path if expert is None else target_path[:-1]]
        shape = tuple(var.get_value().shape)
        if expert is not None:  # one expert of a stacked (E, ...) weight
            shape = shape[1:]
        hf_shape = shape[::-1] if transpose else shape
        if tuple(x.shape) != hf_shape:
            msg = f"tensor {name!r}: expected shape {hf_shape}, got {tuple(x.shape)}"
            raise ValueError(msg)
        x = as_dtype(x, dt)
        if transpose:
            x = np.ascontiguousarray(x.T)
        if expert is None:
            put(target_path, var, x)
            continue
        stacked_path = target_path[:-1]
        full_shape = tuple(var.get_value().shape)
        buffer, filled = stacks.get(stacked_path, (np.empty(full_shape, x.dtype), 0))
        buffer[expert] = x
        filled += 1
        if filled == full_shape[0]:  # every expert is in: placed, the host copy dropped
            put(stacked_path, var, buffer)
            stacks.pop(stacked_path, None)
        else:
            stacks[stacked_path] = (buffer, filled)
    missing = sorted(set(mapping) - seen)
    if missing:
        msg = f"missing tensor {missing[0]!r} in {source} ({len(missing)} missing: {missing[:8]})"
        raise ValueError(msg)
    if tied_head is not None:
        embedding = np.asarray(jax.device_get(model.embed.embedding[...]))
        if tied_head.shape != embedding.shape or not np.array_equal(
            as_dtype(tied_head, dt), embedding
        ):
            msg = (
                "tensor 'lm_head.weight': config has tie_word_embeddings=True but lm_head.weight "
                "differs from model.embed_tokens.weight"
            )
            raise ValueError(msg)
    for var_path, var in variables.items():
        if isinstance(var.get_value(), jax.ShapeDtypeStruct):
            msg = f"parameter {param_path_str(var_path)!r} was not loaded from {source}"
            raise ValueError(msg)


def load_hf_weights(
    model: nnx.Module,
    path: str | os.PathLike[str],
    *,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> None:
    """Loads the safetensors weights of a checkpoint directory into an abstract model, in place.

    Reads `model.safetensors` or the shards listed in `model.safetensors.index.json` with
    `safetensors` (NumPy) one tensor at a time and hands them to `place_tensors`. The set of
    tensor names is checked against `hf_tensor_map(model.config)` before any is read.

    Args:
        model: The abstract model (see `place_tensors`).
        path: Checkpoint directory.
        mesh: Optional `jax.sharding.Mesh` to place parameters on.
        rules: Optional `rules(param_path, shape) -> PartitionSpec`, used with `mesh`.

    Raises:
        FileNotFoundError: If the safetensors files are missing.
        ValueError: Naming the tensor, for a missing, unexpected or misshapen tensor.
        TypeError: If `rules` is given without `mesh`.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM
        >>> from artifex.generative_models.models.causal_lm.hf_io import (
        ...     load_hf_weights, read_hf_config)
        >>> path = "tests/fixtures/qwen2_tiny"  # from the repository root
        >>> config = read_hf_config(path)
        >>> abstract = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))  # no memory
        >>> load_hf_weights(abstract, path)
        >>> abstract.embed.embedding[...].shape
        (128, 32)
    """
    directory = os.fspath(path)
    if rules is not None and mesh is None:
        msg = "from_pretrained: rules were given without a mesh; pass mesh= as well"
        raise TypeError(msg)
    files = weight_files(directory)
    config: CausalLMConfig = model.config
    mapping = hf_tensor_map(config)
    present = {name for names in files.values() for name in names}
    extra = sorted(n for n in present - set(mapping) if not IGNORED.match(n))
    if config.tie_word_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")
    if extra:
        msg = f"unexpected tensor {extra[0]!r} in {directory!r} ({len(extra)} unexpected: {extra})"
        raise ValueError(msg)
    missing = sorted(set(mapping) - present)
    if missing:
        msg = (
            f"missing tensor {missing[0]!r} in {directory!r} "
            f"({len(missing)} missing: {missing[:8]})"
        )
        raise ValueError(msg)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for fname, names in files.items():
            with safe_open(fname, framework="numpy") as f:
                for name in names:
                    if not IGNORED.match(name):
                        yield name, f.get_tensor(name)

    place_tensors(model, tensors(), mesh=mesh, rules=rules, source=repr(directory))


def _lora_paths(model: nnx.Module) -> Iterator[str]:
    for path, var in variables_by_path(model).items():
        if isinstance(var, nnx.LoRAParam):
            yield param_path_str(path)


def _gathered(x: Any) -> np.ndarray:
    """The full host value of a parameter; one spread over several processes is all-gathered.

    The gather is a collective: in a multi-host run every process must call this (through
    :func:`to_hf_tensors` or :func:`save_pretrained`) in the same order.
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def to_hf_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """Returns the model's parameters as host NumPy arrays under Hugging Face names and layouts.

    Args:
        model: A model without LoRA adapters (per-layer or stacked layers).

    Returns:
        `{hf_name: array}` (linear weights (out, in); bfloat16 stays `ml_dtypes.bfloat16`).

    Raises:
        ValueError: If the model still has LoRA adapters (merge them first with `merge_lora`).

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, to_hf_tensors)
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=12,
        ...                      num_layers=1, num_heads=2)
        >>> tensors = to_hf_tensors(CausalLM(cfg, rngs=nnx.Rngs(0)))
        >>> tensors["model.layers.0.mlp.up_proj.weight"].shape  # (out, in), as transformers stores
        (12, 8)
        >>> len(tensors)
        12
    """
    lora = list(_lora_paths(model))
    if lora:
        msg = (
            f"model has LoRA adapters (e.g. {lora[0]!r}); call merge_lora(model) before saving "
            "a Hugging Face checkpoint"
        )
        raise ValueError(msg)
    variables = variables_by_path(model)
    stacked = getattr(model, "layers_stacked", False)
    gathered: dict[PathParts, np.ndarray] = {}  # stacked layer weights, read once each
    out: dict[str, np.ndarray] = {}
    for name, (target_path, transpose) in hf_tensor_map(model.config).items():
        expert = target_path[-1] if isinstance(target_path[-1], int) else None
        if expert is not None:  # row `expert` of a stacked expert weight
            target_path = target_path[:-1]
        if stacked and target_path[0] == "layers":  # ("layers", i, ...) is ("layers", ...)[i]
            key = (target_path[0], *target_path[2:])
            if key not in gathered:
                gathered[key] = _gathered(variables[key].get_value())
            x = gathered[key][target_path[1]]
        elif expert is not None:
            if target_path not in gathered:
                gathered[target_path] = _gathered(variables[target_path].get_value())
            x = gathered[target_path]
        else:
            x = _gathered(variables[target_path].get_value())
        if expert is not None:
            x = x[expert]
        out[name] = np.ascontiguousarray(x.T) if transpose else x
    return out


def parse_size(size: int | str) -> int:
    """Parses a shard size: an int of bytes or a string such as "5GB", "200MiB", "40KB".

    Decimal units (KB, MB, GB) are powers of 10 and binary units (KiB, MiB, GiB) powers of 2, as
    in transformers.

    Args:
        size: The size.

    Returns:
        The number of bytes.

    Raises:
        ValueError: If the size cannot be parsed or is not positive.

    Examples:
        >>> from artifex.generative_models.models.causal_lm.hf_io import parse_size
        >>> parse_size("5GB"), parse_size("200MiB"), parse_size(1024)
        (5000000000, 209715200, 1024)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            msg = f"max_shard_size must be an int or a string like '5GB', got {size!r}"
            raise ValueError(msg)
        n = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if n <= 0:
        msg = f"max_shard_size must be positive, got {size!r}"
        raise ValueError(msg)
    return n


def _save_file(tensors: dict[str, np.ndarray], tmp: str, final: str) -> None:
    """``safetensors`` ``save_file``, its I/O failures raised as ``OSError`` naming the file."""
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
    except OSError:
        raise
    except Exception as err:  # safetensors reports I/O errors (a full disk) as its own type
        code = re.search(r"os error (\d+)", str(err))
        errno_ = int(code.group(1)) if code else None
        msg = f"cannot write {final}: {err}"
        raise OSError(errno_, msg) if errno_ is not None else OSError(msg) from err


def save_pretrained(
    model: nnx.Module, path: str | os.PathLike[str], *, max_shard_size: int | str | None = None
) -> None:
    """Writes `model` as a Hugging Face checkpoint directory.

    Writes `config.json` (`config.to_hf_config()`) and the weights under transformers' names and
    layouts in their stored dtype: one `model.safetensors`, or, when the total exceeds
    `max_shard_size`, `model-0000k-of-0000n.safetensors` shards plus
    `model.safetensors.index.json`. Tied models get no `lm_head.weight`.

    The write is atomic per file and safe for the previous export: every new file is written
    under a temporary name first, so a failure (a full disk, a kill) leaves the previous export
    in the directory loadable; then the files are renamed into place and weight files of the
    previous layout that the new one does not use are removed, so no stale shard is read back.

    In a multi-host run every process calls it: parameters spread over several processes are
    all-gathered (a collective), and only process 0 writes the directory.

    Args:
        model: The model (merge LoRA adapters first).
        path: Output directory, created if needed.
        max_shard_size: Optional largest shard, bytes or a string like "2GB"; None writes one file.

    Raises:
        ValueError: If the model has LoRA adapters or `max_shard_size` is invalid.
        OSError: If writing fails (the previous export, if any, is left loadable).

    Examples:
        >>> import os, tempfile
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, save_pretrained)
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> path = tempfile.mkdtemp()
        >>> save_pretrained(CausalLM(cfg, rngs=nnx.Rngs(0)), path)
        >>> sorted(os.listdir(path))
        ['config.json', 'model.safetensors']
        >>> CausalLM.from_pretrained(path).config.hidden_size
        8
    """
    tensors = to_hf_tensors(model)  # every process: parameters gathered across hosts
    if jax.process_index() != 0:
        return  # multi-host: process 0 writes the files, the others only took part in the gather
    write_hf_checkpoint(tensors, model.config, path, max_shard_size=max_shard_size)


def write_hf_checkpoint(
    tensors: Mapping[str, np.ndarray],
    config: CausalLMConfig,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None = None,
) -> None:
    """Writes Hugging Face-named tensors and `config.json` as a checkpoint directory.

    The file layout and the atomicity are those of `save_pretrained` (which calls this after
    gathering the model's parameters); use it directly for tensors that come from elsewhere (a
    converted GGUF file).

    Args:
        tensors: `{hf_name: array}` in Hugging Face layout, exactly the names of
            `hf_tensor_map(config)`.
        config: The architecture, written as `config.json`.
        path: Output directory, created if needed.
        max_shard_size: Optional largest shard, bytes or a string like "2GB"; None writes one file.

    Raises:
        ValueError: If a tensor is missing or unexpected, or `max_shard_size` is invalid.
        OSError: If writing fails (the previous export, if any, is left loadable).

    Examples:
        >>> import os, tempfile
        >>> from artifex.generative_models.models.causal_lm import CausalLM, to_hf_tensors
        >>> from artifex.generative_models.models.causal_lm.hf_io import write_hf_checkpoint
        >>> model = CausalLM.from_pretrained("tests/fixtures/qwen2_tiny")  # repository root
        >>> out = tempfile.mkdtemp()
        >>> write_hf_checkpoint(to_hf_tensors(model), model.config, out)
        >>> sorted(os.listdir(out))
        ['config.json', 'model.safetensors']
    """
    expected = set(hf_tensor_map(config))
    if set(tensors) != expected:
        wrong = sorted(set(tensors) ^ expected)
        msg = f"tensors: expected exactly the names of hf_tensor_map(config); mismatch: {wrong[:8]}"
        raise ValueError(msg)
    directory = os.fspath(path)
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    os.makedirs(directory, exist_ok=True)
    remove_temp_files(directory)  # left by an earlier save that was killed

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, x in tensors.items():
        if limit is not None and shards[-1] and size + x.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    names = (
        [SAFE_NAME]
        if len(shards) == 1
        else [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    )
    # Every new file is written completely under a temporary name first; the previous export is
    # untouched (and loadable) until all of them exist, then each is renamed into place: weights
    # first, the index next, config.json last, and only then are stale files of the old
    # layout removed.
    written: list[tuple[str, str]] = []
    try:
        for fname, shard in zip(names, shards, strict=True):
            tmp = temp_path(os.path.join(directory, fname))
            written.append((tmp, fname))
            _save_file(shard, tmp, os.path.join(directory, fname))
        files = list(names)
        if len(shards) > 1:
            weight_map = {
                n: fname for fname, shard in zip(names, shards, strict=True) for n in shard
            }
            index = {
                "metadata": {"total_size": int(sum(x.nbytes for s in shards for x in s.values()))},
                "weight_map": dict(sorted(weight_map.items())),
            }
            tmp = temp_path(os.path.join(directory, INDEX_NAME))
            written.append((tmp, INDEX_NAME))
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
            files.append(INDEX_NAME)
        tmp = temp_path(os.path.join(directory, "config.json"))
        written.append((tmp, "config.json"))
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(config.to_hf_config(), f, indent=2, sort_keys=True)
            f.write("\n")
    except BaseException:
        for tmp, _ in written:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise
    if len(shards) == 1:  # the old index (if any) would shadow the new single file: drop it
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, INDEX_NAME))
    for tmp, fname in written:
        commit_file(tmp, os.path.join(directory, fname))
    stale = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")
    for fname in os.listdir(directory):
        if stale.fullmatch(fname) and fname not in files:
            os.remove(os.path.join(directory, fname))
