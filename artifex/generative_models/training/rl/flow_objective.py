r"""The GRPO objective on flow trajectories with the closed-form per-step KL.

``GRPOTrainer`` trains flow models unchanged through
:func:`~artifex.generative_models.inference.flow_sampling.flow_log_prob_fn`; its KL term is
then the configured sample estimator (``k3``) on the transition log-probs. Because policy and
reference transitions from the same state are Gaussians with the same variance, the per-step KL
is also available exactly, and :func:`flow_grpo_objective` uses it:

    ``loss = agg(-min(rho A, clip(rho) A)) + beta * agg(||mu_theta - mu_ref||^2 / (2 std^2))``

with the same aggregation ``agg`` over the trained steps (``completion_mask``) as the surrogate.
It is a pure function of ``(model, reference, batch)`` for custom training loops.

References:
    Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via Online RL",
    arXiv:2505.05470.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from artifex.generative_models.inference.flow_sampling import (
    SDEConfig,
    flow_kl,
    flow_log_prob_fn,
)
from artifex.generative_models.training.rl import losses
from artifex.generative_models.training.rl.batch import GRPOBatch
from artifex.generative_models.training.rl.configs import GRPOConfig
from artifex.generative_models.training.rl.objective import grpo_objective

__all__ = ["flow_grpo_objective"]


def flow_grpo_objective(
    model: Any,
    reference: Any | None,
    batch: GRPOBatch,
    config: GRPOConfig,
    sde: SDEConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""GRPO loss on flow trajectories with the exact Gaussian KL as the per-step KL.

    The surrogate, advantages and aggregation are :func:`grpo_objective`'s (run with
    ``beta = 0``); the KL term is ``beta * agg(KL_s)`` with ``KL_s`` from
    :func:`~artifex.generative_models.inference.flow_sampling.flow_kl` (the reference's
    means are not differentiated).

    Args:
        model: The policy ``v_theta`` (differentiate with respect to it).
        reference: The reference model, or ``None`` (no KL term).
        batch: Trajectories from
            :func:`~artifex.generative_models.inference.flow_sampling.to_grpo_batch`.
        config: GRPO options (``beta``, clipping, aggregation, ...).
        sde: The sampler settings the trajectories were drawn with.

    Returns:
        ``(total_loss, metrics)`` as :func:`grpo_objective`, with ``kl`` the aggregated
        closed-form KL and ``kl_penalty = beta * kl``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.inference.flow_sampling import (
        ...     FlowSampler, SDEConfig, to_grpo_batch)
        >>> from artifex.generative_models.models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.training import GRPOConfig
        >>> from artifex.generative_models.training.rl.flow_objective import flow_grpo_objective
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> sde = SDEConfig(num_steps=4)
        >>> batch = to_grpo_batch(FlowSampler(sde)(model, [3], 2, jax.random.key(0)),
        ...                       jnp.array([1.0, 0.0]), group_size=2, config=sde)
        >>> loss, metrics = flow_grpo_objective(model, nnx.clone(model), batch,
        ...                                     GRPOConfig(num_generations=2, beta=0.1), sde)
        >>> bool(jnp.isfinite(loss)), float(metrics["kl"])  # reference = policy: KL 0
        (True, 0.0)
    """
    log_probs, entropy = flow_log_prob_fn(sde)(model, batch)
    no_kl = dataclasses.replace(config, beta=0.0)
    total, metrics = grpo_objective(log_probs, entropy, batch, no_kl)
    if reference is None or config.beta == 0.0:
        return total, metrics
    kl_steps = flow_kl(model, _Frozen(reference), batch, sde)
    kl = losses.aggregate_loss(
        kl_steps,
        jnp.asarray(batch.completion_mask, jnp.float32),
        config.loss_aggregation,
        max_length=config.max_completion_length,
    )
    total = total + config.beta * kl
    stop = jax.lax.stop_gradient
    metrics = dict(
        metrics,
        kl=stop(kl),
        kl_penalty=stop(config.beta * kl),
        total_loss=stop(total),
    )
    return total, metrics


class _Frozen:
    """Calls a model with its outputs' gradients stopped (the reference is not trained)."""

    def __init__(self, model: Any):
        self.model = model

    def __call__(self, *args: Any) -> jax.Array:
        return jax.lax.stop_gradient(self.model(*args))
