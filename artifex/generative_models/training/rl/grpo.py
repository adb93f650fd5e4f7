r"""GRPO: the loss as a pure function and the trainer that applies it.

:func:`grpo_objective` turns per-token log-probs into the loss and its metrics (a pure
function of arrays). :func:`make_grpo_loss` binds a model's graph and a config into the pure
``grpo_loss(params, batch) -> (loss, metrics)`` that ``jax.grad`` differentiates.
:class:`GRPOTrainer` runs one compiled optimizer update per ``train_step(batch)``.

Per token ``t`` of completion ``i`` (DeepSeekMath eq. 3, with the options of
:class:`~artifex.generative_models.training.rl.configs.GRPOConfig`):

.. math::

    \ell_{i,t} = -\min\big(\rho_{i,t}\hat A_{i,t},\
    \operatorname{clip}(\rho_{i,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high})\hat A_{i,t}\big)
    + \beta\,\mathrm{KL}_{i,t} - c_H H_{i,t},

aggregated over tokens and completions; ``policy_loss + kl_penalty - entropy_coeff * entropy``
equals ``total_loss`` because all three use the same aggregation.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from artifex.generative_models.training.rl import advantages as adv_lib
from artifex.generative_models.training.rl import losses
from artifex.generative_models.training.rl.batch import GRPOBatch
from artifex.generative_models.training.rl.configs import GRPOConfig
from artifex.generative_models.training.rl.logprobs import LogProbFn, default_log_prob_fn
from artifex.generative_models.training.sharding import (
    PartitionRules,
    current_mesh,
    shard_batch,
    shard_model,
    shard_optimizer,
)

__all__ = [
    "GRPOTrainer",
    "NonFiniteUpdateError",
    "as_grpo_batch",
    "compute_advantages",
    "grpo_objective",
    "make_grpo_loss",
    "split_microbatches",
]

logger = logging.getLogger(__name__)


class NonFiniteUpdateError(FloatingPointError):
    """A step produced a non-finite loss or gradient; the update was not applied.

    Args:
        message: The error message.
        metrics: The step's metrics.

    Attributes:
        metrics: The step's metrics (as floats), to see what went wrong.
    """

    def __init__(self, message: str, metrics: dict[str, float]):
        super().__init__(message)
        self.metrics = metrics


# ---------------------------------------------------------------------------------- batches
def as_grpo_batch(batch: GRPOBatch | Mapping[str, Any], config: GRPOConfig) -> GRPOBatch:
    """Converts a batch (``GRPOBatch`` or the dict batch form) to a ``GRPOBatch`` of arrays.

    Args:
        batch: A :class:`GRPOBatch`, or a dict with ``observations``, ``actions``,
            ``rewards`` and optionally ``log_probs``, ``ref_log_probs``, ``advantages``,
            ``group_size``.
        config: Supplies the default group size (``num_generations``).

    Returns:
        A ``GRPOBatch`` whose leaves are JAX arrays.

    Raises:
        TypeError: For any other batch type.
    """
    if isinstance(batch, Mapping):
        batch = GRPOBatch.from_dict(batch, group_size=config.num_generations)
    elif not isinstance(batch, GRPOBatch):
        msg = f"batch must be a GRPOBatch or a dict, got {type(batch).__name__}"
        raise TypeError(msg)
    return jax.tree.map(jnp.asarray, batch)


def compute_advantages(batch: GRPOBatch, config: GRPOConfig) -> jax.Array:
    """The advantages the loss uses for ``batch``: ``(B,)`` or ``(B, T)`` float32.

    Precedence: the batch's precomputed ``advantages``; else process-supervision token
    advantages from ``step_rewards``; else outcome advantages from ``rewards`` (the segment
    kernel when the batch has ``group_ids``, the fixed-group kernel otherwise).

    Args:
        batch: The batch.
        config: Advantage options.

    Returns:
        The advantages.
    """
    if batch.advantages is not None:
        return jnp.asarray(batch.advantages, jnp.float32)
    if batch.step_rewards is not None:
        return adv_lib.process_advantages(
            batch.step_rewards,
            batch.group_size,
            gamma=config.gamma,
            scale=config.scale_rewards,
            ddof=config.std_ddof,
            eps=config.advantage_eps,
        )
    return adv_lib.advantages_from_config(
        batch.rewards, config, group_size=batch.group_size, group_ids=batch.group_ids
    )


# ---------------------------------------------------------------------------------- the loss
def _reward_metrics(batch: GRPOBatch, advantages: jax.Array) -> dict[str, jax.Array]:
    rewards = jnp.asarray(batch.rewards, jnp.float32)
    valid = (~jnp.isnan(rewards)).astype(jnp.float32)
    mean = losses.masked_mean(rewards, valid)
    std = jnp.sqrt(losses.masked_mean((rewards - mean) ** 2, valid))
    if batch.group_ids is not None:
        stats = adv_lib.segment_stats(rewards, batch.group_ids, ddof=0)
        present = jax.ops.segment_sum(valid, batch.group_ids, num_segments=rewards.shape[0]) > 0
        zero = jax.ops.segment_max(
            ((stats.std == 0) & (valid > 0)).astype(jnp.float32),
            batch.group_ids,
            num_segments=rewards.shape[0],
        )
        frac_zero = jnp.sum(jnp.where(present, zero, 0.0)) / jnp.maximum(jnp.sum(present), 1)
    else:
        stats = adv_lib.group_stats(rewards, batch.group_size, ddof=0)
        g = batch.group_size
        group_std = stats.std[::g]
        present = stats.count[::g] > 0
        frac_zero = jnp.sum((group_std == 0) & present) / jnp.maximum(jnp.sum(present), 1)
    if advantages.ndim == 2:
        adv_mask = jnp.asarray(batch.completion_mask, jnp.float32)
    else:
        adv_mask = valid if batch.advantages is None else jnp.ones_like(valid)
    adv_mean = losses.masked_mean(advantages, adv_mask)
    adv_std = jnp.sqrt(losses.masked_mean((advantages - adv_mean) ** 2, adv_mask))
    return {
        "reward_mean": mean,
        "reward_std": std,
        "frac_reward_zero_std": frac_zero.astype(jnp.float32),
        "advantage_mean": adv_mean,
        "advantage_std": adv_std,
    }


def grpo_objective(
    log_probs: jax.Array,
    entropy: jax.Array | None,
    batch: GRPOBatch,
    config: GRPOConfig,
    *,
    normalizer: jax.Array | float | None = None,
    advantages: jax.Array | None = None,
    reward_metrics: bool = True,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""The GRPO loss and its metrics from the current policy's per-token log-probs.

    ``loss = agg(-min(rho A, clip(rho) A)) + beta * agg(KL) - entropy_coeff * agg(H)`` where
    ``agg`` is the configured aggregation (see
    :func:`~artifex.generative_models.training.rl.losses.aggregate_loss`), ``rho`` the token
    or sequence importance ratio, ``A`` the advantages from :func:`compute_advantages`.

    Args:
        log_probs: ``(B, T)`` log-probs of the completion tokens under the current policy
            (differentiable).
        entropy: ``(B, T)`` entropies of the current policy, or ``None`` (counts as 0; only
            allowed with ``entropy_coeff == 0``).
        batch: The batch (masks, rewards, old and reference log-probs).
        config: The objective's options.
        normalizer: Overrides the aggregation denominator (for microbatches of a larger
            batch, see :func:`~artifex.generative_models.training.rl.losses.loss_normalizer`).
        advantages: Overrides :func:`compute_advantages` (e.g. advantages computed on the whole
            batch when this is one of its microbatches).
        reward_metrics: Whether to add the reward and advantage statistics to the metrics.

    Returns:
        ``(total_loss, metrics)``; metrics are float32 device scalars: ``policy_loss``,
        ``kl``, ``kl_penalty`` (``beta * kl``), ``approx_kl`` (vs. the sampling policy),
        ``entropy``, ``clip_fraction_low``, ``clip_fraction_high``, ``clip_fraction``,
        ``reward_mean``, ``reward_std``, ``advantage_mean``, ``advantage_std``,
        ``frac_reward_zero_std``, ``completion_length``, ``num_tokens``, ``total_loss``.

    Raises:
        ValueError: ``entropy`` is ``None`` while ``entropy_coeff > 0``.
    """
    mask = jnp.asarray(batch.completion_mask, jnp.float32)
    log_probs = jnp.asarray(log_probs, jnp.float32)
    agg_kwargs = dict(
        mode=config.loss_aggregation,
        max_length=config.max_completion_length,
        normalizer=normalizer,
    )
    if advantages is None:
        advantages = compute_advantages(batch, config)
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))

    log_ratio = losses.log_importance_ratio(
        log_probs, batch.old_log_probs, mask, level=config.importance_sampling_level
    )
    pg, low, high = losses.clipped_surrogate(
        log_ratio,
        advantages,
        mask,
        epsilon_low=config.epsilon_low,
        epsilon_high=config.epsilon_high,
        dual_clip=config.dual_clip,
    )
    policy_loss = losses.aggregate_loss(pg, mask, **agg_kwargs)
    total = policy_loss

    if config.beta > 0.0 and batch.ref_log_probs is not None:
        kl_tok = losses.kl_divergence(
            log_probs, batch.ref_log_probs, mask, estimator=config.kl_estimator
        )
        kl = losses.aggregate_loss(kl_tok, mask, **agg_kwargs)
        total = total + config.beta * kl
    else:
        kl = jnp.zeros((), jnp.float32)

    if entropy is None:
        if config.entropy_coeff > 0.0:
            msg = "entropy is required when GRPOConfig.entropy_coeff > 0"
            raise ValueError(msg)
        ent = jnp.zeros((), jnp.float32)
    else:
        ent = losses.aggregate_loss(entropy, mask, **agg_kwargs)
        if config.entropy_coeff > 0.0:
            total = total - config.entropy_coeff * ent

    metrics = {
        "policy_loss": policy_loss,
        "kl": kl,
        "kl_penalty": config.beta * kl,
        "approx_kl": losses.masked_mean(losses.approx_kl_old(log_ratio, mask), mask),
        "entropy": ent,
        "clip_fraction_low": losses.masked_mean(low, mask),
        "clip_fraction_high": losses.masked_mean(high, mask),
        "clip_fraction": losses.masked_mean(low + high, mask),
        "completion_length": jnp.mean(jnp.sum(mask, axis=-1)),
        "num_tokens": jnp.sum(mask),
        "total_loss": total,
    }
    if reward_metrics:
        metrics.update(_reward_metrics(batch, advantages))
    metrics = {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in metrics.items()}
    return total, metrics


