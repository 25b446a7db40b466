"""FluxServePipeline on CUDA (tiny preset, bf16): lossless bit-exact vs stock diffusers on the GPU, high mounts and
unmounts, batching. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import kernels
from model.flux import FluxAttention
from model.loading import load_pipeline
from model.metrics import psnr, ssim
from model.pipeline import GenerationRequest, md5

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_pipe(tiny_path):
    return load_pipeline(str(tiny_path), device="cuda", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def gpu_stock(tiny_path):
    from diffusers import FluxPipeline

    from model.loading import _dtype_kwarg

    pipe = FluxPipeline.from_pretrained(tiny_path, **_dtype_kwarg(torch.bfloat16), local_files_only=True).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock(pipe, prompts, seeds, steps, size):
    common = dict(prompt=prompts, height=size, width=size, num_inference_steps=steps, guidance_scale=3.5,
                  max_sequence_length=32)  # the tiny preset's T5 length (its tokenizer's model_max_length)
    packed = pipe(**common, generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="latent").images
    latents = pipe._unpack_latents(packed, size, size, pipe.vae_scale_factor).cpu()
    import io

    pngs = []
    for im in pipe(**common, generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pil").images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        pngs.append(buf.getvalue())
    return latents, pngs


def test_gpu_lossless_bit_exact_vs_stock_diffusers(gpu_pipe, gpu_stock) -> None:
    reqs = [GenerationRequest("a red fox in the snow", seed=3, steps=4),
            GenerationRequest("a lighthouse at night", seed=4, steps=4)]
    for batch in (reqs[:1], reqs):
        ours = gpu_pipe.generate(batch)
        ref_lat, ref_png = _stock(gpu_stock, [r.prompt for r in batch], [r.seed for r in batch], 4, 256)
        for i, res in enumerate(ours):
            assert res.latents.dtype == torch.bfloat16
            assert torch.equal(res.latents, ref_lat[i]), f"batch {len(batch)} item {i}"
            assert md5(res.png) == md5(ref_png[i])


def test_gpu_high_mounts_for_the_batch_only_and_unmount_restores_lossless(gpu_pipe) -> None:
    model = gpu_pipe.transformer
    n_sites = 2 * model.config.num_layers + model.config.num_single_layers
    req = GenerationRequest("a bowl of ramen", seed=5, steps=4)
    before = gpu_pipe.generate([req])[0]
    high = gpu_pipe.generate([GenerationRequest("a bowl of ramen", seed=5, steps=4, quality="high")])[0]
    assert high.ran.gelu_sites == n_sites, gpu_pipe.last_mount_report
    assert kernels.mounted_sites(model) == []
    after = gpu_pipe.generate([req])[0]
    assert torch.equal(before.latents, after.latents) and before.png == after.png
    # high is an approximation of lossless, not something else
    assert torch.isfinite(high.latents.float()).all()
    assert ssim(high.png, before.png) > 0.9
    print(f"tiny bf16 high vs lossless: PSNR {psnr(high.png, before.png):.2f} dB, SSIM {ssim(high.png, before.png):.5f}")


def test_gpu_request_independent_of_batch_mates_and_alone(gpu_pipe) -> None:
    a = GenerationRequest("a red fox", seed=1, steps=3)
    b = GenerationRequest("a dragon", seed=2, steps=3)
    c = GenerationRequest("a sailing ship", seed=9, steps=3)
    ab, ca = gpu_pipe.generate([a, b]), gpu_pipe.generate([c, a])
    assert torch.equal(ab[0].latents, ca[1].latents) and ab[0].png == ca[1].png
    alone = gpu_pipe.generate([a])[0]
    if not torch.equal(alone.latents, ab[0].latents):
        diff = (alone.latents.float() - ab[0].latents.float()).abs().max().item()
        g = torch.Generator(device="cuda").manual_seed(0)
        inner = gpu_pipe.transformer.config.num_attention_heads * gpu_pipe.transformer.config.attention_head_dim
        x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(inner, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        m_dependent = not torch.equal(torch.nn.functional.linear(x[:1], w)[0], torch.nn.functional.linear(x, w)[0])
        assert m_dependent, f"batched != alone ({diff:.3g}) although this GPU's GEMM rows do not depend on M"
        pytest.xfail(f"on this GPU a request batched with another differs from it alone by {diff:.3g} "
                     f"(GEMM kernel selection depends on M = batch size for the conditioning linears)")
    if alone.png != ab[0].png:
        # Same latents, different pixels: the VAE decode itself depends on the batch size (cuDNN picks conv
        # algorithms per input shape). Show that on the VAE directly, else fail.
        pipe = gpu_pipe.pipe
        lat = torch.stack([ab[0].latents, ab[1].latents]).to("cuda")
        lat = lat / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        with torch.no_grad():
            two, one = pipe.vae.decode(lat).sample, pipe.vae.decode(lat[:1]).sample
        assert not torch.equal(two[0], one[0]), "same latents, same VAE outputs, yet different PNGs"
        pytest.xfail("latents are batch-invariant on this GPU, but the VAE decode depends on the batch size "
                     f"(max |diff| {(two[0] - one[0]).abs().max().item():.3g} in decoder output)")


def test_gpu_high_fast_norm_switches_sites_and_stays_close(gpu_pipe) -> None:
    from kernels.modulate import fast_norm_sites

    model = gpu_pipe.transformer
    # LayerNorm + modulate sites (3 per double block, 1 per single block) and QK RMSNorm + RoPE (1 per attention)
    n_sites = 3 * model.config.num_layers + model.config.num_single_layers + sum(isinstance(m, FluxAttention) for m in model.modules())
    lossless = gpu_pipe.generate([GenerationRequest("a bowl of ramen", seed=5, steps=4)])[0]
    high = gpu_pipe.generate([GenerationRequest("a bowl of ramen", seed=5, steps=4, quality="high")])[0]
    gpu_pipe.use(fast_norm=True)
    try:
        fast = gpu_pipe.generate([GenerationRequest("a bowl of ramen", seed=5, steps=4, quality="high")])[0]
    finally:
        gpu_pipe.use(fast_norm=False)
    assert fast.ran.fast_norm_sites == n_sites and high.ran.fast_norm_sites == 0 and fast_norm_sites(model) == 0
    assert not torch.equal(fast.latents, high.latents)  # the fast kernel really ran
    assert ssim(fast.png, lossless.png) > 0.9
    again = gpu_pipe.generate([GenerationRequest("a bowl of ramen", seed=5, steps=4)])[0]
    assert torch.equal(again.latents, lossless.latents) and again.png == lossless.png
    print(f"tiny bf16 high+fast_norm vs lossless: PSNR {psnr(fast.png, lossless.png):.2f} dB, "
          f"SSIM {ssim(fast.png, lossless.png):.5f}")


def test_gpu_a_real_out_of_memory_batch_fails_alone_and_memory_comes_back(gpu_pipe) -> None:
    """A batch the allocator cannot hold (the process capped at a small fraction of the H200) raises torch's
    OutOfMemoryError out of generate; release_memory() returns what it held, and the next request succeeds with the
    same bytes as before."""
    small = GenerationRequest("after the oom", height=256, width=256, steps=2, seed=3)
    before = gpu_pipe.generate([small])[0]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # earlier tests' cached blocks would otherwise serve the big batch under the cap
    baseline = torch.cuda.memory_allocated()
    # reserved also counts what empty_cache cannot return (earlier tests' CUDA-graph pools): the cap sits above it
    reserved = torch.cuda.memory_reserved()
    headroom = 512 * 2**20  # the small request fits; 16 images at 2048^2 (1 GiB per VAE activation) do not
    torch.cuda.set_per_process_memory_fraction((reserved + headroom) / torch.cuda.get_device_properties(0).total_memory)
    try:
        big = [GenerationRequest("too big", height=2048, width=2048, steps=1, seed=i) for i in range(16)]
        with pytest.raises(torch.OutOfMemoryError):
            gpu_pipe.generate(big)
        gpu_pipe.release_memory()
        assert torch.cuda.memory_allocated() <= baseline + 64 * 2**20  # the failed batch's tensors are gone
        assert torch.cuda.memory_reserved() <= reserved + 64 * 2**20  # and the cache handed its blocks back
        after = gpu_pipe.generate([small])[0]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert after.png == before.png and kernels.mounted_sites(gpu_pipe.transformer) == []
