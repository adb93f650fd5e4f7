"""Flow-GRPO with and without an SDE window through the main loop: step time and reward.

    python benchmarks/flow_window_reward.py [--grpo-steps 40] [--window 2] [--seeds 0 1]
        [--window-grpo-steps N] [--sde-steps 10] [--eval-every 10] [--json FILE]

The flow demo's task (a class-conditioned DiT pretrained briefly on scikit-learn's 8x8 digits,
a digit classifier's confidence in the requested class as the reward), trained with
``train_flow`` (the main loop) from the same pretrained weights with every step an SDE step
("full") and with an SDE window of ``--window`` steps at a random position ("window": the other
steps are ODE steps the update does not evaluate; ``--window-grpo-steps`` runs it longer).
Each run: 10 class prompts x 8 images per step, Adam 3e-4, exact KL with beta 0.05;
evaluation every ``--eval-every`` steps on 16 ODE images per class from fixed noise. Printed
per setting and seed: the evaluation reward at each evaluation, the median step time and
update time (steps after the first, which compiles), and the GRPO wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.demos.flow import FlowDemoConfig, build_flow_model
from artifex.generative_models.flow import (
    DigitClassifier,
    FlowTrainConfig,
    SDEConfig,
    classifier_reward,
    flow_trainer,
    image_reward,
    load_digits_images,
    train_classifier,
    train_flow,
    train_flow_matching,
)
from artifex.generative_models.training.rl import GRPOConfig, TrainConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpo-steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument(
        "--window-grpo-steps", type=int, default=None, help="steps of the window runs"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--sde-steps", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    demo = FlowDemoConfig(out_dir=None)
    images, labels = load_digits_images()
    t0 = time.perf_counter()
    pretrained = build_flow_model(demo)
    train_flow_matching(
        pretrained,
        images,
        labels,
        FlowTrainConfig(num_steps=demo.pretrain_steps, learning_rate=demo.pretrain_learning_rate),
    )
    classifier = DigitClassifier(rngs=nnx.Rngs(1))
    accuracy = train_classifier(classifier, images, labels, num_steps=400, seed=1)
    print(f"pretrained in {time.perf_counter() - t0:.1f} s; classifier accuracy {accuracy:.3f}")
    # host copies: every run starts from them (a run's updates donate its own buffers)
    snapshot = jax.tree.map(np.asarray, nnx.state(pretrained))
    reward = image_reward(classifier_reward(classifier), name="classifier")
    rows = [{"prompt": c} for c in range(10)]
    results = []
    for name, window in (("full", None), ("window", args.window)):
        sde = SDEConfig(num_steps=args.sde_steps, noise_level=0.7, window_size=window)
        for seed in args.seeds:
            model = nnx.clone(pretrained)
            nnx.update(model, jax.tree.map(jnp.asarray, snapshot))
            optimizer = nnx.Optimizer(model, optax.adam(3e-4), wrt=nnx.Param)
            grpo = GRPOConfig(
                num_generations=8,
                beta=0.05,
                kl_estimator="exact",
                entropy_coeff=0.0,
                max_grad_norm=1.0,
            )
            trainer = flow_trainer(model, optimizer, grpo, sde)
            num_steps = args.grpo_steps
            if window is not None and args.window_grpo_steps is not None:
                num_steps = args.window_grpo_steps
            loop = TrainConfig(
                num_steps=num_steps,
                prompts_per_step=10,
                eval_every=args.eval_every,
                seed=seed,
                progress=False,
                handle_signals=False,
                compile_ahead=False,
            )
            t0 = time.perf_counter()
            result = train_flow(
                trainer, rows, reward, loop, sde, eval_dataset=rows, eval_images_per_prompt=16
            )
            wall = time.perf_counter() - t0
            steps = result.history[1:]
            entry = {
                "setting": name,
                "window_size": window,
                "seed": seed,
                "eval_reward": {s: m["eval/reward_mean"] for s, m in result.evaluations},
                "step_time_median": statistics.median(h["step_time"] for h in steps),
                "update_time_median": statistics.median(
                    h["step_time"] - h["rollout_time"] for h in steps
                ),
                "rollout_time_median": statistics.median(h["rollout_time"] for h in steps),
                "train_reward_last10": float(np.mean([h["reward_mean"] for h in steps[-10:]])),
                "grpo_seconds": wall,
            }
            results.append(entry)
            curve = " ".join(f"{s}:{r:.3f}" for s, r in entry["eval_reward"].items())
            print(
                f"{name:6s} seed {seed}: eval reward {curve}; "
                f"step {entry['step_time_median']:.3f} s "
                f"(update {entry['update_time_median']:.3f} s, rollout "
                f"{entry['rollout_time_median']:.3f} s); GRPO {wall:.0f} s",
                flush=True,
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