_SUMMED = ("policy_loss", "kl", "kl_penalty", "entropy", "total_loss", "num_tokens")
_TOKEN_WEIGHTED = ("approx_kl", "clip_fraction_low", "clip_fraction_high", "clip_fraction")


def split_microbatches(batch: GRPOBatch, num_microbatches: int) -> GRPOBatch:
    """Reshapes every per-row field ``(B, ...)`` to ``(A, B / A, ...)`` for ``lax.scan``.

    Args:
        batch: The batch.
        num_microbatches: ``A``; must divide ``B``.

    Returns:
        The same pytree with a leading microbatch axis.

    Raises:
        ValueError: If ``A`` does not divide the number of rows.
    """
    b = batch.batch_size
    if num_microbatches < 1 or b % num_microbatches:
        msg = f"num_microbatches={num_microbatches} must be >= 1 and divide the {b} batch rows"
        raise ValueError(msg)
    a = num_microbatches
    return jax.tree.map(lambda x: x.reshape(a, b // a, *x.shape[1:]), batch)


def _combine_micro_metrics(stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Metrics of the whole batch from per-microbatch metrics stacked on axis 0."""
    out = {}
    tokens = stacked["num_tokens"]
    for name, values in stacked.items():
        if name in _SUMMED:
            out[name] = jnp.sum(values)
        elif name in _TOKEN_WEIGHTED:
            out[name] = jnp.sum(values * tokens) / jnp.maximum(jnp.sum(tokens), 1.0)
        else:
            out[name] = jnp.mean(values)
    return out


def _check_traceable_batch(batch: GRPOBatch) -> None:
    concrete = not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(batch))
    batch.validate(check_values=concrete)


def make_grpo_loss(
    model: nnx.Module,
    config: GRPOConfig,
    *,
    wrt: Any = nnx.Param,
    log_prob_fn: LogProbFn | None = None,
) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """Binds ``model``'s graph and ``config`` into a pure, jit-compiled ``grpo_loss``.

    The returned ``grpo_loss(params, batch, rest=None) -> (loss, metrics)`` is a pure function
    of the parameter state ``params = nnx.state(model, wrt)`` and a :class:`GRPOBatch` (or the
    dict batch form), so ``jax.grad(grpo_loss, has_aux=True)(params, batch)`` works anywhere.
    Variables not selected by ``wrt`` (e.g. frozen base weights under LoRA) are read from
    ``model`` at each call, or taken from ``rest_state`` when given.

    Args:
        model: The policy (an NNX module).
        config: The GRPO options.
        wrt: Filter selecting the differentiable variables (``nnx.Param`` by default).
        log_prob_fn: ``fn(model, batch) -> (log_probs, entropy)``; defaults to
            :func:`~artifex.generative_models.training.rl.logprobs.default_log_prob_fn`.

    Returns:
        ``grpo_loss``.
    """
    graphdef = nnx.graphdef(model)
    if log_prob_fn is None:
        log_prob_fn = default_log_prob_fn(model, temperature=config.temperature)

    @jax.jit
    def _loss(params: nnx.State, rest: nnx.State, batch: GRPOBatch):
        policy = nnx.merge(graphdef, params, rest)
        log_probs, entropy = log_prob_fn(policy, batch)
        return grpo_objective(log_probs, entropy, batch, config)

    def grpo_loss(
        params: nnx.State, batch: GRPOBatch | Mapping[str, Any], rest_state: Any = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """GRPO loss of ``params`` on ``batch``: ``(loss, metrics)`` (pure, jit-compiled)."""
        batch = as_grpo_batch(batch, config) if isinstance(batch, Mapping) else batch
        _check_traceable_batch(batch)
        if rest_state is None:  # read now: a trainer's step replaces (donates) these buffers
            rest_state = nnx.state(model, nnx.Not(wrt))
        return _loss(params, rest_state, batch)

    return grpo_loss


# ---------------------------------------------------------------------------------- trainer
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


def _unshare_buffers(reference: nnx.Module, model: nnx.Module) -> None:
    """Gives ``reference`` its own copy of any array it shares with ``model``.

    ``nnx.clone`` shares arrays; the trainer donates the model's buffers to the compiled step,
    which would delete a reference that still points at them.
    """
    model_ids = {id(x) for x in jax.tree.leaves(nnx.state(model))}
    state = nnx.state(reference)
    if any(id(x) in model_ids for x in jax.tree.leaves(state)):
        nnx.update(
            reference,
            jax.tree.map(lambda x: jnp.array(x, copy=True) if id(x) in model_ids else x, state),
        )


class GRPOTrainer:
    """Applies GRPO updates to an NNX policy through an ``nnx.Optimizer``.

    ``train_step(batch)`` validates the batch on the host, then runs one compiled step:
    per-token log-probs -> advantages -> clipped surrogate + KL + entropy -> gradient ->
    global-norm clipping -> ``optimizer.update``. The step compiles once per batch shape. If
    the loss or gradient is not finite the update is not applied (model and optimizer keep
    their state) and :class:`NonFiniteUpdateError` is raised carrying the metrics.

    Reference policy for the KL term (``beta > 0``), in order: the batch's ``ref_log_probs``;
    ``reference_model`` (run inside the same compiled step); for a LoRA policy trained with
    ``wrt=nnx.LoRAParam``, the same model with its adapters zeroed (the base weights exist
    once). Without any of these the KL term is 0 and a warning says so (the artifex GRPO
    documentation describes the KL penalty as enabled by providing ``ref_log_probs``).

    The step donates the model's and optimizer's buffers (so parameters and optimizer state
    exist once in memory): arrays taken out of the model before a step are invalid after it;
    copy them (``jnp.copy``) to keep them. A ``reference_model`` sharing arrays with the policy
    (``nnx.clone``) gets its own copies when the trainer is built.

    Example::

        optimizer = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
        trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=4))
        metrics = trainer.train_step(batch)   # dict[str, float]

    Args:
        model: The policy: a causal LM (``hidden_states``/``output_embedding``) or any module
            ``model(observations) -> logits``.
        optimizer: ``nnx.Optimizer(model, tx, wrt=...)`` built on ``model``.
        config: GRPO options; defaults to ``GRPOConfig()``.
        reference_model: Optional frozen reference policy (same kind of model).
        log_prob_fn: Optional ``fn(model, batch) -> (log_probs, entropy)`` for custom models.
        mesh: Optional ``jax.sharding.Mesh`` (default: the mesh set with ``jax.set_mesh``, if
            any). The model, reference and optimizer state are placed on it when the trainer is
            built (:func:`~artifex.generative_models.training.sharding.shard_model`,
            :func:`~artifex.generative_models.training.sharding.shard_optimizer`), each batch
            is split over its data axes, and the same compiled step runs with its outputs kept
            in the inputs' layout (so donation reuses the buffers).
        partition_rules: :class:`~artifex.generative_models.training.sharding.PartitionRules`
            (or ``(regex, PartitionSpec)`` pairs) for ``mesh``; default ``PartitionRules()``.
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        config: GRPOConfig | None = None,
        reference_model: nnx.Module | None = None,
        *,
        log_prob_fn: LogProbFn | None = None,
        mesh: Mesh | None = None,
        partition_rules: PartitionRules | Sequence[tuple[str, Any]] | None = None,
    ):
        config = GRPOConfig() if config is None else config
        if not isinstance(model, nnx.Module):
            msg = f"model must be an nnx.Module, got {type(model).__name__}"
            raise TypeError(msg)
        if not isinstance(optimizer, nnx.Optimizer):
            msg = f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}"
            raise TypeError(msg)
        if not isinstance(config, GRPOConfig):
            msg = f"config must be a GRPOConfig, got {type(config).__name__}"
            raise TypeError(msg)
        if reference_model is not None and not isinstance(reference_model, nnx.Module):
            msg = f"reference_model must be an nnx.Module, got {type(reference_model).__name__}"
            raise TypeError(msg)
        if reference_model is model:
            msg = (
                "reference_model must be a frozen copy of the policy (e.g. nnx.clone(model)), "
                "not the policy itself"
            )
            raise ValueError(msg)
        mesh = current_mesh() if mesh is None else mesh
        if mesh is not None and not isinstance(mesh, Mesh):
            msg = f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}"
            raise TypeError(msg)
        if partition_rules is not None and mesh is None:
            msg = "partition_rules were given without a mesh; pass mesh= as well"
            raise TypeError(msg)
        if reference_model is not None:
            # Before placement: device_put onto a mesh may reuse a source buffer, so two models
            # sharing arrays (nnx.clone) would end up sharing device buffers the step donates.
            _unshare_buffers(reference_model, model)
        if mesh is not None:
            shard_model(model, mesh, partition_rules)
            shard_optimizer(optimizer, model, mesh, partition_rules)
            if reference_model is not None:
                shard_model(reference_model, mesh, partition_rules)
        self.mesh = mesh
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.reference_model = reference_model
        self.wrt = optimizer.wrt
        self.log_prob_fn = (
            default_log_prob_fn(model, temperature=config.temperature)
            if log_prob_fn is None
            else log_prob_fn
        )
        self._lora_reference = reference_model is None and _is_lora_only(model, self.wrt)
        self._warned_no_reference = False
        self._num_traces = 0
        self._graphdef = nnx.graphdef(model)
        self._opt_graphdef = nnx.graphdef(optimizer)
        self._ref_graphdef = None if reference_model is None else nnx.graphdef(reference_model)
        shardings = {}
        if mesh is not None:
            # New model/optimizer states keep their inputs' layout: the donated buffers are reused.
            model_layout, opt_layout = (
                jax.tree.map(lambda x: x.sharding, nnx.state(obj)) for obj in (model, optimizer)
            )
            replicated = NamedSharding(mesh, PartitionSpec())
            shardings["out_shardings"] = (model_layout, opt_layout, replicated, replicated)
        self._step_fn = jax.jit(self._step, donate_argnums=(0, 1), static_argnums=(4,), **shardings)
        self._log_probs_fn = jax.jit(self._log_probs)
        self.grpo_loss = make_grpo_loss(model, config, wrt=self.wrt, log_prob_fn=self.log_prob_fn)

    # ----------------------------------------------------------------- public helpers
    @property
    def params(self) -> nnx.State:
        """The trainable state ``nnx.state(model, wrt)`` (what ``grpo_loss`` takes)."""
        return nnx.state(self.model, self.wrt)

    @property
    def num_compilations(self) -> int:
        """How many times the step has been traced (one per distinct batch shape)."""
        return self._num_traces

    @property
    def has_reference(self) -> bool:
        """Whether the step can compute reference log-probs itself."""
        return self.reference_model is not None or self._lora_reference

    # ----------------------------------------------------------------- compiled step
    def _reference(
        self,
        split: tuple[nnx.GraphDef, nnx.State, nnx.State],
        ref_state: nnx.State | None,
    ) -> Any:
        """The reference policy as a module (inside a trace)."""
        if ref_state is not None:
            return nnx.merge(self._ref_graphdef, ref_state)
        # LoRA: the same graph with the adapters zeroed is exactly the base model.
        graphdef, trainable, frozen = split
        return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, trainable), frozen)

    def _needs_reference(self, batch: GRPOBatch, ref_state: nnx.State | None) -> bool:
        return (
            self.config.beta > 0.0
            and batch.ref_log_probs is None
            and (ref_state is not None or self._lora_reference)
        )

    def _step(
        self,
        model_state: nnx.State,
        opt_state: nnx.State,
        ref_state: nnx.State | None,
        batch: GRPOBatch,
        num_microbatches: int,
    ) -> tuple[nnx.State, nnx.State, dict[str, jax.Array], jax.Array]:
        self._num_traces += 1
        config = self.config
        # Leaves captured before merging: merge shares Variables with the state, and the update
        # below mutates them in place.
        old_model_leaves = jax.tree.leaves(model_state)
        old_opt_leaves = jax.tree.leaves(opt_state)
        model = nnx.merge(self._graphdef, model_state)
        optimizer = nnx.merge(self._opt_graphdef, opt_state)
        graphdef, trainable, frozen = nnx.split(model, self.wrt, ...)
        needs_ref = self._needs_reference(batch, ref_state)

        # Advantages and the loss normalizer come from the whole batch, so splitting it into
        # microbatches changes nothing but peak memory.
        advantages = jax.lax.stop_gradient(compute_advantages(batch, config))
        normalizer = losses.loss_normalizer(
            batch.completion_mask, config.loss_aggregation, max_length=config.max_completion_length
        )

        def loss_fn(
            params: nnx.State, mb: GRPOBatch, adv: jax.Array
        ) -> tuple[jax.Array, dict[str, jax.Array]]:
            if needs_ref:
                ref = self._reference((graphdef, params, frozen), ref_state)
                ref_lp, _ = self.log_prob_fn(ref, mb)
                mb = mb.replace(ref_log_probs=jax.lax.stop_gradient(ref_lp))
            policy = nnx.merge(graphdef, params, frozen)
            log_probs, entropy = self.log_prob_fn(policy, mb)
            return grpo_objective(
                log_probs,
                entropy,
                mb,
                config,
                normalizer=normalizer,
                advantages=adv,
                reward_metrics=False,
            )

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if num_microbatches == 1:
            (loss, metrics), grads = grad_fn(trainable, batch, advantages)
        else:
            micro = split_microbatches(batch, num_microbatches)
            if (batch.batch_size // num_microbatches) % batch.group_size:
                micro = micro.replace(shared_prompts=False)  # slices cut through groups
            micro_adv = advantages.reshape(num_microbatches, -1, *advantages.shape[1:])

            def accumulate(acc: nnx.State, xs: tuple[GRPOBatch, jax.Array]):
                (loss_i, metrics_i), grads_i = grad_fn(trainable, *xs)
                return jax.tree.map(jnp.add, acc, grads_i), (loss_i, metrics_i)

            zeros = jax.tree.map(jnp.zeros_like, trainable)
            grads, (micro_loss, micro_metrics) = jax.lax.scan(accumulate, zeros, (micro, micro_adv))
            loss = jnp.sum(micro_loss)
            metrics = _combine_micro_metrics(micro_metrics)
        metrics.update(_reward_metrics(batch, advantages))

        grad_norm = optax.tree.norm(grads)
        if config.max_grad_norm is not None:
            scale = jnp.minimum(1.0, config.max_grad_norm / jnp.maximum(grad_norm, 1e-12))
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        optimizer.update(model, grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def keep(new_state: nnx.State, old_leaves: list[jax.Array]) -> nnx.State:
            leaves, treedef = jax.tree.flatten(new_state)
            kept = [jnp.where(ok, n, o) for n, o in zip(leaves, old_leaves, strict=True)]
            return jax.tree.unflatten(treedef, kept)

        new_model_state = keep(nnx.state(model), old_model_leaves)
        new_opt_state = keep(nnx.state(optimizer), old_opt_leaves)
        metrics = dict(metrics, grad_norm=grad_norm.astype(jnp.float32))
        return new_model_state, new_opt_state, metrics, ok

    def _log_probs(
        self, model_state: nnx.State, ref_state: nnx.State | None, batch: GRPOBatch
    ) -> tuple[jax.Array, jax.Array | None]:
        model = nnx.merge(self._graphdef, model_state)
        log_probs, _ = self.log_prob_fn(model, batch)
        ref_log_probs = None
        if self._needs_reference(batch, ref_state):
            ref = self._reference(nnx.split(model, self.wrt, ...), ref_state)
            ref_log_probs, _ = self.log_prob_fn(ref, batch)
        return log_probs, ref_log_probs

    # ----------------------------------------------------------------- the step
    def prepare_batch(self, batch: GRPOBatch | Mapping[str, Any]) -> GRPOBatch:
        """Converts and validates a batch on the host (what ``train_step`` does first).

        Args:
            batch: A :class:`GRPOBatch` or the dict batch form.

        Returns:
            The validated ``GRPOBatch`` of JAX arrays (with a mesh: rows split over its data
            axes by :func:`~artifex.generative_models.training.sharding.shard_batch`).

        Raises:
            ValueError: The batch breaks its contract (see :meth:`GRPOBatch.validate`), its
                group size is < 2 without precomputed advantages, or (with a mesh) its rows
                cannot be split evenly over the data shards.
            TypeError: Wrong batch type or dtypes.
        """
        batch = as_grpo_batch(batch, self.config).validate()
        if not batch.shared_prompts and batch.prompts_shared_within_groups():
            batch = batch.replace(shared_prompts=True)  # encode each prompt once per group
        if batch.group_size < 2 and batch.advantages is None and batch.group_ids is None:
            msg = f"batch group_size must be >= 2 to compare completions, got {batch.group_size}"
            raise ValueError(msg)
        if self.mesh is not None:
            batch = shard_batch(batch, self.mesh)
        return batch

    def compute_log_probs(self, batch: GRPOBatch | Mapping[str, Any]) -> GRPOBatch:
        """Fills ``old_log_probs`` (current policy) and ``ref_log_probs`` (reference) of a batch.

        Used before ``mu > 1`` optimization iterations on one generation batch: the old
        log-probs are those of the policy that sampled the batch, scored by the training graph,
        and the reference log-probs are computed once instead of at every iteration. Fields the
        batch already has are kept; the reference is only scored when ``beta > 0`` and the
        trainer has one.

        Args:
            batch: The batch.

        Returns:
            The batch with the log-prob fields set (no gradient, one compiled forward pass).
        """
        batch = self.prepare_batch(batch)
        ref_state = None if self.reference_model is None else nnx.state(self.reference_model)
        log_probs, ref_log_probs = self._log_probs_fn(nnx.state(self.model), ref_state, batch)
        if batch.old_log_probs is None:
            batch = batch.replace(old_log_probs=log_probs)
        if batch.ref_log_probs is None and ref_log_probs is not None:
            batch = batch.replace(ref_log_probs=ref_log_probs)
        return batch

    def train_step(
        self, batch: GRPOBatch | Mapping[str, Any], *, num_microbatches: int = 1
    ) -> dict[str, float]:
        """One GRPO update on ``batch``.

        Args:
            batch: A :class:`GRPOBatch` (flat prompt-major rows) or the dict batch form
                (``observations``, ``actions``, ``rewards``, optional ``log_probs``,
                ``ref_log_probs``, ``group_size``).
            num_microbatches: Accumulate gradients over this many equal row slices of the batch
                inside the compiled step (a ``lax.scan``): the update is the full-batch update
                (advantages and loss normalization use the whole batch) with less peak memory.

        Returns:
            Metrics as Python floats: those of :func:`grpo_objective` plus ``grad_norm``
            (before clipping).

        Raises:
            ValueError: Invalid batch or ``num_microbatches`` (raised before anything is traced).
            TypeError: Wrong batch type or dtypes.
            NonFiniteUpdateError: Non-finite loss or gradient; nothing was updated.
        """
        batch = self.prepare_batch(batch)
        if (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or num_microbatches < 1
            or batch.batch_size % num_microbatches
        ):
            msg = (
                f"num_microbatches must be an int >= 1 dividing the {batch.batch_size} batch "
                f"rows, got {num_microbatches!r}"
            )
            raise ValueError(msg)
        if (
            self.config.beta > 0.0
            and batch.ref_log_probs is None
            and not self.has_reference
            and not self._warned_no_reference
        ):
            logger.warning(
                "GRPOConfig.beta=%s but the batch has no ref_log_probs and the trainer has no "
                "reference_model: the KL penalty is 0 for such batches.",
                self.config.beta,
            )
            self._warned_no_reference = True
        ref_state = None if self.reference_model is None else nnx.state(self.reference_model)
        model_state = nnx.state(self.model)
        opt_state = nnx.state(self.optimizer)
        new_model_state, new_opt_state, metrics, ok = self._step_fn(
            model_state, opt_state, ref_state, batch, num_microbatches
        )
        nnx.update(self.model, new_model_state)
        nnx.update(self.optimizer, new_opt_state)
        host = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not bool(ok):
            msg = (
                f"non-finite loss or gradient (total_loss={host['total_loss']}, "
                f"grad_norm={host['grad_norm']}); the update was not applied"
            )
            raise NonFiniteUpdateError(msg, host)
        return host

    # ----------------------------------------------------------------- the whole loop
    def train(
        self,
        dataset: Any,
        *,
        tokenizer: Any,
        rewards: Any,
        num_steps: int | None = None,
        config: Any = None,
        rollout_config: Any = None,
        eval_dataset: Any = None,
        eval_reward: Any = None,
        **loop_options: Any,
    ) -> Any:
        """Runs the full GRPO loop on ``dataset``: rollouts, updates, logging, checkpoints.

        A shortcut for :func:`artifex.generative_models.training.rl.loop.train`.

        Args:
            dataset: Rows (mappings) with a prompt column and the columns the rewards read.
            tokenizer: The policy's tokenizer.
            rewards: A ``RewardCombiner``, a reward function or a list of them.
            num_steps: Generation batches to train on (shortcut for ``TrainConfig.num_steps``).
            config: A ``TrainConfig``; ``num_steps`` and ``loop_options`` override its fields.
            rollout_config: A ``RolloutConfig`` (generation settings).
            eval_dataset: Held-out rows for pass@1.
            eval_reward: Scores evaluation completions (default: the first reward function).
            **loop_options: Other ``TrainConfig`` fields (``prompts_per_step=16``, ...).

        Returns:
            The loop's ``TrainResult``.
        """
        from artifex.generative_models.training.rl.loop import TrainConfig
        from artifex.generative_models.training.rl.loop import train as run_loop

        if num_steps is not None:
            loop_options["num_steps"] = num_steps
        config = (
            TrainConfig(**loop_options)
            if config is None
            else dataclasses.replace(config, **loop_options)
        )
        return run_loop(
            self,
            tokenizer,
            dataset,
            rewards,
            config,
            rollout_config,
            eval_dataset=eval_dataset,
            eval_reward=eval_reward,
        )
