"""Stacked layer storage (`CausalLM.stack_layers`) against the same model stored per layer.

Stacking changes where the decoder-layer weights live (one `(L, ...)` variable per weight kind)
and nothing else: logits, cached decoding, sampled tokens, gradients (unrolled, rematerialized,
scanned), a GRPO step with its optimizer, LoRA, Hugging Face export and sharding specs must all
be those of the per-layer model, layer `i` of each stack being that layer's weight.
"""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from artifex.generative_models.inference import generate
from artifex.generative_models.models.causal_lm import (
    CausalLM,
    LoRAConfig,
    apply_lora,
    merge_lora,
)
from artifex.generative_models.models.causal_lm.hf_io import place_tensors, to_hf_tensors
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.checkpointing import CheckpointManager
from artifex.generative_models.training.rl import GRPOBatch
from artifex.generative_models.training.sharding import make_mesh, state_partition_specs
from tests.generative_models.models.causal_lm.test_scan_layers import CONFIGS, _ids


def _pair(name: str = "llama", seed: int = 0) -> tuple[CausalLM, CausalLM]:
    """The same model twice: stored per layer, and stacked."""
    per_layer = CausalLM(CONFIGS[name], rngs=nnx.Rngs(seed))
    stacked = CausalLM(CONFIGS[name], rngs=nnx.Rngs(seed)).stack_layers()
    return per_layer, stacked


def _per_layer_view(state: nnx.State, num_layers: int) -> dict[str, np.ndarray]:
    """Flat `{dotted path: array}` of a state, stacked layers written as `layers.i.<name>`."""
    out = {}
    for path, x in nnx.to_flat_state(state):
        x = np.asarray(x.get_value() if isinstance(x, nnx.Variable) else x)
        parts = [str(p) for p in path]
        if parts[0] == "layers" and not parts[1].isdigit():
            for i in range(num_layers):
                out[".".join(["layers", str(i), *parts[1:]])] = x[i]
        else:
            out[".".join(parts)] = x
    return out


def _assert_states_equal(a: nnx.State, b: nnx.State, num_layers: int = 3, **tol) -> None:
    va, vb = _per_layer_view(a, num_layers), _per_layer_view(b, num_layers)
    assert sorted(va) == sorted(vb)
    for key, x in va.items():
        np.testing.assert_allclose(vb[key], x, err_msg=key, **(tol or {"rtol": 0, "atol": 0}))


