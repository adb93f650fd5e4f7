"""The one Hugging Face directory per workload that every system under test loads.

``ensure_dir(workload, root)`` writes, once, ``root/<name>/``:

- ``config.json`` + ``model.safetensors``: random weights from a fixed seed (our
  ``CausalLM.save_pretrained``, the layout transformers reads), or, for W2, a copy-free link to a
  real checkpoint directory given with ``--w2-model``;
- ``tokenizer.json`` + ``tokenizer_config.json``: a word-level tokenizer over ``"<pad>"``,
  ``"<eos>"``, ``"t2"`` ... ``"t{V-1}"`` (the text ``"t17 t4"`` is the ids ``[17, 4]``), so the
  peers' text-based APIs see exactly the prompt ids we use;
- ``prompts.json``: the prompt token ids (every prompt exactly ``prompt_length`` tokens) and, for
  a real tokenizer, their text;
- ``workload.json``: the settings every runner reads (prompts, generations, lengths, beta,
  learning rate).

W1: Qwen2-shaped (vocab 4096, width 256, 4 layers, 4 q / 2 kv heads of 64, MLP 768, tied, q/k/v
biases, RoPE 1e6), 8 prompts x 4 generations, 32 + 96 tokens, beta 0.04, AdamW 1e-5.
W2: SmolLM2-135M-Instruct's shape (Llama, vocab 49152, width 576, 30 layers, 9 q / 3 kv heads of
64, MLP 1536, tied, RoPE 1e5), 4 prompts x 4 generations, 48 + 64 tokens, beta 0.04, AdamW 1e-6.
Q05: Qwen2.5-0.5B's shape (vocab 151936, width 896, 24 layers, 14 q / 2 kv heads of 64, MLP 4864,
tied, q/k/v biases, RoPE 1e6), 8 prompts x 8 generations, 256 + 512 tokens, beta 0.04, AdamW
1e-6: the accelerator workload of ``docs/benchmarks.md`` (about 140 TFLOP per update, 8 N T with
each prompt encoded once per group, T = 34,816 tokens; far too much for a 2-core CPU).
Long: Qwen2.5-1.5B's shape (vocab 151936, width 1536, 28 layers, 12 q / 2 kv heads of 128, MLP
8960, tied, q/k/v biases, RoPE 1e6), 8 prompts x 8 generations, 256 + 2,048 tokens, beta 0.04,
AdamW 1e-6: the long-completion workload of ``benchmarks/accelerator.py`` (bf16, rematerialized).
G3-1B: Gemma 3 1B's shape (vocab 262144, width 1152, 26 layers, 4 q / 1 kv heads of 256, MLP
6912, five sliding-window layers to one global), bfloat16, 2 prompts x 4, 32 + 32 tokens, beta
0.04, AdamW 1e-6. MoE-S: a small Qwen3-MoE (vocab 4096, width 256, 4 layers, 16 experts of 256,
4 per token), W1's batch.
"""

from __future__ import annotations

import json
import os

import numpy as np

WORKLOADS: dict[str, dict] = {
    "w1": {
        "name": "W1",
        "num_prompts": 8,
        "num_generations": 4,
        "prompt_length": 32,
        "completion_length": 96,
        "beta": 0.04,
        "learning_rate": 1e-5,
        "seed": 0,
        "model": {
            "model_type": "qwen2",
            "vocab_size": 4096,
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "max_position_embeddings": 2048,
        },
    },
    "w2": {
        "name": "W2",
        "num_prompts": 4,
        "num_generations": 4,
        "prompt_length": 48,
        "completion_length": 64,
        "beta": 0.04,
        "learning_rate": 1e-6,
        "seed": 0,
        "model": {
            "model_type": "llama",
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_layers": 30,
            "num_heads": 9,
            "num_kv_heads": 3,
            "head_dim": 64,
            "rope_theta": 100_000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "max_position_embeddings": 8192,
        },
    },
    "q05": {
        "name": "Q05",
        "num_prompts": 8,
        "num_generations": 8,
        "prompt_length": 256,
        "completion_length": 512,
        "beta": 0.04,
        "learning_rate": 1e-6,
        "seed": 0,
        "model": {
            "model_type": "qwen2",
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_layers": 24,
            "num_heads": 14,
            "num_kv_heads": 2,
            "head_dim": 64,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "max_position_embeddings": 32768,
        },
    },
    "long": {
        "name": "Long",
        "num_prompts": 8,
        "num_generations": 8,
        "prompt_length": 256,
        "completion_length": 2048,
        "beta": 0.04,
        "learning_rate": 1e-6,
        "seed": 0,
        "model": {
            "model_type": "qwen2",
            "vocab_size": 151936,
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_layers": 28,
            "num_heads": 12,
            "num_kv_heads": 2,
            "head_dim": 128,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "max_position_embeddings": 32768,
        },
    },
    "g3": {
        # Gemma 3 1B's shape (google/gemma-3-1b-it's config.json): five sliding-window layers
        # (window 512, RoPE 1e4) to one global layer (RoPE 1e6), query_pre_attn_scalar 256,
        # GELU-tanh MLP, (1 + w) norms, embeddings scaled by sqrt(width), tied. bfloat16 for
        # every system (a float32 policy, reference and AdamW state would not fit beside the
        # peer's on a 24 GB machine), and a small batch: 2 prompts x 4, 32 + 32 tokens.
        "name": "G3-1B",
        "num_prompts": 2,
        "num_generations": 4,
        "prompt_length": 32,
        "completion_length": 32,
        "beta": 0.04,
        "learning_rate": 1e-6,
        "seed": 0,
        "dtype": "bfloat16",
        "model": {
            "model_type": "gemma3_text",
            "vocab_size": 262144,
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_layers": 26,
            "num_heads": 4,
            "num_kv_heads": 1,
            "head_dim": 256,
            "hidden_act": "gelu_pytorch_tanh",
            "rope_theta": 1_000_000.0,
            "rope_local_theta": 10_000.0,
            "sliding_window": 512,
            "query_pre_attn_scalar": 256.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "qk_norm": True,
            "max_position_embeddings": 32768,
        },
    },
    "moe": {
        # A small Qwen3-MoE (Qwen3-30B-A3B's design at W1's scale): 16 experts of width 256 per
        # layer, 4 per token, normalized top-k weights, q/k norms; W1's batch.
        "name": "MoE-S",
        "num_prompts": 8,
        "num_generations": 4,
        "prompt_length": 32,
        "completion_length": 96,
        "beta": 0.04,
        "learning_rate": 1e-5,
        "seed": 0,
        "model": {
            "model_type": "qwen3_moe",
            "vocab_size": 4096,
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "qk_norm": True,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 256,
            "norm_topk_prob": True,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "max_position_embeddings": 2048,
        },
    },
}

