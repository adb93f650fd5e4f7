"""Low-rank adapters (LoRA) for the projections of `CausalLM`.

`apply_lora` gives each targeted `Linear` a `lora` submodule with `lora_a` (in, r) and `lora_b`
(r, out), both `nnx.LoRAParam`, so the projection computes `y = x W + b + (alpha / r) x A B`.
In a mixture-of-experts layer the feed-forward targets are the experts' stacked weights: each
expert gets its own adapter, `mlp.experts.lora.<proj>.lora_a` (E, in, r) and `.lora_b`
(E, r, out) (:mod:`~artifex.generative_models.models.causal_lm.lora_experts`).

Filters (`nnx.LoRAParam` subclasses `nnx.Param`):

- adapters only: `nnx.LoRAParam` (e.g. `nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`), also
  exported as `LORA_FILTER`;
- base weights only: `nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))`, exported as `BASE_FILTER`;
- everything: `nnx.Param`.

B starts at zero, so a fresh adapter leaves the model's output unchanged; with every adapter
parameter zero the output equals the base model's exactly (the added term is an exact 0), which
lets a trainer compute the reference policy with the same graph and the adapter state zeroed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from artifex.generative_models.models.causal_lm.lora_experts import (
    add_expert_adapters,
    expert_modules,
    merge_expert_adapters,
)
from artifex.generative_models.models.causal_lm.model import CausalLM, resolve_dtype
from artifex.generative_models.models.causal_lm.modules import Linear

__all__ = [
    "BASE_FILTER",
    "LORA_FILTER",
    "LORA_TARGETS",
    "LoRAAdapter",
    "LoRAConfig",
    "apply_lora",
    "lora_state",
    "merge_lora",
    "zero_lora_state",
]

#: Projection names that can carry an adapter.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Selects only adapter parameters.
LORA_FILTER = nnx.LoRAParam
#: Selects only base (non-adapter) parameters.
BASE_FILTER = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoRAConfig:
    """Which projections get adapters, and their size.

    Attributes:
        rank: Rank r of `A` (in, r) and `B` (r, out).
        alpha: Scale numerator; the update is `(alpha / r) x A B`, PEFT's `lora_alpha / r`.
        target_modules: Projection names among `LORA_TARGETS` (default: all seven).
        param_dtype: Dtype of the adapter parameters ("float32" / "bfloat16"); None means the
            model's parameter dtype. The adapter output is cast to the projection's dtype.
        use_rslora: Rank-stabilized scale `alpha / sqrt(r)` instead of `alpha / r` (PEFT's
            `use_rslora`; Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning
            with LoRA", 2023).

    Raises:
        ValueError: Naming the field, if rank/alpha are not positive or a target is unknown.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import LoRAConfig
        >>> config = LoRAConfig(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))
        >>> config.scale, config.target_modules
        (2.0, ('q_proj', 'v_proj'))

    References:
        Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021.
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = LORA_TARGETS
    param_dtype: str | None = None
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            msg = f"rank must be a positive int, got {self.rank!r}"
            raise ValueError(msg)
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, int | float)
            or self.alpha <= 0
        ):
            msg = f"alpha must be a positive number, got {self.alpha!r}"
            raise ValueError(msg)
        if isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", (self.target_modules,))
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if not self.target_modules:
            msg = "target_modules must name at least one projection, got ()"
            raise ValueError(msg)
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown:
            msg = f"target_modules: unknown projections {unknown}; expected names in {LORA_TARGETS}"
            raise ValueError(msg)
        if self.param_dtype is not None:
            resolve_dtype(self.param_dtype)
        if not isinstance(self.use_rslora, bool):
            msg = f"use_rslora must be a bool, got {self.use_rslora!r}"
            raise TypeError(msg)

    @property
    def scale(self) -> float:
        """The update scale: `alpha / rank`, or `alpha / sqrt(rank)` with `use_rslora`."""
        if self.use_rslora:
            return self.alpha / math.sqrt(self.rank)
        return self.alpha / self.rank


