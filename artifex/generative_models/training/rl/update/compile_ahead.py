"""What every step engine shares: the ``StepEngine`` protocol and compilation in the background.

A step engine is a compiled form of one GRPO update, ``(state, batch) -> (state, metrics)``
(:func:`~artifex.generative_models.training.rl.update.state.grpo_train_step`). The trainer holds
one per number of microbatches and calls nothing else of it. Three engines implement the
protocol (:func:`~artifex.generative_models.training.rl.update.engines.make_step_engine`
chooses): one program, a gradient program with the optimizer split by layer, and the
layer-by-layer update. :class:`BackgroundCompiles` is their compile-ahead: lowered programs
compiled in threads while the caller goes on (a rollout, the first data batch).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.update.state import GRPOTrainState

__all__ = ["BackgroundCompiles", "MultiProgramEngine", "StepEngine"]


@runtime_checkable
class StepEngine(Protocol):
    """One GRPO update in compiled form, as a trainer runs it.

    Implemented by ``OneProgramEngine``, ``SplitOptimizerEngine`` and ``LayerwiseStep``;
    ``GRPOTrainer.compiled_step`` returns one.

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training import GRPOTrainer
        >>> from artifex.generative_models.training.rl import GRPOConfig
        >>> from artifex.generative_models.training.rl.update.compile_ahead import StepEngine
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2))
        >>> isinstance(trainer.compiled_step(), StepEngine)
        True
    """

    def __call__(
        self, state: GRPOTrainState, batch: GRPOBatch
    ) -> tuple[GRPOTrainState, dict[str, jax.Array]]:
        """One update: the new state (input buffers donated) and the metrics."""
        ...

    def wait(self) -> None:
        """Waits for a background compilation (``compile_ahead``) to finish, if any."""
        ...

    def compile_ahead(self, state: GRPOTrainState, batch: GRPOBatch) -> concurrent.futures.Future:
        """Traces for ``state`` and ``batch`` here, compiles in the background."""
        ...

    def lower(self, state: GRPOTrainState, batch: GRPOBatch) -> Any:
        """XLA's lowering of the update (one-program engines only)."""
        ...

    def cache_size(self) -> int:
        """How many compiled variants the engine holds (one per batch structure)."""
        ...


class BackgroundCompiles:
    """Compiles lowered programs in background threads; the engines' compile-ahead.

    Lowering (tracing) happens in the caller's thread, under its JAX context (a mesh set with
    ``jax.set_mesh``, a default device, a matmul precision: per-thread settings a background
    thread would not see); XLA's compilation, the long part, in threads. JAX caches the
    result, so the first call with arguments of the same types runs without compiling.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.training.rl.update.compile_ahead import (
        ...     BackgroundCompiles,
        ... )
        >>> lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
        >>> compiles = BackgroundCompiles()
        >>> compiles.compile_in_background([[("double", lowered)]]).result() is None
        True
    """

    def __init__(self) -> None:
        self._ready: dict[str, concurrent.futures.Future] = {}

    def wait(self) -> None:
        """Waits for every compilation in flight (its error is not raised here).

        A failed compilation fails again, with the caller's traceback, when the program is
        called (the returned future keeps the first error).
        """
        ready, self._ready = self._ready, {}
        concurrent.futures.wait(list(ready.values()))

    def take_ready(self) -> dict[str, concurrent.futures.Future]:
        """The per-program futures of the compilation in flight, handed over (then forgotten).

        Returns:
            Program name -> a future done once that program is compiled.
        """
        ready, self._ready = dict(self._ready), {}
        return ready

    def compile_in_background(
        self, lanes: Sequence[Sequence[tuple[str, Any]]]
    ) -> concurrent.futures.Future:
        """Compiles each lane's ``(name, lowered)`` programs in order, in a thread per lane.

        Waits for a compilation still in flight first. A program's future (``take_ready``) is
        done once its name's last lowering in its lane is compiled, or once the lane failed or
        ended (no waiter is left hanging); after an error a lane compiles nothing more.

        Args:
            lanes: Sequences of ``(name, jax.stages.Lowered)``.

        Returns:
            A future whose result is ``None`` once every lane is compiled, or the first error.
        """
        self.wait()
        ready: dict[str, concurrent.futures.Future] = {}
        lane_futures: list[concurrent.futures.Future] = []
        for lane in lanes:
            last = {name: i for i, (name, _) in enumerate(lane)}
            mine = {name: ready.setdefault(name, concurrent.futures.Future()) for name in last}
            done: concurrent.futures.Future = concurrent.futures.Future()

            def work(lane=lane, last=last, mine=mine, done=done) -> None:
                error: BaseException | None = None
                try:
                    for i, (name, lowered) in enumerate(lane):
                        if error is None:
                            try:
                                lowered.compile()
                            except BaseException as exc:  # handed to whoever waits on `done`
                                error = exc
                        if last[name] == i and not mine[name].done():
                            mine[name].set_result(None)
                finally:
                    for pending in mine.values():
                        if not pending.done():
                            pending.set_result(None)
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)

            threading.Thread(target=work, name="artifex-compile-ahead").start()
            lane_futures.append(done)
        self._ready = {**ready, **{f"lane {i}": f for i, f in enumerate(lane_futures)}}
        if len(lane_futures) == 1:
            return lane_futures[0]
        joined: concurrent.futures.Future = concurrent.futures.Future()

        def join() -> None:
            errors = [f.exception() for f in lane_futures]
            error = next((e for e in errors if e is not None), None)
            if error is None:
                joined.set_result(None)
            else:
                joined.set_exception(error)

        threading.Thread(target=join, name="artifex-compile-ahead-join").start()
        return joined

    def _cache_size(self) -> int:
        return self.cache_size()

    def cache_size(self) -> int:
        """How many compiled variants the engine holds (each engine says).

        Returns:
            One per batch structure compiled so far.

        Raises:
            NotImplementedError: In this base class.
        """
        raise NotImplementedError


class MultiProgramEngine(BackgroundCompiles):
    """An engine made of several programs: no single lowering to analyse.

    Subclasses name the setting that gives the one-program engine instead (``_ONE_PROGRAM``).

    Examples:
        >>> from artifex.generative_models.training.rl.update.compile_ahead import (
        ...     MultiProgramEngine,
        ... )
        >>> class Engine(MultiProgramEngine):
        ...     _ONE_PROGRAM = "GRPOConfig(optimizer_by_layer=False)"
        >>> try:
        ...     Engine().lower(None, None)
        ... except NotImplementedError as e:
        ...     print(str(e)[:36])
        this update runs as several programs
    """

    _ONE_PROGRAM = ""

    def lower(self, state: GRPOTrainState, batch: GRPOBatch) -> Any:
        """Not available: the update is several programs.

        Args:
            state: A train state.
            batch: A batch.

        Returns:
            Nothing: it always raises.

        Raises:
            NotImplementedError: Always, naming the setting of the one-program engine.
        """
        msg = (
            "this update runs as several programs, not one lowering; "
            f"{self._ONE_PROGRAM} gives one program for XLA's cost and memory analysis"
        )
        raise NotImplementedError(msg)
