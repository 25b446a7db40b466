"""Triton kernels of kernels/fp8.py (not bit-exact): per-row fp8 quantization of `[a | gelu(b)]` in one pass,
LayerNorm + AdaLN modulation whose output row is quantized in the same pass (it never exists in bf16), and the
weight-only fp8 GEMV of layers fed a few rows (bf16 activations, fp8 weights read once)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._high_triton import fp8_saturate, ln_modulate_row
from ._lossless_triton import _GELU_BETA, _GELU_KAPPA, _interpreting, libdevice
from .cache import autotune

_FP8_MAX = 448.0
_MIN_AMAX = 1e-12
# Above the largest |gelu_tanh(x)| over x < 0 (0.17004 at x = -0.7518), with margin for rounding.
GELU_DIP = tl.constexpr(0.171)


@triton.jit
def _gelu_tanh(x, BETA: tl.constexpr, KAPPA: tl.constexpr, INTERPRET: tl.constexpr, EXP_TANH: tl.constexpr):
    # EXP_TANH: tanh(u) = 1 - 2 / (exp(2u) + 1) with the hardware's exp2 and reciprocal, a few instructions instead
    # of libdevice's tanh; its error (~1e-7 absolute) is far below fp8's rounding step. Also the CPU interpreter's
    # form (it has no libdevice). exp overflowing to inf gives t = 1, underflowing to 0 gives t = -1.
    inner = BETA * (x + KAPPA * x * x * x)
    if INTERPRET or EXP_TANH:
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    else:
        t = libdevice.tanh(inner)
    return 0.5 * x * (1.0 + t)


@triton.jit
def _load_rows(ptr, rows, row_stride, cols, ok, GELU: tl.constexpr, BETA: tl.constexpr, KAPPA: tl.constexpr,
               INTERPRET: tl.constexpr, EXP_TANH: tl.constexpr):
    x = tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if GELU:
        x = _gelu_tanh(x, BETA, KAPPA, INTERPRET, EXP_TANH)
    return x


@triton.jit
def _store_fp8(q_ptr, rows, q_sr, cols, x, scale, ok, INTERPRET: tl.constexpr):
    tl.store(q_ptr + rows[:, None] * q_sr + cols[None, :], fp8_saturate(x / scale[:, None], INTERPRET), mask=ok)


@triton.jit
def _row_amax(amax, ptr, rows, row_stride, row_ok, offs, K, GELU: tl.constexpr, BLOCK: tl.constexpr,
              BETA: tl.constexpr, KAPPA: tl.constexpr, INTERPRET: tl.constexpr, EXP_TANH: tl.constexpr):
    """Each row's amax over one part (GELU'd if asked), folded into `amax` ([ROWS, BLOCK] running maxima)."""
    for k0 in range(0, K, BLOCK):
        cols = k0 + offs
        ok = row_ok[:, None] & (cols < K)[None, :]
        amax = tl.maximum(amax, tl.abs(_load_rows(ptr, rows, row_stride, cols, ok, GELU, BETA, KAPPA, INTERPRET,
                                                     EXP_TANH)))
    return tl.max(amax, axis=1)


@triton.jit
def _quant_rows_kernel(
    a_ptr, b_ptr, q_ptr, s_ptr, M, KA, KB, a_sr, b_sr, q_sr,
    GELU_B: tl.constexpr, HAS_B: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    BETA: tl.constexpr, KAPPA: tl.constexpr, INTERPRET: tl.constexpr, GELU_FROM_MAX: tl.constexpr,
    EXP_TANH: tl.constexpr,
):
    # ROWS rows per program: pass 1 finds each row's amax (both parts), pass 2 re-reads the rows (mostly from L2)
    # and writes fp8; the GELU is recomputed in pass 2 rather than stored. (A variant holding whole rows in
    # registers, one read instead of two, measured slower on the H200: bench/results/high-h200-session5.md.)
    # INTERPRET: q is fp32 and the wrapper rounds to fp8 (the CPU interpreter's own fp8 cast rounds wrongly; on the
    # GPU the cast is the hardware's round-to-nearest-even with saturation, like torch's).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    row_amax = _row_amax(amax, a_ptr, rows, a_sr, row_ok, offs, KA, False, BLOCK, BETA, KAPPA, INTERPRET,
                         EXP_TANH)
    if HAS_B:
        if GELU_B and GELU_FROM_MAX:
            # gelu rises on x >= 0 and its negative part never exceeds GELU_DIP in magnitude, so a row whose
            # gelu(max b) reaches GELU_DIP has amax gelu(max b): one GELU per row in this pass, not one per element.
            # Rows below it (rare: b all small or negative) take the per-element pass.
            bmax = tl.full([ROWS, BLOCK], float("-inf"), dtype=tl.float32)
            for k0 in range(0, KB, BLOCK):
                cols = k0 + offs
                ok = row_ok[:, None] & (cols < KB)[None, :]
                bmax = tl.maximum(bmax, tl.load(b_ptr + rows[:, None] * b_sr + cols[None, :], mask=ok,
                                                other=float("-inf")).to(tl.float32))
            g = _gelu_tanh(tl.max(bmax, axis=1), BETA, KAPPA, INTERPRET, EXP_TANH)
            g = tl.where(row_ok, g, GELU_DIP)  # rows past M: neither NaN nor a reason for the slow pass
            if tl.min(g, axis=0) >= GELU_DIP:
                row_amax = tl.maximum(row_amax, g)
            else:
                row_amax = tl.maximum(row_amax, _row_amax(amax, b_ptr, rows, b_sr, row_ok, offs, KB, True, BLOCK,
                                                          BETA, KAPPA, INTERPRET, EXP_TANH))
        else:
            row_amax = tl.maximum(row_amax, _row_amax(amax, b_ptr, rows, b_sr, row_ok, offs, KB, GELU_B, BLOCK,
                                                      BETA, KAPPA, INTERPRET, EXP_TANH))
    scale = tl.maximum(row_amax, 1e-12) / 448.0
    tl.store(s_ptr + rows, scale, mask=row_ok)
    for k0 in range(0, KA, BLOCK):
        cols = k0 + offs
        ok = row_ok[:, None] & (cols < KA)[None, :]
        x = _load_rows(a_ptr, rows, a_sr, cols, ok, False, BETA, KAPPA, INTERPRET, EXP_TANH)
        _store_fp8(q_ptr, rows, q_sr, cols, x, scale, ok, INTERPRET)
    if HAS_B:
        for k0 in range(0, KB, BLOCK):
            cols = k0 + offs
            ok = row_ok[:, None] & (cols < KB)[None, :]
            x = _load_rows(b_ptr, rows, b_sr, cols, ok, GELU_B, BETA, KAPPA, INTERPRET, EXP_TANH)
            _store_fp8(q_ptr, rows, q_sr, KA + cols, x, scale, ok, INTERPRET)


# Tiles measured per row shape on the GPU at first use (each key once; the CUDA-graph warm-up runs eagerly first).
_CONFIGS = [triton.Config({"ROWS": r, "BLOCK": b}, num_warps=w)
            for r, b, w in ((1, 1024, 4), (1, 2048, 8), (1, 4096, 8), (2, 1024, 4), (2, 2048, 8), (4, 512, 4),
                            (4, 1024, 8), (8, 256, 4), (8, 512, 8))]
_quant_rows_tuned = autotune(_CONFIGS, key=["KA", "KB", "GELU_B", "HAS_B", "GELU_FROM_MAX",
                                                                         "EXP_TANH"])(
    _quant_rows_kernel)


def quantize_rows(a: torch.Tensor, b: torch.Tensor | None, gelu_b: bool, gelu_from_max: bool = True,
                  exp_tanh: bool = True, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, Ka], b [M, Kb] or None (unit last strides) -> fp8 [M, Ka + Kb] (into `out` when given: any row
    stride), fp32 scale [M, 1].
    gelu_from_max=False: the amax pass applies the GELU per element; exp_tanh=False: the GELU's tanh from libdevice
    (the earlier kernels; benchmarks compare)."""
    M, KA = a.shape
    KB = 0 if b is None else b.shape[1]
    interpret = _interpreting()
    out = torch.empty((M, KA + KB), dtype=torch.float8_e4m3fn, device=a.device) if out is None else out
    q = _host_rows(out) if interpret else out
    scale = torch.empty((M, 1), dtype=torch.float32, device=a.device)
    if M == 0:
        return out, scale
    args = (a, a if b is None else b, q, scale, M, KA, KB, a.stride(0), 0 if b is None else b.stride(0), q.stride(0))
    meta = dict(GELU_B=bool(gelu_b), HAS_B=b is not None, BETA=_GELU_BETA, KAPPA=_GELU_KAPPA, INTERPRET=interpret,
                GELU_FROM_MAX=bool(gelu_from_max), EXP_TANH=bool(exp_tanh))
    if interpret:  # no timing in the interpreter: two rows per program, blocks small enough to wrap
        _quant_rows_kernel[(triton.cdiv(M, 2),)](*args, ROWS=2, BLOCK=1024, **meta)
        out.copy_(q)
        return out, scale
    _quant_rows_tuned[lambda m: (triton.cdiv(M, m["ROWS"]),)](*args, **meta)
    return out, scale


