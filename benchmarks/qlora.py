"""Quantized frozen bases (QLoRA) against plain LoRA: memory and step time, one process each.

Usage:
    python benchmarks/qlora.py                     # W2's shape, fp32: lora, int8, int4, nf4
    python benchmarks/qlora.py --shape q05 --dtype bfloat16 --prompts 2 --generations 4 \\
        --prompt-length 64 --new-tokens 64         # Q05's shape, a CPU-sized batch
    python benchmarks/qlora.py --json out.json     # the rows as JSON too

Each configuration runs in a fresh process (``--worker``): a random-weight model of the
workload's shape (``benchmarks/hfdir.WORKLOADS``), its base quantized with
``quantize_base(QuantizeConfig(qtype, block_size=64))`` for int8 / int4 / nf4 (none for
``lora``), LoRA adapters of rank 16 on all seven projections, AdamW on the adapters only
(``wrt=nnx.LoRAParam``), ``GRPOConfig(beta=0.04, remat=True)`` (the reference is the base with
the adapters zeroed, so no second copy of the weights). The worker samples one batch with
``generate`` (temperature 1) and runs ``--steps`` updates on it; it prints:

- ``proj_mb``: the bytes of the seven projections' stored weights (kernels, or codes and
  scales), exactly, from the arrays; ``model_mb``: the whole model's arrays (embeddings,
  norms and adapters included), what a device holds for the weights;
- ``rss_model_gb``: the process's resident memory once the model and the trainer are built
  (``VmRSS``; the model is built abstractly, then each array drawn at random, so a quantized
  row never holds full-precision kernels); ``peak_step_gb``: the peak resident memory
  (``VmHWM``, reset after the model is built) over the sampling and the updates;
- ``generate_s``: the second sampling call (the first compiles); ``first_update_s``: the first
  update (compilation included); ``update_s``: the median of the later updates.

Times on a shared CPU are noisy. ``--interleave`` times the configurations in one process
instead, a sampling and an update of each in turn per round (``--steps`` rounds, after one that
compiles), and gives each round's time over plain LoRA's (the median of those ratios): load
that changes during the run then falls on every configuration alike.

``python benchmarks/qlora.py --accuracy DIR`` measures instead how far each format moves a real
checkpoint's next-token distributions (float32, ``block_size=64``) on a few chat prompts and
their teacher-forced answers: the largest logit error over the largest logit, the mean
KL(full || quantized) per token, and how often the most likely token is the same.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CONFIGS = ("lora", "int8", "int4", "nf4")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:  # Linux: writing 5 to clear_refs resets VmHWM to the current VmRSS
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _nbytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _proj_shape(config, name: str) -> tuple[int, int]:
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }[name]


def _setup(args: argparse.Namespace, name: str) -> tuple:
    """(model, trainer, model config, projection bytes, model bytes) of one configuration."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from artifex.generative_models.models.causal_lm import (
        CausalLM,
        CausalLMConfig,
        LoRAConfig,
        apply_lora,
    )
    from artifex.generative_models.models.causal_lm.quantize import (
        QuantizeConfig,
        QuantizedWeight,
        quantize_base,
    )
    from artifex.generative_models.training.rl import GRPOConfig, GRPOTrainer
    from benchmarks.hfdir import WORKLOADS

    shape = dict(WORKLOADS[args.shape]["model"])
    config = CausalLMConfig(**shape, param_dtype=args.dtype)

    def build() -> CausalLM:
        model = CausalLM(config, rngs=nnx.Rngs(0))
        if name != "lora":
            quantize_base(model, QuantizeConfig(qtype=name, block_size=64))
        apply_lora(model, LoRAConfig(rank=16, alpha=32.0), nnx.Rngs(1))
        if args.scan:
            model.stack_layers()
        return model

    # The structure only, then random values array by array: the process never holds the
    # full-precision kernels of a quantized row (as loading a checkpoint layer by layer would).
    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    keys = iter(jax.random.split(jax.random.key(0), 4096))

    def fill(path, leaf):
        names = {str(getattr(p, "key", getattr(p, "name", p))) for p in path}
        dtype = jnp.dtype(leaf.dtype)
        if jnp.issubdtype(dtype, jnp.integer):  # codes
            info = jnp.iinfo(dtype)
            return jax.random.randint(next(keys), leaf.shape, info.min, info.max, dtype)
        if "kernel_scale" in names:
            return jnp.full(leaf.shape, 0.05 / 7.5, dtype)
        if "lora_b" in names:
            return jnp.zeros(leaf.shape, dtype)
        if "scale" in names:  # RMSNorm
            return jnp.ones(leaf.shape, dtype)
        return (0.02 * jax.random.normal(next(keys), leaf.shape, jnp.float32)).astype(dtype)

    state = jax.tree_util.tree_map_with_path(fill, abstract)
    model = nnx.merge(graphdef, state)
    model.scan_layers = args.scan
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    itemsize = jnp.dtype(args.dtype).itemsize
    proj_full = config.num_layers * sum(
        _proj_shape(config, n)[0] * _proj_shape(config, n)[1] * itemsize for n in lora_targets
    )
    proj = proj_full if name == "lora" else _nbytes(nnx.state(model, QuantizedWeight))
    model_bytes = _nbytes(nnx.state(model))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-6), wrt=nnx.LoRAParam)
    trainer = GRPOTrainer(
        model,
        optimizer,
        GRPOConfig(num_generations=args.generations, beta=0.04, remat=True, scan_layers=args.scan),
    )
    return model, trainer, config, proj, model_bytes


