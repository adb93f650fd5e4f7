"""The compositional shapes task: a text-conditioned flow model and its prompts, on disk.

:func:`prepare_shapes_task` pretrains a
:class:`~artifex.generative_models.flow.TextFlowDiT` with rectified flow matching on
the procedural captioned shapes (:mod:`~artifex.generative_models.flow.shapes`; 32x32,
drawn with NumPy, nothing downloaded) of the *training* captions only, and writes what a
Flow-GRPO run reads:

- ``<out>/model``: the flow model directory (``config.json`` + ``model.safetensors``), the
  ``--model`` of ``artifex-grpo train``;
- ``<out>/train.jsonl`` and ``<out>/heldout.jsonl``: ``{"prompt": caption}`` rows of the two
  caption splits (held-out captions never reach the pretraining or GRPO);
- ``<out>/pretrain.json``: the settings, the loss and the time.

Run it with ``python -m artifex.flow_shapes --out runs/shapes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
from flax import nnx

from artifex.generative_models.flow import (
    FlowTrainConfig,
    TextFlowDiT,
    TextFlowDiTConfig,
    make_shapes_dataset,
    save_flow_model,
    split_captions,
    train_flow_matching,
)
from artifex.generative_models.flow.text_encoder import (
    TextPretrainConfig,
    layout_accuracy,
    pretrain_text_encoder,
)
from artifex.generative_models.utils.atomic import atomic_write, atomic_write_json
from artifex.generative_models.utils.validation import check_choice, check_float, check_int

__all__ = ["ShapesTaskConfig", "main", "prepare_shapes_task"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShapesTaskConfig:
    """Settings of the shapes task's model and pretraining.

    Attributes:
        seed: Seeds the model, the images and the pretraining.
        held_out_fraction: Share of captions held out (never drawn for pretraining).
        num_images: Pretraining images (drawn from the training captions).
        hidden_dim: Width of the DiT.
        num_blocks: Its transformer blocks.
        num_heads: Attention heads.
        patch_size: Patch side (32x32 images).
        pretrain_steps: Flow-matching steps.
        batch_size: Images per step.
        learning_rate: Peak Adam learning rate.
        layout: ``"grid"`` or ``"free"``
            (:func:`~artifex.generative_models.flow.shapes.draw_scene`).
        text_layers: Transformer layers of the text encoder.
        time_shift: How far the pretraining times lean toward noise
            (:class:`~artifex.generative_models.flow.FlowTrainConfig`; 1: uniform).
        text_pretrain_steps: Steps of
            :func:`~artifex.generative_models.flow.text_encoder.pretrain_text_encoder` on the
            training captions before the flow pretraining, which then keeps the text encoder
            frozen; 0 (the default) trains the encoder with the flow loss from scratch
            (which leaves it reading captions as bags of words).

    Examples:
        >>> from artifex.flow_shapes import ShapesTaskConfig
        >>> ShapesTaskConfig().patch_size, ShapesTaskConfig(pretrain_steps=10).pretrain_steps
        (4, 10)
    """

    seed: int = 0
    held_out_fraction: float = 0.2
    num_images: int = 20000
    hidden_dim: int = 64
    num_blocks: int = 2
    num_heads: int = 4
    patch_size: int = 4
    pretrain_steps: int = 3000
    batch_size: int = 64
    learning_rate: float = 2e-3
    layout: str = "grid"
    text_layers: int = 1
    time_shift: float = 1.0
    text_pretrain_steps: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_images",
            "hidden_dim",
            "num_blocks",
            "num_heads",
            "patch_size",
            "text_layers",
        ):
            check_int(f"ShapesTaskConfig.{name}", getattr(self, name), minimum=1)
        for name in ("pretrain_steps", "batch_size"):
            check_int(f"ShapesTaskConfig.{name}", getattr(self, name), minimum=1)
        check_int("ShapesTaskConfig.seed", self.seed)
        check_int("ShapesTaskConfig.text_pretrain_steps", self.text_pretrain_steps, minimum=0)
        check_float(
            "ShapesTaskConfig.held_out_fraction",
            self.held_out_fraction,
            greater_than=0.0,
            less_than=1.0,
        )
        check_float("ShapesTaskConfig.learning_rate", self.learning_rate, greater_than=0.0)
        check_float("ShapesTaskConfig.time_shift", self.time_shift, greater_than=0.0)
        check_choice("ShapesTaskConfig.layout", self.layout, ("grid", "free"))

    def model_config(self) -> TextFlowDiTConfig:
        """The DiT's config (32x32 RGB, the shapes vocabulary).

        Returns:
            A :class:`~artifex.generative_models.flow.TextFlowDiTConfig`.
        """
        return TextFlowDiTConfig(
            hidden_dim=self.hidden_dim,
            num_blocks=self.num_blocks,
            num_heads=self.num_heads,
            patch_size=self.patch_size,
            text_layers=self.text_layers,
        )


def _write_rows(path: str, captions: list[str]) -> None:
    with atomic_write(path, "w") as fh:
        fh.write("".join(json.dumps({"prompt": c}) + "\n" for c in captions))


def prepare_shapes_task(
    out_dir: str, config: ShapesTaskConfig | None = None, *, verbose: bool = True
) -> dict[str, object]:
    """Pretrains the shapes model and writes it with the prompt splits to ``out_dir``.

    Args:
        out_dir: The task directory (created).
        config: Settings (``None``: ``ShapesTaskConfig()``).
        verbose: Print progress.

    Returns:
        What ``pretrain.json`` holds: the settings, ``loss_first``/``loss_last`` (means of
        the first and last 100 steps), ``seconds``, the numbers of captions and, with
        ``text_pretrain_steps``, the text encoder's last loss and exact share
        (``text_loss_last``, ``text_exact_last``: means of the last 50 steps) and
        ``text_layout_held_out`` (:func:`~artifex.generative_models.flow.text_encoder.
        layout_accuracy` fitted on the training captions, scored on the held-out ones).

    Raises:
        ValueError: ``text_pretrain_steps`` with a ``held_out_fraction`` that holds out no
            caption (checked before anything is drawn).

    Examples:
        Pretraining takes minutes; the test suite runs a few steps of it.

        >>> from artifex.flow_shapes import ShapesTaskConfig, prepare_shapes_task
        >>> summary = prepare_shapes_task("runs/shapes", ShapesTaskConfig())  # doctest: +SKIP
    """
    config = ShapesTaskConfig() if config is None else config
    log = print if verbose else (lambda *a, **k: None)
    t0 = time.perf_counter()
    train_captions, held_out = split_captions(config.held_out_fraction, seed=config.seed)
    if config.text_pretrain_steps and not held_out:
        msg = (
            f"ShapesTaskConfig.held_out_fraction {config.held_out_fraction} holds out no caption; "
            "the text encoder's layout probe (text_pretrain_steps) needs at least one"
        )
        raise ValueError(msg)
    images, captions = make_shapes_dataset(
        config.num_images, captions=train_captions, seed=config.seed, layout=config.layout
    )
    model = TextFlowDiT(config.model_config(), rngs=nnx.Rngs(config.seed))
    tokens = model.config.tokenizer().encode(captions)
    text = {}
    if config.text_pretrain_steps:
        log(
            f"pretraining the text encoder to name the layouts of the {len(train_captions)} "
            f"training captions, {config.text_pretrain_steps} steps"
        )
        history = pretrain_text_encoder(
            model,
            train_captions,
            TextPretrainConfig(num_steps=config.text_pretrain_steps, seed=config.seed),
        )
        text = {
            "text_loss_last": float(np.mean(history["loss"][-50:])),
            "text_exact_last": float(np.mean(history["exact"][-50:])),
            "text_layout_held_out": layout_accuracy(model, train_captions, held_out),
        }
        log(
            f"text encoder: loss {text['text_loss_last']:.4f}, layouts named "
            f"{text['text_layout_held_out']:.3f} of the held-out captions (a fresh readout)"
        )
    log(
        f"pretraining a text-conditioned DiT on {config.num_images} shapes images "
        f"({len(train_captions)} training captions, {len(held_out)} held out), "
        f"{config.pretrain_steps} steps"
    )
    losses = train_flow_matching(
        model,
        images,
        tokens,
        FlowTrainConfig(
            num_steps=config.pretrain_steps,
            batch_size=config.batch_size,
            learning_rate=config.learning_rate,
            seed=config.seed,
            time_shift=config.time_shift,
            freeze_text_encoder=config.text_pretrain_steps > 0,
        ),
    )
    seconds = time.perf_counter() - t0
    os.makedirs(out_dir, exist_ok=True)
    save_flow_model(model, os.path.join(out_dir, "model"))
    _write_rows(os.path.join(out_dir, "train.jsonl"), train_captions)
    _write_rows(os.path.join(out_dir, "heldout.jsonl"), held_out)
    summary = {
        "config": dataclasses.asdict(config),
        "loss_first": float(np.mean(losses[:100])),
        "loss_last": float(np.mean(losses[-100:])),
        **text,
        "seconds": seconds,
        "train_captions": len(train_captions),
        "held_out_captions": len(held_out),
    }
    atomic_write_json(os.path.join(out_dir, "pretrain.json"), summary, indent=2)
    log(
        f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} in {seconds:.0f} s; "
        f"wrote {out_dir}/model, train.jsonl, heldout.jsonl, pretrain.json"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m artifex.flow_shapes --out DIR [--pretrain-steps N ...]``.

    Args:
        argv: Arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.

    Raises:
        ValueError: A setting :class:`ShapesTaskConfig` refuses (before anything is drawn).

    Examples:
        Pretraining compiles and runs for minutes (``tests/test_flow_shapes.py`` runs a tiny
        one); the settings are checked first:

        >>> import tempfile
        >>> from artifex.flow_shapes import main
        >>> main(["--out", tempfile.mkdtemp(), "--layout", "ring"])
        Traceback (most recent call last):
            ...
        ValueError: ShapesTaskConfig.layout must be one of ('grid', 'free'), got 'ring'
        >>> main(["--out", tempfile.mkdtemp(), "--pretrain-steps", "0"])
        Traceback (most recent call last):
            ...
        ValueError: ShapesTaskConfig.pretrain_steps ...
    """
    parser = argparse.ArgumentParser(
        prog="python -m artifex.flow_shapes", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="task directory to write")
    for field in dataclasses.fields(ShapesTaskConfig):
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            type=type(field.default),
            default=field.default,
            help=f"default: {field.default}",
        )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ShapesTaskConfig)}
    prepare_shapes_task(args.out, ShapesTaskConfig(**values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
