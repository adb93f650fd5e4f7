"""Shared test configuration.

JAX runs on the CPU in tests. 8 simulated host devices are requested before JAX is imported so
that the sharding tests can build meshes; single-device code is unaffected (arrays default to
device 0).

One JAX persistent compilation cache serves the whole run: a fresh temporary directory made by
the first pytest process, shared with its xdist workers and with the subprocesses tests start
(``JAX_COMPILATION_CACHE_DIR``, and ``ARTIFEX_COMPILATION_CACHE`` for the CLI's default), and
removed at the end. Many tests build the same trainer again (a resumed run, a second launch), so
a program is compiled once per run instead of once per test, and nothing is read from or written
to the user's own cache (``~/.cache/artifex/jax``). A cache hit runs the very program a compile
would build; the compile counters in the tests see it as a compilation all the same (JAX's
backend-compile event wraps the cache lookup). ``ARTIFEX_TEST_COMPILATION_CACHE=none`` turns it
off; ``ARTIFEX_TEST_COMPILATION_CACHE=DIR`` uses (and keeps) ``DIR``.

Programs compile at LLVM optimization level 0 on the CPU (``ARTIFEX_CPU_OPT_LEVEL=0`` for the
library's programs, which subprocesses inherit, and ``--xla_backend_optimization_level=0`` in
``XLA_FLAGS`` for the tests' own): compilation is about two thirds of the suite's time, level 0
takes about a third less of it than the library's level 1, and most tests' arrays are too small
for level 1's faster kernels to matter (the W1- and W2-shaped compile-count tests do run
slower). The optimized HLO is the same at every level (compared for the demo model's forward
and backward). ``ARTIFEX_CPU_OPT_LEVEL=1 python -m pytest ...`` runs the suite at the library's
default.

The tests also compile XLA:CPU's fusions with its older LLVM IR emitters
(``--xla_cpu_use_fusion_emitters=false`` in ``XLA_FLAGS``), not the MLIR fusion emitters XLA
uses by default: most of the suite's thousands of compilations are small programs, whose fixed
cost that about halves (a 447-test sample, alternated: 177 and 195 s against 258 and 289 s; the
whole suite 1,064 s against 1,607 s; 2026-11-27, see CONTRIBUTING.md). It changes how XLA
generates the fused elementwise kernels, not the programs (the HLO) nor the library calls that
run the products, and the library's programs keep XLA's default for users (W1's first step and
steps were the same either way). The flag is used only if this JAX accepts it (checked once, in
a subprocess, since XLA aborts on a flag it does not know).
``XLA_FLAGS=--xla_cpu_use_fusion_emitters=true python -m pytest ...`` runs the suite with XLA's
default emitters.

Tests marked ``slow`` run first (in their files' order; the rest keep theirs). pytest-xdist hands
out the first quarter of the collected tests round robin and the rest on demand, so the long
tests are shared between the workers at the start and the run ends on short ones, not on one
worker's long test while the other waits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
_level = os.environ.setdefault("ARTIFEX_CPU_OPT_LEVEL", "0")
if _level not in ("0", "1", "2", "3"):
    raise ValueError(f"ARTIFEX_CPU_OPT_LEVEL: expected 0, 1, 2 or 3, got {_level!r}")
if "xla_backend_optimization_level" not in flags:
    flags += f" --xla_backend_optimization_level={_level}"
_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_PROBED = "ARTIFEX_TEST_EMITTERS_PROBED"  # set by the first pytest process; xdist workers inherit


def _accepts(flag: str) -> bool:
    """Whether this JAX's XLA starts with ``flag`` in ``XLA_FLAGS`` (it aborts on unknown ones)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"],
            env=env, capture_output=True, timeout=300, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


if "xla_cpu_use_fusion_emitters" not in flags and _PROBED not in os.environ:
    os.environ[_PROBED] = "1"
    if _accepts(_EMITTERS):
        flags += f" {_EMITTERS}"
os.environ["XLA_FLAGS"] = flags.strip()

_CACHE_ENV = "ARTIFEX_TEST_COMPILATION_CACHE"
_owned_cache: str | None = None  # made by this process: removed when the run ends
if _CACHE_ENV not in os.environ:  # the first pytest process; xdist workers inherit the variable
    _owned_cache = tempfile.mkdtemp(prefix="artifex-test-jax-cache-")
    os.environ[_CACHE_ENV] = _owned_cache
_cache = os.environ[_CACHE_ENV]
os.environ["ARTIFEX_COMPILATION_CACHE"] = _cache  # the CLI's default ("none": off)
if _cache == "none":
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
else:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
if _cache != "none":  # in case JAX was imported before this file, by a plugin
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow first


def pytest_unconfigure(config):
    if _owned_cache is not None:
        shutil.rmtree(_owned_cache, ignore_errors=True)