def _prompts(args: argparse.Namespace, vocab_size: int):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    return jnp.asarray(rng.integers(2, vocab_size, (args.prompts, args.prompt_length)), jnp.int32)


def _sample(args: argparse.Namespace, model, prompts, seed: int):
    import jax

    from artifex.generative_models.inference import generate

    out = generate(
        model,
        prompts,
        key=jax.random.key(seed),
        num_generations=args.generations,
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        eos_ids=[],
    )
    jax.block_until_ready(out.completion_ids)
    return out


def _batch(args: argparse.Namespace, out):
    import jax.numpy as jnp
    import numpy as np

    from artifex.generative_models.training.rl import GRPOBatch

    rows = args.prompts * args.generations
    return GRPOBatch(
        prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask,
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        rewards=jnp.asarray(np.random.default_rng(1).normal(size=rows), jnp.float32),
        group_size=args.generations,
    )


def worker(args: argparse.Namespace) -> dict:
    import numpy as np

    model, trainer, config, proj, model_bytes = _setup(args, args.config)
    gc.collect()
    rss_model = _status_kb("VmRSS") / 1e6
    _reset_peak()
    prompts = _prompts(args, config.vocab_size)
    _sample(args, model, prompts, 0)
    start = time.perf_counter()
    out = _sample(args, model, prompts, 1)
    generate_s = time.perf_counter() - start
    batch = _batch(args, out)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        times.append(time.perf_counter() - start)
    assert np.isfinite(metrics["policy_loss"])
    return {
        "config": args.config + (" scan" if args.scan else ""),
        "shape": args.shape,
        "dtype": args.dtype,
        "proj_mb": round(proj / 2**20, 1),
        "model_mb": round(model_bytes / 2**20, 1),
        "rss_model_gb": round(rss_model, 2),
        "peak_step_gb": round(_status_kb("VmHWM") / 1e6, 2),
        "generate_s": round(generate_s, 2),
        "first_update_s": round(times[0], 2),
        "update_s": round(statistics.median(times[1:]), 2) if len(times) > 1 else None,
    }


