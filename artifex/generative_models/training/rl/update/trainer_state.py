"""The train state of a :class:`GRPOTrainer`: read it, write it back, checkpoint it, seed it.

``TrainerStateIO``, a base class of
:class:`~artifex.generative_models.training.rl.update.trainer.GRPOTrainer`, holds the trainer's
methods that move its
:class:`~artifex.generative_models.training.rl.update.train_state.GRPOTrainState` in and out of its
``nnx`` model and optimizer: the ``state`` property, ``load_state`` and ``store_update``, the
part of the state a checkpoint holds (``checkpoint_state``, ``load_checkpoint_state``), the
run's PRNG key (``seed_rng``) and the reference sync after an update
(``maybe_sync_reference``). They read the attributes ``GRPOTrainer.__init__`` sets.

Moved out of :mod:`~artifex.generative_models.training.rl.update.trainer` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.training.rl.update.ref_sync import (
    reference_sync_due,
    sync_reference,
)
from artifex.generative_models.training.rl.update.train_state import (
    GRPOTrainState,
    init_train_state,
    write_train_state,
)
from artifex.generative_models.training.rl.update.trainer_setup import (
    _replicated_key,
    _uncommitted_key,
)

__all__ = ["TrainerStateIO"]


class TrainerStateIO:
    """The train-state methods of ``GRPOTrainer`` (a base class of it).

    The methods are documented here and available on every
    :class:`~artifex.generative_models.training.rl.update.trainer.GRPOTrainer`.

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl.update.trainer import GRPOTrainer
        >>> from artifex.generative_models.training.rl.update.trainer_state import TrainerStateIO
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
        >>> isinstance(trainer, TrainerStateIO), int(trainer.checkpoint_state().step)
        (True, 0)
    """

    @property
    def state(self) -> GRPOTrainState:
        """The train state of the model, optimizer, reference and ``rng`` (their own arrays).

        A :class:`~artifex.generative_models.training.rl.update.train_state.GRPOTrainState`, not a
        copy: the compiled step reuses its buffers for its outputs (they are donated to XLA).

        Examples:
            >>> import optax
            >>> from flax import nnx
            >>> from artifex.generative_models.training import GRPOTrainer
            >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            >>> trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
            >>> state = trainer.state
            >>> int(state.step), sorted(state.params), state.reference is None
            (0, ['bias', 'kernel'], True)
        """
        rng = self.rng
        if self.mesh is not None:  # every leaf of the state on the mesh (one device set)
            if self._placed_rng is None or self._placed_rng[0] is not rng:
                self._placed_rng = (rng, _replicated_key(rng, self.mesh))
            rng = self._placed_rng[1]
        state = init_train_state(self.model, self.optimizer, rng=rng)
        state = state.replace(teacher=self._teacher_state)
        return (
            state
            if self._reference_state is None
            else state.replace(reference=self._reference_state)
        )

    def load_state(self, state: GRPOTrainState) -> None:
        """Writes a train state back into the model, optimizer, reference and ``rng``.

        Args:
            state: A state of this trainer's model (e.g. from the pure step in a user's loop).
        """
        write_train_state(state, self.model, self.optimizer, self.reference_model)
        if self.reference_model is not None:
            self._reference_state = nnx.as_pure(nnx.state(self.reference_model))
        self.rng = _uncommitted_key(state.rng)

    def seed_rng(self, seed: int | jax.Array) -> None:
        """Sets the run's PRNG key (``state.rng``): ``jax.random.key(seed)``, or a key as given.

        The training loop seeds it from ``TrainConfig.seed`` before a run (a resumed run then
        loads the checkpoint's, which is the same key); step ``k`` samples with
        ``fold_in(rng, k)``.

        Args:
            seed: An int seed, or a typed PRNG key (``jax.random.key``).

        Raises:
            TypeError: ``seed`` is neither an int nor a typed PRNG key.

        Examples:
            >>> import jax, optax
            >>> from flax import nnx
            >>> from artifex.generative_models.training import GRPOTrainer
            >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            >>> trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
            >>> trainer.seed_rng(7)
            >>> bool((jax.random.key_data(trainer.state.rng) ==
            ...       jax.random.key_data(jax.random.key(7))).all())
            True
        """
        if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
            self.rng = seed
            return
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
            msg = f"seed_rng: seed must be an int or a typed PRNG key, got {seed!r}"
            raise TypeError(msg)
        self.rng = jax.random.key(int(seed))

    def checkpoint_state(self) -> GRPOTrainState:
        """The part of the train state a checkpoint holds: everything but reference and teacher.

        Returns:
            ``self.state`` with ``reference=None`` and ``teacher=None`` (frozen models are
            rebuilt, not saved);
            with ``GRPOConfig.sync_ref_model`` the reference too (it changes in training).

        Examples:
            >>> import optax
            >>> from flax import nnx
            >>> from artifex.generative_models.training import GRPOTrainer
            >>> from artifex.generative_models.training.rl import GRPOConfig
            >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(beta=0.04),
            ...                       reference_model=nnx.clone(model))
            >>> trainer.state.reference is None, trainer.checkpoint_state().reference is None
            (False, True)
        """
        if self.config.sync_ref_model:
            return self.state.replace(teacher=None)
        return self.state.replace(reference=None, teacher=None)

    def load_checkpoint_state(self, state: GRPOTrainState) -> None:
        """Loads a restored :meth:`checkpoint_state`, keeping the current reference.

        Args:
            state: The restored state (without a reference; with ``sync_ref_model``, with the
                synced reference, which replaces the current one).
        """
        if state.reference is None:
            state = state.replace(reference=self.state.reference)
        if state.teacher is None:
            state = state.replace(teacher=self._teacher_state)
        self.load_state(state)

    def maybe_sync_reference(
        self, state: GRPOTrainState, metrics: Mapping[str, Any]
    ) -> GRPOTrainState:
        """TR-DPO's reference sync after an update, when it is due (``sync_ref_model``).

        When the update was applied (``metrics["update_applied"]``) and brought the step count
        to a multiple of ``ref_model_sync_steps``, the reference becomes
        ``alpha * policy + (1 - alpha) * reference``
        (:func:`~artifex.generative_models.training.rl.update.ref_sync.sync_reference`), in the
        returned state, in this trainer and in ``reference_model``. ``train_step`` and the
        training loop call it after every update.

        Args:
            state: The state an update returned.
            metrics: That update's metrics (the compiled step's, with ``update_applied``).

        Returns:
            ``state``, with the synced reference when a sync was due.
        """
        if not self.config.sync_ref_model or float(metrics["update_applied"]) == 0:
            return state
        if not reference_sync_due(state.step, self.config):
            return state
        state = sync_reference(state, self.config.ref_model_mixup_alpha)
        self._reference_state = state.reference
        nnx.update(self.reference_model, state.reference)
        return state

    def store_update(self, state: GRPOTrainState) -> None:
        """Writes what an update changes (parameters, optimizer state, step) into the model.

        The frozen variables, the PRNG key and the reference are only read by the compiled
        step (their buffers are not donated to XLA), so they need no write-back. A loop that
        runs several updates on one generation batch calls this once, after the last.

        Args:
            state: The state the compiled step returned.
        """
        nnx.update(self.model, state.params)
        nnx.update(self.optimizer.opt_state, nnx.state(state.opt_state))
        self.optimizer.step.set_value(state.step)
