"""A step's data: the dataset order, the rollouts of its rows, and the generation batch.

:class:`DataIterator` gives each step its rows, in a deterministic and resumable order.
:func:`collect_generation_batch` turns them into the step's generation batch: one rollout, or
with dynamic sampling (DAPO) rollouts of further rows until enough groups have rewards that
differ, their groups joined by :func:`concat_batches`. :func:`dataset_fingerprint` is what a
resumed run must train on.

References:
    Yu et al., 2025, "DAPO", arXiv:2503.14476 (dynamic sampling).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.rl.core.advantages import nonconstant_groups
from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.policy import Policy
from artifex.generative_models.training.rl.rewards import RewardCombiner
from artifex.generative_models.training.rl.rollouts.rollout import (
    Rollout,
    RolloutConfig,
    spans_processes,
)
from artifex.generative_models.training.sharding import host_array, process_row_range

__all__ = [
    "DataIterator",
    "GenerationBatch",
    "collect_generation_batch",
    "concat_batches",
    "dataset_fingerprint",
    "take_rows",
]


class DataIterator:
    """Deterministic, resumable pass over a dataset of rows, epoch after epoch.

    The order of epoch ``e`` is a permutation drawn from ``(seed, e)``; the position is
    ``(epoch, index)`` and can be saved and restored.

    Across processes every process builds the same iterator (same dataset, seed, order) and
    keeps the same global position; :meth:`take` with ``part=(start, stop)`` (the process's
    :func:`~artifex.generative_models.training.sharding.process_row_range` of the step's
    prompts) returns only that process's rows of the step while the position advances by the
    whole step. Each process's rows are therefore a deterministic function of the step and its
    process index, and restoring the saved ``(epoch, index)`` restores every process's position.

    Args:
        dataset: Rows (mappings), indexable.
        seed: Seeds the per-epoch permutations.
        shuffle: Shuffle each epoch.

    Examples:
        >>> from artifex.generative_models.training.rl import DataIterator
        >>> rows = [{"prompt": str(i)} for i in range(5)]
        >>> data = DataIterator(rows, seed=0, shuffle=False)
        >>> [r["prompt"] for r in data.take(3)], data.state()
        (['0', '1', '2'], {'epoch': 0, 'index': 3})
        >>> [r["prompt"] for r in data.take(3)], data.state()  # crosses into epoch 1
        (['3', '4', '0'], {'epoch': 1, 'index': 1})
        >>> data.restore({"epoch": 0, "index": 3})
        >>> [r["prompt"] for r in data.take(2)]
        ['3', '4']
    """

    def __init__(self, dataset: Sequence[Mapping[str, Any]], *, seed: int, shuffle: bool):
        if len(dataset) == 0:
            msg = "the dataset is empty"
            raise ValueError(msg)
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def take(self, n: int, *, part: tuple[int, int] | None = None) -> list[Mapping[str, Any]]:
        """The next ``n`` rows (crossing into the next epoch as needed).

        Args:
            n: How many rows the position advances by (the global step).
            part: Return only rows ``[start, stop)`` of those ``n`` (this process's share);
                ``None``: all of them.

        Returns:
            The rows.

        Raises:
            ValueError: ``part`` is not a range inside ``[0, n]``.
        """
        if part is not None:
            start, stop = part
            if not 0 <= start <= stop <= n:
                msg = f"DataIterator.take: part must satisfy 0 <= start <= stop <= {n}, got {part}"
                raise ValueError(msg)
            return self.take(n)[start:stop]
        rows = []
        while len(rows) < n:
            if self.index == len(self.dataset):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            rows.append(self.dataset[int(self._order[self.index])])
            self.index += 1
        return rows

    def peek(self, n: int) -> list[Mapping[str, Any]]:
        """The next ``n`` rows, without moving the position.

        Args:
            n: How many rows.

        Returns:
            The rows :meth:`take` would return.
        """
        saved = self.state()
        rows = self.take(n)
        self.restore(saved)
        return rows

    def state(self) -> dict[str, int]:
        """The position, JSON-able.

        Returns:
            ``{"epoch": ..., "index": ...}``.
        """
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: Mapping[str, int]) -> None:
        """Moves to a saved position.

        Args:
            state: What :meth:`state` returned.
        """
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = self._permutation(self.epoch)


def dataset_fingerprint(dataset: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The size and a content hash of a dataset (what a resumed run must train on).

    Each row is hashed as canonical JSON (sorted keys; values JSON cannot hold by ``repr``).

    Args:
        dataset: The rows.

    Returns:
        ``{"size": len(dataset), "sha256": hex digest}``.

    Examples:
        >>> from artifex.generative_models.training.rl.run.loop import dataset_fingerprint
        >>> rows = [{"prompt": "1+1=", "answer": "2"}]
        >>> fp = dataset_fingerprint(rows)
        >>> fp["size"], len(fp["sha256"]), fp == dataset_fingerprint([dict(r) for r in rows])
        (1, 64, True)
        >>> fp == dataset_fingerprint([{"prompt": "1+1=", "answer": "3"}])
        False
    """
    digest = hashlib.sha256()
    for row in dataset:
        text = json.dumps(row, sort_keys=True, default=repr, ensure_ascii=True)
        digest.update(text.encode("utf-8"))
        digest.update(b"\n")
    return {"size": len(dataset), "sha256": digest.hexdigest()}


def concat_batches(batches: Sequence[GRPOBatch]) -> GRPOBatch:
    """Concatenates batches row-wise, left-padding prompts to a common width.

    Recorded routed experts (``routed_experts``) are left-padded alike, with -1.

    Args:
        batches: Batches with the same completion width and the same optional fields.

    Returns:
        One batch (group size of the first).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl import GRPOBatch, concat_batches
        >>> def batch(prompt_width):
        ...     return GRPOBatch(prompt_ids=jnp.ones((2, prompt_width), jnp.int32),
        ...                      prompt_mask=jnp.ones((2, prompt_width), jnp.int32),
        ...                      completion_ids=jnp.ones((2, 3), jnp.int32),
        ...                      completion_mask=jnp.ones((2, 3)), rewards=jnp.zeros(2),
        ...                      group_size=2)
        >>> both = concat_batches([batch(2), batch(4)])
        >>> both.batch_size, both.prompt_ids.shape, both.prompt_mask[0].tolist()
        (4, (4, 4), [0, 0, 1, 1])
    """
    width = max(b.prompt_ids.shape[1] for b in batches)

    def left_pad(x: jax.Array | None, extra: int, fill: int = 0) -> jax.Array | None:
        if x is None or extra == 0:
            return x
        pad = [(0, 0), (extra, 0)] + [(0, 0)] * (x.ndim - 2)
        return jnp.pad(x, pad, constant_values=fill)

    padded = []
    for b in batches:
        extra = width - b.prompt_ids.shape[1]
        padded.append(
            b.replace(
                prompt_ids=left_pad(b.prompt_ids, extra),
                prompt_mask=left_pad(b.prompt_mask, extra),
                # (B, P + T, L, k): -1, no expert recorded, on the prompt padding
                routed_experts=left_pad(b.routed_experts, extra, -1),
            )
        )
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *padded)


