"""The functional train state and the pure grpo_train_step under GRPOTrainer."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch
from artifex.generative_models.training.rl.state import (
    GRPOTrainState,
    init_train_state,
    make_grpo_log_probs,
    make_grpo_train_step,
    write_train_state,
)


def tiny_lm(seed: int = 0) -> CausalLM:
    cfg = CausalLMConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=32,
    )
    return CausalLM(cfg, rngs=nnx.Rngs(seed))


def lm_batch(seed: int, prompts: int = 2, g: int = 4, p: int = 3, t: int = 5) -> GRPOBatch:
    """A random causal-LM batch: shared prompts per group, ragged completions, old log-probs."""
    rng = np.random.default_rng(seed)
    b = prompts * g
    prompt_ids = np.repeat(rng.integers(1, 32, (prompts, p)), g, axis=0)
    lengths = rng.integers(1, t + 1, b)
    completion_mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    return GRPOBatch(
        prompt_ids=jnp.asarray(prompt_ids, jnp.int32),
        prompt_mask=jnp.ones((b, p), jnp.float32),
        completion_ids=jnp.asarray(rng.integers(1, 32, (b, t)), jnp.int32),
        completion_mask=jnp.asarray(completion_mask),
        rewards=jnp.asarray(rng.normal(size=b), jnp.float32),
        old_log_probs=jnp.asarray(-3.5 + 0.1 * rng.normal(size=(b, t)), jnp.float32),
        group_size=g,
    )


CONFIG = GRPOConfig(num_generations=4, beta=0.04, clip_param=0.2)


def copies(seed: int = 0):
    """Two identical (policy, reference) pairs with independent buffers."""
    out = []
    for _ in range(2):
        policy, reference = tiny_lm(seed), tiny_lm(seed + 1)
        out.append((policy, reference))
    return out


def test_scan_over_batches_equals_trainer_train_step_loop():
    batches = [lm_batch(s) for s in range(3)]
    (p1, r1), (p2, r2) = copies()
    tx = optax.adamw(1e-2, weight_decay=0.01)

    trainer = GRPOTrainer(p1, nnx.Optimizer(p1, tx, wrt=nnx.Param), CONFIG, reference_model=r1)
    for b in batches:
        trainer.train_step(b)

    optimizer = nnx.Optimizer(p2, tx, wrt=nnx.Param)
    step = make_grpo_train_step(p2, optimizer.tx, CONFIG, reference_model=r2)
    state = init_train_state(p2, optimizer, reference_model=r2)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)

    @jax.jit
    def run(state: GRPOTrainState, stacked: GRPOBatch):
        return jax.lax.scan(step, state, stacked)

    final, metrics = run(state, stacked)
    assert metrics["total_loss"].shape == (3,)
    np.testing.assert_array_equal(np.asarray(metrics["update_applied"]), 1.0)
    assert int(final.step) == 3 == int(trainer.optimizer.step[...])
    # The trainer compiles with the library's CPU compiler options, this jit without them:
    # the same math, equal to float32 rounding rather than bitwise.
    chex.assert_trees_all_close(
        final.params, nnx.as_pure(nnx.state(p1, nnx.Param)), rtol=1e-5, atol=5e-6
    )
    chex.assert_trees_all_close(
        final.opt_state, nnx.as_pure(trainer.optimizer.opt_state), rtol=1e-5, atol=1e-7
    )
    # The parameters moved (the comparison above is not between two untouched models).
    moved = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(a - b))),
        final.params,
        nnx.as_pure(nnx.state(tiny_lm(0), nnx.Param)),
    )
    assert max(jax.tree.leaves(moved)) > 1e-3
    # write_train_state puts the scanned state into the second model: both models now agree.
    write_train_state(final, p2, optimizer, r2)
    ids = jnp.asarray([[3, 4, 5, 6]])
    np.testing.assert_allclose(np.asarray(p2(ids)), np.asarray(p1(ids)), rtol=1e-4, atol=1e-5)


def test_pure_step_leaves_the_state_unchanged_on_a_non_finite_update():
    policy = tiny_lm(0)
    optimizer = nnx.Optimizer(policy, optax.adam(1e39), wrt=nnx.Param)  # the update overflows
    step = jax.jit(make_grpo_train_step(policy, optimizer.tx, GRPOConfig(num_generations=4)))
    state = init_train_state(policy, optimizer)
    before = jax.tree.map(np.asarray, state.params)
    new, metrics = step(state, lm_batch(0))
    assert float(metrics["update_applied"]) == 0.0
    assert float(metrics["finite_update"]) == 0.0
    assert float(metrics["finite_params"]) == 0.0
    assert int(new.step) == 0
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, new.params), before)


def test_pure_step_skips_a_batch_without_reward_signal():
    policy = tiny_lm(0)
    optimizer = nnx.Optimizer(policy, optax.adam(1e-2), wrt=nnx.Param)
    config = GRPOConfig(num_generations=4, entropy_coeff=0.0)  # no entropy bonus asked for
    step = jax.jit(make_grpo_train_step(policy, optimizer.tx, config))
    state = init_train_state(policy, optimizer)
    batch = lm_batch(0)
    batch = batch.replace(rewards=jnp.full_like(batch.rewards, jnp.nan))
    new, metrics = step(state, batch)
    assert float(metrics["reward_signal"]) == 0.0
    assert float(metrics["update_applied"]) == 0.0
    assert np.isnan(float(metrics["reward_mean"]))
    assert int(new.step) == 0


def test_microbatched_pure_step_equals_the_full_batch_step():
    policy = tiny_lm(0)
    optimizer = nnx.Optimizer(policy, optax.sgd(0.1), wrt=nnx.Param)
    state = init_train_state(policy, optimizer)
    batch = lm_batch(3)
    full = jax.jit(make_grpo_train_step(policy, optimizer.tx, CONFIG))
    micro = jax.jit(make_grpo_train_step(policy, optimizer.tx, CONFIG, num_microbatches=2))
    a, ma = full(state, batch)
    b, mb = micro(state, batch)
    chex.assert_trees_all_close(a.params, b.params, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(ma["total_loss"]), float(mb["total_loss"]), rtol=1e-5)


def test_log_probs_of_the_state_match_the_trainer():
    (p1, r1), _ = copies()
    trainer = GRPOTrainer(
        p1, nnx.Optimizer(p1, optax.adam(1e-3), wrt=nnx.Param), CONFIG, reference_model=r1
    )
    batch = lm_batch(1).replace(old_log_probs=None)
    filled = trainer.compute_log_probs(batch)
    log_probs = jax.jit(make_grpo_log_probs(p1, CONFIG, reference_model=r1))
    lp, ref_lp = log_probs(trainer.state, filled.replace(old_log_probs=None, ref_log_probs=None))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(filled.old_log_probs), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ref_lp), np.asarray(filled.ref_log_probs), rtol=1e-6)
    assert not np.allclose(np.asarray(lp), np.asarray(ref_lp))  # two different policies


def test_train_state_is_a_pytree_of_arrays_and_bad_arguments_are_named():
    policy = tiny_lm(0)
    optimizer = nnx.Optimizer(policy, optax.adam(1e-3), wrt=nnx.Param)
    state = init_train_state(policy, optimizer, rng=jax.random.key(7))
    for leaf in jax.tree.leaves(state):
        assert isinstance(leaf, jax.Array)
    assert state.reference is None
    with pytest.raises(TypeError, match=r"optimizer must be an nnx\.Optimizer"):
        init_train_state(policy, optax.adam(1e-3))
    with pytest.raises(ValueError, match="num_microbatches"):
        make_grpo_train_step(policy, optimizer.tx, CONFIG, num_microbatches=0)
    with pytest.raises(TypeError, match="config must be a GRPOConfig"):
        make_grpo_train_step(policy, optimizer.tx, {"beta": 0.0})


@pytest.mark.parametrize("rows_first", [False, True])
@pytest.mark.parametrize("where", ["none", "param", "mu", "nu", "scalar"])
def test_finite_flags_match_a_numpy_reference(where, rows_first, monkeypatch):
    """Each parameter is checked with its Adam moments in one two-output reduction.

    ``rows_first``: every array with two or more axes is reduced to its rows first, as large
    arrays are (the threshold lowered to 1 element).
    """
    from artifex.generative_models.training.rl import state as state_module
    from artifex.generative_models.training.rl.state import _finite_flags

    if rows_first:
        monkeypatch.setattr(state_module, "_ROWS_FIRST", 1)

    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16),
        "s": jnp.float32(0.5),  # a scalar parameter
        "steps": jnp.int32(3),  # not inexact: never checked
    }
    opt_state = optax.adamw(1e-3).init(params)
    inf = jnp.float32(np.inf)
    if where == "param":
        params["b"] = params["b"].at[2].set(jnp.nan)
    elif where == "mu":
        mu = dict(opt_state[0].mu, w=opt_state[0].mu["w"].at[1, 1].set(inf))
        opt_state = (opt_state[0]._replace(mu=mu), *opt_state[1:])
    elif where == "nu":
        nu = dict(opt_state[0].nu, s=jnp.float32(np.nan))
        opt_state = (opt_state[0]._replace(nu=nu), *opt_state[1:])
    elif where == "scalar":
        params["s"] = -inf

    def reference(tree):
        leaves = [
            np.asarray(x, np.float64)
            for x in jax.tree.leaves(tree)
            if np.issubdtype(np.asarray(x).dtype, np.inexact) or x.dtype == jnp.bfloat16
        ]
        return all(np.isfinite(x).all() for x in leaves)

    got = jax.jit(_finite_flags)(params, opt_state)
    assert (bool(got[0]), bool(got[1])) == (reference(params), reference(opt_state)), where
    assert (bool(got[0]), bool(got[1])) == {
        "none": (True, True), "param": (False, True), "mu": (True, False),
        "nu": (True, False), "scalar": (False, True),
    }[where]  # fmt: skip


@pytest.mark.parametrize("threshold", [1, 1 << 22])
def test_all_finite_checks_every_leaf_rows_first_or_whole(threshold, monkeypatch):
    from artifex.generative_models.training.rl import state as state_module

    monkeypatch.setattr(state_module, "_ROWS_FIRST", threshold)
    tree = {"m": jnp.ones((3, 4, 2)), "v": jnp.ones((5,)), "s": jnp.float32(1.0), "n": jnp.int32(7)}
    check = jax.jit(state_module._all_finite)
    assert bool(check(tree))
    for name, index in (("m", (2, 3, 1)), ("m", (0, 0, 0)), ("v", (4,)), ("s", ())):
        for bad in (jnp.nan, jnp.inf, -jnp.inf):
            broken = dict(tree, **{name: tree[name].at[index].set(bad)})
            assert not bool(check(broken)), (name, index, bad)
    assert bool(check({"n": jnp.int32(7)}))  # no inexact leaf: nothing to check


def test_finite_flags_with_a_single_array_and_an_optimizer_without_moments():
    from artifex.generative_models.training.rl.state import _finite_flags

    w = jnp.ones((2, 3))
    assert tuple(map(bool, _finite_flags(w, optax.adam(1.0).init(w)))) == (True, True)
    assert tuple(map(bool, _finite_flags(w.at[0, 0].set(jnp.inf), optax.sgd(1.0).init(w)))) == (
        False,
        True,
    )
    bad = optax.adam(1.0).init(w)
    bad = (bad[0]._replace(nu=bad[0].nu.at[1, 2].set(jnp.nan)), *bad[1:])
    assert tuple(map(bool, _finite_flags(w, bad))) == (True, False)


def test_guarded_update_keeps_no_second_copy_of_the_parameters_and_moments():
    # Parameters dominate (a 4,096 x 128 embedding and output layer, 2 layers), activations
    # are tiny (1 prompt x 2 completions of 2 tokens). The step checks that the new state is
    # finite before applying it in place of the donated one: its temporaries hold the
    # gradients (one parameter-sized copy) but not the new parameters and AdamW moments next
    # to the old ones (3 parameter-sized copies). Measured: 1.36 x the parameters with the
    # check fused into a pass of its own, 3.0 x when the new state was computed once, outside
    # the branch that applies it.
    model = CausalLM(
        CausalLMConfig.tiny(vocab_size=4096, num_layers=2, tie_word_embeddings=False),
        rngs=nnx.Rngs(0),
    )
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    config = GRPOConfig(num_generations=2, beta=0.0, optimizer_by_layer=False)  # one program
    trainer = GRPOTrainer(model, optimizer, config)
    batch = GRPOBatch.zeros(1, 2, 2, 2).replace(shared_prompts=True)
    compiled = trainer.compiled_step().lower(trainer.state, batch).compile()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.state.params))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 2 * param_bytes, (temp, param_bytes)


@pytest.mark.parametrize("split", [False, True], ids=["one_program", "optimizer_by_layer"])
def test_a_batch_without_advantage_signal_moves_nothing_unless_asked(split, monkeypatch):
    # Every group's rewards equal: every advantage is 0, and only the KL and the entropy bonus
    # (on by default) would move the policy, at Adam's full step size. By default the update is
    # skipped; update_without_advantage=True applies it (the earlier behaviour).
    from artifex.generative_models.training import GRPOTrainer
    from artifex.generative_models.training.rl.update import engines

    # the optimizer by layer from 2 layers (the library: 8; its threshold is tested in
    # test_optimizer_split.py): the same programs, smaller
    monkeypatch.setattr(engines, "MIN_LAYERS_FOR_OPTIMIZER_BY_LAYER", 2)

    def trainer(**options):
        # 2 layers: the optimizer runs layer by layer on the CPU; 1: one program
        cfg = CausalLMConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_layers=2 if split else 1,
            num_heads=2,
            num_kv_heads=1,
            max_position_embeddings=32,
        )
        policy = CausalLM(cfg, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(policy, optax.adam(1e-2), wrt=nnx.Param)
        config = GRPOConfig(num_generations=4, beta=0.0, entropy_coeff=0.01, **options)
        return GRPOTrainer(policy, optimizer, config)

    batch = lm_batch(0)
    flat = jnp.repeat(jnp.asarray([0.0, 1.0]), 4)[: batch.rewards.shape[0]]
    batch = batch.replace(rewards=flat.astype(batch.rewards.dtype))
    trainers = []
    for options, moves in (({}, False), ({"update_without_advantage": True}, True)):
        t = trainer(**options)
        trainers.append(t)
        before = jax.tree.map(np.array, nnx.state(t.model, nnx.Param))
        metrics = t.train_step(batch)
        after = jax.tree.map(np.array, nnx.state(t.model, nnx.Param))
        diff = jax.tree.map(lambda a, b: bool((a != b).any()), before, after)
        changed = any(jax.tree.leaves(diff))
        assert metrics["advantage_signal"] == 0.0
        assert changed is moves, options
        assert int(t.optimizer.step[...]) == int(moves)
        assert (type(t.compiled_step()).__name__ == "SplitOptimizerEngine") is split
    # One group whose rewards differ is a signal: the update is applied by default (by the
    # first trainer, unchanged by the skipped update: its step count is still 0).
    spread = batch.rewards.at[0].set(5.0)
    t = trainers[0]
    metrics = t.train_step(batch.replace(rewards=spread))
    assert metrics["advantage_signal"] == 1.0 and int(t.optimizer.step[...]) == 1


def test_advantage_signal_against_numpy():
    from artifex.generative_models.training.rl.state import advantage_signal

    rng = np.random.default_rng(0)
    for _ in range(20):
        mask = rng.integers(0, 2, (6, 5))
        adv = np.where(rng.random((6, 5)) < 0.2, rng.normal(size=(6, 5)), 0.0)
        want = float(np.any((adv != 0) & (mask > 0)))
        assert float(advantage_signal(jnp.asarray(adv), jnp.asarray(mask))) == want
        seq = np.where(rng.random(6) < 0.3, rng.normal(size=6), 0.0)
        want = float(np.any((seq != 0) & mask.any(axis=1)))
        assert float(advantage_signal(jnp.asarray(seq), jnp.asarray(mask))) == want
