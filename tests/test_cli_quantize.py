"""``artifex-grpo train --quantize``: options, refusals, the quantized policy and its export."""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.cli_quantize import (
    add_options,
    apply_defaults,
    check_options,
    export_model,
    fingerprint,
    quantize_config,
    quantize_model,
)
from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.models.causal_lm import CausalLM, LoRAConfig, apply_lora


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_options(parser)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--rollout-engine", default="sampler")
    return parser.parse_args(list(argv))


def test_options_parse():
    args = parse()
    assert args.quantize == "none" and quantize_config(args) is None and fingerprint(args) == {}
    args = parse("--quantize", "int4", "--quantize-block-size", "32", "--lora-rank", "4")
    check_options(args)
    config = quantize_config(args)
    assert (config.qtype, config.block_size) == ("int4", 32)
    assert fingerprint(args) == {"quantize": {"qtype": "int4", "block_size": 32}}
    args = parse("--quantize", "nf4", "--quantize-block-size", "column", "--lora-rank", "4")
    assert quantize_config(args).block_size is None
    assert quantize_config(parse("--quantize", "int8")).block_size == 64  # QLoRA's default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--quantize", "fp4"], "invalid choice"),
        (["--quantize", "nf4", "--quantize-block-size", "33"], "expected an even number"),
        (["--quantize", "nf4", "--quantize-block-size", "x"], "expected an even number"),
    ],
)
def test_bad_values_are_parse_errors(argv, message):
    with pytest.raises(argparse.ArgumentError, match=message):
        parse(*argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--quantize-block-size", "32"], "applies to --quantize int8|int4|nf4 only"),
        (["--quantize", "nf4"], "needs LoRA adapters"),
        (
            ["--quantize", "int8", "--lora-rank", "2", "--rollout-engine", "vllm"],
            "not --rollout-engine vllm",
        ),
    ],
)
def test_refusals_before_loading(argv, message):
    with pytest.raises(ValueError, match=message):
        check_options(parse(*argv))


def test_quantizing_scans_the_layers_unless_told_otherwise():
    def scan(**given):
        args = argparse.Namespace(quantize="nf4", quantize_block_size=None)
        for key, value in given.items():
            setattr(args, f"GRPOConfig.{key}", value)
        apply_defaults(args)
        return getattr(args, "GRPOConfig.scan_layers", None)

    assert scan() is True
    assert scan(scan_layers=False) is False  # --scan-layers false is kept
    assert scan(remat_every=2) is None and scan(layerwise_update=True) is None
    args = argparse.Namespace(quantize="none", quantize_block_size=None)
    apply_defaults(args)
    assert not hasattr(args, "GRPOConfig.scan_layers")


def test_without_qwix_the_check_names_the_extra(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"artifex-grpo\[quantize\]"):
        check_options(parse("--quantize", "nf4", "--lora-rank", "2"))


def test_quantize_then_export_the_trained_function():
    pytest.importorskip("qwix", reason="the [quantize] extra (qwix) is not installed")
    model = demo_model(demo_tokenizer())
    model = quantize_model(parse("--quantize", "nf4", "--lora-rank", "2"), model)
    assert model.layers[0].mlp.down_proj.qtype == "nf4"
    assert model.scan_layers  # the sampler dequantizes one layer at a time
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(1))
    for layer in model.layers:  # "trained" adapters
        layer.attn.q_proj.lora.lora_b.set_value(jnp.full_like(layer.attn.q_proj.lora.lora_b, 0.1))
    ids = jnp.array([[1, 5, 6, 14, 7, 15]])
    exported = export_model(model)
    assert isinstance(exported, CausalLM) and exported.layers[0].attn.q_proj.lora is None
    np.testing.assert_allclose(np.asarray(exported(ids)), np.asarray(model(ids)), atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple of block_size 128"):
        quantize_model(
            parse("--quantize", "int8", "--quantize-block-size", "128"),
            demo_model(demo_tokenizer()),
        )


@pytest.mark.slow
def test_train_command_with_a_quantized_base(tmp_path, capsys):
    pytest.importorskip("qwix", reason="the [quantize] extra (qwix) is not installed")
    from artifex.cli import build_parser, main

    try:
        build_parser().parse_args(["train", "--model", "m", "--data", "d", "--quantize", "nf4"])
    except SystemExit:
        pytest.skip("artifex-grpo train has no --quantize option yet (artifex.cli_quantize)")
    capsys.readouterr()
    tok = demo_tokenizer()
    model_dir = str(tmp_path / "model")
    demo_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in addition_dataset(num_eval=8)[0][:16]))
    out = str(tmp_path / "out" / "model")
    common = ["train", "--model", model_dir, "--data", str(data), "--output", out,
              "--reward", "math", "--reward", "tests.spread_reward:text_reward",
              "--num-steps", "1", "--prompts-per-step", "2", "--num-generations", "4",
              "--max-new-tokens", "4", "--progress", "false",
              "--learning-rate", "1e-2"]  # fmt: skip
    assert main([*common, "--quantize", "nf4"]) == 2  # no --lora-rank: refused, nothing run
    assert "needs LoRA adapters" in capsys.readouterr().err
    assert main([*common, "--lora-rank", "2", "--quantize", "nf4"]) == 0
    trained = CausalLM.from_pretrained(out)  # the export: full precision, adapters merged
    assert isinstance(trained.layers[0].attn.q_proj.kernel, nnx.Param)
    base = CausalLM.from_pretrained(model_dir)
    ids = np.array([[1, 5, 6, 14, 7, 15]], np.int32)
    assert not np.allclose(np.asarray(trained(ids)), np.asarray(base(ids)))
