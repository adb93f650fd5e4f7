"""The library's ``jit``: backend options at the top level, none inside a caller's trace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.utils import compile_options
from artifex.generative_models.utils.compile_options import compiler_options, jit


def test_top_level_calls_take_the_backend_options(monkeypatch):
    assert compiler_options() == (
        {"xla_backend_optimization_level": 1} if jax.default_backend() == "cpu" else None
    )
    monkeypatch.setenv(compile_options.ENV_VAR, "0")
    assert compiler_options() is None


def test_a_library_function_runs_inside_a_callers_transformations():
    """JAX refuses compiler options on a nested jit: inside a caller's jit, eval_shape, vmap or
    grad the library's jitted functions compile as part of the caller's program instead."""

    @jit(static_argnames=("k",))
    def scale(x, k):
        return k * jnp.sin(x)

    x = jnp.linspace(0.0, 1.0, 5, dtype=jnp.float32)
    want = 3.0 * np.sin(np.asarray(x, np.float64))
    np.testing.assert_allclose(scale(x, k=3), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda y: scale(y, k=3))(x), want, rtol=1e-6)
    assert jax.eval_shape(lambda y: scale(y, k=3), x).shape == (5,)
    np.testing.assert_allclose(jax.vmap(lambda y: scale(y, k=3))(x), want, rtol=1e-6)
    grad = jax.grad(lambda y: scale(y, k=3).sum())(x)
    np.testing.assert_allclose(grad, 3.0 * np.cos(np.asarray(x, np.float64)), rtol=1e-6)


def test_compiler_options_cannot_be_passed():
    with pytest.raises(TypeError, match="chosen per backend"):
        jit(lambda x: x, compiler_options={})
