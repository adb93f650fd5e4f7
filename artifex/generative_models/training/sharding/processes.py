"""Several processes: local rows, global arrays from local rows, ``jax.distributed``.

Part of the package :mod:`artifex.generative_models.training.sharding`, which re-exports
every public name (see its docstring).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from artifex.generative_models.training.sharding.batches import shard_batch

__all__ = [
    "initialize_distributed",
    "local_rows",
    "rows_to_global",
]


def local_rows(x: Any) -> np.ndarray:
    """The rows of a row-sharded array that this process holds, as NumPy, in row order.

    The counterpart of ``shard_batch(..., process_local=True)``: for an array laid out by
    :func:`shard_batch` on a :func:`make_mesh` mesh, process ``p`` gets back exactly the rows
    ``[start, stop)`` of :func:`process_row_range`, with no communication (each addressable
    row shard is copied once). In a single process that is the whole array. The rollout decodes
    and scores completions through this, so each process handles only its own rows.

    Args:
        x: An array whose leading dimension (rows) is sharded (or replicated), or a host array.

    Returns:
        This process's rows.

    Raises:
        ValueError: This process's row shards are not contiguous.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.training import local_rows, make_mesh, shard_batch
        >>> mesh = make_mesh(data=2, devices=jax.devices()[:2])  # 2 devices
        >>> local_rows(shard_batch(jnp.arange(6).reshape(3, 2).repeat(2, axis=0), mesh)).shape
        (6, 2)
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    parts: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        sl = shard.index[0] if shard.index else slice(None)
        start = sl.start or 0
        if start not in parts:
            parts[start] = np.asarray(shard.data)
    starts = sorted(parts)
    for a, b in itertools.pairwise(starts):
        if a + parts[a].shape[0] != b:
            msg = f"local_rows: this process's row shards start at {starts}, not contiguous rows"
            raise ValueError(msg)
    return np.concatenate([parts[k] for k in starts], axis=0)


def rows_to_global(local: Any, mesh: Mesh, data_axes: Sequence[str] | None = None) -> jax.Array:
    """One global row-sharded array from every process's rows (``shard_batch`` of one array).

    Args:
        local: This process's rows ``(b, ...)`` (the range :func:`process_row_range` gives).
        mesh: The mesh.
        data_axes: Axes the rows are split over (default: ``("data", "fsdp")`` as present).

    Returns:
        The global array ``(b * processes, ...)`` with rows over the data axes.

    Examples:
        >>> import jax, numpy as np
        >>> from artifex.generative_models.training import make_mesh, rows_to_global
        >>> mesh = make_mesh(data=2, devices=jax.devices()[:2])  # 2 devices, one process
        >>> x = rows_to_global(np.arange(4), mesh)
        >>> x.shape, x.sharding.spec
        ((4,), P(('data', 'fsdp'),))
    """
    return shard_batch(np.asarray(local), mesh, process_local=True, data_axes=data_axes)


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    timeout: float | None = None,
) -> bool:
    """Joins this process to a multi-host JAX run (``jax.distributed.initialize``) when asked.

    Explicit arguments win; missing ones are read from the environment: JAX's own
    ``JAX_COORDINATOR_ADDRESS``, and ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` (read here,
    by this library). When none is set and ``auto`` is false nothing happens (a single-process
    run). With ``auto`` (or only some values known) the rest is left to JAX's cluster
    auto-detection (SLURM, Open MPI, Cloud TPU, Kubernetes...). Call it before anything else
    touches JAX's devices; the CPU collectives JAX uses across processes default to gloo.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator service.
        num_processes: Number of processes in the run.
        process_id: This process's index in ``[0, num_processes)``.
        auto: Initialize even when nothing is set (cluster auto-detection).
        timeout: Seconds to wait for every process: the address is checked first and the
            processes meet before JAX starts, so a process that does not come is named in a
            :class:`~artifex.generative_models.training.rendezvous.DistributedStartError`
            (see :func:`~artifex.generative_models.training.rendezvous.join_processes`).
            ``None``: JAX's own wait (it aborts the process after 300 s).

    Returns:
        Whether ``jax.distributed.initialize`` was called.

    Raises:
        ValueError: ``num_processes`` < 1, ``process_id`` outside ``[0, num_processes)``, or
            (with ``timeout``) a malformed or unresolvable coordinator address.
        DistributedStartError: (with ``timeout``) not every process came in time.

    Examples:
        >>> from artifex.generative_models.training import initialize_distributed
        >>> initialize_distributed()  # nothing set in the environment: a single-process run
        False
    """
    import os

    if coordinator_address is None:
        coordinator_address = os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator_address is None and num_processes is None and process_id is None and not auto:
        return False
    if num_processes is not None and num_processes < 1:
        msg = f"num_processes must be >= 1, got {num_processes}"
        raise ValueError(msg)
    if process_id is not None and (
        process_id < 0 or (num_processes is not None and process_id >= num_processes)
    ):
        msg = f"process_id must be in [0, num_processes={num_processes}), got {process_id}"
        raise ValueError(msg)
    if timeout is not None:
        from artifex.generative_models.training.rendezvous import join_processes

        join_processes(coordinator_address, num_processes, process_id, timeout)
        return True
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    return True
