"""`lora_tail`: a LoRA adapter's term added to its layer's output in PEFT's order, `y + F.linear(t, B) * scale`
(t = the adapter's A applied to the input), in one pass instead of PEFT's three (a GEMM, a product, a sum): the
lossless tier's adapters. Bit-exact with eager where `GATE` has seen it match, eager everywhere else."""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.nn.functional as F

from .exact import ExactGate, Signature, tensor_signature

Term = tuple[torch.Tensor, torch.Tensor, float]  # (t = A applied to the input, B [N, r], scale) of one adapter

_HALF = (torch.float16, torch.bfloat16)
GATE = ExactGate("lora_tail", "LoRA term y + F.linear(t, B) * s in one Triton pass (bit-exact gate)")
# Ranks the kernel takes: tensor-core dot products over K in steps of 16, the whole rank in registers.
RANKS = (16, 32, 64, 128)
# The LoRA passes address a tile by 32-bit offsets from its first row: rows (and an output's row stride) of at most
# this many elements (tiles have at most 256 rows).
MAX_ROW = 2**31 // 256


def lora_tail_eager(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """PEFT's expression (`result + lora_B(t) * scaling`, lora_B a bias-free linear with weight b)."""
    return y + F.linear(t, b) * scale


def _device_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def signature(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor) -> Signature | None:
    """The gate's key for adding F.linear(t, b) to y in a kernel, or None where no kernel takes it (eager): fp16 /
    bf16 on CUDA, a rank in `RANKS`, fitting contiguous operands, no autograd."""
    if y.dtype not in _HALF or t.dtype != y.dtype or b.dtype != y.dtype:
        return None
    if not (_device_supported(y.device) and t.device == y.device == b.device):
        return None
    r = t.shape[-1]
    if r not in RANKS or b.shape != (y.shape[-1], r) or t.shape[:-1] != y.shape[:-1] or y.numel() == 0:
        return None
    if y.shape[-1] > MAX_ROW:
        return None
    if not (y.is_contiguous() and t.is_contiguous() and b.is_contiguous()):
        return None
    if torch.is_grad_enabled() and (y.requires_grad or t.requires_grad or b.requires_grad):
        return None  # no autograd formula
    return tensor_signature(y, t, b)


def lora_tail(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """`y + F.linear(t, b) * scale`, bit for bit: y [..., N], t [..., r], b [N, r]; one Triton pass on CUDA fp16/bf16
    (ranks in `RANKS`) once the gate saw it equal eager for these shapes, the eager expression otherwise."""
    sig = signature(y, t, b) if GATE.enabled else None

    def fast() -> torch.Tensor:
        from . import _lossless_triton

        n, r = y.shape[-1], t.shape[-1]
        return _lossless_triton.lora_tail(y.view(-1, n), t.view(-1, r), b, scale).view(y.shape)

    return GATE.run(sig, fast, lambda: lora_tail_eager(y, t, b, scale))


def lora_tail2(y: torch.Tensor, first: Term, second: Term) -> torch.Tensor:
    """`lora_tail(lora_tail(y, *first), *second)` (two adapters, PEFT's order and roundings) in one pass where the
    gate has seen it match for these shapes; the two eager expressions otherwise."""
    (t, b, scale), (t2, b2, scale2) = first, second
    one, two = (signature(y, t, b), signature(y, t2, b2)) if GATE.enabled else (None, None)
    sig = None if one is None or two is None else ("two terms", one, two)

    def fast() -> torch.Tensor:
        from . import _lossless_triton

        n = y.shape[-1]
        return _lossless_triton.lora_tail2(y.view(-1, n), t.view(-1, t.shape[-1]), b, scale,
                                           t2.view(-1, t2.shape[-1]), b2, scale2).view(y.shape)

    return GATE.run(sig, fast, lambda: lora_tail_eager(lora_tail_eager(y, t, b, scale), t2, b2, scale2))


def add_terms(y: torch.Tensor, terms: list[Term]) -> torch.Tensor:
    """y with each term added in order, as PEFT adds its active adapters: two at a time in one pass (`lora_tail2`),
    an odd last one alone (`lora_tail`)."""
    for i in range(0, len(terms) - 1, 2):
        y = lora_tail2(y, terms[i], terms[i + 1])
    if len(terms) % 2:
        y = lora_tail(y, *terms[-1])
    return y


# Adapter terms a consumer adds itself, inside its own pass over the layer's output (kernels.gelu.gelu_tanh_into,
# kernels.residual.residual_gate_add): within `deferred(layer)`, that adapter layer (model/peft_tail.py's hook)
# returns its base output and leaves its terms in the list `deferred` yields instead of adding them. Keyed by the
# layer, so a consumer's block may call other adapter layers (an attention's q, k, v before its output projection)
# and nest (the GELU's inside the feed-forward's).
_DEFERRED: ContextVar[dict[int, list]] = ContextVar("lora_deferred", default={})


# Whether any layer may defer (set by `accept_deferrals`, when model/peft_tail.py hooks adapter layers): until then
# the blocks' `deferred` calls skip the bookkeeping (host time in every eager step).
_ACCEPTING = False


def accept_deferrals() -> None:
    """Adapter layers that `defer` exist from now on in this process."""
    global _ACCEPTING
    _ACCEPTING = True


def deferred(layer: object) -> AbstractContextManager[list[Term]]:
    """Collect the terms of `layer`'s first call inside (its base output is what that call returns). Under
    torch.compile (which serves no PEFT adapters: the feature table), or before any adapter layer is hooked, a no-op
    (a trace takes it whole)."""
    if not _ACCEPTING or torch.compiler.is_compiling():
        return nullcontext([])
    return _deferred(layer)


@contextmanager
def _deferred(layer: object) -> Iterator[list[Term]]:
    terms: list[Term] = []
    token = _DEFERRED.set({**_DEFERRED.get(), id(layer): [terms, False]})
    try:
        yield terms
    finally:
        _DEFERRED.reset(token)


def defer(layer: object, terms: list[Term]) -> bool:
    """Hand `layer`'s `terms` to the consumer that asked for them (`deferred`), if one did and this is the layer's
    first call there; False: add them yourself (a second call of the layer in the same block adds its own)."""
    pending = _DEFERRED.get().get(id(layer))
    if pending is None or pending[1]:
        return False
    pending[0].extend(terms)
    pending[1] = True
    return True
