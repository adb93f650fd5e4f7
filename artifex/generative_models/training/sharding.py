r"""Scale-out through ``jax.sharding``: the mesh, partition rules, and batch sharding.

The same compiled functions run on one device or on a mesh; only where the arrays live changes
(GSPMD propagates the shardings through the step and inserts the collectives). This module
decides where they live:

- :func:`make_mesh` builds a ``Mesh`` with the named axes ``("data", "fsdp", "tensor")`` (any of
  size 1) in GSPMD (``AxisType.Auto``) mode, and ``"expert"`` before ``"tensor"`` for expert
  parallelism of mixture-of-experts models (``make_mesh(expert=n)``, with :data:`MOE_RULES`).
- :class:`PartitionRules` maps a parameter path (``"layers.0.attn.q_proj.kernel"``, as
  :func:`~artifex.generative_models.models.causal_lm.hf_io.param_path_str` writes it) and shape
  to a ``PartitionSpec``: Megatron-style tensor parallelism over ``"tensor"``
  (:data:`CAUSAL_LM_RULES`), plus FSDP (ZeRO-3) sharding of every large parameter over
  ``"fsdp"``.
- :func:`shard_model` and :func:`shard_optimizer` place a model and its ``nnx.Optimizer`` state
  (Adam's ``mu``/``nu`` follow their parameter; scalars are replicated).
- :func:`shard_batch` splits a :class:`~artifex.generative_models.training.rl.batch.GRPOBatch`
  (or any pytree of row-major arrays) along its rows over ``("data", "fsdp")`` together.

Tensor parallelism (Shoeybi et al., 2019): for a block ``y = (\sigma(x W_1)) W_2`` the first
matrix is split by columns (column-parallel: q/k/v, gate/up), the second by rows (row-parallel:
o, down), so ``y = \sum_i \sigma(x W_1^{(i)}) W_2^{(i)}`` needs one all-reduce per block. FSDP
(Rajbhandari et al., 2020) stores ``1/n`` of every large parameter and its optimizer state on each
of the ``n`` devices of ``"fsdp"`` and all-gathers a parameter where it is used; the batch is split
over ``"fsdp"`` too, so FSDP is also data parallelism.

**Batch layout.** Rows stay contiguous and prompt-major (row ``i`` belongs to prompt ``i // G``,
generation ``i % G``): with ``S = data * fsdp`` data shards, shard ``s`` holds rows
``[s B/S, (s+1) B/S)``, so when the number of groups is a multiple of ``S`` every group lies on
one shard. A batch whose rows are not a multiple of ``S`` is an error (no silent padding).

**Multi-host.** Every process calls :func:`initialize_distributed` (or
``jax.distributed.initialize()``) first, builds the mesh over all devices with
:func:`make_mesh` and shards the same model with the same rules; it then loads only its rows of
the global batch (:func:`process_row_range`) and calls ``shard_batch(local_batch, mesh,
process_local=True)``; :func:`local_rows` is the way back. The Sharding guide
(``docs/sharding.md``) covers the whole multi-process loop.

References:
    Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
    Model Parallelism", arXiv:1909.08053. Rajbhandari et al., 2020, "ZeRO: Memory Optimizations
    Toward Training Trillion Parameter Models", arXiv:1910.02054. Xu et al., 2021, "GSPMD:
    General and Scalable Parallelization for ML Computation Graphs", arXiv:2105.04663.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from flax.nnx import spmd
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from artifex.generative_models.training.logging import is_primary_process
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "CAUSAL_LM_RULES",
    "DATA_AXES",
    "MESH_AXES",
    "MOE_RULES",
    "PartitionRules",
    "batch_partition_spec",
    "current_mesh",
    "host_array",
    "initialize_distributed",
    "is_primary_process",
    "local_rows",
    "make_mesh",
    "num_data_shards",
    "process_row_range",
    "rows_to_global",
    "shard_batch",
    "shard_model",
    "shard_optimizer",
    "state_partition_specs",
    "state_shardings",
]

T = TypeVar("T")

#: Names of the mesh axes, outermost first.
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")
#: The axes a batch is split over (its rows), together (those the mesh has; ``"expert"`` only
#: on a mesh made with ``make_mesh(expert=n)``, where it is data parallel outside the experts).
DATA_AXES: tuple[str, ...] = ("data", "fsdp", "expert")

_COLUMN = r"(q_proj|k_proj|v_proj|gate_proj|up_proj)"
_ROW = r"(o_proj|down_proj)"

#: Megatron-style tensor-parallel rules for the causal LM's parameter paths (first match wins;
#: unmatched parameters are replicated over ``"tensor"``). Kernels are ``(in, out)``.
CAUSAL_LM_RULES: tuple[tuple[str, PartitionSpec], ...] = (
    # Column-parallel: output features over "tensor" (with their biases and LoRA B (r, out)).
    (rf"(^|\.){_COLUMN}\.kernel$", PartitionSpec(None, "tensor")),
    (rf"(^|\.){_COLUMN}\.bias$", PartitionSpec("tensor")),
    (rf"(^|\.){_COLUMN}\.lora\.lora_b$", PartitionSpec(None, "tensor")),
    # Row-parallel: input features over "tensor" (and LoRA A (in, r)); outputs are all-reduced.
    (rf"(^|\.){_ROW}\.kernel$", PartitionSpec("tensor", None)),
    (rf"(^|\.){_ROW}\.lora\.lora_a$", PartitionSpec("tensor", None)),
    # Vocabulary-parallel embedding (V, D) and output head (D, V).
    (r"(^|\.)embed\.embedding$", PartitionSpec("tensor", None)),
    (r"(^|\.)lm_head\.kernel$", PartitionSpec(None, "tensor")),
)

#: Expert parallelism for mixture-of-experts layers (Qwen3-MoE): the stacked expert weights
#: ``(E, D, I)`` / ``(E, I, D)`` split over ``"expert"`` by expert, and each expert
#: Megatron-style over ``"tensor"`` (gate/up by columns, down by rows). For a mesh made with
#: ``make_mesh(expert=n)``: ``PartitionRules(rules=MOE_RULES + CAUSAL_LM_RULES)``. The router
#: (``mlp.gate.kernel``) stays replicated (FSDP may split it).
MOE_RULES: tuple[tuple[str, PartitionSpec], ...] = (
    (r"(^|\.)experts\.(gate_proj|up_proj)$", PartitionSpec("expert", None, "tensor")),
    (r"(^|\.)experts\.down_proj$", PartitionSpec("expert", "tensor", None)),
)


# ------------------------------------------------------------------------------ processes
# ------------------------------------------------------------------------------ the mesh
def make_mesh(
    data: int | None = None,
    fsdp: int = 1,
    tensor: int = 1,
    *,
    expert: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a ``Mesh`` with axes ``("data", "fsdp", "tensor")`` over the given devices.

    With ``expert`` the axes are ``("data", "fsdp", "expert", "tensor")``: the experts of
    mixture-of-experts layers are split over ``"expert"`` (see :data:`MOE_RULES`) and the
    batch's rows over ``"data"``, ``"fsdp"`` and ``"expert"`` (outside the experts,
    ``"expert"`` is one more data-parallel axis).

    ``data * fsdp * tensor`` (times ``expert``) must equal the number of devices. The axes are
    of type ``AxisType.Auto`` (GSPMD propagation; ``jax.make_mesh`` otherwise defaults to explicit
    sharding, which the model code is not written for). Device order follows
    ``jax.make_mesh`` (topology-aware on TPU/GPU; by process, so each process's devices form
    contiguous data shards).

    Args:
        data: Size of the pure data-parallel axis; ``None`` uses all devices left over by
            ``fsdp * tensor`` (by default every device is on ``"data"``).
        fsdp: Size of the FSDP axis (parameters and optimizer state split ``1/fsdp``; the batch
            is split over it as well).
        tensor: Size of the tensor-parallel axis (Megatron-style).
        expert: Size of the expert-parallel axis, or ``None`` for a mesh without one.
        devices: Devices to use (default: ``jax.devices()``, all processes' devices).

    Returns:
        The mesh.

    Raises:
        ValueError: An axis size is not a positive int, or the product of the sizes is not
            the number of devices.

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training import make_mesh
        >>> mesh = make_mesh(devices=jax.devices()[:1])  # every device on "data"
        >>> dict(mesh.shape)
        {'data': 1, 'fsdp': 1, 'tensor': 1}
        >>> dict(make_mesh(data=2, fsdp=2, devices=jax.devices()[:4]).shape)  # needs 4 devices
        {'data': 2, 'fsdp': 2, 'tensor': 1}
        >>> dict(make_mesh(data=1, expert=2, devices=jax.devices()[:2]).shape)  # 2 devices
        {'data': 1, 'fsdp': 1, 'expert': 2, 'tensor': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name, size in (("fsdp", fsdp), ("tensor", tensor), ("data", data), ("expert", expert)):
        if size is None:
            continue
        check_int(f"make_mesh: {name}", size, minimum=1)
    ep = 1 if expert is None else int(expert)
    if data is None:
        if n % (fsdp * tensor * ep):
            msg = (
                f"make_mesh: fsdp * tensor = {fsdp} * {tensor} = {fsdp * tensor} does not divide "
                f"the {n} devices"
            )
            if expert is not None:
                msg = (
                    f"make_mesh: fsdp * expert * tensor = {fsdp} * {ep} * {tensor} = "
                    f"{fsdp * ep * tensor} does not divide the {n} devices"
                )
            raise ValueError(msg)
        data = n // (fsdp * tensor * ep)
    if data * fsdp * tensor * ep != n:
        msg = (
            f"make_mesh: data * fsdp * tensor = {data} * {fsdp} * {tensor} = "
            f"{data * fsdp * tensor} must equal the number of devices, {n}"
        )
        if expert is not None:
            msg = (
                f"make_mesh: data * fsdp * expert * tensor = {data} * {fsdp} * {ep} * {tensor} = "
                f"{data * fsdp * ep * tensor} must equal the number of devices, {n}"
            )
        raise ValueError(msg)
    if expert is not None:
        shape = (int(data), int(fsdp), ep, int(tensor))
        axes = ("data", "fsdp", "expert", "tensor")
        return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * 4, devices=devices)
    shape = (int(data), int(fsdp), int(tensor))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def current_mesh() -> Mesh | None:
    """The concrete mesh set with ``jax.set_mesh(mesh)`` (as a context or globally), if any.

    Returns:
        The mesh, or ``None`` when no mesh is set.

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training import current_mesh, make_mesh
        >>> mesh = make_mesh(devices=jax.devices()[:1])
        >>> current_mesh() is None
        True
        >>> with jax.set_mesh(mesh):
        ...     current_mesh() is mesh
        True
    """
    mesh = jax.sharding.get_mesh()
    return None if mesh.empty else mesh


def _check_mesh(mesh: Any, where: str) -> None:
    if not isinstance(mesh, Mesh):
        msg = f"{where}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}"
        raise TypeError(msg)
    for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True):
        if kind != AxisType.Auto:
            msg = (
                f"{where}: mesh axis {name!r} is {kind}, but the model code relies on GSPMD "
                "propagation (AxisType.Auto); build the mesh with make_mesh(...) or "
                "jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)"
            )
            raise ValueError(msg)


# ------------------------------------------------------------------------------ rules
def _entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes named by one entry of a ``PartitionSpec`` (None, a name or a tuple)."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    return tuple(a for entry in spec for a in _entry_axes(entry))


def _check_axes(spec: PartitionSpec, mesh: Mesh, what: str) -> None:
    for axis in _spec_axes(spec):
        if axis not in mesh.axis_names:
            msg = (
                f"{what} names mesh axis {axis!r}, which the mesh does not have "
                f"(mesh axes: {tuple(mesh.axis_names)})"
            )
            raise ValueError(msg)


def _fit(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh, what: str) -> list[Any]:
    """``spec`` padded to ``len(shape)``; size-1 axes and non-dividing entries dropped."""
    if len(spec) > len(shape):
        msg = f"{what}: spec {spec} has {len(spec)} entries but the array has shape {shape}"
        raise ValueError(msg)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for i, entry in enumerate(entries):
        axes = tuple(a for a in _entry_axes(entry) if mesh.shape[a] > 1)  # size 1: no-op
        if not axes or shape[i] % math.prod(mesh.shape[a] for a in axes):
            entries[i] = None  # documented fallback: replicate this dimension
        else:
            entries[i] = axes[0] if len(axes) == 1 else axes
    return entries


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PartitionRules:
    """How parameters are laid out on a mesh: regex rules, FSDP and annotations.

    For a variable at dotted ``path`` with ``shape``:

    1. If it carries a sharding annotation (``nnx.with_partitioning`` or ``out_sharding``
       metadata, resolved through Flax's logical-axis rules when set) and
       ``use_annotations``, that spec is used as is (no FSDP is added).
    2. Otherwise the first rule whose regular expression matches (``re.search``) gives the
       spec; no match means replicated. Then, if the mesh has ``fsdp_axis`` of size ``n > 1``
       and the parameter has at least ``fsdp_min_size`` elements, the largest dimension that
       is still unsharded and divisible by ``n`` is sharded over ``fsdp_axis``.
    3. Axes of size 1 are dropped from the spec (they shard nothing, and FSDP may then take
       that dimension), and so are entries whose mesh axes do not divide their dimension
       (that dimension is replicated) rather than raising.

    Rules that name an axis the mesh does not have raise ``ValueError`` (at :meth:`bind`).

    Attributes:
        rules: ``(regex, PartitionSpec)`` pairs, first match wins (a tuple spec is converted);
            default :data:`CAUSAL_LM_RULES` (Megatron-style over ``"tensor"``).
        fsdp_axis: Mesh axis for FSDP, or ``None`` to disable FSDP.
        fsdp_min_size: Parameters with fewer elements are not FSDP-sharded.
        use_annotations: Whether variables' own sharding annotations take precedence.

    Raises:
        ValueError: Naming the field: an invalid regular expression or spec, or a negative
            ``fsdp_min_size``.

    Examples:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> from flax import nnx
        >>> from artifex.generative_models.training import (
        ...     PartitionRules, make_mesh, state_partition_specs)
        >>> mesh = make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4])  # 4 devices
        >>> model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
        >>> rules = PartitionRules(rules=((r"kernel$", P(None, "tensor")),), fsdp_min_size=1024)
        >>> specs = state_partition_specs(model, mesh, rules)
        >>> specs["kernel"].get_value()  # the tensor rule, then FSDP on the free dimension
        P('fsdp', 'tensor')
        >>> specs["bias"].get_value()  # no rule, too small for FSDP: replicated
        P(None,)

    References:
        Shoeybi et al., 2019, arXiv:1909.08053 (tensor parallelism); Rajbhandari et al.,
        2020, arXiv:1910.02054 (ZeRO-3 / FSDP).
    """

    rules: tuple[tuple[str, PartitionSpec], ...] = CAUSAL_LM_RULES
    fsdp_axis: str | None = "fsdp"
    fsdp_min_size: int = 1024
    use_annotations: bool = True

    def __post_init__(self) -> None:
        converted = []
        for i, rule in enumerate(self.rules):
            if not isinstance(rule, tuple | list) or len(rule) != 2:
                msg = (
                    f"PartitionRules.rules[{i}] must be a (regex, PartitionSpec) pair, got {rule!r}"
                )
                raise ValueError(msg)
            pattern, spec = rule
            try:
                re.compile(pattern)
            except (re.error, TypeError) as err:
                msg = f"PartitionRules.rules[{i}]: invalid regular expression {pattern!r} ({err})"
                raise ValueError(msg) from err
            if not isinstance(spec, PartitionSpec):
                if not isinstance(spec, tuple | list):
                    msg = f"PartitionRules.rules[{i}]: spec must be a PartitionSpec, got {spec!r}"
                    raise ValueError(msg)
                spec = PartitionSpec(*spec)
            converted.append((pattern, spec))
        object.__setattr__(self, "rules", tuple(converted))
        if self.fsdp_axis is not None and not isinstance(self.fsdp_axis, str):
            msg = (
                f"PartitionRules.fsdp_axis must be a mesh axis name or None, got {self.fsdp_axis!r}"
            )
            raise ValueError(msg)
        size = self.fsdp_min_size
        check_int("PartitionRules.fsdp_min_size", size, minimum=0)

    def validate(self, mesh: Mesh) -> PartitionRules:
        """Checks that every axis the rules name exists in ``mesh``.

        Args:
            mesh: The mesh.

        Returns:
            ``self``, for chaining.

        Raises:
            ValueError: Naming the unknown axis and the rule.
        """
        for pattern, spec in self.rules:
            _check_axes(spec, mesh, f"partition rule {pattern!r} -> {spec}")
        if self.fsdp_axis is not None and self.fsdp_axis not in mesh.axis_names:
            msg = (
                f"PartitionRules.fsdp_axis names mesh axis {self.fsdp_axis!r}, which the mesh "
                f"does not have (mesh axes: {tuple(mesh.axis_names)}); pass fsdp_axis=None"
            )
            raise ValueError(msg)
        return self

    def spec(
        self,
        path: str,
        shape: Sequence[int],
        mesh: Mesh,
        annotation: PartitionSpec | None = None,
    ) -> PartitionSpec:
        """The ``PartitionSpec`` of one parameter (steps 1 to 3 of the class docstring).

        Args:
            path: Dotted parameter path, e.g. ``"layers.0.mlp.up_proj.kernel"``.
            shape: The parameter's shape.
            mesh: The mesh (gives axis sizes for the divisibility fallback and FSDP).
            annotation: The variable's own annotation, if it has one.

        Returns:
            A spec with one entry per dimension.

        Raises:
            ValueError: The spec names an unknown axis or has more entries than ``shape`` has
                dimensions.
        """
        shape = tuple(int(s) for s in shape)
        if annotation is not None and self.use_annotations:
            _check_axes(annotation, mesh, f"sharding annotation of {path!r}")
            return PartitionSpec(*_fit(annotation, shape, mesh, f"annotation of {path!r}"))
        spec, where = PartitionSpec(), "default"
        for pattern, rule_spec in self.rules:
            if re.search(pattern, path):
                spec, where = rule_spec, f"rule {pattern!r}"
                break
        _check_axes(spec, mesh, f"partition {where} (for {path!r})")
        entries = _fit(spec, shape, mesh, f"{path!r} ({where})")
        axis = self.fsdp_axis
        if axis is not None:
            _check_axes(PartitionSpec(axis), mesh, "PartitionRules.fsdp_axis")
            n = mesh.shape[axis]
            used = _spec_axes(PartitionSpec(*entries))
            if n > 1 and axis not in used and math.prod(shape) >= self.fsdp_min_size:
                free = [i for i, e in enumerate(entries) if e is None and shape[i] % n == 0]
                if free:
                    largest = max(free, key=lambda i: (shape[i], -i))
                    entries[largest] = axis
        return PartitionSpec(*entries)

    def bind(self, mesh: Mesh) -> Callable[[str, tuple[int, ...]], PartitionSpec]:
        """The ``rules(path, shape) -> PartitionSpec`` hook of ``from_pretrained`` for ``mesh``.

        Args:
            mesh: The mesh.

        Returns:
            The function.

        Raises:
            ValueError: The rules name an axis the mesh does not have.

        Examples:
            >>> import jax
            >>> from artifex.generative_models.models.causal_lm import CausalLM
            >>> from artifex.generative_models.training import PartitionRules, make_mesh
            >>> mesh = make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4])  # 4 devices
            >>> rules = PartitionRules().bind(mesh)
            >>> rules("layers.0.mlp.up_proj.kernel", (32, 64))  # column-parallel, then FSDP
            P('fsdp', 'tensor')
            >>> path = "tests/fixtures/qwen2_tiny"  # from the repository root
            >>> model = CausalLM.from_pretrained(path, mesh=mesh, rules=rules)
            >>> model.layers[0].mlp.up_proj.kernel.sharding.spec
            P('fsdp', 'tensor')
        """
        _check_mesh(mesh, "PartitionRules.bind")
        self.validate(mesh)

        def rules(path: str, shape: tuple[int, ...]) -> PartitionSpec:
            return self.spec(path, shape, mesh)

        return rules


def _as_rules(rules: PartitionRules | Sequence[tuple[str, Any]] | None) -> PartitionRules:
    if rules is None:
        return PartitionRules()
    if isinstance(rules, PartitionRules):
        return rules
    if isinstance(rules, str) or not isinstance(rules, Sequence):
        msg = (
            "partition rules must be a PartitionRules or a sequence of (regex, PartitionSpec) "
            f"pairs, got {type(rules).__name__}"
        )
        raise TypeError(msg)
    return PartitionRules(rules=tuple(rules))


# ------------------------------------------------------------------------------ states
def _path_parts(keypath: tuple[Any, ...]) -> tuple[Any, ...]:
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
        parts = _path_parts(keypath)
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
            out.append((_path_parts(keypath), x, x.get_value()))
        else:
            out.append((_path_parts(keypath), None, x))
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
    _check_mesh(mesh, "state_partition_specs")
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


# ------------------------------------------------------------------------------ batches
def _data_axes(mesh: Mesh, data_axes: Sequence[str] | None) -> tuple[str, ...]:
    if data_axes is None:
        axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
        if not axes:
            msg = (
                f"the mesh has none of the data axes {DATA_AXES} (mesh axes: "
                f"{tuple(mesh.axis_names)}); pass data_axes="
            )
            raise ValueError(msg)
        return axes
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    _check_axes(PartitionSpec(axes), mesh, f"data_axes={axes}")
    return axes


def num_data_shards(mesh: Mesh, data_axes: Sequence[str] | None = None) -> int:
    """How many row shards a batch is split into: the product of the data axes' sizes.

    Args:
        mesh: The mesh.
        data_axes: Axes the rows are split over (default: those of ``("data", "fsdp")`` the
            mesh has).

    Returns:
        ``S = prod(mesh.shape[a] for a in data_axes)``.

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training import make_mesh, num_data_shards
        >>> mesh = make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])  # 8 devices
        >>> num_data_shards(mesh), num_data_shards(mesh, data_axes=("data",))
        (4, 2)
    """
    return math.prod(mesh.shape[a] for a in _data_axes(mesh, data_axes))


def batch_partition_spec(mesh: Mesh, data_axes: Sequence[str] | None = None) -> PartitionSpec:
    """The spec of a row-major batch array: rows over the data axes together, rest replicated.

    Args:
        mesh: The mesh.
        data_axes: Axes the rows are split over (default: ``("data", "fsdp")`` as present).

    Returns:
        ``PartitionSpec(("data", "fsdp"))``.

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training import batch_partition_spec, make_mesh
        >>> mesh = make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])  # 4 devices
        >>> batch_partition_spec(mesh), batch_partition_spec(mesh, data_axes=("data",))
        (P(('data', 'fsdp'),), P('data',))
    """
    return PartitionSpec(_data_axes(mesh, data_axes))


def _local_shards(sharding: NamedSharding, rows: int) -> list[tuple[int, int]]:
    """Distinct ``(start, stop)`` row ranges this process's devices hold, in row order."""
    ranges = set()
    for index in sharding.addressable_devices_indices_map((rows,)).values():
        sl = index[0]
        ranges.add((sl.start or 0, rows if sl.stop is None else sl.stop))
    return sorted(ranges)


