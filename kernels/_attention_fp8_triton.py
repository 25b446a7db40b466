"""Triton kernels of kernels/attention.py (not bit-exact): 8-bit attention for the `high` tier.

Q K^T in int8 and P V in fp8 e4m3 (SageAttention 2's split: int8 keeps the logits ~3x closer than e4m3's 3-bit
mantissa would; P and V are fine in e4m3), both with 32-bit accumulation. `quantize_qkv` reads q, k, v in their
[B, S, H, D] layout once and writes head-major 8-bit copies: q with one scale per token (its row's amax over D), k
with one per 128-token block (a scalar per key tile in the loop), v with one per channel over all tokens (a channel's
scale multiplies the output column once, after the loop), v transposed ([D, S]: an fp8 GEMM wants its reduction
dimension contiguous). `attention` is a flash-attention forward over them whose softmax costs one FMA, one exp2 and
one add per logit: the q and k scales and the softmax scale fold into a per-row factor, P is scaled by 448 inside the
exp2 (so that small probabilities keep e4m3's mantissa instead of flushing to zero; the row sum carries the same
factor and cancels it), and P V accumulates straight into the output tile.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._high_triton import fp8_saturate
from ._lossless_triton import _interpreting
from .cache import autotune
_LOG2E = 1.4426950408889634
_LOG2_448 = tl.constexpr(8.807354922057604)  # P = exp2(logit - max + log2(448)) <= 448, e4m3's largest value


@triton.jit
def _int8_rows(x):
    """fp32 tile -> (int8 values rounded half away from zero, fp32 scale per row): row amax -> 127."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 127.0
    y = x / scale[:, None]
    return tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int8), scale


@triton.jit
def _int8_tile(x):
    """fp32 tile -> (int8 values, one fp32 scale): tile amax -> 127."""
    scale = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-12) / 127.0
    y = x / scale
    return tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int8), scale


