"""Building blocks of the decoder: RMSNorm, linear projection, attention, SwiGLU MLP, layer.

Shapes are spelled with einsum letters: B batch, T target (query) length, S source (key) length,
N query heads, K key/value heads, G = N / K query heads per key/value head, H head width,
D model width, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from artifex.generative_models.models.causal_lm.config import CausalLMConfig
from artifex.generative_models.models.causal_lm.rope import apply_rope

__all__ = ["MLP", "Attention", "DecoderLayer", "Embed", "Linear", "RMSNorm", "SharedPrefixMask"]

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


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` in their dtype; on the CPU, 16-bit operands get a float32 product.

    On the CPU a bfloat16 product is computed with a float32 result and rounded once to
    bfloat16: the values of a bfloat16 product that accumulates in float32, which XLA:CPU runs
    on the CPU's matrix units where it has them (AMX), faster than a product with a bfloat16
    result (docs/benchmarks.md). Elsewhere (GPUs accumulate bfloat16 products in float32
    anyway) it is ``x @ w``.
    """
    if x.dtype == w.dtype and f32_products(x.dtype):
        return _matmul_f32_accumulate(x, w)
    return jnp.matmul(x, w)


def f32_products(dtype: Any) -> bool:
    """Whether products of ``dtype`` operands are computed with a float32 result (see `_matmul`).

    True for 16-bit floats on the CPU backend.
    """
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and jax.default_backend() == "cpu"


