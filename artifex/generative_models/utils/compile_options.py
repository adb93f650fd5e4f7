"""XLA compiler options for the library's own compiled programs, chosen per backend.

On the CPU, XLA hands each fused kernel to LLVM at its highest optimization level, and that
code generation is most of the time of a first training step. The library compiles at level 1
(``xla_backend_optimization_level``), which compiles faster and runs its programs as fast
(`docs/benchmarks.md`): the kernels that matter are matmuls and convolutions, which XLA:CPU
calls from its libraries rather than generating. Level 0 compiles faster still but
runs the generated kernels more slowly, so it is not the default; it suits programs that run a few
times on small arrays, such as the project's tests, which compile at level 0.
Other backends keep XLA's defaults.

Set ``ARTIFEX_CPU_OPT_LEVEL`` (0-3) to choose the level on the CPU, or
``ARTIFEX_CPU_FAST_COMPILE=0`` to compile at XLA's default level everywhere.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> from artifex.generative_models.utils.compile_options import compiler_options, jit
    >>> double = jit(lambda x: 2 * x)
    >>> int(double(jnp.int32(3)))
    6
    >>> options = compiler_options()  # {'xla_backend_optimization_level': 1} on the CPU
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["CPU_COMPILER_OPTIONS", "ENV_VAR", "LEVEL_ENV_VAR", "compiler_options", "jit"]

ENV_VAR = "ARTIFEX_CPU_FAST_COMPILE"
LEVEL_ENV_VAR = "ARTIFEX_CPU_OPT_LEVEL"
CPU_COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 1}


def _cpu_level() -> int:
    raw = os.environ.get(LEVEL_ENV_VAR, "").strip()
    if not raw:
        return CPU_COMPILER_OPTIONS["xla_backend_optimization_level"]
    if raw not in ("0", "1", "2", "3"):
        msg = f"{LEVEL_ENV_VAR}: expected an LLVM optimization level 0, 1, 2 or 3, got {raw!r}"
        raise ValueError(msg)
    return int(raw)


def compiler_options() -> dict[str, Any] | None:
    """Compiler options for ``jax.jit`` on the default backend (None: XLA's defaults).

    Returns:
        A copy of :data:`CPU_COMPILER_OPTIONS` when the default backend is the CPU and
        ``ARTIFEX_CPU_FAST_COMPILE`` is not ``0``/``false``/``no``/``off``, with the level
        ``ARTIFEX_CPU_OPT_LEVEL`` names if it is set; otherwise None.

    Raises:
        ValueError: If ``ARTIFEX_CPU_OPT_LEVEL`` is set to anything but 0, 1, 2 or 3.

    Examples:
        >>> import jax
        >>> from artifex.generative_models.utils.compile_options import compiler_options
        >>> options = compiler_options()
        >>> options is None or set(options) == {"xla_backend_optimization_level"}
        True
        >>> f = jax.jit(lambda x: x + 1, compiler_options=options)
    """
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if jax.default_backend() != "cpu":
        return None
    return {**CPU_COMPILER_OPTIONS, "xla_backend_optimization_level": _cpu_level()}


class _LazyJit:
    """``jax.jit(fun, **kwargs)`` built on first use, with :func:`compiler_options` added.

    The backend is known only once JAX is initialized, which a module-level decorator must not
    force; the wrapped function is jitted at its first call (or ``lower``).
    """

    def __init__(self, fun: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self._fun = fun
        self._kwargs = kwargs
        self._jitted: Any = None
        self._nested: Any = None
        functools.update_wrapper(self, fun)

    def _get(self) -> Any:
        if self._jitted is None:
            self._jitted = jax.jit(self._fun, compiler_options=compiler_options(), **self._kwargs)
        return self._jitted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            # Called inside another transformation (a caller's jit, eval_shape, vmap): JAX
            # takes compiler options only at the top level, and the caller's compilation
            # decides them anyway.
            if self._nested is None:
                self._nested = jax.jit(self._fun, **self._kwargs)
            return self._nested(*args, **kwargs)
        return self._get()(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(...).lower``: the lowering for these arguments."""
        return self._get().lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return 0 if self._jitted is None else self._jitted._cache_size()


def jit(fun: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """``jax.jit`` with the backend's :func:`compiler_options`; usable as a decorator.

    Args:
        fun: The function to compile; omit it to get a decorator (``@jit(static_argnames=...)``).
        **kwargs: Passed to ``jax.jit`` (``static_argnames``, ``donate_argnums``, shardings...).

    Returns:
        The jitted function (built at its first call), or a decorator.

    Raises:
        TypeError: If ``compiler_options`` is passed (it is chosen per backend).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.utils.compile_options import jit
        >>> @jit(static_argnames=("k",))
        ... def scale(x, k):
        ...     return k * x
        >>> int(scale(jnp.int32(2), k=3))
        6
    """
    if "compiler_options" in kwargs:
        msg = "jit: compiler_options is chosen per backend; call jax.jit directly to set it"
        raise TypeError(msg)
    if fun is None:
        return lambda f: _LazyJit(f, kwargs)
    return _LazyJit(fun, kwargs)
