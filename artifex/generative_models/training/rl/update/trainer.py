r"""GRPO, the stateful trainer: ``GRPOTrainer(model, optimizer, config).train_step(batch)``.

The loss is a pure function (:mod:`~artifex.generative_models.training.rl.core.objective`:
:func:`grpo_objective`, :func:`make_grpo_loss`), the update a pure function of a train state
(:mod:`~artifex.generative_models.training.rl.update.state`: ``grpo_train_step``). This module holds
:class:`GRPOTrainer`, the stateful shell: it validates user batches once at the boundary,
runs the compiled update on the state of its ``nnx`` model and optimizer, and raises
:class:`NonFiniteUpdateError` when a step was rejected. The whole loop drives a trainer
from above (:func:`~artifex.generative_models.training.rl.run.loop.train`); nothing here
imports it.

``GRPOTrainer`` gets its methods by concern from two base classes: the train-state methods
(``state``, ``load_state``, ``store_update``, ``seed_rng``, ``checkpoint_state``,
``load_checkpoint_state``, ``maybe_sync_reference``) from
:class:`~artifex.generative_models.training.rl.update.trainer_state.TrainerStateIO`, the batch
methods (``prepare_batch``, ``place_batch``, ``fill_log_probs``, ``compute_log_probs``,
``policy``, ``maybe_pack``, ``auto_microbatches``) from
:class:`~artifex.generative_models.training.rl.update.trainer_batches.TrainerBatches`. This module
keeps construction, the compiled step and the update itself.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.core.logprobs import LogProbFn
from artifex.generative_models.training.rl.core.objective import (
    as_grpo_batch,
    compute_advantages,
    grpo_objective,
    make_grpo_loss,
    split_microbatches,
)
from artifex.generative_models.training.rl.update.engines import (
    choose_optimizer_split,
    make_step_engine,
)
from artifex.generative_models.training.rl.update.microbatches import (
    MIN_MICROBATCH_TOKENS,
    auto_num_microbatches,
    check_microbatches,
)
from artifex.generative_models.training.rl.update.optimizer_split import (
    LayerSplit,
    SplitDecisions,
)
from artifex.generative_models.training.rl.update.ref_sync import (
    check_sync_setup,
)
from artifex.generative_models.training.rl.update.signals import interrupt_scope
from artifex.generative_models.training.rl.update.state import (
    NonFiniteUpdateError,
    _is_lora_only,
    make_grpo_log_probs,
)
from artifex.generative_models.training.rl.update.trainer_batches import TrainerBatches
from artifex.generative_models.training.rl.update.trainer_setup import (
    check_trainer_inputs,
    host_update_metrics,
    place_models,
    trainer_log_prob_fn,
)
from artifex.generative_models.training.rl.update.trainer_state import TrainerStateIO
from artifex.generative_models.training.sharding import (
    PartitionRules,
    current_mesh,
)
from artifex.generative_models.utils.compile_options import jit
from artifex.generative_models.utils.host_memory import release_memory_after_compilation
from artifex.generative_models.utils.validation import check_float

__all__ = [
    "MIN_MICROBATCH_TOKENS",
    "GRPOTrainer",
    "NonFiniteUpdateError",
    "as_grpo_batch",
    "auto_num_microbatches",
    "compute_advantages",
    "grpo_objective",
    "make_grpo_loss",
    "split_microbatches",
]

logger = logging.getLogger(__name__)


class GRPOTrainer(TrainerStateIO, TrainerBatches):
    """Applies GRPO updates to an NNX policy through an ``nnx.Optimizer``.

    A thin shell over the pure
    :func:`~artifex.generative_models.training.rl.update.state.make_grpo_train_step`: it holds the
    model, optimizer and reference, builds their
    :class:`~artifex.generative_models.training.rl.update.train_state.GRPOTrainState`, runs the
    compiled step on it and writes the result back. ``train_step(batch)`` validates the batch on the
    host, then runs one step, compiled once per batch shape: per-token log-probs ->
    advantages -> clipped surrogate + KL + entropy -> gradient -> global-norm clipping ->
    ``optimizer.update``. A step whose loss or gradient is not finite is not applied (the
    state is kept) and raises :class:`NonFiniteUpdateError`.

    The KL term (``beta > 0``) takes its reference log-probs, in order, from the batch's
    ``ref_log_probs``, from ``reference_model`` (run inside the step), or, for a LoRA policy
    trained with ``wrt=nnx.LoRAParam``, from the same model with its adapters zeroed. Without
    any of these the KL term is 0 and a warning says so.

    The model's and optimizer's input buffers are donated to XLA (reused for the step's
    outputs), so parameters and optimizer state exist once in memory: arrays taken out of the
    model before a step are invalid after it; ``jnp.copy`` them to keep them. A
    ``reference_model`` sharing arrays with the policy (``nnx.clone``) gets its own copies.

    Args:
        model: The policy: a causal LM (``hidden_states``/``output_embedding``) or any module
            ``model(observations) -> logits``.
        optimizer: ``nnx.Optimizer(model, tx, wrt=...)`` built on ``model``.
        config: GRPO options (default ``GRPOConfig()``).
        reference_model: Optional frozen reference policy (same kind of model).
        log_prob_fn: Optional ``fn(model, batch) -> (log_probs, entropy)`` for custom models
            (default:
            :func:`~artifex.generative_models.training.rl.update.trainer_setup.trainer_log_prob_fn`).
        mesh: Optional ``jax.sharding.Mesh`` (default: the one set with ``jax.set_mesh``).
            The model, reference, teacher and optimizer state are placed on it
            (:func:`~artifex.generative_models.training.sharding.shard_model`,
            :func:`~artifex.generative_models.training.sharding.shard_optimizer`) and each
            batch is split over its data axes.
        partition_rules: :class:`~artifex.generative_models.training.sharding.PartitionRules`
            (or ``(regex, PartitionSpec)`` pairs) for ``mesh``; default ``PartitionRules()``.
        rng: The run's PRNG key (default ``jax.random.key(0)``).
        packing_threshold: Pack a causal-LM batch
            (:meth:`~artifex.generative_models.training.rl.update.trainer_batches.TrainerBatches.maybe_pack`)
            when over this fraction of it is padding; None: never.
        teacher_model: Optional frozen distillation teacher
            (:mod:`~artifex.generative_models.training.rl.core.teacher`), run inside the step.
        teacher_partition_rules: The teacher's rules on ``mesh`` (default ``partition_rules``).

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training import GRPOConfig, GRPOTrainer
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))  # a 3-action policy
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=4, beta=0.0))
        >>> batch = {"observations": jnp.ones((4, 4)), "actions": jnp.array([0, 1, 2, 0]),
        ...          "rewards": jnp.array([1.0, 0.0, 0.0, 1.0])}
        >>> metrics = trainer.train_step(batch)  # dict[str, float]
        >>> metrics["reward_mean"], metrics["grad_norm"] > 0, int(optimizer.step[...])
        (0.5, True, 1)
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        config: GRPOConfig | None = None,
        reference_model: nnx.Module | None = None,
        *,
        log_prob_fn: LogProbFn | None = None,
        mesh: Mesh | None = None,
        partition_rules: PartitionRules | Sequence[tuple[str, Any]] | None = None,
        rng: jax.Array | None = None,
        packing_threshold: float | None = None,
        teacher_model: nnx.Module | None = None,
        teacher_partition_rules: PartitionRules | Sequence[tuple[str, Any]] | None = None,
    ):
        config = GRPOConfig() if config is None else config
        check_float("packing_threshold", packing_threshold, minimum=0, maximum=1, allow_none=True)
        self.packing_threshold = packing_threshold
        mesh = current_mesh() if mesh is None else mesh
        check_trainer_inputs(
            model,
            optimizer,
            config,
            reference_model,
            mesh=mesh,
            partition_rules=partition_rules,
            teacher_model=teacher_model,
            teacher_partition_rules=teacher_partition_rules,
            log_prob_fn=log_prob_fn,
        )
        place_models(
            model,
            optimizer,
            mesh,
            partition_rules,
            reference_model=reference_model,
            teacher_model=teacher_model,
            teacher_partition_rules=teacher_partition_rules,
        )
        self.mesh = mesh
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.reference_model = reference_model
        self.teacher_model = teacher_model
        # Frozen like the reference: read once, never donated.
        self._teacher_state = (
            None if teacher_model is None else nnx.as_pure(nnx.state(teacher_model))
        )
        self.wrt = optimizer.wrt
        self.rng = jax.random.key(0) if rng is None else rng
        self._placed_rng: tuple[jax.Array, jax.Array] | None = None  # rng on the mesh, cached
        # The reference is frozen and never donated: its arrays are read once, here (reload
        # them with ``load_state`` after changing the reference model's weights).
        self._reference_state = (
            None if reference_model is None else nnx.as_pure(nnx.state(reference_model))
        )
        # A mixture-of-experts policy's own: routing replay (GRPOConfig.routing_replay).
        self.log_prob_fn, self._moe_log_probs = trainer_log_prob_fn(model, config, log_prob_fn)
        self._lora_reference = reference_model is None and _is_lora_only(model, self.wrt)
        _, params, frozen = nnx.split(model, self.wrt, ...)
        check_sync_setup(
            config,
            lora_only=_is_lora_only(model, self.wrt),
            reference=self._reference_state,
            params=nnx.as_pure(params),
            frozen=nnx.as_pure(frozen),
        )
        self._warned_no_reference = False
        self._num_traces = 0
        self._auto_eligible: bool | None = None  # auto_microbatches' model and device test
        self._custom_log_prob_fn = log_prob_fn is not None
        self._steps: dict[int, Any] = {}
        self._split_decisions = SplitDecisions(optimizer.tx)  # split_by_layer per state types
        self._bound = {
            "wrt": self.wrt,
            "reference_model": reference_model,
            "log_prob_fn": self.log_prob_fn,
        }
        # The library's jit: the backend's options, and usable inside a caller's trace.
        self._log_probs_fn = jit(make_grpo_log_probs(model, config, **self._bound))
        self.grpo_loss = make_grpo_loss(
            model, config, wrt=self.wrt, log_prob_fn=self.log_prob_fn, teacher_model=teacher_model
        )
        # XLA's working memory for compiling the step is freed but kept by the C allocator:
        # give it back so that the step's own temporaries do not come on top of it.
        release_memory_after_compilation()

    # ----------------------------------------------------------------- public helpers
    @property
    def params(self) -> nnx.State:
        """The trainable state ``nnx.state(model, wrt)`` (what ``grpo_loss`` takes)."""
        return nnx.state(self.model, self.wrt)

    @property
    def num_compilations(self) -> int:
        """How many times the step has been traced (one per distinct batch shape)."""
        return self._num_traces

    @property
    def has_reference(self) -> bool:
        """Whether the step can compute reference log-probs itself."""
        return self.reference_model is not None or self._lora_reference

    def compiled_step(self, num_microbatches: int = 1) -> Any:
        """The compiled ``grpo_train_step(state, batch) -> (state, metrics)`` of this trainer.

        The input buffers of the trainable parameters, optimizer state and step count are
        donated to XLA (reused for the outputs, so they are invalid after the call); the frozen
        variables, the PRNG key and the reference are only read, so they stay valid.

        Args:
            num_microbatches: Gradient-accumulation slices bound into the step.

        Returns:
            The compiled pure step (cached per ``num_microbatches``). Where the optimizer runs
            one decoder layer at a time (``GRPOConfig.optimizer_by_layer``, models of 8 or
            more layers; ``trainer.optimizer_split_reason`` says why not) it is a gradient
            program followed by the optimizer's per-layer programs; otherwise one program,
            whose ``.lower(state, batch)`` gives XLA's lowering for cost and memory analysis.

        Examples:
            >>> import jax, jax.numpy as jnp, optax
            >>> from flax import nnx
            >>> from artifex.generative_models.training import GRPOTrainer
            >>> from artifex.generative_models.training.rl import GRPOConfig
            >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))  # a 3-action policy
            >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=4, beta=0.0))
            >>> batch = trainer.prepare_batch({"observations": jnp.ones((4, 4)),
            ...     "actions": jnp.array([0, 1, 2, 0]), "rewards": jnp.array([1.0, 0, 0, 1.0])})
            >>> before = jax.nn.softmax(model(jnp.ones(4)))[0]  # p(action 0), the rewarded one
            >>> step, state = trainer.compiled_step(), trainer.state
            >>> for _ in range(3):  # a loop of one's own over the pure step
            ...     state, metrics = step(state, batch)
            >>> trainer.load_state(state)  # back into the model and optimizer
            >>> after = jax.nn.softmax(model(jnp.ones(4)))[0]
            >>> int(optimizer.step[...]), trainer.num_compilations, bool(after > before)
            (3, 1, True)
        """
        if num_microbatches not in self._steps:
            out_layout = None
            if self.mesh is not None:
                state = self.state
                out_layout = jax.tree.map(
                    lambda x: x.sharding, (state.params, state.opt_state, state.step)
                )
            self._steps[num_microbatches] = make_step_engine(
                self.model,
                self.optimizer.tx,
                self.config,
                num_microbatches=num_microbatches,
                bound=self._bound,
                teacher_model=self.teacher_model,
                split=None if self.config.layerwise_update else self._optimizer_split(),
                decisions=self._split_decisions,
                lora_reference=self._lora_reference,
                out_layout=out_layout,
                mesh=self.mesh,
                on_trace=self._count_trace,
            )
        return self._steps[num_microbatches]

    def _count_trace(self) -> None:
        self._num_traces += 1

    def _optimizer_split(self) -> LayerSplit | None:
        """The per-layer split of the optimizer step, or None (then one program runs it).

        Only with ``GRPOConfig.optimizer_by_layer``, for parameters on the CPU (the split
        shortens XLA:CPU's compile time), without a mesh, for models of at least
        ``MIN_LAYERS_FOR_OPTIMIZER_BY_LAYER`` decoder layers, and where
        :func:`~artifex.generative_models.training.rl.update.layer_split.split_by_layer` accepts
        the optimizer's transformation for the trainer's state when the step is first built.
        That chooses the kind of step; the split step then asks again for each state's types
        (a state loaded later with other dtypes, a loop of one's own) and runs the optimizer in
        one program for the states it cannot split.
        """
        if not hasattr(self, "_split"):
            self._split, self._split_reason = choose_optimizer_split(
                self.config, self.model, self.mesh, lambda: self.state, self._split_decisions
            )
        return self._split

    @property
    def optimizer_split_reason(self) -> str:
        """Why the optimizer step runs in one program; empty where it runs layer by layer.

        See ``GRPOConfig.optimizer_by_layer`` (and ``layerwise_update``, whose update decides
        the same way for its own optimizer programs).

        Examples:
            >>> import optax
            >>> from flax import nnx
            >>> from artifex.generative_models.training import GRPOTrainer
            >>> from artifex.generative_models.training.rl import GRPOConfig
            >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            >>> GRPOTrainer(model, optimizer, GRPOConfig()).optimizer_split_reason
            'fewer than 8 decoder layers (one program compiles as fast)'
        """
        if self.config.layerwise_update:
            step = self.compiled_step()
            step.optimizer_split(self.state)
            return step.optimizer_split_reason
        if self._optimizer_split() is None:
            return self._split_reason
        state = self.state  # the split step decides for the state it is given
        return self._split_decisions(state.params, state.opt_state)[1]

    # ----------------------------------------------------------------- the step
    def train_step(
        self, batch: GRPOBatch | Mapping[str, Any], *, num_microbatches: int | None = None
    ) -> dict[str, float]:
        """One GRPO update on ``batch``.

        Args:
            batch: A :class:`GRPOBatch` (row ``i`` of prompt ``i // G``) or the dict batch form
                (``observations``, ``actions``, ``rewards``, optional ``log_probs``,
                ``ref_log_probs``, ``group_size``).
            num_microbatches: Accumulate gradients over this many equal row slices of the batch
                inside the compiled step (a ``lax.scan``): the update is the full-batch update
                (advantages and loss normalization use the whole batch) with less peak memory.
                ``None`` (the default):
                :meth:`~artifex.generative_models.training.rl.update.trainer_batches.TrainerBatches.auto_microbatches`
                (on the CPU, slices of at least 512 token positions; elsewhere 1).

        Returns:
            Metrics as Python floats: those of :func:`grpo_objective` plus ``grad_norm``
            (before clipping).

        Raises:
            ValueError: Invalid batch or ``num_microbatches`` (raised before anything is traced).
            TypeError: Wrong batch type or dtypes.
            NonFiniteUpdateError: Non-finite loss, gradient, updated parameters or updated
                optimizer state; nothing was updated.
        """
        batch = self.prepare_batch(batch)
        if num_microbatches is None:
            num_microbatches = self.auto_microbatches(batch)
        check_microbatches(num_microbatches, batch.batch_size)
        if (
            self.config.beta > 0.0
            and batch.ref_log_probs is None
            and not self.has_reference
            and not self._warned_no_reference
        ):
            logger.warning(
                "GRPOConfig.beta=%s but the batch has no ref_log_probs and the trainer has no "
                "reference_model: the KL penalty is 0 for such batches.",
                self.config.beta,
            )
            self._warned_no_reference = True
        return self.apply_prepared(batch, num_microbatches=num_microbatches)

    def compile_ahead(
        self, batch: GRPOBatch | Mapping[str, Any], *, num_microbatches: int | None = None
    ) -> concurrent.futures.Future:
        """Compiles the step for batches like ``batch`` in a background thread, and returns.

        Start it before the first rollout: the update then compiles while the sampler compiles
        and generates, instead of after it (on the CPU both share the cores). The step is
        traced here, in the caller's JAX context, and compiled in the background;
        ``train_step`` waits for a compilation still in flight rather than starting a second
        one.

        The example is validated and placed like a real batch
        (:meth:`~artifex.generative_models.training.rl.update.trainer_batches.TrainerBatches.prepare_batch`);
        only its structure, shapes and dtypes matter, and they must be those of the batches to come
        (for a GRPO rollout: each prompt repeated ``group_size`` times and padded to the sampler's
        prompt-length bucket, as :meth:`GRPOBatch.zeros` builds it). Otherwise the first
        ``train_step`` compiles for its own batch (``num_compilations`` counts both).

        Args:
            batch: An example batch (``GRPOBatch.zeros(num_prompts, group_size,
                bucket_length(prompt_width), max_new_tokens)`` for the sampler's), or a dict
                batch.
            num_microbatches: As for :meth:`train_step`.

        Returns:
            A ``concurrent.futures.Future``: ``result()`` is ``None`` once compiled, or raises
            the compilation's error.

        Raises:
            ValueError: Invalid example batch or ``num_microbatches`` (checked here, at once).
            TypeError: Wrong batch type or dtypes.

        Examples:
            >>> import jax.numpy as jnp, optax
            >>> from flax import nnx
            >>> from artifex.generative_models.training import GRPOTrainer
            >>> from artifex.generative_models.training.rl import GRPOConfig
            >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2, beta=0.0))
            >>> shape = {"observations": jnp.zeros((4, 4)), "actions": jnp.zeros(4, jnp.int32),
            ...          "rewards": jnp.zeros(4)}
            >>> future = trainer.compile_ahead(shape)  # compiles while we do other work
            >>> metrics = trainer.train_step({**shape, "rewards": jnp.array([1.0, 0, 0, 1])})
            >>> future.result(), trainer.num_compilations
            (None, 1)
        """
        batch = self.prepare_batch(batch)
        if num_microbatches is None:
            num_microbatches = self.auto_microbatches(batch)
        check_microbatches(num_microbatches, batch.batch_size)
        return self.compiled_step(num_microbatches).compile_ahead(self.state, batch)

    def apply_prepared(
        self, batch: GRPOBatch, *, num_microbatches: int | None = None
    ) -> dict[str, float]:
        """One GRPO update on a batch that is already checked (no host validation).

        For batches the library built itself (the rollout) or that went through
        :meth:`~artifex.generative_models.training.rl.update.trainer_batches.TrainerBatches.prepare_batch`:
        nothing is copied to the host before the compiled step. The one method the training loop
        calls per update: it packs the batch where that pays
        (:meth:`~artifex.generative_models.training.rl.update.trainer_batches.TrainerBatches.maybe_pack`),
        runs the compiled step (:meth:`compiled_step`) on
        :attr:`~artifex.generative_models.training.rl.update.trainer_state.TrainerStateIO.state`,
        stores the new state in the model and optimizer (a Ctrl-C arriving meanwhile is delivered
        after the store), syncs the reference when due and returns the metrics as floats. A rejected
        update stores the state before it, unchanged.

        Args:
            batch: A prepared :class:`GRPOBatch` of arrays (on the trainer's mesh, if any).
            num_microbatches: As for :meth:`train_step` (must divide the rows; ``None``:
                :meth:`~artifex.generative_models.training.rl.update.trainer_batches.TrainerBatches.auto_microbatches`).

        Returns:
            The step's metrics as Python floats, as for :meth:`train_step`.

        Raises:
            NonFiniteUpdateError: The step was rejected (nothing was updated).
        """
        if num_microbatches is None:
            num_microbatches = self.auto_microbatches(batch)
        batch = self.maybe_pack(batch, num_microbatches)
        # A Ctrl-C while the optimizer runs group by group is delivered once the new state is
        # stored: the old arrays are donated by then.
        with interrupt_scope():
            state, metrics = self.compiled_step(num_microbatches)(self.state, batch)
            self.store_update(state)
        host = self.host_metrics(metrics, step=state.step)
        self.maybe_sync_reference(state, metrics)
        return host

    def host_metrics(
        self, metrics: Mapping[str, jax.Array], *, step: int | jax.Array
    ) -> dict[str, float]:
        """The step's metrics as floats, raising if the update was rejected.

        Args:
            metrics: The metrics the compiled step returned.
            step: The optimizer step the update was tried at, for the message (the step count
                of the returned state: a rejected update leaves it unchanged).

        Returns:
            The metrics without the guard's flags.

        Raises:
            NonFiniteUpdateError: The update was not finite (the state it returned is the
                state before it).
        """
        return host_update_metrics(metrics, step=step, config=self.config)
