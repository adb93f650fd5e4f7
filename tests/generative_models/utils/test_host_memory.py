"""Tests for returning freed host memory after XLA compilations."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.utils import host_memory

glibc = pytest.mark.skipif(
    host_memory._malloc_trim() is None, reason="the C library has no malloc_trim"
)


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@glibc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_release_returns_freed_pages_to_the_system():
    # Many small blocks (below the mmap threshold: they live in the heap arenas), freed
    # except for a few, which keep the arena from shrinking by itself at its top.
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 2048  # 128 MiB in all
    blocks = []
    for _ in range(count):
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)  # touch the pages: they are resident now
        blocks.append(p)
    for p in blocks[:-1]:
        libc.free(p)
    before = _rss_bytes()
    assert host_memory.release_freed_host_memory() is True
    after = _rss_bytes()
    libc.free(blocks[-1])
    assert before - after > 64 * 2**20, (before, after)


def test_min_seconds_is_checked():
    for bad in (-1.0, float("nan"), "1", True, None):
        with pytest.raises(ValueError, match="min_seconds"):
            host_memory.release_memory_after_compilation(bad)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(host_memory.ENV_VAR, "0")
    assert host_memory.release_memory_after_compilation() is False


@glibc
def test_trims_after_long_compilations_only(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "release_freed_host_memory", lambda: calls.append(1))
    monkeypatch.delenv(host_memory.ENV_VAR, raising=False)
    assert host_memory.release_memory_after_compilation(0.5) is True
    assert host_memory.release_memory_after_compilation(0.5) is True  # registers once
    record = jax.monitoring.record_event_duration_secs
    record(host_memory.COMPILE_EVENT, 0.1)
    assert calls == []
    record(host_memory.COMPILE_EVENT, 0.6)
    assert calls == [1]
    record("/jax/some/other/event", 5.0)
    assert calls == [1]
    # A real compilation (any duration counts at min_seconds=0) fires the listener once.
    host_memory.release_memory_after_compilation(0.0)
    try:
        out = jax.jit(lambda x: jnp.sin(x) * 3.0)(np.arange(7.0, dtype=np.float32))
        assert len(calls) >= 2  # this jit compiled (and nothing else trims below 0.5 s)
        np.testing.assert_allclose(out, np.sin(np.arange(7.0)) * 3.0, rtol=1e-6)
    finally:
        host_memory.release_memory_after_compilation(0.5)
