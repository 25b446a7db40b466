"""`residual_gate_add`: the FLUX residual-gate pair `residual + gate * update`, fused, bit-exact with eager."""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from . import lora, switches
from .exact import ExactGate, tensor_signature

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)

# Process-wide switch of the fast path; the first runtime failure of the kernel (outside torch.compile) turns it off.
SWITCH = switches.register("residual_gate_add", True, "Triton residual-gate kernel (bit-exact; off after a failure)")
# Counts Triton launches, so tests can prove the fast path (not the fallback) produced a result.
_triton_calls = 0


def reset_fast_path() -> None:
    """Re-enable the fast path after a failure disabled it (for tests and long-lived processes)."""
    SWITCH.value = True


def fast_path_disabled() -> bool:
    return not SWITCH.value


def triton_calls() -> int:
    return _triton_calls


def _eager(residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, clip: float | None = None) -> torch.Tensor:
    out = residual + gate * update
    return out if clip is None else out.clip(-clip, clip)


def _device_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def _gate_as_b1d(residual: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    """gate as a [B, 1, D] view with last-dim stride 1, or None if its shape/strides are not supported."""
    B, _, D = residual.shape
    if gate.dim() == 0 or gate.dim() > 3 or gate.shape[-1] != D:
        return None
    g = gate
    while g.dim() < 3:
        g = g.unsqueeze(0)  # eager broadcasting aligns trailing dims
    if g.shape[1] != 1 or g.shape[0] not in (1, B):
        return None
    g = g.expand(B, 1, D)  # batch stride 0 for a shared gate
    if g.stride(2) != 1 and D > 1:
        return None
    return g


def _fast_path_args(
    residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor | None:
    """The [B,1,D] gate view if the Triton kernel reproduces eager exactly for these inputs, else None."""
    if residual.dtype not in _HALF or update.dtype != residual.dtype or gate.dtype != residual.dtype:
        return None  # fp32, or mixed dtypes whose promotion eager handles
    if not (_device_supported(residual.device) and update.device == residual.device == gate.device):
        return None
    if residual.dim() != 3 or update.shape != residual.shape or residual.numel() == 0:
        return None
    if not (residual.is_contiguous() and update.is_contiguous()):
        return None
    if torch.is_grad_enabled() and (residual.requires_grad or update.requires_grad or gate.requires_grad):
        return None  # the kernel has no autograd formula
    return _gate_as_b1d(residual, gate)


LORA_GATE = ExactGate("residual_gate_lora", "an adapter's term added to the update inside the residual-gate pass "
                                            "(bit-exact gate)")


def _with_term(residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, clip: float | None,
               t: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """`residual + gate * (update + F.linear(t, b) * scale)` with PEFT's and eager's roundings: one Triton pass
    where the gate has seen it match, else the term's own pass and the residual's."""
    gate3 = _fast_path_args(residual, update, gate) if SWITCH.value and not _is_compiling() else None
    tail = lora.signature(update, t, b) if gate3 is not None else None  # (t's rows match update's, or None)
    sig = None if tail is None else (tail, tensor_signature(residual, gate3), clip)

    def fast() -> torch.Tensor:
        from . import _residual_triton

        return _residual_triton.launch_lora(residual, update, gate3, t, b, scale, clip=clip)

    return LORA_GATE.run(sig, fast, lambda: residual_gate_add(residual, lora.lora_tail(update, t, b, scale), gate,
                                                              clip))


def _launch(residual: torch.Tensor, update: torch.Tensor, gate3: torch.Tensor, clip: float | None) -> torch.Tensor:
    global _triton_calls
    from . import _residual_triton

    out = _residual_triton.launch(residual, update, gate3, clip=clip)
    _triton_calls += 1
    return out


# The traceable path for torch.compile: an opaque custom op (Dynamo/Inductor call it, never trace the launcher).
@torch.library.custom_op("fluxserve::residual_gate_add", mutates_args=())
def _residual_gate_add_op(
    residual: torch.Tensor, update: torch.Tensor, gate3: torch.Tensor, clip: float | None
) -> torch.Tensor:
    return _launch(residual, update, gate3, clip)


@_residual_gate_add_op.register_fake
def _(residual: torch.Tensor, update: torch.Tensor, gate3: torch.Tensor, clip: float | None) -> torch.Tensor:
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def residual_gate_add(
    residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, clip: float | None = None,
    terms: Sequence[lora.Term] = (),
) -> torch.Tensor:
    """`residual + gate * update`, bit for bit; a Triton kernel on CUDA fp16/bf16, the eager expression otherwise.

    gate: [D], [1, 1, D] or [B, 1, D] (any batch stride, e.g. a `.chunk()` of the AdaLN output).
    clip: if set, also `.clip(-clip, clip)` of the result (diffusers' fp16 overflow guard), in the same pass.
    terms: adapter terms of the layer that made `update` (`kernels.lora.deferred`), added to it first as PEFT adds
    them: one inside this pass (its own gate), more through `lora.add_terms` first.
    Under torch.compile a kernel failure raises; outside it, the first failure logs one warning and the
    process uses eager from then on (see `reset_fast_path`).
    """
    if len(terms) == 1:
        return _with_term(residual, update, gate, clip, *terms[0])
    if terms:
        update = lora.add_terms(update, list(terms))
    if not SWITCH.value:
        return _eager(residual, update, gate, clip)
    gate3 = _fast_path_args(residual, update, gate)
    if gate3 is None:
        return _eager(residual, update, gate, clip)
    if _is_compiling():
        return _residual_gate_add_op(residual, update, gate3, clip)
    try:
        return _launch(residual, update, gate3, clip)
    except Exception as exc:  # noqa: BLE001 - any kernel/compiler failure must degrade to eager, once
        SWITCH.value = False
        logger.warning(
            "residual_gate_add: Triton fast path failed (%s: %s); using eager `residual + gate * update` "
            "for the rest of this process",
            type(exc).__name__,
            exc,
        )
        return _eager(residual, update, gate, clip)
