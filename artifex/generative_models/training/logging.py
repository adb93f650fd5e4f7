"""Metric writers for training loops: JSON Lines, TensorBoard (when installed), a progress bar.

Every writer writes from the primary process only (``jax.process_index() == 0``), so a
multi-host run logs once.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax

from artifex.generative_models.utils.atomic import atomic_write
from artifex.generative_models.utils.validation import check_bool, check_int

__all__ = ["JsonlWriter", "MetricLogger", "ProgressBar", "TensorBoardWriter", "is_primary_process"]


def is_primary_process() -> bool:
    """Whether this is the process that writes logs and files (process 0).

    Returns:
        ``True`` on process 0 (always, in a single-process run).
    """
    return jax.process_index() == 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them readable
    return value


class JsonlWriter:
    """Appends one JSON object per call to a ``.jsonl`` file.

    Args:
        path: File to append to (its directory is created).
        keep_until: When resuming from a checkpoint of this step: first rewrite the file
            (atomically: a temporary file renamed over it) keeping only complete records of
            steps ``<= keep_until``, so the steps redone after the checkpoint are not logged
            twice and a line torn by a kill is dropped. ``None`` appends to the file as it is.

    Raises:
        TypeError: ``keep_until`` is not an int or ``None``.
        ValueError: ``keep_until`` is negative.
    """

    def __init__(self, path: str | os.PathLike[str], *, keep_until: int | None = None):
        keep_until = check_int("JsonlWriter.keep_until", keep_until, minimum=0, allow_none=True)
        self.path = os.fspath(path)
        self._fh = None
        if is_primary_process():
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            if keep_until is not None and os.path.exists(self.path):
                self._truncate(keep_until)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _truncate(self, keep_until: int) -> None:
        kept = []
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a kill
                if isinstance(record, dict) and int(record.get("step", 0)) <= keep_until:
                    kept.append(line if line.endswith("\n") else line + "\n")
        with atomic_write(self.path) as fh:
            fh.writelines(kept)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes ``{"step": step, **metrics}`` as one line.

        Args:
            step: The step number.
            metrics: Scalar metrics.
        """
        if self._fh is None:
            return
        record = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        """Closes the file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class TensorBoardWriter:
    """Scalars to TensorBoard event files, through ``tensorboardX`` or ``torch.utils.tensorboard``.

    Use :meth:`create`, which returns ``None`` when neither package is installed.

    Args:
        writer: A ``SummaryWriter``.
    """

    def __init__(self, writer: Any):
        self._writer = writer

    @classmethod
    def create(cls, logdir: str | os.PathLike[str]) -> TensorBoardWriter | None:
        """A writer for ``logdir``, or ``None`` if no TensorBoard writer package is installed.

        Args:
            logdir: Directory for the event files.

        Returns:
            The writer or ``None`` (also on non-primary processes).
        """
        if not is_primary_process():
            return None
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                return None
        return cls(SummaryWriter(os.fspath(logdir)))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes each finite scalar of ``metrics`` under its name.

        Args:
            step: The step number.
            metrics: Scalar metrics.
        """
        for key, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        """Closes the writer."""
        self._writer.close()


class ProgressBar:
    """A tqdm progress bar showing reward, KL and step time.

    Args:
        total: Number of steps.
        initial: Steps already done (when resuming).
        enabled: Show it (only on the primary process).

    Raises:
        TypeError: ``total`` or ``initial`` is not an int, or ``enabled`` not a bool.
        ValueError: ``total`` or ``initial`` is negative.
    """

    def __init__(self, total: int, *, initial: int = 0, enabled: bool = True):
        total = check_int("ProgressBar.total", total, minimum=0)
        initial = check_int("ProgressBar.initial", initial, minimum=0)
        enabled = check_bool("ProgressBar.enabled", enabled)
        self._bar = None
        if enabled and is_primary_process():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="GRPO", dynamic_ncols=True)

    def update(self, metrics: Mapping[str, Any]) -> None:
        """Advances one step and shows the headline metrics.

        Args:
            metrics: The step's metrics (``reward_mean``, ``kl``, ``step_time`` are shown).
        """
        if self._bar is None:
            return
        shown = {
            "reward": metrics.get("reward_mean"),
            "kl": metrics.get("kl"),
            "s/step": metrics.get("step_time"),
        }
        self._bar.set_postfix(
            {k: f"{v:.3g}" for k, v in shown.items() if isinstance(v, int | float)}, refresh=False
        )
        self._bar.update(1)

    def close(self) -> None:
        """Closes the bar."""
        if self._bar is not None:
            self._bar.close()


class MetricLogger:
    """Fans metrics out to a JSONL file, TensorBoard (when installed) and a progress bar.

    Args:
        jsonl_path: JSONL file, or ``None``.
        tensorboard_dir: TensorBoard log directory, or ``None``.
        progress_total: Steps for the progress bar, or ``None`` for no bar.
        progress_initial: Steps already done.
        resume_step: The step a resumed run restarts from: the JSONL file keeps only the
            records up to it (see :class:`JsonlWriter`); ``None`` appends.

    Raises:
        TypeError: A step count that is not an int (or ``None`` where allowed).
        ValueError: A negative step count.
    """

    def __init__(
        self,
        *,
        jsonl_path: str | os.PathLike[str] | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        progress_total: int | None = None,
        progress_initial: int = 0,
        resume_step: int | None = None,
    ):
        check_int("MetricLogger.resume_step", resume_step, minimum=0, allow_none=True)
        check_int("MetricLogger.progress_total", progress_total, minimum=0, allow_none=True)
        check_int("MetricLogger.progress_initial", progress_initial, minimum=0)
        self.jsonl = None if jsonl_path is None else JsonlWriter(jsonl_path, keep_until=resume_step)
        self.tensorboard = (
            None if tensorboard_dir is None else TensorBoardWriter.create(tensorboard_dir)
        )
        self.progress = (
            None
            if progress_total is None
            else ProgressBar(progress_total, initial=progress_initial)
        )

    def log(self, step: int, metrics: Mapping[str, Any], *, advance: bool = True) -> None:
        """Writes one step's metrics everywhere.

        Args:
            step: The step number.
            metrics: Scalar metrics.
            advance: Advance the progress bar (``False`` for evaluation records).
        """
        if self.jsonl is not None:
            self.jsonl.write(step, metrics)
        if self.tensorboard is not None:
            self.tensorboard.write(step, metrics)
        if self.progress is not None and advance:
            self.progress.update(metrics)

    def close(self) -> None:
        """Closes every writer."""
        for writer in (self.jsonl, self.tensorboard, self.progress):
            if writer is not None:
                writer.close()
