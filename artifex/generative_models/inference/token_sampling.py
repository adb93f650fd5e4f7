r"""Drawing one token per row from a model's logits, with its log-prob.

:func:`sample_logits` is the sampling step of every sampler of this package
(:func:`~artifex.generative_models.inference.sampling.generate`, the continuous-batching and
multi-turn decoders). Sampling distribution at each step, from the model's float32 logits ``z``:

.. math::

    \pi(v) \propto \exp(z_v / \tau)\ \ \text{for } v \in \mathcal{A},

where ``tau`` is the temperature and ``A`` the allowed set: all tokens, or the ``top_k`` largest
logits, intersected with the top-p nucleus (the smallest set of most likely tokens whose
probability reaches ``top_p``; Holtzman et al., 2020). The returned log-probs are
``log pi(token)`` under exactly this distribution, so for ``top_k=None, top_p=1`` they equal the
teacher-forced ``log_softmax(z / tau)`` of the sampled tokens. Greedy decoding picks ``argmax z``
and reports ``log_softmax(z / tau)`` of that token.

Moved out of :mod:`~artifex.generative_models.inference.sampling` unchanged; it still imports
these names, so they stay importable from there.

References:
    Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration", arXiv:1904.09751.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from artifex.generative_models.utils.validation import check_int

__all__ = ["sample_logits"]


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
