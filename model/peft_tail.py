"""PEFT's LoRA layers with each adapter's term added in one fused pass (`kernels.lora.lora_tail`) instead of PEFT's
three, or handed to the consumer of the layer's output to add in its own pass (`kernels.lora.deferred`): a diffusers
hook on every PEFT LoRA linear of a served transformer, not model code.

The hook computes what PEFT's `lora.Linear.forward` computes, in its order and with its roundings, wherever the
layer is in the state PEFT's plain loop covers: adapters on and not merged, no per-row adapter names, vanilla LoRA
(no DoRA or other variant, no LoRA bias), dropout inert, A in the input's dtype, B a plain bias-free linear (this
rank's share, at TP > 1). Anything else runs PEFT's own forward. So adapters through PEFT (the lossless tier's)
stay byte-identical to stock diffusers with PEFT, and the fused pass runs only where its gate saw it match.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch import nn

from kernels.lora import add_terms, defer
from model.linear import plain_weight

HOOK = "fluxserve_lora_tail"


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


class LoraTailHook(ModelHook):
    """Replaces a PEFT LoRA linear's forward by base + one `lora_tail` per active adapter (PEFT's order)."""

    def new_forward(self, module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapters = None if args or kwargs else plain_adapters(module, x)
        if adapters is None:
            return self.fn_ref.original_forward(x, *args, **kwargs)
        result = module.base_layer(x)
        terms = [(module.lora_A[n](x), b, module.scaling[n]) for n, b in adapters]
        if defer(module, terms):  # the consumer adds them in its own pass (kernels.lora.deferred)
            return result
        # (PEFT ends with a cast back to the base output's dtype: x, A, B and the base share one dtype here)
        return add_terms(result, terms)


def install(model: nn.Module) -> int:
    """Hook every PEFT LoRA linear of `model` not hooked yet (after adapters are loaded into it); returns how many
    layers carry the hook."""
    hooked = 0
    for module in model.modules():
        if _is_lora_linear(module):
            registry = HookRegistry.check_if_exists_or_initialize(module)
            if registry.get_hook(HOOK) is None:
                registry.register_hook(LoraTailHook(), HOOK)
            hooked += 1
    return hooked
