"""GRPOTrainer: seed examples, learning, compilation, reference handling, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import (
    GRPOBatch,
    NonFiniteUpdateError,
    categorical_log_probs,
    make_grpo_loss,
)


class PolicyModel(nnx.Module):
    """A small categorical policy: observations (B, 8) -> logits (B, 5)."""

    def __init__(self, rngs: nnx.Rngs, obs_dim: int = 8, num_actions: int = 5):
        self.hidden = nnx.Linear(obs_dim, 16, rngs=rngs)
        self.out = nnx.Linear(16, num_actions, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def seed_batch(batch_size=8, seed=0, obs_dim=8, with_log_probs=True):
    keys = jax.random.split(jax.random.key(seed), 4)
    batch = {
        "observations": jax.random.normal(keys[0], (batch_size, obs_dim)),
        "actions": jax.random.randint(keys[1], (batch_size,), 0, 5),
        "rewards": jax.random.normal(keys[2], (batch_size,)),
    }
    if with_log_probs:
        batch["log_probs"] = -1.6 + 0.1 * jax.random.normal(keys[3], (batch_size,))
    return batch


def frozen_copy(model):
    """A copy with its own buffers (train_step donates the model's)."""
    copy = nnx.clone(model)
    nnx.update(copy, jax.tree.map(lambda x: jnp.array(x, copy=True), nnx.state(copy)))
    return copy


def state_leaves(*objs):
    return [np.asarray(x) for o in objs for x in jax.tree.leaves(nnx.state(o))]


# ------------------------------------------------------------------ seed 002 examples
def test_seed_quick_start_runs_unchanged():
    # --- seed 002 "Quick Start", verbatim apart from the data it leaves to the reader ---
    model = PolicyModel(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
    config = GRPOConfig(
        num_generations=4,  # Generate 4 samples per prompt
        clip_param=0.2,
        beta=0.01,  # KL penalty coefficient
        entropy_coeff=0.01,
    )
    trainer = GRPOTrainer(model, optimizer, config)
    b = seed_batch()
    observations, actions, rewards, old_log_probs = (
        b["observations"],
        b["actions"],
        b["rewards"],
        b["log_probs"],
    )
    batch = {
        "observations": observations,  # (batch_size, ...)
        "actions": actions,  # (batch_size, ...)
        "rewards": rewards,  # (batch_size,)
        "log_probs": old_log_probs,  # (batch_size,)
    }
    metrics = trainer.train_step(batch)
    for key in ("policy_loss", "approx_kl", "kl_penalty", "grad_norm", "total_loss"):
        assert isinstance(metrics[key], float) and np.isfinite(metrics[key])
    # With ref_log_probs the KL penalty is enabled (seed: "Provide ref_log_probs ...").
    batch["ref_log_probs"] = old_log_probs - 0.3
    metrics = trainer.train_step(batch)
    assert metrics["kl_penalty"] > 0
    # Custom group size override.
    batch = dict(batch, group_size=8)
    assert np.isfinite(trainer.train_step(batch)["policy_loss"])


def test_seed_training_with_grouped_generations_runs_unchanged():
    """Seed 002 "Complete Training Example", with a model that has the generate() it assumes."""

    class GenerativePolicy(PolicyModel):
        def generate(self, prompt, return_log_prob=True):
            logits = self(prompt[None])[0]
            action = jnp.argmax(
                logits
                + jax.random.gumbel(jax.random.key(int(prompt.sum() * 1e3) % 2**31), logits.shape)
            )
            return action, jax.nn.log_softmax(logits)[action]

    def reward_fn(samples, prompts):
        return (samples == 2).astype(jnp.float32)

    class Prompts(np.ndarray):
        pass

    prompts_loader = [np.asarray(jax.random.normal(jax.random.key(i), (3, 8))) for i in range(2)]

    def train_with_grpo(
        model, reward_fn, prompts_loader, num_epochs=2, num_generations=4, learning_rate=1e-4
    ):
        optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
        config = GRPOConfig(num_generations=num_generations, clip_param=0.2, beta=0.01)
        trainer = GRPOTrainer(model, optimizer, config)
        for _epoch in range(num_epochs):
            for prompts in prompts_loader:
                all_samples, all_log_probs = [], []
                for prompt in prompts:
                    for _ in range(num_generations):
                        sample, log_prob = model.generate(prompt, return_log_prob=True)
                        all_samples.append(sample)
                        all_log_probs.append(log_prob)
                samples = jnp.stack(all_samples)
                log_probs = jnp.stack(all_log_probs)
                rewards = reward_fn(samples, prompts.repeat(num_generations))
                batch = {
                    "observations": prompts.repeat(num_generations, axis=0),
                    "actions": samples,
                    "rewards": rewards,
                    "log_probs": log_probs,
                }
                metrics = trainer.train_step(batch)
                assert np.isfinite(metrics["policy_loss"])
        return model

    train_with_grpo(GenerativePolicy(rngs=nnx.Rngs(1)), reward_fn, prompts_loader)


# ------------------------------------------------------------------ learning
class BanditPolicy(nnx.Module):
    def __init__(self, num_arms: int = 10):
        self.logits = nnx.Param(jnp.zeros((num_arms,)))

    def __call__(self, observations):
        return jnp.broadcast_to(self.logits[...], (observations.shape[0], self.logits.shape[0]))


def test_bandit_learns_rewarded_arm():
    model = BanditPolicy()
    optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=8, beta=0.0))
    key = jax.random.key(0)
    obs = jnp.zeros((32, 1))
    for _ in range(150):
        key, sub = jax.random.split(key)
        logits = model(obs)
        actions = jax.random.categorical(sub, logits)
        log_probs = jax.nn.log_softmax(logits)[jnp.arange(32), actions]
        rewards = (actions == 7).astype(jnp.float32)
        trainer.train_step(
            {"observations": obs, "actions": actions, "rewards": rewards, "log_probs": log_probs}
        )
    probs = jax.nn.softmax(model.logits[...])
    assert float(probs[7]) >= 0.9, probs


