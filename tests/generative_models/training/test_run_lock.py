"""Tests for artifex/generative_models/training/run_lock.py (one run per directory)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from artifex.generative_models.training.run_lock import LOCK_NAME, DirectoryInUseError, RunLock


def dead_pid() -> int:
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def write_lock(directory, **fields):
    directory.mkdir(parents=True, exist_ok=True)
    record = {"pid": 1, "host": socket.gethostname(), "started": None, "token": "other"}
    record.update(fields)
    (directory / LOCK_NAME).write_text(json.dumps(record))


def test_the_lock_file_names_this_process_and_goes_at_release(tmp_path):
    with RunLock(tmp_path / "out", "--output") as lock:
        record = json.loads((tmp_path / "out" / LOCK_NAME).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert lock.path == str(tmp_path / "out" / LOCK_NAME)
    assert not (tmp_path / "out" / LOCK_NAME).exists()


def test_one_process_may_hold_a_directory_twice(tmp_path):
    outer = RunLock(tmp_path, "log_dir").acquire()
    with RunLock(tmp_path, "checkpoint_dir"):  # the same directory for two roles
        pass
    assert (tmp_path / LOCK_NAME).exists()  # still held by the outer one
    outer.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_live_process_of_this_host_keeps_its_directory(tmp_path):
    hold = textwrap.dedent(
        """
        import sys, time
        from artifex.generative_models.training.run_lock import RunLock
        RunLock(sys.argv[1]).acquire()
        print("held", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"held"
        with pytest.raises(DirectoryInUseError, match=rf"pid {proc.pid} on this host") as info:
            RunLock(tmp_path, "--output").acquire()
        assert info.value.pid == proc.pid and info.value.lock_file.endswith(LOCK_NAME)
        assert "--output" in str(info.value) and "wait for it to finish" in str(info.value)
    finally:
        proc.kill()
        proc.wait()
    # The holder died without releasing (SIGKILL): its lock is stale now and is taken over.
    with RunLock(tmp_path, "--output"):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_dead_pid_is_taken_over_with_a_warning(tmp_path, caplog):
    pid = dead_pid()
    write_lock(tmp_path, pid=pid)
    with RunLock(tmp_path, "TrainConfig.checkpoint_dir"):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"took over the lock of pid {pid}" in caplog.text
    assert "TrainConfig.checkpoint_dir" in caplog.text


def test_a_reused_pid_is_recognized_by_its_start_time(tmp_path, caplog):
    write_lock(tmp_path, pid=os.getpid(), started="1", token="before-a-reboot")
    with RunLock(tmp_path):  # this pid runs, but it is a process started at another time
        pass
    assert f"took over the lock of pid {os.getpid()}" in caplog.text


def test_another_hosts_lock_is_refused_and_says_which_file_to_delete(tmp_path):
    write_lock(tmp_path, host="node-that-is-not-this-one", pid=123)
    with pytest.raises(DirectoryInUseError, match="host node-that-is-not-this-one") as info:
        RunLock(tmp_path).acquire()
    assert f"if that run is over, delete {tmp_path / LOCK_NAME}" in str(info.value)


def test_an_empty_lock_left_by_a_kill_is_taken_over(tmp_path, caplog):
    (tmp_path / LOCK_NAME).write_text("")
    with RunLock(tmp_path):
        pass
    assert "took over an unreadable lock" in caplog.text