def test_stack_layers_stores_each_layer_at_its_index_and_unstacks_exactly():
    per_layer, stacked = _pair()
    assert stacked.layers_stacked and not per_layer.layers_stacked
    kernel = stacked.layers.attn.q_proj.kernel
    assert kernel.shape == (3, 128, 128)
    assert kernel.get_metadata().get("stacked_layers") is True
    for i, layer in enumerate(per_layer.layers):
        np.testing.assert_array_equal(kernel[...][i], layer.attn.q_proj.kernel[...])
    _assert_states_equal(nnx.state(per_layer), nnx.state(stacked))
    # the optimizer sees one array per weight kind, not one per layer and kind
    assert len(jax.tree.leaves(nnx.state(stacked, nnx.Param))) < len(
        jax.tree.leaves(nnx.state(per_layer, nnx.Param))
    )
    assert stacked.stack_layers() is stacked  # already stacked: nothing changes
    back = stacked.unstack_layers()
    assert back is stacked and not back.layers_stacked
    assert "stacked_layers" not in back.layers[0].attn.q_proj.kernel.get_metadata()
    for a, b in zip(
        jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(per_layer)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_layer_stack_is_the_stored_arrays_not_a_copy():
    _, stacked = _pair()
    stack = stacked.layer_stack()
    assert stack.state["mlp"]["up_proj"]["kernel"][...] is stacked.layers.mlp.up_proj.kernel[...]


def test_layers_of_different_structure_cannot_be_stacked():
    model = CausalLM(CONFIGS["llama"], rngs=nnx.Rngs(0))
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",)), nnx.Rngs(5))
    model.layers[1].attn.q_proj.lora = None
    with pytest.raises(ValueError, match="differ in structure"):
        model.stack_layers()
    assert not model.layers_stacked


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("scan", [False, True])
def test_logits_and_cached_decoding_equal_per_layer(name, scan):
    ids, mask = _ids()
    per_layer, stacked = _pair(name)
    stacked.scan_layers = scan
    np.testing.assert_allclose(stacked(ids, mask), per_layer(ids, mask), rtol=1e-5, atol=1e-5)
    outs = []
    for model in (per_layer, stacked):
        cache = model.init_cache(2, 10)
        h1, cache = model.hidden_states(ids[:, :5], mask[:, :5], cache=cache)
        h2, cache = model.hidden_states(ids[:, 5:6], mask[:, 5:6], cache=cache)
        outs.append((h1, h2, cache.valid, cache.index))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scan", [False, True])
def test_generate_draws_the_same_tokens(scan):
    ids, mask = _ids(t=5)
    per_layer, stacked = _pair("qwen2_bias_tied")
    stacked.scan_layers = scan
    outs = [
        generate(m, ids, mask, key=jax.random.key(3), num_generations=3, max_new_tokens=6,
                 eos_ids=())
        for m in (per_layer, stacked)
    ]  # fmt: skip
    np.testing.assert_array_equal(outs[0].completion_ids, outs[1].completion_ids)
    np.testing.assert_allclose(outs[0].log_probs, outs[1].log_probs, rtol=1e-5, atol=1e-5)
    assert stacked.layers_stacked  # the sampler slices a traced copy, not the model


def _gradient_loss(remat: bool | int):
    ids, mask = _ids()

    def loss(model):
        h, _ = model.hidden_states(ids, mask, remat=remat)
        return jnp.mean(model.logits_from_hidden(h) ** 2)

    return loss


@pytest.fixture(scope="module")
def per_layer_gradients():
    """The per-layer model's gradients, without rematerialization: it changes what the backward
    pass keeps, not its values, so these are what every stacked run must give. (The program is
    test_scan_layers' unrolled one, found in the compilation cache when that ran first.)"""
    per_layer, _ = _pair("qwen3_qk_norm")
    return nnx.state(jax.jit(nnx.grad(_gradient_loss(False)))(per_layer))


@pytest.mark.parametrize("remat", [False, True, 2])
@pytest.mark.parametrize("scan", [False, True])
def test_gradients_equal_per_layer(remat, scan, per_layer_gradients):
    if scan and remat == 2:
        pytest.skip("a scan rematerializes all its layers or none")
    _, stacked = _pair("qwen3_qk_norm")
    stacked.scan_layers = scan
    got = nnx.state(jax.jit(nnx.grad(_gradient_loss(remat)))(stacked))
    _assert_states_equal(per_layer_gradients, got, rtol=1e-4, atol=1e-7)


def _batch(ids: jax.Array, mask: jax.Array) -> GRPOBatch:
    completion = jnp.asarray(np.random.default_rng(4).integers(1, 512, (4, 6)), jnp.int32)
    return GRPOBatch(
        prompt_ids=jnp.repeat(ids, 2, axis=0),
        prompt_mask=jnp.repeat(mask, 2, axis=0),
        completion_ids=completion,
        completion_mask=jnp.ones((4, 6), jnp.int32),
        rewards=jnp.array([1.0, 0.0, 0.5, 0.25]),
        group_size=2,
    )


def _two_grpo_steps(stacked: bool, options: dict) -> tuple[list[dict], nnx.State]:
    policy, reference = _pair()[int(stacked)], _pair(seed=7)[int(stacked)]
    # SGD: the parameters move by the gradient itself (AdamW's first step is about
    # lr * sign(g), which turns float32 rounding in a gradient of ~1e-8 into a full step).
    optimizer = nnx.Optimizer(policy, optax.sgd(0.1), wrt=nnx.Param)
    config = GRPOConfig(num_generations=2, beta=0.04, **options)
    trainer = GRPOTrainer(policy, optimizer, config, reference_model=reference)
    ids, mask = _ids(b=2, t=5)
    metrics = [trainer.train_step(_batch(ids, mask)) for _ in range(2)]
    assert trainer.num_compilations == 1
    return metrics, nnx.state(policy, nnx.Param)


@pytest.fixture(scope="module")
def per_layer_grpo_steps():
    """The per-layer model's two steps, run plainly: scanning and rematerializing change how
    an update runs, not its values, so this one update is what every stacked run must give
    (one per-layer update compiled, not one per option)."""
    return _two_grpo_steps(stacked=False, options={})


@pytest.mark.parametrize(
    "options", [{"scan_layers": True, "remat": True}, {"remat": True, "remat_every": 2}, {}]
)
def test_grpo_steps_equal_per_layer(options, per_layer_grpo_steps):
    results = [per_layer_grpo_steps, _two_grpo_steps(stacked=True, options=options)]
    for step in range(2):
        for key in ("total_loss", "kl", "grad_norm"):
            np.testing.assert_allclose(
                results[1][0][step][key], results[0][0][step][key], rtol=1e-5, atol=1e-7
            )
    _assert_states_equal(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)


def test_lora_on_stacked_layers_equals_lora_per_layer_and_trains():
    ids, mask = _ids(b=2, t=5)
    models = []
    for per_layer_first in (True, False):
        per_layer, stacked = _pair()
        model = per_layer if per_layer_first else stacked
        apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(5))
        if per_layer_first:
            model.stack_layers()  # adapters per layer, then stacked
        models.append(model)
    a, b = models
    assert b.layers.attn.q_proj.lora.lora_a.shape == (3, 128, 2)
    _assert_states_equal(nnx.state(a), nnx.state(b))
    # nonzero adapters, so they change the output; then merged, still stacked
    lora_b = b.layers.mlp.up_proj.lora.lora_b
    lora_b[...] = jnp.full_like(lora_b[...], 0.01)
    merged = merge_lora(b)
    assert merged.layers_stacked and merged.layers.mlp.up_proj.lora is None
    np.testing.assert_allclose(merged(ids, mask), b(ids, mask), rtol=1e-5, atol=1e-5)
    # the LoRA-only update of the stacked model (reference: the base model, adapters zeroed)
    optimizer = nnx.Optimizer(b, optax.sgd(0.1), wrt=nnx.LoRAParam)
    config = GRPOConfig(num_generations=2, beta=0.04, scan_layers=True)
    trainer = GRPOTrainer(b, optimizer, config)
    before = b.layers.mlp.up_proj.lora.lora_a[...]
    metrics = trainer.train_step(_batch(ids, mask))
    assert metrics["kl"] > 0.0  # the adapters differ from the zeroed reference
    assert not np.array_equal(b.layers.mlp.up_proj.lora.lora_a[...], before)


