"""Joint attention: SDPA (exact: diffusers' native backend, the lossless path) or 8-bit attention (`high`).

`attention(q, k, v, mask, fp8=...)` takes q, k, v as [B, S, H, D] (the layout the projections produce) and returns
[B, S, H, D]. With `fp8=True` and no refusal, q and k are quantized to int8 (q per token, k per 128-token block),
v to fp8 e4m3 (per channel), and Q K^T runs in int8, P V in fp8, both accumulating in 32 bits
(kernels/_attention_fp8_triton.py): not bit-exact, for the high tier only. `fp8_attention_refusal` says why it
cannot run (no CUDA, a GPU before Ada, fp32, a mask, a head size other than 32, 64 or 128); the caller then gets
SDPA, and the refusal is logged once per reason.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from .fp8 import FP8, FP8_MAX, MIN_AMAX, to_fp8

logger = logging.getLogger(__name__)

VBLOCK = 128  # tokens per k scale: the Triton kernels' block, and the eager twin's
_HEAD_DIMS = (32, 64, 128)
_refusals_logged: set[str] = set()


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' native attention backend: [B, S, H, D] in, permuted views into SDPA, [B, S, H, D] out."""
    if attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
        attn_mask = attn_mask.unsqueeze(1).unsqueeze(1)
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
    return out.permute(0, 2, 1, 3)


def fp8_attention_refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attn_mask: torch.Tensor | None = None) -> str | None:
    """Why fp8 attention cannot run on these inputs, or None when it can."""
    if query.device.type != "cuda":
        return f"fp8 attention needs a CUDA device (inputs are on {query.device})"
    if torch.cuda.get_device_capability(query.device) < (8, 9):
        return "fp8 attention needs compute capability >= 8.9 (Ada/Hopper)"
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"fp8 attention takes bf16/fp16 inputs, got {query.dtype}"
    if attn_mask is not None:
        return "fp8 attention has no mask support"
    if query.shape[-1] not in _HEAD_DIMS:
        return f"fp8 attention supports head sizes {_HEAD_DIMS}, got {query.shape[-1]}"
    if not (query.shape == key.shape == value.shape):
        return f"fp8 attention needs q, k, v of one shape, got {tuple(query.shape)}, {tuple(key.shape)}, " \
               f"{tuple(value.shape)}"
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return "fp8 attention needs unit last strides"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def _blocks(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[B, S, H, D] fp32 -> zero-padded [B, S_pad / VBLOCK, VBLOCK, H, D] and S."""
    B, S, H, D = t.shape
    pad = -S % VBLOCK
    return F.pad(t, (0, 0, 0, 0, 0, pad)).view(B, -1, VBLOCK, H, D), S


def _int8(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = amax.clamp(min=MIN_AMAX) / 127.0
    y = x / scale
    return torch.trunc(y + 0.5 * torch.sign(y)), scale  # half away from zero, as the kernel rounds


def fp8_attention_eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        round_p: bool = True) -> torch.Tensor:
    """The Triton kernel's arithmetic in eager fp32 (tests): the same quantization of q, k (int8) and v (e4m3),
    dequantized, softmax in fp32 and P rounded to e4m3 after scaling by 448 (relative to the row's global max, where
    the kernel uses its running max: close, not equal; `round_p=False` leaves P unrounded, as Triton's CPU
    interpreter runs the kernel)."""
    q = query.float()
    q8, qs = _int8(q, q.abs().amax(dim=-1, keepdim=True))
    kb, S = _blocks(key.float())
    k8, ks = _int8(kb, kb.abs().amax(dim=(2, 4), keepdim=True))
    k = (k8 * ks).flatten(1, 2)[:, :S]
    v = value.float()
    v8, vs = to_fp8(v, v.abs().amax(dim=1, keepdim=True))  # one scale per channel over all tokens
    v8s = v8.float() * (vs / FP8_MAX)  # v's scale and P's 1/448 applied after the product
    qh = (q8 * qs).permute(0, 2, 1, 3)
    s = qh @ k.permute(0, 2, 3, 1) / math.sqrt(query.shape[-1])
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    p8 = (p * FP8_MAX).to(FP8).float() if round_p else p * FP8_MAX
    out = (p8 @ v8s.permute(0, 2, 1, 3)) / denom
    return out.permute(0, 2, 1, 3).to(query.dtype)


def fp8_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 attention of [B, S, H, D] q, k, v on CUDA (see `fp8_attention_refusal`), into `out` when given."""
    from . import _attention_fp8_triton

    return _attention_fp8_triton.attention(query, key, value, VBLOCK, out)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              *, fp8: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, H, D] attention: SDPA, or with `fp8` the 8-bit kernel where `fp8_attention_refusal` admits the inputs.
    out: a [B, S, H, D] view (unit last stride) to write the result into; it is returned."""
    if fp8:
        reason = fp8_attention_refusal(query, key, value, attn_mask)
        if reason is None and out is not None and out.stride(-1) != 1:
            reason = "fp8 attention writes into outputs with a unit last stride only"
        if reason is None:
            return fp8_attention(query, key, value, out)
        if reason not in _refusals_logged:
            _refusals_logged.add(reason)
            logger.warning("fp8 attention refused, SDPA kept: %s", reason)
    result = sdpa(query, key, value, attn_mask)
    if out is None:
        return result
    out.copy_(result)
    return out
