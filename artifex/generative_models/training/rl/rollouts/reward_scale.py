"""A check that a generation batch's rewards fit the float32 statistics GRPO computes from them.

Rewards are stored in float32. A reward function that returns huge values (``1e30`` for "very
good") passes the combiner's finiteness check, but the group statistics overflow: the squared
deviations exceed float32's range, the standard deviation becomes ``inf`` and every advantage
``(r - mean) / std`` becomes 0, so nothing is learned and ``reward_std`` is logged as ``inf``.
:func:`check_reward_scale` finds this on the host, before the update, and names the step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["FLOAT32_MAX", "check_reward_scale"]

#: The largest float32: a sum of squared reward deviations above it overflows to ``inf``.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_reward_scale(
    rewards: Any, group_size: int, *, group_ids: Any = None, step: int | None = None
) -> None:
    r"""Raises when a batch's rewards would give non-finite float32 reward statistics.

    Checked, in float64: every reward is finite or NaN (no reward), and neither the whole
    batch's nor any group's sum of squared deviations from its mean,
    :math:`\sum_i (r_i - \bar r)^2`, reaches the largest float32 (about ``3.4e38``; the
    variance and standard deviation computed in float32 would be ``inf``).

    Args:
        rewards: The ``(B,)`` rewards, row ``i`` of prompt ``i // G`` (NaN: no reward).
        group_size: Completions per prompt ``G`` (groups are ``i // G``), used when
            ``group_ids`` is ``None``.
        group_ids: Optional ``(B,)`` group index of each row (a dynamically sampled batch).
        step: The training step, named in the error.

    Raises:
        ValueError: Naming the step, the rewards' range and what to do.

    Examples:
        >>> from artifex.generative_models.training.rl.rollouts.reward_scale import (
        ...     check_reward_scale,
        ... )
        >>> check_reward_scale([1.0, 0.0, 1e6, -1e6], group_size=2)  # large but representable
        >>> check_reward_scale([1e30, -1e30, 0.0, 1.0], group_size=2, step=3)
        Traceback (most recent call last):
            ...
        ValueError: training step 3: the rewards' spread overflows float32 ...
    """
    r = np.asarray(rewards, np.float64).ravel()
    where = "" if step is None else f"training step {step}: "
    inf = np.isinf(r)
    if inf.any():
        msg = (
            f"{where}reward {r[inf][0]:g} at row {int(np.flatnonzero(inf)[0])} is beyond "
            "float32's range (rewards are stored in float32): scale the reward functions' "
            "outputs down"
        )
        raise ValueError(msg)
    valid = ~np.isnan(r)
    if not valid.any():
        return
    groups = (
        np.arange(r.size) // max(int(group_size), 1)
        if group_ids is None
        else np.asarray(group_ids).ravel()
    )
    parts = [valid] + [valid & (groups == g) for g in np.unique(groups)]
    for part in parts:
        x = r[part]
        if x.size and float(np.sum((x - x.mean()) ** 2)) >= FLOAT32_MAX:
            msg = (
                f"{where}the rewards' spread overflows float32 (rewards from {r[valid].min():g} "
                f"to {r[valid].max():g}): their standard deviation would be inf and every "
                "advantage 0, so nothing would be learned; scale the reward functions' outputs "
                "down (deviations from the mean well below 1e19)"
            )
            raise ValueError(msg)
