"""Experiment trackers: report_to names, the writers with stand-ins, and each real package.

The tests with a real tracker package skip (saying which) where it is not installed: the
``[tensorboard]``, ``[wandb]`` and ``[trackio]`` extras install them (``.ci/run`` does). W&B runs
offline (``WANDB_MODE=offline``) and trackio into a temporary ``TRACKIO_DIR``: nothing leaves
the machine. Each real tracker's records are read back from what it wrote (TensorBoard's event
files, W&B's ``.wandb`` run file, trackio's database) and compared, key by key and step by step,
with ``metrics.jsonl`` and ``completions.jsonl``.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from artifex.generative_models.training import trackers
from artifex.generative_models.training.completions import CompletionLog
from artifex.generative_models.training.logging import (
    MetricLogger,
    TensorBoardWriter,
    completions_as_table,
)
from artifex.generative_models.training.rl.loop import TrainConfig
from artifex.generative_models.training.trackers import (
    MetricWriter,
    TrackioWriter,
    WandbWriter,
    check_report_to,
    open_trackers,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def installed(module):
    return importlib.util.find_spec(module) is not None


def wandb_env(tmp_path):
    """W&B offline, its own files (debug logs, artifact staging, settings) under ``tmp_path``."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        **{f"WANDB_{d}_DIR": str(tmp_path / f"wandb-{d.lower()}") for d in ("DATA", "CACHE",
                                                                            "CONFIG")},
    }  # fmt: skip


needs_tensorboardx = pytest.mark.skipif(
    not installed("tensorboardX"), reason="tensorboardX is not installed (the [tensorboard] extra)"
)
needs_wandb = pytest.mark.skipif(
    not installed("wandb"), reason="wandb is not installed (the [wandb] extra)"
)
needs_trackio = pytest.mark.skipif(
    not installed("trackio"), reason="trackio is not installed (the [trackio] extra)"
)

RECORDS = [
    {"step": 4, "index": 0, "group": 0, "prompt": "1+2=", "completion": "3|x\nend",
     "rewards": {"math": 1.0, "format": None}, "reward": 1.0, "advantage": 0.7071},
    {"step": 4, "index": 1, "group": 0, "prompt": "1+2=", "completion": "4",
     "rewards": {"math": 0.0, "format": 0.5}, "reward": 0.5, "advantage": -0.7071},
]  # fmt: skip
METRICS = {"reward_mean": 0.25, "kl": 0.0, "reward_std": float("nan"), "step_time": 1.5}


# ------------------------------------------------------------------------------ names
def test_report_to_names_are_normalized():
    assert check_report_to("none") == ("jsonl",)
    assert check_report_to("jsonl") == ("jsonl",)
    assert check_report_to(("JSONL", "jsonl")) == ("jsonl",)
    assert TrainConfig(num_steps=1).report_to == ("jsonl",)


def test_report_to_names_with_packages_keep_their_order(monkeypatch):
    monkeypatch.setattr(trackers, "_installed", lambda module: True)
    assert check_report_to("wandb, tensorboard,wandb") == ("jsonl", "wandb", "tensorboard")
    assert check_report_to(["trackio", "jsonl,wandb"]) == ("jsonl", "trackio", "wandb")
    config = TrainConfig(num_steps=1, log_dir="logs", report_to="tensorboard,trackio")
    assert config.report_to == ("jsonl", "tensorboard", "trackio")
    with pytest.raises(ValueError, match=r"'tensorboard', which writes to log_dir/tb, but log_dir"):
        TrainConfig(num_steps=1, report_to=("tensorboard",))


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("comet", ValueError, r"unknown tracker 'comet': use jsonl, tensorboard, wandb, trackio"),
        ("all", ValueError, r"'all' is not accepted: name the trackers"),
        ("wandb,", ValueError, r"an empty tracker name in 'wandb,'"),
        ((), ValueError, r"an empty tracker name"),
        ("none,wandb", ValueError, r"'none' means no tracker and cannot stand beside others"),
        (3, TypeError, r"TrainConfig.report_to must be a string or a sequence of strings, got 3"),
        ([None], TypeError, r"must be a string or a sequence of strings"),
    ],
)
def test_bad_report_to_values_are_errors(value, error, message):
    with pytest.raises(error, match=message):
        TrainConfig(num_steps=1, report_to=value)


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "trackio"])
def test_a_missing_tracker_package_is_an_error_naming_the_extra(monkeypatch, name):
    monkeypatch.setattr(trackers, "_installed", lambda module: False)
    with pytest.raises(ImportError, match=rf"pip install 'artifex-grpo\[{name}\]'"):
        TrainConfig(num_steps=1, log_dir="logs", report_to=name)


