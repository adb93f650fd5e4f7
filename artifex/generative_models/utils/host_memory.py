"""Giving the compiler's freed working memory back to the operating system.

XLA compiles a program with a large, short-lived working set on the host. The C library's allocator
keeps what was freed in its arenas instead of returning it, so the process stays that much larger
for the rest of the run, and the first execution of the program (whose temporaries XLA:CPU allocates
as one new block) adds its whole working set on top. On glibc, ``malloc_trim(0)`` returns the free
pages of every arena to the system, which lowers the peak resident memory of a run
(``docs/benchmarks.md`` has the measurements).

:func:`release_memory_after_compilation` registers, once per process, a ``jax.monitoring``
listener that trims after every XLA compilation that took at least ``min_seconds`` (short
compilations free little, and each trim takes time of its own). :class:`GRPOTrainer` calls it; a
loop of one's own can call it too. On other C libraries (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading

__all__ = [
    "release_freed_host_memory",
    "release_memory_after_compilation",
    "reuse_host_memory",
]

#: The event JAX records (with its duration in seconds) after each XLA compilation.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

#: Set to ``0`` to keep freed memory in the allocator (no trim after compilations).
ENV_VAR = "ARTIFEX_TRIM_AFTER_COMPILE"

_lock = threading.Lock()
_registered: dict[str, float] = {}


@functools.cache
def _malloc_trim():
    """The C library's ``malloc_trim`` (glibc), or ``None`` where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_host_memory() -> bool:
    """Returns the allocator's free memory to the operating system (``malloc_trim(0)``).

    Memory still in use is untouched; this only shrinks the resident set by pages that were
    freed and kept for reuse.

    Returns:
        Whether a trim ran (``False`` where the C library has no ``malloc_trim``).

    Examples:
        >>> import sys
        >>> from artifex.generative_models.utils import release_freed_host_memory
        >>> release_freed_host_memory() or not sys.platform.startswith("linux")
        True
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _on_duration(event: str, duration: float, **_: object) -> None:
    if event == COMPILE_EVENT and duration >= _registered.get("min_seconds", float("inf")):
        release_freed_host_memory()


def release_memory_after_compilation(min_seconds: float = 0.5) -> bool:
    """Trims the allocator after every XLA compilation of at least ``min_seconds``.

    Registers one ``jax.monitoring`` listener per process (later calls only update
    ``min_seconds``). The environment variable ``ARTIFEX_TRIM_AFTER_COMPILE=0`` turns it off.

    Args:
        min_seconds: Compilations shorter than this are not followed by a trim (>= 0).

    Returns:
        Whether the listener is registered (``False`` when turned off by the environment or
        where the C library has no ``malloc_trim``).

    Raises:
        ValueError: ``min_seconds`` is negative or not a number.

    Examples:
        >>> import sys
        >>> from artifex.generative_models.utils import release_memory_after_compilation
        >>> release_memory_after_compilation() or not sys.platform.startswith("linux")
        True
    """
    if isinstance(min_seconds, bool) or not isinstance(min_seconds, int | float):
        msg = f"min_seconds must be a number >= 0, got {min_seconds!r}"
        raise ValueError(msg)
    if not min_seconds >= 0:
        msg = f"min_seconds must be a number >= 0, got {min_seconds!r}"
        raise ValueError(msg)
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if _malloc_trim() is None:
        return False
    with _lock:
        first = "min_seconds" not in _registered
        _registered["min_seconds"] = float(min_seconds)
        if first:
            import jax  # here, so that importing the utilities does not import JAX

            jax.monitoring.register_event_duration_secs_listener(_on_duration)
    return True


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

_reusing: list[bool] = []  # what reuse_host_memory's one application gave

#: Set to ``0`` to leave the allocator and JAX's CPU dispatch as they are (see
#: :func:`reuse_host_memory`).
REUSE_ENV_VAR = "ARTIFEX_REUSE_HOST_MEMORY"


@functools.cache
def _mallopt():
    """The C library's ``mallopt`` (glibc), or ``None`` where the C library has none."""
    if _malloc_trim() is None:  # not glibc
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    opt = libc.mallopt
    opt.argtypes = [ctypes.c_int, ctypes.c_int]
    opt.restype = ctypes.c_int
    return opt


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a JAX without the module: assume the worst
        return True
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return True if probe is None else bool(probe())


