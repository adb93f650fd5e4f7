"""Metric writers for training loops: JSON Lines, TensorBoard, a progress bar, completions.

Metrics go to a JSON Lines file, a progress bar and any other writers given to
:class:`MetricLogger` (TensorBoard here; Weights & Biases and trackio in
:mod:`~artifex.generative_models.training.trackers`); sample completions to a JSON Lines file,
a console table and the same writers (:class:`CompletionLog`).

Every writer writes from the primary process only (``jax.process_index() == 0``), so a
multi-host run logs once.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

import jax

from artifex.generative_models.utils.atomic import atomic_write
from artifex.generative_models.utils.validation import check_bool, check_int

__all__ = [
    "CompletionLog",
    "JsonlWriter",
    "MetricLogger",
    "ProgressBar",
    "TensorBoardWriter",
    "completions_as_table",
    "format_completions_table",
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


def _keep_records_until(path: str, keep_until: int) -> None:
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
        _keep_records_until(self.path, keep_until)

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
            records: The records :meth:`CompletionLog.log` returns.
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
        self.writers = _checked_writers("MetricLogger.writers", writers, ("write", "close"))
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


def _checked_writers(name: str, writers: Any, methods: Sequence[str]) -> list[Any]:
    if isinstance(writers, str | bytes) or not isinstance(writers, Sequence):
        msg = f"{name} must be a sequence of writers, got {writers!r}"
        raise TypeError(msg)
    for writer in writers:
        missing = [m for m in methods if not callable(getattr(writer, m, None))]
        if missing:
            msg = f"{name}: {writer!r} has no {' or '.join(missing)} method"
            raise TypeError(msg)
    return list(writers)


# ------------------------------------------------------------------------------ completions


def _json_reward(value: Any) -> float | None:
    value = float(value) if value is not None else float("nan")
    return value if math.isfinite(value) else None  # NaN: the function gave no reward


def _cell(text: str, width: int, *, keep_end: bool = False) -> str:
    """``text`` on one line, cut to ``width`` characters (the table only; files keep it all).

    ``keep_end`` keeps the last characters (``...`` first) instead of the first ones.
    """
    text = str(text).replace("\r", "").replace("\n", "\\n").replace("\t", " ")
    if len(text) <= width:
        return text
    if keep_end:
        return "..." + text[len(text) - max(width - 3, 0) :]
    return text[: max(width - 3, 0)] + "..."


def _number(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}"


def format_completions_table(
    records: Sequence[Mapping[str, Any]], *, max_rows: int = 4, max_chars: int = 40
) -> str:
    r"""A compact text table of sample completions: row, prompt, completion, rewards, advantage.

    Long or multi-line prompts and completions are shown on one line and cut to ``max_chars``
    characters: a prompt keeps its end (``...`` first: chat templates start every prompt with
    the same text, the question comes last), a completion its start (``...`` last). The
    numbers are shown with 3 significant digits and ``-`` for a missing reward.

    Args:
        records: Records as :meth:`CompletionLog.log` builds them (``index``, ``prompt``,
            ``completion``, ``rewards``, ``advantage``).
        max_rows: Show the first this many records.
        max_chars: Width of the prompt and completion columns.

    Returns:
        The table, one line per record under a header line (no trailing newline).

    Examples:
        >>> from artifex.generative_models.training.logging import format_completions_table
        >>> records = [
        ...     {"index": 0, "prompt": "1+2=", "completion": "3", "rewards": {"math": 1.0},
        ...      "advantage": 0.707},
        ...     {"index": 1, "prompt": "1+2=", "completion": "4\nor 5", "rewards": {"math": 0.0},
        ...      "advantage": -0.707},
        ... ]
        >>> print(format_completions_table(records))
        row  prompt  completion  math  advantage
          0  1+2=    3           1     0.707
          1  1+2=    4\nor 5     0     -0.707
    """
    shown = list(records[:max_rows])
    names = list(dict.fromkeys(n for r in shown for n in r.get("rewards", {})))
    header = ["row", "prompt", "completion", *names, "advantage"]
    lines = [header]
    for r in shown:
        rewards = r.get("rewards", {})
        lines.append(
            [
                str(r.get("index", "")),
                _cell(r.get("prompt", ""), max_chars, keep_end=True),
                _cell(r.get("completion", ""), max_chars),
                *(_number(rewards.get(n)) for n in names),
                _number(r.get("advantage")),
            ]
        )
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    out = []
    for line in lines:
        cells = [line[0].rjust(widths[0])]
        cells += [cell.ljust(w) for cell, w in zip(line[1:], widths[1:], strict=True)]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def completions_as_table(
    records: Sequence[Mapping[str, Any]],
) -> tuple[list[str], list[list[Any]]]:
    """The records of :meth:`CompletionLog.log` as the columns and rows of a tracker's table.

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


