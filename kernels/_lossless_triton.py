"""Triton kernels of the lossless tier's elementwise fusions (imported lazily: triton is optional on CPU hosts).

Each kernel repeats eager's rounding points: every aten op rounds its result to its output dtype, so we round
(`.to(ty, fp_downcast_rounding="rtne")`) wherever the eager chain materialises a tensor, compute the op itself in
fp32 like aten's opmath, and launch with `enable_fp_fusion=False` so no multiply-add becomes an FMA.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .cache import autotune

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


# ----------------------------------------------------------------------------------------------------------------
# LayerNorm (no affine) + AdaLN modulation: modulate(F.layer_norm(x, (D,), eps=eps), scale, shift)
# ----------------------------------------------------------------------------------------------------------------
#
# Exact variant: aten's CUDA LayerNorm (`vectorized_layer_norm_kernel`, taken when D % 4 == 0 and the rows are
# aligned) computes the row statistics with one 128-thread block per row (32 lanes x 4 warps): thread t reads
# 4-element vectors t, t + 128, ... and folds each element into a Welford state (mean, m2, count); then a warp
# shuffle-down tree (offsets 16..1) and a shared-memory tree over the 4 warps combine the states. We replay that
# exact order on tensors shaped like the thread block ([128] states, split in halves the way the shuffles pair
# lanes), so the fp32 mean and rstd are the same bits; then `rstd * (x - mean)` rounds once to the input dtype
# like aten, and the modulation repeats eager's three roundings.
#
# nvcc contracts some of aten's `a + b * c` into FMAs; which ones is a property of the compiled library, not of
# the source. The FMA_* switches reproduce each choice; LN_FMA_VARIANT is the one measured to match torch's
# CUDA build (tests/test_kernels_gpu.py searches all of them and asserts the default matches).

LN_THREADS = 128  # aten: num_threads() = 4 warps of 32
LN_VEC = 4  # aten: vec_size, fixed for every dtype
# (online-mean FMA, online-m2 FMA, combine-mean form {0: none, 1: fma(nA, mA, nB*mB), 2: fma(nB, mB, nA*mA)},
#  combine-m2 FMA)
LN_FMA_VARIANT = (True, True, 1, True)
# Largest per-lane element count whose compile-time reciprocal is checked to round like fp32 1/n (see _welford_add).
_MAX_LANE_COUNT = 16383


@triton.jit
def _welford_add(mean, m2, cnt, v, valid, RCP: tl.constexpr, FMA_MEAN: tl.constexpr, FMA_M2: tl.constexpr):
    # aten cuWelfordOnlineSum: delta = v - mean; n += 1; mean += delta * (1/n); m2 += delta * (v - mean_new).
    # Every valid lane holds the same count at a given (iteration, element), so 1/n is a compile-time constant:
    # RCP is the Python double 1/n, and its fp32 rounding equals the correctly rounded fp32 1/n for every n up to
    # _MAX_LANE_COUNT (tests/test_flux_lossless.py checks it). No per-element division: no branch into the slow path of
    # IEEE division between the loads, so they issue back to back.
    delta = v - mean
    if FMA_MEAN:
        new_mean = tl.fma(delta, RCP, mean)
    else:
        new_mean = mean + delta * RCP
    d2 = v - new_mean
    if FMA_M2:
        new_m2 = tl.fma(delta, d2, m2)
    else:
        new_m2 = m2 + delta * d2
    return tl.where(valid, new_mean, mean), tl.where(valid, new_m2, m2), tl.where(valid, cnt + 1.0, cnt)


@triton.jit
def _welford_combine(mB, sB, cB, mA, sA, cA, MEAN_FORM: tl.constexpr, FMA_S: tl.constexpr):
    # aten cuWelfordCombine(dataB = own lane/warp, dataA = the one shuffled in)
    delta = mB - mA
    count = cA + cB
    coef = tl.math.div_rn(tl.full(count.shape, 1.0, tl.float32), count)
    nA = cA * coef
    nB = cB * coef
    if MEAN_FORM == 0:
        mean = nA * mA + nB * mB
    elif MEAN_FORM == 1:
        mean = tl.fma(nA, mA, nB * mB)
    else:
        mean = tl.fma(nB, mB, nA * mA)
    t = delta * delta * cA
    if FMA_S:
        s = tl.fma(t, nB, sA + sB)
    else:
        s = (sA + sB) + t * nB
    nonempty = count > 0.0
    return tl.where(nonempty, mean, 0.0), tl.where(nonempty, s, 0.0), count


@triton.jit
def _halves(t, W: tl.constexpr, O: tl.constexpr):
    # [W, 2*O] lanes -> (lanes 0..O-1, lanes O..2O-1): the pairing of a shuffle-down by O.
    return tl.split(tl.permute(tl.reshape(t, (W, 2, O)), (0, 2, 1)))


@triton.jit
def _shuffle_down_combine(mean, m2, cnt, O: tl.constexpr, MEAN_FORM: tl.constexpr, FMA_S: tl.constexpr):
    # One shuffle-down step by O over [4 warps, 2*O lanes]: lane i absorbs lane i + O.
    mB, mA = _halves(mean, 4, O)
    sB, sA = _halves(m2, 4, O)
    cB, cA = _halves(cnt, 4, O)
    return _welford_combine(mB, sB, cB, mA, sA, cA, MEAN_FORM, FMA_S)


@triton.jit
def _welford_combine_default(mB, sB, cB, mA, sA, cA):
    # the combine of LN_FMA_VARIANT (tl.reduce takes no constexpr arguments)
    return _welford_combine(mB, sB, cB, mA, sA, cA, 1, True)


@triton.jit
def _explicit_tree(mean, m2, cnt, MEAN_FORM: tl.constexpr, FMA_S: tl.constexpr):
    # intra-warp shuffle-down tree: [warp, lane]
    mean = tl.reshape(mean, (4, 32))
    m2 = tl.reshape(m2, (4, 32))
    cnt = tl.reshape(cnt, (4, 32))
    mean, m2, cnt = _shuffle_down_combine(mean, m2, cnt, 16, MEAN_FORM, FMA_S)
    mean, m2, cnt = _shuffle_down_combine(mean, m2, cnt, 8, MEAN_FORM, FMA_S)
    mean, m2, cnt = _shuffle_down_combine(mean, m2, cnt, 4, MEAN_FORM, FMA_S)
    mean, m2, cnt = _shuffle_down_combine(mean, m2, cnt, 2, MEAN_FORM, FMA_S)
    mean, m2, cnt = _shuffle_down_combine(mean, m2, cnt, 1, MEAN_FORM, FMA_S)
    # now [4, 1] -> lane 0 of each warp; shared-memory tree: warps (0,1) absorb (2,3), then warp 0 absorbs 1
    mean = tl.reshape(mean, (2, 2))
    m2 = tl.reshape(m2, (2, 2))
    cnt = tl.reshape(cnt, (2, 2))
    mB, mA = tl.split(tl.permute(mean, (1, 0)))
    sB, sA = tl.split(tl.permute(m2, (1, 0)))
    cB, cA = tl.split(tl.permute(cnt, (1, 0)))
    mean, m2, cnt = _welford_combine(mB, sB, cB, mA, sA, cA, MEAN_FORM, FMA_S)
    mB, mA = tl.split(mean)
    sB, sA = tl.split(m2)
    cB, cA = tl.split(cnt)
    mean, m2, cnt = _welford_combine(mB, sB, cB, mA, sA, cA, MEAN_FORM, FMA_S)
    return mean, m2, cnt


@triton.jit
def _ln_modulate_exact_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr, mean_ptr, rstd_ptr,
    S, N, x_sb, x_ss, scale_sb, shift_sb, eps,
    TY: tl.constexpr, ITERS: tl.constexpr, WRITE_STATS: tl.constexpr,
    FMA_MEAN: tl.constexpr, FMA_M2: tl.constexpr, MEAN_FORM: tl.constexpr, FMA_S: tl.constexpr,
    TREE_BY_REDUCE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    x_row = x_ptr + b * x_sb + row * x_ss
    t = tl.arange(0, 128)
    e4 = tl.arange(0, 4)
    nvec = N // 4
    mean = tl.zeros((128,), tl.float32)
    m2 = tl.zeros((128,), tl.float32)
    cnt = tl.zeros((128,), tl.float32)
    for it in tl.static_range(ITERS):
        vec = it * 128 + t
        valid = vec < nvec
        # thread t's 4-element vector, loaded as one tile; elements 0..3 are then folded in order
        tile = tl.load(x_row + vec[:, None] * 4 + e4[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(tile, (128, 2, 2)))
        v0, v2 = tl.split(even)
        v1, v3 = tl.split(odd)
        mean, m2, cnt = _welford_add(mean, m2, cnt, v0, valid, 1.0 / (it * 4 + 1), FMA_MEAN, FMA_M2)
        mean, m2, cnt = _welford_add(mean, m2, cnt, v1, valid, 1.0 / (it * 4 + 2), FMA_MEAN, FMA_M2)
        mean, m2, cnt = _welford_add(mean, m2, cnt, v2, valid, 1.0 / (it * 4 + 3), FMA_MEAN, FMA_M2)
        mean, m2, cnt = _welford_add(mean, m2, cnt, v3, valid, 1.0 / (it * 4 + 4), FMA_MEAN, FMA_M2)
    if TREE_BY_REDUCE:
        # Triton lowers a reduction over a [128] tensor held one element per thread into the same tree as aten:
        # butterfly shuffles 16..1 where lane i < o combines (own, lane i + o) -- lane 0 ends with exactly the
        # shuffle-down result -- then lane 0 of each warp goes through shared memory and the 4 warp values are
        # reduced by shuffles 2, 1: (w0, w2), (w1, w3), then (w0 w2, w1 w3). Warp shuffles, no layout conversions.
        mean, m2, cnt = tl.reduce((mean, m2, cnt), 0, _welford_combine_default)
    else:
        # The same tree spelled out on [warp, lane]-shaped tensors (the order's reference; the Triton interpreter
        # folds tl.reduce sequentially, so it runs this one).
        mean, m2, cnt = _explicit_tree(mean, m2, cnt, MEAN_FORM, FMA_S)
    var = tl.math.div_rn(m2, N.to(tl.float32))
    rstd = tl.math.rsqrt(var + eps)
    if WRITE_STATS:  # what aten's native_layer_norm returns beside its output (tests compare them bit for bit)
        tl.store(mean_ptr + b * S + row, mean)
        tl.store(rstd_ptr + b * S + row, rstd)
    # normalise + modulate: elementwise, so any thread-to-element map gives the same bits; 2-D tiles vectorise the
    # loads and stores (the row is hot in L1/L2 from the statistics pass)
    out_row = out_ptr + (b * S + row) * N
    for start in range(0, nvec, 128):  # a runtime loop: unrolled, its hoisted loads cost occupancy
        col = (start + t)[:, None] * 4 + e4[None, :]
        ok = col < N
        v = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
        sc = tl.load(scale_ptr + b * scale_sb + col, mask=ok, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + b * shift_sb + col, mask=ok, other=0.0).to(tl.float32)
        normed = _round(rstd * (v - mean), TY)  # aten LayerNorm's output
        prod = _round(normed * _round(sc + 1.0, TY), TY)  # eager `normed * (1 + scale)`
        tl.store(out_row + col, _cast(prod + sh, TY), mask=ok)


def ln_modulate_exact(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
    variant: tuple[bool, bool, int, bool] | None = None, stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    tree: str | None = None,
) -> torch.Tensor:
    """x [B, S, D] (D % 4 == 0, unit last stride), scale/shift [B, D] with unit last stride.

    variant: the FMA choices (default LN_FMA_VARIANT); stats: fp32 [B * S] buffers that receive mean and rstd;
    tree: "reduce" (tl.reduce, fast; the default on a GPU) or "explicit" (the default under the Triton interpreter
    and for combine choices other than the library's)."""
    B, S, D = x.shape
    iters = triton.cdiv(D // LN_VEC, LN_THREADS)
    if iters * LN_VEC > _MAX_LANE_COUNT:
        raise ValueError(f"row length {D} is past the checked range of compile-time reciprocals")
    out = torch.empty((B, S, D), dtype=x.dtype, device=x.device)
    fma_mean, fma_m2, mean_form, fma_s = variant or LN_FMA_VARIANT
    if tree is None:
        tree = "reduce" if (mean_form, fma_s) == LN_FMA_VARIANT[2:] and not _interpreting() else "explicit"
    if tree == "reduce" and (mean_form, fma_s) != LN_FMA_VARIANT[2:]:
        raise ValueError("the tl.reduce tree is built for LN_FMA_VARIANT's combine choices only")
    mean_buf, rstd_buf = stats if stats is not None else (out, out)
    _ln_modulate_exact_kernel[(S, B)](
        x, scale, shift, out, mean_buf, rstd_buf, S, D, x.stride(0), x.stride(1), scale.stride(0), shift.stride(0),
        eps, TY=_TL_DTYPE[x.dtype], ITERS=iters, WRITE_STATS=stats is not None,
        FMA_MEAN=fma_mean, FMA_M2=fma_m2, MEAN_FORM=mean_form, FMA_S=fma_s, TREE_BY_REDUCE=tree == "reduce",
        enable_fp_fusion=False, num_warps=4,
    )
    return out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------------------------------------------
# QK RMSNorm + RoPE on [text; image] -> joint buffer
# ----------------------------------------------------------------------------------------------------------------
#
# torch's CUDA `rms_norm` (what nn.RMSNorm calls) is aten's vectorised LayerNorm kernel in its rms mode: one
# 128-thread block per (token, head) row of D elements; thread t sums the squares of its 4-element vectors in order,
# then a shuffle-down tree adds lanes (offsets 16..1) and the 4 warps add up (lanes past D/4 hold 0, so with
# D <= 128 only warp 0 carries data). ms = sum / D; rstd = rsqrt(ms + eps); y = weight * (rstd * x), one rounding.
# The kernel replays that per head, then applies RoPE to the normalised values and writes the joint tensor.

RMS_FMA_SQUARES = True  # nvcc contracts `sigma2 + val * val`; tests/bench check it against torch


@triton.jit
def _rms_rope_cat_kernel(
    txt_ptr, img_ptr, wt_ptr, wi_ptr, cos_ptr, sin_ptr, out_ptr,
    T, I, HD, eps_t, eps_i,
    txt_sb, txt_ss, img_sb, img_ss,
    TY: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, FMA_SQ: tl.constexpr,
):
    # One token row (b, s) per program along axis 0; BLOCK columns = BLOCK // D whole heads along axis 1.
    row = tl.program_id(0).to(tl.int64)
    S = T + I
    b = row // S
    s = row % S
    HB: tl.constexpr = BLOCK // D
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HD
    if s < T:
        base = txt_ptr + b * txt_sb + s * txt_ss
        w_ptr = wt_ptr
        eps = eps_t
    else:
        base = img_ptr + b * img_sb + (s - T) * img_ss
        w_ptr = wi_ptr
        eps = eps_i
    x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    # per-lane sums of squares: lane l of a head owns elements 4l..4l+3, added in order
    x4 = tl.reshape(x, (HB, D // 4, 2, 2))
    e02, e13 = tl.split(x4)
    e0, e2 = tl.split(e02)
    e1, e3 = tl.split(e13)
    acc = e0 * e0
    if FMA_SQ:
        acc = tl.fma(e1, e1, acc)
        acc = tl.fma(e2, e2, acc)
        acc = tl.fma(e3, e3, acc)
    else:
        acc = acc + e1 * e1
        acc = acc + e2 * e2
        acc = acc + e3 * e3
    # shuffle-down tree over the D // 4 lanes (D = 128: 32 lanes, one warp)
    acc = _lane_tree_sum(acc, HB, D // 4)
    rstd = tl.math.rsqrt(tl.math.div_rn(acc, tl.full(acc.shape, D, tl.float32)) + eps)  # [HB]
    rstd_cols = tl.reshape(tl.broadcast_to(tl.reshape(rstd, (HB, 1)), (HB, D)), (BLOCK,))
    d = cols % D
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    xn = _round(w * (rstd_cols * x), TY)  # torch rms_norm's output
    # RoPE on interleaved pairs: out[2i] = xn[2i] cos - xn[2i+1] sin; out[2i+1] = xn[2i+1] cos + xn[2i] sin
    c = tl.load(cos_ptr + s * D + d, mask=mask, other=0.0)
    sn = tl.load(sin_ptr + s * D + d, mask=mask, other=0.0)
    ev, od = tl.split(tl.reshape(xn, (BLOCK // 2, 2)))
    c_ev, c_od = tl.split(tl.reshape(c, (BLOCK // 2, 2)))
    s_ev, s_od = tl.split(tl.reshape(sn, (BLOCK // 2, 2)))
    y_ev = ev * c_ev + (-od) * s_ev
    y_od = od * c_od + ev * s_od
    y = tl.reshape(tl.join(y_ev, y_od), (BLOCK,))
    tl.store(out_ptr + row * HD + cols, _cast(y, TY), mask=mask)


@triton.jit
def _lane_tree_sum(acc, HB: tl.constexpr, LANES: tl.constexpr):
    # [HB, LANES] -> [HB]: lane i adds lane i + o for o = LANES/2 .. 1 (aten's WARP_SHFL_DOWN loop; adding the
    # idle warps' zeros afterwards changes nothing). LANES is a power of two <= 32.
    # Spelled out: a loop would rebind a constexpr offset, which Triton's compiler (not its interpreter) rejects.
    if LANES >= 32:
        a, c = _halves(acc, HB, 16)
        acc = a + c
    if LANES >= 16:
        a, c = _halves(acc, HB, 8)
        acc = a + c
    if LANES >= 8:
        a, c = _halves(acc, HB, 4)
        acc = a + c
    if LANES >= 4:
        a, c = _halves(acc, HB, 2)
        acc = a + c
    if LANES >= 2:
        a, c = _halves(acc, HB, 1)
        acc = a + c
    return tl.reshape(acc, (HB,))


# The pass's launch: heads per program (a power of two dividing H; None: as many as fit 1024 columns) and warps.
# bench/lossless_ops.py --rope-tiles times others.
RMS_ROPE_TILE = {"heads": None, "num_warps": 4}


def rms_rope_cat(
    txt: torch.Tensor | None, img: torch.Tensor, w_txt: torch.Tensor | None, w_img: torch.Tensor,
    eps_txt: float, eps_img: float, cos: torch.Tensor, sin: torch.Tensor, fma_squares: bool | None = None,
    tile: dict | None = None,
) -> torch.Tensor:
    """RoPE(cat([rms_norm(txt), rms_norm(img)])) for txt/img [B, *, H, D] with contiguous (H, D) rows,
    D a power of two in [8, 128]; weights [D]; cos/sin fp32 [T + I, D]. tile: RMS_ROPE_TILE's keys (a bench's)."""
    B, I, H, D = img.shape
    T = 0 if txt is None else txt.shape[1]
    src_t = img if txt is None else txt
    w_t = w_img if w_txt is None else w_txt
    out = torch.empty((B, T + I, H, D), dtype=img.dtype, device=img.device)
    HD = H * D
    tile = {**RMS_ROPE_TILE, **(tile or {})}
    heads = tile["heads"] or 1  # heads per program: a power of two dividing H, at most 1024 columns by default
    while tile["heads"] is None and heads * 2 * D <= 1024 and H % (heads * 2) == 0:
        heads *= 2
    if H % heads or heads & (heads - 1):
        raise ValueError(f"heads per program {heads} must be a power of two dividing {H}")
    block = heads * D
    _rms_rope_cat_kernel[(B * (T + I), triton.cdiv(HD, block))](
        src_t, img, w_t, w_img, cos, sin, out, T, I, HD, float(eps_txt if txt is not None else eps_img),
        float(eps_img), src_t.stride(0), src_t.stride(1), img.stride(0), img.stride(1),
        TY=_TL_DTYPE[img.dtype], D=D, BLOCK=block,
        FMA_SQ=RMS_FMA_SQUARES if fma_squares is None else fma_squares,
        enable_fp_fusion=False, num_warps=tile["num_warps"],
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# tanh-GELU into a strided destination: F.gelu(x, approximate="tanh", out=out) for a column slice `out`
# ----------------------------------------------------------------------------------------------------------------
#
# aten (ActivationGeluKernel.cu), per element in fp32: x_cube = x * x * x; inner = kBeta * (x + kKappa * x_cube);
# 0.5 * x * (1 + tanhf(inner)), rounded once to the output dtype. Into a non-contiguous `out` aten falls back to
# its unvectorised elementwise loop (about twice the time of the contiguous call); this kernel writes the slice at
# full bandwidth. nvcc may contract `x + kKappa * x_cube` into an FMA; GELU_FMA_INNER is the choice measured to
# match torch's CUDA build on every bf16 and fp16 value (tests/test_flux_lossless.py), and the gate checks it
# again.

GELU_FMA_INNER = True
GELU_CONFIG = {"BLOCK": 2048, "num_warps": 8}
# the C++ constants: kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 evaluated in double, then rounded to fp32 (as Python floats
# holding those fp32 values, so passing them as constexprs rounds nothing again)
_GELU_BETA = float(torch.tensor(1.41421356237309504880 * 1.12837916709551257390 * 0.5, dtype=torch.float32))
_GELU_KAPPA = float(torch.tensor(0.044715, dtype=torch.float32))


@triton.jit
def _gelu_tanh_value(x, BETA: tl.constexpr, KAPPA: tl.constexpr, FMA_INNER: tl.constexpr, INTERPRET: tl.constexpr):
    # aten's tanh-GELU of fp32 values (the caller rounds once to the output dtype)
    x_cube = x * x * x
    if FMA_INNER:
        inner = tl.fma(KAPPA, x_cube, x)
    else:
        inner = x + KAPPA * x_cube
    inner = BETA * inner
    if INTERPRET:  # Triton's CPU interpreter has no libdevice: a tanh from exp (tests check the indexing there)
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    else:
        t = libdevice.tanh(inner)  # what CUDA's tanhf is
    return 0.5 * x * (1.0 + t)


@triton.jit
def _gelu_tanh_kernel(
    x_ptr, out_ptr, N, x_sr, out_sr,
    BETA: tl.constexpr, KAPPA: tl.constexpr, TY: tl.constexpr, FMA_INNER: tl.constexpr, BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # rows on the grid's x axis: up to 2**31 - 1 of them
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * x_sr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _gelu_tanh_value(x, BETA, KAPPA, FMA_INNER, INTERPRET)
    tl.store(out_ptr + row * out_sr + cols, _cast(y, TY), mask=ok)


def gelu_tanh(x: torch.Tensor, out: torch.Tensor, fma_inner: bool | None = None) -> torch.Tensor:
    """x [M, N] with unit last stride -> out [M, N] (any row stride, unit last stride); returns out."""
    M, N = x.shape
    config = GELU_CONFIG
    _gelu_tanh_kernel[(M, triton.cdiv(N, config["BLOCK"]))](
        x, out, N, x.stride(0), out.stride(0), BETA=_GELU_BETA, KAPPA=_GELU_KAPPA, TY=_TL_DTYPE[x.dtype],
        FMA_INNER=GELU_FMA_INNER if fma_inner is None else fma_inner, BLOCK=config["BLOCK"], INTERPRET=_interpreting(),
        enable_fp_fusion=False, num_warps=config["num_warps"],
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# LoRA tail: y + F.linear(t, B) * s (PEFT's order) in one pass
# ----------------------------------------------------------------------------------------------------------------
#
# PEFT adds an adapter as `result + lora_B(lora_A(x)) * scaling`: cuBLAS's [M, r] x [r, N] GEMM rounded to the
# dtype, the product with the scale (a Python float: fp32 opmath) rounded, the sum rounded. The kernel keeps the
# three roundings and does the K = r dot product on the tensor cores as cuBLAS does (one accumulator from zero, K in
# steps of 16); whether the two sum alike is the gate's to find out (kernels/lora.py), per signature.

LORA_TAIL_CONFIG = {"BM": 64, "BN": 128, "num_warps": 4}


@triton.jit
def _store_tile(ptrs, v, lm, rn, rows, N, EVEN: tl.constexpr):
    # a [BM, BN] tile's store: masked to `rows` local rows and N columns unless the tile is whole (EVEN)
    if EVEN:
        tl.store(ptrs, v)
    else:
        tl.store(ptrs, v, mask=(lm[:, None] < rows) & (rn[None, :] < N))


@triton.jit
def _term(t_ptr, b_ptr, row0, M, N, scale, lm, rn, R: tl.constexpr, TY: tl.constexpr, EVEN: tl.constexpr):
    # fp32 [BM, BN] tile of PEFT's rounded term F.linear(t, B) * scale (t contiguous [M, R], B [N, R]; row0, lm, rn,
    # EVEN as in _with_lora)
    t_blk = t_ptr + row0 * R
    rows = M - row0
    rk = tl.arange(0, R)
    if EVEN:
        t = tl.load(t_blk + lm[:, None] * R + rk[None, :])
        b = tl.load(b_ptr + rn[None, :] * R + rk[:, None])  # B^T tile [R, BN]
    else:
        t = tl.load(t_blk + lm[:, None] * R + rk[None, :], mask=lm[:, None] < rows, other=0.0)
        b = tl.load(b_ptr + rn[None, :] * R + rk[:, None], mask=rn[None, :] < N, other=0.0)
    lora = _round(tl.dot(t, b, out_dtype=tl.float32), TY)
    return _round(lora * scale, TY)


@triton.jit
def _with_lora(y_ptr, t_ptr, b_ptr, row0, M, N, scale, lm, rn, R: tl.constexpr, TY: tl.constexpr,
               EVEN: tl.constexpr):
    # fp32 [BM, BN] tile of PEFT's output y + F.linear(t, B) * scale for contiguous y [M, N], t [M, R]: the tile's
    # first row row0 (64-bit, added to the pointers once), lm its local rows (32-bit offsets within the tile), rn
    # its columns. EVEN (whole tiles: M and N multiples of the tile): no masks.
    y_blk = y_ptr + row0 * N
    if EVEN:
        y = tl.load(y_blk + lm[:, None] * N + rn[None, :])
    else:
        y = tl.load(y_blk + lm[:, None] * N + rn[None, :], mask=(lm[:, None] < M - row0) & (rn[None, :] < N),
                    other=0.0)
    return y.to(tl.float32) + _term(t_ptr, b_ptr, row0, M, N, scale, lm, rn, R, TY, EVEN)


@triton.jit
def _lora_tail_kernel(
    y_ptr, t_ptr, b_ptr, out_ptr, M, N, scale,
    R: tl.constexpr, TY: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr,
):
    row0 = tl.program_id(0).to(tl.int64) * BM  # 64-bit once per tile; 32-bit offsets inside it
    lm = tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    v = _with_lora(y_ptr, t_ptr, b_ptr, row0, M, N, scale, lm, rn, R, TY, EVEN)
    _store_tile(out_ptr + row0 * N + lm[:, None] * N + rn[None, :], _cast(v, TY), lm, rn, M - row0, N, EVEN)


@triton.jit
def _lora_tail2_kernel(
    y_ptr, t_ptr, b_ptr, t2_ptr, b2_ptr, out_ptr, M, N, scale, scale2,
    R: tl.constexpr, R2: tl.constexpr, TY: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr,
):
    # two adapters' terms in PEFT's order, each sum rounded: (y + term1) + term2, in one pass
    row0 = tl.program_id(0).to(tl.int64) * BM
    lm = tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    v = _round(_with_lora(y_ptr, t_ptr, b_ptr, row0, M, N, scale, lm, rn, R, TY, EVEN), TY)
    v = v + _term(t2_ptr, b2_ptr, row0, M, N, scale2, lm, rn, R2, TY, EVEN)
    _store_tile(out_ptr + row0 * N + lm[:, None] * N + rn[None, :], _cast(v, TY), lm, rn, M - row0, N, EVEN)


@triton.jit
def _gelu_tanh_lora_kernel(
    y_ptr, t_ptr, b_ptr, out_ptr, M, N, out_sr, scale,
    R: tl.constexpr, TY: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr,
    BETA: tl.constexpr, KAPPA: tl.constexpr, FMA_INNER: tl.constexpr, INTERPRET: tl.constexpr,
):
    # the adapter's layer output as PEFT rounds it, then the tanh-GELU into out's strided rows (a column slice)
    row0 = tl.program_id(0).to(tl.int64) * BM
    lm = tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    v = _round(_with_lora(y_ptr, t_ptr, b_ptr, row0, M, N, scale, lm, rn, R, TY, EVEN), TY)
    g = _gelu_tanh_value(v, BETA, KAPPA, FMA_INNER, INTERPRET)
    _store_tile(out_ptr + row0 * out_sr + lm[:, None] * out_sr + rn[None, :], _cast(g, TY), lm, rn, M - row0, N,
                EVEN)


def _even(M: int, N: int, bm: int, bn: int) -> bool:
    return M % bm == 0 and N % bn == 0


# Tiles timed per (M, N, rank) on the GPU: the tile shape changes which outputs a program writes, not how one
# output's K = r sum runs (the gate checks each signature anyway); the interpreter takes LORA_TAIL_CONFIG.
_LORA_CONFIGS = [triton.Config({"BM": bm, "BN": bn}, num_warps=w)
                 for bm, bn, w in ((64, 128, 4), (64, 128, 8), (128, 128, 8), (64, 256, 8), (128, 64, 4),
                                   (32, 256, 4), (32, 128, 4), (16, 256, 4), (32, 64, 4),
                                   # 16 outputs per thread: the GELU's fp32 temporaries without spills
                                   (16, 128, 4), (16, 256, 8), (32, 128, 8), (64, 64, 8))]
_EVEN = triton.heuristics({"EVEN": lambda a: _even(a["M"], a["N"], a["BM"], a["BN"])})
_lora_tail_tuned = autotune(_LORA_CONFIGS, key=["M", "N", "R"])(_EVEN(_lora_tail_kernel))
_lora_tail2_tuned = autotune(_LORA_CONFIGS, key=["M", "N", "R", "R2"])(_EVEN(_lora_tail2_kernel))
_gelu_tanh_lora_tuned = autotune(_LORA_CONFIGS, key=["M", "N", "R"])(_EVEN(_gelu_tanh_lora_kernel))


def _lora_launch(kernel: Any, tuned: Any, M: int, N: int, *args: Any, **meta: Any) -> None:
    """Launch a LoRA-term kernel over [M, N]: the tuned one on the GPU, LORA_TAIL_CONFIG's tile in the interpreter."""
    if _interpreting():
        c = LORA_TAIL_CONFIG
        kernel[(triton.cdiv(M, c["BM"]), triton.cdiv(N, c["BN"]))](
            *args, BM=c["BM"], BN=c["BN"], EVEN=_even(M, N, c["BM"], c["BN"]), num_warps=c["num_warps"], **meta)
    else:
        tuned[lambda m: (triton.cdiv(M, m["BM"]), triton.cdiv(N, m["BN"]))](*args, **meta)


def gelu_tanh_lora(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor,
                   fma_inner: bool | None = None) -> torch.Tensor:
    """gelu_tanh(y + F.linear(t, b) * scale) into out: y [M, N], t [M, r], b [N, r] contiguous (one dtype, r a
    multiple of 16), out [M, N] with unit columns; returns out."""
    M, N = y.shape
    _lora_launch(_gelu_tanh_lora_kernel, _gelu_tanh_lora_tuned, M, N,
                 y, t, b, out, M, N, out.stride(0), float(scale), R=t.shape[1], TY=_TL_DTYPE[y.dtype],
                 BETA=_GELU_BETA, KAPPA=_GELU_KAPPA, FMA_INNER=GELU_FMA_INNER if fma_inner is None else fma_inner,
                 INTERPRET=_interpreting(), enable_fp_fusion=False)
    return out


def lora_tail(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """y [M, N], t [M, r], b [N, r] (contiguous, one dtype; r a multiple of 16) -> y + F.linear(t, b) * scale."""
    M, N = y.shape
    out = torch.empty_like(y)
    _lora_launch(_lora_tail_kernel, _lora_tail_tuned, M, N,
                 y, t, b, out, M, N, float(scale), R=t.shape[1], TY=_TL_DTYPE[y.dtype], enable_fp_fusion=False)
    return out


def lora_tail2(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float, t2: torch.Tensor, b2: torch.Tensor,
               scale2: float) -> torch.Tensor:
    """lora_tail(lora_tail(y, t, b, scale), t2, b2, scale2) in one pass (each operand as lora_tail takes it)."""
    M, N = y.shape
    out = torch.empty_like(y)
    _lora_launch(_lora_tail2_kernel, _lora_tail2_tuned, M, N,
                 y, t, b, t2, b2, out, M, N, float(scale), float(scale2), R=t.shape[1], R2=t2.shape[1],
                 TY=_TL_DTYPE[y.dtype], enable_fp_fusion=False)
    return out