def test_tensorboard_through_torch_counts_as_installed(monkeypatch):
    monkeypatch.setattr(trackers, "_installed", lambda module: module in ("torch", "tensorboard"))
    assert check_report_to("tensorboard") == ("jsonl", "tensorboard")
    monkeypatch.setattr(trackers, "_installed", lambda module: module == "torch")
    with pytest.raises(ImportError, match="tensorboardX or torch with tensorboard"):
        check_report_to("tensorboard")


# ------------------------------------------------------------------------------ stand-ins
class Recorder:
    def __init__(self, log, name="w", fail_close=False):
        self.log, self.name, self.fail_close = log, name, fail_close

    def write(self, step, metrics):
        self.log.append((self.name, "write", step, dict(metrics)))

    def write_completions(self, step, records):
        self.log.append((self.name, "completions", step, [dict(r) for r in records]))

    def close(self):
        self.log.append((self.name, "close"))
        if self.fail_close:
            raise OSError("disk full")


def test_metric_logger_and_completion_log_hand_everything_to_writers(tmp_path):
    log = []
    a, b = Recorder(log, "a"), Recorder(log, "b")
    assert isinstance(a, MetricWriter)
    logger = MetricLogger(jsonl_path=tmp_path / "m.jsonl", writers=[a, b])
    samples = CompletionLog(tmp_path / "c.jsonl", print_rows=0, writers=[a, b])
    records = samples.log(
        2, prompts=["p", "p"], completions=["x", "y"], rewards={"r": [1.0, None]},
        advantages=[0.5, -0.5], total_rewards=[1.0, float("nan")], group_size=2,
    )  # fmt: skip
    logger.log(2, METRICS)
    logger.log(2, {"eval/pass@1": 0.5}, advance=False)
    samples.close()
    assert [e for e in log if e[1] == "close"] == []  # the completion log does not close them
    logger.close()
    file_records = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert records == file_records
    assert log == [
        ("a", "completions", 2, records),
        ("b", "completions", 2, records),
        ("a", "write", 2, METRICS),
        ("b", "write", 2, METRICS),
        ("a", "write", 2, {"eval/pass@1": 0.5}),
        ("b", "write", 2, {"eval/pass@1": 0.5}),
        ("a", "close"),
        ("b", "close"),
    ]


def test_every_writer_is_closed_even_when_one_fails(tmp_path):
    log = []
    logger = MetricLogger(writers=[Recorder(log, "a", fail_close=True), Recorder(log, "b")])
    with pytest.raises(OSError, match="disk full"):
        logger.close()
    assert log == [("a", "close"), ("b", "close")]


def test_writers_without_the_methods_are_type_errors():
    with pytest.raises(TypeError, match=r"MetricLogger.writers: .* has no write or close method"):
        MetricLogger(writers=[object()])
    with pytest.raises(TypeError, match=r"MetricLogger.writers must be a sequence of writers"):
        MetricLogger(writers=Recorder([]))
    with pytest.raises(TypeError, match=r"CompletionLog.writers: .* has no write_completions"):
        CompletionLog(None, writers=[MetricLogger()])


