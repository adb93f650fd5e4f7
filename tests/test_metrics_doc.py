"""Every metric key the objective, the train step, a multi-turn rollout and the loop produce is
documented.

The keys are computed by running the code (``grpo_objective`` with its optional variants turned
on, the pure train step, ``Episodes.metrics``, and ``artifex-grpo train`` with evaluation and
dynamic sampling, whose ``metrics.jsonl`` holds every key the rollout and the loop log) and
compared with the keys listed in the tables of ``docs/metrics.md``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.training.rl import GRPOBatch, GRPOConfig, grpo_objective
from artifex.generative_models.training.rl.multiturn import Episodes
from artifex.generative_models.training.rl.state import init_train_state, make_grpo_train_step

ROOT = Path(__file__).resolve().parents[1]
_ROW_RE = re.compile(r"^\|([^|\n]*)\|", re.M)
_KEY_RE = re.compile(r"`([^`]+)`")


def documented_keys(markdown: str) -> list[re.Pattern[str]]:
    """One pattern per key named in the first column of a table (``<x>`` matches any word)."""
    keys = []
    for cell in _ROW_RE.findall(markdown):
        for key in _KEY_RE.findall(cell):
            parts = re.split(r"<[^>]+>", key)
            keys.append(re.compile(r"[\w@.]+".join(map(re.escape, parts)) + r"\Z"))
    return keys


def undocumented(names: set[str], markdown: str) -> list[str]:
    patterns = documented_keys(markdown)
    return sorted(n for n in names if not any(p.match(n) for p in patterns))


def _batch(**fields) -> GRPOBatch:
    rng = np.random.default_rng(0)
    b, t = 4, 3
    log_probs = jnp.asarray(-rng.uniform(0.1, 2.0, (b, t)), jnp.float32)
    return GRPOBatch(
        prompt_ids=jnp.ones((b, 2), jnp.int32),
        completion_ids=jnp.ones((b, t), jnp.int32),
        completion_mask=jnp.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], jnp.float32),
        rewards=jnp.array([1.0, 0.0, 0.5, 0.0]),
        old_log_probs=log_probs,
        ref_log_probs=log_probs - 0.1,
        sampler_log_probs=log_probs + 0.3,
        group_size=2,
        **fields,
    )


_VARIANTS = [
    dict(beta=0.1),
    dict(
        beta=0.1,
        sampler_correction="truncate",
        off_policy_mask_threshold=0.0,
        top_entropy_quantile=0.5,
    ),
    dict(sampler_correction="mask", sampler_correction_level="sequence"),
    dict(policy_loss="vespo", sampler_correction="truncate"),
    dict(policy_loss="cispo"),
    dict(policy_loss="sapo"),
]


def objective_keys() -> set[str]:
    batch = _batch()
    log_probs = batch.old_log_probs - 0.05
    entropy = jnp.linspace(0.1, 2.0, 12).reshape(4, 3)
    keys: set[str] = set()
    for options in _VARIANTS:
        _, metrics = grpo_objective(
            log_probs, entropy, batch, GRPOConfig(num_generations=2, **options)
        )
        keys |= set(metrics)
    for divergence in ("reverse_kl", "forward_kl", "jsd"):  # on-policy distillation
        config = GRPOConfig(
            num_generations=2, distillation_coeff=0.5, distillation_divergence=divergence
        )
        _, metrics = grpo_objective(
            log_probs, entropy, batch, config, distillation=jnp.ones_like(log_probs)
        )
        keys |= set(metrics)
    return keys


def step_keys() -> set[str]:
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = GRPOBatch.from_dict(
        {
            "observations": jnp.ones((4, 2)),
            "actions": jnp.array([0, 1, 2, 0]),
            "rewards": jnp.array([1.0, 0.0, 0.0, 1.0]),
        },
        group_size=2,
    )
    step = make_grpo_train_step(model, optimizer.tx, GRPOConfig(num_generations=2))
    _, metrics = step(init_train_state(model, optimizer), batch)
    return set(metrics)


def multiturn_keys() -> set[str]:
    rows, turns = 2, 2
    values = {}
    for field in dataclasses.fields(Episodes):
        if field.name in ("turn_rewards", "turn_ends"):
            values[field.name] = np.ones((rows, turns))
        elif "list" in str(field.type):
            values[field.name] = [""] * rows
        else:
            values[field.name] = np.ones((rows, 3))
    for name in ("turns", "tool_calls", "tool_errors", "turn_limit", "token_limit"):
        values[name] = np.ones(rows)
    values["model_tokens"] = values["env_reward"] = np.ones(rows)
    return set(Episodes(**values).metrics())


def loop_keys(tmp_path_factory) -> set[str]:
    """Every key of ``metrics.jsonl`` of two short runs of the command (one with dynamic
    sampling and a completions log, both with evaluation)."""
    import json

    from artifex.cli import main
    from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer

    tmp = tmp_path_factory.mktemp("loop_keys")
    tok = demo_tokenizer()
    demo_model(tok).save_pretrained(str(tmp / "model"))
    tok.save_pretrained(str(tmp / "model"))
    rows, held_out = addition_dataset(num_eval=4)
    for name, data in (("train", rows[:16]), ("eval", held_out)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    common = ["train", "--model", str(tmp / "model"), "--data", str(tmp / "train.jsonl")]
    common += ["--eval-data", str(tmp / "eval.jsonl"), "--reward", "math", "--reward", "format"]
    common += ["--num-steps", "2", "--prompts-per-step", "2", "--num-generations", "4"]
    common += ["--max-new-tokens", "4", "--progress", "false", "--beta", "0.04"]
    keys: set[str] = set()
    dynamic = ["--dynamic-sampling", "true", "--max-resample-rounds", "1"]
    sampled = ["--eval-num-samples", "2"]  # pass@k, mean@n, maj@n
    for i, extra in enumerate(([], [*dynamic, *sampled])):
        log_dir = tmp / f"logs{i}"
        extra = [*extra, "--checkpoint-dir", str(tmp / f"checkpoints{i}")]  # one per run
        assert (
            main([*common, *extra, "--log-dir", str(log_dir), "--output", str(tmp / f"m{i}")]) == 0
        )
        for line in (log_dir / "metrics.jsonl").read_text().splitlines():
            keys |= set(json.loads(line))
    return keys


@pytest.fixture(scope="module")
def metrics_page() -> str:
    return (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("source", [objective_keys, step_keys, multiturn_keys])
def test_every_metric_key_is_documented(source, metrics_page):
    keys = source()
    assert keys
    missing = undocumented(keys, metrics_page)
    assert not missing, f"metric keys missing from docs/metrics.md: {missing}"


def test_every_key_the_loop_logs_is_documented(tmp_path_factory, metrics_page):
    keys = loop_keys(tmp_path_factory)
    for key in ("rollout_time", "step_time", "eval/pass@1", "eval/maj@2", "rewards/format_reward"):
        assert key in keys, key
    assert any(k.startswith("dynamic_sampling/") for k in keys), sorted(keys)
    missing = undocumented(keys, metrics_page)
    assert not missing, f"metric keys missing from docs/metrics.md: {missing}"


def test_variants_produce_the_optional_keys():
    keys = objective_keys()
    for key in ("sampler_kl", "off_policy_masked_fraction", "high_entropy_fraction"):
        assert key in keys
    assert "multiturn/turn_reward_2" in multiturn_keys()
    assert "update_applied" in step_keys()


def test_key_parser():
    page = "| Key | Meaning |\n|---|---|\n| `a`, `b/c` | x `not_a_key` |\n| `t_<k>` | y |\n"
    assert undocumented({"a", "b/c", "t_12", "not_a_key", "t_"}, page) == ["not_a_key", "t_"]
