"""Ragged completions: today's sampler and update against continuous batching and packing.

    python benchmarks/ragged.py                 # the CPU shape (flags below), with HF generate
    python benchmarks/ragged.py --w2            # W2's shape (benchmarks/hfdir.py)
    python benchmarks/ragged.py --windows 3 --json out.json
    python benchmarks/ragged.py --from-json out.json   # the table again, nothing measured

The workload: a causal LM (random weights, fixed seed) whose end-of-sequence logit is set at
every decoding step, so completion lengths are long-tailed and run from ``--min-new`` (16) to
``--max-new`` (1,024) new tokens with median ``--median`` (100): the end token cannot be drawn
before token ``--min-new`` and is drawn with probability
``p = 1 - 0.5 ** (1 / (median - min_new + 1))`` at every later step (its logit is set to the
log-sum-exp of the others plus ``log(p / (1 - p))``; sampling at temperature 1). A length is
then ``min_new - 1`` plus a geometric number of tokens, capped at ``max_new``. ``--prompts``
prompts (random ids, ``--prompt-length`` tokens) x ``--k`` completions each. The rule sits in a
thin wrapper around the model (:class:`RaggedEOS`): ``hidden_states`` appends each row's count of
generated tokens (read from its KV cache) to the hidden state and ``logits_from_hidden`` uses
it, so both samplers run it unchanged. The update scores the completions with the model
itself, which changes the log-prob values, not the work.

Measured, side by side in one process (the peer in its own):

- rollout: ``generate`` (today's sampler: a batch decodes until its longest row ends, with its
  default row groups) and ``generate_continuous`` (``--slots`` slots, ``--steps-per-call``); and,
  where the TRL virtual environment exists (``benchmarks/peers/README.md``), Hugging Face
  ``model.generate`` as TRL's GRPOTrainer calls it (``benchmarks/peers/hf_generate_ragged.py``,
  the same shape, prompts and end rule). Useful tokens are the completions' tokens (EOS
  included), not padding. Window ``w`` samples with key ``w`` (retries reuse the keys), so the
  windows see different lengths; both of ours see the same key;
- update: ``GRPOTrainer.train_step`` on the GRPOBatch of ``--update-prompts`` prompts of a
  continuous rollout as the rollout builds it (``--max-new`` completion columns: today's
  update), the same batch trimmed to its longest completion, and packed
  (``packing_threshold=0``). Useful tokens count each group's real prompt tokens once and the
  completion tokens.

Each window runs new, old, ..., old, new after warm-up calls (compilation is not timed; a
timed call that compiles is marked). Around every timed call the CPU share of other processes
is read from ``/proc/stat`` (``benchmarks/cleanwin.py``); a window where it is above
``--clean`` (5%) in any call is run again, up to ``--max-retries`` extra windows. The table
reports medians over the clean windows (over all when too few were clean; the table says
how many), their spread and the other processes' share; and, less sensitive to a machine
shared with other processes, useful tokens per CPU-second of the measured process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# W2 (benchmarks/hfdir.py): SmolLM2-135M's shape.
W2_SHAPE = dict(vocab=49152, hidden=576, mlp=1536, layers=30, heads=9, kv_heads=3, head_dim=64)
CPU_SHAPE = dict(vocab=8192, hidden=384, mlp=1024, layers=4, heads=6, kv_heads=2, head_dim=64)
EOS, PAD = 1, 0
TRL_PYTHON = os.environ.get("ARTIFEX_TRL_PYTHON", "/tmp/artifex-peers/trl/bin/python")


def hazard(median: float, min_new: int) -> float:
    """The per-step end probability that gives median length ``median`` (ending from ``min_new``).

    Args:
        median: The median completion length, ``> min_new - 1``.
        min_new: The shortest completion.

    Returns:
        ``p`` with ``1 - (1 - p) ** (median - min_new + 1) = 1 / 2``.
    """
    return 1.0 - 0.5 ** (1.0 / (median - min_new + 1))


def make_ragged(lm, prompt_length: int, min_new: int, p: float):
    """``lm`` with the workload's end-of-sequence rule, for the samplers (see the module text)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    log_odds = math.log(p / (1 - p))

    class RaggedEOS(nnx.Module):
        """``lm`` whose end token is impossible before ``min_new`` tokens, ``p`` likely after."""

        def __init__(self, lm):
            self.lm, self.config = lm, lm.config

        def init_cache(self, *a, **k):
            return self.lm.init_cache(*a, **k)

        def hidden_states(self, input_ids, attention_mask=None, positions=None, cache=None, **k):
            hidden, cache = self.lm.hidden_states(input_ids, attention_mask, positions, cache, **k)
            if cache is None:
                generated = jnp.zeros(hidden.shape[:1], hidden.dtype)
            else:  # real tokens in the row's cache, the prompt's excluded
                generated = cache.valid.sum(-1).astype(hidden.dtype) - prompt_length
            column = jnp.broadcast_to(generated[:, None, None], (*hidden.shape[:-1], 1))
            return jnp.concatenate([hidden, column], axis=-1), cache

        def logits_from_hidden(self, hidden):
            generated = hidden[..., -1]  # the index of the token these logits draw
            z = self.lm.logits_from_hidden(hidden[..., :-1])
            others = jax.nn.logsumexp(z.at[..., EOS].set(-jnp.inf), axis=-1)
            eos = jnp.where(generated >= min_new - 1, others + log_odds, -jnp.inf)
            return z.at[..., EOS].set(eos)

    return RaggedEOS(lm)


