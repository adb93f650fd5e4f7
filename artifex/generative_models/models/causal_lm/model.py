"""The decoder-only causal LM (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE, Mistral, Gemma 3) in Flax NNX.

Parameter paths (as in `nnx.state(model)`, dotted; `i` is the layer index) and the Hugging Face
tensors they load from (linear kernels are the transposed HF weights):

- `embed.embedding` (V, D) <- `model.embed_tokens.weight`
- `layers.i.attn_norm.scale` (D,) <- `model.layers.i.input_layernorm.weight`
- `layers.i.attn.{q,k,v,o}_proj.kernel` `(D, N*H)` / `(D, K*H)` / `(D, K*H)` / `(N*H, D)`
  <- `model.layers.i.self_attn.{q,k,v,o}_proj.weight`.T
- `layers.i.attn.{q,k,v,o}_proj.bias` <- `....bias` (q/k/v with `attention_bias`; o_proj for
  Llama/Qwen3 with `attention_bias`)
- `layers.i.attn.{q,k}_norm.scale` (H,) <- `model.layers.i.self_attn.{q,k}_norm.weight` (Qwen3,
  Gemma 3)
- `layers.i.mlp_norm.scale` (D,) <- `model.layers.i.post_attention_layernorm.weight` (Gemma 3:
  `model.layers.i.pre_feedforward_layernorm.weight`)
- Gemma 3 only: `layers.i.post_attn_norm.scale` (D,) <-
  `model.layers.i.post_attention_layernorm.weight`, `layers.i.post_mlp_norm.scale` (D,) <-
  `model.layers.i.post_feedforward_layernorm.weight`; Gemma's norm scales hold transformers'
  `w` (the norms multiply by `1 + w`)
- `layers.i.mlp.{gate,up}_proj.kernel` (D, F), `layers.i.mlp.down_proj.kernel` (F, D)
  <- `model.layers.i.mlp.{gate,up,down}_proj.weight`.T
- Qwen3-MoE instead: `layers.i.mlp.gate.kernel` (D, E) <- `model.layers.i.mlp.gate.weight`.T
  (the router) and `layers.i.mlp.experts.{gate,up}_proj` (E, D, I),
  `layers.i.mlp.experts.down_proj` (E, I, D) <- `model.layers.i.mlp.experts.j.{...}.weight`.T
  stacked over the experts `j`
- `final_norm.scale` (D,) <- `model.norm.weight`
- `lm_head.kernel` (D, V) <- `lm_head.weight`.T (untied models only)

LoRA adapters (see `apply_lora`) add `<proj>.lora.lora_a` (in, r) and `<proj>.lora.lora_b`
(r, out), both `nnx.LoRAParam`.

After `model.stack_layers()` the decoder layers are stored stacked: one variable per kind of
layer weight, with a leading layer axis, at `layers.<name>` instead of `layers.i.<name>` (e.g.
`layers.attn.q_proj.kernel` of shape `(L, D, N*H)`); `unstack_layers()` goes back.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from artifex.generative_models.models.causal_lm.cache import KVCache
from artifex.generative_models.models.causal_lm.config import (
    CausalLMConfig,
    RopeScaling,
    resolve_dtype,
)
from artifex.generative_models.models.causal_lm.gguf import GGUFCheckpoint, is_gguf_file, read_gguf
from artifex.generative_models.models.causal_lm.hf_io import (
    load_hf_weights,
    place_tensors,
    read_hf_config,
)
from artifex.generative_models.models.causal_lm.hf_io import save_pretrained as _save_pretrained
from artifex.generative_models.models.causal_lm.modules import (
    DecoderLayer,
    Embed,
    Linear,
    RMSNorm,
    SharedPrefixMask,
    f32_products,
)
from artifex.generative_models.models.causal_lm.moe import MoEDecoderLayer, RouterTrace
from artifex.generative_models.models.causal_lm.rope import rope_cos_sin, rope_inv_frequencies
from artifex.generative_models.models.causal_lm.tokenizer import Tokenizer
from artifex.generative_models.utils.validation import check_remat

__all__ = [
    "CausalLM",
    "LayerStack",
    "from_pretrained",
    "load_gguf",
    "positions_from_mask",
    "resolve_dtype",
]

Rules = Callable[[str, tuple[int, ...]], PartitionSpec]


def positions_from_mask(attention_mask: jax.Array, offset: jax.Array | int = 0) -> jax.Array:
    """Positions of left-padded rows: `p_t = offset + cumsum(mask)_t - 1`, clipped at 0.

    This is the Hugging Face convention: the first real token of each row gets position
    `offset` whatever the amount of left padding; padding gets position 0 (or the position of the
    last real token before it).

    Args:
        attention_mask: (B, T), 1 on real tokens, 0 on padding.
        offset: (B,) or scalar number of real tokens already seen (e.g. in a KV cache).

    Returns:
        int32 positions (B, T).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import positions_from_mask
        >>> positions_from_mask(jnp.array([[0, 0, 1, 1], [1, 1, 1, 1]])).tolist()
        [[0, 0, 0, 1], [0, 1, 2, 3]]
        >>> positions_from_mask(jnp.array([[1, 1]]), offset=3).tolist()
        [[3, 4]]
    """
    mask = attention_mask.astype(jnp.int32)
    offset = jnp.asarray(offset, jnp.int32)
    if offset.ndim == 1:
        offset = offset[:, None]
    return jnp.maximum(offset + jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)


@functools.lru_cache(maxsize=32)
def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    return rope_inv_frequencies(head_dim, theta, scaling)


def _cache_dtype(compute_dtype: Any) -> jnp.dtype:
    """The default KV-cache dtype (see ``CausalLM.init_cache``)."""
    dtype = jnp.dtype(compute_dtype)
    return jnp.dtype(jnp.float32) if f32_products(dtype) else dtype


_ROPE_TABLE_MAX_ENTRIES = 1 << 18  # positions x H/2; above it the angles are computed in place


def _rope_tables(
    positions: jax.Array, inv_freq: np.ndarray, dtype: jnp.dtype, bound: int | None
) -> tuple[jax.Array, jax.Array]:
    """``rope_cos_sin(positions, ...)``, looked up in a table of positions ``[0, bound)``.

    Computed in place, XLA fuses the cosines and sines into every layer's query and key
    rotation (forward and backward) and evaluates them there again, per head and per use. The
    table is computed once, when the program is traced, by the same XLA operations, so the
    values are the same. ``bound`` is None when the positions come from the caller (any
    value): then they are computed in place.
    """
    if bound is None or bound * inv_freq.shape[0] > _ROPE_TABLE_MAX_ENTRIES:
        return rope_cos_sin(positions, inv_freq, dtype)
    table_cos, table_sin = _rope_table(bound, inv_freq.tobytes(), jnp.dtype(dtype).name)
    # An out-of-range position would read NaN ("fill"), never another position's angles.
    cos = jnp.take(table_cos, positions, axis=0, mode="fill")
    sin = jnp.take(table_sin, positions, axis=0, mode="fill")
    return cos, sin


@functools.lru_cache(maxsize=64)
def _rope_table(bound: int, inv_freq: bytes, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The cosines and sines of positions ``[0, bound)``: (bound, H/2) host arrays."""
    freqs = np.frombuffer(inv_freq, np.float32)
    # Evaluated now, by XLA, even inside a trace: compiled as one program and called with
    # host arrays (under `ensure_compile_time_eval` each of its operations would be compiled
    # and run alone, five programs); its own small transfer to the host.
    with jax.transfer_guard("allow"):
        cos, sin = _rope_table_program.lower(bound, freqs, dtype).compile()(freqs)
        return np.asarray(cos), np.asarray(sin)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _rope_table_program(bound: int, inv_freq: jax.Array, dtype: str) -> tuple[jax.Array, jax.Array]:
    cos, sin = rope_cos_sin(jnp.arange(bound, dtype=jnp.int32)[None], inv_freq, jnp.dtype(dtype))
    return cos[0], sin[0]


