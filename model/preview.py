"""Cheap previews of an image while it denoises (streamed partial images).

A full VAE decode per preview would cost about as much as a denoising step at 1024x1024, so a preview is a linear
map from the latent channels to RGB at latent resolution, then resized to the image size (a model whose VAE decode
is cheap may state `previews: "vae"` in its folder and be previewed by its VAE: `use_vae_previews`). The map is fitted once
per pipeline from the pipeline's own VAE: a deterministic colourful picture is encoded, and least squares finds
the RGB of each 8x8 patch from its latent vector (a "latent2rgb" fit that works for any VAE, no table of factors).

What is previewed is the denoised estimate, not the noisy latents: for a flow-matching Euler step from sigma_i to
sigma_j the velocity is (x_j - x_i) / (sigma_j - sigma_i), and the clean estimate is x_j - sigma_j * velocity.
Reading the latents never changes them: the final image is the same with or without previews.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MAX_PARTIAL_IMAGES = 3
_FIT_SIDE = 256  # side of the synthetic picture the fit encodes (32x32 latents per picture at 8x)
_FIT_SEEDS = (0, 1)  # the synthetic pictures the fit encodes


@dataclass(frozen=True)
class PreviewSink:
    """Where the partial images of one batch go: after each step in `steps` (0-based step indices), `emit(index,
    step, pngs)` is called from the generating thread with one PNG per request of the batch."""

    steps: tuple[int, ...]
    emit: Callable[[int, int, list[bytes]], None]


def preview_steps(steps: int, partial_images: int) -> tuple[int, ...]:
    """The 0-based step indices after which `partial_images` previews are taken: spread evenly, never the last
    step (the final image follows it) and never the first (nothing is drawn yet); fewer when there are few steps."""
    if not 0 <= partial_images <= MAX_PARTIAL_IMAGES:
        raise ValueError(f"partial_images must be between 0 and {MAX_PARTIAL_IMAGES}, got {partial_images}")
    candidates = range(1, steps - 1)
    if partial_images >= len(candidates):
        return tuple(candidates)
    # evenly spaced and distinct: consecutive picks are len / (k + 1) >= 1 apart
    return tuple(candidates[(k + 1) * len(candidates) // (partial_images + 1)] for k in range(partial_images))


def _fit_picture(side: int, seed: int) -> "torch.Tensor":
    """A smooth, colourful RGB picture in [-1, 1], [3, side, side]: colour gradients plus a few flat discs, so the
    fit sees saturated colours, greys and edges."""
    import torch

    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, side), torch.linspace(0, 1, side), indexing="ij")
    base = torch.stack([xx, yy, 1 - (xx + yy) / 2]) * 2 - 1
    picture = base[torch.randperm(3, generator=g)]
    for _ in range(6):
        cy, cx, r = (torch.rand(3, generator=g) * torch.tensor([1.0, 1.0, 0.25])).tolist()
        colour = torch.rand(3, generator=g) * 2 - 1
        inside = (yy - cy) ** 2 + (xx - cx) ** 2 < (r + 0.05) ** 2
        picture = torch.where(inside, colour[:, None, None], picture)
    return picture


class LatentPreviewer:
    """The fitted latent -> RGB map of one pipeline's VAE (fitted on first use, thread-safe); by_vae=True: previews
    decoded by the VAE itself instead (`use_vae_previews`)."""

    def __init__(self, pipe: Any, by_vae: bool = False) -> None:
        self.pipe = pipe
        self.by_vae = by_vae
        self._weights: torch.Tensor | None = None  # [C + 1, 3] (the last row is the bias)
        self._lock = threading.Lock()

    def weights(self) -> "torch.Tensor":
        with self._lock:
            if self._weights is None:
                self._weights = self._fit()
            return self._weights

    def _fit(self) -> "torch.Tensor":
        import torch
        import torch.nn.functional as F

        vae = self.pipe.vae
        factor = self.pipe.vae_scale_factor
        pictures = torch.stack([_fit_picture(_FIT_SIDE, seed) for seed in _FIT_SEEDS])
        with torch.no_grad():
            dist = vae.encode(pictures.to(vae.device, vae.dtype)).latent_dist
            # the pipeline's latent space: (z - shift) * scaling, as FluxPipeline prepares and decodes it
            z = (dist.mean.float() - vae.config.shift_factor) * vae.config.scaling_factor
        rgb = F.avg_pool2d(pictures, factor).to(z.device)  # [N, 3, h, w], one colour per latent position
        x = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        y = rgb.permute(0, 2, 3, 1).reshape(-1, 3)
        x = torch.cat([x, torch.ones(len(x), 1, device=x.device)], dim=1)
        return torch.linalg.lstsq(x.cpu(), y.cpu()).solution  # [C + 1, 3]

    def pngs(self, packed: "torch.Tensor", previous: "torch.Tensor | None", sigma_prev: float, sigma: float,
             height: int, width: int) -> list[bytes]:
        """PNG previews of packed latents [B, tokens, 64] at `sigma` (the previous step's latents at `sigma_prev`
        give the velocity, hence the denoised estimate; without them the latents are shown as they are)."""
        import torch
        from PIL import Image

        from model.png import png_bytes

        with torch.no_grad():
            x = packed.float()
            if previous is not None and sigma != sigma_prev:
                velocity = (x - previous.float()) / (sigma - sigma_prev)
                x = x - sigma * velocity
            z = self.pipe._unpack_latents(x, height, width, self.pipe.vae_scale_factor)  # [B, C, h, w]
            if self.by_vae:  # as FluxPipeline decodes its final latents
                vae = self.pipe.vae
                z = z / vae.config.scaling_factor + vae.config.shift_factor
                images = self.pipe.image_processor.postprocess(vae.decode(z.to(vae.dtype), return_dict=False)[0],
                                                               output_type="pil")
                return [png_bytes(im) for im in images]
            w = self.weights().to(z.device)
            rgb = torch.einsum("bchw,cd->bhwd", z, w[:-1]) + w[-1]
            rgb = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
        out = []
        for im in rgb:
            pil = Image.fromarray(im, "RGB").resize((width, height), Image.BILINEAR)
            out.append(png_bytes(pil))
        return out


def use_vae_previews(pipe: Any) -> None:
    """Preview `pipe`'s images by decoding the denoised estimate with its VAE: exact colours and detail, for a model
    whose VAE decode costs little next to a step (a model folder states it: model.loading.STATEMENT_FILE). A real
    FLUX.1 VAE decode costs about a step at 1024x1024, so those keep the linear map."""
    pipe.__dict__["_fluxserve_previewer"] = LatentPreviewer(pipe, by_vae=True)


def previewer_of(pipe: Any) -> LatentPreviewer:
    """The pipeline's previewer (one per diffusers pipeline object; the edit pipelines share their base's VAE)."""
    return pipe.__dict__.setdefault("_fluxserve_previewer", LatentPreviewer(pipe))  # unfitted until first used

