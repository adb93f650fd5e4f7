"""Tests for returning freed host memory after XLA compilations."""

from __future__ import annotations

import os
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


# A program whose temporaries (an 8192 x 4096 float32 product between two others, 128 MiB) exceed
# what a glibc thread arena can hold: run twice, the second run's minor page faults are printed.
_REUSE_PROGRAM = """
import sys
from artifex.generative_models.utils.host_memory import reuse_host_memory
applied = reuse_host_memory() if sys.argv[1] == "1" else None
again = reuse_host_memory() if sys.argv[1] == "1" else None
import jax, jax.numpy as jnp
from jax._src import xla_bridge

def faults():
    with open("/proc/self/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[7])

f = jax.jit(lambda x, y, w: ((x @ y) @ w).sum())
x, y, w = jnp.full((8192, 64), 0.5), jnp.full((64, 4096), 0.25), jnp.ones((4096, 8))
first = float(f(x, y, w))
before = faults()
second = float(f(x, y, w))
print(applied, again, xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value, first, second, faults() - before)
"""


def _run_reuse_program(reuse: bool, **env: str):
    import os
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _REUSE_PROGRAM, "1" if reuse else "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        check=True,
    ).stdout.split()
    return out[0], out[1], out[2], float(out[3]), float(out[4]), int(out[5])


@glibc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/stat")
def test_reused_host_memory_keeps_a_programs_temporaries_mapped_between_runs():
    expected = 8192 * 4096 * 8 * (64 * 0.5 * 0.25)
    applied, again, asynchronous, first, second, faults = _run_reuse_program(True)
    assert (applied, again, asynchronous) == ("True", "True", "False")
    assert first == second == pytest.approx(expected, rel=1e-5)
    assert faults < 2_000  # the 128 MiB block comes back from the heap, already mapped
    _, _, asynchronous, first, _, faults = _run_reuse_program(False)
    assert asynchronous == "True" and first == pytest.approx(expected, rel=1e-5)
    assert faults > 16_000  # by default: mapped anew, each 4 KiB page faulted in again
    applied, _, asynchronous, _, _, _ = _run_reuse_program(True, ARTIFEX_REUSE_HOST_MEMORY="0")
    assert (applied, asynchronous) == ("False", "True")


def test_reuse_host_memory_refuses_once_jax_has_run():
    jnp.ones(2).block_until_ready()  # this process's CPU client exists
    from jax._src import xla_bridge

    before = xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value
    if host_memory._reusing:  # applied earlier in this process: it stays in effect
        assert host_memory.reuse_host_memory() is host_memory._reusing[0]
    else:
        assert host_memory.reuse_host_memory() is False
    assert xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value == before


def test_the_cli_says_when_it_cannot_reuse_host_memory(capsys, tmp_path):
    from artifex.cli import build_parser, main

    jnp.ones(2).block_until_ready()
    if host_memory._reusing:
        pytest.skip("applied earlier in this process")
    assert build_parser().parse_args(["demo", "--reuse-host-memory"]).reuse_host_memory is True
    assert build_parser().parse_args(["demo"]).reuse_host_memory is False
    missing = str(tmp_path / "no-model")
    status = main(
        ["train", "--model", missing, "--data", missing, "--reward", "math", "--reuse-host-memory"]
    )
    assert status == 2
    err = capsys.readouterr().err
    assert "--reuse-host-memory not applied" in err
    # A bad value of the environment variable: one line, status 2, before anything runs.
    os.environ[host_memory.REUSE_ENV_VAR] = "sometimes"
    try:
        status = main(["demo", "--steps", "1", "--reuse-host-memory"])
    finally:
        del os.environ[host_memory.REUSE_ENV_VAR]
    err = capsys.readouterr().err
    assert status == 2
    assert "ARTIFEX_REUSE_HOST_MEMORY must be one of" in err and "'sometimes'" in err
    assert len(err.strip().splitlines()) == 1


def test_reuse_host_memory_checks_its_environment_variable(monkeypatch):
    monkeypatch.setattr(host_memory, "_reusing", [])
    monkeypatch.setenv(host_memory.REUSE_ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=r"ARTIFEX_REUSE_HOST_MEMORY must be one of .*'maybe'"):
        host_memory.reuse_host_memory()
    monkeypatch.setenv(host_memory.REUSE_ENV_VAR, "off")
    assert host_memory.reuse_host_memory() is False
    assert host_memory._reusing == []


def test_a_refused_mallopt_leaves_dispatch_and_allocator_as_they_were(monkeypatch):
    from jax._src import xla_bridge

    calls = []

    def mallopt(param, value):
        calls.append((param, value))
        return 0 if param == host_memory._M_TRIM_THRESHOLD else 1

    monkeypatch.setattr(host_memory, "_reusing", [])
    monkeypatch.delenv(host_memory.REUSE_ENV_VAR, raising=False)
    monkeypatch.setattr(host_memory, "_mallopt", lambda: mallopt)
    monkeypatch.setattr(host_memory, "_backends_initialized", lambda: False)
    monkeypatch.setattr(host_memory, "_accelerator_plugin_installed", lambda: False)
    before = xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value
    assert host_memory.reuse_host_memory() is False
    assert xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value == before
    mmap_max, trim = host_memory._M_MMAP_MAX, host_memory._M_TRIM_THRESHOLD
    assert calls == [(mmap_max, 0), (trim, 2**31 - 1), (mmap_max, 65536)]  # the default back
    assert host_memory.reuse_host_memory() is False  # remembered, nothing called again
    assert len(calls) == 3
