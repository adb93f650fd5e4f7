r"""GRPO: the loss as a pure function and the trainer that applies it.

:func:`grpo_objective` turns per-token log-probs into the loss and its metrics (a pure
function of arrays). :func:`make_grpo_loss` binds a model's graph and a config into the pure
``grpo_loss(params, batch) -> (loss, metrics)`` that ``jax.grad`` differentiates.
:class:`GRPOTrainer` runs one compiled optimizer update per ``train_step(batch)``.

Per token ``t`` of completion ``i`` (DeepSeekMath eq. 3, with the options of
:class:`~artifex.generative_models.training.rl.configs.GRPOConfig`):

.. math::

    \ell_{i,t} = -\min\big(\rho_{i,t}\hat A_{i,t},\
    \operatorname{clip}(\rho_{i,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high})\hat A_{i,t}\big)
    + \beta\,\mathrm{KL}_{i,t} - c_H H_{i,t},

aggregated over tokens and completions; ``policy_loss + kl_penalty - entropy_coeff * entropy``
equals ``total_loss`` because all three use the same aggregation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from artifex.generative_models.training.rl import advantages as adv_lib
from artifex.generative_models.training.rl import losses
from artifex.generative_models.training.rl.batch import GRPOBatch
from artifex.generative_models.training.rl.configs import GRPOConfig
from artifex.generative_models.training.rl.logprobs import LogProbFn, default_log_prob_fn
from artifex.generative_models.training.sharding import (
    PartitionRules,
    current_mesh,
    shard_batch,
    shard_model,
    shard_optimizer,
)

__all__ = [
    "GRPOTrainer",
    "NonFiniteUpdateError",
    "as_grpo_batch",
    "compute_advantages",
    "grpo_objective",
    "make_grpo_loss",
    "split_microbatches",
]

logger = logging.getLogger(__name__)


class NonFiniteUpdateError(FloatingPointError):
    """A step produced a non-finite loss, gradient or update; the update was not applied.

    Args:
        message: The error message.
        metrics: The step's metrics.

    Attributes:
        metrics: The step's metrics (as floats), to see what went wrong.
    """

    def __init__(self, message: str, metrics: dict[str, float]):
        super().__init__(message)
        self.metrics = metrics


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
def _reward_metrics(batch: GRPOBatch, advantages: jax.Array) -> dict[str, jax.Array]:
    rewards = jnp.asarray(batch.rewards, jnp.float32)
    valid = (~jnp.isnan(rewards)).astype(jnp.float32)
    mean = losses.masked_mean(rewards, valid)
    std = jnp.sqrt(losses.masked_mean((rewards - mean) ** 2, valid))
    if batch.group_ids is not None:
        stats = adv_lib.segment_stats(rewards, batch.group_ids, ddof=0)
        present = jax.ops.segment_sum(valid, batch.group_ids, num_segments=rewards.shape[0]) > 0
        zero = jax.ops.segment_max(
            ((stats.std == 0) & (valid > 0)).astype(jnp.float32),
            batch.group_ids,
            num_segments=rewards.shape[0],
        )
        frac_zero = jnp.sum(jnp.where(present, zero, 0.0)) / jnp.maximum(jnp.sum(present), 1)
    else:
        stats = adv_lib.group_stats(rewards, batch.group_size, ddof=0)
        g = batch.group_size
        group_std = stats.std[::g]
        present = stats.count[::g] > 0
        frac_zero = jnp.sum((group_std == 0) & present) / jnp.maximum(jnp.sum(present), 1)
    if advantages.ndim == 2:
        adv_mask = jnp.asarray(batch.completion_mask, jnp.float32)
    else:
        adv_mask = valid if batch.advantages is None else jnp.ones_like(valid)
    adv_mean = losses.masked_mean(advantages, adv_mask)
    adv_std = jnp.sqrt(losses.masked_mean((advantages - adv_mean) ** 2, adv_mask))
    # No valid reward at all: the statistics are undefined (NaN), not 0.
    any_valid = jnp.any(valid > 0)
    nan = jnp.asarray(jnp.nan, jnp.float32)
    return {
        "reward_mean": jnp.where(any_valid, mean, nan),
        "reward_std": jnp.where(any_valid, std, nan),
        "frac_reward_zero_std": frac_zero.astype(jnp.float32),
        "advantage_mean": adv_mean,
        "advantage_std": adv_std,
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
    zeros = jnp.zeros_like(mask)
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

    if config.policy_loss == "clip":
        pg, low, high = losses.clipped_surrogate(
            log_ratio,
            advantages,
            mask,
            epsilon_low=config.epsilon_low,
            epsilon_high=config.epsilon_high,
            dual_clip=config.dual_clip,
        )
    elif config.policy_loss == "cispo":
        pg, high = losses.cispo_surrogate(
            log_ratio, log_probs, advantages, mask, max_weight=config.cispo_max_weight
        )
        low = zeros
    elif config.policy_loss == "sapo":
        pg = losses.sapo_surrogate(
            log_ratio,
            advantages,
            mask,
            temperature_pos=config.sapo_temperature_pos,
            temperature_neg=config.sapo_temperature_neg,
        )
        low = high = zeros
    else:  # "vespo": the sampler correction enters the sequence weight, not the loss
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
        adv = jnp.broadcast_to(
            advantages if advantages.ndim == 2 else advantages[:, None], mask.shape
        )
        pg = jnp.where(mask > 0, -phi * adv * log_probs, 0.0)
        low = high = zeros
        metrics["vespo_weight_mean"] = losses.masked_mean(phi, mask)
        is_weights = None

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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""The GRPO loss and its metrics from the current policy's per-token log-probs.

    ``loss = agg(w * m * l) + beta * agg(c * KL) - entropy_coeff * agg(H)`` where ``agg`` is
    the configured aggregation (see
    :func:`~artifex.generative_models.training.rl.losses.aggregate_loss`), ``l`` the per-token
    policy term (``policy_loss``: the clipped surrogate ``-min(rho A, clip(rho) A)`` with the
    token, sequence or GSPO-token ratio ``rho``; CISPO; SAPO; VESPO), ``m`` the off-policy
    sequence mask and the high-entropy token mask (1 when disabled), ``w`` the sampler/trainer
    correction weights (1 when disabled), ``c`` the importance ratio when
    ``kl_importance_weighted`` (else 1), and ``A`` the advantages from
    :func:`compute_advantages`. This is TRL 1.16's ``_compute_loss`` term by term (its
    ``loss_type`` is ``policy_loss`` plus ``loss_aggregation`` here).

    Args:
        log_probs: ``(B, T)`` log-probs of the completion tokens under the current policy
            (differentiable).
        entropy: ``(B, T)`` entropies of the current policy, or ``None`` (counts as 0; only
            allowed with ``entropy_coeff == 0`` and ``top_entropy_quantile == 1``).
        batch: The batch (masks, rewards, old, reference and sampler log-probs).
        config: The objective's options.
        normalizer: Overrides the aggregation denominator (for microbatches of a larger
            batch, see :func:`~artifex.generative_models.training.rl.losses.loss_normalizer`).
        advantages: Overrides :func:`compute_advantages` (e.g. advantages computed on the whole
            batch when this is one of its microbatches).
        reward_metrics: Whether to add the reward and advantage statistics to the metrics.
        entropy_threshold: Overrides the entropy quantile of ``top_entropy_quantile`` (the
            whole batch's, when this is one of its microbatches).

    Returns:
        ``(total_loss, metrics)``; metrics are float32 device scalars: ``policy_loss``,
        ``kl``, ``kl_penalty`` (``beta * kl``), ``approx_kl`` (vs. the sampling policy),
        ``entropy``, ``clip_fraction_low``, ``clip_fraction_high``, ``clip_fraction``,
        ``reward_mean``, ``reward_std``, ``advantage_mean``, ``advantage_std``,
        ``frac_reward_zero_std``, ``completion_length``, ``num_tokens``, ``total_loss``; with
        the sampler correction also ``sampler_ratio_mean/min/max`` (the correction weights),
        ``sampler_logp_diff_mean/max``, ``sampler_kl`` and ``sampler_corrected_fraction``
        (truncated or masked); ``off_policy_masked_fraction``, ``high_entropy_fraction`` and
        ``vespo_weight_mean`` when those are on.

    Raises:
        ValueError: ``entropy`` is ``None`` while ``entropy_coeff > 0`` or
            ``top_entropy_quantile < 1``.
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

    if config.beta > 0.0 and batch.ref_log_probs is not None:
        kl_tok = losses.kl_divergence(
            log_probs, batch.ref_log_probs, mask, estimator=config.kl_estimator
        )
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
    }
    if reward_metrics:
        metrics.update(_reward_metrics(batch, advantages))
    metrics = {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in metrics.items()}
    return total, metrics


_SUMMED = ("policy_loss", "kl", "kl_penalty", "entropy", "total_loss", "num_tokens")
_TOKEN_WEIGHTED = (
    "approx_kl",
    "clip_fraction_low",
    "clip_fraction_high",
    "clip_fraction",
    "high_entropy_fraction",
    "vespo_weight_mean",
    "sampler_kl",
    "sampler_logp_diff_mean",
)
_MAXED = ("sampler_ratio_max", "sampler_logp_diff_max")
_MINNED = ("sampler_ratio_min",)


def split_microbatches(batch: GRPOBatch, num_microbatches: int) -> GRPOBatch:
    """Reshapes every per-row field ``(B, ...)`` to ``(A, B / A, ...)`` for ``lax.scan``.

    Args:
        batch: The batch.
        num_microbatches: ``A``; must divide ``B``.

    Returns:
        The same pytree with a leading microbatch axis.

    Raises:
        ValueError: If ``A`` does not divide the number of rows.
    """
    b = batch.batch_size
    if num_microbatches < 1 or b % num_microbatches:
        msg = f"num_microbatches={num_microbatches} must be >= 1 and divide the {b} batch rows"
        raise ValueError(msg)
    a = num_microbatches
    return jax.tree.map(lambda x: x.reshape(a, b // a, *x.shape[1:]), batch)


def _combine_micro_metrics(
    stacked: dict[str, jax.Array], config: GRPOConfig | None = None
) -> dict[str, jax.Array]:
    """Metrics of the whole batch from per-microbatch metrics stacked on axis 0."""
    out = {}
    tokens = stacked["num_tokens"]
    token_weighted = _TOKEN_WEIGHTED
    if config is not None and config.sampler_correction_level == "token":
        token_weighted = (*token_weighted, "sampler_ratio_mean", "sampler_corrected_fraction")
    for name, values in stacked.items():
        if name in _SUMMED:
            out[name] = jnp.sum(values)
        elif name in token_weighted:
            out[name] = jnp.sum(values * tokens) / jnp.maximum(jnp.sum(tokens), 1.0)
        elif name in _MAXED:
            out[name] = jnp.max(values)
        elif name in _MINNED:
            out[name] = jnp.min(values)
        else:
            out[name] = jnp.mean(values)
    return out


def _check_traceable_batch(batch: GRPOBatch) -> None:
    concrete = not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(batch))
    batch.validate(check_values=concrete)


def make_grpo_loss(
    model: nnx.Module,
    config: GRPOConfig,
    *,
    wrt: Any = nnx.Param,
    log_prob_fn: LogProbFn | None = None,
) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """Binds ``model``'s graph and ``config`` into a pure, jit-compiled ``grpo_loss``.

    The returned ``grpo_loss(params, batch, rest=None) -> (loss, metrics)`` is a pure function
    of the parameter state ``params = nnx.state(model, wrt)`` and a :class:`GRPOBatch` (or the
    dict batch form), so ``jax.grad(grpo_loss, has_aux=True)(params, batch)`` works anywhere.
    Variables not selected by ``wrt`` (e.g. frozen base weights under LoRA) are read from
    ``model`` at each call, or taken from ``rest_state`` when given.

    Args:
        model: The policy (an NNX module).
        config: The GRPO options.
        wrt: Filter selecting the differentiable variables (``nnx.Param`` by default).
        log_prob_fn: ``fn(model, batch) -> (log_probs, entropy)``; defaults to
            :func:`~artifex.generative_models.training.rl.logprobs.default_log_prob_fn`.

    Returns:
        ``grpo_loss``.
    """
    graphdef = nnx.graphdef(model)
    if log_prob_fn is None:
        log_prob_fn = default_log_prob_fn(model, temperature=config.temperature)

    @jax.jit
    def _loss(params: nnx.State, rest: nnx.State, batch: GRPOBatch):
        policy = nnx.merge(graphdef, params, rest)
        log_probs, entropy = log_prob_fn(policy, batch)
        return grpo_objective(log_probs, entropy, batch, config)

    def grpo_loss(
        params: nnx.State, batch: GRPOBatch | Mapping[str, Any], rest_state: Any = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """GRPO loss of ``params`` on ``batch``: ``(loss, metrics)`` (pure, jit-compiled)."""
        batch = as_grpo_batch(batch, config) if isinstance(batch, Mapping) else batch
        _check_traceable_batch(batch)
        if rest_state is None:  # read now: a trainer's step replaces (donates) these buffers
            rest_state = nnx.state(model, nnx.Not(wrt))
        return _loss(params, rest_state, batch)

    return grpo_loss


# ---------------------------------------------------------------------------------- trainer
def _has_reward_signal(batch: GRPOBatch) -> jax.Array:
    """Whether the batch carries any reward signal (a bool scalar, traceable)."""
    signal = jnp.any(~jnp.isnan(jnp.asarray(batch.rewards, jnp.float32)))
    if batch.step_rewards is not None:
        signal |= jnp.any(~jnp.isnan(jnp.asarray(batch.step_rewards, jnp.float32)))
    if batch.advantages is not None:  # given advantages are a signal unless all zero
        signal |= jnp.any(jnp.asarray(batch.advantages, jnp.float32) != 0)
    return signal


def _vocab_size(model: Any) -> int | None:
    """The vocabulary size of a causal LM (``None`` when the model is not one)."""
    if not (hasattr(model, "hidden_states") and hasattr(model, "output_embedding")):
        return None
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    try:
        return int(jnp.shape(model.output_embedding())[-1])
    except Exception:  # an unusual model: skip the check rather than fail
        return None


def _check_token_range(batch: GRPOBatch, vocab_size: int | None) -> None:
    """Token ids outside ``[0, vocab_size)`` would be clamped silently by the gathers."""
    if vocab_size is None:
        return
    for name in ("prompt_ids", "completion_ids"):
        value = getattr(batch, name)
        if not jnp.issubdtype(jnp.result_type(value), jnp.integer):
            continue
        mask = batch.completion_mask if name == "completion_ids" else batch.prompt_mask
        if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in (value, mask)):
            continue  # multi-host shards: each process checks what it feeds (the sampler)
        host = np.asarray(value)
        if mask is not None and np.shape(mask) == host.shape:  # padding may hold anything
            host = np.where(np.asarray(mask) > 0, host, 0)
        if host.size and (host.min() < 0 or host.max() >= vocab_size):
            bad = np.argwhere((host < 0) | (host >= vocab_size))[0]
            msg = (
                f"GRPOBatch.{name} must hold token ids in [0, {vocab_size}) (the model's "
                f"vocabulary), got {int(host[tuple(bad)])} at row {int(bad[0])}: check that "
                "the tokenizer matches the model"
            )
            raise ValueError(msg)


def _all_finite(state: Any) -> jax.Array:
    """Whether every inexact leaf of ``state`` is finite (one fused reduction, a bool scalar)."""
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(state)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not checks:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(checks))


def _is_lora_only(model: nnx.Module, wrt: Any) -> bool:
    """Whether ``wrt`` selects exactly the model's (non-empty set of) LoRA parameters."""
    selected = jax.tree.leaves(nnx.state(model, wrt), is_leaf=lambda x: isinstance(x, nnx.Variable))
    lora = jax.tree.leaves(
        nnx.state(model, nnx.LoRAParam), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return (
        bool(lora)
        and len(selected) == len(lora)
        and all(isinstance(v, nnx.LoRAParam) for v in selected)
    )


def _unshare_buffers(reference: nnx.Module, model: nnx.Module) -> None:
    """Gives ``reference`` its own copy of any array it shares with ``model``.

    ``nnx.clone`` shares arrays; the trainer donates the model's buffers to the compiled step,
    which would delete a reference that still points at them.
    """
    model_ids = {id(x) for x in jax.tree.leaves(nnx.state(model))}
    state = nnx.state(reference)
    if any(id(x) in model_ids for x in jax.tree.leaves(state)):
        nnx.update(
            reference,
            jax.tree.map(lambda x: jnp.array(x, copy=True) if id(x) in model_ids else x, state),
        )


class GRPOTrainer:
    """Applies GRPO updates to an NNX policy through an ``nnx.Optimizer``.

    ``train_step(batch)`` validates the batch on the host, then runs one compiled step:
    per-token log-probs -> advantages -> clipped surrogate + KL + entropy -> gradient ->
    global-norm clipping -> ``optimizer.update``. The step compiles once per batch shape. If
    the loss or gradient is not finite the update is not applied (model and optimizer keep
    their state) and :class:`NonFiniteUpdateError` is raised carrying the metrics.

    Reference policy for the KL term (``beta > 0``), in order: the batch's ``ref_log_probs``;
    ``reference_model`` (run inside the same compiled step); for a LoRA policy trained with
    ``wrt=nnx.LoRAParam``, the same model with its adapters zeroed (the base weights exist
    once). Without any of these the KL term is 0 and a warning says so (the artifex GRPO
    documentation describes the KL penalty as enabled by providing ``ref_log_probs``).

    The step donates the model's and optimizer's buffers (so parameters and optimizer state
    exist once in memory): arrays taken out of the model before a step are invalid after it;
    copy them (``jnp.copy``) to keep them. A ``reference_model`` sharing arrays with the policy
    (``nnx.clone``) gets its own copies when the trainer is built.

    Example::

        optimizer = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
        trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=4))
        metrics = trainer.train_step(batch)   # dict[str, float]

    Args:
        model: The policy: a causal LM (``hidden_states``/``output_embedding``) or any module
            ``model(observations) -> logits``.
        optimizer: ``nnx.Optimizer(model, tx, wrt=...)`` built on ``model``.
        config: GRPO options; defaults to ``GRPOConfig()``.
        reference_model: Optional frozen reference policy (same kind of model).
        log_prob_fn: Optional ``fn(model, batch) -> (log_probs, entropy)`` for custom models.
        mesh: Optional ``jax.sharding.Mesh`` (default: the mesh set with ``jax.set_mesh``, if
            any). The model, reference and optimizer state are placed on it when the trainer is
            built (:func:`~artifex.generative_models.training.sharding.shard_model`,
            :func:`~artifex.generative_models.training.sharding.shard_optimizer`), each batch
            is split over its data axes, and the same compiled step runs with its outputs kept
            in the inputs' layout (so donation reuses the buffers).
        partition_rules: :class:`~artifex.generative_models.training.sharding.PartitionRules`
            (or ``(regex, PartitionSpec)`` pairs) for ``mesh``; default ``PartitionRules()``.
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        config: GRPOConfig | None = None,
        reference_model: nnx.Module | None = None,
        *,
        log_prob_fn: LogProbFn | None = None,
        mesh: Mesh | None = None,
        partition_rules: PartitionRules | Sequence[tuple[str, Any]] | None = None,
    ):
        config = GRPOConfig() if config is None else config
        if not isinstance(model, nnx.Module):
            msg = f"model must be an nnx.Module, got {type(model).__name__}"
            raise TypeError(msg)
        if not isinstance(optimizer, nnx.Optimizer):
            msg = f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}"
            raise TypeError(msg)
        if not isinstance(config, GRPOConfig):
            msg = f"config must be a GRPOConfig, got {type(config).__name__}"
            raise TypeError(msg)
        if reference_model is not None and not isinstance(reference_model, nnx.Module):
            msg = f"reference_model must be an nnx.Module, got {type(reference_model).__name__}"
            raise TypeError(msg)
        if reference_model is model:
            msg = (
                "reference_model must be a frozen copy of the policy (e.g. nnx.clone(model)), "
                "not the policy itself"
            )
            raise ValueError(msg)
        mesh = current_mesh() if mesh is None else mesh
        if mesh is not None and not isinstance(mesh, Mesh):
            msg = f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}"
            raise TypeError(msg)
        if partition_rules is not None and mesh is None:
            msg = "partition_rules were given without a mesh; pass mesh= as well"
            raise TypeError(msg)
        if reference_model is not None:
            # Before placement: device_put onto a mesh may reuse a source buffer, so two models
            # sharing arrays (nnx.clone) would end up sharing device buffers the step donates.
            _unshare_buffers(reference_model, model)
        if mesh is not None:
            shard_model(model, mesh, partition_rules)
            shard_optimizer(optimizer, model, mesh, partition_rules)
            if reference_model is not None:
                shard_model(reference_model, mesh, partition_rules)
        self.mesh = mesh
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.reference_model = reference_model
        self.wrt = optimizer.wrt
        self.log_prob_fn = (
            default_log_prob_fn(model, temperature=config.temperature)
            if log_prob_fn is None
            else log_prob_fn
        )
        self._lora_reference = reference_model is None and _is_lora_only(model, self.wrt)
        self._warned_no_reference = False
        self._num_traces = 0
        self._graphdef = nnx.graphdef(model)
        self._opt_graphdef = nnx.graphdef(optimizer)
        self._ref_graphdef = None if reference_model is None else nnx.graphdef(reference_model)
        shardings = {}
        if mesh is not None:
            # New model/optimizer states keep their inputs' layout: the donated buffers are reused.
            model_layout, opt_layout = (
                jax.tree.map(lambda x: x.sharding, nnx.state(obj)) for obj in (model, optimizer)
            )
            replicated = NamedSharding(mesh, PartitionSpec())
            shardings["out_shardings"] = (model_layout, opt_layout, replicated, replicated)
        self._step_fn = jax.jit(self._step, donate_argnums=(0, 1), static_argnums=(4,), **shardings)
        self._log_probs_fn = jax.jit(self._log_probs)
        self.grpo_loss = make_grpo_loss(model, config, wrt=self.wrt, log_prob_fn=self.log_prob_fn)

    # ----------------------------------------------------------------- public helpers
    @property
    def params(self) -> nnx.State:
        """The trainable state ``nnx.state(model, wrt)`` (what ``grpo_loss`` takes)."""
        return nnx.state(self.model, self.wrt)

    @property
    def num_compilations(self) -> int:
        """How many times the step has been traced (one per distinct batch shape)."""
        return self._num_traces

    @property
    def has_reference(self) -> bool:
        """Whether the step can compute reference log-probs itself."""
        return self.reference_model is not None or self._lora_reference

    # ----------------------------------------------------------------- compiled step
    def _reference(
        self,
        split: tuple[nnx.GraphDef, nnx.State, nnx.State],
        ref_state: nnx.State | None,
    ) -> Any:
        """The reference policy as a module (inside a trace)."""
        if ref_state is not None:
            return nnx.merge(self._ref_graphdef, ref_state)
        # LoRA: the same graph with the adapters zeroed is exactly the base model.
        graphdef, trainable, frozen = split
        return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, trainable), frozen)

    def _needs_reference(self, batch: GRPOBatch, ref_state: nnx.State | None) -> bool:
        return (
            self.config.beta > 0.0
            and batch.ref_log_probs is None
            and (ref_state is not None or self._lora_reference)
        )

    def _step(
        self,
        model_state: nnx.State,
        opt_state: nnx.State,
        ref_state: nnx.State | None,
        batch: GRPOBatch,
        num_microbatches: int,
    ) -> tuple[nnx.State, nnx.State, dict[str, jax.Array], jax.Array]:
        self._num_traces += 1
        config = self.config
        # Leaves captured before merging: merge shares Variables with the state, and the update
        # below mutates them in place.
        old_model_leaves = jax.tree.leaves(model_state)
        old_opt_leaves = jax.tree.leaves(opt_state)
        model = nnx.merge(self._graphdef, model_state)
        optimizer = nnx.merge(self._opt_graphdef, opt_state)
        graphdef, trainable, frozen = nnx.split(model, self.wrt, ...)
        needs_ref = self._needs_reference(batch, ref_state)

        # Advantages and the loss normalizer come from the whole batch, so splitting it into
        # microbatches changes nothing but peak memory.
        advantages = jax.lax.stop_gradient(compute_advantages(batch, config))
        normalizer = losses.loss_normalizer(
            batch.completion_mask, config.loss_aggregation, max_length=config.max_completion_length
        )

        # Likewise the entropy quantile of top_entropy_quantile: over the whole batch, from a
        # gradient-free forward of each microbatch (one microbatch computes it in the loss).
        entropy_threshold = None
        if config.top_entropy_quantile < 1.0 and num_microbatches > 1:

            def micro_entropy(mb: GRPOBatch) -> jax.Array:
                _, ent = self.log_prob_fn(nnx.merge(graphdef, trainable, frozen), mb)
                return jax.lax.stop_gradient(ent)

            mbs = split_microbatches(batch, num_microbatches)
            if (batch.batch_size // num_microbatches) % batch.group_size:
                mbs = mbs.replace(shared_prompts=False)  # slices cut through groups
            ents = jax.lax.map(micro_entropy, mbs)
            entropy_threshold = losses.entropy_quantile_threshold(
                ents.reshape(batch.completion_mask.shape),
                batch.completion_mask,
                1.0 - config.top_entropy_quantile,
            )

        def loss_fn(
            params: nnx.State, mb: GRPOBatch, adv: jax.Array
        ) -> tuple[jax.Array, dict[str, jax.Array]]:
            if needs_ref:
                ref = self._reference((graphdef, params, frozen), ref_state)
                ref_lp, _ = self.log_prob_fn(ref, mb)
                mb = mb.replace(ref_log_probs=jax.lax.stop_gradient(ref_lp))
            policy = nnx.merge(graphdef, params, frozen)
            log_probs, entropy = self.log_prob_fn(policy, mb)
            return grpo_objective(
                log_probs,
                entropy,
                mb,
                config,
                normalizer=normalizer,
                advantages=adv,
                reward_metrics=False,
                entropy_threshold=entropy_threshold,
            )

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if num_microbatches == 1:
            (loss, metrics), grads = grad_fn(trainable, batch, advantages)
        else:
            micro = split_microbatches(batch, num_microbatches)
            if (batch.batch_size // num_microbatches) % batch.group_size:
                micro = micro.replace(shared_prompts=False)  # slices cut through groups
            micro_adv = advantages.reshape(num_microbatches, -1, *advantages.shape[1:])

            def accumulate(acc: nnx.State, xs: tuple[GRPOBatch, jax.Array]):
                (loss_i, metrics_i), grads_i = grad_fn(trainable, *xs)
                return jax.tree.map(jnp.add, acc, grads_i), (loss_i, metrics_i)

            zeros = jax.tree.map(jnp.zeros_like, trainable)
            grads, (micro_loss, micro_metrics) = jax.lax.scan(accumulate, zeros, (micro, micro_adv))
            loss = jnp.sum(micro_loss)
            metrics = _combine_micro_metrics(micro_metrics, config)
        metrics.update(_reward_metrics(batch, advantages))

        grad_norm = optax.tree.norm(grads)
        if config.max_grad_norm is not None:
            scale = jnp.minimum(1.0, config.max_grad_norm / jnp.maximum(grad_norm, 1e-12))
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        optimizer.update(model, grads)
        loss_ok = jnp.isfinite(loss)
        grad_ok = jnp.isfinite(grad_norm)
        # The update itself can overflow (a huge learning rate, a schedule that overflows): the
        # new parameters and optimizer state must be finite too (one fused all-finite reduction).
        params_ok = _all_finite(nnx.state(model, self.wrt))
        opt_ok = _all_finite(nnx.state(optimizer))
        ok = loss_ok & grad_ok & params_ok & opt_ok
        # A batch without any reward signal (all rewards NaN) moves nothing: its only gradients
        # would be the KL and entropy terms (and Adam's momentum, weight decay) acting blindly.
        signal = _has_reward_signal(batch)
        apply = ok & signal

        def keep(new_state: nnx.State, old_leaves: list[jax.Array]) -> nnx.State:
            leaves, treedef = jax.tree.flatten(new_state)
            kept = [jnp.where(apply, n, o) for n, o in zip(leaves, old_leaves, strict=True)]
            return jax.tree.unflatten(treedef, kept)

        new_model_state = keep(nnx.state(model), old_model_leaves)
        new_opt_state = keep(nnx.state(optimizer), old_opt_leaves)
        metrics = dict(metrics, grad_norm=grad_norm.astype(jnp.float32))
        metrics["finite_params"] = params_ok.astype(jnp.float32)
        metrics["finite_optimizer_state"] = opt_ok.astype(jnp.float32)
        metrics["reward_signal"] = jnp.asarray(signal, jnp.float32)
        return new_model_state, new_opt_state, metrics, ok

    def _log_probs(
        self, model_state: nnx.State, ref_state: nnx.State | None, batch: GRPOBatch
    ) -> tuple[jax.Array, jax.Array | None]:
        model = nnx.merge(self._graphdef, model_state)
        log_probs, _ = self.log_prob_fn(model, batch)
        ref_log_probs = None
        if self._needs_reference(batch, ref_state):
            ref = self._reference(nnx.split(model, self.wrt, ...), ref_state)
            ref_log_probs, _ = self.log_prob_fn(ref, batch)
        return log_probs, ref_log_probs

    # ----------------------------------------------------------------- the step
    def prepare_batch(self, batch: GRPOBatch | Mapping[str, Any]) -> GRPOBatch:
        """Converts and validates a batch on the host (what ``train_step`` does first).

        Args:
            batch: A :class:`GRPOBatch` or the dict batch form.

        Returns:
            The validated ``GRPOBatch`` of JAX arrays (with a mesh: rows split over its data
            axes by :func:`~artifex.generative_models.training.sharding.shard_batch`).

        Raises:
            ValueError: The batch breaks its contract (see :meth:`GRPOBatch.validate`), its
                group size is < 2 without precomputed advantages, or (with a mesh) its rows
                cannot be split evenly over the data shards.
            TypeError: Wrong batch type or dtypes.
        """
        batch = as_grpo_batch(batch, self.config).validate()
        _check_token_range(batch, _vocab_size(self.model))
        if not batch.shared_prompts and batch.prompts_shared_within_groups():
            batch = batch.replace(shared_prompts=True)  # encode each prompt once per group
        if batch.group_size < 2 and batch.advantages is None and batch.group_ids is None:
            msg = f"batch group_size must be >= 2 to compare completions, got {batch.group_size}"
            raise ValueError(msg)
        if self.mesh is not None:
            batch = shard_batch(batch, self.mesh)
        return batch

    def compute_log_probs(self, batch: GRPOBatch | Mapping[str, Any]) -> GRPOBatch:
        """Fills ``old_log_probs`` (current policy) and ``ref_log_probs`` (reference) of a batch.

        Used before ``mu > 1`` optimization iterations on one generation batch: the old
        log-probs are those of the policy that sampled the batch, scored by the training graph,
        and the reference log-probs are computed once instead of at every iteration. Fields the
        batch already has are kept; the reference is only scored when ``beta > 0`` and the
        trainer has one.

        Args:
            batch: The batch.

        Returns:
            The batch with the log-prob fields set (no gradient, one compiled forward pass).
        """
        batch = self.prepare_batch(batch)
        ref_state = None if self.reference_model is None else nnx.state(self.reference_model)
        log_probs, ref_log_probs = self._log_probs_fn(nnx.state(self.model), ref_state, batch)
        if batch.old_log_probs is None:
            batch = batch.replace(old_log_probs=log_probs)
        if batch.ref_log_probs is None and ref_log_probs is not None:
            batch = batch.replace(ref_log_probs=ref_log_probs)
        return batch

    def train_step(
        self, batch: GRPOBatch | Mapping[str, Any], *, num_microbatches: int = 1
    ) -> dict[str, float]:
        """One GRPO update on ``batch``.

        Args:
            batch: A :class:`GRPOBatch` (flat prompt-major rows) or the dict batch form
                (``observations``, ``actions``, ``rewards``, optional ``log_probs``,
                ``ref_log_probs``, ``group_size``).
            num_microbatches: Accumulate gradients over this many equal row slices of the batch
                inside the compiled step (a ``lax.scan``): the update is the full-batch update
                (advantages and loss normalization use the whole batch) with less peak memory.

        Returns:
            Metrics as Python floats: those of :func:`grpo_objective` plus ``grad_norm``
            (before clipping).

        Raises:
            ValueError: Invalid batch or ``num_microbatches`` (raised before anything is traced).
            TypeError: Wrong batch type or dtypes.
            NonFiniteUpdateError: Non-finite loss, gradient, updated parameters or updated
                optimizer state; nothing was updated.
        """
        batch = self.prepare_batch(batch)
        if (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or num_microbatches < 1
            or batch.batch_size % num_microbatches
        ):
            msg = (
                f"num_microbatches must be an int >= 1 dividing the {batch.batch_size} batch "
                f"rows, got {num_microbatches!r}"
            )
            raise ValueError(msg)
        if (
            self.config.beta > 0.0
            and batch.ref_log_probs is None
            and not self.has_reference
            and not self._warned_no_reference
        ):
            logger.warning(
                "GRPOConfig.beta=%s but the batch has no ref_log_probs and the trainer has no "
                "reference_model: the KL penalty is 0 for such batches.",
                self.config.beta,
            )
            self._warned_no_reference = True
        ref_state = None if self.reference_model is None else nnx.state(self.reference_model)
        model_state = nnx.state(self.model)
        opt_state = nnx.state(self.optimizer)
        new_model_state, new_opt_state, metrics, ok = self._step_fn(
            model_state, opt_state, ref_state, batch, num_microbatches
        )
        nnx.update(self.model, new_model_state)
        nnx.update(self.optimizer, new_opt_state)
        host = {k: float(v) for k, v in jax.device_get(metrics).items()}
        finite_params = host.pop("finite_params") > 0
        finite_opt = host.pop("finite_optimizer_state") > 0
        if host.pop("reward_signal") == 0 and bool(ok):
            logger.warning(
                "every reward of this batch is NaN (no reward signal): the reward metrics are "
                "NaN and the update was skipped (parameters unchanged); check the reward "
                "functions"
            )
        if not bool(ok):
            bad = [
                f"{name}={host[name]}"
                for name in ("total_loss", "grad_norm")
                if not math.isfinite(host[name])
            ]
            if not finite_params:
                bad.append("updated parameters")
            if not finite_opt:
                bad.append("updated optimizer state")
            step = int(jax.device_get(self.optimizer.step[...]))
            msg = (
                f"non-finite {', '.join(bad) or 'values'} at optimizer step {step}; the update "
                "was not applied (parameters and optimizer state are unchanged): lower the "
                "learning rate, clip gradients (GRPOConfig.max_grad_norm) or check the batch"
            )
            raise NonFiniteUpdateError(msg, host)
        return host

    # ----------------------------------------------------------------- the whole loop
    def train(
        self,
        dataset: Any,
        *,
        tokenizer: Any,
        rewards: Any,
        num_steps: int | None = None,
        config: Any = None,
        rollout_config: Any = None,
        eval_dataset: Any = None,
        eval_reward: Any = None,
        **loop_options: Any,
    ) -> Any:
        """Runs the full GRPO loop on ``dataset``: rollouts, updates, logging, checkpoints.

        A shortcut for :func:`artifex.generative_models.training.rl.loop.train`.

        Args:
            dataset: Rows (mappings) with a prompt column and the columns the rewards read.
            tokenizer: The policy's tokenizer.
            rewards: A ``RewardCombiner``, a reward function or a list of them.
            num_steps: Generation batches to train on (shortcut for ``TrainConfig.num_steps``).
            config: A ``TrainConfig``; ``num_steps`` and ``loop_options`` override its fields.
            rollout_config: A ``RolloutConfig`` (generation settings).
            eval_dataset: Held-out rows for pass@1.
            eval_reward: Scores evaluation completions (default: the first reward function).
            **loop_options: Other ``TrainConfig`` fields (``prompts_per_step=16``, ...).

        Returns:
            The loop's ``TrainResult``.
        """
        from artifex.generative_models.training.rl.loop import TrainConfig
        from artifex.generative_models.training.rl.loop import train as run_loop

        if num_steps is not None:
            loop_options["num_steps"] = num_steps
        config = (
            TrainConfig(**loop_options)
            if config is None
            else dataclasses.replace(config, **loop_options)
        )
        return run_loop(
            self,
            tokenizer,
            dataset,
            rewards,
            config,
            rollout_config,
            eval_dataset=eval_dataset,
            eval_reward=eval_reward,
        )
