r"""Evaluation beyond greedy pass@1: ``n`` samples per held-out prompt, pass@k and maj@n.

With ``TrainConfig.eval_num_samples = n > 1`` the training loop's evaluation also samples ``n``
completions per held-out prompt (at the policy's ``temperature``, with the rollout's top-k and
top-p) and reports, besides the greedy ``eval/pass@1``:

- ``eval/pass@<k>`` for ``k = 2, 4, 8, ... < n`` and ``k = n``: the unbiased estimator of
  Chen et al. (2021) averaged over prompts, with ``c`` of the ``n`` samples passing
  (reward ``>= pass_threshold``),

  .. math::

      \text{pass@}k = 1 - \binom{n-c}{k} \Big/ \binom{n}{k}
      = 1 - \prod_{i=n-c+1}^{n} \Big(1 - \frac{k}{i}\Big),

  computed as the product (no large binomials);
- ``eval/mean@<n>``: the mean pass rate of the samples (pass@1 estimated from ``n`` samples);
- ``eval/maj@<n>``: majority vote: the most frequent answer among the ``n`` samples (ties: the
  one seen first; samples without an answer do not vote) passes when its first sample passes;
  a prompt where no sample has an answer fails;
- ``eval/sampled_reward_mean``: the mean reward of the samples.

Answers come from ``answer_fn(completion) -> str | None``; by default from the evaluation
reward's ``extract_answer`` (the built-in
:func:`~artifex.generative_models.training.rl.rewards.math.math_answer_reward` has one: its own
extraction); without one, ``maj@n`` is not reported. Two answers vote together when
:func:`~artifex.generative_models.training.rl.rewards.math.answers_equal` says they are equal:
exact rationals when both are numbers (``0.5``, ``1/2``, ``\frac{1}{2}``), else the text after
its LaTeX clean-up, whitespace removed.

References:
    Chen et al., 2021, "Evaluating Large Language Models Trained on Code", arXiv:2107.03374,
    sec. 2.1 (the unbiased pass@k); Wang et al., 2023, "Self-Consistency Improves Chain of
    Thought Reasoning in Language Models", arXiv:2203.11171 (majority vote).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from artifex.generative_models.training.rl.rewards.math import (
    normalize_answer_text,
    normalize_number,
)
from artifex.generative_models.training.rl.rollouts.rollout import (
    Policy,
    RolloutConfig,
    SupportsPolicy,
    as_policy,
    sample_completions,
    spans_processes,
)
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "answer_key",
    "check_sampled_eval",
    "evaluate_sampled",
    "majority_vote",
    "pass_at_k",
    "pass_at_k_values",
    "sampled_metrics",
]

#: Completions per generation call of :func:`evaluate_sampled` (prompts x samples).
SAMPLED_EVAL_ROWS = 64


def pass_at_k(num_samples: Any, num_correct: Any, k: int) -> np.ndarray:
    r"""The unbiased pass@k estimate ``1 - C(n-c, k) / C(n, k)`` per prompt, in float64.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (Chen et al., 2021), which stays exact
    to rounding for any ``n``; it is 1 when ``n - c < k``.

    Args:
        num_samples: ``n``, samples per prompt (an int or an int array), ``n >= k``.
        num_correct: ``c``, passing samples per prompt, ``0 <= c <= n`` (broadcast with ``n``).
        k: ``k >= 1``.

    Returns:
        The estimates, float64, shaped like the broadcast of ``n`` and ``c``.

    Raises:
        ValueError: ``k < 1``, ``n < k``, or ``c`` outside ``[0, n]``.
        TypeError: ``k`` is not an int, or ``n``/``c`` not integers.

    Examples:
        >>> from artifex.generative_models.training.rl.run.evaluation_metrics import pass_at_k
        >>> pass_at_k(4, [0, 1, 2, 4], 2).round(4).tolist()  # 1 - C(4-c, 2) / C(4, 2)
        [0.0, 0.5, 0.8333, 1.0]

    References:
        Chen et al., 2021, "Evaluating Large Language Models Trained on Code",
        arXiv:2107.03374, sec. 2.1.
    """
    k = check_int("k", k, minimum=1)
    n_arr, c_arr = np.asarray(num_samples), np.asarray(num_correct)
    for name, arr in (("num_samples", n_arr), ("num_correct", c_arr)):
        if not np.issubdtype(arr.dtype, np.integer):
            msg = f"pass_at_k: {name} must be integers, got dtype {arr.dtype}"
            raise TypeError(msg)
    n, c = np.broadcast_arrays(n_arr.astype(np.int64), c_arr.astype(np.int64))
    if np.any(n < k):
        msg = f"pass_at_k: every num_samples must be >= k={k}, got {np.unique(n).tolist()}"
        raise ValueError(msg)
    if np.any(c < 0) or np.any(c > n):
        msg = f"pass_at_k: num_correct must lie in [0, num_samples], got {c.tolist()}"
        raise ValueError(msg)
    out = np.empty(n.shape, np.float64)
    for idx in np.ndindex(n.shape):
        ni, ci = int(n[idx]), int(c[idx])
        if ni - ci < k:
            out[idx] = 1.0
        else:
            i = np.arange(ni - ci + 1, ni + 1, dtype=np.float64)
            out[idx] = 1.0 - float(np.prod(1.0 - k / i))
    return out


def pass_at_k_values(num_samples: int) -> list[int]:
    """The ``k`` of ``eval/pass@<k>`` for ``n`` samples: 2, 4, 8, ... below ``n``, then ``n``.

    Args:
        num_samples: ``n >= 2``.

    Returns:
        The sorted ``k`` values.

    Examples:
        >>> from artifex.generative_models.training.rl.run.evaluation_metrics import (
        ...     pass_at_k_values)
        >>> pass_at_k_values(2), pass_at_k_values(8), pass_at_k_values(12)
        ([2], [2, 4, 8], [2, 4, 8, 12])
    """
    n = check_int("num_samples", num_samples, minimum=2)
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def answer_key(answer: str | None) -> tuple[str, Any] | None:
    r"""The class an answer votes for: equal keys exactly when ``answers_equal`` says equal.

    Args:
        answer: An extracted answer, or ``None``.

    Returns:
        ``("number", Fraction)`` for a number, ``("text", cleaned text)`` otherwise, ``None``
        for no answer (``None`` or empty after clean-up).

    Raises:
        TypeError: ``answer`` is neither a string nor ``None``.

    Examples:
        >>> from artifex.generative_models.training.rl.run.evaluation_metrics import answer_key
        >>> answer_key("1/2") == answer_key("0.5"), answer_key(r"\text{Monday}")
        (True, ('text', 'Monday'))
    """
    if answer is None:
        return None
    if not isinstance(answer, str):
        msg = f"answer must be a str or None, got {type(answer).__name__}"
        raise TypeError(msg)
    number = normalize_number(answer)
    if number is not None:
        return ("number", number)
    text = normalize_answer_text(answer)
    return ("text", text) if text else None


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """The index of the first sample of the most frequent answer (ties: the first seen).

    Args:
        answers: One extracted answer (or ``None``) per sample of a prompt.

    Returns:
        The index, or ``None`` when no sample has an answer.

    Examples:
        >>> from artifex.generative_models.training.rl.run.evaluation_metrics import majority_vote
        >>> majority_vote(["3", None, "4", "3.0", "4"])  # "3" and "3.0" vote together
        0
        >>> majority_vote(["4", "3", "3", "4"]), majority_vote([None, None])  # tie: first seen
        (0, None)
    """
    counts: dict[Any, int] = {}
    first: dict[Any, int] = {}
    for i, answer in enumerate(answers):
        key = answer_key(answer)
        if key is None:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    best = max(counts, key=lambda key: (counts[key], -first[key]))
    return first[best]


def sampled_metrics(
    scores: Any,
    pass_threshold: float,
    answers: Sequence[Sequence[str | None]] | None = None,
) -> dict[str, float]:
    """pass@k, mean@n, maj@n and the mean reward from the rewards of ``n`` samples per prompt.

    Args:
        scores: ``(P, n)`` rewards, row ``p`` the samples of prompt ``p`` (NaN: no reward,
            which fails).
        pass_threshold: A sample passes when its reward is at least this.
        answers: ``P`` lists of ``n`` extracted answers (``None``: no answer) for maj@n;
            ``None``: no maj@n.

    Returns:
        ``eval/pass@<k>`` for :func:`pass_at_k_values`, ``eval/mean@<n>``, ``eval/maj@<n>``
        (with ``answers``) and ``eval/sampled_reward_mean``.

    Raises:
        ValueError: ``scores`` is not ``(P, n)`` with ``n >= 2``, or ``answers`` does not
            match it.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl.run.evaluation_metrics import sampled_metrics
        >>> scores = np.array([[1.0, 0.0], [0.0, 0.0]])
        >>> metrics = sampled_metrics(scores, 1.0, answers=[["2", "3"], ["5", "5"]])
        >>> metrics["eval/pass@2"], metrics["eval/mean@2"], metrics["eval/maj@2"]
        (0.5, 0.25, 0.5)
    """
    s = np.asarray(scores, np.float64)
    if s.ndim != 2 or s.shape[0] < 1 or s.shape[1] < 2:
        msg = f"sampled_metrics: scores must have shape (P, n) with n >= 2, got {s.shape}"
        raise ValueError(msg)
    p, n = s.shape
    passed = np.where(np.isnan(s), -np.inf, s) >= pass_threshold
    correct = passed.sum(axis=1)
    out = {f"eval/pass@{k}": float(pass_at_k(n, correct, k).mean()) for k in pass_at_k_values(n)}
    out[f"eval/mean@{n}"] = float(passed.mean())
    if answers is not None:
        if len(answers) != p or any(len(a) != n for a in answers):
            msg = f"sampled_metrics: answers must be {p} lists of {n} answers"
            raise ValueError(msg)
        votes = [majority_vote(a) for a in answers]
        out[f"eval/maj@{n}"] = float(
            np.mean([v is not None and bool(passed[i, v]) for i, v in enumerate(votes)])
        )
    valid = ~np.isnan(s)
    out["eval/sampled_reward_mean"] = float(s[valid].mean()) if valid.any() else float("nan")
    return out


def check_sampled_eval(
    num_samples: int, *, custom_evaluate: bool, mesh: Any, rollout_config: RolloutConfig
) -> None:
    """Raises before training when ``TrainConfig.eval_num_samples`` cannot run as set.

    Args:
        num_samples: ``TrainConfig.eval_num_samples``.
        custom_evaluate: The loop was given its own ``evaluate_fn`` (e.g. multi-turn).
        mesh: The sampling mesh.
        rollout_config: The rollout settings (``row_groups``).

    Raises:
        ValueError: Naming the setting and what is not supported.

    Examples:
        >>> from artifex.generative_models.training import RolloutConfig
        >>> from artifex.generative_models.training.rl.run.evaluation_metrics import (
        ...     check_sampled_eval)
        >>> check_sampled_eval(8, custom_evaluate=False, mesh=None, rollout_config=RolloutConfig())
        >>> check_sampled_eval(8, custom_evaluate=True, mesh=None, rollout_config=RolloutConfig())
        Traceback (most recent call last):
            ...
        ValueError: TrainConfig.eval_num_samples=8 samples single-turn completions; ...
    """
    if num_samples == 1:
        return
    if custom_evaluate:
        msg = (
            f"TrainConfig.eval_num_samples={num_samples} samples single-turn completions; a "
            "custom evaluate_fn (multi-turn evaluation) runs its own episodes: leave it at 1"
        )
        raise ValueError(msg)
    if spans_processes(mesh):
        msg = (
            f"TrainConfig.eval_num_samples={num_samples} is not supported on a mesh spanning "
            "several processes yet; leave it at 1"
        )
        raise ValueError(msg)
    groups = rollout_config.row_groups
    if groups is not None and groups > 1:
        msg = (
            f"TrainConfig.eval_num_samples={num_samples} needs RolloutConfig.row_groups None "
            f"or 1 (the evaluation batches hold a varying number of prompts), got {groups}"
        )
        raise ValueError(msg)


def evaluate_sampled(
    policy: Policy | SupportsPolicy,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    reward_fn: Callable[..., Sequence[float | None]],
    rollout_config: RolloutConfig,
    *,
    num_samples: int,
    key: jax.Array,
    pass_threshold: float = 1.0,
    answer_fn: Callable[[str], str | None] | None = None,
    placement: Any = None,
) -> dict[str, float]:
    """Samples ``num_samples`` completions per row and returns :func:`sampled_metrics`.

    Completions are sampled at the policy's ``GRPOConfig.temperature`` with the rollout's
    ``top_k``/``top_p``, :data:`SAMPLED_EVAL_ROWS` completions per generation call.

    Args:
        policy: The rollout :class:`~artifex.generative_models.training.rl.rollouts.rollout.Policy`,
            or a ``GRPOTrainer``.
        tokenizer: The tokenizer.
        rows: Evaluation rows.
        reward_fn: Scores completions like a training reward function.
        rollout_config: Prompt column, ``max_new_tokens``, top-k/top-p.
        num_samples: ``n >= 2`` samples per row.
        key: PRNG key of the sampling.
        pass_threshold: Reward needed to pass.
        answer_fn: ``completion -> answer or None`` for maj@n; default:
            ``reward_fn.extract_answer`` when it has one, else no maj@n.
        placement: Sample on this rollout placement's mesh (``None``: the policy's).

    Returns:
        The metrics of :func:`sampled_metrics`.

    Raises:
        ValueError: ``num_samples < 2``, no rows, or a reward function with a wrong output.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import GRPOConfig, RolloutConfig
        >>> from artifex.generative_models.training.rl import Policy
        >>> from artifex.generative_models.training.rl.run.evaluation_metrics import (
        ...     evaluate_sampled)
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> policy = Policy(CausalLM(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=2))
        >>> def always(prompts, completions, **columns):
        ...     return [1.0] * len(completions)
        >>> metrics = evaluate_sampled(policy, tok, [{"prompt": "1+1="}], always,
        ...                            RolloutConfig(max_new_tokens=2), num_samples=4,
        ...                            key=jax.random.key(0))
        >>> sorted(metrics), metrics["eval/pass@4"]
        (['eval/mean@4', 'eval/pass@2', 'eval/pass@4', 'eval/sampled_reward_mean'], 1.0)
    """
    n = check_int("num_samples", num_samples, minimum=2)
    if not rows:
        msg = "evaluate_sampled needs at least one row"
        raise ValueError(msg)
    policy = as_policy(policy)
    model, mesh = policy.model, policy.mesh
    if placement is not None:
        model, mesh = placement.sampler_model(policy.model), placement.mesh
    if answer_fn is None:
        answer_fn = getattr(reward_fn, "extract_answer", None)
    per_call = max(1, SAMPLED_EVAL_ROWS // n)
    scores: list[float] = []
    answers: list[str | None] = []
    for start in range(0, len(rows), per_call):
        sampled = sample_completions(
            model,
            tokenizer,
            list(rows[start : start + per_call]),
            rollout_config,
            key=jax.random.fold_in(key, start),
            num_generations=n,
            temperature=policy.config.temperature,
            mesh=mesh,
        )
        values = reward_fn(sampled.prompts, sampled.completions, **sampled.columns)
        if len(values) != len(sampled.completions):
            msg = (
                f"evaluation reward returned {len(values)} values for "
                f"{len(sampled.completions)} completions"
            )
            raise ValueError(msg)
        scores += [float("nan") if v is None else float(v) for v in values]
        if answer_fn is not None:
            answers += [answer_fn(c) for c in sampled.completions]
    grid = np.asarray(scores, np.float64).reshape(len(rows), n)
    votes = None
    if answer_fn is not None:
        votes = [answers[i * n : (i + 1) * n] for i in range(len(rows))]
    return sampled_metrics(grid, pass_threshold, votes)
