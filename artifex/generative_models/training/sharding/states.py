"""Placing model and optimizer states on a mesh by the partition rules.

Part of the package :mod:`artifex.generative_models.training.sharding`, which re-exports
every public name (see its docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from artifex.generative_models.training.sharding.mesh import check_mesh
from artifex.generative_models.training.sharding.rules import PartitionRules, _as_rules

__all__ = [
    "shard_model",
    "shard_optimizer",
    "state_partition_specs",
    "state_shardings",
]


def path_parts(keypath: tuple[Any, ...]) -> tuple[Any, ...]:
    """The keys, attribute names and indices of a pytree key path, as plain values."""
    parts = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(k.key)
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(k.idx)
        else:
            parts.append(getattr(k, "key", k))
    return tuple(parts)


def _annotation(var: Any) -> PartitionSpec | None:
    if not isinstance(var, nnx.Variable):
        return None
    if not var.get_metadata().get("out_sharding"):
        return None
    return spmd.get_var_pspec(var)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _map_vars(fn: Callable[[tuple[Any, ...], Any, Any], Any], tree: Any) -> Any:
    """Maps ``fn(path_parts, variable_or_array, value)`` over a state; keeps Variable boxes."""

    def leaf(keypath: tuple[Any, ...], x: Any) -> Any:
        parts = path_parts(keypath)
        if isinstance(x, nnx.Variable):
            return x.replace(fn(parts, x, x.get_value()))
        if hasattr(x, "shape"):
            return fn(parts, None, x)
        return x

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=_is_var)


def _flat_vars(tree: Any) -> list[tuple[tuple[Any, ...], Any, Any]]:
    """``(path_parts, variable or None, value)`` for every array (or spec) of a state."""
    out = []
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_var)
    for keypath, x in flat:
        if isinstance(x, nnx.Variable):
            out.append((path_parts(keypath), x, x.get_value()))
        else:
            out.append((path_parts(keypath), None, x))
    return out


def state_partition_specs(
    tree: Any, mesh: Mesh, rules: PartitionRules | Sequence[tuple[str, Any]] | None = None
) -> Any:
    """``PartitionSpec`` of every array of a module or state under ``rules`` (see the class).

    Args:
        tree: An NNX module, an ``nnx.State`` or any pytree of (Variable-boxed) arrays.
        mesh: The mesh.
        rules: :class:`PartitionRules` or ``(regex, spec)`` pairs; default ``PartitionRules()``.

    Returns:
        The tree (the module's state for a module) with each array replaced by its spec.

    Raises:
        ValueError: The rules or an annotation name an axis the mesh does not have.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.training import make_mesh, state_partition_specs
        >>> mesh = make_mesh(data=1, fsdp=2, devices=jax.devices()[:2])  # 2 devices
        >>> specs = state_partition_specs(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), mesh)
        >>> specs["kernel"].get_value(), specs["bias"].get_value()
        (P('fsdp', None), P(None,))
    """
    check_mesh(mesh, "state_partition_specs")
    rules = _as_rules(rules).validate(mesh)
    state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree

    def spec(parts: tuple[Any, ...], var: Any, value: Any) -> PartitionSpec:
        path = ".".join(str(p) for p in parts)
        shape, annotation = np.shape(value), _annotation(var)
        if var is not None and var.get_metadata().get("stacked_layers") and len(shape) >= 1:
            # A stack of layer weights (CausalLM.stack_layers): sharded as one layer is, with
            # the leading layer axis unsharded.
            inner = None if annotation is None else PartitionSpec(*tuple(annotation)[1:])
            return PartitionSpec(None, *rules.spec(path, shape[1:], mesh, inner))
        return rules.spec(path, shape, mesh, annotation)

    return _map_vars(spec, state)


def state_shardings(
    tree: Any, mesh: Mesh, rules: PartitionRules | Sequence[tuple[str, Any]] | None = None
) -> Any:
    """``NamedSharding`` of every array of a module or state (:func:`state_partition_specs`).

    Args:
        tree: An NNX module, an ``nnx.State`` or a pytree of arrays.
        mesh: The mesh.
        rules: :class:`PartitionRules` or ``(regex, spec)`` pairs; default ``PartitionRules()``.

    Returns:
        The tree with each array replaced by its ``NamedSharding``.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.training import make_mesh, state_shardings
        >>> mesh = make_mesh(data=1, fsdp=2, devices=jax.devices()[:2])  # 2 devices
        >>> shardings = state_shardings(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), mesh)
        >>> shardings["kernel"].spec, shardings["kernel"].mesh is mesh
        (P('fsdp', None), True)
    """
    specs = state_partition_specs(tree, mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def _put(x: Any, sharding: NamedSharding) -> Any:
    """``x`` with ``sharding``; across processes, built from the full host value of ``x``."""
    if getattr(x, "sharding", None) == sharding:
        return x
    local = not isinstance(x, jax.Array) or x.is_fully_addressable
    if (
        sharding.is_fully_addressable
        or not local
        or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ):
        return jax.device_put(x, sharding)
    # Several processes: each holds the same full value and keeps only its own shards.
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _place(module: nnx.Module, shardings: Any) -> None:
    nnx.update(module, jax.tree.map(_put, nnx.state(module), shardings))


def shard_model(
    model: nnx.Module, mesh: Mesh, rules: PartitionRules | Sequence[tuple[str, Any]] | None = None
) -> nnx.Module:
    """Places every array of ``model`` (a policy or a reference) on ``mesh``, in place.

    Each array gets ``NamedSharding(mesh, spec)`` with the spec from
    :func:`state_partition_specs`. In several processes every process must hold the same full
    values (``jax.device_put`` then keeps only this process's shards).

    Args:
        model: The NNX module.
        mesh: The mesh.
        rules: :class:`PartitionRules` or ``(regex, spec)`` pairs; default ``PartitionRules()``.

    Returns:
        ``model`` (the same object), now sharded.

    Raises:
        TypeError: ``model`` is not an NNX module or ``mesh`` not a ``Mesh``.
        ValueError: The rules or an annotation name an axis the mesh does not have.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.training import make_mesh, shard_model
        >>> mesh = make_mesh(data=1, fsdp=2, devices=jax.devices()[:2])  # 2 devices
        >>> model = shard_model(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), mesh)
        >>> model.kernel[...].sharding.spec, len(model.kernel[...].addressable_shards)
        (P('fsdp', None), 2)
    """
    if not isinstance(model, nnx.Module):
        msg = f"shard_model: model must be an nnx.Module, got {type(model).__name__}"
        raise TypeError(msg)
    _place(model, state_shardings(model, mesh, rules))
    return model


def shard_optimizer(
    optimizer: nnx.Optimizer,
    model: nnx.Module,
    mesh: Mesh,
    rules: PartitionRules | Sequence[tuple[str, Any]] | None = None,
) -> nnx.Optimizer:
    """Places an ``nnx.Optimizer``'s state on ``mesh`` following the parameters of ``model``.

    Every optimizer array whose path ends with a parameter's path and has that parameter's
    shape (Adam's ``mu`` and ``nu``, momentum, ...) gets the parameter's spec (as
    :func:`state_partition_specs` computes it for ``model``); every other array (the step,
    ``count``, factored statistics) is replicated.

    Args:
        optimizer: The optimizer built on ``model``.
        model: The model whose parameters the optimizer updates.
        mesh: The mesh.
        rules: The rules used for ``model``.

    Returns:
        ``optimizer`` (the same object), now sharded.

    Raises:
        TypeError: ``optimizer`` is not an ``nnx.Optimizer``.
        ValueError: The rules or an annotation name an axis the mesh does not have.

    Examples:
        >>> import jax, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training import make_mesh, shard_model, shard_optimizer
        >>> mesh = make_mesh(data=1, fsdp=2, devices=jax.devices()[:2])  # 2 devices
        >>> model = shard_model(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), mesh)
        >>> optimizer = shard_optimizer(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
        ...                             model, mesh)
        >>> optimizer.opt_state[0].mu["kernel"][...].sharding.spec
        P('fsdp', None)
    """
    if not isinstance(optimizer, nnx.Optimizer):
        msg = f"shard_optimizer: optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}"
        raise TypeError(msg)
    shapes = {parts: np.shape(value) for parts, _, value in _flat_vars(nnx.state(model))}
    param_specs = {
        parts: (spec, tuple(shapes[parts]))
        for parts, _, spec in _flat_vars(state_partition_specs(model, mesh, rules))
    }

    def follow(parts: tuple[Any, ...], var: Any, value: Any) -> NamedSharding:
        shape = tuple(np.shape(value))
        for k in range(len(parts)):
            hit = param_specs.get(parts[k:])
            if hit is not None and hit[1] == shape:
                return NamedSharding(mesh, hit[0])
        return NamedSharding(mesh, PartitionSpec())

    _place(optimizer, _map_vars(follow, nnx.state(optimizer)))
    return optimizer
