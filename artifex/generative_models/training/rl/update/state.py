r"""The train state and the pure GRPO update: ``state, metrics = grpo_train_step(state, batch)``.

:class:`GRPOTrainState` is a pytree of arrays: the policy's trainable parameters, its other
(frozen) variables, the optax optimizer state, the step count, the run's PRNG key and, beside
them, the frozen reference policy and distillation teacher.
:func:`make_grpo_train_step` binds the model's graph, the
optimizer's gradient transformation and a :class:`GRPOConfig` into a pure function of that
state and a :class:`GRPOBatch`, so a user can ``jax.jit`` it, call it inside ``jax.lax.scan``,
shard it, or checkpoint the state directly. :class:`GRPOTrainer` (the stateful ``nnx.Optimizer``
API) is a thin shell over it.

One update (DeepSeekMath, Algorithm 1, inner loop):

1. advantages from the batch (precomputed by the rollout, else from its rewards), and the
   loss normalizer, over the whole batch;
2. ``value_and_grad`` of :func:`grpo_objective`, accumulated over ``num_microbatches`` slices
   inside a ``lax.scan`` (the update does not depend on the split);
3. global-norm clipping, ``tx.update`` and ``optax.apply_updates``;
4. the guard: if the loss, the gradient norm, the new parameters or the new optimizer state is
   not finite, or the batch carries no reward signal at all (and no entropy bonus or
   distillation term was asked for), the state is returned unchanged
   (``metrics["update_applied"] == 0``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.training.rl.batch import GRPOBatch
from artifex.generative_models.training.rl.core import losses
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.core.logprobs import LogProbFn, default_log_prob_fn
from artifex.generative_models.training.rl.core.objective import (
    _combine_micro_metrics,
    _reward_metrics,
    compute_advantages,
    grpo_objective,
    split_microbatches,
)
from artifex.generative_models.training.rl.core.teacher import (
    DistillationTerms,
    make_distillation_terms,
)
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "GRPOTrainState",
    "NonFiniteUpdateError",
    "advantage_signal",
    "init_train_state",
    "make_grpo_gradients",
    "make_grpo_log_probs",
    "make_grpo_train_step",
    "write_train_state",
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


# ---------------------------------------------------------------------------------- the state
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


# ---------------------------------------------------------------------------------- the step
@dataclasses.dataclass(frozen=True)
class _Program:
    """What the pure functions close over: graphs, config and the log-prob function."""

    graphdef: Any
    ref_graphdef: Any
    config: GRPOConfig
    log_prob_fn: LogProbFn
    lora_reference: bool
    distill: DistillationTerms | None = None  # the teacher's term (distillation_coeff > 0)

    @property
    def exact_kl(self) -> bool:
        """The KL comes from ``log_prob_fn.log_probs_and_kl`` (``kl_estimator="exact"``)."""
        return self.config.kl_estimator == "exact"

    def policy(self, params: Any, frozen: Any) -> nnx.Module:
        return nnx.merge(self.graphdef, params, frozen)

    def reference(self, state: GRPOTrainState, params: Any) -> nnx.Module | None:
        if state.reference is not None and self.ref_graphdef is not None:
            return nnx.merge(self.ref_graphdef, state.reference)
        if self.lora_reference:  # the same graph with the adapters zeroed is the base model
            return self.policy(jax.tree.map(jnp.zeros_like, params), state.frozen)
        return None

    def needs_reference(self, state: GRPOTrainState, batch: GRPOBatch) -> bool:
        """Whether the reference's log-probs are computed (not with the exact KL)."""
        return (
            self.config.beta > 0.0
            and not self.exact_kl
            and batch.ref_log_probs is None
            and self._has_reference(state)
        )

    def runs_exact_kl(self, state: GRPOTrainState) -> bool:
        """Whether the update runs the reference for the exact KL."""
        return self.config.beta > 0.0 and self.exact_kl and self._has_reference(state)

    def _has_reference(self, state: GRPOTrainState) -> bool:
        return (state.reference is not None and self.ref_graphdef is not None) or (
            self.lora_reference
        )


