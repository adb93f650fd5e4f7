"""GRPO configuration.

One frozen, keyword-only, validated dataclass covers GRPO and the variants the field has named
since DeepSeekMath. Each variant is a setting, not a new trainer:

- GRPO (Shao et al., 2024): the defaults -- ``scale_rewards="group"``,
  ``loss_aggregation="sequence_mean"``, ``kl_estimator="k3"``.
- Dr. GRPO (Liu et al., 2025): ``scale_rewards="none"``, ``loss_aggregation="constant_length"``,
  ``beta=0``.
- DAPO (Yu et al., 2025): ``clip_param=0.2``, ``clip_param_high=0.28``,
  ``loss_aggregation="token_mean"``, ``beta=0`` (plus dynamic sampling in the training loop).
- GSPO (Zheng et al., 2025): ``importance_sampling_level="sequence"``, ``clip_param=3e-4``,
  ``clip_param_high=4e-4``.
- RLOO (Ahmadian et al., 2024): ``baseline="leave_one_out"``, ``scale_rewards="none"``.
- CISPO (MiniMax-M1, 2025): ``policy_loss="cispo"``, ``cispo_max_weight=5.0``,
  ``loss_aggregation="token_mean"``.
- SAPO (Gao et al., 2025): ``policy_loss="sapo"`` with ``sapo_temperature_pos/neg``.
- VESPO: ``policy_loss="vespo"`` with ``vespo_k_pos/neg`` and ``vespo_lambda_pos/neg``.
- LUSPO: ``importance_sampling_level="sequence"``, ``loss_aggregation="sequence_sum"``.
- GSPO-token: ``importance_sampling_level="sequence_token"``.
- Importance-weighted KL (DeepSeek-V3.2): ``kl_importance_weighted=True``.
- Sampler/trainer mismatch correction (TIS, MIS, IcePop): ``sampler_correction`` with
  ``sampler_correction_level``, ``sampler_ratio_min`` and ``sampler_ratio_max``.
- Off-policy sequence masking (DeepSeek-V3.2): ``off_policy_mask_threshold``.
- High-entropy token training (Wang et al., 2025): ``top_entropy_quantile=0.2``.
- REINFORCE++ and pass@k advantages: ``advantage_estimator``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from artifex.generative_models.utils.validation import (
    check_bool,
    check_choice,
    check_float,
    check_int,
)

__all__ = [
    "AdvantageBaseline",
    "AdvantageEstimator",
    "GRPOConfig",
    "ImportanceSamplingLevel",
    "KLEstimator",
    "LossAggregation",
    "PolicyLoss",
    "RewardScaling",
    "SamplerCorrection",
    "SamplerCorrectionLevel",
]

RewardScaling = Literal["group", "batch", "none"]
KLEstimator = Literal["k1", "k2", "k3"]
LossAggregation = Literal["sequence_mean", "token_mean", "constant_length", "sequence_sum"]
ImportanceSamplingLevel = Literal["token", "sequence", "sequence_token"]
AdvantageBaseline = Literal["group_mean", "leave_one_out"]
PolicyLoss = Literal["clip", "cispo", "sapo", "vespo"]
SamplerCorrection = Literal["none", "truncate", "mask"]
SamplerCorrectionLevel = Literal["token", "sequence", "geometric"]
AdvantageEstimator = Literal["grpo", "reinforce_pp", "reinforce_pp_baseline", "pass_at_k"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "scale_rewards": ("group", "batch", "none"),
    "kl_estimator": ("k1", "k2", "k3"),
    "loss_aggregation": ("sequence_mean", "token_mean", "constant_length", "sequence_sum"),
    "importance_sampling_level": ("token", "sequence", "sequence_token"),
    "baseline": ("group_mean", "leave_one_out"),
    "policy_loss": ("clip", "cispo", "sapo", "vespo"),
    "sampler_correction": ("none", "truncate", "mask"),
    "sampler_correction_level": ("token", "sequence", "geometric"),
    "advantage_estimator": ("grpo", "reinforce_pp", "reinforce_pp_baseline", "pass_at_k"),
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    r"""Hyper-parameters of the GRPO objective and update.

    For a prompt with ``G`` completions ``o_i`` and rewards ``r_i``, the loss is the negative of
    (DeepSeekMath, eq. 3)

    .. math::

        \frac{1}{G}\sum_i \frac{1}{|o_i|}\sum_t \Big[\min\big(\rho_{i,t} \hat A_{i,t},
        \operatorname{clip}(\rho_{i,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high})\hat A_{i,t}\big)
        - \beta\, D_{KL}[\pi_\theta \| \pi_{ref}]_{i,t} + c_H\, H_{i,t}\Big]

    with ``rho = pi_theta / pi_old`` and ``A_i = (r_i - mean(r)) / (std(r) + eps)``. The
    variants (Dr. GRPO, DAPO, GSPO, RLOO, ...) are settings of these fields: see
    :mod:`~artifex.generative_models.training.rl.configs`.

    Attributes:
        num_generations: Group size ``G >= 2``; row ``i`` of a batch belongs to prompt ``i // G``.
        clip_param: ``epsilon_low`` in (0, 1); also ``epsilon_high`` unless that is set.
        clip_param_high: ``epsilon_high > 0`` (DAPO's clip-higher, arXiv:2503.14476).
        dual_clip: ``c > 1`` caps a negative-advantage token's loss at ``c * |A|``
            (arXiv:1912.09729).
        beta: KL coefficient >= 0; 0 skips the reference model.
        kl_estimator: KL estimate from ``log_r = log pi_ref - log pi_theta`` (Schulman, 2020):
            ``"k1"`` ``-log_r``, ``"k2"`` ``log_r**2 / 2``, ``"k3"`` ``exp(log_r) - log_r - 1``.
        entropy_coeff: Weight ``c_H >= 0`` of the entropy bonus.
        gamma: Discount in (0, 1] of per-step ``step_rewards`` (DeepSeekMath sec. 4.1.3).
        scale_rewards: Divide centered rewards by the ``"group"`` std, the ``"batch"`` std
            (arXiv:2508.08221) or ``"none"`` (Dr. GRPO, arXiv:2503.20783).
        std_ddof: Delta degrees of freedom of that std, 1 (Bessel) or 0.
        advantage_eps: ``eps >= 0`` added to the std.
        baseline: ``"group_mean"`` or ``"leave_one_out"`` (RLOO, arXiv:2402.14740).
        loss_aggregation: ``"sequence_mean"`` (GRPO), ``"token_mean"`` (DAPO),
            ``"constant_length"`` (Dr. GRPO) or ``"sequence_sum"`` (LUSPO); see
            :func:`~artifex.generative_models.training.rl.aggregate_loss`.
        max_completion_length: Length of ``"constant_length"``; ``None``: the batch's width.
        importance_sampling_level: Ratios per ``"token"``, per ``"sequence"`` (GSPO,
            arXiv:2507.18071) or ``"sequence_token"`` (GSPO-token).
        max_grad_norm: Bound (> 0) on the gradient's global L2 norm; ``None``: no clipping.
        temperature: ``tau > 0``; the policy sampled and optimized is ``softmax(logits / tau)``.
        policy_loss: ``"clip"`` (PPO/GRPO), ``"cispo"`` (arXiv:2506.13585), ``"sapo"``
            (arXiv:2511.20347) or ``"vespo"`` (arXiv:2602.10693).
        cispo_max_weight: CISPO's cap ``eps_max > 0`` on the importance weight.
        sapo_temperature_pos: SAPO gate temperature (> 0) where ``A > 0``.
        sapo_temperature_neg: SAPO gate temperature (> 0) where ``A <= 0``.
        vespo_k_pos: VESPO power ``k >= 0`` where ``A >= 0``.
        vespo_lambda_pos: VESPO decay ``lambda > 0`` where ``A >= 0``.
        vespo_k_neg: VESPO power ``k >= 0`` where ``A < 0``.
        vespo_lambda_neg: VESPO decay ``lambda > 0`` where ``A < 0``.
        kl_importance_weighted: Weight the KL estimate by the ratio to the sampler
            (DeepSeek-V3.2, arXiv:2512.02556).
        sampler_correction: Sampler/trainer mismatch correction (arXiv:2510.18855):
            ``"truncate"`` (TIS), ``"mask"`` (MIS, IcePop) or ``"none"``.
        sampler_correction_level: Its ratio per ``"token"``, ``"sequence"`` or
            ``"geometric"`` (mean of the log ratios).
        sampler_ratio_min: Lower bound (>= 0) of that ratio; ``None``: unbounded.
        sampler_ratio_max: Upper bound (> 0) of that ratio; ``None``: unbounded.
        off_policy_mask_threshold: Leave out negative-advantage completions this far
            off-policy (DeepSeek-V3.2, eq. 9); ``None``: off.
        top_entropy_quantile: Fraction in [0, 1] of highest-entropy tokens trained
            (arXiv:2506.01939).
        advantage_estimator: ``"grpo"``, ``"reinforce_pp"``, ``"reinforce_pp_baseline"``
            (arXiv:2501.03262) or ``"pass_at_k"`` (arXiv:2508.10751).
        pass_at_k: ``k >= 1`` of ``"pass_at_k"``.
        remat: Recompute decoder activations in the backward pass: less memory, one more
            forward pass, same values.
        remat_every: With ``remat``, recompute only every n-th layer; not with ``scan_layers``.
        scan_layers: Run the update's decoder layers as one ``jax.lax.scan``: faster compile
            for deep models, slower updates on the CPU, same values.
        layerwise_update: Run a ``CausalLM`` update as per-layer programs, whose compile time
            does not grow with depth; needs ``remat=True`` and ``remat_every=1``.
        optimizer_by_layer: Let ``GRPOTrainer`` update one layer per program (faster compile)
            where the result is the same: an element-wise optimizer, 8 or more layers,
            parameters on the CPU (XLA:CPU's compile time is what it shortens), no mesh.

    Raises:
        TypeError: If a field has the wrong type (``num_generations=4.0``, ``beta="0.1"``).
        ValueError: If a field is out of range, not one of its choices, or contradicts
            another field.

    Examples:
        >>> from artifex.generative_models.training import GRPOConfig
        >>> config = GRPOConfig(num_generations=4, clip_param_high=0.28, beta=0.0)
        >>> config.num_generations, config.clip_param, config.clip_param_high
        (4, 0.2, 0.28)
        >>> GRPOConfig(num_generations=1)
        Traceback (most recent call last):
            ...
        ValueError: GRPOConfig.num_generations must be an int >= 2, got 1
    """

    num_generations: int = 4
    clip_param: float = 0.2
    clip_param_high: float | None = None
    dual_clip: float | None = None
    beta: float = 0.01
    kl_estimator: KLEstimator = "k3"
    entropy_coeff: float = 0.01
    gamma: float = 1.0
    scale_rewards: RewardScaling = "group"
    std_ddof: int = 1
    advantage_eps: float = 1e-4
    baseline: AdvantageBaseline = "group_mean"
    loss_aggregation: LossAggregation = "sequence_mean"
    max_completion_length: int | None = None
    importance_sampling_level: ImportanceSamplingLevel = "token"
    max_grad_norm: float | None = 1.0
    temperature: float = 1.0
    policy_loss: PolicyLoss = "clip"
    cispo_max_weight: float = 5.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl_importance_weighted: bool = False
    sampler_correction: SamplerCorrection = "none"
    sampler_correction_level: SamplerCorrectionLevel = "token"
    sampler_ratio_min: float | None = None
    sampler_ratio_max: float | None = 3.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    advantage_estimator: AdvantageEstimator = "grpo"
    pass_at_k: int = 1
    remat: bool = False
    remat_every: int = 1
    scan_layers: bool = False
    layerwise_update: bool = False
    optimizer_by_layer: bool = True

    def __post_init__(self) -> None:
        # Wrong type: TypeError; right type, out of range: ValueError (utils.validation).
        f = "GRPOConfig."
        check_int(f + "num_generations", self.num_generations, minimum=2)
        check_float(f + "clip_param", self.clip_param, greater_than=0.0, less_than=1.0)
        check_float(f + "clip_param_high", self.clip_param_high, greater_than=0.0, allow_none=True)
        check_float(f + "dual_clip", self.dual_clip, greater_than=1.0, allow_none=True)
        for name in ("beta", "entropy_coeff", "advantage_eps"):
            check_float(f + name, getattr(self, name), minimum=0.0)
        check_float(f + "gamma", self.gamma, greater_than=0.0, maximum=1.0)
        check_int(f + "std_ddof", self.std_ddof, minimum=0, maximum=1)
        for name, choices in _CHOICES.items():
            check_choice(f + name, getattr(self, name), choices)
        check_int(
            f + "max_completion_length", self.max_completion_length, minimum=1, allow_none=True
        )
        check_float(f + "temperature", self.temperature, greater_than=0.0)
        check_float(f + "max_grad_norm", self.max_grad_norm, greater_than=0.0, allow_none=True)
        check_bool(f + "remat", self.remat)
        check_int(f + "remat_every", self.remat_every, minimum=1)
        check_bool(f + "scan_layers", self.scan_layers)
        if self.remat_every > 1 and not self.remat:
            msg = f"GRPOConfig.remat_every={self.remat_every} needs remat=True"
            raise ValueError(msg)
        if self.remat_every > 1 and self.scan_layers:
            msg = (
                f"GRPOConfig.remat_every={self.remat_every} needs unrolled layers, not "
                "scan_layers=True (a scan rematerializes all its layers or none)"
            )
            raise ValueError(msg)
        check_bool(f + "layerwise_update", self.layerwise_update)
        check_bool(f + "optimizer_by_layer", self.optimizer_by_layer)
        if self.layerwise_update and (not self.remat or self.remat_every > 1 or self.scan_layers):
            msg = (
                "GRPOConfig.layerwise_update=True recomputes every decoder layer in the backward "
                "pass: it needs remat=True, remat_every=1 and scan_layers=False, got "
                f"remat={self.remat}, remat_every={self.remat_every}, "
                f"scan_layers={self.scan_layers}"
            )
            raise ValueError(msg)
        self._check_variants()

    def _check_variants(self) -> None:
        f = "GRPOConfig."
        for name in (
            "cispo_max_weight",
            "sapo_temperature_pos",
            "sapo_temperature_neg",
            "vespo_lambda_pos",
            "vespo_lambda_neg",
        ):
            check_float(f + name, getattr(self, name), greater_than=0.0)
        for name in ("vespo_k_pos", "vespo_k_neg"):
            check_float(f + name, getattr(self, name), minimum=0.0)
        check_bool(f + "kl_importance_weighted", self.kl_importance_weighted)
        lo = check_float(
            f + "sampler_ratio_min", self.sampler_ratio_min, minimum=0.0, allow_none=True
        )
        hi = check_float(
            f + "sampler_ratio_max", self.sampler_ratio_max, greater_than=0.0, allow_none=True
        )
        check_float(
            f + "off_policy_mask_threshold", self.off_policy_mask_threshold, allow_none=True
        )
        if lo is not None and hi is not None and lo > hi:
            msg = f"GRPOConfig.sampler_ratio_min ({lo}) must be <= sampler_ratio_max ({hi})"
            raise ValueError(msg)
        if (
            self.policy_loss == "vespo"
            and self.sampler_correction != "none"
            and self.sampler_correction_level != "token"
        ):
            msg = (
                "GRPOConfig.policy_loss='vespo' folds the sampler correction into its sequence "
                "weight token by token: sampler_correction_level must be 'token', "
                f"got {self.sampler_correction_level!r}"
            )
            raise ValueError(msg)
        check_float(f + "top_entropy_quantile", self.top_entropy_quantile, minimum=0.0, maximum=1.0)
        check_int(f + "pass_at_k", self.pass_at_k, minimum=1)
        if self.pass_at_k > 1 and self.advantage_estimator != "pass_at_k":
            msg = (
                f"GRPOConfig.pass_at_k={self.pass_at_k} is only used with "
                f"advantage_estimator='pass_at_k', got {self.advantage_estimator!r}"
            )
            raise ValueError(msg)

    @property
    def remat_option(self) -> bool | int:
        """``remat=`` for the log-prob functions: False, True (every layer) or every n-th."""
        if not self.remat:
            return False
        return True if self.remat_every == 1 else self.remat_every

    @property
    def epsilon_low(self) -> float:
        """Lower clipping range: the ratio is clipped below at ``1 - epsilon_low``."""
        return self.clip_param

    @property
    def epsilon_high(self) -> float:
        """Upper clipping range: the ratio is clipped above at ``1 + epsilon_high``."""
        return self.clip_param if self.clip_param_high is None else self.clip_param_high

    def replace(self, **changes: Any) -> GRPOConfig:
        """Returns a copy with ``changes`` applied (and validated).

        Args:
            **changes: Field names and their new values.

        Returns:
            A new ``GRPOConfig``.
        """
        return dataclasses.replace(self, **changes)
