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

The reading is split by concern: `gguf_tensors` (the file, its metadata fields, tensor names,
dequantization), `gguf_config` (metadata -> `CausalLMConfig`) and `gguf_vocab` (the tokenizer);
this module puts them together (`read_gguf`) and writes Hugging Face directories
(`convert_gguf`). Their names stay importable from here.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from artifex.generative_models.models.causal_lm.config import CausalLMConfig, resolve_dtype
from artifex.generative_models.models.causal_lm.gguf_config import (
    _ROPE_FREQS,
    GGUF_ARCHITECTURES,
    _config,
)
from artifex.generative_models.models.causal_lm.gguf_tensors import (
    _dequantize,
    _gguf_name,
    _gguf_package,
    _GGUFTensors,
    _hf_name,
    _metadata,
    is_gguf_file,
)
from artifex.generative_models.models.causal_lm.gguf_vocab import gguf_tokenizer
from artifex.generative_models.models.causal_lm.hf_io import hf_tensor_map, write_hf_checkpoint
from artifex.generative_models.models.causal_lm.tokenizer import Tokenizer
from artifex.generative_models.utils.atomic import (
    TEMP_MARKER,
    atomic_write_json,
    remove_temp_files,
    temp_path,
)

__all__ = [
    "GGUFCheckpoint",
    "convert_gguf",
    "read_gguf",
]


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
