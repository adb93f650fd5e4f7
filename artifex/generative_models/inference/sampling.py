r"""A compiled KV-cache sampler that draws ``K`` completions per prompt.

Each left-padded prompt is prefilled once; its cache is then repeated for its ``K`` generations
(prompt-major rows: row ``i`` belongs to prompt ``i // K``, generation ``i % K``), and a
``lax.while_loop`` decodes one token per step for all rows until every row has produced an
end-of-sequence token or ``max_new_tokens`` is reached.
The whole generation is one XLA program, compiled once per (batch size, prompt-length bucket,
``max_new_tokens``, number of generations, decoding mode).

Sampling distribution at each step, from the model's float32 logits ``z``:

.. math::

    \pi(v) \propto \exp(z_v / \tau)\ \ \text{for } v \in \mathcal{A},

where ``tau`` is the temperature and ``A`` the allowed set: all tokens, or the ``top_k`` largest
logits, intersected with the top-p nucleus (the smallest set of most likely tokens whose
probability reaches ``top_p``; Holtzman et al., 2020). The returned log-probs are
``log pi(token)`` under exactly this distribution, so for ``top_k=None, top_p=1`` they equal the
teacher-forced ``log_softmax(z / tau)`` of the sampled tokens. Greedy decoding picks ``argmax z``
and reports ``log_softmax(z / tau)`` of that token.

References:
    Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration", arXiv:1904.09751.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from artifex.generative_models.utils.compile_options import jit
from artifex.generative_models.utils.validation import check_float, check_int

__all__ = [
    "DEFAULT_PROMPT_BUCKETS",
    "ROW_GROUP_MAX_MATRIX_SIZE",
    "Sampler",
    "SamplerOutput",
    "auto_row_groups",
    "bucket_length",
    "check_fits_positions",
    "generate",
    "sample_logits",
]

DEFAULT_PROMPT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

#: :func:`auto_row_groups` splits the rows only for models whose largest weight matrix (one
#: layer's, for layers stored stacked) has at most this many elements: products that XLA:CPU
#: runs on one core. Measured on a 2-core CPU (``docs/benchmarks.md``, "Decoding in concurrent
#: row groups"): shorter generations up to 1.3 M elements (float32 and bfloat16), none from
#: 3.1 M on.
ROW_GROUP_MAX_MATRIX_SIZE = 2**21


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Completions in prompt-major, generation-minor order (row ``i``: prompt ``i // K``).

    Attributes:
        prompt_ids: ``(B*K, P)`` the left-padded prompts (padded to their length bucket),
            repeated for each generation.
        prompt_mask: ``(B*K, P)`` 1 on real prompt tokens.
        completion_ids: ``(B*K, N)`` generated tokens; ``pad_id`` after a row's EOS.
        completion_mask: ``(B*K, N)`` int32, 1 on generated tokens up to and including EOS.
        log_probs: ``(B*K, N)`` float32 log-prob of each generated token under the sampling
            distribution (0 where the mask is 0).
        truncated: ``(B*K,)`` bool, True for rows that reached ``max_new_tokens`` without EOS.
        lengths: ``(B*K,)`` int32 number of completion tokens (the mask's row sums).
        routed_experts: With ``generate(..., record_routing=True)`` (mixture-of-experts models):
            ``(B*K, P + N, L, k)`` int32, the ``k`` experts each of the ``L`` layers computed
            every prompt and completion token by, as the tokens went through the model (-1
            where a token was not computed as a real token: prompt padding, the last
            completion token, tokens after EOS); else ``None``.

    Examples:
        >>> import dataclasses
        >>> from artifex.generative_models.inference import SamplerOutput
        >>> [f.name for f in dataclasses.fields(SamplerOutput)][:4]
        ['prompt_ids', 'prompt_mask', 'completion_ids', 'completion_mask']
    """

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    completion_ids: jax.Array
    completion_mask: jax.Array
    log_probs: jax.Array
    truncated: jax.Array
    lengths: jax.Array
    routed_experts: jax.Array | None = None


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS) -> int:
    """The smallest bucket >= ``length`` (``length`` itself beyond the largest bucket).

    Args:
        length: A prompt width.
        buckets: Increasing bucket sizes.

    Returns:
        The padded width.

    Examples:
        >>> from artifex.generative_models.inference import bucket_length
        >>> bucket_length(5, (16, 32)), bucket_length(20, (16, 32)), bucket_length(40, (16, 32))
        (16, 32, 40)
    """
    for b in sorted(buckets):
        if b >= length:
            return int(b)
    return int(length)


