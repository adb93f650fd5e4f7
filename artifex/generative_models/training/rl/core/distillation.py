r"""On-policy distillation: a teacher's per-token divergence on the student's own samples.

The student samples completions (the GRPO rollout), a frozen teacher scores them, and the update
adds ``distillation_coeff`` times the aggregated per-token divergence to the loss
(:func:`~artifex.generative_models.training.rl.core.objective.grpo_objective`, ``distillation=``);
with ``GRPOConfig.policy_loss_coeff = 0`` it is distillation alone. At completion position
``t``, student ``S = \pi_\theta(\cdot | x, o_{<t})`` and teacher ``T = \pi_T(\cdot | x,
o_{<t})``, both at the sampling temperature:

- ``"reverse_kl"``, from the sampled token only (GKD; Thinking Machines):
  ``d_t = \log S(o_t) - \log T(o_t)``, the single-sample (k1) estimate of ``KL(S || T)``
  with ``o_t ~ S``. The per-token loss is ``\rho_t\, \mathrm{sg}(d_t)`` with
  ``\rho_t = \exp(\log S(o_t) - \mathrm{sg}(\log \mu(o_t)))``, ``\mu`` the sampling policy
  (``old_log_probs``; without them the current one, ``\rho_t = 1``): its value is the
  (importance-weighted) estimate, its gradient ``\rho_t d_t \nabla \log S(o_t)``, whose
  expectation is ``\nabla KL(S || T)`` at that prefix (``E_S[\nabla \log S] = 0``, so the
  gradient of ``d_t`` itself would be 0 in expectation). It is per token: the effect of
  ``o_t`` on later positions' divergence is not followed (discount 0, as in the Thinking
  Machines recipe). Only the teacher's log-prob of each sampled token is needed, so it can
  come in the batch (``GRPOBatch.teacher_log_probs``) instead of from a teacher model.
- ``"forward_kl"``: ``KL(T || S) = \sum_v T_v (\log T_v - \log S_v)`` over the vocabulary.
- ``"jsd"``: GKD's generalized Jensen-Shannon divergence, ``M = \beta T + (1 - \beta) S``,
  ``JSD_\beta = \beta\, KL(T || M) + (1 - \beta)\, KL(S || M)``, ``0 < \beta < 1``
  (``jsd_beta``, TRL ``GKDTrainer``'s ``beta``): about ``\beta\, KL(T || S)`` for small
  ``\beta`` and ``(1 - \beta)\, KL(S || T)`` near 1.

The full-distribution divergences compare every logit of both models at every completion
position: :func:`chunked_distillation` walks over the ``B*T`` positions in chunks (a
rematerialized ``lax.scan``), so one chunk's ``(chunk, V)`` logits of each model exist at a
time, forward and backward; the student's token log-probs and entropies come from the same
chunks. Student and teacher share the vocabulary; the teacher may be of any size.

References:
    Agarwal et al., 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (GKD), arXiv:2306.13649.
    Lu and Thinking Machines Lab, 2025, "On-Policy Distillation", Connectionism.
    Gu et al., 2024, "MiniLLM: Knowledge Distillation of Large Language Models",
    arXiv:2306.08543 (reverse KL on student samples).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from artifex.generative_models.training.rl.core.logprobs import auto_chunk_size, token_log_probs
from artifex.generative_models.utils.validation import check_choice, check_float

__all__ = [
    "DIVERGENCES",
    "chunked_distillation",
    "logits_divergence",
    "sampled_reverse_kl",
]

#: The divergences of ``GRPOConfig.distillation_divergence``. :func:`logits_divergence` computes
#: all three exactly; the update's ``"reverse_kl"`` is :func:`sampled_reverse_kl`.
DIVERGENCES: tuple[str, ...] = ("reverse_kl", "forward_kl", "jsd")
_FULL = DIVERGENCES


# ---------------------------------------------------------------------------------- kernels
def sampled_reverse_kl(
    log_probs: jax.Array,
    teacher_log_probs: jax.Array,
    mask: jax.Array,
    *,
    old_log_probs: jax.Array | None = None,
) -> jax.Array:
    r"""Per-token reverse-KL loss on the student's own samples (the sampled-token estimator).

    ``l_t = \rho_t\, \mathrm{sg}(\log S(o_t) - \log T(o_t))`` with
    ``\rho_t = \exp(\log S(o_t) - \mathrm{sg}(\log \mu(o_t)))`` (``\mu``: ``old_log_probs``, or
    the current log-probs when ``None``). Its value is the k1 estimate of ``KL(S || T)``
    (importance-weighted when ``\mu`` is not the current policy); its gradient
    ``\rho_t (\log S - \log T) \nabla \log S(o_t)`` is, in expectation over ``o_t ~ \mu``, the
    gradient of ``KL(S || T)`` at that prefix. 0 where ``mask`` is 0.

    Args:
        log_probs: ``(B, T)`` student log-probs of the sampled tokens (differentiable).
        teacher_log_probs: ``(B, T)`` teacher log-probs of the same tokens (no gradient).
        mask: ``(B, T)`` completion mask.
        old_log_probs: ``(B, T)`` log-probs under the sampling policy, or ``None`` (on-policy).

    Returns:
        ``(B, T)`` float32 per-token loss.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl.core.distillation import sampled_reverse_kl
        >>> student = jnp.array([[-0.5, -1.0]])
        >>> teacher = jnp.array([[-0.7, -0.4]])
        >>> sampled_reverse_kl(student, teacher, jnp.array([[1, 0]])).tolist()
        [[0.19999998807907104, 0.0]]

    References:
        Agarwal et al., 2024, arXiv:2306.13649; Thinking Machines, "On-Policy Distillation".
    """
    lp = jnp.asarray(log_probs, jnp.float32)
    tlp = jax.lax.stop_gradient(jnp.asarray(teacher_log_probs, jnp.float32))
    behavior = (
        jax.lax.stop_gradient(lp)
        if old_log_probs is None
        else jax.lax.stop_gradient(jnp.asarray(old_log_probs, jnp.float32))
    )
    m = jnp.asarray(mask) > 0
    ratio = jnp.exp(jnp.where(m, lp - behavior, 0.0))
    estimate = jax.lax.stop_gradient(jnp.where(m, lp - tlp, 0.0))
    return jnp.where(m, ratio * estimate, 0.0)


def logits_divergence(
    logits: jax.Array, teacher_logits: jax.Array, divergence: str, *, beta: float = 0.5
) -> jax.Array:
    r"""A divergence between the student's and the teacher's full distributions, per position.

    ``"forward_kl"``: ``KL(T || S)``; ``"reverse_kl"``: ``KL(S || T)`` (exact, over the whole
    vocabulary); ``"jsd"``: ``\beta KL(T || M) + (1 - \beta) KL(S || M)`` with
    ``M = \beta T + (1 - \beta) S`` (GKD's generalized JSD). ``S = softmax(logits)`` and
    ``T = softmax(teacher_logits)`` in float32; the teacher gets no gradient.

    Args:
        logits: ``(..., V)`` student logits (already divided by the temperature).
        teacher_logits: ``(..., V)`` teacher logits.
        divergence: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
        beta: The JSD's teacher weight, ``0 < beta < 1``.

    Returns:
        ``(...)`` float32 divergences.

    Raises:
        ValueError: Unknown divergence, ``beta`` out of range, or logits of different shapes.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl.core.distillation import logits_divergence
        >>> s, t = jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.9, 0.1]))
        >>> round(float(logits_divergence(s, t, "forward_kl")), 4)  # 0.9 ln 1.8 + 0.1 ln 0.2
        0.3681

    References:
        Agarwal et al., 2024, arXiv:2306.13649, sec. 3 (generalized JSD).
    """
    check_choice("divergence", divergence, _FULL)
    if divergence == "jsd":
        check_float("beta", beta, greater_than=0.0, less_than=1.0)
    if jnp.shape(logits) != jnp.shape(teacher_logits):
        msg = (
            "student and teacher logits must have the same shape (one vocabulary), got "
            f"{jnp.shape(logits)} and {jnp.shape(teacher_logits)}"
        )
        raise ValueError(msg)
    ls = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    lt = jax.nn.log_softmax(
        jax.lax.stop_gradient(jnp.asarray(teacher_logits, jnp.float32)), axis=-1
    )
    if divergence == "forward_kl":
        return jnp.sum(jnp.exp(lt) * (lt - ls), axis=-1)
    if divergence == "reverse_kl":
        return jnp.sum(jnp.exp(ls) * (ls - lt), axis=-1)
    lm = jnp.logaddexp(jnp.log(beta) + lt, jnp.log1p(-beta) + ls)
    kl_t = jnp.sum(jnp.exp(lt) * (lt - lm), axis=-1)
    kl_s = jnp.sum(jnp.exp(ls) * (ls - lm), axis=-1)
    return beta * kl_t + (1.0 - beta) * kl_s


def _project(
    h: jax.Array,
    weight: jax.Array,
    transposed: bool,
    softcap: float | None,
    temperature: float,
) -> jax.Array:
    """float32 logits ``h W`` (``h W^T`` when ``transposed``), soft-capped, over temperature."""
    spec = "nd,vd->nv" if transposed else "nd,dv->nv"
    z = jnp.einsum(spec, h, weight, preferred_element_type=jnp.float32)
    if softcap is not None:
        z = jnp.tanh(z / softcap) * softcap
    return z / temperature if temperature != 1.0 else z


def chunked_distillation(
    hidden: jax.Array,
    weight: jax.Array,
    teacher_hidden: jax.Array,
    teacher_weight: jax.Array,
    targets: jax.Array,
    *,
    divergence: str,
    beta: float = 0.5,
    chunk_size: int | None = None,
    transposed: bool = False,
    teacher_transposed: bool = False,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token log-probs, entropies and a full-vocabulary divergence from two models' hidden states.

    Student logits ``z = h W``, teacher logits ``z_T = h_T W_T`` (each soft-capped when its cap
    is set, then divided by ``temperature``), in float32. The ``N`` positions are processed
    ``chunk_size`` rows at a time by a ``lax.scan`` whose body is rematerialized in the backward
    pass: one chunk's ``(chunk, V)`` logits of each model exist at a time. The teacher gets no
    gradient. Values are those of :func:`logits_divergence` and
    :func:`~artifex.generative_models.training.rl.core.logprobs.token_log_probs` on the full logits.

    Args:
        hidden: ``(..., D)`` student hidden states.
        weight: ``(D, V)`` student output projection (``(V, D)`` with ``transposed``).
        teacher_hidden: ``(..., D_T)`` teacher hidden states (same leading shape).
        teacher_weight: ``(D_T, V)`` teacher output projection (``(V, D_T)`` with
            ``teacher_transposed``).
        targets: ``(...)`` int sampled token ids.
        divergence: ``"forward_kl"``, ``"reverse_kl"`` (exact) or ``"jsd"``.
        beta: The JSD's teacher weight.
        chunk_size: Rows per chunk; ``None``:
            :func:`~artifex.generative_models.training.rl.core.logprobs.auto_chunk_size`.
        transposed: ``weight`` is ``(V, D)`` (a tied embedding as stored).
        teacher_transposed: ``teacher_weight`` is ``(V, D_T)``.
        softcap: The student's final logit soft-cap (Gemma), or ``None``.
        teacher_softcap: The teacher's, or ``None``.
        temperature: Divides both models' logits.

    Returns:
        ``(log_probs, entropy, divergence)``, each of ``targets``' shape, float32.

    Raises:
        ValueError: The vocabularies differ, the leading shapes differ, or ``chunk_size < 1``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.training.rl.core.distillation import (
        ...     chunked_distillation, logits_divergence)
        >>> k = jax.random.split(jax.random.key(0), 4)
        >>> h, w = jax.random.normal(k[0], (2, 3, 4)), jax.random.normal(k[1], (4, 7))
        >>> ht, wt = jax.random.normal(k[2], (2, 3, 6)), jax.random.normal(k[3], (6, 7))
        >>> _, _, d = chunked_distillation(h, w, ht, wt, jnp.zeros((2, 3), jnp.int32),
        ...                                divergence="jsd", chunk_size=4)
        >>> full = logits_divergence(h @ w, ht @ wt, "jsd")
        >>> d.shape, bool(jnp.allclose(d, full, atol=1e-5))
        ((2, 3), True)
    """
    check_choice("divergence", divergence, _FULL)
    lead = jnp.shape(targets)
    v, d = weight.shape if transposed else weight.shape[::-1]
    vt, dt = teacher_weight.shape if teacher_transposed else teacher_weight.shape[::-1]
    if v != vt:
        msg = (
            f"the student's vocabulary has {v} tokens and the teacher's {vt}: forward_kl and "
            "jsd compare full distributions, so both models need the same vocabulary"
        )
        raise ValueError(msg)
    if jnp.shape(hidden)[:-1] != lead or jnp.shape(teacher_hidden)[:-1] != lead:
        msg = (
            f"hidden {jnp.shape(hidden)} and teacher_hidden {jnp.shape(teacher_hidden)} must "
            f"have the leading shape of targets {lead}"
        )
        raise ValueError(msg)
    h = hidden.reshape(-1, d)
    ht = jax.lax.stop_gradient(teacher_hidden).reshape(-1, dt)
    wt = jax.lax.stop_gradient(teacher_weight)
    y = jnp.asarray(targets).reshape(-1).astype(jnp.int32)
    n = h.shape[0]
    chunk = auto_chunk_size(v) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        msg = f"chunk_size must be >= 1, got {chunk_size}"
        raise ValueError(msg)

    def block(h_c: jax.Array, ht_c: jax.Array, y_c: jax.Array) -> tuple[jax.Array, ...]:
        z = _project(h_c, weight, transposed, softcap, temperature)
        zt = _project(ht_c, wt, teacher_transposed, teacher_softcap, temperature)
        logp, ent = token_log_probs(z, y_c)
        return logp, ent, logits_divergence(z, zt, divergence, beta=beta)

    if n <= chunk:
        return tuple(x.reshape(lead) for x in block(h, ht, y))  # type: ignore[return-value]
    pad = (-n) % chunk
    h = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, chunk, d)
    ht = jnp.pad(ht, ((0, pad), (0, 0))).reshape(-1, chunk, dt)
    y = jnp.pad(y, (0, pad)).reshape(-1, chunk)
    # Nothing of a chunk is kept for the backward pass: both logits blocks are recomputed there.
    body = jax.checkpoint(lambda carry, xs: (carry, block(*xs)))
    _, outs = jax.lax.scan(body, None, (h, ht, y))
    return tuple(x.reshape(-1)[:n].reshape(lead) for x in outs)  # type: ignore[return-value]
