"""The trainer's inputs: checked, placed, and the small array helpers its shell needs.

What ``GRPOTrainer`` does around its compiled step that is not the update itself: the checks
of its constructor's arguments, the log-prob function it runs, placing the models on a mesh,
the token-range check of a user's batch, the update's metrics on the host, and PRNG keys moved
between the host and the mesh.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.core.logprobs import LogProbFn, default_log_prob_fn
from artifex.generative_models.training.rl.core.packing import packed_log_prob_fn
from artifex.generative_models.training.rl.core.routing_replay import routing_replay_log_prob_fn
from artifex.generative_models.training.rl.core.teacher import check_teacher_setup
from artifex.generative_models.training.rl.update.layerwise import check_layerwise_model
from artifex.generative_models.training.rl.update.state import NonFiniteUpdateError
from artifex.generative_models.training.sharding import path_parts, shard_model, shard_optimizer

__all__ = [
    "check_expert_options",
    "check_routed_batch",
    "check_trainer_inputs",
    "host_update_metrics",
    "place_models",
    "trainer_log_prob_fn",
]

logger = logging.getLogger("artifex.generative_models.training.rl.update.trainer")


def _vocab_size(model: Any) -> int | None:
    """The vocabulary size of a causal LM (``None`` when the model is not one)."""
    if not (hasattr(model, "hidden_states") and hasattr(model, "output_embedding")):
        return None
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    try:
        return int(jnp.shape(model.output_embedding())[-1])
    except Exception:  # an unusual model: skip the check rather than fail
        return None


def _is_moe(model: Any) -> bool:
    """Whether ``model`` is a mixture-of-experts causal LM (``config.is_moe``)."""
    config = getattr(model, "config", None)
    return hasattr(model, "hidden_states") and getattr(config, "is_moe", False) is True


def _expert_options(config: GRPOConfig) -> list[str]:
    """The mixture-of-experts options ``config`` sets, as ``name=value`` (empty: none)."""
    return [
        f"{name}={getattr(config, name)}"
        for name, default in (("routing_replay", False), ("moe_aux_loss_coef", 0.0))
        if getattr(config, name) != default
    ]


def check_expert_options(model: Any, config: GRPOConfig, log_prob_fn: Any = None) -> None:
    """Raises unless ``GRPOConfig.routing_replay`` / ``moe_aux_loss_coef`` fit the policy.

    They configure the trainer's own log-prob function of a mixture-of-experts policy
    (:func:`trainer_log_prob_fn`): a model without experts, or a custom ``log_prob_fn`` (which
    would run instead), is refused when either is set.

    Args:
        model: The policy.
        config: The ``GRPOConfig``.
        log_prob_fn: The trainer's custom log-prob function, or ``None``.

    Raises:
        ValueError: An option set for a model without experts or with a custom
            ``log_prob_fn``.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.rl.update.trainer_setup import (
        ...     check_expert_options)
        >>> dense = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> check_expert_options(dense, GRPOConfig())  # nothing set: nothing to check
        >>> check_expert_options(dense, GRPOConfig(routing_replay=True))
        Traceback (most recent call last):
            ...
        ValueError: GRPOConfig.routing_replay=True needs a mixture-of-experts policy ...
    """
    options = _expert_options(config)
    if not options:
        return
    what = f"GRPOConfig.{' and '.join(options)}"
    if not _is_moe(model):
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        msg = (
            f"{what} needs a mixture-of-experts policy (a CausalLM of model_type "
            f"'qwen3_moe'), got model_type {kind!r}, which has no experts"
        )
        raise ValueError(msg)
    if log_prob_fn is not None:
        msg = (
            f"{what} configures the trainer's own mixture-of-experts log-probs, which a custom "
            "log_prob_fn replaces: leave log_prob_fn out, or set routing_replay and "
            "aux_loss_coef on routing_replay_log_prob_fn(...) and keep the config's defaults"
        )
        raise ValueError(msg)


def trainer_log_prob_fn(
    model: Any, config: GRPOConfig, log_prob_fn: LogProbFn | None
) -> tuple[LogProbFn, bool]:
    """The log-prob function a ``GRPOTrainer`` runs, and whether it is its mixture-of-experts one.

    ``log_prob_fn`` when given. Otherwise the model's
    :func:`~artifex.generative_models.training.rl.core.logprobs.default_log_prob_fn`: for a
    causal LM with ``packed_hidden_states`` wrapped in
    :func:`~artifex.generative_models.training.rl.core.packing.packed_log_prob_fn` (packed batches
    run packed), and for a mixture-of-experts causal LM
    :func:`~artifex.generative_models.training.rl.core.routing_replay.routing_replay_log_prob_fn`
    with ``GRPOConfig.routing_replay`` and ``moe_aux_loss_coef`` (the update logs
    ``moe/routing_agreement`` and ``moe/aux_loss``; batches are not packed).

    Args:
        model: The policy.
        config: The ``GRPOConfig`` (temperature, rematerialization, scanned layers, the
            mixture-of-experts options).
        log_prob_fn: The user's log-prob function, or ``None``.

    Returns:
        ``(log_prob_fn, moe)``.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.rl.update.trainer_setup import (
        ...     trainer_log_prob_fn)
        >>> cfg = CausalLMConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8,
        ...     intermediate_size=16, num_layers=1, num_heads=2, qk_norm=True, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=6)
        >>> fn, moe = trainer_log_prob_fn(CausalLM(cfg, rngs=nnx.Rngs(0)),
        ...                               GRPOConfig(routing_replay=True), None)
        >>> type(fn).__name__, fn.routing_replay, moe
        ('RoutingReplayLogProbFn', True, True)
    """
    if log_prob_fn is not None:
        return log_prob_fn, False
    options = dict(
        temperature=config.temperature, remat=config.remat_option, scan_layers=config.scan_layers
    )
    fn = default_log_prob_fn(model, **options)  # also checks remat against the model
    if _is_moe(model):
        replay = routing_replay_log_prob_fn(
            routing_replay=config.routing_replay, aux_loss_coef=config.moe_aux_loss_coef, **options
        )
        return replay, True
    if callable(getattr(model, "packed_hidden_states", None)):
        # Packed batches (maybe_pack) run packed; every other batch as before.
        fn = packed_log_prob_fn(fn, **options)
    return fn, False


def check_routed_batch(batch: GRPOBatch, config: GRPOConfig, *, moe: bool) -> None:
    """Raises when the trainer replays routing and ``batch`` has no routed experts.

    Args:
        batch: A user's batch.
        config: The ``GRPOConfig``.
        moe: Whether the trainer runs its mixture-of-experts log-probs.

    Raises:
        ValueError: ``routing_replay`` without ``batch.routed_experts``.

    Examples:
        >>> from artifex.generative_models.training.rl import GRPOBatch, GRPOConfig
        >>> from artifex.generative_models.training.rl.update.trainer_setup import (
        ...     check_routed_batch)
        >>> batch = GRPOBatch.zeros(1, 2, 4, 3)
        >>> check_routed_batch(batch, GRPOConfig(), moe=True)  # no replay: nothing needed
        >>> check_routed_batch(batch, GRPOConfig(routing_replay=True), moe=True)
        Traceback (most recent call last):
            ...
        ValueError: GRPOConfig.routing_replay=True needs batches with routed_experts ...
    """
    if moe and config.routing_replay and batch.routed_experts is None:
        msg = (
            "GRPOConfig.routing_replay=True needs batches with routed_experts (B, P + T, L, k): "
            "the rollout records them (generate(..., record_routing=True), as the library's "
            "rollout does for this config)"
        )
        raise ValueError(msg)


def _check_token_range(batch: GRPOBatch, vocab_size: int | None) -> None:
    """Token ids outside ``[0, vocab_size)`` would be clamped silently by the gathers."""
    if vocab_size is None:
        return
    for name in ("prompt_ids", "completion_ids"):
        value = getattr(batch, name)
        if not jnp.issubdtype(jnp.result_type(value), jnp.integer):
            continue
        mask = batch.completion_mask if name == "completion_ids" else batch.prompt_mask
        if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in (value, mask)):
            continue  # multi-host shards: each process checks what it feeds (the sampler)
        host = np.asarray(value)
        if mask is not None and np.shape(mask) == host.shape:  # padding may hold anything
            host = np.where(np.asarray(mask) > 0, host, 0)
        if host.size and (host.min() < 0 or host.max() >= vocab_size):
            bad = np.argwhere((host < 0) | (host >= vocab_size))[0]
            msg = (
                f"GRPOBatch.{name} must hold token ids in [0, {vocab_size}) (the model's "
                f"vocabulary), got {int(host[tuple(bad)])} at row {int(bad[0])}: check that "
                "the tokenizer matches the model"
            )
            raise ValueError(msg)


def _uncommitted_key(key: jax.Array) -> jax.Array:
    """A copy of a PRNG key that is not committed to any device (samplers use it anywhere).

    Keys taken out of a train state live on the training mesh; the rollout may sample on
    other devices (a placement of its own), so the trainer keeps its ``rng`` on the host side.
    """
    local = key.addressable_shards[0].data if isinstance(key, jax.Array) else key
    data = np.asarray(jax.random.key_data(local))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(local))


def _holds_per_layer_state(optimizer: nnx.Optimizer) -> bool:
    """Whether the optimizer state has per-layer entries (paths `... layers <int> ...`)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(nnx.state(optimizer.opt_state))
    for keypath, _ in leaves:
        keys = path_parts(keypath)
        if any(a == "layers" and isinstance(b, int) for a, b in itertools.pairwise(keys)):
            return True
    return False


