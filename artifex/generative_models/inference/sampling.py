r"""A compiled KV-cache sampler that draws ``K`` completions per prompt.

Each left-padded prompt is prefilled once; its cache is then repeated for its ``K`` generations
(prompt-major rows: row ``i`` belongs to prompt ``i // K``, generation ``i % K``), and a
``lax.while_loop`` decodes one token per step for all rows until every row has produced an
end-of-sequence token or ``max_new_tokens`` is reached.
The whole generation is one XLA program, compiled once per (batch size, prompt-length bucket,
``max_new_tokens``, number of generations, decoding mode).

This module holds :func:`generate`, :class:`Sampler` and the row groups that decode at the same
time on host threads (:func:`auto_row_groups`). The sampling step and its distribution are in
:mod:`~artifex.generative_models.inference.token_sampling`; the prompt buckets, the position
check and :class:`~artifex.generative_models.inference.batch_layout.SamplerOutput` in
:mod:`~artifex.generative_models.inference.batch_layout`; the compiled decode program in
``_kv_decode`` and the slicing of stacked layers in ``_layer_slices``. Their names stay
importable from here.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.inference._kv_decode import (  # noqa: F401  (old imports)
    _generate,
    _routed,
)
from artifex.generative_models.inference._layer_slices import (  # noqa: F401  (old imports)
    _PER_LAYER_PLANS,
    _layer_slice,
    _per_layer_plan,
    _per_layer_split,
    _runs_stacked_layers_unrolled,
    _sharded_like_stack,
    per_layer_model,
)
from artifex.generative_models.inference.batch_layout import (
    DEFAULT_PROMPT_BUCKETS,
    SamplerOutput,
    _local_rows,
    bucket_length,
    check_fits_positions,
)
from artifex.generative_models.inference.token_sampling import (  # noqa: F401  (old imports)
    _argmax,
    _check_row_slice,
    _inverse_cdf,
    sample_logits,
)
from artifex.generative_models.utils.compile_options import jit
from artifex.generative_models.utils.validation import check_float, check_int

__all__ = [
    "ROW_GROUP_MAX_MATRIX_SIZE",
    "Sampler",
    "auto_row_groups",
    "generate",
]

#: :func:`auto_row_groups` splits the rows only for models whose largest weight matrix (one
#: layer's, for layers stored stacked) has at most this many elements: products that XLA:CPU
#: runs on one core. Measured on a 2-core CPU (``docs/benchmarks.md``, "Decoding in concurrent
#: row groups"): shorter generations up to 1.3 M elements (float32 and bfloat16), none from
#: 3.1 M on.
ROW_GROUP_MAX_MATRIX_SIZE = 2**21


def auto_row_groups(model: nnx.Module, num_prompts: int) -> int:
    """The row groups :func:`generate` runs ``num_prompts`` prompts in when not told.

    More than one only for a model on one CPU device, in one process, whose largest weight matrix
    (per layer, for layers stored stacked) has at most :data:`ROW_GROUP_MAX_MATRIX_SIZE`
    elements: there XLA:CPU runs each decoding product on one core, and groups decoded at the
    same time on host threads use the others. Then the most groups, at most one per CPU core
    this process may run on, that divide ``num_prompts`` into equal groups. Larger products
    already use every core, and groups would only read the weights once more each.

    Args:
        model: The model to sample from.
        num_prompts: The prompts of the batch (``B``).

    Returns:
        A divisor of ``num_prompts``, >= 1.

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.inference import auto_row_groups
        >>> config = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                         num_layers=1, num_heads=2)
        >>> model = CausalLM(config, rngs=nnx.Rngs(0))
        >>> groups = auto_row_groups(model, 8)  # on the CPU: one group per core, up to 8
        >>> groups >= 1 and 8 % groups == 0
        True
        >>> auto_row_groups(model, 1)
        1
    """
    check_int("num_prompts", num_prompts, minimum=1)
    if jax.process_count() != 1:
        return 1
    stacked = bool(getattr(model, "layers_stacked", False))
    largest = 0
    devices: set[Any] = set()
    for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        if not (hasattr(x, "devices") and jnp.issubdtype(x.dtype, jnp.inexact)):
            continue
        devices |= set(x.devices())
        if len(devices) > 1 or {d.platform for d in devices} != {"cpu"}:
            return 1  # on an accelerator, or spread over several devices
        size = x.size
        if stacked and x.ndim and path and getattr(path[0], "key", None) == "layers":
            size //= max(int(x.shape[0]), 1)  # one layer of a stacked weight
        largest = max(largest, size)
    if not largest or largest > ROW_GROUP_MAX_MATRIX_SIZE:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(g for g in range(1, min(cores, num_prompts) + 1) if num_prompts % g == 0)


def _on_one_device(*trees: Any) -> bool:
    """The arrays in ``trees`` run on one device, in a single process.

    Only the arrays committed to devices count: an uncommitted one (made without a device, as
    ``jnp.asarray`` of host data) goes where the committed ones are.
    """
    if jax.process_count() != 1:
        return False
    devices: set[Any] = set()
    for x in jax.tree.leaves(trees):
        if isinstance(x, jax.Array) and (x.committed or len(x.devices()) > 1):
            devices |= set(x.devices())
            if len(devices) > 1:
                return False
    return True


# The row groups' worker threads: (pool, its number of workers, the process that made it).
_ROW_GROUP_POOL: tuple[concurrent.futures.ThreadPoolExecutor, int, int] | None = None
_ROW_GROUP_LOCK = threading.Lock()


def _run_row_groups(run: Callable[..., Any], parts: list[dict[str, Any]]) -> list[Any]:
    """``run(**part)`` for every part: the first on this thread, the others on the pool's.

    Waits for every group before it returns or raises; an error of one group is raised with
    the others' errors as notes.
    """
    global _ROW_GROUP_POOL
    workers = len(parts) - 1
    with _ROW_GROUP_LOCK:  # submitted under the lock: no other call shuts this pool down first
        held = _ROW_GROUP_POOL
        if held is None or held[1] < workers or held[2] != os.getpid():
            # A forked child's copy of the parent's pool has no threads: made anew there.
            pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="artifex-row-group"
            )
            _ROW_GROUP_POOL = (pool, workers, os.getpid())
            if held is not None and held[2] == os.getpid():
                # Its running tasks finish; new ones go to the new pool.
                held[0].shutdown(wait=False)
        pending = [_ROW_GROUP_POOL[0].submit(run, **part) for part in parts[1:]]
    outs: list[Any] = []
    errors: list[BaseException] = []
    try:
        outs.append(run(**parts[0]))
    except Exception as err:
        errors.append(err)
    for future in pending:
        try:
            outs.append(future.result())
        except Exception as err:
            errors.append(err)
    if errors:
        for other in errors[1:]:
            errors[0].add_note(f"another row group failed too: {type(other).__name__}: {other}")
        raise errors[0]
    return outs


@jit
def _concat_rows(outs: list[SamplerOutput]) -> SamplerOutput:
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outs)


def generate(
    model: nnx.Module,
    prompt_ids: jax.Array | np.ndarray,
    prompt_mask: jax.Array | np.ndarray | None = None,
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
    share_prefill: bool = True,
    row_groups: int | None = None,
    record_routing: bool = False,
) -> SamplerOutput:
    """Generates ``num_generations`` completions for each left-padded prompt.

    Arguments are checked on the host before anything is traced.

    Args:
        model: A causal LM (``init_cache``, ``hidden_states``, ``logits_from_hidden``, a
            ``config``).
        prompt_ids: ``(B, P)`` int token ids, left-padded.
        prompt_mask: ``(B, P)`` 1 on real tokens; ``None`` means no padding.
        key: PRNG key; the output is a deterministic function of it.
        num_generations: ``K >= 1`` completions per prompt.
        max_new_tokens: ``N >= 1``, the most tokens generated per completion.
        temperature: ``tau >= 0``; 0 means greedy decoding.
        top_k: Sample among the ``top_k`` most likely tokens only (``None``: all).
        top_p: Nucleus mass in (0, 1]; 1 disables nucleus sampling.
        eos_ids: Token id(s) that end a completion (default: the model config's).
        pad_id: Filler after EOS (default: the config's pad id, else the first EOS id, else 0).
        prompt_buckets: Prompt widths to left-pad to (``None``: no bucketing).
        share_prefill: Prefill each prompt once for all its generations; ``False`` prefills
            every row (for benchmarks).
        row_groups: Run the prompts as this many equal groups at the same time, each with the
            same compiled program on a host thread of its own. The tokens are those of one run
            of the whole batch (each row draws the same random numbers; products over fewer
            rows may round differently). ``None`` (the default):
            :func:`auto_row_groups`. Must divide ``B``; more than one group needs the prompts
            and the model on one device of one process.
        record_routing: Fill ``SamplerOutput.routed_experts`` (mixture-of-experts models).

    Returns:
        A :class:`SamplerOutput` with ``B * K`` rows; row ``i`` belongs to prompt ``i // K``,
        generation ``i % K``.

    Raises:
        ValueError: An empty prompt row, a prompt too long for the model's positions plus
            ``max_new_tokens``, an argument out of its range, mismatched shapes, token ids
            outside the vocabulary, ``row_groups`` that does not divide ``B`` (or is over 1
            for prompts held on several devices), or ``record_routing`` without experts.
        TypeError: Non-integer ``prompt_ids``, or an argument of the wrong type
            (``num_generations=2.0``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.inference import generate
        >>> config = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                         num_layers=1, num_heads=2, eos_token_id=2)
        >>> model = CausalLM(config, rngs=nnx.Rngs(0))
        >>> prompts = jnp.array([[0, 5, 6], [7, 8, 9]])  # left-padded
        >>> mask = jnp.array([[0, 1, 1], [1, 1, 1]])
        >>> out = generate(model, prompts, mask, key=jax.random.key(0), num_generations=2,
        ...                max_new_tokens=4, temperature=0.0)
        >>> out.completion_ids.shape  # rows 0-1 answer prompt 0
        (4, 4)
        >>> bool((out.completion_ids[0] == out.completion_ids[1]).all())  # greedy: equal
        True
    """
    # Across processes the checks see this process's rows (a global array is not fetched).
    ids = _local_rows(prompt_ids)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        msg = f"prompt_ids must have shape (B, P) with B, P >= 1, got {ids.shape}"
        raise ValueError(msg)
    if not np.issubdtype(ids.dtype, np.integer):
        msg = f"prompt_ids must hold integer token ids, got dtype {ids.dtype}"
        raise TypeError(msg)
    mask = np.ones(ids.shape, np.int32) if prompt_mask is None else _local_rows(prompt_mask)
    if mask.shape != ids.shape:
        msg = f"prompt_mask must have the shape of prompt_ids {ids.shape}, got {mask.shape}"
        raise ValueError(msg)
    lengths = mask.astype(bool).sum(axis=1)
    if (lengths == 0).any():
        msg = f"empty prompt: row {int(np.argmin(lengths))} of prompt_mask has no real token"
        raise ValueError(msg)
    check_int("num_generations", num_generations, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_int("top_k", top_k, minimum=1, allow_none=True)
    check_float("top_p", top_p, greater_than=0.0, maximum=1.0)
    check_float("temperature", temperature, minimum=0.0)
    check_int("row_groups", row_groups, minimum=1, allow_none=True)
    if row_groups is not None and ids.shape[0] % row_groups:
        msg = f"row_groups must divide the number of prompts {ids.shape[0]}, got {row_groups}"
        raise ValueError(msg)
    config = getattr(model, "config", None)
    if not isinstance(record_routing, bool):
        msg = f"record_routing must be a bool, got {record_routing!r}"
        raise TypeError(msg)
    if record_routing and not getattr(config, "is_moe", False):
        msg = (
            "record_routing: only mixture-of-experts models route tokens (model_type "
            f"'qwen3_moe'), got {getattr(config, 'model_type', type(model).__name__)!r}"
        )
        raise ValueError(msg)
    check_fits_positions(model, int(lengths.max()), max_new_tokens)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        real = np.where(mask.astype(bool), ids, 0)
        if real.min() < 0 or real.max() >= vocab:
            row = int(np.argwhere((real < 0) | (real >= vocab))[0][0])
            msg = (
                f"prompt_ids must hold token ids in [0, {vocab}) (the model's vocabulary), got "
                f"[{int(real.min())}, {int(real.max())}] (first bad row {row}): check that the "
                "tokenizer matches the model"
            )
            raise ValueError(msg)
    if eos_ids is None:
        eos_ids = getattr(config, "eos_token_id", None)
    if eos_ids is None:
        eos = ()
    elif isinstance(eos_ids, int | np.integer):
        eos = (int(eos_ids),)
    else:
        eos = tuple(int(e) for e in eos_ids)
    if pad_id is None:
        pad_id = getattr(config, "pad_token_id", None)
        if pad_id is None:
            pad_id = eos[0] if eos else 0

    # Device arrays stay where they are (a batch sharded over a mesh stays sharded, so the
    # generation runs data-parallel); host arrays are uploaded.
    dev_ids = jnp.asarray(prompt_ids if isinstance(prompt_ids, jax.Array) else ids, jnp.int32)
    if prompt_mask is None and isinstance(prompt_ids, jax.Array):
        dev_mask = jnp.ones_like(dev_ids)  # same layout as the ids (also across processes)
    else:
        dev_mask = jnp.asarray(
            prompt_mask if isinstance(prompt_mask, jax.Array) else mask, jnp.int32
        )
    # Left-pad to the prompt-length bucket (padding never changes a row's result).
    width = ids.shape[1] if prompt_buckets is None else bucket_length(ids.shape[1], prompt_buckets)
    if width > ids.shape[1]:
        extra = width - ids.shape[1]
        dev_ids = jnp.pad(dev_ids, ((0, 0), (extra, 0)), constant_values=pad_id)
        dev_mask = jnp.pad(dev_mask, ((0, 0), (extra, 0)))
    # Checked before `_per_layer_split` slices stacked layers (nothing runs for a refusal).
    one_device = _on_one_device(nnx.state(model), dev_ids, dev_mask)
    if row_groups is None:
        groups = auto_row_groups(model, ids.shape[0]) if one_device else 1
    elif row_groups > 1 and not one_device:
        msg = (
            f"row_groups={row_groups} needs the prompts and the model on one device of one "
            "process; they are placed on several devices or processes (leave row_groups=None, "
            "or 1)"
        )
        raise ValueError(msg)
    else:
        groups = row_groups
    graphdef, state = _per_layer_split(model)
    greedy = temperature == 0
    run = functools.partial(
        _generate,
        graphdef,
        state,
        key=key,
        temperature=jnp.asarray(1.0 if greedy else temperature, jnp.float32),
        top_p=jnp.asarray(top_p, jnp.float32),
        num_generations=int(num_generations),
        max_new_tokens=int(max_new_tokens),
        top_k=top_k,
        use_top_p=top_p < 1.0,
        greedy=greedy,
        eos_ids=eos,
        pad_id=int(pad_id),
        share_prefill=share_prefill,
        batch_rows=int(dev_ids.shape[0]) * int(num_generations),  # global rows
        record_routing=record_routing,
    )
    if groups == 1:
        return run(prompt_ids=dev_ids, prompt_mask=dev_mask, row_offset=np.int32(0))
    per = ids.shape[0] // groups
    parts = [
        dict(
            prompt_ids=dev_ids[g * per : (g + 1) * per],
            prompt_mask=dev_mask[g * per : (g + 1) * per],
            row_offset=np.int32(g * per * num_generations),
        )
        for g in range(groups)
    ]
    # The first call of a shape compiles once (JAX lets concurrent callers wait for one
    # compilation).
    return _concat_rows(_run_row_groups(run, parts))


class Sampler:
    """Holds a model and decoding settings; ``sampler(prompts, mask, key=...)`` generates.

    A thin stateful shell over :func:`generate` for training loops: the model object is read at
    each call, so updates made by a trainer are seen by the next generation.

    Args:
        model: The causal LM.
        num_generations: Completions per prompt ``K``.
        max_new_tokens: Most tokens per completion.
        temperature: Sampling temperature (0 = greedy).
        top_k: Optional top-k.
        top_p: Nucleus mass (1 disables).
        eos_ids: End-of-sequence ids (default: the model config's).
        pad_id: Filler after EOS (default: the model config's pad id).
        prompt_buckets: Prompt widths to pad to.
        row_groups: Groups of prompts decoded at the same time (``None``:
            :func:`auto_row_groups`; see :func:`generate`).
        record_routing: Record the routed experts of mixture-of-experts models (see
            :func:`generate`).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
        >>> from artifex.generative_models.inference import Sampler
        >>> config = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                         num_layers=1, num_heads=2, eos_token_id=2)
        >>> model = CausalLM(config, rngs=nnx.Rngs(0))
        >>> sampler = Sampler(model, num_generations=3, max_new_tokens=5)
        >>> out = sampler(jnp.array([[4, 5]]), key=jax.random.key(1))
        >>> out.completion_ids.shape, out.log_probs.dtype
        ((3, 5), dtype('float32'))
        >>> out = sampler(jnp.array([[4, 5]]), key=jax.random.key(1), max_new_tokens=2)
        >>> out.completion_ids.shape
        (3, 2)
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        num_generations: int = 1,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        eos_ids: Sequence[int] | int | None = None,
        pad_id: int | None = None,
        prompt_buckets: Sequence[int] | None = DEFAULT_PROMPT_BUCKETS,
        row_groups: int | None = None,
        record_routing: bool = False,
    ):
        self.model = model
        self.settings = dict(
            num_generations=num_generations,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_ids=eos_ids,
            pad_id=pad_id,
            prompt_buckets=prompt_buckets,
            row_groups=row_groups,
            record_routing=record_routing,
        )

    def __call__(
        self,
        prompt_ids: jax.Array | np.ndarray,
        prompt_mask: jax.Array | np.ndarray | None = None,
        *,
        key: jax.Array,
        **overrides: Any,
    ) -> SamplerOutput:
        """Generates completions (see :func:`generate`).

        Args:
            prompt_ids: ``(B, P)`` left-padded prompt ids.
            prompt_mask: ``(B, P)`` mask, or ``None``.
            key: PRNG key.
            **overrides: Per-call changes to the settings.

        Returns:
            A :class:`SamplerOutput`.
        """
        return generate(
            self.model, prompt_ids, prompt_mask, key=key, **{**self.settings, **overrides}
        )
