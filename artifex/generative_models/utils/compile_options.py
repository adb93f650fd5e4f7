"""XLA compiler options for the library's own compiled programs, chosen per backend.

On the CPU, XLA hands each fused kernel to LLVM at its highest optimization level, and that
code generation is most of the time of a first training step. Two options shorten it:

- ``xla_backend_optimization_level=1``: LLVM at level 1 compiles the W1 update about 15-25%
  faster and ran no slower (the kernels that matter are matmuls, which XLA:CPU calls from its
  libraries rather than generating). Level 0 is much slower at run time, so it is not used.
- ``xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE``, XLA:CPU's preset for compile time: it
  fuses less (W1's update: 1,031 top-level operations against 936, temporaries 0.48 against
  0.42 GB), yet every program ran faster with it, side by side on 2026-11-26: W2's update
  compiled in 12.2 against 13.5 s and ran 2% faster, W1's and W2's sampler 3-7% faster, for
  2-3% more peak memory (`docs/benchmarks.md`). A jaxlib whose XLA lacks the option compiles
  without it.

Other backends keep XLA's defaults. Set ``ARTIFEX_CPU_FAST_COMPILE=0`` to compile with XLA's
defaults everywhere.

Example:
    >>> import jax, jax.numpy as jnp
    >>> double = jit(lambda x: 2 * x)
    >>> int(double(jnp.int32(3)))
    6
    >>> options = compiler_options()  # CPU_COMPILER_OPTIONS on the CPU, else None
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["CPU_COMPILER_OPTIONS", "ENV_VAR", "compiler_options", "jit"]

ENV_VAR = "ARTIFEX_CPU_FAST_COMPILE"
CPU_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_backend_optimization_level": 1,
    "xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_COMPILE",
}


def _accepted(options: dict[str, Any]) -> bool:
    """Whether this jaxlib's XLA accepts ``options`` (compiles a tiny program)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
    except jax.errors.JaxRuntimeError as exc:
        if "No such compile option" in str(exc) or "not a valid enum value" in str(exc):
            return False
        raise
    return True


@functools.cache
def _known_cpu_options() -> tuple[tuple[str, Any], ...]:
    """The items of :data:`CPU_COMPILER_OPTIONS` this jaxlib knows (probed once per process)."""
    if _accepted(CPU_COMPILER_OPTIONS):
        return tuple(CPU_COMPILER_OPTIONS.items())
    return tuple((k, v) for k, v in CPU_COMPILER_OPTIONS.items() if _accepted({k: v}))


def compiler_options() -> dict[str, Any] | None:
    """Compiler options for ``jax.jit`` on the default backend (None: XLA's defaults).

    Returns:
        :data:`CPU_COMPILER_OPTIONS` (those this jaxlib knows) when the default backend is the
        CPU and ``ARTIFEX_CPU_FAST_COMPILE`` is not ``0``/``false``/``no``/``off``; otherwise
        None.

    Example:
        >>> import jax
        >>> options = compiler_options()
        >>> options is None or options.items() <= CPU_COMPILER_OPTIONS.items()
        True
        >>> f = jax.jit(lambda x: x + 1, compiler_options=options)
    """
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if jax.default_backend() != "cpu":
        return None
    return dict(_known_cpu_options())


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

    Example:
        >>> import jax.numpy as jnp
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
