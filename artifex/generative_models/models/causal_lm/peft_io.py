"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

`save_peft_adapter` writes a model's LoRA adapters (`apply_lora`) the way PEFT's
`PeftModel.save_pretrained` does, so `PeftModel.from_pretrained(base, path)` reads them, and
`load_peft_adapter` puts an adapter saved by PEFT (or by `save_peft_adapter`) into a `CausalLM`.

Tensor names and layouts (`i` the layer, `proj` a projection of `LORA_TARGETS`):

- `base_model.model.model.layers.i.self_attn.proj.lora_A.weight` (r, in) = our `lora_a`.T
- `base_model.model.model.layers.i.self_attn.proj.lora_B.weight` (out, r) = our `lora_b`.T
- the same under `mlp.` for `gate_proj`, `up_proj`, `down_proj`;
- on a mixture-of-experts model (Qwen3-MoE), the experts' adapters as PEFT's
  `target_parameters` of transformers' fused expert weights, `mlp.experts.gate_up_proj` and
  `mlp.experts.down_proj` (:mod:`~artifex.generative_models.models.causal_lm.peft_experts`).

The scales agree: PEFT adds `lora_B(lora_A(x)) * lora_alpha / r` (`lora_alpha / sqrt(r)` with
`use_rslora`) and `LoRAConfig.scale` is `alpha / rank` (`alpha / sqrt(rank)` with
`use_rslora`). Reading refuses what has no counterpart here, naming the key: DoRA, trained
biases, `modules_to_save`, per-module ranks or alphas (`rank_pattern`, `alpha_pattern`),
adapters on some layers only, embedding or head adapters. `lora_dropout` is recorded by PEFT for
training only and has no effect on the loaded function.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from artifex.generative_models.models.causal_lm.hf_io import _gathered, _save_file
from artifex.generative_models.models.causal_lm.lora import (
    _MLP_TARGETS,
    LORA_TARGETS,
    LoRAConfig,
    apply_lora,
)
from artifex.generative_models.models.causal_lm.model import CausalLM
from artifex.generative_models.models.causal_lm.moe import Experts
from artifex.generative_models.models.causal_lm.peft_experts import (
    EXPERT_KEY,
    EXPERT_PARAMETERS,
    EXPERT_TARGETS,
    check_expert_shapes,
    expert_key,
    expert_projections,
    expert_rank,
    expert_target,
    expert_tensors,
    peft_expert_order,
    read_expert_tensors,
)
from artifex.generative_models.utils.atomic import commit_file, temp_path

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "load_peft_adapter",
    "peft_adapter_config",
    "read_peft_adapter",
    "save_peft_adapter",
]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
#: adapter_config.json keys whose non-default values have no counterpart here.
_UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layer_replication": None,
    "lora_bias": False,
    "use_qalora": False,
    "target_parameters": None,
    "trainable_token_indices": None,
}
#: Tensor dtypes an adapter file may hold.
_FLOATS = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))


def _parent(proj: str) -> tuple[str, str]:
    """(our attribute, PEFT's module) of a projection's parent."""
    return ("attn", "self_attn") if proj in _ATTN else ("mlp", "mlp")


def _peft_name(layer: int, proj: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_parent(proj)[1]}.{proj}.lora_{which}.weight"


def _adapters(model: CausalLM) -> Iterator[tuple[int, str, Any]]:
    """(layer, projection, adapter) of every adapter of a per-layer model."""
    for i, layer in enumerate(model.layers):
        for proj in LORA_TARGETS:
            # a mixture-of-experts layer's feed-forward has no such projection (no adapters)
            linear = getattr(getattr(layer, _parent(proj)[0]), proj, None)
            if getattr(linear, "lora", None) is not None:
                yield i, proj, linear.lora


def _layer_experts(model: CausalLM) -> Iterator[tuple[int, Experts]]:
    """(layer, experts) of every sparse layer of a per-layer model."""
    for i, layer in enumerate(model.layers):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if isinstance(experts, Experts):
            yield i, experts


