"""The batches of a :class:`GRPOTrainer`: checked, placed, packed, scored and sliced.

``TrainerBatches``, a base class of
:class:`~artifex.generative_models.training.rl.update.trainer.GRPOTrainer`, holds the trainer's
methods that take a batch before its update: host validation (``prepare_batch``), placement on
the trainer's mesh or device (``place_batch``), the old and reference log-probs
(``fill_log_probs``, ``compute_log_probs``, and ``policy``, the rollout's view of the trainer
whose ``score`` fills them), packing (``maybe_pack``) and the number of microbatches an update
runs in by default (``auto_microbatches``). They read the attributes ``GRPOTrainer.__init__``
sets.

Moved out of :mod:`~artifex.generative_models.training.rl.update.trainer` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.objective import as_grpo_batch
from artifex.generative_models.training.rl.core.packing import pack_batch, should_pack
from artifex.generative_models.training.rl.core.policy import Policy
from artifex.generative_models.training.rl.update.microbatches import auto_num_microbatches
from artifex.generative_models.training.rl.update.trainer_setup import (
    _check_token_range,
    _vocab_size,
    check_routed_batch,
)
from artifex.generative_models.training.sharding import num_data_shards, shard_batch

__all__ = ["TrainerBatches"]


class TrainerBatches:
    """The batch methods of ``GRPOTrainer`` (a base class of it).

    The methods are documented here and available on every
    :class:`~artifex.generative_models.training.rl.update.trainer.GRPOTrainer`.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.rl.update.trainer import GRPOTrainer
        >>> from artifex.generative_models.training.rl.update.trainer_batches import TrainerBatches
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2, beta=0.0))
        >>> batch = trainer.prepare_batch({"observations": jnp.ones((2, 4)),
        ...     "actions": jnp.array([0, 2]), "rewards": jnp.array([1.0, 0.0])})
        >>> isinstance(trainer, TrainerBatches), batch.group_size
        (True, 2)
    """

    def policy(self) -> Policy:
        """The rollout stage's view of this trainer: model, config, mesh and scorer.

        Returns:
            A :class:`~artifex.generative_models.training.rl.core.policy.Policy` whose
            ``score`` fills old and reference log-probs of library-built batches (no host
            validation).

        Examples:
            >>> import optax
            >>> from flax import nnx
            >>> from artifex.generative_models.training import GRPOTrainer
            >>> from artifex.generative_models.training.rl import GRPOConfig
            >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=4))
            >>> policy = trainer.policy()
            >>> policy.model is model, policy.config.num_generations, policy.mesh is None
            (True, 4, True)
        """
        return Policy(model=self.model, config=self.config, mesh=self.mesh, score=self._score)

    def place_batch(self, batch: GRPOBatch) -> GRPOBatch:
        """A library-built batch placed on the trainer's mesh (no validation, no host copy).

        Args:
            batch: A :class:`GRPOBatch` of arrays.

        Returns:
            The batch with its rows split over the mesh's data axes; without a mesh, on the
            device the parameters are committed to (restored or ``device_put`` weights), or
            the batch itself when they are not committed. Either way every batch the library
            builds is placed alike, so a compiled step (and one compiled ahead for a zero
            example) serves them all.
        """
        if self.mesh is not None:
            return shard_batch(batch, self.mesh)
        # Metadata only: inside the loop's updates these buffers may already be donated.
        leaf = jax.tree.leaves(self.state.params)[:1]
        if not leaf or not isinstance(leaf[0], jax.Array) or not leaf[0].committed:
            return batch
        devices = leaf[0].sharding.device_set
        if len(devices) != 1:  # parameters spread over devices without a mesh: leave it be
            return batch
        return jax.device_put(batch, next(iter(devices)))

    def _score(self, batch: GRPOBatch) -> GRPOBatch:
        """:meth:`fill_log_probs` of the placed batch (``Policy.score`` for custom loops)."""
        return self.fill_log_probs(self.place_batch(batch))

    def fill_log_probs(self, batch: GRPOBatch) -> GRPOBatch:
        """Fills the missing old and reference log-probs of a prepared, placed batch.

        What :meth:`compute_log_probs` does after its host checks: ``old_log_probs`` (the
        current policy, scored by the training graph) when the batch has none, and
        ``ref_log_probs`` when it has none, ``beta > 0`` and the trainer has a reference. One
        compiled forward pass, no gradient, no host copy. The training loop calls it as its own
        stage, after the rollout and before the updates on the batch, when several updates
        share the batch (``mu > 1`` or several minibatches).

        Args:
            batch: A :class:`GRPOBatch` built by the library or :meth:`prepare_batch`, on the
                trainer's mesh (:meth:`place_batch`).

        Returns:
            The batch with those fields set (fields it had are kept).

        Examples:
            >>> import jax.numpy as jnp, optax
            >>> from flax import nnx
            >>> from artifex.generative_models.training import GRPOTrainer
            >>> from artifex.generative_models.training.rl import GRPOConfig
            >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2, beta=0.0))
            >>> batch = trainer.prepare_batch({"observations": jnp.ones((2, 4)),
            ...     "actions": jnp.array([0, 2]), "rewards": jnp.array([1.0, 0.0])})
            >>> trainer.fill_log_probs(batch).old_log_probs.shape
            (2, 1)
        """
        log_probs, ref_log_probs = self._log_probs_fn(self.state, batch)
        if batch.old_log_probs is None:
            batch = batch.replace(old_log_probs=log_probs)
        if batch.ref_log_probs is None and ref_log_probs is not None:
            batch = batch.replace(ref_log_probs=ref_log_probs)
        return batch

    def prepare_batch(self, batch: GRPOBatch | Mapping[str, Any]) -> GRPOBatch:
        """Converts and validates a batch on the host (what ``train_step`` does first).

        Args:
            batch: A :class:`GRPOBatch` or the dict batch form.

        Returns:
            The validated ``GRPOBatch`` of JAX arrays (with a mesh: rows split over its data
            axes by :func:`~artifex.generative_models.training.sharding.shard_batch`).

        Raises:
            ValueError: The batch breaks its contract (see :meth:`GRPOBatch.validate`), its
                group size is < 2 without precomputed advantages, or (with a mesh) its rows
                cannot be split evenly over the data shards.
            TypeError: Wrong batch type or dtypes.
        """
        batch = as_grpo_batch(batch, self.config).validate()
        _check_token_range(batch, _vocab_size(self.model))
        check_routed_batch(batch, self.config, moe=self._moe_log_probs)
        if not batch.shared_prompts and batch.prompts_shared_within_groups():
            batch = batch.replace(shared_prompts=True)  # encode each prompt once per group
        if batch.group_size < 2 and batch.advantages is None and batch.group_ids is None:
            msg = f"batch group_size must be >= 2 to compare completions, got {batch.group_size}"
            raise ValueError(msg)
        return self.place_batch(batch)

    def compute_log_probs(self, batch: GRPOBatch | Mapping[str, Any]) -> GRPOBatch:
        """Fills ``old_log_probs`` (current policy) and ``ref_log_probs`` (reference) of a batch.

        Used before ``mu > 1`` optimization iterations on one generation batch: the old
        log-probs are those of the policy that sampled the batch, scored by the training graph,
        and the reference log-probs are computed once instead of at every iteration. Fields the
        batch already has are kept; the reference is only scored when ``beta > 0`` and the
        trainer has one.

        Args:
            batch: The batch.

        Returns:
            The batch with the log-prob fields set (no gradient, one compiled forward pass).

        Examples:
            >>> import jax, jax.numpy as jnp, optax
            >>> from flax import nnx
            >>> from artifex.generative_models.training import GRPOTrainer
            >>> from artifex.generative_models.training.rl import GRPOConfig
            >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=4, beta=0.0))
            >>> actions = jnp.array([0, 1, 2, 0])
            >>> scored = trainer.compute_log_probs({"observations": jnp.ones((4, 4)),
            ...     "actions": actions, "rewards": jnp.array([1.0, 0, 0, 1.0])})
            >>> expected = jax.nn.log_softmax(model(jnp.ones(4)))[actions]  # log p(action)
            >>> scored.old_log_probs.shape, bool(jnp.allclose(scored.old_log_probs[:, 0], expected))
            ((4, 1), True)
        """
        return self._score(self.prepare_batch(batch))

    def auto_microbatches(self, batch: GRPOBatch) -> int:
        """The microbatches an update of ``batch`` runs in when ``num_microbatches`` is not given.

        For a causal LM with float32 trainable parameters on one CPU device (no mesh):
        :func:`auto_num_microbatches` of the batch's shape, the most slices of whole prompt groups
        of at least
        :data:`~artifex.generative_models.training.rl.update.microbatches.MIN_MICROBATCH_TOKENS`
        token positions each. The update is the same (advantages and the loss normalizer come from
        the whole batch); its temporaries, mapped anew by XLA:CPU at every run, are smaller. 1
        otherwise: on an accelerator (a pooled allocator and larger matrix products), on a mesh, for
        a model that is not a causal LM, with a custom ``log_prob_fn`` (it may not treat rows
        independently), with lower-precision parameters (the slices' gradients would be summed in
        that precision), with ``layerwise_update`` (already one layer at a time), with
        ``top_entropy_quantile < 1`` (a further forward pass per slice), for groups of different
        sizes (``group_ids``) and for rows that are not whole groups. The parameters' device and
        dtype are read once, at the first call.

        Args:
            batch: A :class:`GRPOBatch` (only its shapes and static fields are read; a
                ``jax.eval_shape`` of one will do).

        Returns:
            The number of microbatches, >= 1, dividing the batch's rows.

        Examples:
            >>> import optax
            >>> from flax import nnx
            >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
            >>> from artifex.generative_models.training import GRPOTrainer
            >>> from artifex.generative_models.training.rl import GRPOBatch, GRPOConfig
            >>> cfg = CausalLMConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
            ...                      num_layers=1, num_heads=2)
            >>> model = CausalLM(cfg, rngs=nnx.Rngs(0))
            >>> trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
            ...                       GRPOConfig(num_generations=4, beta=0.0))
            >>> batch = trainer.prepare_batch(GRPOBatch.zeros(8, 4, 32, 96))  # 32 rows
            >>> batch.shared_prompts, trainer.auto_microbatches(batch)  # on the CPU
            (True, 4)
        """
        if self._auto_eligible is None:
            leaves = [x for x in jax.tree.leaves(self.params) if hasattr(x, "dtype")]
            platforms = {d.platform for x in leaves[:1] for d in x.devices()}
            self._auto_eligible = (
                bool(leaves)
                and platforms == {"cpu"}
                and self.mesh is None
                and _vocab_size(self.model) is not None
                and not self._custom_log_prob_fn
                and all(
                    x.dtype == jnp.float32 for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)
                )
            )
        if (
            not self._auto_eligible
            or self.config.layerwise_update
            or self.config.top_entropy_quantile < 1.0
            or batch.group_ids is not None
            or len(batch.prompt_ids.shape) != 2
            or len(batch.completion_ids.shape) != 2
            or batch.batch_size % batch.group_size
        ):
            return 1
        return auto_num_microbatches(
            batch.batch_size,
            batch.group_size,
            int(batch.prompt_ids.shape[1]),
            int(batch.completion_ids.shape[1]),
            shared_prompts=batch.shared_prompts,
        )

    def maybe_pack(self, batch: GRPOBatch, num_microbatches: int = 1) -> GRPOBatch:
        """``batch`` packed (``pack_batch``) where ``packing_threshold`` says it pays, else as is.

        Packs when the threshold is set, the trainer runs its own causal-LM log-probs (not a
        custom ``log_prob_fn``, not ``layerwise_update``, not those of a mixture-of-experts
        policy) and more than that fraction of the batch's positions is padding
        (``should_pack``). Reads the masks on the host; the packed batch is placed as
        :meth:`place_batch` places batches. The update's value is the padded batch's, up to
        rounding; it compiles once per row bucket.

        Args:
            batch: A prepared batch.
            num_microbatches: The update's microbatches (each slice is packed on its own).

        Returns:
            A :class:`~artifex.generative_models.training.rl.core.packing.PackedGRPOBatch`, or
            ``batch``.
        """
        if (
            self.packing_threshold is None
            or self._custom_log_prob_fn
            or self._moe_log_probs  # routing replay reads the padded rows
            or self.config.layerwise_update
            or (
                self.config.distillation_coeff > 0.0
                and self.config.distillation_divergence != "reverse_kl"
            )
            or not callable(getattr(self.model, "packed_hidden_states", None))
            or not should_pack(batch, self.packing_threshold)
        ):
            return batch
        shards = 1 if self.mesh is None else num_data_shards(self.mesh)
        return self.place_batch(
            pack_batch(batch, num_microbatches=num_microbatches, row_multiple=shards)
        )
