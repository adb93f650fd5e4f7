r"""Rollout routing replay (R3) for mixture-of-experts policies: log-probs under recorded routing.

At rollout the sampler records the experts every token was routed to
(``generate(..., record_routing=True)`` -> ``SamplerOutput.routed_experts`` ->
``GRPOBatch.routed_experts``). In the update the router may pick other experts for the same
tokens (other numerics, other weights): the token's log-prob is then that of another
computation than the one that sampled it, and the importance ratio
``rho = pi_theta(o_t) / pi_old(o_t)`` drifts even where ``theta`` did not move. With replay the
update routes each token to the recorded experts; the routing weights still come from the
current router (``softmax`` of its logits at the recorded experts), so the router keeps its
gradient. With the old log-probs computed under the same replayed routing, the ratio of the
first update of a batch is exactly 1.

:func:`routing_replay_log_probs` returns the log-probs, the entropies and two metrics:
``moe/routing_agreement`` (the fraction of (token, layer) pairs whose current router picks the
recorded experts; 1 without replay) and ``moe/aux_loss`` (the load-balancing loss of
:func:`~artifex.generative_models.models.causal_lm.moe.load_balancing_loss`).
:func:`routing_replay_log_prob_fn` (a :class:`RoutingReplayLogProbFn`) is the log-prob function
of ``GRPOTrainer(log_prob_fn=...)``; with ``aux_loss_coef > 0`` it adds
``aux_loss_coef * aux_loss``'s gradient to the update's. ``GRPOTrainer`` uses one by itself for
a mixture-of-experts policy, configured by ``GRPOConfig.routing_replay`` and
``GRPOConfig.moe_aux_loss_coef``, and logs the two metrics with the update's.

References:
    Ma et al., 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
    Routers", arXiv:2510.11370. Fedus et al., 2021, "Switch Transformers", arXiv:2101.03961.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from artifex.generative_models.models.causal_lm.moe import load_balancing_loss, routing_agreement
from artifex.generative_models.training.rl.core.logprobs import chunked_token_log_probs
from artifex.generative_models.utils.validation import (
    check_bool,
    check_float,
    check_int,
    check_remat,
)

if TYPE_CHECKING:
    from artifex.generative_models.training.rl.core.batch import GRPOBatch

__all__ = ["RoutingReplayLogProbFn", "routing_replay_log_prob_fn", "routing_replay_log_probs"]


def _check_model(model: Any) -> None:
    config = getattr(model, "config", None)
    if not getattr(config, "is_moe", False):
        msg = (
            "routing replay needs a mixture-of-experts causal LM (model_type 'qwen3_moe'), got "
            f"{getattr(config, 'model_type', type(model).__name__)!r}"
        )
        raise ValueError(msg)


def _replay(batch: GRPOBatch, routing_replay: bool) -> jax.Array | None:
    """The batch's recorded experts as ``(L, B, P + T, k)``, or None (the routers choose)."""
    if not routing_replay:
        return None
    if batch.routed_experts is None:
        msg = (
            "routing_replay=True needs GRPOBatch.routed_experts (the rollout's routed experts: "
            "generate(..., record_routing=True))"
        )
        raise ValueError(msg)
    return jnp.moveaxis(jnp.asarray(batch.routed_experts, jnp.int32), 2, 0)