def test_completions_as_table_keeps_every_value():
    columns, rows = completions_as_table(RECORDS)
    assert columns == ["step", "index", "group", "prompt", "completion", "rewards/math",
                       "rewards/format", "reward", "advantage"]  # fmt: skip
    assert rows[0] == [4, 0, 0, "1+2=", "3|x\nend", 1.0, None, 1.0, 0.7071]
    assert rows[1][5:7] == [0.0, 0.5]
    # a reward function that only some records have: None in the others
    columns, rows = completions_as_table([{"rewards": {"a": 1.0}}, {"rewards": {"b": 2.0}}])
    assert columns == ["rewards/a", "rewards/b"] and rows == [[1.0, None], [None, 2.0]]


def test_only_the_primary_process_opens_trackers(monkeypatch, tmp_path):
    monkeypatch.setattr(trackers, "_installed", lambda module: True)
    monkeypatch.setattr(trackers, "is_primary_process", lambda: False)

    def fail(*args, **kwargs):
        raise AssertionError("a tracker was started on a non-primary process")

    monkeypatch.setattr(WandbWriter, "create", classmethod(fail))
    monkeypatch.setattr(TrackioWriter, "create", classmethod(fail))
    monkeypatch.setattr(TensorBoardWriter, "create", classmethod(fail))
    assert open_trackers("tensorboard,wandb,trackio", log_dir=str(tmp_path)) == []


def test_a_tracker_that_fails_to_start_closes_those_started(monkeypatch, tmp_path):
    monkeypatch.setattr(trackers, "_installed", lambda module: True)
    log = []
    monkeypatch.setattr(WandbWriter, "create", classmethod(lambda cls, **kw: Recorder(log)))

    def fail(cls, **kwargs):
        raise RuntimeError("trackio failed")

    monkeypatch.setattr(TrackioWriter, "create", classmethod(fail))
    with pytest.raises(RuntimeError, match="trackio failed"):
        open_trackers("wandb,trackio", log_dir=str(tmp_path))
    assert log == [("w", "close")]


# ------------------------------------------------------------------------------ readers
def _tfrecords(path):
    """The records of a TFRecord file (TensorBoard's event files): length, crc, data, crc."""
    with open(path, "rb") as fh:
        data = fh.read()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        yield data[pos + 12 : pos + 12 + length]
        pos += 12 + length + 4


def tensorboard_events(logdir):
    """``{step: {tag: float or text}}`` and the purge steps of the event files in ``logdir``."""
    from tensorboardX.proto.event_pb2 import Event

    values, purges = {}, []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for raw in _tfrecords(path):
            event = Event.FromString(raw)
            if event.HasField("session_log"):
                purges.append(event.step)
            for v in event.summary.value:
                tag = v.tag
                if v.metadata.plugin_data.plugin_name == "text":  # tag: NAME/text_summary
                    tag, value = tag.removesuffix("/text_summary"), v.tensor.string_val[0].decode()
                else:
                    value = v.simple_value
                values.setdefault(event.step, {})[tag] = value
    return values, purges


def wandb_records(run_dir):
    """The records of a W&B run file (``run-<id>.wandb``: W&B's 32 KiB-block record log)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_dir):
    """``{step: {key: value}}`` of a W&B run's history (nested keys joined with ``/``)."""
    history = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        history.setdefault(int(row["_step"]), {}).update(row)
    return history


def same(expected, got):
    """A metric as JSON Lines wrote it (``"nan"`` for NaN) against a tracker's value."""
    if isinstance(expected, str):
        expected = float(expected)
    if isinstance(got, str):
        got = float(got)
    return math.isclose(expected, got, rel_tol=1e-6, abs_tol=1e-7) or (
        math.isnan(expected) and math.isnan(got)
    )


def markdown_rows(text):
    return [line.strip("| ").split(" | ") for line in text.splitlines()[2:]]


