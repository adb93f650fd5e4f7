"""Ours against TRL and Tunix on identical weights, prompts and settings, in clean windows.

    python benchmarks/honest.py                       # W1 and W2, every system installed
    python benchmarks/honest.py --workloads w1 --quick  # a short check of the harness
    python benchmarks/honest.py --w2-model DIR        # W2 on a real checkpoint (HF directory)
    python benchmarks/honest.py --write-docs          # also regenerate docs/benchmarks.md's table

For each workload, ``benchmarks/hfdir.py`` writes one Hugging Face directory once (config.json,
model.safetensors, tokenizer, prompts.json, workload.json) that every system loads: ours with
``CausalLM.from_pretrained``, TRL with transformers' ``AutoModelForCausalLM`` (through
``GRPOTrainer(model=DIR)``), Tunix with its own safetensors loader. Each system runs in its own
process, in the order ours, TRL, Tunix, ours (W1 then runs ours twice more on one empty JAX
persistent compilation cache, one process filling it and one reading it, for the first step of
a second run, then ours and Tunix with the process settings of
``host_memory.reuse_host_memory()``, ``--reuse-host-memory``; W2: ours, TRL, ours, ours with
those settings, then ours and TRL with
bfloat16 parameters, ours recomputing every layer, ours without remat and ours with the
decoder layers stored stacked and scanned in the update, ``CausalLM.stack_layers()`` with
``GRPOConfig(scan_layers=True)``, and ours with the update run as per-layer programs,
``GRPOConfig(layerwise_update=True)``), one after the other. On W2 ours
recomputes the activations of every second layer in the backward pass (``GRPOConfig(remat=True,
remat_every=2)``), as TRL recomputes its layers by default (its
``gradient_checkpointing=True``), with a peak memory that stays below TRL's; on W1 it does
not, as Tunix (``RematConfig.NONE``). Every process
times its steps as windows and measures the CPU that other processes used in each window
(``benchmarks/cleanwin.py``); windows above the threshold (5%) are re-run, up to ``--max-retries``
more, and a row whose windows never got clean says so. The fp32 matmul peak is measured in the same
run, before and after, in clean windows too, and briefly again just before every row (two clean
windows): the machine's speed can change within minutes without any other process showing on
its CPU (a neighbour on the host), and that column shows the state each row ran in.

Rows: median seconds per whole step with the spread (min-max) over the clean windows, generation
and training parts, first step (compilation included), peak resident memory of the process
(VmHWM), clean windows / windows run, the matmul peak measured just before the row, and ours over
the faster peer run in the same dtype and with the same host-memory settings (the peer's default
run where it has no such run). The training part's FLOP/s are given against the peaks before
and after the runs and against the one just before the row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

# The orchestrator holds the matmul-peak buffers only: on a GPU it must not take the device's
# memory (JAX preallocates 75% by default) away from the benchmark processes it starts.
_USER_PREALLOCATE = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks import cleanwin, hfdir  # noqa: E402

PEERS = {
    "trl": ("TRL", "trl_step.py", "/tmp/artifex-peers/trl/bin/python", ("w1", "w2", "g3", "moe")),
    "tunix": ("Tunix", "tunix_w1.py", "/tmp/artifex-peers/tunix/bin/python", ("w1",)),
}
DOCS_BEGIN = "<!-- honest-table:begin -->"
DOCS_END = "<!-- honest-table:end -->"


def matmul_peak(windows: int, max_retries: int, threshold: float, n: int = 2048) -> dict:
    """fp32 ``n^3`` matmul FLOP/s, each window 8 products, the best clean window."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    reps = 8

    def work():
        for _ in range(reps):
            f(a, b).block_until_ready()

    win = cleanwin.Windows(windows, max_retries, threshold)
    win.run(work)
    s = win.summary()
    flops = 2 * n**3 * reps
    return {
        "gflops": flops / s["seconds"]["min"] / 1e9,
        "gflops_median": flops / s["seconds"]["median"] / 1e9,
        "clean_windows": s["clean_windows"],
        "windows": s["windows"],
        "all_clean": s["all_clean"],
        "other_cpu_max": s["other_cpu_max"],
    }


