"""What ``artifex-grpo train`` imports by path: rewards, step rewards, tools, environments.

- :func:`import_object`: ``"package.module:attribute"``, the current directory importable;
- ``--reward`` (built-in names or ``module:function``), ``--reward-weights``,
  ``--reward-mode`` and ``--reward-model`` as the run's ``RewardCombiner``;
- ``--step-reward`` and ``--step-separator`` as ``StepRewards`` (process supervision);
- ``--tools`` or ``--environment`` (with the multi-turn options) as the multi-turn rollout and
  evaluation hooks of the training loop.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from artifex.cli_ecosystem import reward_model_from_args

__all__ = ["import_object"]


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
