"""Sequence classification (reward models) on the `CausalLM` body, as transformers' heads.

`CausalLMForSequenceClassification` is the JAX side of transformers'
`LlamaForSequenceClassification`, `Qwen2ForSequenceClassification` and
`Qwen3ForSequenceClassification`: the decoder (`model.*` tensors, loaded into a `CausalLM`) and a
`score` projection `(num_labels, hidden)` without bias, applied to the final-norm hidden state of
one token per row. Which token follows transformers exactly (`last_token_index`): the rightmost
token whose id differs from `config.pad_token_id`, found on the ids (not on the attention mask),
so left and right padding give the same token; a row of padding only pools position 0. Without a
pad token transformers pools the last position and refuses batches of more than one row; here the
last position whose attention mask is 1 is pooled, which is the same token for a single unpadded
row and extends it to padded batches.

Parameter paths: the body's under `model.` (see `model.py`) and `score.kernel` (D, num_labels)
<- `score.weight`.T. The body is built with tied embeddings (a classifier checkpoint has no
`lm_head.weight`), so `model.model(ids)` gives next-token logits through the embedding matrix
(an untrained head; the scores are what the checkpoint was trained for).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open

from artifex.generative_models.models.causal_lm.config import CausalLMConfig, resolve_dtype
from artifex.generative_models.models.causal_lm.hf_format import (
    as_dtype,
    param_path_str,
    weight_files,
)
from artifex.generative_models.models.causal_lm.hf_io import place_tensors
from artifex.generative_models.models.causal_lm.model import CausalLM
from artifex.generative_models.models.causal_lm.modules import Linear

__all__ = ["CausalLMForSequenceClassification", "last_token_index"]

Rules = Callable[[str, tuple[int, ...]], PartitionSpec]

_SCORE = "score.weight"


def last_token_index(
    input_ids: jax.Array,
    pad_token_id: int | None,
    attention_mask: jax.Array | None = None,
) -> jax.Array:
    """The position each row's score is read from, as transformers' classification heads pick it.

    With a pad token: `argmax_t(t * [ids_t != pad])`, the rightmost non-pad token (position 0
    for a row of padding only), the same for left and right padding. Without one: the last
    position whose attention mask is 1 (the last position when there is no mask), which is
    transformers' `-1` for a single unpadded row.

    Args:
        input_ids: Token ids (B, T).
        pad_token_id: The model's `config.pad_token_id`, or None.
        attention_mask: Optional (B, T) mask, read only when `pad_token_id` is None.

    Returns:
        int32 positions (B,).

    Raises:
        ValueError: If `input_ids` is not 2-D or the mask's shape differs.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.models.causal_lm import last_token_index
        >>> ids = jnp.array([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [5, 0, 6, 0, 0]])
        >>> last_token_index(ids, pad_token_id=0).tolist()  # right, left, a pad id inside
        [2, 4, 2]
        >>> mask = jnp.array([[1, 1, 1, 0, 0]] * 3)
        >>> last_token_index(ids, None, mask).tolist()  # no pad token: the mask decides
        [2, 2, 2]
    """
    if input_ids.ndim != 2:
        msg = f"input_ids must be (B, T), got shape {input_ids.shape}"
        raise ValueError(msg)
    t = input_ids.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)
    if pad_token_id is not None:
        real = (input_ids != pad_token_id).astype(jnp.int32)
    elif attention_mask is None:
        return jnp.full((input_ids.shape[0],), t - 1, jnp.int32)
    else:
        if attention_mask.shape != input_ids.shape:
            msg = f"attention_mask must have shape {input_ids.shape}, got {attention_mask.shape}"
            raise ValueError(msg)
        real = (attention_mask != 0).astype(jnp.int32)
    return jnp.argmax(positions[None, :] * real, axis=-1).astype(jnp.int32)


class CausalLMForSequenceClassification(nnx.Module):
    """A `CausalLM` body with transformers' `score` head: scores (B, num_labels) per sequence.

    `scores = h_L[b, last_token_index(b)] W_score` in float32, where `h_L` are the body's
    final-norm hidden states (`CausalLM.hidden_states`) and `W_score` is (D, num_labels). A reward
    model has `num_labels = 1`.

    Args:
        config: The body's architecture (`pad_token_id` chooses the pooled token).
        num_labels: Rows of transformers' `score.weight`.
        rngs: Random streams for the initial weights.
        dtype: Optional parameter dtype override ("float32" / "bfloat16").
        scan_layers: Passed to `CausalLM`.

    Raises:
        ValueError: If `num_labels` is not a positive int.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.models.causal_lm import (
        ...     CausalLMConfig, CausalLMForSequenceClassification)
        >>> cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, pad_token_id=0)
        >>> rm = CausalLMForSequenceClassification(cfg, num_labels=1, rngs=nnx.Rngs(0))
        >>> ids = jnp.array([[3, 4, 5, 0], [3, 4, 5, 6]])
        >>> rm(ids, (ids != 0).astype(jnp.int32)).shape
        (2, 1)
    """

    def __init__(
        self,
        config: CausalLMConfig,
        num_labels: int,
        *,
        rngs: nnx.Rngs,
        dtype: str | jnp.dtype | None = None,
        scan_layers: bool = False,
    ) -> None:
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            msg = f"num_labels must be a positive int, got {num_labels!r}"
            raise ValueError(msg)
        if not isinstance(config, CausalLMConfig):
            msg = f"config must be a CausalLMConfig, got {type(config).__name__}"
            raise TypeError(msg)
        body_config = config.replace(tie_word_embeddings=True)  # no lm_head in a classifier
        self.model = CausalLM(body_config, rngs=rngs, dtype=dtype, scan_layers=scan_layers)
        self.config = self.model.config
        self.num_labels = num_labels
        self.score = Linear(
            config.hidden_size,
            num_labels,
            use_bias=False,
            std=config.initializer_range,
            dtype=self.model.dtype,
            rngs=rngs,
        )

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Scores each row.

        Args:
            input_ids: Token ids (B, T).
            attention_mask: (B, T), 1 on real tokens, 0 on padding; None means all 1.
            positions: Optional int positions (B, T); by default `positions_from_mask` (for
                right padding the same as transformers' default `0..T-1`).

        Returns:
            float32 scores (B, num_labels).
        """
        hidden, _ = self.model.hidden_states(input_ids, attention_mask, positions)
        index = last_token_index(input_ids, self.config.pad_token_id, attention_mask)
        pooled = jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]
        kernel = self.score.kernel[...]
        return jnp.matmul(
            pooled.astype(jnp.float32),
            kernel.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        dtype: str | jnp.dtype | None = None,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
    ) -> CausalLMForSequenceClassification:
        """Loads a transformers `*ForSequenceClassification` checkpoint directory.

        `config.json` is read as for `CausalLM` (model_type llama, qwen2 or qwen3); the weights
        are the body's `model.*` tensors and `score.weight` (num_labels, D), whose first
        dimension gives `num_labels` (checked against the config's `id2label` or `num_labels`
        when present). Placement and dtype work as in `CausalLM.from_pretrained`; `rules` sees
        the body's paths (`"layers.0.attn.q_proj.kernel"`) and `"score.kernel"`.

        Args:
            path: Checkpoint directory.
            dtype: Parameter dtype; None uses the checkpoint's.
            mesh: Optional `jax.sharding.Mesh` to place parameters on.
            rules: Optional `rules(param_path, shape) -> PartitionSpec`, used with `mesh`.

        Returns:
            The loaded model.

        Raises:
            FileNotFoundError: If config.json or the safetensors files are missing.
            ValueError: Naming the tensor or key: no `score.weight` (a language-model checkpoint),
                a score head that disagrees with the config, or any error of the body's tensors.
            TypeError: If `rules` is given without `mesh`.

        Examples:
            >>> import jax.numpy as jnp
            >>> from artifex.generative_models.models.causal_lm import (
            ...     CausalLMForSequenceClassification)
            >>> rm = CausalLMForSequenceClassification.from_pretrained(
            ...     "tests/fixtures/reward_models/qwen2_rm")  # from the repository root
            >>> rm.num_labels, rm.config.pad_token_id
            (1, 0)
            >>> rm(jnp.array([[5, 6, 7, 0]]), jnp.array([[1, 1, 1, 0]])).shape
            (1, 1)
        """
        directory = os.fspath(path)
        if rules is not None and mesh is None:
            msg = "from_pretrained: rules were given without a mesh; pass mesh= as well"
            raise TypeError(msg)
        config_path = os.path.join(directory, "config.json")
        if not os.path.exists(config_path):
            msg = f"no config.json in {directory!r}"
            raise FileNotFoundError(msg)
        with open(config_path, encoding="utf-8") as f:
            hf_config = json.load(f)
        config = CausalLMConfig.from_hf_config(hf_config)
        files = weight_files(directory)
        score_file = next((f for f, names in files.items() if _SCORE in names), None)
        if score_file is None:
            archs = hf_config.get("architectures")
            msg = (
                f"no tensor {_SCORE!r} in {directory!r} (architectures {archs}): expected a "
                "*ForSequenceClassification checkpoint; load a language model with "
                "CausalLM.from_pretrained"
            )
            raise ValueError(msg)
        with safe_open(score_file, framework="numpy") as f:
            score = f.get_tensor(_SCORE)
        if score.ndim != 2 or score.shape[1] != config.hidden_size:
            msg = (
                f"tensor {_SCORE!r}: expected shape (num_labels, {config.hidden_size}), got "
                f"{tuple(score.shape)}"
            )
            raise ValueError(msg)
        num_labels = int(score.shape[0])
        declared = _declared_num_labels(hf_config)
        if declared is not None and declared != num_labels:
            msg = (
                f"config.json declares {declared} labels (id2label / num_labels), but "
                f"{_SCORE!r} has {num_labels} rows"
            )
            raise ValueError(msg)
        dt = resolve_dtype(config.param_dtype if dtype is None else dtype)
        config = config.replace(param_dtype=dt.name)
        model = nnx.eval_shape(lambda: cls(config, num_labels, rngs=nnx.Rngs(0)))

        def body_tensors() -> Iterator[tuple[str, np.ndarray]]:
            for fname, names in files.items():
                with safe_open(fname, framework="numpy") as f:
                    for name in names:
                        if name != _SCORE:
                            yield name, f.get_tensor(name)

        place_tensors(model.model, body_tensors(), mesh=mesh, rules=rules, source=repr(directory))
        kernel = np.ascontiguousarray(as_dtype(score, dt).T)
        if mesh is None:
            arr = jax.device_put(kernel)
        else:
            spec = (
                PartitionSpec()
                if rules is None
                else rules(param_path_str(("score", "kernel")), kernel.shape)
            )
            arr = jax.device_put(kernel, NamedSharding(mesh, spec))
        model.score.kernel.set_value(arr)
        return model


def _declared_num_labels(hf_config: dict[str, Any]) -> int | None:
    """The label count a transformers config.json states, if it states one."""
    id2label = hf_config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    num = hf_config.get("num_labels")
    if isinstance(num, int) and not isinstance(num, bool):
        return num
    return None
