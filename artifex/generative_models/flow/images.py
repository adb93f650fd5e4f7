"""Images of a flow run on disk: a grid of samples as a PNG, and words for one image.

:func:`image_grid` tiles ``(N, H, W, C)`` images in ``[-1, 1]`` into one ``uint8`` picture
(rows of ``columns`` images, one pixel of border); :func:`write_png` writes it with the
standard library only (``zlib``), so a run needs no imaging package; :func:`describe_shapes`
puts what the compositional reward's detector sees in an image into words, which is what
the completions log shows in place of a text completion.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from artifex.generative_models.flow.detection import detect_shapes
from artifex.generative_models.utils.atomic import atomic_write
from artifex.generative_models.utils.validation import check_int

__all__ = ["as_images", "describe_shapes", "image_grid", "write_png"]


def as_images(images: Any, image_shape: Sequence[int]) -> np.ndarray:
    """``(N, H, W, C)`` float32 images from flattened ``(N, D)`` rows (or images already).

    Args:
        images: ``(N, D)`` with ``D = H W C`` (or ``H W`` for grey), or ``(N, *image_shape)``.
        image_shape: ``(H, W, C)`` or ``(H, W)``.

    Returns:
        ``(N, H, W, C)`` (``C = 1`` for grey images).

    Raises:
        ValueError: The values do not make ``N`` images of ``image_shape``.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow.images import as_images
        >>> as_images(np.zeros((2, 48)), (4, 4, 3)).shape
        (2, 4, 4, 3)
        >>> as_images(np.zeros((2, 16)), (4, 4)).shape  # grey
        (2, 4, 4, 1)
    """
    x = np.asarray(images, np.float32)
    shape = tuple(int(s) for s in image_shape)
    if len(shape) not in (2, 3):
        msg = f"image_shape must be (H, W) or (H, W, C), got {shape}"
        raise ValueError(msg)
    if x.ndim < 1 or x.size != x.shape[0] * math.prod(shape):
        msg = f"images must be N images of shape {shape} (or flattened), got shape {x.shape}"
        raise ValueError(msg)
    full = shape if len(shape) == 3 else (*shape, 1)
    return x.reshape(x.shape[0], *full)


def image_grid(images: Any, columns: int = 8, *, border: int = 1) -> np.ndarray:
    """Tiles ``N`` images into one ``uint8`` RGB picture, ``columns`` per row.

    Values in ``[-1, 1]`` map to ``[0, 255]`` (clipped); grey images become RGB; empty cells
    of the last row and the borders are grey (128).

    Args:
        images: ``(N, H, W, C)`` with ``C`` 1 or 3.
        columns: Images per row.
        border: Pixels between images.

    Returns:
        ``(rows (H + border) + border, columns (W + border) + border, 3)`` uint8.

    Raises:
        ValueError: Not ``(N, H, W, 1 or 3)`` with ``N >= 1``, or values that are not finite.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow.images import image_grid
        >>> grid = image_grid(np.ones((3, 2, 2, 3)), columns=2)
        >>> grid.shape, grid.dtype, int(grid[1, 1, 0]), int(grid[0, 0, 0])
        ((7, 7, 3), dtype('uint8'), 255, 128)
    """
    x = np.asarray(images, np.float64)
    if x.ndim != 4 or x.shape[0] < 1 or x.shape[-1] not in (1, 3):
        msg = f"images must be (N, H, W, C) with N >= 1 and C 1 or 3, got shape {x.shape}"
        raise ValueError(msg)
    if not np.isfinite(x).all():
        msg = f"images must be finite, got {int((~np.isfinite(x)).sum())} NaN or infinite values"
        raise ValueError(msg)
    columns = check_int("columns", columns, minimum=1)
    border = check_int("border", border, minimum=0)
    n, h, w, _ = x.shape
    columns = min(columns, n)
    rows = -(-n // columns)
    pixels = np.round((np.clip(x, -1.0, 1.0) + 1.0) * 127.5).astype(np.uint8)
    if pixels.shape[-1] == 1:
        pixels = np.repeat(pixels, 3, axis=-1)
    out = np.full((rows * (h + border) + border, columns * (w + border) + border, 3), 128, np.uint8)
    for i in range(n):
        r, c = divmod(i, columns)
        y, z = border + r * (h + border), border + c * (w + border)
        out[y : y + h, z : z + w] = pixels[i]
    return out


def write_png(path: str | os.PathLike[str], pixels: Any) -> None:
    """Writes an ``(H, W, 3)`` uint8 picture as a PNG file (atomically).

    Args:
        path: The file.
        pixels: ``(H, W, 3)`` uint8 (e.g. from :func:`image_grid`).

    Raises:
        ValueError: Not ``(H, W, 3)`` uint8.

    Examples:
        >>> import os, tempfile
        >>> import numpy as np
        >>> from artifex.generative_models.flow.images import write_png
        >>> path = os.path.join(tempfile.mkdtemp(), "x.png")
        >>> write_png(path, np.zeros((2, 3, 3), np.uint8))
        >>> open(path, "rb").read(4)[1:]
        b'PNG'
    """
    x = np.asarray(pixels)
    if x.ndim != 3 or x.shape[-1] != 3 or x.dtype != np.uint8 or 0 in x.shape:
        msg = f"pixels must be (H, W, 3) uint8, got shape {x.shape} and dtype {x.dtype}"
        raise ValueError(msg)
    h, w, _ = x.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    # each row starts with filter type 0 (none)
    raw = b"".join(b"\x00" + x[row].tobytes() for row in range(h))
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB
    data = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
    with atomic_write(os.fspath(path), "wb") as fh:
        fh.write(data)


def describe_shapes(image: Any) -> str:
    """What the compositional reward's detector finds in an image, in words.

    Args:
        image: ``(H, W, 3)`` RGB in ``[-1, 1]`` (or flattened ``3 S^2`` values).

    Returns:
        E.g. ``"2 red squares, 1 blue circle"`` (grouped by colour and kind, sorted), or
        ``"nothing"``.

    Raises:
        ValueError: A malformed image, or NaN or infinite values.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow.images import describe_shapes
        >>> from artifex.generative_models.flow import draw_scene, parse_caption
        >>> img = draw_scene(parse_caption("two red squares left of a blue circle"),
        ...                  np.random.default_rng(0))
        >>> describe_shapes(img)
        '1 blue circle, 2 red squares'
    """
    counts: dict[tuple[str, str], int] = {}
    for s in detect_shapes(image):
        counts[(s.colour, s.shape)] = counts.get((s.colour, s.shape), 0) + 1
    if not counts:
        return "nothing"
    return ", ".join(
        f"{n} {colour} {shape}{'s' if n > 1 else ''}"
        for (colour, shape), n in sorted(counts.items())
    )