def check_fits_positions(model: Any, longest_prompt: int, max_new_tokens: int) -> None:
    """Raises unless the longest prompt plus ``max_new_tokens`` fits the model's positions.

    Args:
        model: The model; its ``config.max_position_embeddings`` (if any) is the limit.
        longest_prompt: Tokens of the longest prompt (without padding).
        max_new_tokens: Tokens to generate.

    Raises:
        ValueError: Naming both lengths and the limit.

    Examples:
        >>> from types import SimpleNamespace
        >>> from artifex.generative_models.inference.sampling import check_fits_positions
        >>> model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8))
        >>> check_fits_positions(model, 5, 3)  # 8 positions: fits
    """
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_pos is not None and longest_prompt + max_new_tokens > max_pos:
        msg = (
            f"prompt too long: the longest prompt has {longest_prompt} tokens and "
            f"max_new_tokens={max_new_tokens}, but the model has {max_pos} positions "
            f"(max_position_embeddings)"
        )
        raise ValueError(msg)


def _argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, -1)`` (first index of the maximum) as two plain reductions.

    XLA:CPU lowers ``argmax`` to a variadic (value, index) reduce that runs several times slower
    than a max followed by a min over matching indices; this runs once per generated token.
    """
    v = x.shape[-1]
    hit = x == jnp.max(x, axis=-1, keepdims=True)
    idx = jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    return jnp.minimum(idx, v - 1).astype(jnp.int32)  # all-NaN rows: a valid id, never v


def sample_logits(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    top_k: int | None = None,
    top_p: float | jax.Array | None = None,
    greedy: bool = False,
    batch_rows: int | None = None,
    row_offset: int | jax.Array = 0,
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row and returns it with its log-prob under the sampling distribution.

    Args:
        logits: ``(R, V)`` float logits.
        key: PRNG key.
        temperature: ``tau > 0`` dividing the logits.
        top_k: Keep only the ``top_k`` largest logits (static), or ``None``.
        top_p: Nucleus mass in (0, 1], or ``None`` for no nucleus truncation.
        greedy: Take the argmax instead of sampling (static).
        batch_rows: For ``logits`` that are rows ``row_offset .. row_offset + R`` of a batch of
            ``batch_rows`` rows (static; ``None``: ``R``, the whole batch): the rows draw the
            random numbers they would draw in that batch, so a batch sampled in slices
            samples as it would whole.
        row_offset: The first row's index in that batch (0 without ``batch_rows``). A traced
            offset must be an integer scalar; its value is not checked and must lie in
            ``[0, batch_rows - R]``.

    Raises:
        ValueError: ``batch_rows`` smaller than ``R``, or a concrete ``row_offset`` outside
            ``[0, batch_rows - R]`` (other than 0 without ``batch_rows``).
        TypeError: A ``row_offset`` that is not an integer scalar.

    Returns:
        ``(tokens (R,) int32, log_probs (R,) float32)``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from artifex.generative_models.inference import sample_logits
        >>> logits = jnp.array([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
        >>> tokens, logp = sample_logits(logits, jax.random.key(0), greedy=True)
        >>> tokens.tolist()
        [1, 0]
        >>> tokens, logp = sample_logits(logits, jax.random.key(0), top_k=1)
        >>> tokens.tolist(), logp.tolist()
        ([1, 0], [0.0, 0.0])
    """
    n_rows = int(np.shape(logits)[0])
    _check_row_slice(n_rows, n_rows if batch_rows is None else batch_rows, row_offset)
    z = jnp.asarray(logits, jnp.float32) / jnp.asarray(temperature, jnp.float32)
    if greedy:
        token = _argmax(z)
        logp = jax.nn.log_softmax(z, axis=-1)
        return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
    neg = jnp.finfo(jnp.float32).min
    if top_k is not None and top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, top_k)[0][:, -1:]
        z = jnp.where(z >= kth, z, neg)
    if top_p is not None:
        order = jnp.argsort(-z, axis=-1)
        sorted_z = jnp.take_along_axis(z, order, axis=-1)
        probs = jax.nn.softmax(sorted_z, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        keep_sorted = before < jnp.asarray(top_p, jnp.float32)
        keep_sorted = keep_sorted.at[:, 0].set(True)
        row_ids = jnp.arange(z.shape[0])[:, None]
        keep = jnp.zeros(z.shape, jnp.bool_).at[row_ids, order].set(keep_sorted)
        z = jnp.where(keep, z, neg)
    logp = jax.nn.log_softmax(z, axis=-1)
    # Inverse-CDF sampling: one uniform per row (instead of a Gumbel draw per vocabulary entry,
    # which costs a random hash per entry at every step).
    tiny = jnp.finfo(jnp.float32).tiny  # u > 0, so leading zero-probability tokens are skipped
    total = n_rows if batch_rows is None else batch_rows
    uniform = jax.random.uniform(key, (total, 1), jnp.float32, minval=tiny)
    if total != n_rows:
        uniform = jax.lax.dynamic_slice_in_dim(uniform, jnp.asarray(row_offset, jnp.int32), n_rows)
    token = _inverse_cdf(jnp.exp(logp), uniform)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _check_row_slice(rows: int, batch_rows: int, row_offset: int | jax.Array) -> None:
    """Raises unless ``rows`` rows from ``row_offset`` fit a batch of ``batch_rows`` rows."""
    check_int("batch_rows", batch_rows, minimum=rows)
    if isinstance(row_offset, jax.core.Tracer):  # its value is not known: its type is
        if row_offset.shape or not jnp.issubdtype(row_offset.dtype, jnp.integer):
            msg = f"row_offset must be an integer scalar, got a traced {row_offset.aval}"
            raise TypeError(msg)
        return
    offset = np.asarray(row_offset)
    if offset.shape or not np.issubdtype(offset.dtype, np.integer):
        msg = f"row_offset must be an integer scalar, got {row_offset!r}"
        raise TypeError(msg)
    if not 0 <= int(offset) <= batch_rows - rows:
        msg = (
            f"row_offset must be in [0, {batch_rows - rows}] for {rows} rows of a batch of "
            f"{batch_rows}, got {int(offset)}"
        )
        raise ValueError(msg)


def _inverse_cdf(probs: jax.Array, uniform: jax.Array, block: int = 64) -> jax.Array:
    """Token ``v`` with ``cdf[v-1] < u <= cdf[v]`` for ``u = uniform * cdf[-1]``, per row.

    So token ``v`` is drawn with probability ``p[v] / sum(p)``, and a token with ``p[v] = 0``
    never is. The CDF is taken in two levels, over blocks of ``block`` entries and then inside
    the one block that ``u`` falls in: a cumulative sum over the whole vocabulary lowers on
    XLA:CPU to a windowed reduction that is several times slower than these plain sums, and
    this runs once per generated token.

    Args:
        probs: ``(R, V)`` non-negative float32 weights, each row with a positive sum.
        uniform: ``(R, 1)`` float32 in ``(0, 1)``.
        block: Entries per block.

    Returns:
        ``(R,)`` int32 token ids.
    """
    rows, v = probs.shape
    blocks = -(-v // block)
    padded = jnp.pad(probs, ((0, 0), (0, blocks * block - v))).reshape(rows, blocks, block)
    sums = jnp.sum(padded, axis=-1)  # (R, blocks)
    cdf = jnp.cumsum(sums, axis=-1)
    u = uniform * cdf[:, -1:]
    j = jnp.minimum(jnp.sum(cdf < u, axis=-1), blocks - 1)  # cdf[j-1] < u <= cdf[j]
    inside = jnp.take_along_axis(padded, j[:, None, None], axis=1)[:, 0]  # (R, block)
    before = jnp.take_along_axis(cdf - sums, j[:, None], axis=-1)
    count = jnp.sum(jnp.cumsum(inside, axis=-1) + before < u, axis=-1)
    # Rounding may put u past the block's last partial sum: stay on its last nonzero entry.
    ids = jnp.arange(block, dtype=jnp.int32)
    last = jnp.max(jnp.where(inside > 0, ids, 0), axis=-1)
    return (j * block + jnp.minimum(count, last)).astype(jnp.int32)


@jit(
    static_argnames=(
        "graphdef",
        "num_generations",
        "max_new_tokens",
        "top_k",
        "use_top_p",
        "greedy",
        "eos_ids",
        "pad_id",
        "share_prefill",
        "batch_rows",
        "record_routing",
    ),
)
def _generate(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    row_offset: jax.Array,
    *,
    num_generations: int,
    max_new_tokens: int,
    top_k: int | None,
    use_top_p: bool,
    greedy: bool,
    eos_ids: tuple[int, ...],
    pad_id: int,
    share_prefill: bool,
    batch_rows: int,
    record_routing: bool = False,
) -> SamplerOutput:
    # ``prompt_ids`` may be one group of a batch of ``batch_rows`` rows (see ``generate``'s
    # ``row_groups``), whose first row is row ``row_offset`` of the batch.
    model = nnx.merge(graphdef, state)
    # Scanned layers: stack the layer weights once, outside the decode loop (no copy when the
    # model stores them stacked). Unrolled layers stored stacked arrive sliced per layer
    # (`generate` slices them before this program, see `_per_layer_split`).
    stack = model.layer_stack() if getattr(model, "scan_layers", False) else None
    layers = {} if stack is None else {"layer_stack": stack}
    k, n = num_generations, max_new_tokens
    b, p = prompt_ids.shape
    rows = b * k
    prompt_ids = prompt_ids.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(jnp.int32)
    rep_ids = jnp.repeat(prompt_ids, k, axis=0)
    rep_mask = jnp.repeat(prompt_mask, k, axis=0)

    if record_routing:  # mixture-of-experts models: each layer's routed experts per token
        layers = {**layers, "routing": True}
    # Prefill once per prompt, then share the cache with the prompt's K generations.
    if share_prefill:
        cache = model.init_cache(b, p + n)
        hidden, cache, *trace = model.hidden_states(
            prompt_ids, attention_mask=prompt_mask, cache=cache, **layers
        )
        cache = cache.repeat(k)
        last = jnp.repeat(hidden[:, -1], k, axis=0)
        prompt_routing = _routed(trace, prompt_mask, k)
    else:
        cache = model.init_cache(rows, p + n)
        hidden, cache, *trace = model.hidden_states(
            rep_ids, attention_mask=rep_mask, cache=cache, **layers
        )
        last = hidden[:, -1]
        prompt_routing = _routed(trace, rep_mask, 1)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def draw(logits: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
        return sample_logits(
            logits,
            jax.random.fold_in(key, step),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p if use_top_p else None,
            greedy=greedy,
            batch_rows=None if batch_rows == rows else batch_rows,
            row_offset=row_offset,
        )

    def record(carry: dict[str, Any], token: jax.Array, logp: jax.Array, step: jax.Array):
        alive = ~carry["done"]
        token = jnp.where(alive, token, pad_id)
        carry["tokens"] = carry["tokens"].at[:, step].set(token)
        carry["mask"] = carry["mask"].at[:, step].set(alive.astype(jnp.int32))
        carry["logps"] = carry["logps"].at[:, step].set(jnp.where(alive, logp, 0.0))
        carry["done"] = carry["done"] | (alive & jnp.any(token[:, None] == eos[None, :], axis=-1))
        return carry

    carry = {
        "tokens": jnp.full((rows, n), pad_id, jnp.int32),
        "mask": jnp.zeros((rows, n), jnp.int32),
        "logps": jnp.zeros((rows, n), jnp.float32),
        "done": jnp.zeros((rows,), jnp.bool_),
        "cache": cache,
        "step": jnp.zeros((), jnp.int32),
    }
    if prompt_routing is not None:
        carry["routing"] = jnp.full((rows, n, *prompt_routing.shape[2:]), -1, jnp.int32)
    token, logp = draw(model.logits_from_hidden(last), carry["step"])
    carry = record(carry, token, logp, carry["step"])
    carry["last"] = carry["tokens"][:, 0]

    def cond(c: dict[str, Any]) -> jax.Array:
        return (c["step"] + 1 < n) & ~jnp.all(c["done"])

    def body(c: dict[str, Any]) -> dict[str, Any]:
        step = c["step"] + 1
        alive = (~c["done"]).astype(jnp.int32)
        hidden, cache, *trace = model.hidden_states(
            c["last"][:, None], attention_mask=alive[:, None], cache=c["cache"], **layers
        )
        token, logp = draw(model.logits_from_hidden(hidden[:, 0]), step)
        if trace:  # the fed token is completion token step - 1
            c = dict(
                c, routing=c["routing"].at[:, step - 1].set(_routed(trace, alive[:, None])[:, 0])
            )
        c = dict(c, cache=cache, step=step)
        c = record(c, token, logp, step)
        c["last"] = c["tokens"][:, step]
        return c

    carry = jax.lax.while_loop(cond, body, carry)
    mask = carry["mask"]
    return SamplerOutput(
        prompt_ids=rep_ids,
        prompt_mask=rep_mask,
        completion_ids=carry["tokens"],
        completion_mask=mask,
        log_probs=carry["logps"],
        truncated=~carry["done"],
        lengths=jnp.sum(mask, axis=-1, dtype=jnp.int32),
        routed_experts=None
        if prompt_routing is None
        else jnp.concatenate([prompt_routing, carry["routing"]], axis=1),
    )


def _routed(trace: list[Any], valid: jax.Array, repeat: int = 1) -> jax.Array | None:
    """A router trace's experts as ``(rows, T, L, k)``, -1 on invalid tokens (None: no trace)."""
    if not trace:
        return None
    experts = jnp.moveaxis(trace[0].experts, 0, 2)  # (L, B, T, k) -> (B, T, L, k)
    experts = jnp.where(valid.astype(jnp.bool_)[:, :, None, None], experts, -1)
    return jnp.repeat(experts, repeat, axis=0) if repeat > 1 else experts


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


def _local_rows(x: Any) -> np.ndarray:
    """Host copy of the rows of ``x`` that this process holds (all of them in one process).

    A ``jax.Array`` spread over several processes cannot be fetched whole; its addressable
    row shards are concatenated in row order (replicas counted once), so the host-side checks
    of :func:`generate` look at this process's prompts.
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    parts: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        start = (shard.index[0].start or 0) if shard.index else 0
        parts.setdefault(start, np.asarray(shard.data))
    return np.concatenate([parts[k] for k in sorted(parts)], axis=0)


def _per_layer_split(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split(model)``, with decoder layers stored stacked sliced one module per layer.

    For the unrolled samplers (:func:`generate`, the multi-turn rollout): a model whose layers
    are stored stacked (``CausalLM.stack_layers()``) and not scanned runs its layers one by
    one, so the sampler needs them sliced. They are sliced here, one layer per call of one small
    compiled program (a dynamic index into each stack), and the sampler then compiles the same
    program as for per-layer storage (slicing inside the sampler's program, or all layers in one
    program of its own, compiles longer; ``docs/benchmarks.md``). The model itself is left as
    it is; the slices are copies, made once per call.

    Args:
        model: The model to sample from.

    Returns:
        ``(graphdef, state)`` to merge inside the sampler's program.
    """
    graphdef, state = nnx.split(model)
    if not _runs_stacked_layers_unrolled(model):
        return graphdef, state
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    key = (graphdef, tuple((np.shape(x), jnp.result_type(x)) for _, x in leaves))
    plan = _PER_LAYER_PLANS.get(key)
    if plan is None:
        plan = _per_layer_plan(graphdef, state, [path for path, _ in leaves])
        if len(_PER_LAYER_PLANS) >= 16:  # a few model shapes per process at most
            _PER_LAYER_PLANS.clear()
        _PER_LAYER_PLANS[key] = plan
    per_layer_graphdef, treedef, sources, stacked_at, num_layers = plan
    stacks = tuple(leaves[j][1] for j in stacked_at)
    layers = [_layer_slice(stacks, np.int32(i)) for i in range(num_layers)]
    layers = [tuple(map(_sharded_like_stack, stacks, layer)) for layer in layers]
    out = [leaves[j][1] if layer is None else layers[layer][j] for layer, j in sources]
    return per_layer_graphdef, jax.tree_util.tree_unflatten(treedef, out)


def _per_layer_model(model: nnx.Module) -> nnx.Module:
    """``model``, or for stacked, unrolled layers the same model with one module per layer.

    The layers are sliced once (:func:`_per_layer_split`); the other arrays are shared, not
    copied. For callers that run the samplers several times on unchanged weights (the
    multi-turn rollout calls them twice per turn), so that each call does not slice again.
    """
    return nnx.merge(*_per_layer_split(model)) if _runs_stacked_layers_unrolled(model) else model


def _runs_stacked_layers_unrolled(model: nnx.Module) -> bool:
    """Layers stored stacked (``CausalLM.stack_layers()``) and run one by one (not scanned)."""
    stacked = bool(getattr(model, "layers_stacked", False))
    return stacked and not getattr(model, "scan_layers", False)


def _sharded_like_stack(stack: jax.Array, piece: jax.Array) -> jax.Array:
    """``piece``, one layer of ``stack``, with the stack's partition spec less its layer axis.

    The slicing program hands back an equivalent sharding under another spec (``P()`` for a
    replicated vector, where a per-layer model's weight has ``P(None,)``); relabelled, the slices
    match a per-layer model's weights and the sampler reuses its program. Where the spec is
    only relabelled, ``device_put`` moves no data.
    """
    sharding = getattr(stack, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return piece
    spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:])
    want = jax.sharding.NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
    return piece if piece.sharding == want else jax.device_put(piece, want)


# (graphdef, leaf shapes and dtypes) -> (per-layer graphdef, its state's treedef, where each of
# its leaves comes from: (None, leaf index) or (layer, stack index), the stacked leaves, number
# of layers)
_PER_LAYER_PLANS: dict[Any, tuple[Any, ...]] = {}


def _per_layer_plan(graphdef: nnx.GraphDef, state: nnx.State, paths: list[Any]) -> tuple:
    """How the per-layer state is assembled from the stacked one (shapes only, traced once)."""
    abstract = nnx.eval_shape(lambda s: nnx.merge(graphdef, s).unstack_layers(), state)
    per_layer_graphdef, abstract_state = nnx.split(abstract)
    out, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    index = {path: j for j, path in enumerate(paths)}
    stacked_at: list[int] = []  # leaf indices of the stacked layer weights, in order of use
    sources = []
    layer_key = jax.tree_util.DictKey("layers")
    num_layers = 0
    for path, _ in out:
        index_key = path[1] if len(path) > 2 and path[0] == layer_key else None
        if isinstance(index_key, jax.tree_util.DictKey) and isinstance(index_key.key, int):
            source = index[(path[0], *path[2:])]  # the stacked weight this slice comes from
            if source not in stacked_at:
                stacked_at.append(source)
            sources.append((index_key.key, stacked_at.index(source)))
            num_layers = max(num_layers, index_key.key + 1)
        else:
            sources.append((None, index[path]))
    return per_layer_graphdef, treedef, tuple(sources), tuple(stacked_at), num_layers


@jit
def _layer_slice(stacks: tuple[jax.Array, ...], layer: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) for x in stacks)


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
