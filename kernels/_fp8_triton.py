"""Triton kernels of kernels/fp8.py (not bit-exact): per-row fp8 quantization of `[a | gelu(b)]` in one pass, and
LayerNorm + AdaLN modulation whose output row is quantized in the same pass (it never exists in bf16)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._high_triton import ln_modulate_row
from ._lossless_triton import _GELU_BETA, _GELU_KAPPA, _interpreting, libdevice

_FP8_MAX = 448.0
_MIN_AMAX = 1e-12
# Above the largest |gelu_tanh(x)| over x < 0 (0.17004 at x = -0.7518), with margin for rounding.
GELU_DIP = tl.constexpr(0.171)


@triton.jit
def _gelu_tanh(x, BETA: tl.constexpr, KAPPA: tl.constexpr, INTERPRET: tl.constexpr):
    inner = BETA * (x + KAPPA * x * x * x)
    if INTERPRET:  # the CPU interpreter has no libdevice
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    else:
        t = libdevice.tanh(inner)
    return 0.5 * x * (1.0 + t)


@triton.jit
def _load_rows(ptr, rows, row_stride, cols, ok, GELU: tl.constexpr, BETA: tl.constexpr, KAPPA: tl.constexpr,
               INTERPRET: tl.constexpr):
    x = tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if GELU:
        x = _gelu_tanh(x, BETA, KAPPA, INTERPRET)
    return x


@triton.jit
def _store_fp8(q_ptr, rows, q_sr, cols, x, scale, ok, INTERPRET: tl.constexpr):
    y = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    if not INTERPRET:
        y = y.to(tl.float8e4nv)
    tl.store(q_ptr + rows[:, None] * q_sr + cols[None, :], y, mask=ok)


@triton.jit
def _row_amax(amax, ptr, rows, row_stride, row_ok, offs, K, GELU: tl.constexpr, BLOCK: tl.constexpr,
              BETA: tl.constexpr, KAPPA: tl.constexpr, INTERPRET: tl.constexpr):
    """Each row's amax over one part (GELU'd if asked), folded into `amax` ([ROWS, BLOCK] running maxima)."""
    for k0 in range(0, K, BLOCK):
        cols = k0 + offs
        ok = row_ok[:, None] & (cols < K)[None, :]
        amax = tl.maximum(amax, tl.abs(_load_rows(ptr, rows, row_stride, cols, ok, GELU, BETA, KAPPA, INTERPRET)))
    return tl.max(amax, axis=1)


@triton.jit
def _quant_rows_kernel(
    a_ptr, b_ptr, q_ptr, s_ptr, M, KA, KB, a_sr, b_sr, q_sr,
    GELU_B: tl.constexpr, HAS_B: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    BETA: tl.constexpr, KAPPA: tl.constexpr, INTERPRET: tl.constexpr, GELU_FROM_MAX: tl.constexpr,
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
    row_amax = _row_amax(amax, a_ptr, rows, a_sr, row_ok, offs, KA, False, BLOCK, BETA, KAPPA, INTERPRET)
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
            g = _gelu_tanh(tl.max(bmax, axis=1), BETA, KAPPA, INTERPRET)
            g = tl.where(row_ok, g, GELU_DIP)  # rows past M: neither NaN nor a reason for the slow pass
            if tl.min(g, axis=0) >= GELU_DIP:
                row_amax = tl.maximum(row_amax, g)
            else:
                row_amax = tl.maximum(row_amax, _row_amax(amax, b_ptr, rows, b_sr, row_ok, offs, KB, True, BLOCK,
                                                          BETA, KAPPA, INTERPRET))
        else:
            row_amax = tl.maximum(row_amax, _row_amax(amax, b_ptr, rows, b_sr, row_ok, offs, KB, GELU_B, BLOCK,
                                                      BETA, KAPPA, INTERPRET))
    scale = tl.maximum(row_amax, 1e-12) / 448.0
    tl.store(s_ptr + rows, scale, mask=row_ok)
    for k0 in range(0, KA, BLOCK):
        cols = k0 + offs
        ok = row_ok[:, None] & (cols < KA)[None, :]
        x = _load_rows(a_ptr, rows, a_sr, cols, ok, False, BETA, KAPPA, INTERPRET)
        _store_fp8(q_ptr, rows, q_sr, cols, x, scale, ok, INTERPRET)
    if HAS_B:
        for k0 in range(0, KB, BLOCK):
            cols = k0 + offs
            ok = row_ok[:, None] & (cols < KB)[None, :]
            x = _load_rows(b_ptr, rows, b_sr, cols, ok, GELU_B, BETA, KAPPA, INTERPRET)
            _store_fp8(q_ptr, rows, q_sr, KA + cols, x, scale, ok, INTERPRET)


# Tiles measured per row shape on the GPU at first use (each key once; the CUDA-graph warm-up runs eagerly first).
_CONFIGS = [triton.Config({"ROWS": r, "BLOCK": b}, num_warps=w)
            for r, b, w in ((1, 1024, 4), (1, 2048, 8), (1, 4096, 8), (2, 1024, 4), (2, 2048, 8), (4, 512, 4),
                            (4, 1024, 8), (8, 256, 4), (8, 512, 8))]
_quant_rows_tuned = triton.autotune(configs=_CONFIGS, key=["KA", "KB", "GELU_B", "HAS_B", "GELU_FROM_MAX"])(
    _quant_rows_kernel)


def quantize_rows(a: torch.Tensor, b: torch.Tensor | None, gelu_b: bool,
                  gelu_from_max: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, Ka], b [M, Kb] or None (unit last strides) -> fp8 [M, Ka + Kb], fp32 scale [M, 1].
    gelu_from_max=False: the amax pass applies the GELU per element (the earlier kernel; benchmarks compare)."""
    M, KA = a.shape
    KB = 0 if b is None else b.shape[1]
    interpret = _interpreting()
    q = torch.empty((M, KA + KB), dtype=torch.float32 if interpret else torch.float8_e4m3fn, device=a.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=a.device)
    if M == 0:
        return q.to(torch.float8_e4m3fn), scale
    args = (a, a if b is None else b, q, scale, M, KA, KB, a.stride(0), 0 if b is None else b.stride(0), q.stride(0))
    meta = dict(GELU_B=bool(gelu_b), HAS_B=b is not None, BETA=_GELU_BETA, KAPPA=_GELU_KAPPA, INTERPRET=interpret,
                GELU_FROM_MAX=bool(gelu_from_max))
    if interpret:  # no timing in the interpreter: two rows per program, blocks small enough to wrap
        _quant_rows_kernel[(triton.cdiv(M, 2),)](*args, ROWS=2, BLOCK=1024, **meta)
        return q.to(torch.float8_e4m3fn), scale
    _quant_rows_tuned[lambda m: (triton.cdiv(M, m["ROWS"]),)](*args, **meta)
    return q, scale