def _replicated_key(key: jax.Array, mesh: Mesh) -> jax.Array:
    """``key`` replicated over ``mesh`` (which may span several processes)."""
    sharding = NamedSharding(mesh, PartitionSpec())
    if getattr(key, "sharding", None) == sharding:
        return key
    data = np.asarray(jax.random.key_data(key))
    arr = jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])
    return jax.random.wrap_key_data(arr, impl=jax.random.key_impl(key))


def _unshare_buffers(reference: nnx.Module, model: nnx.Module) -> None:
    """Gives ``reference`` its own copy of any array it shares with ``model``.

    ``nnx.clone`` shares arrays; the compiled step reuses the model's buffers for its outputs
    (they are donated to XLA), which would delete a reference that still points at them.
    """
    model_ids = {id(x) for x in jax.tree.leaves(nnx.state(model))}
    state = nnx.state(reference)
    if any(id(x) in model_ids for x in jax.tree.leaves(state)):
        nnx.update(
            reference,
            jax.tree.map(lambda x: jnp.array(x, copy=True) if id(x) in model_ids else x, state),
        )


def check_trainer_inputs(
    model: Any,
    optimizer: Any,
    config: Any,
    reference_model: Any,
    *,
    mesh: Any,
    partition_rules: Any,
    teacher_model: Any,
    teacher_partition_rules: Any,
    log_prob_fn: Any,
) -> None:
    """Raises unless ``GRPOTrainer``'s arguments work together (its constructor's checks).

    Args:
        model: The policy.
        optimizer: Its ``nnx.Optimizer``.
        config: The ``GRPOConfig``.
        reference_model: The reference policy, or ``None``.
        mesh: The mesh, or ``None``.
        partition_rules: The policy's partition rules, or ``None``.
        teacher_model: The distillation teacher, or ``None``.
        teacher_partition_rules: The teacher's partition rules, or ``None``.
        log_prob_fn: A custom log-prob function, or ``None``.

    Raises:
        TypeError: An argument of the wrong type, or partition rules without a mesh.
        ValueError: Arguments that do not combine (the policy as its own reference,
            ``layerwise_update`` with a custom ``log_prob_fn`` or a mesh, an optimizer built
            before ``stack_layers``, a teacher that does not fit, ``routing_replay`` or
            ``moe_aux_loss_coef`` without experts, see :func:`check_expert_options`).

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.rl.update.trainer_setup import (
        ...     check_trainer_inputs)
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> check_trainer_inputs(model, optimizer, GRPOConfig(), model, mesh=None,
        ...     partition_rules=None, teacher_model=None, teacher_partition_rules=None,
        ...     log_prob_fn=None)
        Traceback (most recent call last):
            ...
        ValueError: reference_model must be a frozen copy of the policy ...
    """
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
    if mesh is not None and not isinstance(mesh, Mesh):
        msg = f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}"
        raise TypeError(msg)
    if partition_rules is not None and mesh is None:
        msg = "partition_rules were given without a mesh; pass mesh= as well"
        raise TypeError(msg)
    if teacher_partition_rules is not None and mesh is None:
        msg = "teacher_partition_rules were given without a mesh; pass mesh= as well"
        raise TypeError(msg)
    check_teacher_setup(model, teacher_model, config, custom_log_prob_fn=log_prob_fn is not None)
    check_expert_options(model, config, log_prob_fn)
    if config.layerwise_update:
        if log_prob_fn is not None:
            msg = (
                "GRPOConfig.layerwise_update runs the causal LM's own layers and output "
                "projection; it cannot use a custom log_prob_fn"
            )
            raise ValueError(msg)
        if mesh is not None:
            msg = "GRPOConfig.layerwise_update does not support a mesh yet; leave mesh=None"
            raise ValueError(msg)
        check_layerwise_model(model, reference_model, optimizer.wrt)
    if getattr(model, "layers_stacked", False) and _holds_per_layer_state(optimizer):
        msg = (
            "the optimizer was built before model.stack_layers(): its state holds the "
            "per-layer parameters; build the nnx.Optimizer after stacking the layers"
        )
        raise ValueError(msg)


