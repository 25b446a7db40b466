"""Triton kernel of kernels/fp8.py: per-row fp8 quantization of `[a | gelu(b)]` in one pass (not bit-exact)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._lossless_triton import _GELU_BETA, _GELU_KAPPA, _interpreting, libdevice

_FP8_MAX = 448.0
_MIN_AMAX = 1e-12


@triton.jit
def _gelu_tanh(x, BETA: tl.constexpr, KAPPA: tl.constexpr, INTERPRET: tl.constexpr):
    inner = BETA * (x + KAPPA * x * x * x)
    if INTERPRET:  # the CPU interpreter has no libdevice
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    else:
        t = libdevice.tanh(inner)
    return 0.5 * x * (1.0 + t)


@triton.jit
def _quant_rows_kernel(
    a_ptr, b_ptr, q_ptr, s_ptr, KA, KB, a_sr, b_sr, q_sr,
    GELU_B: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr,
    BETA: tl.constexpr, KAPPA: tl.constexpr, INTERPRET: tl.constexpr,
):
    # INTERPRET: q is fp32 and the wrapper rounds to fp8 (the CPU interpreter's own fp8 cast rounds wrongly; on the
    # GPU the cast is the hardware's round-to-nearest-even with saturation, like torch's).
    # One row per program: pass 1 finds the row's amax (both parts), pass 2 re-reads the row (from L2) and writes
    # fp8. The GELU is recomputed in pass 2 rather than stored. (A variant holding the whole row in registers, one
    # read instead of two, measured slower on the H200: bench/results/high-h200.md.)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, KA, BLOCK):
        cols = k0 + offs
        x = tl.load(a_ptr + row * a_sr + cols, mask=cols < KA, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    if HAS_B:
        for k0 in range(0, KB, BLOCK):
            cols = k0 + offs
            x = tl.load(b_ptr + row * b_sr + cols, mask=cols < KB, other=0.0).to(tl.float32)
            if GELU_B:
                x = _gelu_tanh(x, BETA, KAPPA, INTERPRET)
            amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    tl.store(s_ptr + row, scale)
    for k0 in range(0, KA, BLOCK):
        cols = k0 + offs
        ok = cols < KA
        x = tl.load(a_ptr + row * a_sr + cols, mask=ok, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        if not INTERPRET:
            y = y.to(tl.float8e4nv)
        tl.store(q_ptr + row * q_sr + cols, y, mask=ok)
    if HAS_B:
        for k0 in range(0, KB, BLOCK):
            cols = k0 + offs
            ok = cols < KB
            x = tl.load(b_ptr + row * b_sr + cols, mask=ok, other=0.0).to(tl.float32)
            if GELU_B:
                x = _gelu_tanh(x, BETA, KAPPA, INTERPRET)
            y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
            if not INTERPRET:
                y = y.to(tl.float8e4nv)
            tl.store(q_ptr + row * q_sr + KA + cols, y, mask=ok)


def quantize_rows(a: torch.Tensor, b: torch.Tensor | None, gelu_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, Ka], b [M, Kb] or None (unit last strides) -> fp8 [M, Ka + Kb], fp32 scale [M, 1]."""
    M, KA = a.shape
    KB = 0 if b is None else b.shape[1]
    interpret = _interpreting()
    q = torch.empty((M, KA + KB), dtype=torch.float32 if interpret else torch.float8_e4m3fn, device=a.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=a.device)
    if M == 0:
        return q.to(torch.float8_e4m3fn), scale
    block = min(2048, triton.next_power_of_2(max(KA, KB, 16)))
    _quant_rows_kernel[(M,)](
        a, a if b is None else b, q, scale, KA, KB, a.stride(0), 0 if b is None else b.stride(0), q.stride(0),
        GELU_B=bool(gelu_b), HAS_B=b is not None, BLOCK=block, BETA=_GELU_BETA, KAPPA=_GELU_KAPPA,
        INTERPRET=interpret, num_warps=max(1, min(8, block // 256)),
    )
    return (q.to(torch.float8_e4m3fn) if interpret else q), scale
