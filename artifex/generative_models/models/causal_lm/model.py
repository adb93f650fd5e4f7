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
(r, out), both `nnx.LoRAParam`; on Qwen3-MoE's experts, `layers.i.mlp.experts.lora.<proj>.lora_a`
(E, in, r) and `.lora_b` (E, r, out).

After `model.stack_layers()` the decoder layers are stored stacked: one variable per kind of
layer weight, with a leading layer axis, at `layers.<name>` instead of `layers.i.<name>` (e.g.
`layers.attn.q_proj.kernel` of shape `(L, D, N*H)`); `unstack_layers()` goes back.

This module holds the model's construction, its forward pass (`hidden_states`), the output
projection and the KV cache it builds, and the module-level loaders `from_pretrained` and
`load_gguf`. Its other methods come from its bases, one module each:
:mod:`~artifex.generative_models.models.causal_lm.prompt_passes` (prompts with their
completions, packed rows), :mod:`~artifex.generative_models.models.causal_lm.layer_storage`
(stacked layers) and :mod:`~artifex.generative_models.models.causal_lm.pretrained_io`
(checkpoints); the loop over the layers is in `_decoder_loop` and the positions and RoPE tables
in :mod:`~artifex.generative_models.models.causal_lm.positions`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from artifex.generative_models.models.causal_lm._decoder_loop import _check_cache, _DecoderLoop
from artifex.generative_models.models.causal_lm._products import f32_products
from artifex.generative_models.models.causal_lm.cache import KVCache
from artifex.generative_models.models.causal_lm.config import CausalLMConfig, resolve_dtype
from artifex.generative_models.models.causal_lm.gguf import read_gguf
from artifex.generative_models.models.causal_lm.hf_io import Rules
from artifex.generative_models.models.causal_lm.layer_storage import LayerStack, LayerStorage
from artifex.generative_models.models.causal_lm.modules import (
    DecoderLayer,
    Embed,
    Linear,
    RMSNorm,
)
from artifex.generative_models.models.causal_lm.moe import MoEDecoderLayer, RouterTrace
from artifex.generative_models.models.causal_lm.positions import (  # noqa: F401  (re-exported for old imports)
    _ROPE_TABLE_MAX_ENTRIES,
    _rope_tables,
    positions_from_mask,
)
from artifex.generative_models.models.causal_lm.pretrained_io import PretrainedIO
from artifex.generative_models.models.causal_lm.prompt_passes import PromptPasses
from artifex.generative_models.models.causal_lm.tokenizer import Tokenizer
from artifex.generative_models.utils.validation import check_remat

__all__ = [
    "CausalLM",
    "from_pretrained",
    "load_gguf",
    "resolve_dtype",
]


def _cache_dtype(compute_dtype: Any) -> jnp.dtype:
    """The default KV-cache dtype (see ``CausalLM.init_cache``)."""
    dtype = jnp.dtype(compute_dtype)
    return jnp.dtype(jnp.float32) if f32_products(dtype) else dtype


class CausalLM(PromptPasses, LayerStorage, PretrainedIO, _DecoderLoop, nnx.Module):
    """Decoder-only transformer language model (Llama 3, Qwen2/2.5, Qwen3, Mistral, Gemma 3).

    `logits = RMSNorm(h_L) W_out`, `h_l = Layer_l(h_{l-1})`, `h_0 = E[ids]`. Parameters live in the
    parameter dtype (config `param_dtype`, or `dtype`) and compute runs in it, except the
    RMSNorm statistics and the attention softmax (float32) and the logits (always float32).
    Initialisation follows transformers: weights N(0, initializer_range^2), biases 0, norms 1.
    See the module docstring for the parameter paths.
    Methods by concern come from the bases: `PromptPasses` (`shared_prefix_hidden_states`,
    `packed_hidden_states`, `layer_inputs`), `LayerStorage` (`layer_stack`, `stack_layers`,
    `unstack_layers`) and `PretrainedIO` (`from_pretrained`, `save_pretrained`).

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
