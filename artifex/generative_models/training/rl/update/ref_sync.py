r"""Reference-model sync (TR-DPO): the KL reference follows the policy every few updates.

With ``GRPOConfig.sync_ref_model``, after every ``ref_model_sync_steps``-th optimizer update
(the updated step count ``n`` with ``n % ref_model_sync_steps == 0``) the reference parameters
become a mix of the policy's and their own,

.. math::

    \theta_{ref} \leftarrow \alpha\, \theta + (1 - \alpha)\, \theta_{ref},

with ``alpha = ref_model_mixup_alpha`` (``alpha = 1`` copies the policy), as TRL's
``SyncRefModelCallback`` does. Every floating-point array of the reference is mixed with the
policy's array at the same path (trainable and frozen variables alike; computed in at least
float32 and stored in the reference's dtype); other arrays are kept.

:class:`~artifex.generative_models.training.rl.update.trainer.GRPOTrainer` syncs after each update
of
``train_step`` and of the training loop, and a checkpoint then holds the reference (it is no
longer the frozen start), so a resumed run continues with the same reference. A pure loop of
one's own calls :func:`sync_reference` when :func:`reference_sync_due` says so.

A LoRA policy has no separate reference (its reference is the base model with the adapters
off) and mixing a full reference with adapters is not a mix of the two policies, so sync needs
a full fine-tuned policy and a ``reference_model``, as in TRL (which refuses PEFT models).

References:
    Gorbatovski et al., 2024, "Learn Your Reference Model for Real Good Alignment" (TR-DPO),
    arXiv:2404.09656; TRL 1.16 ``sync_ref_model``, ``ref_model_mixup_alpha``,
    ``ref_model_sync_steps``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.update.state import GRPOTrainState
from artifex.generative_models.utils.validation import check_float, check_int

__all__ = [
    "check_reference_syncable",
    "check_sync_setup",
    "reference_sync_due",
    "sync_reference",
]


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _by_path(*trees: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tree in trees:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[jax.tree_util.keystr(path)] = leaf
    return out


def check_reference_syncable(reference: Any, params: Any, frozen: Any = None) -> None:
    """Raises unless every floating-point array of ``reference`` has a policy twin.

    Args:
        reference: The reference's variables (``GRPOTrainState.reference``).
        params: The policy's trainable variables.
        frozen: The policy's other variables.

    Raises:
        ValueError: A reference array has no policy array at its path, or another shape.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl.update.ref_sync import (
        ...     check_reference_syncable)
        >>> check_reference_syncable({"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
        >>> check_reference_syncable({"w": jnp.ones(2)}, {"v": jnp.zeros(2)})
        Traceback (most recent call last):
            ...
        ValueError: sync_ref_model mixes the policy into the reference path by path: ...
    """
    policy = _by_path(params, frozen)
    bad = []
    for path, leaf in _by_path(reference).items():
        if not _floating(leaf):
            continue
        twin = policy.get(path)
        if twin is None or tuple(twin.shape) != tuple(leaf.shape):
            got = "missing" if twin is None else f"shape {tuple(twin.shape)}"
            bad.append(f"{path}: reference shape {tuple(leaf.shape)}, policy {got}")
    if bad:
        msg = (
            "sync_ref_model mixes the policy into the reference path by path: the reference "
            f"must be a copy of the policy's architecture, but {len(bad)} arrays differ: "
            + "; ".join(bad[:5])
        )
        raise ValueError(msg)


@jax.jit
def _mix(reference: Any, policy: Mapping[str, Any], alpha: jax.Array) -> Any:
    def mix(path: Any, r: Any) -> Any:
        if not _floating(r):
            return r
        p = policy[jax.tree_util.keystr(path)]
        dtype = jnp.promote_types(r.dtype, jnp.float32)
        a = alpha.astype(dtype)
        return (a * p.astype(dtype) + (1 - a) * r.astype(dtype)).astype(r.dtype)

    return jax.tree_util.tree_map_with_path(mix, reference)


def sync_reference(state: GRPOTrainState, alpha: float) -> GRPOTrainState:
    r"""``state`` with its reference replaced by ``alpha * policy + (1 - alpha) * reference``.

    Pure and jit-compatible in ``state`` (``alpha`` is traced, so another value does not
    recompile). The new reference keeps the old one's dtypes and shardings.

    Args:
        state: A train state with a ``reference``.
        alpha: Mixing weight in ``[0, 1]`` (TRL's ``ref_model_mixup_alpha``).

    Returns:
        The state with the mixed reference (everything else unchanged).

    Raises:
        ValueError: The state has no reference, ``alpha`` is outside ``[0, 1]``, or the
            reference does not have the policy's arrays.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import init_train_state
        >>> from artifex.generative_models.training.rl.update.ref_sync import sync_reference
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> reference = nnx.Linear(2, 1, rngs=nnx.Rngs(1))
        >>> state = init_train_state(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
        ...                          reference_model=reference)
        >>> new = sync_reference(state, 0.25)
        >>> bool(jnp.allclose(new.reference["kernel"], 0.25 * model.kernel[...]
        ...                   + 0.75 * reference.kernel[...]))
        True

    References:
        Gorbatovski et al., 2024, "Learn Your Reference Model for Real Good Alignment",
        arXiv:2404.09656.
    """
    if not isinstance(state, GRPOTrainState):
        msg = f"sync_reference: state must be a GRPOTrainState, got {type(state).__name__}"
        raise TypeError(msg)
    if state.reference is None:
        msg = "sync_reference: the state has no reference (GRPOTrainState.reference is None)"
        raise ValueError(msg)
    if not isinstance(alpha, jax.Array):
        alpha = check_float("ref_model_mixup_alpha", alpha, minimum=0.0, maximum=1.0)
    check_reference_syncable(state.reference, state.params, state.frozen)
    mixed = _mix(state.reference, _by_path(state.params, state.frozen), jnp.asarray(alpha))
    return state.replace(reference=jax.tree.map(_placed_like, mixed, state.reference))


def _placed_like(new: Any, old: Any) -> Any:
    """``new`` on ``old``'s sharding (outside a trace), so a compiled step is reused."""
    concrete = isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer)
    if concrete and new.sharding != old.sharding:
        return jax.device_put(new, old.sharding)
    return new


def reference_sync_due(step: int | jax.Array, config: GRPOConfig) -> bool:
    """Whether the update that brought the step count to ``step`` is followed by a sync.

    Args:
        step: The optimizer's step count after the update (``GRPOTrainState.step``).
        config: The run's ``GRPOConfig`` (``sync_ref_model``, ``ref_model_sync_steps``).

    Returns:
        ``True`` when ``sync_ref_model`` is on and ``step`` is a positive multiple of
        ``ref_model_sync_steps``.

    Examples:
        >>> from artifex.generative_models.training import GRPOConfig
        >>> from artifex.generative_models.training.rl.update.ref_sync import reference_sync_due
        >>> config = GRPOConfig(beta=0.04, sync_ref_model=True, ref_model_sync_steps=2)
        >>> [reference_sync_due(n, config) for n in range(5)]
        [False, False, True, False, True]
    """
    if not config.sync_ref_model:
        return False
    n = check_int("step", int(jax.device_get(step)), minimum=0)
    return n > 0 and n % config.ref_model_sync_steps == 0


def check_sync_setup(
    config: GRPOConfig, *, lora_only: bool, reference: Any, params: Any, frozen: Any
) -> None:
    """Raises unless ``config.sync_ref_model`` has a reference it can mix the policy into.

    Args:
        config: The trainer's ``GRPOConfig`` (nothing is checked when ``sync_ref_model`` is
            off).
        lora_only: The optimizer trains only LoRA adapters.
        reference: The reference's variables (``None``: no reference model).
        params: The policy's trainable variables.
        frozen: The policy's other variables.

    Raises:
        ValueError: A LoRA policy, no reference model, or a reference of another
            architecture.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training import GRPOConfig
        >>> from artifex.generative_models.training.rl.update.ref_sync import check_sync_setup
        >>> config = GRPOConfig(beta=0.04, sync_ref_model=True)
        >>> check_sync_setup(config, lora_only=False, reference={"w": jnp.ones(2)},
        ...                  params={"w": jnp.zeros(2)}, frozen={})
        >>> check_sync_setup(config, lora_only=False, reference=None, params={}, frozen={})
        Traceback (most recent call last):
            ...
        ValueError: GRPOConfig.sync_ref_model=True needs a reference_model ...
    """
    if not config.sync_ref_model:
        return
    if lora_only:
        msg = (
            "GRPOConfig.sync_ref_model=True needs a fully fine-tuned policy: a LoRA policy's "
            "reference is its own base model with the adapters off, so there is no separate "
            "reference to mix the policy into (TRL refuses PEFT models for the same reason); "
            "train all parameters (wrt=nnx.Param) with a reference_model, or turn the sync off"
        )
        raise ValueError(msg)
    if reference is None:
        msg = (
            "GRPOConfig.sync_ref_model=True needs a reference_model to mix the policy into "
            "(e.g. GRPOTrainer(..., reference_model=nnx.clone(model)))"
        )
        raise ValueError(msg)
    check_reference_syncable(reference, params, frozen)