@jax.custom_vjp
def _matmul_f32_accumulate(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _matmul_f32_accumulate_fwd(x: jax.Array, w: jax.Array):
    return _matmul_f32_accumulate(x, w), (x, w)


def _matmul_f32_accumulate_bwd(res: tuple[jax.Array, jax.Array], ct: jax.Array):
    # The gradients as a product with a 16-bit cotangent would compute them (the cotangent of a
    # 16-bit result is 16-bit), accumulated in float32: without this rule JAX would multiply in
    # float32, converting the operands, and not use the matrix units.
    x, w = res
    ct = ct.astype(x.dtype)
    dx = jnp.matmul(ct, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.matmul(x.T, ct, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


_matmul_f32_accumulate.defvjp(_matmul_f32_accumulate_fwd, _matmul_f32_accumulate_bwd)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype: jnp.dtype) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation `y = x / sqrt(mean(x^2) + eps) * scale`.

    The statistic is computed in float32 and the normalised value cast back to the input dtype
    before the (learned) scale multiplies it, as in transformers' `LlamaRMSNorm`. With
    `unit_offset` (Gemma 3) the factor is `1 + scale`, `scale` starts at 0, and the product is
    taken in float32 before the cast, as in transformers' `Gemma3RMSNorm`.

    Args:
        dim: Width of the normalised (last) axis.
        eps: Epsilon added to the mean square.
        dtype: Parameter and compute dtype.
        unit_offset: Multiply by `1 + scale` (Gemma) instead of `scale`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import RMSNorm
        >>> norm = RMSNorm(4, eps=1e-6, dtype=jnp.float32)
        >>> y = norm(jnp.array([[2.0, -2.0, 2.0, -2.0]]))
        >>> y.round(4).tolist()  # unit root-mean-square, scale 1 at init
        [[1.0, -1.0, 1.0, -1.0]]

    References:
        Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019.
    """

    def __init__(
        self, dim: int, *, eps: float, dtype: jnp.dtype, unit_offset: bool = False
    ) -> None:
        self.scale = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), dtype))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises the last axis.

        Args:
            x: Array (..., dim).

        Returns:
            The normalised array, same shape and dtype as `x`.
        """
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        if self.unit_offset:
            y = x32 * jax.lax.rsqrt(var + self.eps)
            return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        y = (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.scale[...] * y


class Embed(nnx.Module):
    """Token embedding table `embedding` of shape (V, D), initialised N(0, std^2).

    Args:
        num_embeddings: Vocabulary size V.
        features: Width D.
        std: Standard deviation of the initialisation.
        dtype: Parameter and compute dtype.
        rngs: Random streams (`params`).
        padding_idx: Row initialised to zero (as transformers does for `pad_token_id`), or None.
        scale: Optional factor of the looked-up rows, applied in the table's dtype (Gemma's
            `sqrt(D)`, rounded to that dtype first as transformers does); the table itself
            (a tied output matrix) is not scaled.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import Embed
        >>> embed = Embed(16, 8, std=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0), padding_idx=0)
        >>> x = embed(jnp.array([[0, 5]]))
        >>> x.shape, float(jnp.abs(x[0, 0]).max())  # the padding row starts at zero
        ((1, 2, 8), 0.0)
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        std: float,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        padding_idx: int | None = None,
        scale: float | None = None,
    ) -> None:
        table = _normal(rngs, (num_embeddings, features), std, dtype)
        if padding_idx is not None and 0 <= padding_idx < num_embeddings:
            table = table.at[padding_idx].set(0)
        self.embedding = nnx.Param(table)
        self.scale = scale

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Looks up token ids.

        Ids outside [0, V) are clipped into range rather than producing NaN rows (a NaN key at a
        masked position would still poison the attention output through `0 * NaN`).

        Args:
            ids: Integer ids (B, T).

        Returns:
            Embeddings (B, T, D).
        """
        x = jnp.take(self.embedding[...], ids, axis=0, mode="clip")
        return x if self.scale is None else x * jnp.asarray(self.scale, x.dtype)


class Linear(nnx.Module):
    """Dense projection `y = x W + b` with kernel (in, out) and an optional LoRA adapter.

    The kernel is the transpose of the Hugging Face `nn.Linear.weight` (out, in). When `lora` is
    set (see `apply_lora`), `y += lora(x)`.

    Args:
        in_features: Input width.
        out_features: Output width.
        use_bias: Whether to add a bias (initialised to zero).
        std: Standard deviation of the normal initialisation of the kernel.
        dtype: Parameter and compute dtype.
        rngs: Random streams (`params`).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import Linear
        >>> proj = Linear(8, 4, use_bias=True, std=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> proj.kernel.shape, proj(jnp.ones((2, 8))).shape
        ((8, 4), (2, 4))
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool,
        std: float,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.kernel = nnx.Param(_normal(rngs, (in_features, out_features), std, dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None
        self.lora: Any = nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Projects the last axis.

        Args:
            x: Array (..., in).

        Returns:
            Array (..., out) in the dtype of `x`.
        """
        # Tokens are flattened to one row axis: XLA:CPU runs a 2-D (N, in) x (in, out) matmul
        # and its gradient much faster than the same product with (B, T, in) activations.
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        y = _matmul(x2, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora is not None:
            y = y + self.lora(x2).astype(y.dtype)
        return y.reshape(*lead, y.shape[-1])


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k RMSNorm and an optional KV cache.

    `softmax(s q k^T + mask) v` per head with `s = config.attention_scale` (`1 / sqrt(H)`,
    or Gemma 3's `1 / sqrt(query_pre_attn_scalar)`), where query head `n` reads key/value head
    `n // G`. Keys and values are never repeated: queries are viewed as (B, T, K, G, H) and the
    einsums contract over shared K. Scores and the softmax are float32.

    Args:
        config: Model configuration.
        dtype: Parameter and compute dtype.
        rngs: Random streams (`params`).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import Attention, CausalLMConfig
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=4, num_kv_heads=2)
        >>> attn = Attention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> attn.q_proj.kernel.shape, attn.k_proj.kernel.shape  # 4 query heads, 2 kv heads of 2
        ((8, 8), (8, 4))

    References:
        Vaswani et al., "Attention Is All You Need", 2017; Ainslie et al., "GQA: Training
        Generalized Multi-Query Transformer Models from Multi-Head Checkpoints", 2023.
    """

    def __init__(self, config: CausalLMConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        std = config.initializer_range
        qkv_bias = config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.scale = config.attention_scale
        self.q_proj = Linear(d, n * h, use_bias=qkv_bias, std=std, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, k * h, use_bias=qkv_bias, std=std, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, k * h, use_bias=qkv_bias, std=std, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(
            n * h, d, use_bias=config.attention_out_bias, std=std, dtype=dtype, rngs=rngs
        )
        if config.qk_norm:
            offset = config.norm_unit_offset
            self.q_norm = RMSNorm(h, eps=config.rms_norm_eps, dtype=dtype, unit_offset=offset)
            self.k_norm = RMSNorm(h, eps=config.rms_norm_eps, dtype=dtype, unit_offset=offset)
        else:
            self.q_norm = None
            self.k_norm = None

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Attends the T new tokens to themselves or to the cached slots.

        Args:
            x: Normalised hidden states (B, T, D).
            cos: RoPE cosines (B, T, H/2).
            sin: RoPE sines (B, T, H/2).
            mask: Bool (B, T, S): query t may attend to key s. S = T without a cache. Or a
                `SharedPrefixMask` (no cache): each row is a prompt followed by its
                completions.
            kv: None, or this layer's cache `(keys, values)`, keys (B, K, H, S) and values
                (B, K, S, H) (see `KVCache`); the new keys and values are written at slots
                `[index, index + T)` and attention runs over all S slots.
            index: int32 scalar, first slot to write (with `kv`).

        Returns:
            `(out, kv)`: the output (B, T, D) and the layer's updated cache (None without one).
        """
        b, t, _ = x.shape
        n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).reshape(b, t, n, h)
        key = self.k_proj(x).reshape(b, t, k, h)
        value = self.v_proj(x).reshape(b, t, k, h)
        if self.q_norm is not None:
            q = self.q_norm(q)
            key = self.k_norm(key)
        q = apply_rope(q, cos, sin)
        key = apply_rope(key, cos, sin).transpose(0, 2, 1, 3)  # (B, K, T, H)
        value = value.transpose(0, 2, 1, 3)

        if kv is not None:
            keys, values = kv
            zero = jnp.zeros((), jnp.asarray(index).dtype)  # one index dtype, also under x64
            keys = _write_slots(keys, key.swapaxes(2, 3), (zero, zero, zero, index))
            values = _write_slots(values, value, (zero, zero, index, zero))
            kv = (keys, values)
            # Read in the cache's dtype (the products promote and accumulate in float32).
            key, value = keys, values
        if isinstance(mask, SharedPrefixMask):
            if kv is not None:
                msg = "a SharedPrefixMask runs without a KV cache"
                raise ValueError(msg)
            out = _shared_prefix_attention(q, key, value, mask, scale=self.scale)
        else:
            out = _grouped_attention(
                q, key, value, mask, keys_transposed=kv is not None, scale=self.scale
            )
        return self.o_proj(out.reshape(b, t, n * h)), kv


def _write_slots(cache: jax.Array, update: jax.Array, start: tuple[jax.Array, ...]) -> jax.Array:
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


def _grouped_attention(
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


def _shared_prefix_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: SharedPrefixMask, *, scale: float | None = None
) -> jax.Array:
    """GQA over rows laid out as ``[prompt ; completion 1 ; ... ; completion C]``.

    The prompt part is plain causal attention (:func:`_grouped_attention`). The completions'
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
    out_prompt = _grouped_attention(q[:, :p], k[:, :, :p], v[:, :, :p], prompt_mask, scale=scale)
    # Completion queries as (B, K, C, Q, H), Q = G * T with row g * T + t as in _grouped_attention
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


class MLP(nnx.Module):
    """Gated feed-forward block `down(act(gate(x)) * up(x))`.

    `act` is SiLU (SwiGLU) or, with `config.hidden_act="gelu_pytorch_tanh"` (Gemma 3), GELU's
    tanh approximation `x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.

    Args:
        config: Model configuration.
        dtype: Parameter and compute dtype.
        rngs: Random streams (`params`).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import MLP, CausalLMConfig
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> mlp = MLP(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> mlp(jnp.ones((1, 3, 8))).shape, mlp.up_proj.kernel.shape
        ((1, 3, 8), (8, 16))

    References:
        Shazeer, "GLU Variants Improve Transformer", 2020.
    """

    def __init__(self, config: CausalLMConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, f, std = config.hidden_size, config.intermediate_size, config.initializer_range
        self.gate_proj = Linear(d, f, use_bias=False, std=std, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, use_bias=False, std=std, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, use_bias=False, std=std, dtype=dtype, rngs=rngs)
        self.activation = config.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the block.

        Args:
            x: Array (B, T, D).

        Returns:
            Array (B, T, D).
        """
        gate = self.gate_proj(x)
        if self.activation == "gelu_pytorch_tanh":
            gate = jax.nn.gelu(gate, approximate=True)
        else:
            gate = jax.nn.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer: `h = x + attn(attn_norm(x)); y = h + mlp(mlp_norm(h))`.

    With `config.post_norms` (Gemma 3) the block outputs are normalized too:
    `h = x + post_attn_norm(attn(attn_norm(x))); y = h + post_mlp_norm(mlp(mlp_norm(h)))`.

    Args:
        config: Model configuration.
        dtype: Parameter and compute dtype.
        rngs: Random streams (`params`).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLMConfig, DecoderLayer
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> layer = DecoderLayer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> type(layer.attn).__name__, type(layer.mlp).__name__
        ('Attention', 'MLP')
    """

    def __init__(self, config: CausalLMConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_unit_offset
        self.attn_norm = RMSNorm(d, eps=eps, dtype=dtype, unit_offset=offset)
        self.attn = Attention(config, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype, unit_offset=offset)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)
        if config.post_norms:
            self.post_attn_norm = RMSNorm(d, eps=eps, dtype=dtype, unit_offset=offset)
            self.post_mlp_norm = RMSNorm(d, eps=eps, dtype=dtype, unit_offset=offset)
        else:
            self.post_attn_norm = None
            self.post_mlp_norm = None

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Applies the layer.

        Args:
            x: Hidden states (B, T, D).
            cos: RoPE cosines (B, T, H/2).
            sin: RoPE sines (B, T, H/2).
            mask: Bool attention mask (B, T, S).
            kv: Optional cache `(keys, values)` of this layer, see `Attention`.
            index: First slot to write (with `kv`).

        Returns:
            `(y, kv)`: hidden states (B, T, D) and the updated cache (or None).
        """
        attn_out, kv = self.attn(self.attn_norm(x), cos, sin, mask, kv, index)
        if self.post_attn_norm is not None:
            attn_out = self.post_attn_norm(attn_out)
        h = x + attn_out
        mlp_out = self.mlp(self.mlp_norm(h))
        if self.post_mlp_norm is not None:
            mlp_out = self.post_mlp_norm(mlp_out)
        return h + mlp_out, kv
