"""Expert parallelism of Qwen3-MoE on 8 simulated devices, against one device.

The experts of `qwen3_moe_tiny` (8 per layer) are split over an `"expert"` mesh axis
(`make_mesh(expert=n)`, `MOE_RULES`), alone and together with data, FSDP and tensor parallelism;
the logits, the router traces, the gradients, a GRPO update and greedy decoding equal those of one
device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from artifex.generative_models.inference.sampling import generate
from artifex.generative_models.models.causal_lm import from_pretrained
from artifex.generative_models.models.causal_lm.moe import EXPERT_AXIS
from artifex.generative_models.training import GRPOConfig, GRPOTrainer, make_mesh
from artifex.generative_models.training.rl import GRPOBatch
from artifex.generative_models.training.sharding import (
    CAUSAL_LM_RULES,
    MOE_RULES,
    PartitionRules,
    shard_model,
)

from ._helpers import FIXTURES, load_expected

NAME = "qwen3_moe_tiny"
RULES = PartitionRules(rules=MOE_RULES + CAUSAL_LM_RULES, fsdp_min_size=256)

#: (data, fsdp, expert, tensor) on 8 devices.
MESHES = [(1, 1, 8, 1), (2, 1, 4, 1), (1, 2, 2, 2), (2, 1, 2, 2)]


def _mesh(shape):
    data, fsdp, expert, tensor = shape
    return make_mesh(data=data, fsdp=fsdp, expert=expert, tensor=tensor)


def _inputs():
    e = load_expected(NAME)
    ids = np.concatenate([e["input_ids"], e["input_ids"][:1]])  # 4 rows: divisible by 2 and 4
    mask = np.concatenate([e["attention_mask"], e["attention_mask"][:1]])
    return jnp.asarray(ids), jnp.asarray(mask)


def _loss(model, ids, mask):
    hidden, _, trace = model.hidden_states(ids, mask, routing=True)
    logits = model.logits_from_hidden(hidden)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return -jnp.sum(picked * mask[:, 1:]), (logits, trace)


@nnx.jit
def _forward_and_grads(model, ids, mask):
    (_, (logits, trace)), grads = nnx.value_and_grad(_loss, has_aux=True)(model, ids, mask)
    return logits, trace, grads


@pytest.fixture(scope="module")
def reference():
    model = from_pretrained(FIXTURES / NAME)
    logits, trace, grads = _forward_and_grads(model, *_inputs())
    return np.asarray(logits), jax.tree.map(np.asarray, trace), jax.tree.map(np.asarray, grads)


def test_make_mesh_with_an_expert_axis_and_the_rules():
    mesh = _mesh((1, 2, 2, 2))
    assert mesh.axis_names == ("data", "fsdp", EXPERT_AXIS, "tensor")
    rules = RULES.bind(mesh)
    assert rules("layers.0.mlp.experts.gate_proj", (8, 32, 16)) == P("expert", "fsdp", "tensor")
    assert rules("layers.0.mlp.experts.down_proj", (8, 16, 32)) == P("expert", "tensor", "fsdp")
    assert rules("layers.0.mlp.gate.kernel", (32, 8)) == P("fsdp", None)
    with pytest.raises(ValueError, match="expert \\* tensor = 1 \\* 3 \\* 2 = 6 does not divide"):
        make_mesh(fsdp=1, expert=3, tensor=2)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "d{}f{}e{}t{}".format(*s))
def test_expert_parallel_equals_one_device(shape, reference):
    want_logits, want_trace, want_grads = reference
    mesh = _mesh(shape)
    model = shard_model(from_pretrained(FIXTURES / NAME), mesh, RULES)
    experts = model.layers[0].mlp.experts.gate_proj[...]
    # each device holds E / n experts (and its share of FSDP and tensor)
    assert experts.sharding.spec[0] == "expert"
    assert experts.addressable_shards[0].data.shape[0] == 8 // shape[2]
    ids, mask = _inputs()
    lowered = _forward_and_grads.lower(model, ids, mask).as_text()
    assert "manual_computation" in lowered or "SPMDFullToShardShape" in lowered  # shard_map ran
    logits, trace, grads = _forward_and_grads(model, ids, mask)
    real = np.asarray(mask).astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[real], want_logits[real], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(trace.experts), want_trace.experts)
    np.testing.assert_allclose(np.asarray(trace.load), want_trace.load)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-4)


def test_the_ragged_expert_path_on_a_mesh_equals_one_device(monkeypatch):
    # On the CPU the experts run densely (moe_dispatch._dense_dispatch); the ragged batches,
    # what other backends run, are forced here, under shard_map on a mesh with expert, FSDP
    # and tensor axes, against the dense computation on one device (values and gradients).
    # Each call is a new function, traced anew (no program of the dense path is reused).
    from artifex.generative_models.models.causal_lm import moe, moe_dispatch

    traced = []
    ragged = moe_dispatch._ragged_dispatch

    def spy(*args, **kwargs):
        traced.append(1)
        return ragged(*args, **kwargs)

    model = shard_model(from_pretrained(FIXTURES / NAME), _mesh((1, 2, 2, 2)), RULES)
    mlp = model.layers[0].mlp.experts
    weights = (mlp.gate_proj[...], mlp.up_proj[...], mlp.down_proj[...])
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (16, weights[0].shape[1]))
    experts, gates, _, _ = moe.route_tokens(jax.random.normal(keys[1], (16, 8)), 2)

    def value_and_grads(x, gate, up, down):
        def loss(x, gate, up, down):
            return jnp.sum(jnp.sin(moe.expert_mlp(x, experts, gates, gate, up, down)))

        y = moe.expert_mlp(x, experts, gates, gate, up, down)
        return y, jax.grad(loss, argnums=(0, 1, 2, 3))(x, gate, up, down)

    local = tuple(np.asarray(w) for w in weights)  # one device
    want = jax.jit(lambda *a: value_and_grads(*a))(np.asarray(x), *local)
    monkeypatch.setattr(moe_dispatch, "_use_dense", lambda x, gate: False)
    monkeypatch.setattr(moe_dispatch, "_ragged_dispatch", spy)
    on_mesh = jax.jit(lambda *a: value_and_grads(*a))
    lowered = on_mesh.lower(x, *weights).as_text()
    assert "manual_computation" in lowered or "SPMDFullToShardShape" in lowered  # shard_map ran
    got = on_mesh(x, *weights)
    assert traced  # the ragged path ran
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4)


def _batch(model, g=2):
    e = load_expected(NAME)
    out = generate(
        model,
        e["input_ids"][:2],
        e["attention_mask"][:2],
        key=jax.random.key(0),
        num_generations=g,
        max_new_tokens=5,
        eos_ids=(),
    )
    return GRPOBatch(
        prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask,
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        rewards=jnp.array([1.0, 0.0, 0.5, 0.0]),
        group_size=g,
    )


def _update(mesh):
    model = from_pretrained(FIXTURES / NAME)
    # SGD: the step is the gradient (Adam's first step is about lr * sign(g), which turns
    # float rounding of near-zero gradient entries into differences of lr)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    kwargs = {} if mesh is None else {"mesh": mesh, "partition_rules": RULES}
    trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2, beta=0.0), **kwargs)
    batch = _batch(from_pretrained(FIXTURES / NAME))
    metrics = trainer.train_step(batch)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return metrics, params


def test_grpo_update_on_an_expert_parallel_mesh_equals_one_device():
    want_metrics, want = _update(None)
    got_metrics, got = _update(_mesh((1, 1, 4, 2)))
    for key in ("policy_loss", "grad_norm", "entropy"):
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=1e-5, atol=1e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_greedy_decoding_on_an_expert_parallel_mesh():
    e = load_expected(NAME)
    model = shard_model(from_pretrained(FIXTURES / NAME), _mesh((1, 1, 8, 1)), RULES)
    steps = e["generate_ids"].shape[1]
    out = generate(
        model,
        e["input_ids"],
        e["attention_mask"],
        key=jax.random.key(0),
        max_new_tokens=steps,
        temperature=0.0,
        eos_ids=(),
    )
    np.testing.assert_array_equal(np.asarray(out.completion_ids), e["generate_ids"])
