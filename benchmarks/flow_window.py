"""Flow-GRPO update time with and without an SDE window (MixGRPO / Flow-GRPO-Fast), one process.

    python benchmarks/flow_window.py [--steps 10] [--window 2] [--repeats 8] [--classes 10]
        [--generations 8] [--hidden 64] [--blocks 2]

Two trainers on the same model shape and batch size (the flow demo's DiT on 8x8 images,
``classes x generations`` trajectories of ``--steps`` denoising steps, exact KL to a reference):
"full" trains every step (each trajectory all SDE), "window" makes only ``--window`` consecutive
steps SDE steps and trains those (the rest are ODE steps the update does not evaluate). Each
repeat samples a batch and runs one update for each setting, alternating, after one warm-up
(compilation) of each; the medians are printed, with the sampling time of each setting.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.flow import (
    FlowDiT,
    FlowDiTConfig,
    FlowSampler,
    SDEConfig,
    flow_log_prob_fn,
    to_grpo_batch,
)
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.update.trainer import GRPOTrainer


def _setting(model_cfg: FlowDiTConfig, sde: SDEConfig, generations: int):
    model = FlowDiT(model_cfg, rngs=nnx.Rngs(0))
    grpo = GRPOConfig(
        num_generations=generations, beta=0.05, kl_estimator="exact", entropy_coeff=0.0
    )
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param),
        grpo,
        reference_model=nnx.clone(model),
        log_prob_fn=flow_log_prob_fn(sde),
    )
    return model, trainer, FlowSampler(sde)


def _once(setting, classes, generations, key) -> tuple[float, float]:
    model, trainer, sampler = setting
    t0 = time.perf_counter()
    traj = sampler(model, classes, generations, key)
    images = np.asarray(traj.images)  # waits for the sampler
    t1 = time.perf_counter()
    rewards = images.mean(axis=1)
    trainer.train_step(to_grpo_batch(traj, rewards, group_size=generations))  # host floats
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=2)
    args = parser.parse_args()
    model_cfg = FlowDiTConfig(hidden_dim=args.hidden, num_blocks=args.blocks, num_heads=4)
    settings = {
        "full": _setting(model_cfg, SDEConfig(num_steps=args.steps), args.generations),
        "window": _setting(
            model_cfg,
            SDEConfig(num_steps=args.steps, window_size=args.window),
            args.generations,
        ),
    }
    classes = np.arange(args.classes) % 10
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    key = jax.random.key(0)
    for repeat in range(args.repeats + 1):  # repeat 0 compiles
        for name, setting in settings.items():
            key, sub = jax.random.split(key)
            t = _once(setting, classes, args.generations, sub)
            if repeat:
                times[name].append(t)
    b = args.classes * args.generations
    print(
        f"B = {b} trajectories, S = {args.steps}, window W = {args.window}, DiT {args.hidden} "
        f"wide x {args.blocks} blocks, {args.repeats} alternating repeats, backend "
        f"{jax.default_backend()}"
    )
    print(f"{'setting':8} {'trained steps':>13} {'update s (median)':>18} {'sampling s':>11}")
    medians = {}
    for name, rows in times.items():
        k = args.steps if name == "full" else args.window
        upd = statistics.median(r[1] for r in rows)
        smp = statistics.median(r[0] for r in rows)
        medians[name] = upd
        print(f"{name:8} {k:>13} {upd:>18.3f} {smp:>11.3f}")
    print(f"update speed-up: {medians['full'] / medians['window']:.2f}x")


if __name__ == "__main__":
    main()
