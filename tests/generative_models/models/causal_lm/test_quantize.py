"""Quantized frozen bases (QLoRA): formats against float64 NumPy, bounds, gradients, GRPO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

pytest.importorskip("qwix", reason="the [quantize] extra (qwix) is not installed")

from artifex.generative_models.models.causal_lm import (
    CausalLM,
    CausalLMConfig,
    Linear,
    LoRAConfig,
    apply_lora,
    load_peft_adapter,
    lora_state,
    merge_lora,
    save_peft_adapter,
    zero_lora_state,
)
from artifex.generative_models.models.causal_lm.quantize import (
    QTYPES,
    QuantizeConfig,
    QuantizedLinear,
    QuantizedWeight,
    dequantize_base,
    dequantize_weight,
    error_bound,
    is_quantized,
    quantize_base,
    quantize_weight,
    quantized_matmul,
)
from artifex.generative_models.training.rl import (
    GRPOBatch,
    GRPOConfig,
    GRPOTrainer,
    causal_lm_log_probs,
)

CFG = CausalLMConfig.tiny(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    head_dim=8,
    max_position_embeddings=64,
)


# ---------------------------------------------------------------- float64 NumPy references


def nf4_levels() -> np.ndarray:
    """The 16 NF4 levels built as QLoRA builds them (quantiles of N(0, 1), offset 0.9677083)."""
    from scipy.special import ndtri  # norm.ppf, without importing scipy.stats

    offset = 0.9677083
    positive = ndtri(np.linspace(offset, 0.5, 9)[:-1])
    negative = -ndtri(np.linspace(offset, 0.5, 8)[:-1])
    levels = np.sort(np.concatenate([positive, [0.0], negative]))
    return levels / levels.max()


def reference(w: np.ndarray, qtype: str, block: int | None):
    """float64 absmax blockwise quantization: (dequantized, distance to a rounding boundary)."""
    w = np.asarray(w, np.float64)
    rows, cols = w.shape
    b = rows if block is None else block
    blocks = w.reshape(rows // b, b, cols)
    absmax = np.abs(blocks).max(axis=1, keepdims=True)
    if qtype == "nf4":
        levels = nf4_levels()
        t = blocks / absmax
        codes = np.abs(t[..., None] - levels).argmin(-1)
        mids = (levels[1:] + levels[:-1]) / 2
        margin = np.abs(t[..., None] - mids).min(-1)
        deq = levels[codes] * absmax
    else:
        qmax = {"int8": 127, "int4": 7}[qtype]
        scale = absmax / (qmax + 0.5)
        t = blocks / scale
        codes = np.clip(np.rint(t), -qmax - 1, qmax)
        margin = np.abs(np.abs(t - np.floor(t)) - 0.5)
        deq = codes * scale
    return (
        deq.reshape(rows, cols),
        margin.reshape(rows, cols),
        np.repeat(absmax, b, 1).reshape(rows, cols),
    )


def test_nf4_levels_are_qloras():
    codes = jnp.arange(16, dtype=jnp.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(8, 1)
    got = dequantize_weight(packed, jnp.ones((1, 1)), "nf4").ravel()
    np.testing.assert_allclose(np.asarray(got), nf4_levels(), atol=2e-7)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("block", [16, 64, None])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_equals_float64_numpy_within_the_stated_bound(qtype, block, seed):
    rng = np.random.default_rng(seed)
    # Heavy tails, so that some blocks hold outliers.
    w = (rng.standard_t(df=4, size=(128, 24)) * 0.05).astype(np.float32)
    codes, scale = quantize_weight(jnp.asarray(w), qtype, block)
    got = np.asarray(dequantize_weight(codes, scale, qtype), np.float64)
    want, margin, absmax = reference(w, qtype, block)
    # Away from a rounding boundary float32 and float64 pick the same code (a block's absmax
    # lands on one for int8 and int4: 127.5 and 7.5 steps; the bound below covers all).
    clear = margin > 1e-4
    assert clear.mean() > 1 - 1.1 / (128 if block is None else block)
    np.testing.assert_allclose(got[clear], want[clear], rtol=0, atol=1e-6 * absmax.max())
    bound = error_bound(qtype) * absmax
    assert (np.abs(got - w) <= bound * (1 + 1e-5) + 1e-7).all()
    assert (np.abs(want - w) <= bound * (1 + 1e-12)).all()
    if qtype != "nf4":  # the bound is attained: a block's absmax itself sits half a step off
        assert np.max(np.abs(got - w) / bound) > 0.99


def test_storage_bits():
    w = jnp.ones((128, 16))
    for qtype, shape, dtype in (("int8", (128, 16), "int8"), ("int4", (64, 16), "uint8")):
        codes, scale = quantize_weight(w, qtype, 64)
        assert codes.shape == shape and codes.dtype == dtype
        assert scale.shape == (2, 16) and scale.dtype == jnp.float32
    assert QuantizeConfig(qtype="int8", block_size=32).bits_per_weight == 9.0
    assert QuantizeConfig(qtype="int4", block_size=None).bits_per_weight is None


def test_packing_round_trips_every_4_bit_code():
    values = np.arange(-8, 8)
    w = np.tile(values, 2).reshape(32, 1).astype(np.float32)  # absmax 8: int4 codes = values
    codes, scale = quantize_weight(jnp.asarray(w), "int4", None)
    np.testing.assert_allclose(np.asarray(scale), [[8 / 7.5]], rtol=1e-7)
    got = np.asarray(dequantize_weight(codes, scale, "int4"))
    want = np.clip(np.rint(w / (8 / 7.5)), -8, 7) * (8 / 7.5)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_projection_output_within_the_stated_bound_of_float64(qtype, seed):
    rng = np.random.default_rng(seed)
    lin = Linear(64, 24, use_bias=True, std=0.05, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    lin.bias.set_value(jnp.asarray(rng.normal(size=24), jnp.float32))
    q = QuantizedLinear.from_linear(lin, qtype, block_size=16)
    x = rng.normal(size=(3, 5, 64))
    got = np.asarray(q(jnp.asarray(x, jnp.float32)), np.float64)
    w = np.asarray(lin.kernel[...], np.float64)
    b = np.asarray(lin.bias[...], np.float64)
    _, _, absmax = reference(w.astype(np.float32), qtype, 16)
    # Exactly the product with the dequantized kernel (float32 rounding only) ...
    deq = np.asarray(q.dequantized_kernel(), np.float64)
    np.testing.assert_allclose(got, x @ deq + b, rtol=0, atol=1e-5)
    # ... and within sum_i |x_i| bound * absmax(block(i), j) of the full-precision one.
    bound = np.abs(x) @ (error_bound(qtype) * absmax)
    assert (np.abs(got - (x @ w + b)) <= bound + 1e-5).all()


@pytest.mark.parametrize("qtype", QTYPES)
def test_model_equals_its_dequantized_copy_and_is_close_to_the_original(qtype):
    model = CausalLM(CausalLMConfig.tiny(), rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, size=(2, 12)))
    original = np.asarray(model(ids))
    quantize_base(model, QuantizeConfig(qtype=qtype))
    assert is_quantized(model)
    quantized = np.asarray(model(ids))
    full = dequantize_base(model)
    assert not is_quantized(full) and is_quantized(model)
    np.testing.assert_allclose(np.asarray(full(ids)), quantized, atol=1e-5)
    # The largest logit error over the largest logit: 0.012 (int8), 0.167 (int4) and 0.172
    # (nf4) on this random model (docs/models.md has a real model's).
    rel = np.abs(quantized - original).max() / np.abs(original).max()
    assert rel < {"int8": 0.015, "int4": 0.2, "nf4": 0.2}[qtype]


def test_bfloat16_model_dequantizes_to_bfloat16():
    model = CausalLM(CFG, rngs=nnx.Rngs(0), dtype="bfloat16")
    quantize_base(model, QuantizeConfig(qtype="nf4", block_size=16))
    proj = model.layers[0].mlp.down_proj
    assert proj.dequantized_kernel().dtype == jnp.bfloat16
    assert proj.kernel_scale[...].dtype == jnp.float32
    ids = jnp.array([[3, 4, 5, 6]])
    out, want = model(ids), dequantize_base(model)(ids)
    assert out.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=1e-2)


def test_targets_and_stacked_layers():
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    ids = jnp.array([[3, 4, 5, 6]])
    model.stack_layers()
    quantize_base(model, QuantizeConfig(qtype="int8", block_size=16, target_modules=("q_proj",)))
    assert model.layers_stacked
    assert model.layers.attn.q_proj.kernel_codes.shape == (2, 32, 32)
    assert isinstance(model.layers.attn.k_proj.kernel, nnx.Param)
    np.testing.assert_allclose(
        np.asarray(model(ids)), np.asarray(dequantize_base(model)(ids)), atol=1e-5
    )


# ---------------------------------------------------------------- gradients


def test_gradients_reach_the_adapters_only_and_equal_the_dequantized_models():
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    quantize_base(model, QuantizeConfig(qtype="nf4", block_size=16))
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(1))
    nnx.update(model, jax.tree.map(lambda a: a + 0.1, lora_state(model)))  # B != 0
    full = dequantize_base(model)
    ids = jnp.array([[3, 4, 5, 6, 7]])

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(ids)) ** 2)

    diff = nnx.DiffState(0, nnx.LoRAParam)
    # jitted: one program per model (run eagerly, every piece of the backward pass compiles)
    grads = nnx.jit(nnx.grad(loss, argnums=diff))(model)
    want = nnx.jit(nnx.grad(loss, argnums=diff))(full)
    for (path, g), (_, w) in zip(
        jax.tree_util.tree_leaves_with_path(grads),
        jax.tree_util.tree_leaves_with_path(want),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, err_msg=str(path))
    # The storage is neither a parameter nor trainable: nnx.Param does not select it.
    params = jax.tree_util.keystr(nnx.state(model, nnx.Param))
    assert "kernel_codes" not in params and "kernel_scale" not in params
    assert jax.tree.leaves(nnx.state(model, QuantizedWeight))


def test_the_backward_pass_keeps_no_dequantized_kernel():
    lin = Linear(64, 32, use_bias=False, std=0.05, dtype=jnp.float32, rngs=nnx.Rngs(0))
    q = QuantizedLinear.from_linear(lin, "int4", block_size=16)
    x = jnp.ones((3, 64))

    def kept(f):
        _, vjp = jax.vjp(f, x)
        return [(a.shape, a.dtype) for a in jax.tree.leaves(vjp)]

    assert ((64, 32), jnp.float32) in kept(lin)  # sanity: a plain product keeps the kernel
    assert ((64, 32), jnp.float32) not in kept(q)
    codes, scale = q.kernel_codes[...], q.kernel_scale[...]
    dscale = jax.grad(lambda s: quantized_matmul(x, codes, s, "int4").sum())(scale)
    assert not np.asarray(dscale).any()  # frozen: no gradient to the scales


def test_scanned_layers_dequantize_one_layer_at_a_time():
    # XLA:CPU computes the dequantized kernels of unrolled layers up front and keeps them all
    # (the gradient program's temporaries: 18.1 MB here, against 18.0 MB of full-precision
    # projections); a scan over stacked layers dequantizes one layer per iteration (4.6 MB).
    # Compiled for shapes only: the models are abstract (built, quantized and stacked inside
    # nnx.eval_shape), so nothing is initialized, quantized or stacked for real.
    cfg = CausalLMConfig.tiny(
        num_layers=6, hidden_size=256, intermediate_size=768, head_dim=64, vocab_size=64
    )
    plain = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    projections = sum(
        x.size * x.dtype.itemsize
        for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(plain, nnx.Param))
        if "_proj" in jax.tree_util.keystr(path)
    )

    def build():
        model = CausalLM(cfg, rngs=nnx.Rngs(0))
        quantize_base(model, QuantizeConfig(qtype="nf4"))
        apply_lora(model, LoRAConfig(rank=4, alpha=8.0), nnx.Rngs(1))
        return model.stack_layers()

    model = nnx.eval_shape(build)
    assert model.layers_stacked and is_quantized(model)
    model.scan_layers = True
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    ids = jnp.ones((1, 8), jnp.int32)

    def loss(adapters, rest):
        return nnx.merge(graphdef, adapters, rest)(ids).sum()

    compiled = jax.jit(jax.grad(loss)).lower(adapters, rest).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 0.4 * projections


# ---------------------------------------------------------------- GRPO


def batch(seed=0, g=4, n=2, p=5, t=6):
    rng = np.random.default_rng(seed)
    prompts = np.repeat(rng.integers(4, 64, size=(n, p)), g, 0).astype(np.int32)
    comp = rng.integers(4, 64, size=(n * g, t)).astype(np.int32)
    lengths = rng.integers(2, t + 1, size=n * g)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
    return GRPOBatch(
        prompt_ids=jnp.asarray(prompts),
        prompt_mask=jnp.ones_like(prompts),
        completion_ids=jnp.asarray(comp),
        completion_mask=jnp.asarray(mask),
        rewards=jnp.asarray(rng.normal(size=n * g), jnp.float32),
        group_size=g,
    )


def leaves(state):
    return [np.asarray(a) for a in jax.tree.leaves(state)]


@pytest.mark.parametrize(("qtype", "stacked"), [("int4", False), ("nf4", True)])
def test_grpo_train_step_on_a_quantized_base(qtype, stacked):
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    quantize_base(model, QuantizeConfig(qtype=qtype, block_size=16))
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(1))
    if stacked:
        model.stack_layers()
    storage = leaves(nnx.state(model, QuantizedWeight))
    adapters = leaves(nnx.state(model, nnx.LoRAParam))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    trainer = GRPOTrainer(model, optimizer, GRPOConfig(beta=0.1, scan_layers=stacked))
    b = batch()
    first = trainer.train_step(b)
    assert first["kl"] == 0.0  # B = 0: the policy is the quantized base
    second = trainer.train_step(b)
    assert second["kl"] > 0.0 and np.isfinite(second["policy_loss"])
    # The quantized base is the reference, and it did not move.
    ref = trainer.compute_log_probs(b).ref_log_probs
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    base = nnx.merge(graphdef, zero_lora_state(lora), rest)
    want, _ = nnx.jit(causal_lm_log_probs)(
        base, b.prompt_ids, b.completion_ids, prompt_mask=b.prompt_mask
    )
    np.testing.assert_allclose(ref, want, atol=1e-6)
    for a, c in zip(storage, leaves(nnx.state(model, QuantizedWeight)), strict=True):
        np.testing.assert_array_equal(a, c)
    assert any(
        not np.array_equal(a, c)
        for a, c in zip(adapters, leaves(nnx.state(model, nnx.LoRAParam)), strict=True)
    )


@pytest.mark.slow
def test_the_loop_trains_checkpoints_and_resumes_a_quantized_base(tmp_path):
    from artifex.demos.addition import addition_dataset, demo_model, demo_tokenizer
    from artifex.generative_models.training.rl import (
        RolloutConfig,
        TrainConfig,
        math_answer_reward,
        train,
    )

    rows = addition_dataset(seed=0, num_eval=4)[0][:16]

    def trainer():
        tok = demo_tokenizer()
        # The demo model with one decoder layer (depth proves nothing about checkpoints).
        config = nnx.eval_shape(lambda: demo_model(tok)).config.replace(num_layers=1)
        model = quantize_base(CausalLM(config, rngs=nnx.Rngs(0)), QuantizeConfig(qtype="nf4"))
        apply_lora(model, LoRAConfig(rank=4, alpha=8.0), nnx.Rngs(1))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
        return GRPOTrainer(model, opt, GRPOConfig(num_generations=4, beta=0.05)), tok

    loop = dict(prompts_per_step=2, progress=False, seed=3, checkpoint_dir=str(tmp_path))
    reward = [math_answer_reward(last_number_fallback=True)]
    rollout = RolloutConfig(max_new_tokens=4)
    first, tok = trainer()
    storage = leaves(nnx.state(first.model, QuantizedWeight))
    train(first, tok, rows, reward, TrainConfig(num_steps=1, **loop), rollout)
    resumed, tok = trainer()
    result = train(resumed, tok, rows, reward, TrainConfig(num_steps=2, **loop), rollout)
    assert result.start_step == 1 and len(result.history) == 1
    for a, c in zip(storage, leaves(nnx.state(resumed.model, QuantizedWeight)), strict=True):
        np.testing.assert_array_equal(a, c)


# ---------------------------------------------------------------- export, adapters


def test_export_and_peft_adapters_of_a_quantized_base(tmp_path):
    model = quantize_base(
        CausalLM(CFG, rngs=nnx.Rngs(0)), QuantizeConfig(qtype="int4", block_size=16)
    )
    lora = LoRAConfig(rank=2, alpha=4.0)
    apply_lora(model, lora, nnx.Rngs(1))
    nnx.update(model, jax.tree.map(lambda a: a + 0.1, lora_state(model)))  # "trained"
    ids = jnp.array([[3, 4, 5, 6]])
    merged = merge_lora(dequantize_base(model))
    np.testing.assert_allclose(np.asarray(merged(ids)), np.asarray(model(ids)), atol=1e-5)
    save_peft_adapter(model, tmp_path, config=lora)
    again = quantize_base(
        CausalLM(CFG, rngs=nnx.Rngs(0)), QuantizeConfig(qtype="int4", block_size=16)
    )
    again = load_peft_adapter(again, tmp_path)
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"qtype": "fp4"}, "qtype must be one of"),
        ({"qtype": "int8", "block_size": 3}, "block_size must be even"),
        ({"qtype": "int8", "block_size": 0}, "block_size must be an int >= 2"),
        ({"qtype": "int8", "block_size": True}, "block_size must be an int >= 2"),
        ({"qtype": "int8", "block_size": "64"}, "block_size must be an int >= 2"),
        ({"qtype": "nf4", "target_modules": ("lm_head",)}, "target_modules"),
        ({"qtype": "nf4", "target_modules": ()}, "target_modules"),
    ],
)
def test_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizeConfig(**kwargs)


def test_bad_input_is_refused_before_anything_changes():
    with pytest.raises(ValueError, match="2-D floating"):
        quantize_weight(jnp.ones(8), "int8")
    with pytest.raises(ValueError, match="2-D floating"):
        quantize_weight(jnp.ones((8, 2), jnp.int32), "int8")
    with pytest.raises(ValueError, match="not a multiple of block_size 64"):
        quantize_weight(jnp.ones((96, 2)), "int8")
    with pytest.raises(ValueError, match="input width must be even"):
        quantize_weight(jnp.ones((7, 2)), "nf4", None)
    with pytest.raises(ValueError, match="qtype must be one of"):
        error_bound("int2")
    with pytest.raises(TypeError, match="must be a CausalLM"):
        quantize_base(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), QuantizeConfig(qtype="int8"))
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="must be a QuantizeConfig"):
        quantize_base(model, {"qtype": "int8"})
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q_proj has input width 32"):
        quantize_base(model, QuantizeConfig(qtype="int8"))  # 32 is no multiple of 64
    assert not is_quantized(model)  # checked before any projection changed
    quantize_base(model, QuantizeConfig(qtype="int8", block_size=32))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_base(model, QuantizeConfig(qtype="int8", block_size=32))
    with pytest.raises(AttributeError, match=r"stored quantized \(int8\); .*dequantize_base"):
        merge_lora(apply_lora(model, LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(1)))
    with pytest.raises(ValueError, match="codes of a"):
        QuantizedLinear(
            jnp.zeros((4, 2), jnp.uint8),
            jnp.ones((1, 2)),
            None,
            qtype="nf4",
            in_features=4,
            out_features=2,
            dtype=jnp.float32,
        )


def test_without_qwix_the_error_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "qwix", None)
    with pytest.raises(ImportError, match=r"artifex-grpo\[quantize\]"):
        quantize_weight(jnp.ones((4, 4)), "int4", 2)
