"""`group_norm`: GroupNorm, and optionally the SiLU that follows it, in one read and one write of a channels-last
activation (the high tier's VAE decoder: `model/vae.py`). Not bit-exact: one rounding where eager rounds after the
norm and again after the SiLU, and statistics merged per chunk of pixels; eager elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import switches

SWITCH = switches.register("group_norm_silu", True, "GroupNorm (+ SiLU) over channels-last activations in one Triton "
                                                   "pass (not bit-exact; the high tier's VAE decoder)")
_HALF = (torch.float16, torch.bfloat16)


def group_norm_eager(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     eps: float, silu: bool = False) -> torch.Tensor:
    """`nn.GroupNorm` (then `nn.SiLU` where `silu`), as diffusers' VAE runs them."""
    y = F.group_norm(x, groups, weight, bias, eps)
    return F.silu(y) if silu else y


def _device_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def _channels_last(x: torch.Tensor) -> torch.Tensor | None:
    """x [B, C, *spatial] seen as [B, L, C] without a copy, where its channels are innermost (a channels-last
    tensor, or diffusers' attention's transposed [B, C, L]); None otherwise."""
    rows = x.movedim(1, -1)
    if not rows.is_contiguous():
        return None
    return rows.view(x.shape[0], -1, x.shape[1])


def kernel_takes(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether the Triton pass runs for these operands: CUDA fp16/bf16, channels innermost, C a power of two and a
    multiple of `groups` (so the groups are a power of two too), affine, no autograd."""
    c = x.shape[1] if x.dim() >= 3 else 0
    return (SWITCH.value and _device_supported(x.device) and x.dtype in _HALF and c > 0 and c & (c - 1) == 0
            and c % groups == 0 and weight is not None and bias is not None
            and x.numel() > 0 and not (torch.is_grad_enabled() and x.requires_grad)
            and _channels_last(x) is not None)


def group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               silu: bool = False) -> torch.Tensor:
    """GroupNorm of x [B, C, *spatial] (then SiLU where `silu`), in x's layout: one Triton pass where
    `kernel_takes`, eager otherwise."""
    if not kernel_takes(x, groups, weight, bias):
        return group_norm_eager(x, groups, weight, bias, eps, silu)
    return fused(x, groups, weight, bias, eps, silu)


def fused(x: torch.Tensor, groups: int, weight: torch.Tensor, bias: torch.Tensor, eps: float,
          silu: bool) -> torch.Tensor:
    """The Triton pass on x [B, C, *spatial] with channels innermost (`group_norm` asks `kernel_takes` first)."""
    from ._high_triton import group_norm_channels_last

    rows = _channels_last(x)
    out = group_norm_channels_last(rows, groups, weight, bias, eps, silu)
    # back to x's shape and strides: [B, L, C] -> [B, *spatial, C] -> [B, C, *spatial]
    return out.view(x.shape[0], *x.shape[2:], x.shape[1]).movedim(-1, 1)


class GroupNormAct(torch.nn.Module):
    """An `nn.GroupNorm` (its parameters kept) whose forward is `group_norm`, with the SiLU after it where `silu`."""

    def __init__(self, norm: torch.nn.GroupNorm, silu: bool) -> None:
        super().__init__()
        self.num_groups, self.eps, self.silu = norm.num_groups, norm.eps, silu
        self.weight, self.bias = norm.weight, norm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps, self.silu)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.weight.shape[0] if self.weight is not None else '?'}, eps={self.eps}, " \
               f"silu={self.silu}"
