"""Image edits through the pipeline: image-to-image and inpainting run diffusers' own FluxImg2ImgPipeline /
FluxInpaintPipeline over the loaded components (no second copy of any weight). Lossless is byte-identical to those
stock pipelines with diffusers' transformer; edits never share a batch with other inputs; bad inputs are refused.
(The HTTP endpoint `/v1/images/edits` through the openai client: tests/test_serve.py.)
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

import pytest
import torch
from PIL import Image

from model.loading import diffusers_reference, load_pipeline
from model.pipeline import GenerationRequest, edit_pipeline, run_flux_pipeline
from model.request import validate_batch
from tests._inputs import random_png


def _req(seed: int = 3, quality: str = "lossless", **edit) -> GenerationRequest:
    return GenerationRequest("a red fox", height=64, width=64, steps=4, seed=seed, quality=quality, **edit)


@pytest.fixture(scope="module")
def pipes(tiny_path: Path):
    ours = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    return ours, diffusers_reference(ours)


@pytest.mark.parametrize("inpaint", [False, True])
def test_lossless_edits_are_byte_identical_to_the_stock_edit_pipelines(pipes, inpaint: bool) -> None:
    ours, ref = pipes
    edit = {"image": random_png(1), "strength": 0.7, "mask": random_png(2, mask=True) if inpaint else None}
    batch = [_req(3, **edit), _req(4, **edit)]
    got = ours.generate(batch)
    lat, pngs = run_flux_pipeline(ref, batch)  # the reference's own Img2Img / Inpaint pipeline
    assert type(edit_pipeline(ref, inpaint)).__name__ == ("FluxInpaintPipeline" if inpaint else "FluxImg2ImgPipeline")
    for r, la, png in zip(got, lat, pngs):
        assert torch.equal(r.latents, la) and r.png == png
    text_only = ours.generate([_req(3)])[0]
    assert not torch.equal(got[0].latents, text_only.latents)  # the input image matters
    # no weight is copied: the edit pipeline holds the very same modules
    assert edit_pipeline(ours.pipe, inpaint).transformer is ours.transformer
    assert edit_pipeline(ours.pipe, inpaint).vae is ours.pipe.vae


def _corner_mask() -> bytes:
    """White (repaint) over the top-left quarter only: a flipped or transposed mask would repaint elsewhere."""
    arr = np.zeros((64, 64, 3), dtype=np.uint8)
    arr[:32, :24] = 255
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def stock_edit_pipes(tiny_path: Path) -> dict[bool, object]:
    """diffusers' edit pipelines loaded from the folder by diffusers itself, with none of our code in the way."""
    from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline

    return {inpaint: cls.from_pretrained(str(tiny_path), torch_dtype=torch.float32)
            for inpaint, cls in ((False, FluxImg2ImgPipeline), (True, FluxInpaintPipeline))}


@pytest.mark.parametrize("inpaint, strength", [(False, 0.35), (False, 0.9), (True, 0.5), (True, 1.0)])
def test_lossless_edits_equal_the_stock_edit_pipelines_called_as_a_user_would(
        pipes, stock_edit_pipes, inpaint: bool, strength: float) -> None:
    """The reference is `FluxImg2ImgPipeline` / `FluxInpaintPipeline.from_pretrained(folder)` called with PIL images,
    `strength` and `mask_image` as a user writes it: catches a strength, mask or source image that reaches diffusers
    wrongly (e.g. a dropped or fixed strength, a mask flipped or passed as the image, a source image re-encoded or resized),
    which a reference run through our own `run_flux_pipeline` would share."""
    from diffusers import FluxPipeline

    ours, _ = pipes
    stock = stock_edit_pipes[inpaint]
    source, mask = random_png(7), _corner_mask()
    edit = {"image": source, "strength": strength, "mask": mask if inpaint else None}
    got = ours.generate([_req(11, **edit)])[0]

    user = {"image": Image.open(io.BytesIO(source)), "strength": strength, "prompt": "a red fox", "height": 64,
            "width": 64, "num_inference_steps": 4, "guidance_scale": 3.5,
            # the T5 length diffusers documents for a model with a guidance embedding (dev), capped by the tokenizer
            "max_sequence_length": min(512, stock.tokenizer_2.model_max_length)}
    if inpaint:
        user["mask_image"] = Image.open(io.BytesIO(mask))
    packed = stock(**user, generator=torch.Generator().manual_seed(11), output_type="latent").images
    image = stock(**user, generator=torch.Generator().manual_seed(11), output_type="pil").images[0]
    latents = FluxPipeline._unpack_latents(packed, 64, 64, stock.vae_scale_factor)[0]
    assert torch.equal(got.latents, latents)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(got.png)).convert("RGB")), np.asarray(image))


