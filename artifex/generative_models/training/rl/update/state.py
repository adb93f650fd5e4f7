r"""The pure GRPO update: ``state, metrics = grpo_train_step(state, batch)``.

:func:`make_grpo_train_step` binds the model's graph, the optimizer's gradient transformation and
a :class:`GRPOConfig` into a pure function of a :class:`GRPOTrainState` and a :class:`GRPOBatch`,
so a user can ``jax.jit`` it, call it inside ``jax.lax.scan``, shard it, or checkpoint the state
directly. :class:`GRPOTrainer` (the stateful ``nnx.Optimizer`` API) is a thin shell over it.

The state (``GRPOTrainState``, ``init_train_state``, ``write_train_state``) lives in
:mod:`~artifex.generative_models.training.rl.update.train_state`, the update's first half (the
objective and its gradient: ``make_grpo_gradients``; ``make_grpo_log_probs``) in
:mod:`~artifex.generative_models.training.rl.update.gradients`. This module holds the second
half (:func:`apply_gradients`: clipping, the optimizer and the guard) and imports the others'
names, so they stay importable from here.

One update (DeepSeekMath, Algorithm 1, inner loop):

1. advantages from the batch (precomputed by the rollout, else from its rewards), and the
   loss normalizer, over the whole batch;
2. ``value_and_grad`` of
   :func:`~artifex.generative_models.training.rl.core.objective.grpo_objective`, accumulated
   over ``num_microbatches`` slices inside a ``lax.scan`` (the update does not depend on the split);
3. global-norm clipping, ``tx.update`` and ``optax.apply_updates``;
4. the guard: if the loss, the gradient norm, the new parameters or the new optimizer state is
   not finite, or the batch carries no reward signal at all (and no entropy bonus or
   distillation term was asked for), the state is returned unchanged
   (``metrics["update_applied"] == 0``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.core.logprobs import LogProbFn
from artifex.generative_models.training.rl.update.gradients import (  # noqa: F401  (old imports)
    _is_lora_only,
    _micro,
    _Program,
    _program,
    advantage_signal,
    make_grpo_gradients,
    make_grpo_log_probs,
)
from artifex.generative_models.training.rl.update.train_state import (  # noqa: F401  (old imports)
    GRPOTrainState,
    init_train_state,
    write_train_state,
)

__all__ = [
    "NonFiniteUpdateError",
    "make_grpo_train_step",
]


class NonFiniteUpdateError(FloatingPointError):
    """A step produced a non-finite loss, gradient or update; the update was not applied.

    Args:
        message: The error message.
        metrics: The step's metrics.

    Attributes:
        metrics: The step's metrics (as floats), to see what went wrong.

    Examples:
        >>> from artifex.generative_models.training import NonFiniteUpdateError
        >>> err = NonFiniteUpdateError("loss is nan", {"loss": float("nan")})
        >>> isinstance(err, FloatingPointError), sorted(err.metrics)
        (True, ['loss'])
    """

    def __init__(self, message: str, metrics: dict[str, float]):
        super().__init__(message)
        self.metrics = metrics


# ---------------------------------------------------------------------------------- the step
def make_grpo_train_step(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    config: GRPOConfig,
    *,
    wrt: Any = nnx.Param,
    reference_model: nnx.Module | None = None,
    log_prob_fn: LogProbFn | None = None,
    num_microbatches: int = 1,
    teacher_model: nnx.Module | None = None,
) -> Callable[[GRPOTrainState, GRPOBatch], tuple[GRPOTrainState, dict[str, jax.Array]]]:
    """Binds a policy's graph, ``tx`` and ``config`` into the pure ``grpo_train_step``.

    ``grpo_train_step(state, batch) -> (state, metrics)`` is one GRPO update (see the module
    docstring) as a pure function of a :class:`GRPOTrainState` and a :class:`GRPOBatch`: no
    host work, no validation (check user batches first, e.g. with ``GRPOBatch.validate``), no
    side effects. It is not jitted: ``jax.jit`` it (``donate_argnums=0`` lets XLA reuse the
    state's buffers for the new state), call it inside ``jax.lax.scan`` over stacked batches,
    or inside your own jitted loop. The optimizer update is ``tx.update`` followed by
    ``optax.apply_updates``, exactly ``nnx.Optimizer.update``.

    Args:
        model: The policy (only its graph is bound; its values come from the state).
        tx: The optax gradient transformation (``optimizer.tx``).
        config: The GRPO options.
        wrt: The filter of trainable variables (``optimizer.wrt``).
        reference_model: The reference policy's module (its values come from
            ``state.reference``). A LoRA policy (``wrt=nnx.LoRAParam``) without one uses
            itself with zeroed adapters.
        log_prob_fn: ``fn(model, batch) -> (log_probs, entropy)`` for custom models; the
            metrics of one with ``log_probs_and_metrics(model, batch)`` join the update's, and
            one with ``for_microbatches(n)`` is replaced by its result (e.g.
            :class:`~artifex.generative_models.training.rl.core.routing_replay.RoutingReplayLogProbFn`).
        num_microbatches: Accumulate gradients over this many equal row slices.
        teacher_model: The distillation teacher's module (its values come from
            ``state.teacher``), for ``GRPOConfig.distillation_coeff > 0``
            (:mod:`~artifex.generative_models.training.rl.core.teacher`).

    Returns:
        ``grpo_train_step``. Its metrics are float32 scalars: those of
        :func:`~artifex.generative_models.training.rl.core.objective.grpo_objective`, ``grad_norm``
        (before clipping), ``update_applied`` (1 when the state moved), ``finite_update``,
        ``finite_params``, ``finite_optimizer_state`` and ``reward_signal``.

    Raises:
        TypeError: ``config`` is not a ``GRPOConfig``.
        ValueError: ``num_microbatches`` is not an int >= 1.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import (
        ...     GRPOBatch,
        ...     GRPOConfig,
        ...     init_train_state,
        ...     make_grpo_train_step,
        ... )
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))  # a 3-action policy
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> step = jax.jit(make_grpo_train_step(model, optimizer.tx, GRPOConfig()))
        >>> batch = GRPOBatch.from_dict(
        ...     {"observations": jnp.ones((4, 4)), "actions": jnp.array([0, 1, 2, 0]),
        ...      "rewards": jnp.array([1.0, 0.0, 0.0, 1.0])}, group_size=4)
        >>> state, metrics = step(init_train_state(model, optimizer), batch)
        >>> int(state.step), float(metrics["update_applied"])
        (1, 1.0)
    """
    gradients = make_grpo_gradients(
        model,
        config,
        wrt=wrt,
        reference_model=reference_model,
        log_prob_fn=log_prob_fn,
        num_microbatches=num_microbatches,
        teacher_model=teacher_model,
    )

    def grpo_train_step(
        state: GRPOTrainState, batch: GRPOBatch
    ) -> tuple[GRPOTrainState, dict[str, jax.Array]]:
        """One GRPO update of ``state`` on ``batch``: ``(new_state, metrics)`` (pure)."""
        loss, metrics, grads = gradients(state, batch)
        return apply_gradients(tx, config, state, batch, loss, metrics, grads)

    return grpo_train_step


def apply_gradients(
    tx: optax.GradientTransformation,
    config: GRPOConfig,
    state: GRPOTrainState,
    batch: GRPOBatch,
    loss: jax.Array,
    metrics: dict[str, jax.Array],
    grads: Any,
) -> tuple[GRPOTrainState, dict[str, jax.Array]]:
    """Steps 3 and 4 of the update: clipping, ``tx``, and the guard (pure, traceable).

    Shared by ``grpo_train_step`` and the layer-by-layer update
    (:mod:`~artifex.generative_models.training.rl.update.layerwise`), which computes ``loss``,
    ``metrics`` and ``grads`` its own way.

    Args:
        tx: The optax gradient transformation.
        config: The GRPO options (``max_grad_norm``, ``entropy_coeff``).
        state: The state the gradients were taken at.
        batch: The batch (for its reward signal).
        loss: The objective's value.
        metrics: The objective's metrics (returned with the update's added).
        grads: The gradient of ``loss`` with respect to ``state.params``.

    Returns:
        ``(new_state, metrics)``: the state after the update, or ``state``'s parameters,
        optimizer state and step where the guard rejected it.
    """
    grad_norm = jnp.sqrt(_squared_norm(grads))
    if config.max_grad_norm is not None:
        scale = _clip_scale(grad_norm, config.max_grad_norm)
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)

    # Jitted so that the optimizer (per-leaf work, a large part of this step's tracing) is
    # traced once for its two uses below; XLA inlines both calls.
    @jax.jit
    def apply_tx(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
        updates, new_opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state

    def updated() -> tuple[Any, Any]:
        return apply_tx(grads, state.opt_state, state.params)

    # The update itself can overflow (a huge learning rate, a schedule that overflows): the
    # new parameters and optimizer state must be finite too. They are computed twice: here
    # only for the finiteness check (XLA fuses each leaf's update into its reduction, so
    # nothing parameter-sized is written), and again inside the branch below that applies
    # them, in place of the donated state. Computing them once, outside the branch, kept
    # the old and the new state alive together: about 1 GB more peak memory for
    # SmolLM2-135M and 0.1 s more per update (docs/benchmarks.md). One branch, not a
    # `where` per leaf: XLA fuses the and-reduction over every leaf's check into each
    # leaf's select, a program quadratic in the number of leaves (minutes to compile for
    # a 30-layer model). The two computations are fused differently and may round apart in
    # the last bit; only a value at the very edge of overflow could be finite in one and
    # not the other.
    params_ok, opt_ok = _finite_flags(*updated())
    apply, metrics = _guard_decision(config, batch, loss, grad_norm, params_ok, opt_ok, metrics)
    params, opt_state = jax.lax.cond(apply, updated, lambda: (state.params, state.opt_state))
    new_state = state.replace(
        params=params,
        opt_state=opt_state,
        step=state.step + apply.astype(state.step.dtype),
    )
    return new_state, metrics


def _squared_norm(tree: Any) -> jax.Array:
    """The squared L2 norm of all the arrays of ``tree``, accumulated in float32.

    Each array is squared and summed in float32 (a bfloat16 gradient's norm is not rounded to
    bfloat16), then the sums are added; 0 for an empty tree.
    """
    sums = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sum(jnp.stack(sums)) if sums else jnp.zeros((), jnp.float32)


def _clip_scale(grad_norm: jax.Array, max_grad_norm: float) -> jax.Array:
    """The factor that scales the gradient to a norm of at most ``max_grad_norm`` (traceable)."""
    return jnp.minimum(1.0, max_grad_norm / jnp.maximum(grad_norm, 1e-12))


def _guard_decision(
    config: GRPOConfig,
    batch: GRPOBatch,
    loss: jax.Array,
    grad_norm: jax.Array,
    params_ok: jax.Array,
    opt_ok: jax.Array,
    metrics: dict[str, jax.Array],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Whether the guard applies an update, and the update's metrics (traceable).

    Shared by :func:`apply_gradients` and the optimizer run one layer at a time.

    Returns:
        ``(apply, metrics)``: a bool scalar, and ``metrics`` with ``grad_norm``,
        ``update_applied``, ``finite_update``, ``finite_params``, ``finite_optimizer_state`` and
        ``reward_signal`` added.
    """
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & params_ok & opt_ok
    # A batch without any advantage signal (every group's rewards equal, or none) moves
    # nothing unless asked to: its only gradients would be the KL and entropy terms, which
    # Adam takes at full step size whatever their scale, step after step.
    signal = _has_reward_signal(batch)
    if config.update_without_advantage:
        apply = ok & (signal | (config.entropy_coeff > 0.0))
    else:
        apply = ok & (metrics["advantage_signal"] > 0)
    if config.distillation_coeff > 0.0:  # the teacher's term is a signal of its own
        apply = ok
    f32 = jnp.float32
    metrics = dict(metrics, grad_norm=grad_norm.astype(f32))
    metrics["update_applied"] = apply.astype(f32)
    metrics["finite_update"] = ok.astype(f32)
    metrics["finite_params"] = params_ok.astype(f32)
    metrics["finite_optimizer_state"] = opt_ok.astype(f32)
    metrics["reward_signal"] = signal.astype(f32)
    return apply, metrics