def test_export_from_stacked_layers_is_the_per_layer_checkpoint():
    per_layer, stacked = _pair("qwen2_bias_tied")
    expected = to_hf_tensors(per_layer)
    got = to_hf_tensors(stacked)
    assert sorted(got) == sorted(expected)
    for name, x in expected.items():
        np.testing.assert_array_equal(got[name], x, err_msg=name)
    ids, mask = _ids()
    with tempfile.TemporaryDirectory() as out:
        stacked.save_pretrained(out)
        on_disk = load_file(os.path.join(out, "model.safetensors"))
        reloaded = CausalLM.from_pretrained(out)
    np.testing.assert_array_equal(
        on_disk["model.layers.2.self_attn.q_proj.weight"],
        expected["model.layers.2.self_attn.q_proj.weight"],
    )
    assert not reloaded.layers_stacked  # checkpoints load per layer; stack_layers() after
    np.testing.assert_allclose(reloaded(ids, mask), per_layer(ids, mask), rtol=0, atol=0)


def test_loading_into_a_stacked_model_is_refused_with_the_way_out():
    _, stacked = _pair()
    with pytest.raises(ValueError, match=r"stacked; load into a model with per-layer storage"):
        place_tensors(stacked, [], source="nothing")


def test_partition_specs_shard_a_stack_as_one_layer():
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    per_layer, stacked = _pair()
    one = state_partition_specs(per_layer, mesh)
    stack = state_partition_specs(stacked, mesh)
    for kind in (("attn", "q_proj", "kernel"), ("mlp", "down_proj", "kernel")):
        layer_spec = one["layers"][0]
        stack_spec = stack["layers"]
        for part in kind:
            layer_spec, stack_spec = layer_spec[part], stack_spec[part]
        assert stack_spec.get_value() == P(None, *layer_spec.get_value()), kind
    assert stack["embed"]["embedding"].get_value() == one["embed"]["embedding"].get_value()