def _program(
    model: nnx.Module,
    config: GRPOConfig,
    wrt: Any,
    reference_model: nnx.Module | None,
    log_prob_fn: LogProbFn | None,
    teacher_model: nnx.Module | None = None,
    *,
    distillation: bool = True,
) -> _Program:
    if not isinstance(config, GRPOConfig):
        msg = f"config must be a GRPOConfig, got {type(config).__name__}"
        raise TypeError(msg)
    if config.kl_estimator == "exact" and not callable(
        getattr(log_prob_fn, "log_probs_and_kl", None)
    ):
        name = getattr(log_prob_fn, "__name__", type(log_prob_fn).__name__)
        msg = (
            "GRPOConfig.kl_estimator='exact' needs a log_prob_fn with a closed-form KL "
            "(a log_probs_and_kl(model, reference, batch) method, e.g. flow_log_prob_fn(sde)), "
            f"got {'the default log-prob function' if log_prob_fn is None else name}"
        )
        raise ValueError(msg)
    graphdef, _, _ = nnx.split(model, wrt, ...)
    program = _Program(
        graphdef=graphdef,
        ref_graphdef=None if reference_model is None else nnx.graphdef(reference_model),
        config=config,
        log_prob_fn=(
            default_log_prob_fn(
                model,
                temperature=config.temperature,
                remat=config.remat_option,
                scan_layers=config.scan_layers,
            )
            if log_prob_fn is None
            else log_prob_fn
        ),
        lora_reference=reference_model is None and _is_lora_only(model, wrt),
    )
    if not distillation:  # log-probs only (make_grpo_log_probs)
        return program
    distill = make_distillation_terms(model, teacher_model, config, log_prob_fn=program.log_prob_fn)
    return dataclasses.replace(program, distill=distill)


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


