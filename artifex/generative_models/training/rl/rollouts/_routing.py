"""Routing replay at rollout: whether the sampler records the routed experts, and their layout.

With ``GRPOConfig.routing_replay`` a mixture-of-experts policy's rollout records the experts
each token went through (``generate(..., record_routing=True)``) into
``GRPOBatch.routed_experts``, and the update routes the tokens to them (see
:mod:`~artifex.generative_models.training.rl.core.routing_replay`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.policy import Policy


def records_routing(policy: Policy, engine: Any = None) -> bool:
    """Whether the rollout of ``policy`` records routed experts (refusing an engine that cannot).

    Args:
        policy: The rollout's policy: ``config.routing_replay`` and a model with experts
            (``model.config.is_moe``) record.
        engine: The rollout engine, or ``None`` (the library's sampler).

    Returns:
        Whether to sample with ``record_routing=True``.

    Raises:
        ValueError: Recording asked of a rollout engine (its ``generate`` does not record).
    """
    config = getattr(policy.model, "config", None)
    if not (policy.config.routing_replay and getattr(config, "is_moe", False) is True):
        return False
    if engine is not None:
        msg = (
            "GRPOConfig.routing_replay=True replays the experts the library's sampler records; "
            f"a rollout engine ({type(engine).__name__}) does not record them: sample with the "
            "library's sampler (no engine) or set routing_replay=False"
        )
        raise ValueError(msg)
    return True


def routed_like(policy: Policy, batch: GRPOBatch) -> GRPOBatch:
    """``batch`` (a rollout's layout) with -1 ``routed_experts`` when the rollout records them.

    Args:
        policy: The rollout's policy (see :func:`records_routing`).
        batch: A batch laid out as the rollout's, without ``routed_experts``.

    Returns:
        ``batch``, with ``routed_experts`` ``(B, P + T, L, k)`` int32 of -1 when recorded.
    """
    if not records_routing(policy):
        return batch
    cfg = policy.model.config
    width = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1]
    shape = (batch.batch_size, width, cfg.num_layers, cfg.num_experts_per_tok)
    return batch.replace(routed_experts=jnp.full(shape, -1, jnp.int32))
