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
import os
import sys
import typing
from typing import Any

from artifex.cli_data import add_options as add_data_options
from artifex.cli_devices import (  # noqa: F401  (re-exported for old imports)
    DEFAULT_COMPILATION_CACHE,
    FULL_FLOAT32_PRECISIONS,
    _add_distributed_options,
    _setup_devices,
    enable_compilation_cache,
    float32_precision_notice,
)
from artifex.cli_ecosystem import add_options as add_ecosystem_options
from artifex.cli_engines import add_options as add_engine_options
from artifex.cli_flow import add_options as add_flow_options
from artifex.cli_options import (  # noqa: F401  (re-exported for old imports)
    _add_dataclass_options,
    _collect,
    _expand_config,
    _finite_float,
    _non_negative,
    _parse_bool,
    _report_to,
    _reward_spec,
)
from artifex.cli_rewards import (  # noqa: F401  (re-exported for old imports)
    _build_rewards,
    _multi_turn_hooks,
    _step_rewards,
    import_object,
)
from artifex.cli_rows import _eval_split, load_rows  # noqa: F401  (re-exported for old imports)
from artifex.cli_train import (  # noqa: F401  (re-exported for old imports)
    EXIT_INTERRUPTED,
    _error_line,
    _train,
    lr_schedule,
)

__all__ = ["build_parser", "main"]


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
    add_flow_options(tr)  # --sde-steps, --window-size, ...: a flow model directory as --model
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
