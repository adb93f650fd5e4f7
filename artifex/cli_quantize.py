"""``artifex-grpo train`` options for a quantized frozen base, QLoRA (wiring only).

- ``--quantize int8|int4|nf4``: with ``--lora-rank``, the loaded model's projections are
  stored quantized (:func:`~artifex.generative_models.models.causal_lm.quantize.quantize_base`)
  and only the adapters train; ``none`` (default) keeps the base as loaded. Needs the
  ``quantize`` extra (qwix).
- ``--quantize-block-size N|column``: input rows per scale (default 64, QLoRA's); ``column``
  gives one scale per output column.

With ``--quantize`` the sampler and the update scan the decoder layers (``model.scan_layers``;
``--scan-layers`` defaults to true unless given, or ``--remat-every`` > 1 or
``--layerwise-update`` asks otherwise): XLA:CPU dequantizes the kernels of unrolled layers all
up front and keeps them, as much memory as the full-precision projections; a scan dequantizes
one layer at a time.

The export (``--output``) is the trained function in full precision: the dequantized base with
the adapters merged (``merge_lora(dequantize_base(model))``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from typing import Any

DEFAULT_BLOCK_SIZE = 64


def parse_block_size(text: str) -> int | str:
    """Parses ``--quantize-block-size``: an even int >= 2, or ``column``.

    Args:
        text: The option's value.

    Returns:
        The int, or ``"column"``.

    Raises:
        argparse.ArgumentTypeError: Anything else.

    Examples:
        >>> from artifex.cli_quantize import parse_block_size
        >>> parse_block_size("32"), parse_block_size("column")
        (32, 'column')
    """
    if text.strip().lower() == "column":
        return "column"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 2 or value % 2:
        msg = f"expected an even number of input rows >= 2, or 'column', got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def add_options(tr: argparse.ArgumentParser) -> None:
    """Adds ``--quantize`` and ``--quantize-block-size`` to the ``train`` parser.

    Args:
        tr: The ``train`` subcommand's parser.

    Examples:
        >>> import argparse
        >>> from artifex.cli_quantize import add_options
        >>> parser = argparse.ArgumentParser()
        >>> add_options(parser)
        >>> args = parser.parse_args(["--quantize", "nf4"])
        >>> args.quantize, args.quantize_block_size
        ('nf4', None)
    """
    group = tr.add_argument_group("quantized base (QLoRA)")
    group.add_argument(
        "--quantize",
        choices=("none", "int8", "int4", "nf4"),
        default="none",
        help="store the frozen base's projections as int8, int4 or NF4 and train LoRA "
        "adapters on top (needs --lora-rank; pip install 'artifex-grpo[quantize]'); the "
        "export is the dequantized base with the adapters merged (default: none)",
    )
    group.add_argument(
        "--quantize-block-size",
        type=parse_block_size,
        default=None,
        metavar="N",
        help=f"input rows per quantization scale, or 'column' for one scale per output "
        f"column (default {DEFAULT_BLOCK_SIZE})",
    )


def _quantizing(args: argparse.Namespace) -> bool:
    return getattr(args, "quantize", "none") not in (None, "none")


def check_options(args: argparse.Namespace) -> None:
    """Refuses quantization options that cannot work, before anything is loaded.

    Args:
        args: The parsed ``train`` arguments.

    Raises:
        ValueError: ``--quantize-block-size`` without ``--quantize``; ``--quantize`` without
            ``--lora-rank`` (a quantized base cannot be fine-tuned in full) or with
            ``--rollout-engine vllm`` (the engine is given full-precision weights).
        ImportError: ``--quantize`` without qwix installed (naming the extra).

    Examples:
        >>> import argparse
        >>> from artifex.cli_quantize import check_options
        >>> check_options(argparse.Namespace(quantize="none", quantize_block_size=None))
        >>> check_options(argparse.Namespace(quantize="nf4", quantize_block_size=None,
        ...                                  lora_rank=0))
        Traceback (most recent call last):
            ...
        ValueError: --quantize nf4 keeps the base frozen: it needs LoRA adapters (--lora-rank R)
    """
    if not _quantizing(args):
        if getattr(args, "quantize_block_size", None) is not None:
            msg = "--quantize-block-size applies to --quantize int8|int4|nf4 only"
            raise ValueError(msg)
        return
    if getattr(args, "lora_rank", 0) <= 0:
        msg = (
            f"--quantize {args.quantize} keeps the base frozen: it needs LoRA adapters "
            "(--lora-rank R)"
        )
        raise ValueError(msg)
    if getattr(args, "rollout_engine", "sampler") == "vllm":
        msg = (
            f"--quantize {args.quantize} runs with the library's sampler, not --rollout-engine vllm"
        )
        raise ValueError(msg)
    if importlib.util.find_spec("qwix") is None:
        msg = f"--quantize {args.quantize} needs qwix: pip install 'artifex-grpo[quantize]'"
        raise ImportError(msg)


def apply_defaults(args: argparse.Namespace) -> None:
    """With ``--quantize``, makes ``--scan-layers`` default to true (see the module docstring).

    Call it before ``GRPOConfig`` is built from the arguments. A ``--scan-layers`` given, or a
    ``--remat-every`` > 1 or ``--layerwise-update`` (which need unrolled layers), is kept.

    Args:
        args: The parsed ``train`` arguments (changed in place).

    Examples:
        >>> import argparse
        >>> from artifex.cli_quantize import apply_defaults
        >>> args = argparse.Namespace(quantize="nf4", quantize_block_size=None)
        >>> apply_defaults(args)
        >>> getattr(args, "GRPOConfig.scan_layers")
        True
    """
    if not _quantizing(args):
        return
    given = vars(args)
    unrolled = given.get("GRPOConfig.remat_every", 1) > 1 or given.get(
        "GRPOConfig.layerwise_update", False
    )
    if "GRPOConfig.scan_layers" not in given and not unrolled:
        setattr(args, "GRPOConfig.scan_layers", True)


def quantize_config(args: argparse.Namespace) -> Any:
    """The :class:`~artifex.generative_models.models.causal_lm.quantize.QuantizeConfig` asked for.

    Args:
        args: The parsed ``train`` arguments.

    Returns:
        The config, or ``None`` without ``--quantize``.

    Examples:
        >>> import argparse
        >>> from artifex.cli_quantize import quantize_config
        >>> quantize_config(argparse.Namespace(quantize="int4", quantize_block_size="column"))
        QuantizeConfig(qtype='int4', block_size=None, target_modules=(...))
    """
    if not _quantizing(args):
        return None
    from artifex.generative_models.models.causal_lm.quantize import QuantizeConfig

    block = getattr(args, "quantize_block_size", None)
    if block is None:
        block = DEFAULT_BLOCK_SIZE
    return QuantizeConfig(qtype=args.quantize, block_size=None if block == "column" else block)


def quantize_model(args: argparse.Namespace, model: Any) -> Any:
    """Quantizes the loaded policy's base as ``--quantize`` asks (in place; a no-op without).

    The sampler then scans the layers (``model.scan_layers = True``), unless the update runs
    them unrolled (``GRPOConfig.scan_layers`` false after :func:`apply_defaults`). In a
    mixture-of-experts model the attention projections are quantized; the experts' stacked
    weights stay in full precision (``quantize_base`` stores only ``Linear`` projections).

    Args:
        args: The parsed ``train`` arguments.
        model: The loaded ``CausalLM`` (before or after ``apply_lora``).

    Returns:
        The same model.

    Raises:
        ValueError: A projection whose input width is not a multiple of the block size.

    Examples:
        >>> import argparse
        >>> from flax import nnx
        >>> from artifex.cli_quantize import quantize_model
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> args = argparse.Namespace(quantize="nf4", quantize_block_size=None)
        >>> model = quantize_model(args, model)
        >>> model.layers[0].attn.q_proj.qtype
        'nf4'
    """
    config = quantize_config(args)
    if config is None:
        return model
    from artifex.generative_models.models.causal_lm.moe_dispatch import EXPERT_PROJECTIONS
    from artifex.generative_models.models.causal_lm.quantize import quantize_base

    if getattr(model.config, "is_moe", False):  # the experts' stacked weights: full precision
        attention = tuple(t for t in config.target_modules if t not in EXPERT_PROJECTIONS)
        config = dataclasses.replace(config, target_modules=attention)
    quantize_base(model, config)
    model.scan_layers = bool(getattr(args, "GRPOConfig.scan_layers", True))
    return model


def export_model(model: Any) -> Any:
    """The trained LoRA policy as one full-precision model: base dequantized, adapters merged.

    Args:
        model: The policy with adapters, its base quantized or not.

    Returns:
        A plain ``CausalLM`` for ``save_pretrained``.

    Examples:
        >>> import argparse
        >>> from flax import nnx
        >>> from artifex.cli_quantize import export_model, quantize_model
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, LoRAConfig, apply_lora)
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> model = quantize_model(argparse.Namespace(quantize="int8", quantize_block_size=None),
        ...                        model)
        >>> model = apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(1))
        >>> export_model(model).layers[0].attn.q_proj.kernel.shape
        (128, 128)
    """
    from artifex.generative_models.models.causal_lm.lora import merge_lora
    from artifex.generative_models.models.causal_lm.quantize import (
        dequantize_base,
        is_quantized,
    )

    return merge_lora(dequantize_base(model) if is_quantized(model) else model)


def fingerprint(args: argparse.Namespace) -> dict[str, Any]:
    """``{"quantize": {...}}`` for the run's fingerprint, or ``{}`` without ``--quantize``.

    A resumed run must quantize the same way; runs without ``--quantize`` keep the fingerprint
    they had, so they still resume.

    Args:
        args: The parsed ``train`` arguments.

    Returns:
        The entry to add to the fingerprint.

    Examples:
        >>> import argparse
        >>> from artifex.cli_quantize import fingerprint
        >>> fingerprint(argparse.Namespace(quantize="nf4", quantize_block_size=None))
        {'quantize': {'qtype': 'nf4', 'block_size': 64}}
        >>> fingerprint(argparse.Namespace(quantize="none", quantize_block_size=None))
        {}
    """
    config = quantize_config(args)
    if config is None:
        return {}
    return {"quantize": {"qtype": config.qtype, "block_size": config.block_size}}
