"""Building blocks of the decoder: RMSNorm, linear projection, attention, SwiGLU MLP, layer.

Shapes are spelled with einsum letters: B batch, T target (query) length, S source (key) length,
N query heads, K key/value heads, G = N / K query heads per key/value head, H head width,
D model width, F MLP width, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from artifex.generative_models.models.causal_lm._products import matmul
from artifex.generative_models.models.causal_lm.attention_ops import (
    SharedPrefixMask,
    grouped_attention,
    shared_prefix_attention,
    write_slots,
)
from artifex.generative_models.models.causal_lm.config import CausalLMConfig
from artifex.generative_models.models.causal_lm.rope import apply_rope

__all__ = ["MLP", "Attention", "DecoderLayer", "Embed", "Linear", "RMSNorm"]


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
        y = matmul(x2, self.kernel[...])
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
            keys = write_slots(keys, key.swapaxes(2, 3), (zero, zero, zero, index))
            values = write_slots(values, value, (zero, zero, index, zero))
            kv = (keys, values)
            # Read in the cache's dtype (the products promote and accumulate in float32).
            key, value = keys, values
        if isinstance(mask, SharedPrefixMask):
            if kv is not None:
                msg = "a SharedPrefixMask runs without a KV cache"
                raise ValueError(msg)
            out = shared_prefix_attention(q, key, value, mask, scale=self.scale)
        else:
            out = grouped_attention(
                q, key, value, mask, keys_transposed=kv is not None, scale=self.scale
            )
        return self.o_proj(out.reshape(b, t, n * h)), kv


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