class BigramLM(nnx.Module):
    """A tiny causal LM (next token depends on the current one) with the LM interface."""

    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, rngs=rngs)
        self.head = nnx.Param(jax.random.normal(rngs.params(), (dim, vocab)) * 0.1)

    def hidden_states(self, ids, attention_mask=None, positions=None, cache=None):
        return jnp.tanh(self.proj(self.embed(ids))), None

    def output_embedding(self):
        return self.head[...]

    def __call__(self, ids, attention_mask=None):
        return self.hidden_states(ids)[0] @ self.head[...]


def sample_bigram(model, prompts, length, key):
    ids = prompts
    for _ in range(length):
        key, sub = jax.random.split(key)
        logits = model(ids)[:, -1]
        nxt = jax.random.categorical(sub, logits)
        ids = jnp.concatenate([ids, nxt[:, None]], axis=1)
    return ids[:, prompts.shape[1] :]


def test_tiny_sequence_policy_raises_mean_reward():
    vocab, g, n_prompts, length = 6, 8, 4, 5
    model = BigramLM(vocab, 16, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.03), wrt=nnx.Param)
    trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=g, beta=0.0))
    key = jax.random.key(1)

    def reward(completions):  # fraction of tokens equal to 3
        return jnp.mean((completions == 3).astype(jnp.float32), axis=1)

    prompts = jnp.repeat(jnp.arange(n_prompts)[:, None] % vocab, g, axis=0).astype(jnp.int32)
    means = []
    for _ in range(40):
        key, sub = jax.random.split(key)
        comp = sample_bigram(model, prompts, length, sub)
        r = reward(comp)
        means.append(float(r.mean()))
        batch = GRPOBatch(
            prompt_ids=prompts,
            completion_ids=comp,
            completion_mask=jnp.ones(comp.shape, jnp.float32),
            rewards=r,
            group_size=g,
        )
        trainer.train_step(batch)
    assert np.mean(means[-5:]) > np.mean(means[:5]) + 0.3, means


