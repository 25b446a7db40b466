"""FLUX.1 Kontext, the second model family (model/flux1_kontext.py): FLUX.1's transformer in diffusers'
`FluxKontextPipeline`, which edits by instruction with the input image as a condition of every step.

Lossless is byte-identical to the stock pipeline loaded by diffusers from the same folder and called as a user would;
the image steers the result; masks and strength are refused everywhere with the reason; at tp 2 the ranks serve the
same edits. (HTTP, through the openai client: tests/test_serve.py, `-k kontext`.)
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from model.family import family_of
from model.request import GenerationRequest
from tests._inputs import random_png

PROMPT = "make the fox red"
STEPS = 2


def _req(seed: int = 3, quality: str = "lossless", height: int = 64, width: int = 64, **edit) -> GenerationRequest:
    return GenerationRequest(PROMPT, height=height, width=width, steps=STEPS, seed=seed, quality=quality, **edit)


@pytest.fixture(scope="module")
def ours(kontext_path: Path):
    from model.loading import load_pipeline

    return load_pipeline(str(kontext_path), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def stock(kontext_path: Path):
    """diffusers' FluxKontextPipeline loaded from the folder by diffusers itself, none of our code in the way."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline.from_pretrained(str(kontext_path), torch_dtype=torch.float32)


