"""The ``artifex-grpo`` command.

- ``artifex-grpo demo``: the built-in end-to-end run (a tiny Llama-style model learns 2-digit
  addition with GRPO on the CPU); prints accuracy before and after and writes a reward-curve
  PNG.
- ``artifex-grpo demo --task flow``: Flow-GRPO on images (a tiny flow-matching model of 8x8
  digits, a classifier reward); writes before/after images and the reward and KL curves.
- ``artifex-grpo train --model DIR --data FILE.jsonl --reward math ...``: GRPO on a local
  Hugging Face model (Llama / Qwen) with a local JSONL, JSON, CSV or Parquet dataset, a directory
  written by ``datasets``' ``save_to_disk`` (``--split`` for a DatasetDict), or whatever
  ``datasets.load_dataset`` reads (``--data-format load_dataset``). Prompts are plain
  text or chat messages. ``--reward`` is repeatable and takes a built-in name or your own
  function as ``module:function``. Every field of ``GRPOConfig``, ``TrainConfig`` and
  ``RolloutConfig`` is an option (``--beta 0.04``, ``--loss-aggregation token_mean``,
  ``--log-completions-every 10``...), and ``--config run.yaml`` (or ``.json``) reads any option
  from a file that the command line overrides. The trained policy is written
  with ``save_pretrained`` to ``--output``. For several hosts, run it once per host with
  ``--coordinator-address``, ``--num-processes``, ``--process-id`` (or ``--distributed`` for
  SLURM / Cloud TPU auto-detection) and the mesh sizes ``--mesh-fsdp``, ``--mesh-tensor``.
- ``artifex-grpo convert FILE.gguf OUT_DIR [--dtype float32|bfloat16]``: a GGUF file (Llama,
  Qwen2, Qwen3; quantized weights are dequantized) into a Hugging Face model directory that
  ``train --model`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from artifex.cli_data import add_options as add_data_options
from artifex.cli_ecosystem import add_options as add_ecosystem_options
from artifex.cli_ecosystem import check_options as check_ecosystem_options
from artifex.cli_ecosystem import reward_model_from_args, save_adapter
from artifex.cli_engines import add_options as add_engine_options
from artifex.cli_engines import build_engine
from artifex.cli_engines import check_options as check_engine_options

__all__ = [
    "build_parser",
    "float32_precision_notice",
    "import_object",
    "load_rows",
    "lr_schedule",
    "main",
]

_REWARDS = ("math", "format", "overlong")


def _reward_spec(text: str) -> str:
    """An argparse type for ``--reward``: a built-in name or a ``module:function`` path."""
    if text in _REWARDS:
        return text
    module, sep, attr = text.partition(":")
    if sep and module.strip() and attr.strip():
        return text
    msg = (
        f"unknown reward {text!r}: use a built-in one ({', '.join(_REWARDS)}) or an import "
        "path module:function"
    )
    raise argparse.ArgumentTypeError(msg)


def _field_type(tp: Any) -> tuple[Any, tuple[str, ...] | None]:
    """An argparse converter (and choices) for a dataclass field annotation."""
    if isinstance(tp, str):
        tp = eval(tp, {**vars(typing), "types": types})  # annotations are postponed strings
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return str, tuple(args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        conv, choices = _field_type(inner[0])

        def optional(text: str) -> Any:
            return None if text.lower() == "none" else conv(text)

        return optional, choices
    if tp is bool:
        return _parse_bool, None
    return tp, None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(text: str) -> bool:
    """``true``/``false`` (and 1/0, yes/no, on/off); anything else is an error, not False."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    msg = f"expected true or false, got {text!r}"
    raise argparse.ArgumentTypeError(msg)