def process_row_range(
    num_rows: int, mesh: Mesh, data_axes: Sequence[str] | None = None
) -> tuple[int, int]:
    """The contiguous rows ``[start, stop)`` of a global batch that this process feeds.

    With :func:`make_mesh` the data shards of one process are contiguous, so each process
    loads ``global_batch[start:stop]`` (whole groups when ``num_groups`` is a multiple of the
    number of processes) and passes it to ``shard_batch(..., process_local=True)``.

    Args:
        num_rows: Rows ``B`` of the global batch.
        mesh: The mesh.
        data_axes: Axes the rows are split over (default: ``("data", "fsdp")`` as present).

    Returns:
        ``(start, stop)``; ``(0, num_rows)`` in a single process.

    Raises:
        ValueError: ``num_rows`` is not a multiple of the number of data shards, or this
            process's shards are not contiguous (a hand-built mesh).

    Examples:
        >>> import jax
        >>> from artifex.generative_models.training import make_mesh, process_row_range
        >>> process_row_range(16, make_mesh(data=2, devices=jax.devices()[:2]))  # one process
        (0, 16)
    """
    shards = num_data_shards(mesh, data_axes)
    if num_rows % shards:
        msg = (
            f"a batch of {num_rows} rows cannot be split evenly over {shards} data shards "
            f"({_axes_desc(mesh, data_axes)})"
        )
        raise ValueError(msg)
    sharding = NamedSharding(mesh, batch_partition_spec(mesh, data_axes))
    ranges = _local_shards(sharding, num_rows)
    for (_, stop), (start, _) in itertools.pairwise(ranges):
        if stop != start:
            msg = (
                f"this process's data shards {ranges} are not contiguous rows; build the mesh "
                "with make_mesh (devices ordered by process)"
            )
            raise ValueError(msg)
    return ranges[0][0], ranges[-1][1]


