"""The mapping between `CausalLMConfig` and Hugging Face `config.json` dictionaries.

`from_hf_config` and `to_hf_config` are the bodies of
:meth:`~artifex.generative_models.models.causal_lm.config.CausalLMConfig.from_hf_config` and
:meth:`~artifex.generative_models.models.causal_lm.config.CausalLMConfig.to_hf_config` (documented
there), with the helpers that read the Qwen3-MoE fields and one RoPE parameter mapping.

Moved out of :mod:`~artifex.generative_models.models.causal_lm.config` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from artifex.generative_models.models.causal_lm.config_types import (
    _GEMMA3_PATTERN,
    ACTIVATIONS,
    LAYER_TYPES,
    SUPPORTED_MODEL_TYPES,
    RopeScaling,
)


def from_hf_config(cls: type, d: Mapping[str, Any]) -> Any:
    """Builds a `cls` config from a Hugging Face `config.json` dictionary.

    Args:
        cls: The config class to build (`CausalLMConfig` or a subclass).
        d: The parsed `config.json`.

    Returns:
        The config, a `cls`.

    Raises:
        ValueError: As `CausalLMConfig.from_hf_config` documents.
    """
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = (
            " (multimodal Gemma 3, Gemma3ForConditionalGeneration; only the text-only "
            "'gemma3_text' is supported)"
            if model_type == "gemma3"
            else ""
        )
        msg = (
            f"model_type: unsupported architecture {model_type!r}{hint}; expected one of "
            f"{sorted(SUPPORTED_MODEL_TYPES)}"
        )
        raise ValueError(msg)
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        if key not in d:
            msg = f"config.json ({model_type}): missing required key {key!r}"
            raise ValueError(msg)
    gemma = model_type == "gemma3_text"
    if gemma:
        act_key = "hidden_activation" if "hidden_activation" in d else "hidden_act"
        act = d.get(act_key) or "gelu_pytorch_tanh"
    else:
        act_key, act = "hidden_act", d.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        msg = f"{act_key}: only {ACTIVATIONS} are supported, got {act!r}"
        raise ValueError(msg)
    if d.get("mlp_bias", False):
        msg = "mlp_bias: MLP biases are not supported, got True"
        raise ValueError(msg)
    if d.get("use_sliding_window", False):
        msg = "use_sliding_window: sliding-window attention is not supported, got True"
        raise ValueError(msg)
    if d.get("pretraining_tp", 1) not in (1, None):
        msg = f"pretraining_tp: only 1 is supported, got {d.get('pretraining_tp')!r}"
        raise ValueError(msg)

    family: dict[str, Any] = {}
    rope_params = d.get("rope_parameters")
    if gemma:
        for key in ("use_bidirectional_attention", "attn_logit_softcapping"):
            if d.get(key):
                msg = (
                    f"{key}: not supported, got {d[key]!r} (transformers' Gemma3ForCausalLM "
                    "does not apply attn_logit_softcapping; bidirectional attention is for "
                    "embedding models)"
                )
                raise ValueError(msg)
        if isinstance(rope_params, Mapping) and any(t in rope_params for t in LAYER_TYPES):
            global_d = rope_params.get("full_attention") or {}
            local_d = rope_params.get("sliding_attention") or {}
        else:
            global_d = {"rope_theta": d.get("rope_theta"), **(d.get("rope_scaling") or {})}
            local_d = {"rope_theta": d.get("rope_local_base_freq")}
        rope_theta, rope_scaling = _rope_entry(global_d, 1_000_000.0, "rope_parameters")
        local_theta, local_scaling = _rope_entry(local_d, 10_000.0, "rope_parameters")
        if local_scaling is not None:
            msg = (
                "rope_parameters['sliding_attention']: RoPE scaling of the sliding-window "
                f"layers is not supported, got {dict(local_d)}"
            )
            raise ValueError(msg)
        layer_types = d.get("layer_types")
        if layer_types is None:
            pattern = int(d.get("sliding_window_pattern") or _GEMMA3_PATTERN)
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(int(d["num_hidden_layers"]))
            ]
        scalar = d.get("query_pre_attn_scalar", 256)
        family = {
            "sliding_window": d.get("sliding_window", 4096),
            "layer_types": tuple(layer_types),
            "rope_local_theta": float(local_theta),
            "query_pre_attn_scalar": None if scalar is None else float(scalar),
            "final_logit_softcapping": d.get("final_logit_softcapping"),
        }
    else:
        legacy = {"rope_theta": d.get("rope_theta"), **(d.get("rope_scaling") or {})}
        if isinstance(rope_params, Mapping):
            legacy = {**legacy, **rope_params}
        rope_theta, rope_scaling = _rope_entry(legacy, 10_000.0, "rope_scaling")
        if model_type == "mistral":
            family = {"sliding_window": d.get("sliding_window")}
        elif model_type == "qwen3_moe":
            family = _moe_fields(d)

    num_heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    head_dim = d.get("head_dim") or hidden // num_heads
    dtype_name = d.get("torch_dtype", d.get("dtype"))
    param_dtype = "bfloat16" if dtype_name == "bfloat16" else "float32"
    # Qwen2 hard-codes q/k/v biases and Mistral none; the others read attention_bias.
    attention_bias = model_type == "qwen2" or (
        model_type != "mistral" and bool(d.get("attention_bias", False))
    )
    eos = d.get("eos_token_id")
    return cls(
        model_type=model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
        attention_bias=attention_bias,
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        hidden_act=act,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        initializer_range=float(d.get("initializer_range", 0.02)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=d.get("pad_token_id"),
        param_dtype=param_dtype,
        **family,
    )


def to_hf_config(config: Any) -> dict[str, Any]:
    """Returns a `config.json` dictionary of `config` that transformers reads back.

    Args:
        config: The `CausalLMConfig`.

    Returns:
        A JSON-serialisable dict with `architectures` and `model_type` set.
    """
    eos = (
        list(config.eos_token_id) if isinstance(config.eos_token_id, tuple) else config.eos_token_id
    )
    out: dict[str, Any] = {
        "architectures": [SUPPORTED_MODEL_TYPES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else config.rope_scaling.to_dict(),
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": config.param_dtype,
        "use_cache": True,
    }
    if config.model_type == "llama":
        out["attention_bias"] = config.attention_bias
        out["mlp_bias"] = False
        out["pretraining_tp"] = 1
    elif config.model_type == "qwen2":
        out["use_sliding_window"] = False
        out["sliding_window"] = None
        out["max_window_layers"] = config.num_layers
    elif config.model_type == "qwen3":
        out["attention_bias"] = config.attention_bias
        out["use_sliding_window"] = False
        out["sliding_window"] = None
        out["max_window_layers"] = config.num_layers
    elif config.model_type == "mistral":
        out["sliding_window"] = config.sliding_window
    elif config.model_type == "qwen3_moe":
        out["attention_bias"] = config.attention_bias
        out["use_sliding_window"] = False
        out["sliding_window"] = None
        out["max_window_layers"] = config.num_layers
        out["num_experts"] = config.num_experts
        out["num_experts_per_tok"] = config.num_experts_per_tok
        out["moe_intermediate_size"] = config.moe_intermediate_size
        out["norm_topk_prob"] = config.norm_topk_prob
        out["router_aux_loss_coef"] = config.router_aux_loss_coef
        out["decoder_sparse_step"] = 1
        out["mlp_only_layers"] = []
        out["output_router_logits"] = False
    else:  # gemma3_text
        out["hidden_activation"] = out.pop("hidden_act")
        out["attention_bias"] = config.attention_bias
        out["rope_local_base_freq"] = config.rope_local_theta
        out["sliding_window"] = config.sliding_window
        out["layer_types"] = list(config.layer_types)
        scalar = config.query_pre_attn_scalar  # transformers' field is an int
        out["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
        out["final_logit_softcapping"] = config.final_logit_softcapping
        out["attn_logit_softcapping"] = None
        out["use_bidirectional_attention"] = False
    return out


def _moe_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """The Qwen3-MoE fields of a `config.json`; refuses dense layers among the sparse ones.

    The expert count is `num_experts` (Hub checkpoints) or `num_local_experts` (transformers 5).
    """
    mlp_only = d.get("mlp_only_layers") or []
    step = d.get("decoder_sparse_step", 1)
    if mlp_only or step not in (1, None):
        msg = (
            "mlp_only_layers / decoder_sparse_step: only models whose every layer is sparse are "
            f"supported (mlp_only_layers=[], decoder_sparse_step=1), got mlp_only_layers="
            f"{list(mlp_only)}, decoder_sparse_step={step!r}"
        )
        raise ValueError(msg)
    experts = d.get("num_experts", d.get("num_local_experts"))
    for key, value in (
        ("num_experts", experts),
        ("num_experts_per_tok", d.get("num_experts_per_tok")),
        ("moe_intermediate_size", d.get("moe_intermediate_size")),
    ):
        if value is None:
            msg = f"config.json (qwen3_moe): missing required key {key!r}"
            raise ValueError(msg)
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(d["num_experts_per_tok"]),
        "moe_intermediate_size": int(d["moe_intermediate_size"]),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "router_aux_loss_coef": float(d.get("router_aux_loss_coef", 0.001)),
    }


def _rope_entry(
    d: Mapping[str, Any], default_theta: float, key: str
) -> tuple[float, RopeScaling | None]:
    """`(theta, scaling)` of one RoPE parameter mapping (legacy keys merged into it)."""
    theta = d.get("rope_theta")
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type in (None, "default"):
        scaling = None
    elif rope_type in ("llama3", "linear"):
        scaling = RopeScaling.from_dict(d)
    else:
        msg = f"{key}: unsupported rope_type {rope_type!r}; supported: 'llama3', 'linear'"
        raise ValueError(msg)
    return float(default_theta if theta is None else theta), scaling
