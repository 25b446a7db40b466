"""Triton GEMM with a bias + tanh-GELU epilogue: y = gelu_tanh(x @ W.T + b), fp32 accumulate, one rounding.

Two variants, each autotuned per (M, N, K) by Triton and then offered to the per-shape dispatcher in
kernels/gelu.py, which keeps whichever implementation is fastest on that shape (and correct on first sight):
- `mm_gelu`: one program per output tile, pointer loads (portable; wgmma + cp.async pipelining on Hopper).
- `mm_gelu_tma`: persistent (one program per SM) with host TMA descriptors for A, W and the output (Hopper+).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache import autotune

_SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def _gelu_tanh(y):
    # 0.5*y*(1+tanh(z)) == y*sigmoid(2z): one exp and one division, saturates correctly for |z| large.
    z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
    return y / (1.0 + tl.exp(-2.0 * z))


@triton.jit
def _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row-tiles share W column-tiles while they are still in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


def _ptr_configs() -> list[triton.Config]:
    return [
        triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in [
            (128, 256, 64, 3, 8),
            (128, 256, 64, 4, 8),
            (256, 128, 64, 3, 8),
            (128, 128, 64, 4, 4),
            (128, 128, 128, 3, 8),
        ]
    ]


@autotune(_ptr_configs(), key=["M", "N", "K"])
@triton.jit
def _mm_gelu_kernel(
    a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    rows = tl.max_contiguous(tl.multiple_of(tl.where(offs_m < M, offs_m, 0), BM), BM)
    cols = tl.max_contiguous(tl.multiple_of(tl.where(offs_n < N, offs_n, 0), BN), BN)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None]  # a [BK, BN] tile of W.T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        k_left = K - k * BK
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BK
        w_ptrs += BK
    bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    out = _gelu_tanh(acc + bias[None, :])
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def mm_gelu(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    x2d = x2d.contiguous()
    weight = weight.contiguous()
    M, K = x2d.shape
    N = weight.shape[0]
    out = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)

    _mm_gelu_kernel[grid](x2d, weight, bias, out, M, N, K, x2d.stride(0), weight.stride(0), out.stride(0))
    return out


# ---------------------------------------------------------------- persistent + TMA (Hopper and newer)


def _set_block_shapes(nargs: dict) -> None:
    bm, bn, bk = nargs["BM"], nargs["BN"], nargs["BK"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn]


def _tma_configs() -> list[triton.Config]:
    return [
        triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=s, num_warps=w,
                      pre_hook=_set_block_shapes)
        for bm, bn, bk, s, w in [
            (128, 256, 64, 3, 8),
            (128, 256, 64, 4, 8),
            (128, 128, 64, 4, 8),
            (128, 128, 128, 3, 8),
            (256, 128, 64, 3, 8),
        ]
    ]


@autotune(_tma_configs(), key=["M", "N", "K"])
@triton.jit
def _mm_gelu_tma_kernel(
    a_desc, w_desc, c_desc, bias_ptr, M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(start, num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BK])
            w = w_desc.load([off_n, ki * BK])
            acc = tl.dot(a, w.T, acc)
        offs_n = off_n + tl.arange(0, BN)
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        out = _gelu_tanh(acc + bias[None, :])
        c_desc.store([off_m, off_n], out.to(tl.bfloat16 if OUT_BF16 else tl.float16))  # TMA clips ragged edges


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])


_num_sms: dict[int, int] = {}


def mm_gelu_tma(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    x2d = x2d.contiguous()
    weight = weight.contiguous()
    if not (_aligned(x2d) and _aligned(weight)) or torch.cuda.get_device_capability(x2d.device)[0] < 9:
        return mm_gelu(x2d, weight, bias)  # TMA needs 16-byte aligned bases/strides and sm_90+
    M, K = x2d.shape
    N = weight.shape[0]
    out = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    if N * out.element_size() % 16:
        return mm_gelu(x2d, weight, bias)
    dev = x2d.device.index if x2d.device.index is not None else torch.cuda.current_device()
    if dev not in _num_sms:
        _num_sms[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    n_sms = _num_sms[dev]
    dummy = [1, 1]  # real block shapes are set per config by _set_block_shapes
    a_desc = TensorDescriptor(x2d, list(x2d.shape), list(x2d.stride()), dummy)
    w_desc = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), dummy)
    c_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), dummy)

    def grid(meta: dict) -> tuple[int]:
        return (min(n_sms, triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"])),)

    _mm_gelu_tma_kernel[grid](
        a_desc, w_desc, c_desc, bias, M, N, K, NUM_SMS=n_sms, OUT_BF16=out.dtype == torch.bfloat16
    )
    return out