# ------------------------------------------------------------------ compilation
def test_twenty_same_shaped_steps_compile_once():
    model = PolicyModel(rngs=nnx.Rngs(0))
    trainer = GRPOTrainer(
        model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), GRPOConfig()
    )
    for i in range(20):
        trainer.train_step(seed_batch(seed=i))
    assert trainer.num_compilations == 1
    assert trainer.compiled_step()._cache_size() == 1
    trainer.train_step(seed_batch(batch_size=12, seed=0))  # a new shape compiles once more
    assert trainer.num_compilations == 2


# ------------------------------------------------------------------ update semantics
def test_on_policy_step_is_plain_policy_gradient_with_clipped_norm():
    model = PolicyModel(rngs=nnx.Rngs(0))
    before = frozen_copy(model)
    cfg = GRPOConfig(beta=0.0, entropy_coeff=0.0, max_grad_norm=0.05)
    trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param), cfg)
    batch = seed_batch(with_log_probs=False)
    metrics = trainer.train_step(batch)
    assert metrics["approx_kl"] == 0.0 and metrics["clip_fraction"] == 0.0

    # Expected gradient: -mean_i A_i * grad log pi(a_i | s_i), clipped to norm 0.05.
    adv = np.asarray(
        jax.jit(
            lambda r: (
                (r.reshape(2, 4) - r.reshape(2, 4).mean(1, keepdims=True))
                / (r.reshape(2, 4).std(1, ddof=1, keepdims=True) + 1e-4)
            )
        )(batch["rewards"])
    ).reshape(-1)

    def surrogate(m):
        lp = jax.nn.log_softmax(m(batch["observations"]))[jnp.arange(8), batch["actions"]]
        return -jnp.mean(adv * lp)

    grads = nnx.grad(surrogate)(before)
    norm = float(optax.tree.norm(grads))
    np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-5)
    scale = min(1.0, 0.05 / norm)
    for (path, new), (_, old), (_, g) in zip(
        nnx.to_flat_state(nnx.state(model, nnx.Param)),
        nnx.to_flat_state(nnx.state(before, nnx.Param)),
        nnx.to_flat_state(nnx.state(grads)),
        strict=True,
    ):
        np.testing.assert_allclose(
            new[...], old[...] - scale * g[...], rtol=1e-5, atol=1e-7, err_msg=str(path)
        )


def test_grpo_loss_is_pure_and_differentiable_outside_trainer():
    model = PolicyModel(rngs=nnx.Rngs(0))
    cfg = GRPOConfig()
    grpo_loss = make_grpo_loss(model, cfg)
    params = nnx.state(model, nnx.Param)
    batch = seed_batch()
    batch["ref_log_probs"] = batch["log_probs"] - 0.2
    (loss, metrics), grads = jax.value_and_grad(grpo_loss, has_aux=True)(params, batch)
    assert np.isfinite(float(loss)) and float(metrics["kl"]) > 0
    # Same value as the trainer's objective on the same parameters.
    trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param), cfg)
    m = trainer.train_step(batch)
    np.testing.assert_allclose(m["total_loss"], float(loss), rtol=1e-6)
    np.testing.assert_allclose(m["grad_norm"], float(optax.tree.norm(grads)), rtol=1e-5)


