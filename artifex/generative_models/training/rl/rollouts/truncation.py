r"""Masking truncated completions: a completion cut at the length limit adds no loss.

A completion that reaches ``max_new_tokens`` without an end-of-sequence token was cut, and its
reward judges an unfinished answer. DAPO's *overlong filtering* leaves such samples out of the
loss; TRL calls it ``mask_truncated_completions``. With ``GRPOConfig.mask_truncated_completions``
the rollout zeroes the completion mask of every truncated row,

.. math::

    m_{i,t} \leftarrow m_{i,t}\,(1 - \mathrm{trunc}_i),

as TRL 1.16 does, so the row contributes no policy, KL or entropy term and no token to the
``"token_mean"`` denominator; ``"sequence_mean"``, ``"constant_length"`` and
``"sequence_sum"`` still divide by all ``B`` rows. Its reward still enters its group's
statistics (the advantages of the other rows do not change).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.rl.core.batch import GRPOBatch

__all__ = ["mask_truncated_completions"]


def mask_truncated_completions(batch: GRPOBatch, truncated: Any) -> GRPOBatch:
    """Zeroes the completion mask of the truncated rows of ``batch``.

    Args:
        batch: A :class:`~artifex.generative_models.training.rl.core.batch.GRPOBatch`.
        truncated: ``(B,)`` bools, True for a row that reached the length limit without an
            end-of-sequence token (``Rollout.truncated``, the sampler's ``truncated``).

    Returns:
        The batch with ``completion_mask`` 0 on every truncated row (its dtype kept).

    Raises:
        ValueError: ``truncated`` does not have shape ``(B,)``.
        TypeError: ``batch`` is not a ``GRPOBatch`` or ``truncated`` is not boolean.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import GRPOBatch
        >>> from artifex.generative_models.training.rl.rollouts.truncation import (
        ...     mask_truncated_completions)
        >>> batch = GRPOBatch(prompt_ids=jnp.ones((2, 1), jnp.int32),
        ...                   completion_ids=jnp.ones((2, 3), jnp.int32),
        ...                   completion_mask=jnp.array([[1, 1, 1], [1, 1, 0]]),
        ...                   rewards=jnp.array([1.0, 0.0]), group_size=2)
        >>> mask_truncated_completions(batch, jnp.array([True, False])).completion_mask.tolist()
        [[0, 0, 0], [1, 1, 0]]

    References:
        Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
        arXiv:2503.14476, sec. 3.4 (overlong filtering); TRL 1.16
        ``GRPOConfig.mask_truncated_completions``.
    """
    if not isinstance(batch, GRPOBatch):
        msg = f"mask_truncated_completions: batch must be a GRPOBatch, got {type(batch).__name__}"
        raise TypeError(msg)
    rows = int(np.shape(batch.completion_mask)[0])
    if tuple(np.shape(truncated)) != (rows,):
        msg = (
            f"mask_truncated_completions: truncated must have shape ({rows},) (one flag per "
            f"batch row), got {tuple(np.shape(truncated))}"
        )
        raise ValueError(msg)
    if not isinstance(truncated, jax.Array):
        truncated = np.asarray(truncated)
    dtype = truncated.dtype
    if dtype != jnp.bool_:
        msg = f"mask_truncated_completions: truncated must be booleans, got dtype {dtype}"
        raise TypeError(msg)
    return batch.replace(completion_mask=_masked(batch.completion_mask, truncated))


@jax.jit
def _masked(mask: jax.Array, truncated: jax.Array) -> jax.Array:
    keep = jnp.logical_not(truncated)[:, None]
    return jnp.where(keep, mask, jnp.zeros_like(mask))