PAD, EOS = 0, 1

# Chat prompts for a real W2 checkpoint (its own tokenizer and chat template).
_QUESTIONS = (
    "What is 17 + 25? Think step by step, then give the answer as a number.",
    "A train travels 60 km in 45 minutes. What is its speed in km/h? Show your work.",
    "Name three prime numbers greater than 20 and explain why each one is prime.",
    "If a rectangle has sides 7 cm and 12 cm, what are its area and its perimeter?",
)


def _word_level_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from artifex.generative_models.models.causal_lm import Tokenizer

    vocab = {"<pad>": PAD, "<eos>": EOS}
    vocab.update({f"t{i}": i for i in range(2, vocab_size)})
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, eos_token="<eos>", pad_token="<pad>", unk_token="<pad>")


def _random_prompts(spec: dict, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(spec["seed"] + 1)
    ids = rng.integers(2, vocab_size, (spec["num_prompts"], spec["prompt_length"]))
    return ids.tolist()


def _chat_prompts(model_dir: str, spec: dict) -> tuple[list[list[int]], list[str]]:
    """Chat-template prompts cut or left-filled to exactly ``prompt_length`` tokens."""
    from artifex.generative_models.models.causal_lm import Tokenizer

    tok = Tokenizer.from_pretrained(model_dir)
    p = spec["prompt_length"]
    ids_all, texts = [], []
    for q in _QUESTIONS[: spec["num_prompts"]]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) > p:
            ids = ids[-p:]  # keep the end: the generation prompt
        # Left-fill with copies of the first token so every prompt is exactly p tokens long.
        ids = [ids[0]] * (p - len(ids)) + ids
        ids_all.append([int(i) for i in ids])
        texts.append(tok.decode(ids, skip_special_tokens=False))
    return ids_all, texts


def ensure_dir(name: str, root: str, *, real_model: str | None = None) -> str:
    """Writes (once) and returns the workload directory ``root/<name>``.

    Args:
        name: A key of ``WORKLOADS`` ("w1", "w2", "q05", "long", or one added by a caller).
        root: Parent directory.
        real_model: For W2, a Hugging Face directory with real weights and tokenizer (its files
            are symlinked into the workload directory); None writes random weights.

    Returns:
        The directory path.
    """
    spec = WORKLOADS[name]
    tag = name if real_model is None else f"{name}-real"
    path = os.path.join(root, tag)
    done = os.path.join(path, "workload.json")
    if os.path.exists(done):
        return path
    os.makedirs(path, exist_ok=True)
    info = dict(spec)
    if real_model is None:
        import jax  # noqa: F401  (imported before flax, for the CPU default)
        from flax import nnx

        from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig

        # G3-1B's weights are stored in bfloat16, the dtype every system runs it in.
        cfg = CausalLMConfig(**spec["model"], param_dtype=spec.get("dtype", "float32"))
        model = CausalLM(cfg, rngs=nnx.Rngs(spec["seed"]))
        model.save_pretrained(path)
        tok = _word_level_tokenizer(cfg.vocab_size)
        tok.save_pretrained(path)
        prompts, texts = _random_prompts(spec, cfg.vocab_size), None
        info["weights"] = f"random (CausalLM init, seed {spec['seed']})"
        info["tokenizer"] = "word-level t<id>"
    else:
        real = os.path.abspath(real_model)
        for f in os.listdir(real):
            os.symlink(os.path.join(real, f), os.path.join(path, f))
        prompts, texts = _chat_prompts(real, spec)
        info["weights"] = f"checkpoint {real}"
        info["tokenizer"] = "the checkpoint's"
    with open(os.path.join(path, "prompts.json"), "w") as fh:
        json.dump({"ids": prompts, "text": texts}, fh)
    with open(done, "w") as fh:
        json.dump(info, fh, indent=2)
    return path
