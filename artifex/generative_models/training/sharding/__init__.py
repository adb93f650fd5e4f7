r"""Scale-out through ``jax.sharding``: the mesh, partition rules, and batch sharding.

The same compiled functions run on one device or on a mesh; only where the arrays live changes
(GSPMD propagates the shardings through the step and inserts the collectives). This module
decides where they live:

- :func:`make_mesh` builds a ``Mesh`` with the named axes ``("data", "fsdp", "tensor")`` (any of
  size 1) in GSPMD (``AxisType.Auto``) mode, and ``"expert"`` before ``"tensor"`` for expert
  parallelism of mixture-of-experts models (``make_mesh(expert=n)``, with :data:`MOE_RULES`).
- :class:`PartitionRules` maps a parameter path (``"layers.0.attn.q_proj.kernel"``, as
  :func:`~artifex.generative_models.models.causal_lm.hf_format.param_path_str` writes it) and shape
  to a ``PartitionSpec``: Megatron-style tensor parallelism over ``"tensor"``
  (:data:`CAUSAL_LM_RULES`), plus FSDP (ZeRO-3) sharding of every large parameter over
  ``"fsdp"``.
- :func:`shard_model` and :func:`shard_optimizer` place a model and its ``nnx.Optimizer`` state
  (Adam's ``mu``/``nu`` follow their parameter; scalars are replicated).
- :func:`shard_batch` splits a :class:`~artifex.generative_models.training.rl.core.batch.GRPOBatch`
  (or any pytree of row-major arrays) along its rows over ``("data", "fsdp")`` together.

Tensor parallelism (Shoeybi et al., 2019): for a block ``y = (\sigma(x W_1)) W_2`` the first
matrix is split by columns (column-parallel: q/k/v, gate/up), the second by rows (row-parallel:
o, down), so ``y = \sum_i \sigma(x W_1^{(i)}) W_2^{(i)}`` needs one all-reduce per block. FSDP
(Rajbhandari et al., 2020) stores ``1/n`` of every large parameter and its optimizer state on each
of the ``n`` devices of ``"fsdp"`` and all-gathers a parameter where it is used; the batch is split
over ``"fsdp"`` too, so FSDP is also data parallelism.

**Batch layout.** Rows stay contiguous and prompt-major (row ``i`` belongs to prompt ``i // G``,
generation ``i % G``): with ``S = data * fsdp`` data shards, shard ``s`` holds rows
``[s B/S, (s+1) B/S)``, so when the number of groups is a multiple of ``S`` every group lies on
one shard. A batch whose rows are not a multiple of ``S`` is an error (no silent padding).

**Multi-host.** Every process calls :func:`initialize_distributed` (or
``jax.distributed.initialize()``) first, builds the mesh over all devices with
:func:`make_mesh` and shards the same model with the same rules; it then loads only its rows of
the global batch (:func:`process_row_range`) and calls ``shard_batch(local_batch, mesh,
process_local=True)``; :func:`local_rows` is the way back. The Sharding guide
(``docs/sharding.md``) covers the whole multi-process loop.

References:
    Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
    Model Parallelism", arXiv:1909.08053. Rajbhandari et al., 2020, "ZeRO: Memory Optimizations
    Toward Training Trillion Parameter Models", arXiv:1910.02054. Xu et al., 2021, "GSPMD:
    General and Scalable Parallelization for ML Computation Graphs", arXiv:2105.04663.
"""

from __future__ import annotations

from artifex.generative_models.training.logging import is_primary_process

# Private helpers other library modules import from here.
from artifex.generative_models.training.sharding.batches import (
    _data_axes,  # noqa: F401
    batch_partition_spec,
    host_array,
    num_data_shards,
    process_row_range,
    shard_batch,
)
from artifex.generative_models.training.sharding.mesh import (
    DATA_AXES,
    MESH_AXES,
    check_mesh,  # noqa: F401
    current_mesh,
    make_mesh,
)
from artifex.generative_models.training.sharding.processes import (
    initialize_distributed,
    local_rows,
    rows_to_global,
)
from artifex.generative_models.training.sharding.rules import (
    CAUSAL_LM_RULES,
    MOE_RULES,
    PartitionRules,
    _as_rules,  # noqa: F401
)
from artifex.generative_models.training.sharding.states import (
    path_parts,  # noqa: F401
    shard_model,
    shard_optimizer,
    state_partition_specs,
    state_shardings,
)

__all__ = [
    "CAUSAL_LM_RULES",
    "DATA_AXES",
    "MESH_AXES",
    "MOE_RULES",
    "PartitionRules",
    "batch_partition_spec",
    "current_mesh",
    "host_array",
    "initialize_distributed",
    "is_primary_process",
    "local_rows",
    "make_mesh",
    "num_data_shards",
    "process_row_range",
    "rows_to_global",
    "shard_batch",
    "shard_model",
    "shard_optimizer",
    "state_partition_specs",
    "state_shardings",
]
