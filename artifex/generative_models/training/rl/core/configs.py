"""GRPO configuration.

One frozen, keyword-only, validated dataclass covers GRPO and the variants the field has named
since DeepSeekMath. Each variant is a setting, not a new trainer:

- GRPO (Shao et al., 2024, arXiv:2402.03300): the defaults -- ``scale_rewards="group"``,
  ``loss_aggregation="sequence_mean"``, ``kl_estimator="k3"``; ``gamma`` discounts per-step
  rewards (process supervision, sec. 4.1.3).
- Dr. GRPO (Liu et al., 2025, arXiv:2503.20783): ``scale_rewards="none"``,
  ``loss_aggregation="constant_length"``, ``beta=0``.
- DAPO (Yu et al., 2025, arXiv:2503.14476): ``clip_param=0.2``, ``clip_param_high=0.28``,
  ``loss_aggregation="token_mean"``, ``beta=0`` (plus dynamic sampling in the training loop).
- GSPO (Zheng et al., 2025, arXiv:2507.18071): ``importance_sampling_level="sequence"``,
  ``clip_param=3e-4``, ``clip_param_high=4e-4``; GSPO-token: ``"sequence_token"``.
- RLOO (Ahmadian et al., 2024, arXiv:2402.14740): ``baseline="leave_one_out"``,
  ``scale_rewards="none"``.
- Batch-level reward scaling (Liu et al., 2025, arXiv:2508.08221): ``scale_rewards="batch"``.
- Dual clipping (Ye et al., 2020, arXiv:1912.09729): ``dual_clip``.
- CISPO (MiniMax-M1, arXiv:2506.13585): ``policy_loss="cispo"``, ``cispo_max_weight=5.0``,
  ``loss_aggregation="token_mean"``.
- SAPO (Gao et al., 2025, arXiv:2511.20347): ``policy_loss="sapo"`` with
  ``sapo_temperature_pos/neg``.
- VESPO (arXiv:2602.10693): ``policy_loss="vespo"`` with ``vespo_k_pos/neg`` and
  ``vespo_lambda_pos/neg``.
- LUSPO (arXiv:2602.05261): ``importance_sampling_level="sequence"``,
  ``loss_aggregation="sequence_sum"``.
- DeepSeek-V3.2 (arXiv:2512.02556): ``kl_importance_weighted=True`` (importance-weighted KL) and
  ``off_policy_mask_threshold`` (off-policy sequence masking, eq. 9).
- Sampler/trainer mismatch correction (TIS, MIS, IcePop; arXiv:2510.18855): ``sampler_correction``
  with ``sampler_correction_level``, ``sampler_ratio_min`` and ``sampler_ratio_max``.
- High-entropy token training (Wang et al., 2025, arXiv:2506.01939): ``top_entropy_quantile=0.2``.
- REINFORCE++ (arXiv:2501.03262) and pass@k (arXiv:2508.10751) advantages:
  ``advantage_estimator``.
- Rollout routing replay for mixture-of-experts policies (R3; Ma et al., 2025,
  arXiv:2510.11370): ``routing_replay=True`` (the rollout records each token's experts, and
  the update and the old log-probs the trainer scores route the tokens to them, so that the
  first ratio of an update is 1; ``GRPOTrainer`` refuses it for a model without experts), and
  ``moe_aux_loss_coef``, the weight of the load-balancing loss's gradient (Fedus et al., 2021,
  arXiv:2101.03961; e.g. the model config's ``router_aux_loss_coef``); see
  :mod:`~artifex.generative_models.training.rl.core.routing_replay`.
- On-policy distillation (GKD, arXiv:2306.13649; Thinking Machines, 2025): a teacher's
  per-token divergence on the student's samples, ``distillation_coeff`` with
  ``distillation_divergence`` and ``jsd_beta``, added to the GRPO loss or alone
  (``policy_loss_coeff=0``); see
  :mod:`~artifex.generative_models.training.rl.core.distillation`.

The KL estimators ``k1``, ``k2`` and ``k3`` are Schulman's (2020, "Approximating KL
Divergence"); ``"exact"`` is the closed-form KL a log-prob function provides (a flow model's
Gaussian transitions, Flow-GRPO); formulas of every option are in the docstrings of
:mod:`~artifex.generative_models.training.rl.core.losses` and
:mod:`~artifex.generative_models.training.rl.core.advantages`.
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
    "DistillationDivergence",
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
KLEstimator = Literal["k1", "k2", "k3", "exact"]
LossAggregation = Literal["sequence_mean", "token_mean", "constant_length", "sequence_sum"]
ImportanceSamplingLevel = Literal["token", "sequence", "sequence_token"]
AdvantageBaseline = Literal["group_mean", "leave_one_out"]
PolicyLoss = Literal["clip", "cispo", "sapo", "vespo"]
SamplerCorrection = Literal["none", "truncate", "mask"]
SamplerCorrectionLevel = Literal["token", "sequence", "geometric"]
AdvantageEstimator = Literal["grpo", "reinforce_pp", "reinforce_pp_baseline", "pass_at_k"]
DistillationDivergence = Literal["reverse_kl", "forward_kl", "jsd"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "scale_rewards": ("group", "batch", "none"),
    "kl_estimator": ("k1", "k2", "k3", "exact"),
    "loss_aggregation": ("sequence_mean", "token_mean", "constant_length", "sequence_sum"),
    "importance_sampling_level": ("token", "sequence", "sequence_token"),
    "baseline": ("group_mean", "leave_one_out"),
    "policy_loss": ("clip", "cispo", "sapo", "vespo"),
    "sampler_correction": ("none", "truncate", "mask"),
    "sampler_correction_level": ("token", "sequence", "geometric"),
    "advantage_estimator": ("grpo", "reinforce_pp", "reinforce_pp_baseline", "pass_at_k"),
    "distillation_divergence": ("reverse_kl", "forward_kl", "jsd"),
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    """Hyper-parameters of the GRPO objective and update.

    Variants and their papers: :mod:`~artifex.generative_models.training.rl.core.configs`; the
    objective: :mod:`~artifex.generative_models.training.rl.core.objective`.

    Attributes:
        num_generations: Group size ``G >= 2``: completions per prompt.
        clip_param: ``epsilon_low`` in (0, 1), also ``epsilon_high`` by default.
        clip_param_high: ``epsilon_high > 0`` (DAPO).
        dual_clip: ``c > 1`` bounding negative-advantage losses by ``c |A|``.
        beta: KL coefficient >= 0.
        kl_estimator: ``"k1"``/``"k2"``/``"k3"`` (Schulman, 2020) or ``"exact"``.
        entropy_coeff: Entropy bonus weight >= 0.
        gamma: Per-step reward discount in (0, 1].
        scale_rewards: Scale by the ``"group"`` or ``"batch"`` std, or ``"none"``.
        std_ddof: The std's ddof, 1 or 0.
        advantage_eps: ``eps >= 0`` added to the std.
        baseline: ``"group_mean"`` or ``"leave_one_out"`` (RLOO).
        loss_aggregation: ``"sequence_mean"``, ``"token_mean"``, ``"constant_length"`` or
            ``"sequence_sum"``.
        max_completion_length: ``"constant_length"``'s length; ``None``: batch width.
        importance_sampling_level: Ratios per ``"token"``, ``"sequence"`` (GSPO) or
            ``"sequence_token"``.
        max_grad_norm: Gradient-norm bound > 0; ``None``: none.
        temperature: Sampling temperature ``tau > 0``.
        policy_loss: ``"clip"``, ``"cispo"``, ``"sapo"`` or ``"vespo"``.
        cispo_max_weight: CISPO's importance-weight cap > 0.
        sapo_temperature_pos: SAPO temperature > 0 where ``A > 0``.
        sapo_temperature_neg: SAPO temperature > 0 where ``A <= 0``.
        vespo_k_pos: VESPO ``k >= 0`` for ``A >= 0``.
        vespo_lambda_pos: VESPO ``lambda > 0`` where ``A >= 0``.
        vespo_k_neg: VESPO ``k >= 0`` where ``A < 0``.
        vespo_lambda_neg: VESPO ``lambda > 0`` where ``A < 0``.
        kl_importance_weighted: Weight the KL by the sampler ratio (DeepSeek-V3.2).
        sampler_correction: ``"truncate"`` (TIS), ``"mask"`` (MIS) or ``"none"``.
        sampler_correction_level: Sampler ratio per ``"token"``, ``"sequence"`` or ``"geometric"``.
        sampler_ratio_min: Sampler ratio lower bound >= 0; ``None``: none.
        sampler_ratio_max: Sampler ratio upper bound > 0; ``None``: none.
        off_policy_mask_threshold: Off-policy sequence mask ``delta``; ``None``: off.
        top_entropy_quantile: Fraction in [0, 1] of highest-entropy tokens trained.
        advantage_estimator: ``"grpo"``, ``"reinforce_pp"``, ``"reinforce_pp_baseline"`` or
            ``"pass_at_k"``.
        pass_at_k: ``k >= 1`` of ``"pass_at_k"``.
        mask_truncated_completions: DAPO's overlong filtering.
        sync_ref_model: TR-DPO reference sync.
        ref_model_mixup_alpha: Policy weight in [0, 1].
        ref_model_sync_steps: Updates per sync.
        remat: Gradient checkpointing of the decoder layers (same values).
        remat_every: With ``remat``, recompute only every n-th layer.
        scan_layers: Scan the update's decoder layers (faster compile).
        layerwise_update: Per-layer update programs (needs ``remat``).
        optimizer_by_layer: Per-layer optimizer programs (``GRPOTrainer``).
        update_without_advantage: Apply all-zero-advantage updates (``False``: skip).
        policy_loss_coeff: Policy term weight >= 0 (0: distillation alone).
        distillation_coeff: Teacher divergence weight >= 0.
        distillation_divergence: ``"reverse_kl"``, ``"forward_kl"`` or ``"jsd"``.
        jsd_beta: JSD teacher weight in (0, 1).
        routing_replay: Replay the rollout's experts in the update (R3, MoE).
        moe_aux_loss_coef: MoE load-balancing loss weight >= 0.

    Raises:
        TypeError: A wrongly typed field.
        ValueError: A field out of range or inconsistent.

    Examples:
        >>> from artifex.generative_models.training import GRPOConfig
        >>> GRPOConfig(num_generations=4, clip_param_high=0.28).epsilon_high
        0.28
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
    mask_truncated_completions: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    remat: bool = False
    remat_every: int = 1
    scan_layers: bool = False
    layerwise_update: bool = False
    optimizer_by_layer: bool = True
    update_without_advantage: bool = False
    policy_loss_coeff: float = 1.0
    distillation_coeff: float = 0.0
    distillation_divergence: DistillationDivergence = "reverse_kl"
    jsd_beta: float = 0.5
    routing_replay: bool = False
    moe_aux_loss_coef: float = 0.0

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
        check_bool(f + "update_without_advantage", self.update_without_advantage)
        if self.layerwise_update and (not self.remat or self.remat_every > 1 or self.scan_layers):
            msg = (
                "GRPOConfig.layerwise_update=True recomputes every decoder layer in the backward "
                "pass: it needs remat=True, remat_every=1 and scan_layers=False, got "
                f"remat={self.remat}, remat_every={self.remat_every}, "
                f"scan_layers={self.scan_layers}"
            )
            raise ValueError(msg)
        self._check_variants()
        self._check_distillation()
        self._check_experts()

    def _check_experts(self) -> None:
        f = "GRPOConfig."
        check_bool(f + "routing_replay", self.routing_replay)
        check_float(f + "moe_aux_loss_coef", self.moe_aux_loss_coef, minimum=0.0)
        options = [
            f"{name}={getattr(self, name)}"
            for name, default in (("routing_replay", False), ("moe_aux_loss_coef", 0.0))
            if getattr(self, name) != default
        ]
        if not options:
            return
        what = f"GRPOConfig.{' and '.join(options)} {'is' if len(options) == 1 else 'are'}"
        if self.layerwise_update:
            msg = (
                f"{what} for the mixture-of-experts log-probs of the one-program update, which "
                "layerwise_update=True does not run: set layerwise_update=False"
            )
            raise ValueError(msg)
        if self.distillation_coeff > 0.0 and self.distillation_divergence != "reverse_kl":
            msg = (
                f"{what} for the student's sampled-token log-probs; "
                f"distillation_divergence={self.distillation_divergence!r} computes them from "
                "the full logits without routing replay or the aux loss: use 'reverse_kl'"
            )
            raise ValueError(msg)

    def _check_distillation(self) -> None:
        f = "GRPOConfig."
        check_float(f + "policy_loss_coeff", self.policy_loss_coeff, minimum=0.0)
        check_float(f + "distillation_coeff", self.distillation_coeff, minimum=0.0)
        check_float(f + "jsd_beta", self.jsd_beta, greater_than=0.0, less_than=1.0)
        if self.jsd_beta != 0.5 and self.distillation_divergence != "jsd":
            msg = (
                f"GRPOConfig.jsd_beta={self.jsd_beta} is only used with "
                f"distillation_divergence='jsd', got {self.distillation_divergence!r}"
            )
            raise ValueError(msg)
        if self.distillation_coeff == 0.0:
            if self.distillation_divergence != "reverse_kl":
                msg = (
                    f"GRPOConfig.distillation_divergence={self.distillation_divergence!r} is "
                    "only used with distillation_coeff > 0, got distillation_coeff=0"
                )
                raise ValueError(msg)
            if self.policy_loss_coeff == 0.0:
                msg = (
                    "GRPOConfig.policy_loss_coeff=0 switches the policy term off: it needs "
                    "distillation_coeff > 0 (distillation alone), got distillation_coeff=0"
                )
                raise ValueError(msg)
            return
        if self.layerwise_update:
            msg = (
                "GRPOConfig.distillation_coeff > 0 runs a teacher in the update, which "
                "layerwise_update=True does not support; set layerwise_update=False"
            )
            raise ValueError(msg)
        if self.kl_estimator == "exact":
            msg = (
                "GRPOConfig.distillation_coeff > 0 needs a token-level policy; "
                "kl_estimator='exact' (flow models) does not combine with it"
            )
            raise ValueError(msg)

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
        check_bool(f + "mask_truncated_completions", self.mask_truncated_completions)
        check_bool(f + "sync_ref_model", self.sync_ref_model)
        check_float(
            f + "ref_model_mixup_alpha", self.ref_model_mixup_alpha, minimum=0.0, maximum=1.0
        )
        check_int(f + "ref_model_sync_steps", self.ref_model_sync_steps, minimum=1)
        if self.sync_ref_model and self.beta == 0.0:
            msg = (
                "GRPOConfig.sync_ref_model=True needs beta > 0: with beta=0 there is no "
                "reference to sync"
            )
            raise ValueError(msg)
        if not self.sync_ref_model and (
            self.ref_model_mixup_alpha != 0.6 or self.ref_model_sync_steps != 512
        ):
            msg = (
                "GRPOConfig.ref_model_mixup_alpha and ref_model_sync_steps are only used with "
                f"sync_ref_model=True, got alpha={self.ref_model_mixup_alpha}, "
                f"steps={self.ref_model_sync_steps} with sync_ref_model=False"
            )
            raise ValueError(msg)
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
