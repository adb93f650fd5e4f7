"""``split_by_layer``: the optimizer step one decoder layer at a time, only where it is exact.

The check must accept the usual per-parameter transformations, refuse the ones that mix
parameters or treat layers differently, and where it accepts, the groups' updates put together
must equal the transformation's update of the whole tree.
"""

from __future__ import annotations

import contextlib
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import LoRAConfig, apply_lora
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import NonFiniteUpdateError
from artifex.generative_models.training.rl.optimizer_split import (
    deferred_interrupt,
    group_tree,
    split_by_layer,
    update_function,
)
from artifex.generative_models.training.rl.state import init_train_state
from tests.generative_models.training.rl.compiles import CompileCounter
from tests.generative_models.training.rl.test_remat import (
    flat,
    lm_batch,
    tiny_lm,
)


def _layer_zero_frozen(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: (
            "layers" not in jax.tree_util.keystr(path) or "[0]" not in jax.tree_util.keystr(path)
        ),
        params,
    )


def _scaled_by_position():
    """Scales each gradient by a constant of its place in the tree, inside a nested program
    (a jaxpr prints such a program's constants by type only)."""

    def update(updates, state, params=None):
        leaves, treedef = jax.tree.flatten(updates)
        out = []
        for i, u in enumerate(leaves):
            c = np.full((1,), 1.0 + i, np.float32)
            out.append(jax.jit(lambda x, c=c: x * c)(u))
        return treedef.unflatten(out), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


SEPARABLE = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adamw, schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1
    ),
    "clip by value, adamw": lambda: optax.chain(optax.clip(0.01), optax.adamw(1e-2)),
    "adamw, decay mask by rank": lambda: optax.adamw(
        1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    ),
    "lion": lambda: optax.lion(1e-3),
    # moments in another dtype than the parameters are still one entry per parameter
    "adamw, bfloat16 first moment": lambda: optax.adamw(1e-2, mu_dtype=jnp.bfloat16),
}
NOT_SEPARABLE = {
    # the global norm reads every parameter's gradient
    "clip by global norm, adamw": (
        lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
        "reads other groups",
    ),
    # a mask that depends on the layer's place in the whole tree
    "adamw, decay mask by layer": (
        lambda: optax.adamw(1e-2, mask=_layer_zero_frozen),
        "differs from its part of the whole update",
    ),
    # gradient accumulation decides for all parameters at once
    "multisteps": (lambda: optax.MultiSteps(optax.adam(1e-2), 2), "reads other groups"),
    # constants that depend on the layer's place, hidden inside nested programs
    "scaled by position": (
        lambda: optax.chain(_scaled_by_position(), optax.sgd(1.0)),
        "differs from its part of the whole update",
    ),
    # factored second moments: state arrays that are not shaped like the parameters
    "adafactor": (lambda: optax.adafactor(1e-2), "outside the parameter-shaped trees"),
}


def _state(tx, num_layers=3, tied=False):
    model = tiny_lm(num_layers, 0, tie_word_embeddings=tied)
    return init_train_state(model, nnx.Optimizer(model, tx, wrt=nnx.Param))


def _random_like(tree, seed, scale=1.0):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten(
        [
            scale * jax.random.normal(k, jnp.shape(x), jnp.result_type(x))
            if jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.ndim(x)
            else x
            for k, x in zip(keys, leaves, strict=True)
        ]
    )


def _by_groups(tx, split, grads, opt_state, params, scale):
    """The update computed group by group with the split's own pieces, put together."""
    f = update_function(tx, split)
    shared = split.shared(opt_state)
    new_params, new_slots, new_shared = {}, {}, shared
    for g in split.groups:
        p, s, new_shared = f(
            group_tree(grads, g), split.slots(opt_state, g), shared, group_tree(params, g), scale
        )
        new_params[g], new_slots[g] = p, s
    return split.assemble(new_params), split.assemble_state(new_slots, new_shared)