def _axes_desc(mesh: Mesh, data_axes: Sequence[str] | None) -> str:
    return " * ".join(f"{a}={mesh.shape[a]}" for a in _data_axes(mesh, data_axes))


def shard_batch(
    batch: T,
    mesh: Mesh,
    *,
    process_local: bool = False,
    data_axes: Sequence[str] | None = None,
) -> T:
    """Splits a batch's rows over the data axes of ``mesh``, in contiguous blocks, in order.

    Every array's leading dimension (rows) is sharded over ``data_axes`` together
    (``PartitionSpec(("data", "fsdp"))``), the rest replicated, so shard ``s`` of ``S`` holds
    rows ``[s B/S, (s+1) B/S)``: with ``num_groups % S == 0`` each group lies on one shard.
    Arrays already laid out that way are left as they are.

    With ``process_local=True`` the batch holds only this process's rows (the range
    :func:`process_row_range` gives, as NumPy or JAX arrays) and the global arrays are
    assembled with ``jax.make_array_from_process_local_data``; in a single process that is
    the whole batch.

    Args:
        batch: Any pytree of row-major arrays ``(B, ...)`` (e.g. a ``GRPOBatch``; a batch with
            a ``group_size`` attribute keeps its groups whole).
        mesh: The mesh.
        process_local: Whether ``batch`` holds only this process's rows.
        data_axes: Axes the rows are split over (default: ``("data", "fsdp")`` as present).

    Returns:
        The same pytree with sharded ``jax.Array`` leaves.

    Raises:
        ValueError: The rows (or, for a batch with a ``group_size``, the groups) cannot be
            split evenly over the data shards; the message names both numbers. Leaves
            disagree on the rows, or ``data_axes`` names an unknown axis.
        TypeError: ``mesh`` is not a ``Mesh``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.training import make_mesh, shard_batch
        >>> mesh = make_mesh(data=2, devices=jax.devices()[:2])  # 2 devices
        >>> batch = shard_batch({"rewards": jnp.arange(8.0), "ids": jnp.zeros((8, 3))}, mesh)
        >>> batch["ids"].sharding.spec
        P(('data', 'fsdp'),)
        >>> [s.data.tolist() for s in batch["rewards"].addressable_shards]
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    """
    _check_mesh(mesh, "shard_batch")
    shards = num_data_shards(mesh, data_axes)
    spec = batch_partition_spec(mesh, data_axes)
    rows_sharding = NamedSharding(mesh, spec)
    leaves = [x for x in jax.tree.leaves(batch) if np.ndim(x) > 0]
    if not leaves:
        return batch
    rows = {int(np.shape(x)[0]) for x in leaves}
    if len(rows) != 1:
        msg = f"shard_batch: every array must have the same number of rows, got {sorted(rows)}"
        raise ValueError(msg)
    (b,) = rows
    where = "this process's" if process_local else "a"
    if process_local:
        local = _local_shards(rows_sharding, shards)  # one row per shard: which shards are here
        n_local = len(local)
        if b % n_local:
            msg = (
                f"{where} batch of {b} rows cannot be split evenly over its {n_local} local data "
                f"shards (of {shards}: {_axes_desc(mesh, data_axes)})"
            )
            raise ValueError(msg)
        global_rows = b * shards // n_local
    else:
        global_rows = b
    if global_rows % shards:
        msg = (
            f"a batch of {global_rows} rows cannot be split evenly over {shards} data shards "
            f"({_axes_desc(mesh, data_axes)}); use a multiple of {shards} rows"
        )
        g = getattr(batch, "group_size", 0)  # a batch type with fixed-size groups (duck-typed)
        if getattr(batch, "group_ids", None) is None and isinstance(g, int) and g > 0:
            msg += f" (e.g. a multiple of {shards // math.gcd(shards, g)} groups of {g})"
        raise ValueError(msg)

    def put(x: Any) -> Any:
        if np.ndim(x) == 0:
            return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
        if process_local:
            data = np.asarray(x)
            shape = (global_rows, *np.shape(x)[1:])
            return jax.make_array_from_process_local_data(rows_sharding, data, shape)
        if (
            isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)  # traced (eval_shape): no sharding to read
            and x.sharding == rows_sharding
        ):
            return x
        # Also an equivalent layout under another spec (P('data') for P(('data', 'fsdp')) with
        # fsdp 1): one spec for every batch, so one compiled program serves them all.
        return jax.device_put(x, rows_sharding)

    return jax.tree.map(put, batch)


