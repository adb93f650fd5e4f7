"""The update's non-finite check on one large array: reduced to rows first, or in one piece.

    python benchmarks/finite_check.py [--repeats 9]

The train step applies an update only when the new parameters and AdamW moments are finite
(``artifex.generative_models.training.rl.update.state._finite_flags``; the new values are computed
inside the check, fused into its reduction). Arrays of at least ``_ROWS_FIRST`` elements are
reduced to their rows first, then to a scalar; smaller ones in one reduction. This prints the
median time (after two warm-up calls) of the check on a parameter with its AdamW update, at
W2's embedding shape (49,152 x 576) and at a stacked MLP weight of W2 (30 x 576 x 1,536), both
ways: ``rows first`` (the library's) and ``one piece`` (the threshold set above the size).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"W2 embedding": (49152, 576), "W2 stacked MLP weight": (30, 576, 1536)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)

    import jax
    import optax

    from artifex.generative_models.training.rl import state as state_module
    from benchmarks.common import machine

    tx = optax.adamw(1e-3)
    print(f"machine: {machine()}")
    for label, shape in SHAPES.items():
        keys = jax.random.split(jax.random.key(0), 2)
        params = {"w": jax.random.normal(keys[0], shape)}
        grads = {"w": jax.random.normal(keys[1], shape)}
        opt_state = tx.init(params)

        times = {}
        for form, threshold in (("rows first", state_module._ROWS_FIRST), ("one piece", 1 << 62)):

            def check(params, grads, opt_state):  # a new function per form: traced anew
                updates, new_opt = tx.update(grads, opt_state, params)
                return state_module._finite_flags(optax.apply_updates(params, updates), new_opt)

            saved = state_module._ROWS_FIRST
            state_module._ROWS_FIRST = threshold
            try:
                fn = jax.jit(check)  # traced by the first call below, with this threshold
                for _ in range(2):
                    jax.block_until_ready(fn(params, grads, opt_state))
            finally:
                state_module._ROWS_FIRST = saved
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                flags = jax.block_until_ready(fn(params, grads, opt_state))
                runs.append(time.perf_counter() - t0)
            if not all(bool(f) for f in flags):
                raise RuntimeError(f"{label}: the check found a non-finite value in finite data")
            times[form] = statistics.median(runs) * 1e3
        print(
            f"{label} {shape}: rows first {times['rows first']:.1f} ms, "
            f"one piece {times['one piece']:.1f} ms (median of {args.repeats})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
