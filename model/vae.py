"""The high tier's VAE decode (`fast_vae`): a channels-last copy of the VAE's decoder whose GroupNorms take the SiLU
after them into one pass (`kernels.groupnorm`), used by the batches that ask for it.

A diffusers hook on the VAE's `decoder`, not model code: inside `decoding(pipe, True)` the decoder's forward runs the
copy, everywhere else (lossless batches, the encoder of edits, previews by VAE) the stock decoder runs untouched, so
lossless stays byte-identical. The copy is made on first use (`install`) and holds the decoder's weights once more;
the VAE's weights never change while serving, so it never goes stale.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch import nn

from kernels.groupnorm import GroupNormAct

HOOK = "fluxserve_fast_vae"
_FAST: ContextVar[bool] = ContextVar("fast_vae", default=False)


def fast_decoder(decoder: nn.Module) -> nn.Module:
    """A channels-last copy of a diffusers VAE `Decoder` with each GroupNorm, and the SiLU right after it, as one
    `GroupNormAct`: the ResNet blocks' two norms (their `nonlinearity` runs only after those in a decoder: no time
    embedding, no resampling inside the block), the attention's norm, and the output norm with `conv_act`."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D

    fast = copy.deepcopy(decoder)
    for m in fast.modules():
        if isinstance(m, ResnetBlock2D) and m.time_emb_proj is None and m.upsample is None and m.downsample is None:
            silu = isinstance(m.nonlinearity, nn.SiLU)
            if isinstance(m.norm1, nn.GroupNorm) and isinstance(m.norm2, nn.GroupNorm):
                m.norm1, m.norm2 = GroupNormAct(m.norm1, silu), GroupNormAct(m.norm2, silu)
                if silu:
                    m.nonlinearity = nn.Identity()
        elif isinstance(m, Attention) and isinstance(m.group_norm, nn.GroupNorm):
            m.group_norm = GroupNormAct(m.group_norm, False)
    if isinstance(getattr(fast, "conv_norm_out", None), nn.GroupNorm):
        silu = isinstance(fast.conv_act, nn.SiLU)
        fast.conv_norm_out = GroupNormAct(fast.conv_norm_out, silu)
        if silu:
            fast.conv_act = nn.Identity()
    return fast.to(memory_format=torch.channels_last).eval().requires_grad_(False)


class FastDecodeHook(ModelHook):
    """Runs the decoder's fast copy inside `decoding(pipe, True)`, the decoder itself otherwise."""

    def __init__(self, fast: nn.Module) -> None:
        super().__init__()
        self.fast = fast

    def new_forward(self, module: nn.Module, sample: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not _FAST.get():
            return self.fn_ref.original_forward(sample, *args, **kwargs)
        return self.fast(sample.contiguous(memory_format=torch.channels_last), *args, **kwargs)


def install(vae: nn.Module) -> FastDecodeHook:
    """Hook `vae.decoder` (once: its copy is made here, from the decoder before it carries the hook)."""
    registry = getattr(vae.decoder, "_diffusers_hook", None)
    hook = registry.get_hook(HOOK) if registry is not None else None
    if hook is None:
        hook = FastDecodeHook(fast_decoder(vae.decoder))
        HookRegistry.check_if_exists_or_initialize(vae.decoder).register_hook(hook, HOOK)
    return hook


@contextmanager
def decoding(pipe: Any, fast: bool) -> Iterator[None]:
    """Inside, `pipe`'s VAE decodes through its fast copy where `fast` (a batch whose plan has `fast_vae` on)."""
    if fast:
        install(pipe.vae)
    token = _FAST.set(fast)
    try:
        yield
    finally:
        _FAST.reset(token)
