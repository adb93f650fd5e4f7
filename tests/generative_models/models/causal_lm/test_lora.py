"""Tests for artifex/generative_models/models/causal_lm/lora.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import (
    BASE_FILTER,
    LORA_FILTER,
    CausalLM,
    CausalLMConfig,
    LoRAConfig,
    apply_lora,
    from_pretrained,
    lora_state,
    merge_lora,
    zero_lora_state,
)

from ._helpers import FIXTURES

IDS = jnp.array([[0, 0, 5, 9, 3, 7], [4, 8, 15, 16, 23, 42]], jnp.int32)
MASK = jnp.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], jnp.int32)


@nnx.jit
def _fwd(m, ids, mask):
    return m(ids, mask)


def _randomize_b(model, seed):
    """Give every B a random value so the adapters change the output."""
    rng = np.random.default_rng(seed)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.LoRAParam) and path[-1] == "lora_b":
            value = node.get_value()
            node.set_value(jnp.asarray(0.05 * rng.normal(size=value.shape), value.dtype))


def _model(seed=0, **lora):
    cfg = CausalLMConfig.tiny(vocab_size=64, initializer_range=0.1)
    model = CausalLM(cfg, rngs=nnx.Rngs(seed))
    base = _fwd(model, IDS, MASK)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, **lora), nnx.Rngs(seed + 100))
    return model, base


def test_config_validation():
    assert LoRAConfig(rank=8, alpha=16).scale == 2.0
    assert LoRAConfig(rank=2, alpha=1, target_modules="q_proj").target_modules == ("q_proj",)
    for kwargs, field in (
        ({"rank": 0, "alpha": 1}, "rank"),
        ({"rank": 2, "alpha": 0}, "alpha"),
        ({"rank": 2, "alpha": 1, "target_modules": ("qkv",)}, "target_modules"),
        ({"rank": 2, "alpha": 1, "target_modules": ()}, "target_modules"),
    ):
        with pytest.raises(ValueError, match=field):
            LoRAConfig(**kwargs)


def test_loraparam_is_param_and_filters_split_cleanly():
    assert issubclass(nnx.LoRAParam, nnx.Param)
    model, _ = _model()
    everything = nnx.state(model, nnx.Param)
    adapters = nnx.state(model, LORA_FILTER)
    base = nnx.state(model, BASE_FILTER)
    n = lambda s: len(jax.tree.leaves(s))  # noqa: E731
    assert n(adapters) == 2 * 7 * 2 and n(base) + n(adapters) == n(everything)
    assert n(base) == n(nnx.state(CausalLM(model.config, rngs=nnx.Rngs(0)), nnx.Param))
    paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(adapters)}
    assert (
        "layers.0.attn.q_proj.lora.lora_a" in paths
        and "layers.1.mlp.down_proj.lora.lora_b" in paths
    )
    a = model.layers[0].attn.k_proj.lora
    assert a.lora_a[...].shape == (128, 4) and a.lora_b[...].shape == (4, 64)
    assert not np.any(np.asarray(a.lora_b[...]))
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoRAConfig(rank=2, alpha=2), nnx.Rngs(0))


def test_target_subset():
    model, _ = _model(target_modules=("q_proj", "v_proj"))
    assert model.layers[0].attn.q_proj.lora is not None and model.layers[0].attn.k_proj.lora is None
    assert model.layers[1].mlp.up_proj.lora is None
    assert len(jax.tree.leaves(lora_state(model))) == 2 * 2 * 2


def test_fresh_adapters_leave_logits_unchanged():
    model, base = _model()
    np.testing.assert_array_equal(np.asarray(_fwd(model, IDS, MASK)), np.asarray(base))


def test_zeroed_adapter_state_reproduces_base_exactly():
    model, base = _model(seed=1)
    _randomize_b(model, 0)
    adapted = _fwd(model, IDS, MASK)
    assert np.abs(np.asarray(adapted) - np.asarray(base)).max() > 1e-3
    graphdef, adapters, rest = nnx.split(model, LORA_FILTER, ...)

    @jax.jit
    def forward(adapters, rest):
        return nnx.merge(graphdef, adapters, rest)(IDS, MASK)

    np.testing.assert_array_equal(np.asarray(forward(adapters, rest)), np.asarray(adapted))
    ref = forward(zero_lora_state(adapters), rest)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(base))


def test_merge_matches_adapted_model(tmp_path):
    model, _ = _model(seed=2)
    _randomize_b(model, 1)
    adapted = _fwd(model, IDS, MASK)
    merged = merge_lora(model)
    assert not jax.tree.leaves(nnx.state(merged, LORA_FILTER))
    assert jax.tree.leaves(nnx.state(model, LORA_FILTER))  # input untouched
    np.testing.assert_allclose(np.asarray(_fwd(merged, IDS, MASK)), np.asarray(adapted), atol=1e-5)
    merged.save_pretrained(tmp_path)
    again = from_pretrained(tmp_path)
    np.testing.assert_array_equal(
        np.asarray(_fwd(again, IDS, MASK)), np.asarray(_fwd(merged, IDS, MASK))
    )


def test_lora_on_loaded_bf16_model():
    model = from_pretrained(FIXTURES / "llama_tiny_sharded_bf16")
    apply_lora(model, LoRAConfig(rank=2, alpha=4, param_dtype="float32"), nnx.Rngs(0))
    assert model.layers[0].attn.q_proj.lora.lora_a[...].dtype == jnp.float32
    hidden, _ = model.hidden_states(IDS % 128, MASK)
    assert hidden.dtype == jnp.bfloat16


def test_optimizer_with_lora_filter_updates_only_adapters():
    model, _ = _model(seed=3)
    before_base = jax.tree.map(np.asarray, nnx.state(model, BASE_FILTER))
    before_lora = jax.tree.map(np.asarray, nnx.state(model, LORA_FILTER))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=LORA_FILTER)
    targets = jnp.roll(IDS, -1, axis=1)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            logits = model(IDS, MASK)
            logp = jax.nn.log_softmax(logits)
            nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
            return jnp.sum(nll * MASK) / jnp.sum(MASK)

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, LORA_FILTER))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(4)]
    assert losses[-1] < losses[0]
    after_base = jax.tree.map(np.asarray, nnx.state(model, BASE_FILTER))
    after_lora = jax.tree.map(np.asarray, nnx.state(model, LORA_FILTER))
    jax.tree.map(np.testing.assert_array_equal, after_base, before_base)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), after_lora, before_lora)
    assert all(jax.tree.leaves(changed))
