"""PEFT's LoRA layers with each adapter's term added in one fused pass (`kernels.lora.lora_tail`) instead of PEFT's
three, or handed to the consumer of the layer's output to add in its own pass (`kernels.lora.deferred`): a diffusers
hook on every PEFT LoRA linear of a served transformer, not model code.

The hook computes what PEFT's `lora.Linear.forward` computes, in its order and with its roundings, wherever the
layer is in the state PEFT's plain loop covers: adapters on and not merged, no per-row adapter names, vanilla LoRA
(no DoRA or other variant, no LoRA bias), dropout inert, A in the input's dtype, B a plain bias-free linear (this
rank's share, at TP > 1). Anything else runs PEFT's own forward. So adapters through PEFT (the lossless tier's)
stay byte-identical to stock diffusers with PEFT, and the fused pass runs only where its gate saw it match.

Layers that read one tensor (the model's `shared_input_groups`: a block's q, k, v and MLP-in) take each adapter's
`lora_A(x)` from one GEMM against their A's stacked (`SharedInput`), which reads x once instead of once per layer,
where its gate saw the stacked product's columns equal each layer's own GEMM.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook
from torch import nn

from kernels.exact import ExactGate, cannot_verify_now, tensor_signature
from kernels.lora import accept_deferrals, add_terms, defer
from model.linear import plain_weight

HOOK = "fluxserve_lora_tail"
# cuBLAS picks its kernel (split-K included) by shape, so whether x [A_1; ...; A_p]^T holds each x A_i^T bit for bit
# is a per-shape fact: compared once per signature.
SHARED_A_GATE = ExactGate("lora_shared_a", "one GEMM against the stacked LoRA A's of layers that read one input "
                          "(bit-exact gate)")


def _is_lora_linear(module: nn.Module) -> bool:
    from peft.tuners.lora import Linear as LoraLinear

    return isinstance(module, LoraLinear)


def _inert(dropout: nn.Module) -> bool:
    """PEFT's dropout passes its input through: an identity (dropout 0) or a dropout in eval mode."""
    return isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and not dropout.training)


