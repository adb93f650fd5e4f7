"""Prints the performance table: ``python benchmarks/run.py [--only a,b] [--json FILE]``.

Every ratio is measured side by side in this one run on this one machine (the matmul peak
included), so a noisy shared machine moves both sides together. Sections:

- ``peak``: fp32 matmul FLOP/s (2048^3), the machine's practical peak.
- ``train_step``: W1's training part (one ``GRPOTrainer.train_step`` with reference forward),
  achieved FLOP/s from XLA's cost analysis against the peak.
- ``logprob_memory``: peak temporary memory of the compiled loss+gradient at vocabulary
  151,936 and B x T = 8 x 1024, chunked log-probs against naive full logits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import common
from benchmarks.workloads import W1, build_trainer, random_batch, random_prompts, w1_step

Row = dict[str, object]
SECTIONS: dict[str, Callable[[dict], list[Row]]] = {}


def section(name: str):
    def register(fn):
        SECTIONS[name] = fn
        return fn

    return register


@section("peak")
def bench_peak(ctx: dict) -> list[Row]:
    peak = common.matmul_peak()
    ctx["peak"] = peak
    return [{"benchmark": "matmul peak (fp32, 2048^3)", "value": f"{peak / 1e9:.0f} GFLOP/s"}]


@section("train_step")
def bench_train_step(ctx: dict) -> list[Row]:
    trainer = build_trainer(W1)
    batch = trainer.prepare_batch(random_batch(W1))
    args = (
        nnx.state(trainer.model),
        nnx.state(trainer.optimizer),
        nnx.state(trainer.reference_model),
        batch,
    )
    flops = common.compiled_flops(trainer._step_fn, *args, 1)
    t = common.time_fn(lambda: trainer.train_step(batch), warmup=2, repeats=5)
    tokens = W1.batch_size * (W1.prompt_length + W1.completion_length)
    achieved = flops / t["median_s"]
    rows = [
        {
            "benchmark": "W1 train_step (policy fwd+bwd, reference fwd, AdamW)",
            "value": f"{t['median_s'] * 1e3:.0f} ms",
            "detail": f"{tokens / t['median_s']:.0f} tok/s, {flops / 1e9:.1f} GFLOP/step",
        },
        {
            "benchmark": "W1 train_step achieved FLOP/s",
            "value": f"{achieved / 1e9:.0f} GFLOP/s",
            "detail": (
                f"{100 * achieved / ctx['peak']:.0f}% of matmul peak" if "peak" in ctx else ""
            ),
        },
    ]
    ctx["w1_train_s"] = t["median_s"]
    return rows


@section("w1")
def bench_w1(ctx: dict) -> list[Row]:
    from artifex.generative_models.inference import generate

    trainer = build_trainer(W1)
    prompts = random_prompts(W1)
    key = jax.random.key(0)

    def gen():
        return generate(
            trainer.model,
            *prompts,
            key=key,
            num_generations=W1.num_generations,
            max_new_tokens=W1.completion_length,
            eos_ids=(),
        )

    t_gen = common.time_fn(gen, warmup=2, repeats=5)["median_s"]
    batch = trainer.prepare_batch(random_batch(W1))
    t_train = common.time_fn(lambda: trainer.train_step(batch), warmup=2, repeats=5)["median_s"]
    keys = iter(jax.random.split(jax.random.key(1), 100))
    t_step = common.time_fn(lambda: w1_step(trainer, W1, prompts, next(keys)), warmup=2, repeats=5)[
        "median_s"
    ]
    gen_tokens = W1.batch_size * W1.completion_length
    return [
        {
            "benchmark": "W1 generation (8 prompts x 4, 32 + 96 tokens, KV cache)",
            "value": f"{t_gen * 1e3:.0f} ms",
            "detail": f"{gen_tokens / t_gen:.0f} generated tok/s",
        },
        {
            "benchmark": "W1 training part (train_step, reference fwd, AdamW)",
            "value": f"{t_train * 1e3:.0f} ms",
            "detail": "",
        },
        {
            "benchmark": "W1 whole step (generate + reward + train_step)",
            "value": f"{t_step * 1e3:.0f} ms",
            "detail": "target < 900 ms (TRL / Tunix: about 1800-1900 ms on this machine)",
        },
    ]


@section("logprob_memory")
def bench_logprob_memory(ctx: dict) -> list[Row]:
    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
    from artifex.generative_models.training import GRPOConfig
    from artifex.generative_models.training.rl import GRPOBatch, causal_lm_log_probs_fn
    from artifex.generative_models.training.rl.grpo import make_grpo_loss

    b, p, t, v = 8, 16, 1024, 151_936
    cfg = CausalLMConfig.qwen2_w1(
        vocab_size=v,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
    )
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    batch = GRPOBatch(
        prompt_ids=jnp.ones((b, p), jnp.int32),
        prompt_mask=jnp.ones((b, p), jnp.int32),
        completion_ids=jnp.ones((b, t), jnp.int32),
        completion_mask=jnp.ones((b, t), jnp.int32),
        rewards=jnp.arange(b, dtype=jnp.float32),
        group_size=4,
    )
    params = nnx.state(model, nnx.Param)
    rows, temps = [], {}
    for name, chunk in (("naive", b * t), ("chunked", None)):
        loss = make_grpo_loss(
            model, GRPOConfig(), log_prob_fn=causal_lm_log_probs_fn(chunk_size=chunk)
        )
        grad_fn = jax.jit(jax.grad(lambda prm, bt, f=loss: f(prm, bt)[0]))
        mem = common.compiled_memory(grad_fn, params, batch)
        temps[name] = mem["temp_bytes"]
        rows.append(
            {
                "benchmark": f"log-probs+grad peak temp memory, V=151936, 8x1024, {name}",
                "value": common.fmt_bytes(mem["temp_bytes"]),
                "detail": "",
            }
        )
    rows[-1]["detail"] = f"{temps['chunked'] / temps['naive']:.3f} of naive (target <= 0.125)"
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated sections")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(SECTIONS)
    unknown = set(names) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    if "peak" not in names:
        names = ["peak", *names]
    ctx: dict = {}
    rows: list[Row] = []
    print(f"machine: {common.machine()}", flush=True)
    for name in names:
        for row in SECTIONS[name](ctx):
            rows.append(row)
            print(f"| {row['benchmark']} | {row['value']} | {row.get('detail', '')} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": common.machine(), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