def _non_negative(kind: type) -> Any:
    """An argparse type: a finite number of ``kind`` that is >= 0."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError as err:
            msg = f"expected a {kind.__name__}, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from err
        if not math.isfinite(value) or value < 0:
            msg = f"must be a finite number >= 0, got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        return value

    parse.__name__ = f"non-negative {kind.__name__}"
    return parse


def lr_schedule(kind: str, learning_rate: float, warmup_steps: int, total_steps: int) -> Any:
    """The learning-rate schedule of ``artifex-grpo train`` (an optax schedule).

    ``warmup_steps`` updates rise linearly from 0 to ``learning_rate`` (update ``i`` of the
    warm-up uses ``learning_rate * i / warmup_steps``); with ``warmup_steps=0`` the first
    update already uses ``learning_rate``. Then ``"constant"`` keeps it, ``"linear"`` decays it
    linearly and ``"cosine"`` along a half cosine, both to 0 at ``total_steps``.

    Args:
        kind: ``"constant"``, ``"linear"`` or ``"cosine"``.
        learning_rate: The peak rate.
        warmup_steps: Updates of linear warm-up, >= 0.
        total_steps: Updates of the whole run.

    Returns:
        The schedule: update index -> learning rate.

    Examples:
        >>> from artifex.cli import lr_schedule
        >>> [float(lr_schedule("constant", 0.1, 0, 10)(i)) for i in (0, 5)]
        [0.1, 0.1]
        >>> [round(float(lr_schedule("linear", 0.1, 2, 6)(i)), 3) for i in range(7)]
        [0.0, 0.05, 0.1, 0.075, 0.05, 0.025, 0.0]
    """
    import optax

    decay = max(total_steps - warmup_steps, 1)
    if kind == "cosine":
        after = optax.cosine_decay_schedule(learning_rate, decay)
    elif kind == "linear":
        after = optax.linear_schedule(learning_rate, 0.0, decay)
    elif kind == "constant":
        after = optax.constant_schedule(learning_rate)
    else:
        msg = f"lr schedule: expected 'constant', 'linear' or 'cosine', got {kind!r}"
        raise ValueError(msg)
    if warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, after], [warmup_steps])


def _report_to(text: str) -> list[str]:
    """An argparse type for ``--report-to``: tracker names, checked (packages included)."""
    from artifex.generative_models.training.trackers import check_report_to

    try:
        check_report_to(text, field="the option")
    except (ValueError, ImportError) as err:  # argparse names the option first
        raise argparse.ArgumentTypeError(str(err).removeprefix("the option: ")) from err
    return [name.strip().lower() for name in text.split(",")]


def _finite_float(text: str) -> float:
    """An argparse type: a finite float."""
    try:
        value = float(text)
    except ValueError as err:
        msg = f"expected a number, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from err
    if not math.isfinite(value):
        msg = f"must be a finite number, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _add_dataclass_options(
    parser: argparse.ArgumentParser, cls: type, *, skip: Sequence[str] = ()
) -> None:
    hints = typing.get_type_hints(cls, include_extras=False)
    group = parser.add_argument_group(cls.__name__)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        conv, choices = _field_type(hints[field.name])
        default = None if field.default is dataclasses.MISSING else field.default
        flag = {"nargs": "?", "const": True} if conv is _parse_bool else {}  # `--overwrite`
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=f"{cls.__name__}.{field.name}",
            type=conv,
            choices=choices,
            default=argparse.SUPPRESS,
            metavar=None if choices else field.name.upper(),
            help=f"default: {default}",
            **flag,
        )


def _collect(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    prefix = cls.__name__ + "."
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}


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


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the full usage is in ``--help``)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser.

    Returns:
        The parser.

    Examples:
        >>> from artifex.cli import build_parser
        >>> args = build_parser().parse_args(["demo", "--steps", "10", "--task", "tools"])
        >>> args.command, args.steps, args.task
        ('demo', 10, 'tools')
    """
    from artifex.cli_checks import _non_empty, positive_float, positive_int
    from artifex.generative_models.training.rl.core.configs import GRPOConfig
    from artifex.generative_models.training.rl.rollouts.rollout import RolloutConfig
    from artifex.generative_models.training.rl.run.loop import TrainConfig

    parser = _Parser(
        prog="artifex-grpo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the full traceback when an error occurs"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the built-in end-to-end GRPO demo")
    demo.add_argument("--steps", type=int, default=None, help="GRPO steps (default 1000)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--out",
        default="runs/demo",
        help="output directory (an earlier demo run's checkpoints and logs there are replaced)",
    )
    demo.add_argument(
        "--task",
        choices=("addition", "tools", "flow"),
        default="addition",
        help="addition: a tiny LM learns 2-digit sums; tools: multi-turn, learn to call a "
        "multiply tool; flow: Flow-GRPO on an 8x8 digit generator",
    )

    tr = sub.add_parser("train", help="train a local Hugging Face model on a local dataset")
    for sp in (demo, tr):  # also accepted after the subcommand
        sp.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks"
        )
    for sp in (demo, tr):
        sp.add_argument(
            "--config",
            default=None,
            metavar="FILE",
            help="read options from a .yaml/.yml or .json file: keys are the long option names "
            "(num_steps or num-steps); options on the command line override the file",
        )
    tr.add_argument("--model", required=True, help="Hugging Face model directory")
    tr.add_argument(
        "--teacher-model",
        default=None,
        metavar="DIR",
        help="Hugging Face model directory of a distillation teacher (the model's tokenizer, "
        "any size); needs --distillation-coeff > 0: on-policy distillation of its per-token "
        "divergence (--distillation-divergence reverse_kl|forward_kl|jsd, --jsd-beta), added to "
        "GRPO or alone with --policy-loss-coeff 0",
    )
    tr.add_argument(
        "--data",
        required=True,
        help="training rows: .jsonl, .json, .csv, .parquet, or a directory written by datasets' "
        "save_to_disk (a Dataset, or a DatasetDict with --split); --data-format for others",
    )
    tr.add_argument(
        "--split", default=None, help="split of a DatasetDict --data directory (default: train)"
    )
    tr.add_argument("--eval-data", default=None, help="held-out rows for pass@1 (same formats)")
    tr.add_argument(
        "--eval-split",
        default=None,
        help="split of a DatasetDict --eval-data directory (default: test, else validation)",
    )
    add_data_options(tr)  # --data-format, --eval-data-format
    tr.add_argument(
        "--apply-chat-template",
        type=_parse_bool,
        nargs="?",
        const=True,
        default=False,
        metavar="BOOL",
        help="render plain-text prompts as one user message with the tokenizer's chat template "
        "(prompts that are lists of chat messages always are; default: plain text as is)",
    )
    tr.add_argument(
        "--reward",
        action="append",
        type=_reward_spec,
        default=[],  # at least one --reward or a --reward-model (cli_ecosystem.check_options)
        metavar="NAME|MODULE:FUNCTION",
        help="reward function (repeatable): math (answer), format, overlong (DAPO), or your "
        "own f(prompts, completions, **columns) by import path, e.g. my_rewards:exact_match",
    )
    tr.add_argument(
        "--reward-weights",
        type=_finite_float,
        nargs="+",
        default=None,
        metavar="W",
        help="one weight per --reward, in order (default: all 1)",
    )
    tr.add_argument("--reward-mode", choices=("sum", "normalized"), default="sum")
    add_ecosystem_options(tr, _parse_bool)  # --reward-model, --adapter-output, --save-merged
    add_engine_options(tr)  # --rollout-engine, --vllm-option
    tr.add_argument("--answer-column", default="answer")
    tr.add_argument(
        "--answer-extraction",
        choices=("markers", "last_number"),
        default="markers",
        help="how the math reward finds a completion's answer: the last \\boxed{}, #### or "
        "<answer> marker (default), or the last number in the text (GSM8K-style)",
    )
    tr.add_argument("--format-pattern", default=None, help="regex for the format reward")
    tr.add_argument(
        "--overlong-cache",
        type=_non_negative(int),
        default=None,
        help="DAPO soft-overlong buffer L_cache in tokens, at most --max-new-tokens: the "
        "overlong reward falls from 0 to -1 over the last L_cache tokens (default "
        "max_new_tokens // 4)",
    )
    tr.add_argument(
        "--step-reward",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a step reward f(prompts, completions, steps, **columns) by import path, one "
        "reward per step of each completion: process supervision (single-turn only)",
    )
    tr.add_argument(
        "--step-separator",
        default=None,
        metavar="TEXT",
        help="the text that ends a step for --step-reward (\\n and \\t read as newline and "
        "tab; default \\n)",
    )
    tr.add_argument("--learning-rate", type=_non_negative(float), default=1e-6)
    tr.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"), default="constant")
    tr.add_argument("--warmup-steps", type=_non_negative(int), default=0)
    tr.add_argument("--weight-decay", type=_non_negative(float), default=0.0)
    tr.add_argument("--lora-rank", type=_non_negative(int), default=0, help="0: full fine-tuning")
    tr.add_argument("--lora-alpha", type=_non_negative(float), default=None)
    tr.add_argument(
        "--lora-targets",
        nargs="+",
        choices=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        default=None,
        metavar="PROJ",
        help="projections that get adapters (default: all seven: q_proj k_proj v_proj o_proj "
        "gate_proj up_proj down_proj)",
    )
    tr.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    tr.add_argument("--output", default="runs/train/model", help="save_pretrained directory")
    _add_distributed_options(tr)
    mt = tr.add_argument_group("multi-turn (tools or an environment)")
    mt.add_argument(
        "--tools",
        action="append",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a tool by import path (repeatable); episodes become multi-turn tool use",
    )
    mt.add_argument(
        "--environment",
        default=None,
        metavar="MODULE:FACTORY",
        help="a zero-argument factory of environments (reset(row), step(text)) by import path",
    )
    mt.add_argument(
        "--tool-format", choices=("qwen", "llama3"), default=None, help="default: qwen (--tools)"
    )
    mt.add_argument(
        "--tool-timeout",
        type=positive_float,
        default=None,
        help="seconds per tool call (default 10; --tools)",
    )
    mt.add_argument(
        "--tool-max-threads",
        type=positive_int,
        default=None,
        help="tool threads alive at once, hung ones included (default 16; --tools)",
    )
    mt.add_argument(
        "--max-turns", type=positive_int, default=None, help="model turns per episode (default 4)"
    )
    mt.add_argument(
        "--max-observation-chars",
        type=positive_int,
        default=None,
        help="characters of a tool or environment message shown to the model; longer ones are "
        "cut with a notice (default 8192)",
    )
    mt.add_argument(
        "--max-completion-tokens",
        type=positive_int,
        default=None,
        help="tokens after the prompt per episode (default 4 * max_new_tokens)",
    )
    mt.add_argument(
        "--stop-string",
        action="append",
        type=_non_empty,
        default=None,
        help="text that ends a model turn, matched on the decoded text (repeatable; default "
        "</tool_call>)",
    )
    _add_dataclass_options(tr, GRPOConfig)
    _add_dataclass_options(tr, TrainConfig, skip=("report_to",))
    tr.add_argument(
        "--report-to",
        dest="TrainConfig.report_to",
        action="extend",
        type=_report_to,
        default=argparse.SUPPRESS,
        metavar="NAMES",
        help="experiment trackers besides metrics.jsonl: tensorboard, wandb, trackio "
        "(comma-separated or repeated; none, the default: metrics.jsonl only); each needs its "
        "extra, e.g. pip install 'artifex-grpo[wandb]' (docs/training-loop.md)",
    )
    _add_dataclass_options(tr, RolloutConfig)
    _add_convert_parser(sub)
    for sub_parser in (demo, tr):
        sub_parser.add_argument(
            "--compilation-cache",
            default=os.environ.get("ARTIFEX_COMPILATION_CACHE", DEFAULT_COMPILATION_CACHE),
            help="JAX persistent compilation cache directory ('none' disables; default "
            "$ARTIFEX_COMPILATION_CACHE or %(default)s)",
        )
        sub_parser.add_argument(
            "--reuse-host-memory",
            action="store_true",
            help="on the CPU, let XLA reuse the memory of each program's temporaries from run "
            "to run (faster steps, a larger resident set; see docs/benchmarks.md)",
        )
    return parser