class CausalLM(nnx.Module):
    """Decoder-only transformer language model (Llama 3, Qwen2/2.5, Qwen3, Mistral, Gemma 3).

    `logits = RMSNorm(h_L) W_out`, `h_l = Layer_l(h_{l-1})`, `h_0 = E[ids]`. Parameters live in the
    parameter dtype (config `param_dtype`, or `dtype`) and compute runs in it, except the
    RMSNorm statistics and the attention softmax (float32) and the logits (always float32).
    Initialisation follows transformers: weights N(0, initializer_range^2), biases 0, norms 1.
    See the module docstring for the parameter paths.

    Args:
        config: The architecture.
        rngs: Random streams; `rngs.params()` draws the initial weights.
        dtype: Optional override of `config.param_dtype` ("float32", "bfloat16" or a dtype); the
            stored config is updated to match.
        scan_layers: Run the decoder layers as one `jax.lax.scan` over their stacked weights
            instead of unrolling them in Python. The values are the same; the
            compiled programs hold one layer instead of `num_layers`, so they compile faster
            and need less memory. The attribute `model.scan_layers` can be changed
            after construction (it is read when a function is traced).

    Attributes:
        layers_stacked: Whether the decoder layers are stored stacked (`stack_layers()`).

    Raises:
        ValueError: If `dtype` is not float32 or bfloat16.
        TypeError: If `scan_layers` is not a bool.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> config = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                         num_layers=1, num_heads=2)
        >>> model = CausalLM(config, rngs=nnx.Rngs(0))
        >>> logits = model(jnp.array([[1, 2, 3]]))
        >>> logits.shape, logits.dtype
        ((1, 3, 16), dtype('float32'))
        >>> hidden, _ = model.hidden_states(jnp.array([[1, 2, 3]]))
        >>> bool(jnp.allclose(model.logits_from_hidden(hidden), logits))
        True
    """

    def __init__(
        self,
        config: CausalLMConfig,
        *,
        rngs: nnx.Rngs,
        dtype: str | jnp.dtype | None = None,
        scan_layers: bool = False,
    ) -> None:
        if not isinstance(config, CausalLMConfig):
            msg = f"config must be a CausalLMConfig, got {type(config).__name__}"
            raise TypeError(msg)
        dt = resolve_dtype(config.param_dtype if dtype is None else dtype)
        if dt.name != config.param_dtype:
            config = config.replace(param_dtype=dt.name)
        if not isinstance(scan_layers, bool):
            msg = f"scan_layers must be a bool, got {type(scan_layers).__name__} {scan_layers!r}"
            raise TypeError(msg)
        self.config = config
        self.dtype = dt
        self.scan_layers = scan_layers
        self.layers_stacked = False
        std = config.initializer_range
        self.embed = Embed(
            config.vocab_size,
            config.hidden_size,
            std=std,
            dtype=dt,
            rngs=rngs,
            padding_idx=config.pad_token_id,
            scale=config.embed_scale,
        )
        layer_cls = MoEDecoderLayer if config.is_moe else DecoderLayer
        self.layers = nnx.List(
            [layer_cls(config, dtype=dt, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.final_norm = RMSNorm(
            config.hidden_size,
            eps=config.rms_norm_eps,
            dtype=dt,
            unit_offset=config.norm_unit_offset,
        )
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(
                config.hidden_size, config.vocab_size, use_bias=False, std=std, dtype=dt, rngs=rngs
            )

    # ------------------------------------------------------------------ forward

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Computes next-token logits.

        Args:
            input_ids: Token ids (B, T).
            attention_mask: (B, T), 1 on real tokens and 0 on (left) padding; None means all 1.
            positions: Optional int positions (B, T); by default `positions_from_mask`.

        Returns:
            float32 logits (B, T, V).
        """
        hidden, _ = self.hidden_states(input_ids, attention_mask, positions)
        return self.logits_from_hidden(hidden)

    def hidden_states(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        cache: KVCache | None = None,
        *,
        remat: bool | int = False,
        layer_stack: LayerStack | None = None,
        routing: jax.Array | bool | None = None,
    ) -> tuple[jax.Array, KVCache | None] | tuple[jax.Array, KVCache | None, RouterTrace]:
        """Runs the decoder and returns the final-norm hidden states.

        Without a cache, token `t` attends to tokens `s <= t` with `mask[s] = 1`. With a cache,
        the T new keys/values are written at slots `[cache.index, cache.index + T)`, their
        validity set from `attention_mask`, and the token at slot `q` attends to every slot
        `s <= q` that is valid; default positions then continue from the number of valid slots.
        Query rows of padding tokens attend to nothing real but stay finite.

        With `remat` (gradient checkpointing) a reverse-mode gradient keeps only each
        rematerialized layer's inputs (its hidden states and, with a cache, its own keys and
        values) and recomputes the layer in the backward pass, for about one more forward pass
        of compute; `jax.jvp` is not supported then.

        With `model.scan_layers` the layers run as one `jax.lax.scan` over their weights stacked
        on a new leading axis (`layer_stack()`: the model's own arrays after `stack_layers()`,
        else a copy made inside the traced function, once per call); pass a `layer_stack`
        computed once to reuse it across calls. Either form of cache (stacked, per layer)
        works with either kind of layers and is returned in its form.

        Args:
            input_ids: Token ids (B, T).
            attention_mask: (B, T), 1 on real tokens, 0 on padding; None means all 1.
            positions: Optional int positions (B, T); by default `positions_from_mask` (offset by
                the valid slots of the cache).
            cache: Optional `KVCache` from `init_cache` (or a previous call).
            remat: Rematerialize every decoder layer in the backward pass (less activation
                memory, more compute); an int n >= 1: layers 0, n, 2n, ... only (`1` is every
                layer). Scanned layers take only True or 1.
            layer_stack: Optional result of `layer_stack()` for this model's current weights; the
                layers are then scanned with it whatever `scan_layers` says.
            routing: Mixture-of-experts models: True returns the layers' `RouterTrace` too;
                experts `(L, B, T, k)` are routed to instead (replay, -1: the router's).

        Returns:
            `(hidden, cache)`: hidden states (B, T, D) in the compute dtype and the updated cache
            (`index` advanced by T), or None when no cache was passed (the trace third with
            `routing`).

        Raises:
            ValueError: If `input_ids` is not 2-D, a mask / positions / cache shape disagrees,
                `remat` is an int < 1 (or > 1 with scanned layers), or `routing` is invalid.
            TypeError: If `remat` is neither a bool nor an int.
        """
        if input_ids.ndim != 2:
            msg = f"input_ids must be (B, T), got shape {input_ids.shape}"
            raise ValueError(msg)
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), jnp.int32)
        elif attention_mask.shape != (b, t):
            msg = f"attention_mask must have shape {(b, t)}, got {attention_mask.shape}"
            raise ValueError(msg)
        if positions is not None and positions.shape != (b, t):
            msg = f"positions must have shape {(b, t)}, got {positions.shape}"
            raise ValueError(msg)
        token_valid = attention_mask.astype(jnp.bool_)
        remat = check_remat("remat", remat)

        bound = None  # positions are below it when derived here (see _rope_tables)
        if cache is None:
            if positions is None:
                positions, bound = positions_from_mask(attention_mask), t
            causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
            mask = causal[None, :, :] & token_valid[:, None, :]
            kv = None
            index = None
        else:
            _check_cache(cache, self.config, b)
            index = cache.index
            if not isinstance(index, jax.core.Tracer) and int(index) + t > cache.max_length:
                msg = (
                    f"the cache has {cache.max_length - int(index)} free slots of "
                    f"{cache.max_length}, {t} tokens do not fit (init_cache(max_length=...))"
                )
                raise ValueError(msg)
            if positions is None:
                offset = jnp.sum(cache.valid, axis=-1, dtype=jnp.int32)
                positions = positions_from_mask(attention_mask, offset)
                bound = cache.max_length
            zero = jnp.zeros((), jnp.asarray(index).dtype)  # one index dtype, also under x64
            valid = jax.lax.dynamic_update_slice(cache.valid, token_valid, (zero, index))
            slots = jnp.arange(cache.max_length, dtype=jnp.int32)
            query_slots = index + jnp.arange(t, dtype=jnp.int32)
            mask = valid[:, None, :] & (slots[None, None, :] <= query_slots[None, :, None])
            kv = (cache.keys, cache.values)

        moe = self._routing_input(routing, token_valid)
        q_slots = jnp.arange(t, dtype=jnp.int32) if cache is None else query_slots
        (cos, sin, mask), sliding = self._attention_inputs(
            positions, bound, mask, q_slots, jnp.arange(mask.shape[-1], dtype=jnp.int32)
        )
        h = self.embed(input_ids).astype(self.dtype)
        h, kv, trace = self._run_layers(
            h, cos, sin, mask, kv, index, remat, layer_stack, sliding, moe
        )
        hidden = self.final_norm(h)
        traced = () if routing is None or routing is False else (trace,)
        if cache is None:
            return hidden, None, *traced
        keys, values = kv
        if cache.stacked and isinstance(keys, tuple):
            keys, values = jnp.stack(keys), jnp.stack(values)
        elif not cache.stacked and not isinstance(keys, tuple):
            keys, values = tuple(keys), tuple(values)
        new_cache = cache.replace(keys=keys, values=values, valid=valid, index=index + t)
        return hidden, new_cache, *traced

    def _routing_input(
        self, routing: jax.Array | bool | None, valid: jax.Array
    ) -> tuple[jax.Array | None, jax.Array] | None:
        """The layers' `(replay, valid)` for a mixture-of-experts model (None for dense ones)."""
        cfg = self.config
        if not cfg.is_moe:
            if routing is not None and routing is not False:
                msg = (
                    f"routing: only mixture-of-experts models route tokens (model_type "
                    f"'qwen3_moe'); this model is {cfg.model_type!r}"
                )
                raise ValueError(msg)
            return None
        if routing is None or isinstance(routing, bool):
            return None, valid
        expected = (cfg.num_layers, *valid.shape, cfg.num_experts_per_tok)
        if jnp.shape(routing) != expected:
            msg = (
                f"routing: replayed experts must have shape (L, B, T, k) = {expected}, got "
                f"{jnp.shape(routing)}"
            )
            raise ValueError(msg)
        if not jnp.issubdtype(jnp.result_type(routing), jnp.integer):
            msg = f"routing: replayed experts must be integers, got {jnp.result_type(routing)}"
            raise ValueError(msg)
        return jnp.asarray(routing, jnp.int32), valid

    def _attention_inputs(
        self,
        positions: jax.Array,
        bound: int | None,
        mask: Any,
        query_slots: jax.Array,
        key_slots: jax.Array,
    ) -> tuple[tuple[jax.Array, jax.Array, Any], tuple[jax.Array, jax.Array, Any] | None]:
        """The layers' `(cos, sin, mask)`, and those of the sliding-window layers if they differ.

        A sliding-window layer's mask also requires `query_slot - key_slot < sliding_window`
        (slots: (T,) and (S,), or per row (B, T) and (B, S)); a `SharedPrefixMask` gets the
        window as its `window`. Gemma 3's sliding-window layers take RoPE tables of base
        `rope_local_theta`, unscaled. When every layer is of one kind the first element holds
        that kind's inputs and the second is None; when they mix (Gemma 3), the first holds the
        full-attention layers' inputs and the second the sliding-window layers'.
        """
        cfg = self.config
        inv_freq = _inv_freq(cfg.head_dim, float(cfg.rope_theta), cfg.rope_scaling)
        cos, sin = _rope_tables(positions, inv_freq, self.dtype, bound)
        kinds = set(cfg.sliding_layers)
        if True not in kinds:
            return (cos, sin, mask), None
        if cfg.model_type == "gemma3_text":
            local_freq = _inv_freq(cfg.head_dim, float(cfg.rope_local_theta), None)
            local_cos, local_sin = _rope_tables(positions, local_freq, self.dtype, bound)
        else:
            local_cos, local_sin = cos, sin
        window = cfg.sliding_window
        if isinstance(mask, SharedPrefixMask):
            local_mask = dataclasses.replace(mask, window=jnp.asarray(window, jnp.int32))
            # one structure for both kinds (scanned layers select between them)
            no_window = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
            mask = dataclasses.replace(mask, window=no_window)
        else:
            band = (query_slots[..., :, None] - key_slots[..., None, :]) < window
            local_mask = mask & (band[None] if band.ndim == 2 else band)
        sliding = (local_cos, local_sin, local_mask)
        if kinds == {True}:
            return sliding, None
        return (cos, sin, mask), sliding

    def _run_layers(
        self,
        h: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: Any,
        kv: KVPairs | None,
        index: jax.Array | None,
        remat: bool | int,
        layer_stack: LayerStack | None,
        sliding: tuple[jax.Array, jax.Array, Any] | None = None,
        routing: tuple[jax.Array | None, jax.Array] | None = None,
    ) -> tuple[jax.Array, KVPairs | None, RouterTrace | None]:
        """Runs the decoder layers: scanned, rematerialized or unrolled (see `hidden_states`).

        With `sliding` (see `_attention_inputs`), the layers `config.sliding_layers` marks take
        those `(cos, sin, mask)` instead. Mixture-of-experts layers take `routing` (`(replay
        (L, B, T, k) or None, valid (B, T))`) and their traces are returned stacked (None for
        dense layers).
        """
        flags = None if sliding is None else self.config.sliding_layers
        if layer_stack is None and getattr(self, "scan_layers", False):
            layer_stack = self.layer_stack()
        if layer_stack is not None:
            if remat is not True and remat > 1:
                msg = (
                    f"remat={remat} (one layer in {remat}) needs unrolled layers; scanned "
                    "layers rematerialize all of them or none (remat=True or False)"
                )
                raise ValueError(msg)
            return _scan_layers(
                layer_stack, h, cos, sin, mask, kv, index, remat=bool(remat),
                sliding=sliding, flags=flags, routing=routing,
            )  # fmt: skip
        layers = self._layer_states()
        if remat:
            every = 1 if remat is True else int(remat)
            return _remat_layers(
                layers, h, cos, sin, mask, kv, index, every, sliding, flags, routing
            )
        new_kv, traces = [], []
        for i, (graphdef, state) in enumerate(layers):
            layer_kv = None if kv is None else (kv[0][i], kv[1][i])
            c, s, m = sliding if flags is not None and flags[i] else (cos, sin, mask)
            out = _traced_once_layer_step(
                graphdef, state, h, c, s, m, layer_kv, index, _layer_routing(routing, i)
            )
            h, layer_kv = out[0], out[1]
            new_kv.append(layer_kv)
            traces.append(out[2] if len(out) > 2 else None)
        return h, None if kv is None else _unzip(new_kv), _stack_traces(traces)

    def _layer_states(self) -> list[tuple[nnx.GraphDef, nnx.State]]:
        """Each decoder layer's `(graphdef, state)`; stacked layers are split along axis 0.

        Splitting stacked layers slices their weights (a copy inside a traced function), and
        the gradient of the slices is their concatenation (`lax.split`), one copy back.
        """
        if not getattr(self, "layers_stacked", False):
            return [nnx.split(layer) for layer in self.layers]
        graphdef, stacked = nnx.split(self.layers)
        n = self.config.num_layers
        leaves, treedef = jax.tree.flatten(stacked)
        parts = [jax.lax.split(x, [1] * n, axis=0) for x in leaves]
        return [
            (graphdef, jax.tree.unflatten(treedef, [jnp.squeeze(p[i], 0) for p in parts]))
            for i in range(n)
        ]

    def shared_prefix_hidden_states(
        self,
        prompt_ids: jax.Array,
        completion_ids: jax.Array,
        *,
        prompt_mask: jax.Array | None = None,
        remat: bool | int = False,
        layer_stack: LayerStack | None = None,
        routing: jax.Array | bool | None = None,
    ) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, RouterTrace]:
        """Hidden states of prompts and of several completions of each, in one pass.

        Row `i` of `completion_ids` continues prompt `i // G` (`G = len(completion_ids) //
        len(prompt_ids)`), as in a GRPO batch with the prompt stored once per group. Each
        group runs through the layers as one row `[prompt ; completion 1 ; ... ; completion
        G]` under a `SharedPrefixMask`: the prompt is encoded once, every completion attends to
        it and to its own earlier tokens only, at positions continuing from the prompt's valid
        tokens. The completions' values, and those of the prompts' real tokens, are those of
        `hidden_states` over each `[prompt ; completion]` (or of encoding the prompt into a KV
        cache and the completions after it), with one pass over the layers instead of two and
        no per-completion copy of the prompt's keys and values. Completion tokens are all real
        (no completion mask). A padding position attends to no real token; its value (at the
        last prompt position only for a prompt with no real token) is a uniform mix over the
        prompt's keys here, where per-row encoding mixes in the completion's keys too.

        Args:
            prompt_ids: Left-padded prompts (B, P), `P >= 1`.
            completion_ids: (B * G, T).
            prompt_mask: (B, P), 1 on real prompt tokens; None means all 1.
            remat: Rematerialize each layer (True) or every n-th layer (an int n >= 1) in the
                backward pass (see `hidden_states`).
            layer_stack: Optional `layer_stack()` to scan the layers with (see
                `hidden_states`).
            routing: Mixture-of-experts models: as for `hidden_states`, over the rows
                `[prompt ; completion 1 ; ... ; completion G]`: replayed experts
                `(L, B, P + G * T, k)`, and the trace in that layout.

        Returns:
            `(prompt_hidden (B, P, D), completion_hidden (B * G, T, D))`, final-norm hidden
            states in the compute dtype; with `routing`, the `RouterTrace` third.

        Raises:
            ValueError: If the shapes disagree (ranks, `P < 1`, `T < 1`, a completion count that
                is not a positive multiple of the prompts, a mask of another shape) or the ids
                are not integers.

        Examples:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
            >>> prompt, completions = jnp.array([[5, 6, 7]]), jnp.array([[1, 2], [3, 4]])
            >>> hp, hc = model.shared_prefix_hidden_states(prompt, completions)
            >>> full, _ = model.hidden_states(jnp.array([[5, 6, 7, 3, 4]]))
            >>> hc.shape, bool(jnp.allclose(hc[1], full[0, 3:], atol=1e-5))
            ((2, 2, 128), True)
        """
        if prompt_ids.ndim != 2 or completion_ids.ndim != 2:
            msg = (
                "prompt_ids and completion_ids must be (B, P) and (B * G, T), got shapes "
                f"{prompt_ids.shape} and {completion_ids.shape}"
            )
            raise ValueError(msg)
        b, p = prompt_ids.shape
        rows, t = completion_ids.shape
        if p < 1 or b < 1 or t < 1 or rows < b or rows % b:
            msg = (
                "shared_prefix_hidden_states needs P >= 1 prompt columns, T >= 1 completion "
                "columns and a number of completions that is a positive multiple of the prompts; "
                f"got prompt_ids {prompt_ids.shape} and completion_ids {completion_ids.shape}"
            )
            raise ValueError(msg)
        for name, ids_ in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
            if not jnp.issubdtype(ids_.dtype, jnp.integer):
                msg = f"{name} must hold integer token ids, got dtype {ids_.dtype}"
                raise ValueError(msg)
        g = rows // b
        if prompt_mask is None:
            prompt_mask = jnp.ones((b, p), jnp.int32)
        elif jnp.shape(prompt_mask) != (b, p):
            msg = f"prompt_mask must have shape {(b, p)}, got {jnp.shape(prompt_mask)}"
            raise ValueError(msg)
        prompt_mask = jnp.asarray(prompt_mask)
        remat = check_remat("remat", remat)
        ids, (cos, sin, mask), sliding = self._layer_inputs(
            prompt_ids, completion_ids, prompt_mask, group=g
        )
        valid = jnp.concatenate(
            [prompt_mask.astype(jnp.bool_), jnp.ones((b, g * t), jnp.bool_)], axis=1
        )
        moe = self._routing_input(routing, valid)
        h = self.embed(ids).astype(self.dtype)
        h, _, trace = self._run_layers(
            h, cos, sin, mask, None, None, remat, layer_stack, sliding, moe
        )
        hidden = self.final_norm(h)
        out = hidden[:, :p], hidden[:, p:].reshape(rows, t, hidden.shape[-1])
        return out if routing is None or routing is False else (*out, trace)

    def packed_hidden_states(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        branch_ids: jax.Array | None = None,
        *,
        remat: bool | int = False,
        layer_stack: LayerStack | None = None,
    ) -> jax.Array:
        """Hidden states of rows that each pack several sequences, without a cache.

        Token `t` attends to an earlier token `s` of its row iff `segment_ids[s] ==
        segment_ids[t] > 0` and, with `branch_ids`, `branch_ids[s]` is 0 or `branch_ids[t]`:
        branch 0 of a segment is a prefix its branches share (a prompt and its completions,
        each a branch). Segment 0 is padding. With positions restarting per segment (and per
        branch after the prefix), each sequence's values are those of `hidden_states` on it
        alone, up to rounding. Sliding-window layers (Mistral, Gemma 3) count their window in
        positions here (`positions[t] - positions[s] < sliding_window`): a completion's
        positions continue its prompt's, so this is the window of the sequence alone.

        Args:
            input_ids: Token ids (B, T).
            positions: Int positions (B, T), each below T.
            segment_ids: Int (B, T), 0 on padding.
            branch_ids: Optional int (B, T); None: every token is in branch 0.
            remat: As for `hidden_states`.
            layer_stack: As for `hidden_states`.

        Returns:
            Final-norm hidden states (B, T, D) in the compute dtype.

        Raises:
            ValueError: If an array is not (B, T) like `input_ids`.

        Examples:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
            >>> ids = jnp.array([[5, 6, 7, 8, 9]])  # [5 6 7] then [8 9]
            >>> packed = model.packed_hidden_states(
            ...     ids, jnp.array([[0, 1, 2, 0, 1]]), jnp.array([[1, 1, 1, 2, 2]]))
            >>> alone, _ = model.hidden_states(jnp.array([[8, 9]]))
            >>> bool(jnp.allclose(packed[0, 3:], alone[0], atol=1e-5))
            True
        """
        b, t = np.shape(input_ids) if np.ndim(input_ids) == 2 else (None, None)
        arrays = {"positions": positions, "segment_ids": segment_ids, "branch_ids": branch_ids}
        for name, x in {"input_ids": input_ids, **arrays}.items():
            if x is not None and (b is None or np.shape(x) != (b, t)):
                msg = f"{name} must have shape (B, T) like input_ids, got {np.shape(x)}"
                raise ValueError(msg)
        seg = jnp.asarray(segment_ids, jnp.int32)
        mask = jnp.tril(jnp.ones((t, t), jnp.bool_))[None] & (seg[:, :, None] == seg[:, None, :])
        mask = mask & (seg > 0)[:, None, :]
        if branch_ids is not None:
            br = jnp.asarray(branch_ids, jnp.int32)
            mask = mask & ((br[:, None, :] == 0) | (br[:, None, :] == br[:, :, None]))
        pos = jnp.asarray(positions, jnp.int32)
        (cos, sin, mask), sliding = self._attention_inputs(pos, t, mask, pos, pos)
        h = self.embed(jnp.asarray(input_ids, jnp.int32)).astype(self.dtype)
        remat = check_remat("remat", remat)
        moe = self._routing_input(None, seg > 0)
        h, _, _ = self._run_layers(h, cos, sin, mask, None, None, remat, layer_stack, sliding, moe)
        return self.final_norm(h)

    def layer_inputs(
        self,
        prompt_ids: jax.Array,
        completion_ids: jax.Array,
        prompt_mask: jax.Array,
        *,
        group: int | None,
    ) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
        """What the decoder layers take for a pass over prompts and their completions.

        With `group=G`, prompts `(B, P)` and completions `(B * G, T)` as in
        `shared_prefix_hidden_states` (each group one row, `[prompt ; completion 1 ; ... ;
        completion G]`, under a `SharedPrefixMask`); with `group=None`, prompts and completions
        row for row, `[prompt ; completion]` under a causal mask, as `hidden_states` without a
        cache. The layers' output, after `final_norm`, is those calls' hidden states. Not
        validated here (the callers check shapes).

        Args:
            prompt_ids: Left-padded prompts, int.
            completion_ids: Completions, int.
            prompt_mask: 1 on real prompt tokens (the shape of `prompt_ids`).
            group: Completions per prompt, or None for one completion per prompt row.

        Returns:
            `(ids, cos, sin, mask)`: the token ids of each row (int32), the RoPE tables of
            their positions, and the attention mask (`SharedPrefixMask` or a bool array); for
            sliding-window layers (Mistral) the mask keeps only the window.

        Raises:
            ValueError: For a model whose layers mix sliding-window and global attention (Gemma
                3), whose layers take different inputs, or a mixture-of-experts model (its
                layers also take and return routing).
        """
        if self.config.is_moe:
            msg = (
                "layer_inputs: mixture-of-experts layers (qwen3_moe) take routing inputs and "
                "return router traces; the layer-by-layer update does not run them"
            )
            raise ValueError(msg)
        ids, inputs, sliding = self._layer_inputs(
            prompt_ids, completion_ids, prompt_mask, group=group
        )
        if sliding is not None:
            msg = (
                "layer_inputs: this model's layers mix sliding-window and global attention "
                f"({self.config.model_type}), whose RoPE tables and masks differ; there is no "
                "one set of inputs for all layers"
            )
            raise ValueError(msg)
        return (ids, *inputs)

    def _layer_inputs(
        self,
        prompt_ids: jax.Array,
        completion_ids: jax.Array,
        prompt_mask: jax.Array,
        *,
        group: int | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, Any], Any]:
        """`layer_inputs` as `(ids, (cos, sin, mask), sliding)`, see `_attention_inputs`."""
        b, p = prompt_ids.shape
        t = completion_ids.shape[1]
        if group is None:
            ids = jnp.concatenate([prompt_ids, completion_ids], axis=1).astype(jnp.int32)
            attention = jnp.concatenate(
                [jnp.asarray(prompt_mask, jnp.int32), jnp.ones((b, t), jnp.int32)], axis=1
            )
            causal = jnp.tril(jnp.ones((p + t, p + t), jnp.bool_))
            mask = causal[None, :, :] & attention.astype(jnp.bool_)[:, None, :]
            slots = jnp.arange(p + t, dtype=jnp.int32)
            inputs, sliding = self._attention_inputs(
                positions_from_mask(attention), p + t, mask, slots, slots
            )
            return ids, inputs, sliding
        g = group
        valid = prompt_mask.astype(jnp.bool_)
        causal = jnp.tril(jnp.ones((p, p), jnp.bool_))
        mask = SharedPrefixMask(causal[None] & valid[:, None, :], valid, g, p)
        prompt_positions = positions_from_mask(prompt_mask)
        start = jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32)  # first completion position
        completion_positions = start[:, None, None] + jnp.arange(t, dtype=jnp.int32)
        positions = jnp.concatenate(
            [prompt_positions, jnp.broadcast_to(completion_positions, (b, g, t)).reshape(b, -1)],
            axis=1,
        )
        ids = jnp.concatenate([prompt_ids, completion_ids.reshape(b, g * t)], axis=1)
        slots = jnp.arange(p + t, dtype=jnp.int32)  # unused: the mask holds the window
        inputs, sliding = self._attention_inputs(positions, p + t, mask, slots, slots)
        return ids.astype(jnp.int32), inputs, sliding

    def layer_stack(self) -> LayerStack | None:
        """The decoder layers as one layer's graph and their states stacked on a new axis 0.

        With stacked layers (`stack_layers()`) this is the model's own storage, no copy.
        Otherwise every layer must have the same structure (the same variables, shapes and
        dtypes, LoRA adapters included), or there is nothing to scan over and None is returned
        (the layers then run unrolled); inside a traced function the stack is then a copy of
        the layer weights that a gradient flows through back to each layer's own variables.

        Returns:
            A `LayerStack` `(graphdef, state)` with every leaf of shape `(num_layers, ...)`, or
            None if the layers differ in structure.

        Examples:
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
            >>> stack = model.layer_stack()
            >>> stack.state["mlp"]["up_proj"]["kernel"].shape  # (L, D, F)
            (2, 128, 384)
        """
        if getattr(self, "layers_stacked", False):
            return LayerStack(*nnx.split(self.layers))
        graphdef = None
        states = []
        for layer in self.layers:
            layer_graph, state = nnx.split(layer)
            if graphdef is None:
                graphdef = layer_graph
            elif layer_graph != graphdef:
                return None
            states.append(state)
        if graphdef is None:
            return None
        shapes = {tuple((x.shape, x.dtype) for x in jax.tree.leaves(st)) for st in states}
        if len(shapes) != 1:
            return None
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        return LayerStack(graphdef, stacked)

    def stack_layers(self) -> CausalLM:
        """Stores the decoder layers stacked, in place: one variable per kind, layer on axis 0.

        The values and the function are the same; the parameter paths become
        `layers.<name>` with a leading layer axis (see the module docstring). Scanned layers
        (`scan_layers`, `GRPOConfig.scan_layers`) then read this storage directly instead of
        stacking a copy of the weights in every traced call, and an optimizer has one array
        per weight kind instead of one per layer and kind, so the GRPO update compiles faster
        and needs less memory (docs/benchmarks.md).

        Build the optimizer after this call: one built before holds the per-layer arrays
        (`GRPOTrainer` refuses such a pair). A variable's sharding annotation, if any, gets a
        leading `None` (the layer axis is not sharded), and each stacked variable carries the
        metadata `stacked_layers=True`, which `state_partition_specs` (and so `shard_model`)
        reads from the model or its `nnx.State` to shard the stack as it shards one layer; a
        plain dict of arrays has no metadata, and `PartitionRules.spec` alone sees a stack as
        one array. Unrolled layers (the sampler's decoding unless `scan_layers`,
        `remat_every > 1`) slice the stack once per call: a copy of the layer weights while the
        call runs. Checkpoints hold the
        layout they were written from: restore into a model of the same layout.

        Returns:
            The model itself (stacked; a no-op when it already is).

        Raises:
            ValueError: If the layers differ in structure (variables, shapes or dtypes), or
                the model is abstract (`nnx.eval_shape`).

        Examples:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
            >>> ids = jnp.array([[1, 2, 3]])
            >>> before = model(ids)
            >>> model = model.stack_layers()
            >>> model.layers.mlp.up_proj.kernel.shape  # (L, D, F)
            (2, 128, 384)
            >>> bool(jnp.allclose(model(ids), before, atol=1e-5))
            True
        """
        if self.layers_stacked:
            return self
        _check_concrete(self.layers, "stack_layers")
        stack = self.layer_stack()
        if stack is None:
            msg = (
                "stack_layers: the decoder layers differ in structure (variables, shapes or "
                "dtypes), so they cannot be stacked"
            )
            raise ValueError(msg)
        layers = nnx.merge(stack.graphdef, stack.state)
        for _, var in nnx.iter_graph(layers):
            if isinstance(var, nnx.Variable):
                _mark_stacked(var, True)
        self.layers = layers
        self.layers_stacked = True
        return self

    def unstack_layers(self) -> CausalLM:
        """Stores the decoder layers one module per layer again (undoes `stack_layers`).

        Returns:
            The model itself (per-layer; a no-op when it already is).

        Raises:
            ValueError: If the model is abstract (`nnx.eval_shape`).

        Examples:
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
            >>> kernel = model.layers[1].attn.q_proj.kernel[...]
            >>> model = model.stack_layers().unstack_layers()
            >>> bool((model.layers[1].attn.q_proj.kernel[...] == kernel).all())
            True
        """
        if not self.layers_stacked:
            return self
        _check_concrete(self.layers, "unstack_layers")
        layers = []
        for graphdef, state in self._layer_states():
            layer = nnx.merge(graphdef, state)
            for _, var in nnx.iter_graph(layer):
                if isinstance(var, nnx.Variable):
                    _mark_stacked(var, False)
            layers.append(layer)
        self.layers = nnx.List(layers)
        self.layers_stacked = False
        return self

    def output_embedding(self) -> jax.Array:
        """The (D, V) matrix that maps hidden states to logits (`embedding.T` when tied).

        Returns:
            The output projection in the parameter dtype.
        """
        if self.lm_head is None:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def output_embedding_rows(self) -> jax.Array | None:
        """The (V, D) output matrix as stored (the tied embedding), or None when untied.

        Products that contract its second axis read it in place; the transposed view of
        `output_embedding()` makes XLA:CPU write a transposed copy of it inside a compiled
        loop (the GRPO update's chunked log-probs). An untied `lm_head` is stored (D, V): use
        `output_embedding()`.

        Returns:
            The embedding matrix (V, D) of a tied model, None otherwise.

        Examples:
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> model = CausalLM(CausalLMConfig.tiny(tie_word_embeddings=True), rngs=nnx.Rngs(0))
            >>> model.output_embedding_rows().shape, model.output_embedding().shape
            ((512, 128), (128, 512))
        """
        if self.lm_head is None:
            return self.embed.embedding[...]
        return None

    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """Projects hidden states to float32 logits, `hidden @ output_embedding()`.

        The matmul accumulates and returns float32 even for bfloat16 parameters. Works on any
        leading shape, so callers can chunk over tokens. With `config.final_logit_softcapping`
        `c` (Gemma 3) the logits are `c tanh(z / c)`.

        Args:
            hidden: Hidden states (..., D).

        Returns:
            float32 logits (..., V).
        """
        w = self.output_embedding()
        logits = jnp.einsum("...D,DV->...V", hidden, w, preferred_element_type=jnp.float32)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def init_cache(
        self, batch_size: int, max_length: int, dtype: Any = None, *, stacked: bool | None = None
    ) -> KVCache:
        """Builds an empty KV cache for this model.

        Args:
            batch_size: Rows B.
            max_length: Slots S per row (prompt plus generated tokens).
            dtype: Dtype of keys/values; None means the compute dtype, except on the CPU for a
                16-bit compute dtype: float32 there, which holds the same values (keys and
                values are computed in the compute dtype) and which XLA:CPU reads and writes in
                place, where it converts a whole 16-bit cache to float32 at every decoding
                step.
            stacked: Keys and values as one (L, B, K, H, S) and one (L, B, K, S, H) array,
                which scanned layers read and write layer by layer, instead of L per-layer
                arrays (keys (B, K, H, S), values (B, K, S, H)), which unrolled layers update in
                place; None follows `model.scan_layers`.
                Either form works with either kind of layers (converted inside the call).

        Returns:
            An empty `KVCache`.

        Examples:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
            >>> cache = model.init_cache(batch_size=1, max_length=8)
            >>> _, cache = model.hidden_states(jnp.array([[1, 2, 3]]), cache=cache)  # the prompt
            >>> hidden, cache = model.hidden_states(jnp.array([[4]]), cache=cache)  # one token
            >>> full = model(jnp.array([[1, 2, 3, 4]]))  # the same 4 tokens without a cache
            >>> last = model.logits_from_hidden(hidden)[0, -1]
            >>> int(cache.index), bool(jnp.allclose(last, full[0, -1], atol=1e-4))
            (4, True)
        """
        cfg = self.config
        return KVCache.create(
            num_layers=cfg.num_layers,
            batch_size=batch_size,
            max_length=max_length,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=_cache_dtype(self.dtype) if dtype is None else jnp.dtype(dtype),
            stacked=bool(getattr(self, "scan_layers", False)) if stacked is None else stacked,
        )

    # ------------------------------------------------------------------ checkpoints

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        dtype: str | jnp.dtype | None = None,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
    ) -> CausalLM:
        """Loads a Hugging Face checkpoint directory or a GGUF file.

        A directory holds `config.json` (model_type llama, qwen2, qwen3, mistral, gemma3_text or
        qwen3_moe) and
        `model.safetensors` or the shards listed in `model.safetensors.index.json`; a `.gguf`
        file is read with `read_gguf` (dequantized). The model is built abstractly
        (`nnx.eval_shape`, no random weights are drawn) and each tensor, checked against the
        expected shape, cast to the parameter dtype and transposed for linear weights, is placed
        into its variable: on the default device without `mesh`, else with
        `jax.device_put(x, NamedSharding(mesh, rules(path, shape)))`. Tied models need no
        `lm_head.weight`; if present it must equal the embedding.

        Args:
            path: Checkpoint directory or `.gguf` file.
            dtype: Parameter dtype ("float32" / "bfloat16"); None uses the checkpoint's
                (`torch_dtype` bfloat16 -> bfloat16, anything else, GGUF included, -> float32).
            mesh: Optional `jax.sharding.Mesh` to place parameters on.
            rules: Optional `rules(param_path, shape) -> PartitionSpec`, used with `mesh`
                (default: replicated).

        Returns:
            The loaded model.

        Raises:
            FileNotFoundError: If config.json, the safetensors files or the GGUF file are missing.
            ValueError: Naming the tensor, for an unsupported model_type, a missing, unexpected
                or misshapen tensor, or an untied `lm_head.weight` in a tied model; for GGUF,
                naming the unsupported architecture or tensor type.
            TypeError: If `rules` is given without `mesh`.

        Examples:
            >>> from artifex.generative_models.models.causal_lm import CausalLM
            >>> model = CausalLM.from_pretrained("tests/fixtures/qwen2_tiny")  # from the repo root
            >>> model.config.model_type, model.config.num_layers, model.dtype
            ('qwen2', 2, dtype('float32'))
            >>> quantized = CausalLM.from_pretrained("tests/fixtures/qwen2_tiny.Q8_0.gguf")
            >>> quantized.config.model_type, quantized.embed.embedding.shape
            ('qwen2', (128, 32))
        """
        source = os.fspath(path)
        if not os.path.isdir(source) and (source.lower().endswith(".gguf") or is_gguf_file(source)):
            if rules is not None and mesh is None:
                msg = "from_pretrained: rules were given without a mesh; pass mesh= as well"
                raise TypeError(msg)
            checkpoint = read_gguf(source, dtype="float32" if dtype is None else dtype)
            return cls._from_gguf_checkpoint(checkpoint, source, mesh=mesh, rules=rules)
        config = read_hf_config(source)
        if rules is not None and mesh is None:
            msg = "from_pretrained: rules were given without a mesh; pass mesh= as well"
            raise TypeError(msg)
        dt = resolve_dtype(config.param_dtype if dtype is None else dtype)
        config = config.replace(param_dtype=dt.name)
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
        load_hf_weights(model, source, mesh=mesh, rules=rules)
        return model

    @classmethod
    def _from_gguf_checkpoint(
        cls,
        checkpoint: GGUFCheckpoint,
        source: str,
        *,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
    ) -> CausalLM:
        config = checkpoint.config
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
        place_tensors(
            model, checkpoint.tensors.items(), mesh=mesh, rules=rules, source=repr(source)
        )
        return model

    def save_pretrained(
        self, path: str | os.PathLike[str], *, max_shard_size: int | str | None = None
    ) -> None:
        """Writes a Hugging Face checkpoint directory; see `hf_io.save_pretrained`.

        Args:
            path: Output directory (created if needed).
            max_shard_size: Optional shard size limit in bytes (or "5GB"-style string).

        Examples:
            >>> import os, tempfile
            >>> import jax.numpy as jnp
            >>> from artifex.generative_models.models.causal_lm import CausalLM
            >>> model = CausalLM.from_pretrained("tests/fixtures/qwen2_tiny")  # from the repo root
            >>> ids = jnp.array([[1, 2, 3]])
            >>> with tempfile.TemporaryDirectory() as out:
            ...     model.save_pretrained(out)
            ...     files = sorted(os.listdir(out))
            ...     reloaded = CausalLM.from_pretrained(out)
            >>> files, bool(jnp.array_equal(reloaded(ids), model(ids)))
            (['config.json', 'model.safetensors'], True)
        """
        _save_pretrained(self, path, max_shard_size=max_shard_size)


