"""The bounds of multi-turn episodes reach their settings from the command line."""

from __future__ import annotations

import pytest

from artifex.cli import _multi_turn_hooks, build_parser
from artifex.cli_checks import check_multi_turn_flags
from artifex.generative_models.training.rl.rollout import RolloutConfig

BASE = ["train", "--model", "m", "--data", "d.jsonl", "--reward", "math"]


def parse(*extra):
    args = build_parser().parse_args([*BASE, *extra])
    check_multi_turn_flags(args)
    return args


def test_tool_threads_and_observation_size_reach_the_environment():
    args = parse(
        "--tools", "artifex.demos.tools:multiply", "--tool-max-threads", "3",
        "--max-observation-chars", "100",
    )  # fmt: skip
    hooks = _multi_turn_hooks(args, RolloutConfig(max_new_tokens=8))
    rollout = hooks["rollout_fn"]
    assert rollout.config.max_observation_chars == 100
    assert rollout.environment_factory().runner.max_threads == 3


def test_without_the_flags_the_settings_keep_their_defaults():
    from artifex.generative_models.training.rl.multiturn import MultiTurnConfig, ToolEnvironment
    from artifex.generative_models.training.rl.tools import ToolRunner

    args = parse("--tools", "artifex.demos.tools:multiply")
    rollout = _multi_turn_hooks(args, RolloutConfig(max_new_tokens=8))["rollout_fn"]
    default_chars = MultiTurnConfig(max_new_tokens=8).max_observation_chars
    assert rollout.config.max_observation_chars == default_chars
    from artifex.demos.tools import multiply

    default_threads = ToolRunner([multiply]).max_threads
    assert isinstance(rollout.environment_factory(), ToolEnvironment)
    assert rollout.environment_factory().runner.max_threads == default_threads


@pytest.mark.parametrize(
    ("extra", "needs"),
    [
        (["--tool-max-threads", "2"], "applies to --tools only"),
        (["--max-observation-chars", "10"], "applies to multi-turn episodes only"),
    ],
)
def test_the_flags_without_what_reads_them_are_refused(extra, needs):
    args = build_parser().parse_args([*BASE, *extra])
    with pytest.raises(ValueError, match=needs):
        check_multi_turn_flags(args)


@pytest.mark.parametrize("flag", ["--tool-max-threads", "--max-observation-chars"])
def test_the_flags_take_positive_integers(flag, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*BASE, "--tools", "x:y", flag, "0"])
    assert f"argument {flag}" in capsys.readouterr().err