# ------------------------------------------------------------------------------ real packages
@needs_tensorboardx
def test_tensorboard_writes_every_key_and_the_completions_table(tmp_path):
    writer = TensorBoardWriter.create(tmp_path, purge_step=3)
    writer.write(4, METRICS | {"note": "text"})
    writer.write_completions(4, RECORDS)
    writer.close()
    values, purges = tensorboard_events(tmp_path)
    assert purges == [3]
    for key, value in METRICS.items():
        assert same(value, values[4][key]), key
    assert values[4]["note"] == "text"
    table = values[4]["completions"]
    columns, _ = completions_as_table(RECORDS)
    assert table.splitlines()[0] == "| " + " | ".join(columns) + " |"
    assert markdown_rows(table)[0] == [
        "4", "0", "0", "1+2=", "3\\|x\\nend", "1.0", "-", "1.0", "0.7071",
    ]  # fmt: skip


# One CI run of many (2026-11-29, two xdist workers on a loaded 2-core machine) found one of
# the 400 history rows missing from W&B's run file; 47 runs here, alone and under load, never
# did. The row goes through ``run.log`` and wandb-core, not through our code, so a lost row is
# retried once (only as the KeyError/AssertionError below): a writer that drops rows fails both.
@needs_wandb
@pytest.mark.flaky(reruns=1, only_rerun=["KeyError", "AssertionError"])
def test_wandb_offline_writes_every_key_and_the_completions_table(tmp_path, monkeypatch):
    for name, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_PROJECT", "artifex-test")
    writer = WandbWriter.create(log_dir=str(tmp_path), config={"train_config": {"seed": 3}})
    writer.write(0, {"eval/pass@1": 0.5})
    writer.write_completions(4, RECORDS)
    writer.write(4, METRICS)
    for step in range(5, 405):  # the run file grows past W&B's 32 KiB blocks
        writer.write(step, {"x": step, "y": -step})
    writer.close()
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert os.path.getsize(glob.glob(os.path.join(run_dir, "*.wandb"))[0]) > 2 * 32768
    history = wandb_history(run_dir)
    assert history[0]["eval/pass@1"] == 0.5
    missing = [s for s in range(5, 405) if s not in history]
    assert not missing, f"history rows missing from the run file: {missing}"
    assert all(history[s]["x"] == s and history[s]["y"] == -s for s in range(5, 405))
    for key, value in METRICS.items():
        assert same(value, history[4][key]), key
    table_file = os.path.join(run_dir, "files", history[4]["completions/path"])
    with open(table_file, encoding="utf-8") as fh:
        table = json.load(fh)
    columns, rows = completions_as_table(RECORDS)
    assert table["columns"] == columns and table["data"] == rows
    runs = [r for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
    assert runs[0].run.project == "artifex-test"
    config = {item.key: json.loads(item.value_json) for item in runs[0].run.config.update}
    assert config["train_config"] == {"seed": 3}


@needs_wandb
def test_wandb_init_failures_say_how_to_go_offline(tmp_path, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(RuntimeError, match=r"wandb.init failed \(UsageError: api_key.*WANDB_MODE"):
        WandbWriter.create(log_dir=str(tmp_path))


TRACKIO_SCRIPT = """
import json, sys
from artifex.generative_models.training.trackers import TrackioWriter, DEFAULT_PROJECT
records, metrics = json.loads(sys.argv[1]), json.loads(sys.argv[2])
writer = TrackioWriter.create(config={"train_config": {"seed": 3}})
writer.write_completions(4, records)
writer.write(4, metrics)
writer.close()
from trackio.sqlite_storage import SQLiteStorage
(run,) = SQLiteStorage.get_runs(DEFAULT_PROJECT)
print("RESULT " + json.dumps({"logs": SQLiteStorage.get_logs(DEFAULT_PROJECT, run),
      "config": SQLiteStorage.get_run_config(DEFAULT_PROJECT, run)}, default=str))
"""


@needs_trackio
def test_trackio_writes_every_key_and_the_completions_table(tmp_path):
    # trackio reads TRACKIO_DIR when it is imported: a process of its own.
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": ROOT}
    env.pop("TRACKIO_PROJECT", None)
    proc = subprocess.run(
        [sys.executable, "-c", TRACKIO_SCRIPT, json.dumps(RECORDS), json.dumps(METRICS)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    stored = json.loads(line[len("RESULT ") :])
    assert stored["config"]["train_config"] == {"seed": 3}
    merged = {}
    for entry in stored["logs"]:
        merged.setdefault(entry["step"], {}).update(entry)
    for key, value in METRICS.items():
        assert same(value, merged[4][key]), key
    table = merged[4]["completions"]
    assert table["_type"] == "trackio.table"
    columns, rows = completions_as_table(RECORDS)
    assert table["_value"] == [dict(zip(columns, row, strict=True)) for row in rows]


# ------------------------------------------------------------------------------ the loop
@pytest.mark.slow
def test_the_loop_reports_every_key_of_every_step_to_each_installed_tracker(tmp_path):
    names = [n for n, m in (("tensorboard", "tensorboardX"), ("wandb", "wandb"),
                            ("trackio", "trackio")) if installed(m)]  # fmt: skip
    if not names:
        pytest.skip("no tracker package is installed (the [tensorboard], [wandb], [trackio] extra)")
    env = {
        **os.environ,
        **wandb_env(tmp_path),
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "PYTHONPATH": ROOT,
    }
    env.pop("WANDB_PROJECT", None)
    env.pop("TRACKIO_PROJECT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.generative_models.training.tracker_worker", str(tmp_path),
         ",".join(names)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = tmp_path / "logs"
    expected = {}  # step -> every key logged at that step (training metrics and evaluations)
    for line in (logs / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        expected.setdefault(record.pop("step"), {}).update(record)
    assert sorted(expected) == [0, 1, 2]
    assert {"eval/pass@1", "reward_mean", "policy_loss", "step_time"} <= set(expected[1])
    completions = {}
    for line in (logs / "completions.jsonl").read_text().splitlines():
        record = json.loads(line)
        completions.setdefault(record["step"], []).append(record)
    assert sorted(completions) == [1, 2]

    got = {}
    if "tensorboard" in names:
        values, purges = tensorboard_events(logs / "tb")
        assert purges == [0]  # a fresh start hides nothing but what an earlier attempt logged
        got["tensorboard"] = values
        for step, records in completions.items():
            rows = markdown_rows(values[step]["completions"])
            assert [r[4] for r in rows] == [r["completion"].replace("\n", "\\n") for r in records]
    if "wandb" in names:
        (run_dir,) = glob.glob(str(logs / "wandb" / "offline-run-*"))
        got["wandb"] = history = wandb_history(run_dir)
        for step, records in completions.items():
            with open(os.path.join(run_dir, "files", history[step]["completions/path"])) as fh:
                table = json.load(fh)
            assert [table["columns"], table["data"]] == list(completions_as_table(records))
    if "trackio" in names:
        with open(tmp_path / "trackio.json") as fh:
            stored = json.load(fh)
        assert len(stored["runs"]) == 1
        assert stored["config"]["train_config"]["report_to"] == ["jsonl", *names]
        merged = {}
        for entry in stored["logs"]:
            merged.setdefault(entry["step"], {}).update(entry)
        got["trackio"] = merged
        for step, records in completions.items():
            columns, rows = completions_as_table(records)
            assert merged[step]["completions"]["_value"] == [
                dict(zip(columns, row, strict=True)) for row in rows
            ]
    for name, steps in got.items():
        for step, metrics in expected.items():
            for key, value in metrics.items():
                if name == "tensorboard":  # TensorBoard's tags: other characters become _
                    key = re.sub(r"[^-/\w.]", "_", key)
                assert key in steps[step], f"{name}: step {step} has no {key!r}"
                assert same(value, steps[step][key]), f"{name}: step {step} {key!r}"
    assert np.all([len(expected[s]) > 10 for s in (1, 2)])
