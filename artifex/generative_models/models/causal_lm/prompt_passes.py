"""Passes of `CausalLM` over rows that hold several sequences: prompts with their completions.

`PromptPasses`, a base of `CausalLM`, holds `shared_prefix_hidden_states` (each prompt
encoded once, its completions attending to it under a `SharedPrefixMask`),
`packed_hidden_states` (rows packing several sequences, by segment and branch) and
`layer_inputs` (what the decoder layers take for a pass over prompts and completions, for the
layer-by-layer update).

Moved out of :mod:`~artifex.generative_models.models.causal_lm.model` unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.models.causal_lm.attention_ops import SharedPrefixMask
from artifex.generative_models.models.causal_lm.layer_storage import LayerStack
from artifex.generative_models.models.causal_lm.moe import RouterTrace
from artifex.generative_models.models.causal_lm.positions import positions_from_mask
from artifex.generative_models.utils.validation import check_remat

__all__ = ["PromptPasses"]


class PromptPasses:
    """The prompt-and-completion passes of `CausalLM` (a base class of it).

    The methods run the model's embedding, decoder layers and final norm on rows laid out as a
    GRPO batch lays them out: a prompt shared by its group's completions, or packed rows.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.models.causal_lm.prompt_passes import PromptPasses
        >>> model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
        >>> hp, hc = model.shared_prefix_hidden_states(jnp.array([[5, 6]]), jnp.array([[1], [2]]))
        >>> isinstance(model, PromptPasses), hp.shape, hc.shape
        (True, (1, 2, 128), (2, 1, 128))
    """

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