class LoRAAdapter(nnx.Module):
    """The low-rank update `delta(x) = (alpha / r) (x A) B`.

    `A` is drawn from U(-1/sqrt(in), 1/sqrt(in)) (PEFT's Kaiming-uniform with a = sqrt(5)) and
    `B` starts at zero.

    Args:
        in_features: Input width.
        out_features: Output width.
        rank: Rank r.
        scale: `alpha / r`.
        dtype: Parameter and compute dtype of the adapter.
        rngs: Random streams (`params`).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import LoRAAdapter
        >>> adapter = LoRAAdapter(8, 4, rank=2, scale=0.5, dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> adapter.lora_a.shape, adapter.lora_b.shape
        ((8, 2), (2, 4))
        >>> float(jnp.abs(adapter(jnp.ones((3, 8)))).max())  # B starts at zero: no change yet
        0.0
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        scale: float,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        bound = 1.0 / math.sqrt(in_features)
        a = jax.random.uniform(rngs.params(), (in_features, rank), jnp.float32, -bound, bound)
        self.lora_a = nnx.LoRAParam(a.astype(dtype))
        self.lora_b = nnx.LoRAParam(jnp.zeros((rank, out_features), dtype))
        self.scale = scale

    def __call__(self, x: jax.Array) -> jax.Array:
        """Computes the update.

        Args:
            x: Input (..., in).

        Returns:
            `(alpha / r) x A B`, shape (..., out), in the adapter dtype.
        """
        a = self.lora_a[...]
        z = jnp.matmul(x.astype(a.dtype), a) * jnp.asarray(self.scale, a.dtype)
        return jnp.matmul(z, self.lora_b[...])


#: The feed-forward projections; in a mixture-of-experts layer they are the experts' stacked
#: weights, which take per-expert adapters (`lora_experts`).
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def _targets(model: CausalLM, names: tuple[str, ...]) -> list[Linear]:
    out = []
    for layer in model.layers:
        for parent in (layer.attn, layer.mlp):
            for name in names:
                proj = getattr(parent, name, None)
                if isinstance(proj, Linear):
                    out.append(proj)
    return out


def apply_lora(model: CausalLM, config: LoRAConfig, rngs: nnx.Rngs) -> CausalLM:
    """Adds LoRA adapters to the targeted projections of every layer, in place.

    A model with stacked layers (`stack_layers()`) gets stacked adapters, of the same values.
    In a mixture-of-experts layer, `gate_proj`, `up_proj` and `down_proj` are the experts'
    stacked weights: each expert gets its own adapter of each, `A` (E, in, r) and `B`
    (E, r, out) under `mlp.experts.lora.<proj>` (`ExpertLoRAAdapter`, same rank and scale),
    drawn after the `Linear` adapters of all layers. A plain `Linear` feed-forward keeps the
    ordinary adapter.

    Args:
        model: The model (modified in place and returned).
        config: The adapter configuration.
        rngs: Random streams for `A`.

    Returns:
        The same model object, now with adapters (`<proj>.lora.lora_a` / `.lora_b`).

    Raises:
        ValueError: If the model already has adapters.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, LoRAConfig, apply_lora)
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> model = CausalLM(cfg, rngs=nnx.Rngs(0))
        >>> before = model(jnp.array([[1, 2, 3]]))
        >>> model = apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(1))
        >>> model.layers[0].attn.q_proj.lora.lora_a.shape
        (8, 2)
        >>> bool(jnp.allclose(model(jnp.array([[1, 2, 3]])), before))  # B = 0: same function
        True

        Mixture-of-experts layers get one adapter per expert:

        >>> moe = CausalLMConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8,
        ...     intermediate_size=16, num_layers=1, num_heads=2, qk_norm=True, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=6)
        >>> model = CausalLM(moe, rngs=nnx.Rngs(0))
        >>> before = model(jnp.array([[1, 2, 3]]))
        >>> model = apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(1))
        >>> model.layers[0].mlp.experts.lora.gate_proj.lora_a.shape  # (E, D, r)
        (4, 8, 2)
        >>> bool((model(jnp.array([[1, 2, 3]])) == before).all())  # B = 0: exactly the same
        True
    """
    if any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(model)):
        msg = "apply_lora: the model already has LoRA adapters"
        raise ValueError(msg)
    stacked = getattr(model, "layers_stacked", False)
    if stacked:  # adapters per layer (the same draws as unstacked), then stacked with them
        model.unstack_layers()
    dtype = model.dtype if config.param_dtype is None else resolve_dtype(config.param_dtype)
    for proj in _targets(model, config.target_modules):
        proj.lora = LoRAAdapter(
            proj.in_features,
            proj.out_features,
            rank=config.rank,
            scale=config.scale,
            dtype=dtype,
            rngs=rngs,
        )
    expert_targets = tuple(n for n in _MLP_TARGETS if n in config.target_modules)
    for experts in expert_modules(model) if expert_targets else ():
        add_expert_adapters(
            experts, expert_targets, rank=config.rank, scale=config.scale, dtype=dtype, rngs=rngs
        )
    if stacked:
        model.stack_layers()
    return model


def merge_lora(model: CausalLM) -> CausalLM:
    """Returns a copy of `model` without adapters, `W' = W + (alpha / r) A B`.

    The product is formed in float32 and cast to the kernel's dtype; expert adapters fold into
    each expert's stacked weight (`W_e' = W_e + (alpha / r) A_e B_e`). The input model is left
    unchanged; the result can be saved with `save_pretrained`.

    Args:
        model: A model with (or without) adapters.

    Returns:
        A plain `CausalLM` with merged weights.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, LoRAConfig, apply_lora, lora_state, merge_lora)
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> model = apply_lora(CausalLM(cfg, rngs=nnx.Rngs(0)), LoRAConfig(rank=2, alpha=4.0),
        ...                    nnx.Rngs(1))
        >>> nnx.update(model, jax.tree.map(lambda x: x + 0.1, lora_state(model)))  # "trained"
        >>> merged = merge_lora(model)
        >>> merged.layers[0].attn.q_proj.lora is None
        True
        >>> ids = jnp.array([[1, 2, 3]])
        >>> bool(jnp.allclose(merged(ids), model(ids), atol=1e-5))
        True
    """
    merged = nnx.clone(model)
    stacked = getattr(merged, "layers_stacked", False)
    if stacked:
        merged.unstack_layers()
    for proj in _targets(merged, LORA_TARGETS):
        adapter = proj.lora
        if adapter is None:
            continue
        kernel = proj.kernel[...]
        a = adapter.lora_a[...].astype(jnp.float32)
        b = adapter.lora_b[...].astype(jnp.float32)
        delta = (a * adapter.scale) @ b
        proj.kernel.set_value((kernel.astype(jnp.float32) + delta).astype(kernel.dtype))
        proj.lora = None
    for experts in expert_modules(merged):
        merge_expert_adapters(experts)
    if stacked:
        merged.stack_layers()
    return merged


def lora_state(model: CausalLM) -> nnx.State:
    """The adapter parameters of `model` as an `nnx.State` (filter `nnx.LoRAParam`).

    Args:
        model: A model with adapters.

    Returns:
        The adapter state.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, LoRAConfig, apply_lora, lora_state)
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> model = apply_lora(CausalLM(cfg, rngs=nnx.Rngs(0)),
        ...                    LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",)),
        ...                    nnx.Rngs(1))
        >>> sum(x.size for x in jax.tree.leaves(lora_state(model)))  # (8 x 2) + (2 x 8)
        32
    """
    return nnx.state(model, LORA_FILTER)


def zero_lora_state(state: nnx.State) -> nnx.State:
    """Zeros every array of an adapter state (reference policy = base model).

    Args:
        state: An adapter state, e.g. from `lora_state`.

    Returns:
        A state of the same structure with all arrays zero.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLM, CausalLMConfig, LoRAConfig, apply_lora, lora_state, zero_lora_state)
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2)
        >>> model = apply_lora(CausalLM(cfg, rngs=nnx.Rngs(0)), LoRAConfig(rank=2, alpha=4.0),
        ...                    nnx.Rngs(1))
        >>> zeros = zero_lora_state(lora_state(model))
        >>> max(float(abs(x).max()) for x in jax.tree.leaves(zeros))
        0.0
    """
    return jax.tree.map(jnp.zeros_like, state)
