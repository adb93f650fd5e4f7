"""Flow-GRPO on compositional prompts: held-out compositional accuracy before and after.

    python -m artifex.flow_shapes --out runs/shapes        # pretrain the model (minutes)
    python benchmarks/flow_compositional.py --task runs/shapes [--grpo-steps 150]
        [--window 2] [--learning-rate 3e-4] [--beta 0.01] [--out runs/shapes/grpo]

The text-conditioned DiT of ``artifex.flow_shapes`` (pretrained on the training captions of the
shapes grammar only) is trained with ``train_flow`` (the main loop) on the training captions
with the compositional reward (the fraction of GenEval-style checks passed: each object group
present, its count, the relation, nothing else). Before training and every ``--eval-every``
steps, every held-out caption is drawn ``--eval-images`` times with the ODE sampler from fixed
noise; the compositional accuracy is the fraction of those images that pass every check
(``eval/pass@1`` with threshold 1), printed with the mean reward. Results go to
``<out>/results.json``; the loop's logs (metrics, completions, image grids) to ``<out>/logs``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.flow import (
    FlowEvaluator,
    SDEConfig,
    compositional,
    compositional_correct,
    compositional_counts,
    draw_scene,
    flow_trainer,
    load_flow_model,
    save_flow_model,
    train_flow,
)
from artifex.generative_models.flow.detection import detect_shapes, scene_checks
from artifex.generative_models.flow.shapes import parse_caption
from artifex.generative_models.flow.text_encoder import ALL_BUT_TEXT_ENCODER
from artifex.generative_models.training.rl import GRPOConfig, TrainConfig

REWARDS = {
    "fraction": compositional,
    "correct": compositional_correct,
    "counts": compositional_counts,
}


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def check_rates(
    model, captions: list[str], images_per_prompt: int, seed: int = 0, num_steps: int = 10
) -> dict:
    """How often each check passes on ODE images of ``captions`` (the evaluation's noise).

    Args:
        model: A text-conditioned flow model of the shapes task.
        captions: Captions of the shapes grammar.
        images_per_prompt: ODE images per caption.
        seed: The noise seed (the loop's evaluation uses ``TrainConfig.seed``).
        num_steps: ODE steps.

    Returns:
        The pass rate of each check of ``scene_checks`` (``present_1``, ``count_1`` and
        ``relation`` over the two-group captions only), ``correct`` (the compositional
        accuracy), ``fraction`` (the mean fraction of checks passed: the evaluation's mean
        reward) and ``shapes_over`` (the mean number of shapes found beyond those asked for;
        negative: fewer).

    Raises:
        ValueError: A caption outside the grammar.
    """
    evaluator = FlowEvaluator(num_steps, images_per_prompt=images_per_prompt, seed=seed)
    images = evaluator.sample(model, None, captions)
    passed: dict[str, list[bool]] = {}
    over, fraction = [], []
    repeated = [c for c in captions for _ in range(images_per_prompt)]
    for image, caption in zip(images, repeated, strict=True):
        scene = parse_caption(caption)
        shapes = detect_shapes(image)
        checks = scene_checks(shapes, scene)
        for name, ok in checks.items():
            passed.setdefault(name, []).append(ok)
        passed.setdefault("correct", []).append(all(checks.values()))
        fraction.append(np.mean(list(checks.values())))
        over.append(len(shapes) - sum(g.count for g in scene.groups))
    rates = {name: float(np.mean(v)) for name, v in passed.items()}
    rates["fraction"] = float(np.mean(fraction))
    rates["shapes_over"] = float(np.mean(over))
    return rates


FLIP = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def relation_probe(model, captions: list[str], seed: int = 0, t_min: float = 0.8) -> dict:
    """Whether the model reads the relation: its loss with the true and the flipped relation.

    For each two-group caption, a scene is drawn and noised to ``t ~ U(t_min, 1)`` (where the
    layout is decided); the flow-matching loss of the model's velocity is taken with the
    caption and with its relation flipped ("left of" <-> "right of", "above" <-> "below").
    A model that reads the relation has a lower loss with the true one: ``gain`` =
    loss(flipped) - loss(true) > 0; a model that ignores it has ``gain`` 0.

    Args:
        model: A text-conditioned flow model (``model(x, t, tokens)``, ``model.config``
            with ``tokenizer()``).
        captions: Captions of the shapes grammar; the two-group ones are used.
        seed: Seeds the scenes, the noise and the times.
        t_min: The lowest time, in ``[0, 1)``.

    Returns:
        ``{"loss_true": ..., "loss_flipped": ..., "gain": ...}``.

    Raises:
        ValueError: No two-group caption, ``t_min`` outside ``[0, 1)``, or a caption outside
            the grammar.
    """
    if not 0.0 <= t_min < 1.0:
        msg = f"relation_probe: t_min must be in [0, 1), got {t_min}"
        raise ValueError(msg)
    rng = np.random.default_rng(seed)
    pairs = [c for c in captions if parse_caption(c).relation is not None]
    if not pairs:
        msg = "relation_probe: no caption with a relation among the captions given"
        raise ValueError(msg)
    flipped = [c.replace(parse_caption(c).relation, FLIP[parse_caption(c).relation]) for c in pairs]
    x0 = np.stack([draw_scene(parse_caption(c), rng).reshape(-1) for c in pairs])
    x1 = rng.standard_normal(x0.shape).astype(np.float32)
    t = rng.uniform(t_min, 1.0, size=len(pairs)).astype(np.float32)
    xt = jnp.asarray((1 - t[:, None]) * x0 + t[:, None] * x1)
    target = x1 - x0
    tok = model.config.tokenizer()
    losses = []
    for caps in (pairs, flipped):
        v = np.asarray(model(xt, jnp.asarray(t), jnp.asarray(tok.encode(caps))))
        losses.append(float(np.mean((v - target) ** 2)))
    return {"loss_true": losses[0], "loss_flipped": losses[1], "gain": losses[1] - losses[0]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, help="directory of python -m artifex.flow_shapes")
    parser.add_argument("--out", default=None, help="default: <task>/grpo")
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--sde-steps", type=int, default=10)
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--window", type=int, default=2, help="SDE window (0: every step)")
    parser.add_argument(
        "--window-start", type=int, default=None, help="fixed window start (default: random)"
    )
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--beta", type=float, default=0.01)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-images", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reward",
        choices=sorted(REWARDS),
        default="fraction",
        help="the training reward: the fraction of checks passed, 1 for an image that passes "
        "every check, or the fraction without the 'present' checks",
    )
    parser.add_argument(
        "--freeze-text-encoder",
        action="store_true",
        help="train everything but the text encoder (for a task pretrained with "
        "--text-pretrain-steps, whose encoder was kept frozen)",
    )
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.task, "grpo")

    model = load_flow_model(os.path.join(args.task, "model"))
    heldout = [row["prompt"] for row in _rows(os.path.join(args.task, "heldout.jsonl"))]
    sde = SDEConfig(
        num_steps=args.sde_steps,
        noise_level=args.noise_level,
        window_size=args.window or None,
    )
    grpo = GRPOConfig(
        num_generations=args.generations,
        beta=args.beta,
        kl_estimator="exact",
        entropy_coeff=0.0,
        max_grad_norm=1.0,
    )
    trained = ALL_BUT_TEXT_ENCODER if args.freeze_text_encoder else nnx.Param
    optimizer = nnx.Optimizer(model, optax.adam(args.learning_rate), wrt=trained)
    trainer = flow_trainer(model, optimizer, grpo, sde)
    loop = TrainConfig(
        num_steps=args.grpo_steps,
        prompts_per_step=args.prompts_per_step,
        eval_every=args.eval_every,
        seed=args.seed,
        log_dir=os.path.join(out, "logs"),
        checkpoint_dir=os.path.join(out, "checkpoints"),
        log_completions_every=args.eval_every,
        completions_to_print=0,
        progress=False,
    )
    # the settings are all checked above; the model is measured before it trains
    before = check_rates(model, heldout, args.eval_images, args.seed, args.sde_steps)
    probe_before = relation_probe(model, heldout, args.seed)
    t0 = time.perf_counter()
    result = train_flow(
        trainer,
        _rows(os.path.join(args.task, "train.jsonl")),
        REWARDS[args.reward],
        loop,
        sde,
        eval_dataset=_rows(os.path.join(args.task, "heldout.jsonl")),
        eval_images_per_prompt=args.eval_images,
        eval_reward=compositional,
        window_start=args.window_start,
    )
    seconds = time.perf_counter() - t0
    for step, m in result.evaluations:
        print(
            f"step {step:4d}: held-out compositional accuracy {m['eval/pass@1']:.3f}, "
            f"reward {m['eval/reward_mean']:.3f}",
            flush=True,
        )
    after = check_rates(model, heldout, args.eval_images, args.seed, args.sde_steps)
    probe_after = relation_probe(model, heldout, args.seed)
    print("held-out check pass rates (before -> after):")
    for name in before:
        print(f"  {name:12s} {before[name]:6.3f} -> {after[name]:6.3f}")
    print(
        "relation probe, loss(flipped) - loss(true) at t in [0.8, 1]: "
        f"{probe_before['gain']:.5f} -> {probe_after['gain']:.5f}"
    )
    steps = result.history
    summary = {
        "args": vars(args),
        "evaluations": [{"step": s, **m} for s, m in result.evaluations],
        "checks": {"before": before, "after": after},
        "relation_probe": {"before": probe_before, "after": probe_after},
        "train_reward": [h["reward_mean"] for h in steps],
        "kl": [h["kl"] for h in steps],
        "step_time": [h["step_time"] for h in steps],
        "seconds": seconds,
    }
    os.makedirs(out, exist_ok=True)
    save_flow_model(model, os.path.join(out, "model"))
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
    print(f"{len(steps)} GRPO steps in {seconds:.0f} s; wrote {out}/results.json and {out}/model")
    return summary


if __name__ == "__main__":
    main()
