"""The training loop's outputs, opened before the first step: locked, checked, restored.

:func:`open_run_outputs` does, in order, what
:func:`~artifex.generative_models.training.rl.run.loop.train` needs before its first (expensive)
step:

1. every output directory is created and written to once (a read-only or misspelled path fails
   now, not hours later);
2. the checkpoint and log directories are locked for this run
   (:class:`~artifex.generative_models.training.run_lock.RunLock`, on the primary process): a
   second run into them at the same time is refused, naming the first one's pid;
3. the checkpoint directory is cleared (``overwrite``), refused (checkpoints of another run
   with ``resume`` off), or its newest intact checkpoint restored after its fingerprint is
   compared with this run's;
4. the log directory must hold this run's logs: a directory whose ``metrics.jsonl`` belongs to
   a run with another checkpoint directory (recorded in ``.artifex-run.json``) is refused
   instead of being appended to, or cut back to this run's checkpoint step on a resume;
5. the metric and completion logs are opened (a resumed run keeps only the records up to its
   checkpoint's step), and the experiment trackers of ``report_to`` started
   (:func:`~artifex.generative_models.training.trackers.open_trackers`).

Whatever fails releases what was taken before it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from artifex.generative_models.training.checkpointing import CheckpointManager
from artifex.generative_models.training.completions import CompletionLog
from artifex.generative_models.training.logging import MetricLogger, is_primary_process
from artifex.generative_models.training.run_lock import RunLock
from artifex.generative_models.training.trackers import open_trackers
from artifex.generative_models.utils.atomic import atomic_write_json

__all__ = [
    "LATER_FINGERPRINT_KEYS",
    "LOG_OWNER_NAME",
    "LogDirectoryInUseError",
    "RunOutputs",
    "check_log_owner",
    "check_writable_dir",
    "open_run_outputs",
]

_log = logging.getLogger(__name__)

#: The record, in a log directory, of the checkpoint directory whose run writes its logs.
LOG_OWNER_NAME = ".artifex-run.json"

#: Fingerprint entries recorded since a later version: a checkpoint written without them is
#: resumed with a warning instead of being refused.
LATER_FINGERPRINT_KEYS = ("rewards", "run")

_LOG_FILES = ("metrics.jsonl", "completions.jsonl")


class LogDirectoryInUseError(FileExistsError):
    """The log directory holds the logs of another run (one with another checkpoint directory).

    Examples:
        >>> from artifex.generative_models.training.rl.run.preflight import LogDirectoryInUseError
        >>> issubclass(LogDirectoryInUseError, FileExistsError)
        True
    """


def check_log_owner(
    log_dir: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str] | None,
    *,
    overwrite: bool,
) -> None:
    """Claims ``log_dir`` for the run whose checkpoints are in ``checkpoint_dir``.

    The claim is ``log_dir/.artifex-run.json`` (``{"checkpoint_dir": absolute path or null}``).
    A directory claimed by a run with another checkpoint directory that still holds its
    ``metrics.jsonl`` or ``completions.jsonl`` is refused unless ``overwrite`` (whose caller
    deletes those files); one without log files, or without a claim (written by an earlier
    version), is claimed.

    Args:
        log_dir: The log directory (it exists).
        checkpoint_dir: This run's checkpoint directory, or ``None``.
        overwrite: The run starts over and replaces the directory's logs.

    Raises:
        LogDirectoryInUseError: The logs there are another run's.

    Examples:
        >>> import os, tempfile
        >>> from artifex.generative_models.training.rl.run.preflight import check_log_owner
        >>> logs = tempfile.mkdtemp()
        >>> check_log_owner(logs, "/runs/a/checkpoints", overwrite=False)  # claimed for run a
        >>> open(os.path.join(logs, "metrics.jsonl"), "w").close()  # run a logs a step
        >>> check_log_owner(logs, "/runs/b/checkpoints", overwrite=False)
        Traceback (most recent call last):
            ...
        artifex.generative_models.training.rl.run.preflight.LogDirectoryInUseError: ...
    """
    import json

    log_dir = os.path.abspath(os.fspath(log_dir))
    mine = None if checkpoint_dir is None else os.path.abspath(os.fspath(checkpoint_dir))
    record_path = os.path.join(log_dir, LOG_OWNER_NAME)
    owner: Any = mine
    try:
        with open(record_path, encoding="utf-8") as fh:
            owner = json.load(fh).get("checkpoint_dir")
    except (OSError, ValueError, AttributeError):
        pass
    used = [n for n in _LOG_FILES if os.path.isfile(os.path.join(log_dir, n))]
    if owner != mine and used and not overwrite:
        theirs = "no checkpoint directory" if owner is None else f"checkpoint_dir {owner}"
        ours = "none" if mine is None else mine
        msg = (
            f"log directory {log_dir} holds the logs ({', '.join(used)}) of another run "
            f"({theirs}); this run's checkpoint_dir is {ours}: give this run a log directory "
            "of its own (--log-dir), or replace those logs with overwrite=True (--overwrite)"
        )
        raise LogDirectoryInUseError(msg)
    if owner != mine or not os.path.isfile(record_path):
        atomic_write_json(record_path, {"checkpoint_dir": mine})


@dataclasses.dataclass
class RunOutputs:
    """What :func:`open_run_outputs` opened; :meth:`close` releases all of it.

    Attributes:
        manager: The checkpoint manager (``None`` without a checkpoint directory).
        start_step: The restored checkpoint's step (0 for a fresh start).
        record: The restored checkpoint's JSON record (``None`` for a fresh start).
        logger: The metric logger.
        samples: The completion log.
        locks: The directory locks held.

    Examples:
        >>> from artifex.generative_models.training.rl.run.preflight import RunOutputs
        >>> outputs = RunOutputs(manager=None, start_step=0, record=None)  # nothing opened
        >>> outputs.close()
        >>> outputs.locks
        []
    """

    manager: CheckpointManager | None
    start_step: int
    record: dict[str, Any] | None
    logger: MetricLogger | None = None
    samples: CompletionLog | None = None
    locks: list[RunLock] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        """Closes the logs and the checkpoint manager, then releases the locks."""
        try:
            for item in (self.logger, self.samples, self.manager):
                if item is not None:
                    item.close()
        finally:
            for lock in reversed(self.locks):
                lock.release()
            self.locks = []


def check_writable_dir(path: str | os.PathLike[str], what: str = "directory") -> str:
    """Creates ``path`` if needed and checks that a file can be written in it.

    Args:
        path: The directory.
        what: How to name it in the error (e.g. ``"--output"``).

    Returns:
        The absolute path.

    Raises:
        NotADirectoryError: ``path`` (or a parent) is an existing file.
        PermissionError: The directory cannot be created or written.

    Examples:
        >>> import os, tempfile
        >>> from artifex.generative_models.training.rl.run.preflight import check_writable_dir
        >>> path = check_writable_dir(os.path.join(tempfile.mkdtemp(), "runs", "logs"), "--log-dir")
        >>> os.path.isdir(path), os.path.isabs(path)
        (True, True)
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        msg = f"{what} {path} is an existing file, not a directory: choose another path"
        raise NotADirectoryError(msg)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".artifex-write-probe-{os.getpid()}")
        with open(probe, "w", encoding="utf-8") as fh:
            fh.write("ok")
        os.remove(probe)
    except (NotADirectoryError, FileExistsError) as err:
        msg = f"{what} {path} cannot be created: a parent is a file ({err})"
        raise NotADirectoryError(msg) from err
    except OSError as err:
        msg = f"{what} {path} is not writable ({err.strerror or err}): choose another path"
        raise PermissionError(msg) from err
    return path