def test_gradients_match_finite_differences_on_tiny_model():
    """Gradient of grpo_loss w.r.t. the parameters of a linear softmax policy vs. central
    differences of an independent float64 NumPy implementation of the same loss."""
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(8, 3)).astype(np.float32)
    actions = rng.integers(0, 4, size=8)
    rewards = rng.normal(size=8).astype(np.float32)
    old = np.log(rng.dirichlet(np.ones(4), size=8)[np.arange(8), actions]).astype(np.float32)
    ref = old - rng.uniform(0, 0.5, size=8).astype(np.float32)
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    cfg = GRPOConfig(beta=0.1, entropy_coeff=0.05, clip_param=0.2)
    grpo_loss = make_grpo_loss(model, cfg, log_prob_fn=categorical_log_probs)
    batch = {
        "observations": obs,
        "actions": actions,
        "rewards": rewards,
        "log_probs": old,
        "ref_log_probs": ref,
    }
    params = nnx.state(model, nnx.Param)
    grads = jax.grad(lambda p: grpo_loss(p, batch)[0])(params)

    def np_loss(w, b):
        z = obs.astype(np.float64) @ w + b
        z = z - z.max(1, keepdims=True)
        logp_all = z - np.log(np.exp(z).sum(1, keepdims=True))
        logp = logp_all[np.arange(8), actions]
        ent = -(np.exp(logp_all) * logp_all).sum(1)
        r = rewards.reshape(2, 4).astype(np.float64)
        a = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).ravel()
        ratio = np.exp(logp - old)
        pg = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
        x = ref - logp
        kl = np.exp(x) - x - 1
        return np.mean(pg + 0.1 * kl - 0.05 * ent)

    w0 = np.asarray(model.kernel[...], np.float64)
    b0 = np.asarray(model.bias[...], np.float64)
    h = 1e-6
    gw = np.zeros_like(w0)
    for idx in np.ndindex(w0.shape):
        up, dn = w0.copy(), w0.copy()
        up[idx] += h
        dn[idx] -= h
        gw[idx] = (np_loss(up, b0) - np_loss(dn, b0)) / (2 * h)
    gb = np.zeros_like(b0)
    for idx in np.ndindex(b0.shape):
        up, dn = b0.copy(), b0.copy()
        up[idx] += h
        dn[idx] -= h
        gb[idx] = (np_loss(w0, up) - np_loss(w0, dn)) / (2 * h)
    np.testing.assert_allclose(grads["kernel"][...], gw, rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(grads["bias"][...], gb, rtol=1e-3, atol=1e-6)


# ------------------------------------------------------------------ reference policy
def test_reference_model_log_probs_computed_inside_the_step():
    model = PolicyModel(rngs=nnx.Rngs(0))
    ref_model = PolicyModel(rngs=nnx.Rngs(5))
    cfg = GRPOConfig(beta=0.1)
    batch = seed_batch()
    trainer = GRPOTrainer(
        model, nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param), cfg, reference_model=ref_model
    )
    got = trainer.train_step(batch)
    ref_lp = jax.nn.log_softmax(ref_model(batch["observations"]))[jnp.arange(8), batch["actions"]]
    grpo_loss = make_grpo_loss(model, cfg)
    _, want = grpo_loss(nnx.state(model, nnx.Param), dict(batch, ref_log_probs=ref_lp))
    np.testing.assert_allclose(got["kl"], float(want["kl"]), rtol=1e-5)
    assert got["kl"] > 0


def test_cloned_reference_survives_donation():
    model = PolicyModel(rngs=nnx.Rngs(0))
    ref = nnx.clone(model)  # shares buffers with model
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param),
        GRPOConfig(beta=0.1),
        reference_model=ref,
    )
    first = trainer.train_step(seed_batch())
    second = trainer.train_step(seed_batch())
    assert first["kl"] == 0.0 and second["kl"] > 0.0  # reference stayed at the initial policy
    assert np.isfinite(np.asarray(ref.out.kernel[...])).all()


def test_reference_model_must_be_a_copy():
    model = PolicyModel(rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="reference_model"):
        GRPOTrainer(
            model,
            nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
            GRPOConfig(),
            reference_model=model,
        )


def test_missing_reference_warns_once(caplog):
    model = PolicyModel(rngs=nnx.Rngs(0))
    trainer = GRPOTrainer(
        model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), GRPOConfig(beta=0.05)
    )
    with caplog.at_level("WARNING"):
        trainer.train_step(seed_batch())
        trainer.train_step(seed_batch(seed=1))
    assert sum("KL penalty is 0" in r.message for r in caplog.records) == 1


# ------------------------------------------------------------------ bad input
def make_trainer(**cfg):
    model = PolicyModel(rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return GRPOTrainer(model, opt, GRPOConfig(**cfg))


def test_batch_not_multiple_of_group_size():
    trainer = make_trainer()
    with pytest.raises(ValueError, match="not a multiple of its group size 4"):
        trainer.train_step(seed_batch(batch_size=6))
    assert trainer.num_compilations == 0  # raised before anything was traced


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("rewards", np.zeros(7, np.float32), "rows"),
        ("log_probs", np.zeros(7, np.float32), "shape of actions"),
        ("ref_log_probs", np.zeros((8, 2), np.float32), "shape of actions"),
        ("observations", np.zeros((7, 8), np.float32), "8 rows"),
    ],
)
def test_mismatched_rows_or_lengths(field, value, match):
    trainer = make_trainer()
    batch = seed_batch()
    batch[field] = value
    with pytest.raises(ValueError, match=match):
        trainer.train_step(batch)


