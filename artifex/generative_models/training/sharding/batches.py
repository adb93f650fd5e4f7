"""Batches on a mesh: rows split over the data axes, process row ranges, host copies.

Part of the package :mod:`artifex.generative_models.training.sharding`, which re-exports
every public name (see its docstring).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from artifex.generative_models.training.sharding.mesh import DATA_AXES, check_mesh
from artifex.generative_models.training.sharding.rules import _check_axes

__all__ = [
    "batch_partition_spec",
    "host_array",
    "num_data_shards",
    "process_row_range",
    "shard_batch",
]

T = TypeVar("T")


def _data_axes(mesh: Mesh, data_axes: Sequence[str] | None) -> tuple[str, ...]:
    if data_axes is None:
        axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
        if not axes:
            msg = (
                f"the mesh has none of the data axes {DATA_AXES} (mesh axes: "
                f"{tuple(mesh.axis_names)}); pass data_axes="
            )
            raise ValueError(msg)
        return axes
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    _check_axes(PartitionSpec(axes), mesh, f"data_axes={axes}")
    return axes


def num_data_shards(mesh: Mesh, data_axes: Sequence[str] | None = None) -> int:
    """How many row shards a batch is split into: the product of the data axes' sizes.

    Args:
        mesh: The mesh.
        data_axes: Axes the rows are split over (default: those of ``("data", "fsdp")`` the
            mesh has).

    Returns:
        ``S = prod(mesh.shape[a] for a in data_axes)``.

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training import make_mesh, num_data_shards
        >>> mesh = make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])  # 8 devices
        >>> num_data_shards(mesh), num_data_shards(mesh, data_axes=("data",))
        (4, 2)
    """
    return math.prod(mesh.shape[a] for a in _data_axes(mesh, data_axes))


def batch_partition_spec(mesh: Mesh, data_axes: Sequence[str] | None = None) -> PartitionSpec:
    """The spec of a row-major batch array: rows over the data axes together, rest replicated.

    Args:
        mesh: The mesh.
        data_axes: Axes the rows are split over (default: ``("data", "fsdp")`` as present).

    Returns:
        ``PartitionSpec(("data", "fsdp"))``.

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training import batch_partition_spec, make_mesh
        >>> mesh = make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])  # 4 devices
        >>> batch_partition_spec(mesh), batch_partition_spec(mesh, data_axes=("data",))
        (P(('data', 'fsdp'),), P('data',))
    """
    return PartitionSpec(_data_axes(mesh, data_axes))


def _local_shards(sharding: NamedSharding, rows: int) -> list[tuple[int, int]]:
    """Distinct ``(start, stop)`` row ranges this process's devices hold, in row order."""
    ranges = set()
    for index in sharding.addressable_devices_indices_map((rows,)).values():
        sl = index[0]
        ranges.add((sl.start or 0, rows if sl.stop is None else sl.stop))
    return sorted(ranges)


def process_row_range(
    num_rows: int, mesh: Mesh, data_axes: Sequence[str] | None = None
) -> tuple[int, int]:
    """The contiguous rows ``[start, stop)`` of a global batch that this process feeds.

    With :func:`make_mesh` the data shards of one process are contiguous, so each process
    loads ``global_batch[start:stop]`` (whole groups when ``num_groups`` is a multiple of the
    number of processes) and passes it to ``shard_batch(..., process_local=True)``.

    Args:
        num_rows: Rows ``B`` of the global batch.
        mesh: The mesh.
        data_axes: Axes the rows are split over (default: ``("data", "fsdp")`` as present).

    Returns:
        ``(start, stop)``; ``(0, num_rows)`` in a single process.

    Raises:
        ValueError: ``num_rows`` is not a multiple of the number of data shards, or this
            process's shards are not contiguous (a hand-built mesh).

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training import make_mesh, process_row_range
        >>> process_row_range(16, make_mesh(data=2, devices=jax.devices()[:2]))  # one process
        (0, 16)
    """
    shards = num_data_shards(mesh, data_axes)
    if num_rows % shards:
        msg = (
            f"a batch of {num_rows} rows cannot be split evenly over {shards} data shards "
            f"({_axes_desc(mesh, data_axes)})"
        )
        raise ValueError(msg)
    sharding = NamedSharding(mesh, batch_partition_spec(mesh, data_axes))
    ranges = _local_shards(sharding, num_rows)
    for (_, stop), (start, _) in itertools.pairwise(ranges):
        if stop != start:
            msg = (
                f"this process's data shards {ranges} are not contiguous rows; build the mesh "
                "with make_mesh (devices ordered by process)"
            )
            raise ValueError(msg)
    return ranges[0][0], ranges[-1][1]


def _axes_desc(mesh: Mesh, data_axes: Sequence[str] | None) -> str:
    return " * ".join(f"{a}={mesh.shape[a]}" for a in _data_axes(mesh, data_axes))


