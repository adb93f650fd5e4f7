r"""The teacher's pass of on-policy distillation, and the term the update binds.

:func:`make_distillation_terms` binds a teacher's graph and a ``GRPOConfig`` into a
:class:`DistillationTerms`: called inside the compiled update with the student, the teacher's
variables (``GRPOTrainState.teacher``, held frozen beside the train state like the reference)
and a batch, it returns the student's per-token log-probs and entropies and the per-token
distillation loss that
:func:`~artifex.generative_models.training.rl.core.objective.grpo_objective` aggregates. The
divergences themselves are in :mod:`~artifex.generative_models.training.rl.core.distillation`.

Where the teacher's numbers come from:

- ``"reverse_kl"``: the teacher's log-prob of each sampled token, from the batch's
  ``teacher_log_probs`` when it has them (scored elsewhere: another device set, a server), else
  from the teacher model run inside the step (packed batches run packed).
- ``"forward_kl"``, ``"jsd"``: the teacher's full distribution at every completion position,
  from the teacher model run inside the step: its hidden states once per (micro)batch, its
  logits chunk by chunk beside the student's (:func:`causal_lm_distillation`).

The teacher is any ``CausalLM`` with the student's vocabulary (for ``"reverse_kl"``, at least
the student's token ids), of any size, or for categorical policies any ``model(observations)
-> logits`` module with the student's number of actions.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from artifex.generative_models.training.rl.core.distillation import (
    chunked_distillation,
    logits_divergence,
    sampled_reverse_kl,
)
from artifex.generative_models.training.rl.core.logprobs import (
    LogProbFn,
    default_log_prob_fn,
    token_log_probs,
)
from artifex.generative_models.training.rl.core.packing import packed_log_prob_fn
from artifex.generative_models.utils.validation import check_remat

if TYPE_CHECKING:
    from artifex.generative_models.training.rl.core.batch import GRPOBatch
    from artifex.generative_models.training.rl.core.configs import GRPOConfig

__all__ = [
    "DistillationTerms",
    "causal_lm_distillation",
    "check_teacher_setup",
    "completion_hidden_states",
    "make_distillation_terms",
]


# ---------------------------------------------------------------------------------- models
def completion_hidden_states(
    model: Any,
    prompt_ids: jax.Array,
    completion_ids: jax.Array,
    *,
    prompt_mask: jax.Array | None = None,
    shared_prompt_group: int | None = None,
    remat: bool | int = False,
    scan_layers: bool = False,
) -> jax.Array:
    """The causal LM's hidden states that predict each completion token: ``(B, T, D)``.

    Position ``t`` is the hidden state one token earlier (the prompt's last token for
    ``t = 0``), as in
    :func:`~artifex.generative_models.training.rl.core.logprobs.causal_lm_log_probs`: over
    ``[prompt ; completion]``, or with ``shared_prompt_group=G`` through
    ``shared_prefix_hidden_states`` (each prompt encoded once for its ``G`` completions).

    Args:
        model: A causal LM with ``hidden_states`` (and ``shared_prefix_hidden_states``).
        prompt_ids: ``(B, P)`` left-padded prompts, ``P >= 1``.
        completion_ids: ``(B, T)`` completions.
        prompt_mask: ``(B, P)`` 1 on real prompt tokens; ``None``: all real.
        shared_prompt_group: ``G`` when every ``G`` consecutive rows share a prompt.
        remat: Rematerialize the decoder layers in the backward pass (or every n-th).
        scan_layers: Scan the layers over ``model.layer_stack()``.

    Returns:
        The hidden states, in the model's compute dtype.

    Raises:
        ValueError: ``prompt_ids`` has no column or the rows differ.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl.core.teacher import completion_hidden_states
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> completion_hidden_states(model, jnp.ones((2, 3), jnp.int32),
        ...                          jnp.ones((2, 4), jnp.int32)).shape
        (2, 4, 128)
    """
    remat = check_remat("remat", remat)
    b, p = prompt_ids.shape
    if p < 1 or completion_ids.ndim != 2 or completion_ids.shape[0] != b:
        msg = (
            f"prompt_ids {prompt_ids.shape} (P >= 1) and completion_ids {completion_ids.shape} "
            "must have the same rows"
        )
        raise ValueError(msg)
    t = completion_ids.shape[1]
    mask = jnp.ones((b, p), jnp.int32) if prompt_mask is None else jnp.asarray(prompt_mask)
    mask = mask.astype(jnp.int32)
    options: dict[str, Any] = {"remat": remat} if remat else {}
    if scan_layers and callable(getattr(model, "layer_stack", None)):
        stack = model.layer_stack()
        if stack is not None:
            options["layer_stack"] = stack
    g = shared_prompt_group
    if (
        g is not None
        and g > 1
        and b % g == 0
        and callable(getattr(model, "shared_prefix_hidden_states", None))
    ):
        prompt_hidden, completion_hidden = model.shared_prefix_hidden_states(
            prompt_ids[::g].astype(jnp.int32),
            completion_ids.astype(jnp.int32),
            prompt_mask=mask[::g],
            **options,
        )
        first = jnp.repeat(prompt_hidden[:, -1:], g, axis=0)
        return jnp.concatenate([first, completion_hidden[:, :-1]], axis=1)
    ids = jnp.concatenate([prompt_ids, completion_ids], axis=1).astype(jnp.int32)
    full = jnp.concatenate([mask, jnp.ones((b, t), jnp.int32)], axis=1)
    hidden, _ = model.hidden_states(ids, attention_mask=full, **options)
    return hidden[:, p - 1 : p + t - 1]


def _projection(model: Any) -> tuple[jax.Array, bool, float | None]:
    """``(weight, transposed, softcap)`` of a causal LM's output layer."""
    rows = getattr(model, "output_embedding_rows", None)
    weight = rows() if callable(rows) else None
    transposed = weight is not None
    if weight is None:
        weight = model.output_embedding()
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return weight, transposed, softcap


