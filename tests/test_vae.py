"""The high tier's VAE decode (`fast_vae`): the GroupNorm (+ SiLU) pass against eager GroupNorm in Triton's CPU
interpreter, the channels-last decoder copy against the stock decoder, and the routing: only a batch whose plan has
`fast_vae` on decodes through the copy, so lossless stays byte-identical."""

from __future__ import annotations

import pytest
import torch

from kernels import groupnorm
from tests._interpret import run_in_interpreter

_GN_PROBE = r"""
import torch, torch.nn.functional as F
from kernels import groupnorm
from kernels import _high_triton as H
torch.manual_seed(0)
H._GN_CHUNKS = 3  # several chunks per image, ragged: the merge of partial statistics is exercised
n = 0
for dtype, tol in ((torch.float32, 2e-5), (torch.float16, 2e-3)):
    for (b, c, h, w, g) in ((2, 32, 7, 9, 8), (1, 64, 5, 13, 32), (2, 16, 3, 3, 4)):
        # a mean far from zero: E[x^2] - E[x]^2 would lose the variance in fp32 (the reference is float64)
        x = (torch.randn(b, c, h, w) * 0.5 + 40.0).to(dtype).contiguous(memory_format=torch.channels_last)
        wt, bs = torch.randn(c).to(dtype), torch.randn(c).to(dtype)
        for silu in (False, True):
            ref = groupnorm.group_norm_eager(x.double(), g, wt.double(), bs.double(), 1e-6, silu)
            got = groupnorm.fused(x, g, wt, bs, 1e-6, silu)
            assert got.shape == x.shape and got.dtype == dtype, (got.shape, got.dtype)
            assert got.is_contiguous(memory_format=torch.channels_last)
            err = (got.double() - ref).abs().max().item()
            assert err <= tol * max(1.0, ref.abs().max().item()), (dtype, b, c, h, w, g, silu, err)
            n += 1
        # diffusers' attention norm: a [B, C, L] view of [B, L, C] rows
        rows = torch.randn(b, h * w, c).to(dtype)
        x3 = rows.transpose(1, 2)
        got = groupnorm.fused(x3, g, wt, bs, 1e-6, False)
        ref = groupnorm.group_norm_eager(x3.double(), g, wt.double(), bs.double(), 1e-6)
        assert got.stride() == x3.stride() and (got.double() - ref).abs().max().item() <= tol * 8, dtype
        n += 1
print("group norm ok", n)
"""


def test_group_norm_pass_in_the_interpreter_matches_eager() -> None:
    """The three Triton kernels (statistics per chunk, their merge, the normalizing pass with or without SiLU) on
    channels-last 4-D inputs and on the attention's transposed 3-D view, fp32 and fp16, several ragged chunks per
    image, a mean far from zero: equal to eager GroupNorm (+ SiLU) within rounding."""
    run_in_interpreter(_GN_PROBE, "group norm ok 18")


def test_group_norm_falls_back_to_eager_where_the_kernel_does_not_run() -> None:
    """CPU tensors, a non-power-of-two C, NCHW layout, no affine: eager's values exactly."""
    x = torch.randn(1, 24, 4, 4).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(24), torch.randn(24)
    assert not groupnorm.kernel_takes(x, 8, w, b)
    assert torch.equal(groupnorm.group_norm(x, 8, w, b, 1e-6, True),
                       torch.nn.functional.silu(torch.nn.functional.group_norm(x, 8, w, b, 1e-6)))
    if torch.cuda.is_available():
        cuda = torch.randn(1, 32, 4, 4, device="cuda", dtype=torch.bfloat16)
        wc, bc = torch.randn(32, device="cuda", dtype=torch.bfloat16), torch.randn(32, device="cuda",
                                                                                  dtype=torch.bfloat16)
        assert not groupnorm.kernel_takes(cuda, 8, wc, bc)  # NCHW: channels not innermost
        assert groupnorm.kernel_takes(cuda.contiguous(memory_format=torch.channels_last), 8, wc, bc)
        assert not groupnorm.kernel_takes(cuda.contiguous(memory_format=torch.channels_last), 8, None, None)