def make_grpo_gradients(
    model: nnx.Module,
    config: GRPOConfig,
    *,
    wrt: Any = nnx.Param,
    reference_model: nnx.Module | None = None,
    log_prob_fn: LogProbFn | None = None,
    num_microbatches: int = 1,
    teacher_model: nnx.Module | None = None,
) -> Callable[[GRPOTrainState, GRPOBatch], tuple[jax.Array, dict[str, jax.Array], Any]]:
    """The first half of ``grpo_train_step``: the objective and its gradient, nothing applied.

    ``grpo_gradients(state, batch) -> (loss, metrics, grads)`` (pure, not jitted): the
    objective's value, its metrics (the reward metrics included) and its gradient with respect
    to ``state.params``; :func:`apply_gradients` is the second half.
    ``make_grpo_train_step`` is the two in one function.

    Args:
        model: The policy (only its graph is bound).
        config: The GRPO options.
        wrt: The filter of trainable variables.
        reference_model: The reference policy's module, as for ``make_grpo_train_step``.
        log_prob_fn: As for ``make_grpo_train_step``.
        num_microbatches: Accumulate gradients over this many equal row slices.
        teacher_model: The distillation teacher's module, as for ``make_grpo_train_step``.

    Returns:
        ``grpo_gradients``.

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
        ... )
        >>> from artifex.generative_models.training.rl.update.state import make_grpo_gradients
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> gradients = jax.jit(make_grpo_gradients(model, GRPOConfig()))
        >>> batch = GRPOBatch.from_dict(
        ...     {"observations": jnp.ones((4, 4)), "actions": jnp.array([0, 1, 2, 0]),
        ...      "rewards": jnp.array([1.0, 0.0, 0.0, 1.0])}, group_size=4)
        >>> loss, metrics, grads = gradients(init_train_state(model, optimizer), batch)
        >>> grads["kernel"].shape, "reward_mean" in metrics
        ((4, 3), True)
    """
    check_int("num_microbatches", num_microbatches, minimum=1)
    if callable(getattr(log_prob_fn, "for_microbatches", None)):  # per-pass terms: a mean
        log_prob_fn = log_prob_fn.for_microbatches(num_microbatches)
    program = _program(model, config, wrt, reference_model, log_prob_fn, teacher_model)
    log_prob = program.log_prob_fn

    def grpo_gradients(
        state: GRPOTrainState, batch: GRPOBatch
    ) -> tuple[jax.Array, dict[str, jax.Array], Any]:
        """The objective, its metrics and its gradient for ``state`` on ``batch`` (pure)."""
        needs_ref = program.needs_reference(state, batch)
        exact_kl = program.runs_exact_kl(state)
        frozen = state.frozen
        # Advantages and the loss normalizer come from the whole batch, so splitting it into
        # microbatches changes nothing but peak memory.
        precomputed = batch.advantages is not None
        advantages = jax.lax.stop_gradient(compute_advantages(batch, config))
        normalizer = losses.loss_normalizer(
            batch.completion_mask, config.loss_aggregation, max_length=config.max_completion_length
        )
        # Likewise the entropy quantile of top_entropy_quantile: over the whole batch, from a
        # gradient-free forward of each microbatch (one microbatch computes it in the loss).
        entropy_threshold = None
        if config.top_entropy_quantile < 1.0 and num_microbatches > 1:

            def micro_entropy(mb: GRPOBatch) -> jax.Array:
                _, ent = log_prob(program.policy(state.params, frozen), mb)
                return jax.lax.stop_gradient(ent)

            ents = jax.lax.map(micro_entropy, _micro(batch, num_microbatches))
            entropy_threshold = losses.entropy_quantile_threshold(
                ents.reshape(batch.completion_mask.shape),
                batch.completion_mask,
                1.0 - config.top_entropy_quantile,
            )

        def loss_fn(
            params: Any, mb: GRPOBatch, adv: jax.Array
        ) -> tuple[jax.Array, dict[str, jax.Array]]:
            kl = None
            if needs_ref:
                ref = program.reference(state, params)
                ref_lp, _ = log_prob(ref, mb)
                mb = mb.replace(ref_log_probs=jax.lax.stop_gradient(ref_lp))
            policy, term, extra = program.policy(params, frozen), None, {}
            if program.distill is not None:  # the student's log-probs beside the teacher's term
                log_probs, entropy, term = program.distill(policy, state.teacher, mb)
            elif exact_kl:  # the policy's and the reference's transitions in one call
                log_probs, entropy, kl = log_prob.log_probs_and_kl(
                    policy, program.reference(state, params), mb
                )
            elif callable(getattr(log_prob, "log_probs_and_metrics", None)):  # its own metrics
                log_probs, entropy, extra = log_prob.log_probs_and_metrics(policy, mb)
            else:
                log_probs, entropy = log_prob(policy, mb)
            loss, metrics = grpo_objective(
                log_probs,
                entropy,
                mb,
                config,
                normalizer=normalizer,
                advantages=adv,
                reward_metrics=False,
                entropy_threshold=entropy_threshold,
                distillation=term,
                kl=kl,
            )
            return loss, {**metrics, **extra}  # e.g. routing replay's moe/ metrics

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if num_microbatches == 1:
            (loss, metrics), grads = grad_fn(state.params, batch, advantages)
        else:
            micro = _micro(batch, num_microbatches)
            micro_adv = advantages.reshape(num_microbatches, -1, *advantages.shape[1:])

            def accumulate(acc: Any, xs: tuple[GRPOBatch, jax.Array]):
                (loss_i, metrics_i), grads_i = grad_fn(state.params, *xs)
                return jax.tree.map(jnp.add, acc, grads_i), (loss_i, metrics_i)

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            grads, (micro_loss, micro_metrics) = jax.lax.scan(accumulate, zeros, (micro, micro_adv))
            loss = jnp.sum(micro_loss)
            metrics = _combine_micro_metrics(micro_metrics)
        if not precomputed:  # a loop that precomputes advantages reports these once per batch
            metrics.update(_reward_metrics(batch, advantages))
        metrics["advantage_signal"] = advantage_signal(advantages, batch.completion_mask)
        return loss, metrics, grads

    return grpo_gradients


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