def _stock_run(stock, seed: int, height: int, width: int, image: bytes | None) -> tuple[torch.Tensor, np.ndarray]:
    """The stock pipeline as a user calls it: a PIL image (or none), the prompt, the size and its area (Kontext
    rescales to `max_area`, 1024x1024 unless told), the T5 length diffusers documents for dev capped by the
    tokenizer, a seeded CPU generator."""
    from diffusers import FluxPipeline

    user = {"prompt": PROMPT, "height": height, "width": width, "max_area": height * width,
            "num_inference_steps": STEPS, "guidance_scale": 3.5,
            "max_sequence_length": min(512, stock.tokenizer_2.model_max_length)}
    if image is not None:
        user["image"] = Image.open(io.BytesIO(image))
    packed = stock(**user, generator=torch.Generator().manual_seed(seed), output_type="latent").images
    pil = stock(**user, generator=torch.Generator().manual_seed(seed), output_type="pil").images[0]
    return FluxPipeline._unpack_latents(packed, height, width, stock.vae_scale_factor)[0], np.asarray(pil)


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@pytest.mark.parametrize("image_size, size", [((64, 64), (64, 64)), ((96, 48), (48, 96)), (None, (64, 48))])
def test_lossless_kontext_equals_the_stock_pipeline_called_as_a_user_would(ours, stock, image_size, size) -> None:
    """An edit (a square image; a wide one with a wide output) and a text-only request: latents `torch.equal`, PNG
    pixels equal. Catches an image that reaches diffusers resized, re-encoded or not at all, a wrong output area
    (the stock default would draw 1024x1024), a strength passed where Kontext has none."""
    height, width = size
    image = None if image_size is None else random_png(7, image_size)
    got = ours.generate([_req(11, height=height, width=width, image=image, strength=1.0)])[0]
    latents, pixels = _stock_run(stock, 11, height, width, image)
    assert got.latents.shape == latents.shape == (16, height // 8, width // 8)
    assert torch.equal(got.latents, latents)
    assert np.array_equal(_pixels(got.png), pixels) and pixels.shape == (height, width, 3)
    assert type(ours.pipe).__name__ == "FluxKontextPipeline" and family_of(ours.pipe).name == "flux1-kontext"


def test_the_image_steers_the_edit(ours) -> None:
    a = ours.generate([_req(5, image=random_png(1), strength=1.0)])[0]
    b = ours.generate([_req(5, image=random_png(2), strength=1.0)])[0]
    text = ours.generate([_req(5)])[0]
    assert not torch.equal(a.latents, b.latents) and not torch.equal(a.latents, text.latents)
    # a batch of two edits of one image: each request's result is its own seed's, as alone
    pair = ours.generate([_req(5, image=random_png(1), strength=1.0), _req(6, image=random_png(1), strength=1.0)])
    assert torch.allclose(pair[0].latents, a.latents, atol=1e-4) and not torch.equal(pair[0].latents, pair[1].latents)


@pytest.mark.parametrize("edit, message", [
    ({"mask": random_png(2, mask=True), "strength": 1.0}, "FLUX.1 Kontext edits by instruction from the whole image: "
                                                          "it takes no mask"),
    ({"strength": 0.6}, "strength does not apply to FLUX.1 Kontext"),
])
def test_a_mask_or_a_strength_is_refused_with_the_reason(ours, edit: dict, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        ours.generate([_req(image=random_png(1), **edit)])
    assert str(exc.value).startswith(message)


def test_the_families_answer_for_their_edits() -> None:
    from diffusers import FluxImg2ImgPipeline, FluxKontextPipeline

    from model.loading import model_family

    kontext, flux1 = model_family("tiny-kontext"), model_family("tiny")
    assert (kontext.name, kontext.edits, flux1.name, flux1.edits) == ("flux1-kontext", "reference", "flux1", "strength")
    assert model_family("flux-kontext-random") is kontext and model_family("toy") is flux1
    assert family_of("FluxKontextPipeline") is kontext and family_of("FluxPipeline") is flux1
    assert kontext.pipeline_classes() == {"text": FluxKontextPipeline}
    assert flux1.pipeline_classes()["img2img"] is FluxImg2ImgPipeline
    # the strength an edit gets when it names none, and what each family refuses
    assert (kontext.strength(None), flux1.strength(None), flux1.strength(0.3)) == (1.0, 0.6, 0.3)
    assert kontext.edit_error(False, 1.0) is None and flux1.edit_error(True, 0.3) is None
    assert kontext.edit_error(True, 1.0) and kontext.edit_error(False, 0.99)
    # the output keeps the asked size: the area Kontext rescales to is the asked one
    assert kontext.size_kwargs(48, 96) == {"max_area": 48 * 96} and flux1.size_kwargs(48, 96) == {}


def test_the_cli_edits_with_kontext_and_refuses_a_mask(kontext_path: Path, tmp_path: Path, capsys) -> None:
    from model.__main__ import main

    src = tmp_path / "in.png"
    src.write_bytes(random_png(4))
    out = tmp_path / "out.png"
    base = ["generate", "--model", str(kontext_path), "--image", str(src), "--size", "64x64", "--steps", "2",
            "--prompt", PROMPT, "--seed", "3", "--no-progress"]
    assert main([*base, "--out", str(out)]) == 0
    assert Image.open(out).size == (64, 64)
    assert main([*base, "--mask", str(src), "--out", str(tmp_path / "no.png")]) == 2
    assert "takes no mask" in capsys.readouterr().err and not (tmp_path / "no.png").exists()
    assert main([*base, "--strength", "0.5", "--out", str(tmp_path / "no.png")]) == 2
    assert "strength does not apply to FLUX.1 Kontext" in capsys.readouterr().err


def test_the_edit_schema_applies_the_familys_rules(kontext_path: Path) -> None:
    from deployments.config import AppArgs
    from deployments.errors import BadRequest
    from deployments.schema import validate_edit
    from model.loading import model_family

    args, kontext, flux1 = AppArgs(model=str(kontext_path)), model_family(str(kontext_path)), model_family("tiny")
    files = {"image": random_png(3)}
    (job,) = validate_edit({"prompt": PROMPT}, files, args, "m", family=kontext).jobs
    assert job.strength == 1.0 and job.image == files["image"] and job.mask is None
    (job,) = validate_edit({"prompt": PROMPT, "strength": "1"}, files, args, "m", family=kontext).jobs
    assert job.strength == 1.0
    (job,) = validate_edit({"prompt": PROMPT}, files, args, "m", family=flux1).jobs
    assert job.strength == 0.6
    for fields, extra, param, message in (
            ({"strength": "0.5"}, {}, "strength", "strength does not apply to FLUX.1 Kontext"),
            ({}, {"mask": random_png(2, mask=True)}, "mask", "FLUX.1 Kontext edits by instruction")):
        with pytest.raises(BadRequest) as exc:
            validate_edit({"prompt": PROMPT, **fields}, {**files, **extra}, args, "m", family=kontext)
        assert exc.value.param == param and exc.value.message.startswith(message)


def _tp_rank(rank: int, port: int, folder: str, outdir: str) -> None:
    from tests.test_tp import GROUP_TIMEOUT_S, WORLD, report_rank

    def body(res: dict) -> None:
        from model.form import ServingForm
        from model.loading import diffusers_reference
        from model.pipeline import run_flux_pipeline
        from tp.shard import shard_transformer
        from tp.worker import TPWorker

        torch.set_num_threads(1)  # two ranks on two cores
        worker = TPWorker(rank, WORLD, ServingForm(folder, device="cpu", dtype="float32"), port=port, backend="gloo",
                          timeout_s=GROUP_TIMEOUT_S)
        worker.setup()
        batch = [_req(11, image=random_png(7), strength=1.0)]
        res["ours"] = worker.generate(batch)
        reference = diffusers_reference(worker.pipe)  # diffusers' own Kontext pipeline and transformer, sharded alike
        shard_transformer(reference.transformer, rank, WORLD, worker.group)
        res["stock"] = run_flux_pipeline(reference, batch)

    report_rank(rank, outdir, body)


def test_kontext_edits_at_tp2_equal_stock_diffusers_sharded_alike_and_match_tp1(ours, kontext_path: Path,
                                                                                 tmp_path: Path) -> None:
    """A tp 2 replica serves Kontext like a tp 1 one: the same family code under the same TP plan (heads and the
    parallel FF over gloo), byte-identical to stock diffusers sharded the same way, close to the tp 1 image."""
    from model.metrics import psnr
    from tests.test_tp import JOIN_TIMEOUT_S, PSNR_MIN_DB, WORLD, spawn_ranks

    run = spawn_ranks(_tp_rank, WORLD, kontext_path, tmp_path, JOIN_TIMEOUT_S)
    (got,), (latents, pngs) = run[0]["ours"], run[0]["stock"]
    assert run[1]["ours"] is None  # rank 0 answers
    assert torch.equal(got.latents, latents[0]) and got.png == pngs[0]
    tp1 = ours.generate([_req(11, image=random_png(7), strength=1.0)])[0]
    torch.testing.assert_close(got.latents, tp1.latents, rtol=1e-4, atol=1e-4)  # sharded sums round differently
    assert psnr(_pixels(got.png), _pixels(tp1.png)) >= PSNR_MIN_DB


@pytest.mark.gpu
def test_gpu_kontext_lossless_equals_stock_and_high_runs_the_served_set(kontext_path: Path) -> None:
    """On CUDA in bf16: a lossless Kontext edit equals the stock pipeline's (latents, PNG md5); the high tier as a
    high replica serves it (converted: fused projections, fp8 where it runs; fast norms, 8-bit attention; CUDA
    graphs) switches its kernels on for Kontext's longer sequence (noisy + image tokens) and stays close."""
    from diffusers import FluxKontextPipeline, FluxPipeline

    from model.loading import load_pipeline
    from model.metrics import psnr, ssim
    from model.pipeline import md5

    lossless = load_pipeline(str(kontext_path), device="cuda", dtype=torch.bfloat16)
    stock = FluxKontextPipeline.from_pretrained(str(kontext_path), torch_dtype=torch.bfloat16).to("cuda")
    stock.set_progress_bar_config(disable=True)
    image = random_png(7, (128, 128))
    req = lambda q: _req(11, q, 128, 128, image=image, strength=1.0)  # noqa: E731
    got = lossless.generate([req("lossless")])[0]
    user = {"image": Image.open(io.BytesIO(image)), "prompt": PROMPT, "height": 128, "width": 128,
            "max_area": 128 * 128, "num_inference_steps": STEPS, "guidance_scale": 3.5, "max_sequence_length": 32}
    packed = stock(**user, generator=torch.Generator().manual_seed(11), output_type="latent").images
    pil = stock(**user, generator=torch.Generator().manual_seed(11)).images[0]
    assert torch.equal(got.latents, FluxPipeline._unpack_latents(packed, 128, 128, 8)[0].cpu())
    from model.png import png_bytes

    assert md5(got.png) == md5(png_bytes(pil))
    del stock
    high = load_pipeline(str(kontext_path), device="cuda", dtype=torch.bfloat16)
    high.take_high_defaults()
    high.enable_cuda_graphs()
    first, again = (high.generate([req("high")])[0] for _ in range(2))
    ran = again.ran
    assert ran.fast_norm_sites > 0 and ran.graphed and (ran.fp8_layers > 0 or high.fp8_refusal() is not None), ran
    assert torch.equal(first.latents, again.latents)  # graph replay changes no bit
    assert ssim(again.png, got.png) > 0.9
    print(f"tiny-kontext high vs lossless: PSNR {psnr(again.png, got.png):.2f} dB, SSIM {ssim(again.png, got.png):.4f}")