def host_array(x: Any) -> np.ndarray:
    """The full value of ``x`` as a NumPy array on this host.

    A ``jax.Array`` spread over several processes is all-gathered first
    (``multihost_utils.process_allgather``), so every process gets the whole array; anything
    else is fetched with ``jax.device_get``. The rollout and the evaluation decode completions
    through this, so the loop works the same in a single process and across hosts.

    Args:
        x: An array.

    Returns:
        The NumPy array.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.training import host_array, make_mesh, shard_batch
        >>> mesh = make_mesh(data=2, devices=jax.devices()[:2])  # 2 devices
        >>> x = shard_batch(jnp.arange(4), mesh)
        >>> type(host_array(x)).__name__, host_array(x).tolist()
        ('ndarray', [0, 1, 2, 3])
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


# ------------------------------------------------------------------------------ several processes
def local_rows(x: Any) -> np.ndarray:
    """The rows of a row-sharded array that this process holds, as NumPy, in row order.

    The counterpart of ``shard_batch(..., process_local=True)``: for an array laid out by
    :func:`shard_batch` on a :func:`make_mesh` mesh, process ``p`` gets back exactly the rows
    ``[start, stop)`` of :func:`process_row_range`, with no communication (each addressable
    row shard is copied once). In a single process that is the whole array. The rollout decodes
    and scores completions through this, so each process handles only its own rows.

    Args:
        x: An array whose leading dimension (rows) is sharded (or replicated), or a host array.

    Returns:
        This process's rows.

    Raises:
        ValueError: This process's row shards are not contiguous.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.training import local_rows, make_mesh, shard_batch
        >>> mesh = make_mesh(data=2, devices=jax.devices()[:2])  # 2 devices
        >>> local_rows(shard_batch(jnp.arange(6).reshape(3, 2).repeat(2, axis=0), mesh)).shape
        (6, 2)
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    parts: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        sl = shard.index[0] if shard.index else slice(None)
        start = sl.start or 0
        if start not in parts:
            parts[start] = np.asarray(shard.data)
    starts = sorted(parts)
    for a, b in itertools.pairwise(starts):
        if a + parts[a].shape[0] != b:
            msg = f"local_rows: this process's row shards start at {starts}, not contiguous rows"
            raise ValueError(msg)
    return np.concatenate([parts[k] for k in starts], axis=0)


