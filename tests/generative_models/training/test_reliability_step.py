"""Reliability of one training step: the non-finite guard, range checks, all-NaN rewards."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch, NonFiniteUpdateError


class BigramLM(nnx.Module):
    """A tiny causal LM with the library's LM interface (vocabulary of 6)."""

    def __init__(self, vocab: int = 6, dim: int = 8, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.head = nnx.Param(jax.random.normal(rngs.params(), (dim, vocab)) * 0.1)

    def hidden_states(self, ids, attention_mask=None, positions=None, cache=None):
        return jnp.tanh(self.embed(ids)), None

    def output_embedding(self):
        return self.head[...]


def lm_batch(seed=0, b=8, t=4, g=4, **changes):
    rng = np.random.default_rng(seed)
    batch = GRPOBatch(
        prompt_ids=jnp.asarray(rng.integers(0, 6, size=(b, 3)), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(0, 6, size=(b, t)), jnp.int32),
        completion_mask=jnp.ones((b, t), jnp.float32),
        rewards=jnp.asarray(rng.normal(size=b), jnp.float32),
        old_log_probs=jnp.asarray(-1.8 + 0.1 * rng.normal(size=(b, t)), jnp.float32),
        group_size=g,
    )
    return batch.replace(**changes)


def make_trainer(tx=None, **cfg):
    model = BigramLM()
    opt = nnx.Optimizer(model, tx or optax.adam(1e-2), wrt=nnx.Param)
    return GRPOTrainer(model, opt, GRPOConfig(num_generations=4, **cfg))


def leaves(trainer):
    return [
        np.asarray(x)
        for o in (trainer.model, trainer.optimizer)
        for x in jax.tree.leaves(nnx.state(o))
    ]


def assert_unchanged(before, trainer):
    for x, y in zip(before, leaves(trainer), strict=True):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------ non-finite update guard
def test_overflowing_update_changes_nothing_and_names_the_parameters():
    # A finite loss and gradient, but sgd(1e39) overflows float32 in the update itself.
    trainer = make_trainer(optax.sgd(1e39))
    before = leaves(trainer)
    with pytest.raises(NonFiniteUpdateError, match="updated parameters") as info:
        trainer.train_step(lm_batch())
    assert np.isfinite(info.value.metrics["total_loss"])
    assert np.isfinite(info.value.metrics["grad_norm"])
    assert "step 0" in str(info.value)
    assert_unchanged(before, trainer)


def test_overflowing_optimizer_state_changes_nothing():
    # Adam's second moment overflows (gradient ** 2 with the gradient scaled by 1e30) while
    # the normalized update stays finite: only the optimizer state is non-finite.
    tx = optax.chain(optax.scale(1e30), optax.adam(1e-3))
    trainer = make_trainer(tx)
    before = leaves(trainer)
    with pytest.raises(NonFiniteUpdateError, match="optimizer state"):
        trainer.train_step(lm_batch())
    assert_unchanged(before, trainer)


def test_guard_allows_training_to_continue_after_a_rejected_step():
    trainer = make_trainer(optax.inject_hyperparams(optax.sgd)(learning_rate=1e39))
    with pytest.raises(NonFiniteUpdateError):
        trainer.train_step(lm_batch())
    trainer.optimizer.opt_state.hyperparams["learning_rate"][...] = jnp.asarray(1e-2)
    m = trainer.train_step(lm_batch(seed=1))
    assert np.isfinite(m["total_loss"])
    assert all(np.isfinite(x).all() for x in leaves(trainer))


# ------------------------------------------------------------------ range checks
@pytest.mark.parametrize("field", ["prompt_ids", "completion_ids"])
@pytest.mark.parametrize("value", [6, 100, -1])
def test_token_ids_outside_the_vocabulary_are_rejected(field, value):
    trainer = make_trainer()
    batch = lm_batch()
    ids = np.asarray(getattr(batch, field)).copy()
    ids[5, 1] = value
    with pytest.raises(ValueError, match=rf"{field} must hold token ids in \[0, 6\).*row 5"):
        trainer.train_step(batch.replace(**{field: jnp.asarray(ids)}))
    assert trainer.num_compilations == 0


def test_out_of_range_ids_on_padding_are_allowed():
    trainer = make_trainer()
    batch = lm_batch()
    ids = np.asarray(batch.completion_ids).copy()
    mask = np.ones(ids.shape, np.float32)
    ids[2, 3], mask[2, 3] = 99, 0.0
    m = trainer.train_step(
        batch.replace(completion_ids=jnp.asarray(ids), completion_mask=jnp.asarray(mask))
    )
    assert np.isfinite(m["total_loss"])


@pytest.mark.parametrize("field", ["old_log_probs", "ref_log_probs"])
def test_positive_log_probs_are_rejected(field):
    batch = lm_batch(ref_log_probs=jnp.full((8, 4), -2.0))
    value = np.asarray(getattr(batch, field)).copy()
    value[3, 2] = 0.7  # a probability, not a log-probability
    with pytest.raises(ValueError, match=rf"{field} must be log-probabilities.*\(3, 2\)"):
        make_trainer(beta=0.1).train_step(batch.replace(**{field: jnp.asarray(value)}))
    value[3, 2] = 5e-4  # float rounding above 0 is tolerated
    make_trainer(beta=0.1).train_step(batch.replace(**{field: jnp.asarray(value)}))


def test_python_lists_as_batch_fields_are_converted_or_named():
    batch = lm_batch()
    as_lists = batch.replace(
        rewards=np.asarray(batch.rewards).tolist(),
        completion_ids=np.asarray(batch.completion_ids).tolist(),
    )
    m = make_trainer().train_step(as_lists)
    assert np.isfinite(m["total_loss"])
    ragged = batch.replace(completion_ids=[[1, 2], [3]] + [[1, 2]] * 6)
    with pytest.raises(ValueError, match="completion_ids"):
        make_trainer().train_step(ragged)


# ------------------------------------------------------------------ all-NaN rewards
def test_all_nan_rewards_give_nan_metrics_a_warning_and_no_update(caplog):
    trainer = make_trainer(beta=0.1, entropy_coeff=0.0)  # no entropy bonus asked for
    trainer.train_step(lm_batch(seed=1, ref_log_probs=jnp.full((8, 4), -2.0)))  # Adam moments
    before = leaves(trainer)
    batch = lm_batch(rewards=jnp.full((8,), jnp.nan), ref_log_probs=jnp.full((8, 4), -2.0))
    with caplog.at_level(logging.WARNING):
        m = trainer.train_step(batch)
    assert np.isnan(m["reward_mean"]) and np.isnan(m["reward_std"])
    assert any("every reward of this batch is NaN" in r.message for r in caplog.records)
    assert_unchanged(before, trainer)


def test_all_nan_rewards_skip_the_update_even_with_a_kl_penalty():
    trainer = make_trainer(beta=0.1, entropy_coeff=0.0)
    before = leaves(trainer)
    m = trainer.train_step(lm_batch(rewards=jnp.full((8,), jnp.nan)))
    assert np.isnan(m["reward_mean"])
    assert_unchanged(before, trainer)


def test_all_nan_rewards_still_apply_an_entropy_bonus_the_user_asked_for():
    # update_without_advantage=True: a batch without advantages still applies the entropy bonus
    # (by default it is skipped: test_state.py's zero-advantage test)
    trainer = make_trainer(entropy_coeff=0.1, beta=0.1, update_without_advantage=True)
    before = leaves(trainer)
    m = trainer.train_step(lm_batch(rewards=jnp.full((8,), jnp.nan)))
    assert np.isnan(m["reward_mean"])
    assert m["entropy"] > 0
    assert any(not np.array_equal(x, y) for x, y in zip(before, leaves(trainer), strict=True))


def test_some_nan_rewards_still_train():
    trainer = make_trainer()
    before = leaves(trainer)
    rewards = np.asarray(lm_batch().rewards).copy()
    rewards[:3] = np.nan
    m = trainer.train_step(lm_batch(rewards=jnp.asarray(rewards)))
    np.testing.assert_allclose(m["reward_mean"], np.nanmean(rewards), rtol=1e-5)
    assert any(not np.array_equal(x, y) for x, y in zip(before, leaves(trainer), strict=True))
