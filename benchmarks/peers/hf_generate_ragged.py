"""The ragged workload's rollout with Hugging Face ``model.generate``, as TRL's GRPOTrainer runs it.

Run in the TRL venv (``benchmarks/peers/README.md``), not in the project's Python;
``benchmarks/ragged.py`` starts it with the same flags as its own rollout:

    /tmp/artifex-peers/trl/bin/python benchmarks/peers/hf_generate_ragged.py --vocab 8192 \
        --hidden 384 --mlp 1024 --layers 4 --heads 6 --kv-heads 2 --head-dim 64 \
        --prompts 16 --k 8 --prompt-length 48 --max-new 1024 --min-new 16 --median 100

The model is transformers' ``LlamaForCausalLM`` of the same shape as ours (random weights, fp32,
tied embeddings); the prompts are the same ids (``numpy.random.default_rng(0)``), each repeated
``--k`` times (prompt-major), left-padded as TRL pads them. ``model.generate`` runs as TRL's
regular (non-vLLM) path calls it: sampling at temperature 1, no top-k / top-p, the KV cache,
``disable_compile=True``; it stops when every row has ended. A logits processor applies the
workload's end-of-sequence rule (``benchmarks/ragged.py``): the end token is impossible before
``--min-new`` tokens and has probability ``hazard(--median, --min-new)`` at every later step, so
completion lengths follow the same distribution as ours (other random numbers).

Each timed call is one ``generate`` of all ``prompts x k`` completions, after one warm-up call,
with the CPU other processes used meanwhile (``benchmarks/cleanwin.py``). The last line printed
is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cleanwin
import numpy as np
import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessor

EOS, PAD = 1, 0


def hazard(median: float, min_new: int) -> float:
    """Per-step end probability: median length ``median``, ending from token ``min_new``."""
    return 1.0 - 0.5 ** (1.0 / (median - min_new + 1))


class RaggedEOS(LogitsProcessor):
    """The end token: impossible before ``min_new`` tokens, probability ``p`` after."""

    def __init__(self, prompt_width: int, min_new: int, p: float):
        self.prompt_width, self.min_new = prompt_width, min_new
        self.log_odds = math.log(p / (1 - p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_width  # index of the token being drawn
        scores = scores.clone()
        if generated < self.min_new - 1:
            scores[:, EOS] = -math.inf
        else:
            others = scores.clone()
            others[:, EOS] = -math.inf
            scores[:, EOS] = torch.logsumexp(others, dim=-1) + self.log_odds
        return scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("vocab", 8192), ("hidden", 384), ("mlp", 1024), ("layers", 4), ("heads", 6),
        ("kv-heads", 2), ("head-dim", 64), ("prompts", 16), ("k", 8), ("prompt-length", 48),
        ("max-new", 1024), ("min-new", 16), ("windows", 2), ("max-retries", 2),
    ):  # fmt: skip
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--median", type=float, default=100.0)
    parser.add_argument("--clean", type=float, default=0.05)
    args = parser.parse_args(argv)

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        rope_theta=100_000.0,
        tie_word_embeddings=True,
        max_position_embeddings=args.prompt_length + args.max_new + 64,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=None,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, args.vocab, (args.prompts, args.prompt_length))
    ids = torch.as_tensor(np.repeat(prompts, args.k, axis=0), dtype=torch.long)
    mask = torch.ones_like(ids)
    gen = GenerationConfig(
        max_new_tokens=args.max_new,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        pad_token_id=PAD,
        eos_token_id=EOS,
        disable_compile=True,
    )
    processors = [RaggedEOS(ids.shape[1], args.min_new, hazard(args.median, args.min_new))]

    def call(seed: int) -> tuple[int, list[int]]:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=gen,
                logits_processor=processors,
            )  # fmt: skip
        completion = out[:, ids.shape[1] :]
        is_eos = completion == EOS
        ended = is_eos.any(1)
        lengths = torch.where(ended, is_eos.int().argmax(1) + 1, completion.shape[1])
        return int(lengths.sum()), lengths.tolist()

    t = time.perf_counter()
    call(10_000)
    print(f"# warm-up: {time.perf_counter() - t:.1f} s", flush=True)
    runs, clean = [], 0
    for attempt in range(args.windows + args.max_retries):
        t0 = cleanwin.snapshot()
        tokens, lengths = call(attempt)
        t1 = cleanwin.snapshot()
        other = cleanwin.other_fraction(t0, t1)
        ok = other <= args.clean
        clean += ok
        runs.append(
            dict(seconds=t1[0] - t0[0], other=other, cpu=(t1[2] - t0[2]) / cleanwin.HZ,
                 tokens=tokens, longest=max(lengths), clean=ok, window=attempt)
        )  # fmt: skip
        print(
            f"# window {attempt + 1}: {runs[-1]['seconds']:.2f} s, {100 * other:.0f}% other, "
            f"{tokens} tokens, longest {max(lengths)}" + ("" if ok else "  [noisy]"),
            flush=True,
        )
        if clean >= args.windows:
            break
    versions = dict(torch=torch.__version__, transformers=transformers.__version__)
    print("RESULT " + json.dumps({"runs": runs, "versions": versions}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
