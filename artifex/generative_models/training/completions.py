"""Sample completions of a run: a JSON Lines file, a console table, and the trackers' tables.

:class:`CompletionLog` appends every completion of a logged step (its prompt, text, each
reward, the combined reward and the advantage) to ``completions.jsonl``, prints a few as a
table (:func:`format_completions_table`) and hands the records to experiment trackers, which
show them as a table (:func:`~artifex.generative_models.training.logging.completions_as_table`).
Only the primary process writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

from artifex.generative_models.training.logging import (
    checked_writers,
    is_primary_process,
    keep_records_until,
)

__all__ = ["CompletionLog", "format_completions_table"]


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
        >>> from artifex.generative_models.training.completions import format_completions_table
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
        >>> from artifex.generative_models.training.completions import CompletionLog
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
        self.writers = checked_writers("CompletionLog.writers", writers, ("write_completions",))
        self.path = None if path is None else os.fspath(path)
        self.print_rows = int(print_rows)
        self.max_chars = int(max_chars)
        self._stream = stream
        self._fd: int | None = None
        if self.path is not None and is_primary_process():
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            if keep_until is not None and os.path.exists(self.path):
                keep_records_until(self.path, int(keep_until))
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
