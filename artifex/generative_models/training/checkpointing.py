"""Orbax checkpoints of the whole GRPO training state.

A checkpoint holds the trainable parameters (all parameters for full fine-tuning, the adapters
only for LoRA: whatever the optimizer's ``wrt`` selects), the model's non-parameter variables,
the optimizer state, and a JSON record with the step, the PRNG key, the data position, the
configs and the parameter shapes. Frozen base weights and a frozen reference are not saved: a
resumed run rebuilds them the way the original run did (load the same pretrained weights).

Writes are atomic (Orbax writes to a temporary directory and renames it when complete) and only
the newest ``max_to_keep`` checkpoints are kept. Every process calls :meth:`save` in a multi-host
run; Orbax coordinates the writes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

__all__ = ["CheckpointManager", "IncompatibleCheckpointError", "training_fingerprint"]


class IncompatibleCheckpointError(ValueError):
    """The checkpoint was written by a run whose configuration or shapes differ."""


def _shapes(state: nnx.State) -> dict[str, list[int]]:
    flat = nnx.to_flat_state(state)
    return {".".join(str(p) for p in path): list(var.shape) for path, var in flat}


def training_fingerprint(trainer: Any, **extra: Any) -> dict[str, Any]:
    """What must match between a checkpoint and the run resuming from it.

    Args:
        trainer: The :class:`~artifex.generative_models.training.rl.grpo.GRPOTrainer`.
        **extra: More JSON-able settings that must match (e.g. the loop's batch shape).

    Returns:
        A JSON-able dict: the GRPO config, the trainable parameter shapes and ``extra``.
    """
    return {
        "grpo_config": dataclasses.asdict(trainer.config),
        "trainable_shapes": _shapes(nnx.state(trainer.model, trainer.wrt)),
        **extra,
    }


def _diff(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            if key not in saved:
                out.append(f"{prefix}{key}: missing in the checkpoint")
            elif key not in current:
                out.append(f"{prefix}{key}: in the checkpoint but not in this run")
            else:
                out += _diff(saved[key], current[key], f"{prefix}{key}.")
        return out
    if saved != current:
        return [f"{prefix.rstrip('.')}: checkpoint has {saved!r}, this run has {current!r}"]
    return []


class CheckpointManager:
    """Saves and restores a :class:`GRPOTrainer`'s state with Orbax.

    Args:
        directory: Checkpoint directory (created).
        max_to_keep: Keep only the newest this many checkpoints.
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int = 3):
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            msg = f"max_to_keep must be an int >= 1, got {max_to_keep!r}"
            raise ValueError(msg)
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                create=True,
                enable_async_checkpointing=False,
                cleanup_tmp_directories=True,
            ),
        )

    # ------------------------------------------------------------------ queries
    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``.

        Returns:
            The step or ``None``.
        """
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the checkpoints on disk, oldest first.

        Returns:
            The steps.
        """
        return sorted(self._manager.all_steps())

    # ------------------------------------------------------------------ state
    @staticmethod
    def _state(trainer: Any) -> dict[str, Any]:
        model = trainer.model
        return {
            "params": nnx.to_pure_dict(nnx.state(model, trainer.wrt)),
            "variables": nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))),
            "optimizer": nnx.to_pure_dict(nnx.state(trainer.optimizer)),
        }

    def save(self, step: int, trainer: Any, metadata: Mapping[str, Any]) -> None:
        """Writes a checkpoint for ``step`` (blocking, atomic).

        Args:
            step: The training step (checkpoint name).
            trainer: The trainer whose model and optimizer are saved.
            metadata: JSON-able record (data position, PRNG key, fingerprint...).
        """
        self._manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(self._state(trainer)),
                meta=ocp.args.JsonSave(dict(metadata)),
            ),
        )
        self._manager.wait_until_finished()

    def read_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON record of a checkpoint without touching any array.

        Args:
            step: Which checkpoint; the newest by default.

        Returns:
            The record.

        Raises:
            FileNotFoundError: If there is no such checkpoint.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            which = "at all" if step is None else f"for step {step}"
            msg = f"no checkpoint {which} in {self.directory}"
            raise FileNotFoundError(msg)
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored.meta)

    def restore(
        self,
        trainer: Any,
        step: int | None = None,
        *,
        fingerprint: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Loads a checkpoint into ``trainer``'s model and optimizer.

        The checkpoint's recorded fingerprint is compared with ``fingerprint`` first; nothing is
        loaded if they differ.

        Args:
            trainer: The trainer to restore into (its arrays give the target shapes and
                shardings).
            step: Which checkpoint; the newest by default.
            fingerprint: What the checkpoint's ``metadata["fingerprint"]`` must equal
                (see :func:`training_fingerprint`); ``None`` skips the check.

        Returns:
            The checkpoint's JSON record.

        Raises:
            FileNotFoundError: If there is no such checkpoint.
            IncompatibleCheckpointError: If the fingerprints differ (each difference listed).
        """
        metadata = self.read_metadata(step)
        step = int(metadata.get("step", self.latest_step()))
        if fingerprint is not None:
            diffs = _diff(metadata.get("fingerprint", {}), dict(fingerprint))
            if diffs:
                msg = (
                    f"checkpoint {step} in {self.directory} is incompatible with this run:\n  "
                    + "\n  ".join(diffs)
                )
                raise IncompatibleCheckpointError(msg)
        target = self._state(trainer)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        ).state
        for name, obj, filt in (
            ("params", trainer.model, trainer.wrt),
            ("variables", trainer.model, nnx.Not(nnx.Param)),
            ("optimizer", trainer.optimizer, ...),
        ):
            state = nnx.state(obj, filt)
            nnx.replace_by_pure_dict(state, restored[name])
            nnx.update(obj, state)
        return metadata

    def close(self) -> None:
        """Releases the manager."""
        self._manager.close()
