"""Inputs several test files build: random FLUX transformers, random PNGs and masks for edits, random LoRA files."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import torch

def random_flux(cls: type | None = None, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, std: float = 0.02,
                seed: int = 0, **config) -> torch.nn.Module:
    """A FLUX transformer (ours unless `cls`, e.g. diffusers' FluxTransformer2DModel) in eval mode with seeded
    N(0, std) weights: std 0.02 keeps the residual stream's variance near a trained model's."""
    if cls is None:
        from model.flux import FluxTransformer as cls  # noqa: N813
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(**config).to(dtype).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * std)
    return model


LORA_TARGETS = ("attn.to_q", "attn.to_v", "attn.to_out.0", "ff.net.2", "proj_out", "proj_mlp")


def random_png(seed: int, size: tuple[int, int] = (64, 64), mask: bool = False) -> bytes:
    """Random RGB noise as PNG bytes; mask=True: black with a white (repaint) square in the middle."""
    from PIL import Image

    w, h = size
    if mask:
        arr = torch.zeros(h, w, 3, dtype=torch.uint8)
        arr[h // 4: 3 * h // 4, w // 4: 3 * w // 4] = 255
    else:
        arr = (torch.rand(h, w, 3, generator=torch.Generator().manual_seed(seed)) * 255).to(torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr.numpy()).save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    """PNG bytes as the base64 data: URL of OpenAI's JSON edit (`images: [{"image_url": ...}]`)."""
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode()


def write_random_lora(transformer: torch.nn.Module, path: Path, seed: int, rank: int = 4,
                      targets: tuple[str, ...] = LORA_TARGETS, std: float = 0.2,
                      text_encoder: torch.nn.Module | None = None, b_std: float | None = None) -> Path:
    """A random adapter in diffusers/PEFT key format on every block linear whose name ends with one of `targets`;
    with `text_encoder` (CLIP), on its attention projections too. B's entries have `b_std` (default `std`)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    sd = {}
    parts = [("transformer", transformer, "blocks.", targets)]
    if text_encoder is not None:
        parts.append(("text_encoder", text_encoder, "layers.", ("q_proj", "k_proj", "v_proj", "out_proj")))
    for prefix, model, inside, ends in parts:
        for name, mod in model.named_modules():
            if inside in name and name.endswith(ends) and isinstance(mod, torch.nn.Linear):
                sd[f"{prefix}.{name}.lora_A.weight"] = torch.randn(rank, mod.in_features, generator=g) * std
                sd[f"{prefix}.{name}.lora_B.weight"] = torch.randn(mod.out_features, rank, generator=g) * (
                    std if b_std is None else b_std)
    save_file(sd, str(path))
    return path


def write_random_kohya_lora(path: Path, seed: int, inner: int, num_double: int, rank: int = 4) -> Path:
    """A random adapter in kohya (sd-scripts) keys on the double blocks' fused qkv, proj and MLP-down layers (the
    single blocks' fused linear1 is split by diffusers at FLUX.1's width only, so toy models leave it out)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(num_double):
        for name, (n_in, n_out) in {"img_attn_qkv": (inner, 3 * inner), "txt_attn_qkv": (inner, 3 * inner),
                                    "img_attn_proj": (inner, inner), "img_mlp_2": (4 * inner, inner)}.items():
            key = f"lora_unet_double_blocks_{i}_{name}"
            sd[f"{key}.lora_down.weight"] = torch.randn(rank, n_in, generator=g) * 0.2
            sd[f"{key}.lora_up.weight"] = torch.randn(n_out, rank, generator=g) * 0.2
            sd[f"{key}.alpha"] = torch.tensor(float(rank) / 2)
    save_file(sd, str(path))
    return path


def png_psnr(a: bytes, b: bytes) -> float:
    """PSNR in dB between two PNG images (8-bit RGB); inf when they are equal."""
    import io
    import math

    import numpy as np
    from PIL import Image

    x, y = (np.asarray(Image.open(io.BytesIO(p)).convert("RGB")).astype(np.float64) for p in (a, b))
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


@functools.lru_cache(maxsize=4)
def png_bomb(width: int, height: int) -> bytes:
    """A valid RGB PNG of width x height black pixels that is small on the wire (its rows compress to almost
    nothing): a decompression bomb, for tests that must refuse it before decoding. Built row by row, so making it
    never holds the pixels either."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    comp, row, parts = zlib.compressobj(9), b"\0" * (1 + 3 * width), []
    for _ in range(height):
        parts.append(comp.compress(row))
    parts.append(comp.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")