def take_rows(batch: GRPOBatch, rows: np.ndarray) -> GRPOBatch:
    """Rows ``rows`` of every per-row field of ``batch`` (prompts then no longer shared).

    Args:
        batch: A batch.
        rows: Row indices, in the order wanted.

    Returns:
        The batch of those rows, with ``shared_prompts=False`` (shuffled rows cut groups).

    Examples:
        >>> import jax.numpy as jnp, numpy as np
        >>> from artifex.generative_models.training.rl import GRPOBatch
        >>> from artifex.generative_models.training.rl.run.data import take_rows
        >>> batch = GRPOBatch.zeros(2, 2, 3, 4).replace(rewards=jnp.arange(4.0))
        >>> take_rows(batch, np.array([3, 0])).rewards.tolist()
        [3.0, 0.0]
    """
    idx = jnp.asarray(rows)
    return jax.tree.map(lambda x: x[idx], batch).replace(shared_prompts=False)


@dataclasses.dataclass
class GenerationBatch:
    """A step's generation batch and the rollouts it was cut from.

    Attributes:
        batch: The batch the updates train on (``prompts_per_step`` groups).
        rollouts: The step's rollouts, the first first (one without dynamic sampling).
        groups: With dynamic sampling, ``(rollout, group)`` of each group of ``batch``, in
            order; ``None`` when ``batch`` is the first rollout's.
        info: The dynamic-sampling metrics (empty without it).

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.training.rl import GRPOBatch, Rollout
        >>> from artifex.generative_models.training.rl.run.data import GenerationBatch
        >>> batch = GRPOBatch.zeros(1, 2, prompt_length=4, completion_length=1)
        >>> ro = Rollout(batch, [{"prompt": "1+1="}], ["1+1="], ["2", "3"],
        ...              np.array([[1.0], [0.0]]), ["correct"], np.zeros(2, bool))
        >>> gen = GenerationBatch(batch=ro.batch, rollouts=[ro])  # one rollout, no resampling
        >>> gen.batch.batch_size, gen.groups, gen.info
        (2, None, {})
    """

    batch: GRPOBatch
    rollouts: list[Rollout]
    groups: list[tuple[int, int]] | None = None
    info: dict[str, float] = dataclasses.field(default_factory=dict)


