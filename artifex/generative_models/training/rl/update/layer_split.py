"""How a parameter tree and its optimizer state split into per-layer groups, and the check.

An optax transformation such as AdamW updates each parameter from its own gradient and moments
and a few scalars (the step count, the hyperparameters). Then the update of one decoder layer's
parameters can be computed on its own (:class:`LayerSplit` says how the parameters and the
optimizer state divide into such groups); running it group by group is
:class:`~artifex.generative_models.training.rl.update.optimizer_split.LayerOptimizer`'s work.

Whether a transformation is separable this way is not declared by optax, so
:func:`split_by_layer` checks it on the transformation's own computation: it traces
``tx.update`` on the whole parameter tree and on one group's sub-tree, and accepts the split only
if, for every group, the operations that produce the group's outputs in the whole update read
only that group's inputs and the shared scalars, and are the same operations, in the same order
and with the same constants, as the group's own update. A transformation that mixes parameters
(``optax.clip_by_global_norm`` inside the chain), treats them by their place in the whole tree
(a mask or label function that reads the layer index), or keeps per-parameter state outside
parameter-shaped trees is refused, and the caller keeps the one-program optimizer. Constants
are compared by value, also those inside nested programs. :class:`SplitDecisions` caches the
answers by the state's types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from artifex.generative_models.training.rl.update.state import _parameter_shaped

__all__ = [
    "LayerSplit",
    "SplitDecisions",
    "split_by_layer",
]

# A group: a decoder layer's index, or None for the parameters outside ``layers``.
Group = int | None


def group_tree(tree: Any, group: Group) -> Any:
    """The part of a parameter-shaped mapping ``tree`` that belongs to ``group``.

    Args:
        tree: A mapping shaped like the parameters (``embed``, ``layers`` -> ``{i: ...}``, ...).
        group: A layer index, or None for everything outside ``layers``.

    Returns:
        ``tree["layers"][group]``, or ``tree`` without its ``layers`` entry (same mapping type).
    """
    if group is not None:
        return tree["layers"][group]
    return type(tree)({k: v for k, v in tree.items() if k != "layers"})


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """How a parameter tree and its optimizer state split into per-layer groups.

    Built by :func:`split_by_layer`, which has checked that the transformation's update of each
    group equals its part of the whole update. The optimizer state is seen as a container whose
    entries are either parameter-shaped trees (Adam's moments: split by group, their buffers
    reused for the update's outputs with the group's parameters) or scalars shared by every
    group (the step count, hyperparameters).

    Attributes:
        groups: The groups: each layer index, then None (the rest) when the rest is not empty.
        node_def: The optimizer state's container, its entries as leaves.
        shaped: For each entry, whether it is parameter-shaped.
        param_def: The parameters' tree structure.
        order: For each group (in the order of ``groups``), the indices of its parameter
            leaves among all parameter leaves, in the order its sub-tree flattens.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl.update.layer_split import split_by_layer
        >>> params = nnx.State({"layers": {0: {"w": jnp.ones(2)}, 1: {"w": jnp.ones(2)}},
        ...                     "head": {"w": jnp.ones(3)}})
        >>> tx = optax.adam(1e-2)
        >>> split, _ = split_by_layer(tx, params, tx.init(params))
        >>> split.groups, len(split), [jnp.shape(m["w"]) for m in split.slots(tx.init(params), 1)]
        ((0, 1, None), 2, [(2,), (2,)])
    """

    groups: tuple[Group, ...]
    node_def: Any
    shaped: tuple[bool, ...]
    param_def: Any
    order: tuple[tuple[int, ...], ...]

    # ---------------------------------------------------------------- splitting
    def entries(self, opt_state: Any) -> list[Any]:
        """The optimizer state's entries (parameter-shaped trees and shared scalars).

        Args:
            opt_state: An optimizer state of the split's structure.

        Returns:
            Its entries, in order.
        """
        return self.node_def.flatten_up_to(opt_state)

    def shared(self, opt_state: Any) -> list[Any]:
        """The entries every group reads (step counts, hyperparameters).

        Args:
            opt_state: An optimizer state of the split's structure.

        Returns:
            Its scalar entries, in order.
        """
        return [n for n, s in zip(self.entries(opt_state), self.shaped, strict=True) if not s]

    def slots(self, opt_state: Any, group: Group) -> list[Any]:
        """The group's parts of the parameter-shaped entries (its moments).

        Args:
            opt_state: An optimizer state of the split's structure.
            group: A layer index, or None for the rest.

        Returns:
            For each parameter-shaped entry, its sub-tree for ``group``.
        """
        return [
            group_tree(n, group)
            for n, s in zip(self.entries(opt_state), self.shaped, strict=True)
            if s
        ]

    def sub_state(self, slots: Sequence[Any], shared: Sequence[Any]) -> Any:
        """A group's optimizer state, from its slots and the shared entries.

        Args:
            slots: The group's parts of the parameter-shaped entries (:meth:`slots`).
            shared: The shared entries (:meth:`shared`).

        Returns:
            The optimizer state's container holding them (what ``tx.update`` takes for the
            group's parameters).
        """
        slots_it, shared_it = iter(slots), iter(shared)
        nodes = [next(slots_it) if s else next(shared_it) for s in self.shaped]
        return self.node_def.unflatten(nodes)

    def unsplit_state(self, sub_state: Any) -> tuple[list[Any], list[Any]]:
        """``(slots, shared)`` of a group's optimizer state (the inverse of :meth:`sub_state`).

        Args:
            sub_state: A group's optimizer state.

        Returns:
            Its parameter-shaped entries and its shared entries.
        """
        nodes = self.node_def.flatten_up_to(sub_state)
        slots = [n for n, s in zip(nodes, self.shaped, strict=True) if s]
        shared = [n for n, s in zip(nodes, self.shaped, strict=True) if not s]
        return slots, shared

    # ---------------------------------------------------------------- assembling
    def assemble(self, pieces: dict[Group, Any]) -> Any:
        """The whole parameter-shaped tree from each group's sub-tree.

        Args:
            pieces: Each group's sub-tree (parameters, gradients or a moment).

        Returns:
            The tree with the parameters' structure.
        """
        leaves: list[Any] = [None] * self.param_def.num_leaves
        for group, order in zip(self.groups, self.order, strict=True):
            for i, leaf in zip(order, jax.tree.leaves(pieces[group]), strict=True):
                leaves[i] = leaf
        return self.param_def.unflatten(leaves)

    def assemble_state(self, slots: dict[Group, list[Any]], shared: Sequence[Any]) -> Any:
        """The whole optimizer state from each group's slots and the shared entries.

        Args:
            slots: Each group's slots (:meth:`slots`).
            shared: The shared entries.

        Returns:
            The optimizer state, with the split's structure.
        """
        per_slot = [self.assemble({g: s[k] for g, s in slots.items()}) for k in range(len(self))]
        return self.sub_state(per_slot, shared)

    def __len__(self) -> int:
        """The number of parameter-shaped entries of the optimizer state."""
        return sum(self.shaped)


def _groups_of(params: Any) -> list[Group]:
    layers = params.get("layers") if hasattr(params, "get") else None
    if layers is None or not hasattr(layers, "keys") or not len(layers):
        return []
    groups: list[Group] = sorted(k for k in layers if isinstance(k, int))
    if len(groups) != len(layers):
        return []
    if any(k != "layers" for k in params):
        groups.append(None)
    return groups


def update_function(
    tx: optax.GradientTransformation, split: LayerSplit
) -> Callable[..., tuple[Any, list[Any], list[Any]]]:
    """``f(grads, slots, shared, params, scale) -> (new_params, new_slots, new_shared)``.

    The clipped update of one group (or of the whole tree, with all of it as one group):
    ``grads * scale``, ``tx.update``, ``optax.apply_updates``.

    Args:
        tx: The optax transformation.
        split: The state's layout.

    Returns:
        The function (pure, traceable).
    """

    def f(grads: Any, slots: list[Any], shared: list[Any], params: Any, scale: jax.Array):
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        updates, new_state = tx.update(grads, split.sub_state(slots, shared), params)
        new_slots, new_shared = split.unsplit_state(new_state)
        return optax.apply_updates(params, updates), new_slots, new_shared

    return f


def split_by_layer(
    tx: optax.GradientTransformation, params: Any, opt_state: Any
) -> tuple[LayerSplit | None, str]:
    """Checks whether ``tx``'s update can run one decoder layer at a time, and how.

    Args:
        tx: The optax transformation.
        params: The trainable parameters (a mapping with ``layers`` -> ``{i: ...}``; arrays
            or ``jax.ShapeDtypeStruct``).
        opt_state: ``tx``'s state for ``params``.

    Returns:
        ``(split, "")`` where the update of every group equals its part of the whole update;
        ``(None, reason)`` otherwise.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl.update.layer_split import split_by_layer
        >>> params = nnx.State({"layers": {0: {"w": jnp.ones(2)}, 1: {"w": jnp.ones(2)}},
        ...                     "head": {"w": jnp.ones(3)}})
        >>> adamw = optax.adamw(1e-2)
        >>> split_by_layer(adamw, params, adamw.init(params))[0] is not None
        True
        >>> clipped = optax.chain(optax.clip_by_global_norm(1.0), adamw)
        >>> split_by_layer(clipped, params, clipped.init(params))[1]
        "the update of group 0 reads other groups' parameters or state"
    """
    groups = _groups_of(params)
    if not groups:
        return None, "the parameters have no per-layer entries (params['layers'][i])"
    p_leaves, p_def = jax.tree.flatten(params)
    shaped = _parameter_shaped(params)
    nodes, node_def = jax.tree.flatten(opt_state, is_leaf=shaped)
    flags = tuple(shaped(n) for n in nodes)
    for node, flag in zip(nodes, flags, strict=True):
        if not flag and jnp.ndim(node) != 0:
            return None, (
                "the optimizer state holds a non-scalar array outside the parameter-shaped "
                f"trees ({jnp.shape(node)})"
            )
    index_params = p_def.unflatten(list(range(len(p_leaves))))
    order = {g: tuple(jax.tree.leaves(group_tree(index_params, g))) for g in groups}
    if sorted(i for g in groups for i in order[g]) != list(range(len(p_leaves))):
        return None, "the groups do not cover every parameter exactly once"
    split = LayerSplit(tuple(groups), node_def, flags, p_def, tuple(order[g] for g in groups))

    def spec(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))

    structs = jax.tree.map(spec, params)
    state_structs = jax.tree.map(spec, opt_state)
    scale = jax.ShapeDtypeStruct((), jnp.float32)
    f = update_function(tx, split)  # the whole tree as one group
    slots_all = [n for n, s in zip(split.entries(state_structs), flags, strict=True) if s]
    shared = split.shared(state_structs)
    try:
        full = jax.make_jaxpr(f)(structs, slots_all, shared, structs, scale)
    except Exception as exc:  # any failure: keep the whole update (its error shows there)
        return None, f"tracing the whole update failed: {exc}"
    if not isinstance(full.out_avals, (list, tuple)):
        return None, "unexpected update output"
    n_p, n_k, n_s = len(p_leaves), sum(flags), len(shared)
    # The leaf positions of each argument and result of ``f`` in the whole update's jaxpr.
    in_grads, in_slots = 0, n_p
    in_shared, in_params = n_p + n_k * n_p, n_p + n_k * n_p + n_s
    out_slots, out_shared = n_p, n_p + n_k * n_p
    if len(full.jaxpr.invars) != in_params + n_p + 1 or len(full.jaxpr.outvars) != out_shared + n_s:
        return None, "the update's state does not keep its structure"
    specs = []  # each group's inputs and outputs, as positions in the whole update's jaxpr
    for g in groups:
        o = order[g]
        ins = (
            [in_grads + i for i in o]
            + [in_slots + k * n_p + i for k in range(n_k) for i in o]
            + list(range(in_shared, in_shared + n_s))
            + [in_params + i for i in o]
            + [in_params + n_p]  # the scale
        )
        outs = (
            list(o)
            + [out_slots + k * n_p + i for k in range(n_k) for i in o]
            + list(range(out_shared, out_shared + n_s))
        )
        specs.append((ins, outs))
    restricted = _Canonical(full).texts(specs)
    own: dict[Any, tuple[str, ...] | None] = {}  # each group's own update, by sub-structure
    for g, text in zip(groups, restricted, strict=True):
        if text is None:
            return None, f"the update of group {g} reads other groups' parameters or state"
        sub = group_tree(structs, g)
        key = jax.tree.structure(sub), tuple(spec(x) for x in jax.tree.leaves(sub))
        if key not in own:
            slots_g = [group_tree(n, g) for n in slots_all]
            try:
                jaxpr = jax.make_jaxpr(update_function(tx, split))(sub, slots_g, shared, sub, scale)
            except Exception as exc:
                return None, f"tracing group {g}'s own update failed: {exc}"
            everything = list(range(len(jaxpr.jaxpr.invars))), list(range(len(jaxpr.jaxpr.outvars)))
            own[key] = _Canonical(jaxpr).texts([everything])[0]
        if own[key] != text:
            return None, f"group {g}'s own update differs from its part of the whole update"
    return split, ""


class SplitDecisions:
    """:func:`split_by_layer`'s answers for one transformation, by the state's types.

    The answer depends on the parameters' and the optimizer state's structure, shapes and
    dtypes (a transformation may be separable by layer for some dtypes and not others), so a
    step handed states of other types (``load_state``, a loop of one's own) asks again for
    each; each answer is computed once.

    Args:
        tx: The optax transformation.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from artifex.generative_models.training.rl.update.layer_split import SplitDecisions
        >>> params = nnx.State({"layers": {0: {"w": jnp.ones(2)}, 1: {"w": jnp.ones(2)}},
        ...                     "head": {"w": jnp.ones(3)}})
        >>> tx = optax.adam(1e-2)
        >>> decisions = SplitDecisions(tx)
        >>> split, reason = decisions(params, tx.init(params))
        >>> split.groups, reason
        ((0, 1, None), '')
    """

    def __init__(self, tx: optax.GradientTransformation):
        self._tx = tx
        self._answers: dict[Any, tuple[LayerSplit | None, str]] = {}

    def __call__(self, params: Any, opt_state: Any) -> tuple[LayerSplit | None, str]:
        """``(split, "")``, or ``(None, reason)``, for states of these types.

        Args:
            params: The trainable parameters (arrays or ``jax.ShapeDtypeStruct``).
            opt_state: The optimizer state for them.

        Returns:
            :func:`split_by_layer`'s answer.
        """
        key = (
            jax.tree.structure(params),
            jax.tree.structure(opt_state),
            tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves((params, opt_state))),
        )
        if key not in self._answers:
            self._answers[key] = split_by_layer(self._tx, params, opt_state)
        return self._answers[key]


def _const_text(value: Any) -> str:
    arr = np.asarray(value)
    return f"const{arr.dtype}{arr.shape}:{arr.tobytes().hex()}"


def _inner_consts_text(param: Any) -> str:
    """The values of the constants of every program inside an equation's parameter."""
    parts: list[str] = []
    stack = [param]
    while stack:
        x = stack.pop()
        if isinstance(x, ClosedJaxpr):
            parts.extend(_const_text(c) for c in x.consts)
            stack.append(x.jaxpr)
        elif isinstance(x, Jaxpr):
            for eqn in reversed(x.eqns):
                stack.extend(reversed(list(eqn.params.values())))
        elif isinstance(x, tuple | list):
            stack.extend(reversed(x))
    return ",".join(parts)


class _Canonical:
    """Texts of the parts of a jaxpr that compute given outputs from given inputs.

    Inputs are named by their position in a part's inputs, intermediate values by their order
    of definition, constants by their value, so two computations print alike exactly when
    they are the same operations on corresponding inputs.
    """

    def __init__(self, closed: Any):
        jaxpr = closed.jaxpr
        self._jaxpr = jaxpr
        self._consts: dict[Any, str] = {}
        for var, value in zip(jaxpr.constvars, closed.consts, strict=True):
            self._consts[var] = _const_text(value)
        # each equation's operation and parameters, printed once for all parts (a parameter
        # that is a program prints its constants' types only: their values are added)
        self._ops = [
            f"{e.primitive.name} "
            f"{sorted((k, repr(v), _inner_consts_text(v)) for k, v in e.params.items())}"
            for e in jaxpr.eqns
        ]
        self._literals: dict[int, str] = {}

    def _literal(self, v: Any) -> str:
        key = id(v)
        if key not in self._literals:
            self._literals[key] = f"lit{v.aval}:{v.val!r}"
        return self._literals[key]

    def texts(self, parts: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple | None]:
        """For each ``(inputs, outputs)`` (positions), its text, or None if it reads others."""
        jaxpr = self._jaxpr
        need: dict[Any, int] = {}  # a bit per part that needs the value
        for bit, (_, outputs) in enumerate(parts):
            for i in outputs:
                v = jaxpr.outvars[i]
                if not isinstance(v, Literal):
                    need[v] = need.get(v, 0) | (1 << bit)
        masks = [0] * len(jaxpr.eqns)
        for index in range(len(jaxpr.eqns) - 1, -1, -1):
            eqn = jaxpr.eqns[index]
            mask = 0
            for v in eqn.outvars:
                mask |= need.get(v, 0)
            if mask:
                masks[index] = mask
                for v in eqn.invars:
                    if not isinstance(v, Literal):
                        need[v] = need.get(v, 0) | mask
        return [self._text(bit, ins, outs, masks) for bit, (ins, outs) in enumerate(parts)]

    def _text(
        self, bit: int, inputs: Sequence[int], outputs: Sequence[int], masks: list[int]
    ) -> tuple | None:
        jaxpr = self._jaxpr
        names: dict[Any, str] = dict(self._consts)
        names.update({jaxpr.invars[i]: f"in{k}" for k, i in enumerate(inputs)})

        def name(v: Any) -> str | None:
            return self._literal(v) if isinstance(v, Literal) else names.get(v)

        lines: list[str] = []
        count = 0
        for index, eqn in enumerate(jaxpr.eqns):
            if not masks[index] >> bit & 1:
                continue
            args = [name(v) for v in eqn.invars]
            if None in args:
                return None  # an input outside the part
            outs = []
            for v in eqn.outvars:
                names[v] = f"v{count}"
                count += 1
                outs.append(names[v])
            lines.append(f"{self._ops[index]} {args} -> {outs}")
        results = [name(jaxpr.outvars[i]) for i in outputs]
        if None in results:
            return None
        lines.append(f"return {results}")
        return tuple(lines)