def _checked_dirs(config: Any) -> None:
    names = ("log_dir", "checkpoint_dir") if is_primary_process() else ("checkpoint_dir",)
    for name in names:
        if getattr(config, name) is not None:
            check_writable_dir(getattr(config, name), f"TrainConfig.{name}")


def open_run_outputs(config: Any, trainer: Any, fingerprint: Mapping[str, Any]) -> RunOutputs:
    """Checks, locks and opens the loop's output directories; restores the newest checkpoint.

    Args:
        config: The loop's ``TrainConfig``.
        trainer: The trainer (``checkpoint_state()``, ``load_checkpoint_state(state)``).
        fingerprint: What a checkpoint to resume from must match
            (:func:`~artifex.generative_models.training.checkpointing.training_fingerprint`).

    Returns:
        The opened :class:`RunOutputs`.

    Raises:
        FileExistsError: Checkpoints of another run with ``resume`` and ``overwrite`` off.
        LogDirectoryInUseError: The log directory holds another run's logs.
        DirectoryInUseError: Another live run holds a directory
            (:class:`~artifex.generative_models.training.run_lock.DirectoryInUseError`).
        IncompatibleCheckpointError: The checkpoint's fingerprint differs from this run's.
        NotADirectoryError: An output directory is an existing file.
        PermissionError: An output directory is not writable.

    Examples:
        >>> import os, tempfile
        >>> from artifex.generative_models.training import TrainConfig
        >>> from artifex.generative_models.training.rl.run.preflight import open_run_outputs
        >>> logs = tempfile.mkdtemp()
        >>> config = TrainConfig(num_steps=10, log_dir=logs, progress=False)
        >>> outputs = open_run_outputs(config, trainer=None, fingerprint={})  # no checkpoints
        >>> outputs.start_step, outputs.manager is None, sorted(os.listdir(logs))
        (0, True, ['.artifex-run.json', '.artifex-run.lock', 'metrics.jsonl'])
        >>> outputs.close()
        >>> sorted(os.listdir(logs))  # the lock is released
        ['.artifex-run.json', 'metrics.jsonl']
    """
    _checked_dirs(config)
    out = RunOutputs(manager=None, start_step=0, record=None)
    try:
        if is_primary_process():
            for name in ("checkpoint_dir", "log_dir"):
                if getattr(config, name) is not None:
                    out.locks.append(RunLock(getattr(config, name), f"TrainConfig.{name}"))
                    out.locks[-1].acquire()
        if config.checkpoint_dir is not None:
            out.manager = _restore(config, trainer, fingerprint, out)
        if config.log_dir is not None and is_primary_process():
            check_log_owner(config.log_dir, config.checkpoint_dir, overwrite=config.overwrite)
            if config.overwrite:
                # A run started over logs from step 0 again: the old run's records go (else
                # its evaluation before training would stay beside the new one's).
                for name in _LOG_FILES:
                    path = os.path.join(config.log_dir, name)
                    if os.path.isfile(path):
                        os.remove(path)
        if out.start_step > config.num_steps and is_primary_process():
            _log.warning(
                f"the checkpoint in {out.manager.directory} is at step {out.start_step}, past "
                f"num_steps={config.num_steps}: nothing is trained, and the model is the "
                f"checkpoint's (step {out.start_step}), not step {config.num_steps}'s"
            )
        resume_step = out.start_step if out.start_step > 0 else None
        # TensorBoard hides what an earlier attempt logged past this run's start (all of it
        # on a fresh start): those steps are logged again.
        trackers = open_trackers(
            config.report_to,
            log_dir=config.log_dir,
            config=_tracker_config(config, fingerprint),
            purge_step=out.start_step + 1 if out.start_step > 0 else 0,
        )
        try:
            out.logger = MetricLogger(
                jsonl_path=None
                if config.log_dir is None
                else os.path.join(config.log_dir, "metrics.jsonl"),
                resume_step=resume_step,
                progress_total=config.num_steps if config.progress else None,
                progress_initial=min(out.start_step, config.num_steps),
                writers=trackers,
            )
        except BaseException:
            for writer in trackers:
                writer.close()
            raise
        out.samples = CompletionLog(
            os.path.join(config.log_dir, "completions.jsonl")
            if config.log_dir is not None and config.log_completions_every
            else None,
            print_rows=config.completions_to_print,
            keep_until=resume_step,
            writers=trackers,
        )
    except BaseException:
        out.close()
        raise
    return out


