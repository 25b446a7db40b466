"""Preview math (model/preview.py): the denoised estimate a partial image shows, on its own and inside the pipeline.

Flow matching (FLUX's scheduler) puts x_sigma = (1 - sigma) x0 + sigma * noise on a straight line, and an Euler step
moves along the velocity v = noise - x0 that the transformer predicts. So from two points of the line the preview
must recover x0 exactly: a wrong sigma, a wrong sign or a lost velocity shows here. The pipeline test checks that
the sigmas the pipeline hands the previewer are the ones the transformer was run at (the scheduler's own).
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from model.pipeline import GenerationRequest
from model.preview import LatentPreviewer, PreviewSink

H = W = 64  # image side; latents 8x8 at the VAE's factor 8, packed into 16 tokens of 64


def _previewer() -> LatentPreviewer:
    """A previewer with a known latent -> RGB map (latent channels 0, 1, 2 as R, G, B), no VAE needed."""
    from diffusers import FluxPipeline

    pipe = SimpleNamespace(_unpack_latents=FluxPipeline._unpack_latents, vae_scale_factor=8)
    p = LatentPreviewer(pipe)
    w = torch.zeros(17, 3)
    w[0, 0] = w[1, 1] = w[2, 2] = 1.0
    p._weights = w
    return p


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def test_a_preview_shows_the_clean_image_of_a_straight_flow_line() -> None:
    """Two points of x_sigma = (1 - sigma) x0 + sigma * noise give back x0 (up to one level of rounding), for any
    pair of sigmas; the raw latents, the noise-side estimate (wrong sign) or the estimate at the previous sigma are
    far from it. Catches a swapped sigma pair, a sign error or `sigma_prev` used for the extrapolation."""
    g = torch.Generator().manual_seed(0)
    x0 = 0.8 * torch.tanh(torch.randn(2, 16, 64, generator=g))
    noise = torch.randn(2, 16, 64, generator=g)
    on_line = lambda s: (1 - s) * x0 + s * noise  # noqa: E731
    p = _previewer()
    clean = [_pixels(b) for b in p.pngs(x0, None, 0.0, 0.0, H, W)]
    for s_prev, s in ((1.0, 0.9), (0.7, 0.5), (0.3, 0.1)):
        got = [_pixels(b) for b in p.pngs(on_line(s), on_line(s_prev), s_prev, s, H, W)]
        for c, im in zip(clean, got):
            assert np.abs(c - im).max() <= 1, (s_prev, s)
        velocity = (on_line(s) - on_line(s_prev)) / (s - s_prev)
        wrong = {
            "raw latents": p.pngs(on_line(s), None, s_prev, s, H, W),
            "swapped sigmas": p.pngs(on_line(s), on_line(s_prev), s, s_prev, H, W),
            "noise-side sign": p.pngs(on_line(s) + s * velocity, None, 0.0, 0.0, H, W),
            "extrapolated from sigma_prev": p.pngs(on_line(s) - s_prev * velocity, None, 0.0, 0.0, H, W),
        }
        for name, pngs in wrong.items():  # the right estimate is within one level everywhere
            assert np.abs(clean[0] - _pixels(pngs[0])).mean() > 4, (name, s_prev, s)


def test_the_pipeline_previews_at_the_sigmas_the_transformer_ran_at(tiny_pipe, monkeypatch) -> None:
    """Inside the pipeline, after step i: `previous` is the latents the transformer saw at step i, `sigma_prev` its
    timestep, `sigma` the next step's, and the estimate equals previous - sigma_prev * v_i (v_i: the transformer's
    own output at step i). Catches an off-by-one in the scheduler index the pipeline reads."""
    seen: list[dict] = []

    def before(_m, _args, kwargs):
        seen.append({"x": kwargs["hidden_states"].clone(), "sigma": float(kwargs["timestep"][0])})

    def after(_m, _args, _kwargs, out):
        seen[-1]["v"] = out[0].clone()

    calls: list[tuple] = []
    original = LatentPreviewer.pngs

    def spy(self, packed, previous, sigma_prev, sigma, height, width):
        calls.append((packed.clone(), previous.clone(), sigma_prev, sigma))
        return original(self, packed, previous, sigma_prev, sigma, height, width)

    monkeypatch.setattr(LatentPreviewer, "pngs", spy)
    t = tiny_pipe.transformer
    hooks = [t.register_forward_pre_hook(before, with_kwargs=True),
             t.register_forward_hook(after, with_kwargs=True)]
    try:
        steps = (1, 3, 4)
        emitted: list[tuple] = []
        tiny_pipe.generate([GenerationRequest("a red fox", height=H, width=W, steps=6, seed=2)],
                           previews=PreviewSink(steps, lambda *args: emitted.append(args)))
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == 6 and len(calls) == len(steps)
    # the sink hears (preview index, step, one PNG per request) in step order
    assert [(index, step) for index, step, _ in emitted] == [(0, 1), (1, 3), (2, 4)]
    assert all(len(pngs) == 1 and pngs[0].startswith(b"\x89PNG") for _, _, pngs in emitted)
    for i, (packed, previous, sigma_prev, sigma) in zip(steps, calls):
        assert torch.equal(previous, seen[i]["x"]) and torch.equal(packed, seen[i + 1]["x"])
        assert sigma_prev == pytest.approx(seen[i]["sigma"], rel=1e-5)
        assert sigma == pytest.approx(seen[i + 1]["sigma"], rel=1e-5)
        estimate = packed - sigma * (packed - previous) / (sigma - sigma_prev)
        truth = seen[i]["x"] - seen[i]["sigma"] * seen[i]["v"]
        assert torch.allclose(estimate, truth, rtol=1e-3, atol=1e-4), (estimate - truth).abs().max()


def test_a_preview_maps_latent_channels_to_pixels_as_its_weights_say() -> None:
    """Absolute, not relative: with latent channels 0, 1, 2 as R, G, B and no bias, the preview of latents z is
    round((clamp(z, -1, 1) + 1) * 127.5) per latent position, resized bilinearly to the image (PIL's own resize as
    the reference). Catches a wrong bias row, range, rounding, clamp or resampling filter, which a comparison of two
    previews made by the same code would share."""
    from diffusers import FluxPipeline

    g = torch.Generator().manual_seed(3)
    packed = 1.3 * torch.randn(1, 16, 64, generator=g)  # some values beyond [-1, 1]
    p = _previewer()
    p._weights[16] = torch.tensor([0.25, -0.5, 0.0])  # a bias: added, to the RGB of every position
    got = _pixels(p.pngs(packed, None, 0.0, 0.0, H, W)[0])
    z = FluxPipeline._unpack_latents(packed, H, W, 8)[0]  # [16, 8, 8]
    rgb = z[:3].permute(1, 2, 0) + torch.tensor([0.25, -0.5, 0.0])
    small = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    expected = np.asarray(Image.fromarray(small, "RGB").resize((W, H), Image.BILINEAR)).astype(int)
    assert np.array_equal(got, expected)


def test_the_fit_is_made_in_the_pipelines_latent_space_and_once(tiny_pipe) -> None:
    """FluxPipeline decodes latents as vae.decode(z / scaling + shift): the fit must map z = (mean - shift) * scaling.
    A least-squares fit with a bias leaves zero mean error on its own pictures only in the space it was fitted in,
    so a shift or scale applied the wrong way shows as a colour offset (the tiny VAE has FLUX's factors). And the
    previewer is fitted once per pipeline (`previewer_of` caches it)."""
    import torch.nn.functional as F

    from model.preview import _FIT_SEEDS, _FIT_SIDE, _fit_picture, previewer_of

    pipe = tiny_pipe.pipe
    cfg = pipe.vae.config
    assert (cfg.shift_factor, cfg.scaling_factor) != (0.0, 1.0)
    w = LatentPreviewer(pipe).weights()
    pictures = torch.stack([_fit_picture(_FIT_SIDE, s) for s in _FIT_SEEDS])
    with torch.no_grad():
        z = (pipe.vae.encode(pictures).latent_dist.mean - cfg.shift_factor) * cfg.scaling_factor
    rgb = torch.einsum("bchw,cd->bdhw", z.float(), w[:-1]) + w[-1][None, :, None, None]
    offset = (rgb - F.avg_pool2d(pictures, 8)).mean(dim=(0, 2, 3))
    assert offset.abs().max() < 1e-3, offset
    first = previewer_of(pipe)
    assert previewer_of(pipe) is first and first.weights() is first.weights()


def test_the_fit_picture_spans_the_colour_range_and_is_fixed_by_its_seed() -> None:
    """The fit learns colours from this picture: it must stay in the VAE's input range [-1, 1] and span most of it
    in every channel (a picture shifted out of range or squeezed into a corner fits a useless map)."""
    from model.preview import _fit_picture

    p = _fit_picture(256, 0)
    assert p.shape == (3, 256, 256) and float(p.min()) >= -1 and float(p.max()) <= 1
    assert all(float(p[c].max() - p[c].min()) > 1.5 for c in range(3))
    assert torch.equal(_fit_picture(256, 0), p) and not torch.equal(_fit_picture(256, 1), p)
