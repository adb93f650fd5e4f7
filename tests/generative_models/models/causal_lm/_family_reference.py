"""An independent float64 NumPy forward pass of Mistral and Gemma 3 (text) checkpoints.

Written from transformers' modeling_mistral.py / modeling_gemma3.py, not from the library: it
reads the Hugging Face tensors and config.json of a fixture directory and computes the logits of
left-padded rows, one head and one query at a time where that reads clearer.
"""

from __future__ import annotations

import json
import math

import numpy as np
from safetensors.numpy import load_file


def load_checkpoint(directory) -> tuple[dict, dict[str, np.ndarray]]:
    """`(config.json, {name: float64 tensor})` of a one-file fixture checkpoint."""
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    return config, {k: v.astype(np.float64) for k, v in tensors.items()}


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float, gemma: bool) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * (1.0 + w) if gemma else y * w


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x (B, T, N, H) at integer positions (B, T)."""
    angles = positions[..., None].astype(np.float64) * inv_freq  # (B, T, H/2)
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, :, None]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, :, None]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _inv_freq(head_dim: int, theta: float, linear_factor: float | None) -> np.ndarray:
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return inv / linear_factor if linear_factor else inv


def _layer_setup(config: dict) -> list[tuple[bool, np.ndarray]]:
    """Per layer: (sliding?, inverse RoPE frequencies)."""
    n, h = config["num_hidden_layers"], config["head_dim"]
    if config["model_type"] == "mistral":
        theta = config["rope_parameters"]["rope_theta"]
        return [(config.get("sliding_window") is not None, _inv_freq(h, theta, None))] * n
    rope = config["rope_parameters"]
    out = []
    for kind in config["layer_types"]:
        params = rope[kind]
        factor = params["factor"] if params.get("rope_type") == "linear" else None
        out.append((kind == "sliding_attention", _inv_freq(h, params["rope_theta"], factor)))
    return out


def reference_logits(
    config: dict,
    tensors: dict[str, np.ndarray],
    ids: np.ndarray,
    mask: np.ndarray,
    *,
    softcap: float | None = None,
) -> np.ndarray:
    """float64 logits (B, T, V) of left-padded `ids` under the checkpoint (real rows only)."""
    gemma = config["model_type"] == "gemma3_text"
    eps = config["rms_norm_eps"]
    b, t = ids.shape
    n, k, h = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    window = config.get("sliding_window")
    scale = (config["query_pre_attn_scalar"] if gemma else h) ** -0.5
    positions = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    slots = np.arange(t)
    embed = tensors["model.embed_tokens.weight"]
    x = embed[ids]
    if gemma:
        x = x * math.sqrt(config["hidden_size"])

    def w(name: str) -> np.ndarray:
        return tensors[name]

    for i, (sliding, inv_freq) in enumerate(_layer_setup(config)):
        pre = f"model.layers.{i}."
        hn = _rms_norm(x, w(pre + "input_layernorm.weight"), eps, gemma)
        q = (hn @ w(pre + "self_attn.q_proj.weight").T).reshape(b, t, n, h)
        key = (hn @ w(pre + "self_attn.k_proj.weight").T).reshape(b, t, k, h)
        value = (hn @ w(pre + "self_attn.v_proj.weight").T).reshape(b, t, k, h)
        if gemma:
            q = _rms_norm(q, w(pre + "self_attn.q_norm.weight"), eps, True)
            key = _rms_norm(key, w(pre + "self_attn.k_norm.weight"), eps, True)
        q, key = _rope(q, positions, inv_freq), _rope(key, positions, inv_freq)
        allowed = (slots[None, :] <= slots[:, None])[None] & mask.astype(bool)[:, None, :]
        if sliding:
            allowed = allowed & ((slots[:, None] - slots[None, :]) < window)[None]
        out = np.zeros((b, t, n, h))
        for head in range(n):
            kv = head // (n // k)
            scores = np.einsum("btd,bsd->bts", q[:, :, head], key[:, :, kv]) * scale
            scores = np.where(allowed, scores, -np.inf)
            top = np.max(scores, -1, keepdims=True)
            top = np.where(np.isfinite(top), top, 0.0)
            e = np.where(allowed, np.exp(scores - top), 0.0)
            probs = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
            out[:, :, head] = np.einsum("bts,bsd->btd", probs, value[:, :, kv])
        attn = out.reshape(b, t, n * h) @ w(pre + "self_attn.o_proj.weight").T
        if gemma:
            attn = _rms_norm(attn, w(pre + "post_attention_layernorm.weight"), eps, True)
            x = x + attn
            hn = _rms_norm(x, w(pre + "pre_feedforward_layernorm.weight"), eps, True)
        else:
            x = x + attn
            hn = _rms_norm(x, w(pre + "post_attention_layernorm.weight"), eps, False)
        gate = hn @ w(pre + "mlp.gate_proj.weight").T
        act = _gelu_tanh(gate) if gemma else _silu(gate)
        mlp = (act * (hn @ w(pre + "mlp.up_proj.weight").T)) @ w(pre + "mlp.down_proj.weight").T
        if gemma:
            mlp = _rms_norm(mlp, w(pre + "post_feedforward_layernorm.weight"), eps, True)
        x = x + mlp
    x = _rms_norm(x, w("model.norm.weight"), eps, gemma)
    head_w = tensors.get("lm_head.weight", embed)
    logits = x @ head_w.T
    if softcap is not None:
        logits = np.tanh(logits / softcap) * softcap
    return logits
