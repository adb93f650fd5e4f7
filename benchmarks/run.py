"""Prints the performance table: ``python benchmarks/run.py [--only a,b] [--json FILE]``.

Every ratio is measured side by side in this one run on this one machine (the matmul peak
included), so a noisy shared machine moves both sides together. Sections:

- ``peak``: fp32 matmul FLOP/s (2048^3), the machine's practical peak.
- ``train_step``: W1's training part (one ``GRPOTrainer.train_step`` with reference forward),
  achieved FLOP/s from XLA's cost analysis against the peak.
- ``w1``: the W1 workload: generation, the training part and the whole step, timed apart.
- ``train_26m``: ``train_step`` of a ~26M-parameter Qwen2-shaped policy: tokens/s and FLOP/s.
- ``sampler``: KV-cache sampler against a naive cache-free loop (256 new tokens), and the gain
  of the shared prefill at K = 8.
- ``logprob_memory``: peak temporary memory of the compiled loss+gradient at vocabulary
  151,936 and B x T = 8 x 1024, chunked log-probs against naive full logits.
- ``fsdp_memory``: per-device parameter + optimizer bytes under FSDP over 1, 2, 4, 8 simulated
  devices (``benchmarks/sharding_memory.py`` in a subprocess, which needs 8 host devices).

Ours against TRL and Tunix (same weights, prompts and settings, clean timing windows) is
``benchmarks/honest.py``, not a section here.
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
from benchmarks.workloads import (
    Q26M,
    W1,
    build_trainer,
    random_batch,
    random_prompts,
    w1_step,
)

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
    flops = common.compiled_flops(trainer.compiled_step(), trainer.state, batch)
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
    t_step = common.time_fn(lambda: w1_step(trainer, W1, prompts, next(keys)), warmup=2, repeats=7)[
        "median_s"
    ]
    ctx["w1_step_s"] = t_step
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
            "detail": "median of 7 (against TRL and Tunix: benchmarks/honest.py)",
        },
    ]


@section("train_26m")
def bench_train_26m(ctx: dict) -> list[Row]:
    w = Q26M
    trainer = build_trainer(w)
    batch = trainer.prepare_batch(random_batch(w))
    flops = common.compiled_flops(trainer.compiled_step(), trainer.state, batch)
    t = common.time_fn(lambda: trainer.train_step(batch), warmup=2, repeats=3)["median_s"]
    tokens = w.batch_size * (w.prompt_length + w.completion_length)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param)))
    achieved = flops / t
    return [
        {
            "benchmark": f"train_step, {params / 1e6:.1f}M-param Qwen2-shaped policy (W1 batch)",
            "value": f"{tokens / t:.0f} tok/s",
            "detail": (
                f"{t * 1e3:.0f} ms, {achieved / 1e9:.0f} GFLOP/s = "
                f"{100 * achieved / ctx['peak']:.0f}% of matmul peak"
                if "peak" in ctx
                else ""
            ),
        }
    ]


@section("sampler")
def bench_sampler(ctx: dict) -> list[Row]:
    from artifex.generative_models.inference import generate

    trainer = build_trainer(W1)
    model = trainer.model
    prompts = random_prompts(W1)
    rows, new = W1.batch_size, 256
    key = jax.random.key(0)

    def ours():
        return generate(
            model,
            *prompts,
            key=key,
            num_generations=W1.num_generations,
            max_new_tokens=new,
            eos_ids=(),
            temperature=0.0,
        )

    t_ours = common.time_fn(ours, warmup=1, repeats=3)["median_s"]

    # Naive: every step runs the full model over a fixed (rows, P + N) buffer, no cache.
    ids = jnp.repeat(prompts[0], W1.num_generations, axis=0)
    mask = jnp.repeat(prompts[1], W1.num_generations, axis=0)
    p = ids.shape[1]
    buf = jnp.concatenate([ids, jnp.zeros((rows, new), jnp.int32)], axis=1)
    att = jnp.concatenate([mask, jnp.ones((rows, new), jnp.int32)], axis=1)
    graphdef, state = nnx.split(model)
    probe = 16

    @jax.jit
    def naive(state, buf):
        m = nnx.merge(graphdef, state)

        def body(i, buf):
            logits = m(buf, attention_mask=att)
            nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, p + i - 1, 1, False), -1)
            return jax.lax.dynamic_update_slice(buf, nxt[:, None].astype(jnp.int32), (0, p + i))

        return jax.lax.fori_loop(0, probe, body, buf)

    t_naive_step = (
        common.time_fn(lambda: naive(state, buf), warmup=1, repeats=3)["median_s"] / probe
    )
    ours_tps = rows * new / t_ours
    naive_tps = rows / t_naive_step

    # Shared prefill at K = 8: 4 long prompts (512 tokens), 8 generations each, 16 new tokens.
    long_ids = jax.random.randint(jax.random.key(3), (4, 512), 1, W1.model.vocab_size)

    def prefill(share):
        return generate(
            model,
            long_ids,
            key=key,
            num_generations=8,
            max_new_tokens=16,
            eos_ids=(),
            share_prefill=share,
        )

    t_shared = common.time_fn(lambda: prefill(True), warmup=1, repeats=3)["median_s"]
    t_unshared = common.time_fn(lambda: prefill(False), warmup=1, repeats=3)["median_s"]
    return [
        {
            "benchmark": f"sampler, {rows} rows x {new} new tokens (W1 model, KV cache)",
            "value": f"{ours_tps:.0f} tok/s",
            "detail": f"{t_ours * 1e3:.0f} ms",
        },
        {
            "benchmark": "naive loop without a cache, same model and rows",
            "value": f"{naive_tps:.0f} tok/s",
            "detail": (
                f"KV cache is {ours_tps / naive_tps:.1f}x faster (target >= 5x); naive timed "
                f"over {probe} steps of a fixed {p + new}-token forward"
            ),
        },
        {
            "benchmark": "shared prefill, 4 prompts x 512 tokens, K = 8, 16 new tokens",
            "value": f"{t_shared * 1e3:.0f} ms",
            "detail": f"prefilling every row instead: {t_unshared * 1e3:.0f} ms "
            f"({t_unshared / t_shared:.1f}x)",
        },
    ]


@section("logprob_memory")
def bench_logprob_memory(ctx: dict) -> list[Row]:
    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
    from artifex.generative_models.training import GRPOConfig
    from artifex.generative_models.training.rl import GRPOBatch, causal_lm_log_probs_fn
    from artifex.generative_models.training.rl.update.trainer import make_grpo_loss

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


@section("fsdp_memory")
def bench_fsdp_memory(ctx: dict) -> list[Row]:
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharding_memory.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, env=env, check=True
    ).stdout
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not set(cells[0]) <= {"-", " "}:
            if cells[0].lower() == "benchmark":
                continue
            rows.append(
                {
                    "benchmark": cells[0],
                    "value": cells[1],
                    "detail": cells[2] if len(cells) > 2 else "",
                }
            )
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
