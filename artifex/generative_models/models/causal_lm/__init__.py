"""Decoder-only causal language models (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE) in Flax NNX.

Config, modules, KV cache, LoRA adapters (in and out of PEFT's format), Hugging Face safetensors
load/save, GGUF import, sequence classification (reward models) and the tokenizer.
"""

from __future__ import annotations

from artifex.generative_models.models.causal_lm.attention_ops import SharedPrefixMask

# Model, cache and building blocks
from artifex.generative_models.models.causal_lm.cache import KVCache

# Tokenizer
from artifex.generative_models.models.causal_lm.chat_template import render_chat_template

# Configuration
from artifex.generative_models.models.causal_lm.config import (
    SUPPORTED_MODEL_TYPES,
    CausalLMConfig,
    RopeScaling,
)

# GGUF checkpoints
from artifex.generative_models.models.causal_lm.gguf import (
    GGUFCheckpoint,
    convert_gguf,
    read_gguf,
)

# Hugging Face checkpoints
from artifex.generative_models.models.causal_lm.hf_io import (
    hf_tensor_map,
    param_path_str,
    save_pretrained,
    to_hf_tensors,
)
from artifex.generative_models.models.causal_lm.layer_storage import LayerStack

# LoRA
from artifex.generative_models.models.causal_lm.lora import (
    BASE_FILTER,
    LORA_FILTER,
    LORA_TARGETS,
    LoRAAdapter,
    LoRAConfig,
    apply_lora,
    lora_state,
    merge_lora,
    zero_lora_state,
)
from artifex.generative_models.models.causal_lm.lora_experts import ExpertLoRAAdapter
from artifex.generative_models.models.causal_lm.model import (
    CausalLM,
    from_pretrained,
    load_gguf,
    resolve_dtype,
)
from artifex.generative_models.models.causal_lm.modules import (
    MLP,
    Attention,
    DecoderLayer,
    Embed,
    Linear,
    RMSNorm,
)

# Mixture of experts
from artifex.generative_models.models.causal_lm.moe import (
    EXPERT_AXIS,
    Experts,
    MoEDecoderLayer,
    RouterTrace,
    SparseMoeBlock,
    expert_mlp,
    load_balancing_loss,
    route_tokens,
    routing_agreement,
)

# PEFT adapters
from artifex.generative_models.models.causal_lm.peft_io import (
    load_peft_adapter,
    read_peft_adapter,
    save_peft_adapter,
)
from artifex.generative_models.models.causal_lm.positions import positions_from_mask
from artifex.generative_models.models.causal_lm.rope import (
    apply_rope,
    rope_cos_sin,
    rope_inv_frequencies,
)

# Sequence classification (reward models)
from artifex.generative_models.models.causal_lm.sequence_classification import (
    CausalLMForSequenceClassification,
    last_token_index,
)
from artifex.generative_models.models.causal_lm.tokenizer import Tokenizer

__all__ = [  # noqa: RUF022 - grouped by topic, sorted within each group
    # Configuration
    "SUPPORTED_MODEL_TYPES",
    "CausalLMConfig",
    "RopeScaling",
    # Model, cache and building blocks
    "MLP",
    "Attention",
    "CausalLM",
    "DecoderLayer",
    "Embed",
    "KVCache",
    "LayerStack",
    "Linear",
    "RMSNorm",
    "SharedPrefixMask",
    "apply_rope",
    "positions_from_mask",
    "resolve_dtype",
    "rope_cos_sin",
    "rope_inv_frequencies",
    # Mixture of experts
    "EXPERT_AXIS",
    "Experts",
    "MoEDecoderLayer",
    "RouterTrace",
    "SparseMoeBlock",
    "expert_mlp",
    "load_balancing_loss",
    "route_tokens",
    "routing_agreement",
    # Hugging Face checkpoints
    "from_pretrained",
    "hf_tensor_map",
    "param_path_str",
    "save_pretrained",
    "to_hf_tensors",
    # GGUF checkpoints
    "GGUFCheckpoint",
    "convert_gguf",
    "load_gguf",
    "read_gguf",
    # LoRA
    "BASE_FILTER",
    "LORA_FILTER",
    "LORA_TARGETS",
    "ExpertLoRAAdapter",
    "LoRAAdapter",
    "LoRAConfig",
    "apply_lora",
    "lora_state",
    "merge_lora",
    "zero_lora_state",
    # PEFT adapters
    "load_peft_adapter",
    "read_peft_adapter",
    "save_peft_adapter",
    # Sequence classification (reward models)
    "CausalLMForSequenceClassification",
    "last_token_index",
    # Tokenizer
    "Tokenizer",
    "render_chat_template",
]