@pytest.mark.parametrize("name", sorted(SEPARABLE))
def test_a_separable_update_computed_by_groups_equals_the_whole_update(name):
    tx = SEPARABLE[name]()
    state = _state(tx)
    split, reason = split_by_layer(tx, state.params, state.opt_state)
    assert split is not None, reason
    assert split.groups == (0, 1, 2, None)
    params, opt_state = state.params, state.opt_state
    scale = jnp.asarray(0.75, jnp.float32)
    for step in range(3):  # the moments and the step count move between steps
        grads = _random_like(params, seed=step)
        scaled = jax.tree.map(lambda g: g * scale, grads)
        updates, expected_state = tx.update(scaled, opt_state, params)
        expected = optax.apply_updates(params, updates)
        got, got_state = _by_groups(tx, split, grads, opt_state, params, scale)
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        assert jax.tree.structure(got_state) == jax.tree.structure(expected_state)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(expected_state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        params, opt_state = expected, expected_state


@pytest.mark.parametrize("name", sorted(NOT_SEPARABLE))
def test_an_update_that_is_not_separable_is_refused_with_the_reason(name):
    make, reason = NOT_SEPARABLE[name]
    tx = make()
    state = _state(tx)
    split, why = split_by_layer(tx, state.params, state.opt_state)
    assert split is None
    assert reason in why


def test_the_check_itself_would_see_a_difference_without_it():
    # what the refused layer mask would do if split anyway: the groups' own updates differ
    # from the whole update (layer 0 gets weight decay in its own update, not in the whole)
    tx = optax.adamw(1e-1, weight_decay=0.5, mask=_layer_zero_frozen)
    state = _state(tx)
    separable, _ = split_by_layer(optax.adamw(1e-1), state.params, state.opt_state)
    assert separable is not None  # same state layout, so its split applies to this tx too
    grads = _random_like(state.params, seed=0)
    scale = jnp.ones((), jnp.float32)
    updates, _ = tx.update(grads, state.opt_state, state.params)
    expected = optax.apply_updates(state.params, updates)
    got, _ = _by_groups(tx, separable, grads, state.opt_state, state.params, scale)
    differs = [
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True)
    ]
    assert any(differs)


def test_parameters_without_layers_are_not_split():
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    tx = optax.adam(1e-2)
    state = init_train_state(model, nnx.Optimizer(model, tx, wrt=nnx.Param))
    split, why = split_by_layer(tx, state.params, state.opt_state)
    assert split is None
    assert "no per-layer entries" in why


def test_only_layers_trainable_has_no_rest_group():
    tx = optax.adam(1e-2)
    state = _state(tx)
    params = nnx.State({"layers": state.params["layers"]})
    split, reason = split_by_layer(tx, params, tx.init(params))
    assert split is not None, reason
    assert split.groups == (0, 1, 2)


# ---------------------------------------------------------------- GRPOTrainer with the split


LAYERS = 2


@pytest.fixture(autouse=True)
def _low_threshold(monkeypatch):
    """The by-layer optimizer from 2 layers (the library: 8): the same programs, smaller (two
    layer groups run the one layer program, then the rest's)."""
    from artifex.generative_models.training.rl.update import engines

    monkeypatch.setattr(engines, "MIN_LAYERS_FOR_OPTIMIZER_BY_LAYER", LAYERS)


def test_the_library_splits_the_optimizer_from_eight_layers(monkeypatch):
    # the library's threshold itself (the fixture above lowers it for this file)
    from artifex.generative_models.training.rl.update import engines
    from artifex.generative_models.training.rl.update.optimizer_split import SplitDecisions

    monkeypatch.undo()  # the autouse fixture's patch
    assert engines.MIN_LAYERS_FOR_OPTIMIZER_BY_LAYER == 8
    tx = optax.adamw(1e-2)
    for layers, refused in ((7, True), (8, False)):
        model = tiny_lm(layers, 0)
        state = init_train_state(model, nnx.Optimizer(model, tx, wrt=nnx.Param))
        split, reason = engines.choose_optimizer_split(
            GRPOConfig(num_generations=4, optimizer_by_layer=True),
            model,
            None,
            lambda state=state: state,
            SplitDecisions(tx),
        )
        assert ("fewer than 8 decoder layers" in reason) == refused, reason
        assert (split is None) == refused, reason