def _accelerator_plugin_installed() -> bool:
    """Whether JAX may pick a GPU or TPU here (a plugin installed, ``JAX_PLATFORMS`` not cpu)."""
    import importlib.metadata
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms == "cpu":
        return False
    # JAX finds its plugins as entry points and in the jax_plugins namespace package; libtpu
    # ships without either.
    if importlib.metadata.entry_points(group="jax_plugins"):
        return True
    return any(importlib.util.find_spec(name) is not None for name in ("jax_plugins", "libtpu"))


def reuse_host_memory() -> bool:
    """Lets XLA:CPU reuse the memory of a program's temporaries from one run to the next.

    XLA:CPU allocates all temporaries of a run as one block and frees it when the run ends. Run
    from one of JAX's dispatch threads, glibc serves a block that large with a fresh memory
    mapping and unmaps it on free, so every run faults in and zeroes every page of its
    temporaries again.
    This makes a program run in the calling thread (``jax_cpu_enable_async_dispatch=False``;
    single-device programs only) and has glibc serve every block from its heap and keep what
    is freed (``mallopt``: no mappings for large blocks, no automatic trim), so the next run
    finds its pages mapped, and the program runs faster (``docs/benchmarks.md``, "Page
    faults").

    The process then keeps what it freed until :func:`release_freed_host_memory` (called after
    every long compilation, :func:`release_memory_after_compilation`). Python no longer runs
    ahead of single-device CPU programs (a call returns when its program has run).

    Must be called before JAX runs anything on the CPU (the dispatch mode is fixed when JAX
    creates its CPU client); ``artifex-grpo ... --reuse-host-memory`` calls it first. Does
    nothing on other C libraries, with ``ARTIFEX_REUSE_HOST_MEMORY=0``, once JAX's backends are
    initialized, or where a GPU or TPU plugin is installed (unless ``JAX_PLATFORMS=cpu``).

    Returns:
        Whether both settings are in effect (``True`` again on later calls once applied).

    Raises:
        ValueError: ``ARTIFEX_REUSE_HOST_MEMORY`` is set to something other than
            ``0``/``1``/``false``/``true``/``no``/``yes``/``off``/``on``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.utils import reuse_host_memory
        >>> _ = jnp.zeros(1).block_until_ready()  # JAX has run in this process: too late
        >>> reuse_host_memory() in (True, False)  # True only where applied before
        True
    """
    if _reusing:
        return _reusing[0]
    value = os.environ.get(REUSE_ENV_VAR, "1").strip().lower()
    if value not in ("0", "false", "no", "off", "1", "true", "yes", "on"):
        msg = (
            f"{REUSE_ENV_VAR} must be one of 0/1/false/true/no/yes/off/on, got "
            f"{os.environ[REUSE_ENV_VAR]!r}"
        )
        raise ValueError(msg)
    if value in ("0", "false", "no", "off"):
        return False
    opt = _mallopt()
    if opt is None or _backends_initialized():
        return False
    if _accelerator_plugin_installed():
        return False
    # Both mallopt calls, then the dispatch mode only where both took (no half application).
    results = [opt(_M_MMAP_MAX, 0), opt(_M_TRIM_THRESHOLD, 2**31 - 1)]
    applied = all(bool(r) for r in results)
    if applied:
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)
    elif results[0]:  # glibc's default back (DEFAULT_MMAP_MAX)
        opt(_M_MMAP_MAX, 65536)
    _reusing.append(applied)
    return applied