def run_child(cmd: list[str], env: dict, timeout: float) -> dict:
    """Runs one benchmark process; returns its RESULT record plus its ru_maxrss and exit code."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"timed out ({timeout:.0f} s)"}
    # The child has been reaped by communicate(); its rusage is in RUSAGE_CHILDREN only as a max
    # over all children, so the per-process peak is the VmHWM the child reports itself.
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = (err.strip().splitlines() or ["no output"])[-1][:300]
        return {"error": f"exit {proc.returncode}: {tail}"}
    res = json.loads(lines[-1][len("RESULT ") :])
    res["exit"] = proc.returncode
    res["process_wall_s"] = wall
    return res


def machine() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import jax

    dev = jax.devices()[0]
    return (
        f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__} on {dev.platform} "
        f"({dev.device_kind})"
    )


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1e3 * x:,.0f}"


def _spread(d: dict | None) -> str:
    if not d:
        return "n/a"
    return f"{_ms(d['median'])} ({_ms(d['min'])}-{_ms(d['max'])})"


def _gb(b: float | None) -> str:
    return "n/a" if not b else f"{b / 1e9:.2f} GB"


def _shares(achieved: float, row: dict, peak: dict, peak_after: dict | None) -> str:
    """``achieved`` FLOP/s as shares of the peaks before and after the runs and before ``row``."""
    share = f"{100 * achieved / (peak['gflops'] * 1e9):.0f}% of the matmul peak"
    if peak_after is not None:
        share += (
            f" before the runs, {100 * achieved / (peak_after['gflops'] * 1e9):.0f}% "
            "of the peak after them"
        )
    probe = row.get("peak_before_row") or {}
    if "gflops" in probe:
        share += (
            f", {100 * achieved / (probe['gflops'] * 1e9):.0f}% of the peak measured "
            "just before the row"
        )
    return share


def table(results: dict, peak: dict, peak_after: dict | None = None) -> list[str]:
    """Markdown lines for every workload's rows (FLOP/s against both peaks when given)."""
    lines = []
    for wname, runs in results.items():
        lines.append(f"**{wname.upper()}** ({runs['spec']})")
        lines.append("")
        lines.append(
            "| System | Whole step, ms median (min-max) | Generation, ms | After generation, ms | "
            "First step, s | Peak RSS | Clean windows | Matmul peak just before, GFLOP/s | "
            "Ours / faster peer |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        # Each row of ours is compared with the faster peer run in its own dtype and with the
        # same host-memory settings (reuse_host_memory; a peer without such a run: its default).
        fastest: dict[tuple[str, bool], float] = {}
        sliced_peer = math.inf  # the faster peer run with its update in micro-batches
        for r in runs["runs"]:
            if r.get("system") in PEERS and "seconds" in r and not r.get("exit"):
                if r.get("train_micro_batch"):
                    sliced_peer = min(sliced_peer, r["seconds"]["median"])
                    continue
                key = (r.get("dtype", "float32"), bool(r.get("reuse_host_memory")))
                fastest[key] = min(fastest.get(key, math.inf), r["seconds"]["median"])
        for r in runs["runs"]:
            label = r.get("label", r.get("system", "?"))
            if "error" in r:
                lines.append(f"| {label} | {r['error']} | | | | | | | |")
                continue
            step = r.get("seconds")
            ratio = ""
            dtype, reuse = r.get("dtype", "float32"), bool(r.get("reuse_host_memory"))
            peer, note = fastest.get((dtype, reuse)), ""
            if peer is None and reuse:  # no peer run with the same settings: its default run
                peer, note = fastest.get((dtype, False)), " (peer at its defaults)"
            if r["system"] == "ours" and peer and step:
                ratio = f"{step['median'] / peer:.2f}x{note}"
            clean = f"{r['clean_windows']}/{r['windows']}"
            if not r.get("all_clean"):
                clean += f" NOISY (other CPU up to {100 * r['other_cpu_max']:.0f}%)"
            problems = r.get("check", {}).get("problems") or []
            if problems:
                clean += f"; CHECKS FAILED: {problems[0]}"
            probe = r.get("peak_before_row") or {}
            machine = f"{probe['gflops']:.0f}" if "gflops" in probe else ""
            if probe and not probe.get("all_clean"):
                machine += " (noisy)"
            lines.append(
                f"| {label} | {_spread(step)} | {_spread(r.get('generation_s'))} | "
                f"{_spread(r.get('after_generation_s'))} | {r.get('first_step_s') or 0:.1f} | "
                f"{_gb(r.get('peak_rss_bytes'))} | {clean} | {machine} | {ratio} |"
            )
        first = next(
            (
                r
                for r in runs["runs"]
                if r.get("system") == "ours" and r.get("train_flops") and "training_s" in r
            ),
            None,
        )
        if first is not None:
            achieved = first["train_flops"] / first["training_s"]["median"]
            # Each window's whole step is its generation + host + training parts; the median
            # of its host parts, not a difference of three medians (which can be negative).
            host = (first.get("host_s") or {}).get("median")
            if host is None:
                host = first["seconds"]["median"] - first["generation_s"]["median"]
                host -= first["training_s"]["median"]
            lines.append("")
            lines.append(
                f"{first['label']}: training part {first['train_flops'] / 1e9:.1f} GFLOP (XLA "
                f"cost analysis, log-probs in one piece) at {achieved / 1e9:.0f} GFLOP/s = "
                f"{_shares(achieved, first, peak, peak_after)}; "
                f"generation {first['generated_tokens'] / first['generation_s']['median']:.0f} "
                f"tok/s; host overhead {1e3 * host:.0f} ms "
                f"({100 * host / first['seconds']['median']:.1f}% of the step)."
            )
            # Our last row runs the same update (the same command without the cost analysis):
            # its share too, since the machine's speed moves between the rows.
            last = next(
                (
                    r
                    for r in runs["runs"]
                    if r.get("system") == "ours"
                    and r.get("label", "").startswith("ours (last")
                    and "training_s" in r
                ),
                None,
            )
            if last is not None:
                achieved = first["train_flops"] / last["training_s"]["median"]
                lines.append("")
                lines.append(
                    f"{last['label']}: the same update at {achieved / 1e9:.0f} GFLOP/s = "
                    f"{_shares(achieved, last, peak, peak_after)}."
                )
        if sliced_peer < math.inf:
            mine = [
                f"{r['label']} {r['seconds']['median'] / sliced_peer:.2f}x"
                for r in runs["runs"]
                if r.get("system") == "ours"
                and "seconds" in r
                and not r.get("reuse_host_memory")
                and r.get("microbatches", 1) > 1
            ]
            if mine:
                lines.append("")
                lines.append(
                    "Against the faster peer row with its update in micro-batches "
                    f"({_ms(sliced_peer)} ms), as ours runs it by default: " + ", ".join(mine) + "."
                )
        lines.append("")
    return lines


def render(
    command: str,
    started: datetime.datetime | None,
    mach: str,
    peak: dict,
    peak_after: dict,
    results: dict,
    threshold: float,
) -> str:
    """The header (command, date, machine, matmul peaks) and the tables of a run's records."""
    noisy = not peak["all_clean"] or any(
        not r.get("all_clean", True) for w in results.values() for r in w["runs"]
    )
    when = f"{started:%Y-%m-%d %H:%M} UTC" if started else "date not recorded"
    header = [
        f"Command: `{command.strip()}`; {when}; machine: {mach}.",
        "",
        f"fp32 matmul peak (2048^3, best clean window): {peak['gflops']:.0f} GFLOP/s before the "
        f"runs, {peak_after['gflops']:.0f} GFLOP/s after "
        f"({peak['clean_windows']}/{peak['windows']} and "
        f"{peak_after['clean_windows']}/{peak_after['windows']} windows clean).",
        "",
    ]
    if noisy:
        header += [
            "**NOISY**: some windows could not be made clean (other processes used more than "
            f"{100 * threshold:.0f}% of the CPU in every try); these numbers must be "
            "re-measured on a quiet machine.",
            "",
        ]
    return "\n".join(header + table(results, peak, peak_after))


def write_docs(text: str) -> None:
    """Replaces the table between the markers of ``docs/benchmarks.md`` with ``text``."""
    path = os.path.join(ROOT, "docs", "benchmarks.md")
    with open(path) as fh:
        doc = fh.read()
    if DOCS_BEGIN not in doc or DOCS_END not in doc:
        msg = f"{path}: markers {DOCS_BEGIN} / {DOCS_END} not found"
        raise ValueError(msg)
    a = doc.index(DOCS_BEGIN) + len(DOCS_BEGIN)
    b = doc.index(DOCS_END)
    with open(path + ".tmp", "w") as fh:
        fh.write(doc[:a] + "\n" + text + "\n" + doc[b:])
    os.replace(path + ".tmp", path)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="w1,w2")
    parser.add_argument("--systems", default="ours,trl,tunix")
    parser.add_argument("--w2-model", default=None, help="Hugging Face directory for W2")
    parser.add_argument("--work-dir", default="/tmp/artifex-bench")
    parser.add_argument("--windows", type=int, default=5, help="clean windows wanted per run")
    parser.add_argument("--max-retries", type=int, default=10, help="extra windows per run")
    parser.add_argument("--threshold", type=float, default=0.05, help="other-process CPU limit")
    parser.add_argument("--quick", action="store_true", help="2 windows, 2 retries")
    parser.add_argument("--no-bf16", action="store_true", help="skip W2's bf16 rows")
    parser.add_argument(
        "--no-cache-rows",
        action="store_true",
        help="skip W1's two rows through JAX's persistent compilation cache",
    )
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", default="", help="also write every record here")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument(
        "--from-json",
        default=None,
        help="measure nothing: print (and with --write-docs, write) the table of the records "
        "that an earlier run wrote with --json",
    )
    args = parser.parse_args(argv)
    if args.from_json is not None:
        measuring = [
            a.option_strings[0]
            for a in parser._actions
            if a.dest not in ("help", "from_json", "write_docs")
            and getattr(args, a.dest) != a.default
        ]
        if measuring:
            parser.error(f"--from-json measures nothing: {', '.join(measuring)} has no effect")
        try:
            with open(args.from_json) as fh:
                rec = json.load(fh)
        except (OSError, ValueError) as err:
            parser.error(f"--from-json {args.from_json!r}: cannot read the records ({err})")
        need = ("machine", "peak", "peak_after", "results")
        if not isinstance(rec, dict) or any(k not in rec for k in need):
            parser.error(
                f"--from-json {args.from_json!r}: expected an object with the keys {need} "
                "(as honest.py --json writes), got "
                + (f"the keys {sorted(rec)}" if isinstance(rec, dict) else type(rec).__name__)
            )
        started = rec.get("started")
        text = render(
            rec.get("command") or f"(the records in {args.from_json})",
            datetime.datetime.fromisoformat(started) if started else None,
            rec["machine"],
            rec["peak"],
            rec["peak_after"],
            rec["results"],
            rec.get("threshold", args.threshold),
        )
        print(text, flush=True)
        if args.write_docs:
            write_docs(text)
        return 0
    if args.quick:
        args.windows, args.max_retries = 2, 2
    systems = args.systems.split(",")
    wins = ["--windows", str(args.windows), "--max-retries", str(args.max_retries)]
    wins += ["--threshold", str(args.threshold)]
    # The rows measure the library's defaults: no compile level left over from a test shell.
    drop = {"XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "ARTIFEX_CPU_OPT_LEVEL"}
    base_env = {k: v for k, v in os.environ.items() if k not in drop}
    if _USER_PREALLOCATE is not None:
        base_env["XLA_PYTHON_CLIENT_PREALLOCATE"] = _USER_PREALLOCATE
    ours_env = dict(base_env, PYTHONPATH=ROOT)
    peer_env = {k: v for k, v in base_env.items() if k != "PYTHONPATH"}
    started = datetime.datetime.now(datetime.UTC)

    mach = machine()
    print(f"machine: {mach}", flush=True)
    peak = matmul_peak(args.windows, args.max_retries, args.threshold)
    print(f"matmul peak: {peak}", flush=True)
    results: dict = {}
    for wname in args.workloads.split(","):
        real = args.w2_model if wname == "w2" else None
        wdir = hfdir.ensure_dir(wname, args.work_dir, real_model=real)
        with open(os.path.join(wdir, "workload.json")) as fh:
            spec = json.load(fh)
        m = spec["model"]
        desc = (
            f"{m['model_type']}, vocab {m['vocab_size']}, width {m['hidden_size']}, "
            f"{m['num_layers']} layers; {spec['num_prompts']} prompts x "
            f"{spec['num_generations']}, {spec['prompt_length']} + {spec['completion_length']} "
            f"tokens, beta {spec['beta']}, AdamW; weights: {spec['weights']}; dir {wdir}"
        )
        order: list[tuple[str, list[str], dict, str]] = []
        # A workload with a dtype of its own (G3-1B: bfloat16) runs in it in every system.
        dtype = ["--dtype", spec["dtype"]] if "dtype" in spec else []
        wins_dtype = [*wins, *dtype]
        ours_cmd = [
            sys.executable, os.path.join(HERE, "ours_worker.py"), "--dir", wdir, *wins_dtype
        ]  # fmt: skip
        # TRL recomputes activations in the backward pass by default (gradient checkpointing):
        # where TRL is the peer (W2), ours recomputes those of every second layer
        # (GRPOConfig.remat, remat_every=2: less compute than every layer, a peak memory still
        # below TRL's; the row "ours, remat every layer" recomputes all of them). Tunix, W1's
        # faster peer, keeps them (RematConfig.NONE), and so does ours on W1.
        no_remat_cmd = ours_cmd
        full_remat_cmd = [*ours_cmd, "--remat"]
        if wname == "w2":
            ours_cmd = [*ours_cmd, "--remat", "--remat-every", "2"]
        peer_names = [p for p in PEERS if p in systems and wname in PEERS[p][3]]
        tag = ", remat every 2nd layer" if wname == "w2" else ""
        if "ours" in systems:
            order.append(("ours", [*ours_cmd, "--flops"], ours_env, f"ours (1st{tag})"))
        for p in peer_names:
            name, script, default, _ = PEERS[p]
            python = os.environ.get(f"ARTIFEX_{p.upper()}_PYTHON", default)
            cmd = [python, os.path.join(HERE, "peers", script), "--model-dir", wdir, *wins_dtype]
            order.append((p, cmd, peer_env, name))
        if "ours" in systems and peer_names:
            order.append(("ours", ours_cmd, ours_env, f"ours (last{tag})"))
        if "ours" in systems and wname == "w1":
            # The sampler decodes W1's prompts in concurrent row groups by default on the CPU
            # (generate's auto_row_groups: one group per core for small models); this row
            # decodes them in one run, to show what the groups bring in the same run
            label = "ours, sampler in one run (row_groups=1)"
            order.append(("ours", [*ours_cmd, "--row-groups", "1"], ours_env, label))
        cache_dir = None
        if "ours" in systems and wname == "w1" and not args.no_cache_rows:
            # The first step of a second run of the same shapes, as `artifex-grpo` runs it: the
            # first process compiles and fills an empty persistent compilation cache (one
            # window), the second loads its programs from it.
            cache_dir = tempfile.mkdtemp(prefix="jax-cache-", dir=args.work_dir)
            cached = [*ours_cmd, "--compilation-cache", cache_dir]
            fill = [*cached[: cached.index("--windows")], "--windows", "1", "--max-retries", "0"]
            fill += cached[cached.index("--threshold") :]
            order.append(("ours", fill, ours_env, "ours, filling an empty compilation cache"))
            order.append(("ours", cached, ours_env, "ours, second run (compilation cache)"))
        if "ours" in systems and wname in ("w1", "w2"):
            # The process settings of reuse_host_memory() (artifex-grpo --reuse-host-memory),
            # for ours and Tunix alike (both JAX on XLA:CPU); TRL, on PyTorch's allocator, has
            # no setting of that kind, and such a row of ours is compared with its default run
            reuse = "--reuse-host-memory"
            order.append(("ours", [*ours_cmd, reuse], ours_env, f"ours, reusing host memory{tag}"))
            if "tunix" in peer_names:
                name, script, default, _ = PEERS["tunix"]
                python = os.environ.get("ARTIFEX_TUNIX_PYTHON", default)
                cmd = [python, os.path.join(HERE, "peers", script), "--model-dir", wdir, *wins]
                order.append(("tunix", [*cmd, reuse], peer_env, f"{name}, reusing host memory"))
        if "tunix" in peer_names and "ours" in systems:
            # Ours slices the update on the CPU by default (GRPOTrainer.auto_microbatches: W1 in
            # 4 slices of 2 prompts); Tunix can too (RLTrainingConfig.train_micro_batch_size),
            # not by default. These rows show what the same setting does for Tunix; the main
            # ratio stays against Tunix at its defaults, a line below gives the other one.
            name, script, default, _ = PEERS["tunix"]
            python = os.environ.get("ARTIFEX_TUNIX_PYTHON", default)
            cmd = [python, os.path.join(HERE, "peers", script), "--model-dir", wdir, *wins]
            for prompts in (2, 4):
                label = f"{name}, training micro-batches of {prompts} prompts"
                order.append(
                    ("tunix", [*cmd, "--train-micro-batch", str(prompts)], peer_env, label)
                )
        if "ours" in systems and wname == "w2" and not args.no_bf16:
            order.append(("ours", [*ours_cmd, "--dtype", "bfloat16"], ours_env, f"ours, bf16{tag}"))
            if "trl" in peer_names:  # the bf16 row's peer: TRL with bf16 parameters
                name, script, default, _ = PEERS["trl"]
                python = os.environ.get("ARTIFEX_TRL_PYTHON", default)
                cmd = [python, os.path.join(HERE, "peers", script), "--model-dir", wdir, *wins]
                order.append(("trl", [*cmd, "--dtype", "bfloat16"], peer_env, f"{name}, bf16"))
        if "ours" in systems and wname == "w2":
            order.append(("ours", full_remat_cmd, ours_env, "ours, remat every layer"))
            order.append(("ours", no_remat_cmd, ours_env, "ours, no remat"))
            # CausalLM.stack_layers + GRPOConfig.scan_layers: the layers stored stacked, the
            # update scans them without a copy (compiles several times faster, one optimizer
            # array per weight kind); the sampler slices them once per rollout and runs them
            # unrolled; a scan recomputes all its layers or none
            label = "ours, stacked layers, scanned update (remat every layer)"
            stacked_cmd = [*full_remat_cmd, "--scan-update", "--stack-layers"]
            order.append(("ours", stacked_cmd, ours_env, label))
            # GRPOConfig.layerwise_update: the update as per-layer programs (one compiled
            # program per part, whatever the depth), every layer recomputed
            label = "ours, layerwise update (remat every layer)"
            order.append(("ours", [*full_remat_cmd, "--layerwise-update"], ours_env, label))
        runs = []
        for system, cmd, env, label in order:
            if not os.path.exists(cmd[0]):
                res = {"system": system, "error": f"not installed ({cmd[0]})"}
            else:
                # The machine's speed just before the row (two clean windows, under a second)
                probe = matmul_peak(2, args.max_retries, args.threshold)
                print(f"[{wname}] {label}: {' '.join(cmd)}", flush=True)
                res = run_child(cmd, env, args.timeout)
                res.setdefault("system", system)
                res["peak_before_row"] = probe
            res["label"] = label
            runs.append(res)
            print(f"[{wname}] {label}: {json.dumps(res)[:600]}", flush=True)
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
        results[wname] = {"spec": desc, "runs": runs}
    peak_after = matmul_peak(args.windows, args.max_retries, args.threshold)

    command = "python benchmarks/" + " ".join(
        [os.path.basename(__file__), *(a for a in (argv or sys.argv[1:]) if a != "--write-docs")]
    )
    text = render(command, started, mach, peak, peak_after, results, args.threshold)
    print("\n" + text, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "command": command.strip(),
                    "started": started.isoformat(),
                    "threshold": args.threshold,
                    "machine": mach,
                    "peak": peak,
                    "peak_after": peak_after,
                    "results": results,
                },
                fh,
                indent=2,
            )
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
