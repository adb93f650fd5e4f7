"""The library's ``jit``: backend options at the top level, none inside a caller's trace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.utils import compile_options
from artifex.generative_models.utils.compile_options import compiler_options, jit


def test_top_level_calls_take_the_backend_options(monkeypatch):
    monkeypatch.delenv(compile_options.LEVEL_ENV_VAR, raising=False)  # the tests set level 0
    on_cpu = jax.default_backend() == "cpu"
    assert compiler_options() == ({"xla_backend_optimization_level": 1} if on_cpu else None)
    for level in ("0", "3"):
        monkeypatch.setenv(compile_options.LEVEL_ENV_VAR, level)
        assert compiler_options() == (
            {"xla_backend_optimization_level": int(level)} if on_cpu else None
        )
    monkeypatch.setenv(compile_options.ENV_VAR, "0")
    assert compiler_options() is None


@pytest.mark.parametrize("bad", ["4", "-1", "one", "1.0"])
def test_a_bad_level_is_refused_with_the_variable_name(monkeypatch, bad):
    if jax.default_backend() != "cpu":
        pytest.skip("the level applies on the CPU only")
    monkeypatch.setenv(compile_options.LEVEL_ENV_VAR, bad)
    with pytest.raises(ValueError, match=f"ARTIFEX_CPU_OPT_LEVEL: expected .* got '{bad}'"):
        compiler_options()


def test_the_level_reaches_jax_jit(monkeypatch):
    """The library's ``jit`` hands the level in force at its first call to ``jax.jit``."""
    if jax.default_backend() != "cpu":
        pytest.skip("the level applies on the CPU only")
    seen = []
    real_jit = jax.jit

    def spy(fun, **kwargs):
        seen.append(kwargs.get("compiler_options"))
        return real_jit(fun, **kwargs)

    monkeypatch.setattr(compile_options.jax, "jit", spy)
    x = jnp.linspace(0.0, 1.0, 5, dtype=jnp.float32)
    for level in ("0", "2"):
        monkeypatch.setenv(compile_options.LEVEL_ENV_VAR, level)
        f = jit(lambda v: jnp.tanh(v) * 2.0)
        np.testing.assert_allclose(f(x), 2.0 * np.tanh(np.asarray(x, np.float64)), rtol=1e-6)
    assert seen == [{"xla_backend_optimization_level": 0}, {"xla_backend_optimization_level": 2}]


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
