"""Helpers for tests that start several real processes (multi-host runs on 127.0.0.1)."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def xla_flags(device_count: int) -> str:
    """``XLA_FLAGS`` for a subprocess with ``device_count`` CPU devices, compiling with this test
    run's other XLA flags (its optimization level and fusion emitters, ``tests/conftest.py``), so
    that its programs match this process's to the last bit."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    keep = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    return " ".join([f"--xla_force_host_platform_device_count={device_count}", *keep])


def wait_for(procs: list[subprocess.Popen], name: str, timeout_s: float) -> list[int]:
    """Exit codes of ``procs``; a hang fails the test (after ``timeout_s``) and nothing outlives
    it (every process still running is killed)."""
    try:
        return [p.wait(timeout=timeout_s) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: the processes did not finish within {timeout_s} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
