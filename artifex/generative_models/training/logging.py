"""Metric writers for training loops: JSON Lines, TensorBoard, a progress bar.

Metrics go to a JSON Lines file, a progress bar and any other writers given to
:class:`MetricLogger` (TensorBoard here; Weights & Biases and trackio in
:mod:`~artifex.generative_models.training.trackers`); sample completions to a JSON Lines file,
a console table and the same writers
(:class:`~artifex.generative_models.training.completions.CompletionLog`, in its own module).

Every writer writes from the primary process only (``jax.process_index() == 0``), so a
multi-host run logs once.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from artifex.generative_models.utils.atomic import atomic_write
from artifex.generative_models.utils.validation import check_bool, check_int

__all__ = [
    "JsonlWriter",
    "MetricLogger",
    "ProgressBar",
    "TensorBoardWriter",
    "completions_as_table",
    "is_primary_process",
]


def is_primary_process() -> bool:
    """Whether this is the process that writes logs and files (process 0).

    Returns:
        ``True`` on process 0 (always, in a single-process run).

    Examples:
        >>> from artifex.generative_models.training import is_primary_process
        >>> is_primary_process()  # single-process run
        True
    """
    return jax.process_index() == 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them readable
    return value


def keep_records_until(path: str, keep_until: int) -> None:
    """Rewrites a JSONL log atomically, keeping the complete records of steps ``<= keep_until``."""
    kept = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill
            if isinstance(record, dict) and int(record.get("step", 0)) <= keep_until:
                kept.append(line if line.endswith("\n") else line + "\n")
    with atomic_write(path) as fh:
        fh.writelines(kept)


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

    Examples:
        >>> import json, os, tempfile
        >>> from artifex.generative_models.training.logging import JsonlWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        >>> writer = JsonlWriter(path)
        >>> for step in (1, 2, 3):
        ...     writer.write(step, {"reward_mean": step / 10})
        >>> writer.close()
        >>> writer = JsonlWriter(path, keep_until=2)  # resuming from the step-2 checkpoint
        >>> writer.close()
        >>> [json.loads(line) for line in open(path)]
        [{'step': 1, 'reward_mean': 0.1}, {'step': 2, 'reward_mean': 0.2}]
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
        keep_records_until(self.path, keep_until)

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
    """Metrics to TensorBoard event files, through ``tensorboardX`` or ``torch.utils.tensorboard``.

    Use :meth:`create`, which returns ``None`` when neither package is installed
    (``pip install 'artifex-grpo[tensorboard]'`` installs ``tensorboardX``).

    Args:
        writer: A ``SummaryWriter``.

    Examples:
        >>> import tempfile
        >>> from artifex.generative_models.training.logging import TensorBoardWriter
        >>> writer = TensorBoardWriter.create(tempfile.mkdtemp())
        >>> writer is None or isinstance(writer, TensorBoardWriter)  # None without tensorboardX
        True
    """

    def __init__(self, writer: Any):
        self._writer = writer

    @classmethod
    def create(
        cls, logdir: str | os.PathLike[str], *, purge_step: int | None = None
    ) -> TensorBoardWriter | None:
        """A writer for ``logdir``, or ``None`` if no TensorBoard writer package is installed.

        Args:
            logdir: Directory for the event files.
            purge_step: TensorBoard hides the events of steps ``>= purge_step`` written to
                ``logdir`` before (``SummaryWriter``'s ``purge_step``): a run resumed from the
                checkpoint of step ``s`` passes ``s + 1``, a run started over ``0``. ``None``
                hides nothing.

        Returns:
            The writer or ``None`` (also on non-primary processes).

        Raises:
            TypeError: ``purge_step`` is not an int or ``None``.
            ValueError: ``purge_step`` is negative.
        """
        purge_step = check_int(
            "TensorBoardWriter.purge_step", purge_step, minimum=0, allow_none=True
        )
        if not is_primary_process():
            return None
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                return None
        return cls(SummaryWriter(os.fspath(logdir), purge_step=purge_step))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes every entry of ``metrics``: numbers as scalars (NaN and infinities too), text.

        Args:
            step: The step number.
            metrics: The step's metrics; a value that is not a number is written as text.
        """
        for key, value in metrics.items():
            if isinstance(value, numbers.Real):
                self._writer.add_scalar(key, float(value), step)
            else:
                self._writer.add_text(key, str(value), step)
        self._writer.flush()

    def write_completions(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        r"""Writes the step's completions as one Markdown table, under the tag ``completions``.

        The columns are those of :func:`completions_as_table`; the text is written whole, with
        ``|`` escaped and line breaks shown as ``\n``, missing values as ``-``.

        Args:
            step: The step number.
            records: The records
                :meth:`~artifex.generative_models.training.completions.CompletionLog.log`
                returns.
        """
        columns, rows = completions_as_table(records)

        def cell(value: Any) -> str:
            text = "-" if value is None else str(value)
            return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self._writer.add_text("completions", "\n".join(lines), step)
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

    Examples:
        >>> from artifex.generative_models.training.logging import ProgressBar
        >>> bar = ProgressBar(total=10, enabled=False)  # enabled=True shows a tqdm bar
        >>> bar.update({"reward_mean": 0.5, "kl": 0.01, "step_time": 0.2})
        >>> bar.close()
        >>> ProgressBar(total=-1)
        Traceback (most recent call last):
            ...
        ValueError: ProgressBar.total must be an int >= 0, got -1
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
    """Fans metrics out to a JSONL file, TensorBoard, other writers and a progress bar.

    Args:
        jsonl_path: JSONL file, or ``None``.
        tensorboard_dir: TensorBoard log directory, or ``None`` (no TensorBoard writer is
            made when neither ``tensorboardX`` nor ``torch`` is installed: see
            :meth:`TensorBoardWriter.create`).
        progress_total: Steps for the progress bar, or ``None`` for no bar.
        progress_initial: Steps already done.
        resume_step: The step a resumed run restarts from: the JSONL file keeps only the
            records up to it (see :class:`JsonlWriter`); ``None`` appends.
        writers: More writers, each with ``write(step, metrics)`` and ``close()`` (the
            trackers of :func:`~artifex.generative_models.training.trackers.open_trackers`);
            :meth:`close` closes them.

    Raises:
        TypeError: A step count that is not an int (or ``None`` where allowed), or a writer
            without ``write`` and ``close`` methods.
        ValueError: A negative step count.

    Examples:
        >>> import json, os, tempfile
        >>> from artifex.generative_models.training import MetricLogger
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        >>> logger = MetricLogger(jsonl_path=path)
        >>> logger.log(1, {"reward_mean": 0.25, "kl": 0.0})
        >>> logger.close()
        >>> json.loads(open(path).readline())
        {'step': 1, 'reward_mean': 0.25, 'kl': 0.0}
    """

    def __init__(
        self,
        *,
        jsonl_path: str | os.PathLike[str] | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        progress_total: int | None = None,
        progress_initial: int = 0,
        resume_step: int | None = None,
        writers: Sequence[Any] = (),
    ):
        check_int("MetricLogger.resume_step", resume_step, minimum=0, allow_none=True)
        self.writers = checked_writers("MetricLogger.writers", writers, ("write", "close"))
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
        for writer in self.writers:
            writer.write(step, metrics)
        if self.progress is not None and advance:
            self.progress.update(metrics)

    def close(self) -> None:
        """Closes every writer (all of them, even if one fails; the first error is raised)."""
        error = None
        for writer in (self.jsonl, self.tensorboard, *self.writers, self.progress):
            try:
                if writer is not None:
                    writer.close()
            except Exception as err:
                error = error or err
        self.writers = []
        if error is not None:
            raise error


def checked_writers(name: str, writers: Any, methods: Sequence[str]) -> list[Any]:
    if isinstance(writers, str | bytes) or not isinstance(writers, Sequence):
        msg = f"{name} must be a sequence of writers, got {writers!r}"
        raise TypeError(msg)
    for writer in writers:
        missing = [m for m in methods if not callable(getattr(writer, m, None))]
        if missing:
            msg = f"{name}: {writer!r} has no {' or '.join(missing)} method"
            raise TypeError(msg)
    return list(writers)


def completions_as_table(
    records: Sequence[Mapping[str, Any]],
) -> tuple[list[str], list[list[Any]]]:
    """A completion log's records as the columns and rows of a tracker's table.

    The records are those of
    :meth:`~artifex.generative_models.training.completions.CompletionLog.log`.

    One column per key of the records, in their order (``step``, ``index``, ``group``,
    ``prompt``, ``completion``, ``reward``, ``advantage``), except ``rewards``, which becomes one
    column per reward function, ``rewards/<name>``, where ``rewards`` stood. A value a record
    lacks is ``None``. Nothing is shortened.

    Args:
        records: The records.

    Returns:
        ``(columns, rows)``: the column names and one list of values per record.

    Examples:
        >>> from artifex.generative_models.training.logging import completions_as_table
        >>> records = [{"step": 3, "prompt": "1+2=", "completion": "3",
        ...             "rewards": {"math": 1.0, "format": None}, "advantage": 0.5}]
        >>> columns, rows = completions_as_table(records)
        >>> columns
        ['step', 'prompt', 'completion', 'rewards/math', 'rewards/format', 'advantage']
        >>> rows
        [[3, '1+2=', '3', 1.0, None, 0.5]]
    """
    columns: dict[str, tuple[str, str | None]] = {}  # column -> (record key, reward name)
    for record in records:
        for key, value in record.items():
            if key == "rewards" and isinstance(value, Mapping):
                for name in value:
                    columns.setdefault(f"rewards/{name}", (key, str(name)))
            else:
                columns.setdefault(str(key), (key, None))
    rows = [
        [
            record.get(key) if name is None else (record.get(key) or {}).get(name)
            for key, name in columns.values()
        ]
        for record in records
    ]
    return list(columns), rows


_MOVED = {"CompletionLog", "format_completions_table"}  # to training.completions


def __getattr__(name: str) -> Any:
    """Old path of the completion log's names: warns and returns them from their new module."""
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(
            f"artifex.generative_models.training.logging.{name} is deprecated; import it from "
            "artifex.generative_models.training.completions",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(
            importlib.import_module("artifex.generative_models.training.completions"), name
        )
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)
