r"""LoRA adapters on the stacked experts of mixture-of-experts layers (Qwen3-MoE).

The ``E`` experts of a sparse layer store their projections stacked
(:class:`~artifex.generative_models.models.causal_lm.moe.Experts`: ``gate_proj``, ``up_proj``
``(E, D, I)``, ``down_proj`` ``(E, I, D)``). An expert adapter gives every expert ``e`` its own
low-rank update of a projection, ``A`` ``(E, in, r)`` and ``B`` ``(E, r, out)`` (both
``nnx.LoRAParam``), so expert ``e`` computes

.. math::

    u W_e + s\, (u A_e) B_e, \qquad s = \alpha / r \ (\alpha / \sqrt{r} \text{ with rsLoRA}),

before the activation for gate and up, as a ``Linear`` with a
:class:`~artifex.generative_models.models.causal_lm.lora.LoRAAdapter` does: PEFT's LoRA on each
expert's own ``nn.Linear``. ``A`` is drawn per expert from U(-1/sqrt(in), 1/sqrt(in)) and
``B`` starts at zero. The experts' dispatch
(:mod:`~artifex.generative_models.models.causal_lm.moe_dispatch`) adds the update in both of
its paths, and under expert parallelism the adapters are split over ``"expert"`` like the
weights (``MOE_RULES``).

``apply_lora`` and ``merge_lora`` call this module for the feed-forward targets of a
mixture-of-experts model; the functions here work on one ``Experts`` module.

References:
    Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from artifex.generative_models.models.causal_lm.moe import Experts
from artifex.generative_models.models.causal_lm.moe_dispatch import (
    EXPERT_PROJECTIONS,
    ExpertDelta,
)

__all__ = [
    "ExpertLoRA",
    "ExpertLoRAAdapter",
    "add_expert_adapters",
    "expert_modules",
    "merge_expert_adapters",
]


class ExpertLoRAAdapter(nnx.Module):
    """Per-expert low-rank updates of one stacked projection: ``s (u A_e) B_e`` for expert ``e``.

    ``A`` ``(E, in, r)`` is drawn from U(-1/sqrt(in), 1/sqrt(in)) (each expert's as
    :class:`~artifex.generative_models.models.causal_lm.lora.LoRAAdapter` draws one) and ``B``
    ``(E, r, out)`` starts at zero.

    Args:
        num_experts: ``E``.
        in_features: Input width of the projection.
        out_features: Output width of the projection.
        rank: Rank r.
        scale: ``s``, ``alpha / r`` (or ``alpha / sqrt(r)``).
        dtype: Parameter and compute dtype of the adapter.
        rngs: Random streams (``params``).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm.lora_experts import (
        ...     ExpertLoRAAdapter)
        >>> adapter = ExpertLoRAAdapter(4, 8, 6, rank=2, scale=1.0, dtype=jnp.float32,
        ...                             rngs=nnx.Rngs(0))
        >>> adapter.lora_a.shape, adapter.lora_b.shape
        ((4, 8, 2), (4, 2, 6))
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        scale: float,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        bound = 1.0 / math.sqrt(in_features)
        shape = (num_experts, in_features, rank)
        a = jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound)
        self.lora_a = nnx.LoRAParam(a.astype(dtype))
        self.lora_b = nnx.LoRAParam(jnp.zeros((num_experts, rank, out_features), dtype))
        self.scale = scale

    def delta(self) -> ExpertDelta:
        """The update as the experts' dispatch takes it.

        Returns:
            An :class:`~artifex.generative_models.models.causal_lm.moe_dispatch.ExpertDelta`
            of the current ``A``, ``B`` and scale.
        """
        return ExpertDelta(a=self.lora_a[...], b=self.lora_b[...], scale=self.scale)


class ExpertLoRA(nnx.Module):
    """The expert adapters of one sparse layer: ``Experts.lora``.

    Attributes ``gate_proj``, ``up_proj``, ``down_proj``: an :class:`ExpertLoRAAdapter`, or
    None where that projection has none.

    Args:
        adapters: The adapters by projection name (among ``EXPERT_PROJECTIONS``).

    Raises:
        ValueError: If a name is not an expert projection, or there is no adapter.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm.lora_experts import (
        ...     ExpertLoRA, ExpertLoRAAdapter)
        >>> up = ExpertLoRAAdapter(4, 8, 6, rank=2, scale=1.0, dtype=jnp.float32,
        ...                        rngs=nnx.Rngs(0))
        >>> sorted(ExpertLoRA({"up_proj": up}).deltas())
        ['up_proj']
    """

    def __init__(self, adapters: dict[str, ExpertLoRAAdapter]) -> None:
        unknown = sorted(set(adapters) - set(EXPERT_PROJECTIONS))
        if unknown or not adapters:
            msg = (
                f"ExpertLoRA: adapters must name expert projections among "
                f"{EXPERT_PROJECTIONS}, got {sorted(adapters)}"
            )
            raise ValueError(msg)
        self.gate_proj: Any = nnx.data(adapters.get("gate_proj"))
        self.up_proj: Any = nnx.data(adapters.get("up_proj"))
        self.down_proj: Any = nnx.data(adapters.get("down_proj"))

    def adapters(self) -> dict[str, ExpertLoRAAdapter]:
        """The adapters present.

        Returns:
            The adapters by projection name (those that are not None).
        """
        named = {name: getattr(self, name) for name in EXPERT_PROJECTIONS}
        return {name: a for name, a in named.items() if a is not None}

    def deltas(self) -> dict[str, ExpertDelta]:
        """The updates the experts' dispatch adds.

        Returns:
            Each adapter's ``ExpertDelta``, by projection name.
        """
        return {name: a.delta() for name, a in self.adapters().items()}


