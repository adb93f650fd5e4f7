"""Training and evaluation rows from what users have: lists of mappings or Hugging Face datasets.

The loop reads a dataset by ``len`` and row index (it shuffles per epoch and resumes at a saved
position), and hands each row's columns to the reward functions. :func:`as_rows` accepts:

- a sequence of mappings (a list of dicts), as it is;
- a ``datasets.Dataset`` (``load_dataset("json" | "parquet" | "csv", data_files=...,
  split=...)``, ``load_from_disk``, ``Dataset.from_list``...), with its format reset
  (``with_format(None)``), so that rows hold Python values (``str``, ``int``, lists of chat
  messages) as a list of dicts would, whatever ``set_format`` chose; it stays memory-mapped and
  rows are read as the loop takes them;
- a ``datasets.DatasetDict``: one of its splits.

A dataset and the list of its rows have the same content hash, so a run may resume from either.
Streamed datasets (``streaming=True``) have neither a length nor row indices and are refused.
The ``datasets`` package is never imported here: its objects are recognized by their class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["EVAL_SPLITS", "as_rows"]

#: The splits of a ``DatasetDict`` an evaluation set is taken from when none is named, in order.
EVAL_SPLITS = ("test", "validation")

_KINDS = ("Dataset", "DatasetDict", "IterableDataset", "IterableDatasetDict")


def _datasets_kind(obj: Any) -> str | None:
    """The ``datasets`` class ``obj`` is an instance of (of ``_KINDS``), or ``None``."""
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "datasets" and cls.__name__ in _KINDS:
            return cls.__name__
    return None


def as_rows(
    dataset: Any,
    *,
    split: str | None = None,
    default_splits: Sequence[str] = ("train",),
    what: str = "dataset",
) -> Sequence[Mapping[str, Any]]:
    """Rows the training loop can index, from a list of mappings or a ``datasets`` object.

    Args:
        dataset: A sequence of mappings, a ``datasets.Dataset`` or a ``datasets.DatasetDict``.
        split: The split of a ``DatasetDict`` to use. ``None``: the first of ``default_splits``
            it has, else its only split.
        default_splits: The splits to look for, in order, when ``split`` is ``None``.
        what: How to name ``dataset`` in errors (``"eval_dataset"``...).

    Returns:
        ``dataset`` itself (a sequence), the ``Dataset`` with Python-valued rows, or the
        ``DatasetDict``'s split.

    Raises:
        TypeError: A streamed (iterable) dataset, ``split`` given for something other than a
            ``DatasetDict``, or an object without ``len`` and row indexing (a generator).
        ValueError: The ``DatasetDict`` has no split ``split``, or, with ``split=None``, none of
            ``default_splits`` and more than one split.

    Examples:
        >>> from artifex.generative_models.training.rl.rollouts.dataset_rows import as_rows
        >>> rows = [{"prompt": "1+1=", "answer": "2"}]
        >>> as_rows(rows) is rows
        True
        >>> as_rows(row for row in rows)
        Traceback (most recent call last):
            ...
        TypeError: dataset must be rows the loop can index (a list of mappings, a datasets.Dataset or DatasetDict), got a generator
    """  # noqa: E501
    kind = _datasets_kind(dataset)
    if kind in ("IterableDataset", "IterableDatasetDict"):
        msg = (
            f"{what} is a datasets.{kind} (streamed): the loop needs the number of rows and "
            "indexes them (it shuffles per epoch and resumes at a position); load it without "
            "streaming=True"
        )
        raise TypeError(msg)
    if split is not None and kind != "DatasetDict":
        msg = f"{what}: split={split!r} is for a datasets.DatasetDict, got {_kind_name(dataset)}"
        raise TypeError(msg)
    if kind == "DatasetDict":
        names = list(dataset)
        if split is None:
            found = [s for s in default_splits if s in names]
            if not found and len(names) != 1:
                msg = (
                    f"{what} is a datasets.DatasetDict with the splits {names} and none of "
                    f"{list(default_splits)}: pass one split, e.g. {what}['{names[0]}']"
                )
                raise ValueError(msg)
            split = found[0] if found else names[0]
        if split not in names:
            msg = f"{what} has no split {split!r}; its splits are {names}"
            raise ValueError(msg)
        return as_rows(dataset[split], what=f"{what}[{split!r}]")
    if kind == "Dataset":
        return dataset.with_format(None)
    if (
        isinstance(dataset, str | bytes | Mapping)
        or not hasattr(dataset, "__len__")
        or not hasattr(dataset, "__getitem__")
    ):
        msg = (
            f"{what} must be rows the loop can index (a list of mappings, a datasets.Dataset or "
            f"DatasetDict), got {_kind_name(dataset)}"
        )
        raise TypeError(msg)
    return dataset


def _kind_name(obj: Any) -> str:
    name = type(obj).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"
