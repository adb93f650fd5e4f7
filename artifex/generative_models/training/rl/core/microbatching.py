"""Microbatches of a GRPO batch: the rows split for ``lax.scan``, the metrics combined back.

:func:`split_microbatches` gives every per-row field a leading microbatch axis, and
:func:`combine_micro_metrics` turns the per-microbatch metrics of an accumulated update into the
whole batch's (each metric by its kind: a sum, a token-weighted mean, a maximum, ...), so a
split update reports what the unsplit one would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.distillation import DIVERGENCES

__all__ = ["split_microbatches"]


_SUMMED = (
    "policy_loss",
    "kl",
    "kl_penalty",
    "entropy",
    "total_loss",
    "num_tokens",
    "sampler_scored_tokens",
    "sampler_units",
    "distill/penalty",
    *(f"distill/{name}" for name in DIVERGENCES),
)
_TOKEN_WEIGHTED = (
    "approx_kl",
    "clip_fraction_low",
    "clip_fraction_high",
    "clip_fraction",
    "high_entropy_fraction",
    "vespo_weight_mean",
    "moe/routing_agreement",  # over the completion tokens the loss counts
)
# Means over other units than the completion tokens, weighted by their own counts.
_WEIGHTED_BY = {
    "sampler_kl": "sampler_scored_tokens",
    "sampler_logp_diff_mean": "sampler_scored_tokens",
    "sampler_ratio_mean": "sampler_units",
    "sampler_corrected_fraction": "sampler_units",
}
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

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import GRPOBatch, split_microbatches
        >>> batch = GRPOBatch(
        ...     prompt_ids=jnp.zeros((4, 1), jnp.int32),
        ...     completion_ids=jnp.zeros((4, 3), jnp.int32),
        ...     completion_mask=jnp.ones((4, 3)), rewards=jnp.zeros(4), group_size=2)
        >>> split_microbatches(batch, 2).completion_ids.shape
        (2, 2, 3)
    """
    b = batch.batch_size
    if num_microbatches < 1 or b % num_microbatches:
        msg = f"num_microbatches={num_microbatches} must be >= 1 and divide the {b} batch rows"
        raise ValueError(msg)
    a = num_microbatches
    # Each leaf by its own rows (a packed batch's layout has rows of its own, a multiple of A).
    return jax.tree.map(lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:]), batch)


def combine_micro_metrics(stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Metrics of the whole batch from per-microbatch metrics stacked on axis 0.

    Sums stay sums (losses, token counts), token means are weighted by each microbatch's
    tokens, the sampler's means by their own counts, maxima and minima stay maxima and minima,
    and anything else is the plain mean.
    """
    out = {}
    tokens = stacked["num_tokens"]
    for name, values in stacked.items():
        if name in _SUMMED:
            out[name] = jnp.sum(values)
        elif name in _WEIGHTED_BY and _WEIGHTED_BY[name] in stacked:
            weight = stacked[_WEIGHTED_BY[name]]
            out[name] = jnp.sum(values * weight) / jnp.maximum(jnp.sum(weight), 1.0)
        elif name in _TOKEN_WEIGHTED:
            out[name] = jnp.sum(values * tokens) / jnp.maximum(jnp.sum(tokens), 1.0)
        elif name in _MAXED:
            out[name] = jnp.max(values)
        elif name in _MINNED:
            out[name] = jnp.min(values)
        else:
            out[name] = jnp.mean(values)
    return out
