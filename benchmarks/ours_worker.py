"""Our GRPO step on a workload directory (``benchmarks/hfdir.py``), in its own process.

    python benchmarks/ours_worker.py --dir DIR [--windows 5] [--max-retries 10] [--dtype bfloat16]
        [--remat [--remat-every N]] [--scan-update] [--layerwise-update] [--layers scan]
        [--stack-layers]
        [--microbatches N] [--no-compile-ahead]

Loads the policy and the reference with ``CausalLM.from_pretrained(DIR)``, reads the prompt ids
from ``DIR/prompts.json`` and the settings from ``DIR/workload.json``. One step = generate
``num_generations`` completions per prompt (no early stop), score them with the toy reward on the
host (fraction of even ids), one ``GRPOTrainer.train_step`` (reference forward, AdamW). The first
step (compilation included) is timed alone, from the ``GRPOTrainer.compile_ahead`` call that
compiles the update during the first rollout (``--no-compile-ahead``: after it); then steps are
timed as windows until enough are clean (``benchmarks/cleanwin.py``). Prints ``RESULT {json}``
last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import cleanwin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--max-retries", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.05)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--flops", action="store_true", help="XLA cost analysis of the update")
    parser.add_argument(
        "--layers", choices=("scan", "unroll"), default="unroll", help="CausalLM.scan_layers"
    )
    parser.add_argument(
        "--remat",
        action="store_true",
        help="GRPOConfig(remat=True): recompute each layer in the backward pass (as TRL's "
        "default gradient checkpointing)",
    )
    parser.add_argument(
        "--remat-every",
        type=int,
        default=1,
        help="with --remat, GRPOConfig(remat_every=N): recompute every N-th layer only",
    )
    parser.add_argument(
        "--scan-update",
        action="store_true",
        help="GRPOConfig(scan_layers=True): the update scans the decoder layers (the sampler "
        "follows --layers)",
    )
    parser.add_argument(
        "--layerwise-update",
        action="store_true",
        help="GRPOConfig(layerwise_update=True): the update as per-layer programs (needs --remat)",
    )
    parser.add_argument(
        "--one-program-optimizer",
        action="store_true",
        help="GRPOConfig(optimizer_by_layer=False): clipping, AdamW and the guard in the "
        "update's one program",
    )
    parser.add_argument(
        "--stack-layers",
        action="store_true",
        help="CausalLM.stack_layers() on the policy and the reference: the decoder layers "
        "stored stacked (one array per weight kind), read by a scan without a copy",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="train_step(num_microbatches=N): accumulate the gradient over N row slices of the "
        "batch (still one update); default: the trainer's choice (auto_microbatches: on the "
        "CPU, slices of at least 512 token positions)",
    )
    parser.add_argument(
        "--row-groups",
        type=int,
        default=None,
        help="generate(row_groups=N): decode the prompts as N groups at the same time on host "
        "threads; default: the sampler's choice (auto_row_groups: on the CPU, for small "
        "models, one group per core)",
    )
    parser.add_argument(
        "--no-compile-ahead",
        dest="compile_ahead",
        action="store_false",
        help="compile the update after the first rollout instead of during it",
    )
    parser.add_argument(
        "--compilation-cache", default="none", help="JAX persistent cache dir ('none': off)"
    )
    parser.add_argument(
        "--reuse-host-memory",
        action="store_true",
        help="host_memory.reuse_host_memory() first, as artifex-grpo --reuse-host-memory "
        "does: XLA:CPU's temporaries reuse their memory from run to run",
    )
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    if args.reuse_host_memory:
        from artifex.generative_models.utils.host_memory import reuse_host_memory

        if not reuse_host_memory():
            parser.error("--reuse-host-memory: not applied here (see reuse_host_memory)")
    from artifex.cli import enable_compilation_cache

    enable_compilation_cache(args.compilation_cache)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from artifex.generative_models.inference import auto_row_groups, bucket_length, generate
    from artifex.generative_models.training.rl import GRPOBatch
    from benchmarks.common import toy_reward_batch, workload_trainer

    with open(os.path.join(args.dir, "workload.json")) as fh:
        w = json.load(fh)
    with open(os.path.join(args.dir, "prompts.json")) as fh:
        prompt_ids = jnp.asarray(np.asarray(json.load(fh)["ids"], np.int32))
    prompt_mask = jnp.ones_like(prompt_ids)
    k, n = w["num_generations"], w["completion_length"]

    trainer = workload_trainer(
        args.dir,
        w,
        dtype=args.dtype,
        remat=args.remat,
        remat_every=args.remat_every,
        scan_update=args.scan_update,
        layerwise_update=args.layerwise_update,
        optimizer_by_layer=not args.one_program_optimizer,
        stack_layers=args.stack_layers,
        scan_layers=args.layers == "scan",
    )
    policy = trainer.model
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))
    load_s = time.perf_counter() - t_start
    # One key per step, as the training loop derives them (iterating over an array of split
    # keys would compile slicing programs inside the first step).
    root_key = jax.random.key(0)
    step_index = itertools.count()
    last: dict = {}

    def step() -> dict[str, float]:
        t0 = time.perf_counter()
        out = generate(
            trainer.model,
            prompt_ids,
            prompt_mask,
            key=jax.random.fold_in(root_key, next(step_index)),
            num_generations=k,
            max_new_tokens=n,
            eos_ids=(),  # no early stop: every completion is n tokens
            row_groups=args.row_groups,
        )
        comp = np.asarray(jax.device_get(out.completion_ids))
        t1 = time.perf_counter()
        batch = toy_reward_batch(out, k)  # rewards on the host, then device_put
        t2 = time.perf_counter()
        metrics = trainer.train_step(batch, num_microbatches=args.microbatches)
        jax.block_until_ready((metrics, nnx.state(trainer.model)))
        t3 = time.perf_counter()
        last["batch"] = batch
        if comp.shape != (prompt_ids.shape[0] * k, n):
            msg = f"completions: expected {(prompt_ids.shape[0] * k, n)}, got {comp.shape}"
            raise ValueError(msg)
        return {"generation_s": t1 - t0, "host_s": t2 - t1, "training_s": t3 - t2}

    t0 = time.perf_counter()
    if args.compile_ahead:
        # The update compiles in the background while the sampler compiles and generates. The
        # example has the sampler's layout: each prompt repeated k times, padded to its bucket.
        width = bucket_length(prompt_ids.shape[1])
        trainer.compile_ahead(
            GRPOBatch.zeros(prompt_ids.shape[0], k, width, n), num_microbatches=args.microbatches
        )
    first_split = step()
    first_step_s = time.perf_counter() - t0
    if trainer.num_compilations != 1:
        msg = f"the update compiled {trainer.num_compilations} times in the first step"
        raise RuntimeError(msg)

    win = cleanwin.Windows(args.windows, args.max_retries, args.threshold)
    while not win.done():
        win.begin()
        split = step()
        win.end(**split)

    peak_rss = cleanwin.peak_rss_bytes()  # before the cost analysis below compiles again
    # On an accelerator, the device allocator's peak (None on the CPU, where RSS holds it all)
    device_peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    flops = None
    if args.flops:
        from benchmarks.common import update_cost

        flops = update_cost(trainer, last["batch"], remat=trainer.config.remat_option)["flops"]

    summary = win.summary(("generation_s", "host_s", "training_s"))
    result = {
        "system": "ours",
        "versions": {"jax": jax.__version__},
        "device": str(jax.devices()[0].device_kind),
        "dtype": args.dtype,
        "layers": args.layers,
        "remat": args.remat,
        "remat_every": args.remat_every,
        "scan_update": args.scan_update,
        "layerwise_update": args.layerwise_update,
        "optimizer_by_layer": not args.one_program_optimizer,
        "stack_layers": args.stack_layers,
        "compile_ahead": args.compile_ahead,
        "reuse_host_memory": args.reuse_host_memory,
        "microbatches": (
            args.microbatches
            if args.microbatches is not None
            else trainer.auto_microbatches(trainer.prepare_batch(last["batch"]))
        ),
        "microbatches_auto": args.microbatches is None,
        "row_groups": (
            args.row_groups
            if args.row_groups is not None
            else auto_row_groups(policy, int(prompt_ids.shape[0]))
        ),
        "params": int(n_params),
        "load_s": load_s,
        "first_step_s": first_step_s,
        "first_step_split": first_split,
        "train_flops": flops,
        "peak_rss_bytes": peak_rss,
        "device_peak_bytes": device_peak,
        "generated_tokens": int(prompt_ids.shape[0] * k * n),
        **summary,
    }
    cleanwin.emit("RESULT", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
