"""``artifex-grpo train`` with a flow model directory: Flow-GRPO from the command line.

A ``--model`` directory written by
:func:`~artifex.generative_models.flow.save_flow_model` (``config.json`` with a flow
``model_type`` and its ``config``) trains with Flow-GRPO through the same loop and the same
options as a language model: ``--data``/``--eval-data`` rows with a prompt column (captions, or
class labels), ``--reward MODULE:FUNCTION`` rewards on images
(e.g. ``artifex.generative_models.flow.rewards:compositional``), the ``GRPOConfig``,
``TrainConfig`` and ``RolloutConfig`` options (its ``--prompt-column``), the learning-rate
options, checkpoints and resume. The sampler has its own options (:func:`add_options`:
``--sde-steps``, ``--noise-level``, ``--window-size``, ``--train-steps``,
``--eval-images-per-prompt``, ``--eval-sde-steps``). Unless given, ``--kl-estimator`` is
``exact`` (the closed-form KL of two Gaussian transitions) and ``--entropy-coeff`` 0 (a
transition's entropy does not depend on the weights). The trained model is saved to
``--output`` as a flow model directory; image grids of every evaluation go to
``<log_dir>/images``.

Options of language models only (a teacher, LoRA, tools or an environment, a reward model,
vLLM, chat templates, step rewards, a dtype, the built-in text rewards) are refused, as are
several processes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["add_options", "check_flow_options_unused", "is_flow_model_dir", "train_flow_command"]

# (attribute, value when unused, flag): options that only a language model reads
_LM_ONLY = (
    ("teacher_model", None, "--teacher-model"),
    ("lora_rank", 0, "--lora-rank"),
    ("tools", None, "--tools"),
    ("environment", None, "--environment"),
    ("reward_model", None, "--reward-model"),
    ("adapter_output", None, "--adapter-output"),
    ("rollout_engine", "sampler", "--rollout-engine"),
    ("vllm_option", None, "--vllm-option"),
    ("packing_threshold", None, "--packing-threshold"),
    ("step_reward", None, "--step-reward"),
    ("apply_chat_template", False, "--apply-chat-template"),
    ("dtype", None, "--dtype"),
    ("coordinator_address", None, "--coordinator-address"),
    ("num_processes", None, "--num-processes"),
    ("distributed", False, "--distributed"),
)


def is_flow_model_dir(path: str) -> bool:
    """Whether ``path`` holds a flow model (``config.json`` with a flow ``model_type``).

    Args:
        path: A ``--model`` directory.

    Returns:
        True for a directory of
        :func:`~artifex.generative_models.flow.save_flow_model`; False for anything
        else (a Hugging Face model, a missing or unreadable ``config.json``).

    Examples:
        >>> from artifex.cli_flow import is_flow_model_dir
        >>> is_flow_model_dir("tests/fixtures/qwen2_tiny"), is_flow_model_dir("no/such/dir")
        (False, False)
    """
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return False
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return (
        isinstance(model_type, str)
        and model_type.startswith("flow_")
        and isinstance(config.get("config"), dict)
    )


def add_options(tr: argparse.ArgumentParser) -> None:
    """Adds the flow sampler's options to the ``train`` parser.

    Args:
        tr: The ``train`` subcommand's parser.

    Examples:
        >>> import argparse
        >>> from artifex.cli_flow import add_options
        >>> parser = argparse.ArgumentParser()
        >>> add_options(parser)
        >>> args = parser.parse_args(["--window-size", "2"])
        >>> args.sde_steps, args.window_size, args.noise_level
        (10, 2, 0.7)
    """
    group = tr.add_argument_group(
        "flow models", "with a flow model directory as --model (Flow-GRPO: docs/flow-grpo.md)"
    )
    group.add_argument("--sde-steps", type=int, default=10, help="denoising steps (default 10)")
    group.add_argument(
        "--noise-level", type=float, default=0.7, help="SDE noise level a (default 0.7)"
    )
    group.add_argument(
        "--window-size",
        type=int,
        default=None,
        help="SDE window: only this many consecutive steps are stochastic and trained, the "
        "others ODE steps (MixGRPO / Flow-GRPO-Fast; default: every step)",
    )
    group.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="SDE steps trained per trajectory, drawn at random (default: all of them)",
    )
    group.add_argument(
        "--eval-images-per-prompt",
        type=int,
        default=1,
        help="ODE images per held-out prompt at each evaluation (default 1)",
    )
    group.add_argument(
        "--eval-sde-steps",
        type=int,
        default=None,
        help="ODE steps of the evaluation (default: --sde-steps)",
    )
    group.add_argument(
        "--freeze-text-encoder",
        action="store_true",
        help="train everything but a text-conditioned model's text encoder (for a model "
        "pretrained with python -m artifex.flow_shapes --text-pretrain-steps, whose encoder "
        "was kept frozen)",
    )


# (attribute, value when unused, flag): options that only a flow model reads
_FLOW_ONLY = (
    ("sde_steps", 10, "--sde-steps"),
    ("noise_level", 0.7, "--noise-level"),
    ("window_size", None, "--window-size"),
    ("train_steps", None, "--train-steps"),
    ("eval_images_per_prompt", 1, "--eval-images-per-prompt"),
    ("eval_sde_steps", None, "--eval-sde-steps"),
    ("freeze_text_encoder", False, "--freeze-text-encoder"),
)


def check_flow_options_unused(args: argparse.Namespace) -> None:
    """Refuses the flow sampler's options in a language model's run (nothing would read them).

    Args:
        args: The parsed ``train`` arguments (with :func:`add_options`).

    Raises:
        ValueError: A flow option set away from its default, named with the model directory.

    Examples:
        >>> import argparse
        >>> from artifex.cli_flow import add_options, check_flow_options_unused
        >>> parser = argparse.ArgumentParser()
        >>> _ = parser.add_argument("--model")
        >>> add_options(parser)
        >>> check_flow_options_unused(parser.parse_args(["--model", "llm"]))
        >>> check_flow_options_unused(parser.parse_args(["--model", "llm", "--window-size", "2"]))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: --window-size is an option of flow models; --model llm is not a flow model ...
    """
    for attr, unused, flag in _FLOW_ONLY:
        if getattr(args, attr, unused) != unused:
            msg = (
                f"{flag} is an option of flow models; --model {args.model} is not a flow model "
                "directory (its config.json has no flow model_type)"
            )
            raise ValueError(msg)


def _collect(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    prefix = cls.__name__ + "."
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}


def _check_options(args: argparse.Namespace) -> None:
    for attr, unused, flag in _LM_ONLY:
        value = getattr(args, attr, unused)
        if value != unused and not (attr == "num_processes" and value == 1):
            msg = (
                f"{flag} is an option of language models; --model {args.model} is a flow model "
                "(docs/flow-grpo.md lists what a flow run takes)"
            )
            raise ValueError(msg)
    if getattr(args, "mesh_fsdp", 1) > 1 or getattr(args, "mesh_tensor", 1) > 1:
        msg = "a flow model trains on one device from the command line: leave --mesh-* at 1"
        raise ValueError(msg)
    if not args.reward:
        msg = (
            "a flow run needs --reward MODULE:FUNCTION scoring images, e.g. --reward "
            "artifex.generative_models.flow.rewards:compositional"
        )
        raise ValueError(msg)
    for spec in args.reward:
        if ":" not in spec:
            msg = (
                f"--reward {spec} scores text; a flow model's completions are images: give an "
                "image reward by import path, e.g. "
                "artifex.generative_models.flow.rewards:compositional"
            )
            raise ValueError(msg)


def _import_reward(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        msg = f"--reward {spec}: cannot import {module}: {err}"
        raise ImportError(msg) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            msg = f"--reward {spec}: {module} has no {attr}"
            raise ValueError(msg)
        obj = getattr(obj, part)
    if not callable(obj):
        msg = f"--reward {spec} is not callable (got {type(obj).__name__})"
        raise TypeError(msg)
    return obj


def train_flow_command(
    args: argparse.Namespace,
    *,
    load_rows: Callable[..., list[dict[str, Any]]],
    lr_schedule: Callable[[str, float, int, int], Any],
) -> int:
    """The ``train`` subcommand for a flow model directory: load, train, save.

    Args:
        args: The parsed ``train`` arguments (with :func:`add_options`).
        load_rows: ``load_rows(path, split, data_format, default_splits=...)``, the
            command's dataset reader.
        lr_schedule: ``lr_schedule(kind, learning_rate, warmup_steps, total_updates)``, the
            command's learning-rate schedule.

    Returns:
        The exit status (75 when a signal stopped the run after a checkpoint).

    Raises:
        ValueError: Options of language models, a text reward, no ``--reward``, bad sampler
            settings, or as the loop.
        ImportError: A ``--reward`` module that cannot be imported.

    Examples:
        A run trains a flow model (``tests/test_cli_flow_train.py`` runs a tiny one); the
        options are checked before anything is loaded:

        >>> from artifex import cli
        >>> from artifex.cli_flow import train_flow_command
        >>> argv = ["train", "--model", "runs/shapes/model", "--data", "runs/shapes/train.jsonl",
        ...         "--num-steps", "1"]
        >>> args = cli.build_parser().parse_args([*argv, "--reward", "math"])
        >>> train_flow_command(args, load_rows=cli.load_rows, lr_schedule=cli.lr_schedule)
        Traceback (most recent call last):
            ...
        ValueError: --reward math scores text; a flow model's completions are images: ...
        >>> reward = "artifex.generative_models.flow.rewards:compositional"
        >>> args = cli.build_parser().parse_args([*argv, "--reward", reward, "--lora-rank", "4"])
        >>> train_flow_command(args, load_rows=cli.load_rows, lr_schedule=cli.lr_schedule)
        Traceback (most recent call last):
            ...
        ValueError: --lora-rank is an option of language models; ...
    """
    import optax
    from flax import nnx

    from artifex.cli_checks import check_run_paths, default_checkpoint_dir, interrupted_message
    from artifex.generative_models.flow import (
        SDEConfig,
        flow_trainer,
        load_flow_model,
        save_flow_model,
        train_flow,
    )
    from artifex.generative_models.flow.text_encoder import trained_parameters
    from artifex.generative_models.training.logging import is_primary_process
    from artifex.generative_models.training.rl import (
        GRPOConfig,
        RewardCombiner,
        RolloutConfig,
        TrainConfig,
    )
    from artifex.generative_models.training.run_lock import RunLock
    from artifex.generative_models.utils.fingerprint import directory_fingerprint

    _check_options(args)
    loop_kwargs = _collect(args, TrainConfig)
    if "num_steps" not in loop_kwargs:
        msg = "--num-steps is required for train"
        raise ValueError(msg)
    loop_kwargs.setdefault("log_dir", os.path.join(os.path.dirname(args.output) or ".", "logs"))
    if "checkpoint_dir" not in loop_kwargs:
        loop_kwargs["checkpoint_dir"] = default_checkpoint_dir(args.output)
    loop = TrainConfig(**loop_kwargs)
    check_run_paths(args.output, args.model, loop.checkpoint_dir)
    grpo_kwargs = {"kl_estimator": "exact", "entropy_coeff": 0.0, **_collect(args, GRPOConfig)}
    grpo = GRPOConfig(**grpo_kwargs)
    rollout_config = RolloutConfig(**_collect(args, RolloutConfig))
    sde = SDEConfig(
        num_steps=args.sde_steps,
        noise_level=args.noise_level,
        window_size=args.window_size,
        train_steps=args.train_steps,
    )
    rewards = RewardCombiner(
        [_import_reward(spec) for spec in args.reward],
        weights=args.reward_weights,
        mode=args.reward_mode,
    )
    rows = load_rows(args.data, args.split, args.data_format)
    eval_rows = None
    if args.eval_data is not None:
        eval_rows = load_rows(
            args.eval_data,
            args.eval_split,
            args.eval_data_format,
            default_splits=("test", "validation"),
        )
    model = load_flow_model(args.model)
    trained = trained_parameters(
        model, args.freeze_text_encoder, f"--freeze-text-encoder (--model {args.model})"
    )
    reference = load_flow_model(args.model) if grpo.beta > 0 else None

    total = loop.num_steps * loop.num_iterations * loop.num_minibatches
    schedule = lr_schedule(args.lr_schedule, args.learning_rate, args.warmup_steps, total)
    tx = optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule, weight_decay=args.weight_decay
    )
    optimizer = nnx.Optimizer(model, tx, wrt=trained)
    trainer = flow_trainer(model, optimizer, grpo, sde, reference_model=reference)
    fingerprint = {
        "model": directory_fingerprint(args.model),
        "optimizer": {
            "learning_rate": args.learning_rate,
            "lr_schedule": args.lr_schedule,
            "warmup_steps": args.warmup_steps,
            "weight_decay": args.weight_decay,
            "total_updates": total,
            **({"freeze_text_encoder": True} if args.freeze_text_encoder else {}),
        },
        "rewards": {
            "reward": list(args.reward),
            "reward_weights": args.reward_weights,
            "reward_mode": args.reward_mode,
        },
    }
    lock = RunLock(args.output, "--output")
    lock.acquire()
    try:
        result = train_flow(
            trainer,
            rows,
            rewards,
            loop,
            sde,
            rollout_config=rollout_config,
            eval_dataset=eval_rows,
            eval_images_per_prompt=args.eval_images_per_prompt,
            eval_num_steps=args.eval_sde_steps,
            fingerprint_extra=fingerprint,
        )
        if result.interrupted is not None:
            step = result.start_step + len(result.history)
            print(
                interrupted_message(
                    result.interrupted,
                    step,
                    loop.checkpoint_dir,
                    resume=loop.resume,
                    overwrite=loop.overwrite,
                ),
                file=sys.stderr,
            )
            return 75
        save_flow_model(model, args.output)
    finally:
        lock.release()
    if is_primary_process():
        if result.evaluations:
            first, last = result.evaluations[0][1], result.evaluations[-1][1]
            print(
                f"held-out pass@1: {first['eval/pass@1']:.3f} -> {last['eval/pass@1']:.3f}, "
                f"reward {first['eval/reward_mean']:.3f} -> {last['eval/reward_mean']:.3f}"
            )
        print(f"saved the trained flow model to {args.output}")
    return 0
