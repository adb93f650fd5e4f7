"""Orbax checkpoints of a training state: any pytree of arrays, with a verified JSON record.

The GRPO loop saves its
:class:`~artifex.generative_models.training.rl.update.train_state.GRPOTrainState` without the
reference (the trainable parameters, the policy's other variables, the optimizer state, the step
count and the PRNG key), and a JSON record with the data position, the configs and the parameter
shapes. A frozen reference is not saved: a resumed run rebuilds it the way the original run did
(load the same pretrained weights). This module knows no RL types: it saves and restores
pytrees (PRNG keys are stored as their key data and re-wrapped on restore).

Writes are atomic (Orbax writes to a temporary directory and renames it when complete) and only
the newest ``max_to_keep`` checkpoints are kept. Every process calls :meth:`save` in a multi-host
run; Orbax coordinates the writes.

Integrity: a non-finite state is never saved; each checkpoint's JSON record carries an
``integrity`` entry (shape, dtype and SHA-256 of every array). :meth:`CheckpointManager.restore`
verifies the arrays it read against it (and that they are finite) before touching the trainer;
when the newest checkpoint is damaged it warns and falls back to the previous complete one. A
save that fails (a full disk) removes its temporary directory and raises ``OSError``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from artifex.generative_models.utils.validation import check_int

__all__ = [
    "CheckpointManager",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "array_digests",
    "training_fingerprint",
]


class IncompatibleCheckpointError(ValueError):
    """The checkpoint was written by a run whose configuration or shapes differ.

    Examples:
        >>> import tempfile, jax.numpy as jnp
        >>> from artifex.generative_models.training import (
        ...     CheckpointManager, IncompatibleCheckpointError)
        >>> manager = CheckpointManager(tempfile.mkdtemp())
        >>> manager.save(1, {"w": jnp.ones(3)}, metadata={"fingerprint": {"lr": 0.1}})
        >>> try:
        ...     manager.restore({"w": jnp.zeros(3)}, fingerprint={"lr": 0.2})
        ... except IncompatibleCheckpointError as err:
        ...     print(type(err).__name__, isinstance(err, ValueError))
        IncompatibleCheckpointError True
        >>> manager.close()
    """


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (a full disk, a lost mount); the earlier ones are kept.

    An ``OSError`` (with the ``errno`` of the failure, when there is one) that names the step,
    so a caller can tell the checkpoint of the last step from an intermediate one.

    Args:
        errno_: The failure's ``errno``, or ``None``.
        message: What failed and why.
        step: The step whose checkpoint could not be written.
        directory: The checkpoint directory.

    Examples:
        >>> import errno
        >>> from artifex.generative_models.training.checkpointing import CheckpointWriteError
        >>> err = CheckpointWriteError(errno.ENOSPC, "writing checkpoint 5 failed", step=5,
        ...                            directory="/runs/a/checkpoints")
        >>> err.step, err.errno == errno.ENOSPC, isinstance(err, OSError)
        (5, True, True)
    """

    def __init__(self, errno_: int | None, message: str, *, step: int, directory: str):
        super().__init__(errno_, message)
        self.step = step
        self.directory = directory

    def __str__(self) -> str:
        return str(self.strerror)


class CorruptCheckpointError(ValueError):
    """A checkpoint could not be read back intact (unreadable, wrong checksum, or not finite).

    Examples:
        >>> from artifex.generative_models.training import CorruptCheckpointError
        >>> issubclass(CorruptCheckpointError, ValueError)
        True
    """


def _host_leaf(x: Any) -> np.ndarray | None:
    """A host copy of an array leaf (PRNG keys as their key data); ``None`` if not addressable."""
    if isinstance(x, jax.Array):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if not x.is_fully_addressable:
            return None
    return np.asarray(x)


