"""Cases of the hostile-input sweep that no other fault test pinned down.

Each test is one case: a batch without advantage signal is skipped with a warning that names
the setting (and applied, with its own warning, when asked); a multi-turn token budget larger
than the model's positions is refused before the episodes' arrays are allocated (so a huge
``max_turns`` cannot run either); the tools demo's warm-up ends on a measured validation
accuracy, not on a step count; a second --output in the folder of another shares its default
checkpoints and logs, and a resume refused there says so instead of suggesting --overwrite.
"""

from __future__ import annotations

import json
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.cli import main
from artifex.demos import tools as tools_demo
from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.training.checkpointing import CheckpointManager
from artifex.generative_models.training.rl import MultiTurnConfig, ToolEnvironment
from artifex.generative_models.training.rl.rollouts.episodes import run_episodes
from tests.generative_models.training.test_reliability_step import (
    assert_unchanged,
    leaves,
    lm_batch,
    make_trainer,
)


# ------------------------------------------------------------------ degenerate updates
def _equal_rewards_batch():
    # every group's rewards equal: every advantage is zero
    return lm_batch(rewards=jnp.repeat(jnp.asarray([0.0, 1.0]), 4).astype(jnp.float32))


def test_a_batch_without_advantage_is_skipped_with_a_warning_naming_the_setting(caplog):
    trainer = make_trainer()  # the default entropy bonus and KL coefficient are on
    assert trainer.config.entropy_coeff > 0
    trainer.train_step(lm_batch(seed=1))  # Adam moments that a wrong update would move
    before = leaves(trainer)
    with caplog.at_level(logging.WARNING):
        metrics = trainer.train_step(_equal_rewards_batch())
    assert metrics["advantage_signal"] == 0.0
    assert_unchanged(before, trainer)
    (message,) = [r.getMessage() for r in caplog.records if "every advantage" in r.getMessage()]
    assert "the update was skipped" in message
    assert "GRPOConfig.update_without_advantage=True applies such updates" in message


def test_an_update_without_advantage_that_was_asked_for_is_applied_and_said(caplog):
    trainer = make_trainer(update_without_advantage=True)
    before = leaves(trainer)
    with caplog.at_level(logging.WARNING):
        metrics = trainer.train_step(_equal_rewards_batch())
    assert metrics["advantage_signal"] == 0.0
    assert any(not np.array_equal(x, y) for x, y in zip(before, leaves(trainer), strict=True))
    (message,) = [r.getMessage() for r in caplog.records if "every advantage" in r.getMessage()]
    assert "only the KL and entropy terms were applied" in message


# ------------------------------------------------------------------ multi-turn bounds
def test_a_token_budget_beyond_the_models_positions_is_refused_before_any_turn():
    """max_turns <= max_completion_tokens (MultiTurnConfig), and max_completion_tokens plus the
    prompt must fit the model's positions: 5e7 turns never allocate or decode anything."""
    tok = tools_demo.tool_demo_tokenizer()
    model = demo_model(tok, max_positions=160)
    huge = MultiTurnConfig(max_turns=50_000_000, max_completion_tokens=50_000_000)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"max_completion_tokens=50000000, but the model has 160"):
        run_episodes(
            model,
            tok,
            [{"prompt": "What is 1234 * 56?"}],
            lambda: ToolEnvironment([tools_demo.multiply]),
            huge,
            key=jax.random.key(0),
        )
    assert time.monotonic() - start < 10


# ------------------------------------------------------------------ tools demo warm-up
def test_tool_warmup_stops_at_the_first_check_that_passes():
    tok = tools_demo.tool_demo_tokenizer()
    rows, _ = tools_demo.multiplication_dataset(num_eval=1, size=8)
    examples = tools_demo.tool_warmup_rows(tok, rows, tool_fraction=0.5, seed=0)
    model = demo_model(tok, max_positions=128)
    answers = iter([False, True, True])
    losses = tools_demo.tool_warmup(
        model, tok, examples, steps=50, batch_size=4, stop=lambda: next(answers), check_every=2
    )
    assert len(losses) == 4  # checked after steps 2 and 4; the second check passed


class _Stop(Exception):
    pass


def test_the_demo_warmup_ends_on_measured_validation_accuracy(monkeypatch, tmp_path):
    """run_tool_demo hands the warm-up a check that evaluates greedy accuracy on its
    validation problems against warmup_target, every warmup_check_every steps."""
    seen = {}

    def warmup(model, tokenizer, examples, *, steps, seed, stop, check_every):
        seen.update(steps=steps, check_every=check_every, passed=stop())
        raise _Stop  # the rest of the demo is not this test's subject

    monkeypatch.setattr(tools_demo, "tool_warmup", warmup)
    for target, passed in ((0.0, True), (1.0, False)):  # an untrained model answers nothing
        cfg = tools_demo.ToolDemoConfig(
            num_eval=2,
            warmup_examples=8,
            warmup_max_steps=700,
            warmup_target=target,
            warmup_validation=2,
            warmup_check_every=7,
            out_dir=str(tmp_path),
        )
        with pytest.raises(_Stop):
            tools_demo.run_tool_demo(cfg, verbose=False)
        assert seen == {"steps": 700, "check_every": 7, "passed": passed}


# ------------------------------------------------------------------ sibling outputs
def test_a_sibling_output_refused_by_the_shared_default_checkpoints_is_told_why(
    tmp_path, monkeypatch, capsys
):
    """Two outputs in one folder share the default checkpoints/ and logs/: a second run with
    another learning rate is refused, the first run's checkpoints and log are kept, and the
    error does not send the user to --overwrite without saying what it would delete."""
    tok = demo_tokenizer()
    model = tmp_path / "model"
    demo_model(tok, seed=0).save_pretrained(str(model))
    tok.save_pretrained(str(model))
    rows, _ = addition_dataset(num_eval=8)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    (tmp_path / "sibling_rewards.py").write_text(
        "def by_length(prompts, completions, **columns):\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    runs = tmp_path / "runs"

    def args(output, learning_rate):
        return [
            "train", "--model", str(model), "--data", str(tmp_path / "train.jsonl"),
            "--output", str(runs / output), "--reward", "sibling_rewards:by_length",
            "--num-steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
            "--max-new-tokens", "3", "--progress", "false", "--beta", "0",
            "--learning-rate", learning_rate,
        ]  # fmt: skip

    assert main(args("a", "1e-2")) == 0
    log = (runs / "logs" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(args("b", "3e-2")) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("artifex-grpo: error:")]
    assert "is incompatible with this run" in line and "learning_rate" in line
    assert f"{runs / 'checkpoints'} is incompatible" in line
    assert "(the default checkpoint directory beside --output, shared by every --output" in line
    assert "own --checkpoint-dir and --log-dir" in line
    assert "--overwrite deletes the checkpoints and logs there" in line
    assert "use --overwrite, or another" not in line  # the generic advice is not repeated
    assert CheckpointManager(str(runs / "checkpoints")).all_steps() == [1]
    assert (runs / "logs" / "metrics.jsonl").read_text() == log
    assert not (runs / "b" / "model.safetensors").exists()
