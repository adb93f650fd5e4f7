r"""Per-token log-probs and entropies of given completions under a policy.

For a causal LM the log-prob of completion token ``t`` comes from the hidden state one position
earlier: ``log p(o_t) = z_{o_t} - logsumexp(z)`` with logits ``z = h_{t-1} W``. For vocabularies
of 150k tokens the full ``(B, T, V)`` logits of a batch are gigabytes, so
:func:`chunked_token_log_probs` walks over the ``B*T`` positions in chunks of ``chunk_size``
rows (a ``lax.scan`` whose body is rematerialized in the backward pass): only one chunk's
``(chunk_size, V)`` logits exist at any time, in the forward and in the gradient. The values are
those of the naive computation (same float32 math, row by row).

Policies plug in through a *log-prob function* ``fn(model, batch) -> (log_probs, entropy)``,
both ``(B, T)`` float32: :func:`causal_lm_log_probs_fn` for models with ``hidden_states`` and
``output_embedding`` (the library's causal LMs), :func:`categorical_log_probs` for any
``model(observations) -> logits`` policy. :func:`default_log_prob_fn` picks one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from artifex.generative_models.utils.validation import check_remat

if TYPE_CHECKING:
    from artifex.generative_models.training.rl.core.batch import GRPOBatch

__all__ = [
    "LogProbFn",
    "auto_chunk_size",
    "categorical_log_probs",
    "causal_lm_log_probs",
    "causal_lm_log_probs_fn",
    "chunked_token_log_probs",
    "default_log_prob_fn",
    "token_log_probs",
]

LogProbFn = Callable[[Any, "GRPOBatch"], tuple[jax.Array, jax.Array]]

_CHUNK_BYTES = 64 * 2**20  # logits of one chunk: at most 64 MiB of float32
_CACHE_BYTES = 4 * 2**20  # a chunk's logits sized for the cache...
_MIN_CACHED_ROWS = 256  # ...but with at least this many rows
# The chunks' logits are kept for the backward pass when all of them together take at most
# this; above it each chunk's are recomputed there (one more product with the output matrix).
_SAVED_LOGITS_BYTES = 256 * 2**20
# A loop of at most this many chunks whose logits are kept is unrolled (see
# `chunked_token_log_probs`)...
_MAX_UNROLLED_CHUNKS = 4
# ...while the output matrix's gradient, in float32, takes at most this: unrolled, each chunk's
# contribution to it is a buffer of its own.
_UNROLLED_WEIGHT_GRAD_BYTES = 256 * 2**20


def token_log_probs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Naive log-probs of ``targets`` and entropies from full logits, in float32.

    Args:
        logits: ``(..., V)`` logits.
        targets: ``(...)`` int token ids.

    Returns:
        ``(log_probs, entropy)``, each ``(...)`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import token_log_probs
        >>> logits = jnp.log(jnp.array([[0.5, 0.25, 0.25]]))
        >>> logp, entropy = token_log_probs(logits, jnp.array([0]))
        >>> round(float(logp[0]), 4), round(float(entropy[0]), 4)
        (-0.6931, 1.0397)
    """
    z = jnp.asarray(logits, jnp.float32)
    # One pass of exponentials for both: with zm = z - max(z) and e = exp(zm),
    # log p_y = zm_y - log(sum e) and H = log(sum e) - sum(e zm) / sum(e). (Computing
    # softmax = exp(z - logsumexp(z)) for the entropy took a second pass, in the forward and
    # the backward pass: SmolLM2-135M's output projection alone, forward 0.72 against 0.50 s,
    # with its gradient 1.72 against 1.50 s; docs/benchmarks.md.) The shift is a constant for
    # the gradient, as in ``jax.nn.logsumexp``.
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    zm = z - jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(zm)
    total = jnp.sum(e, axis=-1)
    log_total = jnp.log(total)
    picked = jnp.take_along_axis(zm, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    # Where e is 0 (a -inf logit, or a spread beyond float32) its term is 0, not 0 * -inf.
    entropy = log_total - jnp.sum(e * jnp.where(e > 0, zm, 0.0), axis=-1) / total
    return picked - log_total, entropy


def auto_chunk_size(vocab_size: int, *, budget_bytes: int = _CHUNK_BYTES) -> int:
    """Rows per chunk: one chunk's float32 logits fit ``budget_bytes``, and stay cache-sized.

    The budget bounds memory. Below it, a chunk of at most ``_CACHE_BYTES`` (4 MiB) of logits, but
    no fewer than 256 rows, is taken: a small vocabulary's logits then stay in the CPU's cache
    between the matmul and the softmax that reads them, and a large one keeps enough rows per
    chunk to amortize reading the output weight.

    Args:
        vocab_size: ``V``.
        budget_bytes: Bytes allowed for one ``(chunk, V)`` float32 logits block.

    Returns:
        A power of two >= 16.

    Examples:
        >>> from artifex.generative_models.training.rl import auto_chunk_size
        >>> auto_chunk_size(4_096), auto_chunk_size(32_000), auto_chunk_size(151_936)
        (256, 256, 64)
    """
    rows = max(budget_bytes // (4 * vocab_size), 16)
    cached = max(_CACHE_BYTES // (4 * vocab_size), _MIN_CACHED_ROWS)
    return 2 ** math.floor(math.log2(min(rows, cached)))


def chunked_token_log_probs(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    *,
    bias: jax.Array | None = None,
    chunk_size: int | None = None,
    transposed: bool = False,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    r"""Log-probs of ``targets`` and entropies under ``logits = hidden @ weight``, chunked.

    ``log p = z_y - logsumexp(z)`` and ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` with
    ``z = h W (+ b)`` accumulated in float32. The ``N`` positions are processed ``chunk_size``
    rows at a time by a ``lax.scan``, so the softmax's temporaries are one chunk's. Under a
    gradient, the chunks' logits are kept for the backward pass while all ``N x V`` of them
    take at most 256 MiB of float32; above that each chunk's are recomputed in the backward
    pass, so that peak memory holds one chunk's logits instead of all of them, for one more
    product with the output matrix. A scan of at most four chunks whose logits are kept is
    unrolled (faster, as much kept) unless the output matrix's float32 gradient exceeds 256 MiB
    (unrolled, each chunk's would take a buffer of its own).
    The values are the same either way.

    Args:
        hidden: ``(..., D)`` hidden states (any float dtype).
        weight: ``(D, V)`` output projection; ``(V, D)`` with ``transposed``.
        targets: ``(...)`` int token ids.
        bias: Optional ``(V,)`` output bias.
        chunk_size: Rows per chunk; ``None`` picks :func:`auto_chunk_size`. When all rows fit in
            one chunk the computation is done in one piece.
        transposed: ``weight`` is ``(V, D)``, one row per token (a tied embedding as stored):
            the products contract its second axis, ``logits = hidden @ weight.T``. Passing the
            ``(D, V)`` transpose instead makes XLA:CPU write a transposed copy of the matrix
            for every pass over the chunks.
        softcap: Optional ``c``: the logits are ``c tanh(z / c)`` (Gemma's final logit
            soft-capping), then divided by ``temperature``.
        temperature: Divides the (capped) logits.

    Returns:
        ``(log_probs, entropy)``, each of ``targets``' shape, float32.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import (
        ...     chunked_token_log_probs,
        ...     token_log_probs,
        ... )
        >>> hidden = jax.random.normal(jax.random.key(0), (2, 3, 4))
        >>> weight = jax.random.normal(jax.random.key(1), (4, 7))
        >>> targets = jnp.arange(6).reshape(2, 3)
        >>> logp, entropy = chunked_token_log_probs(hidden, weight, targets, chunk_size=4)
        >>> full, _ = token_log_probs(hidden @ weight, targets)
        >>> logp.shape, bool(jnp.allclose(logp, full, atol=1e-5))
        ((2, 3), True)
    """
    lead = targets.shape
    v, d = weight.shape if transposed else weight.shape[::-1]
    h = hidden.reshape(-1, d)
    y = targets.reshape(-1).astype(jnp.int32)
    n = h.shape[0]
    chunk = auto_chunk_size(v) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        msg = f"chunk_size must be >= 1, got {chunk_size}"
        raise ValueError(msg)

    def block(h_c: jax.Array, y_c: jax.Array) -> tuple[jax.Array, jax.Array]:
        spec = "nd,vd->nv" if transposed else "nd,dv->nv"
        z = jnp.einsum(spec, h_c, weight, preferred_element_type=jnp.float32)
        z = checkpoint_name(z, "logits")
        if bias is not None:
            z = z + bias.astype(jnp.float32)
        if softcap is not None:
            z = jnp.tanh(z / softcap) * softcap
        if temperature != 1.0:
            z = z / temperature
        return token_log_probs(z, y_c)

    if n <= chunk:
        logp, ent = block(h, y)
        return logp.reshape(lead), ent.reshape(lead)
    pad = (-n) % chunk
    h = jnp.pad(h, ((0, pad), (0, 0)))
    y = jnp.pad(y, (0, pad))
    h = h.reshape(-1, chunk, d)
    y = y.reshape(-1, chunk)

    # Keeping the logits saves recomputing them: one of the four products of the output
    # projection's forward and backward pass (SmolLM2-135M's output projection with its
    # gradient, alone: 1.76 against 2.03 s; docs/benchmarks.md).
    keep = h.shape[0] * h.shape[1] * v * 4 <= _SAVED_LOGITS_BYTES
    policy = jax.checkpoint_policies.save_only_these_names("logits") if keep else None
    body = jax.checkpoint(lambda carry, xs: (carry, block(*xs)), policy=policy)
    # A few chunks whose logits are kept run unrolled: each chunk's logits then go to a buffer
    # of their own, where the loop zero-fills one stacked buffer for all of them, copies each
    # chunk's in and slices it out again in the backward pass. The same products, and all
    # the logits are kept either way (the update's temporaries: W1 +16 MB, W2 -26 MB); W1's
    # update 2.8% faster, W2's 3.8% (benchmarks/unrolled_chunks.py, docs/benchmarks.md). A
    # long loop stays a loop (one copy of the body to compile). So does a loop over a large
    # output matrix: unrolled, XLA:CPU gives each chunk's float32 gradient of the matrix a
    # buffer of its own before adding them, where the loop accumulates one (Gemma 3's tied
    # 262,144 x 1,152 embedding: 1.2 GB per chunk; a 2-layer G3-1B-shaped update's temporaries
    # 6.5 GB unrolled, 4.9 GB as a loop). W2's matrix (113 MB) stays unrolled.
    unroll = (
        keep
        and h.shape[0] <= _MAX_UNROLLED_CHUNKS
        and v * d * 4 <= _UNROLLED_WEIGHT_GRAD_BYTES
    )
    _, (logp, ent) = jax.lax.scan(body, None, (h, y), unroll=unroll)
    return logp.reshape(-1)[:n].reshape(lead), ent.reshape(-1)[:n].reshape(lead)


def causal_lm_log_probs(
    model: Any,
    prompt_ids: jax.Array,
    completion_ids: jax.Array,
    *,
    prompt_mask: jax.Array | None = None,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    shared_prompt_group: int | None = None,
    remat: bool | int = False,
    scan_layers: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs and entropies of completions under a causal LM.

    Runs the model over ``[prompt ; completion]`` (positions from the attention mask) and
    projects only the ``T`` hidden states that predict completion tokens, chunked by
    :func:`chunked_token_log_probs`.

    With ``shared_prompt_group=G`` (every ``G`` consecutive rows share one prompt, as in a GRPO
    batch) each prompt is encoded once and its ``G`` completions attend to it: the same values,
    with the prompt part of the forward and backward pass done ``G`` times less. A
    ``CausalLM`` (``shared_prefix_hidden_states``) runs each prompt and its completions through
    the layers in one pass; other models with ``init_cache`` encode the prompt into a KV cache.

    Args:
        model: A causal LM with ``hidden_states(ids, attention_mask=..., cache=...)``,
            ``init_cache`` and ``output_embedding() -> (D, V)`` (or
            ``output_embedding_rows() -> (V, D)``, used first when not None).
        prompt_ids: ``(B, P)`` int, left-padded, ``P >= 1``.
        completion_ids: ``(B, T)`` int.
        prompt_mask: ``(B, P)`` 1 on real prompt tokens; ``None`` means no padding.
        chunk_size: Rows per logits chunk (see :func:`chunked_token_log_probs`).
        temperature: Logits are divided by it (the sampling temperature).
        shared_prompt_group: ``G`` when rows ``i`` and ``i // G * G`` always have the same
            prompt; ``None`` or 1 encodes every row's prompt.
        remat: Rematerialize the decoder layers in the backward pass (gradient checkpointing:
            about one more forward pass, less memory, same values), or every n-th layer (an
            int n >= 1); the model's ``hidden_states`` must accept ``remat=``.
        scan_layers: Run the decoder layers as one ``jax.lax.scan`` over
            ``model.layer_stack()`` (unrolled where it is None): same values, faster to compile
            for deep models, somewhat slower on the CPU.

    Returns:
        ``(log_probs, entropy)``, each ``(B, T)`` float32.

    Raises:
        ValueError: If the shapes do not match or ``remat`` is an int below 1.
        TypeError: If ``scan_layers`` is set without ``layer_stack``, or ``remat`` is neither a
            bool nor an int.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl import causal_lm_log_probs
        >>> config = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                         num_layers=1, num_heads=2)
        >>> model = CausalLM(config, rngs=nnx.Rngs(0))
        >>> prompt_ids = jnp.array([[0, 3, 4], [5, 6, 7]])
        >>> prompt_mask = jnp.array([[0, 1, 1], [1, 1, 1]])  # left-padded
        >>> logp, entropy = causal_lm_log_probs(model, prompt_ids, jnp.array([[1, 2], [3, 4]]),
        ...                                     prompt_mask=prompt_mask)
        >>> logp.shape, bool((logp < 0).all()), bool((entropy <= jnp.log(16.0)).all())
        ((2, 2), True, True)
        >>> remat, _ = causal_lm_log_probs(model, prompt_ids, jnp.array([[1, 2], [3, 4]]),
        ...                                prompt_mask=prompt_mask, remat=True)
        >>> bool(jnp.allclose(remat, logp))  # same values; only the backward pass changes
        True
    """
    remat = check_remat("remat", remat)
    b, p = prompt_ids.shape
    if p < 1:
        msg = "prompt_ids must have at least one column: the first completion token is predicted from the last prompt position"  # noqa: E501
        raise ValueError(msg)
    if completion_ids.ndim != 2 or completion_ids.shape[0] != b:
        msg = f"completion_ids must be ({b}, T) for prompt_ids {prompt_ids.shape}, got {completion_ids.shape}"  # noqa: E501
        raise ValueError(msg)
    t = completion_ids.shape[1]
    if prompt_mask is None:
        prompt_mask = jnp.ones((b, p), jnp.int32)
    elif jnp.shape(prompt_mask) != (b, p):
        msg = (
            f"prompt_mask must have the shape of prompt_ids {(b, p)}, got {jnp.shape(prompt_mask)}"
        )
        raise ValueError(msg)
    prompt_mask = jnp.asarray(prompt_mask, jnp.int32)
    # Only passed when set, so models whose hidden_states has no `remat` keep working.
    options: dict[str, Any] = {"remat": remat} if remat else {}
    if scan_layers:
        if not callable(getattr(model, "layer_stack", None)):
            msg = (
                "scan_layers=True needs a model with layer_stack() and "
                f"hidden_states(..., layer_stack=...); got {type(model).__name__}"
            )
            raise TypeError(msg)
        stack = model.layer_stack()
        if stack is not None:
            options["layer_stack"] = stack
    g = shared_prompt_group
    shared = g is not None and g > 1 and b % g == 0
    if shared and callable(getattr(model, "shared_prefix_hidden_states", None)):
        # One pass over the layers: each prompt followed by its G completions in one row.
        prompt_hidden, completion_hidden = model.shared_prefix_hidden_states(
            prompt_ids[::g].astype(jnp.int32),
            completion_ids.astype(jnp.int32),
            prompt_mask=prompt_mask[::g],
            **options,
        )
        first = jnp.repeat(prompt_hidden[:, -1:], g, axis=0)
        hidden = jnp.concatenate([first, completion_hidden[:, :-1]], axis=1)
    elif shared and hasattr(model, "init_cache"):
        cache = model.init_cache(b // g, p + t)
        prompt_hidden, cache = model.hidden_states(
            prompt_ids[::g].astype(jnp.int32),
            attention_mask=prompt_mask[::g],
            cache=cache,
            **options,
        )
        completion_hidden, _ = model.hidden_states(
            completion_ids.astype(jnp.int32),
            attention_mask=jnp.ones((b, t), jnp.int32),
            cache=cache.repeat(g),
            **options,
        )
        first = jnp.repeat(prompt_hidden[:, -1:], g, axis=0)
        hidden = jnp.concatenate([first, completion_hidden[:, :-1]], axis=1)
    else:
        ids = jnp.concatenate([prompt_ids, completion_ids], axis=1).astype(jnp.int32)
        mask = jnp.concatenate([prompt_mask, jnp.ones((b, t), jnp.int32)], axis=1)
        hidden, _ = model.hidden_states(ids, attention_mask=mask, **options)
        hidden = hidden[:, p - 1 : p + t - 1]
    # A tied embedding is used as stored, (V, D): its (D, V) transpose would be copied.
    rows = getattr(model, "output_embedding_rows", None)
    weight = rows() if callable(rows) else None
    transposed = weight is not None
    if weight is None:
        weight = model.output_embedding()
    # Soft-capped logits (Gemma): the cap first, the temperature after, as the sampler does.
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if temperature != 1.0 and softcap is None:
        hidden = hidden / jnp.asarray(temperature, hidden.dtype)
    return chunked_token_log_probs(
        hidden,
        weight,
        completion_ids,
        chunk_size=chunk_size,
        transposed=transposed,
        softcap=softcap,
        temperature=1.0 if softcap is None else temperature,
    )


def causal_lm_log_probs_fn(
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    remat: bool | int = False,
    scan_layers: bool = False,
) -> LogProbFn:
    """A log-prob function for causal LMs reading a :class:`GRPOBatch`.

    Args:
        chunk_size: Rows per logits chunk; ``None`` picks one from the vocabulary size.
        temperature: Sampling temperature the completions were drawn at (logits are divided).
        remat: Rematerialize the decoder layers (True) or every n-th layer (an int n >= 1) in
            the backward pass (see :func:`causal_lm_log_probs`).
        scan_layers: Run the decoder layers as one ``lax.scan`` (see
            :func:`causal_lm_log_probs`).

    Returns:
        ``fn(model, batch) -> (log_probs, entropy)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.training.rl import GRPOBatch, causal_lm_log_probs_fn
        >>> config = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                         num_layers=1, num_heads=2)
        >>> model = CausalLM(config, rngs=nnx.Rngs(0))
        >>> batch = GRPOBatch(
        ...     prompt_ids=jnp.array([[3, 4], [3, 4]]), completion_ids=jnp.array([[1, 2], [5, 6]]),
        ...     completion_mask=jnp.ones((2, 2)), rewards=jnp.array([1.0, 0.0]), group_size=2)
        >>> logp, entropy = causal_lm_log_probs_fn()(model, batch)
        >>> logp.shape, entropy.shape
        ((2, 2), (2, 2))
    """
    remat = check_remat("remat", remat)

    def fn(model: Any, batch: GRPOBatch) -> tuple[jax.Array, jax.Array]:
        return causal_lm_log_probs(
            model,
            batch.prompt_ids,
            batch.completion_ids,
            prompt_mask=batch.prompt_mask,
            chunk_size=chunk_size,
            temperature=temperature,
            shared_prompt_group=batch.group_size if batch.shared_prompts else None,
            remat=remat,
            scan_layers=scan_layers,
        )

    return fn


def categorical_log_probs(
    model: Any, batch: GRPOBatch, *, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies for a policy ``model(observations) -> logits``.

    ``logits`` of shape ``(B, V)`` score a single action per row (completion length 1);
    ``(B, T, V)`` score ``T`` actions per row.

    Args:
        model: Callable on ``batch.prompt_ids`` (the observations).
        batch: The batch; ``completion_ids`` holds the actions.
        temperature: Logits are divided by it.

    Returns:
        ``(log_probs, entropy)``, each ``(B, T)`` float32.

    Raises:
        ValueError: If the logits' shape does not fit the actions.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import GRPOBatch, categorical_log_probs
        >>> batch = GRPOBatch.from_dict({"observations": jnp.ones((2, 3)),
        ...                              "actions": jnp.array([0, 2]), "rewards": jnp.zeros(2)},
        ...                             group_size=2)
        >>> uniform = lambda obs: jnp.zeros((obs.shape[0], 4))  # 4 actions, equally likely
        >>> logp, entropy = categorical_log_probs(uniform, batch)
        >>> logp.shape, round(float(logp[0, 0]), 4), round(float(entropy[0, 0]), 4)
        ((2, 1), -1.3863, 1.3863)
    """
    logits = model(batch.prompt_ids)
    if temperature != 1.0:
        logits = logits / temperature
    b, t = batch.completion_ids.shape
    if logits.ndim == 2:
        logits = logits[:, None, :]
    if logits.shape[:2] != (b, t):
        msg = (
            f"policy logits of shape {logits.shape} do not fit actions of shape ({b}, {t}): "
            "expected (B, V) for one action per row or (B, T, V)"
        )
        raise ValueError(msg)
    return token_log_probs(logits, batch.completion_ids)


def default_log_prob_fn(
    model: Any, *, temperature: float = 1.0, remat: bool | int = False, scan_layers: bool = False
) -> LogProbFn:
    """Chooses the log-prob function for ``model``.

    Models with ``hidden_states`` and ``output_embedding`` methods (the library's causal LMs)
    get :func:`causal_lm_log_probs_fn`; any other callable is treated as a categorical policy
    ``model(observations) -> logits`` (:func:`categorical_log_probs`).

    Args:
        model: The policy.
        temperature: Logits are divided by it (the sampling temperature).
        remat: For causal LMs, rematerialize the decoder layers in the backward pass (True,
            ``GRPOConfig.remat``) or every n-th layer (an int n, ``GRPOConfig.remat_every``);
            categorical policies have no layers to rematerialize and ignore it.
        scan_layers: For causal LMs with ``layer_stack()``, run the decoder layers as one
            ``lax.scan`` (``GRPOConfig.scan_layers``); other models ignore it.

    Returns:
        A log-prob function.

    Raises:
        TypeError: If ``remat`` is neither a bool nor an int.
        ValueError: If ``remat`` is an int below 1, or above 1 for a model with
            ``scan_layers`` set.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import default_log_prob_fn
        >>> default_log_prob_fn(nnx.Linear(4, 3, rngs=nnx.Rngs(0))).__name__
        'categorical_log_probs'
    """
    remat = check_remat("remat", remat)
    if hasattr(model, "hidden_states") and hasattr(model, "output_embedding"):
        if remat is not True and remat > 1 and getattr(model, "scan_layers", False):
            msg = (
                f"remat={remat} (GRPOConfig.remat_every) rematerializes one layer in {remat}, "
                "which needs unrolled layers, but the model has scan_layers=True (a scan "
                "rematerializes all its layers or none): set model.scan_layers = False or "
                "remat_every=1"
            )
            raise ValueError(msg)
        scan = scan_layers and callable(getattr(model, "layer_stack", None))
        return causal_lm_log_probs_fn(temperature=temperature, remat=remat, scan_layers=scan)
    if temperature == 1.0:
        return categorical_log_probs
    return partial(categorical_log_probs, temperature=temperature)