def _layer_of(name: str) -> int:
    match = _KEY.fullmatch(name) or EXPERT_KEY.fullmatch(name)
    return int(match.group(1))


def _check_mlp_form(model: CausalLM, names: tuple[str, ...], experts: bool, where: str) -> None:
    """Refuses feed-forward adapters whose form (Linear or experts) the model does not have."""
    asked = sorted(n for n in names if n in _MLP_TARGETS)
    if asked and model.config.is_moe and not experts:
        msg = (
            f"load_peft_adapter: {where}: target_modules {asked} are expert projections in this "
            f"mixture-of-experts model ({model.config.model_type}); expected its experts' "
            f"adapters as target_parameters {list(EXPERT_TARGETS)} (transformers' fused experts), "
            "got adapters of Linear feed-forward projections"
        )
        raise ValueError(msg)
    if experts and not model.config.is_moe:
        msg = (
            f"load_peft_adapter: {where}: target_parameters (per-expert adapters) need a "
            f"mixture-of-experts model, got model_type {model.config.model_type!r}"
        )
        raise ValueError(msg)


@contextlib.contextmanager
def _per_layer(model: CausalLM) -> Iterator[None]:
    """Runs the body with per-layer storage; a stacked model is restacked after."""
    stacked = getattr(model, "layers_stacked", False)
    if stacked:
        model.unstack_layers()
    try:
        yield
    finally:
        if stacked:
            model.stack_layers()


def peft_adapter_config(
    config: LoRAConfig,
    *,
    base_model_name_or_path: str | None = None,
    target_parameters: list[str] | None = None,
) -> dict[str, Any]:
    """The `adapter_config.json` PEFT writes for a `LoRAConfig`.

    Args:
        config: The adapter configuration.
        base_model_name_or_path: Recorded for `AutoPeftModel` to find the base model.
        target_parameters: For a mixture-of-experts model's expert adapters, transformers'
            fused expert parameters (e.g. `["mlp.experts.down_proj"]`); the feed-forward names
            then leave `target_modules` (None if nothing is left).

    Returns:
        A JSON-able dict (`peft_type` "LORA", `task_type` "CAUSAL_LM", `r`, `lora_alpha`,
        `target_modules`, `use_rslora` and PEFT's defaults for the rest).

    Examples:
        >>> from artifex.generative_models.models.causal_lm import LoRAConfig
        >>> from artifex.generative_models.models.causal_lm.peft_io import peft_adapter_config
        >>> d = peft_adapter_config(LoRAConfig(rank=8, alpha=16.0, target_modules=("v_proj",)))
        >>> d["r"], d["lora_alpha"], d["target_modules"], d["use_rslora"]
        (8, 16.0, ['v_proj'], False)
    """
    modules: list[str] | None = sorted(config.target_modules)
    if target_parameters:
        modules = [t for t in modules if t not in _MLP_TARGETS] or None
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "use_rslora": config.use_rslora,
        "init_lora_weights": True,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        **_UNSUPPORTED,
        "target_parameters": sorted(target_parameters) if target_parameters else None,
    }


