"""The tokenizer a GGUF file's metadata describes (`gguf_tokenizer`).

Byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen2, Qwen3, SmolLM2)
with the pre-tokenizer `tokenizer.ggml.pre` names, and Gemma 3's SentencePiece vocabulary as the
byte-fallback BPE transformers builds from it (merges recovered from the vocabulary). `read_gguf`
(in `artifex.generative_models.models.causal_lm.gguf`) calls it on the file's metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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

from artifex.generative_models.models.causal_lm.tokenizer import Tokenizer

__all__ = ["gguf_tokenizer"]

_TOKEN_CONTROL = 3  # llama.cpp token types: 3 control (special), 4 user-defined (added)
_TOKEN_USER_DEFINED = 4

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
        >>> from artifex.generative_models.models.causal_lm.gguf_vocab import gguf_tokenizer
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
