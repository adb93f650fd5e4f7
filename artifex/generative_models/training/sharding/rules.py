"""Partition rules: parameter path and shape -> ``PartitionSpec`` (tensor parallelism, FSDP).

Part of the package :mod:`artifex.generative_models.training.sharding`, which re-exports
every public name (see its docstring).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from artifex.generative_models.training.sharding.mesh import check_mesh
from artifex.generative_models.utils.validation import check_int

__all__ = [
    "CAUSAL_LM_RULES",
    "MOE_RULES",
    "PartitionRules",
]

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
#: (``mlp.gate.kernel``) stays replicated (FSDP may split it). Per-expert LoRA adapters
#: (``experts.lora.<proj>.lora_a`` ``(E, in, r)``, ``.lora_b`` ``(E, r, out)``) are split by
#: expert the same way, and over ``"tensor"`` where their expert weight is (gate/up ``B`` by
#: columns, down ``A`` by rows).
MOE_RULES: tuple[tuple[str, PartitionSpec], ...] = (
    (r"(^|\.)experts\.(gate_proj|up_proj)$", PartitionSpec("expert", None, "tensor")),
    (r"(^|\.)experts\.down_proj$", PartitionSpec("expert", "tensor", None)),
    (
        r"(^|\.)experts\.lora\.(gate_proj|up_proj)\.lora_a$",
        PartitionSpec("expert", None, None),
    ),
    (
        r"(^|\.)experts\.lora\.(gate_proj|up_proj)\.lora_b$",
        PartitionSpec("expert", None, "tensor"),
    ),
    (r"(^|\.)experts\.lora\.down_proj\.lora_a$", PartitionSpec("expert", "tensor", None)),
    (r"(^|\.)experts\.lora\.down_proj\.lora_b$", PartitionSpec("expert", None, None)),
)


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
        check_mesh(mesh, "PartitionRules.bind")
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
