"""AdaLN modulation `normed * (1 + scale[:, None]) + shift[:, None]` in one pass (lossless: bit-exact).

Eager runs three ops (the small `1 + scale`, then a full-size mul and add, each rounding to the input dtype); the
kernel repeats those roundings in one read and one write of the activation. Guarded by `ExactGate`.
"""

from __future__ import annotations

import torch

from .exact import ExactGate, Signature, tensor_signature

GATE = ExactGate("modulate")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def modulate_eager(normed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """diffusers' AdaLN modulation, operand for operand."""
    return normed * (1 + scale[:, None]) + shift[:, None]


def _signature(normed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> Signature | None:
    if normed.device.type != "cuda" or normed.dim() != 3 or normed.dtype not in _FLOATS:
        return None
    if torch.is_grad_enabled() and (normed.requires_grad or scale.requires_grad or shift.requires_grad):
        return None
    B, S, D = normed.shape
    if normed.stride(2) != 1 or normed.numel() == 0:
        return None
    for t in (scale, shift):
        if t.shape != (B, D) or t.dtype != normed.dtype or t.device != normed.device or t.stride(1) != 1:
            return None
    return tensor_signature(normed, scale, shift)


def modulate(normed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """`normed * (1 + scale[:, None]) + shift[:, None]` for normed [B, S, D], scale/shift [B, D]; bit-exact."""

    def fast() -> torch.Tensor:
        from . import _lossless_triton

        return _lossless_triton.modulate(normed, scale, shift)

    return GATE.run(_signature(normed, scale, shift), fast, lambda: modulate_eager(normed, scale, shift))
