"""The ``artifex-grpo`` command.

- ``artifex-grpo demo``: the built-in end-to-end run (a tiny Llama-style model learns 2-digit
  addition with GRPO on the CPU in a few minutes); prints accuracy before and after and writes a
  reward-curve PNG.
- ``artifex-grpo demo --task flow``: Flow-GRPO on images (a tiny flow-matching model of 8x8
  digits, a classifier reward); writes before/after images and the reward and KL curves.
- ``artifex-grpo train --model DIR --data FILE.jsonl --reward math ...``: GRPO on a local
  Hugging Face model (Llama / Qwen) with a local JSONL or Parquet dataset. Every field of
  ``GRPOConfig``, ``TrainConfig`` and ``RolloutConfig`` is an option (``--beta 0.04``,
  ``--loss-aggregation token_mean``, ``--num-iterations 2``...); the trained policy is written
  with ``save_pretrained`` to ``--output``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

__all__ = ["build_parser", "load_rows", "main"]

_REWARDS = ("math", "format", "overlong")


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
        return (lambda text: text.lower() in ("1", "true", "yes", "on")), None
    return tp, None


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
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=f"{cls.__name__}.{field.name}",
            type=conv,
            choices=choices,
            default=argparse.SUPPRESS,
            metavar=None if choices else field.name.upper(),
            help=f"default: {default}",
        )


def _collect(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    prefix = cls.__name__ + "."
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}


def load_rows(path: str) -> list[dict[str, Any]]:
    """Reads a local JSONL (one JSON object per line) or Parquet file into rows.

    Args:
        path: The file.

    Returns:
        The rows.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: On a line that is not a JSON object, or an unknown extension.
        ImportError: For Parquet without ``pyarrow`` installed.
    """
    if not os.path.isfile(path):
        msg = f"dataset file not found: {path}"
        raise FileNotFoundError(msg)
    if path.endswith((".jsonl", ".json")):
        rows = []
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict):
                    msg = f"{path}:{i}: each line must be a JSON object, got {type(row).__name__}"
                    raise ValueError(msg)
                rows.append(row)
        return rows
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            msg = "reading Parquet needs pyarrow: pip install pyarrow (or the [parquet] extra)"
            raise ImportError(msg) from err
        return pq.read_table(path).to_pylist()
    msg = f"unknown dataset format {path!r}: use .jsonl or .parquet"
    raise ValueError(msg)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser.

    Returns:
        The parser.
    """
    from artifex.generative_models.training.rl.configs import GRPOConfig
    from artifex.generative_models.training.rl.loop import TrainConfig
    from artifex.generative_models.training.rl.rollout import RolloutConfig

    parser = argparse.ArgumentParser(
        prog="artifex-grpo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the built-in end-to-end GRPO demo")
    demo.add_argument("--steps", type=int, default=None, help="GRPO steps (default 1000)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs/demo", help="output directory")
    demo.add_argument(
        "--task",
        choices=("addition", "flow"),
        default="addition",
        help="addition: a tiny LM learns 2-digit sums; flow: Flow-GRPO on an 8x8 digit generator",
    )

    tr = sub.add_parser("train", help="train a local Hugging Face model on a local dataset")
    tr.add_argument("--model", required=True, help="Hugging Face model directory")
    tr.add_argument("--data", required=True, help="training rows: .jsonl or .parquet")
    tr.add_argument("--eval-data", default=None, help="held-out rows for pass@1")
    tr.add_argument(
        "--reward",
        action="append",
        choices=_REWARDS,
        required=True,
        help="reward function (repeatable): math answer, format, DAPO overlong",
    )
    tr.add_argument("--reward-weights", type=float, nargs="+", default=None)
    tr.add_argument("--reward-mode", choices=("sum", "normalized"), default="sum")
    tr.add_argument("--answer-column", default="answer")
    tr.add_argument("--format-pattern", default=None, help="regex for the format reward")
    tr.add_argument(
        "--overlong-cache",
        type=int,
        default=None,
        help="DAPO soft-overlong buffer (default max_new_tokens // 4)",
    )
    tr.add_argument("--learning-rate", type=float, default=1e-6)
    tr.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"), default="constant")
    tr.add_argument("--warmup-steps", type=int, default=0)
    tr.add_argument("--weight-decay", type=float, default=0.0)
    tr.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    tr.add_argument("--lora-alpha", type=float, default=None)
    tr.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    tr.add_argument("--output", default="runs/train/model", help="save_pretrained directory")
    _add_dataclass_options(tr, GRPOConfig)
    _add_dataclass_options(tr, TrainConfig)
    _add_dataclass_options(tr, RolloutConfig)
    return parser


