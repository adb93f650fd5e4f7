"""Rollouts: prompt-major batches, reward columns, old/reference log-probs, bad input."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import demo_model, demo_tokenizer
from artifex.generative_models.models.causal_lm import Tokenizer
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl.rewards import RewardCombiner, RewardFunctionError
from artifex.generative_models.training.rl.rollout import (
    RolloutConfig,
    encode_prompts,
    rollout,
    rollout_batch_like,
)

ROWS = [
    {"prompt": "12+3=", "answer": "15", "id": 0},
    {"prompt": "7+8=", "answer": "15", "id": 1},
    {"prompt": "40+2=", "answer": "42", "id": 2},
]


def make_trainer(beta=0.0, reference=True, temperature=1.0, **cfg):
    tok = demo_tokenizer()
    model = demo_model(tok, seed=0)
    ref = demo_model(tok, seed=1) if reference else None
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
        GRPOConfig(num_generations=4, beta=beta, temperature=temperature, **cfg),
        reference_model=ref,
    )
    return trainer, tok


def test_rollout_builds_prompt_major_batch_and_passes_columns():
    trainer, tok = make_trainer()
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, **columns)
        return [float(len(c)) for c in completions]

    ro = rollout(
        trainer,
        tok,
        ROWS,
        RewardCombiner([spy]),
        RolloutConfig(max_new_tokens=5),
        key=jax.random.key(0),
    )
    b = ro.batch
    assert b.batch_size == 12 and b.group_size == 4 and b.completion_ids.shape == (12, 5)
    # Row i belongs to prompt i // 4: columns repeated per generation.
    assert seen["id"] == [0] * 4 + [1] * 4 + [2] * 4
    assert seen["answer"][4:8] == ["15"] * 4
    assert seen["prompts"][8] == "40+2="
    lengths = np.asarray(b.completion_mask).sum(1)
    assert seen["completion_length"] == lengths.tolist()
    # Decoded text is what the tokens say (cut at EOS, specials skipped).
    for i in range(12):
        ids = np.asarray(b.completion_ids[i, : lengths[i]])
        assert ro.completions[i] == tok.decode(ids)
    np.testing.assert_allclose(b.rewards, [len(c) for c in ro.completions])
    # Prompts decode back to the rows, left-padded.
    for i in range(12):
        ids = np.asarray(b.prompt_ids[i])[np.asarray(b.prompt_mask[i]) > 0]
        assert tok.decode(ids) == ROWS[i // 4]["prompt"]
    assert b.old_log_probs is None and b.ref_log_probs is None
    assert set(ro.metrics()) >= {"rewards/spy", "truncated_fraction", "completion_length_max"}


def scored(trainer, batch, model):
    fn = trainer.log_prob_fn
    return np.asarray(fn(model, batch)[0])


def test_rollout_normalizes_rewards_within_each_prompts_group():
    """The combiner gets the group size from the policy's GRPOConfig (GDPO normalization)."""
    trainer, tok = make_trainer()
    calls = []

    def by_prompt(prompts, completions, **columns):
        calls.append(len(prompts))
        # Prompt 0: rewards 0..3 (varied); prompt 1: all 5 (a constant group); prompt 2: 0..3.
        return [5.0 if p == "7+8=" else float(i % 4) for i, p in enumerate(prompts)]

    ro = rollout(
        trainer,
        tok,
        ROWS,
        RewardCombiner([by_prompt], mode="normalized"),
        RolloutConfig(max_new_tokens=3),
        key=jax.random.key(0),
    )
    r = np.asarray(ro.batch.rewards).reshape(3, 4)
    # Within groups the constant group standardizes to 0 and each group sums to 0; over the
    # whole batch (one group of 12) the constant group would be far above the mean.
    np.testing.assert_allclose(r[1], 0.0, atol=1e-6)
    np.testing.assert_allclose(r.sum(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(r[0], r[2], rtol=1e-6)
    assert calls == [12]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_old_log_probs_from_sampler_equal_recomputed(temperature):
    trainer, tok = make_trainer(beta=0.1, temperature=temperature)
    rewards = RewardCombiner([lambda p, c, **k: [0.0] * len(c)])
    kw = dict(key=jax.random.key(1), need_old_log_probs=True)
    a = rollout(
        trainer, tok, ROWS, rewards, RolloutConfig(max_new_tokens=5, old_log_probs="sampler"), **kw
    )
    b = rollout(
        trainer,
        tok,
        ROWS,
        rewards,
        RolloutConfig(max_new_tokens=5, old_log_probs="recompute"),
        **kw,
    )
    mask = np.asarray(a.batch.completion_mask) > 0
    np.testing.assert_array_equal(a.batch.completion_ids, b.batch.completion_ids)
    np.testing.assert_allclose(
        np.asarray(a.batch.old_log_probs)[mask], np.asarray(b.batch.old_log_probs)[mask], atol=1e-4
    )
    # Recomputed = the training graph's log-probs at the sampling temperature.
    np.testing.assert_allclose(
        np.asarray(b.batch.old_log_probs)[mask],
        scored(trainer, b.batch, trainer.model)[mask],
        atol=1e-6,
    )
    # Reference log-probs come from the reference model.
    np.testing.assert_allclose(
        np.asarray(a.batch.ref_log_probs)[mask],
        scored(trainer, a.batch, trainer.reference_model)[mask],
        atol=1e-5,
    )


def test_auto_recomputes_when_sampling_is_truncated():
    trainer, tok = make_trainer()
    rewards = RewardCombiner([lambda p, c, **k: [0.0] * len(c)])
    ro = rollout(
        trainer,
        tok,
        ROWS,
        rewards,
        RolloutConfig(max_new_tokens=5, top_k=3),
        key=jax.random.key(2),
        need_old_log_probs=True,
    )
    mask = np.asarray(ro.batch.completion_mask) > 0
    np.testing.assert_allclose(
        np.asarray(ro.batch.old_log_probs)[mask],
        scored(trainer, ro.batch, trainer.model)[mask],
        atol=1e-6,
    )


def test_chat_messages_use_the_chat_template():
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"  # noqa: E501
    tok = Tokenizer.for_characters("0123456789+=", chat_template=template)
    texts, ids, mask = encode_prompts(tok, [{"prompt": [{"role": "user", "content": "1+2"}]}])
    assert texts == ["1+2="]
    assert tok.decode(ids[0][mask[0] > 0]) == "1+2="


def test_missing_prompt_column_is_an_error():
    trainer, tok = make_trainer()
    with pytest.raises(ValueError, match="row 1 has no prompt column 'prompt'"):
        rollout(
            trainer,
            tok,
            [ROWS[0], {"question": "1+1="}],
            RewardCombiner([lambda p, c, **k: [0.0] * len(c)]),
            RolloutConfig(),
            key=jax.random.key(0),
        )


def test_prompt_longer_than_allowed_is_an_error_not_a_truncation():
    tok = demo_tokenizer()
    with pytest.raises(ValueError, match="max_prompt_length=3"):
        encode_prompts(tok, ROWS, max_prompt_length=3)


def test_reward_function_wrong_length_names_the_function():
    trainer, tok = make_trainer()

    def short_reward(prompts, completions, **k):
        return [1.0]

    with pytest.raises(ValueError, match="short_reward"):
        rollout(
            trainer,
            tok,
            ROWS,
            RewardCombiner([short_reward]),
            RolloutConfig(max_new_tokens=3),
            key=jax.random.key(0),
        )


def test_reward_exception_names_function_and_row():
    trainer, tok = make_trainer()

    def fragile(prompts, completions, id, **k):
        if 2 in id:
            raise KeyError("boom")
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"fragile.*row 8"):
        rollout(
            trainer,
            tok,
            ROWS,
            RewardCombiner([fragile]),
            RolloutConfig(max_new_tokens=3),
            key=jax.random.key(0),
        )


def test_none_rewards_become_nan():
    trainer, tok = make_trainer()
    ro = rollout(
        trainer,
        tok,
        ROWS,
        RewardCombiner([lambda p, c, id, **k: [None if i == 1 else 1.0 for i in id]]),
        RolloutConfig(max_new_tokens=3),
        key=jax.random.key(0),
    )
    r = np.asarray(ro.batch.rewards)
    assert np.isnan(r[4:8]).all() and (r[:4] == 1).all()
    assert jnp.isfinite(trainer.train_step(ro.batch)["total_loss"])


def test_sampler_log_probs_feed_the_mismatch_correction():
    """Top-k sampling makes the sampler differ from the trainer: the rollout keeps the
    sampler's log-probs, the step corrects with them and reports the mismatch."""
    trainer, tok = make_trainer(
        sampler_correction="truncate", sampler_ratio_max=2.0, entropy_coeff=0.0
    )
    rewards = RewardCombiner([lambda p, c, **k: [float(len(x) % 2) for x in c]])
    ro = rollout(
        trainer,
        tok,
        ROWS,
        rewards,
        RolloutConfig(max_new_tokens=5, top_k=3),
        key=jax.random.key(2),
        need_old_log_probs=True,
    )
    b = ro.batch
    mask = np.asarray(b.completion_mask) > 0
    sampler = np.asarray(b.sampler_log_probs)[mask]
    trainer_lp = np.asarray(b.old_log_probs)[mask]
    # Top-k renormalizes over 3 tokens: the sampler's probabilities are higher.
    assert (sampler >= trainer_lp - 1e-5).all() and (sampler > trainer_lp + 1e-3).any()
    metrics = trainer.train_step(b)
    d = trainer_lp - sampler
    np.testing.assert_allclose(metrics["sampler_logp_diff_mean"], np.abs(d).mean(), rtol=1e-4)
    np.testing.assert_allclose(metrics["sampler_kl"], np.mean(np.expm1(d) - d), rtol=1e-3)
    assert metrics["sampler_ratio_max"] <= 2.0 + 1e-6
    # Without the correction the rollout does not carry them.
    plain, _ = make_trainer()
    ro = rollout(plain, tok, ROWS, rewards, RolloutConfig(max_new_tokens=5), key=jax.random.key(2))
    assert ro.batch.sampler_log_probs is None


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("max_new_tokens", 0, ValueError),
        ("max_new_tokens", 4.0, TypeError),
        ("max_new_tokens", True, TypeError),
        ("top_k", 0, ValueError),
        ("top_p", 0.0, ValueError),
        ("top_p", 1.5, ValueError),
        ("top_p", "0.9", TypeError),
        ("prompt_column", "", ValueError),
        ("prompt_column", 3, TypeError),
        ("max_prompt_length", 0, ValueError),
        ("old_log_probs", "maybe", ValueError),
    ],
)
def test_rollout_config_errors_follow_the_one_rule(field, value, error):
    """Wrong type -> TypeError, right type out of range -> ValueError; the field is named."""
    with pytest.raises(error, match=f"RolloutConfig.{field}"):
        RolloutConfig(**{field: value})