@triton.jit
def _ln_modulate_quant_kernel(
    x_ptr, scale_ptr, shift_ptr, q_ptr, s_ptr,
    S, N, x_sb, x_ss, scale_sb, shift_sb, q_sr, eps,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    # One row per program, held in registers: the high tier's fast LayerNorm + modulation in fp32, then the row's
    # amax, its scale and the fp8 row. INTERPRET: as above.
    y, out_row, cols, mask = ln_modulate_row(x_ptr, scale_ptr, shift_ptr, S, N, x_sb, x_ss, scale_sb, shift_sb, eps,
                                             BLOCK_N)
    qscale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
    tl.store(s_ptr + out_row, qscale)
    tl.store(q_ptr + out_row * q_sr + cols, fp8_saturate(y / qscale, INTERPRET), mask=mask)


def ln_modulate_quantize(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, S, D] (unit last stride), scale/shift [B, D] -> fp8 [B * S, D] (into `out` when given: any row
    stride), fp32 scale [B * S, 1]."""
    B, S, D = x.shape
    interpret = _interpreting()
    out = torch.empty((B * S, D), dtype=torch.float8_e4m3fn, device=x.device) if out is None else out
    q = _host_rows(out) if interpret else out
    qscale = torch.empty((B * S, 1), dtype=torch.float32, device=x.device)
    if B * S:
        block = triton.next_power_of_2(D)
        _ln_modulate_quant_kernel[(S, B)](
            x, scale, shift, q, qscale, S, D, x.stride(0), x.stride(1), scale.stride(0), shift.stride(0),
            q.stride(0), eps, BLOCK_N=block, INTERPRET=interpret, num_warps=max(1, min(8, block // 512)),
        )
    if interpret:
        out.copy_(q)
    return out, qscale


def _host_rows(out: torch.Tensor) -> torch.Tensor:
    """fp32 rows shaped and strided as `out`, for the interpreter to write (it stores no fp8; the host casts)."""
    return torch.empty((out.shape[0], max(out.stride(0), out.shape[1])), dtype=torch.float32,
                       device=out.device)[:, :out.shape[1]]


@triton.jit
def _weight_only_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K, x_sr, y_sr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # A few activation rows (M <= BLOCK_M, padded to the tensor-core minimum of 16) against BLOCK_N weight rows,
    # accumulated in fp32; the channel scale and the bias apply once at the end. The time is the weight read, half
    # of bf16's bytes. The fp8 weight widens to bf16 exactly (every e4m3 value is a bf16 value), so the products
    # are exact. INTERPRET: the CPU interpreter converts to bf16 wrongly, so there both operands go to fp32.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N, m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + m[:, None] * x_sr + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if INTERPRET:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    acc = acc * tl.load(ws_ptr + n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * y_sr + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# Narrow tiles put many programs (and loads) in flight, wide ones reuse the activation rows more: the autotuner
# picks per shape.
_WO_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
               for n, k, w, st in ((16, 512, 4, 4), (16, 1024, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3),
                                   (32, 1024, 8, 3), (64, 256, 4, 4), (64, 512, 8, 3), (128, 256, 8, 3))]
_weight_only_tuned = autotune(_WO_CONFIGS, key=["M", "N", "K", "HAS_BIAS"])(_weight_only_kernel)


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 (a few rows, unit last stride), weight fp8 [N, K] contiguous, weight_scale fp32 [1, N], bias
    [N] or None -> bf16 [M, N] = x @ (weight * scale)^T + bias, accumulated in fp32."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return y
    interpret = _interpreting()
    meta = dict(HAS_BIAS=bias is not None, BLOCK_M=max(16, triton.next_power_of_2(M)), INTERPRET=interpret)
    args = (x, weight.float() if interpret else weight,  # the interpreter loads no fp8: the same values in fp32
            weight_scale, weight_scale if bias is None else bias,  # (a placeholder pointer HAS_BIAS=False never reads)
            y, M, N, K, x.stride(0), y.stride(0))
    if interpret:  # no timing in the interpreter
        _weight_only_kernel[(triton.cdiv(N, 32),)](*args, BLOCK_N=32, BLOCK_K=64, **meta)
    else:
        _weight_only_tuned[lambda m: (triton.cdiv(N, m["BLOCK_N"]),)](*args, **meta)
    return y


@triton.jit
def _saturate_kernel(src_ptr, dst_ptr, M, W, s_sr, d_sr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                     INTERPRET: tl.constexpr):
    # One block of rows: values in the source's dtype -> fp8, saturating, into a (strided) fp8 destination.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_W)
    ok = (rows < M)[:, None] & (cols < W)[None, :]
    x = tl.load(src_ptr + rows[:, None] * s_sr + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_ptr + rows[:, None] * d_sr + cols[None, :], fp8_saturate(x, INTERPRET), mask=ok)


def copy_saturated(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (fp8 [M, W], unit last stride) = src ([M, W], unit last stride) in fp8, saturating: one pass."""
    M, W = src.shape
    if not M:
        return
    interpret = _interpreting()
    out = _host_rows(dst) if interpret else dst
    block_w = triton.next_power_of_2(W)
    block_m = max(1, min(64, 4096 // block_w))
    _saturate_kernel[(triton.cdiv(M, block_m),)](src, out, M, W, src.stride(0), out.stride(0), BLOCK_M=block_m,
                                                 BLOCK_W=block_w, INTERPRET=interpret, num_warps=4)
    if interpret:
        dst.copy_(out)


@triton.jit
def _rows_a_kernel(q_ptr, a_ptr, s_ptr, out_ptr, M, K, W, q_sr, out_sr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, INTERPRET: tl.constexpr):
    # fp8 rows [BLOCK_M, K] (unit scales: the layer's GEMM applies the rows' own) @ fp8 A [W, K]^T, times A's
    # per-row scales [W], saturated into fp8 columns (the rows' spare columns): the GEMM and the cast in one pass,
    # no bf16 [M, W] in between. INTERPRET: operands come as fp32 (the interpreter loads no fp8).
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    w = tl.arange(0, BLOCK_W)
    m_ok, w_ok = m < M, w < W
    acc = tl.zeros([BLOCK_M, BLOCK_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(q_ptr + m[:, None] * q_sr + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + w[None, :] * K + k[:, None], mask=w_ok[None, :] & k_ok[:, None], other=0.0)
        if INTERPRET:
            acc = tl.dot(x, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
    acc = acc * tl.load(s_ptr + w, mask=w_ok, other=0.0)[None, :]
    tl.store(out_ptr + m[:, None] * out_sr + w[None, :], fp8_saturate(acc, INTERPRET),
             mask=m_ok[:, None] & w_ok[None, :])


_ROWS_A_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_K": k}, num_warps=w, num_stages=st)
                   for m, k, w, st in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 256, 8, 3),
                                       (32, 256, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 512, 4, 3))]
_rows_a_tuned = autotune(_ROWS_A_CONFIGS, key=["M", "K", "W"])(_rows_a_kernel)


def rows_times_into(q: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (fp8 [M, W], unit last stride) = fp8(q [M, K] @ a [W, K]^T * a_scale [W]), saturating; q and a fp8 with
    unit last strides, a contiguous."""
    M, K = q.shape
    W = a.shape[0]
    if not M:
        return
    interpret = _interpreting()
    out = _host_rows(dst) if interpret else dst
    args = (q.float() if interpret else q, a.float() if interpret else a, a_scale.reshape(-1), out, M, K, W,
            q.stride(0) if not interpret else K, out.stride(0))
    meta = dict(BLOCK_W=max(16, triton.next_power_of_2(W)), INTERPRET=interpret)
    if interpret:
        _rows_a_kernel[(triton.cdiv(M, 32),)](*args, BLOCK_M=32, BLOCK_K=32, **meta)
        dst.copy_(out)
    else:
        _rows_a_tuned[lambda c: (triton.cdiv(M, c["BLOCK_M"]),)](*args, **meta)
