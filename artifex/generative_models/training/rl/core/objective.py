r"""The GRPO objective as pure functions of arrays, and the pure ``grpo_loss`` built from it.

:func:`grpo_objective` turns per-token log-probs into the loss and its metrics (a pure
function of arrays). :func:`make_grpo_loss` binds a model's graph and a config into the pure
``grpo_loss(params, batch) -> (loss, metrics)`` that ``jax.grad`` differentiates.

Per token ``t`` of completion ``i`` (DeepSeekMath eq. 3, with the options of
:class:`~artifex.generative_models.training.rl.core.configs.GRPOConfig`):

.. math::

    \ell_{i,t} = -\min\big(\rho_{i,t}\hat A_{i,t},\
    \operatorname{clip}(\rho_{i,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high})\hat A_{i,t}\big)
    + \beta\,\mathrm{KL}_{i,t} - c_H H_{i,t},

aggregated over tokens and completions; ``policy_loss + kl_penalty - entropy_coeff * entropy``
equals ``total_loss`` because all three use the same aggregation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.training.rl.core import advantages as adv_lib
from artifex.generative_models.training.rl.core import losses
from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.core.logprobs import LogProbFn, default_log_prob_fn
from artifex.generative_models.training.rl.core.microbatching import (  # noqa: F401 (old path)
    split_microbatches,
)
from artifex.generative_models.training.rl.core.teacher import make_distillation_terms

__all__ = [
    "as_grpo_batch",
    "compute_advantages",
    "grpo_objective",
    "make_grpo_loss",
]


# ---------------------------------------------------------------------------------- batches
def as_grpo_batch(batch: GRPOBatch | Mapping[str, Any], config: GRPOConfig) -> GRPOBatch:
    """Converts a batch (``GRPOBatch`` or the dict batch form) to a ``GRPOBatch`` of arrays.

    Args:
        batch: A :class:`GRPOBatch`, or a dict with ``observations``, ``actions``,
            ``rewards`` and optionally ``log_probs``, ``ref_log_probs``, ``advantages``,
            ``group_size``.
        config: Supplies the default group size (``num_generations``).

    Returns:
        A ``GRPOBatch`` whose leaves are JAX arrays.

    Raises:
        TypeError: For any other batch type.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import GRPOConfig, as_grpo_batch
        >>> batch = as_grpo_batch(
        ...     {"observations": jnp.ones((4, 3)), "actions": jnp.array([0, 1, 2, 0]),
        ...      "rewards": jnp.array([1.0, 0.0, 0.0, 1.0])},
        ...     GRPOConfig(num_generations=2),
        ... )
        >>> batch.group_size, batch.completion_ids.shape
        (2, (4, 1))
    """
    if isinstance(batch, Mapping):
        batch = GRPOBatch.from_dict(batch, group_size=config.num_generations)
    elif not isinstance(batch, GRPOBatch):
        msg = f"batch must be a GRPOBatch or a dict, got {type(batch).__name__}"
        raise TypeError(msg)
    else:
        # Python lists would be pytree nodes (one leaf per element): make them arrays first.
        lists = {
            f.name: getattr(batch, f.name)
            for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), list | tuple)
        }
        if lists:
            try:
                batch = batch.replace(**{k: np.asarray(v) for k, v in lists.items()})
            except ValueError as err:
                msg = f"GRPOBatch fields {sorted(lists)} are ragged lists: {err}"
                raise ValueError(msg) from err
    return jax.tree.map(jnp.asarray, batch)


def compute_advantages(batch: GRPOBatch, config: GRPOConfig) -> jax.Array:
    """The advantages the loss uses for ``batch``: ``(B,)`` or ``(B, T)`` float32.

    Precedence: the batch's precomputed ``advantages``; else process-supervision token
    advantages from ``step_rewards``; else outcome advantages from ``rewards`` (the segment
    kernel when the batch has ``group_ids``, the fixed-group kernel otherwise).

    Args:
        batch: The batch.
        config: Advantage options.

    Returns:
        The advantages.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import (
        ...     GRPOBatch,
        ...     GRPOConfig,
        ...     compute_advantages,
        ... )
        >>> batch = GRPOBatch(
        ...     prompt_ids=jnp.zeros((4, 1), jnp.int32),
        ...     completion_ids=jnp.zeros((4, 2), jnp.int32),
        ...     completion_mask=jnp.ones((4, 2)), rewards=jnp.array([1.0, 0.0, 2.0, 2.0]),
        ...     group_size=2)
        >>> compute_advantages(batch, GRPOConfig(num_generations=2, scale_rewards="none")).tolist()
        [0.5, -0.5, 0.0, 0.0]
    """
    if batch.advantages is not None:
        return jnp.asarray(batch.advantages, jnp.float32)
    if batch.step_rewards is not None:
        return adv_lib.process_advantages(
            batch.step_rewards,
            batch.group_size,
            gamma=config.gamma,
            scale=config.scale_rewards,
            ddof=config.std_ddof,
            eps=config.advantage_eps,
        )
    return adv_lib.advantages_from_config(
        batch.rewards, config, group_size=batch.group_size, group_ids=batch.group_ids
    )


# ---------------------------------------------------------------------------------- the loss
def batch_reward_metrics(batch: GRPOBatch, advantages: jax.Array) -> dict[str, jax.Array]:
    """The reward statistics of a batch (``core.advantages.reward_statistics``)."""
    if advantages.ndim == 2:
        adv_mask = jnp.asarray(batch.completion_mask, jnp.float32)
    elif batch.advantages is None:
        adv_mask = None  # the rows with a valid reward
    else:
        adv_mask = jnp.ones_like(advantages)
    return adv_lib.reward_statistics(
        batch.rewards,
        batch.group_size,
        group_ids=batch.group_ids,
        advantages=advantages,
        advantage_mask=adv_mask,
    )


# The policy losses, by ``GRPOConfig.policy_loss``. Each takes the log ratio (at the configured
# level), the log-probs, advantages, mask, the sampler's importance weights (or None), the batch
# and the config; it returns the per-token loss, the low and high clip indicators, its own
# metrics, and the importance weights left for the caller to apply (VESPO consumes them).
Surrogate = tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array], jax.Array | None]


def _clip_loss(log_ratio, log_probs, advantages, mask, is_weights, batch, config) -> Surrogate:
    pg, low, high = losses.clipped_surrogate(
        log_ratio,
        advantages,
        mask,
        epsilon_low=config.epsilon_low,
        epsilon_high=config.epsilon_high,
        dual_clip=config.dual_clip,
    )
    return pg, low, high, {}, is_weights


def _cispo_loss(log_ratio, log_probs, advantages, mask, is_weights, batch, config) -> Surrogate:
    pg, high = losses.cispo_surrogate(
        log_ratio, log_probs, advantages, mask, max_weight=config.cispo_max_weight
    )
    return pg, jnp.zeros_like(mask), high, {}, is_weights


def _sapo_loss(log_ratio, log_probs, advantages, mask, is_weights, batch, config) -> Surrogate:
    pg = losses.sapo_surrogate(
        log_ratio,
        advantages,
        mask,
        temperature_pos=config.sapo_temperature_pos,
        temperature_neg=config.sapo_temperature_neg,
    )
    zeros = jnp.zeros_like(mask)
    return pg, zeros, zeros, {}, is_weights


def _vespo_loss(log_ratio, log_probs, advantages, mask, is_weights, batch, config) -> Surrogate:
    """The sampler correction enters the sequence weight, not the loss: no weights are left."""
    token_log_ratio = losses.log_importance_ratio(
        log_probs, batch.old_log_probs, mask, level="token"
    )
    phi = losses.vespo_weights(
        token_log_ratio,
        advantages,
        mask,
        sampler_log_weights=None if is_weights is None else jnp.log(is_weights),
        k_pos=config.vespo_k_pos,
        lambda_pos=config.vespo_lambda_pos,
        k_neg=config.vespo_k_neg,
        lambda_neg=config.vespo_lambda_neg,
    )
    adv = jnp.broadcast_to(advantages if advantages.ndim == 2 else advantages[:, None], mask.shape)
    pg = jnp.where(mask > 0, -phi * adv * log_probs, 0.0)
    zeros = jnp.zeros_like(mask)
    return pg, zeros, zeros, {"vespo_weight_mean": losses.masked_mean(phi, mask)}, None


POLICY_LOSSES: dict[str, Callable[..., Surrogate]] = {
    "clip": _clip_loss,
    "cispo": _cispo_loss,
    "sapo": _sapo_loss,
    "vespo": _vespo_loss,
}


def _policy_term(
    log_probs: jax.Array,
    entropy: jax.Array | None,
    batch: GRPOBatch,
    config: GRPOConfig,
    advantages: jax.Array,
    mask: jax.Array,
    entropy_threshold: jax.Array | None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Per-token policy loss with every correction applied, its log ratio, and metrics."""
    log_ratio = losses.log_importance_ratio(
        log_probs, batch.old_log_probs, mask, level=config.importance_sampling_level
    )
    metrics: dict[str, jax.Array] = {}
    # The trainer's log-probs of the behavior policy: the old policy, or (on-policy) the current
    # one without gradient, as TRL does.
    train_lp = jax.lax.stop_gradient(
        log_probs if batch.old_log_probs is None else jnp.asarray(batch.old_log_probs, jnp.float32)
    )
    sampler_lp = batch.sampler_log_probs
    is_weights = None
    if config.sampler_correction != "none" and sampler_lp is not None:
        is_weights, _, outside = losses.sampler_importance_weights(
            train_lp,
            sampler_lp,
            mask,
            mode=config.sampler_correction,
            level=config.sampler_correction_level,
            ratio_min=config.sampler_ratio_min,
            ratio_max=config.sampler_ratio_max,
        )
        metrics.update(_sampler_metrics(train_lp, sampler_lp, is_weights, outside, mask, config))

    pg, low, high, surrogate_metrics, is_weights = POLICY_LOSSES[config.policy_loss](
        log_ratio, log_probs, advantages, mask, is_weights, batch, config
    )
    metrics.update(surrogate_metrics)

    if config.off_policy_mask_threshold is not None:
        behavior = train_lp if sampler_lp is None else jnp.asarray(sampler_lp, jnp.float32)
        keep = losses.off_policy_sequence_mask(
            advantages, log_probs, behavior, mask, threshold=config.off_policy_mask_threshold
        )
        pg = pg * keep
        dropped = (jnp.min(jnp.where(mask > 0, keep, 1.0), axis=-1) < 1).astype(jnp.float32)
        metrics["off_policy_masked_fraction"] = jnp.mean(dropped)  # of all rows
    if config.top_entropy_quantile < 1.0:
        if entropy is None:
            msg = "entropy is required when GRPOConfig.top_entropy_quantile < 1"
            raise ValueError(msg)
        keep = losses.high_entropy_mask(
            entropy, mask, config.top_entropy_quantile, threshold=entropy_threshold
        )
        pg = pg * keep
        metrics["high_entropy_fraction"] = losses.masked_mean(keep, mask)
    if is_weights is not None:
        pg = pg * is_weights
    metrics["clip_fraction_low"] = losses.masked_mean(low, mask)
    metrics["clip_fraction_high"] = losses.masked_mean(high, mask)
    metrics["clip_fraction"] = losses.masked_mean(low + high, mask)
    return pg, log_ratio, metrics