def _demo(args: argparse.Namespace) -> int:
    if getattr(args, "task", "addition") == "flow":
        return _flow_demo(args)
    from artifex.demo import DemoConfig, run_demo

    cfg = DemoConfig(seed=args.seed, out_dir=args.out)
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, grpo_steps=args.steps)
    run_demo(cfg)
    return 0


def _flow_demo(args: argparse.Namespace) -> int:
    from artifex.flow_demo import FlowDemoConfig, run_flow_demo

    out = "runs/flow_demo" if args.out == "runs/demo" else args.out
    cfg = FlowDemoConfig(seed=args.seed, out_dir=out)
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, grpo_steps=args.steps)
    run_flow_demo(cfg)
    return 0


def _train(args: argparse.Namespace) -> int:
    import optax
    from flax import nnx

    from artifex.generative_models.models.causal_lm import (
        LoRAConfig,
        Tokenizer,
        apply_lora,
        from_pretrained,
        merge_lora,
    )
    from artifex.generative_models.training.rl import rewards as rw
    from artifex.generative_models.training.rl.configs import GRPOConfig
    from artifex.generative_models.training.rl.grpo import GRPOTrainer
    from artifex.generative_models.training.rl.loop import TrainConfig, train
    from artifex.generative_models.training.rl.rollout import RolloutConfig

    if not os.path.isdir(args.model):
        msg = f"model directory not found: {args.model}"
        raise FileNotFoundError(msg)
    grpo = GRPOConfig(**_collect(args, GRPOConfig))
    loop_kwargs = _collect(args, TrainConfig)
    if "num_steps" not in loop_kwargs:
        msg = "--num-steps is required for train"
        raise ValueError(msg)
    loop_kwargs.setdefault("log_dir", os.path.join(os.path.dirname(args.output) or ".", "logs"))
    loop = TrainConfig(**loop_kwargs)
    rollout_config = RolloutConfig(**_collect(args, RolloutConfig))

    rows = load_rows(args.data)
    eval_rows = None if args.eval_data is None else load_rows(args.eval_data)
    tokenizer = Tokenizer.from_pretrained(args.model)
    model = from_pretrained(args.model, dtype=args.dtype)

    funcs = []
    for name in args.reward:
        if name == "math":
            funcs.append(rw.math_answer_reward(answer_column=args.answer_column))
        elif name == "format":
            funcs.append(rw.format_reward(args.format_pattern))
        else:
            cache = args.overlong_cache or max(rollout_config.max_new_tokens // 4, 1)
            funcs.append(rw.soft_overlong_penalty(rollout_config.max_new_tokens, cache))
    rewards = rw.RewardCombiner(funcs, weights=args.reward_weights, mode=args.reward_mode)

    total = loop.num_steps * loop.num_iterations * loop.num_minibatches
    if args.lr_schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, args.learning_rate, max(args.warmup_steps, 1), max(total, 2)
        )
    elif args.lr_schedule == "linear":
        schedule = optax.join_schedules(
            [
                optax.linear_schedule(0.0, args.learning_rate, max(args.warmup_steps, 1)),
                optax.linear_schedule(args.learning_rate, 0.0, max(total - args.warmup_steps, 1)),
            ],
            [max(args.warmup_steps, 1)],
        )
    else:
        schedule = optax.join_schedules(
            [
                optax.linear_schedule(0.0, args.learning_rate, max(args.warmup_steps, 1)),
                optax.constant_schedule(args.learning_rate),
            ],
            [max(args.warmup_steps, 1)],
        )
    tx = optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule, weight_decay=args.weight_decay
    )
    reference = None
    if args.lora_rank > 0:
        lora = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha or 2.0 * args.lora_rank)
        apply_lora(model, lora, nnx.Rngs(loop.seed))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    else:
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        if grpo.beta > 0:
            reference = from_pretrained(args.model, dtype=args.dtype)
    trainer = GRPOTrainer(model, optimizer, grpo, reference_model=reference)
    result = train(trainer, tokenizer, rows, rewards, loop, rollout_config, eval_dataset=eval_rows)
    final = merge_lora(model) if args.lora_rank > 0 else model
    final.save_pretrained(args.output)
    if result.evaluations:
        first, last = result.evaluations[0][1], result.evaluations[-1][1]
        print(f"held-out pass@1: {first['eval/pass@1']:.3f} -> {last['eval/pass@1']:.3f}")
    print(f"saved the trained model to {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``artifex-grpo`` command.

    Args:
        argv: Command-line arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The process exit status.
    """
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return _demo(args)
        return _train(args)
    except (FileNotFoundError, ValueError, TypeError, ImportError) as err:
        print(f"artifex-grpo: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
