"""Peak and current resident memory after each phase of a few GRPO steps, in one process.

Usage:
    python benchmarks/host_rss.py --dir W2_DIR [--steps 3] [--one-program-optimizer]
    MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/host_rss.py --dir W2_DIR   # glibc setting

Builds the trainer as the benchmark worker does (``benchmarks/common.workload_trainer``, every
second layer recomputed), starts compiling the update before the first rollout, then runs
``--steps`` steps (rollout, then ``train_step``) and prints, after each rollout and each update,
its wall time, the process's peak resident memory so far (``VmHWM``) and its current
resident memory (``VmRSS``), in GB. The glibc environment variables of the C allocator
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_ARENA_MAX``, ...) apply as set by the caller; the script
prints the ones it sees. Not a clean-window measurement: for the memory a step keeps, not for
speed claims (``benchmarks/honest.py`` and ``benchmarks/ours_worker.py`` are).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def peak_gb() -> float:
    """The process's peak resident memory so far (``VmHWM``, as the benchmark workers report)."""
    from benchmarks import cleanwin

    return cleanwin.peak_rss_bytes() / 1e9


def current_gb() -> float:
    """The process's current resident memory (``VmRSS``), or NaN where there is no /proc."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    """Runs the steps and prints one line per phase."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="workload directory (benchmarks/hfdir.py)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--remat-every", type=int, default=2)
    parser.add_argument(
        "--one-program-optimizer",
        action="store_true",
        help="GRPOConfig(optimizer_by_layer=False): the optimizer in the update's one program",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from artifex.generative_models.inference import bucket_length, generate
    from artifex.generative_models.training.rl import GRPOBatch
    from benchmarks.common import toy_reward_batch, workload_trainer

    malloc_env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(f"allocator environment: {malloc_env or 'none'}", flush=True)
    with open(os.path.join(args.dir, "workload.json")) as fh:
        w = json.load(fh)
    with open(os.path.join(args.dir, "prompts.json")) as fh:
        ids = jnp.asarray(np.asarray(json.load(fh)["ids"], np.int32))
    k, n = w["num_generations"], w["completion_length"]
    trainer = workload_trainer(
        args.dir,
        w,
        remat=True,
        remat_every=args.remat_every,
        optimizer_by_layer=not args.one_program_optimizer,
    )
    print(f"loaded: peak {peak_gb():.2f} GB, current {current_gb():.2f} GB", flush=True)
    trainer.compile_ahead(GRPOBatch.zeros(ids.shape[0], k, bucket_length(ids.shape[1]), n))
    for i in range(args.steps):
        t = time.perf_counter()
        out = generate(
            trainer.model,
            ids,
            jnp.ones_like(ids),
            key=jax.random.fold_in(jax.random.key(0), i),
            num_generations=k,
            max_new_tokens=n,
            eos_ids=(),
        )
        jax.block_until_ready(out.completion_ids)
        seconds = time.perf_counter() - t
        print(
            f"step {i} rollout {seconds:.2f} s: peak {peak_gb():.2f} GB, "
            f"current {current_gb():.2f} GB",
            flush=True,
        )
        batch = toy_reward_batch(out, k)
        t = time.perf_counter()
        metrics = trainer.train_step(batch)
        jax.block_until_ready((metrics, nnx.state(trainer.model)))
        seconds = time.perf_counter() - t
        print(
            f"step {i} update {seconds:.2f} s: peak {peak_gb():.2f} GB, "
            f"current {current_gb():.2f} GB",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
