"""Metric writers: JSONL lines, TensorBoard scalars (through a stand-in module), progress."""

from __future__ import annotations

import json
import sys
import types

import pytest

from artifex.generative_models.training.logging import (
    JsonlWriter,
    MetricLogger,
    TensorBoardWriter,
    is_primary_process,
)


def test_jsonl_writer_appends_one_object_per_step(tmp_path):
    path = tmp_path / "logs" / "m.jsonl"
    w = JsonlWriter(path)
    w.write(1, {"loss": 0.5, "bad": float("nan")})
    w.write(2, {"loss": 0.25})
    w.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 0.5, "bad": "nan"}, {"step": 2, "loss": 0.25}]


def test_tensorboard_writer_uses_an_installed_summary_writer(tmp_path, monkeypatch):
    written = []

    class SummaryWriter:
        def __init__(self, logdir, purge_step=None):
            written.append(("purge_step", purge_step))

        def add_scalar(self, key, value, step):
            written.append((key, value, step))

        def add_text(self, key, text, step):
            written.append((key, text, step))

        def flush(self):
            pass

        def close(self):
            written.append("closed")

    monkeypatch.setitem(
        sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=SummaryWriter)
    )
    logger = MetricLogger(tensorboard_dir=str(tmp_path), jsonl_path=str(tmp_path / "m.jsonl"))
    assert isinstance(logger.tensorboard, TensorBoardWriter)
    logger.log(3, {"reward_mean": 0.5, "inf": float("inf"), "name": "x", "ok": True})
    logger.close()
    # every key: non-finite numbers as scalars (TensorBoard shows them), text as text
    assert written == [
        ("purge_step", None),
        ("reward_mean", 0.5, 3),
        ("inf", float("inf"), 3),
        ("name", "x", 3),
        ("ok", 1.0, 3),
        "closed",
    ]
    written.clear()
    TensorBoardWriter.create(tmp_path, purge_step=5)
    assert written == [("purge_step", 5)]
    with pytest.raises(ValueError, match=r"TensorBoardWriter.purge_step must be an int >= 0"):
        TensorBoardWriter.create(tmp_path, purge_step=-1)


def test_without_tensorboard_packages_there_is_no_writer(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch", None)
    assert TensorBoardWriter.create(tmp_path) is None


def test_primary_process_in_a_single_process_run():
    assert is_primary_process()


def test_step_counts_are_validated(tmp_path):
    with pytest.raises(TypeError, match=r"JsonlWriter.keep_until must be an int or None, got '3'"):
        JsonlWriter(tmp_path / "m.jsonl", keep_until="3")
    with pytest.raises(ValueError, match=r"JsonlWriter.keep_until must be an int >= 0"):
        JsonlWriter(tmp_path / "m.jsonl", keep_until=-1)
    with pytest.raises(TypeError, match=r"MetricLogger\.progress_total must be an int or None"):
        MetricLogger(progress_total=10.0)
    with pytest.raises(ValueError, match=r"MetricLogger\.progress_initial must be an int >= 0"):
        MetricLogger(progress_initial=-2)