@triton.jit
def _ln_modulate_quant_kernel(
    x_ptr, scale_ptr, shift_ptr, q_ptr, s_ptr,
    S, N, x_sb, x_ss, scale_sb, shift_sb, eps,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    # One row per program, held in registers: the high tier's fast LayerNorm + modulation in fp32, then the row's
    # amax, its scale and the fp8 row. INTERPRET: as above.
    y, out_row, cols, mask = ln_modulate_row(x_ptr, scale_ptr, shift_ptr, S, N, x_sb, x_ss, scale_sb, shift_sb, eps,
                                             BLOCK_N)
    qscale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
    tl.store(s_ptr + out_row, qscale)
    q = tl.minimum(tl.maximum(y / qscale, -448.0), 448.0)
    if not INTERPRET:
        q = q.to(tl.float8e4nv)
    tl.store(q_ptr + out_row * N + cols, q, mask=mask)


def ln_modulate_quantize(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, S, D] (unit last stride), scale/shift [B, D] -> fp8 [B * S, D], fp32 scale [B * S, 1]."""
    B, S, D = x.shape
    interpret = _interpreting()
    q = torch.empty((B * S, D), dtype=torch.float32 if interpret else torch.float8_e4m3fn, device=x.device)
    qscale = torch.empty((B * S, 1), dtype=torch.float32, device=x.device)
    if B * S:
        block = triton.next_power_of_2(D)
        _ln_modulate_quant_kernel[(S, B)](
            x, scale, shift, q, qscale, S, D, x.stride(0), x.stride(1), scale.stride(0), shift.stride(0), eps,
            BLOCK_N=block, INTERPRET=interpret, num_warps=max(1, min(8, block // 512)),
        )
    return (q.to(torch.float8_e4m3fn) if interpret else q), qscale
