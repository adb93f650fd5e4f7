"""The text-conditioned DiT: a float64 NumPy forward, masking, conditioning, sampling, saving."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    FlowSampler,
    FlowTrainConfig,
    SDEConfig,
    TextFlowDiT,
    TextFlowDiTConfig,
    compositional_reward,
    flow_log_prob_fn,
    load_flow_model,
    make_shapes_dataset,
    save_flow_model,
    to_grpo_batch,
    train_flow_matching,
)

_CFG = TextFlowDiTConfig(
    image_shape=(8, 8, 3),
    patch_size=4,
    hidden_dim=16,
    num_blocks=2,
    num_heads=2,
    time_features=8,
    text_layers=1,
)
CAPTIONS = ["a red square", "two blue circles left of a green triangle", "three yellow squares"]


def _perturbed(cfg: TextFlowDiTConfig = _CFG, seed: int = 0) -> TextFlowDiT:
    """The model with N(0, 0.3^2) added to every weight (the zero-initialized ones included).

    The noise is NumPy's: jax.random's, leaf by leaf, compiled a program per weight shape.
    """
    model = TextFlowDiT(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed + 100)
    leaves = [
        jnp.asarray(np.asarray(p) + 0.3 * rng.standard_normal(p.shape).astype(np.float32))
        for p in leaves
    ]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


@nnx.jit
def _velocity(model: TextFlowDiT, x, t, prompts):
    """``model(x, t, prompts)`` compiled as one program (called eagerly, every operation of the
    forward compiles on its own, for each batch shape)."""
    return model(x, t, prompts)


# ------------------------------------------------------------------ float64 NumPy forward
def _a(v):
    return np.asarray(v[...], np.float64)


def _lin(m, x):
    return x @ _a(m.kernel) + _a(m.bias)


def _ln(m, x):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + m.epsilon)
    if m.scale is not None:
        y = y * _a(m.scale)
    if m.bias is not None:
        y = y + _a(m.bias)
    return y


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _silu(x):
    return x / (1 + np.exp(-x))


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _attn(q_in, k_in, heads, wq, wk, wv, wo, mask=None):
    """Per example, per head: softmax(q k^T / sqrt(h)) v, keys outside ``mask`` excluded."""
    t, d = q_in.shape
    h = d // heads
    out = np.zeros((t, d))
    for n in range(heads):
        q = (q_in @ wq[0] + wq[1])[:, n * h : (n + 1) * h]
        k = (k_in @ wk[0] + wk[1])[:, n * h : (n + 1) * h]
        v = (k_in @ wv[0] + wv[1])[:, n * h : (n + 1) * h]
        logits = q @ k.T / math.sqrt(h)
        if mask is not None:
            logits = np.where(mask[None, :], logits, -np.inf)
        out[:, n * h : (n + 1) * h] = _softmax(logits) @ v
    return out @ wo[0] + wo[1]


def _split_kv(m, d):
    k, b = _a(m.kv.kernel), _a(m.kv.bias)
    # kv's output is laid out (2, heads, head_dim): keys first, then values
    return (k[:, :d], b[:d]), (k[:, d:], b[d:])


def _numpy_forward(model: TextFlowDiT, x, t, tokens):
    cfg = model.config
    d, p = cfg.hidden_dim, cfg.patch_size
    hh, ww = cfg.grid
    out = np.zeros_like(x, dtype=np.float64)
    half = cfg.time_features // 2
    freqs = np.exp(-math.log(10000.0) * np.arange(half) / half)
    q4 = d // 4
    f4 = np.exp(-math.log(10000.0) * np.arange(q4) / q4)

    def enc(u):
        return np.concatenate([np.sin(u * f4), np.cos(u * f4)])

    pos = np.stack([np.concatenate([enc(i), enc(j)]) for i in range(hh) for j in range(ww)])
    for b in range(x.shape[0]):
        ids = tokens[b]
        mask = ids != 0
        e = _a(model.word.embedding)[ids] + _a(model.word_position)
        for layer in model.text_layers:
            z = _ln(layer.norm1, e)
            kv = _split_kv(layer.attn, d)
            e = e + _attn(
                z,
                z,
                cfg.num_heads,
                (_a(layer.attn.q.kernel), _a(layer.attn.q.bias)),
                *kv,
                (_a(layer.attn.out.kernel), _a(layer.attn.out.bias)),
                mask,
            )
            e = e + _lin(layer.fc2, _gelu(_lin(layer.fc1, _ln(layer.norm2, e))))
        text = _ln(model.text_norm, e)
        pooled = text[mask].mean(0)
        angles = 1000.0 * t[b] * freqs
        phi = np.concatenate([np.sin(angles), np.cos(angles)])
        c = _lin(model.time_out, _silu(_lin(model.time_in, phi))) + _lin(model.pooled, pooled)
        img = x[b].reshape(hh, p, ww, p, cfg.channels).transpose(0, 2, 1, 3, 4)
        h = _lin(model.patch_embed, img.reshape(hh * ww, -1)) + pos
        for blk in model.blocks:
            mod = np.split(_lin(blk.modulation, _silu(c)), 6)
            a = _attn(
                _ln(blk.norm1, h) * (1 + mod[1]) + mod[0],
                _ln(blk.norm1, h) * (1 + mod[1]) + mod[0],
                cfg.num_heads,
                (_a(blk.attn.qkv.kernel)[:, :d], _a(blk.attn.qkv.bias)[:d]),
                (_a(blk.attn.qkv.kernel)[:, d : 2 * d], _a(blk.attn.qkv.bias)[d : 2 * d]),
                (_a(blk.attn.qkv.kernel)[:, 2 * d :], _a(blk.attn.qkv.bias)[2 * d :]),
                (_a(blk.attn.out.kernel), _a(blk.attn.out.bias)),
            )
            h = h + mod[2] * a
            kv = _split_kv(blk.cross, d)
            h = h + _attn(
                _ln(blk.norm_cross, h),
                text,
                cfg.num_heads,
                (_a(blk.cross.q.kernel), _a(blk.cross.q.bias)),
                *kv,
                (_a(blk.cross.out.kernel), _a(blk.cross.out.bias)),
                mask,
            )
            z = _lin(blk.fc2, _gelu(_lin(blk.fc1, _ln(blk.norm2, h) * (1 + mod[4]) + mod[3])))
            h = h + mod[5] * z
        shift, scale = np.split(_lin(model.final_modulation, _silu(c)), 2)
        o = _lin(model.output, _ln(model.final_norm, h) * (1 + scale) + shift)
        o = o.reshape(hh, ww, p, p, cfg.channels).transpose(0, 2, 1, 3, 4)
        out[b] = o.reshape(-1)
    return out


def _qkv_is_head_major():
    """_SelfAttention reshapes qkv to (3, heads, head_dim): q, k, v blocks of D columns."""
    return True


@pytest.mark.parametrize("seed", [0, 1])
def test_forward_against_float64_numpy(seed):
    model = _perturbed(seed=seed)
    tok = _CFG.tokenizer()
    tokens = tok.encode(CAPTIONS)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, _CFG.data_dim)).astype(np.float32)
    t = np.array([0.1, 0.5, 0.95], np.float32)
    got = np.asarray(_velocity(model, jnp.asarray(x), jnp.asarray(t), jnp.asarray(tokens)))
    want = _numpy_forward(model, x.astype(np.float64), t.astype(np.float64), tokens)
    assert _qkv_is_head_major()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_zero_init_padding_and_rows():
    model = TextFlowDiT(_CFG, rngs=nnx.Rngs(0))
    tokens = _CFG.tokenizer().encode(CAPTIONS)
    x = jnp.ones((3, _CFG.data_dim))
    t = jnp.full((3,), 0.5)
    np.testing.assert_array_equal(np.asarray(_velocity(model, x, t, tokens)), 0.0)
    model = _perturbed()
    v = np.asarray(_velocity(model, x, t, tokens))
    # the padding token's embedding is never read: attention and pooling mask it out
    model.word.embedding[...] = model.word.embedding[...].at[0].set(100.0)
    np.testing.assert_allclose(np.asarray(_velocity(model, x, t, tokens)), v, rtol=1e-6, atol=1e-6)
    # the prompt matters, each row is its own
    other = tokens.copy()
    other[0] = _CFG.tokenizer().encode("a blue square")[0]
    v2 = np.asarray(_velocity(model, x, t, other))
    assert not np.allclose(v2[0], v[0], atol=1e-3)
    np.testing.assert_allclose(v2[1:], v[1:], rtol=1e-5, atol=1e-6)


def test_bad_prompts_and_config():
    model = TextFlowDiT(_CFG, rngs=nnx.Rngs(0))
    x, t = jnp.ones((1, _CFG.data_dim)), jnp.full((1,), 0.5)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 20\), got 25 at row 0"):
        model(x, t, jnp.array([[1, 25, 0, 0, 0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"token ids must have shape \(B, 8\)"):
        model(x, t, jnp.array([[1, 2]]))
    with pytest.raises(TypeError, match="token ids must be integers"):
        model(x, t, jnp.ones((1, 8)))
    sampler = FlowSampler(SDEConfig(num_steps=2))
    with pytest.raises(ValueError, match=r"prompts must be token ids in \[0, 20\)"):
        sampler(model, np.array([[1, 20, 0, 0, 0, 0, 0, 0]]), 2, jax.random.key(0))
    with pytest.raises(ValueError, match=r"prompts must be token ids of shape \(B, L\)"):
        sampler(model, np.array([1, 2]), 2, jax.random.key(0))
    with pytest.raises(TypeError, match="prompts must be integer class labels or token ids"):
        sampler(model, [["a red square"]], 2, jax.random.key(0))
    for bad, error in (
        (dict(image_shape=(8, 6, 3)), ValueError),
        (dict(image_shape=(8.0, 8, 3)), TypeError),
        (dict(hidden_dim=18), ValueError),
        (dict(vocabulary=("<pad>",)), ValueError),
        (dict(text_layers=-1), ValueError),
    ):
        with pytest.raises(error):
            TextFlowDiTConfig(**{"image_shape": (8, 8, 3), "patch_size": 4, **bad})
    with pytest.raises(TypeError, match="must be a TextFlowDiTConfig"):
        TextFlowDiT(object(), rngs=nnx.Rngs(0))


def test_sampler_hook_and_save_round_trip(tmp_path):
    model = _perturbed()
    tok = _CFG.tokenizer()
    sde = SDEConfig(num_steps=4, noise_level=0.7, window_size=2)
    traj = FlowSampler(sde)(model, tok.encode(CAPTIONS[:2]), 2, jax.random.key(0))
    assert traj.prompts.shape == (4, 8)
    batch = to_grpo_batch(traj, np.arange(4.0), group_size=2)
    lp, _ = nnx.jit(flow_log_prob_fn(sde))(model, batch)  # compiled, as the trainer runs it
    want = np.take_along_axis(np.asarray(traj.log_probs), np.asarray(batch.completion_ids), 1)
    np.testing.assert_allclose(np.asarray(lp), want, rtol=1e-4, atol=1e-3)
    save_flow_model(model, tmp_path)
    loaded = load_flow_model(tmp_path)
    assert loaded.config == model.config and loaded.config.vocabulary == _CFG.vocabulary
    x = jax.random.normal(jax.random.key(1), (2, _CFG.data_dim))
    args = (x, jnp.array([0.3, 0.7]), tok.encode(CAPTIONS[:2]))
    np.testing.assert_array_equal(
        np.asarray(_velocity(loaded, *args)), np.asarray(_velocity(model, *args))
    )


@pytest.mark.slow
def test_pretraining_on_shapes_lowers_the_loss_and_reads_the_prompt():
    """120 steps of 16 on 32x32 shapes: the loss falls and the caption changes the velocity.

    The learning rate is 4e-3 (the default 2e-3 needs about 150 steps of 32 for the same fall):
    the last 20 losses average 0.47-0.49 of the first 5 over seeds 0-3 (of the model and of
    the batches; measured), under the 0.6 asserted; the caption moves the velocity by 2-4% of
    its size, over the 0.1% asserted.
    Whether the colours then follow the prompt is not asserted: at this size (width 32, one
    block) the sign of the colour contrast changes with the sampling seed and the CPU's float
    order (measured); the flow demo measures it on the trained model instead.
    """
    images, captions = make_shapes_dataset(2000, seed=0)
    cfg = TextFlowDiTConfig(hidden_dim=32, num_blocks=1, num_heads=2)
    model = TextFlowDiT(cfg, rngs=nnx.Rngs(0))
    tok = cfg.tokenizer()
    losses = train_flow_matching(
        model,
        images,
        tok.encode(captions),
        FlowTrainConfig(num_steps=120, batch_size=16, learning_rate=4e-3),
    )
    assert np.mean(losses[-20:]) < 0.6 * np.mean(losses[:5])
    x = jax.random.normal(jax.random.key(1), (2, cfg.data_dim))
    t = jnp.array([0.5, 0.5])
    red = np.asarray(_velocity(model, x, t, tok.encode(["a red square"] * 2)))
    blue = np.asarray(_velocity(model, x, t, tok.encode(["a blue circle"] * 2)))
    assert np.abs(red - blue).mean() > 1e-3 * np.abs(red).mean()  # the caption reaches the output
    traj = FlowSampler(SDEConfig(num_steps=8, noise_level=0.0))(
        model, tok.encode(["a red square", "a blue circle"]), 4, jax.random.key(0)
    )
    assert np.isfinite(np.asarray(traj.images)).all()
    reward = compositional_reward(tok)
    assert reward(
        np.asarray(traj.images), np.repeat(tok.encode(["a red square", "a blue circle"]), 4, 0)
    ).shape == (8,)
