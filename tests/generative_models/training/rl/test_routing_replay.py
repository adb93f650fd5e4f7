"""Rollout routing replay on Qwen3-MoE: the sampler records routed experts, the update reuses them.

The rollout's router is the policy's with its weights perturbed by 5% (an inference engine's
router computes slightly differently: lower precision, fused kernels, weights a step behind), so
it routes a few tokens to other experts than the trainer's router does. The old log-probs are
the rollout's routing evaluated in the trainer's numerics (R3's recomputation). With replay the
update's first ratio is then exactly 1; without it the trainer's own routing gives other
log-probs on those tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.inference.sampling import generate
from artifex.generative_models.models.causal_lm import (
    CausalLM,
    CausalLMConfig,
    Tokenizer,
    from_pretrained,
)
from artifex.generative_models.models.causal_lm.moe import load_balancing_loss
from artifex.generative_models.training import (
    GRPOConfig,
    GRPOTrainer,
    RewardCombiner,
    RolloutConfig,
    TrainConfig,
    train,
)
from artifex.generative_models.training.rl import (
    GRPOBatch,
    Policy,
    causal_lm_log_probs,
    concat_batches,
    rollout,
    rollout_batch_like,
)
from artifex.generative_models.training.rl.core.routing_replay import (
    routing_replay_log_prob_fn,
    routing_replay_log_probs,
)
from tests.test_metrics_doc import ROOT, undocumented

from ...models.causal_lm._helpers import FIXTURES, load_expected

NAME = "qwen3_moe_tiny"
G, N = 4, 8


def _rollout_router(model, scale=0.05):
    for i, layer in enumerate(model.layers):
        w = layer.mlp.gate.kernel[...]
        noise = jax.random.normal(jax.random.key(100 + i), w.shape)
        layer.mlp.gate.kernel[...] = w * (1.0 + scale * noise)
    return model


def _rollout(model, *, shared=False):
    e = load_expected(NAME)
    out = generate(
        model,
        e["input_ids"][:2],
        e["attention_mask"][:2],
        key=jax.random.key(0),
        num_generations=G,
        max_new_tokens=N,
        eos_ids=(),
        record_routing=True,
    )
    batch = GRPOBatch(
        prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask,
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        rewards=jnp.array([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.2, 0.3]),
        group_size=G,
        shared_prompts=shared,
        routed_experts=out.routed_experts,
    )
    return batch.validate(), out


@pytest.fixture(scope="module")
def policy():
    return from_pretrained(FIXTURES / NAME)


def test_batch_checks_the_routed_experts(policy):
    batch, _ = _rollout(policy)
    with pytest.raises(ValueError, match=r"routed_experts must have shape \(B, P \+ T, L, k\)"):
        batch.replace(routed_experts=batch.routed_experts[:, 1:]).validate()
    with pytest.raises(TypeError, match="routed_experts must hold integer expert ids"):
        batch.replace(routed_experts=batch.routed_experts.astype(jnp.float32)).validate()


@pytest.mark.parametrize("shared", [False, True])
def test_replayed_log_probs_equal_the_plain_ones_when_the_routers_agree(policy, shared):
    batch, _ = _rollout(policy, shared=shared)
    logp, entropy, metrics = routing_replay_log_probs(policy, batch)
    want, want_entropy = causal_lm_log_probs(
        policy, batch.prompt_ids, batch.completion_ids, prompt_mask=batch.prompt_mask
    )
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want), atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy), np.asarray(want_entropy), atol=1e-5)
    assert float(metrics["moe/routing_agreement"]) == 1.0
    assert float(metrics["moe/aux_loss"]) > 0
    fn_logp, _, fn_metrics = routing_replay_log_prob_fn(return_metrics=True)(policy, batch)
    np.testing.assert_array_equal(np.asarray(fn_logp), np.asarray(logp))
    assert fn_metrics.keys() == metrics.keys()


def test_first_ratio_is_exactly_one_with_replay_and_not_without(policy):
    rollout_model = _rollout_router(from_pretrained(FIXTURES / NAME))
    batch, _ = _rollout(rollout_model)
    # old log-probs: the rollout's routing evaluated by the trainer (R3's recomputation)
    scored = GRPOTrainer(
        policy,
        nnx.Optimizer(policy, optax.sgd(0.1), wrt=nnx.Param),
        GRPOConfig(num_generations=G, beta=0.0),
        log_prob_fn=routing_replay_log_prob_fn(),
    ).compute_log_probs(batch)
    old = np.asarray(scored.old_log_probs)
    mask = np.asarray(batch.completion_mask).astype(bool)

    replayed, _, with_replay = routing_replay_log_probs(policy, scored)
    own, _, without = routing_replay_log_probs(policy, scored, routing_replay=False)
    np.testing.assert_array_equal(np.exp(np.asarray(replayed) - old)[mask], 1.0)
    ratio = np.exp(np.asarray(own) - old)[mask]
    assert (ratio != 1.0).sum() >= 3 and np.abs(ratio - 1).max() > 1e-3
    # the current router disagrees with the rollout's on some (token, layer) pairs
    assert 0.9 < float(with_replay["moe/routing_agreement"]) < 1.0
    assert float(without["moe/routing_agreement"]) == 1.0

    # the update's first step: no policy change measured (approx. KL 0, nothing clipped)
    for replay, exact in ((True, True), (False, False)):
        model = from_pretrained(FIXTURES / NAME)
        trainer = GRPOTrainer(
            model,
            nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
            GRPOConfig(num_generations=G, beta=0.0, clip_param=1e-4),
            log_prob_fn=routing_replay_log_prob_fn(routing_replay=replay),
        )
        metrics = trainer.train_step(scored)
        if exact:
            assert metrics["approx_kl"] == 0.0 and metrics["clip_fraction"] == 0.0
        else:
            assert metrics["approx_kl"] > 1e-6 and metrics["clip_fraction"] > 0.0


def test_the_aux_loss_option_adds_its_gradient(policy):
    batch, _ = _rollout(policy)
    coef = 0.5
    weights = jnp.asarray(np.random.default_rng(0).normal(size=batch.completion_ids.shape))

    def objective(fn):
        def loss(model):
            logp, _ = fn(model, batch)
            return jnp.sum(logp * weights)

        return nnx.jit(nnx.grad(loss))(policy)

    def explicit(model):
        logp, _, metrics = routing_replay_log_probs(model, batch)
        return jnp.sum(logp * weights) + coef * metrics["moe/aux_loss"]

    got = objective(routing_replay_log_prob_fn(aux_loss_coef=coef))
    plain = objective(routing_replay_log_prob_fn())
    want = nnx.jit(nnx.grad(explicit))(policy)
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(plain), strict=True)
    router_changed = False
    for g, w, p in leaves:
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
        router_changed |= g.shape == (32, 8) and np.abs(np.asarray(g - p)).max() > 1e-6
    assert router_changed  # the aux loss reaches the routers
    # the loss value is the transformers-style load-balancing loss of the pass
    _, _, metrics = routing_replay_log_probs(policy, batch)
    ids = jnp.concatenate([batch.prompt_ids, batch.completion_ids], 1)
    mask = jnp.concatenate([batch.prompt_mask, jnp.ones_like(batch.completion_ids)], 1)
    replay = jnp.moveaxis(batch.routed_experts, 2, 0)  # (L, B, P + T, k)
    _, _, trace = policy.hidden_states(ids, mask, routing=replay)
    np.testing.assert_allclose(float(metrics["moe/aux_loss"]), float(load_balancing_loss(trace)))


def test_replay_refusals(policy):
    batch, _ = _rollout(policy)
    with pytest.raises(ValueError, match=r"needs GRPOBatch\.routed_experts"):
        routing_replay_log_probs(policy, batch.replace(routed_experts=None))
    dense = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="routing replay needs a mixture-of-experts causal LM"):
        routing_replay_log_probs(dense, batch)
    with pytest.raises(ValueError, match="aux_loss_coef"):
        routing_replay_log_prob_fn(aux_loss_coef=-1.0)


# ------------------------------------------------------------------ the GRPOConfig switch
TOK = Tokenizer.for_characters("0123456789+=")
ROWS = [{"prompt": "12+34="}, {"prompt": "5+6="}]
MOE_KEYS = ("moe/routing_agreement", "moe/aux_loss")


def _varied(prompts, completions, **columns):
    return [float(i % 3) for i in range(len(completions))]  # every group has a signal


def _trainer(**options):
    model = from_pretrained(FIXTURES / NAME)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    config = GRPOConfig(num_generations=G, beta=0.0, clip_param=1e-4, **options)
    return GRPOTrainer(model, optimizer, config)


@pytest.mark.parametrize("replay", [True, False])
def test_the_config_switch_replays_the_rollouts_routing(replay):
    """The library's rollout (its sampler's router perturbed, an engine's numerics) and one update.

    With ``routing_replay`` the sampler records the experts, the old log-probs are the trainer's
    under them ("auto" recomputes) and the update routes alike: its first ratio is 1 (up to a
    float32 rounding of one token between the forward-only and the gradient program: approx. KL
    under 1e-12, nothing clipped at 1e-4). Without it "auto" takes the sampler's log-probs, and
    the trainer's own routing differs from the sampler's on some tokens.
    """
    trainer = _trainer(routing_replay=replay, moe_aux_loss_coef=0.001 if replay else 0.0)
    sampler = _rollout_router(from_pretrained(FIXTURES / NAME))
    policy = dataclasses.replace(trainer.policy(), model=sampler)  # the trainer's scorer
    ro = rollout(
        policy, TOK, ROWS, RewardCombiner([_varied]), RolloutConfig(max_new_tokens=4),
        key=jax.random.key(0), need_old_log_probs=True,
    )  # fmt: skip
    batch = ro.batch
    if replay:  # (B, P + T, L, k), laid out as rollout_batch_like says
        like = rollout_batch_like(policy, TOK, ROWS, RolloutConfig(max_new_tokens=4))
        assert batch.routed_experts.shape == like.routed_experts.shape == (8, 20, 2, 2)
    else:
        assert batch.routed_experts is None
    metrics = trainer.train_step(batch)
    assert all(np.isfinite(metrics[key]) for key in MOE_KEYS)
    assert not undocumented(set(metrics), (ROOT / "docs" / "metrics.md").read_text())
    if replay:
        assert metrics["approx_kl"] < 1e-12 and metrics["clip_fraction"] == 0.0
        assert 0.9 < metrics["moe/routing_agreement"] < 1.0  # the router differs from the rollout's
    else:
        assert metrics["approx_kl"] > 1e-5 and metrics["clip_fraction"] > 0.0
        assert metrics["moe/routing_agreement"] == 1.0


def test_microbatches_report_the_whole_batchs_routing_agreement():
    """With microbatches the agreement is weighted by each one's completion tokens, as one pass.

    The first microbatch replays other experts than its routers pick (low agreement), the second
    its own (agreement near 1), and their completion tokens differ (7 and 15), so an unweighted
    mean of the microbatches' agreements would differ from the whole batch's.
    """
    trainer = _trainer(routing_replay=True)
    sampler = _rollout_router(from_pretrained(FIXTURES / NAME))
    policy = dataclasses.replace(trainer.policy(), model=sampler)
    ro = rollout(
        policy, TOK, ROWS, RewardCombiner([_varied]), RolloutConfig(max_new_tokens=4),
        key=jax.random.key(0), need_old_log_probs=True,
    )  # fmt: skip
    lengths = np.array([4, 1, 1, 1, 4, 4, 3, 4])  # 7 and 15 tokens in the two microbatches
    mask = (np.arange(4)[None, :] < lengths[:, None]).astype(np.float32)
    experts = np.asarray(ro.batch.routed_experts).copy()  # (B, P + T, L, k)
    experts[:4] = (experts[:4] + 1) % 8  # the first microbatch replays other experts
    batch = ro.batch.replace(completion_mask=jnp.asarray(mask), routed_experts=jnp.asarray(experts))
    whole = routing_replay_log_probs(trainer.model, batch)[2]["moe/routing_agreement"]
    halves = [
        routing_replay_log_probs(trainer.model, batch.replace(**{
            f: getattr(batch, f)[s] for f in (
                "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "rewards",
                "routed_experts", "old_log_probs",
            )
        }))[2]["moe/routing_agreement"]
        for s in (slice(0, 4), slice(4, 8))
    ]  # fmt: skip
    assert abs(float(halves[0]) - float(halves[1])) > 1e-3  # so the weighting matters
    metrics = trainer.train_step(batch, num_microbatches=2)
    np.testing.assert_allclose(metrics["moe/routing_agreement"], float(whole), rtol=1e-6)
    tokens = mask[:4].sum(), mask[4:].sum()
    weighted = (float(halves[0]) * tokens[0] + float(halves[1]) * tokens[1]) / sum(tokens)
    np.testing.assert_allclose(weighted, float(whole), rtol=1e-6)


def test_the_loop_records_routing_and_logs_the_moe_metrics():
    trainer = _trainer(routing_replay=True)
    config = TrainConfig(num_steps=1, prompts_per_step=2, progress=False)
    result = train(trainer, TOK, ROWS, [_varied], config, RolloutConfig(max_new_tokens=4))
    (metrics,) = result.history
    assert all(np.isfinite(metrics[key]) for key in MOE_KEYS)
    assert trainer.num_compilations == 1  # compiled ahead for the batch with routed experts


def test_the_config_switch_refusals(policy):
    with pytest.raises(ValueError, match=r"GRPOConfig\.moe_aux_loss_coef must be a number >= 0"):
        GRPOConfig(moe_aux_loss_coef=-0.1)
    with pytest.raises(TypeError, match=r"GRPOConfig\.routing_replay must be a bool"):
        GRPOConfig(routing_replay=1)
    with pytest.raises(ValueError, match="which layerwise_update=True does not run"):
        GRPOConfig(routing_replay=True, remat=True, layerwise_update=True)
    dense = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(dense, optax.sgd(0.1), wrt=nnx.Param)
    for options in (dict(routing_replay=True), dict(moe_aux_loss_coef=0.01)):
        with pytest.raises(ValueError, match=r"needs a mixture-of-experts policy .* 'llama'"):
            GRPOTrainer(dense, optimizer, GRPOConfig(num_generations=G, **options))
    optimizer = nnx.Optimizer(policy, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="a custom log_prob_fn replaces"):
        GRPOTrainer(
            policy, optimizer, GRPOConfig(num_generations=G, routing_replay=True),
            log_prob_fn=routing_replay_log_prob_fn(),
        )  # fmt: skip
    mine = Policy(policy, GRPOConfig(num_generations=G, routing_replay=True))
    with pytest.raises(ValueError, match=r"a rollout engine .* does not record them"):
        rollout(mine, TOK, ROWS, RewardCombiner([_varied]), RolloutConfig(), key=jax.random.key(0),
                engine=object())  # fmt: skip
    # a user's batch without the recorded experts, refused on the host
    trainer = _trainer(routing_replay=True)
    batch, _ = _rollout(policy)
    with pytest.raises(ValueError, match="needs batches with routed_experts"):
        trainer.train_step(batch.replace(routed_experts=None))
    assert trainer.num_compilations == 0


def test_dynamic_sampling_pads_the_routed_experts():
    """Batches of two prompt buckets concatenate; the shorter's experts are left-padded with -1."""
    short = GRPOBatch.zeros(1, 2, 4, 3).replace(routed_experts=jnp.zeros((2, 7, 2, 2), jnp.int32))
    wide = GRPOBatch.zeros(1, 2, 8, 3).replace(routed_experts=jnp.ones((2, 11, 2, 2), jnp.int32))
    both = concat_batches([short, wide]).validate()
    assert both.routed_experts.shape == (4, 11, 2, 2)
    np.testing.assert_array_equal(both.routed_experts[:2, :4], -1)
    np.testing.assert_array_equal(both.routed_experts[:2, 4:], 0)
    np.testing.assert_array_equal(both.routed_experts[2:], 1)


def test_a_distillation_teacher_keeps_the_moe_metrics():
    """With reverse-KL distillation the student's log-probs go through the replay function too:
    the update reports its routing agreement and aux loss as without a teacher."""
    model = from_pretrained(FIXTURES / NAME)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    config = GRPOConfig(
        num_generations=G, beta=0.0, routing_replay=True, distillation_coeff=0.5,
        distillation_divergence="reverse_kl",
    )  # fmt: skip
    trainer = GRPOTrainer(model, optimizer, config, teacher_model=from_pretrained(FIXTURES / NAME))
    batch, _ = _rollout(trainer.model)
    metrics = trainer.train_step(batch)
    assert all(np.isfinite(metrics[key]) for key in MOE_KEYS)
    assert metrics["moe/routing_agreement"] == 1.0  # the batch's experts are the policy's own
    assert np.isfinite(metrics["distill/reverse_kl"])
