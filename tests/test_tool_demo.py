"""The tool demo (`artifex-grpo demo --task tools`) runs end to end (a very short configuration)."""

from __future__ import annotations

import json

import pytest

from artifex.demos.tools import ToolDemoConfig, run_tool_demo


@pytest.mark.slow
def test_short_tool_demo_writes_its_summary(tmp_path):
    cfg = ToolDemoConfig(
        num_eval=4,
        warmup_examples=16,
        warmup_max_steps=4,
        warmup_validation=2,
        warmup_check_every=2,
        grpo_steps=2,
        prompts_per_step=2,
        num_generations=2,
        out_dir=str(tmp_path),
    )
    summary = run_tool_demo(cfg, verbose=False)
    for name in (
        "held_out_accuracy",
        "tool_call_rate",
        "sampled_accuracy",
        "sampled_tool_call_rate",
    ):
        for when in ("before", "after"):
            assert 0.0 <= summary[f"{name}_{when}"] <= 1.0, (name, when)
    assert summary["grpo_seconds"] > 0 and summary["warmup_seconds"] > 0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == summary
    steps = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").open()]
    trained = [m for m in steps if "total_loss" in m]
    assert [m["step"] for m in trained] == [1, 2]
    for m in trained:  # the multi-turn metrics reach the loop's log
        assert 0.0 <= m["multiturn/tool_call_rate"] <= 1.0
        assert m["multiturn/turns_mean"] >= 1.0
