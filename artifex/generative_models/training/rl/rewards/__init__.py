"""Reward functions: the protocol, their combination, and built-in verifiable rewards.

A reward function is a plain callable

    ``f(prompts: list[str], completions: list[str], **columns) -> list[float | None]``

called once per rollout batch on the decoded text (see :class:`RewardFunction`). ``None`` means
"no reward for this sample"; it becomes NaN in the combined reward array, which the advantage
stage treats as missing.

The package has one module per concern:

- :mod:`~artifex.generative_models.training.rl.rewards.base`: the :class:`RewardFunction`
  protocol, :class:`RewardFunctionError` and :func:`reward_names`.
- :mod:`~artifex.generative_models.training.rl.rewards.combine`: :func:`combine_rewards`,
  :class:`RewardCombiner` and the array part :func:`combine_reward_columns`.
- :mod:`~artifex.generative_models.training.rl.rewards.math`: :func:`math_answer_reward`
  and its helpers :func:`extract_answer`, :func:`normalize_number`, :func:`answers_equal`.
- :mod:`~artifex.generative_models.training.rl.rewards.format`: :func:`format_reward`.
- :mod:`~artifex.generative_models.training.rl.rewards.length`: :func:`soft_overlong_penalty`
  (DAPO) and its core :func:`overlong_penalty`.
- :mod:`~artifex.generative_models.training.rl.rewards.reward_model`:
  :func:`reward_model_reward`, a sequence-classification reward model as a reward function.

Every built-in reward is a factory that returns a reward callable with a descriptive
``__name__``.
"""

from __future__ import annotations

from artifex.generative_models.training.rl.rewards.base import (
    RewardFunction,
    RewardFunctionError,
    reward_names,
)
from artifex.generative_models.training.rl.rewards.combine import (
    CombinedRewards,
    CombineMode,
    RewardCombiner,
    combine_reward_columns,
    combine_rewards,
)
from artifex.generative_models.training.rl.rewards.format import format_reward
from artifex.generative_models.training.rl.rewards.length import (
    overlong_penalty,
    soft_overlong_penalty,
)
from artifex.generative_models.training.rl.rewards.math import (
    AnswerExtraction,
    MathBackend,
    answers_equal,
    extract_answer,
    math_answer_reward,
    normalize_number,
)
from artifex.generative_models.training.rl.rewards.reward_model import (
    RewardModelReward,
    reward_model_reward,
)

__all__ = [  # noqa: RUF022 - grouped by concern, sorted within each group
    # Protocol and errors
    "RewardFunction",
    "RewardFunctionError",
    "reward_names",
    # Combination
    "CombineMode",
    "CombinedRewards",
    "RewardCombiner",
    "combine_reward_columns",
    "combine_rewards",
    # Math answers
    "AnswerExtraction",
    "MathBackend",
    "answers_equal",
    "extract_answer",
    "math_answer_reward",
    "normalize_number",
    # Format
    "format_reward",
    # Length
    "overlong_penalty",
    "soft_overlong_penalty",
    # Reward models
    "RewardModelReward",
    "reward_model_reward",
]
