"""Training: the GRPO trainer, its numeric core, and sharding over a device mesh.

``from artifex.generative_models.training import GRPOConfig, GRPOTrainer`` is the entry point;
every RL name is also available from :mod:`artifex.generative_models.training.rl`, every
sharding name from :mod:`artifex.generative_models.training.sharding`.
"""

from artifex.generative_models.training.checkpointing import (
    CheckpointManager,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from artifex.generative_models.training.logging import MetricLogger
from artifex.generative_models.training.placement import RolloutPlacement
from artifex.generative_models.training.rl import (
    GRPOBatch,
    GRPOConfig,
    GRPOTrainer,
    NonFiniteUpdateError,
    RewardCombiner,
    RolloutConfig,
    TrainConfig,
    group_advantages,
    grpo_objective,
    make_grpo_loss,
    segment_advantages,
    train,
)
from artifex.generative_models.training.sharding import (
    CAUSAL_LM_RULES,
    DATA_AXES,
    MESH_AXES,
    MOE_RULES,
    PartitionRules,
    batch_partition_spec,
    current_mesh,
    host_array,
    initialize_distributed,
    is_primary_process,
    local_rows,
    make_mesh,
    num_data_shards,
    process_row_range,
    rows_to_global,
    shard_batch,
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
    "CheckpointManager",
    "CorruptCheckpointError",
    "GRPOBatch",
    "GRPOConfig",
    "GRPOTrainer",
    "IncompatibleCheckpointError",
    "MetricLogger",
    "NonFiniteUpdateError",
    "PartitionRules",
    "RewardCombiner",
    "RolloutConfig",
    "RolloutPlacement",
    "TrainConfig",
    "batch_partition_spec",
    "current_mesh",
    "group_advantages",
    "grpo_objective",
    "host_array",
    "initialize_distributed",
    "is_primary_process",
    "local_rows",
    "make_grpo_loss",
    "make_mesh",
    "num_data_shards",
    "process_row_range",
    "rows_to_global",
    "segment_advantages",
    "shard_batch",
    "shard_model",
    "shard_optimizer",
    "state_partition_specs",
    "state_shardings",
    "train",
]