def plain_adapters(layer: nn.Module, x: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """(name, B's weight) of each adapter PEFT's forward would add on `layer` for input `x`, in its order, if all are
    plain LoRA terms the fused pass can add; None where PEFT's forward must run (see the module's docstring)."""
    if layer.disable_adapters or layer.merged:
        return None
    found = []
    for n in layer.active_adapters:
        if n not in layer.lora_A:
            continue
        b = plain_weight(layer.lora_B[n])
        if n in layer.lora_variant or not _inert(layer.lora_dropout[n]) or b is None:
            return None
        if layer.lora_A[n].weight.dtype != x.dtype:  # PEFT would cast the input first
            return None
        found.append((n, b))
    return found


def _pieces(y: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """y's column blocks of these widths, each contiguous (the passes that add the terms take contiguous rows): one
    copy for equal widths."""
    lead = y.shape[:-1]
    if len(set(widths)) == 1:
        parts = y.reshape(-1, len(widths), widths[0]).transpose(0, 1).contiguous()
        return [p.view(*lead, widths[0]) for p in parts]
    return [p.contiguous() for p in y.split(widths, dim=-1)]


class SharedInput:
    """LoRA layers that read one tensor: each adapter's `lora_A(x)` for all of them from one GEMM against their A's
    stacked (kept per adapter until the next `install`), the first member's call computing the others' too. Where
    the gate found the columns differ from a layer's own GEMM, or has not compared yet and cannot now (a capture),
    each layer multiplies its own."""

    def __init__(self, members: tuple[nn.Module, ...]) -> None:
        self.members = members
        # adapter name -> (the A weights it was stacked from, as identity/data/version, the stacked tensor)
        self._stacked: dict[str, tuple[tuple, torch.Tensor]] = {}
        self._retired: list[torch.Tensor] = []  # replaced stacks a captured graph may still read
        # the input the products below belong to, by identity (weakly: a product a member never takes must not keep
        # a block's activations alive)
        self._x: weakref.ref | None = None
        self._ready: dict[tuple[int, str], torch.Tensor] = {}

    def _stack(self, name: str, weights: list[torch.Tensor]) -> torch.Tensor:
        key = tuple((id(w), w.data_ptr(), w._version) for w in weights)
        held = self._stacked.get(name)
        if held is not None and held[0] == key:
            return held[1]
        if held is not None:
            self._retired.append(held[1])
        stacked = torch.cat([w.detach() for w in weights])
        self._stacked[name] = (key, stacked)
        return stacked

    def product(self, layer: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """`layer.lora_A[name](x)` from the group's one GEMM; None where the layer must multiply its own."""
        if self._x is not None and self._x() is x:
            t = self._ready.pop((id(layer), name), None)
            if t is not None:
                if not self._ready:
                    self._x = None
                return t
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or not SHARED_A_GATE.enabled:
            return None  # (the stacked copy carries no gradient; a trace takes each layer's own GEMM)
        members = [m for m in self.members if name in m.lora_A and name in m.active_adapters
                   and not (m.disable_adapters or m.merged)]
        weights = [m.lora_A[name].weight for m in members]
        if len(members) < 2 or any(w.dtype != x.dtype or w.device != x.device or w.shape[1] != x.shape[-1]
                                   for w in weights):
            return None
        stacked = self._stack(name, weights)
        widths = [w.shape[0] for w in weights]
        sig = (*tensor_signature(x, stacked), tuple(widths))
        verdict = SHARED_A_GATE.verdict(sig)
        if verdict is False or (verdict is None and cannot_verify_now()):
            return None
        y = SHARED_A_GATE.run(sig, lambda: F.linear(x, stacked),
                              lambda: torch.cat([F.linear(x, w) for w in weights], dim=-1))
        if self._x is None or self._x() is not x:
            self._x, self._ready = weakref.ref(x), {}
        self._ready.update({(id(m), name): t for m, t in zip(members, _pieces(y, widths))})
        return self.product(layer, name, x)


class LoraTailHook(ModelHook):
    """Replaces a PEFT LoRA linear's forward by base + one `lora_tail` per active adapter (PEFT's order)."""

    def __init__(self) -> None:
        super().__init__()
        self.group: SharedInput | None = None  # the layers reading this one's input (install)

    def _lora_a(self, module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
        t = self.group.product(module, name, x) if self.group is not None else None
        return module.lora_A[name](x) if t is None else t

    def new_forward(self, module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapters = None if args or kwargs else plain_adapters(module, x)
        if adapters is None:
            return self.fn_ref.original_forward(x, *args, **kwargs)
        result = module.base_layer(x)
        terms = [(self._lora_a(module, n, x), b, module.scaling[n]) for n, b in adapters]
        if defer(module, terms):  # the consumer adds them in its own pass (kernels.lora.deferred)
            return result
        # (PEFT ends with a cast back to the base output's dtype: x, A, B and the base share one dtype here)
        return add_terms(result, terms)


def _hook(module: nn.Module) -> LoraTailHook:
    registry = HookRegistry.check_if_exists_or_initialize(module)
    hook = registry.get_hook(HOOK)
    if hook is None:
        hook = LoraTailHook()
        registry.register_hook(hook, HOOK)
    return hook


def install(model: nn.Module) -> int:
    """Hook every PEFT LoRA linear of `model` not hooked yet (after adapters are loaded into it or unloaded), and
    group the hooked layers that read one input (modules' `shared_input_groups`) afresh; returns how many layers
    carry the hook."""
    hooked = 0
    for module in model.modules():
        if _is_lora_linear(module):
            _hook(module).group = None
            hooked += 1
    if hooked:
        accept_deferrals()
    for module in model.modules():
        for group in getattr(module, "shared_input_groups", lambda: ())():
            members = tuple(m for m in group if _is_lora_linear(m))
            if len(members) > 1:
                shared = SharedInput(members)
                for m in members:
                    _hook(m).group = shared
    return hooked
