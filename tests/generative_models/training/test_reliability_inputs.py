"""Range checks where inputs enter: kernels, the sampler, the tokenizer against the model."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.demos.addition import demo_model, demo_tokenizer
from artifex.generative_models.inference.sampling import generate
from artifex.generative_models.training.rl.advantages import (
    group_advantages,
    process_advantages,
    segment_advantages,
)
from artifex.generative_models.training.rl.loop import check_tokenizer_fits


def reference_segment_advantages(rewards, ids, eps=1e-4):
    """float64 NumPy reference: (r - group mean) / (group std (ddof 1) + eps)."""
    out = np.zeros_like(rewards, np.float64)
    for g in np.unique(ids):
        r = rewards[ids == g].astype(np.float64)
        std = r.std(ddof=1) if r.size > 1 else 0.0
        out[ids == g] = (r - r.mean()) / (std + eps)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_checked_segment_kernel_still_matches_the_reference(seed):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.repeat(np.arange(4), 3)).astype(np.int32)
    rewards = rng.normal(size=12).astype(np.float32)
    got = segment_advantages(jnp.asarray(rewards), jnp.asarray(ids))
    np.testing.assert_allclose(
        got, reference_segment_advantages(rewards, ids), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("bad", [[0, 0, 1, 1, 2, 2, 3, 8], [0, 0, 1, 1, 2, 2, 3, -1]])
def test_segment_group_ids_out_of_range_are_rejected(bad):
    with pytest.raises(ValueError, match=r"group_ids must lie in \[0, 8\)"):
        segment_advantages(jnp.arange(8.0), jnp.asarray(bad, jnp.int32))
    with pytest.raises(ValueError, match=r"group_ids must lie in \[0, 4\)"):
        segment_advantages(jnp.arange(8.0), jnp.asarray(bad, jnp.int32), num_groups=4)


def test_float_group_ids_are_a_type_error():
    with pytest.raises(TypeError, match="group_ids must be integers"):
        segment_advantages(jnp.arange(4.0), jnp.zeros(4))


@pytest.mark.parametrize("eps", [-1e-4, float("nan"), float("inf"), True])
def test_kernel_eps_must_be_a_finite_non_negative_number(eps):
    for call in (
        lambda: group_advantages(jnp.arange(8.0), 4, eps=eps),
        lambda: segment_advantages(jnp.arange(8.0), jnp.zeros(8, jnp.int32), eps=eps),
        lambda: process_advantages(jnp.zeros((8, 3)), 4, eps=eps),
    ):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            call()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ddof": -1}, ValueError, "ddof must be an int >= 0, got -1"),
        ({"ddof": True}, TypeError, "ddof must be an int, got True"),
        ({"ddof": 1.0}, TypeError, "ddof must be an int, got 1.0"),
        ({"group_size": 0}, ValueError, "group_size must be an int >= 1, got 0"),
        ({"group_size": 2.0}, TypeError, "group_size must be an int"),
    ],
)
def test_kernel_sizes_follow_the_one_rule(kwargs, error, match):
    """Wrong type -> TypeError, right type out of range -> ValueError (CONTRIBUTING.md)."""
    kwargs = {"group_size": 4, **kwargs}
    with pytest.raises(error, match=match):
        group_advantages(jnp.arange(8.0), **kwargs)


def test_kernels_still_trace_inside_jit():
    f = jax.jit(lambda r, ids: segment_advantages(r, ids, eps=1e-3))
    assert np.isfinite(np.asarray(f(jnp.arange(8.0), jnp.repeat(jnp.arange(4), 2)))).all()


# ------------------------------------------------------------------ the sampler
@pytest.fixture(scope="module")
def model():
    return demo_model(demo_tokenizer())


@pytest.mark.parametrize("value", [-1, 10_000])
def test_generate_rejects_prompt_ids_outside_the_vocabulary(model, value):
    ids = np.ones((2, 4), np.int32)
    ids[1, 2] = value
    with pytest.raises(ValueError, match=r"prompt_ids must hold token ids in \[0, .*row 1"):
        generate(model, ids, key=jax.random.key(0), max_new_tokens=2)


def test_generate_ignores_padding_ids(model):
    ids = np.ones((2, 4), np.int32)
    mask = np.ones((2, 4), np.int32)
    ids[0, 0], mask[0, 0] = 10_000, 0  # left padding may hold anything
    out = generate(model, ids, mask, key=jax.random.key(0), max_new_tokens=2)
    assert out.completion_ids.shape[0] == 2


def test_tokenizer_larger_than_the_model_vocabulary_is_rejected(model):
    tok = demo_tokenizer()
    check_tokenizer_fits(tok, model)  # the matching pair passes

    class Bigger:
        vocab_size = model.config.vocab_size + 5

    with pytest.raises(ValueError, match=r"tokenizer has .* token ids but the model.s vocabulary"):
        check_tokenizer_fits(Bigger(), model)


def test_sizes_elsewhere_follow_the_one_rule(tmp_path):
    """The same rule for the step, the batch, checkpoints, meshes and the flow sampler."""
    import optax
    from flax import nnx

    from artifex.generative_models.flow import SDEConfig
    from artifex.generative_models.training.checkpointing import CheckpointManager
    from artifex.generative_models.training.rl import GRPOBatch, GRPOConfig
    from artifex.generative_models.training.rl.state import make_grpo_train_step

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    tx = optax.adam(1e-3)
    for bad, error in ((2.0, TypeError), (True, TypeError), (0, ValueError)):
        with pytest.raises(error, match="num_microbatches must be an int"):
            make_grpo_train_step(model, tx, GRPOConfig(), num_microbatches=bad)
        with pytest.raises(error, match="max_to_keep must be an int"):
            CheckpointManager(tmp_path / "ckpt", max_to_keep=bad)
    with pytest.raises(TypeError, match=re.escape("SDEConfig.num_steps must be an int, got 2.5")):
        SDEConfig(num_steps=2.5)
    with pytest.raises(ValueError, match=re.escape("num_steps must be an int >= 2, got 1")):
        SDEConfig(num_steps=1)
    with pytest.raises(TypeError, match=re.escape("SDEConfig.train_steps must be an int or None")):
        SDEConfig(num_steps=4, train_steps="2")
    with pytest.raises(ValueError, match=re.escape("SDEConfig.train_steps must be an int in")):
        SDEConfig(num_steps=4, train_steps=5)
    batch = GRPOBatch(
        prompt_ids=jnp.ones((4, 2), jnp.int32),
        prompt_mask=jnp.ones((4, 2), jnp.int32),
        completion_ids=jnp.ones((4, 3), jnp.int32),
        completion_mask=jnp.ones((4, 3), jnp.int32),
        rewards=jnp.arange(4.0),
        group_size=2.0,
    )
    with pytest.raises(TypeError, match=re.escape("GRPOBatch.group_size must be an int, got 2.0")):
        batch.validate()
    with pytest.raises(ValueError, match=re.escape("group_size must be an int >= 1, got 0")):
        batch.replace(group_size=0).validate()