def _has_reward_signal(batch: GRPOBatch) -> jax.Array:
    """Whether the batch carries any reward signal (a bool scalar, traceable)."""
    signal = jnp.any(~jnp.isnan(jnp.asarray(batch.rewards, jnp.float32)))
    if batch.step_rewards is not None:
        signal |= jnp.any(~jnp.isnan(jnp.asarray(batch.step_rewards, jnp.float32)))
    if batch.advantages is not None:  # given advantages are a signal unless all zero
        signal |= jnp.any(jnp.asarray(batch.advantages, jnp.float32) != 0)
    return signal


def _finite_flags(
    params: Any, opt_state: Any, *, rows_first: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Whether every inexact leaf of ``params`` / of ``opt_state`` is finite (two bool scalars).

    Optimizer states hold parameter-shaped trees (Adam's moments): each parameter is checked
    with its moments in one reduction with two outputs, not one reduction per array. The three
    arrays share a sharding, and on the CPU every reduction is a kernel to compile, so fewer
    reductions compile faster. The reduction of a large array keeps its leading axis and a
    second one reduces that, because XLA:CPU runs a reduction to a vector on all cores and a
    reduction to a scalar on one. ``rows_first`` sets that size threshold (default
    ``_ROWS_FIRST``).
    """
    rows_first = _ROWS_FIRST if rows_first is None else rows_first
    p_leaves = jax.tree.leaves(params)
    slots: list[list[Any]] = [[] for _ in p_leaves]  # optimizer arrays shaped like parameter i
    rest: list[Any] = []  # the other optimizer arrays (step counts, ...)
    parameter_shaped = _parameter_shaped(params)

    for node in jax.tree.leaves(opt_state, is_leaf=parameter_shaped):
        if p_leaves and parameter_shaped(node):
            for slot, x in zip(slots, jax.tree.leaves(node), strict=True):
                slot.append(x)
        else:
            rest.append(node)
    params_ok, opt_ok = [jnp.asarray(True)], [_all_finite(rest, rows_first)]
    for p, slot in zip(p_leaves, slots, strict=True):
        a, b = _finite_mask([p]), _finite_mask(slot)
        if a is None or b is None:
            params_ok.append(_all_finite([p], rows_first))
            opt_ok.append(_all_finite(slot, rows_first))
            continue
        rows = a.size >= rows_first and a.ndim > 1
        both = jax.lax.reduce(
            (a, b),
            (np.bool_(True), np.bool_(True)),
            _and_pairs,
            tuple(range(1 if rows else 0, a.ndim)),
        )
        params_ok.append(jnp.all(both[0]))
        opt_ok.append(jnp.all(both[1]))
    return jnp.all(jnp.stack(params_ok)), jnp.all(jnp.stack(opt_ok))


def _parameter_shaped(params: Any) -> Callable[[Any], bool]:
    """A test of whether a node has the structure and shapes of ``params`` (moments).

    The dtypes may differ: moments kept in another precision than the parameters
    (``optax.adamw(mu_dtype=jnp.bfloat16)``) are still one entry per parameter.
    """
    p_leaves, p_def = jax.tree.flatten(params)

    def shaped(node: Any) -> bool:
        if jax.tree.structure(node) != p_def:
            return False
        return all(
            jnp.shape(x) == jnp.shape(p)
            for x, p in zip(jax.tree.leaves(node), p_leaves, strict=True)
        )

    return shaped


def _and_pairs(x: tuple[Any, Any], y: tuple[Any, Any]) -> tuple[Any, Any]:
    # One function for every reduction: JAX traces a reducer once per function and operand
    # types, so a lambda per call would be traced again for every parameter.
    return x[0] & y[0], x[1] & y[1]


# Arrays of at least this many elements are checked rows first (see `_finite_flags`); smaller
# ones in one reduction, as each extra reduction is one more operation to compile.
_ROWS_FIRST = 1 << 22


def _finite_mask(arrays: list[Any]) -> jax.Array | None:
    """Elementwise: every inexact array of ``arrays`` (one shape) is finite there; or None."""
    masks = [jnp.isfinite(x) for x in arrays if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return functools.reduce(jnp.logical_and, masks) if masks else None


def _all_finite(state: Any, rows_first: int = _ROWS_FIRST) -> jax.Array:
    """Whether every inexact leaf of ``state`` is finite (a bool scalar; rows first, see above)."""
    checks = [
        jnp.all(
            jnp.all(jnp.isfinite(x), axis=tuple(range(1, jnp.ndim(x))))
            if jnp.size(x) >= rows_first and jnp.ndim(x) > 1
            else jnp.isfinite(x)
        )
        for x in jax.tree.leaves(state)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not checks:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(checks))
