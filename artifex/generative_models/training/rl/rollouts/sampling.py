"""Prompts to sampled, decoded completions: the rollout settings and the sampling step.

:class:`RolloutConfig` says how prompts become completions (lengths, top-k/top-p, the prompt
column, where old log-probs come from); :func:`encode_prompts` tokenizes and left-pads the rows'
prompts (a string, or chat messages rendered with the tokenizer's chat template);
:func:`sample_completions` samples ``num_generations`` completions per prompt with the compiled
KV-cache sampler (or a rollout engine) and decodes them into :class:`Completions`, with the
dataset columns the reward functions read. :func:`spans_processes` and
:func:`check_engine_rollout` say what a mesh of several processes and an engine allow.

:func:`~artifex.generative_models.training.rl.rollouts.rollout.rollout` scores these
completions and builds the ``GRPOBatch``. These names moved here unchanged from
``rollouts.rollout``, which still imports them, so every import path stays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.inference.engines.base import RolloutEngine
from artifex.generative_models.inference.sampling import generate
from artifex.generative_models.training.rl.rollouts._processes import _global_prompts
from artifex.generative_models.training.sharding import (
    batch_partition_spec,
    host_array,
    local_rows,
    num_data_shards,
    shard_batch,
)
from artifex.generative_models.utils.validation import (
    check_choice,
    check_float,
    check_int,
    check_str,
)

__all__ = [
    "Completions",
    "RolloutConfig",
    "check_engine_rollout",
    "encode_prompts",
    "sample_completions",
    "spans_processes",
]

OldLogProbs = Literal["auto", "sampler", "recompute"]
_COMPLETION_LENGTH_CLASH = (
    "dataset column 'completion_length' clashes with the rollout's own column"
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """How prompts become scored completions.

    The group size and the temperature come from the policy's ``GRPOConfig``
    (``num_generations``, ``temperature``).

    Attributes:
        max_new_tokens: Most tokens per completion (DAPO's overlong penalty can use it).
        top_k: Sample among the ``top_k`` most likely tokens only (``None``: all).
        top_p: Nucleus mass in (0, 1] (1: off).
        prompt_column: Dataset column holding the prompt (a string or chat messages).
        max_prompt_length: Longest prompt allowed, in tokens; a longer one is an error
            (prompts are never truncated silently). ``None``: limited by the model's positions.
        old_log_probs: Where old log-probs come from when they are needed: ``"sampler"``,
            ``"recompute"`` (a forward pass of the training graph), or ``"auto"`` (the sampler's
            when its distribution is the one the loss scores, else recompute).
        row_groups: Groups of prompts the sampler decodes at the same time on host threads
            (``None``: ``auto_row_groups``, which splits only for small models on the CPU; 1:
            one run). See ``generate``.

    Examples:
        >>> from artifex.generative_models.training import RolloutConfig
        >>> config = RolloutConfig(max_new_tokens=16, top_p=0.95)
        >>> config.max_new_tokens, config.old_log_probs
        (16, 'auto')
        >>> RolloutConfig(top_p=0.0)
        Traceback (most recent call last):
            ...
        ValueError: RolloutConfig.top_p must be a number in (0.0, 1.0], got 0.0
    """

    max_new_tokens: int = 128
    top_k: int | None = None
    top_p: float = 1.0
    prompt_column: str = "prompt"
    max_prompt_length: int | None = None
    old_log_probs: OldLogProbs = "auto"
    row_groups: int | None = None

    def __post_init__(self) -> None:
        f = "RolloutConfig."
        check_int(f + "max_new_tokens", self.max_new_tokens, minimum=1)
        check_int(f + "top_k", self.top_k, minimum=1, allow_none=True)
        check_float(f + "top_p", self.top_p, greater_than=0.0, maximum=1.0)
        check_str(f + "prompt_column", self.prompt_column)
        check_int(f + "max_prompt_length", self.max_prompt_length, minimum=1, allow_none=True)
        check_choice(f + "old_log_probs", self.old_log_probs, ("auto", "sampler", "recompute"))
        check_int(f + "row_groups", self.row_groups, minimum=1, allow_none=True)


def _prompt_text(tokenizer: Any, prompt: Any, row: int, column: str) -> tuple[str, list[int]]:
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        text = tokenizer.apply_chat_template(
            list(prompt), add_generation_prompt=True, tokenize=False
        )
        return text, tokenizer.encode(text, add_special_tokens=False)
    msg = (
        f"row {row}: column {column!r} must hold a string or a list of chat messages "
        f"(dicts with 'role' and 'content'), got {type(prompt).__name__}"
    )
    raise TypeError(msg)


def encode_prompts(
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    *,
    prompt_column: str = "prompt",
    max_prompt_length: int | None = None,
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Tokenizes and left-pads the prompts of ``rows``.

    Args:
        tokenizer: A :class:`~artifex.generative_models.models.causal_lm.Tokenizer`.
        rows: Dataset rows (mappings).
        prompt_column: The column with the prompt.
        max_prompt_length: Longest allowed prompt in tokens (error beyond).

    Returns:
        ``(texts, ids (N, P) int32, mask (N, P) int32)``.

    Raises:
        ValueError: A row lacks the prompt column, a prompt is empty or too long.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import Tokenizer
        >>> from artifex.generative_models.training.rl import encode_prompts
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> texts, ids, mask = encode_prompts(tok, [{"prompt": "1+2="}, {"prompt": "3="}])
        >>> texts, ids.tolist(), mask.tolist()
        (['1+2=', '3='], [[1, 5, 14, 6, 15], [0, 0, 1, 7, 15]], [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    """
    texts, encoded = [], []
    for i, row in enumerate(rows):
        if prompt_column not in row:
            msg = (
                f"dataset row {i} has no prompt column {prompt_column!r} "
                f"(it has {sorted(row)}); set prompt_column to the right name"
            )
            raise ValueError(msg)
        text, ids = _prompt_text(tokenizer, row[prompt_column], i, prompt_column)
        if not ids:
            msg = f"dataset row {i}: the prompt encodes to no tokens"
            raise ValueError(msg)
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            msg = (
                f"dataset row {i}: the prompt has {len(ids)} tokens, more than "
                f"max_prompt_length={max_prompt_length} (prompts are never truncated)"
            )
            raise ValueError(msg)
        texts.append(text)
        encoded.append(ids)
    ids, mask = tokenizer.pad_batch(encoded, side="left")
    return texts, np.asarray(ids, np.int32), np.asarray(mask, np.int32)


def _repeat_columns(
    rows: Sequence[Mapping[str, Any]], k: int, exclude: str
) -> dict[str, list[Any]]:
    names = sorted({name for row in rows for name in row} - {exclude})
    return {name: [row.get(name) for row in rows for _ in range(k)] for name in names}


@dataclasses.dataclass
class Completions:
    """Sampled completions of a list of rows, decoded, with the columns reward functions read.

    Attributes:
        output: The sampler's output (``B * K`` rows, row ``i`` of prompt ``i // K``).
        prompts: Prompt texts, one per batch row (repeated per generation).
        completions: Decoded completions, one per batch row.
        columns: Dataset columns repeated per generation, plus ``completion_length``.
        lengths: ``(B * K,)`` completion lengths in tokens.
        truncated: ``(B * K,)`` rows that hit ``max_new_tokens`` without EOS.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import RolloutConfig
        >>> from artifex.generative_models.training.rl import sample_completions
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> rows = [{"prompt": "1+1=", "answer": "2"}]
        >>> out = sample_completions(CausalLM(cfg, rngs=nnx.Rngs(0)), tok, rows,
        ...                          RolloutConfig(max_new_tokens=3), key=jax.random.key(0),
        ...                          num_generations=2, temperature=1.0)
        >>> out.prompts, sorted(out.columns), out.lengths.shape
        (['1+1=', '1+1='], ['answer', 'completion_length'], (2,))
    """

    output: Any
    prompts: list[str]
    completions: list[str]
    columns: dict[str, list[Any]]
    lengths: np.ndarray
    truncated: np.ndarray


def sample_completions(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    config: RolloutConfig,
    *,
    key: jax.Array,
    num_generations: int,
    temperature: float,
    mesh: Any = None,
    engine: RolloutEngine | None = None,
    record_routing: bool = False,
) -> Completions:
    """Encodes the rows' prompts, samples ``num_generations`` completions each and decodes them.

    With a ``mesh`` whose data axes divide the number of prompts, the prompts are sharded over
    them first, so the generation runs data-parallel (otherwise every device decodes every row).

    On a mesh spanning several processes (:func:`spans_processes`), ``rows`` are this
    process's prompts (the same number in every process, a multiple of its data shards): the
    prompt width is agreed with the other processes, the sampler runs once on the global prompt
    array, and only this process's rows of the output are copied to the host and decoded
    (``output`` stays global; ``prompts``, ``completions``, ``columns``, ``lengths`` and
    ``truncated`` are this process's).

    Args:
        model: The causal LM that samples.
        tokenizer: Its tokenizer.
        rows: Dataset rows, one per prompt.
        config: Prompt column, prompt length limit, ``max_new_tokens``, top-k/top-p.
        key: PRNG key.
        num_generations: Completions per prompt.
        temperature: Sampling temperature (0: greedy).
        mesh: Optional device mesh the model is placed on.
        engine: A :class:`~artifex.generative_models.inference.engines.RolloutEngine` that
            samples instead of the library's sampler: it is given ``model``'s weights
            (``sync_weights``, a no-op when unchanged) and the encoded prompts; ``None``: the
            library's sampler (``generate``).
        record_routing: The sampler records the routed experts of a mixture-of-experts model
            (``output.routed_experts``; not with an ``engine``).

    Returns:
        A :class:`Completions`.

    Raises:
        ValueError: Missing prompt column, empty or too-long prompts, a dataset column named
            ``completion_length``, or an ``engine`` with a mesh spanning several processes or
            with ``RolloutConfig.row_groups`` (a setting of the library's sampler).

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, Tokenizer)
        >>> from artifex.generative_models.training import RolloutConfig
        >>> from artifex.generative_models.training.rl import sample_completions
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> cfg = CausalLMConfig(vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, eos_token_id=tok.eos_ids[0])
        >>> rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
        >>> out = sample_completions(CausalLM(cfg, rngs=nnx.Rngs(0)), tok, rows,
        ...                          RolloutConfig(max_new_tokens=3), key=jax.random.key(0),
        ...                          num_generations=2, temperature=1.0)
        >>> out.output.completion_ids.shape, len(out.completions), out.columns["answer"]
        ((4, 3), 4, ['2', '2', '4', '4'])
        >>> bool((out.lengths <= 3).all())
        True
    """
    texts, ids, mask = encode_prompts(
        tokenizer,
        rows,
        prompt_column=config.prompt_column,
        max_prompt_length=config.max_prompt_length,
    )
    across = spans_processes(mesh)
    if engine is not None:
        check_engine_rollout(config, mesh)
    if across:
        ids, mask = _global_prompts(ids, mask, mesh, tokenizer.pad_id)
    elif engine is None and mesh is not None and ids.shape[0] % num_data_shards(mesh) == 0:
        ids, mask = shard_batch((jnp.asarray(ids), jnp.asarray(mask)), mesh)
    settings = dict(
        key=key,
        num_generations=num_generations,
        max_new_tokens=config.max_new_tokens,
        temperature=temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        eos_ids=tokenizer.eos_ids,
        pad_id=tokenizer.pad_id,
    )
    if engine is not None:  # an external engine samples (inference/engines)
        engine.sync_weights(model)
        out = engine.generate(ids, mask, **settings)
    else:
        groups, record = config.row_groups, record_routing
        out = generate(model, ids, mask, row_groups=groups, record_routing=record, **settings)
    if across:
        # Each process decodes (and the caller scores) only its own rows.
        rows_sharding = jax.sharding.NamedSharding(mesh, batch_partition_spec(mesh))
        out = jax.jit(lambda o: o, out_shardings=rows_sharding)(out)
        fetch = local_rows
    else:
        fetch = host_array
    completion_ids, lengths = fetch(out.completion_ids), fetch(out.lengths)
    completions = tokenizer.batch_decode(
        [row[:n] for row, n in zip(completion_ids, lengths, strict=True)],
        skip_special_tokens=True,
    )
    columns = _repeat_columns(rows, num_generations, exclude=config.prompt_column)
    if "completion_length" in columns:
        raise ValueError(_COMPLETION_LENGTH_CLASH)
    columns["completion_length"] = [int(n) for n in lengths]
    return Completions(
        output=out,
        prompts=[t for t in texts for _ in range(num_generations)],
        completions=completions,
        columns=columns,
        lengths=lengths,
        truncated=fetch(out.truncated),
    )


# ------------------------------------------------------------------------------ several processes
def spans_processes(mesh: Any) -> bool:
    """Whether ``mesh`` has devices of more than one process (a multi-host run).

    Then every process passes only its own dataset rows to :func:`sample_completions` and
    :func:`~artifex.generative_models.training.rl.rollouts.rollout.rollout`; the completions,
    their decoding and their rewards stay per process, and the batch arrays are global.

    Args:
        mesh: A ``jax.sharding.Mesh`` or ``None``.

    Returns:
        ``True`` when the mesh spans several processes.

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training.rl.rollouts.sampling import spans_processes
        >>> spans_processes(None), spans_processes(jax.make_mesh((1,), ("data",)))
        (False, False)
    """
    if mesh is None:
        return False
    return len({d.process_index for d in np.asarray(mesh.devices).flat}) > 1


def check_engine_rollout(config: RolloutConfig, mesh: Any) -> None:
    """Raises unless a rollout engine can sample with these settings.

    An engine samples in one process, from host prompts, with its own batching.

    Args:
        config: The rollout settings.
        mesh: The training mesh (``None``: one device).

    Raises:
        ValueError: ``RolloutConfig.row_groups`` set (a setting of the library's sampler), or a
            mesh spanning several processes.

    Examples:
        >>> from artifex.generative_models.training import RolloutConfig
        >>> from artifex.generative_models.training.rl.rollouts.sampling import check_engine_rollout
        >>> check_engine_rollout(RolloutConfig(), None)
        >>> check_engine_rollout(RolloutConfig(row_groups=2), None)
        Traceback (most recent call last):
            ...
        ValueError: RolloutConfig.row_groups=2 is a setting of the library's sampler, not of engines
    """
    if config.row_groups is not None:
        msg = (
            f"RolloutConfig.row_groups={config.row_groups} is a setting of the library's "
            "sampler, not of engines"
        )
        raise ValueError(msg)
    if spans_processes(mesh):
        msg = "a rollout engine samples in one process; the training mesh spans several processes"
        raise ValueError(msg)
