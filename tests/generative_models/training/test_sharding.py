"""Sharding: meshes, partition rules, placement, batch sharding, the trainer and sampler on a mesh.

Runs on 8 simulated CPU devices (``tests/conftest.py`` sets the XLA flag before JAX loads).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from artifex.generative_models.inference import generate
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig, from_pretrained
from artifex.generative_models.models.causal_lm.lora import LoRAConfig, apply_lora
from artifex.generative_models.training import (
    GRPOBatch,
    GRPOConfig,
    GRPOTrainer,
    PartitionRules,
    is_primary_process,
    make_mesh,
    process_row_range,
    shard_batch,
    shard_model,
    shard_optimizer,
    state_partition_specs,
)

P = PartitionSpec
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]
LM_CONFIG = CausalLMConfig.tiny(
    model_type="qwen2",
    attention_bias=True,
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    eos_token_id=1,
)


def lm_batch(seed: int, b: int = 16, p: int = 4, t: int = 6, g: int = 2) -> GRPOBatch:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    prompt_mask = np.ones((b, p), np.int32)
    prompt_mask[::3, :2] = 0
    return GRPOBatch(
        prompt_ids=jnp.asarray(rng.integers(0, 128, (b, p)), jnp.int32),
        prompt_mask=jnp.asarray(prompt_mask),
        completion_ids=jnp.asarray(rng.integers(0, 128, (b, t)), jnp.int32),
        completion_mask=jnp.asarray((np.arange(t)[None] < lengths[:, None]).astype(np.float32)),
        rewards=jnp.asarray(rng.normal(size=b), jnp.float32),
        old_log_probs=jnp.asarray(-4.85 + 0.1 * rng.normal(size=(b, t)), jnp.float32),
        group_size=g,
    )


def flat(state) -> dict[str, jax.Array]:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {
        ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path[:-1]): x
        for path, x in leaves
    }


def shard_shape(shape, spec, mesh) -> tuple[int, ...]:
    out = []
    for dim, entry in zip(shape, list(spec) + [None] * (len(shape) - len(spec)), strict=True):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        out.append(dim // math.prod(mesh.shape[a] for a in axes))
    return tuple(out)


# The trainer of every training test here but the rollout's: tests that train on a mesh of
# one of ``MESHES`` run the update that ``test_trainer_on_mesh_matches_single_device`` compiled
# for that mesh (a cache hit), not a program of their own.
LM_GRPO = GRPOConfig(num_generations=2, beta=0.05, clip_param=0.2)


def lm_optimizer(model) -> nnx.Optimizer:
    # eps=1e-6: Adam's m / (sqrt(v) + eps) amplifies rounding noise of near-zero gradients
    # (summation order differs across shards) when eps is tiny; this keeps the comparison
    # well-conditioned without hiding real differences.
    return nnx.Optimizer(model, optax.adam(1e-3, eps=1e-6), wrt=nnx.Param)


def lm_trainer(model, reference, mesh=None) -> GRPOTrainer:
    return GRPOTrainer(model, lm_optimizer(model), LM_GRPO, reference_model=reference, mesh=mesh)


def run_trainer(mesh, steps: int = 3):
    model = CausalLM(LM_CONFIG, rngs=nnx.Rngs(0))
    trainer = lm_trainer(model, CausalLM(LM_CONFIG, rngs=nnx.Rngs(1)), mesh)
    metrics = [trainer.train_step(lm_batch(i)) for i in range(steps)]
    return trainer, metrics


@pytest.fixture(scope="module")
def single_device_run():
    trainer, metrics = run_trainer(None)
    params = {k: np.asarray(v) for k, v in flat(nnx.state(trainer.model)).items()}
    opt = {k: np.asarray(v) for k, v in flat(nnx.state(trainer.optimizer)).items()}
    return metrics, params, opt


# ------------------------------------------------------------------ mesh
def test_eight_simulated_devices():
    assert jax.device_count() == 8


def test_make_mesh_axes_and_default():
    mesh = make_mesh()
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert dict(make_mesh(fsdp=4).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert dict(make_mesh(2, 2, 2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    small = make_mesh(data=1, fsdp=2, devices=jax.devices()[:2])
    assert small.size == 2


def test_make_mesh_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"2 \* 2 \* 1 = 4 must equal the number of devices, 8"):
        make_mesh(data=2, fsdp=2)
    with pytest.raises(ValueError, match="does not divide the 8 devices"):
        make_mesh(fsdp=3)
    with pytest.raises(ValueError, match="make_mesh: tensor must be an int >= 1, got 0"):
        make_mesh(tensor=0)
    with pytest.raises(TypeError, match=re.escape("make_mesh: fsdp must be an int, got 2.0")):
        make_mesh(fsdp=2.0)


def test_explicit_axes_mesh_is_an_error():
    explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    model = CausalLM(LM_CONFIG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"mesh axis 'data' is .*Explicit.*AxisType\.Auto"):
        shard_model(model, explicit)
    with pytest.raises(ValueError, match=r"AxisType\.Auto"):
        shard_batch(lm_batch(0), explicit)
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        GRPOTrainer(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), mesh="data")


def test_is_primary_process():
    assert is_primary_process() is True


# ------------------------------------------------------------------ rules
def test_causal_lm_rules_megatron_and_fsdp():
    mesh = make_mesh(2, 2, 2)
    specs = flat(state_partition_specs(CausalLM(LM_CONFIG, rngs=nnx.Rngs(0)), mesh))
    expected = {
        # column-parallel (out over tensor) + FSDP on the largest free dim (>= 1024 elements)
        "layers.0.attn.q_proj.kernel": P("fsdp", "tensor"),
        "layers.0.mlp.up_proj.kernel": P("fsdp", "tensor"),
        "layers.0.attn.q_proj.bias": P("tensor"),
        # k_proj (32, 16) has 512 elements: tensor only
        "layers.0.attn.k_proj.kernel": P(None, "tensor"),
        # row-parallel (in over tensor)
        "layers.0.attn.o_proj.kernel": P("tensor", "fsdp"),
        "layers.1.mlp.down_proj.kernel": P("tensor", "fsdp"),
        # vocabulary-parallel embedding and head
        "embed.embedding": P("tensor", "fsdp"),
        "lm_head.kernel": P("fsdp", "tensor"),
        # small: replicated
        "final_norm.scale": P(None),
        "layers.1.mlp_norm.scale": P(None),
    }
    for path, spec in expected.items():
        assert specs[path] == spec, path


def test_fsdp_only_mesh_shards_largest_dim():
    mesh = make_mesh(data=2, fsdp=4)
    rules = PartitionRules()
    assert rules.spec("embed.embedding", (128, 32), mesh) == P("fsdp", None)
    assert rules.spec("lm_head.kernel", (32, 128), mesh) == P(None, "fsdp")
    assert rules.spec("layers.0.mlp.down_proj.kernel", (64, 32), mesh) == P("fsdp", None)
    assert rules.spec("layers.0.attn_norm.scale", (32,), mesh) == P(None)
    assert PartitionRules(fsdp_axis=None).spec("lm_head.kernel", (32, 128), mesh) == P(None, None)


def test_non_dividing_axis_falls_back_to_replication():
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    rules = PartitionRules()
    # 6 output features over tensor=4: that dim is replicated; FSDP still takes the 64 rows.
    assert rules.spec("layers.0.attn.q_proj.kernel", (64, 6), mesh) == P(None, None)
    assert rules.spec("layers.0.attn.q_proj.kernel", (64, 24), mesh) == P("fsdp", "tensor")
    # vocabulary of 50 over tensor=4: replicated vocab; FSDP moves to the hidden dim.
    assert rules.spec("embed.embedding", (50, 64), mesh) == P(None, "fsdp")
    # nothing divides: fully replicated, no error
    assert rules.spec("embed.embedding", (51, 33), mesh) == P(None, None)


def test_rules_naming_unknown_axes_are_errors():
    mesh = make_mesh(2, 2, 2)
    bad = PartitionRules(rules=((r"kernel$", P(None, "model")),))
    with pytest.raises(ValueError, match="'model'"):
        bad.bind(mesh)
    with pytest.raises(ValueError, match="'model'"):
        state_partition_specs(CausalLM(LM_CONFIG, rngs=nnx.Rngs(0)), mesh, bad)
    with pytest.raises(ValueError, match="'expert'"):
        PartitionRules(fsdp_axis="expert").bind(mesh)
    model = CausalLM(LM_CONFIG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="'model'"):
        GRPOTrainer(
            model,
            nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
            mesh=mesh,
            partition_rules=[(r"kernel$", P("model"))],
        )
    with pytest.raises(ValueError, match="invalid regular expression"):
        PartitionRules(rules=(("(", P()),))
    with pytest.raises(ValueError, match="has 3 entries"):
        PartitionRules(rules=((r"scale$", P(None, None, "tensor")),)).spec(
            "final_norm.scale", (32,), mesh
        )


def test_partition_rules_bind_is_the_from_pretrained_hook():
    mesh = make_mesh(2, 2, 2)
    model = from_pretrained(FIXTURES / "llama3_tiny", mesh=mesh, rules=PartitionRules().bind(mesh))
    rules = PartitionRules()
    for path, x in flat(nnx.state(model)).items():
        assert x.sharding.spec == rules.spec(path, x.shape, mesh), path
    q = model.layers[0].attn.q_proj.kernel[...]
    assert "tensor" in q.sharding.spec


def test_nnx_annotations_take_precedence():
    class Annotated(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tensor"))
            self.a = nnx.Linear(64, 48, kernel_init=init, rngs=rngs)
            self.b = nnx.Linear(48, 64, rngs=rngs)

    mesh = make_mesh(2, 2, 2)
    with jax.set_mesh(mesh):  # Flax shards annotated variables eagerly under a mesh
        module = Annotated(nnx.Rngs(0))
    shard_model(module, mesh)
    assert module.a.kernel[...].sharding.spec == P(None, "tensor")  # as annotated, no FSDP
    assert module.b.kernel[...].sharding.spec == P(None, "fsdp")  # rules: FSDP on dim 64

    class Unknown(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model", None))
            self.a = nnx.Linear(8, 8, kernel_init=init, rngs=rngs)

    other = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(other):
        module = Unknown(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"annotation of 'a\.kernel' names mesh axis 'model'"):
        state_partition_specs(module, mesh)


def test_lora_adapters_follow_their_projection():
    mesh = make_mesh(2, 2, 2)
    model = apply_lora(
        CausalLM(LM_CONFIG, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, alpha=8), nnx.Rngs(1)
    )
    specs = flat(state_partition_specs(model, mesh))
    assert specs["layers.0.attn.q_proj.lora.lora_b"] == P(None, "tensor")  # (r, out)
    assert specs["layers.0.attn.q_proj.lora.lora_a"] == P(None, None)  # (in, r), small
    assert specs["layers.0.mlp.down_proj.lora.lora_a"] == P("tensor", None)  # (in, r)
    assert specs["layers.0.mlp.down_proj.lora.lora_b"] == P(None, None)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)
    shard_model(model, mesh)
    shard_optimizer(optimizer, model, mesh)
    opt = flat(nnx.state(optimizer))
    assert opt["opt_state.0.mu.layers.0.attn.q_proj.lora.lora_b"].sharding.spec == P(None, "tensor")
    assert opt["opt_state.0.nu.layers.1.mlp.down_proj.lora.lora_a"].sharding.spec == P(
        "tensor", None
    )


# ------------------------------------------------------------------ batches
def test_shard_batch_keeps_each_group_on_one_shard():
    mesh = make_mesh(2, 4, 1)
    batch = lm_batch(0)  # 16 rows, 8 groups of 2, 8 data shards
    sharded = shard_batch(batch, mesh)
    assert sharded.group_size == 2
    rewards = np.asarray(batch.rewards)
    for leaf in jax.tree.leaves(sharded):
        assert leaf.sharding.spec == P(("data", "fsdp"))
    for shard in sharded.rewards.addressable_shards:
        rows = shard.index[0]
        assert rows.stop - rows.start == 2 and rows.start % 2 == 0  # exactly one group
        np.testing.assert_array_equal(np.asarray(shard.data), rewards[rows])
    np.testing.assert_array_equal(np.asarray(sharded.completion_ids), batch.completion_ids)
    # (2, 2, 2): 4 data shards, 2 whole groups each; tensor replicas hold the same rows.
    sharded = shard_batch(batch, make_mesh(2, 2, 2))
    assert {s.index[0].stop - s.index[0].start for s in sharded.rewards.addressable_shards} == {4}
    # already sharded: returned as is
    again = shard_batch(sharded, make_mesh(2, 2, 2))
    assert again.rewards is sharded.rewards


def test_rows_not_divisible_over_data_shards_is_an_error():
    mesh = make_mesh()
    batch = lm_batch(0, b=12, g=2)
    with pytest.raises(ValueError, match=r"12 rows cannot be split evenly over 8 data shards"):
        shard_batch(batch, mesh)
    with pytest.raises(ValueError, match=r"multiple of 4 groups of 2"):
        shard_batch(batch, mesh)
    model = CausalLM(LM_CONFIG, rngs=nnx.Rngs(0))
    trainer = GRPOTrainer(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), mesh=mesh)
    with pytest.raises(ValueError, match=r"12 rows .* 8 data shards"):
        trainer.train_step(batch)
    assert trainer.num_compilations == 0
    with pytest.raises(ValueError, match=r"6 rows .* 8 data shards"):
        shard_batch(jnp.zeros((6, 3)), mesh)


def test_process_local_batch_in_one_process_is_the_global_batch():
    mesh = make_mesh(2, 4, 1)
    batch = lm_batch(1)
    assert process_row_range(batch.batch_size, mesh) == (0, 16)
    start, stop = process_row_range(batch.batch_size, mesh)
    local = jax.tree.map(lambda x: np.asarray(x)[start:stop], batch)
    sharded = shard_batch(local, mesh, process_local=True)
    direct = shard_batch(batch, mesh)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(direct), strict=True):
        assert a.shape == b.shape and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="10 rows cannot be split evenly over 8 data shards"):
        process_row_range(10, mesh)


# ------------------------------------------------------------------ trainer on a mesh
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_trainer_on_mesh_matches_single_device(shape, single_device_run):
    base_metrics, base_params, base_opt = single_device_run
    mesh = make_mesh(*shape)
    trainer, metrics = run_trainer(mesh)
    assert trainer.mesh is mesh
    assert trainer.num_compilations == 1
    for step, (got, want) in enumerate(zip(metrics, base_metrics, strict=True)):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(
                got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=f"step {step}: {key}"
            )
    assert base_metrics[-1]["kl"] > 0  # the reference path ran

    # Parameters: same values, and still in the intended layout after the (donating) steps.
    specs = flat(state_partition_specs(trainer.model, mesh))
    params = flat(nnx.state(trainer.model))
    split = 0
    for path, x in params.items():
        np.testing.assert_allclose(np.asarray(x), base_params[path], atol=1e-5, err_msg=path)
        assert x.sharding.mesh == mesh and x.sharding.spec == specs[path], path
        want_shape = shard_shape(x.shape, specs[path], mesh)
        assert len(x.addressable_shards) == 8
        assert all(s.data.shape == want_shape for s in x.addressable_shards), path
        split += want_shape != x.shape
    if shape != (8, 1, 1):
        assert split >= 10  # big kernels really are split
        q = params["layers.0.attn.q_proj.kernel"]
        assert "fsdp" in q.sharding.spec
        assert q.addressable_shards[0].data.size == q.size // (shape[1] * shape[2])
    # Optimizer state follows its parameters; scalars are replicated.
    opt = flat(nnx.state(trainer.optimizer))
    for path, x in opt.items():
        np.testing.assert_allclose(np.asarray(x), base_opt[path], atol=1e-5, err_msg=path)
        if path.startswith(("opt_state.0.mu.", "opt_state.0.nu.")):
            param_path = path.split(".", 3)[3]
            assert x.sharding.spec == specs[param_path], path
            assert x.addressable_shards[0].data.shape == shard_shape(
                x.shape, specs[param_path], mesh
            )
        else:
            assert x.ndim == 0 and x.sharding.is_fully_replicated, path
    # The reference model is placed by the same rules.
    for path, x in flat(nnx.state(trainer.reference_model)).items():
        assert x.sharding.spec == specs[path], path


def test_trainer_uses_the_mesh_set_with_jax_set_mesh():
    mesh = make_mesh(data=2, fsdp=4)
    model = CausalLM(LM_CONFIG, rngs=nnx.Rngs(0))
    reference = CausalLM(LM_CONFIG, rngs=nnx.Rngs(1))
    optimizer = lm_optimizer(model)
    with jax.set_mesh(mesh):  # the 2x4x1 mesh test's trainer, so its compiled update
        trainer = GRPOTrainer(model, optimizer, LM_GRPO, reference_model=reference)
    assert trainer.mesh is mesh
    before = model.lm_head.kernel[...]
    metrics = trainer.train_step(lm_batch(0))
    assert np.isfinite(metrics["total_loss"])
    assert before.is_deleted()  # donated: the update reused the sharded buffers
    assert model.lm_head.kernel[...].sharding.spec == P(None, "fsdp")
    with pytest.raises(TypeError, match="partition_rules were given without a mesh"):
        GRPOTrainer(model, optimizer, partition_rules=PartitionRules())


# ------------------------------------------------------------------ sampler on a mesh
def test_generate_on_mesh_matches_unsharded_greedy():
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 128, (8, 5)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[::2, :2] = 0
    kwargs = dict(
        key=jax.random.key(0),
        num_generations=2,
        max_new_tokens=6,
        temperature=0.0,
        prompt_buckets=None,
    )
    want = generate(CausalLM(LM_CONFIG, rngs=nnx.Rngs(0)), ids, mask, **kwargs)
    mesh = make_mesh(2, 2, 2)
    model = shard_model(CausalLM(LM_CONFIG, rngs=nnx.Rngs(0)), mesh)
    prompt_ids, prompt_mask = shard_batch((jnp.asarray(ids), jnp.asarray(mask)), mesh)
    got = generate(model, prompt_ids, prompt_mask, **kwargs)
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_array_equal(got.completion_mask, want.completion_mask)
    np.testing.assert_allclose(got.log_probs, want.log_probs, atol=1e-5)
    assert model.layers[0].attn.q_proj.kernel[...].sharding.spec == P("fsdp", "tensor")
    # The generation ran data-parallel: its outputs are split over the data axes, not copied.
    shard_rows = {s.data.shape[0] for s in got.completion_ids.addressable_shards}
    assert shard_rows == {got.completion_ids.shape[0] // 4}, shard_rows


def test_host_array_returns_the_full_value_of_a_sharded_array():
    from artifex.generative_models.training import host_array

    mesh = make_mesh(8)
    x = jnp.arange(64.0).reshape(16, 4)
    sharded = shard_batch(x, mesh)
    assert len(sharded.addressable_shards) == 8
    np.testing.assert_array_equal(host_array(sharded), np.asarray(x))
    np.testing.assert_array_equal(host_array(np.ones(3)), np.ones(3))


def test_cloned_reference_on_a_mesh_keeps_its_own_buffers():
    mesh = make_mesh(8)
    model = CausalLM(LM_CONFIG, rngs=nnx.Rngs(0))
    ref = nnx.clone(model)  # shares arrays with the policy
    trainer = lm_trainer(model, ref, mesh)  # the 8x1x1 mesh test's trainer and program
    batch = lm_batch(0)
    first = trainer.train_step(batch)
    second = trainer.train_step(batch)
    assert first["kl"] == 0.0 and second["kl"] > 0.0


def test_rollout_on_a_mesh_generates_data_parallel():
    from artifex.demos.addition import demo_model, demo_tokenizer
    from artifex.generative_models.training.rl import RewardCombiner, RolloutConfig, rollout

    tok = demo_tokenizer()
    # One layer: where the rows are generated and trained does not depend on the depth.
    config = nnx.eval_shape(lambda: demo_model(tok)).config.replace(num_layers=1)
    model = CausalLM(config, rngs=nnx.Rngs(0))
    trainer = GRPOTrainer(
        model,
        nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
        GRPOConfig(num_generations=2, beta=0.0),
        mesh=make_mesh(8),
    )
    rows = [{"prompt": f"{i}+{i}="} for i in range(8)]
    ro = rollout(
        trainer,
        tok,
        rows,
        RewardCombiner([lambda p, c, **k: [1.0] * len(c)]),
        RolloutConfig(max_new_tokens=3),
        key=jax.random.key(0),
    )
    ids = ro.batch.completion_ids
    assert {s.data.shape[0] for s in ids.addressable_shards} == {ids.shape[0] // 8}
    assert trainer.train_step(ro.batch)["completion_length"] > 0