def test_the_kernel_takes_channels_innermost_half_tensors_only(monkeypatch) -> None:
    """What `kernel_takes` admits, with the device check passed on the CPU: a channels-last bf16/fp16 tensor with C a
    power of two and a multiple of the groups, affine, no autograd; each other case goes to eager. And the [B, L, C]
    view it hands the kernel is the tensor's own memory, pixels in order."""
    monkeypatch.setattr(groupnorm, "_device_supported", lambda device: True)
    w, b = torch.randn(32).bfloat16(), torch.randn(32).bfloat16()
    x = torch.randn(2, 32, 3, 5).bfloat16().contiguous(memory_format=torch.channels_last)
    assert groupnorm.kernel_takes(x, 8, w, b)
    assert groupnorm.kernel_takes(x.half(), 8, w.half(), b.half())
    assert groupnorm.kernel_takes(torch.randn(2, 15, 32).bfloat16().transpose(1, 2), 8, w, b)  # attention's view
    refused = {
        "fp32": (x.float(), 8), "NCHW": (x.contiguous(), 8), "C not a power of two": (
            torch.randn(2, 24, 3, 5).bfloat16().contiguous(memory_format=torch.channels_last), 8),
        "C not a multiple of the groups": (x, 64),
        "empty": (x[:0], 8), "2-D": (torch.randn(4, 32).bfloat16(), 8),
    }
    for why, (t, g) in refused.items():
        assert not groupnorm.kernel_takes(t, g, w, b), why
    assert not groupnorm.kernel_takes(x, 8, None, None)
    assert not groupnorm.kernel_takes(x.requires_grad_(), 8, w, b)
    with torch.no_grad():
        assert groupnorm.kernel_takes(x, 8, w, b)  # (no autograd: its grad flag does not matter)
    x = x.detach()
    with kernels_switch_off():
        assert not groupnorm.kernel_takes(x, 8, w, b)
    rows = groupnorm._channels_last(x)
    assert rows.shape == (2, 15, 32) and rows.data_ptr() == x.data_ptr()
    assert torch.equal(rows, x.flatten(2).transpose(1, 2))
    assert groupnorm._channels_last(x.contiguous()) is None


def kernels_switch_off():
    from kernels import switches

    return switches.override(group_norm_silu=False)


def _tiny_vae() -> torch.nn.Module:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 3,
                        up_block_types=["UpDecoderBlock2D"] * 3, block_out_channels=[32, 32, 64],
                        layers_per_block=1, latent_channels=16, norm_num_groups=8, use_quant_conv=False,
                        use_post_quant_conv=False).eval()
    with torch.no_grad():  # norms away from their initial (1, 0): a lost weight or bias shows
        for m in vae.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.3)
    return vae


class _Pipe:
    def __init__(self, vae: torch.nn.Module) -> None:
        self.vae = vae


def test_fast_decoder_copy_folds_each_silu_into_its_norm_and_decodes_alike() -> None:
    """The copy: every decoder GroupNorm is a GroupNormAct, SiLU taken in exactly where one followed, no SiLU left
    as a module, channels-last weights, frozen; the stock decoder is untouched; outputs agree to fp32 rounding."""
    from torch import nn

    from model.vae import fast_decoder

    vae = _tiny_vae()
    before = {k: v.clone() for k, v in vae.decoder.state_dict().items()}
    fast = fast_decoder(vae.decoder)
    acts = [m for m in fast.modules() if isinstance(m, groupnorm.GroupNormAct)]
    norms = [m for m in vae.decoder.modules() if isinstance(m, nn.GroupNorm)]
    assert len(acts) == len(norms) > 0
    assert not any(isinstance(m, (nn.SiLU, nn.GroupNorm)) for m in fast.modules())
    assert sum(not a.silu for a in acts) == sum(1 for m in fast.modules() if type(m).__name__ == "Attention")
    assert fast.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert not fast.training and not any(p.requires_grad for p in fast.parameters())  # inference only
    assert any(isinstance(m, nn.GroupNorm) for m in vae.decoder.modules())  # stock decoder kept as it was
    assert all(torch.equal(v, vae.decoder.state_dict()[k]) for k, v in before.items())
    z = torch.randn(2, 16, 12, 10)
    with torch.no_grad():
        ref = vae.decoder(z)
        got = fast(z.contiguous(memory_format=torch.channels_last))
    assert (got - ref).abs().max().item() < 1e-4


