"""GGUF checkpoints in: llama.cpp's single-file format -> config, tensors and tokenizer.

A GGUF file holds the architecture as metadata (`llama.block_count`, ...), the weights under
llama.cpp's tensor names (`blk.0.attn_q.weight`, ...), often quantized (Q4_1, Q8_0, ...), and the
tokenizer (vocabulary, merges, special token ids, chat template) as metadata too. `read_gguf`
turns it into what the rest of the package already speaks: a `CausalLMConfig`, tensors under
Hugging Face names and layouts, dequantized to float32 or bfloat16 with `gguf.quants.dequantize`,
and a `Tokenizer`. `convert_gguf` writes them as a Hugging Face directory that
`CausalLM.from_pretrained` and transformers read; `CausalLM.from_pretrained` and `load_gguf` (in
`model.py`) also accept the `.gguf` file itself.

Gemma 3 (`gemma3`, text only) reads as `model_type="gemma3_text"`: llama.cpp stores its norm
weights as `1 + w` (they are put back to transformers' `w`), and fixes in its code what the file
leaves out, which `read_gguf` fixes the same way: every sixth layer global, the others
sliding-window (`gemma3.attention.sliding_window`); RoPE base 10000 on the sliding layers; the
attention scale `1 / sqrt(head_dim)`, except for the 62-layer (27B) model,
`1 / sqrt(hidden_size / head_count)`. Its SentencePiece vocabulary (`tokenizer.ggml.model`
"llama") becomes the tokenizer transformers builds from such a file: byte-fallback BPE, merges
recovered from the vocabulary in file order, spaces written as "▁".

Mistral has no GGUF architecture of its own: llama.cpp writes Mistral checkpoints as `llama`,
without the sliding window, and they load as Llama models.

Two conversions undo what llama.cpp's converter did to Llama checkpoints:

- Llama's q and k projections are stored with the rows of each head interleaved for llama.cpp's
  "normal" rotary layout: row `2j + c` of a head in the file is row `c * H/2 + j` of the Hugging
  Face weight (`c` in {0, 1}, `j < H/2`). `read_gguf` puts them back (per query head for q, per
  key/value head for k). Qwen2 and Qwen3 use the rotate-half layout in both and are not permuted.
- Llama 3.1 / 3.2 RoPE scaling is stored as a `rope_freqs.weight` tensor of per-frequency divisors;
  it is matched against the scalings those releases use.

Reading needs the `gguf` package (`pip install "artifex-grpo[gguf]"`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as _HFTokenizer

from artifex.generative_models.models.causal_lm.config import (
    CausalLMConfig,
    RopeScaling,
    resolve_dtype,
)
from artifex.generative_models.models.causal_lm.hf_io import hf_tensor_map, write_hf_checkpoint
from artifex.generative_models.models.causal_lm.rope import rope_inv_frequencies
from artifex.generative_models.models.causal_lm.tokenizer import Tokenizer
from artifex.generative_models.utils.atomic import (
    TEMP_MARKER,
    atomic_write_json,
    remove_temp_files,
    temp_path,
)

__all__ = [
    "GGUF_ARCHITECTURES",
    "GGUFCheckpoint",
    "convert_gguf",
    "gguf_tokenizer",
    "is_gguf_file",
    "read_gguf",
]

#: GGUF `general.architecture` -> `CausalLMConfig.model_type`.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
}

_MAGIC = b"GGUF"
_TOKEN_CONTROL = 3  # llama.cpp token types: 3 control (special), 4 user-defined (added)
_TOKEN_USER_DEFINED = 4

#: llama.cpp block tensor suffix -> Hugging Face name inside `model.layers.{i}.`.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
#: Gemma 3's four norms per layer (ffn_norm is the norm before the MLP there).
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
#: llama.cpp's Gemma 3 conventions the file does not state (see the module docstring).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10_000.0
_GEMMA3_27B_LAYERS = 62
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ROPE_FREQS = "rope_freqs.weight"

# Pre-tokenizer split patterns of the byte-level BPE vocabularies (llama.cpp's
# `tokenizer.ggml.pre`): Llama 3 groups up to three digits, Qwen2 splits every digit.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
#: Pre-tokenizers that are GPT-2's byte-level split, optionally after isolating each digit.
_GPT2_LIKE = {"default": False, "gpt2": False, "gpt-2": False, "smollm": True}

#: Llama 3.1 / 3.2 RoPE scalings, matched against a file's `rope_freqs.weight`.
_LLAMA3_SCALINGS = (
    RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
    RopeScaling(
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)


def _gguf_package() -> Any:
    """The `gguf` package, or an ImportError that says how to install it."""
    try:
        import gguf as package
    except ImportError as err:
        msg = (
            "reading GGUF files needs the gguf package: pip install 'artifex-grpo[gguf]' "
            "(or pip install gguf)"
        )
        raise ImportError(msg) from err
    return package


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GGUFCheckpoint:
    """What a GGUF file holds, in this package's terms.

    Attributes:
        config: The architecture, `param_dtype` set to the dtype the tensors were read in.
        tensors: `{hf_name: array}` under Hugging Face names and layouts ((out, in) for linear
            weights), exactly the names of `hf_tensor_map(config)`. The mapping is lazy: each
            access dequantizes the tensor from the memory-mapped file (so loading a model holds
            one dequantized tensor at a time on the host).
        tokenizer: The tokenizer built from the file's metadata.
        metadata: The file's scalar and string metadata (`general.name`, `general.file_type`...);
            arrays (the vocabulary) are left out.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import read_gguf
        >>> checkpoint = read_gguf("tests/fixtures/qwen2_tiny.Q8_0.gguf")  # from the repo root
        >>> checkpoint.config.model_type, checkpoint.config.hidden_size, len(checkpoint.tensors)
        ('qwen2', 32, 26)
        >>> checkpoint.tensors["model.embed_tokens.weight"].shape
        (128, 32)
        >>> checkpoint.metadata["qwen2.block_count"], checkpoint.tokenizer.eos_token
        (2, '<|im_end|>')
    """

    config: CausalLMConfig
    tensors: Mapping[str, np.ndarray]
    tokenizer: Tokenizer
    metadata: dict[str, Any]


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is an existing file that starts with the GGUF magic bytes.

    Args:
        path: Any path.

    Returns:
        True for a GGUF file, False otherwise (directories, missing files, other files).

    Examples:
        >>> from artifex.generative_models.models.causal_lm.gguf import is_gguf_file
        >>> is_gguf_file("tests/fixtures/qwen2_tiny")  # a checkpoint directory (repo root)
        False
        >>> is_gguf_file("tests/fixtures/qwen2_tiny.Q8_0.gguf")
        True
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        return False
    with open(p, "rb") as f:
        return f.read(4) == _MAGIC


def _metadata(reader: Any) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """`(scalars, arrays)`: the file's metadata fields by key."""
    package = _gguf_package()
    scalars: dict[str, Any] = {}
    arrays: dict[str, list[Any]] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types and field.types[0] == package.GGUFValueType.ARRAY:
            arrays[key] = list(value)
        else:
            scalars[key] = value
    return scalars, arrays


