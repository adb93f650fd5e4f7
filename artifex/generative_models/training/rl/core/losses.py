r"""The pieces of the GRPO loss as small pure functions of per-token arrays.

Shapes: ``B`` rows (completions), ``T`` completion tokens. Every function takes a ``mask``
``(B, T)`` that is 1 on the completion tokens that count; values at masked positions never reach
a result (they are replaced before any ``exp``, so padding holding garbage cannot make NaN).

The GRPO objective per token, with ratio ``rho = pi_theta / pi_old`` and advantage ``A``:

.. math::

    \ell_t = -\min\big(\rho_t A_t,\ \operatorname{clip}(\rho_t, 1-\varepsilon_{low},
    1+\varepsilon_{high}) A_t\big) + \beta\, \mathrm{KL}_t - c_H H_t,

aggregated over tokens and rows by :func:`aggregate_loss`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from artifex.generative_models.training.rl.core.configs import (
    ImportanceSamplingLevel,
    KLEstimator,
    LossAggregation,
)
from artifex.generative_models.training.rl.core.variant_losses import (
    cispo_surrogate,
    entropy_quantile_threshold,
    high_entropy_mask,
    off_policy_sequence_mask,
    sampler_importance_weights,
    sapo_surrogate,
    vespo_weights,
)

__all__ = [
    "aggregate_loss",
    "approx_kl_old",
    "cispo_surrogate",
    "clipped_surrogate",
    "entropy_from_logits",
    "entropy_quantile_threshold",
    "high_entropy_mask",
    "kl_divergence",
    "log_importance_ratio",
    "loss_normalizer",
    "masked_mean",
    "off_policy_sequence_mask",
    "sampler_importance_weights",
    "sapo_surrogate",
    "vespo_weights",
]


def _mask(mask: jax.Array) -> jax.Array:
    return jnp.asarray(mask, jnp.float32)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``x`` over positions where ``mask`` is 1; 0 when the mask is empty.

    Args:
        x: Values, any shape.
        mask: Same shape as ``x``; 1 where a value counts.

    Returns:
        Scalar float32 mean.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import masked_mean
        >>> masked_mean(jnp.array([1.0, 3.0, 100.0]), jnp.array([1, 1, 0]))
        Array(2., dtype=float32)
    """
    m = _mask(mask)
    return jnp.sum(jnp.where(m > 0, x, 0.0) * m) / jnp.maximum(jnp.sum(m), 1.0)


def log_importance_ratio(
    log_probs: jax.Array,
    old_log_probs: jax.Array | None,
    mask: jax.Array,
    *,
    level: ImportanceSamplingLevel = "token",
) -> jax.Array:
    r"""Log importance ratio ``log(pi_theta / pi_old)`` per token, at token or sequence level.

    ``"token"`` (GRPO/PPO): ``log rho_t = log pi_theta(o_t) - log pi_old(o_t)``.
    ``"sequence"`` (GSPO): one length-normalized ratio per completion,
    ``log s_i = (1/|o_i|) sum_t (log pi_theta - log pi_old)``, broadcast to its tokens; its
    gradient reaches every token of the completion through the mean (the GSPO-token form with
    equal token advantages equals GSPO). ``"sequence_token"`` (GSPO-token):
    ``log s_{i,t} = sg[log s_i] + log pi_theta(o_t) - sg[log pi_theta(o_t)]``: the value is the
    sequence ratio, the gradient that of the token's own log-prob, so token-level advantages
    act per token.

    Without ``old_log_probs`` the update is on-policy: ``pi_old = stop_gradient(pi_theta)``, so
    the ratio is exactly 1 while its gradient is that of ``log pi_theta``.

    Args:
        log_probs: ``(B, T)`` log-probs of the sampled tokens under the current policy.
        old_log_probs: ``(B, T)`` log-probs under the sampling policy, or ``None``.
        mask: ``(B, T)`` completion mask.
        level: ``"token"``, ``"sequence"`` or ``"sequence_token"``.

    Returns:
        ``(B, T)`` float32 log ratios, 0 at masked positions.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import log_importance_ratio
        >>> logp = jnp.array([[-1.0, -2.0, 0.0]])
        >>> old = jnp.array([[-1.5, -2.0, 0.0]])
        >>> mask = jnp.array([[1, 1, 0]])
        >>> log_importance_ratio(logp, old, mask).tolist()
        [[0.5, 0.0, 0.0]]
        >>> log_importance_ratio(logp, old, mask, level="sequence").tolist()
        [[0.25, 0.25, 0.0]]

    References:
        Zheng et al., 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.
    """
    m = _mask(mask)
    log_probs = jnp.asarray(log_probs, jnp.float32)
    old = jax.lax.stop_gradient(log_probs if old_log_probs is None else old_log_probs)
    diff = jnp.where(m > 0, log_probs - jnp.asarray(old, jnp.float32), 0.0)
    if level == "token":
        return diff
    if level in ("sequence", "sequence_token"):
        seq = jnp.sum(diff * m, axis=-1, keepdims=True) / jnp.maximum(
            jnp.sum(m, axis=-1, keepdims=True), 1.0
        )
        seq = jnp.broadcast_to(seq, diff.shape)
        if level == "sequence_token":
            seq = jax.lax.stop_gradient(seq) + log_probs - jax.lax.stop_gradient(log_probs)
        return jnp.where(m > 0, seq, 0.0)
    msg = f"level must be 'token', 'sequence' or 'sequence_token', got {level!r}"
    raise ValueError(msg)