def causal_lm_distillation(
    model: Any,
    teacher: Any,
    batch: GRPOBatch,
    *,
    divergence: str,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    remat: bool | int = False,
    scan_layers: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Student log-probs, entropies and the full-vocabulary divergence of two causal LMs.

    Both models run over the batch (the teacher without gradient; it may be of another size),
    then :func:`chunked_distillation` compares their logits position by position.

    Args:
        model: The student causal LM.
        teacher: The teacher causal LM (same vocabulary).
        batch: The batch.
        divergence: ``"forward_kl"``, ``"reverse_kl"`` (exact) or ``"jsd"``.
        beta: The JSD's teacher weight.
        temperature: The sampling temperature (divides both models' logits).
        chunk_size: Rows per logits chunk.
        remat: Rematerialize the student's decoder layers in the backward pass.
        scan_layers: Scan the student's decoder layers.

    Returns:
        ``(log_probs, entropy, divergence)``, each ``(B, T)`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl import GRPOBatch
        >>> from artifex.generative_models.training.rl.core.teacher import causal_lm_distillation
        >>> student = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> teacher = CausalLM(CausalLMConfig.tiny(num_layers=3), rngs=nnx.Rngs(1))
        >>> batch = GRPOBatch(prompt_ids=jnp.ones((2, 3), jnp.int32),
        ...                   completion_ids=jnp.ones((2, 4), jnp.int32),
        ...                   completion_mask=jnp.ones((2, 4)), rewards=jnp.zeros(2),
        ...                   group_size=2)
        >>> lp, ent, kl = causal_lm_distillation(student, teacher, batch, divergence="forward_kl")
        >>> kl.shape, bool((kl >= 0).all())
        ((2, 4), True)
    """
    group = batch.group_size if batch.shared_prompts else None
    hidden = completion_hidden_states(
        model,
        batch.prompt_ids,
        batch.completion_ids,
        prompt_mask=batch.prompt_mask,
        shared_prompt_group=group,
        remat=remat,
        scan_layers=scan_layers,
    )
    teacher_hidden = completion_hidden_states(
        teacher,
        batch.prompt_ids,
        batch.completion_ids,
        prompt_mask=batch.prompt_mask,
        shared_prompt_group=group,
    )
    weight, transposed, softcap = _projection(model)
    t_weight, t_transposed, t_softcap = _projection(teacher)
    return chunked_distillation(
        hidden,
        weight,
        jax.lax.stop_gradient(teacher_hidden),
        t_weight,
        batch.completion_ids,
        divergence=divergence,
        beta=beta,
        chunk_size=chunk_size,
        transposed=transposed,
        teacher_transposed=t_transposed,
        softcap=softcap,
        teacher_softcap=t_softcap,
        temperature=temperature,
    )


def _categorical_distillation(
    model: Any,
    teacher: Any,
    batch: GRPOBatch,
    *,
    divergence: str,
    beta: float,
    temperature: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As :func:`causal_lm_distillation` for policies ``model(observations) -> logits``."""
    b, t = batch.completion_ids.shape
    out = []
    for m in (model, teacher):
        z = jnp.asarray(m(batch.prompt_ids), jnp.float32)
        z = z[:, None, :] if z.ndim == 2 else z
        if z.shape[:2] != (b, t):
            msg = f"policy logits of shape {z.shape} do not fit actions of shape ({b}, {t})"
            raise ValueError(msg)
        out.append(z / temperature if temperature != 1.0 else z)
    z, zt = out
    logp, ent = token_log_probs(z, batch.completion_ids)
    return logp, ent, logits_divergence(z, zt, divergence, beta=beta)


def _is_causal_lm(model: Any) -> bool:
    return hasattr(model, "hidden_states") and hasattr(model, "output_embedding")


def _vocab(model: Any) -> int | None:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


# ---------------------------------------------------------------------------------- the term
@dataclasses.dataclass(frozen=True)
class DistillationTerms:
    """What the update binds for the distillation term: ``terms(policy, teacher, batch)``.

    Built by :func:`make_distillation_terms`. Calling it returns the student's
    ``(log_probs, entropy, distillation)``, each ``(B, T)``: the per-token loss
    (:func:`sampled_reverse_kl` for ``"reverse_kl"``, the full-vocabulary divergence
    otherwise) that :func:`~artifex.generative_models.training.rl.core.objective.grpo_objective`
    aggregates.

    Attributes:
        divergence: ``GRPOConfig.distillation_divergence``.
        beta: ``GRPOConfig.jsd_beta``.
        temperature: ``GRPOConfig.temperature`` (both models' logits are divided by it).
        teacher_graphdef: The teacher's graph (its values come from the train state), or
            ``None`` when the batches carry ``teacher_log_probs``.
        log_prob_fn: The student's log-prob function (``"reverse_kl"``).
        teacher_log_prob_fn: The teacher's (``"reverse_kl"``; packed batches run packed).
        full_fn: ``fn(student, teacher, batch) -> (log_probs, entropy, divergence)`` for
            ``"forward_kl"`` and ``"jsd"``.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.rl.core.teacher import make_distillation_terms
        >>> student = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> teacher = nnx.Linear(4, 3, rngs=nnx.Rngs(1))
        >>> config = GRPOConfig(distillation_coeff=1.0, distillation_divergence="jsd")
        >>> make_distillation_terms(student, teacher, config).divergence
        'jsd'
    """

    divergence: str
    beta: float
    temperature: float
    teacher_graphdef: Any
    log_prob_fn: LogProbFn
    teacher_log_prob_fn: LogProbFn | None
    full_fn: Any

    def teacher(self, teacher_state: Any) -> Any:
        """The teacher module from its variables, or ``None`` without them.

        Args:
            teacher_state: ``GRPOTrainState.teacher`` (or ``None``).

        Returns:
            The teacher, merged from its graph and ``teacher_state``; ``None`` when either is
            missing.
        """
        if teacher_state is None or self.teacher_graphdef is None:
            return None
        return nnx.merge(self.teacher_graphdef, teacher_state)

    def __call__(
        self, policy: Any, teacher_state: Any, batch: GRPOBatch
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(log_probs, entropy, distillation)`` of ``policy`` on ``batch`` (traceable).

        Args:
            policy: The student (differentiable).
            teacher_state: The teacher's variables, or ``None``.
            batch: The batch (``teacher_log_probs`` used first by ``"reverse_kl"``).

        Returns:
            Three ``(B, T)`` float32 arrays.

        Raises:
            ValueError: No teacher and no ``teacher_log_probs``; ``teacher_log_probs`` or a
                packed batch given to a full-vocabulary divergence.
        """
        log_probs, entropy, term, _ = self.with_metrics(policy, teacher_state, batch)
        return log_probs, entropy, term

    def with_metrics(
        self, policy: Any, teacher_state: Any, batch: GRPOBatch
    ) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
        """As calling the terms, plus the metrics of the student's log-prob function.

        A log-prob function with ``log_probs_and_metrics(model, batch)`` (routing replay's)
        reports metrics of its own (``moe/routing_agreement``, ``moe/aux_loss``); the update
        adds them to its metrics. Other functions report none (``{}``).

        Args:
            policy: The student (differentiable).
            teacher_state: The teacher's variables, or ``None``.
            batch: The batch.

        Returns:
            ``(log_probs, entropy, distillation, metrics)``.
        """
        teacher = self.teacher(teacher_state)
        mask = batch.completion_mask
        if self.divergence == "reverse_kl":
            with_metrics = getattr(self.log_prob_fn, "log_probs_and_metrics", None)
            if callable(with_metrics):
                log_probs, entropy, metrics = with_metrics(policy, batch)
            else:
                (log_probs, entropy), metrics = self.log_prob_fn(policy, batch), {}
            if batch.teacher_log_probs is not None:
                teacher_lp = batch.teacher_log_probs
            elif teacher is not None:
                teacher_lp, _ = self.teacher_log_prob_fn(teacher, batch)
            else:
                msg = (
                    "GRPOConfig.distillation_coeff > 0 with 'reverse_kl' needs a teacher_model "
                    "or batches with teacher_log_probs; this batch has neither"
                )
                raise ValueError(msg)
            term = sampled_reverse_kl(
                log_probs, teacher_lp, mask, old_log_probs=batch.old_log_probs
            )
            return log_probs, entropy, term, metrics
        if batch.teacher_log_probs is not None or teacher is None:
            msg = (
                f"distillation_divergence={self.divergence!r} compares the teacher's full "
                "distribution with the student's: it needs a teacher_model (a batch's "
                "teacher_log_probs hold only the sampled tokens' log-probs)"
            )
            raise ValueError(msg)
        if getattr(batch, "layout", None) is not None:
            msg = (
                f"distillation_divergence={self.divergence!r} does not run on packed batches; "
                "pass the padded batch"
            )
            raise ValueError(msg)
        return (*self.full_fn(policy, teacher, batch), {})


def make_distillation_terms(
    model: Any,
    teacher_model: Any,
    config: GRPOConfig,
    *,
    log_prob_fn: LogProbFn | None = None,
    chunk_size: int | None = None,
) -> DistillationTerms | None:
    """The distillation term of ``config`` for ``model`` and ``teacher_model``; None when off.

    ``"reverse_kl"`` scores the student with ``log_prob_fn`` (default: the model's
    :func:`~artifex.generative_models.training.rl.core.logprobs.default_log_prob_fn`) and the
    teacher with its own default log-prob function, or reads the batch's
    ``teacher_log_probs`` (then ``teacher_model`` may be ``None``). ``"forward_kl"`` and
    ``"jsd"`` compute the student's log-probs themselves, from the logits they compare:
    :func:`causal_lm_distillation` for causal LMs, the full logits of a categorical policy
    ``model(observations) -> logits`` otherwise; ``log_prob_fn`` is not used for them.

    Args:
        model: The student.
        teacher_model: The teacher (an ``nnx.Module``), or ``None``.
        config: ``distillation_coeff``, ``distillation_divergence``, ``jsd_beta``,
            ``temperature``, ``remat``, ``scan_layers``.
        log_prob_fn: The student's log-prob function for ``"reverse_kl"``.
        chunk_size: Rows per logits chunk of the full-vocabulary divergences.

    Returns:
        A :class:`DistillationTerms`, or ``None`` when ``config.distillation_coeff == 0``.

    Raises:
        TypeError: ``teacher_model`` is not an ``nnx.Module``, or not the student's kind of
            model (causal LM or categorical policy).
        ValueError: ``"forward_kl"``/``"jsd"`` without a teacher, or vocabularies that do not
            fit (equal for those two; the teacher's at least the student's for reverse KL).

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.rl.core.teacher import make_distillation_terms
        >>> student = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> make_distillation_terms(student, None, GRPOConfig()) is None  # coefficient 0
        True
        >>> terms = make_distillation_terms(student, None, GRPOConfig(distillation_coeff=0.5))
        >>> terms.divergence, terms.teacher_graphdef is None  # teacher_log_probs in the batch
        ('reverse_kl', True)
    """
    if config.distillation_coeff == 0.0:
        return None
    if teacher_model is not None and not isinstance(teacher_model, nnx.Module):
        msg = f"teacher_model must be an nnx.Module, got {type(teacher_model).__name__}"
        raise TypeError(msg)
    if teacher_model is not None and _is_causal_lm(model) != _is_causal_lm(teacher_model):
        kinds = {True: "a causal LM", False: "a categorical policy"}
        msg = (
            f"the teacher ({type(teacher_model).__name__}) must be the student's kind of "
            f"model: the student is {kinds[_is_causal_lm(model)]}, the teacher "
            f"{kinds[_is_causal_lm(teacher_model)]}"
        )
        raise TypeError(msg)
    divergence = config.distillation_divergence
    student_v, teacher_v = _vocab(model), _vocab(teacher_model)
    if divergence != "reverse_kl":
        if teacher_model is None:
            msg = (
                f"GRPOConfig.distillation_divergence={divergence!r} needs a teacher_model (it "
                "compares full distributions; only 'reverse_kl' can read teacher_log_probs "
                "from the batch)"
            )
            raise ValueError(msg)
        if student_v is not None and teacher_v is not None and student_v != teacher_v:
            msg = (
                f"distillation_divergence={divergence!r} compares full distributions: the "
                f"teacher's vocabulary ({teacher_v}) must equal the student's ({student_v})"
            )
            raise ValueError(msg)
    elif student_v is not None and teacher_v is not None and teacher_v < student_v:
        msg = (
            f"the teacher's vocabulary ({teacher_v} tokens) is smaller than the student's "
            f"({student_v}): it cannot score every token the student samples"
        )
        raise ValueError(msg)
    temperature = config.temperature
    if log_prob_fn is None:
        log_prob_fn = default_log_prob_fn(
            model,
            temperature=temperature,
            remat=config.remat_option,
            scan_layers=config.scan_layers,
        )
    teacher_fn = None
    graphdef = None
    if teacher_model is not None:
        graphdef = nnx.graphdef(teacher_model)
        teacher_fn = default_log_prob_fn(teacher_model, temperature=temperature)
        if callable(getattr(teacher_model, "packed_hidden_states", None)):
            teacher_fn = packed_log_prob_fn(teacher_fn, temperature=temperature)

    def full_fn(student: Any, teacher: Any, batch: GRPOBatch) -> tuple[jax.Array, ...]:
        if _is_causal_lm(student):
            return causal_lm_distillation(
                student,
                teacher,
                batch,
                divergence=divergence,
                beta=config.jsd_beta,
                temperature=temperature,
                chunk_size=chunk_size,
                remat=config.remat_option,
                scan_layers=config.scan_layers,
            )
        return _categorical_distillation(
            student,
            teacher,
            batch,
            divergence=divergence,
            beta=config.jsd_beta,
            temperature=temperature,
        )

    return DistillationTerms(
        divergence=divergence,
        beta=config.jsd_beta,
        temperature=temperature,
        teacher_graphdef=graphdef,
        log_prob_fn=log_prob_fn,
        teacher_log_prob_fn=teacher_fn,
        full_fn=full_fn,
    )


def check_teacher_setup(
    model: Any,
    teacher_model: Any,
    config: GRPOConfig,
    *,
    custom_log_prob_fn: bool = False,
) -> None:
    """Refuses a teacher setup that cannot work, before anything is traced (a trainer's check).

    Args:
        model: The student.
        teacher_model: The teacher, or ``None``.
        config: The GRPO options.
        custom_log_prob_fn: Whether the student's log-probs come from a user's function.

    Raises:
        TypeError: ``teacher_model`` is not an ``nnx.Module``.
        ValueError: The teacher is the student itself; a teacher with
            ``distillation_coeff = 0`` (it would be ignored); ``"forward_kl"``/``"jsd"`` without
            a teacher or with a custom log-prob function (they compute the student's log-probs
            from its logits).

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.rl.core.teacher import check_teacher_setup
        >>> student = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> teacher = nnx.Linear(4, 3, rngs=nnx.Rngs(1))
        >>> check_teacher_setup(student, teacher, GRPOConfig(distillation_coeff=1.0))
        >>> try:
        ...     check_teacher_setup(student, teacher, GRPOConfig())
        ... except ValueError as err:
        ...     print(str(err)[:60])
        teacher_model was given but GRPOConfig.distillation_coeff is
    """
    if teacher_model is not None and not isinstance(teacher_model, nnx.Module):
        msg = f"teacher_model must be an nnx.Module, got {type(teacher_model).__name__}"
        raise TypeError(msg)
    if teacher_model is not None and teacher_model is model:
        msg = "teacher_model must be another model than the policy it teaches"
        raise ValueError(msg)
    if teacher_model is not None and config.distillation_coeff == 0.0:
        msg = (
            "teacher_model was given but GRPOConfig.distillation_coeff is 0: set "
            "distillation_coeff > 0 to distill from it, or leave teacher_model out"
        )
        raise ValueError(msg)
    full = config.distillation_coeff > 0.0 and config.distillation_divergence != "reverse_kl"
    if full and teacher_model is None:
        msg = (
            f"GRPOConfig.distillation_divergence={config.distillation_divergence!r} needs a "
            "teacher_model (only 'reverse_kl' can read teacher_log_probs from the batch)"
        )
        raise ValueError(msg)
    if full and custom_log_prob_fn:
        msg = (
            f"GRPOConfig.distillation_divergence={config.distillation_divergence!r} computes the "
            "student's log-probs from its logits beside the teacher's: it does not use a custom "
            "log_prob_fn; use 'reverse_kl' or the model's own log-probs"
        )
        raise ValueError(msg)
