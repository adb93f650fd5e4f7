"""The rollout-engine interface: left-padded prompts in, a :class:`SamplerOutput` out.

A rollout engine is whatever samples a rollout's completions. The library's own compiled
sampler is one (:class:`SamplerEngine`); an external inference server such as vLLM is another
(:class:`~artifex.generative_models.inference.engines.vllm.VLLMEngine`). Every engine

1. takes the policy's current weights with ``sync_weights(model)`` (a no-op when they have not
   changed since the last call), and
2. answers ``generate(prompt_ids, prompt_mask, key=..., num_generations=K, ...)`` with the same
   :class:`~artifex.generative_models.inference.batch_layout.SamplerOutput` as
   :func:`~artifex.generative_models.inference.sampling.generate`: ``B * K`` prompt-major rows,
   the prompts left-padded to their length bucket, ``max_new_tokens`` completion columns, the
   completion mask (end-of-sequence token included), the per-token log-probs under the
   engine's sampling distribution, the truncation flags and the lengths.

So the rollout fills ``GRPOBatch.sampler_log_probs`` from any engine, and the importance
corrections of ``GRPOConfig.sampler_correction`` weigh the engine's samples against the
trainer's log-probs.

The helpers here are what every engine that returns ragged token lists needs:
:func:`prompt_token_lists` strips the padding off the prompts (after the checks ``generate``
makes), :func:`assemble_output` lays ragged completions out as a ``SamplerOutput`` (and refuses
what breaks its contract), :func:`hf_weights` gives the policy's weights under Hugging Face
names, LoRA adapters merged, and :class:`WeightVersion` tells whether weights changed.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.inference.sampling import (
    DEFAULT_PROMPT_BUCKETS,
    SamplerOutput,
    bucket_length,
    generate,
)
from artifex.generative_models.utils.validation import check_bool, check_float, check_int

__all__ = [
    "RolloutEngine",
    "SamplerEngine",
    "WeightVersion",
    "assemble_output",
    "check_sampling",
    "hf_weights",
    "prompt_token_lists",
    "resolve_special_ids",
]


@runtime_checkable
class RolloutEngine(Protocol):
    """What samples a rollout: the policy's weights in, completions with log-probs out.

    ``rollout(..., engine=engine)`` calls ``engine.sync_weights(policy.model)`` and then
    ``engine.generate(...)`` once per rollout; ``train(..., rollout_engine=engine)`` passes it
    to every rollout of the run.

    Examples:
        >>> from artifex.generative_models.inference.engines import RolloutEngine, SamplerEngine
        >>> isinstance(SamplerEngine(), RolloutEngine)
        True
    """

    def sync_weights(self, model: Any) -> bool:
        """Makes the engine sample from ``model``'s current weights.

        Args:
            model: The policy (a causal LM).

        Returns:
            Whether weights were pushed (``False``: the engine had them already).
        """
        ...

    def generate(
        self,
        prompt_ids: Any,
        prompt_mask: Any = None,
        *,
        key: jax.Array,
        num_generations: int = 1,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        eos_ids: Sequence[int] | int | None = None,
        pad_id: int | None = None,
        prompt_buckets: Sequence[int] | None = DEFAULT_PROMPT_BUCKETS,
    ) -> SamplerOutput:
        """Samples ``num_generations`` completions per left-padded prompt.

        The arguments mean what they mean for
        :func:`~artifex.generative_models.inference.sampling.generate`.

        Args:
            prompt_ids: ``(B, P)`` integer token ids, left-padded.
            prompt_mask: ``(B, P)`` 1 on real tokens (``None``: no padding).
            key: PRNG key; the output is a function of it (and of the weights).
            num_generations: ``K >= 1`` completions per prompt.
            max_new_tokens: ``N >= 1``, the most tokens of a completion (the output's width).
            temperature: ``tau >= 0``; 0 is greedy.
            top_k: Sample among the ``top_k`` most likely tokens only (``None``: all).
            top_p: Nucleus mass in (0, 1]; 1 disables it.
            eos_ids: Token id(s) that end a completion (``None``: the model config's).
            pad_id: Filler of the padding (``None``: the config's pad id, else the first
                end-of-sequence id, else 0).
            prompt_buckets: Prompt widths to left-pad to (``None``: the longest prompt's).

        Returns:
            A :class:`~artifex.generative_models.inference.batch_layout.SamplerOutput`:
            ``B * K`` prompt-major rows, with the engine's per-token log-probs.
        """
        ...


def resolve_special_ids(
    config: Any, eos_ids: Sequence[int] | int | None, pad_id: int | None
) -> tuple[tuple[int, ...], int]:
    """The end-of-sequence ids and the pad id, defaulted from a model config as ``generate`` does.

    Args:
        config: The model's config (its ``eos_token_id`` and ``pad_token_id`` are the defaults),
            or ``None``.
        eos_ids: Token id(s) that end a completion, or ``None`` for the config's.
        pad_id: Filler after a completion ends, or ``None``: the config's pad id, else the first
            end-of-sequence id, else 0.

    Returns:
        ``(eos_ids, pad_id)``.

    Examples:
        >>> from types import SimpleNamespace
        >>> from artifex.generative_models.inference.engines import resolve_special_ids
        >>> config = SimpleNamespace(eos_token_id=2, pad_token_id=None)
        >>> resolve_special_ids(config, None, None), resolve_special_ids(config, [5, 6], 0)
        (((2,), 2), ((5, 6), 0))
    """
    if eos_ids is None:
        eos_ids = getattr(config, "eos_token_id", None)
    if eos_ids is None:
        eos: tuple[int, ...] = ()
    elif isinstance(eos_ids, int | np.integer):
        eos = (int(eos_ids),)
    else:
        eos = tuple(int(e) for e in eos_ids)
    if pad_id is None:
        pad_id = getattr(config, "pad_token_id", None)
        if pad_id is None:
            pad_id = eos[0] if eos else 0
    return eos, int(pad_id)


def prompt_token_lists(
    prompt_ids: Any,
    prompt_mask: Any = None,
    *,
    vocab_size: int | None = None,
) -> list[list[int]]:
    """The real tokens of each left-padded prompt row, after the checks ``generate`` makes.

    Args:
        prompt_ids: ``(B, P)`` integer token ids.
        prompt_mask: ``(B, P)`` 1 on real tokens; ``None`` means no padding.
        vocab_size: The model's vocabulary size, to check the ids against (``None``: unchecked).

    Returns:
        ``B`` lists of token ids (the tokens whose mask is 1, in order).

    Raises:
        ValueError: ``prompt_ids`` not of shape ``(B, P)`` with ``B, P >= 1``, a mask of
            another shape, a row without a real token, or ids outside ``[0, vocab_size)``.
        TypeError: ``prompt_ids`` that are not integers.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.inference.engines import prompt_token_lists
        >>> ids = np.array([[0, 0, 7, 8], [4, 5, 6, 7]])
        >>> prompt_token_lists(ids, np.array([[0, 0, 1, 1], [1, 1, 1, 1]]))
        [[7, 8], [4, 5, 6, 7]]
    """
    ids = np.asarray(jax.device_get(prompt_ids))
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        msg = f"prompt_ids must have shape (B, P) with B, P >= 1, got {ids.shape}"
        raise ValueError(msg)
    if not np.issubdtype(ids.dtype, np.integer):
        msg = f"prompt_ids must hold integer token ids, got dtype {ids.dtype}"
        raise TypeError(msg)
    mask = np.ones(ids.shape, bool) if prompt_mask is None else np.asarray(prompt_mask)
    if mask.shape != ids.shape:
        msg = f"prompt_mask must have the shape of prompt_ids {ids.shape}, got {mask.shape}"
        raise ValueError(msg)
    mask = mask.astype(bool)
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        msg = f"empty prompt: row {int(empty[0])} of prompt_mask has no real token"
        raise ValueError(msg)
    if vocab_size is not None:
        real = np.where(mask, ids, 0)
        bad = (real < 0) | (real >= vocab_size)
        if bad.any():
            msg = (
                f"prompt_ids must hold token ids in [0, {vocab_size}) (the model's vocabulary), "
                f"got [{int(real.min())}, {int(real.max())}] (first bad row "
                f"{int(np.argwhere(bad)[0][0])}): check that the tokenizer matches the model"
            )
            raise ValueError(msg)
    return [[int(t) for t in row[m]] for row, m in zip(ids, mask, strict=True)]


def assemble_output(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    *,
    num_generations: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    prompt_buckets: Sequence[int] | None = DEFAULT_PROMPT_BUCKETS,
) -> SamplerOutput:
    """Lays ragged completions out as the :class:`SamplerOutput` ``generate`` returns.

    Row ``i`` of the output is completion ``i`` (prompt ``i // K``, generation ``i % K``). The
    prompts are left-padded with ``pad_id`` to the bucket of the longest one and repeated ``K``
    times; the completions are right-padded with ``pad_id`` to ``max_new_tokens`` columns, the
    mask is 1 on each completion's tokens (its end-of-sequence token included) and the
    log-probs are 0 where the mask is 0. A row is truncated when it has ``max_new_tokens``
    tokens and does not end with an end-of-sequence id.

    Args:
        prompts: ``B`` prompts' real token ids.
        completions: ``B * K`` completions' token ids, prompt-major.
        log_probs: The log-prob of each completion token under the sampling distribution.
        num_generations: ``K``.
        max_new_tokens: ``N``, the output's completion width.
        eos_ids: The ids that end a completion.
        pad_id: Filler of the padding.
        prompt_buckets: Prompt widths to pad to (``None``: the longest prompt's).

    Returns:
        A :class:`~artifex.generative_models.inference.batch_layout.SamplerOutput` of device
        arrays.

    Raises:
        ValueError: ``B * K`` completions not given, a completion that is empty or longer than
            ``N``, an end-of-sequence id before a completion's last token, a completion shorter
            than ``N`` that does not end with one (an engine that stopped for another reason),
            log-probs of another length than their completion, or log-probs that are not finite
            or are above 0.

    Examples:
        >>> from artifex.generative_models.inference.engines import assemble_output
        >>> out = assemble_output([[5, 6], [7]], [[3, 2], [4, 4, 4], [2], [9, 9, 9]],
        ...                       [[-0.5, -0.1], [-1.0, -1.0, -1.0], [-0.2], [-2.0, -2.0, -2.0]],
        ...                       num_generations=2, max_new_tokens=3, eos_ids=(2,), pad_id=0,
        ...                       prompt_buckets=None)
        >>> out.prompt_ids.tolist()[1:3], out.completion_ids.tolist()[0]
        ([[5, 6], [0, 7]], [3, 2, 0])
        >>> out.truncated.tolist(), out.lengths.tolist()
        ([False, True, False, True], [2, 3, 1, 3])
    """
    k = check_int("num_generations", num_generations, minimum=1)
    n = check_int("max_new_tokens", max_new_tokens, minimum=1)
    b = len(prompts)
    if len(completions) != b * k or len(log_probs) != b * k:
        msg = (
            f"an engine must return num_generations={k} completions for each of the {b} "
            f"prompts ({b * k}), got {len(completions)} completions and {len(log_probs)} "
            "log-prob rows"
        )
        raise ValueError(msg)
    eos = frozenset(int(e) for e in eos_ids)
    longest = max(len(p) for p in prompts)
    width = longest if prompt_buckets is None else bucket_length(longest, prompt_buckets)
    prompt_ids = np.full((b, width), pad_id, np.int32)
    prompt_mask = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):
        if len(p):
            prompt_ids[i, width - len(p) :] = p
            prompt_mask[i, width - len(p) :] = 1
    ids = np.full((b * k, n), pad_id, np.int32)
    mask = np.zeros((b * k, n), np.int32)
    logps = np.zeros((b * k, n), np.float32)
    truncated = np.zeros((b * k,), bool)
    for i, (tokens, lps) in enumerate(zip(completions, log_probs, strict=True)):
        tokens = [int(t) for t in tokens]
        m = len(tokens)
        where = f"completion {i} (prompt {i // k}, generation {i % k})"
        if not 1 <= m <= n:
            msg = f"{where} has {m} tokens; expected 1 to max_new_tokens={n}"
            raise ValueError(msg)
        if len(lps) != m:
            msg = f"{where} has {m} tokens but {len(lps)} log-probs"
            raise ValueError(msg)
        early = [j for j, t in enumerate(tokens[:-1]) if t in eos]
        if early:
            msg = f"{where} has the end-of-sequence id {tokens[early[0]]} at token {early[0]}, "
            msg += f"before its last token {m - 1}"
            raise ValueError(msg)
        ended = tokens[-1] in eos
        if m < n and not ended:
            msg = (
                f"{where} stopped after {m} of max_new_tokens={n} tokens without an "
                f"end-of-sequence id {sorted(eos)}: the engine stopped for another reason "
                "(its own length limit, a stop string?)"
            )
            raise ValueError(msg)
        row = np.asarray(lps, np.float64)
        if not np.isfinite(row).all() or (row > 1e-4).any():
            j = int(np.flatnonzero(~np.isfinite(row) | (row > 1e-4))[0])
            msg = f"{where}: the log-prob of token {j} is {row[j]}, expected a finite value <= 0"
            raise ValueError(msg)
        ids[i, :m] = tokens
        mask[i, :m] = 1
        logps[i, :m] = np.minimum(row, 0.0)
        truncated[i] = m == n and not ended
    return SamplerOutput(
        prompt_ids=jnp.asarray(np.repeat(prompt_ids, k, axis=0)),
        prompt_mask=jnp.asarray(np.repeat(prompt_mask, k, axis=0)),
        completion_ids=jnp.asarray(ids),
        completion_mask=jnp.asarray(mask),
        log_probs=jnp.asarray(logps),
        truncated=jnp.asarray(truncated),
        lengths=jnp.asarray(mask.sum(axis=1, dtype=np.int32)),
    )


def hf_weights(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's weights as host arrays under Hugging Face names and layouts, LoRA merged.

    What an engine that runs the Hugging Face architecture loads: the names and the
    ``(out, in)`` layout of
    :func:`~artifex.generative_models.models.causal_lm.hf_io.to_hf_tensors` (one map for
    checkpoints and engines), after
    :func:`~artifex.generative_models.models.causal_lm.lora.merge_lora` for a model with
    adapters (``W + (alpha / r) A B``, the weights the policy samples with).

    Args:
        model: A causal LM (per-layer or stacked layers, with or without LoRA adapters).

    Returns:
        ``{hf_name: array}``; bfloat16 weights stay ``ml_dtypes.bfloat16``.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.inference.engines import hf_weights
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=12,
        ...                      num_layers=1, num_heads=2)
        >>> hf_weights(CausalLM(cfg, rngs=nnx.Rngs(0)))["model.layers.0.mlp.up_proj.weight"].shape
        (12, 8)
    """
    from artifex.generative_models.models.causal_lm.hf_io import to_hf_tensors
    from artifex.generative_models.models.causal_lm.lora import merge_lora

    has_lora = any(
        isinstance(node, nnx.LoRAParam)
        for _, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Variable)
    )
    return to_hf_tensors(merge_lora(model) if has_lora else model)


class WeightVersion:
    """Tells whether a model's parameters changed since the last :meth:`mark`.

    It remembers the parameter arrays by weak reference (no copy, and nothing is kept alive):
    an update replaces the arrays, so a parameter that is not the remembered array (or whose
    remembered array was freed) has changed.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.inference.engines import WeightVersion
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=12,
        ...                      num_layers=1, num_heads=2)
        >>> model = CausalLM(cfg, rngs=nnx.Rngs(0))
        >>> version = WeightVersion()
        >>> version.changed(model)
        True
        >>> version.mark(model)
        >>> version.changed(model)
        False
        >>> nnx.update(model, jax.tree.map(lambda x: x + 1, nnx.state(model, nnx.Param)))
        >>> version.changed(model)
        True
    """

    def __init__(self) -> None:
        self._model: weakref.ref[Any] | None = None
        self._leaves: list[weakref.ref[Any]] | None = None

    @staticmethod
    def _arrays(model: nnx.Module) -> list[Any]:
        return jax.tree.leaves(nnx.state(model, nnx.Param))

    def changed(self, model: nnx.Module) -> bool:
        """Whether ``model`` or any of its parameter arrays differs from the marked ones.

        Args:
            model: The model.

        Returns:
            ``True`` before the first :meth:`mark`, for another model, or after an update.
        """
        if self._leaves is None or self._model is None or self._model() is not model:
            return True
        leaves = self._arrays(model)
        return len(leaves) != len(self._leaves) or any(
            ref() is not x for ref, x in zip(self._leaves, leaves, strict=True)
        )

    def mark(self, model: nnx.Module) -> None:
        """Remembers ``model``'s current parameter arrays.

        Args:
            model: The model.
        """
        self._model = weakref.ref(model)
        self._leaves = [weakref.ref(x) for x in self._arrays(model)]


class SamplerEngine:
    """The library's own sampler behind the engine interface.

    It samples with the synced model itself (no copy of the weights):
    :func:`~artifex.generative_models.inference.sampling.generate`, or
    :func:`~artifex.generative_models.inference.continuous.generate_continuous` with
    ``continuous=True`` (completions of very different lengths). A rollout with this engine
    builds the batch a rollout without an engine builds.

    Args:
        continuous: Decode with continuous batching.
        row_groups: ``generate``'s ``row_groups`` (not with ``continuous``).

    Raises:
        TypeError: ``continuous`` not a bool, ``row_groups`` not an int.
        ValueError: ``row_groups`` below 1, or given with ``continuous``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.inference.engines import SamplerEngine
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=2)
        >>> engine = SamplerEngine()
        >>> engine.sync_weights(CausalLM(cfg, rngs=nnx.Rngs(0)))
        True
        >>> out = engine.generate(jnp.array([[4, 5]]), key=jax.random.key(0), num_generations=3,
        ...                       max_new_tokens=4)
        >>> out.completion_ids.shape, out.log_probs.shape
        ((3, 4), (3, 4))
    """

    def __init__(self, *, continuous: bool = False, row_groups: int | None = None):
        self.continuous = check_bool("SamplerEngine.continuous", continuous)
        self.row_groups = check_int(
            "SamplerEngine.row_groups", row_groups, minimum=1, allow_none=True
        )
        if continuous and row_groups is not None:
            msg = "SamplerEngine: row_groups is a setting of generate, not of continuous batching"
            raise ValueError(msg)
        self.model: Any = None
        self._version = WeightVersion()

    def sync_weights(self, model: Any) -> bool:
        """Samples from ``model`` from now on (its arrays are read at each call).

        Args:
            model: The policy.

        Returns:
            Whether the model or its weights changed since the last call.
        """
        changed = self._version.changed(model)
        self.model = model
        self._version.mark(model)
        return changed

    def generate(
        self,
        prompt_ids: Any,
        prompt_mask: Any = None,
        *,
        key: jax.Array,
        num_generations: int = 1,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        eos_ids: Sequence[int] | int | None = None,
        pad_id: int | None = None,
        prompt_buckets: Sequence[int] | None = DEFAULT_PROMPT_BUCKETS,
    ) -> SamplerOutput:
        """Samples with the synced model (see :class:`RolloutEngine`).

        Args:
            prompt_ids: ``(B, P)`` integer token ids, left-padded.
            prompt_mask: ``(B, P)`` 1 on real tokens (``None``: no padding).
            key: PRNG key; the output is a function of it (and of the weights).
            num_generations: ``K >= 1`` completions per prompt.
            max_new_tokens: ``N >= 1``, the most tokens of a completion (the output's width).
            temperature: ``tau >= 0``; 0 is greedy.
            top_k: Sample among the ``top_k`` most likely tokens only (``None``: all).
            top_p: Nucleus mass in (0, 1]; 1 disables it.
            eos_ids: Token id(s) that end a completion (``None``: the model config's).
            pad_id: Filler of the padding (``None``: the config's pad id, else the first
                end-of-sequence id, else 0).
            prompt_buckets: Prompt widths to left-pad to (``None``: the longest prompt's).

        Returns:
            What ``generate`` (or ``generate_continuous``) returns.

        Raises:
            ValueError: No model synced yet, or what ``generate`` refuses.
        """
        if self.model is None:
            msg = "SamplerEngine.generate: no model yet; call sync_weights(model) first"
            raise ValueError(msg)
        kwargs = dict(
            key=key,
            num_generations=num_generations,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_ids=eos_ids,
            pad_id=pad_id,
            prompt_buckets=prompt_buckets,
        )
        if self.continuous:
            from artifex.generative_models.inference.continuous import generate_continuous

            return generate_continuous(self.model, prompt_ids, prompt_mask, **kwargs)
        return generate(self.model, prompt_ids, prompt_mask, row_groups=self.row_groups, **kwargs)


def check_sampling(
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float,
) -> None:
    """Raises unless the sampling settings are in the ranges ``generate`` accepts.

    Args:
        num_generations: ``K >= 1``.
        max_new_tokens: ``N >= 1``.
        temperature: ``tau >= 0``.
        top_k: ``None`` or ``>= 1``.
        top_p: In ``(0, 1]``.

    Raises:
        ValueError: A setting out of its range.
        TypeError: A setting of the wrong type.

    Examples:
        >>> from artifex.generative_models.inference.engines.base import check_sampling
        >>> check_sampling(num_generations=2, max_new_tokens=8, temperature=1.0, top_k=None,
        ...                top_p=1.0)
    """
    check_int("num_generations", num_generations, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_int("top_k", top_k, minimum=1, allow_none=True)
    check_float("top_p", top_p, greater_than=0.0, maximum=1.0)
    check_float("temperature", temperature, minimum=0.0)
