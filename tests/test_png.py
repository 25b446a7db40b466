"""PNG bytes per tier (model/png.py): `lossless` writes Pillow's bytes, `high` the same pixels through the parallel
writer, whose bytes depend on the pixels alone."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from model import png


def _smooth(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A picture with gradients and edges (compresses like a photo, unlike noise)."""
    rng = np.random.default_rng(seed)
    field = np.cumsum(rng.normal(size=(height, width, 3)), axis=1)
    field = (field - field.min()) / max(1e-9, float(field.max() - field.min())) * 255
    return field.astype(np.uint8)


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, payload) of every chunk, each chunk's CRC checked against zlib's."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, payload = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + payload), kind
        out.append((kind, payload))
        pos += 12 + length
    return out


@pytest.mark.parametrize("shape", [(1, 1), (1, 37), (5, 3), (15, 16), (17, 9), (256, 256), (768, 1360)])
def test_the_parallel_writer_keeps_every_pixel(shape: tuple[int, int]) -> None:
    """Fewer rows than bands, one row, odd widths, wide pictures: Pillow (an independent decoder) reads back exactly
    the pixels written. Catches a wrong filter (Sub's first pixel, the uint8 wrap), a band boundary off by a row,
    or a band that ends the stream early."""
    rng = np.random.default_rng(sum(shape))
    for pixels in (rng.integers(0, 256, (*shape, 3), dtype=np.uint8), _smooth(*shape)):
        data = png.parallel_png(pixels)
        with Image.open(io.BytesIO(data)) as im:
            assert im.format == "PNG" and im.mode == "RGB" and im.size == (shape[1], shape[0])
            assert np.array_equal(np.asarray(im), pixels)


def test_the_stream_is_one_valid_zlib_stream_with_its_checksum() -> None:
    """The joined bands inflate as one zlib stream (zlib checks the header and the Adler-32 of the whole data)
    and every chunk's CRC is right: a decoder stricter than Pillow's accepts the file too."""
    pixels = _smooth(300, 200, seed=3)
    kinds = _chunks(png.parallel_png(pixels))
    assert [k for k, _ in kinds] == [b"IHDR", b"IDAT", b"IEND"] and kinds[2][1] == b""
    assert struct.unpack(">IIBBBBB", kinds[0][1]) == (200, 300, 8, 2, 0, 0, 0)
    raw = zlib.decompress(kinds[1][1])  # raises on a bad header, a truncated stream or a wrong checksum
    assert len(raw) == 300 * (1 + 200 * 3)
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(300, -1)
    assert (rows[:, 0] == 1).all()  # every row Sub-filtered
    assert np.array_equal(np.cumsum(rows[:, 1:].reshape(300, 200, 3), axis=1, dtype=np.uint8), pixels)


def test_the_bytes_depend_on_the_pixels_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts with 1, 3 or 64 cores write the same bytes for the same pixels: a replica's PNG does not depend on
    its machine (nor on how many threads the writer got)."""
    pixels = _smooth(200, 120, seed=5)
    here = png.parallel_png(pixels)
    other = pixels.copy()
    other[100, 60, 1] ^= 1
    assert png.parallel_png(other) != here
    for cores in (1, 3, 64):
        monkeypatch.setattr(png.os, "cpu_count", lambda cores=cores: cores)
        monkeypatch.setattr(png, "_pool", None)  # a fresh pool sized for this host
        assert png.parallel_png(pixels) == here, cores
        png._threads().shutdown()


def test_lossless_writes_pillows_bytes_and_high_the_same_pixels_faster() -> None:
    """`lossless` bytes are what `image.save(path)` writes with Pillow's defaults (a diffusers user's file);
    `high` bytes are the parallel writer's, with the same pixels. Other modes go through Pillow in both tiers."""
    image = Image.fromarray(_smooth(64, 96, seed=7))
    saved = io.BytesIO()
    image.save(saved, format="PNG")
    assert png.result_png(image, "lossless") == saved.getvalue() == png.png_bytes(image)
    high = png.result_png(image, "high")
    assert high == png.parallel_png(np.asarray(image)) and high != saved.getvalue()
    with Image.open(io.BytesIO(high)) as im:
        assert np.array_equal(np.asarray(im), np.asarray(image))
    grey = image.convert("L")
    assert png.result_png(grey, "high") == png.png_bytes(grey)


def test_the_writer_refuses_what_it_cannot_write() -> None:
    with pytest.raises(ValueError, match="uint8"):
        png.parallel_png(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        png.parallel_png(np.zeros((4, 4, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="^a PNG has at least one pixel$"):
        png.parallel_png(np.zeros((0, 4, 3), dtype=np.uint8))


def test_a_high_result_is_encoded_by_the_parallel_writer_now_or_later() -> None:
    """Through the pipeline: a `high` image's PNG is the parallel writer's bytes of its pixels, whether generate()
    encodes it or leaves it to `encode_pngs` (what a replica does after the batch); `lossless` stays Pillow's."""
    import torch

    from model.loading import load_pipeline
    from model.pipeline import GenerationRequest, encode_pngs

    pipe = load_pipeline("tiny", device="cpu", dtype=torch.float32)
    for quality in ("lossless", "high"):
        req = GenerationRequest("a red fox", height=64, width=64, steps=2, seed=1, quality=quality)
        now = pipe.generate([req])[0]
        later = pipe.generate([req], encode=False)[0]
        assert later.png is None and later.image is not None
        pending_image = later.image
        encode_pngs([later])
        assert later.png == now.png
        expected = png.parallel_png(np.asarray(pending_image)) if quality == "high" else png.png_bytes(pending_image)
        assert now.png == expected