def test_an_object_holding_a_model_still_works_with_a_deprecation_warning():
    import types

    from artifex.generative_models.training.rl.rollout import Policy, as_policy

    trainer, _ = make_trainer()
    assert as_policy(trainer).model is trainer.model  # a trainer presents its own Policy
    with pytest.warns(DeprecationWarning, match="rollout Policy"):
        policy = as_policy(types.SimpleNamespace(model=trainer.model))
    assert isinstance(policy, Policy) and policy.model is trainer.model
    with pytest.raises(TypeError, match="policy must be a rollout Policy"):
        as_policy(object())


def _layout(batch):
    """Everything a compiled program is specialized on: tree, static flags, shapes, dtypes."""
    leaves, tree = jax.tree.flatten(batch)
    return tree, [(x.shape, x.dtype) for x in leaves]


@pytest.mark.parametrize(
    ("cfg", "need_old", "rollout_cfg"),
    [
        ({}, False, {}),
        ({"beta": 0.05}, True, {}),  # old and reference log-probs from the scorer
        ({"beta": 0.0}, True, {"old_log_probs": "sampler"}),
        ({"sampler_correction": "truncate"}, False, {"max_prompt_length": 40}),
    ],
)
def test_rollout_batch_like_has_the_layout_of_the_rollouts_batch(cfg, need_old, rollout_cfg):
    trainer, tok = make_trainer(**cfg)
    config = RolloutConfig(max_new_tokens=5, **rollout_cfg)
    like = rollout_batch_like(trainer, tok, ROWS, config, need_old_log_probs=need_old)
    real = rollout(
        trainer,
        tok,
        ROWS,
        RewardCombiner([lambda prompts, completions, **_: [1.0] * len(completions)]),
        config,
        key=jax.random.key(0),
        need_old_log_probs=need_old,
    ).batch
    assert _layout(like) == _layout(real)
    assert (like.old_log_probs is not None) == need_old
    assert (like.ref_log_probs is not None) == (need_old and cfg.get("beta", 0.0) > 0)
    assert (like.sampler_log_probs is not None) == ("sampler_correction" in cfg)


