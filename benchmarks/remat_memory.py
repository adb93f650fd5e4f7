"""Memory and FLOPs of W2's compiled update with and without ``GRPOConfig.remat``.

    python benchmarks/remat_memory.py [--layers 30] [--dtype float32]

Compiles (does not run) ``GRPOTrainer.compiled_step()`` -- reference forward, policy forward and
backward, AdamW -- as ``benchmarks/profile_step.py`` measures it, for a random-weight policy of
SmolLM2-135M's shape (W2 of ``benchmarks/hfdir.py``: Llama, vocab 49152, width 576, 30 layers,
9 query / 3 kv heads of 64, MLP 1536, tied embeddings) and W2's batch: 4 prompts x 4
generations = 16 rows, prompts of 48 tokens (left-padded, shared within each group, so the
prompt is encoded once into a KV cache), completions of 64, beta 0.04 with a reference model.
Prints, for ``remat=False`` and ``remat=True``, XLA's ``memory_analysis()`` (temporaries,
arguments, outputs, aliased) and ``cost_analysis()`` FLOPs, and the compile times. ``--layers``
compiles a shallower model of the same width when compiling 30 layers takes too long.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (W2 has 30)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)

    import jax
    import optax
    from flax import nnx

    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
    from artifex.generative_models.training import GRPOConfig, GRPOTrainer
    from benchmarks.hfdir import WORKLOADS
    from benchmarks.workloads import Workload, frozen_copy, random_batch

    spec = WORKLOADS["w2"]
    model_spec = {**spec["model"], "num_layers": args.layers}
    w = Workload(
        name="W2",
        model=CausalLMConfig(**model_spec, param_dtype=args.dtype),
        num_prompts=spec["num_prompts"],
        num_generations=spec["num_generations"],
        prompt_length=spec["prompt_length"],
        completion_length=spec["completion_length"],
        beta=spec["beta"],
    )
    policy = CausalLM(w.model, rngs=nnx.Rngs(spec["seed"]))
    reference = frozen_copy(policy)
    optimizer = nnx.Optimizer(policy, optax.adamw(spec["learning_rate"]), wrt=nnx.Param)
    batch = random_batch(w, seed=spec["seed"])
    shape = f"{args.layers} layers" + ("" if args.layers == 30 else " (W2 has 30)")
    print(
        f"W2 shape, {shape}, {args.dtype}, {w.batch_size} rows x "
        f"({w.prompt_length} + {w.completion_length}) tokens, group {w.num_generations}, "
        f"beta {w.beta} with a reference; device {jax.devices()[0].device_kind}",
        flush=True,
    )
    gb = 1e9
    results = {}
    for remat in (False, True):
        config = GRPOConfig(num_generations=w.num_generations, beta=w.beta, remat=remat)
        trainer = GRPOTrainer(policy, optimizer, config, reference_model=reference)
        prepared = trainer.prepare_batch(batch)  # shared_prompts=True: one prefill per group
        start = time.perf_counter()
        compiled = trainer.compiled_step().lower(trainer.state, prepared).compile()
        seconds = time.perf_counter() - start
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        results[remat] = r = {
            "temp": mem.temp_size_in_bytes,
            "argument": mem.argument_size_in_bytes,
            "output": mem.output_size_in_bytes,
            "alias": mem.alias_size_in_bytes,
            "flops": float(cost.get("flops", float("nan"))),
        }
        print(
            f"remat={remat!s:5}: temporaries {r['temp'] / gb:.3f} GB, arguments "
            f"{r['argument'] / gb:.3f} GB, outputs {r['output'] / gb:.3f} GB (aliased "
            f"{r['alias'] / gb:.3f} GB), {r['flops'] / 1e9:.1f} GFLOP (XLA cost analysis); "
            f"shared prompts {prepared.shared_prompts}; compiled in {seconds:.0f} s",
            flush=True,
        )
        # Free the first program and JAX's caches: compiling 30 layers takes several GB, and a
        # second compilation under memory pressure took four times as long.
        del compiled, trainer
        gc.collect()
        jax.clear_caches()
    off, on = results[False], results[True]
    print(
        f"remat: temporaries x{on['temp'] / off['temp']:.3f} "
        f"({(off['temp'] - on['temp']) / gb:.3f} GB less), FLOPs x{on['flops'] / off['flops']:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
