"""``artifex-grpo train`` options for the rollout engine (wiring only).

- ``--rollout-engine sampler`` (default): the library's compiled sampler.
- ``--rollout-engine continuous``: the library's sampler with continuous batching
  (:class:`~artifex.generative_models.inference.engines.base.SamplerEngine` with
  ``continuous=True``: decode slots refilled as completions end), for completions of very
  different lengths.
- ``--rollout-engine vllm``: a colocated vLLM engine samples every rollout
  (:class:`~artifex.generative_models.inference.engines.vllm.VLLMEngine`, started from the
  ``--model`` directory in the policy's dtype; the policy's weights are pushed into it before
  each rollout that follows an update). Needs the ``vllm`` extra.
- ``--vllm-option KEY=VALUE`` (repeatable): a ``VLLMEngine`` / ``vllm.LLM`` argument, e.g.
  ``max_model_len=1024``, ``gpu_memory_utilization=0.35``, ``kv_cache_memory_bytes=1GiB``,
  ``enforce_eager=true``. Values are read as JSON (numbers, ``true``, ``null``), else as text;
  ``kv_cache_memory_bytes`` also takes a size such as ``512MiB``.
- ``--packing-threshold F``: the update packs a batch's completions into rows without padding
  when more than the fraction ``F`` of its positions is padding (``GRPOTrainer``'s
  ``packing_threshold``; default: never).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def parse_vllm_option(text: str) -> tuple[str, Any]:
    """Parses one ``--vllm-option KEY=VALUE``.

    Args:
        text: ``KEY=VALUE``; the value is read as JSON when it parses, else kept as text.

    Returns:
        ``(key, value)``.

    Raises:
        argparse.ArgumentTypeError: No ``=``, or a key that is not a Python identifier.

    Examples:
        >>> from artifex.cli_engines import parse_vllm_option
        >>> parse_vllm_option("max_model_len=512"), parse_vllm_option("enforce_eager=true")
        (('max_model_len', 512), ('enforce_eager', True))
        >>> parse_vllm_option("kv_cache_memory_bytes=1GiB")
        ('kv_cache_memory_bytes', '1GiB')
    """
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key.isidentifier():
        msg = f"expected KEY=VALUE with KEY a vLLM argument name, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return key, parsed


def add_options(tr: argparse.ArgumentParser) -> None:
    """Adds ``--rollout-engine`` and ``--vllm-option`` to the ``train`` parser.

    Args:
        tr: The ``train`` subcommand's parser.
    """
    group = tr.add_argument_group("rollout engine")
    group.add_argument(
        "--rollout-engine",
        choices=("sampler", "continuous", "vllm"),
        default="sampler",
        help="what samples the rollouts: the library's compiled sampler (default); the same "
        "sampler with continuous batching (decode slots refilled as completions end: for "
        "completions of very different lengths; single-turn, one process); or a vLLM "
        "engine in this process that gets the policy's weights after each update (pip "
        "install 'artifex-grpo[vllm]'; single-turn, one process; evaluation stays on the "
        "library's sampler)",
    )
    group.add_argument(
        "--packing-threshold",
        type=float,
        default=None,
        metavar="F",
        help="pack the update's completions into rows without padding when more than this "
        "fraction (0 to 1) of the batch's positions is padding (default: never; 0.5 pays on "
        "long, ragged completions, docs/benchmarks.md)",
    )
    group.add_argument(
        "--vllm-option",
        action="append",
        type=parse_vllm_option,
        default=None,
        metavar="KEY=VALUE",
        help="a vLLM engine argument (repeatable), e.g. max_model_len=1024, "
        "gpu_memory_utilization=0.35, kv_cache_memory_bytes=1GiB, enforce_eager=true",
    )


def check_options(args: argparse.Namespace) -> None:
    """Refuses engine options that nothing would read, before anything is loaded.

    Args:
        args: The parsed ``train`` arguments.

    Raises:
        ValueError: ``--vllm-option`` without ``--rollout-engine vllm``, the same key twice,
            ``--packing-threshold`` outside ``[0, 1]``, or ``--rollout-engine vllm`` or
            ``continuous`` with multi-turn episodes or several processes.

    Examples:
        >>> import argparse
        >>> from artifex.cli_engines import check_options
        >>> args = argparse.Namespace(rollout_engine="sampler", vllm_option=[("seed", 1)])
        >>> check_options(args)
        Traceback (most recent call last):
            ...
        ValueError: --vllm-option applies to --rollout-engine vllm only
    """
    options = getattr(args, "vllm_option", None) or []
    engine = getattr(args, "rollout_engine", "sampler")
    if options and engine != "vllm":
        msg = "--vllm-option applies to --rollout-engine vllm only"
        raise ValueError(msg)
    keys = [k for k, _ in options]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        msg = f"--vllm-option {twice[0]} is given more than once"
        raise ValueError(msg)
    threshold = getattr(args, "packing_threshold", None)
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        msg = f"--packing-threshold: expected a fraction from 0 to 1, got {threshold}"
        raise ValueError(msg)
    if engine == "sampler":
        return
    if getattr(args, "tools", None) or getattr(args, "environment", None):
        msg = f"--rollout-engine {engine} samples single-turn rollouts; --tools / " + (
            "--environment episodes use the library's sampler"
        )
        raise ValueError(msg)
    processes = getattr(args, "num_processes", None)
    if processes is not None and processes > 1:
        msg = f"--rollout-engine {engine} runs in one process, got --num-processes {processes}"
        raise ValueError(msg)


def build_engine(args: argparse.Namespace, model: Any) -> Any:
    """The rollout engine ``--rollout-engine`` names, or ``None`` for the library's sampler.

    Args:
        args: The parsed ``train`` arguments (``--model`` is the directory vLLM starts from).
        model: The loaded policy (its parameter dtype is vLLM's dtype).

    Returns:
        A :class:`~artifex.generative_models.inference.engines.vllm.VLLMEngine`, a
        :class:`~artifex.generative_models.inference.engines.base.SamplerEngine` with
        continuous batching, or ``None``.

    Raises:
        ImportError: ``--rollout-engine vllm`` without vLLM installed.
        ValueError: An option vLLM or the engine refuses.
    """
    engine = getattr(args, "rollout_engine", "sampler")
    if engine == "continuous":
        from artifex.generative_models.inference.engines.base import SamplerEngine

        return SamplerEngine(continuous=True)
    if engine != "vllm":
        return None
    from artifex.generative_models.inference.engines.vllm import VLLMEngine
    from artifex.generative_models.models.causal_lm.hf_io import parse_size

    options = dict(getattr(args, "vllm_option", None) or [])
    if isinstance(options.get("kv_cache_memory_bytes"), str):
        options["kv_cache_memory_bytes"] = parse_size(options["kv_cache_memory_bytes"])
    options.setdefault("dtype", model.config.param_dtype)
    return VLLMEngine(args.model, **options)
