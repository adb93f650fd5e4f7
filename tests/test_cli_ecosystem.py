"""artifex-grpo train with a reward model (--reward-model) and a PEFT adapter (--adapter-output)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from artifex.cli import build_parser, main
from artifex.cli_checks import run_fingerprint
from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.models.causal_lm import CausalLM, read_peft_adapter
from artifex.generative_models.models.causal_lm.peft_io import load_peft_adapter

RM = os.path.join(os.path.dirname(__file__), "fixtures", "reward_models", "qwen2_rm")

ARGS = [
    "--num-steps",
    "1",
    "--prompts-per-step",
    "2",
    "--num-generations",
    "2",
    "--max-new-tokens",
    "4",
    "--progress",
    "false",
    "--learning-rate",
    "1e-2",
]


@pytest.fixture()
def model_dir(tmp_path):
    tok = demo_tokenizer()
    path = tmp_path / "model"
    demo_model(tok).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


@pytest.fixture()
def data_file(tmp_path):
    rows, _ = addition_dataset(num_eval=4)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows[:8]))
    return str(path)


def _metrics(tmp_path) -> list[dict]:
    with open(tmp_path / "out" / "logs" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_reward_model_mixes_with_a_rule_reward_by_weight(tmp_path, model_dir, data_file):
    out = str(tmp_path / "out" / "model")
    rc = main(
        [
            "train", "--model", model_dir, "--data", data_file, "--output", out,
            "--reward", "math", "--reward-model", RM, "--reward-weights", "1.0", "0.5",
            "--reward-model-batch-size", "3", "--checkpoint-dir", "none", *ARGS,
        ]
    )  # fmt: skip
    assert rc == 0
    rows = [r for r in _metrics(tmp_path) if "rewards/reward_model" in r]
    assert rows, "the reward model's mean reward is logged"
    assert np.isfinite(rows[0]["rewards/reward_model"])
    assert "rewards/math_answer_reward" in rows[0] or any("math" in k for k in rows[0])
    CausalLM.from_pretrained(out)  # the merged (here: full) model was written


def test_reward_model_alone_and_a_peft_adapter_without_the_merged_model(
    tmp_path, model_dir, data_file
):
    out = tmp_path / "out" / "model"
    adapter = tmp_path / "adapter"
    rc = main(
        [
            "train", "--model", model_dir, "--data", data_file, "--output", str(out),
            "--reward-model", RM, "--reward-model-normalize", "running",
            "--lora-rank", "2", "--lora-alpha", "4", "--lora-targets", "q_proj", "v_proj",
            "--adapter-output", str(adapter), "--save-merged", "false",
            "--checkpoint-dir", "none", *ARGS,
        ]
    )  # fmt: skip
    assert rc == 0
    assert not (out / "model.safetensors").exists()
    config, tensors = read_peft_adapter(adapter)
    assert (config.rank, config.alpha, config.target_modules) == (2, 4.0, ("q_proj", "v_proj"))
    with open(adapter / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == model_dir
    assert any(np.abs(t).max() > 0 for k, t in tensors.items() if "lora_B" in k)  # trained


def test_the_adapter_and_the_merged_model_are_the_same_function(tmp_path, model_dir, data_file):
    out = tmp_path / "out" / "model"
    adapter = tmp_path / "adapter"
    rc = main(
        [
            "train", "--model", model_dir, "--data", data_file, "--output", str(out),
            "--reward", "math", "--lora-rank", "2", "--adapter-output", str(adapter),
            "--checkpoint-dir", "none", *ARGS,
        ]
    )  # fmt: skip
    assert rc == 0
    merged = CausalLM.from_pretrained(str(out))
    with_adapter = load_peft_adapter(CausalLM.from_pretrained(model_dir), adapter)
    ids = np.array([[1, 5, 6, 14, 7, 15]], np.int32)
    np.testing.assert_allclose(
        np.asarray(with_adapter(ids)), np.asarray(merged(ids)), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "needs at least one --reward or a --reward-model"),
        (["--reward", "math", "--adapter-output", "a"], "needs --lora-rank > 0"),
        (["--reward", "math", "--lora-rank", "2", "--save-merged", "false"],
         "give --adapter-output"),
        (["--reward-model", "/nonexistent/rm"], "--reward-model directory not found"),
        (["--reward", "math", "--reward-model", RM, "--reward-weights", "1"],
         "1 values for 2 --reward functions and --reward-model"),
    ],
)  # fmt: skip
def test_option_errors(tmp_path, model_dir, data_file, capsys, extra, message):
    out = str(tmp_path / "out" / "model")
    rc = main(["train", "--model", model_dir, "--data", data_file, "--output", out,
               "--checkpoint-dir", "none", *ARGS, *extra])  # fmt: skip
    assert rc == 2
    assert message in capsys.readouterr().err


def test_a_resume_compares_the_reward_model_settings():
    base = ["train", "--model", RM, "--data", "d.jsonl", "--reward-model", RM]
    plain = run_fingerprint(build_parser().parse_args(base), 10)["rewards"]
    affine = run_fingerprint(
        build_parser().parse_args([*base, "--reward-model-normalize", "affine"]), 10
    )["rewards"]
    assert plain["reward_model"]["normalize"] == "none"
    assert plain != affine
    without = run_fingerprint(build_parser().parse_args([*base[:5], "--reward", "math"]), 10)
    assert "reward_model" not in without["rewards"]  # older runs' fingerprints still match
