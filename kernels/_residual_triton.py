"""Triton kernel for `residual + gate * update` (imported lazily: triton is optional on CPU hosts).

Bit-exactness with eager: aten's CUDA `mul` of two half tensors computes in fp32 and rounds to the half type;
`add` does the same with the rounded product. The kernel repeats both rounding points (product -> half -> fp32)
and is launched with `enable_fp_fusion=False`, so no FMA can merge the multiply into the add.
With CLIP > 0 it also applies diffusers' fp16 overflow guard `.clip(-CLIP, CLIP)` to the rounded sum, saving the
separate clip kernel its full read and write (NaN stays NaN, as in aten's clamp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._lossless_triton import _TL_DTYPE, _round, _store_tile, _with_lora

# Tile shapes swept by bench/kernel_ops.py. On an H200 (torch 2.11, triton 3.6) all ran within noise of each other
# on the FLUX shapes (19.2-19.6 us at (1,4096,3072) bf16); Triton's autotuner wrapper cost ~30 us of host time
# per call for nothing, so the kernel launches with one fixed tile (DEFAULT_CONFIG).
_CONFIGS = [
    triton.Config({"BLOCK_S": bs, "BLOCK_D": bd}, num_warps=w)
    for bs, bd, w in [(1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (4, 1024, 8), (8, 512, 4), (8, 1024, 8)]
]
DEFAULT_CONFIG = {"BLOCK_S": 1, "BLOCK_D": 1024, "num_warps": 4}


@triton.jit
def _residual_gate_add_kernel(
    r_ptr,
    u_ptr,
    g_ptr,
    o_ptr,
    B,
    S,
    D,
    g_bstride,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_INT64: tl.constexpr,
    CLIP: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    if USE_INT64:
        b = b.to(tl.int64)
        rows = rows.to(tl.int64)
    # One gate row per program, reused for all BLOCK_S rows (batch stride may be 0, D, 3D or 6D).
    g = tl.load(g_ptr + b * g_bstride + cols, mask=col_mask, other=0.0)
    offs = b * S * D + rows[:, None] * D + cols[None, :]
    mask = (rows[:, None] < S) & col_mask[None, :]
    r = tl.load(r_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    u = tl.load(u_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    out_ty = o_ptr.dtype.element_ty
    prod = (g.to(tl.float32)[None, :] * u.to(tl.float32)).to(out_ty, fp_downcast_rounding="rtne")  # eager `gate * update` rounds here
    out = (r.to(tl.float32) + prod.to(tl.float32)).to(out_ty, fp_downcast_rounding="rtne")  # eager `residual + ...` rounds here
    if CLIP > 0:
        # Clamp the already-rounded sum (exact: CLIP is representable in fp16); comparisons with NaN are false.
        o = out.to(tl.float32)
        o = tl.where(o > CLIP, CLIP, tl.where(o < -CLIP, -CLIP, o))
        out = o.to(out_ty)
    tl.store(o_ptr + offs, out, mask=mask)


def launch(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate3: torch.Tensor,
    config: dict | None = None,
    clip: float | None = None,
) -> torch.Tensor:
    """residual/update: contiguous [B, S, D]; gate3: [B, 1, D] view (batch stride any, last stride 1).

    clip: if set, the result is clamped to [-clip, clip] (eager `.clip(-clip, clip)` after the add).

    config: {"BLOCK_S", "BLOCK_D", "num_warps"}; DEFAULT_CONFIG when None.
    """
    B, S, D = residual.shape
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    use_int64 = residual.numel() >= 2**31 - 1 or gate3.stride(0) * B >= 2**31 - 1

    cfg = DEFAULT_CONFIG if config is None else config
    grid = (triton.cdiv(S, cfg["BLOCK_S"]), triton.cdiv(D, cfg["BLOCK_D"]), B)
    _residual_gate_add_kernel[grid](
        residual, update, gate3, out, B, S, D, gate3.stride(0), USE_INT64=use_int64, CLIP=float(clip or 0.0),
        enable_fp_fusion=False, **cfg
    )
    return out


# --------------------------------------------------------------------------------------------------------------
# The same pair with an adapter's term added to the update first, as PEFT adds it to its layer's output
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _residual_gate_lora_kernel(
    r_ptr, u_ptr, g_ptr, t_ptr, b_ptr, o_ptr, M, S, D, g_bstride, scale,
    R: tl.constexpr, TY: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, CLIP: tl.constexpr, EVEN: tl.constexpr,
):
    # update = u + F.linear(t, B) * scale with PEFT's three roundings (the LoRA tail's own tile function), then
    # residual + gate * update with eager's two: the adapter layer's output is never written. (Rows past S load the
    # next image's rows, M = B * S bounds the loads; the store keeps this image's.) EVEN: S and D multiples of the
    # tile, no masks.
    b = tl.program_id(2).to(tl.int64)
    row0 = b * S + tl.program_id(0) * BS  # the tile's first row of the flattened [B * S, D] tensors (64-bit, once)
    lm = tl.arange(0, BS)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    update = _round(_with_lora(u_ptr, t_ptr, b_ptr, row0, M, D, scale, lm, cols, R, TY, EVEN), TY)
    offs = lm[:, None] * D + cols[None, :]
    rows = S - tl.program_id(0) * BS  # this image's rows left in the tile
    if EVEN:
        g = tl.load(g_ptr + b * g_bstride + cols).to(tl.float32)
        r = tl.load(r_ptr + row0 * D + offs).to(tl.float32)
    else:
        g = tl.load(g_ptr + b * g_bstride + cols, mask=cols < D, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row0 * D + offs, mask=(lm[:, None] < rows) & (cols[None, :] < D), other=0.0)
        r = r.to(tl.float32)
    prod = _round(g[None, :] * update, TY)
    out = _round(r + prod, TY)
    if CLIP > 0:
        out = tl.where(out > CLIP, CLIP, tl.where(out < -CLIP, -CLIP, out))
    _store_tile(o_ptr + row0 * D + offs, out.to(TY), lm, cols, rows, D, EVEN)


LORA_CONFIG = {"BS": 64, "BD": 128, "num_warps": 4}


def launch_lora(residual: torch.Tensor, update: torch.Tensor, gate3: torch.Tensor, t: torch.Tensor, b: torch.Tensor,
                scale: float, clip: float | None = None) -> torch.Tensor:
    """residual + gate3 * (update + F.linear(t, b) * scale), eager's roundings: residual/update contiguous
    [B, S, D], gate3 [B, 1, D] (last stride 1), t contiguous [B, S, r], b [D, r] (r a multiple of 16)."""
    B, S, D = residual.shape
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    cfg = LORA_CONFIG
    grid = (triton.cdiv(S, cfg["BS"]), triton.cdiv(D, cfg["BD"]), B)
    _residual_gate_lora_kernel[grid](
        residual, update, gate3, t, b, out, B * S, S, D, gate3.stride(0), float(scale), R=t.shape[-1],
        TY=_TL_DTYPE[residual.dtype], BS=cfg["BS"], BD=cfg["BD"], CLIP=float(clip or 0.0),
        EVEN=S % cfg["BS"] == 0 and D % cfg["BD"] == 0, enable_fp_fusion=False, num_warps=cfg["num_warps"],
    )
    return out
