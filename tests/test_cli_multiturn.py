"""The artifex-grpo command with tools or an environment (multi-turn episodes)."""

from __future__ import annotations

import json
import os

import pytest

from artifex.cli import import_object, main
from artifex.demos.addition import demo_model
from artifex.demos.tools import multiplication_dataset, multiply, tool_demo_tokenizer


@pytest.fixture()
def setup(tmp_path):
    tok = tool_demo_tokenizer()
    model = demo_model(tok, 0, max_positions=160)
    path = tmp_path / "model"
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    rows, _ = multiplication_dataset(num_eval=2, size=8)
    data = tmp_path / "train.jsonl"
    with open(data, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return str(path), str(data)


ARGS = [
    "--reward", "math", "--num-steps", "1", "--prompts-per-step", "2", "--num-generations",
    "2", "--max-new-tokens", "8", "--progress", "false", "--max-turns", "2",
]  # fmt: skip


@pytest.mark.slow
def test_train_with_tools_and_with_an_environment(tmp_path, setup):
    model_dir, data = setup
    out = str(tmp_path / "out" / "model")
    rc = main(["train", "--model", model_dir, "--data", data, "--output", out,
               "--tools", "artifex.demos.tools:multiply", *ARGS])  # fmt: skip
    assert rc == 0
    with open(os.path.join(tmp_path, "out", "logs", "metrics.jsonl")) as fh:
        lines = fh.read().splitlines()
    metrics = json.loads(lines[-1])
    assert "multiturn/turns_mean" in metrics and "multiturn/tool_calls_mean" in metrics
    env_module = tmp_path / "my_env_mod.py"
    env_module.write_text(
        "class Echo:\n"
        "    def reset(self, row):\n"
        "        return [{'role': 'user', 'content': row['prompt']}]\n"
        "    def step(self, text):\n"
        "        return None, 1.0, True\n"
    )
    os.chdir(tmp_path)
    rc = main(["train", "--model", model_dir, "--data", data, "--output", out + "2",
               "--environment", "my_env_mod:Echo", *ARGS])  # fmt: skip
    assert rc == 0


def test_import_object_and_errors(tmp_path, setup, capsys):
    assert import_object("artifex.demos.tools:multiply") is multiply
    with pytest.raises(ValueError, match="module:attribute"):
        import_object("artifex.demos.tools")
    with pytest.raises(ValueError, match="no attribute"):
        import_object("artifex.demos.tools:nope")
    model_dir, data = setup
    rc = main(["train", "--model", model_dir, "--data", data,
               "--tools", "artifex.demos.tools:multiply",
               "--environment", "artifex.demos.tools:multiply", *ARGS])  # fmt: skip
    assert rc == 2 and "not both" in capsys.readouterr().err
