"""The GRPO batch: a registered pytree with its shape contract.

Row ``i`` of every per-sample array belongs to prompt ``i // G``, generation ``i % G``
(prompt-major, generation-minor); ``B = num_prompts * G``. The group size is static pytree
metadata, so a jitted step specializes on it.

For a causal language model a row is a left-padded prompt followed by a right-padded completion::

    prompt_ids       [pad pad  p1  p2  p3]   prompt_mask     [0 0 1 1 1]
    completion_ids   [c1  c2  c3 EOS pad ]   completion_mask [1 1 1 1 0]

The completion mask is 1 exactly on the completion tokens that count (EOS included; padding and
anything after EOS excluded). For a non-sequence policy ``model(observations) -> logits`` (the
dict batch form), ``prompt_ids`` holds the observations and each action is a completion of
length 1 (see :meth:`GRPOBatch.from_dict` and
:mod:`~artifex.generative_models.training.rl.core.compat`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.training.rl.core.compat import dict_batch_fields
from artifex.generative_models.utils.validation import check_int

__all__ = ["GRPOBatch"]

#: Log-probs above this are rejected (float rounding can push a near-certain token above 0).
_LOG_PROB_TOLERANCE = 1e-3


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _host_values(x: Any) -> np.ndarray | None:
    """Host copy of ``x`` when every shard is addressable here (else ``None``: skip checks)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return np.asarray(x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GRPOBatch:
    """A batch of grouped completions for one GRPO update.

    Attributes:
        prompt_ids: ``(B, P)`` int token ids of the left-padded prompts; for a non-sequence
            policy, the observations ``(B, ...)`` passed to ``model(observations)``.
        completion_ids: ``(B, T)`` int token ids of the completions (right-padded), or actions.
        completion_mask: ``(B, T)`` 1 on completion tokens that count (EOS included).
        rewards: ``(B,)`` float rewards; NaN means "no reward for this sample" (left out of the
            group statistics, advantage 0).
        prompt_mask: ``(B, P)`` 1 on real prompt tokens, 0 on left padding; ``None`` for a
            non-sequence policy or unpadded prompts.
        old_log_probs: ``(B, T)`` log-probs of the completion tokens under the policy that
            sampled them; ``None`` means on-policy (ratio 1).
        ref_log_probs: ``(B, T)`` log-probs under the reference policy, for the KL penalty.
        advantages: Precomputed ``(B,)`` or ``(B, T)`` advantages; when given, the loss uses
            them instead of normalizing ``rewards`` (which are still reported).
        step_rewards: ``(B, T)`` per-step rewards for process supervision (NaN where no step
            ends); when given (and ``advantages`` is not), token advantages come from
            :func:`~artifex.generative_models.training.rl.core.advantages.process_advantages`.
        group_ids: ``(B,)`` int group index per row, for groups of different sizes; then ``B``
            need not be a multiple of ``group_size``.
        sampler_log_probs: ``(B, T)`` log-probs of the completion tokens as the sampler
            reported them, for the sampler/trainer mismatch correction
            (``GRPOConfig.sampler_correction``) and the off-policy sequence mask; NaN marks a
            token the sampler could not score. ``None``: no correction.
        teacher_log_probs: ``(B, T)`` a distillation teacher's log-probs of the tokens
            (``"reverse_kl"``); ``None``: the update runs its ``teacher_model``.
        conditioning: Further inputs of a non-token policy's log-prob function, a pytree of
            ``(B, ...)`` arrays (its static metadata included): a flow model's prompts and
            sampler settings (``FlowConditioning``, see
            :mod:`~artifex.generative_models.flow.batch`). ``None`` for language
            models.
        routed_experts: ``(B, P + T, L, k)`` routed experts of a mixture-of-experts rollout,
            for routing replay.
        group_size: Static group size ``G`` (pytree metadata).
        shared_prompts: Static flag: the ``G`` rows of each group have the same prompt (as in
            every GRPO rollout), so a causal LM can encode each prompt once for its group.
            :meth:`validate` checks it against the data; ``GRPOTrainer.prepare_batch`` sets it
            when it finds the prompts shared.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training import GRPOBatch
        >>> batch = GRPOBatch(
        ...     prompt_ids=jnp.array([[5, 6], [5, 6]]),
        ...     completion_ids=jnp.array([[1, 2, 0], [3, 0, 0]]),
        ...     completion_mask=jnp.array([[1, 1, 0], [1, 0, 0]]),
        ...     rewards=jnp.array([1.0, 0.0]),
        ...     group_size=2,
        ... ).validate()
        >>> batch.batch_size, batch.num_groups, batch.completion_length
        (2, 1, 3)
        >>> batch.prompts_shared_within_groups()
        True
    """

    prompt_ids: jax.Array
    completion_ids: jax.Array
    completion_mask: jax.Array
    rewards: jax.Array
    prompt_mask: jax.Array | None = None
    old_log_probs: jax.Array | None = None
    ref_log_probs: jax.Array | None = None
    advantages: jax.Array | None = None
    step_rewards: jax.Array | None = None
    group_ids: jax.Array | None = None
    sampler_log_probs: jax.Array | None = None
    teacher_log_probs: jax.Array | None = None
    conditioning: Any = None
    routed_experts: jax.Array | None = None
    group_size: int = dataclasses.field(default=4, metadata=dict(static=True))
    shared_prompts: bool = dataclasses.field(default=False, metadata=dict(static=True))

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> int:
        """Number of rows ``B``."""
        return int(_shape(self.rewards)[0])

    @property
    def num_groups(self) -> int:
        """Number of prompts ``B // G`` (fixed-size groups)."""
        return self.batch_size // self.group_size

    @property
    def completion_length(self) -> int:
        """Padded completion width ``T``."""
        return int(_shape(self.completion_ids)[1])

    def replace(self, **changes: Any) -> GRPOBatch:
        """Returns a copy with ``changes`` applied.

        Args:
            **changes: Field names and new values.

        Returns:
            A new ``GRPOBatch``.
        """
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ validation
    def prompts_shared_within_groups(self) -> bool | None:
        """Whether each group's rows have identical prompts (ids and mask).

        Returns:
            The answer, or ``None`` when the arrays are not all addressable from this process
            or groups are given by ``group_ids``.
        """
        if self.group_ids is not None or self.batch_size % self.group_size:
            return None
        ids = _host_values(self.prompt_ids)
        mask = None if self.prompt_mask is None else _host_values(self.prompt_mask)
        if ids is None or (self.prompt_mask is not None and mask is None):
            return None
        g = self.group_size
        groups = ids.reshape(-1, g, *ids.shape[1:])
        same = bool((groups == groups[:, :1]).all())
        if mask is not None:
            m = mask.reshape(-1, g, *mask.shape[1:])
            same = same and bool((m == m[:, :1]).all())
        return same

    def validate(self, *, check_values: bool = True) -> GRPOBatch:
        """Checks the shape contract on the host, before anything is traced.

        Args:
            check_values: Also check values that need a host copy: rewards not infinite,
                masks 0/1, log-probs finite on valid tokens, group ids in range. Skipped for
                arrays not fully addressable from this process.

        Returns:
            ``self``, for chaining.

        Raises:
            ValueError: A field has the wrong rank, rows or length, the batch size is not a
                multiple of the group size, or a value is invalid (e.g. an infinite reward).
            TypeError: A field has the wrong dtype kind.
        """
        g = check_int("GRPOBatch.group_size", self.group_size, minimum=1)
        rshape = _shape(self.rewards)
        if len(rshape) != 1:
            msg = f"GRPOBatch.rewards must have shape (B,), got {rshape}"
            raise ValueError(msg)
        b = rshape[0]
        if b == 0:
            msg = "GRPOBatch.rewards is empty: a batch needs at least one group"
            raise ValueError(msg)
        if self.group_ids is None and b % g:
            msg = (
                f"GRPOBatch has {b} rows, which is not a multiple of its group size {g}: "
                f"a batch holds num_prompts * group_size rows, prompt-major "
                f"({b} = {b // g} * {g} + {b % g})"
            )
            raise ValueError(msg)
        cshape = _shape(self.completion_ids)
        if len(cshape) != 2:
            msg = f"GRPOBatch.completion_ids must have shape (B, T), got {cshape}"
            raise ValueError(msg)
        if cshape[1] < 1:
            msg = f"GRPOBatch.completion_ids must have at least one column, got shape {cshape}"
            raise ValueError(msg)
        if not jnp.issubdtype(jnp.result_type(self.completion_ids), jnp.integer):
            msg = (
                "GRPOBatch.completion_ids must hold integer token ids, "
                f"got dtype {jnp.result_type(self.completion_ids)}"
            )
            raise TypeError(msg)
        t = cshape[1]
        expect = {
            "completion_ids": (b, t),
            "completion_mask": (b, t),
            "old_log_probs": (b, t),
            "ref_log_probs": (b, t),
            "step_rewards": (b, t),
            "group_ids": (b,),
            "sampler_log_probs": (b, t),
            "teacher_log_probs": (b, t),
        }
        for name, want in expect.items():
            value = getattr(self, name)
            if value is not None and _shape(value) != want:
                msg = (
                    f"GRPOBatch.{name} must have shape {want} (B={b} rows, T={t} completion "
                    f"tokens), got {_shape(value)}"
                )
                raise ValueError(msg)
        pshape = _shape(self.prompt_ids)
        if len(pshape) < 1 or pshape[0] != b:
            msg = f"GRPOBatch.prompt_ids must have {b} rows (B, ...), got shape {pshape}"
            raise ValueError(msg)
        if self.prompt_mask is not None and _shape(self.prompt_mask) != pshape[:2]:
            msg = (
                f"GRPOBatch.prompt_mask must have the shape of prompt_ids {pshape[:2]}, "
                f"got {_shape(self.prompt_mask)}"
            )
            raise ValueError(msg)
        for leaf in jax.tree.leaves(self.conditioning):
            if len(_shape(leaf)) < 1 or _shape(leaf)[0] != b:
                msg = f"GRPOBatch.conditioning arrays must have {b} rows, got shape {_shape(leaf)}"
                raise ValueError(msg)
        if self.routed_experts is not None:
            rshape, width = _shape(self.routed_experts), pshape[1] + t if len(pshape) > 1 else t
            if len(rshape) != 4 or rshape[:2] != (b, width):
                msg = (
                    f"GRPOBatch.routed_experts must have shape (B, P + T, L, k) = ({b}, {width}, "
                    f"L, k), got {rshape}"
                )
                raise ValueError(msg)
            if not jnp.issubdtype(jnp.result_type(self.routed_experts), jnp.integer):
                msg = (
                    "GRPOBatch.routed_experts must hold integer expert ids, got dtype "
                    f"{jnp.result_type(self.routed_experts)}"
                )
                raise TypeError(msg)
        if self.advantages is not None and _shape(self.advantages) not in ((b,), (b, t)):
            msg = (
                f"GRPOBatch.advantages must have shape ({b},) or ({b}, {t}), "
                f"got {_shape(self.advantages)}"
            )
            raise ValueError(msg)
        if self.shared_prompts:
            if self.group_ids is not None:
                msg = "GRPOBatch.shared_prompts requires fixed-size groups (no group_ids)"
                raise ValueError(msg)
            if check_values and self.prompts_shared_within_groups() is False:
                msg = (
                    "GRPOBatch.shared_prompts is True but the rows of some group have different "
                    "prompt_ids or prompt_mask"
                )
                raise ValueError(msg)
        if check_values:
            self._check_values(b)
        return self

    def _check_values(self, b: int) -> None:
        rewards = _host_values(self.rewards)
        if rewards is not None:
            if not np.issubdtype(rewards.dtype, np.floating):
                rewards = rewards.astype(np.float32)
            bad = np.flatnonzero(np.isinf(rewards))
            if bad.size:
                msg = (
                    f"GRPOBatch.rewards must be finite or NaN (NaN = no reward), got "
                    f"{rewards[bad[0]]} at row {bad[0]} ({bad.size} infinite in all)"
                )
                raise ValueError(msg)
        for name in ("completion_mask", "prompt_mask"):
            value = getattr(self, name)
            host = None if value is None else _host_values(value)
            if host is not None and not ((host == 0) | (host == 1)).all():
                msg = f"GRPOBatch.{name} must hold only 0 and 1, got values {np.unique(host)[:8]}"
                raise ValueError(msg)
        mask = _host_values(self.completion_mask)
        # Log-probs of discrete tokens are <= 0; densities of continuous actions (float states
        # in ``prompt_ids``, e.g. Flow-GRPO's Gaussian transitions) may be positive.
        discrete = np.issubdtype(np.dtype(self.prompt_ids.dtype), np.integer)
        for name in ("old_log_probs", "ref_log_probs", "teacher_log_probs", "advantages"):
            value = getattr(self, name)
            host = None if value is None else _host_values(value)
            if host is None or mask is None:
                continue
            valid = mask.astype(bool) if host.ndim == 2 else np.ones(host.shape, bool)
            bad = ~np.isfinite(host) & valid
            if bad.any():
                row = int(np.argwhere(bad)[0][0])
                msg = f"GRPOBatch.{name} must be finite on valid tokens; row {row} is not"
                raise ValueError(msg)
            if name != "advantages" and discrete:
                positive = (host > _LOG_PROB_TOLERANCE) & valid
                if positive.any():
                    where = tuple(int(i) for i in np.argwhere(positive)[0])
                    msg = (
                        f"GRPOBatch.{name} must be log-probabilities (<= 0), got "
                        f"{float(host[where])} at {where}: pass log-probs, not probabilities "
                        "or logits"
                    )
                    raise ValueError(msg)
        if self.sampler_log_probs is not None:
            host = _host_values(self.sampler_log_probs)
            if host is not None and mask is not None and np.isinf(host[mask.astype(bool)]).any():
                msg = "GRPOBatch.sampler_log_probs must be finite or NaN on valid tokens"
                raise ValueError(msg)
            if host is not None and mask is not None and discrete:
                positive = (host > _LOG_PROB_TOLERANCE) & mask.astype(bool)
                if positive.any():
                    where = tuple(int(i) for i in np.argwhere(positive)[0])
                    msg = (
                        "GRPOBatch.sampler_log_probs must be log-probabilities (<= 0), got "
                        f"{float(host[where])} at {where}"
                    )
                    raise ValueError(msg)
        if self.step_rewards is not None:
            host = _host_values(self.step_rewards)
            if host is not None and np.isinf(host).any():
                msg = "GRPOBatch.step_rewards must be finite or NaN (NaN = no step ends here)"
                raise ValueError(msg)
        if self.group_ids is not None:
            host = _host_values(self.group_ids)
            if host is not None and (host.min() < 0 or host.max() >= b):
                msg = f"GRPOBatch.group_ids must lie in [0, {b}), got [{host.min()}, {host.max()}]"
                raise ValueError(msg)
            if host is not None and self.step_rewards is not None and self.advantages is None:
                g = self.group_size
                blocks = host.reshape(-1, g) if b % g == 0 else None
                contiguous = blocks is not None and bool((blocks == blocks[:, :1]).all())
                if not contiguous or len(set(blocks[:, 0].tolist())) != len(blocks):
                    msg = (
                        "GRPOBatch.step_rewards are normalized over blocks of group_size="
                        f"{g} consecutive rows (process_advantages): group_ids must describe "
                        "such groups, got groups of other sizes or order"
                    )
                    raise ValueError(msg)

    @classmethod
    def zeros(
        cls, num_prompts: int, group_size: int, prompt_length: int, completion_length: int
    ) -> GRPOBatch:
        """A batch of zeros in the sampler's layout: the shape of GRPO batches to come.

        ``num_prompts * group_size`` rows, each prompt repeated ``group_size`` times and marked
        so (``shared_prompts=True``: the prompts are encoded once per group), full masks, int32
        ids, float32 rewards: what
        :meth:`~artifex.generative_models.training.rl.update.trainer.GRPOTrainer.compile_ahead`
        needs to
        compile the update for the sampler's batches before the first one exists. Pass the
        prompt width the sampler pads to
        (:func:`~artifex.generative_models.inference.batch_layout.bucket_length`).

        Args:
            num_prompts: Prompts per batch.
            group_size: Completions per prompt.
            prompt_length: Prompt width (after padding).
            completion_length: Completion width (``max_new_tokens``).

        Returns:
            The batch.

        Raises:
            ValueError: A size < 1.
            TypeError: A size that is not an int.

        Examples:
            >>> from artifex.generative_models.training import GRPOBatch
            >>> batch = GRPOBatch.zeros(2, 4, prompt_length=16, completion_length=8)
            >>> batch.prompt_ids.shape, batch.completion_mask.shape, batch.group_size
            ((8, 16), (8, 8), 4)
            >>> batch.shared_prompts
            True
        """
        for name, value in (
            ("num_prompts", num_prompts),
            ("group_size", group_size),
            ("prompt_length", prompt_length),
            ("completion_length", completion_length),
        ):
            check_int(f"GRPOBatch.zeros {name}", value, minimum=1)
        rows = num_prompts * group_size
        return cls(
            prompt_ids=jnp.zeros((rows, prompt_length), jnp.int32),
            prompt_mask=jnp.ones((rows, prompt_length), jnp.int32),
            completion_ids=jnp.zeros((rows, completion_length), jnp.int32),
            completion_mask=jnp.ones((rows, completion_length), jnp.int32),
            rewards=jnp.zeros((rows,), jnp.float32),
            group_size=group_size,
            shared_prompts=True,
        )

    # ------------------------------------------------------------------ conversions
    @classmethod
    def from_dict(cls, batch: Mapping[str, Any], *, group_size: int) -> GRPOBatch:
        """Converts the generic dict batch form into a ``GRPOBatch``.

        Keys: ``observations`` ``(B, ...)``, ``actions`` ``(B,)`` or ``(B, L)`` ints,
        ``rewards`` ``(B,)``, optional ``log_probs`` and ``ref_log_probs`` with the shape of
        ``actions``, optional ``advantages`` ``(B,)``, optional ``group_size`` overriding the
        given default. A single-step categorical action is a completion of length 1. The
        conversion itself is
        :func:`~artifex.generative_models.training.rl.core.compat.dict_batch_fields`.

        Args:
            batch: The dict.
            group_size: Group size used when the dict carries none (the config's).

        Returns:
            The equivalent ``GRPOBatch`` (not yet validated).

        Raises:
            ValueError: Unknown or missing keys, or shapes that do not fit.
            TypeError: Non-integer actions.
        """
        return cls(**dict_batch_fields(batch, group_size=group_size))
