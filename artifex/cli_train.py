"""``artifex-grpo train`` itself, and the command's error lines.

- :func:`lr_schedule`: the learning-rate schedule (``--lr-schedule``, ``--warmup-steps``);
- the run: the settings checked and every output location held before anything is loaded,
  then the data, tokenizer and model(s) loaded, the optimizer (full or LoRA), the trainer and
  the training loop, and the export; a run stopped by a signal exits with
  :data:`EXIT_INTERRUPTED`;
- ``--teacher-model`` (on-policy distillation) checked and added to the run's fingerprint;
- one line for any error: what was wrong (with the file, when it names one) and what to do.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from artifex.cli_devices import _setup_devices, float32_precision_notice
from artifex.cli_ecosystem import check_options as check_ecosystem_options
from artifex.cli_ecosystem import save_adapter
from artifex.cli_engines import build_engine
from artifex.cli_engines import check_options as check_engine_options
from artifex.cli_flow import check_flow_options_unused, is_flow_model_dir, train_flow_command
from artifex.cli_options import _collect
from artifex.cli_rewards import _build_rewards, _multi_turn_hooks, _step_rewards
from artifex.cli_rows import _check_chat_template, _eval_split, _prompts_as_chat, load_rows

__all__ = ["lr_schedule"]


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


def _train(args: argparse.Namespace) -> int:
    from artifex.cli_checks import check_multi_turn_flags, check_run_paths, default_checkpoint_dir
    from artifex.generative_models.training.checkpointing import IncompatibleCheckpointError
    from artifex.generative_models.training.logging import is_primary_process
    from artifex.generative_models.training.rl.core.configs import GRPOConfig
    from artifex.generative_models.training.rl.rollouts.rollout import RolloutConfig
    from artifex.generative_models.training.rl.run.loop import TrainConfig, check_writable_dir
    from artifex.generative_models.training.run_lock import RunLock

    if not os.path.isdir(args.model):
        msg = f"model directory not found: {args.model}"
        raise FileNotFoundError(msg)
    if is_flow_model_dir(args.model):  # Flow-GRPO: a flow model directory (artifex/cli_flow.py)
        return train_flow_command(args, load_rows=load_rows, lr_schedule=lr_schedule)
    check_flow_options_unused(args)
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
    except IncompatibleCheckpointError as err:
        if not default_checkpoints:
            raise
        # checkpoints/ and logs/ beside --output are shared by every --output of that folder:
        # the run refused here may be another output's, which --overwrite would delete.
        advice = (
            " (the default checkpoint directory beside --output, shared by every --output in "
            "its folder: resume with the original settings, or give this run its own "
            "--checkpoint-dir and --log-dir; --overwrite deletes the checkpoints and logs there)"
        )
        text = _first_line(err)[: _MAX_LINE - len(advice)]  # the error line keeps the advice
        raise _SharedCheckpointsError(text + advice) from err
    finally:
        output_lock.release()


class _SharedCheckpointsError(ValueError):
    """A refused resume from the default checkpoint directory (its message says what to do)."""


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
        model,
        optimizer,
        grpo,
        reference_model=reference,
        mesh=mesh,
        teacher_model=teacher,
        packing_threshold=args.packing_threshold,
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


_MAX_LINE = 500  # characters of an error's text in its one line


def _first_line(err: BaseException) -> str:
    text = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return text[:_MAX_LINE] or type(err).__name__


_HINTS = (
    ("_SharedCheckpointsError", ""),  # the message says what to do
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
