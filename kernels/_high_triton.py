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


# ----------------------------------------------------------------------------------------------------------------
# GroupNorm (+ the SiLU after it) over channels-last activations [B, L, C]: the VAE decoder of `high` batches
# ----------------------------------------------------------------------------------------------------------------
#
# Three launches: per chunk of pixels each group's (count, mean, M2), merged across tiles by Chan's rule (no
# E[x^2] - E[x]^2 cancellation); per image and group the merged mean and 1/std; then one read and one write of the
# activation, normalized, scaled, shifted and (optionally) through SiLU, rounded once.


@triton.jit
def _group_stats_kernel(x_ptr, part_ptr, L, CHUNK, S,
                        C: tl.constexpr, G: tl.constexpr, BLOCK_P: tl.constexpr):
    chunk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    CPG: tl.constexpr = C // G
    chans = tl.arange(0, C)
    n_acc = tl.zeros((G,), tl.float32)
    mean_acc = tl.zeros((G,), tl.float32)
    m2_acc = tl.zeros((G,), tl.float32)
    start = chunk * CHUNK
    for off in range(0, CHUNK, BLOCK_P):
        rows = off + tl.arange(0, BLOCK_P)
        pix = start + rows
        keep = (pix < L) & (rows < CHUNK)
        mask = keep[:, None] & (chans[None, :] < C)
        x = tl.load(x_ptr + (b * L + pix)[:, None] * C + chans[None, :], mask=mask, other=0.0).to(tl.float32)
        m3 = tl.reshape(mask.to(tl.float32), (BLOCK_P, G, CPG))
        x3 = tl.reshape(x, (BLOCK_P, G, CPG))
        cnt = tl.sum(tl.sum(m3, axis=2), axis=0)
        tile_mean = tl.sum(tl.sum(x3, axis=2), axis=0) / tl.maximum(cnt, 1.0)
        d = (x3 - tile_mean[None, :, None]) * m3
        tile_m2 = tl.sum(tl.sum(d * d, axis=2), axis=0)
        n_new = n_acc + cnt
        delta = tile_mean - mean_acc
        w = cnt / tl.maximum(n_new, 1.0)
        mean_acc = mean_acc + delta * w
        m2_acc = m2_acc + tile_m2 + delta * delta * n_acc * w
        n_acc = n_new
    groups = tl.arange(0, G)
    base = part_ptr + ((b * S + chunk) * 3) * G
    tl.store(base + groups, n_acc)
    tl.store(base + G + groups, mean_acc)
    tl.store(base + 2 * G + groups, m2_acc)


@triton.jit
def _group_partials(part_ptr, b, S, s0, G: tl.constexpr, BLOCK_S: tl.constexpr):
    # chunks [s0, s0 + BLOCK_S) of image b: their (count, mean, M2) per group, [BLOCK_S, G] each (zeros past S)
    groups = tl.arange(0, G)
    s = s0 + tl.arange(0, BLOCK_S)
    ok = (s < S)[:, None] & (groups[None, :] < G)
    base = part_ptr + ((b * S + s)[:, None] * 3) * G + groups[None, :]
    return (tl.load(base, mask=ok, other=0.0), tl.load(base + G, mask=ok, other=0.0),
            tl.load(base + 2 * G, mask=ok, other=0.0))


@triton.jit
def _group_finish_kernel(part_ptr, mean_ptr, rstd_ptr, S, eps, G: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, G)
    n_tot = tl.zeros((G,), tl.float32)
    s_tot = tl.zeros((G,), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        n, m, _ = _group_partials(part_ptr, b, S, s0, G, BLOCK_S)
        n_tot += tl.sum(n, axis=0)
        s_tot += tl.sum(n * m, axis=0)
    mean = s_tot / n_tot
    m2 = tl.zeros((G,), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        n, m, chunk_m2 = _group_partials(part_ptr, b, S, s0, G, BLOCK_S)
        d = m - mean[None, :]
        m2 += tl.sum(chunk_m2 + n * d * d, axis=0)
    tl.store(mean_ptr + b * G + groups, mean)
    tl.store(rstd_ptr + b * G + groups, tl.math.rsqrt(m2 / n_tot + eps))


@triton.jit
def _group_apply_kernel(x_ptr, out_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, L,
                        C: tl.constexpr, G: tl.constexpr, SILU: tl.constexpr, TY: tl.constexpr,
                        BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pix = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    chans = tl.arange(0, C)
    mask = (pix < L)[:, None] & (chans[None, :] < C)
    offs = (b * L + pix)[:, None] * C + chans[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    group = chans // (C // G)
    mean = tl.load(mean_ptr + b * G + group)
    scale = tl.load(rstd_ptr + b * G + group) * tl.load(w_ptr + chans).to(tl.float32)
    y = (x - mean[None, :]) * scale[None, :] + tl.load(b_ptr + chans).to(tl.float32)[None, :]
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + offs, _cast(y, TY), mask=mask)


# Elements of one [pixels, C] tile; the stats pass gives each program about this many pixels per image.
_GN_TILE = 8192
_GN_CHUNKS = 512


def group_norm_channels_last(x: torch.Tensor, groups: int, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                             silu: bool) -> torch.Tensor:
    """x [B, L, C] contiguous (C a power of two, a multiple of `groups`) -> the same shape: GroupNorm over each
    image's C // groups channels x L pixels, affine, then SiLU if `silu`; one rounding to x's dtype."""
    bsz, length, c = x.shape
    out = torch.empty_like(x)
    block_p = max(1, _GN_TILE // c)
    chunk = triton.cdiv(triton.cdiv(length, _GN_CHUNKS), block_p) * block_p
    s = triton.cdiv(length, chunk)
    part = torch.empty((bsz, s, 3, groups), device=x.device, dtype=torch.float32)
    mean = torch.empty((bsz, groups), device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _group_stats_kernel[(s, bsz)](x, part, length, chunk, s, C=c, G=groups, BLOCK_P=block_p, num_warps=8)
    _group_finish_kernel[(bsz,)](part, mean, rstd, s, eps, G=groups, BLOCK_S=max(1, 4096 // groups))
    _group_apply_kernel[(triton.cdiv(length, block_p), bsz)](x, out, mean, rstd, weight, bias, length, C=c, G=groups,
                                                             SILU=silu, TY=_TL_DTYPE[x.dtype], BLOCK_P=block_p,
                                                             num_warps=8)
    return out
