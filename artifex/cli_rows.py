"""``artifex-grpo train``'s datasets: the rows of ``--data`` and ``--eval-data``.

- :func:`load_rows`: a local JSONL, JSON, CSV or Parquet file, or a directory written by
  ``datasets``' ``save_to_disk`` (read with ``pyarrow``), or what ``datasets.load_dataset``
  reads (the formats and ``--data-format``: :mod:`artifex.cli_data`);
- the default split of a ``DatasetDict`` ``--eval-data`` (test, else validation);
- ``--apply-chat-template`` (plain-text prompts as one user message) and the check that chat
  prompts have a tokenizer chat template, made before the model is loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["load_rows"]


def load_rows(
    path: str,
    split: str | None = None,
    data_format: str = "auto",
    *,
    default_splits: Sequence[str] = ("train",),
) -> list[dict[str, Any]]:
    r"""Reads a local dataset into rows: JSONL, JSON, CSV, Parquet, a ``save_to_disk`` directory.

    - ``.jsonl``: one JSON object per line (blank lines skipped);
    - ``.json``: one array of objects;
    - ``.csv``: a header line, then one row per line (needs ``pyarrow``, which infers each
      column's type);
    - ``.parquet``: a Parquet file (needs ``pyarrow``);
    - a directory written by Hugging Face ``datasets``' ``Dataset.save_to_disk`` (Arrow files
      listed in its ``state.json``) or ``DatasetDict.save_to_disk`` (a ``dataset_dict.json``
      and one such directory per split). It is read with ``pyarrow``; the ``datasets``
      package is not needed.

    ``data_format`` names the reader instead of the extension, or ``load_dataset`` for
    ``datasets.load_dataset`` (:mod:`artifex.cli_data`). A prompt column may hold plain text
    or chat messages (a list of ``{"role", "content"}`` objects); both come back as they are.

    Args:
        path: The file or directory.
        split: The split of a ``DatasetDict`` directory (or of what ``load_dataset`` reads).
            ``None``: the first of ``default_splits`` there is, else the only split.
        data_format: ``auto``, ``jsonl``, ``json``, ``csv``, ``parquet``, ``save_to_disk`` or
            ``load_dataset``.
        default_splits: The splits ``load_dataset``'s result is searched for when ``split`` is
            ``None`` (a ``DatasetDict`` directory: ``"train"``).

    Returns:
        The rows.

    Raises:
        FileNotFoundError: If the file or directory does not exist.
        ValueError: On a line that is not a JSON object or repeats a key (the file and line
            are named), an unknown extension or format, a directory that is not a saved
            dataset, or a missing split.
        ImportError: For CSV, Parquet or Arrow without ``pyarrow``, or ``load_dataset`` without
            ``datasets`` installed.

    Examples:
        >>> import json, os, tempfile
        >>> from artifex.cli import load_rows
        >>> path = os.path.join(tempfile.mkdtemp(), "rows.jsonl")
        >>> with open(path, "w") as fh:
        ...     _ = fh.write(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
        >>> load_rows(path)
        [{'prompt': '1+2=', 'answer': '3'}]
    """
    from artifex.cli_data import format_of, load_dataset_rows
    from artifex.generative_models.utils.strict_parse import json_loads_unique

    kind = format_of(path, data_format)
    if kind == "load_dataset":
        return load_dataset_rows(path, split, default_splits)
    if kind == "save_to_disk" and os.path.isdir(path):
        return _load_saved_dataset(path, split)
    if os.path.isdir(path):
        msg = f"{path} is a directory: --data-format {kind} reads a file"
        raise ValueError(msg)
    if not os.path.isfile(path):
        what = "dataset directory" if kind == "save_to_disk" else "dataset file"
        msg = f"{what} not found: {path}"
        raise FileNotFoundError(msg)
    if kind == "save_to_disk":
        msg = f"{path} is a file: --data-format save_to_disk reads a directory"
        raise ValueError(msg)
    if split is not None:
        msg = f"--split {split!r} applies to a DatasetDict directory, but {path} is a file"
        raise ValueError(msg)
    if kind == "json":
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        try:
            data = json_loads_unique(text, path)
        except json.JSONDecodeError as err:
            msg = (
                f"{path}:{err.lineno}: invalid JSON ({err.msg}, column {err.colno}): fix the "
                "file (a .json dataset is one array of objects; use .jsonl for one per line)"
            )
            raise ValueError(msg) from None
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            msg = f"{path}: a .json dataset must be an array of JSON objects"
            raise ValueError(msg)
        return data
    if kind == "jsonl":
        rows = []
        with open(path, "rb") as fh:  # decoded line by line, so a bad byte names its line
            for i, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
                except UnicodeDecodeError as err:
                    msg = f"{path}:{i}: not UTF-8 text ({err.reason} at byte {err.start})"
                    raise ValueError(msg) from None
                if not line.strip():
                    continue
                try:
                    row = json_loads_unique(line, path, line=i)
                except json.JSONDecodeError as err:
                    msg = (
                        f"{path}:{i}: invalid JSON ({err.msg}, column {err.colno}): fix that "
                        "line (each line must be one JSON object)"
                    )
                    raise ValueError(msg) from None
                if not isinstance(row, dict):
                    msg = f"{path}:{i}: each line must be a JSON object, got {type(row).__name__}"
                    raise ValueError(msg)
                rows.append(row)
        return rows
    reader, name = ("parquet", "Parquet") if kind == "parquet" else ("csv", "CSV")
    module = _pyarrow(name, reader)
    try:
        table = module.read_table(path) if kind == "parquet" else module.read_csv(path)
    except Exception as err:  # pyarrow's errors do not name the file
        msg = f"{path}: cannot read the {name} file ({err}): check the file"
        raise ValueError(msg) from err
    return table.to_pylist()


def _pyarrow(what: str, module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(f"pyarrow.{module}")
    except ImportError as err:
        msg = f"reading {what} needs pyarrow: pip install pyarrow (or the [parquet] extra)"
        raise ImportError(msg) from err


def _read_json_file(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as err:
        msg = f"{path}:{err.lineno}: invalid JSON ({err.msg}, column {err.colno})"
        raise ValueError(msg) from None


def _load_saved_dataset(path: str, split: str | None) -> list[dict[str, Any]]:
    """Rows of a ``Dataset``/``DatasetDict`` directory written by ``save_to_disk``."""
    dict_file = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(dict_file):
        splits = _read_json_file(dict_file).get("splits")
        if not isinstance(splits, list) or not splits:
            msg = f"{dict_file}: expected {{'splits': [names]}}, got no split names"
            raise ValueError(msg)
        if split is None:
            if "train" not in splits and len(splits) > 1:
                msg = f"{path} holds the splits {splits}: choose one with --split"
                raise ValueError(msg)
            split = "train" if "train" in splits else splits[0]
        if split not in splits:
            msg = f"{path} has no split {split!r} (--split); its splits are {splits}"
            raise ValueError(msg)
        return _load_saved_dataset(os.path.join(path, split), None)
    state_file = os.path.join(path, "state.json")
    if not os.path.isfile(state_file):
        msg = (
            f"{path} is a directory but not a dataset written by datasets' save_to_disk (no "
            "state.json or dataset_dict.json): pass a .jsonl, .json or .parquet file"
        )
        raise ValueError(msg)
    if split is not None:
        msg = f"--split {split!r} applies to a DatasetDict directory, but {path} is one dataset"
        raise ValueError(msg)
    state = _read_json_file(state_file)
    files = [f.get("filename") for f in state.get("_data_files", []) if isinstance(f, dict)]
    if not files or not all(isinstance(f, str) for f in files):
        msg = f"{state_file}: '_data_files' lists no Arrow files"
        raise ValueError(msg)
    if state.get("_indices_data_files"):
        msg = (
            f"{path} holds an indices mapping (a selected or shuffled view): save it again "
            "after dataset.flatten_indices()"
        )
        raise ValueError(msg)
    ipc = _pyarrow("a saved dataset", "ipc")
    rows: list[dict[str, Any]] = []
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            msg = f"{state_file} lists {name}, which is missing from {path}"
            raise FileNotFoundError(msg)
        try:
            with open(file, "rb") as fh:
                try:  # datasets writes the Arrow IPC stream format
                    table = ipc.open_stream(fh).read_all()
                except Exception:  # the Arrow IPC file format, as a fallback
                    fh.seek(0)
                    table = ipc.open_file(fh).read_all()
            rows += table.to_pylist()
        except Exception as err:  # pyarrow's errors do not name the file
            msg = f"{file}: cannot read the Arrow file ({err}): check the file"
            raise ValueError(msg) from err
    return rows


def _eval_split(path: str) -> str | None:
    """The default split of a DatasetDict ``--eval-data``: test, else validation."""
    dict_file = os.path.join(path, "dataset_dict.json")
    if not os.path.isfile(dict_file):
        return None
    splits = _read_json_file(dict_file).get("splits") or []
    found = [s for s in ("test", "validation") if s in splits]
    if found:
        return found[0]
    if len(splits) == 1:
        return splits[0]
    msg = f"--eval-data {path} holds the splits {splits}: choose one with --eval-split"
    raise ValueError(msg)


def _prompts_as_chat(rows: list[dict[str, Any]], column: str, apply: bool) -> list[dict[str, Any]]:
    """With ``--apply-chat-template``, each plain-text prompt becomes one user message."""
    if not apply:
        return rows
    return [
        {**row, column: [{"role": "user", "content": row[column]}]}
        if isinstance(row.get(column), str)
        else row
        for row in rows
    ]


def _check_chat_template(
    tokenizer: Any, rows: list[dict[str, Any]], column: str, where: str, flag: str
) -> None:
    """Chat-message prompts need the tokenizer's chat template: say so before loading the model."""
    if getattr(tokenizer, "chat_template", None):
        return
    for i, row in enumerate(rows):
        if isinstance(row.get(column), list):
            msg = (
                f"{flag} row {i}: column {column!r} holds chat messages, but the tokenizer in "
                f"{where} has no chat template: use a model directory whose "
                "tokenizer_config.json has one, or plain-text prompts without "
                "--apply-chat-template"
            )
            raise ValueError(msg)
