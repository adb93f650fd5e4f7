r"""The GRPO objective on flow trajectories with the closed-form per-step KL, as a function.

``GRPOTrainer`` trains flow models through
:func:`~artifex.generative_models.flow.batch.flow_log_prob_fn`; with
``GRPOConfig(kl_estimator="exact")`` its KL term is the exact KL between the policy's and the
reference's Gaussian transitions. :func:`flow_grpo_objective` is the same loss as a pure function
of ``(model, reference, batch)`` for custom training loops:

    ``loss = agg(-min(rho A, clip(rho) A)) + beta * agg(||mu_theta - mu_ref||^2 / (2 std^2))``

with the same aggregation ``agg`` over the trained steps as the surrogate.

References:
    Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via Online RL",
    arXiv:2505.05470.
"""

from __future__ import annotations

from typing import Any

import jax

from artifex.generative_models.flow.batch import flow_log_prob_fn
from artifex.generative_models.flow.sde import SDEConfig
from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.core.objective import grpo_objective

__all__ = ["flow_grpo_objective"]


def flow_grpo_objective(
    model: Any,
    reference: Any | None,
    batch: GRPOBatch,
    config: GRPOConfig,
    sde: SDEConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""GRPO loss on flow trajectories with the exact Gaussian KL as the per-step KL.

    The surrogate, advantages and aggregation are :func:`grpo_objective`'s; the KL term is
    ``beta * agg(KL_s)`` with ``KL_s`` from
    :meth:`~artifex.generative_models.flow.batch.FlowLogProbFn.log_probs_and_kl`
    (the reference's means are not differentiated), whatever ``config.kl_estimator`` says. It
    equals ``GRPOTrainer``'s loss with ``kl_estimator="exact"``.

    Args:
        model: The policy ``v_theta`` (differentiate with respect to it).
        reference: The reference model, or ``None`` (no KL term).
        batch: Trajectories from
            :func:`~artifex.generative_models.flow.batch.to_grpo_batch`.
        config: GRPO options (``beta``, clipping, aggregation, ...).
        sde: The sampler settings the trajectories were drawn with.

    Returns:
        ``(total_loss, metrics)`` as :func:`grpo_objective`, with ``kl`` the aggregated
        closed-form KL and ``kl_penalty = beta * kl``.

    Raises:
        ValueError: ``sde`` differs from the batch's sampler settings (``num_steps``,
            ``noise_level``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import FlowSampler, SDEConfig
        >>> from artifex.generative_models.flow import FlowModel, FlowModelConfig
        >>> from artifex.generative_models.training import GRPOConfig
        >>> from artifex.generative_models.flow.batch import to_grpo_batch
        >>> from artifex.generative_models.flow.objective import flow_grpo_objective
        >>> model = FlowModel(FlowModelConfig(image_shape=(4, 4), hidden_dim=16, num_blocks=1,
        ...                                   time_features=8), rngs=nnx.Rngs(0))
        >>> sde = SDEConfig(num_steps=4)
        >>> batch = to_grpo_batch(FlowSampler(sde)(model, [3], 2, jax.random.key(0)),
        ...                       jnp.array([1.0, 0.0]), group_size=2)
        >>> loss, metrics = flow_grpo_objective(model, nnx.clone(model), batch,
        ...                                     GRPOConfig(num_generations=2, beta=0.1), sde)
        >>> bool(jnp.isfinite(loss)), float(metrics["kl"])  # reference = policy: KL 0
        (True, 0.0)
    """
    fn = flow_log_prob_fn(sde)
    if reference is None or config.beta == 0.0:
        log_probs, entropy = fn(model, batch)
        return grpo_objective(log_probs, entropy, batch, config.replace(beta=0.0))
    log_probs, entropy, kl = fn.log_probs_and_kl(model, reference, batch)
    return grpo_objective(log_probs, entropy, batch, config, kl=kl)