class LayerStack(NamedTuple):
    """Decoder layers ready for `jax.lax.scan`: one layer's graph and the stacked states.

    Attributes:
        graphdef: The static structure shared by every layer.
        state: The layers' states, each leaf stacked to `(num_layers, ...)`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> stack = model.layer_stack()  # made once, e.g. outside a decode loop
        >>> ids = jnp.array([[1, 2, 3]])
        >>> scanned, _ = model.hidden_states(ids, layer_stack=stack)
        >>> unrolled, _ = model.hidden_states(ids)  # model.scan_layers is False
        >>> bool(jnp.allclose(scanned, unrolled, atol=1e-5))
        True
    """

    graphdef: nnx.GraphDef
    state: nnx.State


KVPairs = tuple[tuple[jax.Array, ...] | jax.Array, tuple[jax.Array, ...] | jax.Array]


def _check_cache(cache: KVCache, cfg: CausalLMConfig, batch: int) -> None:
    """Raises ValueError unless ``cache`` fits this model and a batch of ``batch`` rows."""
    values_shape = (batch, cfg.num_kv_heads, cache.max_length, cfg.head_dim)
    keys_shape = (batch, cfg.num_kv_heads, cfg.head_dim, cache.max_length)  # slots last
    shapes = {"keys": keys_shape, "values": values_shape}
    if cache.stacked:
        for name, x in (("keys", cache.keys), ("values", cache.values)):
            expected = (cfg.num_layers, *shapes[name])
            if not isinstance(x, jax.Array | np.ndarray) or x.shape != expected:
                got = getattr(x, "shape", type(x).__name__)
                msg = f"cache.{name} (stacked) must have shape {expected}, got {got}"
                raise ValueError(msg)
        return
    if not isinstance(cache.values, tuple):
        msg = "cache.keys and cache.values must both be stacked arrays or both tuples"
        raise ValueError(msg)
    if len(cache.keys) != cfg.num_layers or len(cache.values) != cfg.num_layers:
        msg = (
            f"cache.keys and cache.values must hold one array per layer "
            f"({cfg.num_layers}), got {len(cache.keys)} and {len(cache.values)}"
        )
        raise ValueError(msg)
    for name in ("keys", "values"):
        for x in getattr(cache, name):
            if getattr(x, "shape", None) != shapes[name]:
                got = getattr(x, "shape", type(x).__name__)
                msg = f"cache.{name} must be {shapes[name]} per layer, got {got}"
                raise ValueError(msg)