def rows_to_global(local: Any, mesh: Mesh, data_axes: Sequence[str] | None = None) -> jax.Array:
    """One global row-sharded array from every process's rows (``shard_batch`` of one array).

    Args:
        local: This process's rows ``(b, ...)`` (the range :func:`process_row_range` gives).
        mesh: The mesh.
        data_axes: Axes the rows are split over (default: ``("data", "fsdp")`` as present).

    Returns:
        The global array ``(b * processes, ...)`` with rows over the data axes.

    Examples:
        >>> import jax, numpy as np
        >>> from artifex.generative_models.training import make_mesh, rows_to_global
        >>> mesh = make_mesh(data=2, devices=jax.devices()[:2])  # 2 devices, one process
        >>> x = rows_to_global(np.arange(4), mesh)
        >>> x.shape, x.sharding.spec
        ((4,), P(('data', 'fsdp'),))
    """
    return shard_batch(np.asarray(local), mesh, process_local=True, data_axes=data_axes)


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    timeout: float | None = None,
) -> bool:
    """Joins this process to a multi-host JAX run (``jax.distributed.initialize``) when asked.

    Explicit arguments win; missing ones are read from the environment: JAX's own
    ``JAX_COORDINATOR_ADDRESS``, and ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` (read here,
    by this library). When none is set and ``auto`` is false nothing happens (a single-process
    run). With ``auto`` (or only some values known) the rest is left to JAX's cluster
    auto-detection (SLURM, Open MPI, Cloud TPU, Kubernetes...). Call it before anything else
    touches JAX's devices; the CPU collectives JAX uses across processes default to gloo.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator service.
        num_processes: Number of processes in the run.
        process_id: This process's index in ``[0, num_processes)``.
        auto: Initialize even when nothing is set (cluster auto-detection).
        timeout: Seconds to wait for every process: the address is checked first and the
            processes meet before JAX starts, so a process that does not come is named in a
            :class:`~artifex.generative_models.training.rendezvous.DistributedStartError`
            (see :func:`~artifex.generative_models.training.rendezvous.join_processes`).
            ``None``: JAX's own wait (it aborts the process after 300 s).

    Returns:
        Whether ``jax.distributed.initialize`` was called.

    Raises:
        ValueError: ``num_processes`` < 1, ``process_id`` outside ``[0, num_processes)``, or
            (with ``timeout``) a malformed or unresolvable coordinator address.
        DistributedStartError: (with ``timeout``) not every process came in time.

    Examples:
        >>> from artifex.generative_models.training import initialize_distributed
        >>> initialize_distributed()  # nothing set in the environment: a single-process run
        False
    """
    import os

    if coordinator_address is None:
        coordinator_address = os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator_address is None and num_processes is None and process_id is None and not auto:
        return False
    if num_processes is not None and num_processes < 1:
        msg = f"num_processes must be >= 1, got {num_processes}"
        raise ValueError(msg)
    if process_id is not None and (
        process_id < 0 or (num_processes is not None and process_id >= num_processes)
    ):
        msg = f"process_id must be in [0, num_processes={num_processes}), got {process_id}"
        raise ValueError(msg)
    if timeout is not None:
        from artifex.generative_models.training.rendezvous import join_processes

        join_processes(coordinator_address, num_processes, process_id, timeout)
        return True
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    return True