def test_rollout_batch_like_reports_bad_input_as_the_rollout_would():
    trainer, tok = make_trainer()
    with pytest.raises(ValueError, match="at least one dataset row"):
        rollout_batch_like(trainer, tok, [], RolloutConfig())
    with pytest.raises(ValueError, match="no prompt column 'question'"):
        rollout_batch_like(trainer, tok, ROWS, RolloutConfig(prompt_column="question"))
    with pytest.raises(ValueError, match="more than max_prompt_length=2"):
        rollout_batch_like(trainer, tok, ROWS, RolloutConfig(max_prompt_length=2))
    with pytest.raises(ValueError, match="max_new_tokens=64, but the model has 32 positions"):
        rollout_batch_like(trainer, tok, ROWS, RolloutConfig(max_new_tokens=64))
    with pytest.raises(ValueError, match="'completion_length' clashes"):
        rollout_batch_like(
            trainer, tok, [{**ROWS[0], "completion_length": 3}], RolloutConfig(max_new_tokens=4)
        )
    with pytest.raises(TypeError, match="config must be a RolloutConfig, got dict"):
        rollout_batch_like(trainer, tok, ROWS, {"max_new_tokens": 4})
    with pytest.raises(TypeError, match="need_old_log_probs must be a bool, got 'no'"):
        rollout_batch_like(trainer, tok, ROWS, RolloutConfig(), need_old_log_probs="no")
    with pytest.raises(TypeError, match="rows must be a sequence of rows, got dict"):
        rollout_batch_like(trainer, tok, ROWS[0], RolloutConfig())
    policy = dataclasses.replace(trainer.policy(), score=None)
    with pytest.raises(ValueError, match="needs a Policy with a score function"):
        rollout_batch_like(
            policy, tok, ROWS, RolloutConfig(max_new_tokens=4), need_old_log_probs=True
        )