def save_peft_adapter(
    model: CausalLM,
    path: str | os.PathLike[str],
    *,
    config: LoRAConfig | None = None,
    base_model_name_or_path: str | None = None,
) -> None:
    """Writes the model's LoRA adapters as a PEFT adapter directory.

    Every layer must carry adapters on the same projections with one rank and scale (what
    `apply_lora` makes). Without `config`, `lora_alpha` is written as `scale * r` (the same
    function). A mixture-of-experts model's expert adapters are written as PEFT's
    `target_parameters` of transformers' fused experts (`mlp.experts.gate_up_proj`,
    `mlp.experts.down_proj`); gate and up adapters with different `A`s need rank `2r` there,
    and then the whole file is written at rank `2r` (zero-padded, `lora_alpha = scale * 2r`,
    the same function; see :mod:`~artifex.generative_models.models.causal_lm.peft_experts`).
    Each file is written under a temporary name and renamed into place. In a multi-host run
    every process calls it (adapters spread over processes are all-gathered) and process 0
    writes.

    Args:
        model: A model with adapters (per-layer or stacked layers).
        path: Output directory, created if needed.
        config: The `LoRAConfig` the adapters were made with, to record its `alpha` and
            `use_rslora`; its scale must equal the adapters'.
        base_model_name_or_path: Recorded in `adapter_config.json`.

    Raises:
        ValueError: If the model has no adapters, they differ between layers, or `config`
            disagrees with them.

    Examples:
        >>> import os, tempfile
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, LoRAConfig, apply_lora)
        >>> from artifex.generative_models.models.causal_lm.peft_io import save_peft_adapter
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> lora = LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",))
        >>> model = apply_lora(CausalLM(cfg, rngs=nnx.Rngs(0)), lora, nnx.Rngs(1))
        >>> out = tempfile.mkdtemp()
        >>> save_peft_adapter(model, out, config=lora)
        >>> sorted(os.listdir(out))
        ['adapter_config.json', 'adapter_model.safetensors']
    """
    linear, experts, ranks, scales, grid = _collect(model)
    if not grid:
        msg = "save_peft_adapter: the model has no LoRA adapters (apply_lora first)"
        raise ValueError(msg)
    targets = {frozenset(v) for v in grid.values()}
    if len(grid) != model.config.num_layers or len(targets) != 1:
        got = ", ".join(
            f"layer {i}: {sorted(grid.get(i, ()))}" for i in range(model.config.num_layers)
        )
        msg = (
            f"save_peft_adapter: every layer must have adapters on the same projections, got {got}"
        )
        raise ValueError(msg)
    if len(ranks) != 1 or len(scales) != 1:
        msg = f"save_peft_adapter: adapters of one rank and scale expected, got {ranks} {scales}"
        raise ValueError(msg)
    (rank,), (scale,), (projections,) = ranks, scales, targets
    if config is None:
        config = LoRAConfig(rank=rank, alpha=scale * rank, target_modules=tuple(projections))
    elif (
        config.rank != rank
        or set(config.target_modules) != projections
        or not math.isclose(config.scale, scale, rel_tol=1e-6)
    ):
        msg = (
            f"save_peft_adapter: config (rank {config.rank}, scale {config.scale}, targets "
            f"{sorted(config.target_modules)}) disagrees with the model's adapters (rank {rank}, "
            f"scale {scale}, targets {sorted(projections)})"
        )
        raise ValueError(msg)
    written = expert_rank([named for _, named in experts], rank) if experts else rank
    tensors: dict[str, np.ndarray] = {}
    params: set[str] = set()
    for i, named in experts:
        layer_tensors, params = expert_tensors(i, named, written)
        tensors.update(layer_tensors)
    for i, proj, a, b in linear:  # zero-padded to the file's rank (a no-op unless 2r)
        a = np.pad(a, ((0, 0), (0, written - rank)))
        b = np.pad(b, ((0, written - rank), (0, 0)))
        tensors[_peft_name(i, proj, "A")] = np.ascontiguousarray(a.T)
        tensors[_peft_name(i, proj, "B")] = np.ascontiguousarray(b.T)
    if written != rank:  # the same function at rank 2r: scale = lora_alpha / (2r)
        config = LoRAConfig(
            rank=written, alpha=scale * written, target_modules=config.target_modules
        )
    parameters = [f"mlp.experts.{p}" for p in peft_expert_order(params)] or None
    if jax.process_index() != 0:
        return
    directory = os.fspath(path)
    os.makedirs(directory, exist_ok=True)
    weights = os.path.join(directory, ADAPTER_WEIGHTS_NAME)
    tmp = temp_path(weights)
    try:
        _save_file(dict(sorted(tensors.items())), tmp, weights)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    commit_file(tmp, weights)
    config_path = os.path.join(directory, ADAPTER_CONFIG_NAME)
    tmp = temp_path(config_path)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(
            peft_adapter_config(
                config,
                base_model_name_or_path=base_model_name_or_path,
                target_parameters=parameters,
            ),
            f,
            indent=2,
            sort_keys=True,
        )
        f.write("\n")
    commit_file(tmp, config_path)


