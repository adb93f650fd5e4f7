"""Ours and TRL side by side on one accelerator, in one run, with each phase against its roofline.

    python benchmarks/accelerator.py [--scale auto|gpu|cpu] [--rows w1,w2,q05,long]
        [--budget-s 450] [--work DIR] [--out DIR] [--trl-python PATH] [--ragged]

One call of this script is one comparison: every row runs in its own process, one after the
other, on the same machine, on the same weights (``benchmarks/hfdir.py`` writes one Hugging Face
directory per workload, random weights from a fixed seed, that both systems load). Per workload:

1. ours, cold: ``benchmarks/ours_worker.py`` with a new, empty persistent compilation cache;
2. ours, cached: the same command again, reading the cache the first run filled (its first step
   is the first step a user sees on the second run of a job);
3. TRL: ``benchmarks/peers/trl_step.py`` in TRL's interpreter (``--trl-python``; a missing one
   gives a "not installed" row), on the same device.

Workloads (``--scale gpu``): W1 (toy Qwen2 shape, fp32), W2 (SmolLM2-135M's shape, fp32), Q05
(Qwen2.5-0.5B's shape, 8 x 8, 256 + 512 tokens, bf16) and Long (Qwen2.5-1.5B's shape, 8 x 8,
256 + 2,048 tokens, bf16, rematerialized). ``--scale cpu`` runs the same rows on shapes small
enough for a CPU (2 layers, vocabulary 4,096, shorter lengths; W1 as it is), so that every part
of the script is exercised without an accelerator. ``auto`` picks ``gpu`` when JAX's default
backend is not the CPU.

Rooflines, from a probe run first in its own process: the copy bandwidth (a large array copied,
bytes read + written per second) and the matmul rate in the workload's dtype.

- decode: the bytes one token step must read (every weight once, and the KV cache at the mean
  context length of the step) over the copy bandwidth, against the measured generation time per
  token step (``generation / completion_length``); the table shows measured / roofline.
- update: the update's matmul FLOPs, ``(6 + 2 [reference] + 2 [rematerialization]) x N x T``
  with ``N`` the parameters in matmuls (the output projection included) and ``T`` the tokens of
  the batch, over the measured update time, as a share of the matmul rate. Attention's own
  FLOPs are left out, so the share is a lower bound.

``--ragged`` adds, last, the ragged-completions workload of ``benchmarks/ragged.py`` (ours
only: ``generate`` and the padded update against continuous batching and the packed update; at
W2's shape on an accelerator, a CPU-sized one with ``--scale cpu``), with its own table.

Prints a table and writes ``OUT/results.json`` (every record, the probe, versions, command).
A row that fails or runs out of its time shows the reason instead of numbers; the exit status is
1 when any row of ours failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import hfdir  # noqa: E402

# How each workload runs: dtype and rematerialization for both systems.
SETTINGS = {
    "w1": {"dtype": "float32", "remat": False},
    "w2": {"dtype": "float32", "remat": False},
    "q05": {"dtype": "bfloat16", "remat": False},
    "long": {"dtype": "bfloat16", "remat": True},
}

_PROBE = r"""
import json, time
import jax, jax.numpy as jnp
gpu = jax.default_backend() != "cpu"
def best(f, *a, reps):
    f(*a).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter(); f(*a).block_until_ready(); times.append(time.perf_counter() - t)
    return min(times)
n = (1 << 28) if gpu else (1 << 24)  # float32 elements: 1 GiB / 64 MiB
x = jnp.ones((n,), jnp.float32)
copy = jax.jit(lambda v: v * 1.0001)
copy_s = best(copy, x, reps=10 if gpu else 3)
rates = {}
for dtype in ("float32", "bfloat16"):
    m = 8192 if gpu else 1024
    a = jax.random.normal(jax.random.key(0), (m, m), dtype)
    b = jax.random.normal(jax.random.key(1), (m, m), dtype)
    mm = jax.jit(lambda p, q: p @ q)
    rates[dtype] = 2 * m**3 / best(mm, a, b, reps=10 if gpu else 3)