def _check_concrete(layers: Any, where: str) -> None:
    """Raises ValueError for an abstract model (`nnx.eval_shape`): nothing to stack or slice."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(layers))):
        msg = (
            f"{where}: the model is abstract (built by nnx.eval_shape, its variables hold "
            "shapes only); call it on a model with weights, or inside the function given to "
            "nnx.eval_shape"
        )
        raise ValueError(msg)


def _mark_stacked(var: nnx.Variable, stacked: bool) -> None:
    """Sets (or clears) a variable's `stacked_layers` metadata; a leading None on its annotation."""
    sharding = var.get_metadata().get("out_sharding")
    if sharding:
        entries = (None, *sharding) if stacked else tuple(sharding)[1:]
        # the annotation keeps its type (a PartitionSpec stays one, a tuple a tuple)
        var.set_metadata(
            out_sharding=type(sharding)(*entries)
            if isinstance(sharding, PartitionSpec)
            else entries
        )
    if stacked:
        var.set_metadata(stacked_layers=True)
    elif var.has_metadata("stacked_layers"):
        var.del_metadata("stacked_layers")


def _unzip(pairs: list[tuple[jax.Array, jax.Array]]) -> KVPairs:
    """Per-layer `(keys, values)` pairs as the cache's `(keys per layer, values per layer)`."""
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _layer_routing(
    routing: tuple[jax.Array | None, jax.Array] | None, i: int
) -> tuple[jax.Array | None, jax.Array] | None:
    """Layer `i`'s `(replay, valid)` of the model's `(replay (L, ...) or None, valid)`."""
    if routing is None:
        return None
    replay, valid = routing
    return (None if replay is None else replay[i]), valid