def _add_convert_parser(sub: Any) -> None:
    """The ``convert`` subcommand: a GGUF file into a Hugging Face model directory."""
    conv = sub.add_parser(
        "convert", help="convert a GGUF file (Llama / Qwen) into a Hugging Face model directory"
    )
    conv.add_argument("gguf_file", metavar="FILE.gguf", help="the GGUF file to read")
    conv.add_argument("out_dir", metavar="OUT_DIR", help="the model directory to write")
    conv.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the dequantized weights (default: %(default)s)",
    )
    conv.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model directory OUT_DIR holds (without it, a non-empty OUT_DIR is an "
        "error); every file of the old model goes",
    )
    conv.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    conv.set_defaults(compilation_cache=None, reuse_host_memory=False)  # nothing is compiled


def _convert(args: argparse.Namespace) -> int:
    from artifex.generative_models.models.causal_lm import convert_gguf

    out = convert_gguf(args.gguf_file, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote the Hugging Face model directory {out} ({args.dtype})")
    return 0


# ------------------------------------------------------------------------------ config files
def _read_config(path: str) -> dict[str, Any]:
    """The mapping of a ``--config`` file (.yaml/.yml or .json); errors name the file and line.

    A key repeated in one mapping is an error (naming the file, the line and the key), not the
    last value silently.
    """
    from artifex.generative_models.utils.strict_parse import json_loads_unique, yaml_load_unique

    if not os.path.isfile(path):
        msg = f"config file not found: {path} (--config)"
        raise FileNotFoundError(msg)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as err:
            msg = f"reading {path} needs PyYAML: pip install pyyaml (or use a .json file)"
            raise ImportError(msg) from err
        try:
            data = yaml_load_unique(text, path)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            msg = f"{path}{line}: invalid YAML ({problem}): fix the file"
            raise ValueError(msg) from None
    elif path.endswith(".json"):
        try:
            data = json_loads_unique(text, path)
        except json.JSONDecodeError as err:
            msg = f"{path}:{err.lineno}: invalid JSON ({err.msg}, column {err.colno}): fix the file"
            raise ValueError(msg) from None
    else:
        msg = f"unknown config file format {path!r} (--config): use .yaml, .yml or .json"
        raise ValueError(msg)
    if data is None:
        return {}
    if not isinstance(data, dict):
        msg = f"{path}: expected a mapping of option names to values, got a {type(data).__name__}"
        raise ValueError(msg)
    return data


def _config_text(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    msg = f"{where}: expected a number, a string or true/false, got {type(value).__name__}"
    raise ValueError(msg)


def _config_tokens(action: argparse.Action, option: str, value: Any, where: str) -> list[str]:
    """Command-line tokens for one config entry, checked with the option's own parser."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            msg = f"{where}: expected true or false, got {value!r}"
            raise ValueError(msg)
        return [option] if value else []
    if value is None:
        if action.default is None:
            return []
        try:
            none = action.type("none") if action.type is not None else "none"
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            none = "none"
        if none is None:
            return [f"{option}=none"]
        msg = f"{where}: null is not a value of {option}; leave the key out for its default"
        raise ValueError(msg)
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    if isinstance(value, list) and not many:
        msg = f"{where}: {option} takes one value, got a list"
        raise ValueError(msg)
    texts = [_config_text(v, where) for v in (value if isinstance(value, list) else [value])]
    if not texts:
        msg = f"{where}: {option} needs at least one value, got an empty list"
        raise ValueError(msg)
    for text in texts:
        try:
            parsed = text if action.type is None else action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
            kind = getattr(action.type, "__name__", "value")
            detail = str(err) if isinstance(err, argparse.ArgumentTypeError) else f"not a {kind}"
            msg = f"{where}: {detail} (got {text!r})"
            raise ValueError(msg) from None
        if action.choices is not None and parsed not in action.choices:
            choices = ", ".join(map(str, action.choices))
            msg = f"{where}: {text!r} is not one of {choices}"
            raise ValueError(msg)
    if isinstance(action, argparse._AppendAction):
        return [f"{option}={t}" for t in texts]
    if action.nargs in ("+", "*"):
        return [option, *texts]
    return [f"{option}={texts[0]}"]


def _expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Replaces ``--config FILE`` by the options the file holds, before the command line's own.

    Every key is a long option of the subcommand (``-`` or ``_``). Options given on the command
    line override the file; for repeatable options (``--reward``) the command line's values
    replace the file's instead of adding to them.
    """
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    pos = next((i for i, t in enumerate(argv) if t in commands.choices), None)
    if pos is None:
        return argv
    sub = commands.choices[argv[pos]]
    if "--config" not in sub._option_string_actions:
        return argv  # a subcommand without config files: argparse reports --config
    files: list[str] = []
    kept: list[str] = []
    rest = argv[pos + 1 :]
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--":
            kept += rest[i:]
            break
        name, eq, value = token.partition("=")
        is_config = len(name) >= 5 and "--config".startswith(name)  # argparse takes --conf too
        if is_config and not eq and i + 1 < len(rest):
            files.append(rest[i + 1])
            i += 2
            continue
        if is_config and eq:
            files.append(value)
        else:
            kept.append(token)
        i += 1
    if not files:
        return argv
    if len(files) > 1:
        msg = f"--config is given {len(files)} times ({', '.join(files)}): give one file"
        raise ValueError(msg)
    path = files[0]
    given = set()
    for token in kept:
        action = sub._option_string_actions.get(token.partition("=")[0])
        if token.startswith("--") and action is not None:
            given.add(action.dest)
    options = sorted(o for o in sub._option_string_actions if o.startswith("--"))
    tokens: list[str] = []
    for key, value in _read_config(path).items():
        option = "--" + str(key).replace("_", "-")
        action = sub._option_string_actions.get(option)
        if action is None or option in ("--help", "--config"):
            import difflib

            close = difflib.get_close_matches(option, options, n=1)
            hint = f" (did you mean {close[0][2:]!r}?)" if close else ""
            msg = (
                f"{path}: unknown key {key!r}{hint}: the keys are the long options of "
                f"'artifex-grpo {argv[pos]}' (see --help)"
            )
            raise ValueError(msg)
        if action.dest not in given:
            tokens += _config_tokens(action, option, value, f"{path}: key {key!r}")
    return [*argv[: pos + 1], *tokens, *kept]


# ------------------------------------------------------------------------------ multi-host
def _add_distributed_options(parser: argparse.ArgumentParser) -> None:
    """Options of a multi-process (multi-host) run and of the device mesh."""
    from artifex.cli_checks import positive_float, positive_int
    from artifex.generative_models.training.rendezvous import DEFAULT_TIMEOUT_S

    group = parser.add_argument_group(
        "multi-host",
        "Run one `artifex-grpo train` per host (process) with the same arguments. Unset values "
        "come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, or, with "
        "--distributed, from JAX's cluster auto-detection (SLURM, Open MPI, Cloud TPU).",
    )
    group.add_argument("--coordinator-address", default=None, help="host:port of process 0")
    group.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    group.add_argument("--process-id", type=int, default=None, help="this process's index")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() even with nothing set (auto-detection)",
    )
    group.add_argument(
        "--distributed-timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="how long every process waits for the others to start before it stops with an "
        "error naming the missing ones (default %(default)g)",
    )
    group.add_argument(
        "--mesh-fsdp", type=positive_int, default=1, help="FSDP axis size (default 1)"
    )
    group.add_argument(
        "--mesh-tensor", type=positive_int, default=1, help="tensor axis size (default 1)"
    )


def _setup_devices(args: argparse.Namespace) -> Any:
    """Joins the multi-host run when asked and builds the mesh (``None``: one device)."""
    from artifex.generative_models.training.sharding import initialize_distributed, make_mesh

    if args.coordinator_address is not None and (args.num_processes or 1) > 1:
        print(
            f"artifex-grpo: process {args.process_id} of {args.num_processes}: waiting up to "
            f"{args.distributed_timeout:g} s for every process at {args.coordinator_address} "
            "(--distributed-timeout)",
            file=sys.stderr,
        )
    joined = initialize_distributed(
        args.coordinator_address,
        args.num_processes,
        args.process_id,
        auto=args.distributed,
        timeout=args.distributed_timeout,
    )
    if joined or args.mesh_fsdp > 1 or args.mesh_tensor > 1:
        return make_mesh(fsdp=args.mesh_fsdp, tensor=args.mesh_tensor)
    return None


#: Where the command keeps compiled XLA programs between runs (``--compilation-cache``).
DEFAULT_COMPILATION_CACHE = "~/.cache/artifex/jax"


def enable_compilation_cache(path: str | None) -> str | None:
    """Turns on JAX's persistent compilation cache in ``path``.

    A second run with the same shapes then loads the compiled programs instead of compiling them
    again. Every program is cached, however short its compilation.

    Args:
        path: Cache directory (``~`` expanded, created by JAX). ``"none"`` turns the cache off
            for this process, even where ``JAX_COMPILATION_CACHE_DIR`` would turn it on (JAX
            decides at the process's first compilation, so call this before it). None or ""
            changes nothing.

    Returns:
        The directory used, or None when no cache is turned on here.
    """
    if not path:
        return None
    import jax

    if path.lower() == "none":
        jax.config.update("jax_enable_compilation_cache", False)
        return None

    directory = os.path.abspath(os.path.expanduser(path))
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


#: Values of ``jax_default_matmul_precision`` that keep float32 matrix products at (or within
#: rounding of) full float32 on a GPU; the others (None, "default", "high", "tensorfloat32",
#: "bfloat16", the lower algorithm presets) use TF32 or less there.
FULL_FLOAT32_PRECISIONS = frozenset(
    ("highest", "float32", "f32_f32_f32", "f64_f64_f64", "tf32_tf32_f32_x3", "bf16_bf16_f32_x6",
     "bf16_bf16_f32_x9")
)  # fmt: skip


def float32_precision_notice(
    model: Any, backend: str | None = None, precision: str | None = None
) -> str | None:
    """A one-line notice when a float32 model's matrix products will run below float32.

    On NVIDIA GPUs JAX's default precision computes float32 matrix products on TF32 tensor
    cores (about 1e-3 relative error), unlike PyTorch's default (`docs/installation.md`). The
    command leaves JAX's setting alone and says so.

    Args:
        model: The loaded model (its `nnx.Param` dtypes are read).
        backend: JAX's backend name; None reads `jax.default_backend()` ("gpu" on NVIDIA and
            AMD GPUs).
        precision: JAX's default matmul precision; None reads
            `jax.config.jax_default_matmul_precision` (which `JAX_DEFAULT_MATMUL_PRECISION`
            sets).

    Returns:
        The notice, or None on a CPU or TPU, at a full-float32 precision
        (`FULL_FLOAT32_PRECISIONS`), or without float32 parameters.

    Examples:
        >>> from flax import nnx
        >>> from artifex.cli import float32_precision_notice
        >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))  # float32 parameters
        >>> float32_precision_notice(model, "cpu", "default") is None
        True
        >>> float32_precision_notice(model, "gpu", "highest") is None
        True
        >>> float32_precision_notice(model, "gpu", "default").startswith("note: float32")
        True
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    backend = jax.default_backend() if backend is None else backend
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    setting = "default" if precision is None else str(precision)
    if backend not in ("gpu", "cuda", "rocm") or setting.lower() in FULL_FLOAT32_PRECISIONS:
        return None
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    if jnp.dtype(jnp.float32) not in dtypes:
        return None
    return (
        f"note: float32 parameters on a GPU at matmul precision {setting!r}: JAX computes their "
        "matrix products below float32 there (TF32 by default on NVIDIA GPUs, about 1e-3 "
        "relative error); set JAX_DEFAULT_MATMUL_PRECISION=highest for full float32, as "
        "PyTorch computes by default"
    )


def _demo(args: argparse.Namespace) -> int:
    if getattr(args, "task", "addition") == "flow":
        return _flow_demo(args)
    from artifex.demos.addition import DemoConfig, run_demo

    if getattr(args, "task", "addition") == "tools":
        from artifex.demos.tools import ToolDemoConfig, run_tool_demo

        tcfg = ToolDemoConfig(seed=args.seed, out_dir=args.out)
        if args.steps is not None:
            tcfg = dataclasses.replace(tcfg, grpo_steps=args.steps)
        run_tool_demo(tcfg)
        return 0
    cfg = DemoConfig(seed=args.seed, out_dir=args.out)
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, grpo_steps=args.steps)
    run_demo(cfg)
    return 0


def _flow_demo(args: argparse.Namespace) -> int:
    from artifex.demos.flow import FlowDemoConfig, run_flow_demo

    out = "runs/flow_demo" if args.out == "runs/demo" else args.out
    cfg = FlowDemoConfig(seed=args.seed, out_dir=out)
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, grpo_steps=args.steps)
    run_flow_demo(cfg)
    return 0


def _build_rewards(args: argparse.Namespace, num_generations: int, max_new_tokens: int) -> Any:
    """The ``train`` command's reward functions, combined as ``--reward-mode`` says.

    The group size comes from the one setting that defines it (``--num-generations``), so
    ``--reward-mode normalized`` standardizes each reward within each prompt's group of
    generations (GDPO), never over the whole batch.

    Args:
        args: The parsed ``train`` arguments (``reward``, ``reward_weights``, ``reward_mode``,
            ``answer_column``, ``format_pattern``, ``overlong_cache``).
        num_generations: Completions per prompt (``GRPOConfig.num_generations``).
        max_new_tokens: The completion length (``RolloutConfig.max_new_tokens``).

    Returns:
        A :class:`~artifex.generative_models.training.rl.rewards.RewardCombiner`.
    """
    from artifex.generative_models.training.rl import rewards as rw

    funcs = []
    for name in args.reward:
        if name == "math":
            funcs.append(
                rw.math_answer_reward(
                    answer_column=args.answer_column, extraction=args.answer_extraction
                )
            )
        elif name == "format":
            funcs.append(rw.format_reward(args.format_pattern))
        elif name == "overlong":
            cache = args.overlong_cache
            if cache is None:
                cache = max(max_new_tokens // 4, 1)
            elif not 1 <= cache <= max_new_tokens:
                msg = (
                    f"--overlong-cache must be between 1 and --max-new-tokens "
                    f"({max_new_tokens}), got {cache} (the penalty ramps over the last "
                    "L_cache tokens)"
                )
                raise ValueError(msg)
            funcs.append(rw.soft_overlong_penalty(max_new_tokens, cache))
        else:
            funcs.append(_import_reward(name))
    reward_model = reward_model_from_args(args)  # last, after the --reward functions
    if reward_model is not None:
        funcs.append(reward_model)
    if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
        extra = "" if reward_model is None else " and --reward-model"
        names = [*args.reward, *(["--reward-model"] if reward_model is not None else [])]
        msg = (
            f"--reward-weights has {len(args.reward_weights)} values for {len(funcs)} --reward "
            f"functions{extra} ({', '.join(names)}): give one weight per --reward, in order"
            + (", then one for --reward-model" if extra else "")
        )
        raise ValueError(msg)
    # The group size is not set here: the rollout passes it when it calls the combiner (the
    # one source is GRPOConfig.num_generations).
    return rw.RewardCombiner(funcs, weights=args.reward_weights, mode=args.reward_mode)


def _step_rewards(args: argparse.Namespace) -> Any:
    """``--step-reward`` and ``--step-separator`` as a ``StepRewards`` (``None``: no flag)."""
    if args.step_reward is None:
        if args.step_separator is not None:
            msg = "--step-separator is only used with --step-reward MODULE:FUNCTION"
            raise ValueError(msg)
        return None
    from artifex.generative_models.training.rl.rollouts.step_rewards import StepRewards

    try:
        func = import_object(args.step_reward)
    except Exception as err:
        msg = f"--step-reward {args.step_reward!r}: {type(err).__name__}: {err}"
        raise ValueError(msg) from err
    if not callable(func):
        msg = f"--step-reward {args.step_reward!r} is a {type(func).__name__}, not a function"
        raise TypeError(msg)
    separator = args.step_separator if args.step_separator is not None else "\n"
    separator = separator.replace("\\n", "\n").replace("\\t", "\t")
    if not separator:
        msg = "--step-separator must not be empty"
        raise ValueError(msg)
    return StepRewards(func, separator=separator)


def _import_reward(path: str) -> Any:
    """A reward function given as ``--reward module:function``; errors name the flag."""
    try:
        func = import_object(path)
    except ValueError as err:
        msg = f"--reward {path!r}: {err}"
        raise ValueError(msg) from err
    except ImportError as err:  # ModuleNotFoundError included
        msg = (
            f"--reward {path!r}: cannot import module {path.partition(':')[0]!r} ({err}): run "
            "from the directory that holds it, or put it on PYTHONPATH"
        )
        raise ImportError(msg) from err
    except Exception as err:  # the module itself raised (a syntax error, a failing import)
        msg = f"--reward {path!r}: importing it failed with {type(err).__name__}: {err}"
        raise ImportError(msg) from err
    if not callable(func):
        msg = (
            f"--reward {path!r} is a {type(func).__name__}, not a function "
            "f(prompts, completions, **columns) -> list[float | None]"
        )
        raise TypeError(msg)
    return func


def _train(args: argparse.Namespace) -> int:
    from artifex.cli_checks import check_multi_turn_flags, check_run_paths, default_checkpoint_dir
    from artifex.generative_models.training.logging import is_primary_process
    from artifex.generative_models.training.rl.core.configs import GRPOConfig
    from artifex.generative_models.training.rl.rollouts.rollout import RolloutConfig
    from artifex.generative_models.training.rl.run.loop import TrainConfig, check_writable_dir
    from artifex.generative_models.training.run_lock import RunLock

    if not os.path.isdir(args.model):
        msg = f"model directory not found: {args.model}"
        raise FileNotFoundError(msg)
    check_multi_turn_flags(args)
    check_ecosystem_options(args)
    check_engine_options(args)
    loop_kwargs = _collect(args, TrainConfig)
    if "num_steps" not in loop_kwargs:
        msg = "--num-steps is required for train"
        raise ValueError(msg)
    loop_kwargs.setdefault("log_dir", os.path.join(os.path.dirname(args.output) or ".", "logs"))
    default_checkpoints = "checkpoint_dir" not in loop_kwargs
    if default_checkpoints:  # a run is always resumable unless --checkpoint-dir none
        loop_kwargs["checkpoint_dir"] = default_checkpoint_dir(args.output)
    loop = TrainConfig(**loop_kwargs)
    check_run_paths(args.output, args.model, loop.checkpoint_dir)
    mesh = _setup_devices(args)  # first: jax.distributed.initialize precedes any computation
    grpo = GRPOConfig(**_collect(args, GRPOConfig))
    _check_teacher_flags(args, grpo)
    rollout_config = RolloutConfig(**_collect(args, RolloutConfig))

    # Pre-flight: every output location is checked (and --output held for this run) before
    # anything expensive happens.
    check_writable_dir(args.output, "--output")
    output_lock = RunLock(args.output, "--output")
    if is_primary_process():
        output_lock.acquire()
        if default_checkpoints:
            print(
                f"artifex-grpo: checkpoints go to {loop.checkpoint_dir} (beside --output; "
                "--checkpoint-dir sets another, --checkpoint-dir none keeps none)",
                file=sys.stderr,
            )
        elif loop.checkpoint_dir is None:
            print(
                "artifex-grpo: no checkpoints (--checkpoint-dir none): a run that is stopped or "
                "whose export fails loses its training",
                file=sys.stderr,
            )
    try:
        return _train_held(args, loop, grpo, rollout_config, mesh)
    finally:
        output_lock.release()


def _train_held(
    args: argparse.Namespace, loop: Any, grpo: Any, rollout_config: Any, mesh: Any
) -> int:
    """``train`` once ``--output`` is held: load, train, export."""
    import optax
    from flax import nnx

    from artifex.cli_checks import (
        check_free_space,
        export_failed,
        interrupted_message,
        run_fingerprint,
    )
    from artifex.generative_models.models.causal_lm import (
        LoRAConfig,
        Tokenizer,
        apply_lora,
        from_pretrained,
        merge_lora,
    )
    from artifex.generative_models.training.checkpointing import CheckpointWriteError
    from artifex.generative_models.training.logging import is_primary_process
    from artifex.generative_models.training.rl.rollouts.dataset_rows import EVAL_SPLITS
    from artifex.generative_models.training.rl.run.loop import check_tokenizer_fits, train
    from artifex.generative_models.training.rl.update.trainer import GRPOTrainer

    column = rollout_config.prompt_column
    rows = load_rows(args.data, args.split, args.data_format)
    rows = _prompts_as_chat(rows, column, args.apply_chat_template)
    eval_rows = None
    if args.eval_data is not None:
        eval_rows = load_rows(
            args.eval_data,
            args.eval_split or _eval_split(args.eval_data),
            args.eval_data_format,
            default_splits=EVAL_SPLITS,
        )
        eval_rows = _prompts_as_chat(eval_rows, column, args.apply_chat_template)
    tokenizer = _load(Tokenizer.from_pretrained, args.model, what="tokenizer")
    _check_chat_template(tokenizer, rows, column, args.model, "--data")
    _check_chat_template(tokenizer, eval_rows or [], column, args.model, "--eval-data")
    model = _load(from_pretrained, args.model, dtype=args.dtype, what="model")
    check_tokenizer_fits(tokenizer, model)
    notice = float32_precision_notice(model)
    if notice is not None and is_primary_process():  # once per run, not once per host
        print(notice, file=sys.stderr)

    rewards = _build_rewards(args, grpo.num_generations, rollout_config.max_new_tokens)

    total = loop.num_steps * loop.num_iterations * loop.num_minibatches
    schedule = lr_schedule(args.lr_schedule, args.learning_rate, args.warmup_steps, total)
    tx = optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule, weight_decay=args.weight_decay
    )
    reference = None
    if args.lora_rank > 0:
        targets = {} if args.lora_targets is None else {"target_modules": tuple(args.lora_targets)}
        lora = LoRAConfig(
            rank=args.lora_rank, alpha=args.lora_alpha or 2.0 * args.lora_rank, **targets
        )
        apply_lora(model, lora, nnx.Rngs(loop.seed))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    else:
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        if grpo.beta > 0:
            reference = _load(from_pretrained, args.model, dtype=args.dtype, what="model")
    teacher = None
    if args.teacher_model is not None:  # on-policy distillation (--distillation-coeff)
        teacher = _load(from_pretrained, args.teacher_model, dtype=args.dtype, what="teacher model")
        check_tokenizer_fits(tokenizer, teacher)
    trainer = GRPOTrainer(
        model, optimizer, grpo, reference_model=reference, mesh=mesh, teacher_model=teacher
    )
    hooks = _multi_turn_hooks(args, rollout_config)
    engine = build_engine(args, model)  # --rollout-engine vllm: a colocated vLLM engine
    check_free_space(args.output, loop.checkpoint_dir, model, trainer)
    final = merge_lora if args.lora_rank > 0 else (lambda m: m)
    try:
        result = train(
            trainer,
            tokenizer,
            rows,
            rewards,
            loop,
            rollout_config,
            eval_dataset=eval_rows,
            fingerprint_extra=_with_teacher(run_fingerprint(args, total), args),
            step_rewards=_step_rewards(args),
            rollout_engine=engine,
            **hooks,
        )
    except CheckpointWriteError as err:
        if err.step < loop.num_steps:
            raise
        # Training finished but its last checkpoint could not be written: export the model
        # in memory (to --output, maybe on another disk) rather than lose it.
        try:
            final(model).save_pretrained(args.output)
        except OSError as also:
            msg = (
                f"{err}; exporting the trained model to {args.output} failed too "
                f"({also.strerror or also}): the trained state of step {err.step} is lost"
            )
            raise OSError(also.errno, msg) from also
        msg = (
            f"{err}; the trained model (step {err.step}) was exported to {args.output}, but "
            "the run cannot be resumed from that step"
        )
        raise OSError(err.errno, msg) from err
    step = result.start_step + len(result.history)
    advice = {"resume": loop.resume, "overwrite": loop.overwrite}
    if result.interrupted is not None:
        if is_primary_process():
            print(
                interrupted_message(result.interrupted, step, loop.checkpoint_dir, **advice),
                file=sys.stderr,
            )
        return EXIT_INTERRUPTED
    if result.start_step >= loop.num_steps and is_primary_process():
        print(
            f"artifex-grpo: note: the checkpoint in {loop.checkpoint_dir} is at step "
            f"{result.start_step} (--num-steps {loop.num_steps}): nothing was trained; the "
            f"exported model is step {result.start_step}'s",
            file=sys.stderr,
        )
    try:
        if args.save_merged:
            final(model).save_pretrained(args.output)  # every process gathers; process 0 writes
        save_adapter(model, args, lora if args.lora_rank > 0 else None)  # --adapter-output
    except OSError as err:
        raise export_failed(err, args.output, step, loop.checkpoint_dir, **advice) from err
    if not is_primary_process():
        return 0
    if result.evaluations:
        first, last = result.evaluations[0][1], result.evaluations[-1][1]
        print(f"held-out pass@1: {first['eval/pass@1']:.3f} -> {last['eval/pass@1']:.3f}")
        sampled = [k for k in last if k.startswith(("eval/pass@", "eval/mean@", "eval/maj@"))]
        for key in sorted(set(sampled) - {"eval/pass@1"}, key=lambda k: (k[:9], len(k), k)):
            print(
                f"held-out {key[5:]} ({loop.eval_num_samples} samples per prompt): "
                f"{first[key]:.3f} -> {last[key]:.3f}"
            )
    if args.save_merged:
        print(f"saved the trained model to {args.output}")
    return 0


def _check_teacher_flags(args: argparse.Namespace, grpo: Any) -> None:
    """``--teacher-model`` and ``--distillation-coeff`` go together (checked before loading)."""
    teacher = args.teacher_model
    if teacher is not None and not os.path.isdir(teacher):
        msg = f"--teacher-model directory not found: {teacher}"
        raise FileNotFoundError(msg)
    if teacher is not None and grpo.distillation_coeff == 0.0:
        msg = (
            "--teacher-model is used by on-policy distillation: give --distillation-coeff > 0 "
            "(e.g. 1.0), or leave --teacher-model out"
        )
        raise ValueError(msg)
    if teacher is None and grpo.distillation_coeff > 0.0:
        msg = (
            f"--distillation-coeff {grpo.distillation_coeff} distills from a teacher: give "
            "--teacher-model DIR"
        )
        raise ValueError(msg)


def _with_teacher(fingerprint: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The run's fingerprint with the teacher's directory (absent without one, as before)."""
    if args.teacher_model is None:
        return fingerprint
    from artifex.generative_models.utils.fingerprint import directory_fingerprint

    return {**fingerprint, "teacher": directory_fingerprint(args.teacher_model)}


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


#: Exit status of a run stopped by SIGTERM/SIGINT after saving a checkpoint (EX_TEMPFAIL:
#: "try again", which resumes it).
EXIT_INTERRUPTED = 75


def _load(loader: Any, path: str, *, what: str, **kwargs: Any) -> Any:
    """Calls a loader, naming ``path`` in errors that do not (safetensors, tokenizers)."""
    try:
        return loader(path, **kwargs)
    except (OSError, ValueError, TypeError) as err:
        if path in str(err):
            raise
        msg = f"cannot load the {what} from {path}: {_first_line(err)}"
        base = next(
            c for c in (FileNotFoundError, OSError, ValueError, TypeError) if isinstance(err, c)
        )
        raise base(msg) from err
    except Exception as err:  # the Rust libraries raise their own exception types
        msg = f"cannot load the {what} from {path}: {_first_line(err)}"
        raise ValueError(msg) from err


def _first_line(err: BaseException) -> str:
    text = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return text[:500] or type(err).__name__


_HINTS = (
    ("NonFiniteUpdateError", "lower --learning-rate or set --max-grad-norm, then resume"),
    ("RewardFunctionError", "fix the reward function or the dataset columns it reads"),
    (
        "IncompatibleCheckpointError",
        "resume with the original settings, use --overwrite, or another --checkpoint-dir",
    ),
    ("CorruptCheckpointError", "delete the damaged checkpoint directory, or use --overwrite"),
    ("PermissionError", "choose a writable location"),
    ("LogDirectoryInUseError", ""),  # the message says what to do
    ("FileExistsError", "pass --resume true, --overwrite, or another --checkpoint-dir"),
    ("OSError", "check the path and the free disk space"),
)


def _error_line(err: BaseException) -> str:
    """One line for any error: what was wrong (with the file, when it names one), what to do."""
    text = _first_line(err)
    names = [cls.__name__ for cls in type(err).__mro__]
    hint = next((h for name, h in _HINTS if name in names), None)
    if not isinstance(err, ValueError | TypeError | FileNotFoundError | ImportError):
        text = f"{type(err).__name__}: {text}"
    if hint is not None and hint not in text:
        text = f"{text} ({hint})"
    return f"artifex-grpo: error: {text} [--debug shows the traceback]"


def import_object(path: str) -> Any:
    """Imports ``"package.module:attribute"`` (the current directory is importable).

    Args:
        path: The import path.

    Returns:
        The attribute.

    Raises:
        ValueError: The path has no ``:`` or names a missing attribute.
        ImportError: The module cannot be imported.

    Examples:
        >>> from artifex.cli import import_object
        >>> import_object("math:sqrt")(16.0)
        4.0
        >>> import_object("math")
        Traceback (most recent call last):
            ...
        ValueError: expected an import path 'module:attribute', got 'math'
    """
    import importlib

    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        msg = f"expected an import path 'module:attribute', got {path!r}"
        raise ValueError(msg)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            msg = f"module {module_name!r} has no attribute {attr!r}"
            raise ValueError(msg)
        obj = getattr(obj, part)
    return obj


def _multi_turn_hooks(args: argparse.Namespace, rollout_config: Any) -> dict[str, Any]:
    """``rollout_fn``/``evaluate_fn`` for ``train`` when ``--tools`` or ``--environment``."""
    if not args.tools and not args.environment:
        return {}
    from artifex.generative_models.training.rl.rollouts.multiturn import (
        MultiTurnConfig,
        MultiTurnRollout,
        ToolEnvironment,
    )

    if args.tools and args.environment:
        msg = "use --tools or --environment, not both (an environment can hold its own tools)"
        raise ValueError(msg)
    per_turn = rollout_config.max_new_tokens
    config = MultiTurnConfig(
        max_turns=args.max_turns,
        max_new_tokens=per_turn,
        max_completion_tokens=args.max_completion_tokens or 4 * per_turn,
        stop_strings=tuple(args.stop_string or ("</tool_call>",)),
        **(
            {}
            if args.max_observation_chars is None
            else {"max_observation_chars": args.max_observation_chars}
        ),
    )
    if args.tools:
        tools = [import_object(p) for p in args.tools]
        column, fmt, timeout = rollout_config.prompt_column, args.tool_format, args.tool_timeout
        threads = {} if args.tool_max_threads is None else {"max_threads": args.tool_max_threads}

        def factory() -> Any:
            return ToolEnvironment(
                tools, tool_format=fmt, timeout=timeout, prompt_column=column, **threads
            )
    else:
        factory = import_object(args.environment)
        if not callable(factory):
            msg = f"--environment {args.environment!r} is not callable"
            raise TypeError(msg)
    rollout_fn = MultiTurnRollout(factory, config)
    return {"rollout_fn": rollout_fn, "evaluate_fn": rollout_fn.evaluate}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``artifex-grpo`` command.

    ``--config FILE`` (YAML or JSON) supplies any option; the command line overrides it.
    Every error prints one line (what was wrong, the file involved, what to do) and exits with
    status 2 (1 for unexpected internal errors); ``--debug`` shows the full traceback instead.
    A run stopped by SIGTERM or SIGINT saves a checkpoint and exits with status 75.

    Args:
        argv: Command-line arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The process exit status.

    Examples:
        >>> from artifex.cli import main
        >>> main(["train", "--config", "no-such-file.yaml"])  # one line on stderr, status 2
        2
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv = _expand_config(parser, argv)
    except Exception as err:
        if "--debug" in argv:
            raise
        print(_error_line(err), file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    from artifex.generative_models.utils.host_memory import reuse_host_memory

    try:
        reusing = reuse_host_memory() if args.reuse_host_memory else None
    except ValueError as err:  # a bad ARTIFEX_REUSE_HOST_MEMORY value
        if args.debug:
            raise
        print(_error_line(err), file=sys.stderr)
        return 2
    if reusing is False:
        print(
            "artifex-grpo: --reuse-host-memory not applied (it needs glibc, a process in which "
            "JAX has not run yet, no GPU or TPU plugin installed unless JAX_PLATFORMS=cpu, and "
            "ARTIFEX_REUSE_HOST_MEMORY not 0)",
            file=sys.stderr,
        )
    enable_compilation_cache(args.compilation_cache)
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "convert":
            return _convert(args)
        return _train(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("artifex-grpo: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.debug:
            raise
        print(_error_line(err), file=sys.stderr)
        known = (OSError, ValueError, TypeError, ImportError, ArithmeticError, RuntimeError)
        return 2 if isinstance(err, known) else 1


if __name__ == "__main__":
    sys.exit(main())
