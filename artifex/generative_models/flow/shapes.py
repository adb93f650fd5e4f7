"""A procedurally drawn captioned data set: coloured shapes with counts and positions.

Every image is drawn with NumPy (nothing is downloaded) from a *scene*: one or two object
groups, each ``count`` shapes of one colour and kind, and for two groups a spatial relation
between them. The caption is the scene in words, e.g. ``"two red squares left of a blue
circle"``. The grammar (GenEval's categories on a small vocabulary):

- ``"<count> <colour> <shape>"``: a single group, ``count`` in one..three (``"a"`` for one);
- ``"<count> <colour> <shape> <relation> a <colour> <shape>"``: two groups, the first of one
  or two shapes, the second one shape, ``relation`` in ``left of``, ``right of``, ``above``,
  ``below``; the two groups differ in colour or kind.

Colours are red, green, blue and yellow on a black background; shapes are squares, circles
and triangles. In the default *grid* layout a 32x32 image is a 4x4 grid of 8x8 cells and each
shape, 7 pixels wide, fills the corner of its own cell (so the shapes line up with a DiT's 4x4
patches, which makes the data easy to learn in minutes on a CPU); the *free* layout places
shapes of 7 to 9 pixels anywhere. A relation places the first group wholly on its side of the
second (``left of``: every shape of the first group lies left of every shape of the second).
Images are ``(H, W, 3)`` float32 in ``[-1, 1]``.

:class:`WordTokenizer` maps captions to fixed-length token ids over :data:`SHAPES_VOCABULARY`
(id 0 is padding); :func:`parse_caption` turns a caption back into its :class:`Scene`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from artifex.generative_models.utils.validation import check_choice, check_int

__all__ = [
    "COLOURS",
    "COUNT_WORDS",
    "RELATIONS",
    "SHAPES",
    "SHAPES_VOCABULARY",
    "ObjectGroup",
    "Scene",
    "WordTokenizer",
    "all_captions",
    "draw_scene",
    "make_shapes_dataset",
    "parse_caption",
    "sample_scene",
    "split_captions",
]

#: Colour names and their RGB values in ``[-1, 1]``.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, -1.0, -1.0),
    "green": (-1.0, 1.0, -1.0),
    "blue": (-1.0, -1.0, 1.0),
    "yellow": (1.0, 1.0, -1.0),
}
#: Shape kinds, singular and plural.
SHAPES: dict[str, str] = {"square": "squares", "circle": "circles", "triangle": "triangles"}
#: Count words (``"a"`` and ``"one"`` both mean 1).
COUNT_WORDS: dict[str, int] = {"a": 1, "one": 1, "two": 2, "three": 3}
#: Relations between two groups: the words and the axis and sign of the comparison.
RELATIONS: dict[str, tuple[str, ...]] = {
    "left of": ("left", "of"),
    "right of": ("right", "of"),
    "above": ("above",),
    "below": ("below",),
}
#: Every word of the grammar; id 0 is the padding token.
SHAPES_VOCABULARY: tuple[str, ...] = (
    "<pad>",
    *COUNT_WORDS,
    *COLOURS,
    *SHAPES,
    *SHAPES.values(),
    "left",
    "right",
    "of",
    "above",
    "below",
)
_NUMBER = {1: "a", 2: "two", 3: "three"}


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectGroup:
    """``count`` shapes of one colour and kind.

    Attributes:
        count: How many (1 to 3).
        colour: A key of :data:`COLOURS`.
        shape: A key of :data:`SHAPES` (singular).

    Examples:
        >>> from artifex.generative_models.flow.shapes import ObjectGroup
        >>> ObjectGroup(2, "red", "square").words
        'two red squares'
    """

    count: int
    colour: str
    shape: str

    @property
    def words(self) -> str:
        """The group in words (``"a blue circle"``, ``"two red squares"``)."""
        noun = self.shape if self.count == 1 else SHAPES[self.shape]
        return f"{_NUMBER[self.count]} {self.colour} {noun}"


@dataclasses.dataclass(frozen=True, slots=True)
class Scene:
    """One or two object groups and, for two, the relation of the first to the second.

    Attributes:
        groups: One or two :class:`ObjectGroup`.
        relation: A key of :data:`RELATIONS` for two groups, else ``None``.

    Examples:
        >>> from artifex.generative_models.flow.shapes import ObjectGroup, Scene
        >>> Scene((ObjectGroup(2, "red", "square"), ObjectGroup(1, "blue", "circle")),
        ...       "left of").caption
        'two red squares left of a blue circle'
    """

    groups: tuple[ObjectGroup, ...]
    relation: str | None = None

    @property
    def caption(self) -> str:
        """The scene in words."""
        if self.relation is None:
            return self.groups[0].words
        return f"{self.groups[0].words} {self.relation} {self.groups[1].words}"


def all_captions() -> list[str]:
    """Every caption of the grammar, in a fixed order.

    Returns:
        36 single-group captions (3 counts x 4 colours x 3 shapes) and 1056 two-group ones
        (4 relations x 2 counts x 12 x 11 pairs of different colour-shape kinds).

    Examples:
        >>> from artifex.generative_models.flow.shapes import all_captions
        >>> captions = all_captions()
        >>> len(captions), captions[0], captions[-1]
        (1092, 'a red square', 'two yellow triangles below a yellow circle')
    """
    kinds = list(itertools.product(COLOURS, SHAPES))
    out = [ObjectGroup(n, c, s).words for n in (1, 2, 3) for c, s in kinds]
    for relation in RELATIONS:
        for n in (1, 2):
            for (c1, s1), (c2, s2) in itertools.product(kinds, kinds):
                if (c1, s1) != (c2, s2):
                    groups = (ObjectGroup(n, c1, s1), ObjectGroup(1, c2, s2))
                    out.append(Scene(groups, relation).caption)
    return out


def split_captions(fraction: float = 0.2, seed: int = 0) -> tuple[list[str], list[str]]:
    """Splits :func:`all_captions` at random into training and held-out captions.

    The held-out set keeps the grammar's mix: the same fraction of single-group and of
    two-group captions.

    Args:
        fraction: Share of held-out captions, in ``(0, 1)``.
        seed: Seeds the split.

    Returns:
        ``(train, held_out)``.

    Raises:
        ValueError: ``fraction`` is not in ``(0, 1)``.

    Examples:
        >>> from artifex.generative_models.flow.shapes import split_captions
        >>> train, held_out = split_captions(0.2)
        >>> len(train), len(held_out), set(train) & set(held_out)
        (874, 218, set())
    """
    if not 0.0 < fraction < 1.0:
        msg = f"fraction must be in (0, 1), got {fraction}"
        raise ValueError(msg)
    rng = np.random.default_rng(seed)
    captions = all_captions()
    single = [c for c in captions if parse_caption(c).relation is None]
    double = [c for c in captions if parse_caption(c).relation is not None]
    train, held = [], []
    for part in (single, double):
        order = rng.permutation(len(part))
        k = round(fraction * len(part))
        held += [part[i] for i in sorted(order[:k])]
        train += [part[i] for i in sorted(order[k:])]
    return train, held


def parse_caption(caption: str) -> Scene:
    """The :class:`Scene` a caption of the grammar describes.

    Args:
        caption: E.g. ``"two red squares left of a blue circle"``.

    Returns:
        The scene.

    Raises:
        ValueError: The caption is not in the grammar (the message names the word).

    Examples:
        >>> from artifex.generative_models.flow.shapes import parse_caption
        >>> parse_caption("three green circles").groups[0].count
        3
        >>> parse_caption("a red square above a blue circle").relation
        'above'
    """
    words = caption.split()

    def group(i: int) -> tuple[ObjectGroup, int]:
        if i + 3 > len(words):
            msg = f"caption {caption!r} ends early: expected '<count> <colour> <shape>'"
            raise ValueError(msg)
        count_word, colour, noun = words[i : i + 3]
        if count_word not in COUNT_WORDS:
            expected = sorted(COUNT_WORDS)
            msg = f"caption {caption!r}: expected a count word {expected}, got {count_word!r}"
            raise ValueError(msg)
        if colour not in COLOURS:
            msg = f"caption {caption!r}: expected a colour {sorted(COLOURS)}, got {colour!r}"
            raise ValueError(msg)
        count = COUNT_WORDS[count_word]
        want = {s: s for s in SHAPES} if count == 1 else {p: s for s, p in SHAPES.items()}
        if noun not in want:
            msg = (
                f"caption {caption!r}: expected a shape {sorted(want)} after {count_word!r}, "
                f"got {noun!r}"
            )
            raise ValueError(msg)
        return ObjectGroup(count, colour, want[noun]), i + 3

    first, i = group(0)
    if i == len(words):
        return Scene((first,))
    for relation, rel_words in RELATIONS.items():
        if tuple(words[i : i + len(rel_words)]) == rel_words:
            second, j = group(i + len(rel_words))
            if j != len(words):
                msg = f"caption {caption!r}: unexpected words after the second group: {words[j:]}"
                raise ValueError(msg)
            return Scene((first, second), relation)
    msg = f"caption {caption!r}: expected a relation {sorted(RELATIONS)} after {first.words!r}"
    raise ValueError(msg)


class WordTokenizer:
    """Captions to fixed-length token ids over a word vocabulary (id 0 pads).

    Args:
        vocabulary: The words; the first is the padding token.
        max_length: Token ids per caption (shorter captions are padded, longer refused).

    Raises:
        ValueError: An empty or duplicated vocabulary, a bad ``max_length``.

    Examples:
        >>> from artifex.generative_models.flow.shapes import (
        ...     SHAPES_VOCABULARY, WordTokenizer)
        >>> tok = WordTokenizer(SHAPES_VOCABULARY, max_length=8)
        >>> ids = tok.encode(["a red square", "two blue circles above a green triangle"])
        >>> ids.shape, tok.decode(ids)[0]
        ((2, 8), 'a red square')
    """

    def __init__(self, vocabulary: Sequence[str], max_length: int):
        vocabulary = tuple(vocabulary)
        if len(vocabulary) < 2 or len(set(vocabulary)) != len(vocabulary):
            msg = f"vocabulary must hold >= 2 distinct words, got {vocabulary}"
            raise ValueError(msg)
        self.vocabulary = vocabulary
        self.max_length = check_int("max_length", max_length, minimum=1)
        self._ids = {w: i for i, w in enumerate(vocabulary)}

    @property
    def vocab_size(self) -> int:
        """Number of words, padding included."""
        return len(self.vocabulary)

    def encode(self, captions: Sequence[str] | str) -> np.ndarray:
        """Token ids ``(N, max_length)`` int32 of ``N`` captions (one string: ``N = 1``).

        Args:
            captions: Captions, words separated by spaces.

        Returns:
            The ids, padded with 0.

        Raises:
            ValueError: A word outside the vocabulary, or a caption over ``max_length`` words.
            TypeError: A caption that is not a string.
        """
        if isinstance(captions, str):
            captions = [captions]
        out = np.zeros((len(captions), self.max_length), np.int32)
        for row, caption in enumerate(captions):
            if not isinstance(caption, str):
                msg = f"captions must be strings, got {type(caption).__name__} at row {row}"
                raise TypeError(msg)
            words = caption.split()
            if len(words) > self.max_length:
                msg = (
                    f"caption {caption!r} has {len(words)} words, over max_length {self.max_length}"
                )
                raise ValueError(msg)
            for col, word in enumerate(words):
                if word not in self._ids or self._ids[word] == 0:
                    msg = f"caption {caption!r}: word {word!r} is not in the vocabulary"
                    raise ValueError(msg)
                out[row, col] = self._ids[word]
        return out

    def decode(self, ids: np.ndarray) -> list[str]:
        """Captions of ``(N, L)`` token ids (padding dropped).

        Args:
            ids: Token ids.

        Returns:
            ``N`` captions.

        Raises:
            ValueError: An id outside the vocabulary.
        """
        ids = np.asarray(ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            msg = f"ids must be (N, L) integers, got shape {ids.shape} and dtype {ids.dtype}"
            raise ValueError(msg)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            msg = f"ids must be in [0, {self.vocab_size}), got {ids.min()}..{ids.max()}"
            raise ValueError(msg)
        return [" ".join(self.vocabulary[i] for i in row if i != 0) for row in ids]


# ------------------------------------------------------------------------------ drawing
def _shape_mask(shape: str, size: int) -> np.ndarray:
    """``(size, size)`` bool mask of one shape."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    c = size / 2.0
    if shape == "square":
        return np.ones((size, size), bool)
    if shape == "circle":
        return (x - c) ** 2 + (y - c) ** 2 <= c * c
    # triangle: apex at the top middle, base along the bottom row
    return np.abs(x - c) <= (y / size) * c


