"""Rollout engines without vLLM: the interface, the output layout, the weight pushes, the hooks.

vLLM itself is tested in test_vllm_engine.py (where it is installed). Here an engine that
samples from a copy of the weights it was last given stands in for an external one: a loop
that failed to push the weights after an update would sample from the stale copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
from artifex.generative_models.inference import generate
from artifex.generative_models.inference.engines import (
    RolloutEngine,
    SamplerEngine,
    WeightVersion,
    assemble_output,
    hf_weights,
    prompt_token_lists,
    resolve_special_ids,
)
from artifex.generative_models.models.causal_lm import (
    CausalLM,
    CausalLMConfig,
    LoRAConfig,
    apply_lora,
    lora_state,
    to_hf_tensors,
)
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import RolloutConfig, TrainConfig, rollout, train
from artifex.generative_models.training.rl.rewards import RewardCombiner
from tests.spread_reward import text_reward

ROWS = [{"prompt": "12+3=", "answer": "15"}, {"prompt": "7+8=", "answer": "15"}]


def tiny(seed=0, **kw):
    cfg = CausalLMConfig(
        vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=2, num_heads=2,
        eos_token_id=2, **kw,
    )  # fmt: skip
    return CausalLM(cfg, rngs=nnx.Rngs(seed))


def make_trainer(seed=0, **cfg):
    tok = demo_tokenizer()
    model = demo_model(tok, seed=seed)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return GRPOTrainer(model, opt, GRPOConfig(num_generations=4, beta=0.0, **cfg)), tok


class SnapshotEngine(SamplerEngine):
    """Samples from a copy of the weights of the last push, as an external engine does."""

    def __init__(self, shift=0.0):
        super().__init__()
        self.pushes = 0
        self.shift = shift

    def sync_weights(self, model):
        if not self._version.changed(model):
            return False
        graphdef, state = nnx.split(model)
        self.model = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))  # a copy, not a view
        self._version.mark(model)
        self.pushes += 1
        return True

    def generate(self, *args, **kwargs):
        out = super().generate(*args, **kwargs)
        if self.shift:  # another implementation's numbers: log-probs off by a constant
            shifted = (out.log_probs - self.shift) * out.completion_mask
            out = dataclasses.replace(out, log_probs=shifted)
        return out


# ------------------------------------------------------------------------------ assemble_output
def reference_layout(prompts, completions, logps, k, n, eos, pad, width):
    """The layout written out element by element, in float64."""
    b = len(prompts)
    out = {
        "prompt_ids": np.full((b * k, width), pad),
        "prompt_mask": np.zeros((b * k, width)),
        "completion_ids": np.full((b * k, n), pad),
        "completion_mask": np.zeros((b * k, n)),
        "log_probs": np.zeros((b * k, n)),
        "truncated": np.zeros(b * k, bool),
        "lengths": np.zeros(b * k),
    }
    for row in range(b * k):
        p = prompts[row // k]
        for j, t in enumerate(p):
            out["prompt_ids"][row, width - len(p) + j] = t
            out["prompt_mask"][row, width - len(p) + j] = 1
        for j, (t, lp) in enumerate(zip(completions[row], logps[row], strict=True)):
            out["completion_ids"][row, j] = t
            out["completion_mask"][row, j] = 1
            out["log_probs"][row, j] = lp
        out["lengths"][row] = len(completions[row])
        out["truncated"][row] = len(completions[row]) == n and completions[row][-1] not in eos
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_assemble_output_matches_an_element_by_element_layout(seed):
    rng = np.random.default_rng(seed)
    b, k, n, eos, pad = 3, 2, 6, (2, 3), 0
    prompts = [list(rng.integers(4, 16, rng.integers(1, 9))) for _ in range(b)]
    completions, logps = [], []
    for _ in range(b * k):
        m = int(rng.integers(1, n + 1))
        tokens = list(rng.integers(4, 16, m))
        if m < n or rng.random() < 0.5:
            tokens[-1] = int(rng.choice(eos))  # ends with EOS (always when shorter than n)
        completions.append(tokens)
        logps.append(list(-rng.exponential(1.0, m)))
    out = assemble_output(prompts, completions, logps, num_generations=k, max_new_tokens=n,
                          eos_ids=eos, pad_id=pad, prompt_buckets=(4, 8, 16))  # fmt: skip
    longest = max(len(p) for p in prompts)
    ref = reference_layout(prompts, completions, logps, k, n, eos, pad, 4 if longest <= 4 else 8)
    for name, expected in ref.items():
        got = np.asarray(getattr(out, name))
        if name == "log_probs":
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
            assert got.dtype == np.float32
        else:
            np.testing.assert_array_equal(got, expected)


BAD = [  # (completions, log-probs or None for -1 per token, message)
    ([[5, 2]], None, r"prompts \(2\), got 1 completions and 1 log-prob rows"),
    ([[], [2]], None, "completion 0 .* has 0 tokens"),
    ([[5, 5, 5, 5], [2]], None, "completion 0 .* has 4 tokens"),
    ([[2, 5], [2]], None, "end-of-sequence id 2 at token 0, before its last token 1"),
    ([[5, 5], [2]], None, "stopped after 2 of max_new_tokens=3 tokens"),
    ([[5, 2], [2]], [[-1.0], [-1.0]], "has 2 tokens but 1 log-probs"),
    ([[5, 2], [2]], [[-1.0, 0.5], [-1.0]], "the log-prob of token 1 is 0.5"),
    ([[5, 2], [2]], [[-1.0, float("nan")], [-1.0]], "the log-prob of token 1 is nan"),
]


@pytest.mark.parametrize(("completions", "logps", "message"), BAD)
def test_assemble_output_refuses_what_breaks_the_contract(completions, logps, message):
    if logps is None:
        logps = [[-1.0] * len(c) for c in completions]
    with pytest.raises(ValueError, match=message):
        assemble_output([[7, 8]], completions, logps, num_generations=2, max_new_tokens=3,
                        eos_ids=(2,), pad_id=0)  # fmt: skip


def test_prompt_token_lists_strips_padding_and_refuses_bad_prompts():
    ids = np.array([[0, 0, 7, 8], [4, 5, 6, 7]])
    mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert prompt_token_lists(ids, mask) == [[7, 8], [4, 5, 6, 7]]
    assert prompt_token_lists(jnp.asarray(ids)) == [[0, 0, 7, 8], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="row 0 of prompt_mask has no real token"):
        prompt_token_lists(ids, np.array([[0, 0, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"token ids in \[0, 8\)"):
        prompt_token_lists(ids, mask, vocab_size=8)
    with pytest.raises(TypeError, match="integer token ids"):
        prompt_token_lists(ids.astype(np.float32))
    with pytest.raises(ValueError, match="shape"):
        prompt_token_lists(ids[0])
    with pytest.raises(ValueError, match="must have the shape of prompt_ids"):
        prompt_token_lists(ids, mask[:, :3])


def test_special_ids_default_as_generate_does():
    cfg = tiny().config
    assert resolve_special_ids(cfg, None, None) == ((2,), 2)
    assert resolve_special_ids(None, None, None) == ((), 0)
    assert resolve_special_ids(cfg, [5, 6], 1) == ((5, 6), 1)


# ------------------------------------------------------------------------------- weights
def test_weight_version_sees_updates_and_other_models():
    model = tiny()
    version = WeightVersion()
    assert version.changed(model)
    version.mark(model)
    assert not version.changed(model)
    assert version.changed(tiny())  # another model with the same values
    nnx.update(model, jax.tree.map(lambda x: x * 1.0 + 0.0, nnx.state(model, nnx.Param)))
    assert version.changed(model)  # new arrays, whatever their values


def test_hf_weights_merge_lora_against_float64():
    model = tiny()
    plain = hf_weights(model)
    ref = to_hf_tensors(model)
    assert sorted(plain) == sorted(ref)
    for name in ref:
        np.testing.assert_array_equal(plain[name], ref[name])
    lora = LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj", "down_proj"))
    apply_lora(model, lora, nnx.Rngs(1))
    nnx.update(model, jax.tree.map(lambda x: x + 0.3, lora_state(model)))  # B != 0
    merged = hf_weights(model)
    for i in range(2):
        for proj, layer in (
            ("self_attn.q_proj", model.layers[i].attn.q_proj),
            ("mlp.down_proj", model.layers[i].mlp.down_proj),
        ):
            w = np.asarray(layer.kernel[...], np.float64)
            a = np.asarray(layer.lora.lora_a[...], np.float64)
            b = np.asarray(layer.lora.lora_b[...], np.float64)
            expected = (w + (4.0 / 2) * a @ b).T  # (out, in), as the Hugging Face layout
            got = merged[f"model.layers.{i}.{proj}.weight"]
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
            assert not np.allclose(got, w.T, atol=1e-3)  # the adapters changed it
    k_proj = "model.layers.0.self_attn.k_proj.weight"  # no adapter: as it was
    np.testing.assert_array_equal(merged[k_proj], ref[k_proj])


# ------------------------------------------------------------------------------ SamplerEngine
def test_sampler_engine_is_generate_behind_the_interface():
    model = tiny()
    engine = SamplerEngine()
    assert isinstance(engine, RolloutEngine)
    ids, mask = jnp.array([[0, 4, 5], [6, 7, 8]]), jnp.array([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="call sync_weights"):
        engine.generate(ids, mask, key=jax.random.key(0))
    assert engine.sync_weights(model) and not engine.sync_weights(model)
    kw = dict(key=jax.random.key(3), num_generations=3, max_new_tokens=5, temperature=0.7)
    got, want = engine.generate(ids, mask, **kw), generate(model, ids, mask, **kw)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="row_groups"):
        SamplerEngine(continuous=True, row_groups=2)


def test_the_continuous_sampler_engine_decodes_greedy_as_generate():
    model = tiny()
    engine = SamplerEngine(continuous=True)
    engine.sync_weights(model)
    ids, mask = jnp.array([[0, 4, 5], [6, 7, 8]]), jnp.array([[0, 1, 1], [1, 1, 1]])
    kw = dict(key=jax.random.key(0), num_generations=2, max_new_tokens=6, temperature=0.0)
    got, want = engine.generate(ids, mask, **kw), generate(model, ids, mask, **kw)
    for name in ("completion_ids", "completion_mask", "truncated", "lengths"):
        a, b = getattr(got, name), getattr(want, name)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_a_rollout_with_the_sampler_engine_is_the_rollout_without_one():
    trainer, tok = make_trainer(sampler_correction="truncate")
    rewards = RewardCombiner([text_reward])
    cfg = RolloutConfig(max_new_tokens=5)
    plain = rollout(trainer, tok, ROWS, rewards, cfg, key=jax.random.key(0))
    engine = SamplerEngine()
    via = rollout(trainer, tok, ROWS, rewards, cfg, key=jax.random.key(0), engine=engine)
    assert engine.model is trainer.model
    assert via.completions == plain.completions
    assert via.batch.sampler_log_probs is not None
    for a, b in zip(jax.tree.leaves(via.batch), jax.tree.leaves(plain.batch), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_engine_log_probs_are_the_sampler_log_probs_and_old_ones_are_recomputed():
    trainer, tok = make_trainer(sampler_correction="truncate")
    rewards = RewardCombiner([text_reward])
    cfg = RolloutConfig(max_new_tokens=5)
    engine = SnapshotEngine(shift=0.25)
    ro = rollout(trainer, tok, ROWS, rewards, cfg, key=jax.random.key(0), engine=engine,
                 need_old_log_probs=True)  # fmt: skip
    plain = rollout(trainer, tok, ROWS, rewards, cfg, key=jax.random.key(0),
                    need_old_log_probs=True)  # fmt: skip
    mask = np.asarray(ro.batch.completion_mask)
    sampler = np.asarray(ro.batch.sampler_log_probs)
    np.testing.assert_allclose(sampler, (np.asarray(plain.batch.sampler_log_probs) - 0.25) * mask,
                               rtol=0, atol=1e-6)  # fmt: skip
    # "auto": the training graph's old log-probs, not the engine's shifted numbers.
    old = np.asarray(ro.batch.old_log_probs)
    np.testing.assert_allclose(old * mask, np.asarray(plain.batch.old_log_probs) * mask, atol=1e-5)
    assert np.abs(old * mask - sampler).max() > 0.2
    # "sampler": the engine's.
    ro = rollout(trainer, tok, ROWS, rewards, RolloutConfig(max_new_tokens=5,
                 old_log_probs="sampler"), key=jax.random.key(0), engine=engine,
                 need_old_log_probs=True)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(ro.batch.old_log_probs), sampler)


LOOP = dict(num_steps=3, prompts_per_step=2, progress=False, seed=1)


def test_the_loop_pushes_the_weights_before_each_rollout_after_an_update():
    train_rows = addition_dataset(seed=0, num_eval=4)[0][:16]
    ref, tok = make_trainer()
    want = train(ref, tok, train_rows, [text_reward], TrainConfig(**LOOP),
                 RolloutConfig(max_new_tokens=4))  # fmt: skip
    trainer, tok = make_trainer()
    engine = SnapshotEngine()
    got = train(trainer, tok, train_rows, [text_reward], TrainConfig(**LOOP),
                RolloutConfig(max_new_tokens=4), rollout_engine=engine)  # fmt: skip
    assert engine.pushes == 3  # the first rollout and one after each of the first two updates
    # Samples from copies of the pushed weights give the run of the library's sampler: no
    # rollout sampled from stale weights.
    for a, b in zip(got.history, want.history, strict=True):
        for name in ("reward_mean", "policy_loss", "completion_length_max"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    leaves = [jax.tree.leaves(nnx.state(t.model)) for t in (trainer, ref)]
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert engine.sync_weights(trainer.model)  # the last update is pushed at the next rollout


def test_train_refuses_an_engine_with_what_it_cannot_serve():
    trainer, tok = make_trainer()
    rows = addition_dataset(seed=0, num_eval=4)[0][:8]
    cfg = TrainConfig(num_steps=1, prompts_per_step=2, progress=False)
    with pytest.raises(ValueError, match="custom rollout_fn"):
        train(trainer, tok, rows, [text_reward], cfg, RolloutConfig(max_new_tokens=2),
              rollout_engine=SamplerEngine(), rollout_fn=rollout)  # fmt: skip
    with pytest.raises(ValueError, match="row_groups=2 is a setting of the library's sampler"):
        train(trainer, tok, rows, [text_reward], cfg, RolloutConfig(max_new_tokens=2,
              row_groups=2), rollout_engine=SamplerEngine())  # fmt: skip
    with pytest.raises(ValueError, match="placement"):
        rollout(trainer, tok, ROWS, RewardCombiner([text_reward]), RolloutConfig(),
                key=jax.random.key(0), engine=SamplerEngine(), placement=object())  # fmt: skip
    assert int(trainer.optimizer.step[...]) == 0