class CompletionLog:
    """Sample completions of a run: every one to a JSONL file, a few in a console table.

    Each call of :meth:`log` appends one JSON object per completion, one line each::

        {"step": 10, "index": 0, "group": 0, "prompt": "...", "completion": "...",
         "rewards": {"math": 1.0, "format": 0.0}, "reward": 1.0, "advantage": 0.87}

    ``index`` is the row in the generation batch, ``group`` its prompt (``index // G``),
    ``rewards`` each reward function's raw value (``null`` when the function gave none),
    ``reward`` the combined reward the advantage was computed from and ``advantage`` the row's
    advantage (the mean over its completion tokens for per-token advantages). The text is never
    shortened in the file. A step's lines go to the file in one unbuffered ``write`` call on a
    descriptor opened with ``O_APPEND``, so each record is appended whole; a line torn by a kill is
    dropped when a resumed run rewrites the file (``keep_until``). The file is never rotated.

    Only the primary process writes and prints; :meth:`log` returns the records everywhere.
    ``writers`` (experiment trackers) get each call's records too, through their
    ``write_completions(step, records)``; they are closed by their owner (the
    :class:`MetricLogger` that holds them), not by :meth:`close`.

    Args:
        path: The JSONL file (its directory is created), or ``None`` for the table only.
        print_rows: Rows of the console table per call (0: no table).
        max_chars: Width of the table's prompt and completion columns.
        keep_until: When resuming from a checkpoint of this step, first keep only the records
            of steps ``<= keep_until`` (see :class:`JsonlWriter`); ``None`` appends.
        stream: Where the table goes (default ``sys.stdout``); it is written with
            ``tqdm.write`` so a progress bar stays intact.
        writers: Writers with a ``write_completions(step, records)`` method.

    Raises:
        TypeError: A writer without a ``write_completions`` method.

    Examples:
        >>> import io
        >>> from artifex.generative_models.training.logging import CompletionLog
        >>> out = io.StringIO()
        >>> log = CompletionLog(None, print_rows=2, stream=out)
        >>> records = log.log(
        ...     3,
        ...     prompts=["1+2=", "1+2="],
        ...     completions=["3", "4"],
        ...     rewards={"math": [1.0, 0.0]},
        ...     advantages=[0.707, -0.707],
        ... )
        >>> last = records[1]
        >>> last["advantage"], last["rewards"]
        (-0.707, {'math': 0.0})
        >>> print(out.getvalue().splitlines()[0])
        completions at step 3 (2 of 2):
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        print_rows: int = 4,
        max_chars: int = 40,
        keep_until: int | None = None,
        stream: IO[str] | None = None,
        writers: Sequence[Any] = (),
    ):
        self.writers = _checked_writers("CompletionLog.writers", writers, ("write_completions",))
        self.path = None if path is None else os.fspath(path)
        self.print_rows = int(print_rows)
        self.max_chars = int(max_chars)
        self._stream = stream
        self._fd: int | None = None
        if self.path is not None and is_primary_process():
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            if keep_until is not None and os.path.exists(self.path):
                _keep_records_until(self.path, int(keep_until))
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(
        self,
        step: int,
        *,
        prompts: Sequence[str],
        completions: Sequence[str],
        rewards: Mapping[str, Sequence[float | None]],
        advantages: Sequence[float] | Any,
        total_rewards: Sequence[float | None] | Any = None,
        group_size: int | None = None,
        first_index: int = 0,
    ) -> list[dict[str, Any]]:
        """Appends one step's completions to the file and prints the first rows as a table.

        Args:
            step: The training step.
            prompts: The prompt of each row (as the model saw it).
            completions: The decoded completions, one per row.
            rewards: Each reward function's name and its value on each row (NaN/None: none).
            advantages: Each row's advantage.
            total_rewards: Each row's combined reward (``None``: not recorded).
            group_size: Completions per prompt, for the ``group`` key (``None``: left out).
            first_index: The batch row of the first completion (a process's rows of a batch
                spread over several processes start further on).

        Returns:
            The records (one dict per row), also on processes that write nothing.

        Raises:
            ValueError: The sequences do not all have one entry per completion.
        """
        n = len(completions)
        columns = {"prompts": prompts, "advantages": advantages, **rewards}
        if total_rewards is not None:
            columns["total_rewards"] = total_rewards
        for name, values in columns.items():
            if len(values) != n:
                msg = f"CompletionLog.log: {name!r} has {len(values)} entries for {n} completions"
                raise ValueError(msg)
        records = []
        for i in range(n):
            index = int(first_index) + i
            record: dict[str, Any] = {"step": int(step), "index": index}
            if group_size:
                record["group"] = index // int(group_size)
            record["prompt"] = str(prompts[i])
            record["completion"] = str(completions[i])
            record["rewards"] = {k: _json_reward(v[i]) for k, v in rewards.items()}
            if total_rewards is not None:
                record["reward"] = _json_reward(total_rewards[i])
            record["advantage"] = _json_reward(advantages[i])
            records.append(record)
        if not is_primary_process():
            return records
        if self._fd is not None and records:
            data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            view = memoryview(data.encode("utf-8"))
            while view:  # one write in practice; loop on a short write
                view = view[os.write(self._fd, view) :]
        for writer in self.writers:
            writer.write_completions(int(step), records)
        if self.print_rows > 0 and records:
            shown = min(self.print_rows, n)
            where = "" if self.path is None else f"; all in {self.path}"
            table = format_completions_table(records, max_rows=shown, max_chars=self.max_chars)
            from tqdm.auto import tqdm

            tqdm.write(
                f"completions at step {int(step)} ({shown} of {n}{where}):\n{table}",
                file=self._stream or sys.stdout,
            )
        return records

    def close(self) -> None:
        """Closes the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