def _unpermute_rotary(w: np.ndarray, num_heads: int, name: str) -> np.ndarray:
    """Undoes llama.cpp's per-head row interleaving of a Llama q/k weight or bias."""
    rows = w.shape[0]
    if rows % (2 * num_heads):
        msg = f"tensor {name!r}: {rows} rows cannot be split into {num_heads} rotary heads"
        raise ValueError(msg)
    half = rows // num_heads // 2
    x = w.reshape(num_heads, half, 2, *w.shape[1:])
    return np.ascontiguousarray(x.swapaxes(1, 2).reshape(w.shape))


def _match_rope_scaling(factors: np.ndarray, head_dim: int, theta: float, path: str) -> RopeScaling:
    """The Llama 3.x scaling whose frequency divisors are `factors` (`rope_freqs.weight`)."""
    base = rope_inv_frequencies(head_dim, theta, None)
    factors = np.asarray(factors, np.float64).reshape(-1)
    if factors.shape == base.shape:
        for scaling in _LLAMA3_SCALINGS:
            scaled = rope_inv_frequencies(head_dim, theta, scaling)
            if np.allclose(base / scaled, factors, rtol=1e-3, atol=1e-4):
                return scaling
    msg = (
        f"{path}: tensor {_ROPE_FREQS!r} holds RoPE frequency factors that match no supported "
        "scaling (Llama 3.1 / 3.2 'llama3' rope scaling); convert the original checkpoint instead"
    )
    raise ValueError(msg)


