"""`lora_tail`: a LoRA adapter's term added to its layer's output in PEFT's order, `y + F.linear(t, B) * scale`
(t = the adapter's A applied to the input), in one pass instead of PEFT's three (a GEMM, a product, a sum): the
lossless tier's adapters. Bit-exact with eager where `GATE` has seen it match, eager everywhere else."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .exact import ExactGate, Signature, tensor_signature

_HALF = (torch.float16, torch.bfloat16)
GATE = ExactGate("lora_tail", "LoRA term y + F.linear(t, B) * s in one Triton pass (bit-exact gate)")
# Ranks the kernel takes: tensor-core dot products over K in steps of 16, the whole rank in registers.
RANKS = (16, 32, 64, 128)


def lora_tail_eager(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """PEFT's expression (`result + lora_B(t) * scaling`, lora_B a bias-free linear with weight b)."""
    return y + F.linear(t, b) * scale


def _device_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def _signature(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor) -> Signature | None:
    """The gate's key, or None where the kernel does not apply (eager)."""
    if y.dtype not in _HALF or t.dtype != y.dtype or b.dtype != y.dtype:
        return None
    if not (_device_supported(y.device) and t.device == y.device == b.device):
        return None
    r = t.shape[-1]
    if r not in RANKS or b.shape != (y.shape[-1], r) or t.shape[:-1] != y.shape[:-1] or y.numel() == 0:
        return None
    if not (y.is_contiguous() and t.is_contiguous() and b.is_contiguous()):
        return None
    if torch.is_grad_enabled() and (y.requires_grad or t.requires_grad or b.requires_grad):
        return None  # no autograd formula
    return tensor_signature(y, t, b)


def lora_tail(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """`y + F.linear(t, b) * scale`, bit for bit: y [..., N], t [..., r], b [N, r]; one Triton pass on CUDA fp16/bf16
    (ranks in `RANKS`) once the gate saw it equal eager for these shapes, the eager expression otherwise."""
    signature = _signature(y, t, b) if GATE.enabled else None

    def fast() -> torch.Tensor:
        from . import _lossless_triton

        n, r = y.shape[-1], t.shape[-1]
        return _lossless_triton.lora_tail(y.view(-1, n), t.view(-1, r), b, scale).view(y.shape)

    return GATE.run(signature, fast, lambda: lora_tail_eager(y, t, b, scale))