def _sampler_metrics(
    train_lp: jax.Array,
    sampler_lp: jax.Array,
    weights: jax.Array,
    outside: jax.Array,
    mask: jax.Array,
    config: GRPOConfig,
) -> dict[str, jax.Array]:
    """Mismatch metrics between the sampler and the trainer (as TRL reports them)."""
    diff = jnp.asarray(train_lp, jnp.float32) - jnp.asarray(sampler_lp, jnp.float32)
    scored = mask * (~jnp.isnan(diff)).astype(jnp.float32)
    diff = jnp.where(scored > 0, diff, 0.0)
    # k3 estimate of KL[pi_sampler || pi_train] from the sampler's tokens.
    kl = jnp.expm1(diff) - diff
    if config.sampler_correction_level == "token":
        unit = mask
    else:  # one value per completion: take the first token of each row
        unit = (jnp.cumsum(mask, axis=-1) == 1).astype(jnp.float32) * mask
    big = jnp.float32(jnp.inf)
    return {
        "sampler_logp_diff_mean": losses.masked_mean(jnp.abs(diff), scored),
        "sampler_logp_diff_max": jnp.max(jnp.where(scored > 0, jnp.abs(diff), 0.0)),
        "sampler_kl": losses.masked_mean(kl, scored),
        "sampler_ratio_mean": losses.masked_mean(weights, unit),
        "sampler_ratio_min": jnp.min(jnp.where(unit > 0, weights, big)),
        "sampler_ratio_max": jnp.max(jnp.where(unit > 0, weights, -big)),
        "sampler_corrected_fraction": losses.masked_mean(outside, unit),
        # the denominators of the means above, to combine microbatches' metrics exactly
        "sampler_scored_tokens": jnp.sum(scored),
        "sampler_units": jnp.sum(unit),
    }


