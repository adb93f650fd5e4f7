"""``grpo_objective`` equals TRL 1.16's own loss and d loss / d log-probs, case by case.

The fixtures were made by ``tests/fixtures/make_trl_variant_fixtures.py`` running TRL's
``GRPOTrainer._compute_loss`` in TRL's own virtual environment; this test needs only the
committed ``.npz``/``.json`` files. ``trl_to_config`` is the translation table from TRL's
settings to ``GRPOConfig`` (also in docs/algorithm.md).
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifex.generative_models.training.rl import GRPOBatch, GRPOConfig, grpo_objective
from artifex.generative_models.training.rl.truncation import mask_truncated_completions

FIXTURES = pathlib.Path(__file__).parents[3] / "fixtures" / "trl_variants"
CASES = json.loads((FIXTURES / "cases.json").read_text())
INPUTS = dict(np.load(FIXTURES / "inputs.npz"))
GRADS = dict(np.load(FIXTURES / "grads.npz"))

_AGGREGATION = {
    "grpo": "sequence_mean",
    "sapo": "sequence_mean",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "cispo": "token_mean",
    "vespo": "token_mean",
    "dr_grpo": "constant_length",
    "luspo": "sequence_sum",
}
_POLICY_LOSS = {"cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}


def trl_to_config(kw: dict, options: dict, meta: dict) -> GRPOConfig:
    """The ``GRPOConfig`` that expresses TRL's ``GRPOConfig(**kw)`` (TRL's defaults otherwise)."""
    loss_type = kw.get("loss_type", "dapo")
    eps = kw.get("epsilon", 0.2)
    eps_high = kw.get("epsilon_high")
    out = dict(
        num_generations=meta["shape"]["G"],
        beta=kw.get("beta", 0.0),
        entropy_coeff=0.0,
        clip_param=eps,
        loss_aggregation=_AGGREGATION[loss_type],
        max_completion_length=meta["shape"]["max_completion_length"],
        importance_sampling_level=kw.get("importance_sampling_level", "token"),
        kl_importance_weighted=kw.get("use_bias_correction_kl", True),
        policy_loss=_POLICY_LOSS.get(loss_type, "clip"),
        off_policy_mask_threshold=kw.get("off_policy_mask_threshold"),
        top_entropy_quantile=kw.get("top_entropy_quantile", 1.0),
        mask_truncated_completions=kw.get("mask_truncated_completions", False),
    )
    if loss_type == "cispo":
        out["cispo_max_weight"] = eps if eps_high is None else eps_high
    else:
        out["clip_param_high"] = eps_high
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if name in kw:
            out[name] = kw[name]
    if options.get("vllm_is"):
        mode = kw.get("vllm_importance_sampling_mode", "sequence_mask")
        level, constraint = mode.split("_")
        out.update(
            sampler_correction=constraint,
            sampler_correction_level=level,
            sampler_ratio_min=kw.get("vllm_importance_sampling_clip_min"),
            sampler_ratio_max=kw.get("vllm_importance_sampling_clip_max", 3.0),
        )
    return GRPOConfig(**out)


_EOS = 2  # the fixture's end-of-sequence id


def _truncated() -> np.ndarray:
    """Rows whose last completion token is not EOS, as the sampler reports them."""
    lengths = INPUTS["completion_mask"].sum(axis=1).astype(int)
    last = INPUTS["completion_ids"][np.arange(len(lengths)), lengths - 1]
    return last != _EOS


def _batch(options: dict, config: GRPOConfig | None = None) -> GRPOBatch:
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in INPUTS.items()}
    b, t = f32["completion_mask"].shape
    batch = GRPOBatch(
        prompt_ids=jnp.zeros((b, 2), jnp.int32),
        completion_ids=jnp.zeros((b, t), jnp.int32),
        completion_mask=f32["completion_mask"],
        rewards=jnp.zeros((b,), jnp.float32),
        old_log_probs=None if options.get("on_policy") else f32["old_log_probs"],
        ref_log_probs=f32["ref_log_probs"],
        sampler_log_probs=f32["sampler_log_probs"] if options.get("vllm_is") else None,
        advantages=f32["advantages"],
        group_size=CASES["meta"]["shape"]["G"],
    )
    if config is not None and config.mask_truncated_completions:  # what the rollout does
        batch = mask_truncated_completions(batch, _truncated())
    return batch


def test_fixture_is_trl_1_16_and_covers_every_variant():
    assert CASES["meta"]["trl"] == "1.16.0"
    names = set(CASES["cases"])
    for needed in (
        "grpo", "bnpo", "dr_grpo", "dapo", "gspo", "grpo_beta", "kl_bias_corrected",
        "cispo", "sapo", "luspo", "vespo", "is_token_truncate", "is_token_mask",
        "is_sequence_truncate", "is_sequence_mask", "off_policy_mask", "top_entropy",
        "mask_truncated_grpo", "mask_truncated_dapo", "mask_truncated_dr_grpo",
    ):  # fmt: skip
        assert needed in names


@pytest.mark.parametrize("name", sorted(CASES["cases"]))
def test_loss_and_gradient_match_trl(name):
    case = CASES["cases"][name]
    config = trl_to_config(case["trl_kwargs"], case["options"], CASES["meta"])
    batch = _batch(case["options"], config)
    log_probs = jnp.asarray(INPUTS["log_probs"], jnp.float32)
    entropy = jnp.asarray(INPUTS["entropy"], jnp.float32)

    def loss(lp):
        return grpo_objective(lp, entropy, batch, config, reward_metrics=False)

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(log_probs)
    np.testing.assert_allclose(float(value), case["loss"], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(grad), GRADS[name], rtol=2e-4, atol=2e-6)
    # The case does something: the gradient is not zero.
    assert np.abs(GRADS[name]).max() > 1e-3
    trl_metrics = case["metrics"]
    # At sequence level TRL counts clipped sequences, this library clipped tokens.
    token_level = config.importance_sampling_level == "token"
    if "clip_ratio/region_mean" in trl_metrics and token_level:
        np.testing.assert_allclose(
            float(metrics["clip_fraction"]), trl_metrics["clip_ratio/region_mean"], atol=1e-6
        )
        np.testing.assert_allclose(
            float(metrics["clip_fraction_high"]), trl_metrics["clip_ratio/high_mean"], atol=1e-6
        )
    if "cispo_clip_ratio" in trl_metrics:
        np.testing.assert_allclose(
            float(metrics["clip_fraction_high"]), trl_metrics["cispo_clip_ratio"], atol=1e-6
        )


def test_the_settings_change_the_loss():
    """Each variant case differs from its base case, so the fixture exercises it."""
    loss = {k: v["loss"] for k, v in CASES["cases"].items()}
    for variant, base in (
        ("kl_bias_corrected", "grpo_beta"),
        ("cispo_cap", "cispo"),
        ("sapo_temps", "sapo"),
        ("is_token_truncate", "dapo"),
        ("is_token_mask", "dapo"),
        ("is_sequence_truncate", "grpo"),
        ("is_sequence_mask", "grpo"),
        ("off_policy_mask", "dapo"),
        ("off_policy_mask_sampler", "is_token_truncate"),
        ("top_entropy", "dapo"),
        ("vespo_is_token_truncate", "vespo"),
        ("mask_truncated_grpo", "grpo_beta"),
        ("mask_truncated_dapo", "dapo"),
        ("mask_truncated_dr_grpo", "dr_grpo"),
        ("mask_truncated_gspo_kl", "kl_bias_corrected_sequence"),
        ("mask_truncated_is_sequence_mask", "dapo"),
    ):
        assert abs(loss[variant] - loss[base]) > 1e-4, (variant, base)


def test_truncated_rows_are_the_cut_ones_and_their_gradient_is_zero():
    """The fixture cuts rows 0 and 4; TRL's gradient there is 0 in every masked case."""
    assert _truncated().tolist() == [True, False, False, False, True, False, False, False]
    for name, case in CASES["cases"].items():
        if case["trl_kwargs"].get("mask_truncated_completions"):
            np.testing.assert_array_equal(GRADS[name][_truncated()], 0.0)
            assert np.abs(GRADS[name][~_truncated()]).max() > 1e-3
