"""FLUX.1 presets (and FLUX.1 Kontext ones), offline: random-weight ones built deterministically in code, and a
trained one shipped.

- `tiny` (default) and `tiny-schnell`: every code path of the real pipeline (CLIP + T5 text encoders, guidance
  embedding for `tiny`, none for `tiny-schnell`, a 4-level VAE with 16 latent channels) at toy sizes. Built once on
  the CPU in float32 from a fixed seed, saved in diffusers format under the cache dir (env FLUXSERVE_CACHE, default
  ~/.cache/fluxserve), then loaded through the same `load_pipeline` path as a real checkpoint.
- `tiny-kontext`: `tiny` in FLUX.1 Kontext's pipeline (image-conditioned edits).
- `flux-dev-random` / `flux-schnell-random` / `flux-kontext-random`: the full FLUX.1 architecture (19 + 38 blocks,
  3072 hidden, T5-XXL and CLIP-L sized encoders, the FLUX VAE) with random weights, for GPU benchmarks. ~24 GB in
  bf16, so they are built directly on the target device in memory and never written to disk.

- `toy`: trained (model/toy/train.py) to draw captions of a procedural scene world (model/toy/scenes.py) at
  256x256; its weights are shipped in the repository (`SHIPPED`), so nothing is built or downloaded.

The saved folders use diffusers' own classes (FluxTransformer2DModel etc.), so they are plain FLUX.1 folders that
stock diffusers can load too; our transformer is substituted at load time.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from model.family import ModelFamily, family_of

if TYPE_CHECKING:  # torch is imported where weights are built: naming presets (the CLI's help) loads no torch
    import torch

# Bump when a preset recipe changes: cached folders of older recipes are then ignored, not silently reused.
PRESET_VERSION = 1
_COMPLETE_MARKER = ".fluxserve-complete"


@dataclass(frozen=True)
class PresetSpec:
    name: str
    transformer: dict[str, Any]
    clip: dict[str, Any]
    t5: dict[str, Any]
    vae: dict[str, Any]
    scheduler: dict[str, Any]
    clip_max_length: int = 77
    t5_max_length: int = 512
    on_disk: bool = True  # False: built in memory on the target device (too big to round-trip through disk)
    pipeline: str = "FluxPipeline"  # the diffusers pipeline class (model_index.json's `_class_name`): the family
    seed: int = 0
    notes: str = field(default="", compare=False)


_DEV_SCHEDULER = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096,
)
_SCHNELL_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)

_TINY_TRANSFORMER = dict(
    patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=2, attention_head_dim=32,
    num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
    axes_dims_rope=(8, 12, 12),
)
_TINY_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=32)
_TINY_T5 = dict(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, relative_attention_num_buckets=8,
                relative_attention_max_distance=32)
_TINY_VAE = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, sample_size=256)

_FULL_TRANSFORMER = dict(
    patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# CLIP ViT-L/14 text tower and T5 v1.1 XXL encoder sizes (as used by FLUX.1).
_FULL_CLIP = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  projection_dim=768, vocab_size=49408)
_FULL_T5 = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, vocab_size=32128)
_FULL_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32, sample_size=1024)

PRESETS: dict[str, PresetSpec] = {
    "tiny": PresetSpec("tiny", _TINY_TRANSFORMER, _TINY_CLIP, _TINY_T5, _TINY_VAE, _DEV_SCHEDULER, t5_max_length=32,
                       notes="FLUX.1-dev-like toy: guidance embedding, 2+2 blocks, 4 heads of 32"),
    "tiny-schnell": PresetSpec("tiny-schnell", {**_TINY_TRANSFORMER, "guidance_embeds": False}, _TINY_CLIP,
                               _TINY_T5, _TINY_VAE, _SCHNELL_SCHEDULER, t5_max_length=32,
                               notes="FLUX.1-schnell-like toy: no guidance embedding"),
    "flux-dev-random": PresetSpec("flux-dev-random", _FULL_TRANSFORMER, _FULL_CLIP, _FULL_T5, _FULL_VAE,
                                  _DEV_SCHEDULER, on_disk=False, notes="FLUX.1-dev architecture, random weights"),
    "flux-schnell-random": PresetSpec("flux-schnell-random", {**_FULL_TRANSFORMER, "guidance_embeds": False},
                                      _FULL_CLIP, _FULL_T5, _FULL_VAE, _SCHNELL_SCHEDULER, t5_max_length=256,
                                      on_disk=False, notes="FLUX.1-schnell architecture, random weights"),
    "tiny-kontext": PresetSpec("tiny-kontext", _TINY_TRANSFORMER, _TINY_CLIP, _TINY_T5, _TINY_VAE, _DEV_SCHEDULER,
                               t5_max_length=32, pipeline="FluxKontextPipeline",
                               notes="FLUX.1 Kontext-like toy: tiny's architecture in FluxKontextPipeline"),
    "flux-kontext-random": PresetSpec("flux-kontext-random", _FULL_TRANSFORMER, _FULL_CLIP, _FULL_T5, _FULL_VAE,
                                      _DEV_SCHEDULER, on_disk=False, pipeline="FluxKontextPipeline",
                                      notes="FLUX.1 Kontext [dev] architecture, random weights"),
}


# Presets shipped as trained weights in the repository (diffusers format; model/toy/train.py made them), loaded
# like any local FLUX.1 folder.
SHIPPED: dict[str, Path] = {"toy": Path(__file__).resolve().parent / "toy" / "flux-toy"}


def preset_names() -> list[str]:
    return [*PRESETS, *SHIPPED]


def preset_family(name: str) -> ModelFamily:
    """The model family of random-weights preset `name` (nothing is built)."""
    return family_of(_spec(name).pipeline)


def preset_folder(name: str) -> Path | None:
    """The folder preset `name` loads from: its shipped folder, or its cache folder (built on first use); None for
    a preset built in memory on the target device."""
    if name in SHIPPED:
        return SHIPPED[name]
    return ensure_preset(name) if _spec(name).on_disk else None


def cache_dir() -> Path:
    """Where on-disk presets live: $FLUXSERVE_CACHE, else ~/.cache/fluxserve."""
    env = os.environ.get("FLUXSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fluxserve"


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point parameters directly in `dtype` inside this block."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_components(name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                     seed: int | None = None) -> dict[str, Any]:
    """Build a preset's FluxPipeline components with diffusers'/transformers' own classes and random weights.

    Parameters are created directly on `device` in `dtype` (default float32; no float32 copy, no host round trip):
    this is what makes the full-size presets quick to make on a GPU. Deterministic for a given seed, device and dtype.
    """
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from model.tokenizer_build import build_clip_tokenizer, build_t5_tokenizer

    spec = _spec(name)
    tokenizer = build_clip_tokenizer(model_max_length=spec.clip_max_length)
    tokenizer_2 = build_t5_tokenizer(model_max_length=spec.t5_max_length)

    clip_cfg = CLIPTextConfig(
        **{"vocab_size": len(tokenizer), **spec.clip},
        max_position_embeddings=spec.clip_max_length, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    t5_cfg = T5Config(
        **{"vocab_size": len(tokenizer_2), **spec.t5},
        feed_forward_proj="gated-gelu", dropout_rate=0.0, is_encoder_decoder=False, use_cache=False,
        pad_token_id=tokenizer_2.pad_token_id, eos_token_id=tokenizer_2.eos_token_id,
    )
    vae_cfg = dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, act_fn="silu", latent_channels=16, scaling_factor=0.3611,
        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, force_upcast=True,
        mid_block_add_attention=True, **spec.vae,
    )
    torch.manual_seed(spec.seed if seed is None else seed)
    with torch.device(device), default_dtype(torch.float32 if dtype is None else dtype), torch.no_grad():
        transformer = FluxTransformer2DModel(**spec.transformer)
        text_encoder = CLIPTextModel(clip_cfg)
        text_encoder_2 = T5EncoderModel(t5_cfg)
        vae = AutoencoderKL(**vae_cfg)
    for module in (transformer, text_encoder, text_encoder_2, vae):
        module.eval()
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**spec.scheduler), vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
    )


def save_preset(name: str, dest: str | os.PathLike[str]) -> Path:
    """Build preset `name` on the CPU in float32 and save it in diffusers format to `dest` (must not exist)."""
    spec = _spec(name)
    if not spec.on_disk:
        raise ValueError(f"preset {name!r} is built in memory only (too large to cache on disk)")
    dest = Path(dest)
    pipeline = family_of(spec.pipeline).pipeline_classes()["text"]
    pipeline(**build_components(name, "cpu")).save_pretrained(dest, safe_serialization=True)
    return dest


def ensure_preset(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder of on-disk preset `name`, building it first if the cache does not have it.

    The build goes to a temporary folder next to the final one and is renamed into place, so a crash or a
    concurrent builder never leaves a half-written preset behind (the loser of a race discards its copy).
    """
    root = Path(cache_dir) if cache_dir is not None else globals()["cache_dir"]()
    final = root / f"{name}-v{PRESET_VERSION}"
    if (final / _COMPLETE_MARKER).is_file():
        return final
    _spec(name)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-build-{uuid.uuid4().hex[:8]}-", dir=root))
    try:
        save_preset(name, tmp / "pipe")
        (tmp / "pipe" / _COMPLETE_MARKER).write_text(f"{name} v{PRESET_VERSION}\n")
        try:
            os.rename(tmp / "pipe", final)
        except OSError:
            if not (final / _COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def folder_digest(path: str | os.PathLike[str]) -> dict[str, str]:
    """md5 of every file under `path` (relative path -> hex digest), for build-determinism checks."""
    path = Path(path)
    out = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        out[str(f.relative_to(path))] = hashlib.md5(f.read_bytes()).hexdigest()
    return out


def _spec(name: str) -> PresetSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}") from None
