"""Step rewards from single-turn reward functions: steps, their last tokens, the batch field,
the process advantages (float64 NumPy), the loop with minibatches and dynamic sampling."""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.models.causal_lm import Tokenizer
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl.loop import TrainConfig, train
from artifex.generative_models.training.rl.objective import compute_advantages
from artifex.generative_models.training.rl.rewards import RewardCombiner, RewardFunctionError
from artifex.generative_models.training.rl.rollout import RolloutConfig, rollout
from artifex.generative_models.training.rl.step_rewards import (
    StepRewards,
    split_steps,
    step_end_tokens,
)

FIXTURES = pathlib.Path(__file__).parents[3] / "fixtures"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steps_join_back_to_the_completion(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        text = "".join(rng.choice(list("ab\n;"), size=int(rng.integers(0, 12))))
        for sep in ("\n", ";", "\n\n"):
            steps = split_steps(text, sep)
            assert "".join(steps) == text
            assert all(s for s in steps)
            assert all(s.endswith(sep) for s in steps[:-1])
            assert sep not in "".join(s[: -len(sep)] if s.endswith(sep) else s for s in steps)


def _brute_force(tokenizer, ids, end):
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if end >= len(text):
        return len(ids) - 1
    return next(
        j
        for j in range(len(ids))
        if len(tokenizer.decode(ids[: j + 1], skip_special_tokens=True)) >= end
    )


@pytest.mark.parametrize("which", ["characters", "byte-level BPE"])
def test_step_end_tokens_equal_a_linear_scan(which):
    if which == "characters":
        tok = Tokenizer.for_characters("0123456789+= \n")
    else:
        tok = Tokenizer.from_pretrained(str(FIXTURES / "tokenizer_tiny"))
    rng = np.random.default_rng(0)
    texts = ["12+3=15\n4 5\n6", "the cat\nsat on\nthe mat", "a\n\nb\nc d e f\n"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            continue
        decoded = tok.decode(ids, skip_special_tokens=True)
        ends = sorted({int(e) for e in rng.integers(1, len(decoded) + 2, size=6)})
        got = step_end_tokens(tok, ids, ends)
        assert got == [_brute_force(tok, ids, e) for e in ends]


def test_score_checks_what_the_function_returns():
    def ok(prompts, completions, steps, **columns):
        return [[1.0] * len(s) if i else None for i, s in enumerate(steps)]

    rewards = StepRewards(ok)
    out = rewards.score(["q", "q"], ["a\nb", "c\nd\ne"])
    assert math.isnan(out[0][0]) and len(out[0]) == 2 and out[1] == [1.0, 1.0, 1.0]

    def short(prompts, completions, steps, **columns):
        return [[1.0] for _ in steps]

    with pytest.raises(ValueError, match=r"row 0: 1 rewards for 2 steps \(split at '\\n'\)"):
        StepRewards(short).score(["q"], ["a\nb"])

    def infinite(prompts, completions, steps, **columns):
        return [[math.inf] for _ in steps]

    with pytest.raises(ValueError, match="step 0 is infinite"):
        StepRewards(infinite).score(["q"], ["a"])

    def boom(prompts, completions, steps, **columns):
        raise KeyError("answer")

    with pytest.raises(RewardFunctionError, match="boom raised KeyError"):
        StepRewards(boom).score(["q"], ["a"])
    with pytest.raises(ValueError, match="'steps' clashes"):
        StepRewards(ok).score(["q"], ["a"], steps=["x"])
    with pytest.raises(TypeError, match=r"StepRewards\.fn"):
        StepRewards("not a function")
    with pytest.raises(ValueError, match="separator"):
        StepRewards(ok, separator="")


def digit_steps(prompts, completions, steps, **columns):
    """1 for a step with a digit, 0 otherwise (a step reward for the tests and the CLI)."""
    return [[float(any(c.isdigit() for c in s)) for s in row] for row in steps]


def _numpy_process_advantages(step_rewards, group_size, eps=1e-4):
    """DeepSeekMath sec. 4.1.3 in float64: normalize all step rewards of a group together
    (Bessel std), then sum the normalized rewards at or after each token."""
    r = np.asarray(step_rewards, np.float64)
    b = r.shape[0]
    out = np.zeros_like(r)
    for g in range(b // group_size):
        rows = r[g * group_size : (g + 1) * group_size]
        valid = rows[~np.isnan(rows)]
        if valid.size == 0:
            continue
        std = valid.std(ddof=1) if valid.size > 1 else 0.0
        norm = np.where(np.isnan(rows), 0.0, (rows - valid.mean()) / (std + eps))
        out[g * group_size : (g + 1) * group_size] = np.cumsum(norm[:, ::-1], axis=1)[:, ::-1]
    return out


def test_rollout_places_each_steps_reward_at_its_last_token():
    trainer, tok = _trainer()
    rows = [{"prompt": "12+3="}, {"prompt": "7+8="}]
    # "+" ends a step: the demo tokenizer has no newline.
    steps = StepRewards(digit_steps, separator="+")
    zero = RewardCombiner([lambda p, c, **k: [0.0] * len(c)])
    ro = rollout(trainer, tok, rows, zero, RolloutConfig(max_new_tokens=8),
                 key=jax.random.key(0), step_rewards=steps)  # fmt: skip
    step_rewards = np.asarray(ro.batch.step_rewards)
    mask = np.asarray(ro.batch.completion_mask)
    ids = np.asarray(ro.batch.completion_ids)
    placed = 0
    for i, text in enumerate(ro.completions):
        n = int(mask[i].sum())
        expected = np.full(ids.shape[1], np.nan)
        pieces = split_steps(text, "+")
        end = 0
        for k, piece in enumerate(pieces):
            end += len(piece)
            t = _brute_force(tok, list(ids[i, :n]), end)
            value = digit_steps(None, None, [pieces])[0][k]
            expected[t] = value if np.isnan(expected[t]) else expected[t] + value
        np.testing.assert_array_equal(step_rewards[i], expected.astype(np.float32))
        placed += len(pieces)
    assert placed > len(ro.completions)  # several steps per completion on average
    adv = compute_advantages(ro.batch, trainer.config)
    np.testing.assert_allclose(
        np.asarray(adv), _numpy_process_advantages(step_rewards, 4), rtol=1e-5, atol=1e-5
    )


def _trainer():
    tok = demo_tokenizer()
    model = demo_model(tok, seed=0)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return GRPOTrainer(model, opt, GRPOConfig(num_generations=4, beta=0.0)), tok


def test_the_loop_trains_on_step_rewards_with_minibatches_and_dynamic_sampling():
    train_rows = addition_dataset(seed=0, num_eval=4)[0][:32]

    def digits(prompts, completions, **columns):
        return [float(sum(ch.isdigit() for ch in c)) for c in completions]

    steps = StepRewards(digit_steps, separator="+")
    trainer, tok = _trainer()
    config = TrainConfig(num_steps=2, prompts_per_step=2, num_iterations=2, num_minibatches=2,
                         dynamic_sampling=True, max_resample_rounds=1, progress=False)  # fmt: skip
    result = train(trainer, tok, train_rows, [digits], config, RolloutConfig(max_new_tokens=6),
                   step_rewards=steps)  # fmt: skip
    assert len(result.history) == 2
    for metrics in result.history:
        assert np.isfinite(metrics["total_loss"]) and np.isfinite(metrics["advantage_std"])
    with pytest.raises(ValueError, match="custom rollout_fn"):
        train(trainer, tok, train_rows, [digits], config, RolloutConfig(max_new_tokens=6),
              step_rewards=steps, rollout_fn=rollout)  # fmt: skip
    with pytest.raises(TypeError, match="StepRewards"):
        rollout(trainer, tok, train_rows[:1], RewardCombiner([digits]), RolloutConfig(),
                key=jax.random.key(0), step_rewards=digit_steps)  # fmt: skip


def test_step_rewards_change_the_update():
    """The same rollout with and without step rewards gives different advantages (the option
    is not a no-op), and the token advantages are zero after the last step's reward."""
    trainer, tok = _trainer()
    rows = addition_dataset(seed=0, num_eval=4)[0][:2]
    combiner = RewardCombiner([lambda p, c, **k: [float(len(x)) for x in c]])
    kwargs = dict(key=jax.random.key(1))
    plain = rollout(trainer, tok, rows, combiner, RolloutConfig(max_new_tokens=6), **kwargs)
    stepped = rollout(trainer, tok, rows, combiner, RolloutConfig(max_new_tokens=6),
                      step_rewards=StepRewards(digit_steps, separator="+"), **kwargs)  # fmt: skip
    a = compute_advantages(plain.batch, trainer.config)
    b = compute_advantages(stepped.batch, trainer.config)
    assert a.ndim == 1 and b.ndim == 2
    assert not np.allclose(np.asarray(jnp.broadcast_to(a[:, None], b.shape)), np.asarray(b))


def test_step_rewards_need_fixed_size_groups():
    """The process kernel normalizes blocks of group_size rows: group_ids must describe them
    (dynamic sampling's do); ragged groups are refused before anything is traced."""
    from artifex.generative_models.training.rl import GRPOBatch

    def batch(group_ids):
        b = len(group_ids)
        steps = jnp.full((b, 2), jnp.nan).at[:, 1].set(jnp.arange(b, dtype=jnp.float32))
        return GRPOBatch(prompt_ids=jnp.ones((b, 1), jnp.int32),
                         completion_ids=jnp.ones((b, 2), jnp.int32),
                         completion_mask=jnp.ones((b, 2)), rewards=jnp.zeros(b),
                         step_rewards=steps, group_ids=jnp.asarray(group_ids),
                         group_size=2)  # fmt: skip

    batch([1, 1, 0, 0]).validate()
    for ragged in ([0, 0, 0, 1], [0, 1, 0, 1], [0, 0, 1]):
        with pytest.raises(ValueError, match="blocks of group_size=2 consecutive rows"):
            batch(ragged).validate()