def interleaved(args: argparse.Namespace) -> list[dict]:
    """Step times of every configuration in one process, one sampling and one update each in
    turn per round, so that a change in the machine's load falls on all of them alike."""
    runs = {}
    for name in args.configs:
        model, trainer, config, _, _ = _setup(args, name)
        prompts = _prompts(args, config.vocab_size)
        batch = _batch(args, _sample(args, model, prompts, 0))  # compiles the sampler
        trainer.train_step(batch)  # compiles the update
        runs[name] = (model, trainer, prompts, batch, {"generate": [], "update": []})
    for round_ in range(args.steps):
        for model, trainer, prompts, batch, times in runs.values():
            start = time.perf_counter()
            _sample(args, model, prompts, round_ + 1)
            times["generate"].append(time.perf_counter() - start)
            start = time.perf_counter()
            trainer.train_step(batch)
            times["update"].append(time.perf_counter() - start)
    rows = []
    base = runs.get("lora")
    for name, (_, _, _, _, times) in runs.items():
        row = {"config": name + (" scan" if args.scan else ""), "rounds": args.steps}
        for what in ("generate", "update"):
            row[f"{what}_s"] = round(statistics.median(times[what]), 2)
            if base is not None:
                ratio = [t / b for t, b in zip(times[what], base[4][what], strict=True)]
                row[f"{what}_vs_lora"] = round(statistics.median(ratio), 2)
        rows.append(row)
    return rows


TEXTS = (
    "What is the capital of France? The capital of France is Paris, a city on the Seine.",
    "Write a haiku about autumn. Leaves drift on cold wind, the maple burns red and gold.",
    "Compute 17 + 25. Adding the units gives 12, carry one: 17 + 25 = 42.",
    "Explain photosynthesis briefly. Plants turn light, water and carbon dioxide into sugar.",
)


def accuracy(directory: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from artifex.generative_models.models.causal_lm import CausalLM, Tokenizer
    from artifex.generative_models.models.causal_lm.quantize import (
        QTYPES,
        QuantizeConfig,
        quantize_base,
    )

    tok = Tokenizer.from_pretrained(directory)
    ids, mask = tok.pad_batch([tok.encode(t) for t in TEXTS])
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    valid = np.asarray(mask, bool)
    full = CausalLM.from_pretrained(directory, dtype="float32")
    ref = np.asarray(full(ids, attention_mask=mask), np.float64)[valid]
    del full
    log_p = np.asarray(jax.nn.log_softmax(ref, -1))
    rows = []
    for qtype in QTYPES:
        model = quantize_base(
            CausalLM.from_pretrained(directory, dtype="float32"), QuantizeConfig(qtype=qtype)
        )
        got = np.asarray(model(ids, attention_mask=mask), np.float64)[valid]
        log_q = np.asarray(jax.nn.log_softmax(got, -1))
        kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
        rows.append(
            {
                "qtype": qtype,
                "tokens": int(valid.sum()),
                "max_logit_err_rel": round(float(np.abs(got - ref).max() / np.abs(ref).max()), 4),
                "mean_kl": round(float(kl.mean()), 4),
                "top1_agree": round(float((got.argmax(-1) == ref.argmax(-1)).mean()), 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=("w1", "w2", "q05"), default="w2")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument(
        "--scan",
        action="store_true",
        help="layers stacked and scanned, in the sampler and the update (one layer's kernels "
        "dequantized at a time)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--accuracy", default=None, metavar="DIR", help="see the docstring")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="step times only: every configuration in one process, in turn (--steps rounds)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, default="lora", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    if args.accuracy:
        _table(accuracy(args.accuracy))
        return 0
    if args.interleave:
        rows = interleaved(args)
        _table(rows)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"argv": sys.argv[1:], "rows": rows}, fh, indent=1)
        return 0
    rows = []
    common = [
        "--shape", args.shape, "--dtype", args.dtype, "--prompts", str(args.prompts),
        "--generations", str(args.generations), "--prompt-length", str(args.prompt_length),
        "--new-tokens", str(args.new_tokens), "--steps", str(args.steps),
        *(["--scan"] if args.scan else []),
    ]  # fmt: skip
    for config in args.configs:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", "--config", config, *common],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    _table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"argv": sys.argv[1:], "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