def test_strength_moves_the_result_and_high_edits_run(pipes) -> None:
    ours, _ = pipes
    weak = ours.generate([_req(image=random_png(1), strength=0.3)])[0]
    strong = ours.generate([_req(image=random_png(1), strength=0.9)])[0]
    assert not torch.equal(weak.latents, strong.latents)
    high = ours.generate([_req(image=random_png(1), strength=0.6, quality="high")])[0]
    assert torch.isfinite(high.latents).all() and high.png


def test_edits_never_share_a_batch_with_other_inputs() -> None:
    a, b = _req(image=random_png(1)), _req(image=random_png(5))
    assert a.batch_key() != b.batch_key() != _req().batch_key()
    assert _req(image=random_png(1)).batch_key() == a.batch_key()  # same bytes: same key
    with pytest.raises(ValueError, match="image / mask / strength"):
        validate_batch([a, b])


@pytest.mark.parametrize("edit, message", [
    ({"image": b"not an image"}, "image is not a readable image"),
    ({"image": random_png(1), "mask": b"\x89PNG broken"}, "mask is not a readable image"),
    ({"mask": random_png(2, mask=True)}, "a mask needs an image"),
    ({"image": random_png(1), "strength": 0.0}, r"strength must be in \(0, 1\]"),
    ({"image": random_png(1), "strength": 1.5}, r"strength must be in \(0, 1\]"),
])
def test_bad_edit_inputs_are_refused_with_reasons(pipes, edit: dict, message: str) -> None:
    ours, _ = pipes
    with pytest.raises(ValueError, match=message):
        ours.generate([_req(**edit)])


def test_cli_edits_an_image(tiny_path: Path, tmp_path: Path, capsys) -> None:
    from model.__main__ import main

    src, mask = tmp_path / "in.png", tmp_path / "mask.png"
    src.write_bytes(random_png(1))
    mask.write_bytes(random_png(2, mask=True))
    out = tmp_path / "out.png"
    rc = main(["generate", "--model", str(tiny_path), "--size", "64x64", "--steps", "2", "--image", str(src),
               "--mask", str(mask), "--strength", "0.8", "--out", str(out), "--no-progress"])
    assert rc == 0 and Image.open(out).size == (64, 64)
    assert main(["generate", "--model", str(tiny_path), "--mask", str(mask), "--out", str(out)]) == 2
    assert "--mask needs --image" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_path), "--image", str(tmp_path / "nope.png"),
                 "--out", str(out)]) == 2


def test_an_alpha_mask_follows_openais_rule_and_one_without_alpha_the_inpainting_rule() -> None:
    """OpenAI edits where the mask is fully transparent; inpainting pipelines repaint where it is white. A mask with
    an alpha channel (RGBA, LA, or a palette with a transparent entry) is read by OpenAI's rule, any other by the
    inpainting rule; both give the same white-where-repainted mask. Catches an RGBA mask made for OpenAI silently
    repainting the wrong region (its RGB is often black or the photo itself)."""
    from model.png import png_bytes as png
    from model.request import decode_mask

    hole = np.zeros((64, 64), dtype=bool)
    hole[16:48, 8:40] = True  # the region to repaint
    white = np.where(hole, 255, 0).astype(np.uint8)
    rgb = Image.fromarray(np.stack([white] * 3, -1))
    rgba = np.full((64, 64, 4), 255, dtype=np.uint8)  # an opaque photo-like mask ...
    rgba[..., :3] = np.random.default_rng(0).integers(0, 255, (64, 64, 3))
    rgba[hole, 3] = 0  # ... transparent where OpenAI should edit
    la = Image.fromarray(np.stack([np.full((64, 64), 90, np.uint8), np.where(hole, 0, 255).astype(np.uint8)], -1),
                         "LA")
    palette = Image.fromarray(np.where(hole, 1, 0).astype(np.uint8), "P")
    palette.putpalette([0, 0, 0, 255, 255, 255])
    palette.info["transparency"] = 1
    want = np.stack([white] * 3, -1)
    for name, im in (("rgb", rgb), ("rgba", Image.fromarray(rgba, "RGBA")), ("la", la), ("palette", palette)):
        assert np.array_equal(np.asarray(decode_mask(png(im))), want), name
