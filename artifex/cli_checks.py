"""What ``artifex-grpo train`` checks and says so that no run's work is lost or mixed up.

- :func:`check_run_paths`: ``--output`` may not be ``--model`` (the export would replace the
  pretrained weights a resumed run reloads as its KL reference) nor the checkpoint directory.
- :func:`default_checkpoint_dir`: without ``--checkpoint-dir`` a run still checkpoints, in
  ``checkpoints/`` beside ``--output`` (as ``logs/``), so an interrupted run or a failed
  export can be resumed; ``--checkpoint-dir none`` turns checkpoints off.
- :func:`run_fingerprint`: the command's settings that change the results but that the trainer
  does not hold (the model directory's identity, the optimizer, the reward settings); a resumed
  run must match them.
- :func:`check_free_space`: a run whose export and checkpoint would not fit on their disks is
  refused before its first step, not after its last.
- :func:`check_multi_turn_flags`: multi-turn flags are refused without ``--tools`` or
  ``--environment`` instead of being ignored.
- :func:`interrupted_message`, :func:`export_failed`: messages that say where the work is and
  exactly how to continue it.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import shutil
from typing import Any

__all__ = [
    "DEFAULT_MULTI_TURN",
    "check_free_space",
    "check_multi_turn_flags",
    "check_run_paths",
    "default_checkpoint_dir",
    "export_failed",
    "interrupted_message",
    "positive_float",
    "positive_int",
    "resume_advice",
    "run_fingerprint",
]

#: Defaults of the multi-turn flags (``None`` on the parser, so that a given flag is seen).
DEFAULT_MULTI_TURN = {"tool_format": "qwen", "tool_timeout": 10.0, "max_turns": 4}
_TOOLS_ONLY = ("tool_format", "tool_timeout", "tool_max_threads")
_MULTI_TURN = ("max_turns", "max_completion_tokens", "stop_string", "max_observation_chars")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1.

    Args:
        text: The option's value.

    Returns:
        The int.

    Raises:
        argparse.ArgumentTypeError: Not an int >= 1.

    Examples:
        >>> from artifex.cli_checks import positive_int
        >>> positive_int("2")
        2
        >>> positive_int("0")
        Traceback (most recent call last):
            ...
        argparse.ArgumentTypeError: expected an int >= 1, got '0'
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        msg = f"expected an int >= 1, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0.

    Args:
        text: The option's value.

    Returns:
        The float.

    Raises:
        argparse.ArgumentTypeError: Not a finite number > 0.

    Examples:
        >>> from artifex.cli_checks import positive_float
        >>> positive_float("2.5")
        2.5
        >>> positive_float("-5")
        Traceback (most recent call last):
            ...
        argparse.ArgumentTypeError: expected a finite number > 0, got '-5'
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        msg = f"expected a finite number > 0, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _non_empty(text: str) -> str:
    if not text:
        msg = "expected a non-empty text, got ''"
        raise argparse.ArgumentTypeError(msg)
    return text


def check_multi_turn_flags(args: argparse.Namespace) -> None:
    """Refuses multi-turn flags that nothing would read, then fills in their defaults.

    ``--tool-format``, ``--tool-timeout`` and ``--tool-max-threads`` need ``--tools``;
    ``--max-turns``, ``--max-completion-tokens``, ``--stop-string`` and
    ``--max-observation-chars`` need ``--tools`` or ``--environment``.

    Args:
        args: The parsed ``train`` arguments (changed in place: defaults filled in).

    Raises:
        ValueError: A flag given without what reads it.

    Examples:
        >>> import argparse
        >>> from artifex.cli_checks import check_multi_turn_flags
        >>> args = argparse.Namespace(tools=None, environment=None, tool_format=None,
        ...                           tool_timeout=None, max_turns=0, max_completion_tokens=None,
        ...                           stop_string=None)
        >>> check_multi_turn_flags(args)
        Traceback (most recent call last):
            ...
        ValueError: --max-turns applies to multi-turn episodes only: add --tools or ...
    """
    for name in _TOOLS_ONLY + _MULTI_TURN:
        if getattr(args, name, None) is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name in _TOOLS_ONLY and not args.tools:
            msg = (
                f"{flag} applies to --tools only, and no --tools is given: remove it or add --tools"
            )
            raise ValueError(msg)
        if not args.tools and not args.environment:
            msg = (
                f"{flag} applies to multi-turn episodes only: add --tools or --environment, or "
                "remove it"
            )
            raise ValueError(msg)
    for name, value in DEFAULT_MULTI_TURN.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def check_run_paths(output: str, model: str, checkpoint_dir: str | None) -> None:
    """Refuses an ``--output`` that is ``--model`` or the checkpoint directory.

    Args:
        output: ``--output``.
        model: ``--model``.
        checkpoint_dir: The checkpoint directory, or ``None``.

    Raises:
        ValueError: Naming the two flags.

    Examples:
        >>> from artifex.cli_checks import check_run_paths
        >>> check_run_paths("runs/a/model", "base", "runs/a/checkpoints")
        >>> check_run_paths("base/", "base", None)
        Traceback (most recent call last):
            ...
        ValueError: --output base/ is the --model directory: ...
    """
    out = os.path.realpath(output)
    if out == os.path.realpath(model):
        msg = (
            f"--output {output} is the --model directory: the export would replace the "
            "pretrained weights (which a resumed run loads again as its KL reference); "
            "choose another --output"
        )
        raise ValueError(msg)
    if checkpoint_dir is not None and out == os.path.realpath(checkpoint_dir):
        msg = f"--output {output} is the --checkpoint-dir: give each its own directory"
        raise ValueError(msg)


def default_checkpoint_dir(output: str) -> str:
    """``checkpoints/`` beside ``--output`` (where ``logs/`` goes too).

    Args:
        output: ``--output``.

    Returns:
        The directory.

    Examples:
        >>> from artifex.cli_checks import default_checkpoint_dir
        >>> default_checkpoint_dir("runs/a/model")
        'runs/a/checkpoints'
    """
    return os.path.join(os.path.dirname(os.path.normpath(output)) or ".", "checkpoints")


def run_fingerprint(args: argparse.Namespace, total_updates: int) -> dict[str, Any]:
    """The command's settings that a resumed run must share (beyond the trainer's configs).

    Args:
        args: The parsed ``train`` arguments.
        total_updates: Optimizer updates of the whole run (a decaying schedule depends on it).

    Returns:
        A JSON-able dict: ``model`` (the model directory's
        :func:`~artifex.generative_models.utils.fingerprint.directory_fingerprint`),
        ``dtype``, ``optimizer``, ``lora`` and ``rewards`` settings.

    Examples:
        >>> from artifex.cli import build_parser
        >>> from artifex.cli_checks import run_fingerprint
        >>> args = build_parser().parse_args(
        ...     ["train", "--model", "tests/fixtures/qwen2_tiny", "--data", "rows.jsonl",
        ...      "--reward", "math"])  # from the repository root
        >>> fingerprint = run_fingerprint(args, total_updates=100)
        >>> sorted(fingerprint), fingerprint["rewards"]["reward"]
        (['dtype', 'lora', 'model', 'optimizer', 'rewards'], ['math'])
    """
    from artifex.generative_models.utils.fingerprint import directory_fingerprint

    optimizer = {
        "learning_rate": args.learning_rate,
        "lr_schedule": args.lr_schedule,
        "warmup_steps": args.warmup_steps,
        "weight_decay": args.weight_decay,
    }
    if args.lr_schedule != "constant":
        optimizer["total_updates"] = total_updates
    return {
        "model": directory_fingerprint(args.model),
        "dtype": args.dtype,
        "optimizer": optimizer,
        "lora": {
            "rank": args.lora_rank,
            "alpha": args.lora_alpha,
            "targets": None if args.lora_targets is None else sorted(args.lora_targets),
        },
        "rewards": {
            "reward": list(args.reward),
            "reward_weights": args.reward_weights,
            "reward_mode": args.reward_mode,
            "answer_column": args.answer_column,
            "answer_extraction": args.answer_extraction,
            "format_pattern": args.format_pattern,
            "overlong_cache": args.overlong_cache,
            **_reward_model_fingerprint(args),
        },
    }


def _reward_model_fingerprint(args: argparse.Namespace) -> dict[str, Any]:
    """``{"reward_model": ...}``: its directory fingerprint and settings; ``{}`` without one.

    The batch size is left out: it does not change the scores.
    """
    from artifex.generative_models.utils.fingerprint import directory_fingerprint

    directory = getattr(args, "reward_model", None)
    if directory is None:
        return {}
    settings = {
        "model": directory_fingerprint(directory),
        "normalize": args.reward_model_normalize,
        "scale": args.reward_model_scale,
        "shift": args.reward_model_shift,
        "messages_column": args.reward_model_messages_column,
        "max_length": args.reward_model_max_length,
    }
    return {"reward_model": settings}


def resume_advice(resume: bool, overwrite: bool) -> str:
    """How to continue a run from its checkpoints with the command that started it.

    Args:
        resume: ``--resume`` of that command.
        overwrite: ``--overwrite`` of that command.

    Returns:
        ``"run the same command again"`` plus the changes it needs.

    Examples:
        >>> from artifex.cli_checks import resume_advice
        >>> resume_advice(True, False)
        'run the same command again'
        >>> resume_advice(False, True)
        'run the same command again with --resume true and without --overwrite'
    """
    changes = []
    if not resume:
        changes.append("with --resume true")
    if overwrite:
        changes.append("without --overwrite")  # it would delete the checkpoints
    advice = "run the same command again"
    return f"{advice} {' and '.join(changes)}" if changes else advice


def interrupted_message(
    signal_name: str, step: int, checkpoint_dir: str | None, *, resume: bool, overwrite: bool
) -> str:
    """The line a run stopped by a signal prints: what was saved where, and how to go on.

    Args:
        signal_name: ``"SIGTERM"`` or ``"SIGINT"``.
        step: The last finished step.
        checkpoint_dir: Where its checkpoint was saved (``None``: nowhere).
        resume: ``--resume`` of the command.
        overwrite: ``--overwrite`` of the command.

    Returns:
        The message.

    Examples:
        >>> from artifex.cli_checks import interrupted_message
        >>> print(interrupted_message("SIGTERM", 3, None, resume=True, overwrite=False))
        artifex-grpo: stopped by SIGTERM after step 3; nothing was saved ...
    """
    if checkpoint_dir is None:
        return (
            f"artifex-grpo: stopped by {signal_name} after step {step}; nothing was saved "
            "(--checkpoint-dir none) and the model was not exported: running the command "
            "again starts from step 0"
        )
    return (
        f"artifex-grpo: stopped by {signal_name}; step {step} is saved as a checkpoint in "
        f"{checkpoint_dir} (the model was not exported): {resume_advice(resume, overwrite)} "
        "to resume"
    )


def export_failed(
    err: OSError,
    output: str,
    step: int,
    checkpoint_dir: str | None,
    *,
    resume: bool,
    overwrite: bool,
) -> OSError:
    """The error of a failed export, saying where the trained state still is.

    Args:
        err: What ``save_pretrained`` raised.
        output: ``--output``.
        step: The step of the trained state.
        checkpoint_dir: Where its checkpoint is (``None``: nowhere).
        resume: ``--resume`` of the command.
        overwrite: ``--overwrite`` of the command.

    Returns:
        An ``OSError`` (same ``errno``) with the message.

    Examples:
        >>> import errno
        >>> from artifex.cli_checks import export_failed
        >>> err = export_failed(OSError(errno.ENOSPC, "No space left on device"), "runs/a/model",
        ...                     5, "runs/a/checkpoints", resume=True, overwrite=False)
        >>> err.errno == errno.ENOSPC, "checkpoint of step 5 in runs/a/checkpoints" in str(err)
        (True, True)
    """
    what = err.strerror or str(err)
    if checkpoint_dir is None:
        msg = (
            f"exporting the trained model to {output} failed ({what}); no checkpoint holds the "
            "trained state (--checkpoint-dir none), so it is lost"
        )
    else:
        msg = (
            f"exporting the trained model to {output} failed ({what}); the trained state is "
            f"the checkpoint of step {step} in {checkpoint_dir}: free space or fix the path, "
            f"then {resume_advice(resume, overwrite)}: it loads that checkpoint and exports "
            "it without training"
        )
    return OSError(err.errno, msg)


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_free_space(
    output: str,
    checkpoint_dir: str | None,
    model: Any,
    trainer: Any,
    *,
    free: Any = None,
) -> None:
    """Refuses a run whose export and checkpoint will not fit, before its first step.

    The export needs the model's parameters once more (new files are written before the old ones
    go); a checkpoint, the trainer's checkpointed state (parameters, optimizer state) once more.
    A directory not created yet is measured on its nearest existing parent. Where the two share a
    file system, they add up.

    Args:
        output: ``--output``.
        checkpoint_dir: The checkpoint directory, or ``None``.
        model: The policy (its ``nnx.Param`` arrays are the export).
        trainer: The trainer (``checkpoint_state()``).
        free: ``path -> free bytes`` (``shutil.disk_usage(path).free`` by default).

    Raises:
        OSError: ``ENOSPC``, naming the directories, what they need and what is free.

    Examples:
        >>> import os, tempfile
        >>> from flax import nnx
        >>> from artifex.cli_checks import check_free_space
        >>> model = nnx.Linear(1024, 1024, rngs=nnx.Rngs(0))  # 4 MiB of float32 parameters
        >>> out = tempfile.mkdtemp()
        >>> check_free_space(out, None, model, None, free=lambda path: 5 * 2**20)
        >>> check_free_space(out, None, model, None, free=lambda path: 2**20)
        Traceback (most recent call last):
            ...
        OSError: [Errno 28] not enough free space: ... needs about 4.0 MiB, ...
    """
    import jax
    from flax import nnx

    def nbytes(tree: Any) -> int:
        return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))

    free = free or (lambda path: shutil.disk_usage(path).free)
    needs = [(f"the export to {output}", output, nbytes(nnx.state(model, nnx.Param)))]
    if checkpoint_dir is not None:
        state = trainer.checkpoint_state()
        needs.append((f"a checkpoint in {checkpoint_dir}", checkpoint_dir, nbytes(state)))
    devices: dict[int, list[tuple[str, str, int]]] = {}
    for what, path, size in needs:
        path = os.path.abspath(path)
        while not os.path.exists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)  # a directory not made yet: its file system
        devices.setdefault(os.stat(path).st_dev, []).append((what, path, size))
    for group in devices.values():
        total = sum(n for _, _, n in group)
        available = free(group[0][1])
        if available < total:
            what = " and ".join(f"{w} ({_size(n)})" for w, _, n in group)
            msg = (
                f"not enough free space: {what} needs about {_size(total)}, and its file system "
                f"has {_size(available)} free; free space or choose another location (checked "
                "before the first step)"
            )
            raise OSError(errno.ENOSPC, msg)