def routing_replay_log_probs(
    model: Any,
    batch: GRPOBatch,
    *,
    routing_replay: bool = True,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    remat: bool | int = False,
    scan_layers: bool = False,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Per-token log-probs of a mixture-of-experts policy, its routers replaying the rollout's.

    The same values as ``causal_lm_log_probs`` when the recorded experts are the ones the
    routers pick (or ``routing_replay=False``); a batch with shared prompts runs as one
    ``[prompt ; completion 1 ; ... ; completion G]`` row per group (the prompt's recorded
    experts read from the group's first row).

    Args:
        model: A mixture-of-experts ``CausalLM``.
        batch: The batch; with ``routing_replay``, ``routed_experts`` ``(B, P + T, L, k)``.
        routing_replay: Route to ``batch.routed_experts`` (-1 entries: the router's choice);
            False: the routers choose (the metrics are still computed).
        chunk_size: Rows per logits chunk (see ``chunked_token_log_probs``).
        temperature: Logits are divided by it.
        remat: Rematerialize the decoder layers (True) or every n-th layer (an int n).
        scan_layers: Run the decoder layers as one ``lax.scan`` over ``model.layer_stack()``.

    Returns:
        ``(log_probs (B, T), entropy (B, T), metrics)`` with the float32 scalars
        ``metrics["moe/routing_agreement"]`` (over the layers and the positions whose
        log-probs count: the completion mask, shifted to the position that predicts each
        token) and ``metrics["moe/aux_loss"]`` (over every real token of the pass).

    Raises:
        ValueError: For a model without experts, or ``routing_replay`` without
            ``batch.routed_experts``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl import GRPOBatch
        >>> from artifex.generative_models.training.rl.core.routing_replay import (
        ...     routing_replay_log_probs)
        >>> cfg = CausalLMConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8,
        ...     intermediate_size=16, num_layers=1, num_heads=2, qk_norm=True, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=6)
        >>> model = CausalLM(cfg, rngs=nnx.Rngs(0))
        >>> batch = GRPOBatch(prompt_ids=jnp.array([[3, 4], [3, 4]]),
        ...     completion_ids=jnp.array([[1, 2], [5, 6]]), completion_mask=jnp.ones((2, 2)),
        ...     rewards=jnp.array([1.0, 0.0]), group_size=2,
        ...     routed_experts=-jnp.ones((2, 4, 1, 2), jnp.int32))  # nothing recorded
        >>> logp, entropy, metrics = routing_replay_log_probs(model, batch)
        >>> logp.shape, float(metrics["moe/routing_agreement"])
        ((2, 2), 1.0)
    """
    _check_model(model)
    remat = check_remat("remat", remat)
    replay = _replay(batch, routing_replay)
    b, p = batch.prompt_ids.shape
    t = batch.completion_ids.shape[1]
    prompt_mask = batch.prompt_mask
    if prompt_mask is None:
        prompt_mask = jnp.ones((b, p), jnp.int32)
    prompt_mask = jnp.asarray(prompt_mask, jnp.int32)
    options: dict[str, Any] = {"remat": remat} if remat else {}
    if scan_layers and callable(getattr(model, "layer_stack", None)):
        stack = model.layer_stack()
        if stack is not None:
            options["layer_stack"] = stack
    prompt_ids = batch.prompt_ids.astype(jnp.int32)
    completion_ids = batch.completion_ids.astype(jnp.int32)
    g = batch.group_size
    if batch.shared_prompts and g > 1 and b % g == 0:
        routing: jax.Array | bool = True
        if replay is not None:  # rows [prompt ; completion 1 ; ... ; completion G]
            num_layers, k = replay.shape[0], replay.shape[-1]
            completions = replay[:, :, p:].reshape(num_layers, b // g, g * t, k)
            routing = jnp.concatenate([replay[:, ::g, :p], completions], axis=2)
        prompt_hidden, completion_hidden, trace = model.shared_prefix_hidden_states(
            prompt_ids[::g],
            completion_ids,
            prompt_mask=prompt_mask[::g],
            routing=routing,
            **options,
        )
        first = jnp.repeat(prompt_hidden[:, -1:], g, axis=0)
        hidden = jnp.concatenate([first, completion_hidden[:, :-1]], axis=1)
        agree = trace.agreement  # (L, B / G, P + G T) -> per row (L, B, P + T)
        prompt_part = jnp.repeat(agree[:, :, :p], g, axis=1)
        completion_part = agree[:, :, p:].reshape(agree.shape[0], b, t)
        agreement = jnp.concatenate([prompt_part, completion_part], axis=2)
    else:
        ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
        mask = jnp.concatenate([prompt_mask, jnp.ones((b, t), jnp.int32)], axis=1)
        hidden, _, trace = model.hidden_states(
            ids, attention_mask=mask, routing=True if replay is None else replay, **options
        )
        hidden = hidden[:, p - 1 : p + t - 1]
        agreement = trace.agreement
    # the position predicting completion token j is P - 1 + j
    counted = jnp.zeros((b, p + t), jnp.float32)
    counted = counted.at[:, p - 1 : p + t - 1].set(jnp.asarray(batch.completion_mask, jnp.float32))
    metrics = {
        "moe/routing_agreement": routing_agreement(
            dataclasses.replace(trace, agreement=agreement), counted
        ),
        "moe/aux_loss": load_balancing_loss(trace),
    }
    rows = getattr(model, "output_embedding_rows", None)
    weight = rows() if callable(rows) else None
    transposed = weight is not None
    if weight is None:
        weight = model.output_embedding()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if temperature != 1.0 and softcap is None:
        hidden = hidden / jnp.asarray(temperature, hidden.dtype)
    log_probs, entropy = chunked_token_log_probs(
        hidden,
        weight,
        completion_ids,
        chunk_size=chunk_size,
        transposed=transposed,
        softcap=softcap,
        temperature=1.0 if softcap is None else temperature,
    )
    return log_probs, entropy, metrics


@jax.custom_vjp
def _with_aux_gradient(log_probs: jax.Array, aux: jax.Array, coef: jax.Array) -> jax.Array:
    """``log_probs``; its backward pass also sends ``coef`` to ``aux`` (Megatron-LM's scaler)."""
    return log_probs


def _with_aux_fwd(log_probs, aux, coef):
    return log_probs, (aux, coef)


def _with_aux_bwd(residuals, cotangent):
    aux, coef = residuals
    return cotangent, jnp.broadcast_to(coef, aux.shape).astype(aux.dtype), jnp.zeros_like(coef)


_with_aux_gradient.defvjp(_with_aux_fwd, _with_aux_bwd)


@dataclasses.dataclass(frozen=True)
class RoutingReplayLogProbFn:
    """``fn(model, batch) -> (log_probs, entropy)`` of a mixture-of-experts policy, with replay.

    Built by :func:`routing_replay_log_prob_fn` (which checks the options); the fields are its
    arguments. :meth:`log_probs_and_metrics` also returns the metrics of
    :func:`routing_replay_log_probs`: the GRPO update calls it (any ``log_prob_fn`` with such
    a method) and logs them with its own metrics, and calls :meth:`for_microbatches` when it
    runs in slices.

    Attributes:
        routing_replay: Route to the recorded experts (False: the routers choose).
        aux_loss_coef: Weight of the load-balancing loss's gradient (0: none).
        chunk_size: Rows per logits chunk.
        temperature: The sampling temperature.
        remat: Rematerialize the decoder layers (True) or every n-th layer (an int n).
        scan_layers: Run the decoder layers as one ``lax.scan``.
        return_metrics: Calling it returns ``(log_probs, entropy, metrics)``.

    Examples:
        >>> from artifex.generative_models.training.rl.core.routing_replay import (
        ...     routing_replay_log_prob_fn)
        >>> fn = routing_replay_log_prob_fn(aux_loss_coef=0.01)
        >>> type(fn).__name__, fn.for_microbatches(4).aux_loss_coef
        ('RoutingReplayLogProbFn', 0.0025)
    """

    routing_replay: bool = True
    aux_loss_coef: float = 0.0
    chunk_size: int | None = None
    temperature: float = 1.0
    remat: bool | int = False
    scan_layers: bool = False
    return_metrics: bool = False

    def log_probs_and_metrics(
        self, model: Any, batch: GRPOBatch
    ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """``(log_probs, entropy, metrics)``, the aux loss's gradient attached to the log-probs.

        Args:
            model: A mixture-of-experts ``CausalLM``.
            batch: The batch (with ``routing_replay``, its ``routed_experts``).

        Returns:
            As :func:`routing_replay_log_probs` returns them.
        """
        log_probs, entropy, metrics = routing_replay_log_probs(
            model,
            batch,
            routing_replay=self.routing_replay,
            chunk_size=self.chunk_size,
            temperature=self.temperature,
            remat=self.remat,
            scan_layers=self.scan_layers,
        )
        if self.aux_loss_coef > 0:
            coef = jnp.asarray(self.aux_loss_coef, jnp.float32)
            log_probs = _with_aux_gradient(log_probs, metrics["moe/aux_loss"], coef)
        return log_probs, entropy, metrics

    def __call__(self, model: Any, batch: GRPOBatch) -> tuple[jax.Array, ...]:
        """``(log_probs, entropy)``, or with ``return_metrics`` ``(log_probs, entropy, metrics)``.

        Args:
            model: A mixture-of-experts ``CausalLM``.
            batch: The batch.

        Returns:
            The per-token log-probs and entropies ``(B, T)`` (and the metrics).
        """
        log_probs, entropy, metrics = self.log_probs_and_metrics(model, batch)
        return (log_probs, entropy, metrics) if self.return_metrics else (log_probs, entropy)

    def for_microbatches(self, num_microbatches: int) -> RoutingReplayLogProbFn:
        """This function for an update run in ``num_microbatches`` slices of the batch.

        The update's loss is the sum of its slices' losses; the load-balancing loss is a mean
        over a pass, so each slice adds ``aux_loss_coef / num_microbatches`` of its gradient
        (the slices' mean, as Megatron-LM scales it).

        Args:
            num_microbatches: The number of slices, >= 1.

        Returns:
            The function with ``aux_loss_coef / num_microbatches``.
        """
        n = check_int("num_microbatches", num_microbatches, minimum=1)
        return dataclasses.replace(self, aux_loss_coef=self.aux_loss_coef / n)


def routing_replay_log_prob_fn(
    *,
    routing_replay: bool = True,
    aux_loss_coef: float = 0.0,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    remat: bool | int = False,
    scan_layers: bool = False,
    return_metrics: bool = False,
) -> RoutingReplayLogProbFn:
    """A log-prob function ``fn(model, batch) -> (log_probs, entropy)`` with routing replay.

    For ``GRPOTrainer(model, optimizer, config, log_prob_fn=...)`` with a mixture-of-experts
    policy: the update (and ``trainer.compute_log_probs``, the old log-probs) route every token
    to ``batch.routed_experts`` (see :func:`routing_replay_log_probs`), and the update logs
    ``moe/routing_agreement`` and ``moe/aux_loss``. Without ``log_prob_fn`` the trainer builds
    one from ``GRPOConfig.routing_replay`` and ``GRPOConfig.moe_aux_loss_coef``. With
    ``aux_loss_coef > 0`` the gradient of ``aux_loss_coef * L_aux`` (the load-balancing loss
    of the pass) is added to the update's gradient; the loss value itself is not changed (the
    gradient is added in the backward pass of the log-probs, as Megatron-LM's
    ``MoEAuxLossAutoScaler`` does), and with ``n`` microbatches each adds ``1 / n`` of it
    (:meth:`RoutingReplayLogProbFn.for_microbatches`).

    Args:
        routing_replay: Route to the recorded experts (False: the routers choose).
        aux_loss_coef: Weight of the load-balancing loss's gradient, >= 0 (e.g. the model
            config's ``router_aux_loss_coef``); 0: none.
        chunk_size: Rows per logits chunk.
        temperature: The sampling temperature (logits are divided by it).
        remat: Rematerialize the decoder layers (True) or every n-th layer (an int n).
        scan_layers: Run the decoder layers as one ``lax.scan``.
        return_metrics: ``fn`` returns ``(log_probs, entropy, metrics)``, the metrics of
            :func:`routing_replay_log_probs`.

    Returns:
        The log-prob function, a :class:`RoutingReplayLogProbFn`.

    Raises:
        TypeError: If ``routing_replay``, ``scan_layers`` or ``return_metrics`` is not a bool.
        ValueError: If ``aux_loss_coef`` is negative or not finite.

    Examples:
        >>> from artifex.generative_models.training.rl.core.routing_replay import (
        ...     routing_replay_log_prob_fn)
        >>> fn = routing_replay_log_prob_fn(aux_loss_coef=0.001)
        >>> callable(fn), callable(fn.log_probs_and_metrics)
        (True, True)
    """
    for name, value in (
        ("routing_replay", routing_replay),
        ("scan_layers", scan_layers),
        ("return_metrics", return_metrics),
    ):
        check_bool(name, value)
    return RoutingReplayLogProbFn(
        routing_replay=routing_replay,
        aux_loss_coef=check_float("aux_loss_coef", aux_loss_coef, minimum=0.0),
        chunk_size=check_int("chunk_size", chunk_size, minimum=1, allow_none=True),
        temperature=check_float("temperature", temperature, greater_than=0.0),
        remat=check_remat("remat", remat),
        scan_layers=scan_layers,
        return_metrics=return_metrics,
    )
