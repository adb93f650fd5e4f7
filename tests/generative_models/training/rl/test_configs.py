"""GRPOConfig: seed defaults, validation naming the field, immutability."""

from __future__ import annotations

import dataclasses

import pytest

from artifex.generative_models.training import GRPOConfig


def test_seed_names_and_defaults():
    cfg = GRPOConfig()
    assert (cfg.num_generations, cfg.clip_param, cfg.beta, cfg.entropy_coeff) == (
        4,
        0.2,
        0.01,
        0.01,
    )
    # The seed's gamma is accepted (documented: discount of process-supervision step rewards).
    assert GRPOConfig(gamma=0.99).gamma == 0.99
    # TRL / Tunix agreement where the seeds disagree: Bessel-corrected std, eps 1e-4, k3 KL.
    assert (cfg.std_ddof, cfg.advantage_eps, cfg.kl_estimator) == (1, 1e-4, "k3")
    assert cfg.epsilon_low == cfg.epsilon_high == 0.2
    assert GRPOConfig(clip_param_high=0.28).epsilon_high == 0.28


def test_frozen_keyword_only_and_replace():
    cfg = GRPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.beta = 0.5
    with pytest.raises(TypeError):
        GRPOConfig(4)  # keyword-only
    assert cfg.replace(beta=0.5).beta == 0.5
    with pytest.raises(ValueError, match="beta"):
        cfg.replace(beta=-1.0)


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_generations", 1),
        ("num_generations", 0),
        ("clip_param", -0.1),
        ("clip_param", 0.0),
        ("clip_param", 1.0),
        ("clip_param_high", -0.2),
        ("dual_clip", 1.0),
        ("beta", -0.01),
        ("entropy_coeff", -1.0),
        ("gamma", 0.0),
        ("gamma", 1.5),
        ("std_ddof", 2),
        ("advantage_eps", -1e-4),
        ("max_completion_length", 0),
        ("max_grad_norm", 0.0),
        ("temperature", 0.0),
        ("beta", float("nan")),
        ("scale_rewards", "std"),
        ("kl_estimator", "k4"),
        ("loss_aggregation", "mean"),
        ("importance_sampling_level", "seq"),
        ("baseline", "median"),
    ],
)
def test_impossible_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
        GRPOConfig(**{field: value})


@pytest.mark.parametrize(
    "field,value",
    [("num_generations", 4.0), ("num_generations", True), ("beta", "0.1"), ("clip_param", None)],
)
def test_wrong_types_name_the_field(field, value):
    with pytest.raises(TypeError, match=f"GRPOConfig.{field}"):
        GRPOConfig(**{field: value})


def test_every_field_is_read_by_the_code():
    """Each field's name appears in the library code outside configs.py (nothing unread)."""
    import pathlib

    import artifex

    root = pathlib.Path(artifex.__file__).parent
    sources = "\n".join(
        p.read_text() for p in root.rglob("*.py") if p.name not in ("configs.py", "cli.py")
    )
    aliases = {"clip_param": "epsilon_low", "clip_param_high": "epsilon_high"}
    for field in dataclasses.fields(GRPOConfig):
        name = aliases.get(field.name, field.name)
        assert f".{name}" in sources, f"GRPOConfig.{field.name} is not read anywhere"