def test_grpo_batch_field_mismatches_name_the_field():
    b, t = 8, 5
    good = dict(
        prompt_ids=jnp.zeros((b, 3), jnp.int32),
        completion_ids=jnp.zeros((b, t), jnp.int32),
        completion_mask=jnp.ones((b, t)),
        rewards=jnp.zeros((b,)),
        group_size=4,
    )
    GRPOBatch(**good).validate()
    cases = {
        "completion_mask": jnp.ones((b, t + 1)),
        "old_log_probs": jnp.zeros((b, t - 1)),
        "ref_log_probs": jnp.zeros((b - 4, t)),
        "prompt_mask": jnp.ones((b, 2)),
        "advantages": jnp.zeros((b, 2)),
        "group_ids": jnp.zeros((b + 1,), jnp.int32),
    }
    for name, bad in cases.items():
        with pytest.raises(ValueError, match=f"GRPOBatch.{name}"):
            GRPOBatch(**dict(good, **{name: bad})).validate()
    with pytest.raises(TypeError, match="completion_ids"):
        GRPOBatch(**dict(good, completion_ids=jnp.zeros((b, t)))).validate()
    with pytest.raises(ValueError, match="only 0 and 1"):
        GRPOBatch(**dict(good, completion_mask=jnp.full((b, t), 0.5))).validate()


def test_unknown_dict_keys_are_an_error():
    with pytest.raises(ValueError, match="unknown batch keys"):
        make_trainer().train_step(dict(seed_batch(), rewardz=np.zeros(8)))


def test_row_without_valid_tokens_keeps_loss_finite():
    model = BigramLM(6, 8, nnx.Rngs(0))
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param),
        GRPOConfig(loss_aggregation="sequence_mean"),
    )
    mask = np.ones((8, 4), np.float32)
    mask[3] = 0.0
    for agg in ("sequence_mean", "token_mean", "constant_length"):
        trainer.config = GRPOConfig(loss_aggregation=agg)
        batch = GRPOBatch(
            prompt_ids=jnp.ones((8, 2), jnp.int32),
            completion_ids=jnp.ones((8, 4), jnp.int32),
            completion_mask=jnp.asarray(mask),
            rewards=jnp.arange(8, dtype=jnp.float32),
            group_size=4,
        )
        m = trainer.train_step(batch)
        assert all(np.isfinite(v) for v in m.values())
    all_empty = batch.replace(completion_mask=jnp.zeros((8, 4)))
    m = trainer.train_step(all_empty)
    assert m["total_loss"] == 0.0 and m["grad_norm"] == 0.0


def test_infinite_reward_is_an_error():
    batch = seed_batch()
    batch["rewards"] = batch["rewards"].at[3].set(jnp.inf)
    with pytest.raises(ValueError, match=r"rewards must be finite or NaN.*row 3"):
        make_trainer().train_step(batch)


def test_nan_reward_means_no_reward():
    batch = seed_batch()
    batch["rewards"] = batch["rewards"].at[3].set(jnp.nan)
    m = make_trainer().train_step(batch)
    assert np.isfinite(m["total_loss"]) and np.isfinite(m["reward_mean"])


def test_non_finite_loss_leaves_model_and_optimizer_unchanged():
    trainer = make_trainer()
    trainer.train_step(seed_batch(seed=1))  # a real step first, so the Adam state is non-trivial
    before = state_leaves(trainer.model, trainer.optimizer)
    step_before = int(trainer.optimizer.step[...])
    batch = seed_batch(seed=2)
    batch["observations"] = batch["observations"].at[5, 0].set(jnp.nan)
    with pytest.raises(NonFiniteUpdateError) as info:
        trainer.train_step(batch)
    assert not np.isfinite(info.value.metrics["total_loss"])
    after = state_leaves(trainer.model, trainer.optimizer)
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
    assert int(trainer.optimizer.step[...]) == step_before
    # ... and training goes on normally afterwards.
    assert np.isfinite(trainer.train_step(seed_batch(seed=3))["total_loss"])


