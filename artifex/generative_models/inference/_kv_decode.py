"""The compiled KV-cache decode program behind the sampler's ``generate``.

``_generate`` (which :func:`~artifex.generative_models.inference.sampling.generate` runs)
prefills the (left-padded) prompts, repeats each prompt's cache for its ``K`` generations, and
decodes one token per step for all rows in a ``lax.while_loop`` until every row has ended or
``max_new_tokens`` is reached; ``_routed`` turns a mixture-of-experts router trace into the
routed experts of :class:`SamplerOutput`.

Moved out of :mod:`~artifex.generative_models.inference.sampling` unchanged; ``sampling``
imports ``_generate`` (the same jitted object, whose compiled programs tests count) and
``generate`` calls it through ``sampling``'s namespace.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from artifex.generative_models.inference.batch_layout import SamplerOutput
from artifex.generative_models.inference.token_sampling import sample_logits
from artifex.generative_models.utils.compile_options import jit


@jit(
    static_argnames=(
        "graphdef",
        "num_generations",
        "max_new_tokens",
        "top_k",
        "use_top_p",
        "greedy",
        "eos_ids",
        "pad_id",
        "share_prefill",
        "batch_rows",
        "record_routing",
    ),
)
def _generate(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    row_offset: jax.Array,
    *,
    num_generations: int,
    max_new_tokens: int,
    top_k: int | None,
    use_top_p: bool,
    greedy: bool,
    eos_ids: tuple[int, ...],
    pad_id: int,
    share_prefill: bool,
    batch_rows: int,
    record_routing: bool = False,
) -> SamplerOutput:
    # ``prompt_ids`` may be one group of a batch of ``batch_rows`` rows (see ``generate``'s
    # ``row_groups``), whose first row is row ``row_offset`` of the batch.
    model = nnx.merge(graphdef, state)
    # Scanned layers: stack the layer weights once, outside the decode loop (no copy when the
    # model stores them stacked). Unrolled layers stored stacked arrive sliced per layer
    # (`generate` slices them before this program, see `_per_layer_split`).
    stack = model.layer_stack() if getattr(model, "scan_layers", False) else None
    layers = {} if stack is None else {"layer_stack": stack}
    k, n = num_generations, max_new_tokens
    b, p = prompt_ids.shape
    rows = b * k
    prompt_ids = prompt_ids.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(jnp.int32)
    rep_ids = jnp.repeat(prompt_ids, k, axis=0)
    rep_mask = jnp.repeat(prompt_mask, k, axis=0)

    if record_routing:  # mixture-of-experts models: each layer's routed experts per token
        layers = {**layers, "routing": True}
    # Prefill once per prompt, then share the cache with the prompt's K generations.
    if share_prefill:
        cache = model.init_cache(b, p + n)
        hidden, cache, *trace = model.hidden_states(
            prompt_ids, attention_mask=prompt_mask, cache=cache, **layers
        )
        cache = cache.repeat(k)
        last = jnp.repeat(hidden[:, -1], k, axis=0)
        prompt_routing = _routed(trace, prompt_mask, k)
    else:
        cache = model.init_cache(rows, p + n)
        hidden, cache, *trace = model.hidden_states(
            rep_ids, attention_mask=rep_mask, cache=cache, **layers
        )
        last = hidden[:, -1]
        prompt_routing = _routed(trace, rep_mask, 1)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def draw(logits: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
        return sample_logits(
            logits,
            jax.random.fold_in(key, step),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p if use_top_p else None,
            greedy=greedy,
            batch_rows=None if batch_rows == rows else batch_rows,
            row_offset=row_offset,
        )

    def record(carry: dict[str, Any], token: jax.Array, logp: jax.Array, step: jax.Array):
        alive = ~carry["done"]
        token = jnp.where(alive, token, pad_id)
        carry["tokens"] = carry["tokens"].at[:, step].set(token)
        carry["mask"] = carry["mask"].at[:, step].set(alive.astype(jnp.int32))
        carry["logps"] = carry["logps"].at[:, step].set(jnp.where(alive, logp, 0.0))
        carry["done"] = carry["done"] | (alive & jnp.any(token[:, None] == eos[None, :], axis=-1))
        return carry

    carry = {
        "tokens": jnp.full((rows, n), pad_id, jnp.int32),
        "mask": jnp.zeros((rows, n), jnp.int32),
        "logps": jnp.zeros((rows, n), jnp.float32),
        "done": jnp.zeros((rows,), jnp.bool_),
        "cache": cache,
        "step": jnp.zeros((), jnp.int32),
    }
    if prompt_routing is not None:
        carry["routing"] = jnp.full((rows, n, *prompt_routing.shape[2:]), -1, jnp.int32)
    token, logp = draw(model.logits_from_hidden(last), carry["step"])
    carry = record(carry, token, logp, carry["step"])
    carry["last"] = carry["tokens"][:, 0]

    def cond(c: dict[str, Any]) -> jax.Array:
        return (c["step"] + 1 < n) & ~jnp.all(c["done"])

    def body(c: dict[str, Any]) -> dict[str, Any]:
        step = c["step"] + 1
        alive = (~c["done"]).astype(jnp.int32)
        hidden, cache, *trace = model.hidden_states(
            c["last"][:, None], attention_mask=alive[:, None], cache=c["cache"], **layers
        )
        token, logp = draw(model.logits_from_hidden(hidden[:, 0]), step)
        if trace:  # the fed token is completion token step - 1
            c = dict(
                c, routing=c["routing"].at[:, step - 1].set(_routed(trace, alive[:, None])[:, 0])
            )
        c = dict(c, cache=cache, step=step)
        c = record(c, token, logp, step)
        c["last"] = c["tokens"][:, step]
        return c

    carry = jax.lax.while_loop(cond, body, carry)
    mask = carry["mask"]
    return SamplerOutput(
        prompt_ids=rep_ids,
        prompt_mask=rep_mask,
        completion_ids=carry["tokens"],
        completion_mask=mask,
        log_probs=carry["logps"],
        truncated=~carry["done"],
        lengths=jnp.sum(mask, axis=-1, dtype=jnp.int32),
        routed_experts=None
        if prompt_routing is None
        else jnp.concatenate([prompt_routing, carry["routing"]], axis=1),
    )


def _routed(trace: list[Any], valid: jax.Array, repeat: int = 1) -> jax.Array | None:
    """A router trace's experts as ``(rows, T, L, k)``, -1 on invalid tokens (None: no trace)."""
    if not trace:
        return None
    experts = jnp.moveaxis(trace[0].experts, 0, 2)  # (L, B, T, k) -> (B, T, L, k)
    experts = jnp.where(valid.astype(jnp.bool_)[:, :, None, None], experts, -1)
    return jnp.repeat(experts, repeat, axis=0) if repeat > 1 else experts
