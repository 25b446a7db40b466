"""RoPE for FLUX attention, optionally fused with the [text; image] concatenation (lossless: bit-exact).

`rope_cat(txt, img, cos, sin)` == `apply_rope_eager(torch.cat([txt, img], dim=1), cos, sin)` bit for bit: one Triton
pass reads both streams and writes the joint rotated tensor (eager: a cat plus ~8 elementwise passes with fp32
temporaries). Used for q and k; `txt=None` is plain RoPE (single-stream blocks). Guarded by `ExactGate`.

`rms_rope_cat(txt, img, norm_txt, norm_img, cos, sin)` also folds in the per-head QK RMSNorm that precedes RoPE
(torch's CUDA rms_norm reduction order, replayed per head), so q and k go from the projection output to the joint
rotated tensor in one pass. Its own gate; where it does not apply it is `rope_cat(norm_txt(txt), norm_img(img))`.
With `fast=True` (the `high` tier's fast norms) the same pass runs in a non-exact kernel (kernels/_high_triton.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .exact import ExactGate, Signature, tensor_signature

GATE = ExactGate("rope_cat")
RMS_GATE = ExactGate("rms_rope_cat")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _device_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def apply_rope_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' `apply_rotary_emb(x, (cos, sin), sequence_dim=1)`: x [B, S, H, D], tables [S, D].

    Interleaved pairs (x0, x1) -> (-x1, x0); fp32 math, one rounding to x's dtype at the end.
    """
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def rope_cat_eager(txt: torch.Tensor | None, img: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x = img if txt is None else torch.cat([txt, img], dim=1)
    return apply_rope_eager(x, cos, sin)


def _signature(txt: torch.Tensor | None, img: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Signature | None:
    """The gate key, or None where the kernel does not apply (CPU, autograd, odd layouts, inside a torch.compile
    trace: there the eager twin is traced, and reading data pointers would break the graph)."""
    if torch.compiler.is_compiling() or not _device_supported(img.device) or img.dim() != 4 or img.dtype not in _FLOATS:
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (txt, img, cos, sin)):
        return None
    B, I, H, D = img.shape
    operands = [img] if txt is None else [txt, img]
    for t in operands:
        if t.dtype != img.dtype or t.device != img.device or t.shape[0] != B or t.shape[2:] != (H, D):
            return None
        if t.stride(3) != 1 or t.stride(2) != D:  # (H, D) must be one contiguous row per token
            return None
    S = I + (0 if txt is None else txt.shape[1])
    for t in (cos, sin):
        if t.dtype != torch.float32 or t.device != img.device or t.shape != (S, D) or not t.is_contiguous():
            return None
    if D % 2 or B * S * H * D == 0:
        return None
    return tensor_signature(*operands, cos, sin) + ((txt is None),)


def rope_cat(txt: torch.Tensor | None, img: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of `cat([txt, img], dim=1)` (or of `img` alone), == `rope_cat_eager` bit for bit."""

    def fast() -> torch.Tensor:
        from . import _lossless_triton

        return _lossless_triton.rope_cat(txt, img, cos, sin)

    return GATE.run(_signature(txt, img, cos, sin), fast, lambda: rope_cat_eager(txt, img, cos, sin))


def _rms_signature(
    txt: torch.Tensor | None, img: torch.Tensor, norm_txt: nn.Module | None, norm_img: nn.Module,
    cos: torch.Tensor, sin: torch.Tensor,
) -> Signature | None:
    sig = _signature(txt, img, cos, sin)
    if sig is None:
        return None
    D = img.shape[3]
    if D & (D - 1) or not 8 <= D <= 128:  # aten's per-row thread layout replayed here: one warp, 4-element vectors
        return None
    norms = [norm_img] if txt is None else [norm_txt, norm_img]
    eps = []
    for norm, t in zip(norms, [img] if txt is None else [txt, img]):
        w = getattr(norm, "weight", None)
        if not isinstance(norm, nn.RMSNorm) or w is None or norm.eps is None or tuple(norm.normalized_shape) != (D,):
            return None
        if w.dtype != img.dtype or w.device != img.device or not w.is_contiguous():
            return None
        if torch.is_grad_enabled() and w.requires_grad:
            return None
        align = 4 * t.element_size()  # aten's vectorised path needs 4-element-aligned rows (else another kernel)
        if t.data_ptr() % align or w.data_ptr() % align:
            return None
        eps.append(float(norm.eps))
    return sig + (tuple(eps),) + tensor_signature(*(n.weight for n in norms))


def rms_rope_cat(
    txt: torch.Tensor | None, img: torch.Tensor, norm_txt: nn.Module | None, norm_img: nn.Module,
    cos: torch.Tensor, sin: torch.Tensor, fast: bool = False,
) -> torch.Tensor:
    """`rope_cat(norm_txt(txt), norm_img(img), cos, sin)` (txt may be None) bit for bit, in one pass on CUDA.

    fast=True (quality "high"): where the exact kernel applies, a non-exact one-pass kernel instead (several rows
    and heads per program, Triton's own reduction order); elsewhere the lossless path."""
    if fast:
        out = rms_rope_fast(txt, img, norm_txt, norm_img, cos, sin)
        if out is not None:
            return out

    def fast() -> torch.Tensor:
        from . import _lossless_triton

        return _lossless_triton.rms_rope_cat(
            txt, img, None if txt is None else norm_txt.weight, norm_img.weight,
            0.0 if txt is None else norm_txt.eps, norm_img.eps, cos, sin,
        )

    def eager() -> torch.Tensor:
        return rope_cat(None if txt is None else norm_txt(txt), norm_img(img), cos, sin)

    return RMS_GATE.run(_rms_signature(txt, img, norm_txt, norm_img, cos, sin), fast, eager)


def rms_rope_fast(
    txt: torch.Tensor | None, img: torch.Tensor, norm_txt: nn.Module | None, norm_img: nn.Module,
    cos: torch.Tensor, sin: torch.Tensor, fp8: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """The non-exact one-pass QK RMSNorm + RoPE (quality "high") where the exact kernel would apply, else None (CPU,
    odd layouts, torch.compile). fp8=True: quantized to e4m3 in the same pass, with one scale for the tensor that the
    norm weights bound: (values [B, T + I, H, D], fp32 descale [1])."""
    if _rms_signature(txt, img, norm_txt, norm_img, cos, sin) is None:
        return None
    from . import _high_triton

    return _high_triton.rms_rope_fast(
        txt, img, None if txt is None else norm_txt.weight, norm_img.weight,
        0.0 if txt is None else norm_txt.eps, norm_img.eps, cos, sin, fp8=fp8,
    )
