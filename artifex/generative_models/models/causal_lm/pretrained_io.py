"""Loading and saving `CausalLM` checkpoints: Hugging Face directories and GGUF files.

`PretrainedIO`, a base of `CausalLM`, holds `CausalLM.from_pretrained` (a Hugging Face
checkpoint directory or a `.gguf` file, built abstractly and placed tensor by tensor) and
`save_pretrained`; the module-level `from_pretrained` and `load_gguf` stay in
:mod:`~artifex.generative_models.models.causal_lm.model`.

Moved out of :mod:`~artifex.generative_models.models.causal_lm.model` unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Self

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from artifex.generative_models.models.causal_lm.config import resolve_dtype
from artifex.generative_models.models.causal_lm.gguf import GGUFCheckpoint, is_gguf_file, read_gguf
from artifex.generative_models.models.causal_lm.hf_io import (
    load_hf_weights,
    place_tensors,
    read_hf_config,
)
from artifex.generative_models.models.causal_lm.hf_io import save_pretrained as _save_pretrained

__all__ = ["PretrainedIO"]

Rules = Callable[[str, tuple[int, ...]], PartitionSpec]


class PretrainedIO:
    """The checkpoint methods of `CausalLM` (a base class of it): load and save.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import CausalLM
        >>> from artifex.generative_models.models.causal_lm.pretrained_io import PretrainedIO
        >>> model = CausalLM.from_pretrained("tests/fixtures/qwen2_tiny")  # from the repo root
        >>> isinstance(model, PretrainedIO), model(jnp.array([[1, 2, 3]])).shape
        (True, (1, 3, 128))
    """

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        dtype: str | jnp.dtype | None = None,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
    ) -> Self:
        """Loads a Hugging Face checkpoint directory or a GGUF file.

        A directory holds `config.json` (model_type llama, qwen2, qwen3, mistral, gemma3_text or
        qwen3_moe) and
        `model.safetensors` or the shards listed in `model.safetensors.index.json`; a `.gguf`
        file is read with `read_gguf` (dequantized). The model is built abstractly
        (`nnx.eval_shape`, no random weights are drawn) and each tensor, checked against the
        expected shape, cast to the parameter dtype and transposed for linear weights, is placed
        into its variable: on the default device without `mesh`, else with
        `jax.device_put(x, NamedSharding(mesh, rules(path, shape)))`. Tied models need no
        `lm_head.weight`; if present it must equal the embedding.

        Args:
            path: Checkpoint directory or `.gguf` file.
            dtype: Parameter dtype ("float32" / "bfloat16"); None uses the checkpoint's
                (`torch_dtype` bfloat16 -> bfloat16, anything else, GGUF included, -> float32).
            mesh: Optional `jax.sharding.Mesh` to place parameters on.
            rules: Optional `rules(param_path, shape) -> PartitionSpec`, used with `mesh`
                (default: replicated).

        Returns:
            The loaded model.

        Raises:
            FileNotFoundError: If config.json, the safetensors files or the GGUF file are missing.
            ValueError: Naming the tensor, for an unsupported model_type, a missing, unexpected
                or misshapen tensor, or an untied `lm_head.weight` in a tied model; for GGUF,
                naming the unsupported architecture or tensor type.
            TypeError: If `rules` is given without `mesh`.

        Examples:
            >>> from artifex.generative_models.models.causal_lm import CausalLM
            >>> model = CausalLM.from_pretrained("tests/fixtures/qwen2_tiny")  # from the repo root
            >>> model.config.model_type, model.config.num_layers, model.dtype
            ('qwen2', 2, dtype('float32'))
            >>> quantized = CausalLM.from_pretrained("tests/fixtures/qwen2_tiny.Q8_0.gguf")
            >>> quantized.config.model_type, quantized.embed.embedding.shape
            ('qwen2', (128, 32))
        """
        source = os.fspath(path)
        if not os.path.isdir(source) and (source.lower().endswith(".gguf") or is_gguf_file(source)):
            if rules is not None and mesh is None:
                msg = "from_pretrained: rules were given without a mesh; pass mesh= as well"
                raise TypeError(msg)
            checkpoint = read_gguf(source, dtype="float32" if dtype is None else dtype)
            return cls._from_gguf_checkpoint(checkpoint, source, mesh=mesh, rules=rules)
        config = read_hf_config(source)
        if rules is not None and mesh is None:
            msg = "from_pretrained: rules were given without a mesh; pass mesh= as well"
            raise TypeError(msg)
        dt = resolve_dtype(config.param_dtype if dtype is None else dtype)
        config = config.replace(param_dtype=dt.name)
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
        load_hf_weights(model, source, mesh=mesh, rules=rules)
        return model

    @classmethod
    def _from_gguf_checkpoint(
        cls,
        checkpoint: GGUFCheckpoint,
        source: str,
        *,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
    ) -> Self:
        config = checkpoint.config
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
        place_tensors(
            model, checkpoint.tensors.items(), mesh=mesh, rules=rules, source=repr(source)
        )
        return model

    def save_pretrained(
        self, path: str | os.PathLike[str], *, max_shard_size: int | str | None = None
    ) -> None:
        """Writes a Hugging Face checkpoint directory; see `hf_io.save_pretrained`.

        Args:
            path: Output directory (created if needed).
            max_shard_size: Optional shard size limit in bytes (or "5GB"-style string).

        Examples:
            >>> import os, tempfile
            >>> import jax.numpy as jnp
            >>> from artifex.generative_models.models.causal_lm import CausalLM
            >>> model = CausalLM.from_pretrained("tests/fixtures/qwen2_tiny")  # from the repo root
            >>> ids = jnp.array([[1, 2, 3]])
            >>> with tempfile.TemporaryDirectory() as out:
            ...     model.save_pretrained(out)
            ...     files = sorted(os.listdir(out))
            ...     reloaded = CausalLM.from_pretrained(out)
            >>> files, bool(jnp.array_equal(reloaded(ids), model(ids)))
            (['config.json', 'model.safetensors'], True)
        """
        _save_pretrained(self, path, max_shard_size=max_shard_size)