def test_group_size_override_below_two_is_an_error():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        make_trainer().train_step(dict(seed_batch(), group_size=1))


def test_wrong_types_are_type_errors():
    model = PolicyModel(rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with pytest.raises(TypeError, match="optimizer"):
        GRPOTrainer(model, optax.adam(1e-2), GRPOConfig())
    with pytest.raises(TypeError, match="config"):
        GRPOTrainer(model, opt, {"num_generations": 4})
    with pytest.raises(TypeError, match="batch"):
        GRPOTrainer(model, opt).train_step([1, 2, 3])
    with pytest.raises(TypeError, match="integer"):
        GRPOTrainer(model, opt).train_step(dict(seed_batch(), actions=np.zeros(8, np.float32)))


# ------------------------------------------------------------------ accumulation, log-probs
def lm_batch(seed=0, b=8, t=5, g=4):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, size=b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    return GRPOBatch(
        prompt_ids=jnp.asarray(rng.integers(0, 6, size=(b, 3)), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(0, 6, size=(b, t)), jnp.int32),
        completion_mask=jnp.asarray(mask),
        rewards=jnp.asarray(rng.normal(size=b), jnp.float32),
        old_log_probs=jnp.asarray(-1.8 + 0.2 * rng.normal(size=(b, t)), jnp.float32),
        group_size=g,
    )


@pytest.mark.parametrize("agg", ["sequence_mean", "token_mean", "constant_length"])
def test_gradient_accumulation_equals_full_batch_update(agg):
    cfg = GRPOConfig(loss_aggregation=agg, beta=0.05, clip_param=0.1)
    results = []
    for micro in (1, 2, 4):
        model = BigramLM(6, 8, nnx.Rngs(0))
        ref = BigramLM(6, 8, nnx.Rngs(9))
        trainer = GRPOTrainer(
            model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), cfg, reference_model=ref
        )
        metrics = trainer.train_step(lm_batch(), num_microbatches=micro)
        results.append((metrics, [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]))
    (m1, p1) = results[0]
    for m, p in results[1:]:
        for x, y in zip(p1, p, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
        for key in (
            "total_loss",
            "policy_loss",
            "kl",
            "entropy",
            "grad_norm",
            "approx_kl",
            "clip_fraction",
            "reward_mean",
            "advantage_std",
            "num_tokens",
        ):
            np.testing.assert_allclose(m[key], m1[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_num_microbatches_must_divide_rows():
    model = BigramLM(6, 8, nnx.Rngs(0))
    trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    with pytest.raises(ValueError, match="num_microbatches"):
        trainer.train_step(lm_batch(), num_microbatches=3)


def test_compute_log_probs_scores_policy_and_reference():
    model = BigramLM(6, 8, nnx.Rngs(0))
    ref = BigramLM(6, 8, nnx.Rngs(3))
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param),
        GRPOConfig(beta=0.1),
        reference_model=ref,
    )
    batch = lm_batch().replace(old_log_probs=None)
    filled = trainer.compute_log_probs(batch)

    def score(m):
        seq = jnp.concatenate([batch.prompt_ids, batch.completion_ids], 1)
        logits = m(seq)[:, 2:-1]
        lp = jax.nn.log_softmax(logits)
        return np.take_along_axis(np.asarray(lp), np.asarray(batch.completion_ids)[..., None], -1)[
            ..., 0
        ]

    np.testing.assert_allclose(filled.old_log_probs, score(model), atol=1e-5)
    np.testing.assert_allclose(filled.ref_log_probs, score(ref), atol=1e-5)
    # With both fields filled, a step is exactly the on-policy step at its first iteration.
    m = trainer.train_step(filled)
    assert abs(m["approx_kl"]) < 1e-6 and m["kl"] > 0
