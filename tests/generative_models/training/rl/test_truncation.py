"""``GRPOConfig.mask_truncated_completions``: the mask, the rollouts that apply it, the update.

TRL parity of the loss on masked batches is in ``test_trl_parity.py`` (cases
``mask_truncated_*``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import demo_model, demo_tokenizer
from artifex.demos.tools import tool_demo_tokenizer
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch
from artifex.generative_models.training.rl.multiturn import MultiTurnConfig, MultiTurnRollout
from artifex.generative_models.training.rl.rewards import RewardCombiner
from artifex.generative_models.training.rl.rollout import RolloutConfig, rollout
from artifex.generative_models.training.rl.truncation import mask_truncated_completions

ROWS = [{"prompt": "12+3="}, {"prompt": "7+8="}, {"prompt": "40+2="}]


def _batch(rng: np.random.Generator, b: int = 8, t: int = 5) -> GRPOBatch:
    lengths = rng.integers(1, t + 1, b)
    return GRPOBatch(
        prompt_ids=jnp.ones((b, 2), jnp.int32),
        completion_ids=jnp.ones((b, t), jnp.int32),
        completion_mask=jnp.asarray(np.arange(t)[None] < lengths[:, None], jnp.float32),
        rewards=jnp.asarray(rng.normal(size=b), jnp.float32),
        group_size=4,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mask_matches_a_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    batch = _batch(rng)
    cut = rng.random(batch.batch_size) < 0.5
    out = mask_truncated_completions(batch, cut)
    mask = np.asarray(batch.completion_mask, np.float64)
    expected = mask * (1.0 - cut.astype(np.float64))[:, None]
    np.testing.assert_array_equal(np.asarray(out.completion_mask, np.float64), expected)
    assert out.completion_mask.dtype == batch.completion_mask.dtype
    np.testing.assert_array_equal(out.rewards, batch.rewards)  # rewards untouched


def test_bad_flags_are_errors():
    batch = _batch(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"truncated must have shape \(8,\)"):
        mask_truncated_completions(batch, np.zeros(7, bool))
    with pytest.raises(TypeError, match="booleans"):
        mask_truncated_completions(batch, np.zeros(8, np.int32))
    with pytest.raises(TypeError, match="GRPOBatch"):
        mask_truncated_completions({"completion_mask": 1}, np.zeros(8, bool))
    with pytest.raises(TypeError, match="mask_truncated_completions"):
        GRPOConfig(mask_truncated_completions=1)


def _trainer(**cfg):
    tok = demo_tokenizer()
    model = demo_model(tok, seed=0)
    config = GRPOConfig(num_generations=4, beta=0.0, **cfg)
    # SGD: the parameters move by the gradient itself (Adam's first step is its sign).
    return GRPOTrainer(model, nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param), config), tok


def _lengths(prompts, completions, completion_length, **columns):
    return [float(n) for n in completion_length]


def test_rollout_masks_exactly_the_truncated_rows():
    """Same key with and without the option: the cut rows lose their mask, nothing else moves;
    the rollout's length metrics still see the cut rows' tokens."""
    results = []
    for on in (False, True):
        trainer, tok = _trainer(mask_truncated_completions=on)
        results.append(
            rollout(
                trainer,
                tok,
                ROWS,
                RewardCombiner([_lengths]),
                RolloutConfig(max_new_tokens=3),
                key=jax.random.key(0),
                need_old_log_probs=True,
            )
        )
    plain, masked = results
    cut = masked.truncated
    assert 0 < cut.sum() < cut.size  # the case is exercised both ways
    np.testing.assert_array_equal(plain.truncated, cut)
    np.testing.assert_array_equal(masked.batch.completion_mask[cut], 0)
    np.testing.assert_array_equal(
        masked.batch.completion_mask[~cut], plain.batch.completion_mask[~cut]
    )
    np.testing.assert_array_equal(masked.batch.rewards, plain.batch.rewards)  # rewards as before
    assert masked.metrics() == plain.metrics()


def test_update_on_a_masked_batch_does_not_depend_on_the_microbatches():
    """The masked rows still count in the row normalizers; the split does not change the step."""
    trainer, tok = _trainer(mask_truncated_completions=True, loss_aggregation="token_mean")
    ro = rollout(
        trainer,
        tok,
        ROWS[:2],
        RewardCombiner([_lengths]),
        RolloutConfig(max_new_tokens=3),
        key=jax.random.key(0),
    )
    assert ro.truncated.any()
    params = []
    for n in (1, 2):
        trainer, _ = _trainer(mask_truncated_completions=True, loss_aggregation="token_mean")
        trainer.train_step(ro.batch, num_microbatches=n)
        params.append(jax.tree.map(np.asarray, nnx.state(trainer.model, nnx.Param)))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), *params)


class _Chatty:
    """An environment that always wants another turn (episodes end by a limit)."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, completion):
        return [{"role": "tool", "content": "go on"}], 0.0, False


def test_multi_turn_rollout_masks_the_episodes_cut_by_a_token_limit():
    tok = tool_demo_tokenizer()
    model = demo_model(tok, seed=0, max_positions=128)
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
        GRPOConfig(num_generations=4, beta=0.0, mask_truncated_completions=True),
    )
    ro_fn = MultiTurnRollout(
        _Chatty, MultiTurnConfig(max_turns=2, max_new_tokens=4, max_completion_tokens=64)
    )

    def zero(prompts, completions, **columns):
        return [0.0] * len(completions)

    ro = ro_fn(trainer, tok, [{"prompt": "3*4"}], RewardCombiner([zero]), RolloutConfig(),
               key=jax.random.key(0))  # fmt: skip
    cut = ro.episodes.token_limit
    mask = np.asarray(ro.batch.completion_mask)
    np.testing.assert_array_equal(mask[cut], 0)
    np.testing.assert_array_equal(mask[~cut], ro.episodes.completion_mask[~cut])
    np.testing.assert_array_equal(ro.lengths, ro.episodes.completion_mask.sum(axis=1))
