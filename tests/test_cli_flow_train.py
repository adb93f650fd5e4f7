"""``artifex-grpo train`` with a flow model directory (artifex/cli_flow.py).

The command's parser has the flow options (artifex/cli.py) and ``train`` dispatches a flow model
directory to ``train_flow_command`` (artifex/cli_train.py): the end-to-end run goes through
``artifex.cli.main`` as ``artifex-grpo train`` does; the refusals call ``train_flow_command``
directly to see the exception itself.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from artifex import cli
from artifex.cli_flow import is_flow_model_dir, train_flow_command
from artifex.generative_models.flow import (
    FlowDiT,
    FlowDiTConfig,
    TextFlowDiT,
    TextFlowDiTConfig,
    brightness_reward,
    image_reward,
    load_flow_model,
    save_flow_model,
)
from artifex.generative_models.flow.text_encoder import TEXT_ENCODER

CFG = TextFlowDiTConfig(
    image_shape=(8, 8, 3), patch_size=4, hidden_dim=16, num_blocks=1, num_heads=2, time_features=8
)
REWARD = "artifex.generative_models.flow.rewards:compositional"
# a reward that differs within every group, so the tiny untrained model is updated
bright = image_reward(brightness_reward, name="bright")


def _parse(argv):
    return cli.build_parser().parse_args(["train", *argv])


def _run(argv):
    return train_flow_command(_parse(argv), load_rows=cli.load_rows, lr_schedule=cli.lr_schedule)


@pytest.fixture
def task(tmp_path):
    save_flow_model(TextFlowDiT(CFG, rngs=nnx.Rngs(0)), tmp_path / "base")
    rows = ["a red square", "two blue circles", "a green triangle", "three yellow squares"]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "a blue circle"}) + "\n")
    return tmp_path


def test_is_flow_model_dir(task):
    assert is_flow_model_dir(str(task / "base"))
    assert not is_flow_model_dir(str(pathlib.Path(__file__).parent / "fixtures" / "qwen2_tiny"))
    assert not is_flow_model_dir(str(task))
    (task / "odd").mkdir()
    (task / "odd" / "config.json").write_text("[1, 2]")
    assert not is_flow_model_dir(str(task / "odd"))


def test_a_flow_run_from_the_command_line(task, capsys):
    out = task / "run" / "model"
    argv = [
        "--model", str(task / "base"), "--data", str(task / "train.jsonl"),
        "--eval-data", str(task / "eval.jsonl"), "--reward", REWARD,
        "--reward", "tests.test_cli_flow_train:bright", "--reward-weights", "1", "0.5",
        "--num-generations", "2", "--prompts-per-step", "2", "--num-steps", "2",
        "--beta", "0.01", "--learning-rate", "1e-3", "--sde-steps", "4", "--window-size", "2",
        "--progress", "false", "--output", str(out),
    ]  # fmt: skip
    assert cli.main(["train", *argv]) == 0  # as `artifex-grpo train ...`
    assert "held-out pass@1" in capsys.readouterr().out
    trained = load_flow_model(out)
    assert trained.config == CFG
    base = load_flow_model(task / "base")
    moved = [
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(
            jax.tree.leaves(nnx.state(trained, nnx.Param)),
            jax.tree.leaves(nnx.state(base, nnx.Param)),
            strict=True,
        )
    ]
    assert max(moved) > 0
    logs = task / "run" / "logs"
    assert (logs / "images" / "eval_000002.png").exists()
    assert (task / "run" / "checkpoints").is_dir()
    metrics = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/compositional" in m and "rewards/bright" in m for m in metrics)
    # run again: the checkpoint of step 2 is the end, nothing to train
    assert cli.main(["train", *argv]) == 0


def test_a_frozen_text_encoder_stays_as_it_was(task):
    out = task / "run" / "model"
    argv = [
        "--model", str(task / "base"), "--data", str(task / "train.jsonl"),
        "--reward", "tests.test_cli_flow_train:bright", "--num-generations", "2",
        "--prompts-per-step", "2", "--num-steps", "2", "--beta", "0", "--learning-rate", "1e-3",
        "--sde-steps", "3", "--freeze-text-encoder", "--progress", "false", "--output", str(out),
    ]  # fmt: skip
    assert cli.main(["train", *argv]) == 0
    trained, base = load_flow_model(out), load_flow_model(task / "base")
    rest = nnx.All(nnx.Param, nnx.Not(TEXT_ENCODER))
    for which, same in ((TEXT_ENCODER, True), (rest, False)):
        pairs = zip(
            jax.tree.leaves(nnx.state(trained, which)),
            jax.tree.leaves(nnx.state(base, which)),
            strict=True,
        )
        assert all(np.array_equal(a, b) for a, b in pairs) == same


def test_freezing_needs_a_text_encoder(tmp_path):
    cfg = FlowDiTConfig(image_shape=(8, 8), patch_size=4, hidden_dim=16, num_blocks=1,
                        num_heads=2, num_classes=2, time_features=8)  # fmt: skip
    save_flow_model(FlowDiT(cfg, rngs=nnx.Rngs(0)), tmp_path / "digits")
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "0"}) + "\n")
    argv = [
        "--model", str(tmp_path / "digits"), "--data", str(tmp_path / "train.jsonl"),
        "--reward", REWARD, "--num-steps", "1", "--freeze-text-encoder",
        "--output", str(tmp_path / "run" / "model"),
    ]  # fmt: skip
    needs = r"--freeze-text-encoder \(--model .*digits\) needs a text-conditioned model"
    with pytest.raises(ValueError, match=needs):
        _run(argv)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        (["--lora-rank", "4"], ValueError, "--lora-rank is an option of language models"),
        (["--teacher-model", "x"], ValueError, "--teacher-model is an option of language"),
        (["--apply-chat-template"], ValueError, "--apply-chat-template is an option"),
        (["--mesh-fsdp", "2"], ValueError, "one device"),
        (["--reward", "math"], ValueError, "--reward math scores text"),
        (["--reward", "no_such_module_xyz:f"], ImportError, "cannot import no_such_module_xyz"),
        (["--reward", "math:no_such_function"], ValueError, "math has no no_such_function"),
        (["--window-size", "11"], ValueError, "window_size"),
    ],
)
def test_refusals_before_training(task, extra, error, match):
    argv = [
        "--model", str(task / "base"), "--data", str(task / "train.jsonl"),
        "--num-steps", "1", "--output", str(task / "run" / "model"),
    ]  # fmt: skip
    if not any(x == "--reward" for x in extra):
        argv += ["--reward", REWARD]
    with pytest.raises(error, match=match):
        _run(argv + extra)


def test_no_reward_is_refused(task):
    argv = ["--model", str(task / "base"), "--data", "x.jsonl", "--num-steps", "1"]
    with pytest.raises(ValueError, match="a flow run needs --reward"):
        _run(argv)


def test_flow_options_with_a_language_model_are_refused(tmp_path, capsys):
    llm = str(pathlib.Path(__file__).parent / "fixtures" / "qwen2_tiny")
    argv = ["train", "--model", llm, "--data", "x.jsonl",
            "--reward", "math", "--num-steps", "1", "--output", str(tmp_path / "m"),
            "--window-size", "2"]  # fmt: skip
    assert cli.main(argv) == 2
    assert "--window-size is an option of flow models" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_the_parser_has_the_flow_options():
    args = _parse(["--model", "m", "--data", "d", "--sde-steps", "6", "--window-size", "2"])
    assert (args.sde_steps, args.window_size, args.noise_level) == (6, 2, 0.7)