def shard_batch(
    batch: T,
    mesh: Mesh,
    *,
    process_local: bool = False,
    data_axes: Sequence[str] | None = None,
) -> T:
    """Splits a batch's rows over the data axes of ``mesh``, in contiguous blocks, in order.

    Every array's leading dimension (rows) is sharded over ``data_axes`` together
    (``PartitionSpec(("data", "fsdp"))``), the rest replicated, so shard ``s`` of ``S`` holds
    rows ``[s B/S, (s+1) B/S)``: with ``num_groups % S == 0`` each group lies on one shard.
    Arrays already laid out that way are left as they are.

    With ``process_local=True`` the batch holds only this process's rows (the range
    :func:`process_row_range` gives, as NumPy or JAX arrays) and the global arrays are
    assembled with ``jax.make_array_from_process_local_data``; in a single process that is
    the whole batch.

    Args:
        batch: Any pytree of row-major arrays ``(B, ...)`` (e.g. a ``GRPOBatch``; a batch with
            a ``group_size`` attribute keeps its groups whole).
        mesh: The mesh.
        process_local: Whether ``batch`` holds only this process's rows.
        data_axes: Axes the rows are split over (default: ``("data", "fsdp")`` as present).

    Returns:
        The same pytree with sharded ``jax.Array`` leaves.

    Raises:
        ValueError: The rows (or, for a batch with a ``group_size``, the groups) cannot be
            split evenly over the data shards; the message names both numbers. Leaves
            disagree on the rows, or ``data_axes`` names an unknown axis.
        TypeError: ``mesh`` is not a ``Mesh``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.training import make_mesh, shard_batch
        >>> mesh = make_mesh(data=2, devices=jax.devices()[:2])  # 2 devices
        >>> batch = shard_batch({"rewards": jnp.arange(8.0), "ids": jnp.zeros((8, 3))}, mesh)
        >>> batch["ids"].sharding.spec
        P(('data', 'fsdp'),)
        >>> [s.data.tolist() for s in batch["rewards"].addressable_shards]
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    """
    check_mesh(mesh, "shard_batch")
    shards = num_data_shards(mesh, data_axes)
    spec = batch_partition_spec(mesh, data_axes)
    rows_sharding = NamedSharding(mesh, spec)
    leaves = [x for x in jax.tree.leaves(batch) if np.ndim(x) > 0]
    if not leaves:
        return batch
    rows = {int(np.shape(x)[0]) for x in leaves}
    if len(rows) != 1:
        msg = f"shard_batch: every array must have the same number of rows, got {sorted(rows)}"
        raise ValueError(msg)
    (b,) = rows
    where = "this process's" if process_local else "a"
    if process_local:
        local = _local_shards(rows_sharding, shards)  # one row per shard: which shards are here
        n_local = len(local)
        if b % n_local:
            msg = (
                f"{where} batch of {b} rows cannot be split evenly over its {n_local} local data "
                f"shards (of {shards}: {_axes_desc(mesh, data_axes)})"
            )
            raise ValueError(msg)
        global_rows = b * shards // n_local
    else:
        global_rows = b
    if global_rows % shards:
        msg = (
            f"a batch of {global_rows} rows cannot be split evenly over {shards} data shards "
            f"({_axes_desc(mesh, data_axes)}); use a multiple of {shards} rows"
        )
        g = getattr(batch, "group_size", 0)  # a batch type with fixed-size groups (duck-typed)
        if getattr(batch, "group_ids", None) is None and isinstance(g, int) and g > 0:
            msg += f" (e.g. a multiple of {shards // math.gcd(shards, g)} groups of {g})"
        raise ValueError(msg)

    def put(x: Any) -> Any:
        if np.ndim(x) == 0:
            return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
        if process_local:
            data = np.asarray(x)
            shape = (global_rows, *np.shape(x)[1:])
            return jax.make_array_from_process_local_data(rows_sharding, data, shape)
        if (
            isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)  # traced (eval_shape): no sharding to read
            and x.sharding == rows_sharding
        ):
            return x
        # Also an equivalent layout under another spec (P('data') for P(('data', 'fsdp')) with
        # fsdp 1): one spec for every batch, so one compiled program serves them all.
        return jax.device_put(x, rows_sharding)

    return jax.tree.map(put, batch)


def host_array(x: Any) -> np.ndarray:
    """The full value of ``x`` as a NumPy array on this host.

    A ``jax.Array`` spread over several processes is all-gathered first
    (``multihost_utils.process_allgather``), so every process gets the whole array; anything
    else is fetched with ``jax.device_get``. The rollout and the evaluation decode completions
    through this, so the loop works the same in a single process and across hosts.

    Args:
        x: An array.

    Returns:
        The NumPy array.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.training import host_array, make_mesh, shard_batch
        >>> mesh = make_mesh(data=2, devices=jax.devices()[:2])  # 2 devices
        >>> x = shard_batch(jnp.arange(4), mesh)
        >>> type(host_array(x)).__name__, host_array(x).tolist()
        ('ndarray', [0, 1, 2, 3])
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
