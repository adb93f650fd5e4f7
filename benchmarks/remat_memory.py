"""Memory and FLOPs of W2's compiled update with and without ``GRPOConfig.remat``.

    python benchmarks/remat_memory.py [--layers 30] [--dtype float32]

Compiles (does not run) ``GRPOTrainer.compiled_step()`` -- reference forward, policy forward and
backward, AdamW -- as ``benchmarks/profile_step.py`` measures it, for a random-weight policy of
SmolLM2-135M's shape (W2 of ``benchmarks/hfdir.py``: Llama, vocab 49152, width 576, 30 layers,
9 query / 3 kv heads of 64, MLP 1536, tied embeddings) and W2's batch: 4 prompts x 4
generations = 16 rows, prompts of 48 tokens (left-padded, shared within each group, so the
prompt is encoded once into a KV cache), completions of 64, beta 0.04 with a reference model.
Prints, for ``remat=False`` and ``remat=True``, XLA's ``memory_analysis()`` (temporaries,
arguments, outputs, aliased) and ``cost_analysis()`` FLOPs, and the compile times.

Each variant is compiled in its own process: on the CPU, compiling the 30-layer update takes
about 4 minutes and up to ~10 GB of host memory, and a second compilation in the same process
needs more. ``--layers`` compiles a shallower model of the same width.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_TAG = "REMAT_MEMORY "


def _compile_one(layers: int, dtype: str, remat: bool) -> dict:
    """Builds the trainer and compiles its update; returns XLA's memory and cost analysis."""
    import jax
    import optax
    from flax import nnx

    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
    from artifex.generative_models.training import GRPOConfig, GRPOTrainer
    from benchmarks.hfdir import WORKLOADS
    from benchmarks.workloads import Workload, frozen_copy, random_batch

    spec = WORKLOADS["w2"]
    w = Workload(
        name="W2",
        model=CausalLMConfig(**{**spec["model"], "num_layers": layers}, param_dtype=dtype),
        num_prompts=spec["num_prompts"],
        num_generations=spec["num_generations"],
        prompt_length=spec["prompt_length"],
        completion_length=spec["completion_length"],
        beta=spec["beta"],
    )
    policy = CausalLM(w.model, rngs=nnx.Rngs(spec["seed"]))
    reference = frozen_copy(policy)
    optimizer = nnx.Optimizer(policy, optax.adamw(spec["learning_rate"]), wrt=nnx.Param)
    config = GRPOConfig(
        num_generations=w.num_generations, beta=w.beta, remat=remat, optimizer_by_layer=False
    )
    trainer = GRPOTrainer(policy, optimizer, config, reference_model=reference)
    batch = trainer.prepare_batch(random_batch(w, seed=spec["seed"]))  # one prefill per group
    start = time.perf_counter()
    compiled = trainer.compiled_step().lower(trainer.state, batch).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return {
        "workload": (
            f"{w.batch_size} rows x ({w.prompt_length} + {w.completion_length}) tokens, "
            f"group {w.num_generations}, beta {w.beta} with a reference"
        ),
        "device": jax.devices()[0].device_kind,
        "shared_prompts": bool(batch.shared_prompts),
        "temp": int(mem.temp_size_in_bytes),
        "argument": int(mem.argument_size_in_bytes),
        "output": int(mem.output_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
        "flops": float(cost.get("flops", float("nan"))),
        "compile_s": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (W2 has 30)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--variant", choices=("off", "on"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant is not None:  # the child process: compile one variant
        result = _compile_one(args.layers, args.dtype, args.variant == "on")
        print(_TAG + json.dumps(result), flush=True)
        return 0

    gb = 1e9
    results = {}
    for variant in ("off", "on"):
        command = [sys.executable, os.path.abspath(__file__), "--variant", variant]
        command += ["--layers", str(args.layers), "--dtype", args.dtype]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith(_TAG)]
        if done.returncode != 0 or not lines:
            print(done.stdout + done.stderr[-4000:], file=sys.stderr)
            print(f"compiling remat={variant} failed (exit {done.returncode})", file=sys.stderr)
            return 1
        r = results[variant] = json.loads(lines[-1][len(_TAG) :])
        if variant == "off":
            shape = f"{args.layers} layers" + ("" if args.layers == 30 else " (W2 has 30)")
            print(f"W2 shape, {shape}, {args.dtype}, {r['workload']}; device {r['device']}")
        print(
            f"remat={variant == 'on'!s:5}: temporaries {r['temp'] / gb:.3f} GB, arguments "
            f"{r['argument'] / gb:.3f} GB, outputs {r['output'] / gb:.3f} GB (aliased "
            f"{r['alias'] / gb:.3f} GB), {r['flops'] / 1e9:.1f} GFLOP (XLA cost analysis); "
            f"shared prompts {r['shared_prompts']}; compiled in {r['compile_s']:.0f} s",
            flush=True,
        )
    off, on = results["off"], results["on"]
    print(
        f"remat: temporaries x{on['temp'] / off['temp']:.3f} "
        f"({(off['temp'] - on['temp']) / gb:.3f} GB less), FLOPs x{on['flops'] / off['flops']:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
