"""The update with the log-prob chunk loop unrolled and as a loop, alternated in one process.

    python benchmarks/unrolled_chunks.py --dir DIR [--reps 15] [--remat [--remat-every N]]

``DIR`` is a workload directory (``benchmarks/hfdir.py``). Builds the trainer as
``benchmarks/profile_step.py`` does (the optimizer in the update's one program), samples one
batch, then compiles the update (``GRPOTrainer.compiled_step``, in the trainer's own number of
microbatches) twice: with ``chunked_token_log_probs`` unrolling a scan of at most
``_MAX_UNROLLED_CHUNKS`` chunks (the library's default) and with that limit set to 0 (always a
loop). It prints each program's compile time and temporaries, then runs the two in alternation
(``--reps`` pairs, the order flipped every pair, after two warm-up runs each) and prints the
median, fastest and slowest run of each and the median of the paired differences. Alternating
in one process keeps the machine's drift out of the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--remat", action="store_true", help="GRPOConfig(remat=True)")
    parser.add_argument("--remat-every", type=int, default=1, help="GRPOConfig.remat_every")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from artifex.generative_models.inference import generate
    from artifex.generative_models.training.rl import logprobs
    from benchmarks.common import toy_reward_batch, workload_trainer

    with open(os.path.join(args.dir, "workload.json")) as fh:
        w = json.load(fh)
    with open(os.path.join(args.dir, "prompts.json")) as fh:
        ids = jnp.asarray(np.asarray(json.load(fh)["ids"], np.int32))
    trainer = workload_trainer(
        args.dir, w, remat=args.remat, remat_every=args.remat_every, optimizer_by_layer=False
    )
    out = generate(
        trainer.model,
        ids,
        jnp.ones_like(ids),
        key=jax.random.key(0),
        num_generations=w["num_generations"],
        max_new_tokens=w["completion_length"],
        eos_ids=(),
    )
    prepared = trainer.prepare_batch(toy_reward_batch(out, w["num_generations"]))
    slices = trainer.auto_microbatches(prepared)
    default = logprobs._MAX_UNROLLED_CHUNKS
    variants = {"unrolled": default, "loop": 0}
    executables, info = {}, {}
    for name, limit in variants.items():
        logprobs._MAX_UNROLLED_CHUNKS = limit
        jax.clear_caches()  # traced and compiled again with the limit
        t0 = time.perf_counter()
        executables[name] = trainer.compiled_step(slices).lower(trainer.state, prepared).compile()
        info[name] = {
            "compile_s": time.perf_counter() - t0,
            "temp_bytes": int(executables[name].memory_analysis().temp_size_in_bytes),
        }
    logprobs._MAX_UNROLLED_CHUNKS = default
    parts = type(trainer.compiled_step(slices))._parts

    def run(name: str) -> float:
        dynamic, fixed = parts(trainer.state)
        t0 = time.perf_counter()
        (params, opt_state, count), metrics = executables[name](dynamic, fixed, prepared)
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - t0
        trainer.load_state(trainer.state.replace(params=params, opt_state=opt_state, step=count))
        return seconds

    for name in ("unrolled", "loop", "unrolled", "loop"):
        run(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.reps):
        for name in ("unrolled", "loop") if i % 2 == 0 else ("loop", "unrolled"):
            times[name].append(run(name))
    for name, t in times.items():
        info[name].update(median_s=statistics.median(t), min_s=min(t), max_s=max(t))
        print(
            f"{w['name']} chunk loop {name}: update median {info[name]['median_s']:.4f} s "
            f"({min(t):.4f}-{max(t):.4f}), compile {info[name]['compile_s']:.1f} s, "
            f"temporaries {info[name]['temp_bytes'] / 1e6:.0f} MB"
        )
    diff = statistics.median(u - v for u, v in zip(times["unrolled"], times["loop"], strict=True))
    print(
        f"paired difference (unrolled - loop): median {diff * 1e3:+.1f} ms "
        f"({100 * diff / info['loop']['median_s']:+.1f}% of the loop's median), "
        f"{slices} microbatches"
    )
    print("RESULT " + json.dumps({"workload": w["name"], "microbatches": slices, **info}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
