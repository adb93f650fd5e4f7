"""Image grids, the PNG writer and shape descriptions, against plain float64 references."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from artifex.generative_models.flow import (
    as_images,
    describe_shapes,
    draw_scene,
    image_grid,
    parse_caption,
    write_png,
)


def _grid_reference(images, columns, border):
    """Cell by cell in float64: value v -> round((clip(v, -1, 1) + 1) * 127.5), grey 128."""
    n, h, w, c = images.shape
    cols = min(columns, n)
    rows = -(-n // cols)
    out = np.full((rows * (h + border) + border, cols * (w + border) + border, 3), 128.0)
    for i in range(n):
        r, k = i // cols, i % cols
        for y in range(h):
            for x in range(w):
                for ch in range(3):
                    v = images[i, y, x, ch if c == 3 else 0]
                    v = min(max(float(v), -1.0), 1.0)
                    out[border + r * (h + border) + y, border + k * (w + border) + x, ch] = round(
                        (v + 1.0) * 127.5
                    )
    return out


@pytest.mark.parametrize(
    ("seed", "n", "c", "columns", "border"), [(0, 5, 3, 3, 1), (1, 4, 1, 8, 0)]
)
def test_image_grid_against_float64(seed, n, c, columns, border):
    images = np.random.default_rng(seed).uniform(-1.5, 1.5, (n, 4, 3, c))
    got = image_grid(images, columns=columns, border=border)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, _grid_reference(images, columns, border))


def _read_png(path):
    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    w, h, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2)
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, 3)


def test_png_round_trip(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    write_png(tmp_path / "x.png", pixels)
    np.testing.assert_array_equal(_read_png(tmp_path / "x.png"), pixels)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"pixels must be \(H, W, 3\) uint8"):
        write_png("unused.png", np.zeros((2, 2, 3)))
    with pytest.raises(ValueError, match=r"images must be \(N, H, W, C\)"):
        image_grid(np.zeros((2, 4, 4, 2)))
    with pytest.raises(ValueError, match="images must be finite, got 1 NaN"):
        image_grid(np.full((1, 1, 1, 3), [np.nan, 0.0, 0.0]))
    with pytest.raises(ValueError, match="columns must be"):
        image_grid(np.zeros((1, 2, 2, 3)), columns=0)
    with pytest.raises(ValueError, match=r"images must be N images of shape \(4, 4, 3\)"):
        as_images(np.zeros((2, 47)), (4, 4, 3))
    with pytest.raises(ValueError, match=r"image_shape must be \(H, W\) or \(H, W, C\)"):
        as_images(np.zeros((2, 4)), (4,))
    np.testing.assert_array_equal(as_images(np.arange(12.0)[None], (2, 2, 3))[0, 1, 0], [6, 7, 8])


def test_describe_shapes():
    rng = np.random.default_rng(3)
    img = draw_scene(parse_caption("three green triangles above a yellow square"), rng)
    assert describe_shapes(img) == "3 green triangles, 1 yellow square"
    assert describe_shapes(img.reshape(-1)) == "3 green triangles, 1 yellow square"
    assert describe_shapes(np.full((32, 32, 3), -1.0)) == "nothing"
    with pytest.raises(ValueError, match="NaN or infinite"):
        describe_shapes(np.full((32, 32, 3), np.nan))
