"""Peak and current resident memory and page faults after each phase of a few GRPO steps.

Usage:
    python benchmarks/host_rss.py --dir W2_DIR [--steps 3] [--one-program-optimizer]
    python benchmarks/host_rss.py --dir W1_DIR --no-remat          # W1 as the benchmark runs it
    MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/host_rss.py --dir W2_DIR   # glibc setting
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/host_rss.py --dir W1_DIR --no-remat
    python benchmarks/host_rss.py --dir W1_DIR --no-remat --reuse-host-memory
    python benchmarks/host_rss.py --dir G3_DIR --no-remat --wait-compile --steps 1

Builds the trainer as the benchmark worker does (``benchmarks/common.workload_trainer``, every
second layer recomputed), starts compiling the update before the first rollout, then runs
``--steps`` steps (rollout, then ``train_step``) and prints, after each rollout and each update,
its wall time, the process's peak resident memory so far (``VmHWM``) and its current
resident memory (``VmRSS``), in GB, and the minor page faults the phase took (each one a page
the kernel mapped and zeroed; XLA:CPU maps an update's temporaries anew for every run). The
glibc settings of the C allocator (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_ARENA_MAX``,
``GLIBC_TUNABLES``, ...) apply as set by the caller; the script prints the ones it sees. Not a
clean-window measurement: for the memory a step keeps, not for speed claims
(``benchmarks/honest.py`` and ``benchmarks/ours_worker.py`` are).
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


def minor_faults() -> int:
    """The process's minor page faults so far (``/proc/self/stat``), or 0 where there is none."""
    try:
        with open("/proc/self/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the steps and prints one line per phase."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="workload directory (benchmarks/hfdir.py)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--remat-every", type=int, default=2)
    parser.add_argument(
        "--no-remat", action="store_true", help="keep every activation (W1's benchmark rows)"
    )
    parser.add_argument(
        "--one-program-optimizer",
        action="store_true",
        help="GRPOConfig(optimizer_by_layer=False): the optimizer in the update's one program",
    )
    parser.add_argument(
        "--reuse-host-memory",
        action="store_true",
        help="host_memory.reuse_host_memory() first (as artifex-grpo --reuse-host-memory)",
    )
    parser.add_argument(
        "--wait-compile",
        action="store_true",
        help="wait for the update's compilation before the first rollout, and print the peak "
        "it reached (the compiler's share of the peak, apart from the sampler's)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.reuse_host_memory:
        from artifex.generative_models.utils.host_memory import reuse_host_memory

        if not reuse_host_memory():
            parser.error("--reuse-host-memory: not applied here (see reuse_host_memory)")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from artifex.generative_models.inference import bucket_length, generate
    from artifex.generative_models.training.rl import GRPOBatch
    from benchmarks.common import toy_reward_batch, workload_trainer

    malloc_env = {
        k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"
    }
    print(f"allocator environment: {malloc_env or 'none'}", flush=True)
    with open(os.path.join(args.dir, "workload.json")) as fh:
        w = json.load(fh)
    with open(os.path.join(args.dir, "prompts.json")) as fh:
        ids = jnp.asarray(np.asarray(json.load(fh)["ids"], np.int32))
    k, n = w["num_generations"], w["completion_length"]
    trainer = workload_trainer(
        args.dir,
        w,
        dtype=w.get("dtype", "float32"),  # G3-1B's bfloat16, as the benchmark runs it
        remat=not args.no_remat,
        remat_every=1 if args.no_remat else args.remat_every,
        optimizer_by_layer=not args.one_program_optimizer,
    )
    print(f"loaded: peak {peak_gb():.2f} GB, current {current_gb():.2f} GB", flush=True)
    compiling = trainer.compile_ahead(
        GRPOBatch.zeros(ids.shape[0], k, bucket_length(ids.shape[1]), n)
    )
    if args.wait_compile:
        t = time.perf_counter()
        compiling.result()
        print(
            f"update compiled {time.perf_counter() - t:.2f} s: peak {peak_gb():.2f} GB, "
            f"current {current_gb():.2f} GB",
            flush=True,
        )
    for i in range(args.steps):
        t, faults = time.perf_counter(), minor_faults()
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
            f"current {current_gb():.2f} GB, {minor_faults() - faults} page faults",
            flush=True,
        )
        batch = toy_reward_batch(out, k)
        t, faults = time.perf_counter(), minor_faults()
        metrics = trainer.train_step(batch)
        jax.block_until_ready((metrics, nnx.state(trainer.model)))
        seconds = time.perf_counter() - t
        print(
            f"step {i} update {seconds:.2f} s: peak {peak_gb():.2f} GB, "
            f"current {current_gb():.2f} GB, {minor_faults() - faults} page faults",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
