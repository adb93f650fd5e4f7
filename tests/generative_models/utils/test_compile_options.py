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
        {
            "xla_backend_optimization_level": 1,
            "xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_COMPILE",
        }
        if jax.default_backend() == "cpu"
        else None
    )
    monkeypatch.setenv(compile_options.ENV_VAR, "0")
    assert compiler_options() is None


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU options")
def test_an_option_this_jaxlib_lacks_is_left_out_and_the_rest_kept(monkeypatch):
    monkeypatch.setattr(
        compile_options,
        "CPU_COMPILER_OPTIONS",
        {
            "xla_backend_optimization_level": 1,
            "xla_no_such_option_anywhere": 1,
            "xla_cpu_opt_preset": "CPU_OPT_PRESET_NO_SUCH_PRESET",
        },
    )
    compile_options._known_cpu_options.cache_clear()
    try:
        assert compiler_options() == {"xla_backend_optimization_level": 1}
    finally:
        compile_options._known_cpu_options.cache_clear()
    monkeypatch.undo()
    assert compiler_options() == compile_options.CPU_COMPILER_OPTIONS


def test_programs_compiled_with_the_options_compute_the_same_values():
    """The options change how XLA compiles, not what: a small layer against float64 NumPy."""

    @jit
    def layer(x, w):
        h = x @ w
        return jax.nn.silu(h) * jnp.tanh(h), jax.nn.logsumexp(h, axis=-1)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = (rng.standard_normal((32, 48)) / 6).astype(np.float32)
    got, lse = layer(x, w)
    h = x.astype(np.float64) @ w.astype(np.float64)
    want = h / (1 + np.exp(-h)) * np.tanh(h)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    m = h.max(axis=-1)
    np.testing.assert_allclose(lse, m + np.log(np.exp(h - m[:, None]).sum(-1)), rtol=1e-6)


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
