"""The loss variants' pieces: CISPO, SAPO, VESPO, sampler correction, entropy masks.

Pure functions of per-token arrays, as in ``core.losses`` (same shapes and masking rules);
``grpo_objective`` picks them by ``GRPOConfig`` setting, and ``core.losses`` re-exports them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from artifex.generative_models.training.rl.core.configs import (
    SamplerCorrection,
    SamplerCorrectionLevel,
)

__all__ = [
    "cispo_surrogate",
    "entropy_quantile_threshold",
    "high_entropy_mask",
    "off_policy_sequence_mask",
    "sampler_importance_weights",
    "sapo_surrogate",
    "vespo_weights",
]


def _mask(mask: jax.Array) -> jax.Array:
    return jnp.asarray(mask, jnp.float32)


def _broadcast_adv(advantages: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    return jnp.broadcast_to(adv, shape)


def cispo_surrogate(
    log_ratio: jax.Array,
    log_probs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    max_weight: float,
) -> tuple[jax.Array, jax.Array]:
    r"""Per-token CISPO loss: a clipped, stop-gradient importance weight times REINFORCE.

    ``loss_t = -sg[min(rho_t, eps_max)] * A_t * log pi_theta(o_t)``: unlike the PPO clip, no
    token loses its gradient; the weight only bounds how much an off-policy token counts.
    A token is *clipped* where ``rho_t > eps_max`` and ``A_t > 0`` (TRL's ``cispo_clip_ratio``).

    Args:
        log_ratio: ``(B, T)`` log importance ratios ``log rho``.
        log_probs: ``(B, T)`` log-probs of the current policy (differentiable).
        advantages: ``(B,)`` or ``(B, T)`` advantages.
        mask: ``(B, T)`` completion mask.
        max_weight: The cap ``eps_max > 0`` (ScaleRL uses 5).

    Returns:
        ``(loss, clipped)``, each ``(B, T)`` float32 and 0 at masked positions.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import cispo_surrogate
        >>> log_ratio = jnp.log(jnp.array([[1.0, 8.0]]))
        >>> logp = jnp.array([[-1.0, -2.0]])
        >>> loss, clipped = cispo_surrogate(log_ratio, logp, jnp.array([1.0]), jnp.ones((1, 2)),
        ...                                 max_weight=5.0)
        >>> loss.tolist(), clipped.tolist()
        ([[1.0, 10.0]], [[0.0, 1.0]])

    References:
        MiniMax, 2025, "MiniMax-M1", arXiv:2506.13585; Khatri et al., 2025, "The Art of
        Scaling Reinforcement Learning Compute for LLMs" (ScaleRL), arXiv:2510.13786.
    """
    m = _mask(mask)
    adv = _broadcast_adv(advantages, m.shape)
    ratio = jnp.exp(jnp.where(m > 0, jax.lax.stop_gradient(log_ratio), 0.0))
    weight = jnp.minimum(ratio, max_weight)
    lp = jnp.where(m > 0, jnp.asarray(log_probs, jnp.float32), 0.0)
    loss = -weight * adv * lp
    clipped = ((ratio > max_weight) & (adv > 0)).astype(jnp.float32) * m
    return jnp.where(m > 0, loss, 0.0), clipped


def sapo_surrogate(
    log_ratio: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    temperature_pos: float,
    temperature_neg: float,
) -> jax.Array:
    r"""Per-token SAPO loss: a soft sigmoid gate on the ratio in place of the hard clip.

    ``loss_t = -(4 / tau) * sigmoid(tau * (rho_t - 1)) * A_t`` with ``tau = tau_pos`` where
    ``A_t > 0`` and ``tau_neg`` elsewhere. At ``rho = 1`` the gate's gradient is that of
    ``rho`` (``d/d rho = sigmoid' * 4 = 1``); far from 1 it decays smoothly instead of
    dropping to zero at a clip boundary.

    Args:
        log_ratio: ``(B, T)`` log importance ratios.
        advantages: ``(B,)`` or ``(B, T)`` advantages.
        mask: ``(B, T)`` completion mask.
        temperature_pos: ``tau_pos > 0``.
        temperature_neg: ``tau_neg > 0``.

    Returns:
        ``(B, T)`` float32 losses, 0 at masked positions.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import sapo_surrogate
        >>> loss = sapo_surrogate(jnp.zeros((1, 2)), jnp.array([1.0]), jnp.ones((1, 2)),
        ...                       temperature_pos=1.0, temperature_neg=1.05)
        >>> loss.tolist()
        [[-2.0, -2.0]]

    References:
        Gao et al., 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347.
    """
    m = _mask(mask)
    adv = _broadcast_adv(advantages, m.shape)
    ratio = jnp.exp(jnp.where(m > 0, log_ratio, 0.0))
    tau = jnp.where(adv > 0, temperature_pos, temperature_neg)
    gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return jnp.where(m > 0, -gate * adv, 0.0)


_LOG_1E8 = math.log(1e-8)


def vespo_weights(
    token_log_ratio: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    sampler_log_weights: jax.Array | None = None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> jax.Array:
    r"""VESPO's Gamma weight of the sequence importance ratio (no gradient).

    With ``log w_i = clip(sum_t clip(log rho_{i,t}, -20, 20) + sum_t log c_{i,t}, log 1e-8, 20)``
    (``c`` the optional sampler correction weights, their logs clipped the same way),
    ``phi(w) = exp(lambda + k log w - lambda w)``, normalized so ``phi(1) = 1``, with
    ``(k, lambda) = (k_pos, lambda_pos)`` where ``A >= 0`` and ``(k_neg, lambda_neg)``
    elsewhere. The VESPO loss is ``-sg[phi] * A * log pi_theta``. This follows TRL 1.16's
    ``get_gamma_weights``.

    Args:
        token_log_ratio: ``(B, T)`` per-token log ratios ``log pi_theta - log pi_old``.
        advantages: ``(B,)`` or ``(B, T)`` advantages.
        mask: ``(B, T)`` completion mask.
        sampler_log_weights: Optional ``(B, T)`` log of token-level sampler correction
            weights (``-inf`` where a token is masked).
        k_pos: Power ``k`` for ``A >= 0``.
        lambda_pos: Decay ``lambda`` for ``A >= 0``.
        k_neg: Power ``k`` for ``A < 0``.
        lambda_neg: Decay ``lambda`` for ``A < 0``.

    Returns:
        ``(B, T)`` float32 weights (one value per completion where the advantage is constant
        over it), 0 at masked positions.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import vespo_weights
        >>> w = vespo_weights(jnp.zeros((2, 2)), jnp.array([1.0, -1.0]), jnp.ones((2, 2)))
        >>> w.tolist()
        [[1.0, 1.0], [1.0, 1.0]]
        >>> print(vespo_weights(jnp.full((1, 2), 0.5), jnp.array([1.0]), jnp.ones((1, 2))).round(3))
        [[0.043 0.043]]

    References:
        VESPO, "Variational Sequence-Level Soft Policy Optimization", arXiv:2602.10693.
    """
    m = _mask(mask)
    lr = jnp.where(m > 0, jax.lax.stop_gradient(jnp.asarray(token_log_ratio, jnp.float32)), 0.0)
    seq = jnp.sum(jnp.clip(lr, -20.0, 20.0) * m, axis=-1, keepdims=True)
    if sampler_log_weights is not None:
        lw = jnp.clip(jax.lax.stop_gradient(sampler_log_weights), _LOG_1E8, 20.0)
        seq = seq + jnp.sum(jnp.where(m > 0, lw, 0.0), axis=-1, keepdims=True)
    log_w = jnp.clip(seq, _LOG_1E8, 20.0)
    adv = _broadcast_adv(advantages, m.shape)
    nonneg = adv >= 0
    k = jnp.where(nonneg, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(nonneg, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    phi = jnp.where(jnp.isfinite(phi), phi, 0.0)
    return jnp.where(m > 0, phi, 0.0)


def sampler_importance_weights(
    train_log_probs: jax.Array,
    sampler_log_probs: jax.Array,
    mask: jax.Array,
    *,
    mode: SamplerCorrection,
    level: SamplerCorrectionLevel = "token",
    ratio_min: float | None = None,
    ratio_max: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""Truncated or masked importance weights correcting a sampler/trainer mismatch (no grad).

    The sampler (an inference engine, bf16 or truncated sampling, stale weights) draws tokens
    from ``pi_sampler`` while the loss assumes ``pi_train``. With ``d_t = log pi_train(o_t) -
    log pi_sampler(o_t)`` (0 on masked tokens and where the sampler gave NaN), the ratio is
    ``r_t = exp(d_t)`` (``"token"``), ``exp(sum_t d_t)`` (``"sequence"``, the product, as TRL's
    ``sequence_*`` modes) or ``exp(mean_t d_t)`` (``"geometric"``). Then:

    - ``"truncate"`` (TIS): ``w = clip(r, C_min, C_max)``;
    - ``"mask"`` (MIS; IcePop at token level): ``w = r`` if ``C_min <= r <= C_max``, else 0.

    The policy term of the loss is multiplied by ``w``.

    Args:
        train_log_probs: ``(B, T)`` log-probs of the training graph (the old policy).
        sampler_log_probs: ``(B, T)`` log-probs the sampler reported.
        mask: ``(B, T)`` completion mask.
        mode: ``"truncate"`` or ``"mask"`` (``"none"``: weights 1).
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        ratio_min: ``C_min`` or ``None`` (unbounded).
        ratio_max: ``C_max`` or ``None`` (unbounded).

    Returns:
        ``(weights, ratio, outside)``, each ``(B, T)`` float32: the weights, the raw ratio, and 1
        where the ratio lay outside ``[C_min, C_max]`` (truncated or masked); 0 at masked
        positions.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import sampler_importance_weights
        >>> train, sampler = jnp.log(jnp.array([[0.5, 0.9]])), jnp.log(jnp.array([[0.25, 0.9]]))
        >>> w, ratio, outside = sampler_importance_weights(
        ...     train, sampler, jnp.ones((1, 2)), mode="truncate", ratio_max=1.25
        ... )
        >>> print(w, ratio, outside)
        [[1.25 1.  ]] [[2. 1.]] [[1. 0.]]

    References:
        Yao et al., 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
        Training" (TIS); Liu et al., 2025, "When Speed Kills Stability: Demystifying RL Collapse
        from the Training-Inference Mismatch" (MIS); Ling Team, 2025, "Every Step Evolves"
        (IcePop), arXiv:2510.18855.
    """
    m = _mask(mask)
    diff = jax.lax.stop_gradient(
        jnp.asarray(train_log_probs, jnp.float32) - jnp.asarray(sampler_log_probs, jnp.float32)
    )
    diff = jnp.where((m > 0) & ~jnp.isnan(diff), diff, 0.0)
    if level == "token":
        log_r = diff
    elif level in ("sequence", "geometric"):
        total = jnp.sum(diff, axis=-1, keepdims=True)
        if level == "geometric":
            total = total / jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1.0)
        log_r = jnp.broadcast_to(total, m.shape)
    else:
        msg = f"level must be 'token', 'sequence' or 'geometric', got {level!r}"
        raise ValueError(msg)
    ratio = jnp.exp(log_r)
    lo = -jnp.inf if ratio_min is None else ratio_min
    hi = jnp.inf if ratio_max is None else ratio_max
    outside = (ratio < lo) | (ratio > hi)
    if mode == "truncate":
        weights = jnp.clip(ratio, lo, hi)
    elif mode == "mask":
        weights = jnp.where(outside, 0.0, ratio)
    elif mode == "none":
        weights = jnp.ones_like(ratio)
        outside = jnp.zeros_like(outside)
    else:
        msg = f"mode must be 'none', 'truncate' or 'mask', got {mode!r}"
        raise ValueError(msg)
    return (
        jnp.where(m > 0, weights, 0.0),
        jnp.where(m > 0, ratio, 0.0),
        outside.astype(jnp.float32) * m,
    )


def off_policy_sequence_mask(
    advantages: jax.Array,
    log_probs: jax.Array,
    behavior_log_probs: jax.Array,
    mask: jax.Array,
    *,
    threshold: float,
) -> jax.Array:
    r"""DeepSeek-V3.2's off-policy sequence mask: 0 for stale negative samples, else 1 (no grad).

    A completion is dropped from the policy term when its advantage is negative *and* its mean
    log-ratio ``(1/|o_i|) sum_t (log pi_behavior(o_t) - log pi_theta(o_t))`` (a k1 estimate of
    ``KL[pi_behavior || pi_theta]``) exceeds ``delta``: learning to avoid a sample the current
    policy would no longer produce mostly adds noise. ``pi_behavior`` is the sampler (or the old
    policy when the sampler's log-probs are not available); NaN there counts as no evidence.

    Args:
        advantages: ``(B,)`` or ``(B, T)`` advantages.
        log_probs: ``(B, T)`` current log-probs (their gradient is not used).
        behavior_log_probs: ``(B, T)`` log-probs of the policy that sampled the tokens.
        mask: ``(B, T)`` completion mask.
        threshold: ``delta``.

    Returns:
        ``(B, T)`` float32 mask, 1 where kept.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import off_policy_sequence_mask
        >>> logp = jnp.array([[-3.0, -3.0], [-3.0, -3.0]])
        >>> behavior = jnp.array([[-1.0, -1.0], [-1.0, -1.0]])
        >>> off_policy_sequence_mask(jnp.array([1.0, -1.0]), logp, behavior, jnp.ones((2, 2)),
        ...                          threshold=0.5).tolist()
        [[1.0, 1.0], [0.0, 0.0]]

    References:
        DeepSeek-AI, 2025, "DeepSeek-V3.2", arXiv:2512.02556, eq. 9.
    """
    m = _mask(mask)
    kl = jnp.asarray(behavior_log_probs, jnp.float32) - jax.lax.stop_gradient(
        jnp.asarray(log_probs, jnp.float32)
    )
    kl = jnp.where((m > 0) & ~jnp.isnan(kl), kl, 0.0)
    seq = jnp.sum(kl * m, axis=-1, keepdims=True) / jnp.maximum(
        jnp.sum(m, axis=-1, keepdims=True), 1.0
    )
    adv = _broadcast_adv(advantages, m.shape)
    keep = (adv >= 0) | (seq <= threshold)
    return jax.lax.stop_gradient(keep.astype(jnp.float32))


def entropy_quantile_threshold(entropy: jax.Array, mask: jax.Array, q: float) -> jax.Array:
    r"""The ``q``-quantile of the entropies of the valid tokens (linear interpolation).

    With the ``n`` valid values sorted, ``x_(0) <= ... <= x_(n-1)``, and ``p = q (n - 1)``:
    ``x_(floor p) + (p - floor p)(x_(ceil p) - x_(floor p))`` (``torch.quantile``'s default, as
    TRL uses). Jit-compatible: ``n`` may vary; an empty mask gives ``+inf`` (no token passes).

    Args:
        entropy: ``(B, T)`` token entropies.
        mask: ``(B, T)`` completion mask.
        q: Quantile in [0, 1].

    Returns:
        Scalar float32 threshold.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import entropy_quantile_threshold
        >>> entropy = jnp.array([[1.0, 2.0, 3.0, 9.0]])
        >>> float(entropy_quantile_threshold(entropy, jnp.array([[1, 1, 1, 0]]), 0.5))
        2.0
    """
    m = _mask(mask).reshape(-1)
    x = jnp.where(m > 0, jnp.asarray(entropy, jnp.float32).reshape(-1), jnp.inf)
    x = jnp.sort(jax.lax.stop_gradient(x))
    n = jnp.sum(m)
    pos = q * jnp.maximum(n - 1.0, 0.0)
    lo = jnp.floor(pos)
    hi = jnp.minimum(lo + 1.0, jnp.maximum(n - 1.0, 0.0))
    x_lo = jnp.take(x, lo.astype(jnp.int32))
    x_hi = jnp.take(x, hi.astype(jnp.int32))
    value = x_lo + (pos - lo) * jnp.where(hi > lo, x_hi - x_lo, 0.0)
    return jnp.where(n > 0, value, jnp.inf)


def high_entropy_mask(
    entropy: jax.Array,
    mask: jax.Array,
    top_quantile: float,
    *,
    threshold: jax.Array | None = None,
) -> jax.Array:
    r"""1 on the valid tokens in the top ``rho`` quantile of entropy (the "forking" tokens).

    A token is kept when ``H_t >= Q_{1-rho}(H)``, the ``(1 - rho)`` quantile of the entropies
    of all valid tokens (:func:`entropy_quantile_threshold`). Only those tokens then carry the
    policy gradient (Wang et al., 2025, keep 20%).

    Args:
        entropy: ``(B, T)`` token entropies.
        mask: ``(B, T)`` completion mask.
        top_quantile: ``rho`` in [0, 1].
        threshold: A precomputed threshold (e.g. from the whole batch when this is one of its
            microbatches); computed from ``entropy`` when ``None``.

    Returns:
        ``(B, T)`` float32 0/1 mask.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import high_entropy_mask
        >>> entropy = jnp.array([[0.1, 2.0, 0.3, 1.5, 0.2]])
        >>> high_entropy_mask(entropy, jnp.ones((1, 5)), 0.4).tolist()
        [[0.0, 1.0, 0.0, 1.0, 0.0]]

    References:
        Wang et al., 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
        Reinforcement Learning for LLM Reasoning", arXiv:2506.01939.
    """
    m = _mask(mask)
    h = jax.lax.stop_gradient(jnp.asarray(entropy, jnp.float32))
    if threshold is None:
        threshold = entropy_quantile_threshold(h, m, 1.0 - top_quantile)
    keep = (jnp.where(m > 0, h, 0.0) >= threshold) & (m > 0)
    return keep.astype(jnp.float32)
