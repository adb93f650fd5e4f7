"""The policy as the stages around the update see it: model, configuration, mesh, scorer."""

from __future__ import annotations

import dataclasses
from typing import Any

from artifex.generative_models.training.rl.core.configs import GRPOConfig

__all__ = ["Policy"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """The policy as the rollout stage sees it: what samples, where, and how it scores.

    A rollout reads nothing else of the trainer. ``GRPOTrainer.policy()`` builds one; a custom
    loop can build its own around any causal LM.

    Attributes:
        model: The causal LM that samples (its current weights).
        config: The run's :class:`GRPOConfig`: the group size ``num_generations``, the
            sampling ``temperature`` (the one the loss scores at), and whether the loss reads
            the sampler's log-probs (``sampler_correction``, ``off_policy_mask_threshold``).
        mesh: The training mesh (``None``: one device); batches are built on it.
        score: ``batch -> batch`` filling ``old_log_probs`` (and ``ref_log_probs`` when a
            reference exists and ``beta > 0``) with the training graph, or ``None`` when the
            rollout is never asked for old log-probs.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl import GRPOConfig, Policy
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> policy = Policy(CausalLM(cfg, rngs=nnx.Rngs(0)), GRPOConfig(num_generations=4))
        >>> policy.config.num_generations
        4
    """

    model: Any
    config: GRPOConfig
    mesh: Any = None
    score: Any = None
