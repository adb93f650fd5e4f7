"""``artifex-grpo train`` options for reward models and PEFT adapters (wiring only).

- ``--reward-model DIR``: a transformers ``*ForSequenceClassification`` checkpoint scores every
  completion (:func:`~artifex.generative_models.training.rl.rewards.reward_model_reward`); it
  comes after the ``--reward`` functions, so ``--reward-weights`` gives one weight per
  ``--reward`` and then one for the reward model.
- ``--adapter-output DIR``: with ``--lora-rank``, the trained adapter is also written there in
  PEFT's format (:func:`~artifex.generative_models.models.causal_lm.save_peft_adapter`);
  ``--save-merged false`` leaves out the merged model in ``--output``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any


def add_options(tr: argparse.ArgumentParser, parse_bool: Callable[[str], bool]) -> None:
    """Adds the reward-model and adapter options to the ``train`` parser.

    Args:
        tr: The ``train`` subcommand's parser.
        parse_bool: The command's boolean option type.
    """
    group = tr.add_argument_group("reward model and adapters")
    group.add_argument(
        "--reward-model",
        default=None,
        metavar="DIR",
        help="a transformers *ForSequenceClassification directory (Llama, Qwen2, Qwen3, with "
        "its tokenizer) whose score is a reward, after the --reward functions (its weight is "
        "the last of --reward-weights)",
    )
    group.add_argument(
        "--reward-model-batch-size",
        type=int,
        default=8,
        metavar="N",
        help="completions per reward-model forward pass (default 8)",
    )
    group.add_argument(
        "--reward-model-normalize",
        choices=("none", "affine", "running"),
        default="none",
        help="none: the raw score; affine: scale * score + shift; running: (score - mean) / "
        "std over every score so far (default none)",
    )
    group.add_argument("--reward-model-scale", type=float, default=1.0, metavar="A")
    group.add_argument("--reward-model-shift", type=float, default=0.0, metavar="B")
    group.add_argument(
        "--reward-model-messages-column",
        default=None,
        metavar="NAME",
        help="dataset column with each prompt's chat messages, rendered with the reward "
        "model's chat template (default: the prompt text the policy saw)",
    )
    group.add_argument(
        "--reward-model-max-length",
        type=int,
        default=None,
        metavar="TOKENS",
        help="longest scored text; longer ones stop the run (default: the model's positions)",
    )
    group.add_argument(
        "--adapter-output",
        default=None,
        metavar="DIR",
        help="with --lora-rank: also write the trained LoRA adapter there in PEFT's format "
        "(adapter_config.json + adapter_model.safetensors)",
    )
    group.add_argument(
        "--save-merged",
        type=parse_bool,
        nargs="?",
        const=True,
        default=True,
        metavar="BOOL",
        help="write the model (adapters merged) to --output (default true; false needs "
        "--adapter-output)",
    )


def check_options(args: argparse.Namespace) -> None:
    """Refuses option combinations that cannot work, before anything is loaded.

    Args:
        args: The parsed ``train`` arguments.

    Raises:
        ValueError: Naming the options.
        FileNotFoundError: If ``--reward-model`` is not a directory.
    """
    if not args.reward and args.reward_model is None:
        msg = "train needs at least one --reward or a --reward-model"
        raise ValueError(msg)
    if args.reward_model is not None and not os.path.isdir(args.reward_model):
        msg = f"--reward-model directory not found: {args.reward_model}"
        raise FileNotFoundError(msg)
    if args.reward_model_batch_size < 1:
        msg = f"--reward-model-batch-size must be at least 1, got {args.reward_model_batch_size}"
        raise ValueError(msg)
    if args.adapter_output is not None:
        if args.lora_rank <= 0:
            msg = "--adapter-output writes a LoRA adapter: it needs --lora-rank > 0"
            raise ValueError(msg)
        adapter = os.path.realpath(args.adapter_output)
        for other, flag in ((args.model, "--model"), (args.output, "--output")):
            if adapter == os.path.realpath(other):
                msg = f"--adapter-output must differ from {flag} ({other})"
                raise ValueError(msg)
    if not args.save_merged and args.adapter_output is None:
        msg = "--save-merged false writes no model: give --adapter-output"
        raise ValueError(msg)


def reward_model_from_args(args: argparse.Namespace) -> Any:
    """The ``--reward-model`` reward function, or None without the option.

    Args:
        args: The parsed ``train`` arguments.

    Returns:
        A :class:`~artifex.generative_models.training.rl.rewards.RewardModelReward` or None.
    """
    if args.reward_model is None:
        return None
    from artifex.generative_models.training.rl.rewards import reward_model_reward

    return reward_model_reward(
        args.reward_model,
        batch_size=args.reward_model_batch_size,
        normalize=args.reward_model_normalize,
        scale=args.reward_model_scale,
        shift=args.reward_model_shift,
        messages_column=args.reward_model_messages_column,
        max_length=args.reward_model_max_length,
    )


def save_adapter(model: Any, args: argparse.Namespace, lora_config: Any) -> None:
    """Writes the trained adapter to ``--adapter-output`` when asked (every process calls it).

    Args:
        model: The trained policy with its adapters.
        args: The parsed ``train`` arguments.
        lora_config: The ``LoRAConfig`` the adapters were made with.
    """
    if args.adapter_output is None:
        return
    from artifex.generative_models.models.causal_lm import save_peft_adapter
    from artifex.generative_models.training.logging import is_primary_process

    save_peft_adapter(
        model, args.adapter_output, config=lora_config, base_model_name_or_path=args.model
    )
    if is_primary_process():
        print(f"saved the LoRA adapter (PEFT format) to {args.adapter_output}", file=sys.stdout)
