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

    For prompt ``q`` with ``G`` sampled completions ``o_1..o_G`` with rewards ``r_i``, GRPO
    (DeepSeekMath, eq. 3) maximizes

    .. math::

        \frac{1}{G}\sum_i \frac{1}{|o_i|}\sum_t \Big[\min\big(\rho_{i,t} \hat A_{i,t},
        \operatorname{clip}(\rho_{i,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high})\hat A_{i,t}\big)
        - \beta\, D_{KL}[\pi_\theta \| \pi_{ref}]_{i,t} + c_H\, H_{i,t}\Big]

    with ``rho = pi_theta / pi_old`` and group-normalized advantages
    ``A_i = (r_i - mean(r)) / (std(r) + eps)``. The loss minimized is the negative.

    Attributes:
        num_generations: Group size ``G``: completions per prompt; batches hold
            ``num_prompts * G`` rows, prompt-major. Must be >= 2. A batch may override it.
        clip_param: ``epsilon_low``: the ratio is clipped below at ``1 - clip_param``. Also the
            upper bound unless ``clip_param_high`` is set (symmetric PPO clipping). In (0, 1).
        clip_param_high: ``epsilon_high`` for asymmetric "clip-higher" (DAPO, Yu et al., 2025,
            arXiv:2503.14476, uses 0.28): the ratio is clipped above at ``1 + clip_param_high``.
            ``None`` means ``clip_param``.
        dual_clip: Dual clipping constant ``c > 1`` (Ye et al., 2020, arXiv:1912.09729): for
            negative advantages the per-token objective is bounded below by ``c * A``, i.e. the
            loss is at most ``c * |A|`` however large the ratio grows. ``None`` disables it.
        beta: KL coefficient ``beta`` >= 0. The reference log-probs come from the batch
            (``ref_log_probs``), or from ``reference_model`` inside the step, or for LoRA models
            from the same model with adapters disabled. ``0`` skips the reference entirely.
        kl_estimator: Per-token estimator of ``KL[pi_theta || pi_ref]`` from samples of
            ``pi_theta``, with ``log_r = log pi_ref - log pi_theta`` (Schulman, 2020,
            "Approximating KL divergence"): ``"k1"``: ``-log_r`` (unbiased, high variance);
            ``"k2"``: ``log_r**2 / 2``; ``"k3"``: ``exp(log_r) - log_r - 1`` (unbiased,
            non-negative, low variance; DeepSeekMath eq. 4; the default, as in TRL and Tunix).
        entropy_coeff: Weight ``c_H >= 0`` of the mean token entropy subtracted from the loss
            (an exploration bonus, as in PPO, Schulman et al., 2017).
        gamma: Discount ``gamma`` in (0, 1] for process supervision (DeepSeekMath, sec. 4.1.3):
            when a batch carries per-step ``step_rewards``, token ``t``'s advantage is
            ``sum_{s >= t} gamma**(s - t) * r~_s`` over the normalized step rewards ``r~``.
            With ``gamma=1`` this is the paper's formula. Outcome rewards (one per
            completion, the usual case) give every token the same advantage, so ``gamma`` has no
            effect there, as in DeepSeekMath, TRL and Tunix.
        scale_rewards: How centered rewards are scaled: ``"group"`` divides by the group's std
            (GRPO); ``"batch"`` by the std of all rewards in the batch (Liu et al., 2025,
            "Tricks or Traps", arXiv:2508.08221); ``"none"`` leaves them unscaled (Dr. GRPO,
            Liu et al., 2025, arXiv:2503.20783).
        std_ddof: Delta degrees of freedom of that std: 1 (Bessel's correction, the default,
            as ``torch.std`` in TRL and ``jnp.std(ddof=1)`` in Tunix) or 0 (population std, as
            written in some GRPO tutorials).
        advantage_eps: ``eps`` >= 0 added to the std before dividing (TRL and Tunix use 1e-4).
        baseline: ``"group_mean"`` subtracts the group mean (GRPO); ``"leave_one_out"``
            subtracts the mean of the other members of the group (RLOO, Ahmadian et al., 2024,
            arXiv:2402.14740), which equals ``G/(G-1)`` times the group-mean advantage.
        loss_aggregation: How per-token losses become one number: ``"sequence_mean"`` averages
            each completion's tokens, then the completions (GRPO paper); ``"token_mean"``
            averages all tokens of the batch (DAPO); ``"constant_length"`` sums tokens and
            divides by ``rows * max_completion_length`` (Dr. GRPO), removing the length bias;
            ``"sequence_sum"`` sums each completion's tokens and averages the completions, so
            a sequence-level loss weighs by its length (LUSPO, TRL ``loss_type="luspo"``).
        max_completion_length: The constant length for ``"constant_length"`` aggregation.
            ``None`` uses the padded completion width of the batch.
        importance_sampling_level: ``"token"``: per-token ratios ``pi_theta / pi_old`` (GRPO);
            ``"sequence"``: one length-normalized ratio per completion,
            ``s_i = exp(mean_t(log pi_theta - log pi_old))`` (GSPO, Zheng et al., 2025,
            arXiv:2507.18071), clipped per sequence; ``"sequence_token"``: GSPO-token,
            ``s_{i,t} = sg[s_i] * pi_theta(o_t) / sg[pi_theta(o_t)]``, whose value is ``s_i`` and
            whose gradient is per token (so per-token advantages keep their meaning).
        max_grad_norm: Gradients are rescaled so their global L2 norm is at most this
            (Pascanu et al., 2013). ``None`` disables clipping (the norm is still reported).
        temperature: Sampling temperature ``tau > 0``. The policy being optimized is
            ``softmax(z / tau)``: completions are sampled at ``tau`` and their log-probs are
            scored at ``tau`` in the loss (as TRL does), so the update is on-policy.
        policy_loss: The per-token policy term: ``"clip"`` (PPO/GRPO clipped surrogate);
            ``"cispo"``: ``-sg[min(rho, cispo_max_weight)] * A * log pi_theta`` (MiniMax-M1,
            arXiv:2506.13585; ScaleRL, arXiv:2510.13786); ``"sapo"``: the soft gate
            ``-(4 / tau) * sigmoid(tau * (rho - 1)) * A`` (SAPO, arXiv:2511.20347);
            ``"vespo"``: ``-sg[phi(w_i)] * A * log pi_theta`` with the Gamma weight
            ``phi(w) = exp(lambda + k log w - lambda w)`` of the sequence ratio
            ``w_i = prod_t rho_t`` (VESPO, arXiv:2602.10693, as TRL 1.16 defines it).
        cispo_max_weight: CISPO's upper cap ``eps_max`` on the importance weight (ScaleRL
            recommends 5; TRL reads it from ``epsilon_high`` when ``loss_type="cispo"``). > 0.
        sapo_temperature_pos: SAPO gate temperature ``tau_pos > 0`` for tokens with ``A > 0``.
        sapo_temperature_neg: SAPO gate temperature ``tau_neg > 0`` for tokens with ``A <= 0``.
        vespo_k_pos: VESPO power ``k`` for ``A >= 0`` (>= 0).
        vespo_lambda_pos: VESPO decay ``lambda`` for ``A >= 0`` (> 0).
        vespo_k_neg: VESPO power ``k`` for ``A < 0`` (>= 0).
        vespo_lambda_neg: VESPO decay ``lambda`` for ``A < 0`` (> 0).
        kl_importance_weighted: Multiply the per-token KL estimate by the (differentiable)
            importance ratio ``rho`` to the sampling policy, making its gradient the unbiased
            reverse-KL gradient (DeepSeek-V3.2, arXiv:2512.02556; TRL
            ``use_bias_correction_kl``).
        sampler_correction: Correction for the mismatch between the sampler's log-probs
            (``GRPOBatch.sampler_log_probs``) and the trainer's: ``"truncate"`` multiplies the
            policy term by ``clip(pi_train / pi_sampler, min, max)`` (TIS), ``"mask"`` by the
            ratio where it lies in ``[min, max]`` and 0 elsewhere (MIS; IcePop at token level),
            arXiv:2510.18855. ``"none"`` disables it. Batches without sampler log-probs are not
            corrected.
        sampler_correction_level: ``"token"``: one ratio per token; ``"sequence"``: the product
            of the token ratios of a completion (TRL's ``sequence_*`` modes); ``"geometric"``:
            their geometric mean ``exp(mean_t log ratio)``.
        sampler_ratio_min: Lower bound ``C_min`` of the sampler ratio (``None``: unbounded).
        sampler_ratio_max: Upper bound ``C_max`` of the sampler ratio (``None``: unbounded;
            TRL's default is 3).
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask (eq. 9,
            arXiv:2512.02556): a completion with negative advantage whose mean
            ``log pi_sampler - log pi_theta`` exceeds this ``delta`` is dropped from the policy
            term. ``None`` disables it.
        top_entropy_quantile: Keep in the policy term only the tokens whose entropy is at
            least the ``(1 - rho)`` quantile of the valid tokens' entropies over the whole
            batch (Wang et al., 2025, "Beyond the 80/20 Rule", arXiv:2506.01939; TRL
            ``top_entropy_quantile``). In [0, 1]; 1 keeps every token.
        advantage_estimator: ``"grpo"``: the group baseline and scaling above (GRPO, Dr. GRPO,
            RLOO); ``"reinforce_pp"``: REINFORCE++ (arXiv:2501.03262), rewards whitened by the
            batch mean and std (a global baseline); ``"reinforce_pp_baseline"``: group-mean
            centered, then whitened over the batch; ``"pass_at_k"``: the analytical pass@k
            advantage of "Pass@k Training" (arXiv:2508.10751) for binary rewards.
        pass_at_k: ``k >= 1`` for ``advantage_estimator="pass_at_k"``.
        remat: Rematerialize each decoder layer of a causal-LM policy in the backward pass
            (gradient checkpointing, ``CausalLM.hidden_states(..., remat=True)``): the update
            keeps only each layer's input (and, with a shared-prompt KV cache, that layer's own
            keys and values) instead of all the layer's activations, and recomputes them while
            differentiating. It costs one more forward pass of the decoder layers per update
            (at most about +33% of the update's FLOPs; +18% on SmolLM2-135M's shape, where the
            output projection and the reference forward weigh too) and changes no value. Use it
            when activations, not the parameters and optimizer state, run out of memory (many
            rows, long sequences, deep models). It applies to the default log-prob function; a
            custom ``log_prob_fn`` opts in with ``causal_lm_log_probs_fn(remat=True)``.
            Categorical policies ignore it.
        remat_every: With ``remat``, rematerialize every n-th decoder layer only (layers 0,
            n, 2n, ...); the others keep their activations. 1 (the default) is every layer.
            Memory and compute fall between remat and none: on SmolLM2-135M's shape
            (``docs/benchmarks.md``) the update took 8.8 s and peaked at 3.7 GB with every layer,
            8.4 s and 4.7 GB with every second, 8.2 s and 5.1 GB with every third, 8.0 s and
            5.8 GB without remat. Needs ``remat=True``; not with ``scan_layers`` (a scan
            rematerializes all its layers or none).
        scan_layers: Run a causal-LM policy's (and the reference's) decoder layers in the
            update as one ``jax.lax.scan`` over their stacked weights, whatever
            ``model.scan_layers`` says (the sampler keeps following ``model.scan_layers``:
            its decode loop is faster unrolled). The values are the same; the update's program
            holds one layer instead of all of them, so it compiles faster for deep models, but
            on the CPU each update is slower (it stacks the layer weights and slices them per
            iteration) and holds one stacked copy of the layer weights and of their gradient.
            On SmolLM2-135M with ``remat`` (``docs/benchmarks.md``, 2026-11-25): the update,
            compiled alone, compiled in 11.9-12.3 s instead of 13.4-13.7 s and its first run
            took 8.9 s instead of 12.0 s (the first step 26.5 s instead of 30.1 s); later
            updates 1-2% longer, peak memory 1.1 GB higher. A model whose layers are stored
            stacked (``CausalLM.stack_layers()``, before building the optimizer) is scanned
            without any copy, and its optimizer has one array per weight kind: see
            ``docs/benchmarks.md`` for that row. It applies to
            the default log-prob function (a custom one opts in with
            ``causal_lm_log_probs_fn(scan_layers=True)``); models without ``layer_stack()``
            ignore it.
        layerwise_update: Run a ``CausalLM`` policy's update as small programs called from
            Python (:mod:`~artifex.generative_models.training.rl.layerwise`): the embedding,
            one decoder layer (forward, and backward with the layer recomputed), the output
            projection with the objective, and clipping, AdamW and the guard. Layers of one
            structure share one compiled program, so the layers' compile does not grow with
            the depth, where the one-program update compiles the whole unrolled model (about
            15-20 s for SmolLM2-135M on 2 CPU cores). Same values as the
            one-program update with ``remat=True`` (which it needs, with ``remat_every=1``
            and not ``scan_layers``), up to float32 rounding; with bfloat16 parameters up to
            bfloat16 rounding, since XLA keeps float32 intermediates inside one program (0.1%
            on the KL of a bfloat16 reference). Each update is a little slower (no fusion
            across layers; ``docs/benchmarks.md``). For ``GRPOTrainer`` with the default
            log-prob function, one microbatch and no mesh; the pure ``make_grpo_train_step``
            ignores it.
        optimizer_by_layer: Let ``GRPOTrainer`` run clipping, the optimizer and the
            non-finite guard one decoder layer at a time, in small programs compiled once per
            layer structure, after a program that computes the gradient
            (:mod:`~artifex.generative_models.training.rl.optimizer_split`). Used only where
            that gives the same update: a transformation that updates each parameter from its
            own gradient and state and shared scalars (SGD, Adam, AdamW, Lion, schedules;
            moments in another dtype, ``mu_dtype``; not ``optax.clip_by_global_norm`` inside
            the chain, ``MultiSteps`` or factored states), checked on its own computation
            when the step is first built and again for each state of other dtypes it is given
            (for such a state it refuses, clipping, the optimizer and the guard run as one
            program after the gradient program); a model
            with at least 8 decoder layers (per-layer entries in its parameters; with fewer,
            the one-program step compiles as fast); no mesh. The one-program step spends
            about half its compile on the per-array optimizer work for SmolLM2-135M
            (``docs/benchmarks.md``). ``False``: always one program (which
            ``compiled_step().lower()`` needs). The pure ``make_grpo_train_step`` ignores it.

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
