"""PSNR / SSIM used by `verify` and the benchmark, against direct (slow) formulas."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

from model.metrics import gaussian_window, psnr, ssim


def _naive_ssim(x: np.ndarray, y: np.ndarray, win: int = 11, sigma: float = 1.5, L: float = 255.0) -> float:
    """Wang et al. 2004, window by window with explicit Gaussian weights (valid windows, per channel, mean)."""
    g = gaussian_window(win, sigma)
    w = np.outer(g, g)
    c1, c2 = (0.01 * L) ** 2, (0.03 * L) ** 2
    vals = []
    for c in range(x.shape[2]):
        for i in range(x.shape[0] - win + 1):
            for j in range(x.shape[1] - win + 1):
                a = x[i:i + win, j:j + win, c]
                b = y[i:i + win, j:j + win, c]
                ma, mb = (w * a).sum(), (w * b).sum()
                va, vb = (w * (a - ma) ** 2).sum(), (w * (b - mb) ** 2).sum()
                cov = (w * (a - ma) * (b - mb)).sum()
                vals.append(((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2)))
    return float(np.mean(vals))


def test_ssim_matches_the_direct_formula() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(20, 23, 3)).astype(np.uint8)
    y = np.clip(x.astype(int) + rng.integers(-40, 41, size=x.shape), 0, 255).astype(np.uint8)
    got = ssim(x, y)
    assert got == pytest.approx(_naive_ssim(x.astype(float), y.astype(float)), rel=1e-9, abs=1e-12)
    assert 0.0 < got < 1.0
    assert ssim(x, x) == pytest.approx(1.0, abs=1e-12)


def test_ssim_decreases_with_noise() -> None:
    rng = np.random.default_rng(1)
    x = np.tile(np.linspace(0, 255, 64), (64, 1))[:, :, None].repeat(3, axis=2).astype(np.uint8)
    scores = [ssim(x, np.clip(x + rng.normal(0, s, x.shape), 0, 255).astype(np.uint8)) for s in (2, 10, 40)]
    assert scores[0] > scores[1] > scores[2]


def test_psnr_formula_and_inputs() -> None:
    x = np.zeros((8, 8, 3), dtype=np.uint8)
    y = x.copy()
    y[0, 0, 0] = 10  # MSE = 100 / 192
    assert psnr(x, y) == pytest.approx(10 * math.log10(255**2 / (100 / 192)))
    assert psnr(x, x) == math.inf
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(y).save(buf, format="PNG")
    assert psnr(x, buf.getvalue()) == pytest.approx(psnr(x, y))  # PNG bytes are accepted too
    with pytest.raises(ValueError, match="shape mismatch"):
        psnr(x, np.zeros((8, 9, 3), dtype=np.uint8))
