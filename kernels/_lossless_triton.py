"""Triton kernels of the lossless tier's elementwise fusions (imported lazily: triton is optional on CPU hosts).

Each kernel repeats eager's rounding points: every aten op rounds its result to its output dtype, so we round
(`.to(ty, fp_downcast_rounding="rtne")`) wherever the eager chain materialises a tensor, compute the op itself in
fp32 like aten's opmath, and launch with `enable_fp_fusion=False` so no multiply-add becomes an FMA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _round(x, ty: tl.constexpr):
    # Round an fp32 value to the eager op's output dtype (no-op for fp32).
    if ty == tl.float32:
        return x
    return x.to(ty, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def _cast(x, ty: tl.constexpr):
    # The final rounding of an fp32 value to the output dtype.
    if ty == tl.float32:
        return x
    return x.to(ty, fp_downcast_rounding="rtne")


# ----------------------------------------------------------------------------------------------------------------
# RoPE on [text; image] -> joint buffer
# ----------------------------------------------------------------------------------------------------------------


# Memory-bound: one fixed tile each (an autotuner costs host time per launch, and these ~230 launches per FLUX
# step already compete with the host's launch budget).
ROPE_CONFIG = {"BLOCK": 1024, "num_warps": 4}
MODULATE_CONFIG = {"BLOCK_S": 4, "BLOCK_D": 1024, "num_warps": 4}


@triton.jit
def _rope_cat_kernel(
    txt_ptr,
    img_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    T,
    I,
    HD,
    D,
    txt_sb,
    txt_ss,
    img_sb,
    img_ss,
    TY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One token row (b, s) of the joint [B, T + I, H * D] output per program along axis 0.
    row = tl.program_id(0).to(tl.int64)
    S = T + I
    b = row // S
    s = row % S
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HD
    if s < T:
        base = txt_ptr + b * txt_sb + s * txt_ss
    else:
        base = img_ptr + b * img_sb + (s - T) * img_ss
    x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    # Interleaved pairs: rotated[2i] = -x[2i+1], rotated[2i+1] = x[2i] (bf16 negation is exact).
    xp = tl.load(base + (cols ^ 1), mask=mask, other=0.0).to(tl.float32)
    rot = tl.where((cols & 1) == 0, -xp, xp)
    d = cols % D
    c = tl.load(cos_ptr + s * D + d, mask=mask, other=0.0)
    sn = tl.load(sin_ptr + s * D + d, mask=mask, other=0.0)
    # eager: (x.float() * cos + rotated.float() * sin).to(dtype): two fp32 products, an fp32 add, one rounding.
    y = x * c + rot * sn
    tl.store(out_ptr + row * HD + cols, _cast(y, TY), mask=mask)


def rope_cat(
    txt: torch.Tensor | None, img: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, config: dict | None = None
) -> torch.Tensor:
    """txt [B, T, H, D] (or None), img [B, I, H, D], both with contiguous (H, D); cos/sin fp32 [T + I, D].

    config ({"BLOCK", "num_warps"}) overrides ROPE_CONFIG (benchmarks, the interpreter)."""
    B, I, H, D = img.shape
    T = 0 if txt is None else txt.shape[1]
    src_t = img if txt is None else txt
    out = torch.empty((B, T + I, H, D), dtype=img.dtype, device=img.device)
    HD = H * D

    def grid(meta: dict) -> tuple[int, int]:
        return (B * (T + I), triton.cdiv(HD, meta["BLOCK"]))

    _rope_cat_kernel[grid](
        src_t, img, cos, sin, out, T, I, HD, D,
        src_t.stride(0), src_t.stride(1), img.stride(0), img.stride(1),
        TY=_TL_DTYPE[img.dtype], enable_fp_fusion=False, **(config or ROPE_CONFIG),
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# AdaLN modulation: normed * (1 + scale[:, None]) + shift[:, None]
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _modulate_kernel(
    x_ptr,
    scale_ptr,
    shift_ptr,
    out_ptr,
    S,
    D,
    x_sb,
    x_ss,
    scale_sb,
    shift_sb,
    TY: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = (pid_s * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    scale = tl.load(scale_ptr + b * scale_sb + cols, mask=col_mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + b * shift_sb + cols, mask=col_mask, other=0.0).to(tl.float32)
    one_plus = _round(scale + 1.0, TY)  # eager `1 + scale` materialises in the input dtype
    mask = (rows[:, None] < S) & col_mask[None, :]
    x = tl.load(x_ptr + b * x_sb + rows[:, None] * x_ss + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    prod = _round(x * one_plus[None, :], TY)  # eager `normed * (1 + scale)` rounds here
    y = prod + shift[None, :]
    out_offs = b * S * D + rows[:, None] * D + cols[None, :]
    tl.store(out_ptr + out_offs, _cast(y, TY), mask=mask)


def modulate(
    normed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, config: dict | None = None
) -> torch.Tensor:
    """normed [B, S, D] with unit last stride; scale/shift [B, D] views with unit last stride.

    config ({"BLOCK_S", "BLOCK_D", "num_warps"}) overrides MODULATE_CONFIG."""
    B, S, D = normed.shape
    out = torch.empty((B, S, D), dtype=normed.dtype, device=normed.device)

    def grid(meta: dict) -> tuple[int, int, int]:
        return (triton.cdiv(S, meta["BLOCK_S"]), triton.cdiv(D, meta["BLOCK_D"]), B)

    _modulate_kernel[grid](
        normed, scale, shift, out, S, D,
        normed.stride(0), normed.stride(1), scale.stride(0), shift.stride(0),
        TY=_TL_DTYPE[normed.dtype], enable_fp_fusion=False, **(config or MODULATE_CONFIG),
    )
    return out
