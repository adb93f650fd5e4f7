"""``artifex-grpo train`` data formats: ``--data-format`` and ``datasets.load_dataset``.

``--data-format FORMAT`` (``--eval-data-format`` for ``--eval-data``) says how the rows are read:

- ``auto`` (the default): a directory written by ``datasets``' ``save_to_disk``, else by the
  file's extension: ``.jsonl``, ``.json``, ``.csv``, ``.parquet``;
- ``jsonl``, ``json``, ``csv``, ``parquet``, ``save_to_disk``: that reader, whatever the name
  (CSV and Parquet through ``pyarrow``, which infers each column's type: ``3`` is an int);
- ``load_dataset``: ``datasets.load_dataset`` (the ``[datasets]`` extra) reads it, as a user's
  own script would: a file by its extension (``json`` for ``.json`` and ``.jsonl``, ``csv``,
  ``parquet``, ``arrow``, ``text`` for ``.txt``), else a directory of data files (splits from
  the file names, e.g. ``train.jsonl`` and ``test.jsonl``) or a dataset already in the local
  Hugging Face cache (set ``HF_DATASETS_OFFLINE=1`` to be sure nothing is downloaded).
  ``--split`` picks the split (default ``train``; for ``--eval-data`` ``test``, else
  ``validation``; else the only one).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

#: The values of ``--data-format`` and ``--eval-data-format``.
DATA_FORMATS = ("auto", "jsonl", "json", "csv", "parquet", "save_to_disk", "load_dataset")

_EXTENSIONS = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

# load_dataset's packaged builder for a file's extension
_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}


def add_options(tr: argparse.ArgumentParser) -> None:
    """Adds ``--data-format`` and ``--eval-data-format`` to the ``train`` parser.

    Args:
        tr: The ``train`` subcommand's parser.
    """
    for option, what in (("--data-format", "--data"), ("--eval-data-format", "--eval-data")):
        tr.add_argument(
            option,
            choices=DATA_FORMATS,
            default="auto",
            help=f"how {what} is read: auto (a save_to_disk directory, else by extension: "
            ".jsonl, .json, .csv, .parquet), one of those readers, or load_dataset "
            "(datasets.load_dataset: a file, a directory of data files, or a dataset in the "
            "local Hugging Face cache; the [datasets] extra). Default: auto",
        )


def format_of(path: str, data_format: str) -> str:
    """The reader for ``path``: ``data_format``, or for ``auto`` the one the path calls for.

    Args:
        path: The ``--data`` path.
        data_format: A value of :data:`DATA_FORMATS`.

    Returns:
        One of :data:`DATA_FORMATS` other than ``auto``.

    Raises:
        ValueError: An unknown format, or ``auto`` for a file whose extension names none.
    """
    if data_format not in DATA_FORMATS:
        msg = f"unknown data format {data_format!r}: use one of {', '.join(DATA_FORMATS)}"
        raise ValueError(msg)
    if data_format != "auto":
        return data_format
    if os.path.isdir(path):
        return "save_to_disk"
    found = _EXTENSIONS.get(os.path.splitext(path)[1].lower())
    if found is None and os.path.isfile(path):
        msg = (
            f"unknown dataset format {path!r}: use .jsonl, .json, .csv, .parquet or a directory "
            "written by datasets' save_to_disk, or name the format with --data-format "
            f"({', '.join(DATA_FORMATS[1:])})"
        )
        raise ValueError(msg)
    return found or "jsonl"  # a missing file: the JSON Lines reader says it is missing


def _import_datasets(why: str) -> Any:
    try:
        import datasets
    except ImportError as err:
        msg = f"{why} needs the datasets package: pip install 'artifex-grpo[datasets]'"
        raise ImportError(msg) from err
    return datasets


def load_dataset_rows(
    path: str,
    split: str | None,
    default_splits: Sequence[str] = ("train",),
    split_option: str = "--split",
) -> list[dict[str, Any]]:
    """The rows ``datasets.load_dataset`` reads from ``path`` (``--data-format load_dataset``).

    Args:
        path: A data file, a directory of data files, or a dataset name in the local cache.
        split: The split; ``None``: the first of ``default_splits`` there is, else the only one.
        default_splits: The splits to look for when ``split`` is ``None``.
        split_option: The option that names the split, for errors.

    Returns:
        The rows, with Python values.

    Raises:
        ImportError: ``datasets`` is not installed.
        ValueError: A file extension ``load_dataset`` has no builder for, a missing split, or
            ``load_dataset`` failing (its error in the message).
    """
    from artifex.generative_models.training.rl.rollouts.dataset_rows import as_rows

    datasets = _import_datasets("--data-format load_dataset")
    try:
        if os.path.isfile(path):
            ext = os.path.splitext(path)[1].lower()
            if ext not in _BUILDERS:
                msg = (
                    f"{path}: load_dataset reads {', '.join(sorted(_BUILDERS))} files, not "
                    f"{ext or 'files without an extension'}"
                )
                raise ValueError(msg)
            loaded = datasets.load_dataset(_BUILDERS[ext], data_files=path)
        else:
            loaded = datasets.load_dataset(path)
    except ValueError:
        raise
    except Exception as err:  # FileNotFoundError, DatasetNotFoundError, ...: one line
        msg = f"{path}: datasets.load_dataset failed ({type(err).__name__}: {err})"
        raise ValueError(msg) from err
    names = list(loaded)
    if split is None:
        found = [s for s in default_splits if s in names]
        if not found and len(names) > 1:
            msg = f"{path} holds the splits {names}: choose one with {split_option}"
            raise ValueError(msg)
        split = found[0] if found else names[0]
    if split not in names:
        msg = f"{path} has no split {split!r} ({split_option}); its splits are {names}"
        raise ValueError(msg)
    return as_rows(loaded[split]).to_list()