def build(args):
    """The model, its wrapper for the samplers, the prompts and the shape."""
    import numpy as np
    from flax import nnx

    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig

    shape = W2_SHAPE if args.w2 else {k: getattr(args, k) for k in CPU_SHAPE}
    config = CausalLMConfig(
        model_type="llama",
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["mlp"],
        num_layers=shape["layers"],
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        rope_theta=100_000.0,
        tie_word_embeddings=True,
        max_position_embeddings=args.prompt_length + args.max_new + 64,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    lm = CausalLM(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, config.vocab_size, (args.prompts, args.prompt_length))
    ragged = make_ragged(lm, args.prompt_length, args.min_new, hazard(args.median, args.min_new))
    return lm, ragged, prompts.astype(np.int32), shape


def timed(fn, counter):
    """(seconds, other processes' CPU share, own CPU seconds, compilations, result) of a call."""
    from benchmarks.cleanwin import HZ, other_fraction, snapshot

    counter["n"], counter["on"] = 0, True
    t0 = snapshot()
    out = fn()
    t1 = snapshot()
    counter["on"] = False
    return t1[0] - t0[0], other_fraction(t0, t1), (t1[2] - t0[2]) / HZ, counter["n"], out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--w2", action="store_true", help="W2's shape instead of the flags")
    for key, value in CPU_SHAPE.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--k", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-length", type=int, default=48)
    parser.add_argument("--max-new", type=int, default=1024)
    parser.add_argument("--min-new", type=int, default=16)
    parser.add_argument("--median", type=float, default=100.0)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--steps-per-call", type=int, default=32)
    parser.add_argument("--update-prompts", type=int, default=4)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--max-retries", type=int, default=2)
    parser.add_argument("--clean", type=float, default=0.05)
    parser.add_argument("--skip-rollout", action="store_true")
    parser.add_argument("--skip-update", action="store_true")
    parser.add_argument("--no-peer", action="store_true", help="skip HF generate")
    parser.add_argument("--json", default=None, help="write the records here")
    parser.add_argument("--from-json", default=None, help="print the table of saved records")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        print(_header(saved))
        _table(saved["results"])
        return 0
    if not args.min_new <= args.median - 1 or args.median >= args.max_new:
        parser.error("need --min-new < --median + 1 and --median < --max-new")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from artifex.generative_models.inference import generate, generate_continuous
    from artifex.generative_models.training.rl import (
        GRPOBatch,
        GRPOConfig,
        GRPOTrainer,
        PackedGRPOBatch,
    )
    from benchmarks.common import machine

    counter = {"n": 0, "on": False}

    def listen(event, duration, **kwargs):
        if counter["on"] and event == "/jax/core/compile/backend_compile_duration":
            counter["n"] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    started = datetime.datetime.now(datetime.UTC)
    lm, ragged, prompts, shape = build(args)
    settings = dict(num_generations=args.k, max_new_tokens=args.max_new, temperature=1.0)
    keys = [jax.random.key(w) for w in range(args.windows)]

    def old_rollout(w):
        out = generate(ragged, prompts, key=keys[w % len(keys)], **settings)
        return jax.block_until_ready(out)

    def new_rollout(w):
        out = generate_continuous(
            ragged, prompts, key=keys[w % len(keys)], num_slots=args.slots,
            steps_per_call=args.steps_per_call, **settings,
        )  # fmt: skip
        return jax.block_until_ready(out)

    record = {
        "args": vars(args), "started": started.isoformat(), "machine": machine(),
        "shape": shape, "hazard": hazard(args.median, args.min_new), "results": {},
        "lengths": {},
    }  # fmt: skip
    print("# " + _header(record), flush=True)
    results = record["results"]
    rollout = None
    if not args.skip_rollout:
        # Warm-up: every key for the continuous sampler (its width buckets follow the lengths),
        # one call of today's (one program whatever the lengths).
        for w in range(len(keys)):
            t = time.perf_counter()
            out = new_rollout(w)
            rollout = out if rollout is None else rollout
            record["lengths"][f"key {w}"] = np.asarray(out.lengths).tolist()
            print(f"# warm-up rollout/new key {w}: {time.perf_counter() - t:.1f} s", flush=True)
        t = time.perf_counter()
        old_rollout(0)
        print(f"# warm-up rollout/old: {time.perf_counter() - t:.1f} s", flush=True)
        fns = {"new": new_rollout, "old": old_rollout}
        rows = _windows(args, fns, _useful_rollout, counter)
        results.update({f"rollout/{k}": v for k, v in rows.items()})
        if not args.no_peer:
            peer = _peer(args, shape)
            if peer is not None:
                results["rollout/HF generate (TRL)"] = peer["runs"]
                record["peer_versions"] = peer["versions"]
    if rollout is None:
        rollout = new_rollout(0)
    lengths = np.asarray(rollout.lengths)
    print(
        "# completion lengths (key 0): min {}, p10 {:.0f}, median {:.0f}, p90 {:.0f}, max {}, "
        "truncated {}".format(
            lengths.min(), *np.percentile(lengths, [10, 50, 90]), lengths.max(),
            int(np.asarray(rollout.truncated).sum()),
        ),
        flush=True,
    )  # fmt: skip

    if not args.skip_update:
        n = args.update_prompts * args.k
        rng = np.random.default_rng(0)
        batch = GRPOBatch(
            prompt_ids=rollout.prompt_ids[:n],
            prompt_mask=rollout.prompt_mask[:n],
            completion_ids=rollout.completion_ids[:n],
            completion_mask=rollout.completion_mask[:n],
            rewards=jnp.asarray(rng.normal(size=n), jnp.float32),
            group_size=args.k,
        )
        longest = int(np.asarray(batch.completion_mask).sum(1).max())
        trimmed = batch.replace(
            completion_ids=batch.completion_ids[:, :longest],
            completion_mask=batch.completion_mask[:, :longest],
        )
        record["update_batch"] = dict(
            rows=n, prompt_width=int(batch.prompt_ids.shape[1]), columns=args.max_new,
            longest=longest, useful=_useful_update(batch),
        )  # fmt: skip
        trainers = {}
        for name, threshold in (("new", 0.0), ("old", None), ("trimmed", None)):
            model = nnx.clone(lm)
            nnx.update(model, jax.tree.map(lambda x: jnp.array(x, copy=True), nnx.state(model)))
            opt = nnx.Optimizer(model, optax.adamw(1e-6), wrt=nnx.Param)
            cfg = GRPOConfig(num_generations=args.k, beta=0.0)
            trainers[name] = GRPOTrainer(model, opt, cfg, packing_threshold=threshold)
        # What each update runs on: the packed rows (checked to be packed) and the padded ones.
        for name, b in (("new", batch), ("old", batch), ("trimmed", trimmed)):
            prepared = trainers[name].prepare_batch(b)
            slices = trainers[name].auto_microbatches(prepared)
            ran = trainers[name].maybe_pack(prepared, slices)
            if (name == "new") != isinstance(ran, PackedGRPOBatch):
                raise RuntimeError(f"update/{name}: packed is {isinstance(ran, PackedGRPOBatch)}")
            ids = ran.layout.input_source if name == "new" else ran.completion_ids
            width = ids.shape[1] + (0 if name == "new" else ran.prompt_ids.shape[1])
            record["update_batch"][f"{name}_positions"] = [int(ids.shape[0]), int(width)]
            record["update_batch"][f"{name}_microbatches"] = int(slices)
        fns = {
            "new": lambda w: trainers["new"].train_step(batch),
            "old": lambda w: trainers["old"].train_step(batch),
            "trimmed": lambda w: trainers["trimmed"].train_step(trimmed),
        }
        for name, fn in fns.items():
            t = time.perf_counter()
            fn(0)
            print(f"# warm-up update/{name}: {time.perf_counter() - t:.1f} s", flush=True)
        useful = record["update_batch"]["useful"]
        rows = _windows(args, fns, lambda _: useful, counter)
        results.update({f"update/{k}": v for k, v in rows.items()})

    print()
    _table(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1)
    return 0


