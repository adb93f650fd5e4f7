"""The SmolLM2 addition recipe's task files and summary (the training itself is documented in
docs/recipes.md; it runs for minutes on a real checkpoint, so it is not a unit test)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_addition"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_task_rows_are_fixed_disjoint_and_correct(tmp_path):
    data = _load("data")
    train, held_out = data.rows()
    assert (len(train), len(held_out)) == (data.NUM_TRAIN, data.NUM_EVAL)
    pairs = []
    for row in train + held_out:
        (message,) = row["prompt"]
        assert message["role"] == "user"
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\? Reply with only the number\.",
                                     message["content"]).groups())  # fmt: skip
        assert 1 <= a <= 50 and 1 <= b <= 50 and row["answer"] == str(a + b)
        pairs.append((a, b))
    assert len(set(pairs)) == len(pairs)  # no pair twice, none shared by the two splits
    train_file, eval_file = data.write(str(tmp_path))
    lines = Path(train_file).read_text().splitlines()
    assert [json.loads(line) for line in lines] == train
    assert data.rows() == (train, held_out)  # the same on every call (fixed seed)
    assert len(Path(eval_file).read_text().splitlines()) == data.NUM_EVAL


def test_summary_reads_the_runs_logs(tmp_path):
    run = _load("run")
    logs = tmp_path / "logs"
    logs.mkdir()
    records = [
        {"step": 0, "eval/pass@1": 0.25},
        {"step": 1, "reward_mean": 0.1, "step_time": 90.0, "completion_length": 20.0},
        {"step": 2, "reward_mean": 0.3, "step_time": 10.0, "completion_length": 18.0},
        {"step": 3, "reward_mean": 0.5, "step_time": 12.0, "completion_length": 15.0},
        {"step": 3, "eval/pass@1": 0.5},
    ]
    (logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = run.summarize(str(tmp_path), 123.4, 2**30, ["artifex-grpo", "train"], "recipe")
    assert [list(e) for e in summary["held_out_pass@1"]] == [[0, 0.25], [3, 0.5]]
    assert [r for _, r in summary["reward_mean"]] == [0.1, 0.3, 0.5]
    assert summary["first_step_s"] == 90.0
    assert summary["seconds_per_step_median"] == 12.0  # of 10 and 12, the compiled steps
    assert summary["peak_rss_gb"] == 1.0 and summary["wall_s"] == 123.4
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["held_out_pass@1"] == [[0, 0.25], [3, 0.5]]


def test_committed_results_show_the_documented_runs():
    for mode in ("full", "lora"):
        summary = json.loads((RECIPE / "results" / f"{mode}.json").read_text())
        evals = summary["held_out_pass@1"]
        assert evals[0][0] == 0 and evals[-1][0] == 30
        assert evals[-1][1] > evals[0][1]  # what docs/recipes.md reports
