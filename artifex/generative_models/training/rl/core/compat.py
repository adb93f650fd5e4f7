"""The dict batch form, converted into the fields of a ``GRPOBatch``.

Besides a ``GRPOBatch``, the trainer accepts a plain dict::

    {"observations", "actions", "rewards", "log_probs", "ref_log_probs", "group_size"}

(plus an optional ``advantages``). A single-step categorical policy ``model(observations) ->
logits`` is a completion of length 1: ``prompt_ids`` holds the observations and each action is
one completion token. :func:`dict_batch_fields` does that conversion; the pytree itself is built
by :meth:`~artifex.generative_models.training.rl.core.batch.GRPOBatch.from_dict` (which calls it),
so this module knows nothing of the batch class and imports nothing from the rest of the
package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DICT_BATCH_KEYS", "dict_batch_fields"]

#: The keys of the dict batch form (``observations``, ``actions`` and ``rewards`` required).
DICT_BATCH_KEYS = frozenset(
    {
        "observations",
        "actions",
        "rewards",
        "log_probs",
        "ref_log_probs",
        "advantages",
        "group_size",
    }
)

_REQUIRED_KEYS = frozenset({"observations", "actions", "rewards"})


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def dict_batch_fields(batch: Mapping[str, Any], *, group_size: int) -> dict[str, Any]:
    """Converts the dict batch form into the keyword arguments of a ``GRPOBatch``.

    Keys: ``observations`` ``(B, ...)``, ``actions`` ``(B,)`` or ``(B, L)`` ints, ``rewards``
    ``(B,)``, optional ``log_probs`` and ``ref_log_probs`` with the shape of ``actions``,
    optional ``advantages`` ``(B,)``, and an optional ``group_size`` that overrides the given
    default. ``actions`` become ``completion_ids`` (a ``(B,)`` action is a completion of length
    1), every action counts (``completion_mask`` is all ones), ``log_probs`` become
    ``old_log_probs``. Unknown keys are an error: nothing is silently dropped.

    Args:
        batch: The dict.
        group_size: Group size used when the dict carries none (the config's
            ``num_generations``).

    Returns:
        The fields of the equivalent ``GRPOBatch`` (``prompt_ids``, ``completion_ids``,
        ``completion_mask``, ``rewards``, ``old_log_probs``, ``ref_log_probs``, ``advantages``,
        ``group_size``), not yet validated.

    Raises:
        ValueError: Unknown or missing keys, or shapes that do not fit.
        TypeError: Non-integer actions.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl.core.compat import dict_batch_fields
        >>> fields = dict_batch_fields(
        ...     {"observations": np.zeros((4, 3)), "actions": np.array([0, 1, 1, 2]),
        ...      "rewards": np.array([1.0, 0.0, 0.5, 0.5])},
        ...     group_size=2,
        ... )
        >>> fields["completion_ids"].shape, fields["group_size"]
        ((4, 1), 2)
    """
    unknown = set(batch) - DICT_BATCH_KEYS
    if unknown:
        msg = (
            f"unknown batch keys {sorted(unknown)}; the dict form takes "
            f"{sorted(DICT_BATCH_KEYS)} (nothing is silently dropped)"
        )
        raise ValueError(msg)
    missing = _REQUIRED_KEYS - set(batch)
    if missing:
        msg = f"batch is missing required keys {sorted(missing)}"
        raise ValueError(msg)
    actions = batch["actions"]
    if not jnp.issubdtype(jnp.result_type(actions), jnp.integer):
        msg = (
            "batch['actions'] must hold integer (categorical) actions, "
            f"got dtype {jnp.result_type(actions)}"
        )
        raise TypeError(msg)
    ashape = _shape(actions)
    if len(ashape) not in (1, 2):
        msg = f"batch['actions'] must have shape (B,) or (B, L), got {ashape}"
        raise ValueError(msg)

    def per_token(name: str) -> jax.Array | None:
        value = batch.get(name)
        if value is None:
            return None
        if _shape(value) != ashape:
            msg = f"batch[{name!r}] must have the shape of actions {ashape}, got {_shape(value)}"
            raise ValueError(msg)
        value = jnp.asarray(value, jnp.float32)
        return value[:, None] if len(ashape) == 1 else value

    completion = jnp.asarray(actions, jnp.int32)
    if len(ashape) == 1:
        completion = completion[:, None]
    g = batch.get("group_size", group_size)
    if isinstance(g, jax.Array | np.ndarray):
        g = int(g)
    advantages = batch.get("advantages")
    return {
        "prompt_ids": batch["observations"],
        "completion_ids": completion,
        "completion_mask": jnp.ones(completion.shape, jnp.float32),
        "rewards": jnp.asarray(batch["rewards"], jnp.float32),
        "old_log_probs": per_token("log_probs"),
        "ref_log_probs": per_token("ref_log_probs"),
        "advantages": None if advantages is None else jnp.asarray(advantages, jnp.float32),
        "group_size": g,
    }
