"""artifex-grpo train --rollout-engine / --vllm-option: parsing and refusals (no vLLM needed).

The runs with vLLM itself are in tests/generative_models/inference/test_vllm_engine.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from artifex.cli import build_parser, main
from artifex.cli_engines import parse_vllm_option
from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


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


def test_vllm_options_parse_as_json_else_text():
    assert parse_vllm_option("max_model_len=512") == ("max_model_len", 512)
    assert parse_vllm_option("gpu-memory-utilization=0.35") == ("gpu_memory_utilization", 0.35)
    assert parse_vllm_option("enforce_eager=true") == ("enforce_eager", True)
    assert parse_vllm_option("kv_cache_memory_bytes=1GiB") == ("kv_cache_memory_bytes", "1GiB")
    for bad in ("max_model_len", "=3", "not a name=3"):
        with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
            parse_vllm_option(bad)
    args = build_parser().parse_args(
        ["train", "--model", "m", "--data", "d", "--rollout-engine", "vllm",
         "--vllm-option", "max_model_len=256", "--vllm-option", "seed=3"]
    )  # fmt: skip
    assert args.rollout_engine == "vllm"
    assert args.vllm_option == [("max_model_len", 256), ("seed", 3)]
    assert build_parser().parse_args(["train", "--model", "m", "--data", "d"]).rollout_engine == (
        "sampler"
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--vllm-option", "seed=1"], "--vllm-option applies to --rollout-engine vllm only"),
        (["--rollout-engine", "vllm", "--vllm-option", "seed=1", "--vllm-option", "seed=2"],
         "--vllm-option seed is given more than once"),
        (["--rollout-engine", "vllm", "--tools", "tests.spread_reward:text_reward"],
         "--rollout-engine vllm samples single-turn rollouts"),
        (["--rollout-engine", "continuous", "--tools", "tests.spread_reward:text_reward"],
         "--rollout-engine continuous samples single-turn rollouts"),
        (["--packing-threshold", "1.5"],
         "--packing-threshold: expected a fraction from 0 to 1, got 1.5"),
    ],
)  # fmt: skip
def test_option_errors(tmp_path, model_dir, data_file, capsys, extra, message):
    out = str(tmp_path / "out" / "model")
    rc = main(["train", "--model", model_dir, "--data", data_file, "--output", out,
               "--reward", "math", "--num-steps", "1", "--checkpoint-dir", "none",
               "--progress", "false", *extra])  # fmt: skip
    assert rc == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: the engine would start")
def test_without_vllm_the_engine_says_how_to_install_it(tmp_path, model_dir, data_file, capsys):
    out = str(tmp_path / "out" / "model")
    rc = main(["train", "--model", model_dir, "--data", data_file, "--output", out,
               "--reward", "math", "--num-steps", "1", "--checkpoint-dir", "none",
               "--progress", "false", "--rollout-engine", "vllm"])  # fmt: skip
    assert rc != 0
    assert "artifex-grpo[vllm]" in capsys.readouterr().err


def test_continuous_batching_and_packing_from_the_command_line(
    tmp_path, model_dir, data_file, monkeypatch
):
    # --rollout-engine continuous samples every rollout with continuous batching, and
    # --packing-threshold 0 packs every update's batch; the run trains and saves its model.
    import artifex.generative_models.inference.continuous as continuous
    import artifex.generative_models.training.rl.update.trainer_batches as trainer_batches

    calls = {"continuous": 0, "packed": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        continuous, "generate_continuous", counted("continuous", continuous.generate_continuous)
    )
    monkeypatch.setattr(
        trainer_batches, "pack_batch", counted("packed", trainer_batches.pack_batch)
    )
    out = str(tmp_path / "out" / "model")
    rc = main(["train", "--model", model_dir, "--data", data_file, "--output", out,
               "--reward", "tests.spread_reward:text_reward", "--num-steps", "2",
               "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "6",
               "--checkpoint-dir", "none", "--progress", "false",
               "--rollout-engine", "continuous", "--packing-threshold", "0"])  # fmt: skip
    assert rc == 0
    assert calls == {"continuous": 2, "packed": 2}
    with open(f"{out}/config.json") as fh:
        assert json.load(fh)["vocab_size"] > 0