def _trainer(optimizer_by_layer, *, tx=None, tied=False, lora=False, layers=LAYERS, **options):
    policy = tiny_lm(layers, 0, tie_word_embeddings=tied)
    reference = tiny_lm(layers, 5, tie_word_embeddings=tied)
    wrt = nnx.Param
    if lora:
        apply_lora(policy, LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",)), nnx.Rngs(1))
        wrt, reference = nnx.LoRAParam, None
    optimizer = nnx.Optimizer(policy, tx or optax.adamw(1e-2, weight_decay=0.1), wrt=wrt)
    config = GRPOConfig(
        num_generations=4, beta=0.04, optimizer_by_layer=optimizer_by_layer, **options
    )
    return GRPOTrainer(policy, optimizer, config, reference_model=reference)


def _assert_same_training(a, b, batch, steps=3, num_microbatches=1, rtol=1e-5, atol=2e-6):
    for _ in range(steps):
        ma = a.train_step(batch, num_microbatches=num_microbatches)
        mb = b.train_step(batch, num_microbatches=num_microbatches)
        assert set(ma) == set(mb)
        for key, value in ma.items():
            assert mb[key] == pytest.approx(value, rel=max(rtol, 1e-5), abs=1e-6), key
    for tree in (lambda t: nnx.state(t.model, nnx.Param), lambda t: nnx.state(t.optimizer)):
        fa, fb = flat(tree(a)), flat(tree(b))
        assert fa.keys() == fb.keys()
        for name, expected in fa.items():
            np.testing.assert_allclose(
                np.asarray(fb[name], np.float32),
                np.asarray(expected, np.float32),
                rtol=rtol,
                atol=atol,
                err_msg=name,
            )


# Past the defaults, each option changes its own part of the update: the parameter tree (tied
# embeddings: no output layer in the rest group; LoRA: the adapters alone, with the LoRA base as
# reference), the gradient program (remat, microbatches), the optimizer's state (injected
# hyperparameters: state shared by every group) and the clipping (none; a scale below 1). So
# they share two cases, each option run once (one case per option compiled a pair of update
# programs each).
@pytest.mark.parametrize(
    "case",
    [
        {},
        {
            "tied": True,
            "remat": True,
            "remat_every": 2,
            "tx": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1),
            "max_grad_norm": None,
        },
        # the clipping scale below 1; 2 microbatches of one group each
        {"lora": True, "max_grad_norm": 1e-3, "num_microbatches": 2},
    ],
    ids=["adamw", "tied-remat-injected-no_clipping", "lora-clipped-microbatches"],
)
def test_the_trainer_runs_the_optimizer_by_layer_with_the_one_program_values(case):
    case = dict(case)
    num_microbatches = case.pop("num_microbatches", 1)
    a, b = _trainer(False, **case), _trainer(True, **case)
    batch = lm_batch(seed=1).replace(ref_log_probs=None)
    _assert_same_training(a, b, batch, num_microbatches=num_microbatches)
    assert type(b.compiled_step()).__name__ == "SplitOptimizerEngine", b.optimizer_split_reason
    assert type(a.compiled_step()).__name__ == "OneProgramEngine"
    assert a.num_compilations == b.num_compilations == 1


def test_moments_in_bfloat16_for_float32_parameters_run_by_layer():
    # optax.adamw(mu_dtype=bfloat16): the first moment is still one entry per parameter
    tx = optax.adamw(1e-2, weight_decay=0.1, mu_dtype=jnp.bfloat16)
    a, b = _trainer(False, tx=tx), _trainer(True, tx=tx)
    batch = lm_batch(seed=1).replace(ref_log_probs=None)
    # The gradient norm is summed in another order on the two paths: where a moment lands on a
    # bfloat16 rounding boundary, the two round one unit (2**-8 relative) apart, and so do
    # that parameter's later steps (learning rate 1e-2).
    _assert_same_training(a, b, batch, rtol=2**-7, atol=1e-4)
    assert type(b.compiled_step()).__name__ == "SplitOptimizerEngine", b.optimizer_split_reason
    assert b.optimizer_split_reason == ""
    mu = [x for x in jax.tree.leaves(b.state.opt_state) if x.ndim and x.dtype == jnp.bfloat16]
    assert len(mu) == len(jax.tree.leaves(b.state.params))


def test_an_unseparable_optimizer_and_a_shallow_model_run_as_one_program():
    # (microbatches with the optimizer by layer: the lora case above). The kind of step is
    # chosen when it is first built, from the model and the optimizer state: no step needs to
    # run for it.
    global_clip = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    c = _trainer(True, tx=global_clip)
    assert type(c.compiled_step()).__name__ == "OneProgramEngine"
    assert "reads other groups" in c.optimizer_split_reason
    shallow = _trainer(True, layers=LAYERS - 1)
    assert type(shallow.compiled_step()).__name__ == "OneProgramEngine"
    assert f"fewer than {LAYERS} decoder layers" in shallow.optimizer_split_reason


