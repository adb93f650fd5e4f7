"""Where one GRPO step spends FLOPs, bytes and memory: XLA's cost and memory analysis.

    python benchmarks/profile_step.py --dir DIR [--dtype bfloat16] [--remat [--remat-every N]]
        [--scan-update] [--stack-layers] [--unshared] [--trace OUT_DIR]

``DIR`` is a workload directory (``benchmarks/hfdir.py``). Builds the trainer as
``benchmarks/ours_worker.py`` does, runs one step, then prints, for the compiled update
(``GRPOTrainer.compiled_step(n)``, in the trainer's own ``n`` microbatches: reference
forward, policy forward + backward, AdamW),
XLA's FLOPs and
bytes accessed and the buffer sizes (arguments, outputs, temporaries, aliased = donated), next
to the bytes of the parameters, the AdamW moments and the reference, and the process's peak
resident memory. FLOPs and bytes are counted on the same update with the log-probs in one
piece (``benchmarks.common.update_cost``: XLA counts a loop body once). It also compiles the
update ahead of time and prints the compile time, the number of operations at the top level of
the optimized program (XLA:CPU orders them with a pairwise dependency check, so the compile
grows with their square) and the wall time of the first and second run of that freshly
compiled update (the first run also builds the matrix-product kernels' execution plans).
``--unshared`` compiles the update on the batch with ``shared_prompts=False`` as well (every
row's prompt encoded, G times the prompt tokens), for comparison. With
``--trace`` a ``jax.profiler`` trace of two more steps is written for TensorBoard / Perfetto.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import cleanwin


def _cpu_seconds() -> float:
    """User + system CPU time of this process so far (all its threads; clock-tick resolution)."""
    return cleanwin.snapshot()[2] / cleanwin.HZ


def _analysis(compiled) -> dict:
    mem = compiled.memory_analysis()
    return {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "generated_code_bytes": int(mem.generated_code_size_in_bytes),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--remat", action="store_true", help="GRPOConfig(remat=True)")
    parser.add_argument("--remat-every", type=int, default=1, help="GRPOConfig.remat_every")
    parser.add_argument("--scan-update", action="store_true", help="GRPOConfig(scan_layers=True)")
    parser.add_argument(
        "--stack-layers",
        action="store_true",
        help="CausalLM.stack_layers() on the policy and the reference",
    )
    parser.add_argument(
        "--unshared", action="store_true", help="also compile the update without shared prompts"
    )
    parser.add_argument("--trace", default="", help="write a jax.profiler trace here")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from artifex.generative_models.inference import generate
    from artifex.generative_models.training.rl.update.engines import _parts
    from benchmarks.common import (
        entry_operations,
        toy_reward_batch,
        update_cost,
        workload_trainer,
    )

    with open(os.path.join(args.dir, "workload.json")) as fh:
        w = json.load(fh)
    with open(os.path.join(args.dir, "prompts.json")) as fh:
        ids = jnp.asarray(np.asarray(json.load(fh)["ids"], np.int32))
    mask = jnp.ones_like(ids)
    k, n = w["num_generations"], w["completion_length"]
    trainer = workload_trainer(
        args.dir,
        w,
        dtype=args.dtype,
        remat=args.remat,
        remat_every=args.remat_every,
        scan_update=args.scan_update,
        stack_layers=args.stack_layers,
        optimizer_by_layer=False,  # one program, compiled and analyzed ahead of time here
    )
    policy, reference, optimizer = trainer.model, trainer.reference_model, trainer.optimizer
    rss_loaded = cleanwin.peak_rss_bytes()

    def nbytes(tree) -> int:
        return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))

    sizes = {
        "params_bytes": nbytes(nnx.state(policy, nnx.Param)),
        "optimizer_bytes": nbytes(nnx.state(optimizer)),
        "reference_bytes": nbytes(nnx.state(reference)),
    }
    keys = iter(jax.random.split(jax.random.key(0), 8))

    def step():
        out = generate(
            trainer.model,
            ids,
            mask,
            key=next(keys),
            num_generations=k,
            max_new_tokens=n,
            eos_ids=(),
        )
        batch = toy_reward_batch(out, k)
        jax.block_until_ready(trainer.train_step(batch))
        return batch

    batch = step()
    rss_step = cleanwin.peak_rss_bytes()
    # the batch as train_step runs it (prompts shared within groups, encoded once per group),
    # in the trainer's own number of microbatches (GRPOTrainer.auto_microbatches)
    prepared = trainer.prepare_batch(batch)
    slices = trainer.auto_microbatches(prepared)
    if args.trace:
        with jax.profiler.trace(args.trace):
            step()
            step()
    compiles, executables = {}, {}
    for name, shared in (
        (("shared", True), ("unshared", False)) if args.unshared else (("shared", True),)
    ):
        jax.clear_caches()  # compiled again: neither the jit cache nor an earlier compile
        t0, c0 = time.perf_counter(), _cpu_seconds()
        like = prepared.replace(shared_prompts=shared)
        compiled = (
            trainer.compiled_step(trainer.auto_microbatches(like))
            .lower(trainer.state, like)
            .compile()
        )
        executables[name] = compiled
        compiles[name] = {
            "compile_s": time.perf_counter() - t0,
            "compile_cpu_s": _cpu_seconds() - c0,  # all threads of the process
            "entry_operations": entry_operations(compiled),
            "optimized_hlo_chars": len(compiled.as_text()),
        }
    # memory analysis of the update as it runs; FLOPs and bytes of it with unchunked log-probs
    update = _analysis(executables["shared"])
    update.update(update_cost(trainer, batch, remat=trainer.config.remat_option))
    # The first and second run of the freshly compiled (shared-prompt) update; it donates the
    # state, which is handed back to the trainer after each run.
    runs, run_cpu = [], []
    for _ in range(2):
        dynamic, fixed = _parts(trainer.state)
        t0, c0 = time.perf_counter(), _cpu_seconds()
        (params, opt_state, count), metrics = executables["shared"](dynamic, fixed, prepared)
        jax.block_until_ready(metrics)
        runs.append(time.perf_counter() - t0)
        run_cpu.append(_cpu_seconds() - c0)
        trainer.load_state(trainer.state.replace(params=params, opt_state=opt_state, step=count))
    update.update(
        compiles["shared"],
        first_run_s=runs[0],
        second_run_s=runs[1],
        first_run_cpu_s=run_cpu[0],
        second_run_cpu_s=run_cpu[1],
    )
    result = {
        "workload": w["name"],
        "dtype": args.dtype,
        "device": jax.devices()[0].device_kind,
        **sizes,
        "update": update,
        "microbatches": slices,
        "compiles": compiles,
        "peak_rss_after_load_bytes": rss_loaded,
        "peak_rss_after_first_step_bytes": rss_step,
    }
    gb = 1e9
    u = {key: v / gb for key, v in update.items() if key.endswith("bytes")}
    print(
        f"{w['name']} ({args.dtype}, {result['device']}): "
        f"params {sizes['params_bytes'] / gb:.2f} GB, AdamW {sizes['optimizer_bytes'] / gb:.2f} GB,"
        f" reference {sizes['reference_bytes'] / gb:.2f} GB; update ({slices} microbatches): "
        f"{update['flops'] / 1e9:.1f} GFLOP, {update['bytes_accessed'] / gb:.2f} GB accessed, "
        f"args {u['argument_bytes']:.2f} GB, outputs {u['output_bytes']:.2f} GB (aliased "
        f"{u['alias_bytes']:.2f} GB), temporaries {u['temp_bytes']:.2f} GB; peak RSS after load "
        f"{rss_loaded / gb:.2f} GB, after the first step {rss_step / gb:.2f} GB; "
        + "; ".join(
            f"compiling the update ({name} prompts) {c['compile_s']:.1f} s "
            f"({c['compile_cpu_s']:.1f} s of CPU), "
            f"{c['entry_operations']} top-level operations, "
            f"{c['optimized_hlo_chars'] / 1e6:.1f} M characters of optimized HLO"
            for name, c in compiles.items()
        )
        + f"; first run of the compiled update {runs[0]:.2f} s ({run_cpu[0]:.1f} s of CPU), "
        f"second {runs[1]:.2f} s ({run_cpu[1]:.1f} s of CPU)",
        flush=True,
    )
    cleanwin.emit("PROFILE", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
