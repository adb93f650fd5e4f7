"""pass@k (unbiased, against exact float64/rational references), maj@n and the loop's sampled
evaluation (``TrainConfig.eval_num_samples``)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl.evaluation_metrics import (
    answer_key,
    majority_vote,
    pass_at_k,
    pass_at_k_values,
    sampled_metrics,
)
from artifex.generative_models.training.rl.loop import TrainConfig, train
from artifex.generative_models.training.rl.rewards import answers_equal, math_answer_reward
from artifex.generative_models.training.rl.rollout import RolloutConfig


def _exact(n: int, c: int, k: int) -> float:
    """``1 - C(n-c, k) / C(n, k)`` with exact integers (Chen et al., 2021, eq. 1)."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pass_at_k_equals_the_exact_binomial_ratio(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        n = int(rng.integers(1, 400))
        k = int(rng.integers(1, n + 1))
        c = int(rng.integers(0, n + 1))
        np.testing.assert_allclose(pass_at_k(n, c, k), _exact(n, c, k), rtol=1e-12, atol=1e-15)
    n = np.array([4, 10, 10])
    c = np.array([1, 0, 10])
    np.testing.assert_allclose(pass_at_k(n, c, 3), [_exact(4, 1, 3), 0.0, 1.0], rtol=1e-12)
    assert pass_at_k(n, c, 3).dtype == np.float64


def test_pass_at_k_errors():
    with pytest.raises(ValueError, match="num_samples must be >= k=5"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match=r"num_correct must lie in \[0, num_samples\]"):
        pass_at_k(4, 5, 2)
    with pytest.raises(TypeError, match="integers"):
        pass_at_k(4.0, 1, 2)
    with pytest.raises(ValueError, match="k"):
        pass_at_k(4, 1, 0)


def test_answer_keys_agree_with_answers_equal():
    pool = ["1/2", "0.5", r"\frac{1}{2}", "2", "2.0", "1,000", "1000", r"\text{Monday}",
            "Monday", " monday", "(1, 2)", r"\left( 1,2 \right)", "x+1", "x + 1", "",
            "3/6"]  # fmt: skip
    for a, b in itertools.product(pool, repeat=2):
        same_key = answer_key(a) is not None and answer_key(a) == answer_key(b)
        assert same_key == answers_equal(a, b), (a, b)


def test_majority_vote():
    assert majority_vote(["3", None, "4", "3.0", "4"]) == 0
    assert majority_vote([None, "4", "3", "3", "4"]) == 1  # tie: the answer seen first
    assert majority_vote(["7", "8", "8"]) == 1
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


def _reference_metrics(scores, threshold, answers):
    """The same figures written out with exact binomials and a plain count of the votes."""
    p, n = scores.shape
    passed = np.nan_to_num(scores, nan=-np.inf) >= threshold
    out = {}
    for k in pass_at_k_values(n):
        out[f"eval/pass@{k}"] = np.mean([_exact(n, int(passed[i].sum()), k) for i in range(p)])
    out[f"eval/mean@{n}"] = passed.mean()
    wins = []
    for i in range(p):
        counted = [(a, j) for j, a in enumerate(answers[i]) if a is not None]
        if not counted:
            wins.append(False)
            continue
        tally = {}
        for a, j in counted:
            tally.setdefault(float(Fraction(a)), []).append(j)
        top = max(len(v) for v in tally.values())
        first = min(v[0] for v in tally.values() if len(v) == top)
        wins.append(bool(passed[i, first]))
    out[f"eval/maj@{n}"] = np.mean(wins)
    out["eval/sampled_reward_mean"] = np.nanmean(scores)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sampled_metrics_match_a_reference(seed):
    rng = np.random.default_rng(seed)
    p, n = int(rng.integers(1, 7)), int(rng.integers(2, 13))
    scores = rng.choice([0.0, 0.5, 1.0, np.nan], size=(p, n))
    answers = [[None if rng.random() < 0.2 else str(int(rng.integers(0, 3))) for _ in range(n)]
               for _ in range(p)]  # fmt: skip
    got = sampled_metrics(scores, 1.0, answers)
    want = _reference_metrics(scores, 1.0, answers)
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-12, err_msg=key)


def test_sampled_metrics_errors():
    with pytest.raises(ValueError, match=r"shape \(P, n\) with n >= 2"):
        sampled_metrics(np.zeros((3, 1)), 1.0)
    with pytest.raises(ValueError, match="answers must be 2 lists of 3 answers"):
        sampled_metrics(np.zeros((2, 3)), 1.0, answers=[["1"] * 3])


TRAIN, EVAL = addition_dataset(seed=0, num_eval=6)


def _trainer():
    tok = demo_tokenizer()
    model = demo_model(tok, seed=0)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return GRPOTrainer(model, opt, GRPOConfig(num_generations=2, beta=0.0)), tok


def _run(**loop):
    trainer, tok = _trainer()
    config = TrainConfig(num_steps=1, prompts_per_step=2, progress=False, **loop)
    reward = math_answer_reward(last_number_fallback=True)
    return train(trainer, tok, TRAIN[:8], [reward], config, RolloutConfig(max_new_tokens=4),
                 eval_dataset=EVAL)  # fmt: skip


def test_the_loop_reports_sampled_metrics_reproducibly():
    first = _run(eval_num_samples=4)
    (step0, before), (step1, after) = first.evaluations
    assert (step0, step1) == (0, 1)
    for metrics in (before, after):
        assert {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/mean@4", "eval/maj@4",
                "eval/sampled_reward_mean"} <= set(metrics)  # fmt: skip
        assert metrics["eval/mean@4"] <= metrics["eval/pass@2"] <= metrics["eval/pass@4"]
    again = _run(eval_num_samples=4)
    assert again.evaluations == first.evaluations  # same seed, same samples
    greedy = _run()
    assert set(greedy.evaluations[-1][1]) == {"eval/pass@1", "eval/reward_mean"}


def test_sampled_evaluation_refusals():
    trainer, tok = _trainer()
    reward = math_answer_reward()
    with pytest.raises(ValueError, match="eval_num_samples=4 needs an eval_dataset"):
        train(trainer, tok, TRAIN[:8], [reward],
              TrainConfig(num_steps=1, prompts_per_step=2, progress=False, eval_num_samples=4),
              RolloutConfig(max_new_tokens=4))  # fmt: skip
    with pytest.raises(ValueError, match="custom evaluate_fn"):
        train(trainer, tok, TRAIN[:8], [reward],
              TrainConfig(num_steps=1, prompts_per_step=2, progress=False, eval_num_samples=4),
              RolloutConfig(max_new_tokens=4), eval_dataset=EVAL,
              evaluate_fn=lambda *a, **k: {})  # fmt: skip
    with pytest.raises(ValueError, match="eval_num_samples"):
        TrainConfig(num_steps=1, eval_num_samples=0)