def _stack_traces(traces: list[RouterTrace | None]) -> RouterTrace | None:
    """The layers' router traces stacked on a new axis 0 (None for dense layers)."""
    if not traces or traces[0] is None:
        return None
    return jax.tree.map(lambda *xs: jnp.stack(xs), *traces)


def _scan_layers(
    stack: LayerStack,
    h: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    mask: jax.Array,
    kv: KVPairs | None,
    index: jax.Array | None,
    *,
    remat: bool,
    sliding: tuple[jax.Array, jax.Array, Any] | None = None,
    flags: tuple[bool, ...] | None = None,
    routing: tuple[jax.Array | None, jax.Array] | None = None,
) -> tuple[jax.Array, KVPairs | None, RouterTrace | None]:
    """Runs the decoder layers as one `lax.scan` over the stacked layer states (and caches).

    With `sliding`, layer `i` takes `sliding` for its `(cos, sin, mask)` where `flags[i]`,
    selected inside the scan (one layer body for both kinds). Mixture-of-experts layers take
    their slice of `routing`'s replay and return traces, stacked by the scan.
    """
    graphdef, stacked = stack
    step = functools.partial(_remat_layer_step if remat else _layer_step, graphdef)
    inputs = (cos, sin, mask)
    kinds = None if sliding is None else jnp.asarray(flags, jnp.bool_)
    replay = None if routing is None else routing[0]

    def pick(flag):
        if sliding is None:
            return inputs
        return jax.tree.map(lambda a, b: jnp.where(flag, a, b), sliding, inputs)

    def layer_routing(r):
        return None if routing is None else (r, routing[1])

    if kv is None:

        def body(h, xs):
            state, flag, r = xs
            out = step(state, h, *pick(flag), None, index, layer_routing(r))
            return out[0], (out[2] if len(out) > 2 else None)

        h, traces = jax.lax.scan(body, h, (stacked, kinds, replay))
        return h, None, traces

    def body_kv(h, xs):
        state, layer_keys, layer_values, flag, r = xs
        out = step(state, h, *pick(flag), (layer_keys, layer_values), index, layer_routing(r))
        return out[0], (out[1], out[2] if len(out) > 2 else None)

    keys, values = kv
    if isinstance(keys, tuple):  # per-layer arrays: stacked here, a copy per call
        keys, values = jnp.stack(keys), jnp.stack(values)
    h, ((keys, values), traces) = jax.lax.scan(body_kv, h, (stacked, keys, values, kinds, replay))
    return h, (keys, values), traces