def _header(record: dict) -> str:
    a = record["args"]
    shape = ", ".join(f"{k} {v}" for k, v in record["shape"].items())
    return (
        f"{record['machine']}; {record['started'][:16].replace('T', ' ')} UTC; shape: {shape}; "
        f"{a['prompts']} prompts x {a['k']}, prompt {a['prompt_length']} tokens, completions "
        f"{a['min_new']} to {a['max_new']} tokens, median {a['median']:g} (p(EOS) "
        f"{record['hazard']:.5f} per step); {a['slots']} slots, {a['steps_per_call']} steps per "
        f"call; update on {a['update_prompts']} prompts x {a['k']}"
    )


def _peer(args, shape) -> dict | None:
    """Runs HF generate in the TRL virtual environment; None where it is not installed."""
    if not os.path.exists(TRL_PYTHON):
        print(f"# HF generate: not installed ({TRL_PYTHON} missing)", flush=True)
        return None
    flags = {**shape, "prompts": args.prompts, "k": args.k, "prompt_length": args.prompt_length}
    flags.update(max_new=args.max_new, min_new=args.min_new, median=args.median)
    flags.update(windows=args.windows, max_retries=args.max_retries, clean=args.clean)
    cmd = [TRL_PYTHON, os.path.join(HERE, "peers", "hf_generate_ragged.py")]
    for k, v in flags.items():
        cmd += ["--" + k.replace("_", "-"), str(v)]
    print("# " + " ".join(cmd[1:]), flush=True)
    result = None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:  # printed as it comes
            if line.startswith("#"):
                print("# HF generate: " + line[2:].rstrip(), flush=True)
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        err = proc.stderr.read()
    if result is None:
        print(f"# HF generate failed (exit {proc.returncode}): {err[-2000:]}", flush=True)
    return result