def array_digests(tree: Any) -> dict[str, dict[str, Any]]:
    """Shape, dtype, SHA-256 and finiteness of every array leaf of a pytree.

    Arrays not fully addressable from this process (multi-host shards) get ``sha256=None`` and
    are only checked for shape and dtype.

    Args:
        tree: A pytree of arrays (e.g. the checkpointed state).

    Returns:
        ``{path: {"shape": [...], "dtype": str, "sha256": str | None, "finite": bool}}``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.checkpointing import array_digests
        >>> d = array_digests({"w": jnp.ones((2, 3)), "b": jnp.array([jnp.nan])})
        >>> sorted(d)
        ["['b']", "['w']"]
        >>> w = d["['w']"]
        >>> w["shape"], w["dtype"], w["finite"], len(w["sha256"]), d["['b']"]["finite"]
        ([2, 3], 'float32', True, 64, False)
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        host = _host_leaf(leaf)
        if host is None:
            finite = (
                bool(jnp.all(jnp.isfinite(leaf)))
                if jnp.issubdtype(leaf.dtype, jnp.inexact)
                else True
            )
            out[name] = {
                "shape": list(np.shape(leaf)),
                "dtype": str(leaf.dtype),
                "sha256": None,
                "finite": finite,
            }
            continue
        finite = bool(np.isfinite(host).all()) if np.issubdtype(host.dtype, np.inexact) else True
        digest = hashlib.sha256(np.ascontiguousarray(host).tobytes()).hexdigest()
        out[name] = {
            "shape": list(host.shape),
            "dtype": str(host.dtype),
            "sha256": digest,
            "finite": finite,
        }
    return out


def _shapes(state: nnx.State) -> dict[str, list[int]]:
    flat = nnx.to_flat_state(state)
    return {".".join(str(p) for p in path): list(var.shape) for path, var in flat}


def training_fingerprint(config: Any, params: Any, **extra: Any) -> dict[str, Any]:
    """What must match between a checkpoint and the run resuming from it.

    Args:
        config: The run's dataclass config (e.g. ``GRPOConfig``).
        params: The trainable parameters (an ``nnx.State``; their shapes are recorded).
        **extra: More JSON-able settings that must match (e.g. the loop's batch shape).

    Returns:
        A JSON-able dict: the config, the trainable parameter shapes and ``extra``. A restore
        compares all of it except the config's ``EXECUTION_ONLY_FIELDS`` (``remat``,
        ``remat_every``, ``scan_layers``) and, in an ``extra`` entry ``loop``, its
        ``EXECUTION_ONLY_LOOP_FIELDS`` (``gradient_accumulation_steps``), which change memory
        and speed, not the values.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.checkpointing import training_fingerprint
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> fp = training_fingerprint(GRPOConfig(num_generations=4), nnx.state(model, nnx.Param),
        ...                           prompts_per_step=8)
        >>> list(fp), fp["grpo_config"]["num_generations"]
        (['grpo_config', 'trainable_shapes', 'prompts_per_step'], 4)
    """
    return _plain(
        {
            "grpo_config": dataclasses.asdict(config),
            "trainable_shapes": _shapes(params),
            **extra,
        }
    )


def _plain(value: Any) -> Any:
    """``value`` as JSON records it, so that a fingerprint equals its saved copy.

    NumPy scalars become Python ones (a config may hold ``np.int64(4)``), tuples lists.
    """
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _saveable(tree: Any) -> dict[str, Any]:
    """A flat ``{path: array}`` dict of a pytree (PRNG keys as key data), as Orbax saves it."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = leaf
    return out


