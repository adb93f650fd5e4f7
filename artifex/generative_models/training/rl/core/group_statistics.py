"""Per-group statistics of flat rewards, and the reward metrics of a generation batch.

Rewards arrive flat, grouped by prompt: row ``i`` belongs to group ``i // G``
(:func:`group_stats`) or to group ``group_ids[i]`` (:func:`segment_stats`). The statistics leave
missing (NaN) rewards out and are computed after subtracting one of the group's own rewards, so a
group whose valid rewards are all equal has a standard deviation of exactly 0. The advantage
kernels of :mod:`~artifex.generative_models.training.rl.core.advantages` are built on them;
:func:`nonconstant_groups` (the groups DAPO's dynamic sampling keeps) and
:func:`reward_statistics` (the reward metrics of a batch) read them too.

These functions moved here unchanged from ``core.advantages``, which still imports them, so every
import path stays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from artifex.generative_models.utils.validation import check_int

__all__ = [
    "GroupStats",
    "group_stats",
    "nonconstant_groups",
    "reward_statistics",
    "segment_stats",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupStats:
    """Per-row statistics of each row's group, broadcast back to rows.

    Attributes:
        mean: Mean of the group's valid rewards, ``(B,)``; 0 for a group with none.
        std: Standard deviation of the group's valid rewards with the requested ``ddof``,
            ``(B,)``; 0 for a group with fewer than ``ddof + 1`` valid rewards.
        count: Number of valid (non-NaN) rewards in the group, ``(B,)`` float32.
        centered: ``r - mean`` for valid rows and 0 for missing ones, ``(B,)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import group_stats
        >>> s = group_stats(jnp.array([1.0, 3.0, 2.0, 2.0]), 2)
        >>> s.mean.tolist(), s.centered.tolist()
        ([2.0, 2.0, 2.0, 2.0], [-1.0, 1.0, 0.0, 0.0])
    """

    mean: jax.Array
    std: jax.Array
    count: jax.Array
    centered: jax.Array


def _stats(
    rewards: jax.Array,
    group_sum: Callable[[jax.Array], jax.Array],
    group_max: Callable[[jax.Array], jax.Array],
    ddof: int,
) -> GroupStats:
    """Shared statistics; ``group_sum``/``group_max`` reduce over a row's group and broadcast."""
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = ~jnp.isnan(rewards)
    # Shift by one of the group's own rewards so that equal rewards cancel exactly.
    ref = group_max(jnp.where(valid, rewards, -jnp.inf))
    ref = jnp.where(jnp.isfinite(ref), ref, 0.0)
    shifted = jnp.where(valid, rewards - ref, 0.0)
    count = group_sum(valid.astype(jnp.float32))
    mean_shifted = group_sum(shifted) / jnp.maximum(count, 1.0)
    centered = jnp.where(valid, shifted - mean_shifted, 0.0)
    var = group_sum(centered * centered) / jnp.maximum(count - ddof, 1.0)
    std = jnp.where(count > ddof, jnp.sqrt(var), 0.0)
    return GroupStats(mean=mean_shifted + ref, std=std, count=count, centered=centered)


def _fixed_reducers(group_size: int) -> tuple[Callable, Callable]:
    def group_sum(x: jax.Array) -> jax.Array:
        g = x.reshape(-1, group_size)
        return jnp.repeat(g.sum(axis=1), group_size)

    def group_max(x: jax.Array) -> jax.Array:
        g = x.reshape(-1, group_size)
        return jnp.repeat(g.max(axis=1), group_size)

    return group_sum, group_max


def _segment_reducers(group_ids: jax.Array, num_groups: int) -> tuple[Callable, Callable]:
    group_ids = jnp.asarray(group_ids, jnp.int32)

    def group_sum(x: jax.Array) -> jax.Array:
        return jax.ops.segment_sum(x, group_ids, num_segments=num_groups)[group_ids]

    def group_max(x: jax.Array) -> jax.Array:
        return jax.ops.segment_max(x, group_ids, num_segments=num_groups)[group_ids]

    return group_sum, group_max


