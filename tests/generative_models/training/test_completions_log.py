"""Sample completions: the JSONL file, the console table, the no-reward-signal diagnosis."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.completions import (
    CompletionLog,
    format_completions_table,
)
from artifex.generative_models.training.rl.loop import TrainConfig, reward_signal_diagnosis, train
from artifex.generative_models.training.rl.rollout import RolloutConfig

LONG = "x" * 200 + "\nsecond line"


def _log_two_rows(log, step=5):
    return log.log(
        step,
        prompts=["What is 1+2?", "What is 1+2?"],
        completions=["3", LONG],
        rewards={"math": [1.0, float("nan")], "format": [0.5, None]},
        advantages=np.array([0.7, -0.7], np.float32),
        total_rewards=[1.5, 0.0],
        group_size=2,
    )


def test_file_holds_every_row_in_full_and_the_table_is_cut(tmp_path):
    path = tmp_path / "logs" / "completions.jsonl"
    out = io.StringIO()
    log = CompletionLog(path, print_rows=1, max_chars=20, stream=out)
    _log_two_rows(log, step=5)
    _log_two_rows(log, step=10)
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["index"], r["group"]) for r in records] == [
        (5, 0, 0),
        (5, 1, 0),
        (10, 0, 0),
        (10, 1, 0),
    ]
    assert records[1]["completion"] == LONG  # never shortened in the file
    assert records[1]["rewards"] == {"math": None, "format": None}  # no reward: null
    assert records[0]["rewards"] == {"math": 1.0, "format": 0.5}
    assert records[0]["reward"] == 1.5
    assert records[0]["advantage"] == pytest.approx(0.7)
    assert records[0]["prompt"] == "What is 1+2?"
    text = out.getvalue()
    assert "completions at step 5 (1 of 2; all in" in text
    assert "completions at step 10" in text
    assert "What is 1+2?" in text and "0.7" in text
    assert LONG[:5] not in text  # only the first row is printed


def test_table_cuts_long_text_to_one_line():
    records = _log_two_rows(CompletionLog(None, print_rows=0))
    table = format_completions_table(records, max_rows=2, max_chars=20)
    lines = table.splitlines()
    assert len(lines) == 3
    assert lines[0].split() == ["row", "prompt", "completion", "math", "format", "advantage"]
    assert "x" * 17 + "..." in lines[2] and "x" * 18 not in lines[2]
    assert lines[2].split()[-3:] == ["-", "-", "-0.7"]


def test_resume_keeps_the_records_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "completions.jsonl"
    log = CompletionLog(path, print_rows=0)
    for step in (1, 2, 3):
        _log_two_rows(log, step)
    log.close()
    with open(path, "a") as fh:
        fh.write('{"step": 4, "torn')  # killed mid-line
    CompletionLog(path, print_rows=0, keep_until=2).close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 1, 2, 2]


def test_first_index_numbers_rows_and_groups_of_a_later_slice():
    records = CompletionLog(None, print_rows=0).log(
        1, prompts=["a", "b"], completions=["c", "d"], rewards={"r": [1.0, 0.0]},
        advantages=[0.0, 0.0], group_size=2, first_index=6,
    )  # fmt: skip
    assert [(r["index"], r["group"]) for r in records] == [(6, 3), (7, 3)]


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="'math' has 1 entries for 2 completions"):
        CompletionLog(None).log(
            1, prompts=["a", "b"], completions=["c", "d"], rewards={"math": [1.0]},
            advantages=[0.0, 0.0],
        )  # fmt: skip


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [
        ([0.0, 0.0, 0.0, 0.0], "every reward is 0 (4 completions of 2 prompts)"),
        ([1.0, 1.0, 0.0, 0.0], "every group of 2 completions has the same reward"),
        ([1.0, None, 0.5, 0.5], "every group of 2 completions has the same reward"),
        ([None, float("nan"), None, None], "no completion got a reward"),
        ([1.0, 0.0, 0.0, 0.0], None),
        ([0.0, 0.0, 0.0, 1.0], None),
    ],
)
def test_reward_signal_diagnosis(rewards, expected):
    note = reward_signal_diagnosis(rewards, group_size=2)
    if expected is None:
        assert note is None
    else:
        assert note.startswith("no reward signal: ") and expected in note
        assert "\n" not in note


def test_diagnosis_rejects_a_group_size_that_does_not_divide():
    with pytest.raises(ValueError, match="groups of group_size=3"):
        reward_signal_diagnosis([0.0] * 4, group_size=3)


def _trainer():
    tok = demo_tokenizer()
    model = demo_model(tok, seed=0)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return GRPOTrainer(model, opt, GRPOConfig(num_generations=4, beta=0.0)), tok


def test_loop_logs_completions_and_diagnoses_a_constant_reward(tmp_path, caplog, capsys):
    trainer, tok = _trainer()
    rows, _ = addition_dataset(seed=0, num_eval=4)

    def constant(prompts, completions, **columns):
        return [1.0] * len(completions)

    config = TrainConfig(
        num_steps=2,
        prompts_per_step=2,
        progress=False,
        log_dir=str(tmp_path / "logs"),
        log_completions_every=2,
        completions_to_print=3,
    )
    with caplog.at_level(logging.WARNING):
        train(trainer, tok, rows[:8], [constant], config, RolloutConfig(max_new_tokens=4))
    notes = [r.getMessage() for r in caplog.records if "no reward signal" in r.getMessage()]
    assert len(notes) == 1  # after the first step only
    assert "every group of 4 completions has the same reward" in notes[0]
    records = [
        json.loads(line)
        for line in (tmp_path / "logs" / "completions.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [2] * 8  # step 2 only: every 2 steps
    assert all(r["rewards"] == {"constant": 1.0} and r["advantage"] == 0.0 for r in records)
    assert {r["prompt"] for r in records} <= {row["prompt"] for row in rows[:8]}
    out = capsys.readouterr().out
    assert "completions at step 2 (3 of 8" in out
    assert len(out.strip().splitlines()) == 1 + 1 + 3  # title, header, 3 rows


def test_loop_with_signal_says_nothing_and_logs_real_advantages(tmp_path, caplog):
    trainer, tok = _trainer()
    rows, _ = addition_dataset(seed=0, num_eval=4)
    counter = iter(range(10**6))

    def varied(prompts, completions, **columns):
        return [float(next(counter) % 3) for _ in completions]

    config = TrainConfig(
        num_steps=1,
        prompts_per_step=2,
        progress=False,
        log_dir=str(tmp_path / "logs"),
        log_completions_every=1,
        completions_to_print=0,
    )
    with caplog.at_level(logging.WARNING):
        train(trainer, tok, rows[:8], [varied], config, RolloutConfig(max_new_tokens=4))
    assert not [r for r in caplog.records if "no reward signal" in r.getMessage()]
    lines = (tmp_path / "logs" / "completions.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    rewards = np.array([r["reward"] for r in records]).reshape(2, 4)
    adv = np.array([r["advantage"] for r in records]).reshape(2, 4)
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    expected = centred / (rewards.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(adv, expected, rtol=1e-3, atol=1e-3)


def test_without_completion_logging_no_file_but_still_the_diagnosis(tmp_path, caplog, capsys):
    trainer, tok = _trainer()
    rows, _ = addition_dataset(seed=0, num_eval=4)

    def zero(prompts, completions, **columns):
        return [0.0] * len(completions)

    config = TrainConfig(num_steps=1, prompts_per_step=2, progress=False, log_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        train(trainer, tok, rows[:8], [zero], config, RolloutConfig(max_new_tokens=4))
    notes = [r.getMessage() for r in caplog.records if "no reward signal" in r.getMessage()]
    assert len(notes) == 1 and "every reward is 0 (8 completions of 2 prompts)" in notes[0]
    assert (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "completions.jsonl").exists()
    assert "completions at step" not in capsys.readouterr().out


def test_table_keeps_the_end_of_long_prompts():
    # A chat template starts every prompt with the same text: the table shows the question.
    prompt = "<|im_start|>system\nYou are a helpful assistant<|im_end|>\nWhat is 17 + 25?"
    records = [{"index": 0, "prompt": prompt, "completion": "42 " * 20, "rewards": {},
                "advantage": 0.5}]  # fmt: skip
    row = format_completions_table(records, max_chars=20).splitlines()[1]
    assert " ...nWhat is 17 + 25? " in row  # "..." and the last 17 characters ("\\n" is 2)
    assert " 42 42 42 42 42 42... " in row  # a completion keeps its first 17
    assert "system" not in row


def test_the_old_path_warns_and_gives_the_same_objects():
    from artifex.generative_models.training import completions, logging

    for name in ("CompletionLog", "format_completions_table"):
        with pytest.warns(DeprecationWarning, match=f"logging.{name} is deprecated"):
            assert getattr(logging, name) is getattr(completions, name)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        logging.nothing  # noqa: B018
