"""Per-expert LoRA adapters in PEFT's format: `target_parameters` on transformers' fused experts.

transformers (5.x) stores a Qwen3-MoE layer's experts as two 3-D parameters,
`mlp.experts.gate_up_proj` (E, 2I, D) (gate rows first, then up) and `mlp.experts.down_proj`
(E, D, I), and PEFT adapts them with `LoraConfig(target_parameters=[...])` (its `ParamWrapper`,
one per parameter, nested when both are targeted). Expert `e` of a parameter `W` (E, out, in)
then computes with `W_e + (lora_alpha / r) B_e A_e`, where, with `R` the rank,

- `lora_A.weight` (R E, in) holds `A_e` (R, in) in rows `e R .. e R + R - 1`;
- `lora_B.weight` (out, R E) holds `B_e` (out, R) in columns `j E + e`, `j = 0 .. R - 1`.

The tensors are `base_model.model.model.layers.i.mlp.experts.lora_{A,B}.weight`; with both
parameters targeted, the gate/up one (wrapped first: transformers registers it first) is under
`experts.base_layer.` and the down one directly under `experts.`.

Here the experts' adapters are per projection (`gate_proj`, `up_proj`, `down_proj`, see
:mod:`~artifex.generative_models.models.causal_lm.lora_experts`), so:

- reading, a fused gate/up adapter `(A, B)` becomes a gate adapter `(A, B[:I])` and an up
  adapter `(A, B[I:])`: the same function;
- writing, gate and up adapters with the same `A` (e.g. read from PEFT) are written as one
  rank-r gate/up adapter; with different `A`s they need rank `2r` (`A = [A_g; A_u]`,
  `B = diag(B_g, B_u)`), and then every adapter of the file is written at rank `2r`, the
  others padded with zeros, with `lora_alpha = scale * 2r` and no rsLoRA: the same function,
  read back as rank-`2r` adapters.

Checked against PEFT itself by `tests/fixtures/make_peft_fixtures.py`.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = [
    "EXPERT_PARAMETERS",
    "EXPERT_TARGETS",
    "check_expert_shapes",
    "expert_key",
    "expert_projections",
    "expert_rank",
    "expert_target",
    "expert_tensors",
    "peft_expert_order",
    "read_expert_tensors",
]

#: transformers' fused expert parameters (in their registration order) and what they adapt here.
EXPERT_PARAMETERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
#: `target_parameters` as written here.
EXPERT_TARGETS = tuple(f"mlp.experts.{p}" for p in EXPERT_PARAMETERS)

#: A tensor of a per-expert adapter: `(layer, "base_layer." or "", "A" or "B")`.
EXPERT_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)?)lora_([AB])\.weight"
)


def expert_key(layer: int, nested: bool, which: str) -> str:
    """PEFT's name of a per-expert adapter tensor (`nested`: under `base_layer.`).

    Args:
        layer: The layer index.
        nested: Whether the tensor belongs to the inner wrapper (both parameters targeted).
        which: "A" or "B".

    Returns:
        The tensor's name in `adapter_model.safetensors`.

    Examples:
        >>> from artifex.generative_models.models.causal_lm.peft_experts import expert_key
        >>> expert_key(3, True, "A")
        'base_model.model.model.layers.3.mlp.experts.base_layer.lora_A.weight'
    """
    inner = "base_layer." if nested else ""
    return f"base_model.model.model.layers.{layer}.mlp.experts.{inner}lora_{which}.weight"


def expert_target(entry: str) -> str | None:
    """The fused parameter (`gate_up_proj`, `down_proj`) a `target_parameters` entry names.

    Entries are PEFT's suffixes of `model.layers.i.mlp.experts.<param>`: `mlp.experts.<param>`,
    `experts.<param>` or `<param>`; anything else gives None.

    Args:
        entry: One entry of `target_parameters`.

    Returns:
        `"gate_up_proj"`, `"down_proj"` or None.

    Examples:
        >>> from artifex.generative_models.models.causal_lm.peft_experts import expert_target
        >>> expert_target("mlp.experts.gate_up_proj"), expert_target("mlp.experts.gate_proj")
        ('gate_up_proj', None)
    """
    for param in EXPERT_PARAMETERS:
        full = f"mlp.experts.{param}"
        if entry == full or full.endswith("." + entry):
            return param
    return None


def peft_expert_order(params: set[str]) -> list[str]:
    """The fused parameters of `params`, innermost wrapper first (transformers' order).

    Args:
        params: Fused parameter names.

    Returns:
        Them in transformers' registration order.

    Examples:
        >>> from artifex.generative_models.models.causal_lm.peft_experts import (
        ...     peft_expert_order)
        >>> peft_expert_order({"down_proj", "gate_up_proj"})
        ['gate_up_proj', 'down_proj']
    """
    return [p for p in EXPERT_PARAMETERS if p in params]


def expert_projections(params: set[str]) -> tuple[str, ...]:
    """Our projection names for PEFT's fused parameters.

    Args:
        params: Fused parameter names.

    Returns:
        The projections they adapt here.

    Examples:
        >>> from artifex.generative_models.models.causal_lm.peft_experts import (
        ...     expert_projections)
        >>> expert_projections({"gate_up_proj"})
        ('gate_proj', 'up_proj')
    """
    return tuple(name for p in peft_expert_order(params) for name in EXPERT_PARAMETERS[p])


def _to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ours `A` (E, in, R), `B` (E, R, out) -> PEFT's `lora_A` (R E, in), `lora_B` (out, R E)."""
    e, n_in, rank = a.shape
    peft_a = np.transpose(a, (0, 2, 1)).reshape(e * rank, n_in)
    peft_b = np.transpose(b, (2, 1, 0)).reshape(b.shape[2], rank * e)
    return np.ascontiguousarray(peft_a), np.ascontiguousarray(peft_b)


def _from_peft(
    peft_a: np.ndarray, peft_b: np.ndarray, num_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's `lora_A` (R E, in), `lora_B` (out, R E) -> ours `A` (E, in, R), `B` (E, R, out)."""
    rank = peft_a.shape[0] // num_experts
    a = np.transpose(peft_a.reshape(num_experts, rank, peft_a.shape[1]), (0, 2, 1))
    b = np.transpose(peft_b.reshape(peft_b.shape[0], rank, num_experts), (2, 1, 0))
    return np.ascontiguousarray(a), np.ascontiguousarray(b)


def _pad(x: np.ndarray, axis: int, rank: int) -> np.ndarray:
    width = [(0, 0)] * x.ndim
    width[axis] = (0, rank - x.shape[axis])
    return np.pad(x, width)


def expert_rank(layers: list[dict[str, tuple[np.ndarray, np.ndarray]]], rank: int) -> int:
    """The rank the file needs: `2 rank` if some layer's gate and up adapters differ in `A`.

    Args:
        layers: Each layer's adapters by projection, `(A, B)` as arrays.
        rank: The adapters' rank r.

    Returns:
        `rank` or `2 rank`.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.models.causal_lm.peft_experts import expert_rank
        >>> a, b = np.ones((2, 4, 1)), np.ones((2, 1, 3))
        >>> expert_rank([{"gate_proj": (a, b), "up_proj": (a, b)}], 1)
        1
        >>> expert_rank([{"gate_proj": (a, b), "up_proj": (2 * a, b)}], 1)
        2
    """
    for named in layers:
        both = "gate_proj" in named and "up_proj" in named
        if both and not np.array_equal(named["gate_proj"][0], named["up_proj"][0]):
            return 2 * rank
    return rank


def expert_tensors(
    layer: int, named: dict[str, tuple[np.ndarray, np.ndarray]], rank: int
) -> tuple[dict[str, np.ndarray], set[str]]:
    """PEFT's tensors of one layer's expert adapters, at rank `rank` (see the module docstring).

    Args:
        layer: The layer index.
        named: Our adapters by projection, `(A (E, in, r), B (E, r, out))` as arrays.
        rank: The file's rank (`r`, or `2 r` with `expert_rank`).

    Returns:
        `(tensors, params)`: the tensors under PEFT's names and the fused parameters written.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.models.causal_lm.peft_experts import expert_tensors
        >>> down = (np.ones((4, 6, 2)), np.ones((4, 2, 8)))  # E=4, I=6, r=2, D=8
        >>> tensors, params = expert_tensors(0, {"down_proj": down}, 2)
        >>> {k.split("experts.")[1]: v.shape for k, v in tensors.items()}, params
        ({'lora_A.weight': (8, 6), 'lora_B.weight': (8, 8)}, {'down_proj'})
    """
    fused: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    gate, up = named.get("gate_proj"), named.get("up_proj")
    if gate is not None or up is not None:
        ref = gate if gate is not None else up
        e, _, r = ref[0].shape
        width = ref[1].shape[2]
        zeros_b = np.zeros((e, r, width), ref[1].dtype)
        if gate is not None and up is not None and rank == r:  # one A (checked by expert_rank)
            a, b = gate[0], np.concatenate([gate[1], up[1]], axis=2)
        elif gate is not None and up is not None:  # A = [A_g; A_u], B = diag(B_g, B_u)
            a = np.concatenate([gate[0], up[0]], axis=2)
            top = np.concatenate([gate[1], zeros_b], axis=2)
            bottom = np.concatenate([zeros_b, up[1]], axis=2)
            b = np.concatenate([top, bottom], axis=1)
        elif gate is not None:
            a, b = gate[0], np.concatenate([gate[1], zeros_b], axis=2)
        else:
            a, b = up[0], np.concatenate([zeros_b, up[1]], axis=2)
        fused["gate_up_proj"] = (a, b)
    if "down_proj" in named:
        fused["down_proj"] = named["down_proj"]
    order = peft_expert_order(set(fused))
    tensors = {}
    for param, (a, b) in fused.items():
        nested = len(order) == 2 and order.index(param) == 0
        peft_a, peft_b = _to_peft(_pad(a, 2, rank), _pad(b, 1, rank))
        tensors[expert_key(layer, nested, "A")] = peft_a
        tensors[expert_key(layer, nested, "B")] = peft_b
    return tensors, set(fused)


def check_expert_shapes(tensors: dict[str, np.ndarray], rank: int, where: str) -> int | None:
    """Checks what a file's expert tensors imply without a model: 2-D, `r E` rows, one `E`.

    Each `lora_A` (R E, in) must have a multiple of `r` rows and its `lora_B` (out, R E) as
    many columns, and every expert tensor the same `E`.

    Args:
        tensors: The file's tensors, by PEFT's name (others are skipped).
        rank: r.
        where: The file, for messages.

    Returns:
        The expert count E, or None without expert tensors.

    Raises:
        ValueError: Naming the tensor and its shape.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.models.causal_lm.peft_experts import (
        ...     check_expert_shapes, expert_tensors)
        >>> down = (np.ones((4, 6, 2)), np.ones((4, 2, 8)))  # E=4, I=6, r=2, D=8
        >>> check_expert_shapes(expert_tensors(0, {"down_proj": down}, 2)[0], 2, "file")
        4
    """
    first: tuple[str, int] | None = None
    for name in sorted(n for n in tensors if EXPERT_KEY.fullmatch(n)):
        shape = tensors[name].shape
        if len(shape) != 2:
            msg = f"{where}: tensor {name!r} has shape {shape}, expected 2 dimensions"
            raise ValueError(msg)
        if name.endswith("lora_B.weight"):
            a_name = name.replace("lora_B.weight", "lora_A.weight")
            if a_name not in tensors:
                msg = f"{where}: missing tensor {a_name!r} (the lora_A of {name!r})"
                raise ValueError(msg)
            rows = tensors[a_name].shape[0]
            if shape[1] != rows:
                msg = (
                    f"{where}: tensor {name!r} has shape {shape}, expected {rows} columns (its "
                    f"lora_A's rows, r x experts)"
                )
                raise ValueError(msg)
            continue
        if shape[0] % rank:
            msg = (
                f"{where}: tensor {name!r} has shape {shape}, expected rows a multiple of "
                f"r={rank} (r x experts)"
            )
            raise ValueError(msg)
        if first is None:
            first = (name, shape[0] // rank)
        elif shape[0] // rank != first[1]:
            msg = (
                f"{where}: expert tensors of different expert counts: {first[0]!r} holds "
                f"{first[1]}, {name!r} holds {shape[0] // rank} (r={rank})"
            )
            raise ValueError(msg)
    return None if first is None else first[1]


def read_expert_tensors(
    tensors: dict[str, np.ndarray],
    params: set[str],
    *,
    layer: int,
    num_experts: int,
    dims: dict[str, tuple[int, int]],
    rank: int,
    where: str,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One layer's PEFT expert tensors as our per-projection adapters, shapes checked.

    Args:
        tensors: The file's tensors, by PEFT's name.
        params: The fused parameters targeted (`target_parameters`).
        layer: The layer index.
        num_experts: E.
        dims: Our projections' `(in, out)` widths: `gate_proj` (D, I), `down_proj` (I, D).
        rank: r.
        where: The file, for messages.

    Returns:
        `{projection: (A (E, in, r), B (E, r, out))}`.

    Raises:
        ValueError: Naming the tensor, for a missing one or a wrong shape.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.models.causal_lm.peft_experts import (
        ...     expert_tensors, read_expert_tensors)
        >>> down = (np.ones((4, 6, 2)), np.ones((4, 2, 8)))
        >>> tensors, _ = expert_tensors(0, {"down_proj": down}, 2)
        >>> out = read_expert_tensors(tensors, {"down_proj"}, layer=0, num_experts=4,
        ...     dims={"gate_proj": (8, 6), "down_proj": (6, 8)}, rank=2, where="file")
        >>> [x.shape for x in out["down_proj"]]
        [(4, 6, 2), (4, 2, 8)]
    """
    order = peft_expert_order(params)
    out: dict[str, Any] = {}
    for param in order:
        nested = len(order) == 2 and order.index(param) == 0
        n_in, n_out = dims["gate_proj"] if param == "gate_up_proj" else dims["down_proj"]
        n_out = 2 * n_out if param == "gate_up_proj" else n_out
        arrays = []
        for which, shape in (("A", (rank * num_experts, n_in)), ("B", (n_out, rank * num_experts))):
            name = expert_key(layer, nested, which)
            if name not in tensors:
                msg = f"{where}: missing tensor {name!r} (target_parameters {sorted(params)})"
                raise ValueError(msg)
            if tensors[name].shape != shape:
                msg = (
                    f"{where}: tensor {name!r} ({param}) has shape {tensors[name].shape}, expected "
                    f"{shape} (r={rank}, {num_experts} experts)"
                )
                raise ValueError(msg)
            arrays.append(tensors[name])
        a, b = _from_peft(arrays[0], arrays[1], num_experts)
        if param == "gate_up_proj":
            half = b.shape[2] // 2
            out["gate_proj"] = (a, np.ascontiguousarray(b[:, :, :half]))
            out["up_proj"] = (a, np.ascontiguousarray(b[:, :, half:]))
        else:
            out["down_proj"] = (a, b)
    return out