def _check_group_size(num_rows: int, group_size: int) -> None:
    group_size = check_int("group_size", group_size, minimum=1)
    if num_rows % group_size:
        msg = (
            f"rewards has {num_rows} rows, which is not a multiple of group_size={group_size}; "
            "a batch holds num_prompts * group_size rows, prompt-major"
        )
        raise ValueError(msg)


def group_stats(rewards: jax.Array, group_size: int, *, ddof: int = 1) -> GroupStats:
    """Statistics of fixed-size groups of flat rewards (row ``i`` in group ``i // group_size``).

    Args:
        rewards: ``(B,)`` rewards, ``B = num_groups * group_size``; NaN marks a missing reward.
        group_size: Static group size ``G``.
        ddof: Delta degrees of freedom of the std (1: Bessel's correction; 0: population).

    Returns:
        A :class:`GroupStats` with per-row values.

    Raises:
        ValueError: If ``B`` is not a multiple of ``group_size``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import group_stats
        >>> s = group_stats(jnp.array([1.0, 3.0, 0.0, jnp.nan]), 2, ddof=0)
        >>> s.mean.tolist(), s.std.tolist(), s.count.tolist()
        ([2.0, 2.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [2.0, 2.0, 1.0, 1.0])
    """
    _check_group_size(rewards.shape[0], group_size)
    return _stats(rewards, *_fixed_reducers(group_size), ddof)


def segment_stats(
    rewards: jax.Array, group_ids: jax.Array, *, num_groups: int | None = None, ddof: int = 1
) -> GroupStats:
    """Statistics of groups of any size given by ``group_ids``.

    Args:
        rewards: ``(B,)`` rewards; NaN marks a missing reward.
        group_ids: ``(B,)`` integer group index of each row, in ``[0, num_groups)``.
        num_groups: Static upper bound on the number of groups; defaults to ``B``.
        ddof: Delta degrees of freedom of the std.

    Returns:
        A :class:`GroupStats` with per-row values.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import segment_stats
        >>> rewards, group_ids = jnp.array([1.0, 3.0, 5.0]), jnp.array([0, 0, 1])
        >>> s = segment_stats(rewards, group_ids, num_groups=2, ddof=0)
        >>> s.mean.tolist(), s.count.tolist()
        ([2.0, 2.0, 5.0], [2.0, 2.0, 1.0])
    """
    num_groups = rewards.shape[0] if num_groups is None else num_groups
    return _stats(rewards, *_segment_reducers(group_ids, num_groups), ddof)


def _reducers(
    num_rows: int, group_size: int, group_ids: jax.Array | None
) -> tuple[Callable, Callable]:
    if group_ids is None:
        _check_group_size(num_rows, group_size)
        return _fixed_reducers(group_size)
    return _segment_reducers(group_ids, num_rows)


def nonconstant_groups(rewards: jax.Array, group_size: int) -> jax.Array:
    """Per group: whether its valid rewards are not all equal (the group carries signal).

    A group with fewer than two valid (non-NaN) rewards, or whose valid rewards are all equal,
    has zero advantages under every estimator here: DAPO's dynamic sampling drops such groups.
    Computed from :func:`group_stats` (the shifted statistics make equal rewards cancel
    exactly, so a constant group has a standard deviation of exactly 0).

    Args:
        rewards: ``(B,)`` rewards, row ``i`` in group ``i // group_size``; NaN for a missing one.
        group_size: ``G``.

    Returns:
        ``(B // G,)`` bool.

    Raises:
        ValueError: ``B`` is not a multiple of ``group_size``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl.core.group_statistics import (
        ...     nonconstant_groups,
        ... )
        >>> nonconstant_groups(jnp.array([1.0, 1.0, 0.0, 1.0, jnp.nan, 2.0]), 2).tolist()
        [False, True, False]
    """
    stats = group_stats(jnp.asarray(rewards, jnp.float32), group_size, ddof=0)
    return (stats.std[::group_size] > 0) & (stats.count[::group_size] >= 2)


