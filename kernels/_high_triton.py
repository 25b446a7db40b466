"""Triton kernels of the `high` tier that are not bit-exact (imported lazily: triton is optional on CPU hosts).

Each trades eager's rounding points for fewer passes; the tier that mounts them reports PSNR/SSIM against lossless.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._lossless_triton import _TL_DTYPE, _cast

# ----------------------------------------------------------------------------------------------------------------
# LayerNorm (no affine) + AdaLN modulation in one pass
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def ln_modulate_row(x_ptr, scale_ptr, shift_ptr, S, N, x_sb, x_ss, scale_sb, shift_sb, eps, BLOCK_N: tl.constexpr):
    """Program (row, batch)'s row of `modulate(layer_norm(x))` in fp32: (y, its output row index, cols, mask).

    Not bit-exact (quality "high"): two-pass statistics over the row held in registers, FMAs allowed. Shared with
    kernels/_fp8_triton.py, which quantizes the row instead of rounding it."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + b * x_sb + row * x_ss + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)
    sc = tl.load(scale_ptr + b * scale_sb + cols, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + b * shift_sb + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, xc * rstd * (1.0 + sc) + sh, 0.0), b * S + row, cols, mask


@triton.jit
def _ln_modulate_fast_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr,
    S, N, x_sb, x_ss, scale_sb, shift_sb, eps,
    TY: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One rounding at the end instead of eager's three.
    y, out_row, cols, mask = ln_modulate_row(x_ptr, scale_ptr, shift_ptr, S, N, x_sb, x_ss, scale_sb, shift_sb, eps,
                                             BLOCK_N)
    tl.store(out_ptr + out_row * N + cols, _cast(y, TY), mask=mask)


def ln_modulate_fast(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    B, S, D = x.shape
    out = torch.empty((B, S, D), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    _ln_modulate_fast_kernel[(S, B)](
        x, scale, shift, out, S, D, x.stride(0), x.stride(1), scale.stride(0), shift.stride(0), eps,
        TY=_TL_DTYPE[x.dtype], BLOCK_N=block, num_warps=max(1, min(8, block // 512)),
    )
    return out
