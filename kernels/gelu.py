"""Linear + tanh-GELU fusion (quality "high": not bit-exact) and the mountable site protocol.

A site is `F.gelu(getattr(module, attr)(x), approximate="tanh")`. Models mark their sites once; `mount` switches
all of them to the fused call (or none, if any refuses), `unmount` switches back. The state lives on the
modules themselves, so it follows the model through deepcopy and `.to()`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import lora, sites
from .exact import ExactGate, Signature, tensor_signature

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)
# Per-module dict {attr: mounted?}; a plain instance attribute (not a buffer/parameter) so it is copied by
# deepcopy, untouched by .to(), and invisible to state_dict.
def _device_supported(device: torch.device) -> bool:
    # The fused call is CUDA-only: on CPU `torch._addmm_activation(use_gelu=True)` is the erf GELU, not tanh.
    return device.type == "cuda"


def _unfused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def _cublaslt_epilogue(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # cuBLASLt GELU-bias epilogue (tanh GELU on CUDA).
    return torch._addmm_activation(bias, x2d, weight.t(), use_gelu=True)


def _triton_mm(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    from . import _gemm_gelu_triton

    return _gemm_gelu_triton.mm_gelu(x2d, weight, bias)


def _triton_tma(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    from . import _gemm_gelu_triton

    return _gemm_gelu_triton.mm_gelu_tma(x2d, weight, bias)


# Implementations a shape can be dispatched to, all `(x2d [M,K], weight [N,K], bias [N]) -> [M,N]`.
GELU_IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "unfused": _unfused,
    "cublaslt": _cublaslt_epilogue,
    "triton_mm": _triton_mm,
    "triton_tma": _triton_tma,
}
# Candidates the "auto" dispatch times by default. The Triton GEMMs never beat the cuBLASLt epilogue on the FLUX
# FF shapes on an H200 (bench/results/kernels-h200.md) and their first sight costs seconds of compilation and
# autotuning, so they are opt-in: FLUXSERVE_GELU_CANDIDATES="unfused,cublaslt,triton_tma".
_DEFAULT_CANDIDATES = ("unfused", "cublaslt")
# What torch.compile can trace (aten ops); the Triton launchers with host TMA descriptors are kept out of graphs.
_TRACEABLE = ("unfused", "cublaslt")
# A fused implementation must beat the unfused pair by this factor, so timing noise never swaps numerics for nothing.
_MIN_GAIN = 0.99
# Relative difference to the unfused pair above which a candidate is rejected as wrong (bf16 rounding is ~4e-3).
_MAX_REL_DIFF = 2e-2

# Cached per-shape decision: (M, N, K, dtype, device index) -> impl name; and the timings behind it.
_gelu_choice: dict[tuple, str] = {}
_gelu_timings: dict[tuple, dict] = {}


def clear_gelu_dispatch_cache() -> None:
    _gelu_choice.clear()
    _gelu_timings.clear()


def gelu_dispatch_timings() -> dict[tuple, dict]:
    """Per decided shape: impl -> median ms, or why it was not a candidate."""
    return {k: dict(v) for k, v in _gelu_timings.items()}


def gelu_dispatch_table() -> dict[tuple, str]:
    """A copy of the per-shape decisions taken so far."""
    return dict(_gelu_choice)


def _time_impl(fn: Callable[[], torch.Tensor], reps: int = 7, batch: int = 4) -> float:
    """Median ms per call over `reps` batches of `batch` back-to-back calls: in a batch the host overhead of a
    launch overlaps the previous call's GPU work, as it does in a GPU-bound model forward."""
    for _ in range(3):  # also triggers Triton compilation/autotuning outside the timed region
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    times.sort()
    return times[len(times) // 2]


def _candidates() -> list[str]:
    raw = os.environ.get("FLUXSERVE_GELU_CANDIDATES")
    names = [n.strip() for n in raw.split(",") if n.strip()] if raw else list(_DEFAULT_CANDIDATES)
    unknown = [n for n in names if n not in GELU_IMPLS]
    if unknown:
        raise ValueError(f"FLUXSERVE_GELU_CANDIDATES: unknown {unknown}; known: {sorted(GELU_IMPLS)}")
    return names if "unfused" in names else ["unfused", *names]  # the baseline is always timed


def _decide_by_timing(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[str, dict]:
    ref = _unfused(x2d, weight, bias).float()
    timings: dict[str, float | str] = {}
    for name in _candidates():
        fn = GELU_IMPLS[name]
        try:
            diff = ((fn(x2d, weight, bias).float() - ref).norm() / ref.norm()).item()
            if not diff < _MAX_REL_DIFF:  # also rejects NaN
                timings[name] = f"rejected: rel diff {diff:.2e}"
                continue
            timings[name] = _time_impl(lambda f=fn: f(x2d, weight, bias))
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is just not chosen
            timings[name] = f"failed: {type(exc).__name__}: {exc}"
    ok = {n: t for n, t in timings.items() if isinstance(t, float)}
    best = min(ok, key=ok.__getitem__)
    if best != "unfused" and ok[best] > _MIN_GAIN * ok["unfused"]:
        best = "unfused"
    return best, timings


def _choose_impl(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> str:
    """Pick the implementation for this (M, N, K, dtype): FLUXSERVE_GELU_IMPL forces one; "auto" (default)
    checks and times every candidate once on the real operands and keeps the fastest, so a mounted site never
    runs slower than the unfused pair it replaces (where nothing wins, it runs unfused)."""
    M, K = x2d.shape
    key = (M, weight.shape[0], K, x2d.dtype, x2d.device.index)
    name = _gelu_choice.get(key)
    if torch.compiler.is_compiling():
        # Never time inside a trace (CUDA events and .item() syncs cannot be traced; a choice taken there would
        # be baked into the graph from fake tensors). Use what an eager call decided for this shape (the
        # pipeline's compile warm-up runs one eager high batch per shape first), else a fixed traceable epilogue;
        # nothing is cached here, so a later eager call still decides by timing.
        return name if name in _TRACEABLE else "cublaslt"
    if name is not None:
        return name
    forced = os.environ.get("FLUXSERVE_GELU_IMPL", "auto")
    if forced != "auto":
        if forced not in GELU_IMPLS:
            raise ValueError(f"FLUXSERVE_GELU_IMPL={forced!r}: expected 'auto' or one of {sorted(GELU_IMPLS)}")
        name = forced
    elif torch.cuda.is_current_stream_capturing():
        # CUDA events and syncs are illegal inside a graph capture: never time here (model.graphs warms up
        # eagerly first, so its captures find a decision). The unfused pair is exact and always valid; not
        # cached, so a later eager call still decides by timing.
        logger.warning("fused GELU dispatch %s: no decision yet inside a CUDA graph capture; unfused", key)
        return "unfused"
    else:
        name, timings = _decide_by_timing(x2d, weight, bias)
        _gelu_timings[key] = timings
        shown = {n: f"{t * 1e3:.1f}us" if isinstance(t, float) else t for n, t in timings.items()}
        logger.info("fused GELU dispatch %s -> %s (%s)", key, name, shown)
    _gelu_choice[key] = name
    return name


def fused_linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(x @ weight.T + bias) through a fused GEMM epilogue where that is faster (per-shape choice).

    Not bit-exact with the unfused pair. On non-CUDA devices it is the unfused pair (the CPU epilogue is erf).
    """
    if not x.is_cuda:  # deliberately not `_device_supported` (tests patch that): never the CPU epilogue
        return _unfused(x, weight, bias)
    K = x.shape[-1]
    x2d = x.reshape(-1, K)
    out = GELU_IMPLS[_choose_impl(x2d, weight, bias)](x2d, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _layer_type_ok(layer: nn.Module) -> bool:
    # Exact type: subclasses of nn.Linear (quantized/foreign wrappers) may not compute `x @ W.T + b`; another layer
    # says whether its local computation is `F.linear(x, weight, bias)` (model.linear.Linear: plain, not gathering).
    return type(layer) is nn.Linear or getattr(layer, "fused_gelu_compatible", False) is True


def can_fuse_linear_gelu(layer: nn.Module, x: torch.Tensor | None = None) -> tuple[bool, str]:
    """(ok, reason): whether `gelu_tanh(layer(x))` may run as `fused_linear_gelu_tanh(x, layer.weight, layer.bias)`.

    Static checks on the layer always; dynamic checks on `x` when given.
    """
    if not _layer_type_ok(layer):
        if hasattr(layer, "fused_gelu_compatible"):
            return False, f"{type(layer).__qualname__} does not compute F.linear(x, weight, bias) locally ({layer})"
        return False, f"unsupported layer type {type(layer).__module__}.{type(layer).__qualname__}"
    weight = getattr(layer, "weight", None)
    bias = getattr(layer, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return False, "layer has no 2-D weight"
    if bias is None:
        return False, "layer has no bias"
    if weight.dtype not in _HALF:
        return False, f"weight dtype {weight.dtype} is not fp16/bf16"
    if not _device_supported(weight.device):
        return False, f"weight on {weight.device.type} (the fused GELU epilogue is CUDA-only)"
    if x is not None:
        if not _device_supported(x.device) or x.device != weight.device:
            return False, f"input on {x.device} (weight on {weight.device})"
        if x.dtype not in _HALF:
            return False, f"input dtype {x.dtype} is not fp16/bf16"
        if x.dtype != weight.dtype:
            return False, f"input dtype {x.dtype} != weight dtype {weight.dtype}"
    return True, "ok"


# The site group of the feature table's `gelu_sites` (kernels/sites.py): kind "gelu_sites:<attr>".
GROUP = "gelu_sites"


def mark_fused_gelu_site(module: nn.Module, attr: str) -> None:
    """Declare that `F.gelu(getattr(module, attr)(x), approximate="tanh")` is a fusable site (unmounted)."""
    sites.mark(module, f"{GROUP}:{attr}")


def unmark_fused_gelu_site(module: nn.Module, attr: str) -> None:
    """The site is gone (e.g. its layer was merged into a wider one): mount no longer looks for it."""
    sites.unmark(module, f"{GROUP}:{attr}")


def gelu_site(module: nn.Module, attr: str, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """What a site's forward calls. Unmounted: exactly `F.gelu(layer(x), approximate="tanh")`.
    Mounted and the dynamic guard passes: the fused call; otherwise unfused.

    out: write the result there (e.g. a column slice of a buffer the caller would otherwise `cat` into) and return
    it: the GELU writes into `out` (`gelu_tanh_into`), the same values as the allocating call. A mounted site takes
    this path too: the fused epilogue writes contiguous rows, and copying them into the slice costs as much as the
    GELU pass it saves (bench/results/lossless-ops-h200.md), so the exact path is the faster one there. An adapter
    layer (model/peft_tail.py) hands its terms to the GELU's pass either way."""
    layer = getattr(module, attr)
    if out is None and sites.on(module, f"{GROUP}:{attr}"):
        ok, _ = can_fuse_linear_gelu(layer, x)
        if ok:
            return fused_linear_gelu_tanh(x, layer.weight, layer.bias)
    with lora.deferred(layer) as terms:  # an adapter layer leaves its terms to this pass
        h = layer(x)
    if out is None:
        if not terms:
            return F.gelu(h, approximate="tanh")
        out = torch.empty_like(h)  # the terms go inside the GELU's pass instead of a pass of their own before it
    return gelu_tanh_into(h, out, terms)


GELU_INTO_GATE = ExactGate("gelu_tanh_into")


def _into_device_supported(device: torch.device) -> bool:
    # Its own check: tests that pretend the fused GELU runs on the CPU must not send this exact kernel there.
    return device.type == "cuda"


def _gelu_into_signature(h: torch.Tensor, out: torch.Tensor) -> Signature | None:
    if not _into_device_supported(h.device) or h.dtype not in (torch.float16, torch.bfloat16, torch.float32) or h.dim() < 2:
        return None
    if torch.is_grad_enabled() and h.requires_grad:
        return None
    if out.shape != h.shape or out.dtype != h.dtype or out.device != h.device or not h.is_contiguous():
        return None
    # out's rows must be evenly strided with unit columns (a column slice of a contiguous buffer is)
    rows = out.shape[:-1]
    if out.stride(-1) != 1 or any(out.stride(i) != out.stride(i + 1) * rows[i + 1] for i in range(len(rows) - 1)):
        return None
    return tensor_signature(h, out)


GELU_LORA_GATE = ExactGate("gelu_tanh_lora", "an adapter's term added inside the tanh-GELU pass into a slice "
                           "(bit-exact gate)")


def gelu_tanh_into(h: torch.Tensor, out: torch.Tensor, terms: Sequence[lora.Term] = ()) -> torch.Tensor:
    """`F.gelu(h, approximate="tanh")` written into `out` (e.g. a column slice), bit for bit; returns out. terms:
    adapter terms (`kernels.lora.deferred`) to add to h first, as PEFT adds them (`lora.add_terms`).

    On CUDA a Triton kernel that writes the strided rows at full bandwidth (aten's elementwise loop does not
    vectorise a non-contiguous output), behind a bit-exact gate; elsewhere aten with out=. One adapter's term is
    added inside that pass (its own gate); more go through `lora.add_terms` first."""
    if len(terms) == 1:
        return _gelu_tanh_lora_into(h, out, *terms[0])
    if terms:
        h = lora.add_terms(h, list(terms))
    sig = _gelu_into_signature(h, out)

    def fast() -> torch.Tensor:
        from . import _lossless_triton

        # while the gate compares, the kernel writes a scratch tensor: eager has already filled `out`
        dst = out if GELU_INTO_GATE.verified(sig) else torch.empty_like(h)
        _lossless_triton.gelu_tanh(_rows(h), _rows(dst))
        return dst

    return GELU_INTO_GATE.run(sig, fast, lambda: torch._C._nn.gelu(h, approximate="tanh", out=out))


def _gelu_tanh_lora_into(h: torch.Tensor, out: torch.Tensor, t: torch.Tensor, b: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """gelu_tanh_into(h + F.linear(t, b) * scale, out) in one pass where the gate admits it."""
    def apart() -> torch.Tensor:  # the term's pass, then the GELU's (each behind its own gate)
        return gelu_tanh_into(lora.lora_tail(h, t, b, scale), out)

    into = _gelu_into_signature(h, out) if GELU_LORA_GATE.enabled else None
    term = lora.signature(h, t, b) if into is not None and out.stride(-2) <= lora.MAX_ROW else None
    if term is None:
        return apart()
    sig = (into, term)

    def fast() -> torch.Tensor:
        from . import _lossless_triton

        dst = out if GELU_LORA_GATE.verified(sig) else torch.empty_like(h)  # (see gelu_tanh_into)
        _lossless_triton.gelu_tanh_lora(_rows(h), t.reshape(-1, t.shape[-1]), b, scale, _rows(dst))
        return dst

    return GELU_LORA_GATE.run(sig, fast, apart)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] with evenly strided rows (see _gelu_into_signature) -> a [M, N] view of the same memory."""
    return t.as_strided((t.numel() // t.shape[-1], t.shape[-1]), (t.stride(-2), 1))


@dataclass
class MountReport:
    mounted: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # qualified site name -> reason

    @property
    def ok(self) -> bool:
        return not self.refused


def site_check(module: nn.Module, kind: str) -> tuple[bool, str]:
    """(ok, reason): may the GELU site `kind` of `module` mount (the static guard on its layer)?"""
    attr = kind.partition(":")[2]
    layer = getattr(module, attr, None)
    if not isinstance(layer, nn.Module):
        return False, f"attribute {attr!r} is not a module"
    return can_fuse_linear_gelu(layer)


def mount(model: nn.Module) -> MountReport:
    """Mount every marked site in `model`, or none if any refuses (the report says which and why)."""
    done = sites.switch(model, {GROUP: True}, {GROUP: site_check})
    report = MountReport(mounted=done.on.get(GROUP, []), refused=done.refused.get(GROUP, {}))
    if report.refused:
        logger.info("GELU mount refused (nothing mounted): %s", report.refused)
    return report


def unmount(model: nn.Module) -> None:
    sites.switch(model, {GROUP: False})


def site_names(model: nn.Module) -> list[str]:
    """Every GELU site of `model`, mounted or not."""
    return [name for name, _, kind in sites.iter_sites(model) if sites.group_of(kind) == GROUP]


def mounted_sites(model: nn.Module) -> list[str]:
    return [name for name, module, kind in sites.iter_sites(model)
            if sites.group_of(kind) == GROUP and sites.on(module, kind)]
