"""A GenEval-style compositional reward computed from the image by a rule.

The image is segmented by colour: each pixel goes to the nearest of black (the background) and
the :data:`~artifex.generative_models.flow.shapes.COLOURS` (Euclidean distance in RGB),
and each colour's pixels are split into 8-connected components (``scipy.ndimage.label``);
components under ``min_area`` pixels are dropped as noise. A component's kind comes from its
fill ratio ``area / (bounding-box height x width)``: at least 0.92 a square, from 0.66 a circle
(a disk fills about pi / 4), from 0.35 a triangle (about 1/2), below that none (``"blob"``).

A caption's :class:`~artifex.generative_models.flow.shapes.Scene` is then checked like
GenEval checks an image: per object group, **present** (at least one shape of that colour and
kind) and **count** (exactly ``count`` of them); for two groups the **relation** (every shape of
the first group lies on its side of every shape of the second: centroid columns for ``left
of``/``right of``, rows for ``above``/``below``); and **nothing else** in the image. The reward
is the fraction of checks passed; an image is *correct* when it passes all of them
(compositional accuracy).

References:
    Ghosh et al., 2023, "GenEval: An Object-Focused Framework for Evaluating Text-to-Image
    Alignment", arXiv:2310.11513.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from artifex.generative_models.flow.shapes import (
    COLOURS,
    Scene,
    WordTokenizer,
    parse_caption,
)

__all__ = [
    "DetectedShape",
    "compositional_accuracy",
    "compositional_reward",
    "detect_shapes",
    "scene_checks",
]

_PALETTE_NAMES = ("background", *COLOURS)
_PALETTE = np.array([(-1.0, -1.0, -1.0), *COLOURS.values()], np.float64)


@dataclasses.dataclass(frozen=True, slots=True)
class DetectedShape:
    """One connected component of one colour.

    Attributes:
        colour: A key of :data:`~artifex.generative_models.flow.shapes.COLOURS`.
        shape: ``"square"``, ``"circle"``, ``"triangle"`` or ``"blob"``.
        area: Pixels.
        centroid: ``(row, column)`` of its pixels' mean.
        fill: ``area`` over its bounding box's area.

    Examples:
        >>> from artifex.generative_models.flow.detection import DetectedShape
        >>> DetectedShape("red", "square", 64, (4.5, 4.5), 1.0).shape
        'square'
    """

    colour: str
    shape: str
    area: int
    centroid: tuple[float, float]
    fill: float


def _kind(fill: float) -> str:
    if fill >= 0.92:
        return "square"
    if fill >= 0.66:
        return "circle"
    if fill >= 0.35:
        return "triangle"
    return "blob"


def _as_image(image: Any) -> np.ndarray:
    x = np.asarray(image, np.float64)
    if x.ndim == 1:
        side = math.isqrt(x.size // 3)
        if 3 * side * side != x.size:
            msg = f"a flattened image must have 3 S^2 values (S x S RGB), got {x.size}"
            raise ValueError(msg)
        x = x.reshape(side, side, 3)
    if x.ndim != 3 or x.shape[-1] != 3:
        msg = f"an image must be (H, W, 3) RGB or flattened, got shape {x.shape}"
        raise ValueError(msg)
    if not np.isfinite(x).all():
        msg = f"the image has {int((~np.isfinite(x)).sum())} NaN or infinite values"
        raise ValueError(msg)
    return x


def detect_shapes(image: Any, *, min_area: int = 6) -> list[DetectedShape]:
    """The coloured shapes in an image: components per colour with their kind and centroid.

    Args:
        image: ``(H, W, 3)`` RGB in ``[-1, 1]`` (or flattened ``3 S^2`` values of an ``S x S``
            image).
        min_area: Smaller components are dropped.

    Returns:
        The shapes, ordered by colour, then by component.

    Raises:
        ValueError: A malformed image, or NaN or infinite values.
        ImportError: SciPy is missing (``pip install 'artifex-grpo[flow]'``).

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow.detection import detect_shapes
        >>> from artifex.generative_models.flow.shapes import draw_scene, parse_caption
        >>> img = draw_scene(parse_caption("two red squares left of a blue circle"),
        ...                  np.random.default_rng(0))
        >>> sorted((s.colour, s.shape) for s in detect_shapes(img))
        [('blue', 'circle'), ('red', 'square'), ('red', 'square')]
    """
    try:
        from scipy import ndimage
    except ImportError as err:  # pragma: no cover - scipy comes with the flow extra
        msg = "detect_shapes needs SciPy: pip install 'artifex-grpo[flow]'"
        raise ImportError(msg) from err
    x = _as_image(image)
    dist = np.sum((x[:, :, None, :] - _PALETTE[None, None]) ** 2, axis=-1)
    nearest = np.argmin(dist, axis=-1)
    out = []
    for index, colour in enumerate(_PALETTE_NAMES[1:], start=1):
        labels, n = ndimage.label(nearest == index, structure=np.ones((3, 3), int))
        for k in range(1, n + 1):
            rows, cols = np.nonzero(labels == k)
            area = rows.size
            if area < min_area:
                continue
            box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
            fill = area / box
            out.append(
                DetectedShape(
                    colour, _kind(fill), int(area), (float(rows.mean()), float(cols.mean())), fill
                )
            )
    return out


def scene_checks(shapes: Sequence[DetectedShape], scene: Scene) -> dict[str, bool]:
    """GenEval-style checks of detected shapes against a scene.

    Args:
        shapes: From :func:`detect_shapes`.
        scene: What the caption asks for.

    Returns:
        ``{"present_0": ..., "count_0": ..., ["present_1", "count_1", "relation"],
        "no_extra": ...}``.

    Examples:
        >>> from artifex.generative_models.flow.detection import (
        ...     DetectedShape, scene_checks)
        >>> from artifex.generative_models.flow.shapes import parse_caption
        >>> found = [DetectedShape("red", "square", 64, (10.0, 5.0), 1.0),
        ...          DetectedShape("blue", "circle", 50, (10.0, 20.0), 0.8)]
        >>> checks = scene_checks(found, parse_caption("a red square right of a blue circle"))
        >>> len(checks), [name for name, ok in checks.items() if not ok]
        (6, ['relation'])
    """
    checks: dict[str, bool] = {}
    matches = []
    for i, group in enumerate(scene.groups):
        found = [s for s in shapes if (s.colour, s.shape) == (group.colour, group.shape)]
        matches.append(found)
        checks[f"present_{i}"] = bool(found)
        checks[f"count_{i}"] = len(found) == group.count
    if scene.relation is not None:
        a, b = matches
        axis = 1 if scene.relation in ("left of", "right of") else 0
        first = [s.centroid[axis] for s in a]
        second = [s.centroid[axis] for s in b]
        if not first or not second:
            checks["relation"] = False
        elif scene.relation in ("left of", "above"):
            checks["relation"] = max(first) < min(second)
        else:
            checks["relation"] = min(first) > max(second)
    checks["no_extra"] = len(shapes) == sum(len(m) for m in matches)
    return checks


def _captions(prompts: Any, tokenizer: WordTokenizer | None, rows: int) -> list[str]:
    if isinstance(prompts, str):
        msg = "prompts must be one caption or token-id row per image, got a single string"
        raise TypeError(msg)
    if len(prompts) and isinstance(prompts[0], str):
        captions = list(prompts)
    else:
        if tokenizer is None:
            msg = "token-id prompts need the tokenizer: compositional_reward(tokenizer)"
            raise TypeError(msg)
        captions = tokenizer.decode(np.asarray(prompts))
    if len(captions) != rows:
        msg = f"got {rows} images but {len(captions)} prompts"
        raise ValueError(msg)
    return captions


_SCORES = ("fraction", "correct", "counts")


def _score(checks: dict[str, bool], score: str) -> float:
    if score == "correct":
        return float(all(checks.values()))
    if score == "counts":
        kept = [ok for name, ok in checks.items() if not name.startswith("present_")]
        return float(np.mean(kept))
    return float(np.mean(list(checks.values())))


def compositional_reward(
    tokenizer: WordTokenizer | None = None, *, min_area: int = 6, score: str = "fraction"
) -> Any:
    """The image reward ``fn(images, prompts) -> (B,)``: how well each image passes its checks.

    Args:
        tokenizer: Decodes token-id prompts ``(B, L)``; ``None`` takes captions only.
        min_area: Passed to :func:`detect_shapes`.
        score: ``"fraction"``: the fraction of the checks of :func:`scene_checks` passed;
            ``"correct"``: 1 when every check passes, else 0 (GenEval's score of an image);
            ``"counts"``: the fraction of the checks other than *present* (each group's
            count, the relation, nothing else). The *present* checks give partial credit to
            an image that draws extra shapes, which *count* and *nothing else* then take
            away; without them drawing more shapes than asked earns nothing.

    Returns:
        ``fn(images, prompts)``: ``images`` ``(B, H, W, 3)`` or flattened ``(B, 3 S^2)`` in
        ``[-1, 1]``, ``prompts`` ``B`` captions or ``(B, L)`` token ids; float32 rewards in
        ``[0, 1]``. It raises ``ValueError`` for NaN or infinite images (naming the row), for
        captions outside the grammar, and when the numbers of images and prompts differ.

    Raises:
        ValueError: ``score`` is not one of ``"fraction"``, ``"correct"``, ``"counts"``.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow.detection import compositional_reward
        >>> from artifex.generative_models.flow.shapes import draw_scene, parse_caption
        >>> rng = np.random.default_rng(0)
        >>> images = np.stack([draw_scene(parse_caption("a red square"), rng)] * 2)
        >>> reward = compositional_reward()
        >>> [round(float(r), 3) for r in reward(images, ["a red square", "two red squares"])]
        [1.0, 0.667]
        >>> counts = compositional_reward(score="counts")
        >>> [round(float(r), 3) for r in counts(images, ["a red square", "two red squares"])]
        [1.0, 0.5]
    """
    if score not in _SCORES:
        msg = f"compositional_reward.score must be one of {_SCORES}, got {score!r}"
        raise ValueError(msg)

    def reward(images: Any, prompts: Any) -> np.ndarray:
        images = np.asarray(images)
        captions = _captions(prompts, tokenizer, images.shape[0])
        out = np.empty(len(captions), np.float32)
        for row, (image, caption) in enumerate(zip(images, captions, strict=True)):
            try:
                shapes = detect_shapes(image, min_area=min_area)
            except ValueError as err:
                msg = f"compositional_reward: image {row}: {err}"
                raise ValueError(msg) from err
            checks = scene_checks(shapes, parse_caption(caption))
            out[row] = _score(checks, score)
        return out

    reward.__name__ = "compositional_reward"
    return reward


def compositional_accuracy(
    images: Any, prompts: Any, tokenizer: WordTokenizer | None = None, *, min_area: int = 6
) -> np.ndarray:
    """Whether each image passes every check of its caption (GenEval's "correct").

    Args:
        images: ``(B, H, W, 3)`` or ``(B, 3 S^2)`` in ``[-1, 1]``.
        prompts: ``B`` captions or ``(B, L)`` token ids (with ``tokenizer``).
        tokenizer: For token-id prompts.
        min_area: Passed to :func:`detect_shapes`.

    Returns:
        ``(B,)`` bool.

    Raises:
        ValueError: As :func:`compositional_reward`.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow.detection import (
        ...     compositional_accuracy)
        >>> from artifex.generative_models.flow.shapes import draw_scene, parse_caption
        >>> img = draw_scene(parse_caption("three green triangles"), np.random.default_rng(1))
        >>> compositional_accuracy(img[None], ["three green triangles"]).tolist()
        [True]
    """
    rewards = compositional_reward(tokenizer, min_area=min_area, score="correct")(images, prompts)
    return rewards == 1.0