dev = jax.devices()[0]
print("RESULT " + json.dumps({
    "copy_bytes_per_s": 8 * n / copy_s, "matmul_flops_per_s": rates,
    "device": f"{dev.platform} ({dev.device_kind})", "jax": jax.__version__,
}))
"""


def small(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """A CPU-sized copy of a workload: 2 layers, vocabulary 4,096, shorter lengths."""
    out = json.loads(json.dumps(spec))
    out["name"] = f"{spec['name']} (CPU size)"
    m = out["model"]
    m["num_layers"] = 2
    m["vocab_size"] = 4096
    if m["hidden_size"] > 768:  # Long: a narrower model with the same head layout
        m["hidden_size"], m["intermediate_size"] = 512, 1536
        m["num_heads"], m["head_dim"] = 4, 128
    out["num_prompts"] = min(out["num_prompts"], 2)
    out["num_generations"] = min(out["num_generations"], 4)
    out["prompt_length"] = min(out["prompt_length"], 32)
    out["completion_length"] = {"w2": 64, "q05": 64, "long": 256}.get(name, 64)
    return out


def workload_dir(name: str, scale: str, work: str) -> str:
    """The workload directory for ``name`` at ``scale`` (written once)."""
    if scale == "cpu" and name != "w1":
        key = f"{name}-cpu"
        hfdir.WORKLOADS.setdefault(key, small(hfdir.WORKLOADS[name], name))
        return hfdir.ensure_dir(key, work)
    return hfdir.ensure_dir(name, work)


def run(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Runs one process; its last ``RESULT {json}`` line, or ``{"error": ...}``."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1.0)
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["-"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:300]}"}
    record = json.loads(lines[-1][len("RESULT ") :])
    record["process_wall_s"] = time.perf_counter() - t0
    return record


def matmul_params(model: dict[str, Any]) -> int:
    """Parameters that enter a matrix product per token (embedding lookup excluded)."""
    d, f, layers = model["hidden_size"], model["intermediate_size"], model["num_layers"]
    q = model["num_heads"] * model["head_dim"]
    kv = model["num_kv_heads"] * model["head_dim"]
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    return layers * per_layer + d * model["vocab_size"]  # the output projection


def all_params(model: dict[str, Any]) -> int:
    """Every parameter (tied embeddings counted once)."""
    extra = 0 if model["tie_word_embeddings"] else model["vocab_size"] * model["hidden_size"]
    return matmul_params(model) + extra


def rooflines(w: dict[str, Any], s: dict[str, Any], probe: dict[str, Any]) -> dict[str, float]:
    """Seconds per decode token step and per update at the probe's rates."""
    m = w["model"]
    nbytes = 2 if s["dtype"] == "bfloat16" else 4
    rows = w["num_prompts"] * w["num_generations"]
    mean_context = w["prompt_length"] + w["completion_length"] / 2
    cache = 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * nbytes
    step_bytes = all_params(m) * nbytes + rows * mean_context * cache
    tokens = rows * (w["prompt_length"] + w["completion_length"])
    flops = (6 + 2 * (w["beta"] > 0) + 2 * s["remat"]) * matmul_params(m) * tokens
    return {
        "decode_step_s": step_bytes / probe["copy_bytes_per_s"],
        "update_flops": float(flops),
        "update_s": flops / probe["matmul_flops_per_s"][s["dtype"]],
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:,.0f}"


def _median(rec: dict[str, Any], key: str) -> float | None:
    value = rec.get(key)
    return value.get("median") if isinstance(value, dict) else None


def _spread(rec: dict[str, Any], key: str) -> str:
    value = rec.get(key)
    if not isinstance(value, dict):
        return "-"
    return f"{_ms(value['median'])} ({_ms(value['min'])}-{_ms(value['max'])})"


def row_cells(rec: dict[str, Any], w: dict[str, Any], roof: dict[str, float]) -> list[str]:
    """The table's cells for one record."""
    if "error" in rec:
        return [rec["error"]] + [""] * 6
    gen = _median(rec, "generation_s")
    update = _median(rec, "training_s")
    decode = None if gen is None else gen / w["completion_length"]
    peak = rec.get("device_peak_bytes") or rec.get("peak_rss_bytes")
    return [
        _spread(rec, "seconds"),
        _spread(rec, "generation_s"),
        _spread(rec, "training_s"),
        "-" if rec.get("first_step_s") is None else f"{rec['first_step_s']:.1f} s",
        "-" if not peak else f"{peak / 2**30:.2f} GiB",
        "-" if decode is None else f"{1e3 * decode:.2f} ms ({decode / roof['decode_step_s']:.1f}x)",
        "-" if not update else f"{100 * roof['update_s'] / update:.0f}%",
    ]


# benchmarks/ragged.py's flags for --scale cpu: the same kind of workload, small enough to test
# the row without an accelerator.
RAGGED_CPU_FLAGS = [
    "--vocab", "1024", "--hidden", "64", "--mlp", "128", "--layers", "1", "--heads", "2",
    "--kv-heads", "1", "--head-dim", "32", "--prompts", "4", "--k", "4", "--prompt-length", "16",
    "--max-new", "96", "--min-new", "4", "--median", "24", "--slots", "8",
    "--steps-per-call", "8", "--update-prompts", "2",
]  # fmt: skip


