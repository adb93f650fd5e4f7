"""The sampler in one run against concurrent row groups, over model shapes, alternated.

    python benchmarks/row_groups.py                         # the shapes of docs/benchmarks.md
    python benchmarks/row_groups.py --dir W1_DIR            # also the W1 directory's weights
    python benchmarks/row_groups.py --shapes 256x768x4x4096 --dtype bfloat16 --reps 9

For each shape (width x MLP x layers x vocabulary, random weights from a fixed seed, tied
embeddings, heads of 64) it generates ``--prompts`` x ``--generations`` completions of
``--new-tokens`` tokens (no early stop) from ``--prompt-length``-token prompts, with
``generate(row_groups=1)`` and ``generate(row_groups=G)`` (G: ``--groups``, default one per CPU
core this process may use), alternating the two and flipping their order every pair. It prints
the median and the range of each, their ratio, the largest weight matrix (2**20 elements as
M), what
``auto_row_groups`` chooses for the shape, and whether the two gave the same tokens for the
same key.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

DEFAULT_SHAPES = (
    "128x384x4x4096,256x768x4x4096,320x1024x4x4096,256x768x8x4096,"
    "256x768x4x16384,384x1024x6x8192,512x1536x8x8192"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated HxMxLxV")
    parser.add_argument("--dir", default=None, help="a Hugging Face directory, timed first")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--groups", type=int, default=None, help="default: CPU cores")
    parser.add_argument("--reps", type=int, default=7, help="timed runs of each")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from artifex.generative_models.inference import auto_row_groups, generate
    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig

    groups = args.groups or len(os.sched_getaffinity(0))
    dtype = jnp.dtype(args.dtype)

    def cast(model):
        if dtype != jnp.float32:
            state = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), state))
        return model

    cases = []
    if args.dir:
        with open(os.path.join(args.dir, "prompts.json")) as fh:
            ids = np.asarray(json.load(fh)["ids"], np.int32)
        cases.append(
            (os.path.basename(args.dir.rstrip("/")), cast(CausalLM.from_pretrained(args.dir)), ids)
        )
    for shape in filter(None, args.shapes.split(",")):
        h, m, layers, v = (int(x) for x in shape.split("x"))
        heads = max(h // 64, 1)
        kv = 2 if heads % 2 == 0 else 1
        cfg = CausalLMConfig(
            vocab_size=v, hidden_size=h, intermediate_size=m, num_layers=layers,
            num_heads=heads, num_kv_heads=kv, tie_word_embeddings=True,
            max_position_embeddings=args.prompt_length + args.new_tokens,
        )  # fmt: skip
        model = cast(CausalLM(cfg, rngs=nnx.Rngs(0)))
        ids = np.asarray(
            jax.random.randint(jax.random.key(1), (args.prompts, args.prompt_length), 0, v)
        )
        cases.append((shape, model, ids))

    print(
        f"{args.prompts} prompts x {args.generations}, {args.new_tokens} new tokens, "
        f"{args.dtype}, {groups} groups against one run, {args.reps} runs each, alternated"
    )
    print(
        "| shape | largest matrix, elements (bytes) | auto groups | one run, ms | groups, ms "
        "| ratio | same tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, model, ids in cases:
        mask = np.ones_like(ids)
        kw = dict(num_generations=args.generations, max_new_tokens=args.new_tokens, eos_ids=())

        def run(g, seed, model=model, ids=ids, mask=mask, kw=kw):
            out = generate(model, ids, mask, key=jax.random.key(seed), row_groups=g, **kw)
            return np.asarray(out.completion_ids)

        same = np.array_equal(run(1, 0), run(groups, 0))  # also compiles both
        times: dict[int, list[float]] = {1: [], groups: []}
        for r in range(args.reps):
            for g in (1, groups) if r % 2 == 0 else (groups, 1):
                t = time.perf_counter()
                run(g, r + 1)
                times[g].append(time.perf_counter() - t)
        largest = max(
            (x for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if x.ndim >= 2),
            key=lambda x: x.size,
        )
        one, grp = (statistics.median(times[g]) for g in (1, groups))
        print(
            f"| {name} | {largest.size / 2**20:.2f} M ({largest.nbytes / 2**20:.0f} MiB) | "
            f"{auto_row_groups(model, len(ids))} | "
            f"{one * 1e3:.0f} ({min(times[1]) * 1e3:.0f}-{max(times[1]) * 1e3:.0f}) | "
            f"{grp * 1e3:.0f} ({min(times[groups]) * 1e3:.0f}-{max(times[groups]) * 1e3:.0f}) | "
            f"{grp / one:.2f} | {'yes' if same else 'no'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
