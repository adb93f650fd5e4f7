"""A learned reward model as a reward function: text in, one score per completion out.

:func:`reward_model_reward` wraps a transformers ``*ForSequenceClassification`` checkpoint
(:class:`~artifex.generative_models.models.causal_lm.CausalLMForSequenceClassification`) as a
reward function ``f(prompts, completions, **columns) -> list[float]`` that mixes with rule
rewards through :func:`~artifex.generative_models.training.rl.rewards.combine_rewards` and its
weights. Each completion is scored the way TRL's GRPO trainer scores it: a conversation
(``prompt`` messages plus the completion as the assistant's message) is rendered with the
reward model's own chat template, a plain-text prompt is concatenated with the completion;
either text is encoded without added special tokens, right-padded, and the score of label
``label`` at the token transformers pools is the reward.

Inside the training loop ``prompts`` are the policy's rendered prompt texts; to score with the
reward model's chat template there, keep the prompt's chat messages in a dataset column and name
it with ``messages_column``.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from artifex.generative_models.models.causal_lm import (
    CausalLMForSequenceClassification,
    Tokenizer,
)
from artifex.generative_models.training.sharding import (
    PartitionRules,
    host_array,
    num_data_shards,
    shard_batch,
    shard_model,
)
from artifex.generative_models.utils.validation import check_choice, check_float, check_int

__all__ = ["RewardModelReward", "reward_model_reward"]

Normalize = Literal["none", "affine", "running"]
_MIN_BUCKET = 16


def _apply(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array, mask: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(ids, mask)


def _bucket(length: int, limit: int) -> int:
    """The padded width: the next power of two >= ``length`` (at least 16), at most ``limit``."""
    width = _MIN_BUCKET
    while width < length:
        width *= 2
    return max(min(width, limit), length)


class RewardModelReward:
    """A sequence-classification model scoring completions; see :func:`reward_model_reward`.

    Build it with :func:`reward_model_reward`, which checks the arguments and places the model.

    Args:
        model: The loaded model.
        tokenizer: Its tokenizer.
        batch_size: Rows per forward pass.
        label: The score column used as reward.
        normalize: ``"none"``, ``"affine"`` or ``"running"``.
        scale: ``"affine"`` factor.
        shift: ``"affine"`` offset.
        eps: ``"running"`` std offset.
        messages_column: Dataset column read instead of ``prompts``, or None.
        max_length: Longest scored text in tokens.
        on_too_long: ``"error"`` or ``"none"``.
        mesh: The mesh the model is placed on, or None.
        name: The function's ``__name__``.

    Attributes:
        model: The :class:`CausalLMForSequenceClassification` (placed on ``mesh`` if given).
        tokenizer: The reward model's tokenizer.
        count: Scores seen by ``"running"`` normalization so far.
        mean: Their mean (float64).
        m2: The sum of their squared deviations from ``mean`` (float64).

    Examples:
        >>> from artifex.generative_models.training.rl.rewards import reward_model_reward
        >>> reward = reward_model_reward("tests/fixtures/reward_models/qwen2_rm")  # repo root
        >>> chat = [{"role": "user", "content": "What is 12 + 30?"}]
        >>> scores = reward([chat, chat], ["42", "The answer is 42."])
        >>> len(scores), reward.__name__
        (2, 'reward_model')
    """

    def __init__(
        self,
        model: CausalLMForSequenceClassification,
        tokenizer: Tokenizer,
        *,
        batch_size: int,
        label: int,
        normalize: Normalize,
        scale: float,
        shift: float,
        eps: float,
        messages_column: str | None,
        max_length: int,
        on_too_long: Literal["error", "none"],
        mesh: Mesh | None,
        name: str,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.label = label
        self.normalize = normalize
        self.scale = scale
        self.shift = shift
        self.eps = eps
        self.messages_column = messages_column
        self.max_length = max_length
        self.on_too_long = on_too_long
        self.mesh = mesh
        self.__name__ = name
        pad = model.config.pad_token_id
        self._pad_id = tokenizer.pad_id if pad is None else int(pad)
        graphdef, state = nnx.split(model)
        self._state = state
        self._forward = jax.jit(functools.partial(_apply, graphdef))
        self.reset()

    def __repr__(self) -> str:
        return (
            f"RewardModelReward(name={self.__name__!r}, batch_size={self.batch_size}, "
            f"label={self.label}, normalize={self.normalize!r})"
        )

    # ------------------------------------------------------------------ normalization state

    def reset(self) -> None:
        """Forgets the running statistics of ``"running"`` normalization."""
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    def state_dict(self) -> dict[str, float]:
        """The running statistics, to save beside a checkpoint (the loop does not save them).

        Returns:
            ``{"count", "mean", "m2"}``.
        """
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restores running statistics from :meth:`state_dict`.

        Args:
            state: ``{"count", "mean", "m2"}``.

        Raises:
            ValueError: If a key is missing, the count is negative or a value is not finite.
        """
        missing = {"count", "mean", "m2"} - set(state)
        if missing:
            msg = f"load_state_dict: missing keys {sorted(missing)}"
            raise ValueError(msg)
        self.count = check_int("count", int(state["count"]), minimum=0)
        self.mean = check_float("mean", float(state["mean"]))
        self.m2 = check_float("m2", float(state["m2"]), minimum=0.0)

    def _update_running(self, scores: np.ndarray) -> None:
        """Merges a batch into the running mean and M2 (Chan et al.'s parallel update)."""
        n = scores.size
        if n == 0:
            return
        batch_mean = float(scores.mean())
        batch_m2 = float(((scores - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def _normalized(self, scores: np.ndarray) -> np.ndarray:
        if self.normalize == "affine":
            return self.scale * scores + self.shift
        if self.normalize == "running":
            self._update_running(scores)
            std = math.sqrt(self.m2 / self.count) if self.count else 0.0
            return (scores - self.mean) / (std + self.eps)
        return scores

    # ------------------------------------------------------------------ text -> ids

    def _conversation(self, prompt: Any, completion: Any, row: int) -> list[Any] | None:
        if isinstance(completion, str):
            answer = [{"role": "assistant", "content": completion}]
        elif isinstance(completion, Sequence) and all(isinstance(m, Mapping) for m in completion):
            answer = list(completion)
        else:
            msg = (
                f"{self.__name__}: completions[{row}] must be a string or a list of chat "
                f"messages, got {type(completion).__name__}"
            )
            raise TypeError(msg)
        if isinstance(prompt, str):
            return None
        if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
            return [*prompt, *answer]
        msg = (
            f"{self.__name__}: prompt of row {row} must be a string or a list of chat messages "
            f"(dicts with 'role' and 'content'), got {type(prompt).__name__}"
        )
        raise TypeError(msg)

    def encode(
        self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
    ) -> list[list[int]]:
        """The token ids the reward model scores, one list per completion.

        Args:
            prompts: ``B`` prompts: strings or lists of chat messages.
            completions: ``B`` completions: strings (or lists of assistant messages).
            **columns: Dataset columns; ``messages_column``, if set, is read instead of
                ``prompts``.

        Returns:
            The ids (no special tokens added beyond what the chat template writes).

        Raises:
            ValueError: If ``messages_column`` is missing, lengths differ or a text is empty.
            TypeError: If a prompt or completion has the wrong type.
        """
        if len(prompts) != len(completions):
            msg = (
                f"{self.__name__}: prompts and completions must have the same length, got "
                f"{len(prompts)} and {len(completions)}"
            )
            raise ValueError(msg)
        if self.messages_column is not None:
            if self.messages_column not in columns:
                msg = (
                    f"{self.__name__} needs the dataset column {self.messages_column!r} "
                    f"(messages_column), got columns {sorted(columns)}"
                )
                raise ValueError(msg)
            prompts = columns[self.messages_column]
            if len(prompts) != len(completions):
                msg = (
                    f"{self.__name__}: column {self.messages_column!r} has {len(prompts)} "
                    f"entries, expected {len(completions)}"
                )
                raise ValueError(msg)
        out = []
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            conversation = self._conversation(prompt, completion, row)
            if conversation is not None:
                text = self.tokenizer.apply_chat_template(conversation, tokenize=False)
            elif isinstance(completion, str):
                text = prompt + completion
            else:
                msg = (
                    f"{self.__name__}: row {row} has a plain-text prompt and a chat-message "
                    "completion; give both as text or the prompt as chat messages"
                )
                raise TypeError(msg)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                msg = f"{self.__name__}: row {row} encodes to no tokens"
                raise ValueError(msg)
            out.append(ids)
        return out

    # ------------------------------------------------------------------ scoring

    def scores(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """Raw scores (label ``label``) of token sequences, batch by batch, before normalization.

        Each batch holds ``batch_size`` rows (the last one filled with padding rows), right
        padded to a power-of-two width of at least 16 (at most ``max_length``), so the model
        compiles once per width.

        Args:
            sequences: Token id lists, each at most ``max_length`` long.

        Returns:
            float64 scores ``(len(sequences),)``.

        Raises:
            ValueError: If a sequence is empty or longer than ``max_length``.
        """
        out = np.empty(len(sequences), np.float64)
        for start in range(0, len(sequences), self.batch_size):
            chunk = list(sequences[start : start + self.batch_size])
            longest = max(len(s) for s in chunk)
            if longest > self.max_length or min(len(s) for s in chunk) == 0:
                bad = next(i for i, s in enumerate(chunk) if not 0 < len(s) <= self.max_length)
                msg = (
                    f"{self.__name__}: sequence {start + bad} has {len(chunk[bad])} tokens; "
                    f"expected 1 to max_length={self.max_length}"
                )
                raise ValueError(msg)
            width = _bucket(longest, self.max_length)
            ids = np.full((self.batch_size, width), self._pad_id, np.int32)
            mask = np.zeros((self.batch_size, width), np.int32)
            ids[len(chunk) :, 0] = 0 if self._pad_id != 0 else 1  # filler rows: one real token
            mask[len(chunk) :, 0] = 1
            for b, seq in enumerate(chunk):
                ids[b, : len(seq)] = seq
                mask[b, : len(seq)] = 1
            scores = self._forward(self._state, *self._place(ids, mask))
            out[start : start + len(chunk)] = host_array(scores)[: len(chunk), self.label]
        return out

    def _place(self, ids: np.ndarray, mask: np.ndarray) -> tuple[jax.Array, jax.Array]:
        if self.mesh is None:
            return jnp.asarray(ids), jnp.asarray(mask)
        if self.batch_size % num_data_shards(self.mesh) == 0:
            return shard_batch((jnp.asarray(ids), jnp.asarray(mask)), self.mesh)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.device_put(ids, replicated), jax.device_put(mask, replicated)

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
    ) -> list[float | None]:
        """Scores a batch of completions (the reward-function protocol).

        Args:
            prompts: ``B`` prompts (strings or lists of chat messages).
            completions: ``B`` completions.
            **columns: Dataset columns (``messages_column`` is read if set; the rest ignored).

        Returns:
            ``B`` normalized scores; ``None`` for a text longer than ``max_length`` when
            ``on_too_long="none"``.

        Raises:
            ValueError: For a text longer than ``max_length`` with ``on_too_long="error"``,
                an empty text, or inputs of different lengths.
            TypeError: If a prompt or completion has the wrong type.
        """
        sequences = self.encode(prompts, completions, **columns)
        keep = [i for i, s in enumerate(sequences) if len(s) <= self.max_length]
        if len(keep) < len(sequences):
            first = next(i for i, s in enumerate(sequences) if len(s) > self.max_length)
            if self.on_too_long == "error":
                msg = (
                    f"{self.__name__}: row {first} has {len(sequences[first])} tokens, more than "
                    f"max_length={self.max_length} (texts are never truncated; "
                    "on_too_long='none' gives such rows no reward)"
                )
                raise ValueError(msg)
            warnings.warn(
                f"{self.__name__}: {len(sequences) - len(keep)} of {len(sequences)} rows are "
                f"longer than max_length={self.max_length} tokens and get no reward",
                stacklevel=2,
            )
        raw = self.scores([sequences[i] for i in keep])
        values = self._normalized(raw)
        result: list[float | None] = [None] * len(sequences)
        for i, v in zip(keep, values, strict=True):
            result[i] = float(v)
        return result


def reward_model_reward(
    model: str | os.PathLike[str] | CausalLMForSequenceClassification,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    *,
    batch_size: int = 8,
    label: int = 0,
    normalize: Normalize = "none",
    scale: float = 1.0,
    shift: float = 0.0,
    eps: float = 1e-6,
    messages_column: str | None = None,
    max_length: int | None = None,
    on_too_long: Literal["error", "none"] = "error",
    dtype: str | None = None,
    mesh: Mesh | None = None,
    rules: PartitionRules | Sequence[tuple[str, Any]] | None = None,
    name: str = "reward_model",
) -> RewardModelReward:
    """A reward function that scores each completion with a sequence-classification model.

    ``reward_i = norm(s_i)`` where ``s_i`` is the model's score of label ``label`` for prompt
    ``i`` followed by completion ``i`` (see the module docstring for the text), and ``norm`` is

    - ``"none"``: ``s``;
    - ``"affine"``: ``scale * s + shift`` (e.g. ``1 / std`` and ``-mean / std`` measured on
      reference completions, as OpenRLHF's stored reward mean and std);
    - ``"running"``: ``(s - mean) / (std + eps)`` with the population mean and std of every
      score this function has returned so far, the current batch included (updated before
      normalizing; statistics are per process, and restart with the object unless saved with
      ``state_dict``).

    Args:
        model: A checkpoint directory or a loaded model.
        tokenizer: The reward model's tokenizer, or its directory; default: ``model``'s
            directory.
        batch_size: Rows per forward pass (the last batch is filled up with padding rows).
        label: The score column used as reward (TRL reads column 0).
        normalize: ``"none"``, ``"affine"`` or ``"running"``.
        scale: ``"affine"`` factor.
        shift: ``"affine"`` offset.
        eps: ``"running"``: positive constant added to the std.
        messages_column: Dataset column with each prompt's chat messages, read instead of
            ``prompts`` (in the loop, ``prompts`` are the policy's rendered texts).
        max_length: Longest scored text in tokens; default ``max_position_embeddings``.
        on_too_long: A longer text raises (``"error"``) or gets no reward (``"none"``, warned).
        dtype: Parameter dtype when loading from a directory.
        mesh: Devices of this process to run the model on: its parameters are laid out by
            ``rules`` (:func:`~artifex.generative_models.training.shard_model`) and the rows
            split over the mesh's data axes when ``batch_size`` allows.
        rules: Partition rules for ``mesh`` (default ``PartitionRules()``).
        name: The function's ``__name__`` (metrics ``rewards/<name>``).

    Returns:
        A :class:`RewardModelReward`.

    Raises:
        ValueError: Naming the argument: a bad ``batch_size``, ``label``, ``normalize``,
            ``eps``, ``max_length`` or a ``mesh`` with devices of other processes.
        TypeError: If ``model`` is neither a path nor a sequence-classification model.

    Examples:
        >>> from artifex.generative_models.training.rl.rewards import (
        ...     combine_rewards, format_reward, reward_model_reward)
        >>> rm = reward_model_reward("tests/fixtures/reward_models/qwen2_rm", batch_size=2,
        ...                          normalize="affine", scale=0.5, shift=1.0)  # repo root
        >>> total, per_function = combine_rewards(
        ...     [rm, format_reward()], ["What is 1 + 1? "] * 3, ["2", "<answer>2</answer>", "3"],
        ...     weights=[1.0, 0.1])
        >>> per_function.shape, total.shape
        ((3, 2), (3,))

    References:
        Ouyang et al., "Training language models to follow instructions with human feedback",
        2022 (a learned reward model as the RL reward).
    """
    check_int("batch_size", batch_size, minimum=1)
    check_choice("normalize", normalize, ("none", "affine", "running"))
    check_choice("on_too_long", on_too_long, ("error", "none"))
    check_float("scale", scale)
    check_float("shift", shift)
    check_float("eps", eps, greater_than=0.0)
    if messages_column is not None and not isinstance(messages_column, str):
        msg = f"messages_column must be a str or None, got {type(messages_column).__name__}"
        raise TypeError(msg)
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            msg = f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}"
            raise TypeError(msg)
        foreign = [d for d in mesh.devices.flat if d.process_index != jax.process_index()]
        if foreign:
            msg = (
                f"mesh: a reward model runs on devices of its own process; the mesh holds "
                f"{len(foreign)} devices of other processes"
            )
            raise ValueError(msg)
    if isinstance(model, str | os.PathLike):
        directory = os.fspath(model)
        loaded = CausalLMForSequenceClassification.from_pretrained(directory, dtype=dtype)
        if tokenizer is None:
            tokenizer = directory
    elif isinstance(model, CausalLMForSequenceClassification):
        loaded = model
        if tokenizer is None:
            msg = "tokenizer is required when model is a loaded model (not a directory)"
            raise TypeError(msg)
    else:
        msg = (
            "model must be a checkpoint directory or a CausalLMForSequenceClassification, "
            f"got {type(model).__name__}"
        )
        raise TypeError(msg)
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = Tokenizer.from_pretrained(tokenizer)
    check_int("label", label, minimum=0)
    if label >= loaded.num_labels:
        msg = f"label must be below the model's num_labels={loaded.num_labels}, got {label}"
        raise ValueError(msg)
    limit = loaded.config.max_position_embeddings
    max_length = limit if max_length is None else max_length
    check_int("max_length", max_length, minimum=1)
    if max_length > limit:
        msg = (
            f"max_length must be at most the model's max_position_embeddings={limit}, "
            f"got {max_length}"
        )
        raise ValueError(msg)
    if mesh is not None:
        shard_model(loaded, mesh, rules)
    return RewardModelReward(
        loaded,
        tokenizer,
        batch_size=batch_size,
        label=label,
        normalize=normalize,
        scale=float(scale),
        shift=float(shift),
        eps=float(eps),
        messages_column=messages_column,
        max_length=max_length,
        on_too_long=on_too_long,
        mesh=mesh,
        name=name,
    )