def expert_modules(model: Any) -> list[Experts]:
    """The ``Experts`` of every sparse layer of a model with per-layer storage.

    Args:
        model: A ``CausalLM`` (its layers unstacked).

    Returns:
        The layers' ``mlp.experts`` modules, in layer order (empty for a dense model).

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.models.causal_lm.lora_experts import expert_modules
        >>> cfg = CausalLMConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8,
        ...     intermediate_size=16, num_layers=2, num_heads=2, qk_norm=True, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=6)
        >>> len(expert_modules(CausalLM(cfg, rngs=nnx.Rngs(0))))
        2
    """
    out = []
    for layer in model.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if isinstance(experts, Experts):
            out.append(experts)
    return out


def add_expert_adapters(
    experts: Experts,
    names: tuple[str, ...],
    *,
    rank: int,
    scale: float,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
) -> None:
    """Gives each expert of ``experts`` its own adapter of the projections ``names``, in place.

    ``A`` is drawn for ``gate_proj``, ``up_proj``, ``down_proj`` in that order (those named).

    Args:
        experts: The stacked experts of one sparse layer.
        names: Projection names among ``EXPERT_PROJECTIONS`` (at least one).
        rank: Rank r.
        scale: The update scale ``s``.
        dtype: The adapters' parameter dtype.
        rngs: Random streams for ``A``.

    Raises:
        ValueError: If ``names`` is empty or names something other than an expert projection,
            or the experts already have adapters.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLMConfig
        >>> from artifex.generative_models.models.causal_lm.moe import Experts
        >>> from artifex.generative_models.models.causal_lm.lora_experts import (
        ...     add_expert_adapters)
        >>> cfg = CausalLMConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8,
        ...     intermediate_size=16, num_layers=1, num_heads=2, qk_norm=True, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=6)
        >>> experts = Experts(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> add_expert_adapters(experts, ("down_proj",), rank=2, scale=2.0,
        ...                     dtype=jnp.float32, rngs=nnx.Rngs(1))
        >>> experts.lora.down_proj.lora_a.shape  # (E, I, r)
        (4, 6, 2)
    """
    if not names or any(name not in EXPERT_PROJECTIONS for name in names):
        msg = (
            f"add_expert_adapters: names must be expert projections among "
            f"{EXPERT_PROJECTIONS}, got {tuple(names)!r}"
        )
        raise ValueError(msg)
    if experts.lora is not None:
        msg = "add_expert_adapters: the experts already have LoRA adapters"
        raise ValueError(msg)
    adapters = {}
    for name in EXPERT_PROJECTIONS:
        if name not in names:
            continue
        e, n_in, n_out = getattr(experts, name).shape
        adapters[name] = ExpertLoRAAdapter(
            e, n_in, n_out, rank=rank, scale=scale, dtype=dtype, rngs=rngs
        )
    experts.lora = ExpertLoRA(adapters)


def merge_expert_adapters(experts: Experts) -> None:
    """Folds the adapters of ``experts`` into their weights, in place: ``W_e' = W_e + s A_e B_e``.

    The product is formed in float32 and cast to the weights' dtype; ``experts.lora`` becomes
    None.

    Args:
        experts: The stacked experts of one sparse layer (with or without adapters).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLMConfig
        >>> from artifex.generative_models.models.causal_lm.moe import Experts
        >>> from artifex.generative_models.models.causal_lm.lora_experts import (
        ...     add_expert_adapters, merge_expert_adapters)
        >>> cfg = CausalLMConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8,
        ...     intermediate_size=16, num_layers=1, num_heads=2, qk_norm=True, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=6)
        >>> experts = Experts(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> add_expert_adapters(experts, ("up_proj",), rank=2, scale=1.0,
        ...                     dtype=jnp.float32, rngs=nnx.Rngs(1))
        >>> experts.lora.up_proj.lora_b.set_value(jnp.ones((4, 2, 6)))  # "trained"
        >>> x, e, w = jnp.ones((3, 8)), jnp.array([[0, 1], [2, 3], [1, 2]]), jnp.ones((3, 2))
        >>> adapted = experts(x, e, w)
        >>> merge_expert_adapters(experts)
        >>> experts.lora is None, bool(jnp.allclose(experts(x, e, w), adapted, atol=1e-5))
        (True, True)
    """
    if experts.lora is None:
        return
    for name, adapter in experts.lora.adapters().items():
        weight = getattr(experts, name)
        w = weight[...]
        a = adapter.lora_a[...].astype(jnp.float32) * adapter.scale
        b = adapter.lora_b[...].astype(jnp.float32)
        delta = jnp.einsum("eir,ero->eio", a, b)
        weight.set_value((w.astype(jnp.float32) + delta).astype(w.dtype))
    experts.lora = None