def _useful_rollout(out) -> int:
    import numpy as np

    return int(np.asarray(out.lengths).sum())


def _useful_update(batch) -> int:
    import numpy as np

    g = batch.group_size
    return int(np.asarray(batch.prompt_mask)[::g].sum() + np.asarray(batch.completion_mask).sum())


def _windows(args, fns: dict, useful, counter) -> dict[str, list[dict]]:
    """Windows of ``new, old, ..., old, new`` (the others between), each call timed."""
    import numpy as np

    names = [n for n in fns if n != "new"]
    order = ["new", *names, *reversed(names), "new"]
    kept: dict[str, list[dict]] = {n: [] for n in fns}
    clean = 0
    for attempt in range(args.windows + args.max_retries):
        runs = []
        for name in order:
            seconds, other, cpu, compiles, out = timed(lambda f=fns[name], w=attempt: f(w), counter)
            lengths = getattr(out, "lengths", None)
            longest = None if lengths is None else int(np.asarray(lengths).max())
            runs.append((name, seconds, other, cpu, compiles, useful(out), longest))
        ok = max(r[2] for r in runs) <= args.clean and not any(r[4] for r in runs)
        clean += ok
        print(
            f"# window {attempt + 1}: "
            + ", ".join(
                f"{n} {s:.2f} s ({100 * o:.0f}% other{f', {c} compiles' if c else ''})"
                for n, s, o, _, c, _, _ in runs
            )
            + ("" if ok else "  [noisy]"),
            flush=True,
        )
        for name, seconds, other, cpu, compiles, tokens, longest in runs:
            rec = dict(seconds=seconds, other=other, cpu=cpu, tokens=tokens, compiles=compiles)
            if longest is not None:
                rec["longest"] = longest
            kept[name].append(dict(rec, clean=ok, window=attempt))
        if clean >= args.windows:
            break
    # The clean windows when there are enough, else all of them (the table says which).
    for name, runs in kept.items():
        good = [r for r in runs if r["clean"]]
        if len({r["window"] for r in good}) >= args.windows:
            kept[name] = good
    return kept


def _table(results: dict[str, list[dict]]) -> None:
    print(
        "| Run | Useful tokens/s, median (min-max) | Seconds, median | Longest completion, "
        "median | Other processes' CPU, median (max) | Calls (clean) | vs old | Tokens per "
        "own CPU-second | vs old |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        rates = [r["tokens"] / r["seconds"] for r in runs]
        med = statistics.median(rates)
        base_runs = results.get(name.split("/")[0] + "/old") or runs
        base = statistics.median(r["tokens"] / r["seconds"] for r in base_runs)
        others = [100 * r["other"] for r in runs]
        per_cpu = statistics.median(r["tokens"] / max(r["cpu"], 1e-9) for r in runs)
        base_cpu = statistics.median(r["tokens"] / max(r["cpu"], 1e-9) for r in base_runs)
        longest = [r["longest"] for r in runs if "longest" in r]
        cells = [
            name,
            f"{med:,.0f} ({min(rates):,.0f}-{max(rates):,.0f})",
            f"{statistics.median(r['seconds'] for r in runs):.2f}",
            f"{statistics.median(longest):.0f}" if longest else "",
            f"{statistics.median(others):.0f}% ({max(others):.0f}%)",
            f"{len(runs)} ({sum(r['clean'] for r in runs)})",
            f"{med / base:.2f}x",
            f"{per_cpu:,.0f}",
            f"{per_cpu / base_cpu:.2f}x",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
