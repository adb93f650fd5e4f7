"""Per-step host overhead of the training loop on library-built batches.

Runs ``rl.loop.train`` for ``--steps`` steps on the built-in addition task (the demo's tiny
model and character tokenizer, where host work weighs most), then times the compiled update
alone on a batch of the same shape. Per step:

    host overhead = step_time - rollout_time - (updates per step) x compiled update

``step_time`` and ``rollout_time`` are the loop's own metrics; the compiled update is the
jitted step called directly (median of ``--repeats`` calls, blocked). What remains is the host
work the loop does around the update for a batch it built itself: validation, copies to the
host, sharding, advantages, metrics.

It runs against this checkout, or against an older one to compare (the same command, with
``PYTHONPATH`` pointing at that checkout: its step is found as ``GRPOTrainer.compiled_step()``
or, before the functional train state, ``GRPOTrainer._step_fn``)::

    python benchmarks/host_overhead.py --steps 12
    git worktree add /tmp/before <commit> && PYTHONPATH=/tmp/before \\
        python benchmarks/host_overhead.py --steps 12

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import artifex
from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl.rewards import math_answer_reward
from artifex.generative_models.training.rl.rollouts.rollout import RolloutConfig, rollout
from artifex.generative_models.training.rl.run.loop import TrainConfig, train


def _slices(trainer: GRPOTrainer, batch) -> int:
    """The microbatches the loop's update runs in (the trainer's choice; 1 before there was one)."""
    choose = getattr(trainer, "auto_microbatches", None)
    return 1 if choose is None else choose(batch)


def compiled_update_seconds(trainer: GRPOTrainer, batch, repeats: int) -> float:
    """Median wall time of the compiled update alone on ``batch``.

    The compiled function is called on its own outputs (the state it returned), so no host
    work at all is timed: no validation, no model/optimizer bookkeeping.
    """
    if hasattr(trainer, "compiled_step"):  # the functional train state
        batch = trainer.place_batch(batch)
        step = trainer.compiled_step(_slices(trainer, batch))
        carry = [jax.tree.map(jnp.copy, trainer.state)]  # own buffers (the step donates)

        def call():
            carry[0], metrics = step(carry[0], batch)
            jax.block_until_ready(metrics)

    else:  # the trainer before it (model and optimizer states as arguments)
        # prepare_batch re-detects shared prompts; keep the caller's flag (shuffled
        # minibatches are not shared), so both versions time the same program.
        batch = trainer.prepare_batch(batch).replace(shared_prompts=batch.shared_prompts)
        ref = None if trainer.reference_model is None else nnx.state(trainer.reference_model)
        own = jax.tree.map(jnp.copy, (nnx.state(trainer.model), nnx.state(trainer.optimizer)))
        carry = list(own)  # own buffers (the step donates)

        def call():
            out = trainer._step_fn(carry[0], carry[1], ref, batch, 1)
            jax.block_until_ready(out[2])
            carry[0], carry[1] = out[0], out[1]

    call()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def direct_host_seconds(trainer: GRPOTrainer, batch, repeats: int) -> dict[str, float]:
    """The loop's per-batch training path minus the compiled update, timed interleaved.

    The loop's path for a batch it built: before the functional train state,
    ``trainer.train_step(batch)`` (host validation, then the update); after it, the batch's
    advantages and reward metrics once, then ``trainer.apply_prepared(batch)``. Each repetition
    times that path and the bare compiled update back to back, so drifts of the machine's
    speed hit both alike; the medians of both and of their differences are returned.
    """
    if hasattr(trainer, "apply_prepared"):
        from artifex.generative_models.training.rl import loop as loop_lib

        def path():
            b = trainer.place_batch(batch)
            b = b.replace(advantages=loop_lib._advantages(b, trainer.config))
            metrics = jax.device_get(loop_lib._batch_metrics(b))
            return trainer.apply_prepared(b), metrics

        placed = trainer.place_batch(batch)
        step = trainer.compiled_step(_slices(trainer, placed))
        carry = [jax.tree.map(jnp.copy, trainer.state)]  # own buffers: both paths donate

        def bare():
            carry[0], metrics = step(carry[0], placed)
            jax.block_until_ready(metrics)

    else:

        def path():
            return trainer.train_step(batch)

        prepared = trainer.prepare_batch(batch)
        ref = None if trainer.reference_model is None else nnx.state(trainer.reference_model)
        own = jax.tree.map(jnp.copy, (nnx.state(trainer.model), nnx.state(trainer.optimizer)))
        carry = list(own)  # own buffers: both paths donate

        def bare():
            out = trainer._step_fn(carry[0], carry[1], ref, prepared, 1)
            jax.block_until_ready(out[2])
            carry[0], carry[1] = out[0], out[1]

    path()
    bare()
    paths, bares = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        path()
        t1 = time.perf_counter()
        bare()
        t2 = time.perf_counter()
        paths.append(t1 - t0)
        bares.append(t2 - t1)
    diffs = [a - b for a, b in zip(paths, bares, strict=True)]
    return {
        "direct_path_median_s": statistics.median(paths),
        "direct_compiled_median_s": statistics.median(bares),
        "direct_host_median_s": statistics.median(diffs),
        "direct_host_q25_s": statistics.quantiles(diffs, n=4)[0],
        "direct_host_q75_s": statistics.quantiles(diffs, n=4)[2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=1, help="GRPO's mu")
    parser.add_argument("--minibatches", type=int, default=1, help="updates per pass")
    args = parser.parse_args()

    tok = demo_tokenizer()
    model, ref = demo_model(tok, seed=0), demo_model(tok, seed=1)
    config = GRPOConfig(num_generations=args.generations, beta=0.04)
    trainer = GRPOTrainer(
        model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), config, reference_model=ref
    )
    rows, _ = addition_dataset(seed=0, num_eval=8)
    reward = math_answer_reward(last_number_fallback=True)
    rcfg = RolloutConfig(max_new_tokens=args.max_new_tokens)
    loop = TrainConfig(
        num_steps=args.steps,
        prompts_per_step=args.prompts,
        num_iterations=args.iterations,
        num_minibatches=args.minibatches,
        progress=False,
    )
    result = train(trainer, tok, rows, [reward], loop, rcfg)
    # The first steps compile (sampler, step); the rest are steady state.
    steady = result.history[2:]
    train_side = [m["step_time"] - m["rollout_time"] for m in steady]
    # A batch of the loop's shape (same prompts as its first step, so the same prompt bucket).
    ro = rollout(
        trainer, tok, rows[: args.prompts], reward_combiner(reward), rcfg, key=jax.random.key(1)
    )
    updates = args.iterations * args.minibatches
    rows_per_update = ro.batch.batch_size // args.minibatches
    minibatch = jax.tree.map(lambda x: x[:rows_per_update], ro.batch)
    if args.minibatches > 1:  # shuffled minibatches cut through groups (as in the loop)
        minibatch = minibatch.replace(shared_prompts=False)
    update = compiled_update_seconds(trainer, minibatch, args.repeats)
    overhead = [t - updates * update for t in train_side]
    direct = {} if updates > 1 else direct_host_seconds(trainer, ro.batch, 3 * args.repeats)
    print(
        json.dumps(
            {
                "checkout": os.path.dirname(os.path.dirname(os.path.abspath(artifex.__file__))),
                "steps_measured": len(steady),
                "step_time_median_s": statistics.median(m["step_time"] for m in steady),
                "rollout_time_median_s": statistics.median(m["rollout_time"] for m in steady),
                "train_side_median_s": statistics.median(train_side),
                "compiled_update_median_s": update,
                "host_overhead_median_s": statistics.median(overhead),
                "host_overhead_min_s": min(overhead),
                "host_overhead_max_s": max(overhead),
                "host_overhead_fraction_of_step": statistics.median(overhead)
                / statistics.median(m["step_time"] for m in steady),
                **direct,
                "batch_rows": args.prompts * args.generations,
                "updates_per_step": updates,
                "jax": jax.__version__,
                "numpy": np.__version__,
            }
        )
    )


def reward_combiner(reward):
    from artifex.generative_models.training.rl.rewards import RewardCombiner

    return RewardCombiner([reward])


if __name__ == "__main__":
    main()
