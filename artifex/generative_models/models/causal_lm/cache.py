"""Key/value cache for incremental decoding, an explicit pytree passed in and returned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["KVCache"]


@struct.dataclass
class KVCache:
    """Per-layer keys and values of the tokens seen so far, in fixed-size slots.

    Each layer has its own key and value arrays, keys laid out `(B, K, H, S)` and values
    `(B, K, S, H)`: a decoding step writes its token into them in place and attention reads them
    as they are, with the kv heads as a batch axis of its matmuls, as `(G, H) x (H, S)` for the
    scores and `(G, S) x (S, H)` for the output (one stacked `(L, ...)` array would make every
    layer copy its slice out at every token; keys stored `(B, K, S, H)` would make the score
    matmul contract over the minor axis of both operands, which XLA:CPU runs more slowly). A
    model whose layers run as one `lax.scan` (`CausalLM.scan_layers`) keeps them stacked
    instead, as one `(L, B, K, H, S)` and one `(L, B, K, S, H)` array, which the scan reads and
    writes layer by layer (`stacked=True`).
    Slot `s` of row `b` holds a real token iff `valid[b, s]`; a query written at slot `q`
    attends to slot `s` iff `valid[b, s] and s <= q`.
    `index` is the next slot to write; a forward pass over `T` tokens writes slots
    `[index, index + T)` and advances `index` by `T`. Shapes never change, so the cache can be
    carried through `jax.lax.while_loop`. The caller keeps `index + T <= max_length` (a write
    past the end is clamped by `lax.dynamic_update_slice`, overwriting the last slots).

    Attributes:
        keys: Tuple of L arrays (B, K, H, S): each layer's rotated keys, slot axis last, in the
            compute dtype; or one (L, B, K, H, S) array when stacked.
        values: Tuple of L arrays (B, K, S, H), or one (L, B, K, S, H) array when stacked.
        valid: (B, S) bool, True on slots that hold real (non-padding) tokens.
        index: int32 scalar, the next slot to write.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import KVCache
        >>> cache = KVCache.create(num_layers=2, batch_size=1, max_length=16, num_kv_heads=2,
        ...                        head_dim=4)
        >>> cache.num_layers, cache.batch_size, cache.max_length, int(cache.index)
        (2, 1, 16, 0)
        >>> cache.keys[0].shape, cache.values[0].shape  # layer 0: (B, K, H, S), (B, K, S, H)
        ((1, 2, 4, 16), (1, 2, 16, 4))
        >>> cache.repeat(3).batch_size  # one prompt's cache shared by 3 generations
        3
    """

    keys: tuple[jax.Array, ...] | jax.Array
    values: tuple[jax.Array, ...] | jax.Array
    valid: jax.Array
    index: jax.Array

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        batch_size: int,
        max_length: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
        stacked: bool = False,
    ) -> KVCache:
        """Builds an empty cache (all slots invalid, index 0).

        Args:
            num_layers: Number of decoder layers L.
            batch_size: Rows B.
            max_length: Slots S per row (prompt plus generated tokens).
            num_kv_heads: Key/value heads K.
            head_dim: Head width H.
            dtype: Dtype of keys and values.
            stacked: One (L, B, K, H, S) array for the keys and one (L, B, K, S, H) for the
                values instead of L per-layer arrays (for layers run as a `lax.scan`).

        Returns:
            The zero-filled cache.

        Raises:
            ValueError: Naming the argument, if a size is not a positive int.
        """
        sizes = {
            "num_layers": num_layers,
            "batch_size": batch_size,
            "max_length": max_length,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
        }
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                msg = f"KVCache.create: {name} must be a positive int, got {value!r}"
                raise ValueError(msg)
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        key_shape = (batch_size, num_kv_heads, head_dim, max_length)
        if stacked:
            keys = jnp.zeros((num_layers, *key_shape), dtype)
            values = jnp.zeros((num_layers, *shape), dtype)
        else:
            keys = tuple(jnp.zeros(key_shape, dtype) for _ in range(num_layers))
            values = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return cls(
            keys=keys,
            values=values,
            valid=jnp.zeros((batch_size, max_length), jnp.bool_),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def stacked(self) -> bool:
        """Whether keys and values are one (L, ...) array each (else L arrays)."""
        return not isinstance(self.keys, tuple)

    @property
    def num_layers(self) -> int:
        """Number of layers L."""
        return self.keys.shape[0] if self.stacked else len(self.keys)

    @property
    def batch_size(self) -> int:
        """Number of rows B."""
        return self.valid.shape[0]

    @property
    def max_length(self) -> int:
        """Number of slots S per row."""
        return self.valid.shape[1]

    def repeat(self, k: int) -> KVCache:
        """Repeats every row `k` times consecutively (`jnp.repeat` along the batch axis).

        Row `b` of the result is row `b // k` of this cache, which matches the prompt-major,
        generation-minor layout: one prefill per prompt serves its `k` generations.

        Args:
            k: Repetitions per row (positive int).

        Returns:
            A cache with batch size `B * k` and the same index.

        Raises:
            ValueError: If `k` is not a positive int.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            msg = f"KVCache.repeat: k must be a positive int, got {k!r}"
            raise ValueError(msg)
        if k == 1:
            return self
        if self.stacked:
            return self.replace(
                keys=jnp.repeat(self.keys, k, axis=1),
                values=jnp.repeat(self.values, k, axis=1),
                valid=jnp.repeat(self.valid, k, axis=0),
            )
        return self.replace(
            keys=tuple(jnp.repeat(x, k, axis=0) for x in self.keys),
            values=tuple(jnp.repeat(x, k, axis=0) for x in self.values),
            valid=jnp.repeat(self.valid, k, axis=0),
        )
