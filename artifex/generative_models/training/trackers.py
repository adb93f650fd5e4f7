"""Experiment trackers for training runs: TensorBoard, Weights & Biases, trackio.

``TrainConfig.report_to`` (``--report-to`` on the command line) names where the loop's metrics
go, as TRL's ``report_to`` does. ``log_dir/metrics.jsonl`` is always written when there is a
``log_dir`` (a resumed run cuts it back to its checkpoint); the trackers come on top:

| name | package (extra) | where |
| --- | --- | --- |
| ``jsonl`` | none | ``log_dir/metrics.jsonl`` (and ``completions.jsonl``) |
| ``tensorboard`` | ``tensorboardX`` or ``torch`` (``[tensorboard]``) | ``log_dir/tb`` |
| ``wandb`` | ``wandb`` (``[wandb]``) | ``log_dir/wandb``, synced unless ``WANDB_MODE=offline`` |
| ``trackio`` | ``trackio`` (``[trackio]``) | trackio's local database (``TRACKIO_DIR``) |

``none`` names no tracker (``metrics.jsonl`` only, the default). Every tracker gets every key
of every :class:`~artifex.generative_models.training.logging.MetricLogger` record at its step
(training metrics and evaluations) and, with ``log_completions_every``, the step's completions
as a table (:func:`~artifex.generative_models.training.logging.completions_as_table`).

A tracker whose package is missing is an ``ImportError`` naming the extra when the config is
made, on every process (so none of them starts alone); only the primary process opens the
trackers and writes. The W&B project is ``WANDB_PROJECT`` (default ``artifex-grpo``; W&B reads
its other variables, ``WANDB_ENTITY``, ``WANDB_NAME``, ``WANDB_MODE``, itself), trackio's is
``TRACKIO_PROJECT`` (default ``artifex-grpo``). Each start of a run is a new W&B or trackio run;
TensorBoard hides the events a resumed run writes again (``purge_step``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from artifex.generative_models.training.logging import (
    TensorBoardWriter,
    completions_as_table,
    is_primary_process,
)
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "DEFAULT_PROJECT",
    "REPORT_TO_NAMES",
    "MetricWriter",
    "TrackioWriter",
    "WandbWriter",
    "check_report_to",
    "open_trackers",
]

#: The names ``report_to`` accepts (besides ``none``).
REPORT_TO_NAMES = ("jsonl", "tensorboard", "wandb", "trackio")

#: The W&B and trackio project when ``WANDB_PROJECT`` / ``TRACKIO_PROJECT`` is not set.
DEFAULT_PROJECT = "artifex-grpo"

# name -> (the modules any one of which provides it, the extra that installs it)
_PACKAGES = {
    "tensorboard": ((("tensorboardX",), ("torch", "tensorboard")), "tensorboard"),
    "wandb": ((("wandb",),), "wandb"),
    "trackio": ((("trackio",),), "trackio"),
}


@runtime_checkable
class MetricWriter(Protocol):
    """What a tracker provides: the loop's metrics, its completion tables, a close.

    Examples:
        >>> from artifex.generative_models.training.trackers import MetricWriter
        >>> class Printer:
        ...     def write(self, step, metrics): print(step, dict(metrics))
        ...     def write_completions(self, step, records): print(step, len(records), "rows")
        ...     def close(self): print("closed")
        >>> isinstance(Printer(), MetricWriter)
        True
    """

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records one step's metrics."""

    def write_completions(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Records one step's completions (the records of ``CompletionLog.log``)."""

    def close(self) -> None:
        """Finishes the run and releases what the writer holds."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails to import, a broken module spec
        return False


def _missing_message(name: str, field: str) -> str:
    alternatives, extra = _PACKAGES[name]
    packages = " or ".join(" with ".join(a) for a in alternatives)
    return (
        f"{field} names {name!r}, but {packages} is not installed: "
        f"pip install 'artifex-grpo[{extra}]'"
    )


def check_report_to(value: Any, *, field: str = "TrainConfig.report_to") -> tuple[str, ...]:
    """Checks a ``report_to`` value and returns it as ``("jsonl", tracker, ...)``.

    ``value`` is a name, a comma-separated list of names (``"tensorboard,wandb"``) or a
    sequence of such strings. Names are case-insensitive; a repeated name counts once. ``none``
    (alone) and ``jsonl`` name no tracker: the result always starts with ``"jsonl"``.

    Args:
        value: The names.
        field: How to name the setting in errors.

    Returns:
        ``"jsonl"`` followed by the trackers, in the order given.

    Raises:
        TypeError: ``value`` is not a string or a sequence of strings.
        ValueError: An unknown or empty name, ``all``, or ``none`` beside other names.
        ImportError: A tracker whose package is not installed (the message names the extra).

    Examples:
        >>> from artifex.generative_models.training.trackers import check_report_to
        >>> check_report_to("none"), check_report_to(["jsonl", "JSONL"])
        (('jsonl',), ('jsonl',))
        >>> check_report_to("comet")
        Traceback (most recent call last):
            ...
        ValueError: TrainConfig.report_to: unknown tracker 'comet': use jsonl, tensorboard, wandb, trackio or none
    """  # noqa: E501
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not all(isinstance(v, str) for v in items):
        msg = f"{field} must be a string or a sequence of strings, got {value!r}"
        raise TypeError(msg)
    names = [n.strip().lower() for item in items for n in item.split(",")]
    if not names or "" in names:
        msg = f"{field}: an empty tracker name in {value!r} (use none for no tracker)"
        raise ValueError(msg)
    choices = ", ".join(REPORT_TO_NAMES) + " or none"
    for name in names:
        if name == "all":
            msg = (
                f"{field}: 'all' is not accepted: name the trackers ({choices}); a run reports "
                "to what it names, not to whatever happens to be installed"
            )
            raise ValueError(msg)
        if name not in (*REPORT_TO_NAMES, "none"):
            msg = f"{field}: unknown tracker {name!r}: use {choices}"
            raise ValueError(msg)
    if "none" in names and len(set(names)) > 1:
        msg = f"{field}: 'none' means no tracker and cannot stand beside others, got {value!r}"
        raise ValueError(msg)
    trackers = [n for n in dict.fromkeys(names) if n not in ("jsonl", "none")]
    for name in trackers:
        alternatives, _ = _PACKAGES[name]
        if not any(all(_installed(m) for m in modules) for modules in alternatives):
            raise ImportError(_missing_message(name, field))
    return ("jsonl", *trackers)


class WandbWriter:
    """Metrics and completion tables to a Weights & Biases run.

    Use :meth:`create` to start the run; the writer itself takes any object with W&B's
    ``log(data, step=...)`` and ``finish()``.

    Args:
        run: The run (``wandb.init()``'s result).

    Examples:
        >>> from artifex.generative_models.training.trackers import WandbWriter
        >>> class Run:  # stands in for wandb.init()'s run
        ...     def log(self, data, step): print(step, data)
        ...     def finish(self): print("finished")
        >>> writer = WandbWriter(Run())
        >>> writer.write(3, {"reward_mean": 0.5, "kl": 0.01})
        3 {'reward_mean': 0.5, 'kl': 0.01}
        >>> writer.close()
        finished
    """

    def __init__(self, run: Any):
        self._run = run

    @classmethod
    def create(
        cls, *, log_dir: str | os.PathLike[str] | None, config: Mapping[str, Any] | None = None
    ) -> WandbWriter:
        """Starts a W&B run (a new one, beside any the process has open).

        Args:
            log_dir: The run's files go to ``log_dir/wandb`` (``None``: W&B's default,
                ``./wandb``).
            config: The run's settings, shown in W&B's config panel.

        Returns:
            The writer.

        Raises:
            ImportError: ``wandb`` is not installed.
            RuntimeError: ``wandb.init`` failed (not logged in, no network): the message says
                how to log in or to write the run offline.
        """
        try:
            import wandb
        except ImportError as err:
            raise ImportError(_missing_message("wandb", "report_to")) from err
        try:
            run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                dir=None if log_dir is None else os.fspath(log_dir),
                config=None if config is None else dict(config),
                reinit="create_new",
            )
        except Exception as err:
            msg = (
                f"report_to 'wandb': wandb.init failed ({type(err).__name__}: {err}): log in "
                "with `wandb login` (or WANDB_API_KEY), or set WANDB_MODE=offline to write the "
                "run under log_dir/wandb and upload it later with `wandb sync`"
            )
            raise RuntimeError(msg) from err
        return cls(run)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs every entry of ``metrics`` at ``step``.

        Args:
            step: The step number.
            metrics: The step's metrics.
        """
        self._run.log(dict(metrics), step=int(step))

    def write_completions(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Logs the step's completions as a ``wandb.Table`` under the key ``completions``.

        Args:
            step: The step number.
            records: The records of ``CompletionLog.log``.
        """
        import wandb

        columns, rows = completions_as_table(records)
        self._run.log({"completions": wandb.Table(columns=columns, data=rows)}, step=int(step))

    def close(self) -> None:
        """Finishes the run."""
        self._run.finish()


class TrackioWriter:
    """Metrics and completion tables to a trackio run (local-first, W&B-like).

    Use :meth:`create` to start the run; the writer itself takes any object with trackio's
    ``log(metrics, step=...)`` and ``finish()``.

    Args:
        run: The run (``trackio.init()``'s result).

    Examples:
        >>> from artifex.generative_models.training.trackers import TrackioWriter
        >>> class Run:  # stands in for trackio.init()'s run
        ...     def log(self, metrics, step): print(step, metrics)
        ...     def finish(self): print("finished")
        >>> writer = TrackioWriter(Run())
        >>> writer.write(1, {"reward_mean": 0.25})
        1 {'reward_mean': 0.25}
        >>> writer.close()
        finished
    """

    def __init__(self, run: Any):
        self._run = run

    @classmethod
    def create(cls, *, config: Mapping[str, Any] | None = None) -> TrackioWriter:
        """Starts a trackio run in the project ``TRACKIO_PROJECT`` (default ``artifex-grpo``).

        trackio keeps its runs in a local database (``TRACKIO_DIR``, by default under the
        Hugging Face cache); ``trackio show`` opens its dashboard. ``trackio.init`` finishes
        the process's current trackio run, if any.

        Args:
            config: The run's settings.

        Returns:
            The writer.

        Raises:
            ImportError: ``trackio`` is not installed.
        """
        try:
            import trackio
        except ImportError as err:
            raise ImportError(_missing_message("trackio", "report_to")) from err
        run = trackio.init(
            project=os.environ.get("TRACKIO_PROJECT") or DEFAULT_PROJECT,
            config=None if config is None else dict(config),
            embed=False,
        )
        return cls(run)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs every entry of ``metrics`` at ``step``.

        Args:
            step: The step number.
            metrics: The step's metrics.
        """
        self._run.log(dict(metrics), step=int(step))

    def write_completions(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Logs the step's completions as a ``trackio.Table`` under the key ``completions``.

        Args:
            step: The step number.
            records: The records of ``CompletionLog.log``.
        """
        import trackio

        columns, rows = completions_as_table(records)
        self._run.log({"completions": trackio.Table(columns=columns, data=rows)}, step=int(step))

    def close(self) -> None:
        """Finishes the run (trackio flushes what it still holds)."""
        self._run.finish()


def open_trackers(
    report_to: Any,
    *,
    log_dir: str | os.PathLike[str] | None,
    config: Mapping[str, Any] | None = None,
    purge_step: int | None = None,
) -> list[MetricWriter]:
    """Opens the trackers ``report_to`` names (none on a non-primary process).

    Args:
        report_to: As :func:`check_report_to` takes it.
        log_dir: The run's log directory: TensorBoard writes to ``log_dir/tb``, W&B to
            ``log_dir/wandb``.
        config: The run's settings, for W&B's and trackio's config.
        purge_step: TensorBoard hides earlier events of steps ``>= purge_step``
            (:meth:`~artifex.generative_models.training.logging.TensorBoardWriter.create`).

    Returns:
        The writers, in the order named (``jsonl`` is not among them: the
        :class:`~artifex.generative_models.training.logging.MetricLogger` writes it).

    Raises:
        ValueError: ``tensorboard`` without a ``log_dir``, or a bad name.
        ImportError: A tracker's package is missing.
        RuntimeError: A tracker failed to start (see :meth:`WandbWriter.create`).

    Examples:
        >>> from artifex.generative_models.training.trackers import open_trackers
        >>> open_trackers("none", log_dir=None)
        []
    """
    names = check_report_to(report_to, field="report_to")[1:]
    purge_step = check_int("purge_step", purge_step, minimum=0, allow_none=True)
    if "tensorboard" in names and log_dir is None:
        msg = "report_to 'tensorboard' writes under log_dir/tb: give a log_dir"
        raise ValueError(msg)
    if not is_primary_process():
        return []
    writers: list[MetricWriter] = []
    try:
        for name in names:
            if name == "tensorboard":
                tb_dir = os.path.join(os.fspath(log_dir), "tb")
                writer = TensorBoardWriter.create(tb_dir, purge_step=purge_step)
                if writer is None:
                    raise ImportError(_missing_message(name, "report_to"))
                writers.append(writer)
            elif name == "wandb":
                writers.append(WandbWriter.create(log_dir=log_dir, config=config))
            else:
                writers.append(TrackioWriter.create(config=config))
    except BaseException:
        for writer in writers:
            writer.close()
        raise
    return writers