def _global_when_bfloat16():
    """Momentum SGD whose step, with bfloat16 moments, is scaled by the size of all moments
    together: separable by layer for float32 moments only."""

    def init(params):
        return {"m": jax.tree.map(jnp.zeros_like, params)}

    def update(updates, state, params=None):
        f32 = jnp.float32
        m = jax.tree.map(
            lambda m, u: (0.9 * m.astype(f32) + u.astype(f32)).astype(m.dtype), state["m"], updates
        )
        scale = jnp.ones((), f32)
        if jax.tree.leaves(m)[0].dtype == jnp.bfloat16:
            total = sum(jnp.sum(jnp.abs(x.astype(f32))) for x in jax.tree.leaves(m))
            scale = 1.0 / (1.0 + total)
        out = jax.tree.map(lambda x, u: (-0.1 * scale * x.astype(f32)).astype(u.dtype), m, updates)
        return out, {"m": m}

    return optax.GradientTransformation(init, update)


def test_a_state_loaded_with_other_types_is_split_as_its_own_types_allow():
    # the split is decided for each state's dtypes, not once per trainer
    a, b = _trainer(False, tx=_global_when_bfloat16()), _trainer(True, tx=_global_when_bfloat16())
    batch = lm_batch(seed=3).replace(ref_log_probs=None)
    b.train_step(batch)
    a.train_step(batch)
    assert b.optimizer_split_reason == ""
    for t in (a, b):  # the moments now kept in bfloat16
        state = t.state
        t.load_state(
            state.replace(opt_state=jax.tree.map(lambda x: x.astype(jnp.bfloat16), state.opt_state))
        )
    assert "reads other groups" in b.optimizer_split_reason
    # bfloat16 moments: where one lands on a rounding boundary the two paths round one unit
    # (2**-8 relative) apart, as in test_moments_in_bfloat16_for_float32_parameters_run_by_layer
    _assert_same_training(a, b, batch, steps=2, rtol=2**-7, atol=1e-4)
    assert type(b.compiled_step()).__name__ == "SplitOptimizerEngine"  # optimizer: one program
    back = b.state  # and layer by layer again for float32 moments
    b.load_state(
        back.replace(opt_state=jax.tree.map(lambda x: x.astype(jnp.float32), back.opt_state))
    )
    assert b.optimizer_split_reason == ""
    b.train_step(batch)


def test_a_rejected_update_by_layer_leaves_model_and_optimizer_as_they_were():
    t = _trainer(True, tx=optax.sgd(1e39))  # an infinite float32 learning rate
    before = flat(nnx.state(t.model, nnx.Param))
    before_opt = flat(nnx.state(t.optimizer))
    with pytest.raises(NonFiniteUpdateError):
        t.train_step(lm_batch(seed=6).replace(ref_log_probs=None))
    assert type(t.compiled_step()).__name__ == "SplitOptimizerEngine"
    for now, then in (
        (nnx.state(t.model, nnx.Param), before),
        (nnx.state(t.optimizer), before_opt),
    ):
        got = flat(now)
        for name, expected in then.items():
            np.testing.assert_array_equal(got[name], expected, err_msg=name)


def test_compile_ahead_compiles_every_program_the_step_runs():
    t = _trainer(True)
    batch = lm_batch(seed=5).replace(ref_log_probs=None, old_log_probs=None)
    assert t.compile_ahead(batch).result() is None
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        counter.during(lambda: t.train_step(batch))
    finally:
        counter.active = False
    assert counter.count == 0
    assert t.num_compilations == 1


def test_the_split_step_has_no_single_lowering_and_the_option_is_checked():
    t = _trainer(True)
    batch = t.prepare_batch(lm_batch(seed=7))
    with pytest.raises(NotImplementedError, match="optimizer_by_layer=False"):
        t.compiled_step().lower(t.state, batch)
    assert GRPOConfig().optimizer_by_layer is True
    for value in ("yes", 1, None):
        with pytest.raises(TypeError, match=r"GRPOConfig\.optimizer_by_layer must be a bool"):
            GRPOConfig(optimizer_by_layer=value)
    from artifex.cli import build_parser

    base = ["train", "--model", "m", "--data", "d.jsonl", "--reward", "math"]
    args = vars(build_parser().parse_args([*base, "--optimizer-by-layer", "false"]))
    assert args["GRPOConfig.optimizer_by_layer"] is False