@triton.jit
def _quantize_qkv_kernel(
    q_ptr, k_ptr, v_ptr, vs_ptr, q8_ptr, k8_ptr, v8t_ptr, qs_ptr, ks_ptr,
    S, S_PAD, H, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
    D: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    # Program (token block, batch * head). INTERPRET: v's output is fp32 and the wrapper rounds it to fp8.
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    toks = blk * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    ok = (toks < S)[:, None]
    head = bh * S_PAD * D  # [B, H, S_PAD, D] outputs
    out = head + toks[:, None] * D + d[None, :]

    x = tl.load(q_ptr + b * q_sb + toks[:, None] * q_ss + h * q_sh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    y, s = _int8_rows(x)
    tl.store(q8_ptr + out, y)
    tl.store(qs_ptr + bh * S_PAD + toks, s)

    x = tl.load(k_ptr + b * k_sb + toks[:, None] * k_ss + h * k_sh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    y, s = _int8_tile(x)
    tl.store(k8_ptr + out, y)
    tl.store(ks_ptr + bh * (S_PAD // BLOCK) + blk, s)

    x = tl.load(v_ptr + b * v_sb + toks[:, None] * v_ss + h * v_sh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    y = x / tl.load(vs_ptr + bh * D + d)[None, :]  # the channel's amax over all tokens -> 448
    y = fp8_saturate(y, INTERPRET)
    tl.store(v8t_ptr + head + d[None, :] * S_PAD + toks[:, None], y)  # transposed: [B, H, D, S_PAD]


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, S, H, D] (unit last strides) -> q8, k8 [B, H, S_pad, D] (int8), v8t [B, H, D, S_pad] (fp8), all zero
    past S, which is padded to a multiple of `block` (kernels.attention.VBLOCK: tokens per k scale; the attention
    tiles divide it); scales (fp32): q's [B, H, S_pad], k's [B, H, S_pad / block], v's [B, H, D]."""
    B, S, H, D = q.shape
    s_pad = triton.cdiv(S, block) * block
    interpret = _interpreting()
    q8 = torch.empty((B, H, s_pad, D), dtype=torch.int8, device=q.device)
    k8 = torch.empty_like(q8)
    v8t = torch.empty((B, H, D, s_pad), dtype=torch.float32 if interpret else torch.float8_e4m3fn, device=q.device)
    qs = torch.empty((B, H, s_pad), dtype=torch.float32, device=q.device)
    ks = torch.empty((B, H, s_pad // block), dtype=torch.float32, device=q.device)
    # v's channel amax over all tokens: one reduction launch (exact in v's dtype), then the scale that maps it to 448.
    vs = torch.linalg.vector_norm(v, float("inf"), dim=1).float().clamp_(min=1e-12) / 448.0
    _quantize_qkv_kernel[(s_pad // block, B * H)](
        q, k, v, vs, q8, k8, v8t, qs, ks, S, s_pad, H,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        D=D, BLOCK=block, INTERPRET=interpret, num_warps=8,
    )
    if interpret:
        v8t = v8t.to(torch.float8_e4m3fn)
    return q8, k8, v8t, qs, ks, vs


@triton.jit
def _attention_kernel(
    q8_ptr, k8_ptr, v8t_ptr, qs_ptr, ks_ptr, vs_ptr, o_ptr,
    S, S_PAD, H, o_sb, o_ss, o_sh, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VB: tl.constexpr, EVEN: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # Program (query block, batch * head): the online-softmax loop over all key blocks (no mask, not causal).
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    d = tl.arange(0, D)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    head = bh * S_PAD * D
    q = tl.load(q8_ptr + head + rows[:, None] * D + d[None, :])
    q_scale = tl.load(qs_ptr + bh * S_PAD + rows) * qk_scale  # softmax scale and log2(e) folded in: exp2 below
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the logits, minus log2(448)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for n0 in range(0, S_PAD, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k8_ptr + head + cols[:, None] * D + d[None, :])
        row_scale = q_scale * tl.load(ks_ptr + bh * (S_PAD // VB) + n0 // VB)  # > 0: max commutes with it
        s = tl.dot(q, tl.trans(k)).to(tl.float32)
        if not EVEN:
            s = tl.where((cols < S)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * row_scale - _LOG2_448)
        p = tl.math.exp2(s * row_scale[:, None] - m_new[:, None])  # 448 * softmax numerator
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v8t_ptr + head + d[:, None] * S_PAD + cols[None, :])
        if not INTERPRET:
            p = p.to(tl.float8e4nv)
        acc = tl.dot(p, tl.trans(vt), acc * alpha[:, None])
        m_i = m_new
    out = acc * (tl.load(vs_ptr + bh * D + d)[None, :] / l_i[:, None])
    tl.store(o_ptr + b * o_sb + rows[:, None] * o_ss + h * o_sh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(rows < S)[:, None])


# Tiles measured on the GPU at first use per (S_PAD, D): each divides the k-scale block (128).
_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
            for m, n, w, st in ((128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 3),
                                (128, 64, 8, 3), (128, 64, 4, 4), (64, 128, 4, 3), (64, 64, 4, 4),
                                (128, 128, 4, 3))]
_attention_tuned = autotune(_CONFIGS, key=["S_PAD", "D", "EVEN"])(_attention_kernel)


def attend_quantized(q8: torch.Tensor, k8: torch.Tensor, v8t: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor,
                     vs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The attention launch over `quantize_qkv`'s outputs, into `out` [B, S, H, D] (unit last stride)."""
    B, H, s_pad, D = q8.shape
    S = out.shape[1]
    block = s_pad // ks.shape[-1]  # tokens per k scale
    args = (q8, k8, v8t, qs, ks, vs, out, S, s_pad, H, out.stride(0), out.stride(1), out.stride(2),
            _LOG2E / math.sqrt(D))
    if _interpreting():  # fp8 is not a type the interpreter computes in: v's values as fp32, P not rounded
        _attention_kernel[(s_pad // 64, B * H)](q8, k8, v8t.float(), *args[3:], D=D, BLOCK_M=64, BLOCK_N=64,
                                                VB=block, EVEN=S == s_pad, INTERPRET=True)
        return out
    _attention_tuned[lambda m: (s_pad // m["BLOCK_M"], B * H)](*args, D=D, VB=block, EVEN=S == s_pad,
                                                                INTERPRET=False)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for q, k, v [B, S, H, D] (bf16/fp16, unit last strides) -> [B, S, H, D] in q's
    dtype (written into `out` when given: any [B, S, H, D] view with a unit last stride); `block` as in
    `quantize_qkv`."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return attend_quantized(*quantize_qkv(q, k, v, block), out)


# ----------------------------------------------------------------------------------------------------------------
# For cuDNN's fp8 attention (per-tensor scales): v as one fp8 tensor, and the fp8 output back to bf16
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _tokens_fp8_kernel(
    txt_ptr, img_ptr, out_ptr, amax_ptr, scales_ptr, M, T, S, N, txt_sb, txt_ss, img_sb, img_ss,
    QUANTIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    # Rows of cat([txt, img], dim=1) ([B, T + I, N] with N = H * D; each source row's N values contiguous). Pass 1
    # (QUANTIZE=False): the tensor's amax, folded into amax_ptr (zeroed by the caller) with atomic max. Pass 2: the
    # values scaled by 448 / amax into fp8 e4m3, and the scales the attention call needs: scales[0] = amax / 448
    # (v's descale, which is also the output's: softmax rows average v, so |o| <= amax), scales[1] = 448 / amax.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    b = rows // S
    s = rows % S
    is_txt = (s < T)[:, None]
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    at_t = txt_ptr + (b * txt_sb + s * txt_ss)[:, None] + cols[None, :]
    at_i = img_ptr + (b * img_sb + (s - T) * img_ss)[:, None] + cols[None, :]
    x = tl.where(is_txt, tl.load(at_t, mask=ok & is_txt, other=0.0),
                 tl.load(at_i, mask=ok & ~is_txt, other=0.0)).to(tl.float32)
    if not QUANTIZE:
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    else:
        amax = tl.maximum(tl.load(amax_ptr), 1e-12)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scales_ptr, amax / 448.0)
            tl.store(scales_ptr + 1, 448.0 / amax)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], fp8_saturate(x * (448.0 / amax), INTERPRET), mask=ok)


def tokens_fp8(txt: torch.Tensor | None, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cat([txt, img], dim=1) of [B, *, H, D] tensors with contiguous (H, D) rows -> (fp8 e4m3 [B, T + I, H, D], fp32
    scales [2]: amax / 448 and its inverse), one scale for the whole tensor (two launches: amax, then the values)."""
    B, I, H, D = img.shape
    T = 0 if txt is None else txt.shape[1]
    src_t = img if txt is None else txt
    interpret = _interpreting()
    out = torch.empty((B, T + I, H, D), dtype=torch.float32 if interpret else torch.float8_e4m3fn, device=img.device)
    amax = torch.zeros(1, dtype=torch.float32, device=img.device)
    scales = torch.empty(2, dtype=torch.float32, device=img.device)
    M, N, rows, block = B * (T + I), H * D, 4, 1024
    grid = (triton.cdiv(M, rows), triton.cdiv(N, block))
    for quantize in (False, True):
        _tokens_fp8_kernel[grid](src_t, img, out, amax, scales, M, T, T + I, N, src_t.stride(0), src_t.stride(1),
                                 img.stride(0), img.stride(1), QUANTIZE=quantize, ROWS=rows, BLOCK=block,
                                 INTERPRET=interpret, num_warps=8)
    return (out.to(torch.float8_e4m3fn) if interpret else out), scales


@triton.jit
def _dequant_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    y = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32) * tl.load(scale_ptr)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous fp8 tensor times the scalar `scale` (fp32, on the device) -> `dtype`."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    src = x.float() if _interpreting() else x  # the interpreter computes no fp8
    n = x.numel()
    _dequant_kernel[(triton.cdiv(n, 4096),)](src, scale, out, n, BLOCK=4096, num_warps=8)
    return out
