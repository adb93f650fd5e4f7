"""Matrix-product rates by dtype: float32, bfloat16 with a bfloat16 result, bfloat16 with float32.

    python benchmarks/matmul_dtypes.py [--repeats 9]

Prints GFLOP/s (median of ``--repeats`` timed calls after two warm-up calls) of one jitted
``jnp.matmul`` at a square shape, at W2's training shape (its 1,216 tokens through an MLP
projection) and at W2's decoding shape (16 rows through the 49,152-word output layer), for
three forms: float32 operands; bfloat16 operands with a bfloat16 result; bfloat16 operands with
a float32 result (``preferred_element_type=jnp.float32``), the form ``CausalLM`` uses for
16-bit models on the CPU. On CPUs with AMX, XLA:CPU runs only the last form on the matrix units.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "square 2048": (2048, 2048, 2048),
    "W2 MLP": (1216, 576, 1536),
    "W2 decode head": (16, 576, 49152),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from benchmarks.common import machine

    forms = {
        "float32": (jnp.float32, None),
        "bf16 -> bf16": (jnp.bfloat16, None),
        "bf16 -> f32": (jnp.bfloat16, jnp.float32),
    }
    print(machine())
    print(f"{'shape (M, K, N)':<32}" + "".join(f"{name:>16}" for name in forms) + "   GFLOP/s")
    for label, (m, k, n) in SHAPES.items():
        rates = []
        for dtype, result in forms.values():
            x = jax.random.normal(jax.random.key(0), (m, k), dtype)
            w = jax.random.normal(jax.random.key(1), (k, n), dtype)
            f = jax.jit(lambda x, w, r=result: jnp.matmul(x, w, preferred_element_type=r))
            for _ in range(2):
                jax.block_until_ready(f(x, w))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, w))
                times.append(time.perf_counter() - t0)
            rates.append(2 * m * k * n / statistics.median(times) / 1e9)
        print(f"{label + ' ' + str((m, k, n)):<32}" + "".join(f"{r:>16,.0f}" for r in rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