def _collect(model: CausalLM) -> tuple[list, list, set[int], set[float], dict[int, set[str]]]:
    """The model's adapters as arrays: Linear ones, expert ones, ranks, scales, targets by layer."""
    linear: list[tuple[int, str, np.ndarray, np.ndarray]] = []
    experts: list[tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]]] = []
    ranks: set[int] = set()
    scales: set[float] = set()
    grid: dict[int, set[str]] = {}
    with _per_layer(model):
        for i, proj, adapter in _adapters(model):
            a = _gathered(adapter.lora_a.get_value())
            linear.append((i, proj, a, _gathered(adapter.lora_b.get_value())))
            ranks.add(int(a.shape[1]))
            scales.add(float(adapter.scale))
            grid.setdefault(i, set()).add(proj)
        for i, module in _layer_experts(model):
            if module.lora is None:
                continue
            named = {}
            for name, adapter in module.lora.adapters().items():
                a = _gathered(adapter.lora_a.get_value())
                named[name] = (a, _gathered(adapter.lora_b.get_value()))
                ranks.add(int(a.shape[-1]))
                scales.add(float(adapter.scale))
                grid.setdefault(i, set()).add(name)
            experts.append((i, named))
    return linear, experts, ranks, scales, grid


def read_peft_adapter(
    path: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[LoRAConfig, dict[str, np.ndarray]]:
    """Reads a PEFT LoRA adapter directory and checks it against what `apply_lora` can hold.

    Args:
        path: Directory with `adapter_config.json` and `adapter_model.safetensors`.
        dtype: Adapter parameter dtype ("float32" / "bfloat16"); None keeps the file's
            (float16, and a file of mixed dtypes, read as float32).

    Returns:
        `(config, tensors)`: the `LoRAConfig` (targets from the tensors present; a fused
        expert gate/up adapter of `target_parameters` counts as `gate_proj` and `up_proj`)
        and the tensors under PEFT's names, in PEFT's layout.

    Raises:
        FileNotFoundError: If a file is missing.
        ValueError: Naming the key or tensor, for a non-LoRA adapter, an `r` or `lora_alpha`
            that is not a positive number (`r` an int), an unsupported setting (a
            `target_parameters` other than a list of transformers' fused expert weights), no
            tensors, an unknown tensor, a non-float dtype, a wrong shape (expert tensors: not
            `r E` rows, or not one expert count `E`) or adapters missing from some layers.

    Examples:
        >>> from artifex.generative_models.models.causal_lm.peft_io import read_peft_adapter
        >>> config, tensors = read_peft_adapter("tests/fixtures/peft/qwen2_lora")  # repo root
        >>> config.rank, config.alpha, config.target_modules
        (4, 8.0, ('down_proj', 'q_proj', 'v_proj'))
    """
    directory = os.fspath(path)
    config_path = os.path.join(directory, ADAPTER_CONFIG_NAME)
    weights = os.path.join(directory, ADAPTER_WEIGHTS_NAME)
    for required in (config_path, weights):
        if not os.path.exists(required):
            msg = f"no {os.path.basename(required)} in {directory!r}"
            raise FileNotFoundError(msg)
    with open(config_path, encoding="utf-8") as f:
        d = json.load(f)
    if d.get("peft_type") != "LORA":
        msg = f"{config_path}: peft_type must be 'LORA', got {d.get('peft_type')!r}"
        raise ValueError(msg)
    for key, default in (*_UNSUPPORTED.items(), ("bias", "none")):
        if key == "target_parameters":  # transformers' fused experts only, below
            continue
        value = d.get(key, default)
        if value not in (default, [], {}) and not (default is None and not value):
            msg = f"{config_path}: {key}={value!r} is not supported (expected {default!r})"
            raise ValueError(msg)
    for key in ("rank_pattern", "alpha_pattern"):
        if d.get(key):
            msg = f"{config_path}: {key}={d[key]!r}: per-module ranks and alphas are not supported"
            raise ValueError(msg)
    rank, alpha = d.get("r"), d.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        msg = f"{config_path}: r must be a positive int, got {rank!r}"
        raise ValueError(msg)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        msg = f"{config_path}: lora_alpha must be a positive number, got {alpha!r}"
        raise ValueError(msg)
    entries = d.get("target_parameters") or []
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        msg = f"{config_path}: target_parameters must be a list of parameter names, got {entries!r}"
        raise ValueError(msg)
    params: set[str] = set()
    for entry in entries:
        param = expert_target(entry)
        if param is None:
            msg = (
                f"{config_path}: target_parameters entry {entry!r} is not supported (expected "
                f"transformers' fused expert weights {list(EXPERT_TARGETS)})"
            )
            raise ValueError(msg)
        params.add(param)
    tensors: dict[str, np.ndarray] = {}
    with safe_open(weights, framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
            tensors[name] = f.get_tensor(name)
    if not tensors:
        msg = f"{weights}: no LoRA tensors"
        raise ValueError(msg)
    for name, x in tensors.items():
        if x.dtype not in _FLOATS:
            msg = f"{weights}: tensor {name!r} has dtype {x.dtype}, expected a float dtype"
            raise ValueError(msg)
    grid: dict[int, set[str]] = {}
    expert_layers: set[int] = set()
    for name, x in tensors.items():
        if params and EXPERT_KEY.fullmatch(name):
            expert_layers.add(_layer_of(name))
            continue
        match = _KEY.fullmatch(name)
        if match is None or match.group(3) not in LORA_TARGETS:
            msg = f"{weights}: unsupported tensor {name!r} (LoRA on {LORA_TARGETS} only)"
            raise ValueError(msg)
        layer, _, proj, which = match.groups()
        if params and proj in _MLP_TARGETS:
            msg = (
                f"{weights}: tensor {name!r}: a Linear feed-forward adapter beside "
                f"target_parameters {sorted(params)} (expected one form of feed-forward adapter)"
            )
            raise ValueError(msg)
        expected_dim = 0 if which == "A" else 1
        if x.ndim != 2 or x.shape[expected_dim] != rank:
            msg = f"{weights}: tensor {name!r} has shape {x.shape}, expected rank r={rank}"
            raise ValueError(msg)
        grid.setdefault(int(layer), set()).add(proj)
    targets = sorted({p for projs in grid.values() for p in projs})
    num_layers = 1 + max((*grid, *expert_layers), default=-1)
    order = peft_expert_order(params)
    expected: set[str] = set()
    for layer in range(num_layers):
        for param in order:  # every layer's expert tensors (their shapes: load_peft_adapter)
            for which in "AB":
                name = expert_key(layer, len(order) == 2 and param == order[0], which)
                expected.add(name)
                if name not in tensors:
                    msg = (
                        f"{weights}: missing tensor {name!r} (target_parameters "
                        f"{sorted(params)}, in every layer)"
                    )
                    raise ValueError(msg)
        for proj in targets:
            for which in "AB":
                expected.add(_peft_name(layer, proj, which))
                if _peft_name(layer, proj, which) not in tensors:
                    msg = (
                        f"{weights}: missing tensor {_peft_name(layer, proj, which)!r} (adapters "
                        "must cover every layer and target alike)"
                    )
                    raise ValueError(msg)
    extra = sorted(set(tensors) - expected)
    if extra:
        msg = (
            f"{weights}: unsupported tensor {extra[0]!r} (expected the adapters of "
            f"target_parameters {sorted(params)} only)"
        )
        raise ValueError(msg)
    check_expert_shapes(tensors, rank, weights)
    targets = sorted({*targets, *expert_projections(params)})
    if dtype is None:  # bfloat16 only if every tensor is (no tensor is rounded)
        bf16 = all(x.dtype == np.dtype(ml_dtypes.bfloat16) for x in tensors.values())
        dtype = "bfloat16" if bf16 else "float32"
    config = LoRAConfig(
        rank=rank,
        alpha=float(alpha),
        target_modules=tuple(targets),
        param_dtype=dtype,
        use_rslora=bool(d.get("use_rslora", False)),
    )
    return config, tensors


def load_peft_adapter(
    model: CausalLM, path: str | os.PathLike[str], *, dtype: str | None = None
) -> CausalLM:
    """Adds the LoRA adapters of a PEFT adapter directory to `model`, in place.

    The model must have no adapters yet and the adapter's layers and shapes must match it. A
    sharded model keeps its layout; the new adapter arrays lie on the default device until the
    model is placed again (e.g. `shard_model`).

    Args:
        model: The base model (per-layer or stacked layers).
        path: The adapter directory (see `read_peft_adapter`).
        dtype: Adapter parameter dtype; None keeps the file's.

    Returns:
        The same model object, with adapters.

    Raises:
        FileNotFoundError: If a file is missing.
        ValueError: Naming the tensor or key, for an adapter that does not fit the model
            (for a mixture-of-experts model, feed-forward adapters must be its experts'
            `target_parameters`; those need a mixture-of-experts model).

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import CausalLM
        >>> from artifex.generative_models.models.causal_lm.peft_io import load_peft_adapter
        >>> model = CausalLM.from_pretrained("tests/fixtures/qwen2_tiny")  # from the repo root
        >>> ids = jnp.array([[1, 2, 3]])
        >>> before = model(ids)
        >>> model = load_peft_adapter(model, "tests/fixtures/peft/qwen2_lora")
        >>> model.layers[0].attn.q_proj.lora.lora_a.shape  # (in, r)
        (32, 4)
        >>> bool(jnp.allclose(model(ids), before))  # a trained adapter changes the logits
        False
    """
    config, tensors = read_peft_adapter(path, dtype=dtype)
    where = os.fspath(path)
    layers = 1 + max(_layer_of(n) for n in tensors)
    if layers != model.config.num_layers:
        msg = f"adapter in {where!r} has {layers} layers, the model {model.config.num_layers}"
        raise ValueError(msg)
    experts_form = any(EXPERT_KEY.fullmatch(n) for n in tensors)
    params = {p for p, ours in EXPERT_PARAMETERS.items() if ours[0] in config.target_modules}
    _check_mlp_form(model, config.target_modules, experts_form, where)
    linear_targets = [p for p in config.target_modules if not (experts_form and p in _MLP_TARGETS)]
    with _per_layer(model):
        expert_arrays = {}
        for i, layer in enumerate(model.layers):  # every shape, before the model is changed
            for proj in linear_targets:
                linear = getattr(getattr(layer, _parent(proj)[0]), proj)
                for which, shape in (
                    ("A", (config.rank, linear.in_features)),
                    ("B", (linear.out_features, config.rank)),
                ):
                    name = _peft_name(i, proj, which)
                    if tensors[name].shape != shape:
                        msg = f"tensor {name!r}: expected shape {shape}, got {tensors[name].shape}"
                        raise ValueError(msg)
        for i, experts in _layer_experts(model) if experts_form else ():
            e, d, inner = experts.gate_proj.shape
            expert_arrays[i] = read_expert_tensors(
                tensors, params, layer=i, num_experts=e, rank=config.rank, where=where,
                dims={"gate_proj": (d, inner), "down_proj": (inner, d)},
            )  # fmt: skip
        apply_lora(model, config, nnx.Rngs(0))
        values = [
            (var, tensors[_peft_name(i, proj, which)].T)
            for i, proj, adapter in _adapters(model)
            for which, var in (("A", adapter.lora_a), ("B", adapter.lora_b))
        ]
        for i, experts in _layer_experts(model) if experts_form else ():
            for name, (a, b) in expert_arrays[i].items():
                adapter = getattr(experts.lora, name)
                values += [(adapter.lora_a, a), (adapter.lora_b, b)]
        for var, x in values:
            current = var.get_value()
            x = np.ascontiguousarray(x).astype(np.dtype(current.dtype))
            var.set_value(jax.device_put(x, current.sharding))
    return model
