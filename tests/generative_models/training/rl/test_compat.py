"""Tests for artifex.generative_models.training.rl.compat (the dict batch form)."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.training.rl.batch import GRPOBatch
from artifex.generative_models.training.rl.compat import DICT_BATCH_KEYS, dict_batch_fields


def _dict_batch(rng: np.random.Generator, b: int = 6, **extra):
    batch = {
        "observations": rng.normal(size=(b, 3)).astype(np.float32),
        "actions": rng.integers(0, 4, size=(b,)),
        "rewards": rng.normal(size=(b,)),
    }
    batch.update(extra)
    return batch


def test_single_step_actions_become_completions_of_length_one():
    rng = np.random.default_rng(0)
    log_probs = -rng.uniform(0.1, 2.0, size=(6,))
    batch = _dict_batch(rng, log_probs=log_probs, ref_log_probs=log_probs - 0.1)
    fields = dict_batch_fields(batch, group_size=3)
    chex.assert_shape(
        [fields["completion_ids"], fields["completion_mask"], fields["old_log_probs"]], (6, 1)
    )
    chex.assert_type(fields["completion_ids"], jnp.int32)
    chex.assert_type([fields["rewards"], fields["old_log_probs"]], jnp.float32)
    np.testing.assert_array_equal(fields["completion_ids"][:, 0], batch["actions"])
    np.testing.assert_array_equal(fields["completion_mask"], np.ones((6, 1)))
    chex.assert_trees_all_close(fields["old_log_probs"][:, 0], log_probs.astype(np.float32))
    assert fields["prompt_ids"] is batch["observations"]
    assert fields["advantages"] is None
    assert fields["group_size"] == 3


def test_sequences_of_actions_and_group_size_override():
    rng = np.random.default_rng(1)
    batch = _dict_batch(rng, actions=rng.integers(0, 4, size=(6, 5)), group_size=np.array(2))
    batch["advantages"] = np.arange(6.0)
    fields = dict_batch_fields(batch, group_size=3)
    chex.assert_shape(fields["completion_ids"], (6, 5))
    assert fields["group_size"] == 2 and isinstance(fields["group_size"], int)
    chex.assert_trees_all_close(fields["advantages"], jnp.arange(6.0))


def test_from_dict_builds_the_batch_from_the_fields():
    rng = np.random.default_rng(2)
    batch = _dict_batch(rng)
    built = GRPOBatch.from_dict(batch, group_size=3).validate()
    fields = dict_batch_fields(batch, group_size=3)
    chex.assert_trees_all_equal(built, GRPOBatch(**fields))


def test_errors():
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match=r"unknown batch keys \['extra'\]"):
        dict_batch_fields(_dict_batch(rng, extra=1), group_size=2)
    batch = _dict_batch(rng)
    del batch["rewards"]
    with pytest.raises(ValueError, match="missing required keys"):
        dict_batch_fields(batch, group_size=2)
    with pytest.raises(TypeError, match="integer"):
        dict_batch_fields(_dict_batch(rng, actions=np.zeros(6)), group_size=2)
    with pytest.raises(ValueError, match=r"shape \(B,\) or \(B, L\)"):
        dict_batch_fields(_dict_batch(rng, actions=np.zeros((6, 1, 1), int)), group_size=2)
    with pytest.raises(ValueError, match="log_probs"):
        dict_batch_fields(_dict_batch(rng, log_probs=np.zeros((6, 2))), group_size=2)
    assert {"observations", "actions", "rewards"} <= DICT_BATCH_KEYS