def _tracker_config(config: Any, fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """The run's settings for W&B's and trackio's config panel (the parameter shapes left out)."""
    settings = (
        {"train_config": dataclasses.asdict(config)} if dataclasses.is_dataclass(config) else {}
    )
    return settings | {k: v for k, v in fingerprint.items() if k != "trainable_shapes"}


def _restore(
    config: Any, trainer: Any, fingerprint: Mapping[str, Any], out: RunOutputs
) -> CheckpointManager:
    manager = CheckpointManager(config.checkpoint_dir, max_to_keep=config.keep_checkpoints)
    out.manager = manager  # closed by the caller if anything below fails
    existing = manager.all_steps()
    if existing and config.overwrite:
        manager.delete_all()
    elif existing and not config.resume:
        msg = (
            f"checkpoint directory {manager.directory} already holds checkpoints (steps "
            f"{existing}) and resume is off: continue that run with resume=True "
            "(--resume true), delete them with overwrite=True (--overwrite), or choose "
            "another directory"
        )
        raise FileExistsError(msg)
    elif existing:
        ignore = ("dataset",) if config.allow_dataset_change else ()
        ignore += _keys_missing_in_checkpoint(manager, fingerprint)
        restored, meta = manager.restore(
            trainer.checkpoint_state(), fingerprint=fingerprint, ignore=ignore
        )
        trainer.load_checkpoint_state(restored)
        out.start_step = int(meta["step"])
        out.record = meta
    return manager


def _keys_missing_in_checkpoint(
    manager: CheckpointManager, fingerprint: Mapping[str, Any]
) -> tuple[str, ...]:
    """Later fingerprint entries the newest checkpoint lacks (not compared, with a warning)."""
    try:
        saved = manager.read_metadata().get("fingerprint", {})
    except Exception:  # a damaged record: the restore falls back and reports it
        return ()
    missing = tuple(k for k in LATER_FINGERPRINT_KEYS if k in fingerprint and k not in saved)
    if missing and is_primary_process():
        _log.warning(
            f"the newest checkpoint in {manager.directory} was written before its fingerprint "
            f"recorded {' and '.join(missing)}: they are not compared on this resume (use the "
            "same ones as the run that wrote it)"
        )
    return missing
