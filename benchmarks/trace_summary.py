"""Per-operation time of a ``jax.profiler`` trace, summed over the traced steps.

    python benchmarks/profile_step.py --dir DIR --trace OUT   # writes a trace of two steps
    python benchmarks/trace_summary.py OUT [--steps 2] [--top 25]

Reads the newest ``*.trace.json.gz`` under ``OUT`` and prints, per XLA program (``hlo_module``:
``jit__generate`` is the sampler, ``jit_split_step`` the update), the operations that took the
most time (milliseconds per step) with how often they ran per step: an operation that runs once
per generated token shows ``max_new_tokens`` runs per step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--steps", type=int, default=2, help="steps in the trace")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    files = glob.glob(os.path.join(args.trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        parser.error(f"no *.trace.json.gz under {args.trace_dir}")
    with gzip.open(max(files, key=os.path.getmtime)) as fh:
        events = json.load(fh)["traceEvents"]
    total: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    runs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        module = (e.get("args") or {}).get("hlo_module")
        if e.get("ph") != "X" or module is None:
            continue
        total[module][e["name"]] += e.get("dur", 0)
        runs[module][e["name"]] += 1
    for module, ops in sorted(total.items(), key=lambda kv: -sum(kv[1].values())):
        per_step = sum(ops.values()) / 1e3 / args.steps
        print(f"{module}: {per_step:.1f} ms of operations per step")
        for name, us in ops.most_common(args.top):
            n = runs[module][name] / args.steps
            print(f"  {us / 1e3 / args.steps:8.2f} ms  {n:6.0f} runs  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