def place_models(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    mesh: Mesh | None,
    partition_rules: Any,
    *,
    reference_model: nnx.Module | None,
    teacher_model: nnx.Module | None,
    teacher_partition_rules: Any,
) -> None:
    """Gives the frozen models their own buffers and places every model on ``mesh``.

    The compiled step donates the policy's buffers: a reference or teacher sharing arrays
    with it (``nnx.clone``) gets copies first. On a mesh the policy and its optimizer state
    follow ``partition_rules``, the teacher ``teacher_partition_rules`` (default: the policy's).

    Args:
        model: The policy.
        optimizer: Its ``nnx.Optimizer``.
        mesh: The mesh (``None``: nothing is placed).
        partition_rules: The policy's partition rules (``None``: the defaults).
        reference_model: The reference policy, or ``None``.
        teacher_model: The distillation teacher, or ``None``.
        teacher_partition_rules: The teacher's rules, or ``None``.

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training import make_mesh
        >>> from artifex.generative_models.training.rl.update.trainer_setup import place_models
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> reference = nnx.clone(model)  # shares the policy's arrays
        >>> reference.kernel[...] is model.kernel[...]
        True
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> place_models(model, optimizer, make_mesh(), None, reference_model=reference,
        ...              teacher_model=None, teacher_partition_rules=None)
        >>> reference.kernel[...] is model.kernel[...]  # a copy of its own, equal values
        False
        >>> bool((reference.kernel[...] == model.kernel[...]).all())
        True
        >>> model.kernel[...].sharding.mesh.axis_names
        ('data', 'fsdp', 'tensor')
    """
    if reference_model is not None:
        # Before placement: device_put onto a mesh may reuse a source buffer, so two models
        # sharing arrays (nnx.clone) would end up sharing device buffers the step donates.
        _unshare_buffers(reference_model, model)
    if teacher_model is not None:
        _unshare_buffers(teacher_model, model)
    if mesh is not None:
        shard_model(model, mesh, partition_rules)
        shard_optimizer(optimizer, model, mesh, partition_rules)
        if reference_model is not None:
            shard_model(reference_model, mesh, partition_rules)
        if teacher_model is not None:
            teacher_rules = teacher_partition_rules
            if teacher_rules is None:  # laid out as the policy
                teacher_rules = partition_rules
            shard_model(teacher_model, mesh, teacher_rules)