def test_checkpoint_of_a_stacked_trainer_round_trips():
    _, policy = _pair()
    optimizer = nnx.Optimizer(policy, optax.adamw(1e-2), wrt=nnx.Param)
    trainer = GRPOTrainer(policy, optimizer, GRPOConfig(num_generations=2, beta=0.0))

    # One AdamW update, of made-up gradients, changes what a step changes (parameters, moments,
    # step count) without compiling a GRPO step of its own (stacked steps are tested above).
    @nnx.jit
    def update(optimizer, model):
        optimizer.update(model, jax.tree.map(jnp.sin, nnx.state(model, nnx.Param)))

    update(optimizer, policy)
    assert int(optimizer.step[...]) == 1

    def arrays(state):  # what the update changes: parameters, AdamW moments, step
        return [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state, state.step))]

    saved = arrays(trainer.checkpoint_state())
    with tempfile.TemporaryDirectory() as directory:
        manager = CheckpointManager(directory)
        manager.save(1, trainer, {"note": "stacked"})
        manager.close()
        _, fresh = _pair(seed=3)
        fresh_trainer = GRPOTrainer(
            fresh,
            nnx.Optimizer(fresh, optax.adamw(1e-2), wrt=nnx.Param),
            GRPOConfig(num_generations=2, beta=0.0),
        )
        manager = CheckpointManager(directory)
        manager.restore(fresh_trainer)
        manager.close()
    restored = arrays(fresh_trainer.checkpoint_state())
    assert len(restored) == len(saved)
    for a, b in zip(restored, saved, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_sharding_annotation_gets_the_layer_axis_and_keeps_its_type():
    model = CausalLM(CONFIGS["llama"], rngs=nnx.Rngs(0))
    for layer in model.layers:
        layer.attn.q_proj.kernel.set_metadata(out_sharding=P(None, "tensor"))
    graphdef = nnx.graphdef(model)
    model.stack_layers()
    annotation = model.layers.attn.q_proj.kernel.get_metadata()["out_sharding"]
    assert isinstance(annotation, P) and annotation == P(None, None, "tensor")
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    spec = state_partition_specs(model, mesh)["layers"]["attn"]["q_proj"]["kernel"].get_value()
    assert spec == P(None, None, "tensor")
    model.unstack_layers()
    assert model.layers[2].attn.q_proj.kernel.get_metadata()["out_sharding"] == P(None, "tensor")
    assert nnx.graphdef(model) == graphdef  # the same program as before the round trip


def test_an_abstract_model_is_refused_by_name():
    abstract = nnx.eval_shape(lambda: CausalLM(CONFIGS["llama"], rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"stack_layers: the model is abstract"):
        abstract.stack_layers()
    stacked = nnx.eval_shape(lambda: CausalLM(CONFIGS["llama"], rngs=nnx.Rngs(0)).stack_layers())
    assert stacked.layers.attn.q_proj.kernel.shape == (3, 128, 128)  # inside eval_shape: fine
    with pytest.raises(ValueError, match=r"unstack_layers: the model is abstract"):
        stacked.unstack_layers()


def test_an_optimizer_built_before_stacking_is_refused():
    model = CausalLM(CONFIGS["llama"], rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    model.stack_layers()
    with pytest.raises(ValueError, match=r"optimizer was built before model.stack_layers\(\)"):
        GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2, beta=0.0))
    GRPOTrainer(model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param), GRPOConfig())