def make_grpo_log_probs(
    model: nnx.Module,
    config: GRPOConfig,
    *,
    wrt: Any = nnx.Param,
    reference_model: nnx.Module | None = None,
    log_prob_fn: LogProbFn | None = None,
) -> Callable[[GRPOTrainState, GRPOBatch], tuple[jax.Array, jax.Array | None]]:
    """Binds a policy into the pure ``log_probs(state, batch) -> (log_probs, ref_log_probs)``.

    The per-token log-probs of the batch's completions under the state's policy and (when
    ``beta > 0``, the batch has no ``ref_log_probs`` and a reference exists) under the
    reference, without gradient: what a loop stores as ``old_log_probs`` / ``ref_log_probs``
    before ``mu > 1`` iterations on one generation batch.

    Args:
        model: The policy (its graph).
        config: The GRPO options (``beta``, ``temperature``).
        wrt: The filter of trainable variables.
        reference_model: The reference policy's module, as for :func:`make_grpo_train_step`.
        log_prob_fn: ``fn(model, batch) -> (log_probs, entropy)`` for custom models.

    Returns:
        ``log_probs(state, batch)``; ``ref_log_probs`` is ``None`` when not computed.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import (
        ...     GRPOBatch,
        ...     GRPOConfig,
        ...     init_train_state,
        ...     make_grpo_log_probs,
        ... )
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> log_probs = make_grpo_log_probs(model, GRPOConfig(num_generations=2))
        >>> batch = GRPOBatch.from_dict({"observations": jnp.ones((2, 4)),
        ...                              "actions": jnp.array([0, 2]), "rewards": jnp.zeros(2)},
        ...                             group_size=2)
        >>> old, ref = log_probs(init_train_state(model, optimizer), batch)
        >>> old.shape, bool((old < 0).all()), ref is None
        ((2, 1), True, True)
    """
    program = _program(model, config, wrt, reference_model, log_prob_fn, distillation=False)

    def log_probs(state: GRPOTrainState, batch: GRPOBatch) -> tuple[jax.Array, jax.Array | None]:
        lp, _ = program.log_prob_fn(program.policy(state.params, state.frozen), batch)
        ref_lp = None
        if program.needs_reference(state, batch):
            ref_lp, _ = program.log_prob_fn(program.reference(state, state.params), batch)
        return jax.lax.stop_gradient((lp, ref_lp))

    return log_probs


def _micro(batch: GRPOBatch, num_microbatches: int) -> GRPOBatch:
    """The batch split into microbatches; prompt sharing off when slices cut through groups."""
    micro = split_microbatches(batch, num_microbatches)
    if (batch.batch_size // num_microbatches) % batch.group_size:
        micro = micro.replace(shared_prompts=False)
    return micro


def advantage_signal(advantages: jax.Array, completion_mask: jax.Array) -> jax.Array:
    """1.0 where any advantage that reaches the loss is nonzero, else 0.0 (traceable).

    Args:
        advantages: ``(B,)`` per-sequence or ``(B, T)`` per-token advantages.
        completion_mask: ``(B, T)``: the tokens that count.

    Returns:
        A float32 scalar.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl.update.state import advantage_signal
        >>> mask = jnp.array([[1, 1], [1, 0]])
        >>> float(advantage_signal(jnp.zeros(2), mask))
        0.0
        >>> float(advantage_signal(jnp.array([0.0, 0.5]), mask))
        1.0
        >>> float(advantage_signal(jnp.array([[0.0, 0.0], [0.0, 2.0]]), mask))  # masked out
        0.0
    """
    counted = jnp.asarray(completion_mask) > 0
    adv = jnp.asarray(advantages, jnp.float32)
    counted = jnp.any(counted, axis=-1) if adv.ndim == 1 else counted
    return jnp.any((adv != 0) & counted).astype(jnp.float32)


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


def _is_lora_only(model: nnx.Module, wrt: Any) -> bool:
    """Whether ``wrt`` selects exactly the model's (non-empty set of) LoRA parameters."""
    selected = jax.tree.leaves(nnx.state(model, wrt), is_leaf=lambda x: isinstance(x, nnx.Variable))
    lora = jax.tree.leaves(
        nnx.state(model, nnx.LoRAParam), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return (
        bool(lora)
        and len(selected) == len(lora)
        and all(isinstance(v, nnx.LoRAParam) for v in selected)
    )
