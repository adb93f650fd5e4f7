"""Per-expert LoRA adapters on the stacked experts of Qwen3-MoE (`lora_experts`).

The adapted expert MLP against an independent float64 NumPy computation (values and the
gradients of A and B, hand-derived) on both dispatch paths; fresh adapters change nothing,
exactly; merging equals the adapted model; stacked, scanned and rematerialized layers; a GRPO
update that moves the adapters only; 8 simulated devices with the experts split over an
`"expert"` axis against one device.
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
from artifex.generative_models.models.causal_lm import (
    LoRAConfig,
    apply_lora,
    from_pretrained,
    lora_state,
    merge_lora,
    moe_dispatch,
    zero_lora_state,
)
from artifex.generative_models.models.causal_lm.lora_experts import ExpertLoRAAdapter
from artifex.generative_models.models.causal_lm.moe import expert_mlp, route_tokens
from artifex.generative_models.models.causal_lm.moe_dispatch import ExpertDelta
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
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
RULES = PartitionRules(rules=MOE_RULES + CAUSAL_LM_RULES, fsdp_min_size=256)


def _inputs():
    e = load_expected(NAME)
    return jnp.asarray(e["input_ids"]), jnp.asarray(e["attention_mask"])


def _use_path(monkeypatch, path):
    monkeypatch.setattr(moe_dispatch, "_use_dense", lambda x, gate: path == "dense")


def _randomize_adapters(model, seed=3, std=0.3):
    """Sets every adapter array to random values (B nonzero), as after training."""
    state = lora_state(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, new))


# --------------------------------------------------------------------------- float64 reference
def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _reference(x, experts, weights, w, lora, scale, cot):
    """Float64 values and gradients of `sum(cot * y)` for the MoE MLP with low-rank updates.

    `y_n = sum_j g_nj o_e(x_n)`, `o_e(u) = (silu(p_g) * p_u) W_d + s (h A_d) B_d` with each
    projection `p = u W_e + s (u A_e) B_e`; the gradients of A and B by the chain rule.
    """
    x = x.astype(np.float64)
    w = {k: v.astype(np.float64) for k, v in w.items()}
    lora = {k: (a.astype(np.float64), b.astype(np.float64)) for k, (a, b) in lora.items()}
    y = np.zeros_like(x)
    grads = {k: (np.zeros_like(a), np.zeros_like(b)) for k, (a, b) in lora.items()}

    def project(name, u, e):
        out = u @ w[name][e]
        if name in lora:
            a, b = lora[name]
            out = out + scale * (u @ a[e]) @ b[e]
        return out

    def back(name, u, e, d_out):  # accumulates dA, dB; returns d u
        du = d_out @ w[name][e].T
        if name in lora:
            a, b = lora[name]
            da, db = grads[name]
            db[e] += scale * np.outer(u @ a[e], d_out)
            da[e] += scale * np.outer(u, d_out @ b[e].T)
            du = du + scale * (d_out @ b[e].T) @ a[e].T
        return du

    for n in range(x.shape[0]):
        for j, e in enumerate(experts[n]):
            u = x[n]
            g, p = project("gate_proj", u, e), project("up_proj", u, e)
            sig = _sigmoid(g)
            act = g * sig
            h = act * p
            y[n] += weights[n, j] * project("down_proj", h, e)
            dh = back("down_proj", h, e, weights[n, j] * cot[n])
            dg = dh * p * sig * (1.0 + g * (1.0 - sig))
            back("gate_proj", u, e, dg)
            back("up_proj", u, e, dh * act)
    return y, grads


def _problem(seed, targets, n=12, d=8, i=6, e=4, k=2, r=3):
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    x = jax.random.normal(next(keys), (n, d))
    w = {
        "gate_proj": jax.random.normal(next(keys), (e, d, i)) / np.sqrt(d),
        "up_proj": jax.random.normal(next(keys), (e, d, i)) / np.sqrt(d),
        "down_proj": jax.random.normal(next(keys), (e, i, d)) / np.sqrt(i),
    }
    lora = {}
    for name in targets:
        _, n_in, n_out = w[name].shape
        a = jax.random.normal(next(keys), (e, n_in, r)) / np.sqrt(n_in)
        lora[name] = (a, 0.5 * jax.random.normal(next(keys), (e, r, n_out)))
    experts, weights, _, _ = route_tokens(jax.random.normal(next(keys), (n, e)), k)
    cot = jax.random.normal(next(keys), (n, d))
    return x, experts, weights, w, lora, cot


@pytest.mark.parametrize("path", ["dense", "ragged"])
@pytest.mark.parametrize("targets", [PROJECTIONS, ("up_proj", "down_proj")], ids=["all", "up+down"])
@pytest.mark.parametrize("seed", [0, 1])
def test_adapted_experts_match_float64_numpy(path, targets, seed, monkeypatch):
    _use_path(monkeypatch, path)
    scale = 1.5
    x, experts, weights, w, lora, cot = _problem(seed, targets)

    def loss(lora):
        deltas = {name: ExpertDelta(a=a, b=b, scale=scale) for name, (a, b) in lora.items()}
        y = expert_mlp(x, experts, weights, *(w[p] for p in PROJECTIONS), deltas=deltas)
        return jnp.sum(y * cot), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(lora)
    np_lora = {name: tuple(np.asarray(t) for t in ab) for name, ab in lora.items()}
    want_y, want_grads = _reference(
        np.asarray(x), np.asarray(experts), np.asarray(weights),
        {p: np.asarray(v) for p, v in w.items()}, np_lora, scale, np.asarray(cot),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-5)
    assert set(grads) == set(targets)
    for name in targets:
        for got, want in zip(grads[name], want_grads[name], strict=True):
            assert np.abs(want).max() > 1e-3  # a gradient that matters
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", ["dense", "ragged"])
def test_fresh_expert_adapters_leave_the_model_exactly_unchanged(path, monkeypatch):
    _use_path(monkeypatch, path)
    ids, mask = _inputs()
    model = from_pretrained(FIXTURES / NAME)
    base = np.asarray(model(ids, mask))
    apply_lora(model, LoRAConfig(rank=3, alpha=6.0), nnx.Rngs(1))  # every target, experts too
    experts = model.layers[0].mlp.experts
    adapters = experts.lora.adapters()
    assert set(adapters) == set(PROJECTIONS)
    assert model.layers[0].attn.q_proj.lora is not None  # attention keeps LoRAAdapter
    for name, adapter in adapters.items():
        e, n_in, n_out = getattr(experts, name).shape
        assert isinstance(adapter, ExpertLoRAAdapter) and adapter.scale == 2.0
        a, b = np.asarray(adapter.lora_a[...]), np.asarray(adapter.lora_b[...])
        assert a.shape == (e, n_in, 3) and b.shape == (e, 3, n_out)
        assert isinstance(adapter.lora_a, nnx.LoRAParam) and not b.any()
        assert np.abs(a).max() <= 1.0 / np.sqrt(n_in) and not np.allclose(a[0], a[1])
    np.testing.assert_array_equal(np.asarray(model(ids, mask)), base)  # B = 0: exactly
    _randomize_adapters(model)
    assert np.abs(np.asarray(model(ids, mask)) - base).max() > 1e-3
    nnx.update(model, zero_lora_state(lora_state(model)))  # the trainer's reference policy
    np.testing.assert_array_equal(np.asarray(model(ids, mask)), base)


def test_rslora_scale_and_only_the_named_expert_projections():
    model = from_pretrained(FIXTURES / NAME)
    config = LoRAConfig(rank=4, alpha=8.0, use_rslora=True, target_modules=("q_proj", "up_proj"))
    apply_lora(model, config, nnx.Rngs(0))
    lora = model.layers[1].mlp.experts.lora
    assert lora.gate_proj is None and lora.down_proj is None
    assert lora.up_proj.scale == pytest.approx(8.0 / 2.0)
    assert model.layers[0].attn.k_proj.lora is None
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, config, nnx.Rngs(0))


def test_merge_equals_the_adapted_model():
    ids, mask = _inputs()
    model = apply_lora(from_pretrained(FIXTURES / NAME), LoRAConfig(rank=2, alpha=4.0),
                       nnx.Rngs(1))  # fmt: skip
    _randomize_adapters(model)
    adapted = np.asarray(model(ids, mask))
    merged = merge_lora(model)
    assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(merged))
    assert model.layers[0].mlp.experts.lora is not None  # the input keeps its adapters
    np.testing.assert_allclose(np.asarray(merged(ids, mask)), adapted, atol=1e-5, rtol=1e-5)
    for i, layer in enumerate(model.layers):  # W_e + s A_e B_e, in float64
        for name, adapter in layer.mlp.experts.lora.adapters().items():
            a = np.asarray(adapter.lora_a[...], np.float64)
            b = np.asarray(adapter.lora_b[...], np.float64)
            want = np.asarray(getattr(layer.mlp.experts, name)[...], np.float64)
            want = want + adapter.scale * np.einsum("eir,ero->eio", a, b)
            got = np.asarray(getattr(merged.layers[i].mlp.experts, name)[...])
            np.testing.assert_allclose(got, want, atol=1e-6)
    stacked = merge_lora(nnx.clone(model).stack_layers())
    assert stacked.layers_stacked
    np.testing.assert_allclose(np.asarray(stacked(ids, mask)), adapted, atol=1e-5, rtol=1e-5)


def _loss(model, ids, mask):
    hidden, _ = model.hidden_states(ids, mask)
    logits = model.logits_from_hidden(hidden)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return -jnp.sum(picked * mask[:, 1:]), logits


@nnx.jit
def _logits_and_lora_grads(model, ids, mask):
    grad_fn = nnx.value_and_grad(_loss, has_aux=True, argnums=nnx.DiffState(0, nnx.LoRAParam))
    (_, logits), grads = grad_fn(model, ids, mask)
    return logits, grads


def _flat_grads(grads, stacked):
    """{(layer, path): array} of per-layer adapter gradients (stacked ones split by layer)."""
    out = {}
    for path, x in nnx.to_flat_state(grads):
        x = np.asarray(x.get_value() if isinstance(x, nnx.Variable) else x)
        if stacked:
            for i in range(x.shape[0]):
                out[(i, *path[1:])] = x[i]
        else:
            out[(int(path[1]), *path[2:])] = x
    return out


def test_stacked_scanned_and_rematerialized_layers_agree():
    ids, mask = _inputs()
    config = LoRAConfig(rank=2, alpha=4.0)
    model = apply_lora(from_pretrained(FIXTURES / NAME), config, nnx.Rngs(1))
    stacked = apply_lora(from_pretrained(FIXTURES / NAME).stack_layers(), config, nnx.Rngs(1))
    assert stacked.layers.mlp.experts.lora.down_proj.lora_a.shape == (2, 8, 16, 2)  # (L, E, I, r)
    same = jax.tree.map(np.asarray, nnx.to_pure_dict(lora_state(stacked.unstack_layers())))
    jax.tree.map(np.testing.assert_array_equal, same,
                 jax.tree.map(np.asarray, nnx.to_pure_dict(lora_state(model))))  # fmt: skip
    _randomize_adapters(model)
    stacked = nnx.clone(model).stack_layers()
    want_logits, want = _logits_and_lora_grads(model, ids, mask)
    want = _flat_grads(want, stacked=False)
    assert any("experts" in key for key in want)
    scanned = nnx.clone(model)
    scanned.scan_layers = True
    for m, is_stacked in ((stacked, True), (scanned, False)):
        logits, grads = _logits_and_lora_grads(m, ids, mask)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5)
        got = _flat_grads(grads, stacked=is_stacked)
        assert got.keys() == want.keys()
        for key, g in got.items():
            np.testing.assert_allclose(g, want[key], atol=1e-5, rtol=1e-4, err_msg=str(key))
    hidden, _ = nnx.jit(lambda m, i, k: m.hidden_states(i, k, remat=True))(stacked, ids, mask)
    np.testing.assert_allclose(np.asarray(stacked.logits_from_hidden(hidden)),
                               np.asarray(want_logits), atol=1e-5)  # fmt: skip


def _batch(model):
    e = load_expected(NAME)
    out = generate(
        model, e["input_ids"][:2], e["attention_mask"][:2], key=jax.random.key(0),
        num_generations=2, max_new_tokens=4, eos_ids=(),
    )  # fmt: skip
    return GRPOBatch(
        prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask,
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        rewards=jnp.array([1.0, 0.0, 0.5, 0.0]),
        group_size=2,
    )


def test_a_grpo_update_moves_the_expert_adapters_only():
    ids, mask = _inputs()
    batch = _batch(from_pretrained(FIXTURES / NAME))
    model = from_pretrained(FIXTURES / NAME)
    plain = np.asarray(model(ids, mask))
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, target_modules=PROJECTIONS), nnx.Rngs(1))
    base = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.LoRAParam))))
    optimizer = nnx.Optimizer(model, optax.adam(5e-2), wrt=nnx.LoRAParam)
    trainer = GRPOTrainer(model, optimizer, GRPOConfig(num_generations=2, beta=0.1))
    assert trainer.has_reference  # the model with its adapters zeroed
    for _ in range(2):
        metrics = trainer.train_step(batch)
    assert np.isfinite(metrics["policy_loss"]) and metrics["kl"] > 0.0
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.LoRAParam))))
    jax.tree.map(np.testing.assert_array_equal, after, base)  # router, experts, attention
    for layer in model.layers:
        for adapter in layer.mlp.experts.lora.adapters().values():
            assert np.abs(np.asarray(adapter.lora_b[...])).max() > 0.0
    assert np.abs(np.asarray(model(ids, mask)) - plain).max() > 1e-4


# --------------------------------------------------------------------------- expert parallelism
def _mesh(shape):
    data, fsdp, expert, tensor = shape
    return make_mesh(data=data, fsdp=fsdp, expert=expert, tensor=tensor)


def test_partition_rules_of_expert_adapters():
    rules = RULES.bind(_mesh((1, 1, 4, 2)))  # no FSDP axis: the rules alone
    base = "layers.0.mlp.experts.lora"
    assert rules(f"{base}.gate_proj.lora_a", (8, 32, 2)) == P("expert", None, None)
    assert rules(f"{base}.up_proj.lora_b", (8, 2, 16)) == P("expert", None, "tensor")
    assert rules(f"{base}.down_proj.lora_a", (8, 16, 2)) == P("expert", "tensor", None)
    assert rules(f"{base}.down_proj.lora_b", (8, 2, 32)) == P("expert", None, None)


@pytest.mark.parametrize("shape", [(1, 1, 8, 1), (1, 2, 2, 2)], ids=["e8", "f2e2t2"])
def test_expert_parallel_adapters_equal_one_device(shape):
    e = load_expected(NAME)
    ids = jnp.asarray(np.concatenate([e["input_ids"], e["input_ids"][:1]]))  # 4 rows
    mask = jnp.asarray(np.concatenate([e["attention_mask"], e["attention_mask"][:1]]))
    model = apply_lora(from_pretrained(FIXTURES / NAME), LoRAConfig(rank=2, alpha=4.0),
                       nnx.Rngs(1))  # fmt: skip
    _randomize_adapters(model)
    want_logits, want = _logits_and_lora_grads(model, ids, mask)
    want = _flat_grads(want, stacked=False)
    sharded = shard_model(nnx.clone(model), _mesh(shape), RULES)
    adapter = sharded.layers[0].mlp.experts.lora.down_proj.lora_a[...]
    assert adapter.sharding.spec[0] == "expert"
    assert adapter.addressable_shards[0].data.shape[0] == 8 // shape[2]  # E / n per device
    lowered = _logits_and_lora_grads.lower(sharded, ids, mask).as_text()
    assert "manual_computation" in lowered or "SPMDFullToShardShape" in lowered  # shard_map ran
    logits, grads = _logits_and_lora_grads(sharded, ids, mask)
    real = np.asarray(mask).astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(want_logits)[real], atol=1e-5)
    got = _flat_grads(grads, stacked=False)
    assert got.keys() == want.keys()
    for key, g in got.items():
        np.testing.assert_allclose(g, want[key], atol=2e-5, rtol=1e-4, err_msg=str(key))


def test_the_ragged_path_with_adapters_on_a_mesh_equals_one_device(monkeypatch):
    mesh = _mesh((1, 2, 2, 2))
    x, experts, weights, w, lora, _ = _problem(5, PROJECTIONS, n=16, d=32, i=16, e=8)

    def value_and_grads(x, w, lora):
        def f(x, w, lora):
            deltas = {n: ExpertDelta(a=a, b=b, scale=2.0) for n, (a, b) in lora.items()}
            y = expert_mlp(x, experts, weights, *(w[p] for p in PROJECTIONS), deltas=deltas)
            return jnp.sum(jnp.sin(y)), y

        (_, y), g = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w, lora)
        return y, g

    want = jax.jit(value_and_grads)(x, w, lora)  # one device, the dense path
    rules = RULES.bind(mesh)

    def place(a, path):
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, rules(path, a.shape)))

    w_on = {p: place(v, f"layers.0.mlp.experts.{p}") for p, v in w.items()}
    lora_on = {
        p: (place(a, f"layers.0.mlp.experts.lora.{p}.lora_a"),
            place(b, f"layers.0.mlp.experts.lora.{p}.lora_b"))
        for p, (a, b) in lora.items()
    }  # fmt: skip
    _use_path(monkeypatch, "ragged")
    traced, ragged = [], moe_dispatch._ragged_dispatch
    monkeypatch.setattr(moe_dispatch, "_ragged_dispatch",
                        lambda *a, **k: traced.append(1) or ragged(*a, **k))  # fmt: skip
    on_mesh = jax.jit(lambda *a: value_and_grads(*a))
    lowered = on_mesh.lower(x, w_on, lora_on).as_text()
    assert "manual_computation" in lowered or "SPMDFullToShardShape" in lowered
    assert traced  # the ragged products ran
    got = on_mesh(x, w_on, lora_on)
    for g, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------- quantized bases
def test_qlora_expert_adapters_train_on_full_precision_experts():
    """`quantize_base` stores the attention quantized; the experts stay full precision (their
    feed-forward targets are refused by name) and take adapters on top."""
    import argparse

    from artifex.cli_quantize import quantize_model
    from artifex.generative_models.models.causal_lm.quantize import (
        QuantizeConfig,
        dequantize_base,
        quantize_base,
    )

    ids, mask = _inputs()
    model = from_pretrained(FIXTURES / NAME)
    with pytest.raises(ValueError, match=r"target_modules \['down_proj', 'gate_proj', 'up_proj'\]"
                       r" are the experts' stacked weights.*expected attention"):  # fmt: skip
        quantize_base(model, QuantizeConfig(qtype="nf4"))  # default targets: all seven
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    quantize_base(model, QuantizeConfig(qtype="nf4", block_size=16, target_modules=attention))
    base = np.asarray(model(ids, mask))
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(1))
    assert model.layers[0].mlp.experts.lora.down_proj is not None
    assert model.layers[0].attn.q_proj.lora is not None  # on the QuantizedLinear
    np.testing.assert_array_equal(np.asarray(model(ids, mask)), base)  # B = 0: exactly
    _randomize_adapters(model)
    adapted = np.asarray(model(ids, mask))
    merged = merge_lora(dequantize_base(model))
    np.testing.assert_allclose(np.asarray(merged(ids, mask)), adapted, atol=1e-5, rtol=1e-5)
    cli = quantize_model(argparse.Namespace(quantize="int8", quantize_block_size="column"),
                         from_pretrained(FIXTURES / NAME))  # fmt: skip
    assert cli.layers[0].attn.o_proj.qtype == "int8"
    assert cli.layers[0].mlp.experts.gate_proj[...].dtype == jnp.float32