def _from_saveable(flat: Mapping[str, Any], target: Any) -> Any:
    """The inverse of :func:`_saveable`, in ``target``'s structure (keys re-wrapped)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    for path, like in paths:
        value = flat[jax.tree_util.keystr(path)]
        if isinstance(like, jax.Array) and jnp.issubdtype(like.dtype, jax.dtypes.prng_key):
            value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(like))
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


#: GRPOConfig fields that change how an update runs (memory, compile time), not what it
#: computes: a run may resume from a checkpoint written with other values (or before the field
#: existed), for example with more layers rematerialized after running out of memory.
EXECUTION_ONLY_FIELDS = ("remat", "remat_every", "scan_layers")
# The loop's settings that change how an update is computed, not its values: recorded in the
# fingerprint, not compared (``gradient_accumulation_steps``: the update does not depend on
# the split, and ``None``, the trainer's own choice, may pick another on another device).
EXECUTION_ONLY_LOOP_FIELDS = ("gradient_accumulation_steps",)


def _comparable(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """``fingerprint`` without the execution-only fields of its ``grpo_config`` and loop."""
    out = dict(fingerprint)
    config = out.get("grpo_config")
    if isinstance(config, Mapping):
        out["grpo_config"] = {k: v for k, v in config.items() if k not in EXECUTION_ONLY_FIELDS}
    loop = out.get("loop")
    if isinstance(loop, Mapping):
        out["loop"] = {k: v for k, v in loop.items() if k not in EXECUTION_ONLY_LOOP_FIELDS}
    return out


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


def _brief(err: BaseException) -> str:
    """The first line of an error, at most 200 characters (Orbax errors dump whole specs)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    text = text.split(" See full TensorStore details")[0]
    return f"{type(err).__name__}: {text[:200]}"


def _verify(restored: Any, integrity: Mapping[str, Any] | None, where: str) -> None:
    """Checks restored arrays against the record written with them, and for NaN/Inf."""
    digests = array_digests(restored)
    bad = [name for name, d in digests.items() if not d["finite"]]
    if bad:
        msg = f"{where} is damaged: {bad[0]} holds NaN or Inf ({len(bad)} arrays in all)"
        raise CorruptCheckpointError(msg)
    if integrity is None:  # written before checksums were recorded: finiteness only
        return
    for name, want in integrity.items():
        got = digests.get(name)
        if got is None:
            msg = f"{where} is damaged: array {name} is missing"
            raise CorruptCheckpointError(msg)
        for field in ("shape", "dtype", "sha256"):
            if want.get(field) is not None and got[field] is not None and got[field] != want[field]:
                msg = f"{where} is damaged: array {name} has the wrong {field} (checksum mismatch)"
                if field != "sha256":
                    msg = f"{where} is damaged: array {name} has {field} {got[field]}, "
                    msg += f"expected {want[field]}"
                raise CorruptCheckpointError(msg)


