"""Image similarity for comparing the "high" tier against "lossless": PSNR and SSIM (Wang et al. 2004).

SSIM: Gaussian window (11 taps, sigma 1.5), K1=0.01, K2=0.03, population statistics, computed per channel over the
"valid" region (windows fully inside the image) and averaged; this is the usual definition (skimage's
`structural_similarity(gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=255)` crops the
same border). Computed in float64.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np


def to_array(image: Any) -> np.ndarray:
    """PNG bytes, a PIL image or an array -> float64 array [H, W, C] of 0..255 values."""
    if isinstance(image, (bytes, bytearray)):
        from PIL import Image

        image = Image.open(io.BytesIO(image))
        image.load()
    arr = np.asarray(image, dtype=np.float64)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3:
        raise ValueError(f"expected an image [H, W] or [H, W, C], got shape {arr.shape}")
    return arr


def psnr(a: Any, b: Any, data_range: float = 255.0) -> float:
    """Peak signal-to-noise ratio in dB; inf for identical images."""
    x, y = to_array(a), to_array(b)
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(data_range**2 / mse)


def gaussian_window(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    """Normalised 1-D Gaussian taps."""
    r = np.arange(size, dtype=np.float64) - (size - 1) / 2.0
    g = np.exp(-(r**2) / (2.0 * sigma**2))
    return g / g.sum()


def ssim(a: Any, b: Any, data_range: float = 255.0, win_size: int = 11, sigma: float = 1.5) -> float:
    """Mean structural similarity over channels and valid windows (1.0 for identical images)."""
    import torch
    import torch.nn.functional as F

    x, y = to_array(a), to_array(b)
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
    if min(x.shape[:2]) < win_size:
        raise ValueError(f"image {x.shape[:2]} smaller than the {win_size}-pixel SSIM window")
    c1 = (0.01 * data_range) ** 2
    c2 = (0.03 * data_range) ** 2
    g = torch.from_numpy(gaussian_window(win_size, sigma))
    # [C, 1, H, W]: channels as a batch; separable filter = row pass then column pass.
    tx = torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))[:, None]
    ty = torch.from_numpy(np.ascontiguousarray(y.transpose(2, 0, 1)))[:, None]

    def blur(t: torch.Tensor) -> torch.Tensor:
        t = F.conv2d(t, g.view(1, 1, 1, -1))
        return F.conv2d(t, g.view(1, 1, -1, 1))

    mx, my = blur(tx), blur(ty)
    vx = blur(tx * tx) - mx * mx
    vy = blur(ty * ty) - my * my
    cxy = blur(tx * ty) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(s.mean())
