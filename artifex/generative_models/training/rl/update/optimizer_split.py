"""The optimizer step one decoder layer at a time, where that computes the same as the whole.

An optax transformation such as AdamW updates each parameter from its own gradient and moments
and a few scalars (the step count, the hyperparameters). Then the update of one decoder layer's
parameters can be computed on its own, and all layers of one structure share one small compiled
program instead of one program holding every parameter array (XLA:CPU compiles each array's work
as its own kernels, so that program's compile time grows with the number of arrays).

How the parameters and the optimizer state split into groups (``LayerSplit``) and the check that
a transformation's update separates by them (``split_by_layer``, ``SplitDecisions``) live in
:mod:`~artifex.generative_models.training.rl.update.layer_split`; this module imports those
names, so they stay importable from here. It holds :class:`LayerOptimizer`, which runs the
clipping, the optimizer and the guard group by group, and :func:`lower_programs`.

The groups' update programs donate the old arrays to XLA (their buffers are reused for the new
arrays, so the old ones are deleted); a caller that stores the new state wraps the step and the
store in :func:`~artifex.generative_models.training.rl.update.signals.interrupt_scope`
(re-exported here), so that a Ctrl-C arriving while the groups run is delivered after the store
(``GRPOTrainer.apply_prepared`` does).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from artifex.generative_models.training.rl.core.batch import GRPOBatch
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.update.layer_split import (  # noqa: F401  (old imports)
    Group,
    LayerSplit,
    SplitDecisions,
    group_tree,
    split_by_layer,
    update_function,
)
from artifex.generative_models.training.rl.update.signals import (
    deferred_interrupt,
    interrupt_scope,
)
from artifex.generative_models.training.rl.update.state import (
    GRPOTrainState,
    _clip_scale,
    _finite_flags,
    _guard_decision,
    _squared_norm,
)
from artifex.generative_models.utils.compile_options import jit

__all__ = [
    "LayerOptimizer",
    "interrupt_scope",
]


def _signature(x: Any) -> tuple:
    """What selects a compiled program for the argument ``x``: its type and placement."""
    if isinstance(x, jax.Array):
        return (jax.typeof(x), x.sharding, x.committed)
    return (jnp.shape(x), jnp.result_type(x), type(x))


def _buffer_keys(x: jax.Array) -> tuple:
    """The device buffers of ``x`` (two arrays with one buffer cannot both be donated)."""
    try:
        return (x.unsafe_buffer_pointer(),)
    except Exception:  # several shards, or a backend without pointers
        try:
            return tuple(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
        except Exception:
            return (id(x),)


def _check_donations(split: LayerSplit, slots: Mapping[Group, Any], params: Mapping[Group, Any]):
    """Raises before the first group donates if any group's arrays cannot be donated.

    XLA refuses to donate a deleted buffer or one buffer twice, but only when the group's
    program is called: by then the groups before it were updated and their old arrays deleted.
    """
    seen: dict[Any, Group] = {}
    for g in split.groups:
        for path, x in jax.tree_util.tree_flatten_with_path((params[g], slots[g]))[0]:
            if not isinstance(x, jax.Array):
                continue
            where = f"group {g!r}, {'parameters' if path[0].idx == 0 else 'optimizer state'}"
            where += jax.tree_util.keystr(path[1:])
            if x.is_deleted():
                msg = (
                    f"the optimizer by layer: {where} is an array that was deleted or donated; "
                    "nothing was updated"
                )
                raise ValueError(msg)
            for key in _buffer_keys(x):
                if key in seen:
                    msg = (
                        f"the optimizer by layer: {where} holds the same device buffer as an "
                        f"array of group {seen[key]!r}, and each is donated to its update; "
                        "nothing was updated (give each parameter its own array, or set "
                        "GRPOConfig(optimizer_by_layer=False))"
                    )
                    raise ValueError(msg)
                seen[key] = g


# Arrays checked rows first in the per-group check (see `_finite_flags`): a group's program has
# few arrays, and a reduction of an array to a scalar runs on one core.
_GROUP_ROWS_FIRST = 1 << 14


class LayerOptimizer:
    """Clipping, ``tx`` and the guard of ``apply_gradients``, one group of parameters at a time.

    The same values as :func:`~artifex.generative_models.training.rl.update.state.apply_gradients`
    for a transformation that
    :func:`~artifex.generative_models.training.rl.update.layer_split.split_by_layer` accepted (the
    gradient norm summed in another order).
    Its programs: each group's squared gradient norm, the clipping scale, each group's check of the
    new parameters and optimizer state (computed, not written), the decision, and each group's
    update, which donates the group's parameters and moments to XLA (reuses their buffers for the
    new ones). Every program is compiled once per group structure (one for the decoder layers, one
    for the rest), whatever the depth.

    Args:
        tx: The optax transformation.
        config: The GRPO options (``max_grad_norm``, ``entropy_coeff``).

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training import GRPOBatch, GRPOConfig
        >>> from artifex.generative_models.training.rl import GRPOTrainState
        >>> from artifex.generative_models.training.rl.update.optimizer_split import (
        ...     LayerOptimizer, group_tree, split_by_layer)
        >>> params = nnx.State({"layers": {0: {"w": jnp.ones(2)}, 1: {"w": jnp.ones(2)}},
        ...                     "head": {"w": jnp.ones(3)}})
        >>> tx = optax.sgd(0.5)
        >>> state = GRPOTrainState(params, None, tx.init(params), jnp.array(0), None)
        >>> split, _ = split_by_layer(tx, params, state.opt_state)
        >>> grads = {g: jax.tree.map(jnp.ones_like, group_tree(params, g)) for g in split.groups}
        >>> optimizer = LayerOptimizer(tx, GRPOConfig(max_grad_norm=None))
        >>> fn = dict(optimizer.programs, prepare_apply=optimizer.prepare_apply)
        >>> batch = GRPOBatch.zeros(1, 2, 2, 2).replace(rewards=jnp.array([1.0, 0.0]))
        >>> objective_metrics = {"advantage_signal": jnp.array(1.0)}  # the batch has signal
        >>> (new, _, step), metrics = optimizer.run(fn, split, state, grads, jnp.array(0.0),
        ...                                         objective_metrics, batch)
        >>> new["layers"][1]["w"].tolist(), int(step), round(float(metrics["grad_norm"]) ** 2, 4)
        ([0.5, 0.5], 1, 7.0)
    """

    def __init__(self, tx: optax.GradientTransformation, config: GRPOConfig):
        self._tx = tx

        def grad_sq(grads):
            return _squared_norm(grads)  # as apply_gradients, group by group

        def clip(squares):
            grad_norm = jnp.sqrt(jnp.sum(jnp.stack(squares)))
            if config.max_grad_norm is None:
                return grad_norm, jnp.ones((), jnp.float32)
            return grad_norm, _clip_scale(grad_norm, config.max_grad_norm)

        def check(split, grads, slots, shared, params, scale):
            new_params, new_slots, new_shared = update_function(tx, split)(
                grads, slots, shared, params, scale
            )
            new_state = split.sub_state(new_slots, new_shared)
            return _finite_flags(new_params, new_state, rows_first=_GROUP_ROWS_FIRST)

        def decide(loss, metrics, grad_norm, params_oks, opt_oks, step, batch):
            params_ok = jnp.all(jnp.stack(params_oks))
            opt_ok = jnp.all(jnp.stack(opt_oks))
            apply, metrics = _guard_decision(
                config, batch, loss, grad_norm, params_ok, opt_ok, metrics
            )
            return apply, metrics, step + apply.astype(step.dtype)

        def apply(split, grads, slots, params, shared, scale, flag):
            def updated():
                return update_function(tx, split)(grads, slots, shared, params, scale)

            return jax.lax.cond(flag, updated, lambda: (params, slots, shared))

        self._compiled: set[Any] = set()  # the apply programs' signatures compiled so far
        #: The programs by name (``run`` calls them through a mapping of the same names).
        self.programs: dict[str, Any] = {
            "grad_sq": jit(grad_sq),
            "clip": jit(clip),
            "check": jit(check, static_argnums=0),
            "decide": jit(decide),
            # The group's moments and parameters are donated; the shared scalars (step count,
            # hyperparameters) are read by every group and are not.
            "apply": jit(apply, static_argnums=0, donate_argnums=(2, 3)),
        }

    def prepare_apply(
        self,
        split: LayerSplit,
        grads: Mapping[Group, Any],
        slots: Mapping[Group, Any],
        params: Mapping[Group, Any],
        shared: Any,
        scale: Any,
        flag: Any,
        *,
        wait: concurrent.futures.Future | None = None,
    ) -> None:
        """Compiles the update program for each group structure before any group runs it.

        JAX then runs the calls without compiling, so that no group's program fails to compile
        after another group donated its arrays.

        Args:
            split: The split.
            grads: Each group's gradient.
            slots: Each group's moments.
            params: Each group's parameters.
            shared: The shared optimizer entries.
            scale: The clipping scale.
            flag: Whether to apply.
            wait: A background compilation of the program to wait for first, if any.
        """
        if wait is not None:
            concurrent.futures.wait([wait])
        for g in split.groups:
            args = (grads[g], slots[g], params[g], shared)
            leaves = jax.tree.leaves(args)
            # what JAX's own cache of executables tells apart: types (weak or not), placement
            key = (split, jax.tree.structure(args), tuple(_signature(x) for x in leaves))
            if key not in self._compiled:
                self.programs["apply"].lower(
                    split, grads[g], slots[g], params[g], shared, scale, flag
                ).compile()
                self._compiled.add(key)

    def run(
        self,
        fn: Mapping[str, Callable[..., Any]],
        split: LayerSplit,
        state: GRPOTrainState,
        grads: Mapping[Group, Any],
        loss: Any,
        metrics: Any,
        batch: GRPOBatch,
    ) -> tuple[tuple[Any, Any, Any], Any]:
        """The update: ``((params, opt_state, step), metrics)``, as ``apply_gradients``.

        Args:
            fn: The programs by name (``self.programs`` or wrappers of them: a caller may wait
                for compilations or lower instead of running), and ``prepare_apply``.
            split: The split of ``state``'s parameters and optimizer state.
            state: The state the gradients were taken at (its parameters and moments are
                donated to the last programs).
            grads: Each group's gradient.
            loss: The objective's value.
            metrics: The objective's metrics (``advantage_signal`` among them, which the guard
                reads unless ``update_without_advantage``).
            batch: The batch (for its reward signal).

        Returns:
            The new parameters, optimizer state and step, and the metrics.
        """
        params = {g: group_tree(state.params, g) for g in split.groups}
        slots = {g: split.slots(state.opt_state, g) for g in split.groups}
        shared = split.shared(state.opt_state)
        grad_norm, scale = fn["clip"]([fn["grad_sq"](grads[g]) for g in split.groups])
        flags = [
            fn["check"](split, grads[g], slots[g], shared, params[g], scale) for g in split.groups
        ]
        params_oks, opt_oks = [f[0] for f in flags], [f[1] for f in flags]
        apply, metrics, step = fn["decide"](
            loss, metrics, grad_norm, params_oks, opt_oks, state.step, batch
        )
        _check_donations(split, slots, params)
        fn["prepare_apply"](split, grads, slots, params, shared, scale, apply)
        new_params, new_slots, new_shared = {}, {}, shared
        # Each group's program donates its arrays: the dispatches below are not interrupted
        # halfway (a Ctrl-C waits for the last of them, or, inside an interrupt_scope, for the
        # caller to store the new state).
        with deferred_interrupt():
            for g in split.groups:
                new_params[g], new_slots[g], group_shared = fn["apply"](
                    split, grads[g], slots[g], params[g], shared, scale, apply
                )
                if g == split.groups[-1]:
                    new_shared = group_shared
        new_state = split.assemble_state(new_slots, new_shared)
        return (split.assemble(new_params), new_state, step), metrics


def lower_programs(
    run: Callable[[Any, Any, Mapping[str, Any]], Any],
    programs: Mapping[str, Any],
    state: Any,
    batch: Any,
) -> list[tuple[str, Any]]:
    """Lowers a step made of several programs, in the order it calls them; nothing runs.

    ``run(state, batch, fn)`` is the step's driver, which calls ``fn[name](*args)`` for each
    program; here each call lowers ``programs[name]`` for its arguments and hands on the
    shapes and dtypes of its outputs. ``fn["prepare_apply"]`` does nothing. Every call is
    listed, also a program called again with the same argument types (the per-group programs
    are called once per group); compiling such repeats hits JAX's cache of executables, so
    compiling the whole list compiles each distinct program once.

    Args:
        run: The step's driver.
        programs: The jitted programs by the names ``run`` calls them by.
        state: A train state (only its types are read).
        batch: A batch (only its types are read).

    Returns:
        ``(name, lowered)`` pairs, one per call, in the order of the calls.
    """
    lowered: dict[int, tuple[str, Any]] = {}

    def lowering(name: str, program: Any) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            low = program.lower(*args)
            lowered[id(low)] = (name, low)
            # Without a sharding: the next program gets uncommitted arrays, as when it runs
            # (a struct with the output's sharding lowers to another compiled program).
            return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype), low.out_info)

        return call

    fn = {name: lowering(name, p) for name, p in programs.items()}
    run(state, batch, dict(fn, prepare_apply=lambda *args: None))
    return list(lowered.values())