@pytest.fixture
def default_sigint():
    """Ctrl-C as an interactive interpreter handles it: a process started in the background by
    a shell without job control inherits SIGINT ignored, and then nothing is held back."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _ctrl_c_at_the_first_group(step):
    """Sends SIGINT while the first group's update program is dispatched; yields the calls."""
    apply = step._optimizer.programs["apply"]
    calls = []

    def apply_with_ctrl_c(*args):
        calls.append(1)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C during the first group's dispatch
        return apply(*args)

    apply_with_ctrl_c.lower = apply.lower  # compile_ahead and prepare_apply lower through it
    step._optimizer.programs["apply"] = apply_with_ctrl_c
    try:
        yield calls
    finally:
        step._optimizer.programs["apply"] = apply


def _assert_interrupted_update_stored(t, expected, calls, steps):
    """Every group ran, nothing was deleted, and the model holds the uninterrupted result."""
    assert len(calls) == LAYERS + 1
    assert _deleted(nnx.state(t.model)) == [] and _deleted(nnx.state(t.optimizer)) == []
    assert int(t.optimizer.step[...]) == steps  # the interrupted update was stored
    got, want = flat(nnx.state(t.model, nnx.Param)), flat(nnx.state(expected.model, nnx.Param))
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def _deleted(tree):
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and x.is_deleted()]


def test_a_ctrl_c_during_the_per_group_updates_keeps_the_new_state(default_sigint):
    # The groups donate their arrays: the interrupt must reach the caller only once the
    # trainer stored the new state (delivered at once, the model would hold deleted arrays).
    t = _trainer(True)
    batch = lm_batch(seed=1).replace(ref_log_probs=None)
    t.train_step(batch)
    step = t.compiled_step()
    assert type(step).__name__ == "SplitOptimizerEngine"
    expected = _trainer(True)  # the same two steps, uninterrupted
    expected.train_step(batch)
    expected.train_step(batch)
    with _ctrl_c_at_the_first_group(step) as calls, pytest.raises(KeyboardInterrupt):
        t.train_step(batch)
    _assert_interrupted_update_stored(t, expected, calls, steps=2)
    assert np.isfinite(t.train_step(batch)["grad_norm"])  # and the next step runs