def ragged_row(scale: str, work: str, env: dict[str, str], left: float) -> dict[str, Any]:
    """``benchmarks/ragged.py`` (ours only) at W2's shape, or its CPU-sized shape, in ``left`` s.

    Prints the script's table; returns its records (``--json``), or ``{"error": ...}``.
    """
    if left < 10:
        return {"error": "no time left in --budget-s"}
    out = os.path.join(work, "ragged.json")
    shape = ["--w2"] if scale == "gpu" else RAGGED_CPU_FLAGS
    cmd = [sys.executable, "benchmarks/ragged.py", *shape, "--no-peer", "--windows", "1"]
    cmd += ["--max-retries", "0", "--json", out]
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=max(left, 1.0)
        )
    except subprocess.TimeoutExpired:
        print(f"  ragged: no result within {left:.0f} s")
        return {"error": f"no result within {left:.0f} s", "command": shlex.join(cmd)}
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stderr.strip().splitlines() or ["-"])[-1]
        print(f"  ragged: exit {proc.returncode}: {tail[:300]}")
        return {"error": f"exit {proc.returncode}: {tail[:300]}", "command": shlex.join(cmd)}
    print("\nragged completions (" + shlex.join(cmd) + "):")
    print("\n".join(ln for ln in proc.stdout.splitlines() if ln.startswith("|")))
    with open(out) as fh:
        return {**json.load(fh), "command": shlex.join(cmd)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=("auto", "gpu", "cpu"), default="auto")
    parser.add_argument("--rows", default="w1,w2,q05,long")
    parser.add_argument("--budget-s", type=float, default=450.0, help="for every row together")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "artifex-accel"))
    parser.add_argument("--out", default=None, help="writes results.json here")
    parser.add_argument(
        "--trl-python",
        default=os.environ.get("ARTIFEX_TRL_PYTHON", "/tmp/artifex-peers/trl/bin/python"),
    )
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument(
        "--ragged",
        action="store_true",
        help="also the ragged-completions workload (benchmarks/ragged.py, ours only: today's "
        "sampler and update against continuous batching and packing), last, in what is left of "
        "--budget-s",
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; expected some of {sorted(SETTINGS)}")
    deadline = time.perf_counter() + args.budget_s
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    probe = run([sys.executable, "-c", _PROBE], env, 120)
    if "error" in probe:
        print(f"probe failed: {probe['error']}")
        return 1
    scale = args.scale
    if scale == "auto":
        scale = "cpu" if probe["device"].startswith("cpu") else "gpu"
    on_gpu = not probe["device"].startswith("cpu")
    os.makedirs(args.work, exist_ok=True)
    trl_ok = os.path.exists(args.trl_python)
    print(f"device {probe['device']}, jax {probe['jax']}, scale {scale}")
    rates = probe["matmul_flops_per_s"]
    print(
        f"copy {probe['copy_bytes_per_s'] / 1e9:.1f} GB/s; matmul fp32 "
        f"{rates['float32'] / 1e9:,.0f}, bf16 {rates['bfloat16'] / 1e9:,.0f} GFLOP/s"
    )
    records: dict[str, dict[str, Any]] = {}
    failed = False
    for name in names:
        s = SETTINGS[name]
        directory = workload_dir(name, scale, args.work)
        with open(os.path.join(directory, "workload.json")) as fh:
            w = json.load(fh)
        cache = tempfile.mkdtemp(prefix=f"cache-{name}-", dir=args.work)
        ours = [
            sys.executable,
            "benchmarks/ours_worker.py",
            "--dir",
            directory,
            "--windows",
            str(args.windows),
            "--max-retries",
            "2",
            "--dtype",
            s["dtype"],
            "--compilation-cache",
            cache,
        ] + (["--remat"] if s["remat"] else [])
        trl = [
            args.trl_python,
            "benchmarks/peers/trl_step.py",
            "--model-dir",
            directory,
            "--windows",
            str(args.windows),
            "--max-retries",
            "2",
            "--dtype",
            s["dtype"],
            "--device",
            "cuda" if on_gpu else "cpu",
        ] + (["--gradient-checkpointing"] if s["remat"] else [])
        runs = [("ours", ours), ("ours, cached", ours)]
        runs.append(("TRL", trl) if trl_ok else ("TRL", None))
        for label, cmd in runs:
            left = deadline - time.perf_counter()
            if cmd is None:
                rec = {"error": f"not installed ({args.trl_python})"}
            elif left < 10:
                rec = {"error": "no time left in --budget-s"}
            else:
                rec = run(cmd, env, left)
                rec["command"] = shlex.join(cmd)
            records[f"{name}/{label}"] = rec
            failed |= label.startswith("ours") and "error" in rec
            print(f"  {name} {label}: {'error: ' + rec['error'] if 'error' in rec else 'done'}")
        shutil.rmtree(cache, ignore_errors=True)
        records[f"{name}/roofline"] = rooflines(w, s, probe)
        records[f"{name}/workload"] = w
    head = [
        "workload",
        "system",
        "step ms",
        "generation ms",
        "update ms",
        "first step",
        "peak memory",
        "decode / token step (x roofline)",
        "update (% of matmul rate)",
    ]
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in names:
        roof, w = records[f"{name}/roofline"], records[f"{name}/workload"]
        for label in ("ours", "ours, cached", "TRL"):
            cells = row_cells(records[f"{name}/{label}"], w, roof)
            print("| " + " | ".join([w["name"], label, *cells]) + " |")
        print(
            f"| {w['name']} | roofline | | | {_ms(roof['update_s'])} | | | "
            f"{1e3 * roof['decode_step_s']:.2f} ms | {roof['update_flops'] / 1e12:.2f} TFLOP |"
        )
    if args.ragged:
        records["ragged"] = ragged_row(scale, args.work, env, deadline - time.perf_counter())
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump(
                {"command": shlex.join(sys.argv), "probe": probe, "scale": scale, **records},
                fh,
                indent=1,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
