"""``artifex-grpo train`` flags of the training options (truncation masking, the overlong
reward, reference sync, evaluation with k samples, step rewards): parsed into the settings the
library reads, bad values named by their flag."""

from __future__ import annotations

import pytest

from artifex.cli import _build_rewards, build_parser

BASE = ["train", "--model", "m", "--data", "d.jsonl"]


def _args(*extra: str):
    return build_parser().parse_args([*BASE, *extra])


def test_overlong_reward_reads_its_cache_and_refuses_a_bad_one():
    args = _args("--reward", "overlong", "--overlong-cache", "3")
    reward = _build_rewards(args, num_generations=4, max_new_tokens=8).funcs[0]
    # L_max = max_new_tokens = 8, L_cache = 3: 0 up to 5 tokens, then -1/3 per token.
    assert reward(["q"] * 4, ["a"] * 4, completion_length=[5, 6, 7, 8]) == pytest.approx(
        [0.0, -1 / 3, -2 / 3, -1.0]
    )
    default = _build_rewards(_args("--reward", "overlong"), 4, 8).funcs[0]
    assert default(["q"], ["a"], completion_length=[7]) == [-0.5]  # L_cache = 8 // 4
    for bad in ("9", "0"):
        with pytest.raises(
            ValueError,
            match=f"--overlong-cache must be between 1 and --max-new-tokens \\(8\\), got {bad}",
        ):
            _build_rewards(_args("--reward", "overlong", "--overlong-cache", bad), 4, 8)
    with pytest.raises(SystemExit):
        _args("--reward", "overlong", "--overlong-cache", "-1")


def test_mask_truncated_completions_flag():
    args = _args("--reward", "math", "--mask-truncated-completions")
    assert vars(args)["GRPOConfig.mask_truncated_completions"] is True
    args = _args("--reward", "math", "--mask-truncated-completions", "false")
    assert vars(args)["GRPOConfig.mask_truncated_completions"] is False


def test_reference_sync_flags_build_the_config():
    from artifex.cli import _collect
    from artifex.generative_models.training.rl.configs import GRPOConfig

    args = _args("--reward", "math", "--beta", "0.04", "--sync-ref-model",
                 "--ref-model-mixup-alpha", "0.5", "--ref-model-sync-steps", "64")  # fmt: skip
    config = GRPOConfig(**_collect(args, GRPOConfig))
    assert (config.sync_ref_model, config.ref_model_mixup_alpha, config.ref_model_sync_steps) == (
        True,
        0.5,
        64,
    )
    with pytest.raises(ValueError, match="needs beta > 0"):
        GRPOConfig(**_collect(_args("--reward", "math", "--beta", "0", "--sync-ref-model"),
                              GRPOConfig))  # fmt: skip


def test_train_prints_the_sampled_evaluation(tmp_path, capsys):
    """``--eval-num-samples 2``: the run ends with pass@2, mean@2 and maj@2, first -> last (the
    run also trains on step rewards, ``--step-reward``)."""
    import json

    from artifex.cli import main
    from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer

    tok = demo_tokenizer()
    demo_model(tok).save_pretrained(str(tmp_path / "model"))
    tok.save_pretrained(str(tmp_path / "model"))
    rows, held_out = addition_dataset(num_eval=4)
    for name, data in (("train", rows[:8]), ("eval", held_out)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    argv = ["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "train.jsonl"),
            "--eval-data", str(tmp_path / "eval.jsonl"), "--reward", "math",
            "--num-steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
            "--max-new-tokens", "4", "--progress", "false", "--beta", "0",
            "--eval-num-samples", "2", "--output", str(tmp_path / "out"),
            "--checkpoint-dir", "none",
            "--step-reward", STEP_REWARD, "--step-separator", "+"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in ("pass@1", "pass@2", "mean@2", "maj@2"):
        assert f"held-out {name}" in out, out
    assert "held-out pass@2 (2 samples per prompt): " in out


STEP_REWARD = "tests.generative_models.training.rl.test_step_rewards:digit_steps"


def test_step_reward_flags():
    from artifex.cli import _step_rewards

    assert _step_rewards(_args("--reward", "math")) is None
    steps = _step_rewards(_args("--reward", "math", "--step-reward", STEP_REWARD))
    assert steps.separator == "\n" and steps.name == "digit_steps"
    steps = _step_rewards(_args("--reward", "math", "--step-reward", STEP_REWARD,
                                "--step-separator", "\\n\\n"))  # fmt: skip
    assert steps.separator == "\n\n"
    with pytest.raises(ValueError, match="--step-separator is only used with --step-reward"):
        _step_rewards(_args("--reward", "math", "--step-separator", ";"))
    with pytest.raises(ValueError, match="--step-reward 'nowhere:fn'"):
        _step_rewards(_args("--reward", "math", "--step-reward", "nowhere:fn"))
    with pytest.raises(TypeError, match="not a function"):
        _step_rewards(_args("--reward", "math", "--step-reward", "math:pi"))
