"""Attention kernels of the decoder: grouped-query, shared-prefix, and the KV-cache writes.

:func:`grouped_attention` is GQA with the query heads of a key/value head folded into one
batched product; :func:`shared_prefix_attention` runs a group's prompt once and its
completions against it (:class:`SharedPrefixMask`); :func:`write_slots` writes new keys and
values into the KV cache in place. ``Attention`` (in
:mod:`~artifex.generative_models.models.causal_lm.modules`) calls them.

Shapes are spelled with einsum letters: B batch, T target (query) length, S source (key) length,
N query heads, K key/value heads, G = N / K query heads per key/value head, H head width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from artifex.generative_models.models.causal_lm._products import f32_products

__all__ = ["SharedPrefixMask"]

#: Score given to masked (query, key) pairs: finite, so fully masked rows give a uniform softmax
#: instead of NaN.
MASK_VALUE = float(jnp.finfo(jnp.float32).min)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedPrefixMask:
    """Attention mask of groups laid out as one prompt followed by its completions.

    Each row of the batch is one group: ``prompt_length`` prompt tokens, then
    ``group_size`` completions of equal length one after the other. A prompt token attends to
    the earlier valid prompt tokens (``prompt``); a completion token attends to its group's
    valid prompt tokens (``prefix``) and to the earlier tokens of its own completion, never to
    another completion. Passed as the ``mask`` of a layer (see
    ``CausalLM.shared_prefix_hidden_states``), it runs prompt and completions through each
    layer together: the prompt's keys and values are computed once per group and read by all
    its completions, without a KV cache or a copy per completion.

    With ``window`` (sliding-window layers) a query also attends only to keys fewer than
    ``window`` slots back, counting slots as in ``[prompt ; completion]``: completion token
    ``t`` sits in slot ``P + t``.

    Attributes:
        prompt: Bool ``(B, P, P)``: prompt query ``t`` may attend to prompt key ``s``.
        prefix: Bool ``(B, P)``: prompt key ``s`` is a real token.
        group_size: Completions per group (static).
        prompt_length: ``P`` (static).
        window: Optional int32 scalar ``W`` (an array, so that layers with different windows
            share one structure); None: no window.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import SharedPrefixMask
        >>> valid = jnp.array([[False, True, True]])  # one left-padded prompt of 2 tokens
        >>> m = SharedPrefixMask(jnp.tril(jnp.ones((3, 3), bool))[None] & valid[:, None],
        ...                      valid, group_size=2, prompt_length=3)
        >>> m.prompt.shape, m.group_size
        ((1, 3, 3), 2)
    """

    prompt: jax.Array
    prefix: jax.Array
    group_size: int = dataclasses.field(metadata=dict(static=True))
    prompt_length: int = dataclasses.field(metadata=dict(static=True))
    window: jax.Array | None = None


def write_slots(cache: jax.Array, update: jax.Array, start: tuple[jax.Array, ...]) -> jax.Array:
    """``dynamic_update_slice(cache, update.astype(cache.dtype), start)``, in place.

    XLA:CPU has no 16-bit float ``dynamic_update_slice``: it converts the whole cache to
    float32, writes, and converts it back, a copy of the cache per layer and token. On the CPU
    the same bits are written as 16-bit integers, in place.
    """
    update = update.astype(cache.dtype)
    if not f32_products(cache.dtype):  # not a 16-bit float on the CPU
        return jax.lax.dynamic_update_slice(cache, update, start)
    bits = jax.lax.dynamic_update_slice(
        jax.lax.bitcast_convert_type(cache, jnp.uint16),
        jax.lax.bitcast_convert_type(update, jnp.uint16),
        start,
    )
    return jax.lax.bitcast_convert_type(bits, cache.dtype)


def grouped_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    keys_transposed: bool = False,
    scale: float | None = None,
) -> jax.Array:
    """GQA with the G query heads of a kv head folded into the query axis.

    Queries are laid out (B, K, Q, H) with Q = G * T (row `g * T + t`), keys and values
    (B, K, S, H), so both matmuls are batched over (B, K) with the contracted axis minor: the
    layout XLA's dot kernels want, with no relayout of the score matrices in the forward or the
    backward pass (faster on the CPU than contracting over (B, T, K, G, H) views). The KV cache
    holds the values in this layout and the keys as (B, K, H, S) (`keys_transposed=True`), so a
    decoding step (T = 1) reads both in place and scores its few query rows as a plain
    `(Q, H) x (H, S)` product (faster on XLA:CPU than contracting two minor axes).

    Args:
        q: Queries (B, T, N, H), query head `n = kv_head * G + g`.
        k: Keys (B, K, S, H), or (B, K, H, S) with `keys_transposed`.
        v: Values (B, K, S, H).
        mask: Bool (B, T, S).
        keys_transposed: `k` is laid out (B, K, H, S), as the KV cache holds it.
        scale: Factor of the scores; None means `1 / sqrt(H)`.

    Returns:
        Attention output (B, T, N, H).
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[1]
    groups = n // kv_heads
    queries = q.reshape(b, t, kv_heads, groups, h).transpose(0, 2, 3, 1, 4)
    queries = queries.reshape(b, kv_heads, groups * t, h)
    spec = "BKQH,BKHS->BKQS" if keys_transposed else "BKQH,BKSH->BKQS"
    scores = jnp.einsum(spec, queries, k, preferred_element_type=jnp.float32)
    allowed = jnp.tile(mask, (1, groups, 1))[:, None]  # (B, 1, G*T, S)
    scores = jnp.where(allowed, scores * (h**-0.5 if scale is None else scale), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    f32 = jnp.float32 if f32_products(v.dtype) or v.dtype != probs.dtype else None
    out = jnp.einsum("BKQS,BKSH->BKQH", probs, v, preferred_element_type=f32).astype(q.dtype)
    return out.reshape(b, kv_heads, groups, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def shared_prefix_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: SharedPrefixMask, *, scale: float | None = None
) -> jax.Array:
    """GQA over rows laid out as ``[prompt ; completion 1 ; ... ; completion C]``.

    The prompt part is plain causal attention (:func:`grouped_attention`). The completions'
    queries are scored against the group's prompt keys, shared (one matmul per group for all
    its completions), and against their own completion's keys (causal); one softmax runs over
    both, so the values equal those of encoding each completion after its own copy of the
    prompt.

    Args:
        q: Queries (B, L, N, H), ``L = P + C * T``.
        k: Keys (B, K, L, H).
        v: Values (B, K, L, H).
        mask: The layout and the prompt masks (and the window, if any).
        scale: Factor of the scores; None means `1 / sqrt(H)`.

    Returns:
        Attention output (B, L, N, H).
    """
    b, length, n, h = q.shape
    kv_heads = k.shape[1]
    groups = n // kv_heads
    p, c = mask.prompt_length, mask.group_size
    if p < 1 or c < 1 or length <= p or (length - p) % c:
        msg = (
            f"SharedPrefixMask(prompt_length={p}, group_size={c}) needs rows of the prompt "
            f"followed by {c} completions of equal length; got rows of {length} tokens"
        )
        raise ValueError(msg)
    t = (length - p) // c
    prompt_mask, prefix = mask.prompt, mask.prefix[:, None, None, None, :]
    causal = jnp.tile(jnp.tril(jnp.ones((t, t), jnp.bool_)), (groups, 1))  # (Q, T)
    if mask.window is not None:  # slots back from the query: prompt t - s, prefix P + t - s
        rows, cols = jnp.arange(p)[:, None], jnp.arange(p)[None, :]
        prompt_mask = prompt_mask & (rows - cols < mask.window)[None]
        query_slots = p + jnp.tile(jnp.arange(t), groups)[:, None]  # (Q, 1)
        prefix = prefix & (query_slots - cols < mask.window)
        own = jnp.tile(jnp.arange(t), groups)[:, None] - jnp.arange(t)[None, :]
        causal = causal & (own < mask.window)
    out_prompt = grouped_attention(q[:, :p], k[:, :, :p], v[:, :, :p], prompt_mask, scale=scale)
    # Completion queries as (B, K, C, Q, H), Q = G * T with row g * T + t as in grouped_attention
    queries = q[:, p:].reshape(b, c, t, kv_heads, groups, h).transpose(0, 3, 1, 4, 2, 5)
    queries = queries.reshape(b, kv_heads, c, groups * t, h)
    own_k = k[:, :, p:].reshape(b, kv_heads, c, t, h)
    own_v = v[:, :, p:].reshape(b, kv_heads, c, t, h)
    f32 = jnp.float32
    to_prefix = jnp.einsum("BKCQH,BKSH->BKCQS", queries, k[:, :, :p], preferred_element_type=f32)
    to_own = jnp.einsum("BKCQH,BKCSH->BKCQS", queries, own_k, preferred_element_type=f32)
    scale = h**-0.5 if scale is None else scale
    to_prefix = jnp.where(prefix, to_prefix * scale, MASK_VALUE)
    to_own = jnp.where(causal, to_own * scale, MASK_VALUE)
    # One softmax over both parts without joining them: the shift is the larger of the two
    # maxima (a constant for the gradient: the softmax does not depend on it), the exponentials
    # weight the values unnormalized and the sum divides the (Q, H) output, not the scores.
    # No concatenation of the score blocks and no slicing back, forward or backward.
    shift = jax.lax.stop_gradient(
        jnp.maximum(jnp.max(to_prefix, axis=-1), jnp.max(to_own, axis=-1))
    )[..., None]
    w_prefix = jnp.exp(to_prefix - shift)
    w_own = jnp.exp(to_own - shift)  # the largest entry gives exp(0) = 1: the sum is >= 1
    total = jnp.sum(w_prefix, axis=-1, keepdims=True) + jnp.sum(w_own, axis=-1, keepdims=True)
    pet = f32 if f32_products(v.dtype) else None
    out = jnp.einsum(
        "BKCQS,BKSH->BKCQH", w_prefix.astype(v.dtype), v[:, :, :p], preferred_element_type=pet
    )
    out = out + jnp.einsum(
        "BKCQS,BKCSH->BKCQH", w_own.astype(v.dtype), own_v, preferred_element_type=pet
    )
    out = (out / total).astype(v.dtype)
    out = out.reshape(b, kv_heads, c, groups, t, h).transpose(0, 2, 4, 1, 3, 5)
    return jnp.concatenate([out_prompt, out.reshape(b, c * t, n, h)], axis=1)
