"""The train state: :class:`GRPOTrainState`, built from an NNX model and written back into it.

:class:`GRPOTrainState` is a pytree of arrays: the policy's trainable parameters, its other
(frozen) variables, the optax optimizer state, the step count, the run's PRNG key and, beside
them, the frozen reference policy and distillation teacher. :func:`init_train_state` builds it
from a model and its ``nnx.Optimizer``; :func:`write_train_state` puts a state back into them.
The pure update that reads and writes it is
:func:`~artifex.generative_models.training.rl.update.state.make_grpo_train_step`.

Moved out of :mod:`~artifex.generative_models.training.rl.update.state` unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

__all__ = [
    "GRPOTrainState",
    "init_train_state",
    "write_train_state",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GRPOTrainState:
    """Everything one GRPO update reads and writes, as a pytree of arrays.

    Build it from an NNX model and optimizer with :func:`init_train_state`; write it back with
    :func:`write_train_state`. Every field is a pytree of ``jax.Array`` (``nnx.State`` of plain
    arrays for the model parts), so the state can be donated to XLA (its buffers reused for the
    outputs), sharded, scanned over or saved with Orbax as it is.

    Attributes:
        params: The trainable variables, ``nnx.state(model, wrt)`` as plain arrays.
        frozen: The policy's other variables (LoRA base weights, buffers), passed through.
        opt_state: The optax state of the optimizer's gradient transformation.
        step: The number of updates applied (the optimizer's step counter, a scalar).
        rng: The run's PRNG key. The update is deterministic and passes it through; loops
            draw their sampling keys from it (``jax.random.fold_in(state.rng, step)``).
        reference: The frozen reference policy's variables (``None``: no reference model).
        teacher: The frozen distillation teacher's variables (``None``: no teacher model).

    Examples:
        >>> import jax, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import init_train_state
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        >>> state = init_train_state(model, optimizer, rng=jax.random.key(0))
        >>> int(state.step), sorted(state.params)
        (0, ['bias', 'kernel'])
    """

    params: Any
    frozen: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    reference: Any = None
    teacher: Any = None

    def replace(self, **changes: Any) -> GRPOTrainState:
        """A copy with ``changes`` applied (``dataclasses.replace``).

        Args:
            **changes: New field values.

        Returns:
            The new state.
        """
        return dataclasses.replace(self, **changes)


def init_train_state(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    *,
    reference_model: nnx.Module | None = None,
    rng: jax.Array | None = None,
    teacher_model: nnx.Module | None = None,
) -> GRPOTrainState:
    """The :class:`GRPOTrainState` of an NNX policy, its optimizer and reference.

    The arrays are the model's and optimizer's own (not copies): a step that donates the
    state's buffers to XLA (reuses them for its outputs) invalidates them, and
    :func:`write_train_state` puts the new ones back.

    Args:
        model: The policy.
        optimizer: ``nnx.Optimizer(model, tx, wrt=...)``.
        reference_model: Optional frozen reference policy.
        rng: The run's PRNG key (default ``jax.random.key(0)``).
        teacher_model: Optional frozen distillation teacher (``GRPOConfig.distillation_coeff``).

    Returns:
        The state.

    Raises:
        TypeError: If an argument has the wrong type.

    Examples:
        >>> import jax, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import init_train_state
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> state = init_train_state(model, optimizer, rng=jax.random.key(1))
        >>> int(state.step), state.params["kernel"].shape, state.reference is None
        (0, (4, 3), True)
    """
    if not isinstance(model, nnx.Module):
        msg = f"model must be an nnx.Module, got {type(model).__name__}"
        raise TypeError(msg)
    if not isinstance(optimizer, nnx.Optimizer):
        msg = f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}"
        raise TypeError(msg)
    _, params, frozen = nnx.split(model, optimizer.wrt, ...)
    return GRPOTrainState(
        params=nnx.as_pure(params),
        frozen=nnx.as_pure(frozen),
        opt_state=nnx.as_pure(optimizer.opt_state),
        step=optimizer.step[...],
        rng=jax.random.key(0) if rng is None else rng,
        reference=None if reference_model is None else nnx.as_pure(nnx.state(reference_model)),
        teacher=None if teacher_model is None else nnx.as_pure(nnx.state(teacher_model)),
    )


def write_train_state(
    state: GRPOTrainState,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    reference_model: nnx.Module | None = None,
) -> None:
    """Writes ``state`` back into the NNX model, optimizer and reference (in place).

    Args:
        state: The state (e.g. returned by ``grpo_train_step``).
        model: The policy it was built from.
        optimizer: Its optimizer.
        reference_model: The reference model, when the state has one.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import init_train_state, write_train_state
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> state = init_train_state(model, optimizer)
        >>> zeros = jax.tree.map(jnp.zeros_like, state.params)
        >>> write_train_state(state.replace(params=zeros), model, optimizer)
        >>> float(jnp.abs(model.kernel[...]).sum())
        0.0
    """
    nnx.update(model, state.params, state.frozen)
    nnx.update(optimizer.opt_state, nnx.state(state.opt_state))
    optimizer.step.set_value(state.step)  # not [...]: that would read the donated array
    if reference_model is not None and state.reference is not None:
        nnx.update(reference_model, state.reference)
