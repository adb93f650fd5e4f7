"""The learning-rate schedule of `artifex-grpo train`, against the formulas in float64."""

from __future__ import annotations

import math

import pytest

from artifex.cli import lr_schedule


def reference(kind: str, lr: float, warmup: int, total: int, i: int) -> float:
    if i < warmup:
        return lr * i / warmup
    decay = max(total - warmup, 1)
    t = min(i - warmup, decay) / decay
    if kind == "constant":
        return lr
    if kind == "linear":
        return lr * (1.0 - t)
    return lr * 0.5 * (1.0 + math.cos(math.pi * t))


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_the_schedule_follows_its_formula(kind, warmup):
    lr, total = 2e-3, 12
    schedule = lr_schedule(kind, lr, warmup, total)
    for i in range(total + 3):
        assert float(schedule(i)) == pytest.approx(reference(kind, lr, warmup, total, i), abs=1e-9)


def test_without_warmup_the_first_update_has_the_full_rate():
    # A warm-up of 0 steps used to be one step long, so the first update ran at rate 0.
    for kind in ("constant", "linear", "cosine"):
        assert float(lr_schedule(kind, 1e-3, 0, 10)(0)) == pytest.approx(1e-3)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="expected 'constant', 'linear' or 'cosine'"):
        lr_schedule("step", 1e-3, 0, 10)