def reward_statistics(
    rewards: jax.Array,
    group_size: int,
    *,
    group_ids: jax.Array | None = None,
    advantages: jax.Array | None = None,
    advantage_mask: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The reward and advantage metrics of one generation batch (float32 scalars).

    ``reward_mean`` / ``reward_std`` (population std) over the valid (non-NaN) rewards, NaN
    when there is none; ``frac_reward_zero_std``: the fraction of groups with at least one
    valid reward whose rewards are all equal (their advantages are 0); ``advantage_mean`` /
    ``advantage_std`` of ``advantages`` over ``advantage_mask`` (default: the rows with a
    valid reward). The loop computes these once per generation batch; the trainer's step
    computes them when it computes the advantages itself.

    Args:
        rewards: ``(B,)`` rewards, NaN for a missing one.
        group_size: ``G`` (ignored when ``group_ids`` is given).
        group_ids: Optional ``(B,)`` group index per row (groups of any size).
        advantages: Optional ``(B,)`` or ``(B, T)`` advantages.
        advantage_mask: Weights of ``advantages`` (same shape); default: valid rows.

    Returns:
        ``{"reward_mean", "reward_std", "frac_reward_zero_std"}`` plus ``advantage_mean``
        and ``advantage_std`` when ``advantages`` is given.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl.core.group_statistics import (
        ...     reward_statistics,
        ... )
        >>> m = reward_statistics(jnp.array([1.0, 0.0, 1.0, 1.0]), 2)
        >>> float(m["reward_mean"]), float(m["frac_reward_zero_std"])
        (0.75, 0.5)
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = (~jnp.isnan(rewards)).astype(jnp.float32)

    def masked_mean(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(w > 0, x, 0.0) * w) / jnp.maximum(jnp.sum(w), 1e-8)

    mean = masked_mean(rewards, valid)
    std = jnp.sqrt(masked_mean((rewards - mean) ** 2, valid))
    if group_ids is not None:
        n = rewards.shape[0]
        stats = segment_stats(rewards, group_ids, ddof=0)
        present = jax.ops.segment_sum(valid, group_ids, num_segments=n) > 0
        zero = jax.ops.segment_max(
            ((stats.std == 0) & (valid > 0)).astype(jnp.float32), group_ids, num_segments=n
        )
        frac_zero = jnp.sum(jnp.where(present, zero, 0.0)) / jnp.maximum(jnp.sum(present), 1)
    else:
        stats = group_stats(rewards, group_size, ddof=0)
        present = stats.count[::group_size] > 0
        zero_std = stats.std[::group_size] == 0
        frac_zero = jnp.sum(zero_std & present) / jnp.maximum(jnp.sum(present), 1)
    # No valid reward at all: the statistics are undefined (NaN), not 0.
    any_valid = jnp.any(valid > 0)
    nan = jnp.asarray(jnp.nan, jnp.float32)
    out = {
        "reward_mean": jnp.where(any_valid, mean, nan),
        "reward_std": jnp.where(any_valid, std, nan),
        "frac_reward_zero_std": frac_zero.astype(jnp.float32),
    }
    if advantages is not None:
        advantages = jnp.asarray(advantages, jnp.float32)
        if advantage_mask is None:
            advantage_mask = (
                valid if advantages.ndim == 1 else valid[:, None] * jnp.ones_like(advantages)
            )
        w = jnp.asarray(advantage_mask, jnp.float32)
        adv_mean = masked_mean(advantages, w)
        out["advantage_mean"] = adv_mean
        out["advantage_std"] = jnp.sqrt(masked_mean((advantages - adv_mean) ** 2, w))
    return out
