"""A multi-host rollout's prompts: each process's rows as one global array of one width.

Moved out of :mod:`~artifex.generative_models.training.rl.rollouts.rollout` unchanged (its
``sample_completions`` calls it when the mesh spans several processes).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from artifex.generative_models.training.sharding import shard_batch


def _global_prompts(
    ids: np.ndarray, mask: np.ndarray, mesh: Any, pad_id: int | None
) -> tuple[jax.Array, jax.Array]:
    """This process's encoded prompts -> global arrays with one agreed width, rows sharded."""
    from jax.experimental import multihost_utils

    sizes = np.asarray(
        multihost_utils.process_allgather(np.asarray(ids.shape, np.int64)), np.int64
    ).reshape(-1, 2)
    if len(set(sizes[:, 0].tolist())) != 1:
        msg = (
            "every process must roll out the same number of prompts, got "
            f"{sizes[:, 0].tolist()} (by process)"
        )
        raise ValueError(msg)
    width = int(sizes[:, 1].max())
    if width > ids.shape[1]:
        extra = width - ids.shape[1]
        ids = np.pad(ids, ((0, 0), (extra, 0)), constant_values=0 if pad_id is None else pad_id)
        mask = np.pad(mask, ((0, 0), (extra, 0)))
    return shard_batch((ids, mask), mesh, process_local=True)
