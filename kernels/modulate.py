"""AdaLN modulation, alone or together with the LayerNorm before it, in one pass.

`modulate`: `normed * (1 + scale[:, None]) + shift[:, None]`. Eager runs three ops (the small `1 + scale`, then a
full-size mul and add, each rounding to the input dtype); the kernel repeats those roundings in one read and one
write of the activation.

`layer_norm_modulate`: `modulate(F.layer_norm(x, (D,), eps=eps), scale, shift)`. Lossless: a kernel that replays
aten's CUDA LayerNorm reduction order (see `_lossless_triton`), so the normalised row has the same bits, then the
modulation's roundings, in one read of the row for the statistics and one pass for the output.
Quality "high" may switch a model's norm sites to the fast variant (`set_fast_norm`): plain two-pass statistics
and one rounding, not bit-exact. Both exact kernels are guarded by `ExactGate`. A norm site whose consumers are all
fp8 linears may emit its output quantized (`set_norm_fp8`; `layer_norm_modulate(..., fp8=True)`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from . import sites
from .exact import ExactGate, Signature, tensor_signature

if TYPE_CHECKING:
    from .fp8 import Fp8Rows

GATE = ExactGate("modulate")
LN_GATE = ExactGate("layer_norm_modulate")  # on: aten's LayerNorm statistics replayed bit for bit, ~1.6x faster
# than aten's LayerNorm followed by our modulate kernel at the FLUX shapes (bench/results/lossless-ops-h200.md)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_HALF = (torch.float16, torch.bfloat16)
# Per-module flag of the converted form: does this norm site hand its consumers fp8 rows (kernels.fp8)? A plain
# instance attribute, like the sites: copied by deepcopy, untouched by .to(), invisible to state_dict.
_FP8_NORM_ATTR = "_fluxserve_norm_fp8"


def _device_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def modulate_eager(normed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """diffusers' AdaLN modulation, operand for operand."""
    return normed * (1 + scale[:, None]) + shift[:, None]


def _signature(normed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> Signature | None:
    """The gate key, or None where no kernel applies (as `kernels.rope._signature`; None inside a trace too)."""
    if torch.compiler.is_compiling() or not _device_supported(normed.device) or normed.dim() != 3:
        return None
    if normed.dtype not in _FLOATS:
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


def layer_norm_modulate_eager(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> torch.Tensor:
    """diffusers' `norm(x) * (1 + scale[:, None]) + shift[:, None]` with a non-affine LayerNorm (modulation via the
    bit-exact `modulate`)."""
    return modulate(F.layer_norm(x, (x.shape[-1],), eps=eps), scale, shift)


def _ln_signature(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> Signature | None:
    sig = _signature(x, scale, shift)
    if sig is None:
        return None
    D = x.shape[2]
    # aten takes its vectorised (Welford, 128-thread) kernel only for D % 4 == 0 and rows aligned to 4 elements;
    # other inputs go to a different reduction, which we do not replay. F.layer_norm makes x contiguous first.
    align = 4 * x.element_size()
    if D % 4 != 0 or x.stride(1) != D or x.data_ptr() % align != 0:
        return None
    return (sig, float(eps))


def _fast_supported(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> bool:
    return x.dtype in _HALF and _signature(x, scale, shift) is not None and x.shape[2] <= 16384


def layer_norm_modulate(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, fast: bool = False, fp8: bool = False,
    spare: int = 0,
) -> torch.Tensor | Fp8Rows:
    """`modulate(F.layer_norm(x, (D,), eps=eps), scale, shift)` for x [B, S, D], scale/shift [B, D].

    fast=False (lossless): bit-exact, one pass when the gate has verified the kernel for this signature, else
    eager. fast=True (quality "high", CUDA fp16/bf16): the non-exact single-pass kernel; elsewhere the lossless path.
    fp8=True (an fp8 site, see `norm_fp8`): the result quantized per row as `Fp8Rows`, computed in one pass on CUDA,
    its rows `spare` columns longer (`Fp8Rows.spare`).
    """
    if fp8:  # the fast kernel's row, quantized instead of rounded: the same support rule
        from .fp8 import Fp8Rows, layer_norm_modulate_fp8_eager, with_spare

        if not _fast_supported(x, scale, shift):
            return layer_norm_modulate_fp8_eager(x, scale, shift, eps, spare)
        from . import _fp8_triton

        out = with_spare(x.shape[0] * x.shape[1], x.shape[2], spare, x.device)
        return Fp8Rows(*_fp8_triton.ln_modulate_quantize(x, scale, shift, eps, out=out), x.shape)
    if fast and _fast_supported(x, scale, shift):
        from . import _high_triton

        return _high_triton.ln_modulate_fast(x, scale, shift, eps)

    if not LN_GATE.enabled:  # switched off (benchmarks): skip building a signature on every call of the hot path
        return layer_norm_modulate_eager(x, scale, shift, eps)

    def exact() -> torch.Tensor:
        from . import _lossless_triton

        return _lossless_triton.ln_modulate_exact(x, scale, shift, eps)

    return LN_GATE.run(_ln_signature(x, scale, shift, eps), exact,
                       lambda: layer_norm_modulate_eager(x, scale, shift, eps))


# The site group of the feature table's `fast_norm` (kernels/sites.py).
GROUP = "fast_norm"


def mark_norm_site(module: nn.Module) -> None:
    """Declare `module` a norm site: it computes LayerNorm + modulate through `layer_norm_modulate(...,
    fast=fast_norm(module))` (or, an attention module, QK RMSNorm + RoPE through `kernels.rope.rms_rope_cat`)."""
    sites.mark(module, GROUP)


def fast_norm(module: nn.Module) -> bool:
    return sites.on(module, GROUP)


def set_fast_norm(model: nn.Module, on: bool) -> int:
    """Switch every marked norm site of `model` to the fast kernel (on) or back to lossless; returns the number of
    sites switched on. Sites whose inputs the fast kernel does not support still run lossless."""
    return sites.switch(model, {GROUP: on}).count(GROUP)


def fast_norm_sites(model: nn.Module) -> int:
    """How many norm sites of `model` are switched to the fast kernel."""
    return sites.count(model, GROUP)


def set_norm_fp8(module: nn.Module, on: bool) -> None:
    """Make the norm site `module` hand its consumers fp8 rows (on) or tensors. Only for a site whose every
    consumer takes `kernels.fp8.Fp8Rows` (the model decides that when it quantizes its linears). Part of the
    converted form, not a per-batch switch."""
    if not sites.marked(module, GROUP):
        raise ValueError(f"{type(module).__name__} is not a marked norm site")
    module.__dict__[_FP8_NORM_ATTR] = bool(on)


def norm_fp8(module: nn.Module) -> bool:
    """Does the norm site `module` emit fp8 rows now (its flag, and the `fp8_norm_producer` switch)?"""
    if not module.__dict__.get(_FP8_NORM_ATTR, False):
        return False
    from .fp8 import LN_PRODUCER

    return LN_PRODUCER.value
