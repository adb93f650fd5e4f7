"""``artifex-grpo demo --task flow`` dispatches to the Flow-GRPO demo."""

from __future__ import annotations

import artifex.demos.flow as flow_demo
from artifex import cli


def test_demo_task_flow_runs_the_flow_demo(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(flow_demo, "run_flow_demo", lambda cfg: seen.append(cfg))
    out = str(tmp_path / "flow")
    assert cli.main(["demo", "--task", "flow", "--steps", "3", "--seed", "2", "--out", out]) == 0
    (cfg,) = seen
    assert (cfg.grpo_steps, cfg.seed, cfg.out_dir) == (3, 2, out)


def test_demo_task_defaults_to_addition():
    args = cli.build_parser().parse_args(["demo"])
    assert args.task == "addition"
