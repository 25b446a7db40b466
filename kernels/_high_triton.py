"""Triton kernels of the `high` tier that are not bit-exact (imported lazily: triton is optional on CPU hosts).

Each trades eager's rounding points for fewer passes; the tier that mounts them reports PSNR/SSIM against lossless.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._lossless_triton import _TL_DTYPE, _cast, _interpreting
from .cache import autotune

@triton.jit
def fp8_saturate(y, INTERPRET: tl.constexpr):
    """Scaled fp32 values -> fp8 e4m3, saturating at +-448 (e4m3's largest finite value). INTERPRET: left in fp32 (the
    CPU interpreter's fp8 cast rounds wrongly; the wrappers cast on the host, as torch does on the GPU)."""
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if not INTERPRET:
        y = y.to(tl.float8e4nv)
    return y


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


# ----------------------------------------------------------------------------------------------------------------
# QK RMSNorm + RoPE on [text; image] -> joint buffer, in one pass
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _rms_rope_fast_kernel(
    txt_ptr, img_ptr, wt_ptr, wi_ptr, cos_ptr, sin_ptr, out_ptr,
    M, T, I, H, eps_t, eps_i, txt_sb, txt_ss, img_sb, img_ss, descale_ptr,
    TY: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, HB: tl.constexpr, FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # Program (ROWS rows of the joint [B * (T + I)] sequence, HB heads); a row reads the text or the image tensor.
    # Not bit-exact (quality "high"): the per-head sum of squares in Triton's reduction order, and the normed value
    # is not rounded before RoPE. Rows are loaded whole (vectorised) and split into RoPE's (even, odd) pairs.
    S = T + I
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    b = rows // S
    s = rows % S
    is_txt = s < T
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, D)
    col = heads[None, :, None] * D + d[None, None, :]  # [1, HB, D]: offsets within a row
    txt3 = is_txt[:, None, None]
    ok = row_ok[:, None, None] & (heads < H)[None, :, None]
    at_t = txt_ptr + (b * txt_sb + s * txt_ss)[:, None, None] + col
    at_i = img_ptr + (b * img_sb + (s - T) * img_ss)[:, None, None] + col
    x = tl.where(txt3, tl.load(at_t, mask=ok & txt3, other=0.0),
                 tl.load(at_i, mask=ok & ~txt3, other=0.0)).to(tl.float32)
    eps = tl.where(is_txt, eps_t, eps_i)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=2) / D + eps[:, None])[:, :, None]  # [ROWS, HB, 1]
    w = tl.where(txt3, tl.load(wt_ptr + d)[None, None, :], tl.load(wi_ptr + d)[None, None, :]).to(tl.float32)
    xn = x * w * rstd
    c = tl.load(cos_ptr + s[:, None, None] * D + d[None, None, :], mask=row_ok[:, None, None], other=0.0)
    sn = tl.load(sin_ptr + s[:, None, None] * D + d[None, None, :], mask=row_ok[:, None, None], other=0.0)
    # out[2i] = x[2i] cos[2i] - x[2i+1] sin[2i]; out[2i+1] = x[2i+1] cos[2i+1] + x[2i] sin[2i+1] (diffusers' pairs)
    ev, od = tl.split(tl.reshape(xn, (ROWS, HB, D // 2, 2)))
    c_ev, c_od = tl.split(tl.reshape(tl.broadcast_to(c, (ROWS, HB, D)), (ROWS, HB, D // 2, 2)))
    s_ev, s_od = tl.split(tl.reshape(tl.broadcast_to(sn, (ROWS, HB, D)), (ROWS, HB, D // 2, 2)))
    y = tl.reshape(tl.join(ev * c_ev - od * s_ev, od * c_od + ev * s_od), (ROWS, HB, D))
    out = out_ptr + rows[:, None, None] * (H * D) + col
    if FP8:
        # fp8 e4m3 with one scale for the whole tensor, known before any value: |x_i| * rstd <= sqrt(D), so a normed
        # element is at most max|w| sqrt(D), and RoPE rotates pairs without growing them. Every program derives the
        # same bound from the weights; program (0, 0) publishes its descale.
        wmax = tl.maximum(tl.max(tl.abs(tl.load(wt_ptr + d).to(tl.float32)), axis=0),
                          tl.max(tl.abs(tl.load(wi_ptr + d).to(tl.float32)), axis=0))
        bound = tl.maximum(tl.sqrt(wmax * wmax * D), 1e-12)  # max|w| * sqrt(D)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(descale_ptr, bound / 448.0)
        tl.store(out, fp8_saturate(y * (448.0 / bound), INTERPRET), mask=ok)
    else:
        tl.store(out, _cast(y, TY), mask=ok)


# Tiles measured on the GPU at first use per (H, D): ROWS tokens x HB heads per program (heads past H masked).
_RMS_ROPE_CONFIGS = [triton.Config({"ROWS": r, "HB": hb}, num_warps=w)
                     for r, hb, w in ((1, 8, 4), (2, 8, 4), (2, 8, 8), (4, 8, 8), (4, 4, 4), (8, 4, 8), (8, 2, 4))]
_rms_rope_fast_tuned = autotune(_RMS_ROPE_CONFIGS, key=["H", "D", "FP8"])(_rms_rope_fast_kernel)


def rms_rope_fast(
    txt: torch.Tensor | None, img: torch.Tensor, w_txt: torch.Tensor | None, w_img: torch.Tensor,
    eps_txt: float, eps_img: float, cos: torch.Tensor, sin: torch.Tensor, fp8: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RoPE(cat([rms_norm(txt), rms_norm(img)])) for txt/img [B, *, H, D] with contiguous (H, D) rows, D a power of
    two >= 2; weights [D]; cos/sin fp32 [T + I, D] -> [B, T + I, H, D] in img's dtype (close to, not equal to, the
    lossless kernels/_lossless_triton.rms_rope_cat). fp8=True: (fp8 e4m3 values, fp32 descale [1]) instead, one
    scale for the tensor, from the weights' bound on a normed value (see the kernel)."""
    B, I, H, D = img.shape
    T = 0 if txt is None else txt.shape[1]
    src_t = img if txt is None else txt
    w_t = w_img if w_txt is None else w_txt
    interpret = _interpreting()
    out_dtype = (torch.float32 if interpret else torch.float8_e4m3fn) if fp8 else img.dtype
    out = torch.empty((B, T + I, H, D), dtype=out_dtype, device=img.device)
    descale = torch.empty(1, dtype=torch.float32, device=img.device)
    M = B * (T + I)
    args = (src_t, img, w_t, w_img, cos, sin, out, M, T, I, H, float(eps_txt if txt is not None else eps_img),
            float(eps_img), src_t.stride(0), src_t.stride(1), img.stride(0), img.stride(1), descale)
    meta = dict(TY=_TL_DTYPE[img.dtype], D=D, FP8=fp8, INTERPRET=interpret)
    if interpret:  # no timing in the interpreter: one fixed tile
        hb = 2 if H % 2 == 0 else 1
        _rms_rope_fast_kernel[(triton.cdiv(M, 2), triton.cdiv(H, hb))](*args, ROWS=2, HB=hb, **meta)
        out = out.to(torch.float8_e4m3fn) if fp8 else out
    else:
        _rms_rope_fast_tuned[lambda m: (triton.cdiv(M, m["ROWS"]), triton.cdiv(H, m["HB"]))](*args, **meta)
    return (out, descale) if fp8 else out