def _loop_trainer(num_layers=LAYERS):
    from artifex.demos.addition import demo_tokenizer
    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig

    tok = demo_tokenizer()
    config = CausalLMConfig.tiny(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=32,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_ids,
        pad_token_id=tok.pad_id,
    )
    model = CausalLM(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    return GRPOTrainer(model, optimizer, GRPOConfig(num_generations=4, beta=0.0)), tok


def text_reward(prompts, completions, **columns):
    """A reward that differs between sampled completions (an untrained model answers nothing
    right, and a batch whose advantages are all zero is not applied)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _run_loop(trainer, tok, **options):
    from artifex.demos.addition import addition_dataset
    from artifex.generative_models.training.rl.loop import TrainConfig, train
    from artifex.generative_models.training.rl.rollout import RolloutConfig

    data, _ = addition_dataset(seed=0, num_eval=4)
    config = TrainConfig(prompts_per_step=2, progress=False, seed=3, **options)
    return train(trainer, tok, data[:8], [text_reward], config, RolloutConfig(max_new_tokens=4))


@pytest.fixture(scope="module")
def loop_expected():
    """The loop's first step, uninterrupted (read only; shared by both cases below)."""
    from artifex.generative_models.training.rl.update import engines

    with pytest.MonkeyPatch.context() as patch:  # as _low_threshold, for this module fixture
        patch.setattr(engines, "MIN_LAYERS_FOR_OPTIMIZER_BY_LAYER", LAYERS)
        expected, tok = _loop_trainer()
        assert type(expected.compiled_step()).__name__ == "SplitOptimizerEngine"
        _run_loop(expected, tok, num_steps=1)
    return expected


@pytest.mark.parametrize("handle_signals", [False, True])
def test_a_ctrl_c_during_the_loops_per_group_updates_keeps_the_new_state(
    tmp_path, handle_signals, default_sigint, loop_expected
):
    # The training loop wraps its updates and the store of their state in an interrupt_scope:
    # the interrupt reaches the caller (KeyboardInterrupt) only once the updated state is in
    # the model (without the scope it held deleted arrays). With the loop's own handler the held
    # signal records a stop: the step finishes, a checkpoint is written, the run returns.
    expected = loop_expected  # the same first step, uninterrupted
    t, tok = _loop_trainer()
    step = t.compiled_step()
    assert type(step).__name__ == "SplitOptimizerEngine", t.optimizer_split_reason
    ckpt = str(tmp_path / "ckpt")
    options = dict(num_steps=3, checkpoint_dir=ckpt, handle_signals=handle_signals)
    with _ctrl_c_at_the_first_group(step) as calls:
        if handle_signals:
            result = _run_loop(t, tok, **options)
            assert result.interrupted == "SIGINT" and len(result.history) == 1
            from artifex.generative_models.training.checkpointing import CheckpointManager

            assert CheckpointManager(ckpt).all_steps() == [1]
        else:
            with pytest.raises(KeyboardInterrupt):
                _run_loop(t, tok, **options)
    _assert_interrupted_update_stored(t, expected, calls, steps=1)


def test_ctrl_c_outside_an_interrupt_scope_and_an_ignored_sigint(default_sigint):
    reached = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupt():
        signal.raise_signal(signal.SIGINT)
        reached.append("after the signal")  # the block is not cut short
    assert reached == ["after the signal"]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with deferred_interrupt():  # ignored by the application: nothing to deliver after
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_arrays_that_cannot_be_donated_are_refused_before_any_group_runs():
    batch = lm_batch(seed=1).replace(ref_log_probs=None)
    t = _trainer(True)
    shared = t.model.layers[0].attn.q_proj.kernel.value
    t.model.layers[1].attn.q_proj.kernel.value = shared  # one array in two groups
    with pytest.raises(ValueError, match=r"group 1, parameters.*same device buffer.*group 0"):
        t.train_step(batch)
    assert _deleted(nnx.state(t.model)) == [] and _deleted(nnx.state(t.optimizer)) == []


def test_the_clipping_norm_of_bfloat16_gradients_is_the_one_program_norm():
    # both paths square and sum in float32 (the one-program step used to sum in bfloat16)
    def make(by_layer):
        policy = tiny_lm(LAYERS, 0, param_dtype="bfloat16")
        optimizer = nnx.Optimizer(policy, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)
        config = GRPOConfig(num_generations=4, beta=0.0, optimizer_by_layer=by_layer)
        return GRPOTrainer(policy, optimizer, config)

    a, b = make(False), make(True)
    batch = lm_batch(seed=1).replace(ref_log_probs=None)
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert type(b.compiled_step()).__name__ == "SplitOptimizerEngine"
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-6)
    fa, fb = flat(nnx.state(a.model, nnx.Param)), flat(nnx.state(b.model, nnx.Param))
    for name, value in fa.items():
        np.testing.assert_array_equal(fb[name], value, err_msg=name)


def test_the_update_programs_are_compiled_before_the_groups_run_after_a_placement():
    # committed arrays (a restored checkpoint) select other executables than fresh ones
    t = _trainer(True)
    batch = lm_batch(seed=1).replace(ref_log_probs=None)
    t.train_step(batch)
    step = t.compiled_step()
    apply = step._optimizer.programs["apply"]
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    inside = []

    def run_counted(*args):
        counter.count, counter.active = 0, True
        try:
            out = apply(*args)
        finally:
            counter.active = False
        inside.append(counter.count)
        return out

    run_counted.lower = apply.lower  # prepare_apply compiles through it
    step._optimizer.programs["apply"] = run_counted
    try:
        t.load_state(jax.device_put(t.state, jax.devices()[0]))
        assert jax.tree.leaves(t.state.params)[0].committed
        t.train_step(batch)
    finally:
        step._optimizer.programs["apply"] = apply
    assert inside == [0] * (LAYERS + 1)


def test_the_split_is_chosen_only_for_parameters_on_the_cpu(monkeypatch):
    # The split shortens XLA:CPU's compile time; on an accelerator the update stays one program
    # (the configuration measured there). Placement is read from the parameters' devices.
    from artifex.generative_models.training.rl.update import engines

    on_cpu = _trainer(True)
    assert engines.on_cpu(on_cpu.params)
    assert type(on_cpu.compiled_step()).__name__ == "SplitOptimizerEngine"
    monkeypatch.setattr(engines, "on_cpu", lambda params: False)
    elsewhere = _trainer(True)
    assert "not on the CPU" in elsewhere.optimizer_split_reason
    assert type(elsewhere.compiled_step()).__name__ == "OneProgramEngine"