class CheckpointManager:
    """Saves and restores a training state (a pytree of arrays) with Orbax.

    Args:
        directory: Checkpoint directory (created).
        max_to_keep: Keep only the newest this many checkpoints.

    Examples:
        >>> import tempfile, jax.numpy as jnp
        >>> from artifex.generative_models.training import CheckpointManager
        >>> manager = CheckpointManager(tempfile.mkdtemp(), max_to_keep=2)
        >>> for step in (10, 20, 30):
        ...     manager.save(step, {"w": jnp.full(3, float(step))}, metadata={"step": step})
        >>> manager.all_steps(), manager.latest_step()
        ([20, 30], 30)
        >>> state, metadata = manager.restore({"w": jnp.zeros(3)})
        >>> state["w"].tolist(), metadata["step"]
        ([30.0, 30.0, 30.0], 30)
        >>> manager.close()
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int = 3):
        max_to_keep = check_int("max_to_keep", max_to_keep, minimum=1)
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            msg = f"checkpoint directory {self.directory} is an existing file: choose another path"
            raise NotADirectoryError(msg)
        if jax.process_index() == 0 and os.path.isdir(self.directory):
            # Unfinished saves (a kill, a full disk) leave temporary directories Orbax never
            # deletes and ``max_to_keep`` never counts: remove them before anything else.
            for name in os.listdir(self.directory):
                if re.fullmatch(r"\d+\.orbax-checkpoint-tmp.*", name):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
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
    def save(self, step: int, state: Any, metadata: Mapping[str, Any]) -> None:
        """Writes a checkpoint for ``step`` (blocking, atomic, with a checksum record).

        Args:
            step: The training step (checkpoint name).
            state: The pytree of arrays to save (e.g. a ``GRPOTrainState`` without its
                reference: ``trainer.state.replace(reference=None)``), or an object with a
                ``checkpoint_state()`` method (a ``GRPOTrainer``), whose result is saved.
            metadata: JSON-able record (data position, fingerprint...).

        Raises:
            FloatingPointError: The state holds a non-finite value (nothing is written).
            ValueError: The directory already holds a checkpoint at ``step`` or later (Orbax
                would silently skip the save).
            CheckpointWriteError: The write failed (e.g. a full disk; an ``OSError``); its
                temporary directory is removed.
        """
        step = int(step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            msg = (
                f"cannot save checkpoint {step} in {self.directory}: it already holds step "
                f"{latest}; resume from it, delete it, or use another directory"
            )
            raise ValueError(msg)
        if hasattr(state, "checkpoint_state"):
            state = state.checkpoint_state()
        state = _saveable(state)
        digests = array_digests(state)
        bad = [name for name, d in digests.items() if not d["finite"]]
        if bad:
            msg = (
                f"refusing to save checkpoint {step}: {len(bad)} arrays hold NaN or Inf "
                f"(first: {bad[0]}); the state is corrupted"
            )
            raise FloatingPointError(msg)
        record = dict(metadata, integrity={k: {**d, "finite": True} for k, d in digests.items()})
        before = set(threading.enumerate())
        try:
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    meta=ocp.args.JsonSave(record),
                ),
            )
            self._manager.wait_until_finished()
        except BaseException as err:
            if isinstance(err, Exception):  # an interrupt is not held up by the writers
                self._settle(before)
            self._remove_temporaries(step)
            if isinstance(err, KeyboardInterrupt | SystemExit) or not isinstance(err, Exception):
                raise
            what = err.strerror or str(err) if isinstance(err, OSError) else _brief(err)
            msg = f"writing checkpoint {step} in {self.directory} failed: {what}"
            code = err.errno if isinstance(err, OSError) else None
            raise CheckpointWriteError(code, msg, step=step, directory=self.directory) from err
        if not saved:
            msg = f"Orbax skipped checkpoint {step} in {self.directory} (steps: {self.all_steps()})"
            raise ValueError(msg)

    @staticmethod
    def _settle(before: set[threading.Thread], timeout: float = 60.0) -> None:
        """Waits for the writer threads a failed save started to end.

        When one of Orbax's writer threads fails (a full disk), the save raises at once while
        the others may still be writing into the temporary directory, and would recreate it
        after it was removed: join the threads Orbax started during the save first.
        """
        deadline = time.monotonic() + timeout
        for thread in set(threading.enumerate()) - before:
            if type(thread).__module__.startswith("orbax") and thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _remove_temporaries(self, step: int, timeout: float = 10.0) -> None:
        """Deletes the unfinished temporary directories of ``step`` a failed save left.

        Retries until none is left (a writer still closing a file can make one removal miss a
        file) or ``timeout`` seconds pass; whatever is left then is removed when the directory
        is next opened.
        """
        deadline = time.monotonic() + timeout
        while os.path.isdir(self.directory):
            left = [
                name
                for name in os.listdir(self.directory)
                if name.startswith(f"{step}.orbax-checkpoint-tmp")
            ]
            if not left or time.monotonic() > deadline:
                return
            for name in left:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            time.sleep(0.01)

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
        target: Any,
        step: int | None = None,
        *,
        fingerprint: Mapping[str, Any] | None = None,
        ignore: tuple[str, ...] = (),
    ) -> tuple[Any, dict[str, Any]]:
        """Reads a checkpoint in ``target``'s structure, verifying what it read.

        The checkpoint's recorded fingerprint is compared with ``fingerprint`` first; the arrays
        read are then checked against the checksum record written with them and for NaN/Inf.
        Nothing is returned unless every check passes. Without ``step``, the newest checkpoint
        is tried first; a damaged one is skipped with a warning (naming what was wrong) for the
        previous complete one.

        Args:
            target: A pytree like the saved state (its arrays give the shapes, dtypes and
                shardings to restore into; they are not modified). Or an object with
                ``checkpoint_state()`` and ``load_checkpoint_state(state)`` (a
                ``GRPOTrainer``): the checkpoint is loaded into it and only the record is
                returned, as earlier versions did.
            step: Which checkpoint; the newest readable one by default.
            fingerprint: What the checkpoint's ``metadata["fingerprint"]`` must equal
                (see :func:`training_fingerprint`); ``None`` skips the check.
            ignore: Top-level fingerprint keys not compared (e.g. ``("dataset",)``).

        Returns:
            ``(state, record)``: the restored pytree and the checkpoint's JSON record (the
            record alone when ``target`` is an object that loads the state itself).

        Raises:
            FileNotFoundError: If there is no such checkpoint.
            IncompatibleCheckpointError: If the fingerprints differ (each difference listed).
            CorruptCheckpointError: If the checkpoint (with ``step``), or every checkpoint
                (without), is unreadable or fails verification.
        """
        if hasattr(target, "load_checkpoint_state"):
            restored, record = self.restore(
                target.checkpoint_state(), step, fingerprint=fingerprint, ignore=ignore
            )
            target.load_checkpoint_state(restored)
            return record
        if step is not None:
            return self._restore_step(target, int(step), fingerprint, ignore)
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            msg = f"no checkpoint at all in {self.directory}"
            raise FileNotFoundError(msg)
        problems = []
        for candidate in steps:
            try:
                return self._restore_step(target, candidate, fingerprint, ignore)
            except IncompatibleCheckpointError:
                raise
            except CorruptCheckpointError as err:
                problems.append(str(err))
                warnings.warn(
                    f"{err}; falling back to the previous checkpoint", RuntimeWarning, stacklevel=2
                )
        msg = f"no intact checkpoint in {self.directory}:\n  " + "\n  ".join(problems)
        raise CorruptCheckpointError(msg)

    def _restore_step(
        self,
        target: Any,
        step: int,
        fingerprint: Mapping[str, Any] | None,
        ignore: tuple[str, ...],
    ) -> tuple[Any, dict[str, Any]]:
        where = f"checkpoint {step} in {self.directory}"
        if step not in self._manager.all_steps():
            msg = f"no checkpoint for step {step} in {self.directory}"
            raise FileNotFoundError(msg)
        try:
            metadata = self.read_metadata(step)
        except Exception as err:  # a torn or missing JSON record
            msg = f"{where} is damaged: its metadata cannot be read ({_brief(err)})"
            raise CorruptCheckpointError(msg) from err
        if fingerprint is not None:
            saved = {k: v for k, v in metadata.get("fingerprint", {}).items() if k not in ignore}
            current = {k: v for k, v in dict(fingerprint).items() if k not in ignore}
            diffs = _diff(_comparable(saved), _comparable(current))
            if diffs:
                msg = f"{where} is incompatible with this run:\n  " + "\n  ".join(diffs)
                raise IncompatibleCheckpointError(msg)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _saveable(target))
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            ).state
        except Exception as err:
            msg = f"{where} is damaged: its arrays cannot be read ({_brief(err)})"
            raise CorruptCheckpointError(msg) from err
        _verify(restored, metadata.get("integrity"), where)
        return _from_saveable(restored, target), metadata

    def delete_all(self) -> None:
        """Deletes every checkpoint in the directory (for a run that starts over)."""
        for step in self.all_steps():
            self._manager.delete(step)
        self._manager.reload()

    def close(self) -> None:
        """Releases the manager."""
        self._manager.close()