def _regions(scene: Scene, size: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """``(y0, y1, x0, x1)`` area each group's shapes must lie in."""
    h, w = size
    if scene.relation is None:
        return [(0, h, 0, w)]
    half_w, half_h = w // 2, h // 2
    first, second = {
        "left of": ((0, h, 0, half_w), (0, h, half_w, w)),
        "right of": ((0, h, half_w, w), (0, h, 0, half_w)),
        "above": ((0, half_h, 0, w), (half_h, h, 0, w)),
        "below": ((half_h, h, 0, w), (0, half_h, 0, w)),
    }[scene.relation]
    return [first, second]


def _draw_grid(scene: Scene, rng: np.random.Generator, image_size: int) -> np.ndarray:
    """Shapes of ``image_size // 4 - 1`` pixels at the corners of distinct cells of a 4x4 grid."""
    cell = image_size // 4
    image = np.full((image_size, image_size, 3), -1.0, np.float32)
    taken: set[tuple[int, int]] = set()
    for group, (y0, y1, x0, x1) in zip(
        scene.groups, _regions(scene, (image_size,) * 2), strict=True
    ):
        cells = [
            (r, c)
            for r in range(4)
            for c in range(4)
            if y0 <= r * cell
            and (r + 1) * cell <= y1
            and x0 <= c * cell
            and (c + 1) * cell <= x1
            and (r, c) not in taken
        ]
        chosen = rng.choice(len(cells), size=group.count, replace=False)
        mask = _shape_mask(group.shape, cell - 1)
        for i in sorted(chosen):
            r, c = cells[i]
            taken.add((r, c))
            image[r * cell : (r + 1) * cell - 1, c * cell : (c + 1) * cell - 1][mask] = COLOURS[
                group.colour
            ]
    return image


def draw_scene(
    scene: Scene,
    rng: np.random.Generator,
    image_size: int = 32,
    max_tries: int = 200,
    *,
    layout: str = "grid",
) -> np.ndarray:
    """Draws ``scene`` at random positions: ``(S, S, 3)`` float32 in ``[-1, 1]``.

    Each group lies inside its side of the relation (the left half for ``left of``, ...).
    ``layout="grid"``: the image is a 4x4 grid of cells of ``S / 4`` pixels and each shape,
    ``S / 4 - 1`` pixels wide, fills the corner of a distinct cell (one free pixel to the next
    cell); ``"free"``: shapes of 7 to 9 pixels anywhere, at least one pixel apart.

    Args:
        scene: What to draw.
        rng: Random positions and sizes.
        image_size: ``S`` (at least 24; a multiple of 4 for the grid).
        max_tries: Placement attempts per shape before giving up (``"free"``).
        layout: ``"grid"`` or ``"free"``.

    Returns:
        The image.

    Raises:
        ValueError: ``image_size`` under 24 (or not a multiple of 4 for the grid), an unknown
            ``layout``, or no room for a shape after ``max_tries``.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow.shapes import draw_scene, parse_caption
        >>> img = draw_scene(parse_caption("two red squares"), np.random.default_rng(0))
        >>> img.shape, sorted({tuple(p) for p in img.reshape(-1, 3).tolist()})
        ((32, 32, 3), [(-1.0, -1.0, -1.0), (1.0, -1.0, -1.0)])
        >>> int((img[..., 0] > 0).sum())  # two 7x7 squares
        98
    """
    check_int("image_size", image_size, minimum=24)
    check_choice("layout", layout, ("grid", "free"))
    if layout == "grid":
        if image_size % 4:
            msg = f"image_size must be a multiple of 4 for the grid layout, got {image_size}"
            raise ValueError(msg)
        return _draw_grid(scene, rng, image_size)
    image = np.full((image_size, image_size, 3), -1.0, np.float32)
    taken = np.zeros((image_size, image_size), bool)
    for group, (y0, y1, x0, x1) in zip(
        scene.groups, _regions(scene, (image_size,) * 2), strict=True
    ):
        for _ in range(group.count):
            for _ in range(max_tries):
                s = int(rng.integers(7, 10))
                if y1 - y0 < s or x1 - x0 < s:
                    continue
                y = int(rng.integers(y0, y1 - s + 1))
                x = int(rng.integers(x0, x1 - s + 1))
                # one free pixel around every shape keeps shapes apart
                if taken[max(y - 1, 0) : y + s + 1, max(x - 1, 0) : x + s + 1].any():
                    continue
                mask = _shape_mask(group.shape, s)
                image[y : y + s, x : x + s][mask] = COLOURS[group.colour]
                taken[y : y + s, x : x + s] = True
                break
            else:
                msg = f"no room for {group.words} in {scene.caption!r} after {max_tries} tries"
                raise ValueError(msg)
    return image


def sample_scene(rng: np.random.Generator, captions: Sequence[str] | None = None) -> Scene:
    """A scene drawn uniformly from ``captions`` (default: the whole grammar).

    Args:
        rng: Randomness.
        captions: The captions to draw from.

    Returns:
        The scene.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow.shapes import sample_scene
        >>> sample_scene(np.random.default_rng(0), ["a red square"]).caption
        'a red square'
    """
    captions = all_captions() if captions is None else list(captions)
    return parse_caption(captions[int(rng.integers(len(captions)))])


def make_shapes_dataset(
    num_images: int,
    *,
    captions: Sequence[str] | None = None,
    image_size: int = 32,
    seed: int = 0,
    layout: str = "grid",
) -> tuple[np.ndarray, list[str]]:
    """``num_images`` drawn scenes and their captions.

    Args:
        num_images: How many.
        captions: The captions to draw scenes from (default: the whole grammar; pass the
            training split of :func:`split_captions` to keep held-out captions unseen).
        image_size: Side of the square images.
        seed: Seeds the scenes and their layouts.
        layout: ``"grid"`` or ``"free"`` (:func:`draw_scene`).

    Returns:
        ``(images, captions)``: ``(N, S, S, 3)`` float32 in ``[-1, 1]`` and ``N`` captions.

    Examples:
        >>> from artifex.generative_models.flow.shapes import make_shapes_dataset
        >>> images, captions = make_shapes_dataset(4, seed=1)
        >>> images.shape, len(captions)
        ((4, 32, 32, 3), 4)
    """
    check_int("num_images", num_images, minimum=1)
    rng = np.random.default_rng(seed)
    pool = all_captions() if captions is None else list(captions)
    for c in pool:
        parse_caption(c)  # refuses captions outside the grammar
    images = np.empty((num_images, image_size, image_size, 3), np.float32)
    out = []
    for i in range(num_images):
        scene = sample_scene(rng, pool)
        images[i] = draw_scene(scene, rng, image_size, layout=layout)
        out.append(scene.caption)
    return images, out
