"""``GRPOConfig(layerwise_update=True)``: the trainer's update as per-layer programs.

The layer-by-layer update must give the one-program update's values (``remat=True``, which it
needs), compile a set of programs that does not grow with the depth, leave the state as it was
when the guard rejects an update, and refuse what it cannot run, by name, before any work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import (
    CausalLM,
    LoRAConfig,
    apply_lora,
)
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import NonFiniteUpdateError, causal_lm_log_probs_fn
from tests.generative_models.training.rl.compiles import CompileCounter
from tests.generative_models.training.rl.test_remat import (
    VOCAB,
    assert_bool_config_option,
    flat,
    lm_batch,
    tiny_lm,
)


def tiny(num_layers: int = 3, seed: int = 0, tied: bool = False) -> CausalLM:
    return tiny_lm(num_layers, seed, tie_word_embeddings=tied)


# A sampling temperature other than 1 (the log-probs divide the logits by it) in every test:
# the per-layer programs of one test are those of the next (compiled once, then read from the
# compilation cache).
TEMPERATURE = 0.7


def trainer(layerwise: bool, *, tied=False, num_layers=3, reference=True, tx=None, **options):
    policy = tiny(num_layers, 0, tied)
    ref = tiny(num_layers, 5, tied) if reference else None
    optimizer = nnx.Optimizer(policy, tx or optax.sgd(0.1), wrt=nnx.Param)
    config = GRPOConfig(
        num_generations=4, beta=0.04, remat=True, layerwise_update=layerwise,
        temperature=TEMPERATURE, **options,
    )  # fmt: skip
    return GRPOTrainer(policy, optimizer, config, reference_model=ref)


def assert_same_updates(a: GRPOTrainer, b: GRPOTrainer, batch, steps=2, atol=1e-6) -> None:
    """Same metrics, parameters and optimizer state after ``steps`` updates on ``batch``."""
    for _ in range(steps):
        ma, mb = a.train_step(batch), b.train_step(batch)
        assert set(ma) == set(mb)
        for key, value in ma.items():
            assert mb[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    pa, pb = flat(nnx.state(a.model, nnx.Param)), flat(nnx.state(b.model, nnx.Param))
    for name, expected in pa.items():
        np.testing.assert_allclose(pb[name], expected, rtol=1e-5, atol=atol, err_msg=name)
    oa, ob = flat(nnx.state(a.optimizer.opt_state)), flat(nnx.state(b.optimizer.opt_state))
    for name, expected in oa.items():
        np.testing.assert_allclose(ob[name], expected, rtol=1e-5, atol=atol, err_msg=name)


def every_row_prompts(batch):
    """``batch`` with a prompt of its own in every row (none shared within a group)."""
    ids = np.asarray(batch.prompt_ids)
    ids = (ids + np.arange(len(ids))[:, None]) % (VOCAB - 1) + 1
    batch = batch.replace(prompt_ids=jnp.asarray(ids, jnp.int32), shared_prompts=False)
    assert not batch.prompts_shared_within_groups()
    return batch


# The prompt encoding (once per group, or once per row) and the output layer (an lm_head, or
# the tied embedding's two uses) are independent parts of the update: each of the two cases
# runs one of each. (The trainer encodes the prompts once per group whenever a group's rows
# share them, shared_prompts or not: every_row_prompts gives each row its own.)
@pytest.mark.parametrize(
    "tied,shared", [(False, True), (True, False)], ids=["shared_prompts-lm_head", "every_row-tied"]
)
def test_the_layerwise_update_gives_the_one_program_update(tied, shared):
    batch = lm_batch(seed=1).replace(ref_log_probs=None)
    if not shared:
        batch = every_row_prompts(batch)
    assert_same_updates(trainer(False, tied=tied), trainer(True, tied=tied), batch)


def test_adamw_moments_follow_the_same_gradients():
    # Adam divides by the root of the second moment: last-bit differences of near-zero
    # gradients move a parameter by up to a few learning-rate millionths
    a, b = trainer(False, tx=optax.adamw(1e-2)), trainer(True, tx=optax.adamw(1e-2))
    assert_same_updates(a, b, lm_batch(seed=8).replace(ref_log_probs=None), atol=2e-5)


def test_given_reference_log_probs_and_no_reference_model():
    batch = lm_batch(seed=2)  # ref_log_probs given: no reference forward
    assert_same_updates(trainer(False, reference=False), trainer(True, reference=False), batch)


def test_a_lora_policy_uses_itself_with_zeroed_adapters_as_reference():
    runs = []
    for layerwise in (False, True):
        policy = tiny(2)
        apply_lora(policy, LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",)), nnx.Rngs(1))
        for layer in policy.layers:  # non-zero adapters, so the reference differs
            lora_b = layer.attn.q_proj.lora.lora_b
            lora_b[...] = jnp.full_like(lora_b[...], 0.05)
        optimizer = nnx.Optimizer(policy, optax.sgd(0.1), wrt=nnx.LoRAParam)
        config = GRPOConfig(
            num_generations=4, beta=0.1, remat=True, layerwise_update=layerwise,
            temperature=TEMPERATURE,
        )  # fmt: skip
        runs.append(GRPOTrainer(policy, optimizer, config))
    assert runs[1].has_reference
    batch = lm_batch(seed=3).replace(ref_log_probs=None)
    first = runs[0].train_step(batch)
    assert first["kl"] > 0
    assert runs[1].train_step(batch)["kl"] == pytest.approx(first["kl"], rel=1e-5)
    assert_same_updates(runs[0], runs[1], batch, steps=1)


def _programs(num_layers: int) -> dict[str, int]:
    t = trainer(True, num_layers=num_layers)
    batch = lm_batch(seed=4).replace(ref_log_probs=None)
    for _ in range(3):
        t.train_step(batch)
    assert t.num_compilations == 1
    step = t.compiled_step()
    return {name: program._cache_size() for name, program in step._programs_by_name().items()}


def test_the_compiled_programs_do_not_grow_with_the_depth():
    shallow, deep = _programs(2), _programs(5)
    assert shallow == deep, (shallow, deep)
    # one program per part (the policy and the reference have one layer structure); SGD runs
    # layer by layer: its per-group programs once for a layer and once for the rest, and the
    # whole-tree optimizer program not at all (nor the tied embedding's sum)
    per_group = {"grad_sq", "check", "apply"}
    unused = {"finish", "add"}
    expected = {n: 2 if n in per_group else 0 if n in unused else 1 for n in deep}
    assert deep == expected, deep


def test_compile_ahead_compiles_what_the_step_then_runs():
    t = trainer(True)
    batch = lm_batch(seed=5).replace(ref_log_probs=None, old_log_probs=None)
    future = t.compile_ahead(batch)
    assert future.result() is None
    counter = CompileCounter()  # every XLA compilation, from any thread
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        counter.during(lambda: t.train_step(batch))
    finally:
        counter.active = False
    assert counter.count == 0  # the programs compiled ahead are the ones the step runs
    assert t.num_compilations == 1


# One reference with the policy's dtype and all three other differences at once: the layer
# programs reading any of them from the policy change its log-probs, and so the KL term and the
# update (a bfloat16 reference: its own case, with bfloat16's tolerance).
@pytest.mark.parametrize(
    "reference_options",
    [{"tied": True, "rope_theta": 100.0, "num_layers": 2}, {"dtype": "bfloat16"}],
    ids=["tied-rope-depth", "bf16"],
)
def test_a_reference_of_another_kind_runs_with_its_own_settings(reference_options):
    """The reference's own output tying, dtype, RoPE and depth, as in the one-program update
    (its log-probs reach the update through the KL term)."""
    options = dict(reference_options)
    dtype = options.pop("dtype", None)
    tied = options.pop("tied", False)
    layers = options.pop("num_layers", 3)
    runs = []
    for layerwise in (False, True):
        policy = tiny(3, 0)
        reference = tiny_lm(layers, 5, tie_word_embeddings=tied, **options)
        if dtype is not None:
            reference = CausalLM(reference.config, rngs=nnx.Rngs(5), dtype=dtype)
        optimizer = nnx.Optimizer(policy, optax.sgd(0.1), wrt=nnx.Param)
        config = GRPOConfig(
            num_generations=4, beta=0.5, remat=True, layerwise_update=layerwise,
            temperature=TEMPERATURE,
        )  # fmt: skip
        runs.append(GRPOTrainer(policy, optimizer, config, reference_model=reference))
    batch = lm_batch(seed=9).replace(ref_log_probs=None)
    expected = runs[0].train_step(batch)
    got = runs[1].train_step(batch)
    # A bfloat16 reference: XLA keeps float32 intermediates inside the one program where the
    # per-layer programs round to bfloat16 between layers (bfloat16's epsilon is 7.8e-3).
    rel = 2e-3 if dtype == "bfloat16" else 2e-5
    for key in ("kl", "kl_penalty", "total_loss", "grad_norm"):
        assert got[key] == pytest.approx(expected[key], rel=rel, abs=1e-7), key


def test_a_trainable_variable_outside_the_layers_is_refused_when_the_trainer_is_built():
    policy = tiny(2)
    policy.value_head = nnx.Linear(32, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(policy, optax.sgd(0.1), wrt=nnx.Param)
    config = GRPOConfig(num_generations=4, remat=True, layerwise_update=True)
    with pytest.raises(ValueError, match=r"the model has trainable \['value_head'\]"):
        GRPOTrainer(policy, optimizer, config)


def test_a_rejected_update_leaves_the_state_as_it_was():
    t = trainer(True, tx=optax.sgd(1e39))  # an infinite float32 learning rate
    before = flat(nnx.state(t.model, nnx.Param))
    batch = lm_batch(seed=6).replace(ref_log_probs=None)
    with pytest.raises(NonFiniteUpdateError):
        t.train_step(batch)
    after = flat(nnx.state(t.model, nnx.Param))
    for name, expected in before.items():
        np.testing.assert_array_equal(after[name], expected, err_msg=name)
    assert int(t.optimizer.step[...]) == 0


def test_the_option_is_checked_and_reaches_the_cli():
    assert_bool_config_option("layerwise_update")
    for options in ({}, {"remat": True, "remat_every": 2}, {"remat": True, "scan_layers": True}):
        with pytest.raises(ValueError, match="layerwise_update=True recomputes every decoder"):
            GRPOConfig(layerwise_update=True, **options)


def test_what_it_cannot_run_is_refused_by_name():
    policy = tiny(2)
    optimizer = nnx.Optimizer(policy, optax.sgd(0.1), wrt=nnx.Param)
    config = GRPOConfig(num_generations=4, remat=True, layerwise_update=True)
    with pytest.raises(ValueError, match="cannot use a custom log_prob_fn"):
        GRPOTrainer(policy, optimizer, config, log_prob_fn=causal_lm_log_probs_fn())
    linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="needs a CausalLM model"):
        GRPOTrainer(linear, nnx.Optimizer(linear, optax.sgd(0.1), wrt=nnx.Param), config)
    stacked = tiny(2).stack_layers()
    with pytest.raises(ValueError, match="stored stacked"):
        GRPOTrainer(stacked, nnx.Optimizer(stacked, optax.sgd(0.1), wrt=nnx.Param), config)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="does not support a mesh"):
        GRPOTrainer(policy, optimizer, config, mesh=mesh)
    t = GRPOTrainer(policy, optimizer, config)
    batch = lm_batch(seed=7)
    with pytest.raises(ValueError, match="num_microbatches must be 1"):
        t.train_step(batch, num_microbatches=2)
    with pytest.raises(NotImplementedError, match="several programs"):
        t.compiled_step().lower(t.state, t.prepare_batch(batch))


def test_the_training_loop_runs_it_with_compile_ahead_and_minibatches():
    from artifex.generative_models.training.rl.loop import TrainConfig, train
    from tests.generative_models.training.rl.test_loop import (
        REWARD,
        ROLLOUT,
        TRAIN,
        make_trainer,
        params,
    )

    settings = TrainConfig(
        num_steps=2, prompts_per_step=4, num_iterations=2, num_minibatches=2, progress=False, seed=3
    )
    runs = []
    for layerwise in (False, True):
        trainer_, tok = make_trainer(remat=True, layerwise_update=layerwise)
        train(trainer_, tok, TRAIN, [REWARD], settings, ROLLOUT)
        assert trainer_.num_compilations == 1
        runs.append(params(trainer_))
    for a, b in zip(*runs, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-5)