def _layer_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    h: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    mask: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    index: jax.Array | None,
    routing: tuple[jax.Array | None, jax.Array] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None] | tuple[Any, ...]:
    layer = nnx.merge(graphdef, state)
    if routing is None:  # dense layers (MoE layers get at least their valid tokens)
        return layer(h, cos, sin, mask, kv, index)
    return layer(h, cos, sin, mask, kv, index, routing)


# The unrolled layers call one jitted layer function: JAX traces (and differentiates) a layer
# once per distinct structure and shapes and reuses that trace for every layer and every call
# of the same shapes, instead of tracing all of them; XLA inlines the calls, so the compiled
# program is that of the plain unrolled loop. Tracing was about a quarter of the time to
# compile SmolLM2-135M's update (30 layers).
_traced_once_layer_step = jax.jit(_layer_step, static_argnums=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _remat_layer_step(graphdef, state, h, cos, sin, mask, kv, index, routing=None):
    """`_layer_step` that keeps only its inputs and recomputes the layer in the backward pass."""
    return _layer_step(graphdef, state, h, cos, sin, mask, kv, index, routing)


def _remat_layer_fwd(graphdef, state, h, cos, sin, mask, kv, index, routing=None):
    out = _layer_step(graphdef, state, h, cos, sin, mask, kv, index, routing)
    return out, (state, h, cos, sin, mask, kv, index, routing)


def _remat_layer_bwd(graphdef, residuals, cotangent):
    state, h, cos, sin, mask, kv, index, routing = residuals
    # The recomputation must not start before this layer's cotangent exists. Under
    # `jax.checkpoint` (or `nnx.remat`) XLA:CPU schedules each layer's recomputation right after
    # its forward pass (the optimization barrier meant to order it is gone from the optimized
    # program), so every layer's activations stay alive until the backward pass and no memory
    # is saved. A data dependence cannot be reordered: `h - 0 * |dh|`, with `dh` the cotangent
    # of the layer's output (same shape and sharding as `h`; XLA does not fold a float `0 * x`,
    # which is NaN for infinite x). It is exactly `h` where `dh` is finite; where it is not,
    # the gradient is not finite either way.
    h = h - jnp.zeros((), h.dtype) * jnp.abs(cotangent[0])
    _, vjp = jax.vjp(
        functools.partial(_layer_step, graphdef), state, h, cos, sin, mask, kv, index, routing
    )
    return vjp(cotangent)


_remat_layer_step.defvjp(_remat_layer_fwd, _remat_layer_bwd)


_traced_once_remat_layer_step = jax.jit(_remat_layer_step, static_argnums=0)


def _remat_layers(
    layers: list[tuple[nnx.GraphDef, nnx.State]],
    h: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    mask: jax.Array,
    kv: KVPairs | None,
    index: jax.Array | None,
    every: int = 1,
    sliding: tuple[jax.Array, jax.Array, Any] | None = None,
    flags: tuple[bool, ...] | None = None,
    routing: tuple[jax.Array | None, jax.Array] | None = None,
) -> tuple[jax.Array, KVPairs | None, RouterTrace | None]:
    """Runs the decoder layers, every `every`-th one (0, every, ...) rematerialized.

    A rematerialized layer keeps its inputs for the backward pass: its hidden states and, with
    a cache, its own keys and values. The other layers keep their activations. Layer `i` takes
    `sliding` for its `(cos, sin, mask)` where `flags[i]`, and its part of `routing`.
    """
    new_kv, traces = [], []
    for i, (graphdef, state) in enumerate(layers):
        layer_kv = None if kv is None else (kv[0][i], kv[1][i])
        step = _traced_once_remat_layer_step if i % every == 0 else _traced_once_layer_step
        c, s, m = sliding if flags is not None and flags[i] else (cos, sin, mask)
        out = step(graphdef, state, h, c, s, m, layer_kv, index, _layer_routing(routing, i))
        h, layer_kv = out[0], out[1]
        new_kv.append(layer_kv)
        traces.append(out[2] if len(out) > 2 else None)
    return h, None if kv is None else _unzip(new_kv), _stack_traces(traces)


def from_pretrained(
    path: str | os.PathLike[str],
    dtype: str | jnp.dtype | None = None,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> CausalLM:
    """Loads a Hugging Face checkpoint directory or a GGUF file; see `CausalLM.from_pretrained`.

    Args:
        path: Checkpoint directory or `.gguf` file.
        dtype: Parameter dtype ("float32" / "bfloat16"); None keeps the checkpoint's.
        mesh: Optional `jax.sharding.Mesh` to place parameters on.
        rules: Optional `rules(param_path, shape) -> PartitionSpec`, used with `mesh`.

    Returns:
        The loaded model.

    Raises:
        FileNotFoundError: If the checkpoint files are missing.
        ValueError: Naming the tensor or setting that cannot be loaded.
        TypeError: If `rules` is given without `mesh`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import from_pretrained
        >>> model = from_pretrained("tests/fixtures/qwen2_tiny", dtype="float32")  # repo root
        >>> model.config.model_type, model(jnp.array([[1, 2, 3]])).shape
        ('qwen2', (1, 3, 128))
    """
    return CausalLM.from_pretrained(path, dtype=dtype, mesh=mesh, rules=rules)


def load_gguf(
    path: str | os.PathLike[str],
    *,
    dtype: str | jnp.dtype = "float32",
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> tuple[CausalLM, Tokenizer]:
    """Loads the model and the tokenizer of a GGUF file (Llama, Qwen2, Qwen3, Gemma 3).

    The file is read once (`read_gguf`): tensors dequantized to `dtype`, Llama's q/k rows put
    back in Hugging Face order, the tokenizer and chat template built from the metadata.

    Args:
        path: The `.gguf` file.
        dtype: Parameter dtype, "float32" (default) or "bfloat16".
        mesh: Optional `jax.sharding.Mesh` to place parameters on.
        rules: Optional `rules(param_path, shape) -> PartitionSpec`, used with `mesh`.

    Returns:
        `(model, tokenizer)`.

    Raises:
        FileNotFoundError: If `path` does not exist.
        ImportError: If the `gguf` package is not installed.
        ValueError: Naming the unsupported architecture, tensor type or tokenizer.
        TypeError: If `rules` is given without `mesh`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import from_pretrained, load_gguf
        >>> model, tokenizer = load_gguf("tests/fixtures/qwen2_tiny.Q8_0.gguf")  # qwen2_tiny, Q8_0
        >>> ids = jnp.array([tokenizer.encode("the hello")])
        >>> logits = model(ids)
        >>> unquantized = from_pretrained("tests/fixtures/qwen2_tiny")(ids)  # float32 weights
        >>> bool(jnp.allclose(logits, unquantized, atol=0.1))  # Q8_0 keeps ~8 bits per weight
        True
        >>> bool((logits.argmax(-1) == unquantized.argmax(-1)).all())  # the same greedy tokens
        True
    """
    if rules is not None and mesh is None:
        msg = "load_gguf: rules were given without a mesh; pass mesh= as well"
        raise TypeError(msg)
    source = os.fspath(path)
    checkpoint = read_gguf(source, dtype=dtype)
    model = CausalLM._from_gguf_checkpoint(checkpoint, source, mesh=mesh, rules=rules)
    return model, checkpoint.tokenizer