def clipped_surrogate(
    log_ratio: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    epsilon_low: float,
    epsilon_high: float,
    dual_clip: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""Per-token clipped surrogate loss (PPO/GRPO), with optional dual clipping.

    ``loss_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)`` with
    ``rho = exp(log_ratio)``. With ``dual_clip = c > 1``, for ``A_t < 0`` the loss is further
    capped at ``-c A_t`` (Ye et al., 2020), so an exploding ratio cannot make it unbounded.

    Clipping is *active* (the gradient through the ratio is zero) when
    ``rho < 1 - eps_low`` with ``A < 0`` (low) or ``rho > 1 + eps_high`` with ``A > 0`` (high).

    Args:
        log_ratio: ``(B, T)`` log importance ratios.
        advantages: ``(B,)`` per-completion or ``(B, T)`` per-token advantages.
        mask: ``(B, T)`` completion mask.
        epsilon_low: Lower clip range (``clip_param``).
        epsilon_high: Upper clip range (``clip_param_high``, DAPO's clip-higher).
        dual_clip: Optional dual-clip constant ``c > 1``.

    Returns:
        ``(loss, clipped_low, clipped_high)``, each ``(B, T)`` float32 and 0 at masked
        positions; the last two are 1 where the lower/upper clip is active.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import clipped_surrogate
        >>> log_ratio = jnp.log(jnp.array([[1.0, 1.5]]))
        >>> loss, low, high = clipped_surrogate(
        ...     log_ratio, jnp.array([1.0]), jnp.ones((1, 2)), epsilon_low=0.2, epsilon_high=0.2
        ... )
        >>> print(loss.round(3), high)
        [[-1.  -1.2]] [[0. 1.]]

    References:
        Schulman et al., 2017, "Proximal Policy Optimization", arXiv:1707.06347;
        Yu et al., 2025, "DAPO", arXiv:2503.14476; Ye et al., 2020, "Mastering Complex Control
        in MOBA Games with Deep RL", arXiv:1912.09729.
    """
    m = _mask(mask)
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    adv = jnp.broadcast_to(adv, m.shape)
    ratio = jnp.exp(jnp.where(m > 0, log_ratio, 0.0))
    clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -jnp.minimum(ratio * adv, clipped * adv)
    if dual_clip is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
    low = ((ratio < 1.0 - epsilon_low) & (adv < 0)).astype(jnp.float32) * m
    high = ((ratio > 1.0 + epsilon_high) & (adv > 0)).astype(jnp.float32) * m
    return jnp.where(m > 0, loss, 0.0), low, high


def kl_divergence(
    log_probs: jax.Array,
    ref_log_probs: jax.Array,
    mask: jax.Array,
    *,
    estimator: KLEstimator = "k3",
) -> jax.Array:
    r"""Per-token estimate of ``KL[pi_theta || pi_ref]`` from tokens sampled from ``pi_theta``.

    With ``log_r = log pi_ref(o_t) - log pi_theta(o_t)`` (Schulman, 2020):

    - ``"k1"``: ``-log_r`` (unbiased, can be negative, high variance);
    - ``"k2"``: ``log_r**2 / 2`` (biased, low variance; its gradient is the true KL gradient's);
    - ``"k3"``: ``exp(log_r) - log_r - 1`` (unbiased, >= 0, low variance; DeepSeekMath eq. 4).

    The penalty is *added* to the loss (``+ beta * KL``), pulling the policy towards the
    reference.

    Args:
        log_probs: ``(B, T)`` log-probs under the current policy.
        ref_log_probs: ``(B, T)`` log-probs under the reference policy.
        mask: ``(B, T)`` completion mask.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        ``(B, T)`` float32 estimates, 0 at masked positions.

    Examples:
        >>> import jax.numpy as jnp
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl import kl_divergence
        >>> logp, ref = jnp.array([[-1.0, -1.0]]), jnp.array([[-1.0, -2.0]])
        >>> print(np.asarray(kl_divergence(logp, ref, jnp.ones((1, 2))), float).round(4))
        [[0.     0.3679]]
        >>> print(kl_divergence(logp, ref, jnp.ones((1, 2)), estimator="k2"))
        [[0.  0.5]]

    References:
        Schulman, 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html;
        Shao et al., 2024, arXiv:2402.03300, eq. 4.
    """
    m = _mask(mask)
    log_r = jnp.where(
        m > 0,
        jnp.asarray(ref_log_probs, jnp.float32) - jnp.asarray(log_probs, jnp.float32),
        0.0,
    )
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r * log_r
    elif estimator == "k3":
        kl = jnp.expm1(log_r) - log_r
    else:
        msg = f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}"
        raise ValueError(msg)
    return jnp.where(m > 0, kl, 0.0)


def approx_kl_old(log_ratio: jax.Array, mask: jax.Array) -> jax.Array:
    r"""Per-token k3 estimate of ``KL[pi_old || pi_theta]`` from tokens sampled from ``pi_old``.

    ``(rho - 1) - log rho`` with ``rho = pi_theta / pi_old``: how far the update has moved the
    policy from the one that generated the batch (0 on the first on-policy iteration).

    Args:
        log_ratio: ``(B, T)`` log importance ratios ``log rho``.
        mask: ``(B, T)`` completion mask.

    Returns:
        ``(B, T)`` float32 estimates, 0 at masked positions.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import approx_kl_old
        >>> print(approx_kl_old(jnp.array([[0.0, jnp.log(2.0)]]), jnp.ones((1, 2))).round(4))
        [[0.     0.3069]]

    References:
        Schulman, 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.
    """
    m = _mask(mask)
    lr = jnp.where(m > 0, jax.lax.stop_gradient(log_ratio), 0.0)
    return jnp.where(m > 0, jnp.expm1(lr) - lr, 0.0)


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    r"""Entropy ``H = -sum_v p_v log p_v`` of the categorical distribution of each position.

    Computed as ``logsumexp(z) - sum_v softmax(z)_v z_v`` in float32.

    Args:
        logits: ``(..., V)`` unnormalized log-probabilities.

    Returns:
        ``(...)`` float32 entropies.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import entropy_from_logits
        >>> entropy_from_logits(jnp.zeros((1, 2)))  # uniform over 2 tokens: log 2
        Array([0.6931472], dtype=float32)
    """
    z = jnp.asarray(logits, jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    p = jnp.exp(z - lse[..., None])
    return lse - jnp.sum(p * z, axis=-1)


def loss_normalizer(
    mask: jax.Array, mode: LossAggregation, *, max_length: int | None = None
) -> jax.Array:
    """The denominator that :func:`aggregate_loss` divides by, for a batch or a microbatch.

    Denominators add up over microbatches, so summing :func:`aggregate_loss` numerators of
    several microbatches and dividing by the summed normalizer reproduces the full-batch loss
    exactly, whatever the split.

    Args:
        mask: ``(B, T)`` completion mask.
        mode: ``"sequence_mean"`` -> ``B``; ``"token_mean"`` -> number of valid tokens;
            ``"constant_length"`` -> ``B * max_length``; ``"sequence_sum"`` -> ``B``.
        max_length: Constant length for ``"constant_length"``; defaults to ``T``.

    Returns:
        Scalar float32 denominator (not guarded against 0; :func:`aggregate_loss` is).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import loss_normalizer
        >>> mask = jnp.array([[1, 1, 0], [1, 0, 0]])
        >>> float(loss_normalizer(mask, "token_mean"))
        3.0
        >>> float(loss_normalizer(mask, "sequence_mean"))
        2.0
        >>> float(loss_normalizer(mask, "constant_length", max_length=4))
        8.0
    """
    m = _mask(mask)
    b, t = m.shape
    if mode in ("sequence_mean", "sequence_sum"):
        return jnp.asarray(b, jnp.float32)
    if mode == "token_mean":
        return jnp.sum(m)
    if mode == "constant_length":
        return jnp.asarray(b * (t if max_length is None else max_length), jnp.float32)
    msg = (
        "mode must be one of sequence_mean, token_mean, constant_length, sequence_sum, "
        f"got {mode!r}"
    )
    raise ValueError(msg)


def aggregate_loss(
    per_token: jax.Array,
    mask: jax.Array,
    mode: LossAggregation,
    *,
    max_length: int | None = None,
    normalizer: jax.Array | float | None = None,
) -> jax.Array:
    r"""Reduces a ``(B, T)`` per-token quantity to a scalar, in one of four ways.

    - ``"sequence_mean"`` (GRPO paper): ``(1/B) sum_i (1/|o_i|) sum_t l_{i,t}``; a row with no
      valid token contributes 0.
    - ``"token_mean"`` (DAPO): ``sum_{i,t} l_{i,t} / sum_i |o_i|`` -- every token weighs the
      same, so long completions are not down-weighted.
    - ``"constant_length"`` (Dr. GRPO): ``sum_{i,t} l_{i,t} / (B L)`` with a constant ``L``,
      removing the length bias of per-sequence normalization.
    - ``"sequence_sum"`` (LUSPO, TRL ``loss_type="luspo"``): ``(1/B) sum_{i,t} l_{i,t}``: a
      sequence-level loss (one value per completion, broadcast to its tokens) is weighted by
      the completion's length.

    Args:
        per_token: ``(B, T)`` values (loss, KL, entropy...).
        mask: ``(B, T)`` completion mask.
        mode: ``"sequence_mean"``, ``"token_mean"``, ``"constant_length"`` or
            ``"sequence_sum"``.
        max_length: ``L`` for ``"constant_length"``; defaults to ``T``.
        normalizer: Overrides the denominator (see :func:`loss_normalizer`), e.g. the global
            one when this is a microbatch of a larger batch.

    Returns:
        Scalar float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import aggregate_loss
        >>> per_token = jnp.array([[1.0, 1.0, 0.0], [4.0, 0.0, 0.0]])
        >>> mask = jnp.array([[1, 1, 0], [1, 0, 0]])
        >>> float(aggregate_loss(per_token, mask, "sequence_mean"))
        2.5
        >>> float(aggregate_loss(per_token, mask, "token_mean"))
        2.0

    References:
        Shao et al., 2024, arXiv:2402.03300; Yu et al., 2025, arXiv:2503.14476 (DAPO);
        Liu et al., 2025, arXiv:2503.20783 (Dr. GRPO); LUSPO, arXiv:2602.05261.
    """
    if mode not in ("sequence_mean", "token_mean", "constant_length", "sequence_sum"):
        loss_normalizer(mask, mode)  # raises
    m = _mask(mask)
    x = jnp.where(m > 0, jnp.asarray(per_token, jnp.float32), 0.0) * m
    if mode == "sequence_mean":
        numerator = jnp.sum(jnp.sum(x, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0))
    else:
        numerator = jnp.sum(x)
    if normalizer is None:
        normalizer = loss_normalizer(m, mode, max_length=max_length)
    return numerator / jnp.maximum(jnp.asarray(normalizer, jnp.float32), 1.0)


# ------------------------------------------------------------------ 2025-2026 variants