def collect_generation_batch(
    rollout_fn: Callable[..., Rollout],
    policy: Policy,
    tokenizer: Any,
    data: DataIterator,
    rewards: RewardCombiner,
    rollout_config: RolloutConfig,
    *,
    prompts: int,
    key: jax.Array,
    need_old_log_probs: bool,
    dynamic_sampling: bool = False,
    max_resample_rounds: int = 0,
    placement: Any = None,
) -> GenerationBatch:
    """Rolls out the step's rows into its generation batch (the loop's first stage).

    Without dynamic sampling: one rollout of the next ``prompts`` rows (on a mesh spanning
    processes, each process rolls out its own share of them). With it (DAPO): groups whose
    rewards are all equal are dropped and further rows rolled out, up to
    ``max_resample_rounds`` more times, until ``prompts`` groups remain; if too few do,
    zero-variance groups fill the batch (their advantages are 0). The groups are then told
    apart by ``group_ids`` (the segment form of the advantage kernel).

    Args:
        rollout_fn: ``fn(policy, tokenizer, rows, rewards, config, *, key,
            need_old_log_probs[, placement])``, e.g.
            :func:`~artifex.generative_models.training.rl.rollouts.rollout.rollout`.
        policy: What samples.
        tokenizer: The tokenizer.
        data: The dataset order (advanced by the rows taken).
        rewards: The reward functions.
        rollout_config: Rollout settings.
        prompts: Prompts per step (``TrainConfig.prompts_per_step``).
        key: The step's key; rollout ``r`` samples with ``fold_in(key, r)``.
        need_old_log_probs: Passed to ``rollout_fn``.
        dynamic_sampling: Drop constant groups and refill.
        max_resample_rounds: Extra rollouts allowed to refill.
        placement: A rollout placement passed to ``rollout_fn`` (``None``: none).

    Returns:
        The :class:`GenerationBatch`.

    Examples:
        A scripted rollout stands in for the sampler (``rollout_fn=rollout`` samples from the
        policy): every group answers ``"2"`` and ``"4"``, so ``3+3=`` gets equal rewards.

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from artifex.generative_models.training.rl import (
        ...     DataIterator, GRPOBatch, GRPOConfig, Policy, RewardCombiner, Rollout,
        ...     RolloutConfig)
        >>> from artifex.generative_models.training.rl.run.data import collect_generation_batch
        >>> def scripted(policy, tokenizer, rows, rewards, config, *, key, need_old_log_probs):
        ...     prompts = [row["prompt"] for row in rows]
        ...     completions = ["2", "4"] * len(rows)
        ...     total, per_function = rewards([p for p in prompts for _ in (0, 1)], completions)
        ...     batch = GRPOBatch.zeros(len(rows), 2, 4, 1).replace(rewards=jnp.asarray(total))
        ...     return Rollout(batch, rows, prompts, completions, per_function,
        ...                    list(rewards.names), np.zeros(len(completions), bool))
        >>> def correct(prompts, completions, **columns):
        ...     return [float(int(c) == int(p[0]) + int(p[2]))
        ...             for p, c in zip(prompts, completions, strict=True)]
        >>> policy = Policy(None, GRPOConfig(num_generations=2))  # the script never samples
        >>> data = DataIterator([{"prompt": "3+3="}, {"prompt": "1+1="}], seed=0, shuffle=False)
        >>> gen = collect_generation_batch(
        ...     scripted, policy, None, data, RewardCombiner([correct]), RolloutConfig(),
        ...     prompts=1, key=jax.random.key(0), need_old_log_probs=False,
        ...     dynamic_sampling=True, max_resample_rounds=1)
        >>> len(gen.rollouts), gen.groups, gen.batch.rewards.tolist()  # 3+3= dropped
        (2, [(1, 0)], [1.0, 0.0])
        >>> gen.info["dynamic_sampling/kept_fraction"], data.state()
        (0.5, {'epoch': 0, 'index': 2})
    """
    g = policy.config.num_generations
    mesh = policy.mesh
    extra = {} if placement is None else {"placement": placement}

    def roll(rows: list[Mapping[str, Any]], r: int) -> Rollout:
        return rollout_fn(
            policy,
            tokenizer,
            rows,
            rewards,
            rollout_config,
            key=jax.random.fold_in(key, r),
            need_old_log_probs=need_old_log_probs,
            **extra,
        )

    part = process_row_range(prompts, mesh) if spans_processes(mesh) else None
    first = roll(data.take(prompts, part=part), 0)
    if not dynamic_sampling:
        return GenerationBatch(batch=first.batch, rollouts=[first])
    kept: list[tuple[int, int]] = []
    dropped: list[tuple[int, int]] = []
    rollouts = [first]
    total_groups = 0
    for round_ in range(max_resample_rounds + 1):
        if round_ > 0:
            if len(kept) >= prompts:
                break
            rollouts.append(roll(data.take(prompts), round_))
        good = np.asarray(
            nonconstant_groups(jnp.asarray(host_array(rollouts[-1].batch.rewards)), g)
        )
        total_groups += good.size
        for i, ok in enumerate(good):
            (kept if ok else dropped).append((len(rollouts) - 1, i))
    groups = (kept + dropped)[:prompts]
    batch = concat_batches(
        [take_rows(rollouts[r].batch, np.arange(i * g, (i + 1) * g)) for r, i in groups]
    )
    batch = batch.replace(group_ids=jnp.repeat(jnp.arange(prompts, dtype=jnp.int32), g))
    info = {
        "dynamic_sampling/rounds": float(len(rollouts)),
        "dynamic_sampling/kept_fraction": float(len(kept) / max(total_groups, 1)),
        "dynamic_sampling/zero_std_filled": float(max(prompts - len(kept), 0)),
    }
    return GenerationBatch(batch=batch, rollouts=rollouts, groups=groups, info=info)