def grpo_objective(
    log_probs: jax.Array,
    entropy: jax.Array | None,
    batch: GRPOBatch,
    config: GRPOConfig,
    *,
    normalizer: jax.Array | float | None = None,
    advantages: jax.Array | None = None,
    reward_metrics: bool = True,
    entropy_threshold: jax.Array | None = None,
    distillation: jax.Array | None = None,
    kl: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""The GRPO loss and its metrics from the current policy's per-token log-probs.

    ``loss = p agg(w * m * l) + beta * agg(c * KL) - entropy_coeff * agg(H) + lambda agg(D)``
    where ``agg`` is the configured aggregation (see
    :func:`~artifex.generative_models.training.rl.core.losses.aggregate_loss`), ``l`` the per-token
    policy term (``policy_loss``: the clipped surrogate ``-min(rho A, clip(rho) A)`` with the
    token, sequence or GSPO-token ratio ``rho``; CISPO; SAPO; VESPO), ``m`` the off-policy
    sequence mask and the high-entropy token mask (1 when disabled), ``w`` the sampler/trainer
    correction weights (1 when disabled), ``c`` the importance ratio when
    ``kl_importance_weighted`` (else 1), ``A`` the advantages from :func:`compute_advantages`,
    ``p``/``lambda`` the ``policy_loss_coeff``/``distillation_coeff`` and ``D`` the
    ``distillation``. This is TRL 1.16's ``_compute_loss`` term by term (its
    ``loss_type`` is ``policy_loss`` plus ``loss_aggregation`` here).

    Args:
        log_probs: ``(B, T)`` log-probs of the completion tokens under the current policy
            (differentiable).
        entropy: ``(B, T)`` entropies of the current policy, or ``None`` (counts as 0; only
            allowed with ``entropy_coeff == 0`` and ``top_entropy_quantile == 1``).
        batch: The batch (masks, rewards, old, reference, sampler, teacher log-probs).
        config: The options.
        normalizer: Overrides the aggregation denominator (for microbatches of a larger
            batch, see :func:`~artifex.generative_models.training.rl.core.losses.loss_normalizer`).
        advantages: Overrides :func:`compute_advantages` (e.g. the whole batch's, for one of
            its microbatches).
        reward_metrics: Add the reward and advantage statistics to the metrics.
        entropy_threshold: Overrides the entropy quantile of ``top_entropy_quantile`` (the
            whole batch's, when this is one of its microbatches).
        distillation: ``(B, T)`` per-token distillation loss, given exactly when
            ``distillation_coeff > 0`` (:mod:`~artifex.generative_models.training.rl.core.teacher`).
        kl: ``(B, T)`` per-token KL to the reference computed by the caller (with
            ``kl_estimator="exact"``: a log-prob function's ``log_probs_and_kl``); used in
            place of the estimator on ``ref_log_probs``.

    Returns:
        ``(total_loss, metrics)``; metrics are float32 scalars: ``policy_loss``,
        ``kl``, ``kl_penalty`` (``beta * kl``), ``approx_kl`` (vs. the sampling policy),
        ``entropy``, ``clip_fraction[_low|_high]``, ``reward_mean/std``,
        ``advantage_mean/std``,
        ``frac_reward_zero_std``, ``completion_length``, ``num_tokens``, ``total_loss``; with
        the sampler correction also the ``sampler_*`` metrics; with distillation
        ``distill/<divergence>`` and ``distill/penalty``;
        ``off_policy_masked_fraction``, ``high_entropy_fraction`` and
        ``vespo_weight_mean`` when those are on.

    Raises:
        ValueError: ``entropy`` is ``None`` while ``entropy_coeff > 0`` or
            ``top_entropy_quantile < 1``; ``kl_estimator="exact"`` with ``ref_log_probs`` but
            no ``kl``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training import grpo_objective
        >>> from artifex.generative_models.training.rl import GRPOBatch, GRPOConfig
        >>> batch = GRPOBatch(
        ...     prompt_ids=jnp.zeros((2, 1), jnp.int32),
        ...     completion_ids=jnp.zeros((2, 2), jnp.int32),
        ...     completion_mask=jnp.array([[1, 1], [1, 0]]), rewards=jnp.array([1.0, 0.0]),
        ...     group_size=2)
        >>> log_probs = jnp.array([[-0.5, -0.5], [-1.0, -3.0]])
        >>> config = GRPOConfig(num_generations=2, scale_rewards="none")
        >>> entropy = jnp.full((2, 2), 0.5)
        >>> loss, metrics = grpo_objective(log_probs, entropy, batch, config)
        >>> round(float(loss), 4), float(metrics["reward_mean"]), float(metrics["policy_loss"])
        (-0.005, 0.5, 0.0)
    """
    mask = jnp.asarray(batch.completion_mask, jnp.float32)
    log_probs = jnp.asarray(log_probs, jnp.float32)
    agg_kwargs = dict(
        mode=config.loss_aggregation,
        max_length=config.max_completion_length,
        normalizer=normalizer,
    )
    if advantages is None:
        advantages = compute_advantages(batch, config)
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))

    pg, log_ratio, extra = _policy_term(
        log_probs, entropy, batch, config, advantages, mask, entropy_threshold
    )
    policy_loss = losses.aggregate_loss(pg, mask, **agg_kwargs)
    total = policy_loss
    if config.policy_loss_coeff != 1.0:
        total = config.policy_loss_coeff * policy_loss

    if config.beta > 0.0 and kl is None and batch.ref_log_probs is not None:
        if config.kl_estimator == "exact":
            msg = (
                "GRPOConfig.kl_estimator='exact' takes the per-token KL from the log-prob "
                "function (kl=...), not from ref_log_probs"
            )
            raise ValueError(msg)
        kl = losses.kl_divergence(
            log_probs, batch.ref_log_probs, mask, estimator=config.kl_estimator
        )
    if config.beta > 0.0 and kl is not None:
        kl_tok = jnp.where(mask > 0, jnp.asarray(kl, jnp.float32), 0.0)
        if config.kl_importance_weighted:
            kl_tok = kl_tok * jnp.exp(log_ratio)
        kl = losses.aggregate_loss(kl_tok, mask, **agg_kwargs)
        total = total + config.beta * kl
    else:
        kl = jnp.zeros((), jnp.float32)

    if entropy is None:
        if config.entropy_coeff > 0.0:
            msg = "entropy is required when GRPOConfig.entropy_coeff > 0"
            raise ValueError(msg)
        ent = jnp.zeros((), jnp.float32)
    else:
        ent = losses.aggregate_loss(entropy, mask, **agg_kwargs)
        if config.entropy_coeff > 0.0:
            total = total - config.entropy_coeff * ent
    distill = _distillation_term(distillation, mask, config, agg_kwargs)
    if distill:
        total = total + distill["distill/penalty"]

    metrics = {
        "policy_loss": policy_loss,
        "kl": kl,
        "kl_penalty": config.beta * kl,
        "approx_kl": losses.masked_mean(losses.approx_kl_old(log_ratio, mask), mask),
        "entropy": ent,
        "completion_length": jnp.mean(jnp.sum(mask, axis=-1)),
        "num_tokens": jnp.sum(mask),
        "total_loss": total,
        **extra,
        **distill,
    }
    if reward_metrics:
        metrics.update(batch_reward_metrics(batch, advantages))
    metrics = {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in metrics.items()}
    return total, metrics


def _distillation_term(
    distillation: jax.Array | None, mask: jax.Array, config: GRPOConfig, agg_kwargs: dict
) -> dict[str, jax.Array]:
    """``distill/<divergence>`` (aggregated) and ``distill/penalty`` (times the coefficient)."""
    if (distillation is None) != (config.distillation_coeff == 0.0):
        msg = (
            "grpo_objective: distillation=... (the per-token distillation loss) must be given "
            "exactly when GRPOConfig.distillation_coeff > 0, got "
            f"distillation_coeff={config.distillation_coeff} and "
            f"distillation={'None' if distillation is None else 'an array'}"
        )
        raise ValueError(msg)
    if distillation is None:
        return {}
    per_token = jnp.where(mask > 0, jnp.asarray(distillation, jnp.float32), 0.0)
    value = losses.aggregate_loss(per_token, mask, **agg_kwargs)
    return {
        f"distill/{config.distillation_divergence}": value,
        "distill/penalty": config.distillation_coeff * value,
    }


def _check_traceable_batch(batch: GRPOBatch) -> None:
    concrete = not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(batch))
    batch.validate(check_values=concrete)


def make_grpo_loss(
    model: nnx.Module,
    config: GRPOConfig,
    *,
    wrt: Any = nnx.Param,
    log_prob_fn: LogProbFn | None = None,
    teacher_model: nnx.Module | None = None,
) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """Binds ``model``'s graph and ``config`` into a pure, jit-compiled ``grpo_loss``.

    The returned ``grpo_loss(params, batch, rest_state=None) -> (loss, metrics)`` is a pure function
    of the parameter state ``params = nnx.state(model, wrt)`` and a :class:`GRPOBatch` (or the
    dict batch form), so ``jax.grad(grpo_loss, has_aux=True)(params, batch)`` works anywhere.
    Variables not selected by ``wrt`` (e.g. frozen base weights under LoRA) are read from
    ``model`` at each call, or taken from ``rest_state`` when given.

    Args:
        model: The policy (an NNX module).
        config: The GRPO options.
        wrt: Filter selecting the differentiable variables (``nnx.Param`` by default).
        log_prob_fn: ``fn(model, batch) -> (log_probs, entropy)``; defaults to
            :func:`~artifex.generative_models.training.rl.core.logprobs.default_log_prob_fn`.
        teacher_model: The distillation teacher (``distillation_coeff > 0``; its variables
            are read at each call), see
            :func:`~artifex.generative_models.training.rl.core.teacher.make_distillation_terms`.

    Returns:
        ``grpo_loss``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.training import make_grpo_loss
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))  # a 3-action policy
        >>> grpo_loss = make_grpo_loss(model, GRPOConfig(num_generations=2))
        >>> batch = {"observations": jnp.ones((4, 4)), "actions": jnp.array([0, 1, 2, 0]),
        ...          "rewards": jnp.array([1.0, 0.0, 0.0, 1.0])}
        >>> (loss, metrics), grads = jax.value_and_grad(grpo_loss, has_aux=True)(
        ...     nnx.state(model, nnx.Param), batch)
        >>> grads["kernel"].shape, bool(jnp.isfinite(loss))
        ((4, 3), True)
    """
    graphdef = nnx.graphdef(model)
    if log_prob_fn is None:
        log_prob_fn = default_log_prob_fn(
            model,
            temperature=config.temperature,
            remat=config.remat_option,
            scan_layers=config.scan_layers,
        )
    distill = make_distillation_terms(model, teacher_model, config, log_prob_fn=log_prob_fn)

    @jax.jit
    def _loss(params: nnx.State, rest: nnx.State, teacher: Any, batch: GRPOBatch):
        policy = nnx.merge(graphdef, params, rest)
        if distill is None:
            log_probs, entropy = log_prob_fn(policy, batch)
            return grpo_objective(log_probs, entropy, batch, config)
        log_probs, entropy, term = distill(policy, teacher, batch)
        return grpo_objective(log_probs, entropy, batch, config, distillation=term)

    def grpo_loss(
        params: nnx.State, batch: GRPOBatch | Mapping[str, Any], rest_state: Any = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """GRPO loss of ``params`` on ``batch``: ``(loss, metrics)`` (pure, jit-compiled)."""
        batch = as_grpo_batch(batch, config) if isinstance(batch, Mapping) else batch
        _check_traceable_batch(batch)
        if rest_state is None:  # read now: a trainer's step replaces (donates) these buffers
            rest_state = nnx.state(model, nnx.Not(wrt))
        teacher = None if distill is None or teacher_model is None else nnx.state(teacher_model)
        return _loss(params, rest_state, teacher, batch)

    return grpo_loss
