r"""Pretraining the text encoder of a :class:`~artifex.generative_models.flow.TextFlowDiT` alone.

A text encoder trained only through the flow-matching loss reads a caption of the shapes
grammar as a bag of words. The bag is all the loss asks for at first: ``"a red square left of a
blue circle"`` and ``"a blue circle right of a red square"`` describe the same images, so on
average the relation words carry no information without their order, and the layout (which
group goes where) depends on word order only through an interaction of the relation with
the positions of the two groups, whose gradient is nearly zero while the network ignores
order. Jointly trained, the encoder even erases the difference between ``"left"`` and
``"right"`` (docs/flow-grpo.md, "What holds the accuracy down").

Text-to-image models avoid this with a text encoder pretrained on language and *frozen*
while the image network trains (Imagen's frozen T5; Stable Diffusion's frozen CLIP). With no
language model to download, :func:`pretrain_text_encoder` gives the small encoder the part of
that knowledge the task needs from the captions themselves: a readout of its mean-pooled
output must name, for each *slot* of the layout (:data:`LAYOUT_SLOTS`: the only group of a
one-group caption, or the group on the left, right, top or bottom of a two-group one), the
colour, the shape and the count of the group there ("none" for an empty slot). Only the
encoder (word and position embeddings, text layers, final norm) and the readout train; the
readout is then thrown away and the flow pretraining keeps the encoder frozen
(:class:`~artifex.generative_models.flow.FlowTrainConfig` ``freeze_text_encoder=True``).

References:
    Saharia et al., 2022, "Photorealistic Text-to-Image Diffusion Models with Deep Language
    Understanding" (Imagen: a frozen text encoder), arXiv:2205.11487;
    Yuksekgonul et al., 2023, "When and why vision-language models behave like
    bags-of-words, and what to do about it?", arXiv:2210.01936.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.flow.shapes import COLOURS, SHAPES, parse_caption
from artifex.generative_models.flow.text_dit import TextFlowDiT
from artifex.generative_models.utils.validation import check_float, check_int

__all__ = [
    "ALL_BUT_TEXT_ENCODER",
    "LAYOUT_SLOTS",
    "TEXT_ENCODER",
    "TextPretrainConfig",
    "layout_accuracy",
    "layout_targets",
    "pretrain_text_encoder",
    "trained_parameters",
]

#: The layout slots a caption fills: ``"only"`` (a one-group caption), then the sides.
LAYOUT_SLOTS: tuple[str, ...] = ("only", "left", "right", "top", "bottom")
_SIDES = {
    "left of": ("left", "right"),
    "right of": ("right", "left"),
    "above": ("top", "bottom"),
    "below": ("bottom", "top"),
}
_COLOURS = ("none", *COLOURS)
_SHAPES = ("none", *SHAPES)
_COUNTS = 4  # 0 (none) to 3
# (first, last) logit columns of colour, shape and count in each slot
_PARTS = ((0, len(_COLOURS)), (len(_COLOURS), len(_COLOURS) + len(_SHAPES)))
_PARTS += ((_PARTS[1][1], _PARTS[1][1] + _COUNTS),)
_WIDTH = _PARTS[-1][1]

#: The parameters of a :class:`~artifex.generative_models.flow.TextFlowDiT`'s text encoder
#: (an ``nnx`` filter): word and position embeddings, text layers, final text norm.
TEXT_ENCODER = nnx.All(
    nnx.Param,
    nnx.Any(
        nnx.PathContains("word"),
        nnx.PathContains("word_position"),
        nnx.PathContains("text_layers"),
        nnx.PathContains("text_norm"),
    ),
)
#: Every parameter but the text encoder's: what trains while the encoder is frozen.
ALL_BUT_TEXT_ENCODER = nnx.All(nnx.Param, nnx.Not(TEXT_ENCODER))


def trained_parameters(
    model: object, freeze_text_encoder: bool, option: str
) -> nnx.filterlib.Filter:
    """The ``nnx`` filter of the parameters to train: all, or all but the text encoder's.

    Args:
        model: The flow model.
        freeze_text_encoder: Keep the text encoder as it is.
        option: The setting's name, for the error (``"FlowTrainConfig.freeze_text_encoder"``).

    Returns:
        ``nnx.Param`` or :data:`ALL_BUT_TEXT_ENCODER`.

    Raises:
        ValueError: ``freeze_text_encoder`` for a model without a text encoder (not a
            :class:`~artifex.generative_models.flow.TextFlowDiT`).

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import TextFlowDiT, TextFlowDiTConfig
        >>> from artifex.generative_models.flow.text_encoder import (
        ...     ALL_BUT_TEXT_ENCODER, trained_parameters)
        >>> model = TextFlowDiT(TextFlowDiTConfig(hidden_dim=32, num_blocks=1), rngs=nnx.Rngs(0))
        >>> trained_parameters(model, True, "freeze") is ALL_BUT_TEXT_ENCODER
        True
        >>> trained_parameters(object(), True, "freeze")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: freeze needs a text-conditioned model (a TextFlowDiT, with a text ...
    """
    if not freeze_text_encoder:
        return nnx.Param
    if not isinstance(model, TextFlowDiT):
        msg = (
            f"{option} needs a text-conditioned model (a TextFlowDiT, with a text encoder), "
            f"got {type(model).__name__}"
        )
        raise ValueError(msg)
    return ALL_BUT_TEXT_ENCODER


def layout_targets(captions: Sequence[str]) -> np.ndarray:
    """What each layout slot holds, per caption: ``(N, 5, 3)`` int32 (colour, shape, count).

    Slots follow :data:`LAYOUT_SLOTS`. Colour and shape are indices into ``("none",
    *COLOURS)`` and ``("none", *SHAPES)``; the count is 0 for an empty slot.

    Args:
        captions: Captions of the shapes grammar.

    Returns:
        The targets.

    Raises:
        TypeError: ``captions`` is a single string, or holds something other than strings.
        ValueError: A caption outside the grammar.

    Examples:
        >>> from artifex.generative_models.flow.text_encoder import layout_targets
        >>> layout_targets(["two red squares right of a blue circle"])[0].tolist()
        [[0, 0, 0], [3, 2, 1], [1, 1, 2], [0, 0, 0], [0, 0, 0]]
    """
    captions = _caption_list("captions", captions)
    out = np.zeros((len(captions), len(LAYOUT_SLOTS), 3), np.int32)
    for row, caption in enumerate(captions):
        scene = parse_caption(caption)
        slots = ("only",) if scene.relation is None else _SIDES[scene.relation]
        for group, slot in zip(scene.groups, slots, strict=True):
            out[row, LAYOUT_SLOTS.index(slot)] = (
                _COLOURS.index(group.colour),
                _SHAPES.index(group.shape),
                group.count,
            )
    return out


def _caption_list(name: str, captions: Sequence[str]) -> list[str]:
    """``captions`` as a list, refusing one string (iterated letter by letter) and non-strings."""
    if isinstance(captions, str):
        msg = f"{name} must be a list of captions, got one string {captions!r}"
        raise TypeError(msg)
    captions = list(captions)
    for row, caption in enumerate(captions):
        if not isinstance(caption, str):
            msg = f"{name} must hold strings, got {type(caption).__name__} at row {row}"
            raise TypeError(msg)
    return captions


class _LayoutReadout(nnx.Module):
    """An MLP from the pooled text to the logits of every slot's colour, shape and count."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(dim, dim, rngs=rngs)
        self.out = nnx.Linear(dim, len(LAYOUT_SLOTS) * _WIDTH, rngs=rngs)

    def __call__(self, model: TextFlowDiT, tokens: jax.Array) -> jax.Array:
        text, mask = model.encode_text(tokens)
        w = mask.astype(jnp.float32)[..., None]
        pooled = jnp.sum(text * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)
        logits = self.out(nnx.gelu(self.hidden(pooled)))
        return logits.reshape(tokens.shape[0], len(LAYOUT_SLOTS), _WIDTH)


def _loss_and_exact(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    loss = jnp.zeros((), jnp.float32)
    right = []
    for k, (a, b) in enumerate(_PARTS):
        part = logits[..., a:b].astype(jnp.float32)
        loss = loss + optax.softmax_cross_entropy_with_integer_labels(part, targets[..., k]).mean()
        right.append(jnp.argmax(part, axis=-1) == targets[..., k])
    exact = jnp.all(jnp.stack(right, axis=-1), axis=(-1, -2))
    return loss, exact


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TextPretrainConfig:
    """Settings of :func:`pretrain_text_encoder`.

    Attributes:
        num_steps: Adam steps.
        batch_size: Captions per step (drawn with replacement).
        learning_rate: Constant Adam learning rate.
        seed: Seeds the readout and the batches.

    Raises:
        TypeError: A field of the wrong type.
        ValueError: A field out of range.

    Examples:
        >>> from artifex.generative_models.flow.text_encoder import TextPretrainConfig
        >>> TextPretrainConfig(num_steps=100).batch_size
        128
    """

    num_steps: int = 1000
    batch_size: int = 128
    learning_rate: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("TextPretrainConfig.num_steps", self.num_steps, minimum=1)
        check_int("TextPretrainConfig.batch_size", self.batch_size, minimum=1)
        check_int("TextPretrainConfig.seed", self.seed)
        check_float("TextPretrainConfig.learning_rate", self.learning_rate, greater_than=0.0)


def _check_model(model: object) -> None:
    if not isinstance(model, TextFlowDiT):
        msg = f"model must be a TextFlowDiT (it has a text encoder), got {type(model).__name__}"
        raise TypeError(msg)


def pretrain_text_encoder(
    model: TextFlowDiT,
    captions: Sequence[str],
    config: TextPretrainConfig | None = None,
) -> dict[str, list[float]]:
    """Trains ``model``'s text encoder in place to name the layout its captions describe.

    A fresh readout (an MLP on the mean-pooled encoder output) is trained with the encoder to
    predict :func:`layout_targets` (cross-entropy summed over colour, shape and count, averaged
    over slots and captions) and then discarded. Nothing outside :data:`TEXT_ENCODER` changes.
    The whole run is one compiled ``lax.scan``.

    Args:
        model: The text-conditioned DiT whose encoder to train.
        captions: Training captions of the shapes grammar (keep held-out ones out).
        config: Settings (``None``: ``TextPretrainConfig()``).

    Returns:
        ``{"loss": [...], "exact": [...]}`` per step: the loss and the share of the batch's
        captions whose every slot was named right.

    Raises:
        TypeError: ``model`` is not a :class:`~artifex.generative_models.flow.TextFlowDiT`,
            ``config`` is not a :class:`TextPretrainConfig`, or ``captions`` is one string or
            holds something other than strings.
        ValueError: No captions, or a caption outside the grammar, the model's vocabulary or
            its ``max_prompt_length``.
        FloatingPointError: The loss became NaN or infinite (the model is left as it was).

    Examples:
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import TextFlowDiT, TextFlowDiTConfig
        >>> from artifex.generative_models.flow.text_encoder import (
        ...     TextPretrainConfig, layout_accuracy, pretrain_text_encoder)
        >>> model = TextFlowDiT(TextFlowDiTConfig(hidden_dim=32, num_blocks=1),
        ...                     rngs=nnx.Rngs(0))
        >>> captions = ["a red square left of a blue circle", "a blue circle left of a red square"]
        >>> history = pretrain_text_encoder(model, captions, TextPretrainConfig(num_steps=150))
        >>> history["exact"][-1], layout_accuracy(model, captions)  # order read, not a bag
        (1.0, 1.0)
    """
    _check_model(model)
    config = TextPretrainConfig() if config is None else config
    if not isinstance(config, TextPretrainConfig):
        msg = f"config must be a TextPretrainConfig, got {type(config).__name__}"
        raise TypeError(msg)
    captions = _caption_list("captions", captions)
    if not captions:
        msg = "pretrain_text_encoder needs at least one caption, got none"
        raise ValueError(msg)
    targets = jnp.asarray(layout_targets(captions))
    tokens = jnp.asarray(model.config.tokenizer().encode(captions))
    readout = _LayoutReadout(model.config.hidden_dim, rngs=nnx.Rngs(config.seed))
    trained = nnx.Any(TEXT_ENCODER, nnx.PathContains("readout"))
    pair = nnx.Dict(model=model, readout=readout)
    optimizer = nnx.Optimizer(pair, optax.adam(config.learning_rate), wrt=trained)
    graphdef, state = nnx.split((pair, optimizer))
    n = len(captions)

    def objective(p: nnx.Dict, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = p["readout"](p["model"], tokens[idx])
        loss, exact = _loss_and_exact(logits, targets[idx])
        return loss, jnp.mean(exact.astype(jnp.float32))

    @jax.jit
    def run(state: nnx.State, key: jax.Array) -> tuple[nnx.State, tuple[jax.Array, jax.Array]]:
        def step(state: nnx.State, key: jax.Array):
            p, opt = nnx.merge(graphdef, state)
            idx = jax.random.randint(key, (config.batch_size,), 0, n)
            grad_fn = nnx.value_and_grad(objective, argnums=nnx.DiffState(0, trained), has_aux=True)
            (loss, exact), grads = grad_fn(p, idx)
            opt.update(p, grads)
            return nnx.state((p, opt)), (loss, exact)

        return jax.lax.scan(step, state, jax.random.split(key, config.num_steps))

    state, (losses, exact) = run(state, jax.random.key(config.seed))
    if not np.all(np.isfinite(np.asarray(losses))):
        first = int(np.argmin(np.isfinite(np.asarray(losses))))
        msg = (
            f"pretrain_text_encoder: the loss became non-finite at step {first} (learning rate "
            f"{config.learning_rate}); the model is left as it was"
        )
        raise FloatingPointError(msg)
    nnx.update((pair, optimizer), state)
    return {
        "loss": [float(x) for x in np.asarray(losses)],
        "exact": [float(x) for x in np.asarray(exact)],
    }


def layout_accuracy(
    model: TextFlowDiT,
    captions: Sequence[str],
    held_out: Sequence[str] | None = None,
    *,
    num_steps: int = 300,
    seed: int = 0,
) -> float:
    """Whether layouts can be read from ``model``'s pooled text: a probe of the encoder.

    Fits a fresh readout (the MLP :func:`pretrain_text_encoder` uses) to ``captions`` with the
    encoder frozen and returns the share of ``held_out`` (default: ``captions``) whose every
    slot it names right. A bag-of-words encoder gives ``"a red square left of a blue circle"``
    and ``"a blue circle left of a red square"`` (the same words) the same pooled output, so it
    cannot name both right; an encoder that reads word order can.

    Args:
        model: The text-conditioned DiT (unchanged).
        captions: Captions of the shapes grammar to fit the readout on.
        held_out: Captions to score (``None``: ``captions``).
        num_steps: Adam steps (learning rate 3e-3, full batch) of the readout.
        seed: Seeds the readout.

    Returns:
        The share in ``[0, 1]``.

    Raises:
        TypeError: ``model`` is not a :class:`~artifex.generative_models.flow.TextFlowDiT`,
            ``captions`` or ``held_out`` is one string or holds something other than strings,
            or ``num_steps`` or ``seed`` is not an int.
        ValueError: No captions to fit or to score, a caption outside the grammar, the model's
            vocabulary or its ``max_prompt_length``, or ``num_steps < 1``.

    Examples:
        An encoder without position information (no text layers, zero position embeddings)
        reads a bag of words: two captions with the same words get one answer.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import TextFlowDiT, TextFlowDiTConfig
        >>> from artifex.generative_models.flow.text_encoder import layout_accuracy
        >>> cfg = TextFlowDiTConfig(hidden_dim=32, num_blocks=1, text_layers=0)
        >>> model = TextFlowDiT(cfg, rngs=nnx.Rngs(0))
        >>> model.word_position[...] = jnp.zeros_like(model.word_position[...])
        >>> pair = ["a red square left of a blue circle", "a blue circle left of a red square"]
        >>> layout_accuracy(model, pair) <= 0.5
        True
    """
    _check_model(model)
    num_steps = check_int("layout_accuracy.num_steps", num_steps, minimum=1)
    seed = check_int("layout_accuracy.seed", seed)
    captions = _caption_list("captions", captions)
    held_out = captions if held_out is None else _caption_list("held_out", held_out)
    if not captions or not held_out:
        msg = "layout_accuracy needs at least one caption to fit and one to score, got none"
        raise ValueError(msg)

    def pooled_of(caps: list[str]) -> jax.Array:
        text, mask = model.encode_text(jnp.asarray(model.config.tokenizer().encode(caps)))
        w = mask.astype(jnp.float32)[..., None]
        return jnp.sum(text * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)

    targets = jnp.asarray(layout_targets(captions))
    pooled = pooled_of(captions)
    held_targets = jnp.asarray(layout_targets(held_out))  # checked before anything is fitted
    held_pooled = pooled_of(held_out)
    readout = _LayoutReadout(model.config.hidden_dim, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(readout, nnx.Param)
    tx = optax.adam(3e-3)

    def logits_of(params: nnx.State, pooled: jax.Array) -> jax.Array:
        r = nnx.merge(graphdef, params)
        out = r.out(nnx.gelu(r.hidden(pooled)))
        return out.reshape(pooled.shape[0], len(LAYOUT_SLOTS), _WIDTH)

    @jax.jit
    def fit(params: nnx.State) -> nnx.State:
        def step(carry, _):
            params, opt_state = carry
            grads = jax.grad(lambda p: _loss_and_exact(logits_of(p, pooled), targets)[0])(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), None

        (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), None, length=num_steps)
        return params

    logits = logits_of(fit(params), held_pooled)
    _, exact = _loss_and_exact(logits, held_targets)
    return float(jnp.mean(exact.astype(jnp.float32)))
