"""PNG bytes of a result's image, per quality tier.

`lossless` writes what a diffusers user gets from `image.save(path)` (Pillow's encoder at its default level, no
metadata), so its bytes equal stock diffusers' for the same pixels. `high` writes the same pixels faster: Pillow
deflates one PNG on one core, and at 1024x1024 that is a large share of the time outside the transformer. The
parallel writer here splits the rows into a fixed number of bands, filters and deflates each band on a thread
(zlib releases the GIL), and joins the bands into one zlib stream the way pigz does (each band but the last ends
in a sync flush, so raw deflate data can follow it). The band count is fixed, so equal pixels give equal bytes on
any machine.
"""

from __future__ import annotations

import io
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from model.request import Quality

if TYPE_CHECKING:
    import numpy as np
    import PIL.Image

# Rows are split into this many bands at most: the bytes depend on it, never on the machine's core count.
BANDS = 16
# Level 1 with the Sub filter: a little larger than Pillow's default files, many times faster to write (the trade is
# measured in bench/results/png-cpu.md).
LEVEL = 1
_SUB = 1  # PNG filter type: each byte minus the same channel of the pixel to its left

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def png_bytes(image: "PIL.Image.Image") -> bytes:
    """Pillow's PNG encoding of an image at its default level, with no metadata (no time, no text chunks): equal
    pixels give equal bytes, and they are the bytes `image.save(path)` writes."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def result_png(image: "PIL.Image.Image", quality: Quality) -> bytes:
    """The PNG of a generated image of this tier: Pillow's bytes for `lossless`, the parallel writer's (same pixels)
    for `high`. Images other than 8-bit RGB go through Pillow in both tiers."""
    if quality == "high" and image.mode == "RGB":
        import numpy as np

        return parallel_png(np.asarray(image))
    return png_bytes(image)


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, min(BANDS, os.cpu_count() or 1)),
                                       thread_name_prefix="png")
        return _pool


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _band(pixels: "np.ndarray", r0: int, r1: int, last: bool) -> tuple[bytes, bytes]:
    """Rows [r0, r1) Sub-filtered with their filter bytes (the raw data), and that data deflated (raw deflate,
    ending in a sync flush unless it is the last band)."""
    import numpy as np

    rows = pixels[r0:r1].reshape(r1 - r0, -1)
    channels = pixels.shape[2]
    raw = np.empty((r1 - r0, rows.shape[1] + 1), dtype=np.uint8)
    raw[:, 0] = _SUB
    raw[:, 1:channels + 1] = rows[:, :channels]
    np.subtract(rows[:, channels:], rows[:, :-channels], out=raw[:, channels + 1:])  # uint8: wraps mod 256
    data = raw.tobytes()
    deflate = zlib.compressobj(LEVEL, zlib.DEFLATED, -15, 9)
    return data, deflate.compress(data) + deflate.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


def parallel_png(pixels: "np.ndarray") -> bytes:
    """A PNG of 8-bit RGB pixels [H, W, 3] (C order), its bands filtered and deflated on threads."""
    import numpy as np

    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"parallel_png takes uint8 [H, W, 3] pixels, got {pixels.dtype} {tuple(pixels.shape)}")
    pixels = np.ascontiguousarray(pixels)
    height, width, _ = pixels.shape
    if height == 0 or width == 0:
        raise ValueError("a PNG has at least one pixel")
    bounds = np.linspace(0, height, min(BANDS, height) + 1).astype(int).tolist()
    n = len(bounds) - 1
    bands = list(_threads().map(lambda i: _band(pixels, bounds[i], bounds[i + 1], i == n - 1), range(n)))
    adler = 1
    for data, _ in bands:
        adler = zlib.adler32(data, adler)
    # zlib header: deflate with a 32 KiB window, no preset dictionary (0x78 0x01 passes the FCHECK test)
    stream = b"\x78\x01" + b"".join(deflated for _, deflated in bands) + struct.pack(">I", adler)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, deflate, adaptive filters, no interlace
    return _SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", stream) + _chunk(b"IEND", b"")