def test_only_fast_batches_decode_through_the_copy_and_lossless_stays_identical() -> None:
    """Outside `decoding(pipe, True)` (and with it False) the VAE's decode equals the stock VAE's bit for bit; inside,
    it runs the copy (its output is channels-last and close); the copy is made once."""
    from model import vae as fast_vae

    vae, stock = _tiny_vae(), _tiny_vae()
    pipe = _Pipe(vae)
    z = torch.randn(1, 16, 8, 8)
    with torch.no_grad():
        ref = stock.decode(z).sample
        with fast_vae.decoding(pipe, False):
            assert torch.equal(vae.decode(z).sample, ref)
        with fast_vae.decoding(pipe, True):
            fast = vae.decode(z).sample
        hook = fast_vae.install(vae)
        with fast_vae.decoding(pipe, True):
            again = vae.decode(z).sample
        assert fast_vae.install(vae) is hook  # one copy
        assert torch.equal(vae.decode(z).sample, ref)  # after the block: stock again
    assert fast.is_contiguous(memory_format=torch.channels_last) and not ref.is_contiguous(
        memory_format=torch.channels_last)
    assert torch.equal(fast, again)
    assert (fast - ref).abs().max().item() < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_group_norm_pass_on_the_gpu_matches_eager_bf16() -> None:
    """bf16 at the VAE's shapes' channel counts: within two bf16 ulps of eager GroupNorm (+ SiLU)."""
    torch.manual_seed(0)
    for c, h in ((128, 96), (256, 64), (512, 32)):
        x = torch.randn(2, c, h, h + 8, device="cuda", dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last) * 3 + 1
        w = torch.randn(c, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(c, device="cuda", dtype=torch.bfloat16)
        for silu in (False, True):
            got = groupnorm.group_norm(x, 32, w, b, 1e-6, silu)
            ref = groupnorm.group_norm_eager(x.float(), 32, w.float(), b.float(), 1e-6, silu)
            assert got.is_contiguous(memory_format=torch.channels_last)
            assert ((got.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-2).all(), (c, silu)


def test_a_high_batch_decodes_through_the_copy_and_lossless_stays_byte_identical(tiny_path) -> None:
    """Through the pipeline, with `fast_vae` admitted as on a GPU (the CPU's plan leaves it off: `runs`): a high batch
    reports `ran.fast_vae` and decodes through the copy (counted), a lossless batch after it decodes with the stock
    decoder and its PNG equals stock diffusers'; the form's setting off leaves high batches on the stock decoder."""
    from model.loading import diffusers_reference, load_pipeline
    from model.pipeline import FluxServePipeline, GenerationRequest, run_flux_pipeline
    from model.vae import install

    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    reference = diffusers_reference(pipe)
    assert pipe.plan("high").fast_vae is False  # CPU: the row's devices
    pipe.runs = lambda technique: technique == "fast_vae" or FluxServePipeline.runs(pipe, technique)
    pipe.use(fast_vae=True)
    calls = []
    hook = install(pipe.pipe.vae)
    hook.fast.register_forward_hook(lambda *_: calls.append(1))

    def req(quality: str) -> GenerationRequest:
        return GenerationRequest("a red fox", height=64, width=64, steps=2, seed=3, quality=quality)

    high = pipe.generate([req("high")])[0]
    assert high.ran.fast_vae and calls == [1]
    lossless = pipe.generate([req("lossless")])[0]
    assert not lossless.ran.fast_vae and calls == [1]
    _, stock = run_flux_pipeline(reference, [req("lossless")])
    assert lossless.png == stock[0]
    pipe.use(fast_vae=False)
    assert not pipe.generate([req("high")])[0].ran.fast_vae and calls == [1]