def host_update_metrics(
    metrics: Mapping[str, jax.Array], *, step: int | jax.Array, config: GRPOConfig
) -> dict[str, float]:
    """An update's metrics as floats, raising if the update was rejected.

    Warns when the batch had no reward or advantage signal (the update was then skipped, or
    only its KL and entropy terms applied).

    Args:
        metrics: The metrics the compiled step returned (the guard's flags among them).
        step: The optimizer step the update was tried at, for the message.
        config: The run's ``GRPOConfig`` (which terms an update without signal applies).

    Returns:
        The metrics without the guard's flags.

    Raises:
        NonFiniteUpdateError: The update was not finite (the state it returned is the state
            before it).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.rl.update.trainer_setup import (
        ...     host_update_metrics)
        >>> flags = {"finite_update": 1.0, "finite_params": 1.0, "finite_optimizer_state": 1.0,
        ...          "update_applied": 1.0, "reward_signal": 1.0}
        >>> metrics = {"total_loss": jnp.float32(0.25), "grad_norm": jnp.float32(1.5), **flags}
        >>> host_update_metrics(metrics, step=0, config=GRPOConfig())
        {'grad_norm': 1.5, 'total_loss': 0.25}
        >>> rejected = {**metrics, "finite_update": 0.0, "grad_norm": jnp.float32(jnp.nan)}
        >>> host_update_metrics(rejected, step=3, config=GRPOConfig())
        Traceback (most recent call last):
            ...
        artifex...NonFiniteUpdateError: non-finite grad_norm=nan at optimizer step 3; ...
    """
    host = {k: float(v) for k, v in jax.device_get(dict(metrics)).items()}
    ok = host.pop("finite_update") > 0
    finite_params = host.pop("finite_params") > 0
    finite_opt = host.pop("finite_optimizer_state") > 0
    applied = host.pop("update_applied") > 0
    if host.pop("reward_signal") == 0 and ok and config.policy_loss_coeff > 0.0:
        logger.warning(
            "every reward of this batch is NaN (no reward signal): the reward metrics are "
            "NaN and %s; check the reward functions",
            "only the KL and entropy terms were applied"
            if applied
            else "the update was skipped (parameters unchanged)",
        )
    elif host.get("advantage_signal", 1.0) == 0 and ok and config.distillation_coeff == 0.0:
        logger.warning(
            "every advantage of this batch is zero (each group's rewards are equal): %s",
            "only the KL and entropy terms were applied (GRPOConfig.update_without_advantage=True)"
            if applied
            else "the update was skipped (parameters and optimizer unchanged; "
            "GRPOConfig.update_without_advantage=True applies such updates)",
        )
    if not ok:
        bad = [
            f"{name}={host[name]}"
            for name in ("total_loss", "grad_norm")
            if not math.isfinite(host[name])
        ]
        if not finite_params:
            bad.append("updated parameters")
        if not finite_opt:
            bad.append("updated optimizer state")
        step = int(jax.device_get(step))
        msg = (
            f"non-finite {', '.join(bad) or 'values'} at optimizer step {step}; the update "
            "was not applied (parameters and optimizer state are unchanged): lower the "
            "learning rate, clip gradients (GRPOConfig.max_grad_norm) or check the batch"
        )
        raise NonFiniteUpdateError(msg, host)
    return host