def _get(scalars: Mapping[str, Any], key: str, path: str, default: Any = None) -> Any:
    if key in scalars:
        return scalars[key]
    if default is None:
        msg = f"{path}: missing GGUF metadata key {key!r}"
        raise ValueError(msg)
    return default


def _config(
    scalars: Mapping[str, Any],
    arrays: Mapping[str, list[Any]],
    shapes: Mapping[str, tuple[int, ...]],
    rope_factors: np.ndarray | None,
    dtype_name: str,
    path: str,
) -> CausalLMConfig:
    arch = scalars["general.architecture"]
    hidden = int(_get(scalars, f"{arch}.embedding_length", path))
    num_heads = int(_get(scalars, f"{arch}.attention.head_count", path))
    kv_key = f"{arch}.attention.head_count_kv"
    kv = arrays.get(kv_key, scalars.get(kv_key))
    if isinstance(kv, list):  # per-layer counts: only uniform ones are supported
        if len(set(kv)) != 1:
            msg = f"{path}: {arch}.attention.head_count_kv differs between layers ({kv[:8]})"
            raise ValueError(msg)
        kv = kv[0]
    num_kv = num_heads if kv is None else int(kv)
    head_dim = int(scalars.get(f"{arch}.attention.key_length", hidden // num_heads))
    value_dim = int(scalars.get(f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        msg = (
            f"{path}: {arch}.attention.value_length={value_dim} differs from key_length="
            f"{head_dim}; only equal key and value widths are supported"
        )
        raise ValueError(msg)
    rotary = int(scalars.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        msg = (
            f"{path}: {arch}.rope.dimension_count={rotary} is not the head width {head_dim}; "
            "partial rotary embeddings are not supported"
        )
        raise ValueError(msg)
    gemma = arch == "gemma3"
    scaling_type = scalars.get(f"{arch}.rope.scaling.type", "none")
    linear = None
    if gemma and scaling_type == "linear":  # Gemma 3 4B+: the global layers' positions
        linear = RopeScaling(
            factor=float(_get(scalars, f"{arch}.rope.scaling.factor", path)), rope_type="linear"
        )
    elif scaling_type not in ("none", ""):
        msg = (
            f"{path}: {arch}.rope.scaling.type={scaling_type!r} is not supported (only Llama 3.x "
            "scaling, stored as rope_freqs.weight, and Gemma 3's linear scaling)"
        )
        raise ValueError(msg)
    if f"{arch}.expert_count" in scalars:
        msg = f"{path}: mixture-of-experts models ({arch}.expert_count) are not supported"
        raise ValueError(msg)
    theta = float(scalars.get(f"{arch}.rope.freq_base", 10_000.0))
    rope_scaling = (
        None if rope_factors is None else _match_rope_scaling(rope_factors, head_dim, theta, path)
    )
    vocab_size = shapes["model.embed_tokens.weight"][0]
    eos = scalars.get("tokenizer.ggml.eos_token_id")
    num_layers = int(_get(scalars, f"{arch}.block_count", path))
    family: dict[str, Any] = {}
    if gemma:
        rope_scaling = linear
        scalar = hidden / num_heads if num_layers == _GEMMA3_27B_LAYERS else head_dim
        family = {
            "hidden_act": "gelu_pytorch_tanh",
            "sliding_window": int(_get(scalars, f"{arch}.attention.sliding_window", path)),
            "layer_types": tuple(
                "full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention"
                for i in range(num_layers)
            ),
            "rope_local_theta": _GEMMA3_LOCAL_THETA,
            "query_pre_attn_scalar": float(scalar),
        }
    return CausalLMConfig(
        model_type=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(_get(scalars, f"{arch}.feed_forward_length", path)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(_get(scalars, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        tie_word_embeddings="lm_head.weight" not in shapes,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in shapes,
        qk_norm=arch in ("qwen3", "gemma3"),
        max_position_embeddings=int(scalars.get(f"{arch}.context_length", 2048)),
        bos_token_id=_opt_int(scalars.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(eos),
        pad_token_id=_opt_int(scalars.get("tokenizer.ggml.padding_token_id")),
        param_dtype=dtype_name,
        **family,
    )


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _block_names(arch: str) -> dict[str, str]:
    return _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES


def _hf_name(name: str, path: str, arch: str = "llama") -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    blocks = _block_names(arch)
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in blocks:
        return f"model.layers.{parts[1]}.{blocks[parts[2]]}"
    msg = f"{path}: unsupported tensor {name!r} (not part of a {arch} model)"
    raise ValueError(msg)


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    """The llama.cpp name of a Hugging Face tensor name (the inverse of `_hf_name`)."""
    for gguf_name, name in _GLOBAL_NAMES.items():
        if name == hf_name:
            return gguf_name
    _, _, layer, rest = hf_name.split(".", 3)
    suffix = next(k for k, v in _block_names(arch).items() if v == rest)
    return f"blk.{layer}.{suffix}"


def _pre_tokenizer(pre: str | None, path: str) -> Any:
    name = "default" if pre is None else pre
    if name in _GPT2_LIKE:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if not _GPT2_LIKE[name]:
            return byte_level
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    supported = sorted({*_GPT2_LIKE, *_SPLITS})
    msg = (
        f"{path}: unsupported GGUF pre-tokenizer {name!r} (tokenizer.ggml.pre); "
        f"supported: {supported}"
    )
    raise ValueError(msg)


def gguf_tokenizer(
    scalars: Mapping[str, Any], arrays: Mapping[str, list[Any]], path: str = "GGUF file"
) -> Tokenizer:
    """Builds the tokenizer that a GGUF file's metadata describes.

    Byte-level BPE (`tokenizer.ggml.model` "gpt2"): the vocabulary (`tokenizer.ggml.tokens`) and
    merges (`tokenizer.ggml.merges`) make a `tokenizers` BPE model; the pre-tokenizer follows
    `tokenizer.ggml.pre` (GPT-2's split, SmolLM's digit-by-digit variant, Llama 3's or Qwen2's
    pattern; Llama 3 also takes a piece that is a whole vocabulary entry as one token).
    Gemma 3's SentencePiece vocabulary ("llama" in a `gemma3` file) becomes what transformers
    builds from it (`GemmaTokenizer`): a byte-fallback BPE whose merges are recovered from the
    vocabulary, best first in file order (every split of a token into two tokens), spaces
    replaced by "▁" (tokens of spaces only are respelled so), `encode` prepending bos unless
    `tokenizer.ggml.add_bos_token` says otherwise. Control tokens become special added tokens
    and user-defined ones plain added tokens; `tokenizer.ggml.add_bos_token` makes `encode`
    prepend the bos token. The chat template is `tokenizer.chat_template`; eot/eom ids end
    generations too.

    Args:
        scalars: The file's scalar metadata.
        arrays: The file's array metadata.
        path: Name of the file, for error messages.

    Returns:
        The tokenizer.

    Raises:
        ValueError: For a tokenizer other than byte-level BPE (`tokenizer.ggml.model` "gpt2")
            or Gemma 3's SentencePiece, an unsupported pre-tokenizer, or missing or
            inconsistent vocabulary metadata.

    Examples:
        >>> from artifex.generative_models.models.causal_lm.gguf import gguf_tokenizer
        >>> tokens = ["<|endoftext|>", "a", "b", "ab"]
        >>> scalars = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.eos_token_id": 0}
        >>> arrays = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"],
        ...           "tokenizer.ggml.token_type": [3, 1, 1, 1]}  # 3: a control token
        >>> tokenizer = gguf_tokenizer(scalars, arrays, "model.gguf")
        >>> ids = tokenizer.encode("abba<|endoftext|>")
        >>> [tokens[i] for i in ids], tokenizer.decode(ids), tokenizer.eos_ids
        (['ab', 'b', 'a', '<|endoftext|>'], 'abba', (0,))
    """
    kind = scalars.get("tokenizer.ggml.model")
    gemma = kind == "llama" and scalars.get("general.architecture") == "gemma3"
    if kind != "gpt2" and not gemma:
        msg = (
            f"{path}: unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model); only "
            "byte-level BPE ('gpt2', as in Llama 3, Qwen2, Qwen3, SmolLM2) and Gemma 3's "
            "SentencePiece ('llama' in a gemma3 file) are supported"
        )
        raise ValueError(msg)
    tokens = arrays.get("tokenizer.ggml.tokens")
    merges = arrays.get("tokenizer.ggml.merges")
    if not tokens or (merges is None and not gemma):
        msg = f"{path}: missing tokenizer.ggml.tokens or tokenizer.ggml.merges metadata"
        raise ValueError(msg)
    spelled = [_respell_spaces(t) for t in tokens] if gemma else list(tokens)
    vocab = {token: i for i, token in enumerate(spelled)}
    if len(vocab) != len(tokens):
        msg = f"{path}: tokenizer.ggml.tokens has duplicate entries"
        raise ValueError(msg)
    pairs = []
    for merge in [] if merges is None else merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            msg = f"{path}: tokenizer.ggml.merges entry {merge!r} is not two tokens"
            raise ValueError(msg)
        pairs.append((parts[0], parts[1]))
    pre = scalars.get("tokenizer.ggml.pre")
    if gemma:
        unk_id = scalars.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
        bpe = models.BPE(
            vocab=vocab,
            merges=pairs or _merges_from_vocabulary(vocab),
            unk_token=unk or "<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
        backend = _HFTokenizer(bpe)
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:
        # Llama 3 takes a piece that is a whole vocabulary entry as one token, merges or not.
        bpe = models.BPE(
            vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE
        )
        backend = _HFTokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer(pre, path)
        backend.decoder = decoders.ByteLevel()
    types = arrays.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        msg = f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        raise ValueError(msg)
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == _TOKEN_CONTROL
    ]
    added = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == _TOKEN_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(added)

    def token(key: str) -> str | None:
        index = scalars.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            msg = f"{path}: tokenizer.ggml.{key}={index} is outside the vocabulary"
            raise ValueError(msg)
        return tokens[int(index)]

    bos, eos = token("bos_token_id"), token("eos_token_id")
    # A SentencePiece vocabulary without the flag gets bos, as llama.cpp and transformers do.
    add_bos = bool(scalars.get("tokenizer.ggml.add_bos_token", gemma)) and bos is not None
    add_eos = bool(scalars.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        head = [f"{bos}"] if add_bos else []
        tail = [f"{eos}"] if add_eos else []
        single = [*head, "$A", *tail]
        pair = [*single, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)]
        specials = {t: vocab[t] for t in (*head, *tail)}
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=list(specials.items())
        )
    elif not gemma:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    extra = [
        int(scalars[f"tokenizer.ggml.{k}"])
        for k in ("eot_token_id", "eom_token_id")
        if f"tokenizer.ggml.{k}" in scalars
    ]
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=token("padding_token_id"),
        unk_token=token("unknown_token_id"),
        chat_template=scalars.get("tokenizer.chat_template"),
        extra_eos_ids=extra,
    )


def _respell_spaces(token: str) -> str:
    """A token of two or more spaces as Gemma's tokenizer looks it up ("▁▁"), else itself."""
    return "▁" * len(token) if len(token) > 1 and not token.strip(" ") else token


def _merges_from_vocabulary(vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary without merges, as transformers' `generate_merges`.

    Every split of a token into two vocabulary tokens is a merge; a token's merges are ordered by
    the ids of their halves, and all of them best first by the token's place in the file (the
    earlier the better), then by the lengths of the halves, longer first.
    """
    merges = []
    for token, index in vocab.items():
        local = [
            (token[:i], token[i:], -index)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _dequantize(package: Any, t: Any, data: np.ndarray, source: str) -> np.ndarray:
    try:
        x = np.asarray(package.quants.dequantize(data, t.tensor_type))
    except NotImplementedError as err:
        msg = (
            f"{source}: tensor {t.name!r} has type {t.tensor_type.name}, which the installed "
            f"gguf package cannot dequantize ({err})"
        )
        raise ValueError(msg) from err
    if not np.issubdtype(x.dtype, np.floating):
        msg = (
            f"{source}: tensor {t.name!r} has type {t.tensor_type.name}; weights must be "
            "floating point or quantized"
        )
        raise ValueError(msg)
    return x


class _GGUFTensors(Mapping[str, np.ndarray]):
    """Hugging Face name -> tensor, dequantized from the memory-mapped file on each access."""

    def __init__(
        self,
        package: Any,
        reader: Any,
        sources: dict[str, Any],
        shapes: dict[str, tuple[int, ...]],
        config: CausalLMConfig,
        dtype_name: str,
        source: str,
    ) -> None:
        self._package = package
        self._reader = reader  # keeps the memory map open
        self._sources = sources
        self._shapes = shapes
        self._config = config
        self._target = np.dtype(ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.float32)
        self._source = source

    def __getitem__(self, hf_name: str) -> np.ndarray:
        t = self._sources[hf_name]
        x = _dequantize(self._package, t, t.data, self._source).reshape(self._shapes[hf_name])
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        if bad:
            msg = (
                f"{self._source}: tensor {t.name!r} holds {bad} NaN or infinite values (of "
                f"{x.size}): the file is damaged or was written from a diverged model"
            )
            raise ValueError(msg)
        if self._config.norm_unit_offset and hf_name.endswith("norm.weight"):
            x = x.astype(np.float32) - np.float32(1.0)  # llama.cpp stores Gemma's 1 + w
        if self._config.model_type == "llama":
            if ".self_attn.q_proj." in hf_name:
                x = _unpermute_rotary(x, self._config.num_heads, t.name)
            elif ".self_attn.k_proj." in hf_name:
                x = _unpermute_rotary(x, self._config.num_kv_heads, t.name)
        return x.astype(self._target, copy=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __repr__(self) -> str:
        return f"<{len(self)} GGUF tensors of {self._source}, dequantized on access>"


def read_gguf(path: str | os.PathLike[str], *, dtype: str | Any = "float32") -> GGUFCheckpoint:
    """Reads a GGUF file (Llama, Qwen2, Qwen3, Gemma 3) into a config, tensors and a tokenizer.

    Every tensor is dequantized with `gguf.quants.dequantize` (F32, F16, BF16 and the block
    quantizations the installed `gguf` package implements: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, ...),
    renamed to its Hugging Face name, put back in Hugging Face layout (Llama q/k rows
    un-interleaved, see the module docstring) and cast to `dtype`. A file without `output.weight`
    has tied embeddings. Everything is validated here (names, types, shapes of the metadata);
    the tensors themselves are dequantized when `GGUFCheckpoint.tensors` is read, one at a time.

    Args:
        path: The `.gguf` file.
        dtype: "float32" (default) or "bfloat16": the dtype of the returned tensors and the
            config's `param_dtype`.

    Returns:
        A `GGUFCheckpoint`.

    Raises:
        FileNotFoundError: If `path` does not exist.
        ImportError: If the `gguf` package is not installed.
        ValueError: For a file that is not GGUF, an unsupported architecture (naming it), an
            unsupported tensor type (naming the tensor and the type), an unknown tensor, missing
            metadata, or an unsupported tokenizer.

    Examples:
        >>> import numpy as np
        >>> from safetensors.numpy import load_file
        >>> from artifex.generative_models.models.causal_lm import read_gguf
        >>> checkpoint = read_gguf("tests/fixtures/qwen2_tiny.Q8_0.gguf")  # qwen2_tiny in Q8_0
        >>> name = "model.layers.0.mlp.up_proj.weight"
        >>> original = load_file("tests/fixtures/qwen2_tiny/model.safetensors")[name]
        >>> checkpoint.config.model_type, checkpoint.tensors[name].shape, original.shape
        ('qwen2', (64, 32), (64, 32))
        >>> bool(np.abs(checkpoint.tensors[name] - original).max() < 0.01)  # dequantized
        True
    """
    source = os.fspath(path)
    if not os.path.isfile(source):
        msg = f"GGUF file not found: {source!r}"
        raise FileNotFoundError(msg)
    dt = resolve_dtype(dtype)
    package = _gguf_package()
    if not is_gguf_file(source):
        msg = f"{source}: not a GGUF file (it does not start with the GGUF magic bytes)"
        raise ValueError(msg)
    try:
        reader = package.GGUFReader(source, "r")
    except (ValueError, IndexError, KeyError) as err:
        msg = f"{source}: cannot read the GGUF file ({err})"
        raise ValueError(msg) from err
    scalars, arrays = _metadata(reader)
    arch = scalars.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        msg = (
            f"{source}: unsupported GGUF architecture {arch!r} (general.architecture); "
            f"supported: {sorted(GGUF_ARCHITECTURES)}"
        )
        raise ValueError(msg)

    shapes: dict[str, tuple[int, ...]] = {}
    sources: dict[str, Any] = {}
    rope_factors: np.ndarray | None = None
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            rope_factors = np.asarray(package.quants.dequantize(t.data, t.tensor_type))
            continue
        hf_name = _hf_name(t.name, source, arch)
        if hf_name in sources:
            msg = f"{source}: tensor {t.name!r} appears twice"
            raise ValueError(msg)
        sources[hf_name] = t
        shapes[hf_name] = tuple(int(n) for n in reversed(t.shape.tolist()))
    if "model.embed_tokens.weight" not in shapes:
        msg = f"{source}: missing tensor 'token_embd.weight'"
        raise ValueError(msg)
    config = _config(scalars, arrays, shapes, rope_factors, dt.name, source)
    num_tokens = len(arrays.get("tokenizer.ggml.tokens") or ())
    if num_tokens > config.vocab_size:
        msg = (
            f"{source}: the tokenizer has {num_tokens} tokens (tokenizer.ggml.tokens) but "
            f"token_embd.weight has only {config.vocab_size} rows: token ids "
            f"{config.vocab_size}..{num_tokens - 1} would have no embedding; the file's "
            "tokenizer and weights do not belong together"
        )
        raise ValueError(msg)
    expected = hf_tensor_map(config)
    unexpected = sorted(sources[n].name for n in set(sources) - set(expected))
    if unexpected:
        msg = f"{source}: unexpected tensor {unexpected[0]!r} for this {arch} model ({unexpected})"
        raise ValueError(msg)
    missing = sorted(_gguf_name(n, arch) for n in set(expected) - set(sources))
    if missing:
        msg = f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing: {missing[:8]})"
        raise ValueError(msg)
    for t in sources.values():  # every type must dequantize: try each tensor's first row
        _dequantize(package, t, t.data[:1], source)
    tensors = _GGUFTensors(package, reader, sources, shapes, config, dt.name, source)
    tokenizer = gguf_tokenizer(scalars, arrays, source)
    return GGUFCheckpoint(config=config, tensors=tensors, tokenizer=tokenizer, metadata=scalars)


def convert_gguf(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str | Any = "float32",
    max_shard_size: int | str | None = None,
    overwrite: bool = False,
) -> str:
    """Converts a GGUF file into a Hugging Face checkpoint directory.

    Writes `config.json` and `model.safetensors` (dequantized to `dtype`), `generation_config.json`
    (bos / eos / pad ids) and the tokenizer files (`tokenizer.json`, `tokenizer_config.json` with
    the chat template and special tokens), which `CausalLM.from_pretrained`,
    `Tokenizer.from_pretrained` and transformers read.

    The files are written into a temporary directory beside `out_dir`, which then takes
    `out_dir`'s place, so `out_dir` holds exactly the converted model: with `overwrite`, no file
    of the model it held before stays (an old `chat_template.jinja` or weight shard would be
    read with the new weights). A conversion that fails leaves `out_dir` as it was; the
    temporary directory of one that was killed is removed by the next conversion into
    `out_dir`.

    Args:
        path: The `.gguf` file.
        out_dir: Output directory (created if needed): empty or new, or a model directory to
            replace with `overwrite`.
        dtype: "float32" (default) or "bfloat16".
        max_shard_size: Optional largest safetensors shard ("2GB"...); None writes one file.
        overwrite: Replace the model directory `out_dir` holds (the whole directory).

    Returns:
        The output directory.

    Raises:
        FileNotFoundError: If `path` does not exist.
        FileExistsError: `out_dir` is not empty and `overwrite` is off.
        ValueError: As `read_gguf` (also: more tokens than embedding rows, NaN or infinite
            weights), if `out_dir` exists and is not a directory, or if `overwrite` is asked
            for a directory without a `config.json` (not a model directory).

    Examples:
        >>> import os, tempfile
        >>> from artifex.generative_models.models.causal_lm import CausalLM, Tokenizer, convert_gguf
        >>> with tempfile.TemporaryDirectory() as out:
        ...     convert_gguf("tests/fixtures/qwen2_tiny.Q8_0.gguf", out) == out  # from repo root
        ...     sorted(os.listdir(out))
        ...     model, tokenizer = CausalLM.from_pretrained(out), Tokenizer.from_pretrained(out)
        True
        ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json',
         'tokenizer_config.json']
        >>> model.config.model_type, tokenizer.decode(tokenizer.encode("the hello"))
        ('qwen2', 'the hello')
    """
    directory = os.fspath(out_dir)
    if os.path.exists(directory) and not os.path.isdir(directory):
        msg = f"output {directory!r} exists and is not a directory"
        raise ValueError(msg)
    parent, name = os.path.split(os.path.abspath(directory))
    remove_temp_files(parent, target=name)  # staging directories of killed conversions
    if os.path.isdir(directory):
        remove_temp_files(directory)
        held = sorted(n for n in os.listdir(directory) if TEMP_MARKER not in n)
        if held and not overwrite:
            msg = (
                f"output {directory} is not empty ({', '.join(held[:5])}"
                f"{', ...' if len(held) > 5 else ''}): convert into a new or empty directory, "
                "or replace the model there, every file of it, with overwrite=True (--overwrite)"
            )
            raise FileExistsError(msg)
        if held and "config.json" not in held:
            msg = (
                f"output {directory} holds no config.json, so it is not a model directory: "
                "overwrite replaces a model directory only; choose a new or empty directory"
            )
            raise ValueError(msg)
    checkpoint = read_gguf(path, dtype=dtype)
    config = checkpoint.config
    staging = temp_path(directory)
    try:
        os.makedirs(staging)
        write_hf_checkpoint(checkpoint.tensors, config, staging, max_shard_size=max_shard_size)
        eos = config.eos_token_ids + tuple(
            e for e in checkpoint.tokenizer.eos_ids if e not in config.eos_token_ids
        )
        generation = {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": list(eos) if len(eos) > 1 else (eos[0] if eos else None),
            "pad_token_id": config.pad_token_id,
        }
        atomic_write_json(os.path.join(staging, "generation_config.json"), generation)
        checkpoint.tokenizer.save_pretrained(staging)
        _replace_directory(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _replace_directory(new: str, directory: str) -> None:
    """Puts the complete directory ``new`` in the place of ``directory`` (if any)."""
    if not os.path.exists(directory):
        os.rename(new, directory)
        return
    old = temp_path(directory)  # a kill in between leaves it for the next conversion to remove
    try:
        os.rename(directory, old)
    except OSError:  # a mount point, or a directory that cannot be renamed: empty it instead
        for entry in os.listdir(directory):
            full = os.path.join(directory, entry)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.remove(full)
        for entry in os.listdir(new):
            os.replace(os.path.join(new, entry), os.path.join(directory, entry))
        os.rmdir(new)
        return
    os.rename(new, directory)
    shutil.rmtree(old, ignore_errors=True)
