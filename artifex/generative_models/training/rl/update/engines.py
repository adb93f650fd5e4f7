"""The step engines and the one factory that chooses among them.

:func:`make_step_engine` builds the compiled form of one GRPO update for a trainer:

- :class:`OneProgramEngine`: the whole update in one XLA program (the default; its
  ``lower`` gives the program for cost and memory analysis);
- :class:`SplitOptimizerEngine`: the objective and its gradient in one program, then clipping,
  the optimizer and the guard one decoder layer at a time (``GRPOConfig.optimizer_by_layer``,
  parameters on the CPU, 8 or more layers: XLA:CPU compiles the per-layer programs once);
- :class:`~artifex.generative_models.training.rl.update.layerwise.LayerwiseStep`: forward and
  backward one layer at a time (``GRPOConfig.layerwise_update``).

All three implement :class:`~artifex.generative_models.training.rl.update.compile_ahead.StepEngine`
and compile ahead through
:class:`~artifex.generative_models.training.rl.update.compile_ahead.BackgroundCompiles`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.update.compile_ahead import (
    BackgroundCompiles,
    MultiProgramEngine,
    StepEngine,
)
from artifex.generative_models.training.rl.update.layerwise import LayerwiseStep
from artifex.generative_models.training.rl.update.optimizer_split import (
    LayerOptimizer,
    LayerSplit,
    SplitDecisions,
    group_tree,
    lower_programs,
)
from artifex.generative_models.training.rl.update.state import (
    GRPOTrainState,
    apply_gradients,
    make_grpo_gradients,
    make_grpo_train_step,
)
from artifex.generative_models.utils.compile_options import compiler_options

__all__ = [
    "MIN_LAYERS_FOR_OPTIMIZER_BY_LAYER",
    "OneProgramEngine",
    "SplitOptimizerEngine",
    "choose_optimizer_split",
    "make_step_engine",
]

# With fewer decoder layers the one-program step keeps the optimizer: its per-array work then
# compiles in well under a second, and the per-layer programs' own tracing and loading cost as
# much (docs/benchmarks.md).
MIN_LAYERS_FOR_OPTIMIZER_BY_LAYER = 8


def _parts(state: GRPOTrainState) -> tuple[tuple, tuple]:
    """What an update changes (donated) and what it only reads."""
    return (state.params, state.opt_state, state.step), (
        state.frozen,
        state.rng,
        state.reference,
        state.teacher,
    )


def _state(dynamic: tuple, fixed: tuple) -> GRPOTrainState:
    (params, opt_state, step), (frozen, rng, reference, teacher) = dynamic, fixed
    return GRPOTrainState(params, frozen, opt_state, step, rng, reference, teacher)


class OneProgramEngine(BackgroundCompiles):
    """The whole update as one XLA program, ``(state, batch) -> (state, metrics)``.

    The input buffers of what the update changes (parameters, optimizer state, step) are
    donated to XLA and reused for the outputs; the frozen variables, PRNG key, reference and
    teacher are only read.

    Args:
        jitted: The jitted ``(dynamic, fixed, batch) -> (dynamic, metrics)``.

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training import GRPOTrainer
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2))
        >>> type(trainer.compiled_step()).__name__
        'OneProgramEngine'
    """

    def __init__(self, jitted: Any):
        super().__init__()
        self._jitted = jitted

    def __call__(
        self, state: GRPOTrainState, batch: GRPOBatch
    ) -> tuple[GRPOTrainState, dict[str, jax.Array]]:
        """One update (see the class).

        Args:
            state: The train state (its parameters, optimizer state and step are donated).
            batch: A prepared batch.

        Returns:
            ``(new_state, metrics)``.
        """
        self.wait()
        (params, opt_state, step), metrics = self._jitted(*_parts(state), batch)
        return state.replace(params=params, opt_state=opt_state, step=step), metrics

    def compile_ahead(self, state: GRPOTrainState, batch: GRPOBatch) -> concurrent.futures.Future:
        """Traces the update for ``state`` and ``batch`` here, compiles it in the background.

        Only shapes, dtypes and shardings are read (nothing runs).

        Args:
            state: A train state (only its arrays' types are read).
            batch: A batch with the structure, shapes and dtypes of the batches to come.

        Returns:
            A future whose result is ``None`` once the step is compiled (or its error).
        """
        self.wait()
        return self.compile_in_background([[("step", self.lower(state, batch))]])

    def lower(self, state: GRPOTrainState, batch: GRPOBatch) -> Any:
        """XLA's lowering of the update for ``state`` and ``batch`` (``.compile()`` it).

        Args:
            state: A train state.
            batch: A batch.

        Returns:
            The ``jax.stages.Lowered`` step.
        """
        return self._jitted.lower(*_parts(state), batch)

    def cache_size(self) -> int:
        """How many compiled variants the engine holds.

        Returns:
            One per batch structure compiled so far.
        """
        return self._jitted._cache_size()


class SplitOptimizerEngine(MultiProgramEngine):
    """A gradient program, then the optimizer one parameter group at a time.

    ``(state, batch) -> (state, metrics)`` as :class:`OneProgramEngine`, with the same values
    (the gradient norm summed in another order): the objective and its gradient in one program
    (``make_grpo_gradients``; no input buffer donated), then clipping, ``tx`` and the guard per
    parameter group (each decoder layer, then the rest;
    :class:`~artifex.generative_models.training.rl.update.optimizer_split.LayerOptimizer`),
    whose programs compile once per group structure.

    Args:
        gradients: The jitted ``(dynamic, fixed, batch) -> (loss, metrics, grads)``.
        optimizer: The per-group optimizer programs.
        decisions: Whether a state's types can be split (asked per state).
        tx: The optimizer's transformation.
        config: The GRPO configuration.

    Examples:
        >>> from artifex.generative_models.training.rl.update.engines import (
        ...     SplitOptimizerEngine,
        ... )
        >>> SplitOptimizerEngine._ONE_PROGRAM
        'GRPOConfig(optimizer_by_layer=False)'
    """

    _ONE_PROGRAM = "GRPOConfig(optimizer_by_layer=False)"

    def __init__(
        self,
        gradients: Any,
        optimizer: LayerOptimizer,
        decisions: SplitDecisions,
        tx: optax.GradientTransformation,
        config: GRPOConfig,
    ):
        super().__init__()
        self._gradients = gradients
        self._optimizer = optimizer
        self._decisions = decisions

        def finish(params, opt_state, step, grads, loss, metrics, batch):
            state = GRPOTrainState(params, None, opt_state, step, None, None)
            new, metrics = apply_gradients(tx, config, state, batch, loss, metrics, grads)
            return (new.params, new.opt_state, new.step), metrics

        # For a state whose types the optimizer cannot be split for (a state loaded later may
        # have other dtypes): clipping, ``tx`` and the guard in one program.
        self._finish = jax.jit(
            finish, donate_argnums=(0, 1, 2), compiler_options=compiler_options()
        )

    def _run(self, state: GRPOTrainState, batch: GRPOBatch, fn: Mapping[str, Any]) -> Any:
        (params, opt_state, step), fixed = _parts(state)
        loss, metrics, grads = fn["gradients"]((params, opt_state, step), fixed, batch)
        split, _ = self._decisions(params, opt_state)
        if split is None:
            return fn["finish"](params, opt_state, step, grads, loss, metrics, batch)
        by_group = {g: group_tree(grads, g) for g in split.groups}
        return self._optimizer.run(fn, split, state, by_group, loss, metrics, batch)

    def __call__(
        self, state: GRPOTrainState, batch: GRPOBatch
    ) -> tuple[GRPOTrainState, dict[str, jax.Array]]:
        """One update (see the class).

        Args:
            state: The train state (its parameters, optimizer state and step are donated).
            batch: A prepared batch.

        Returns:
            ``(new_state, metrics)``.
        """
        self.wait()
        fn = dict(
            self._optimizer.programs,
            gradients=self._gradients,
            finish=self._finish,
            prepare_apply=self._optimizer.prepare_apply,
        )
        (params, opt_state, step), metrics = self._run(state, batch, fn)
        return state.replace(params=params, opt_state=opt_state, step=step), metrics

    def compile_ahead(self, state: GRPOTrainState, batch: GRPOBatch) -> concurrent.futures.Future:
        """Traces every program here, compiles them in the background (two threads).

        The gradient program compiles in one thread, the optimizer's small programs in another.

        Args:
            state: A train state (only its types are read).
            batch: A batch with the structure, shapes and dtypes of the batches to come.

        Returns:
            A future whose result is ``None`` once every program is compiled (or an error).
        """
        self.wait()
        programs = dict(self._optimizer.programs, gradients=self._gradients, finish=self._finish)
        order = lower_programs(self._run, programs, state, batch)
        first = [(name, low) for name, low in order if name == "gradients"]
        rest = [(name, low) for name, low in order if name != "gradients"]
        return self.compile_in_background([first, rest])

    def cache_size(self) -> int:
        """How many compiled variants the gradient program holds.

        Returns:
            One per batch structure compiled so far.
        """
        return self._gradients._cache_size()


def on_cpu(params: Any) -> bool:
    """Whether every device holding ``params`` is a CPU (True for no arrays).

    Args:
        params: A pytree of arrays.

    Returns:
        Whether the arrays all live on CPU devices.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.training.rl.update.engines import on_cpu
        >>> on_cpu({"w": jnp.ones(2)}) == (jnp.ones(2).devices().pop().platform == "cpu")
        True
    """
    platforms = {
        d.platform for x in jax.tree.leaves(params) if isinstance(x, jax.Array) for d in x.devices()
    }
    return platforms <= {"cpu"}


def num_layers(model: nnx.Module) -> int:
    """The number of decoder layers a model holds as a sequence (0 for any other model).

    Args:
        model: Any module.

    Returns:
        ``len(model.layers)``, or 0.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl.update.engines import num_layers
        >>> num_layers(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
        0
    """
    try:
        return len(model.layers)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return 0


def choose_optimizer_split(
    config: GRPOConfig,
    model: nnx.Module,
    mesh: Mesh | None,
    state: Callable[[], GRPOTrainState],
    decisions: SplitDecisions,
) -> tuple[LayerSplit | None, str]:
    """Whether the optimizer runs one layer at a time, and why not.

    Only with ``GRPOConfig.optimizer_by_layer``, for parameters on the CPU (the split shortens
    XLA:CPU's compile time), without a mesh, for models of at least
    ``MIN_LAYERS_FOR_OPTIMIZER_BY_LAYER`` decoder layers, and where ``split_by_layer`` accepts
    the optimizer's transformation for the state.

    Args:
        config: The GRPO configuration.
        model: The policy.
        mesh: The trainer's mesh, or None.
        state: Returns the trainer's state (called only when the other tests pass).
        decisions: The optimizer's split decisions per state types.

    Returns:
        ``(split, reason)``: the split, or None with the reason it runs as one program.

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.rl.update.engines import (
        ...     choose_optimizer_split,
        ... )
        >>> from artifex.generative_models.training.rl.update.optimizer_split import (
        ...     SplitDecisions,
        ... )
        >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        >>> choose_optimizer_split(GRPOConfig(optimizer_by_layer=False), model, None, None,
        ...                        SplitDecisions(optax.sgd(0.1)))
        (None, 'GRPOConfig.optimizer_by_layer is False')
    """
    if not config.optimizer_by_layer:
        return None, "GRPOConfig.optimizer_by_layer is False"
    if mesh is not None:
        return None, "a mesh (the one-program step keeps its layout)"
    current = state()
    if not on_cpu(current.params):
        return None, (
            "the parameters are not on the CPU (the split shortens XLA:CPU's compile "
            "time; an accelerator compiles and runs the one program)"
        )
    if num_layers(model) < MIN_LAYERS_FOR_OPTIMIZER_BY_LAYER:
        return None, (
            f"fewer than {MIN_LAYERS_FOR_OPTIMIZER_BY_LAYER} decoder layers (one "
            "program compiles as fast)"
        )
    return decisions(current.params, current.opt_state)


def make_step_engine(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    config: GRPOConfig,
    *,
    num_microbatches: int,
    bound: Mapping[str, Any],
    teacher_model: nnx.Module | None,
    split: LayerSplit | None,
    decisions: SplitDecisions,
    lora_reference: bool,
    out_layout: Any,
    mesh: Mesh | None,
    on_trace: Callable[[], None],
) -> StepEngine:
    """The step engine a trainer runs for ``num_microbatches`` (the one place that chooses).

    ``config.layerwise_update`` gives the layer-by-layer update; a ``split`` the gradient
    program with the optimizer by layer; otherwise one program.

    Args:
        model: The policy.
        tx: The optimizer's transformation.
        config: The GRPO configuration.
        num_microbatches: Gradient-accumulation slices bound into the update.
        bound: ``wrt``, ``reference_model`` and ``log_prob_fn`` of the trainer.
        teacher_model: The distillation teacher, or None.
        split: The optimizer's per-layer split (:func:`choose_optimizer_split`), or None.
        decisions: The optimizer's split decisions per state types.
        lora_reference: Whether the reference is the LoRA base (adapters zeroed).
        out_layout: The shardings of ``(params, opt_state, step)`` on a mesh, else None.
        mesh: The trainer's mesh, or None.
        on_trace: Called each time the update is traced.

    Returns:
        The engine.

    Raises:
        ValueError: ``layerwise_update`` with ``num_microbatches != 1``.

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training import GRPOTrainer
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2))
        >>> type(trainer.compiled_step(num_microbatches=2)).__name__  # make_step_engine's
        'OneProgramEngine'
    """
    if config.layerwise_update:
        if num_microbatches != 1:
            msg = (
                "GRPOConfig.layerwise_update runs the whole batch at once (its activations "
                f"are one layer's); num_microbatches must be 1, got {num_microbatches}"
            )
            raise ValueError(msg)
        return LayerwiseStep(
            model,
            tx,
            config,
            wrt=bound["wrt"],
            reference_model=bound["reference_model"],
            lora_reference=lora_reference,
            on_trace=on_trace,
        )
    if split is not None:
        gradients = make_grpo_gradients(
            model, config, num_microbatches=num_microbatches, teacher_model=teacher_model, **bound
        )

        # Named like the one-program step (`split_step`): both are "the update" by name.
        def split_step_gradients(dynamic: tuple, fixed: tuple, batch: GRPOBatch):
            on_trace()
            return gradients(_state(dynamic, fixed), batch)

        return SplitOptimizerEngine(
            jax.jit(split_step_gradients, compiler_options=compiler_options()),
            LayerOptimizer(tx, config),
            decisions,
            tx,
            config,
        )
    pure = make_grpo_train_step(
        model, tx, config, num_microbatches=num_microbatches, teacher_model=teacher_model, **bound
    )

    def split_step(dynamic: tuple, fixed: tuple, batch: GRPOBatch):
        on_trace()
        new, metrics = pure(_state(dynamic, fixed), batch)
        return (new.params, new.opt_state, new.step), metrics

    shardings = {}
    if mesh is not None:
        # The new state keeps its input's layout: the donated buffers are reused.
        shardings["out_shardings"] = (out_layout, NamedSharding(mesh, PartitionSpec()))
    jitted = jax.jit(split_step, donate_argnums=0, compiler_options=compiler_options(), **shardings)
    return OneProgramEngine(jitted)
