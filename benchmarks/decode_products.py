"""W2's decoding products alone: 30 products of ``(M, 576) x (576, 1536)``, in JAX or PyTorch.

    python benchmarks/decode_products.py                                     # JAX (this project)
    /tmp/artifex-peers/trl/bin/python benchmarks/decode_products.py --torch  # PyTorch (TRL's)

A decoding step of SmolLM2-135M multiplies M = 16 rows (4 prompts x 4 generations) by every
weight matrix once. Each line prints the median time of the 30 products (one per decoder layer,
each with its own float32 weight, 106 MB in all, more than the CPU's caches hold next to the
rest of the model), the weight bytes read per second and the FLOP/s, for M = 1, 4, 16 and 64.
Compare with the fp32 matmul peak (``honest.py`` prints it): at M = 16 both libraries reach a
fraction of it, and a third of the weight bandwidth that M = 1 reaches.
"""

from __future__ import annotations

import argparse
import statistics
import time

LAYERS, K, N = 30, 576, 1536


def _median(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", action="store_true", help="PyTorch instead of JAX")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    weight_bytes = LAYERS * K * N * 4
    for m in (1, 4, 16, 64):
        if args.torch:
            import torch

            ws = [torch.full((K, N), 0.001 * i) for i in range(LAYERS)]
            h = torch.ones(m, K)

            def run(h=h, ws=ws):
                return float(sum((h @ w).sum() for w in ws))

            lib = f"torch {torch.__version__}"
        else:
            import os
            import sys

            import jax
            import jax.numpy as jnp

            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from artifex.generative_models.utils.compile_options import compiler_options

            ws = [jnp.full((K, N), 0.001 * i, jnp.float32) for i in range(LAYERS)]
            h = jnp.ones((m, K), jnp.float32)
            f = jax.jit(
                lambda h, ws: sum((h @ w).sum() for w in ws), compiler_options=compiler_options()
            )

            def run(h=h, ws=ws, f=f):
                return f(h, ws).block_until_ready()

            lib = f"jax {jax.__version__}"
        t = _median(run, args.repeats)
        print(
            f"{lib}: M={m:3d}: {1e3 * t:7.2f} ms, {weight_bytes / t / 1e9:5.1f} GB/s of weights, "
            f"{2 * m * LAYERS * K * N / t / 1e9:6.1f} GFLOP/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