def test_the_sampler_compiles_one_program_for_either_storage():
    """Unrolled and stored stacked, the layers are sliced before the sampler's program."""
    from artifex.generative_models.inference import sampling

    ids, mask = _ids(t=5)
    per_layer, stacked = _pair("llama", seed=1)
    kw = dict(key=jax.random.key(4), num_generations=2, max_new_tokens=5, eos_ids=())
    first = generate(per_layer, ids, mask, **kw)
    programs = sampling._generate._cache_size()
    second = generate(stacked, ids, mask, **kw)
    assert sampling._generate._cache_size() == programs  # the per-layer program, reused
    np.testing.assert_array_equal(first.completion_ids, second.completion_ids)
    np.testing.assert_allclose(first.log_probs, second.log_probs, rtol=1e-6, atol=1e-6)
    assert stacked.layers_stacked  # the model keeps its storage
    stacked.scan_layers = True  # scanned: the sampler reads the stack itself, a program of its own
    generate(stacked, ids, mask, **kw)
    assert sampling._generate._cache_size() == programs + 1


def test_the_sampler_compiles_one_program_for_either_storage_on_a_mesh():
    """Sharded, the slices carry the stack's partition spec less its layer axis: the per-layer
    model's shardings, so the sampler's program is the per-layer one here too."""
    from artifex.generative_models.inference import sampling
    from artifex.generative_models.training.sharding import shard_model

    mesh = make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4])
    per_layer, stacked = (shard_model(m, mesh) for m in _pair("llama", seed=3))
    ids, mask = _ids(t=5)
    kw = dict(key=jax.random.key(6), num_generations=2, max_new_tokens=4, eos_ids=())
    first = generate(per_layer, ids, mask, **kw)
    programs = sampling._generate._cache_size()
    _, sliced = sampling._per_layer_split(stacked)
    _, reference = nnx.split(per_layer)
    assert [x.sharding for x in jax.tree.leaves(sliced)] == [
        x.sharding for x in jax.tree.leaves(reference)
    ]
    second = generate(stacked, ids, mask, **kw)
    assert sampling._generate._cache_size() == programs
    np.testing.assert_array_equal(first.completion_ids, second.completion_ids)


def test_the_sampler_slices_a_stacked_model_holding_a_python_number():
    ids, mask = _ids(t=5)
    outs = []
    for model in _pair("llama", seed=4):
        model.sampling_hint = nnx.Variable(0.5)  # kept as a plain float by nnx.split
        kw = dict(key=jax.random.key(7), max_new_tokens=3, eos_ids=())
        outs.append(np.asarray(generate(model, ids, mask, **kw).completion_ids))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_multi_turn_rollout_on_stacked_layers_equals_per_layer():
    from artifex.generative_models.inference.multiturn import append_tokens, decode_turn

    outs = []
    for model in _pair("llama", seed=2):
        cache = model.init_cache(2, 40)
        cache, logits = append_tokens(model, cache, [[5, 6, 7], [8, 9]], buckets=(8,))
        out = decode_turn(
            model, cache, logits, np.array([True, True]), key=jax.random.key(5),
            max_new_tokens=4, eos_ids=(),
        )  # fmt: skip
        cache, logits = append_tokens(model, out.cache, [[3], [4, 4]], out.logits, buckets=(8,))
        outs.append((np.asarray(out.tokens), np.asarray(out.log_probs), np.asarray(logits)))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[0][2], outs[1][2], rtol=1e-5, atol=1e-5)
    assert model.layers_stacked
