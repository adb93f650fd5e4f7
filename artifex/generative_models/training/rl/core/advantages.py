r"""Group-relative advantages: the kernel at the heart of GRPO.

Rewards arrive flat, grouped by prompt: row ``i`` belongs to group ``i // G``. Within each group,

.. math::

    \hat A_i = \frac{r_i - b_i}{s + \varepsilon},

with baseline ``b_i`` the group mean (GRPO) or the mean of the *other* members (RLOO), and scale
``s`` the group's std (GRPO), the batch's std (Liu et al., 2025) or 1 (Dr. GRPO).

Missing rewards are NaN: they are left out of every statistic and get advantage 0. A group whose
valid rewards are all equal gets exact zeros (the statistics are computed after subtracting one of
the group's own rewards, so equal values cancel exactly in floating point).

Two forms share one implementation: :func:`group_advantages` for fixed groups of size ``G``
(a reshape to ``(N, G)``), and :func:`segment_advantages` for groups of different sizes given by
``group_ids`` (segment sums), e.g. after dynamic sampling dropped some rows. The group
statistics both forms read are in
:mod:`~artifex.generative_models.training.rl.core.group_statistics`.

References:
    Shao et al., 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1.2.
    Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO),
    arXiv:2503.20783.
    Ahmadian et al., 2024, "Back to Basics: Revisiting REINFORCE Style Optimization" (RLOO),
    arXiv:2402.14740.
    Hu et al., 2025, "REINFORCE++", arXiv:2501.03262 (:func:`reinforce_pp_advantages`).
    Chen et al., 2025, "Pass@k Training for Adaptively Balancing Exploration and Exploitation
    of Large Reasoning Models", arXiv:2508.10751 (:func:`pass_at_k_advantages`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.rl.core.configs import (
    AdvantageBaseline,
    GRPOConfig,
    RewardScaling,
)

# The group statistics moved to group_statistics.py; the names imported from this module's path
# stay importable from it.
from artifex.generative_models.training.rl.core.group_statistics import (  # noqa: F401
    GroupStats,
    _check_group_size,
    _reducers,
    _stats,
    group_stats,
    nonconstant_groups,
    reward_statistics,
    segment_stats,
)
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "advantages_from_config",
    "group_advantages",
    "pass_at_k_advantages",
    "process_advantages",
    "reinforce_pp_advantages",
    "segment_advantages",
]


def _finish(
    rewards: jax.Array,
    stats: GroupStats,
    *,
    scale: RewardScaling,
    ddof: int,
    eps: float,
    baseline: AdvantageBaseline,
) -> jax.Array:
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = ~jnp.isnan(rewards)
    if baseline == "group_mean":
        adv = stats.centered
    elif baseline == "leave_one_out":
        # r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean); 0 when alone in the group.
        factor = jnp.where(stats.count > 1, stats.count / jnp.maximum(stats.count - 1.0, 1.0), 0.0)
        adv = stats.centered * factor
    else:
        msg = f"baseline must be 'group_mean' or 'leave_one_out', got {baseline!r}"
        raise ValueError(msg)
    if scale == "group":
        adv = adv / (stats.std + eps)
    elif scale == "batch":
        flat = _stats(
            rewards,
            lambda x: jnp.broadcast_to(x.sum(), x.shape),
            lambda x: jnp.broadcast_to(x.max(), x.shape),
            ddof,
        )
        adv = adv / (flat.std + eps)
    elif scale != "none":
        msg = f"scale must be 'group', 'batch' or 'none', got {scale!r}"
        raise ValueError(msg)
    return jnp.where(valid, adv, 0.0)


def _check_kernel_args(fn: Callable) -> Callable:
    """Validates a kernel's host-side arguments before calling the jitted ``fn``.

    ``eps`` must be a finite number >= 0, ``ddof`` an int >= 0, ``group_size`` /
    ``num_groups`` ints >= 1, and concrete ``group_ids`` must lie in ``[0, num_groups)``
    (out-of-range ids would be dropped by the segment sums). Traced values are not inspected.
    """

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> jax.Array:
        eps = kwargs.get("eps")
        if (
            eps is not None
            and not isinstance(eps, jax.core.Tracer)
            and (
                isinstance(eps, bool)
                or not np.isfinite(np.asarray(eps)).all()
                or np.any(np.asarray(eps) < 0)
            )
        ):
            msg = f"{fn.__name__}: eps must be a finite number >= 0, got {eps!r}"
            raise ValueError(msg)
        ddof = kwargs.get("ddof")
        if ddof is not None:
            check_int(f"{fn.__name__}: ddof", ddof, minimum=0)
        segment = fn.__name__ == "segment_advantages"
        sizes = {"num_groups": kwargs.get("num_groups")}
        if not segment:
            sizes["group_size"] = kwargs.get("group_size", args[1] if len(args) > 1 else None)
        for name, value in sizes.items():
            if value is not None:
                check_int(f"{fn.__name__}: {name}", value, minimum=1)
        if segment:
            rewards = args[0] if args else kwargs["rewards"]
            group_ids = args[1] if len(args) > 1 else kwargs.get("group_ids")
            if group_ids is not None and not isinstance(group_ids, jax.core.Tracer):
                ids = np.asarray(group_ids)
                if not np.issubdtype(ids.dtype, np.integer):
                    msg = f"segment_advantages: group_ids must be integers, got dtype {ids.dtype}"
                    raise TypeError(msg)
                limit = kwargs.get("num_groups") or int(np.shape(rewards)[0])
                if ids.size and (ids.min() < 0 or ids.max() >= limit):
                    msg = (
                        f"segment_advantages: group_ids must lie in [0, {limit}), got "
                        f"[{ids.min()}, {ids.max()}]"
                    )
                    raise ValueError(msg)
        return fn(*args, **kwargs)

    return checked


@_check_kernel_args
@partial(jax.jit, static_argnames=("group_size", "scale", "ddof", "baseline"))
def group_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    scale: RewardScaling = "group",
    ddof: int = 1,
    eps: float = 1e-4,
    baseline: AdvantageBaseline = "group_mean",
) -> jax.Array:
    r"""Group-normalized advantages of flat rewards grouped by prompt (jitted).

    ``A_i = (r_i - b_i) / (s + eps)`` where ``b_i`` is the group mean (``baseline="group_mean"``)
    or the mean of the other valid members (``"leave_one_out"``), and ``s`` is the group's std
    (``scale="group"``), the std of all valid rewards of the batch (``"batch"``), or ``s + eps``
    is replaced by 1 (``"none"``).

    Args:
        rewards: ``(B,)`` rewards, row ``i`` in group ``i // group_size``; NaN = no reward.
        group_size: Static group size ``G`` (``B`` must be a multiple of it).
        scale: ``"group"``, ``"batch"`` or ``"none"``.
        ddof: Delta degrees of freedom of the std (1: Bessel's correction; 0: population).
        eps: Added to the std before dividing.
        baseline: ``"group_mean"`` (GRPO) or ``"leave_one_out"`` (RLOO).

    Returns:
        ``(B,)`` float32 advantages; 0 for rows without a reward and for constant groups.

    Raises:
        ValueError: If ``B`` is not a multiple of ``group_size``, or ``eps < 0``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training import group_advantages
        >>> group_advantages(jnp.array([1.0, 0.0, 1.0, 1.0]), 2, scale="none")
        Array([ 0.5, -0.5,  0. ,  0. ], dtype=float32)

    References:
        Shao et al., 2024, arXiv:2402.03300 (GRPO); Ahmadian et al., 2024, arXiv:2402.14740
        (RLOO); Liu et al., 2025, arXiv:2503.20783 (Dr. GRPO).
    """
    stats = group_stats(rewards, group_size, ddof=ddof)
    return _finish(rewards, stats, scale=scale, ddof=ddof, eps=eps, baseline=baseline)


@_check_kernel_args
@partial(jax.jit, static_argnames=("num_groups", "scale", "ddof", "baseline"))
def segment_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    num_groups: int | None = None,
    scale: RewardScaling = "group",
    ddof: int = 1,
    eps: float = 1e-4,
    baseline: AdvantageBaseline = "group_mean",
) -> jax.Array:
    """Group-normalized advantages for groups of different sizes (jitted).

    The same formula as :func:`group_advantages`, with group membership given by ``group_ids``
    instead of a fixed size, so groups may have different sizes (e.g. after dynamic sampling
    dropped or refilled rows). Rows need not be sorted by group.

    Args:
        rewards: ``(B,)`` rewards; NaN = no reward.
        group_ids: ``(B,)`` int group index of each row, in ``[0, num_groups)``.
        num_groups: Static number of segments; defaults to ``B`` (always enough).
        scale: ``"group"``, ``"batch"`` or ``"none"``.
        ddof: Delta degrees of freedom of the std.
        eps: Added to the std before dividing.
        baseline: ``"group_mean"`` or ``"leave_one_out"``.

    Returns:
        ``(B,)`` float32 advantages.

    Raises:
        ValueError: Concrete ``group_ids`` outside ``[0, num_groups)``, or ``eps < 0``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training import segment_advantages
        >>> rewards, group_ids = jnp.array([1.0, 0.0, 1.0, 2.0, 0.0]), jnp.array([0, 0, 1, 1, 1])
        >>> segment_advantages(rewards, group_ids, num_groups=2, scale="none").tolist()
        [0.5, -0.5, 0.0, 1.0, -1.0]
    """
    stats = segment_stats(rewards, group_ids, num_groups=num_groups, ddof=ddof)
    return _finish(rewards, stats, scale=scale, ddof=ddof, eps=eps, baseline=baseline)


@_check_kernel_args
@partial(jax.jit, static_argnames=("group_size", "scale", "ddof"))
def process_advantages(
    step_rewards: jax.Array,
    group_size: int,
    *,
    gamma: float = 1.0,
    scale: RewardScaling = "group",
    ddof: int = 1,
    eps: float = 1e-4,
) -> jax.Array:
    r"""Token advantages from per-step rewards (process supervision, jitted).

    DeepSeekMath (sec. 4.1.3): the step rewards of all completions of a group are normalized
    together, ``r~ = (r - mean(R)) / (std(R) + eps)`` over the group's set ``R`` of step rewards,
    and each token's advantage is the (discounted) sum of the normalized rewards of the steps
    that end at or after it: ``A_t = sum_{s >= t} gamma**(s - t) r~_s``.

    Args:
        step_rewards: ``(B, T)`` rewards placed at the token that ends each step, NaN elsewhere.
        group_size: Static group size ``G``.
        gamma: Discount in (0, 1]; 1 reproduces the paper.
        scale: ``"group"``, ``"batch"`` or ``"none"`` (see :func:`group_advantages`).
        ddof: Delta degrees of freedom of the std.
        eps: Added to the std before dividing.

    Returns:
        ``(B, T)`` float32 token advantages.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import process_advantages
        >>> nan = jnp.nan
        >>> step_rewards = jnp.array([[nan, 1.0, nan, 1.0], [nan, 0.0, nan, 0.0]])
        >>> process_advantages(step_rewards, 2, scale="none").round(2).tolist()
        [[1.0, 1.0, 0.5, 0.5], [-1.0, -1.0, -0.5, -0.5]]

    References:
        Shao et al., 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1.3.
    """
    b, t = step_rewards.shape
    _check_group_size(b, group_size)
    # Group r of rows -> one group of G*T step rewards.
    flat = jnp.asarray(step_rewards, jnp.float32).reshape(-1)
    normalized = _finish(
        flat,
        group_stats(flat, group_size * t, ddof=ddof),
        scale=scale,
        ddof=ddof,
        eps=eps,
        baseline="group_mean",
    ).reshape(b, t)

    def body(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        carry = x + gamma * carry
        return carry, carry

    _, returns = jax.lax.scan(body, jnp.zeros((b,), jnp.float32), normalized.T, reverse=True)
    return returns.T


def advantages_from_config(
    rewards: jax.Array,
    config: GRPOConfig,
    *,
    group_size: int | None = None,
    group_ids: jax.Array | None = None,
) -> jax.Array:
    """Outcome advantages with the options of a :class:`GRPOConfig`.

    ``config.advantage_estimator`` picks the estimator: ``"grpo"`` (group baseline and scaling,
    :func:`group_advantages` / :func:`segment_advantages`), ``"reinforce_pp"`` /
    ``"reinforce_pp_baseline"`` (:func:`reinforce_pp_advantages`) or ``"pass_at_k"``
    (:func:`pass_at_k_advantages`).

    Args:
        rewards: ``(B,)`` rewards; NaN = no reward.
        config: Supplies ``advantage_estimator``, ``scale_rewards``, ``std_ddof``,
            ``advantage_eps``, ``baseline`` and ``pass_at_k``.
        group_size: Group size; defaults to ``config.num_generations``. Ignored with
            ``group_ids``.
        group_ids: Optional ``(B,)`` group index per row for groups of different sizes.

    Returns:
        ``(B,)`` float32 advantages.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training import GRPOConfig
        >>> from artifex.generative_models.training.rl import advantages_from_config
        >>> config = GRPOConfig(num_generations=2, scale_rewards="none")
        >>> advantages_from_config(jnp.array([1.0, 0.0, 0.5, 0.5]), config).tolist()
        [0.5, -0.5, 0.0, 0.0]
    """
    g = config.num_generations if group_size is None else group_size
    if config.advantage_estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        return reinforce_pp_advantages(
            rewards,
            g,
            group_ids=group_ids,
            subtract_group_mean=config.advantage_estimator == "reinforce_pp_baseline",
            ddof=config.std_ddof,
            eps=config.advantage_eps,
        )
    if config.advantage_estimator == "pass_at_k":
        return pass_at_k_advantages(
            rewards, g, k=config.pass_at_k, group_ids=group_ids, eps=config.advantage_eps
        )
    kwargs = dict(
        scale=config.scale_rewards,
        ddof=config.std_ddof,
        eps=config.advantage_eps,
        baseline=config.baseline,
    )
    if group_ids is not None:
        return segment_advantages(rewards, group_ids, **kwargs)
    return group_advantages(rewards, g, **kwargs)


@partial(jax.jit, static_argnames=("group_size", "subtract_group_mean", "ddof"))
def reinforce_pp_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    group_ids: jax.Array | None = None,
    subtract_group_mean: bool = False,
    ddof: int = 1,
    eps: float = 1e-4,
) -> jax.Array:
    r"""REINFORCE++ advantages: rewards whitened over the whole batch (a global baseline).

    ``A_i = (x_i - mean_B(x)) / (std_B(x) + eps)`` over the valid rows of the batch, with
    ``x_i = r_i`` (REINFORCE++: the batch mean is the baseline, no per-prompt critic or group
    statistics) or, with ``subtract_group_mean``, ``x_i = r_i - mean_{group(i)}(r)``
    (REINFORCE++-baseline: group-mean centering, then batch normalization, which keeps the
    scale of the advantages stable across prompts of different difficulty).

    Args:
        rewards: ``(B,)`` rewards; NaN = no reward (advantage 0, left out of every statistic).
        group_size: Static group size (used with ``subtract_group_mean`` and no ``group_ids``).
        group_ids: Optional ``(B,)`` group index per row (groups of different sizes).
        subtract_group_mean: Center each group first (REINFORCE++-baseline).
        ddof: Delta degrees of freedom of the batch std.
        eps: Added to the std before dividing.

    Returns:
        ``(B,)`` float32 advantages.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import reinforce_pp_advantages
        >>> reinforce_pp_advantages(jnp.array([1.0, 0.0, 1.0, 0.0]), 2, ddof=0).round(3).tolist()
        [1.0, -1.0, 1.0, -1.0]

    References:
        Hu et al., 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both
        Prompt and Reward Models", arXiv:2501.03262.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = ~jnp.isnan(rewards)
    x = rewards
    if subtract_group_mean:
        stats = _stats(rewards, *_reducers(rewards.shape[0], group_size, group_ids), ddof)
        x = jnp.where(valid, stats.centered, jnp.nan)
    flat = _stats(
        x,
        lambda v: jnp.broadcast_to(v.sum(), v.shape),
        lambda v: jnp.broadcast_to(v.max(), v.shape),
        ddof,
    )
    return jnp.where(valid, flat.centered / (flat.std + eps), 0.0)


def _log_binom(n: jax.Array, k: jax.Array) -> jax.Array:
    return jax.lax.lgamma(n + 1.0) - jax.lax.lgamma(k + 1.0) - jax.lax.lgamma(n - k + 1.0)


def _binom_ratio(a: jax.Array, b: jax.Array, k: jax.Array) -> jax.Array:
    """``C(a, k) / C(b, k)`` for ``b >= a``; 0 where ``a < k``; 1 where ``k == 0``."""
    ok = a >= k
    safe_a = jnp.where(ok, a, k)
    return jnp.where(ok, jnp.exp(_log_binom(safe_a, k) - _log_binom(jnp.maximum(b, k), k)), 0.0)


@partial(jax.jit, static_argnames=("group_size", "k"))
def pass_at_k_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    k: int,
    group_ids: jax.Array | None = None,
    eps: float = 1e-4,
) -> jax.Array:
    r"""Analytical pass@k advantages of binary rewards (Pass@k Training).

    In a group of ``N`` valid samples of which ``N_neg`` are wrong (reward ``<= 0.5``), the
    expected pass@k reward of a random ``k``-subset is ``R = 1 - C(N_neg, k) / C(N, k)``, with
    std ``sigma = sqrt(R (1 - R))``. A correct sample gets
    ``A_pos = (1 - R) / (sigma + eps)``; a wrong one
    ``A_neg = (1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / (sigma + eps)``: the advantage
    of each sample under the group's pass@k objective, without enumerating subsets. With
    ``k = 1`` this is GRPO's group normalization with the population std. Groups with fewer
    than ``k`` valid samples, or all right / all wrong, get 0.

    Args:
        rewards: ``(B,)`` rewards in {0, 1}; NaN = no reward.
        group_size: Static group size (ignored with ``group_ids``).
        k: The ``k`` of pass@k (static, >= 1).
        group_ids: Optional ``(B,)`` group index per row (groups of different sizes).
        eps: Added to ``sigma`` before dividing.

    Returns:
        ``(B,)`` float32 advantages.

    Raises:
        ValueError: ``k < 1``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl import pass_at_k_advantages
        >>> rewards = jnp.array([1.0, 0.0, 0.0, 0.0])
        >>> print(np.asarray(pass_at_k_advantages(rewards, 4, k=1), float).round(3))
        [ 1.732 -0.577 -0.577 -0.577]
        >>> print(pass_at_k_advantages(rewards, 4, k=2).round(3))
        [ 1.    -0.333 -0.333 -0.333]

    References:
        Chen et al., 2025, "Pass@k Training for Adaptively Balancing Exploration and
        Exploitation of Large Reasoning Models", arXiv:2508.10751, sec. 3.3.
    """
    k = check_int("k", k, minimum=1)
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = ~jnp.isnan(rewards)
    group_sum, _ = _reducers(rewards.shape[0], group_size, group_ids)
    n = group_sum(valid.astype(jnp.float32))
    n_neg = group_sum((valid & ~(rewards > 0.5)).astype(jnp.float32))
    kf = jnp.float32(k)
    mean = 1.0 - _binom_ratio(n_neg, n, kf)
    sigma = jnp.sqrt(jnp.maximum(mean * (1.0 - mean), 0.0))
    a_pos = (1.0 - mean) / (sigma + eps)
    a_neg = (1.0 - mean - _binom_ratio(n_neg - 1.0, n - 1.0, kf - 1.0)) / (sigma + eps)
    adv = jnp.where(rewards > 0.5, a_pos, a_neg)
    ok = valid & (n >= k) & (sigma > 0)
    return jnp.where(ok, adv, 0.0)
