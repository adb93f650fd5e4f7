"""The first half of the pure GRPO update: the objective and its gradient, and the log-probs.

:func:`make_grpo_gradients` binds a policy's graph and a :class:`GRPOConfig` into the pure
``grpo_gradients(state, batch) -> (loss, metrics, grads)``: the advantages and the loss
normalizer over the whole batch, then ``value_and_grad`` of :func:`grpo_objective`,
accumulated over ``num_microbatches`` slices inside a ``lax.scan`` (the update does not depend
on the split). :func:`make_grpo_log_probs` binds the gradient-free log-probs of the policy and
its reference; :func:`advantage_signal` is the test of whether any advantage reaches the loss.
The second half, clipping, the optimizer and the guard, is
:func:`~artifex.generative_models.training.rl.update.state.apply_gradients`.

Moved out of :mod:`~artifex.generative_models.training.rl.update.state` unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from artifex.generative_models.training.rl.core import losses
from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.core.logprobs import LogProbFn, default_log_prob_fn
from artifex.generative_models.training.rl.core.microbatching import (
    combine_micro_metrics,
    split_microbatches,
)
from artifex.generative_models.training.rl.core.objective import (
    batch_reward_metrics,
    compute_advantages,
    grpo_objective,
)
from artifex.generative_models.training.rl.core.teacher import (
    DistillationTerms,
    make_distillation_terms,
)
from artifex.generative_models.training.rl.update.train_state import GRPOTrainState
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "advantage_signal",
    "make_grpo_gradients",
    "make_grpo_log_probs",
]


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
    to ``state.params``;
    :func:`~artifex.generative_models.training.rl.update.state.apply_gradients` is the second half.
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
        >>> from artifex.generative_models.training.rl.update.gradients import make_grpo_gradients
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
                log_probs, entropy, term, extra = program.distill.with_metrics(
                    policy, state.teacher, mb
                )
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
            metrics = combine_micro_metrics(micro_metrics)
        if not precomputed:  # a loop that precomputes advantages reports these once per batch
            metrics.update(batch_reward_metrics(batch, advantages))
        metrics["advantage_signal"] = advantage_signal(advantages, batch.completion_mask)
        return loss, metrics, grads

    return grpo_gradients


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
        reference_model: The reference policy's module, as for
            :func:`~artifex.generative_models.training.rl.update.state.make_grpo_train_step`.
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
        >>> from artifex.generative_models.training.rl.update.gradients import advantage_signal
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
