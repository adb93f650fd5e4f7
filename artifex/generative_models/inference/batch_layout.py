"""The sampler's rows: prompt-length buckets, the position check, and the output rows.

:func:`~artifex.generative_models.inference.sampling.generate` left-pads prompts to a
prompt-length bucket (:func:`bucket_length` of :data:`DEFAULT_PROMPT_BUCKETS`), checks that the
longest prompt plus the completion fits the model's positions (:func:`check_fits_positions`),
reads the rows a process holds on the host (``_local_rows``), and returns a
:class:`SamplerOutput` of prompt-major rows.

Moved out of :mod:`~artifex.generative_models.inference.sampling` unchanged; it still imports
these names, so they stay importable from there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "DEFAULT_PROMPT_BUCKETS",
    "SamplerOutput",
    "bucket_length",
    "check_fits_positions",
]

DEFAULT_PROMPT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Completions in prompt-major, generation-minor order (row ``i``: prompt ``i // K``).

    Attributes:
        prompt_ids: ``(B*K, P)`` the left-padded prompts (padded to their length bucket),
            repeated for each generation.
        prompt_mask: ``(B*K, P)`` 1 on real prompt tokens.
        completion_ids: ``(B*K, N)`` generated tokens; ``pad_id`` after a row's EOS.
        completion_mask: ``(B*K, N)`` int32, 1 on generated tokens up to and including EOS.
        log_probs: ``(B*K, N)`` float32 log-prob of each generated token under the sampling
            distribution (0 where the mask is 0).
        truncated: ``(B*K,)`` bool, True for rows that reached ``max_new_tokens`` without EOS.
        lengths: ``(B*K,)`` int32 number of completion tokens (the mask's row sums).
        routed_experts: With ``generate(..., record_routing=True)`` (mixture-of-experts models):
            ``(B*K, P + N, L, k)`` int32, the ``k`` experts each of the ``L`` layers computed
            every prompt and completion token by, as the tokens went through the model (-1
            where a token was not computed as a real token: prompt padding, the last
            completion token, tokens after EOS); else ``None``.

    Examples:
        >>> import dataclasses
        >>> from artifex.generative_models.inference import SamplerOutput
        >>> [f.name for f in dataclasses.fields(SamplerOutput)][:4]
        ['prompt_ids', 'prompt_mask', 'completion_ids', 'completion_mask']
    """

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    completion_ids: jax.Array
    completion_mask: jax.Array
    log_probs: jax.Array
    truncated: jax.Array
    lengths: jax.Array
    routed_experts: jax.Array | None = None


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS) -> int:
    """The smallest bucket >= ``length`` (``length`` itself beyond the largest bucket).

    Args:
        length: A prompt width.
        buckets: Increasing bucket sizes.

    Returns:
        The padded width.

    Examples:
        >>> from artifex.generative_models.inference import bucket_length
        >>> bucket_length(5, (16, 32)), bucket_length(20, (16, 32)), bucket_length(40, (16, 32))
        (16, 32, 40)
    """
    for b in sorted(buckets):
        if b >= length:
            return int(b)
    return int(length)


def check_fits_positions(model: Any, longest_prompt: int, max_new_tokens: int) -> None:
    """Raises unless the longest prompt plus ``max_new_tokens`` fits the model's positions.

    Args:
        model: The model; its ``config.max_position_embeddings`` (if any) is the limit.
        longest_prompt: Tokens of the longest prompt (without padding).
        max_new_tokens: Tokens to generate.

    Raises:
        ValueError: Naming both lengths and the limit.

    Examples:
        >>> from types import SimpleNamespace
        >>> from artifex.generative_models.inference.batch_layout import check_fits_positions
        >>> model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8))
        >>> check_fits_positions(model, 5, 3)  # 8 positions: fits
    """
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_pos is not None and longest_prompt + max_new_tokens > max_pos:
        msg = (
            f"prompt too long: the longest prompt has {longest_prompt} tokens and "
            f"max_new_tokens={max_new_tokens}, but the model has {max_pos} positions "
            f"(max_position_embeddings)"
        )
        raise ValueError(msg)


def _local_rows(x: Any) -> np.ndarray:
    """Host copy of the rows of ``x`` that this process holds (all of them in one process).

    A ``jax.Array`` spread over several processes cannot be fetched whole; its addressable
    row shards are concatenated in row order (replicas counted once), so the host-side checks
    of :func:`~artifex.generative_models.inference.sampling.generate` look at this process's
    prompts.
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    parts: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        start = (shard.index[0].start or 0) if shard.index else 0
        parts.setdefault(start, np.asarray(shard.data))
    return np.concatenate([parts[k] for k in sorted(parts)], axis=0)
