"""Train the `toy` preset: a small FLUX.1 pipeline that draws what its caption says (model/toy/scenes.py's world).

    python -m model.toy.train --out model/toy/flux-toy            # on the H200 (the timings in the results file)

1. Tokenizers built in code from captions of the grammar (one token per word). CLIP-L / T5 layouts at toy width.
2. The FLUX VAE layout (16 latent channels, 8x) trained as an autoencoder on rendered scenes, shape pixels
   weighted up (they are a few percent of an image and all the checker reads). Its scaling/shift factors are then
   set from the latents' statistics, and the checker's score of its reconstructions is reported: no transformer
   drawing through this VAE scores better. `--resume F --tune-decoder-seconds N --transformer-seconds 0` trains
   only the decoder of F's VAE (encoder frozen: same latents, so F's transformer stays valid).
3. A small FLUX.1 transformer (diffusers' FluxTransformer2DModel, so diffusers' parameter names; 256x256 images:
   256 image tokens) trained with rectified flow on the VAE latents of captioned scenes (velocity target
   noise - x0, sigma ~ logit-normal), for a fixed wall-time budget, *together with both text encoders*, fed
   exactly as FluxPipeline.encode_prompt feeds them. A frozen random T5 turns a caption into a bag of words (the
   vector of "red" hardly depends on which shape it names), and FLUX gives text tokens no position, so the
   transformer could not tell which colour goes with which shape. A small probe that reads the scene back from
   T5's tokens (per grid cell: colour, kind, size; and the background) adds an auxiliary loss on the T5, so the
   encoder learns the binding early; the probe is not part of the pipeline. At several sizes (`--sizes`), an
   extent head (`Trainee`, `--extent-weight`) asks the image stream after the double blocks for each token's place
   as fractions of the image's sides, which a caption's places are.
4. The pipeline saved in diffusers format (float16 weights, the exponential moving average of the trained ones),
   loaded later by `model.loading.load_pipeline` like any FLUX.1 folder.

Seeded (scenes, initial weights, batches). A GPU run reproduces the same *distribution* of results, not the same
bits: the transformer trains for a time budget, and GPU kernels do not promise run-to-run bitwise equality.
Precision: bf16 autocast when a one-step probe in a child process passes, else fp32 with TF32 (the first run's
bf16 backward failed with CUBLAS_STATUS_EXECUTION_FAILED; the probe records which attention backends work).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.request import parse_size
from model.toy.scenes import BACKGROUNDS, KINDS, PLACES, SHAPE_COLOURS, SIZES, Scene, caption, render_batch, sample_scene

SIZE = 256
T5_TOKENS = 40
CLIP_TOKENS = 77
TRANSFORMER = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=4,
                   attention_head_dim=32, num_attention_heads=6, joint_attention_dim=64, pooled_projection_dim=64,
                   guidance_embeds=False, axes_dims_rope=(8, 12, 12))
CLIP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, projection_dim=64)
# 32 buckets: relative offsets up to 8 (a whole shape phrase) are told apart exactly
T5 = dict(d_model=64, d_ff=256, d_kv=16, num_heads=4, num_layers=3, relative_attention_num_buckets=32,
          relative_attention_max_distance=64)
VAE = dict(block_out_channels=(16, 32, 64, 64), layers_per_block=1, norm_num_groups=16, sample_size=SIZE)
# FLUX's resolution-dependent shift (FluxPipeline computes mu from the image's token count): none at 256 tokens
# (256x256), a shift of e^1.1 = 3 at 4096 (1024x1024), linear in the token count between; training draws its noise
# levels through the same shift (`shifted_sigmas`)
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_image_seq_len=256,
                 max_image_seq_len=4096, base_shift=0.0, max_shift=1.1, time_shift_type="exponential")
# The sizes the transformer trains at (OpenAI's "WxH"): squares from 256 to 1024, and 16:9 / 9:16 near 0.6 and 1 MP
SIZES_TRAINED = ("256x256", "384x384", "512x512", "768x768", "1024x1024", "1024x576", "576x1024", "1360x768",
                 "768x1360")
TRAIN_SCENES = 120000  # default size of the captioned training set
_SCENE_SEED_OFFSET = 2  # the training scenes' stream: random.Random(seed + 2), apart from the VAE's and the model's


def training_scenes(n: int = TRAIN_SCENES, seed: int = 0) -> list:
    """The captioned scenes the transformer trains on (run seed `seed`); held-out prompts avoid their captions."""
    rng = random.Random(seed + _SCENE_SEED_OFFSET)
    return [sample_scene(rng) for _ in range(n)]


def toy_corpus(n: int = 3000, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [caption(sample_scene(rng)) for _ in range(n)]


def toy_t5_tokenizer(lines: list[str]) -> Any:
    """A T5 (unigram) tokenizer whose pieces are the grammar's words, so a caption is one token per word; single
    characters stay as a fallback for anything else. (A sentencepiece model trained on this small, repetitive
    corpus keeps only a few dozen sub-word pieces.)"""
    from transformers import T5TokenizerFast

    words = sorted({w for line in lines for w in line.replace(",", " ").split()})
    chars = sorted({c for line in lines for c in line if not c.isspace()})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -5.0), (",", -1.0)]
    pieces += [("▁" + w, -1.0) for w in words] + [(c, -10.0) for c in chars if c != ","]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=T5_TOKENS)


def build_text(device: str) -> dict[str, Any]:
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from model.tokenizer_build import build_clip_tokenizer

    lines = toy_corpus()
    tokenizer = build_clip_tokenizer(num_merges=200, lines=lines)
    tokenizer_2 = toy_t5_tokenizer(lines)
    clip = CLIPTextModel(CLIPTextConfig(
        **{"vocab_size": len(tokenizer), **CLIP}, max_position_embeddings=CLIP_TOKENS, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    t5 = T5EncoderModel(T5Config(
        **{"vocab_size": len(tokenizer_2), **T5}, feed_forward_proj="gated-gelu", dropout_rate=0.0,
        is_encoder_decoder=False, use_cache=False, pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id))
    return {"tokenizer": tokenizer, "tokenizer_2": tokenizer_2, "text_encoder": clip.to(device).eval(),
            "text_encoder_2": t5.to(device).eval()}


def tokenize(text: dict[str, Any], captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(CLIP ids [N, 77], T5 ids [N, T5_TOKENS]), tokenized as FluxPipeline.encode_prompt does."""
    clip = text["tokenizer"](captions, padding="max_length", max_length=CLIP_TOKENS, truncation=True,
                             return_tensors="pt").input_ids
    t5 = text["tokenizer_2"](captions, padding="max_length", max_length=T5_TOKENS, truncation=True,
                             return_tensors="pt").input_ids
    return clip, t5


def encode_ids(text: dict[str, Any], clip_ids: torch.Tensor, t5_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 sequence embeddings, CLIP pooled embeddings) from token ids, the calls FluxPipeline.encode_prompt makes
    (differentiable: the text encoders train through this)."""
    seq = text["text_encoder_2"](t5_ids, output_hidden_states=False)[0]
    pooled = text["text_encoder"](clip_ids, output_hidden_states=False).pooler_output
    return seq, pooled


class SceneProbe(nn.Module):
    """Reads a scene back from T5's token outputs (training only): one learned query per grid cell says what is
    there (nothing or a colour; its kind and size), one more says the background."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(len(PLACES) + 1, dim) * dim ** -0.5)
        self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.colour = nn.Linear(dim, len(SHAPE_COLOURS) + 1)
        self.kind, self.size = nn.Linear(dim, len(KINDS)), nn.Linear(dim, len(SIZES))
        self.background = nn.Linear(dim, len(BACKGROUNDS))

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        att = torch.softmax(self.queries @ self.key(tokens).transpose(1, 2) / tokens.shape[-1] ** 0.5, dim=-1)
        read = att @ self.value(tokens)  # [B, cells + 1, D]
        cells = read[:, :-1]
        return {"colour": self.colour(cells), "kind": self.kind(cells), "size": self.size(cells),
                "background": self.background(read[:, -1])}


def probe_targets(scenes: list[Scene]) -> dict[str, torch.Tensor]:
    """Per scene and grid cell: colour index + 1 (0: empty), kind and size (-100 where empty); the background."""
    places, colours, bgs = sorted(PLACES), sorted(SHAPE_COLOURS), sorted(BACKGROUNDS)
    colour = torch.zeros(len(scenes), len(places), dtype=torch.long)
    kind = torch.full((len(scenes), len(places)), -100, dtype=torch.long)
    size = kind.clone()
    for i, scene in enumerate(scenes):
        for shape in scene.shapes:
            c = places.index(shape.place)
            colour[i, c] = colours.index(shape.colour) + 1
            kind[i, c], size[i, c] = KINDS.index(shape.kind), SIZES.index(shape.size)
    background = torch.tensor([bgs.index(s.background) for s in scenes])
    return {"colour": colour, "kind": kind, "size": size, "background": background}


def probe_loss(out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(F.cross_entropy(out[k].float().flatten(0, -2), targets[k].flatten(), ignore_index=-100)
               for k in ("colour", "kind", "size", "background"))


def new_vae(device: str) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, act_fn="silu", latent_channels=16,
                         scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,
                         force_upcast=True, mid_block_add_attention=True, **VAE).to(device)


def shape_weights(scenes: list[Scene], x: torch.Tensor, fg_weight: float) -> torch.Tensor:
    """Per-pixel loss weights [B, 1, H, W]: 1 on the background, 1 + fg_weight on shapes. Shapes cover a few percent
    of an image, and everything the checker reads is in them: an unweighted loss lets a VAE blur a small shape's
    colour into its neighbours' and still score well."""
    bg = torch.tensor([BACKGROUNDS[s.background] for s in scenes], device=x.device, dtype=x.dtype) / 127.5 - 1.0
    shape = (x - bg[:, :, None, None]).abs().amax(1, keepdim=True) > 1e-6
    return 1.0 + fg_weight * shape.to(x.dtype)


def fit_vae(vae: Any, device: str, steps: int, batch: int, seed: int, seconds: float = float("inf"),
            decoder_only: bool = False, fg_weight: float = 8.0, lr: float = 1e-3,
            sizes: tuple[str, ...] = (f"{SIZE}x{SIZE}",)) -> dict[str, Any]:
    """Train `vae` as an autoencoder on fresh scenes (shape-weighted L1 + MSE, a tiny KL), cosine learning rate over
    the steps or the time budget. decoder_only: the encoder stays frozen, so the latent space (and a transformer
    trained on it) stays valid while the decoder learns to draw its latents better. Each step draws one of `sizes`
    ('WxH') and `batch` x 256x256 pixels of it (a VAE trained at 256x256 alone reconstructs larger scenes badly)."""
    vae.to(device).train()
    params = list(vae.decoder.parameters()) if decoder_only else list(vae.parameters())
    if decoder_only:
        vae.encoder.requires_grad_(False).eval()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    t0, loss, done = time.time(), torch.tensor(0.0), 0
    for step in range(steps):
        if time.time() - t0 > seconds:
            break
        done = step + 1
        height, width = parse_size(sizes[rng.randrange(len(sizes))] if len(sizes) > 1 else sizes[0])
        scenes = [sample_scene(rng) for _ in range(max(1, batch * SIZE * SIZE // (height * width)))]
        x = render_batch(scenes, (height, width), device)
        w = shape_weights(scenes, x, fg_weight)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            with torch.set_grad_enabled(not decoder_only):
                post = vae.encode(x).latent_dist
            z = post.sample()
            rec = vae.decode(z).sample
        err = rec.float() - x
        loss = (w * (err.abs() + err * err)).mean() / w.mean() + (0.0 if decoder_only else 1e-7 * post.kl().mean())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for g in opt.param_groups:  # cosine over the steps or the time budget, whichever ends first
            frac = max((step + 1) / steps, (time.time() - t0) / seconds)
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        if step % 200 == 0:
            print(f"vae step {step}: loss {loss.item():.4f} ({time.time() - t0:.0f} s)", flush=True)
    vae.requires_grad_(True).eval()
    return {"vae_steps": done, "vae_batch": batch, "vae_loss": float(loss), "vae_seconds": time.time() - t0,
            "vae_decoder_only": decoder_only, "vae_fg_weight": fg_weight, "vae_sizes": list(sizes)}


@torch.no_grad()
def vae_report(vae: Any, device: str, scenes: list[Scene], set_factors: bool,
               size: str = f"{SIZE}x{SIZE}") -> dict[str, float]:
    """Reconstruction figures on `scenes` drawn at `size`: L1 on [-1, 1], and the scene checker's adherence of the
    reconstructions (the ceiling of what a transformer drawing through this VAE can score). set_factors: the
    latents' shift/scaling factors are set from these scenes (a new VAE)."""
    from model.toy.checker import score_all

    h, w = parse_size(size)
    chunk = max(1, 64 * SIZE * SIZE // (h * w))
    x = render_batch(scenes, (h, w), device)
    z = torch.cat([vae.encode(x[i:i + chunk]).latent_dist.mean for i in range(0, len(scenes), chunk)])
    rec = torch.cat([vae.decode(z[i:i + chunk]).sample for i in range(0, len(scenes), chunk)])
    out: dict[str, float] = {"vae_recon_l1": float((rec - x).abs().mean())}
    if set_factors:
        vae.register_to_config(shift_factor=z.mean().item(), scaling_factor=1.0 / z.std().item())
        out.update(shift_factor=vae.config.shift_factor, scaling_factor=vae.config.scaling_factor)
    pixels = ((rec.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    out["vae_recon_adherence"] = score_all(pixels, scenes).fraction
    return out


def train_vae(device: str, steps: int, batch: int, seed: int, seconds: float = float("inf"),
              stats_scenes: int = 256, fg_weight: float = 8.0,
              sizes: tuple[str, ...] = (f"{SIZE}x{SIZE}",)) -> tuple[Any, dict[str, Any]]:
    """A new VAE trained on fresh scenes, its latent shift/scaling factors set from their statistics (at 256x256),
    and its reconstructions reported at each size."""
    vae = new_vae(device)
    report = fit_vae(vae, device, steps, batch, seed, seconds, fg_weight=fg_weight, sizes=sizes)
    rng = random.Random(seed + 1000)
    check = [sample_scene(rng) for _ in range(stats_scenes)]
    report.update(vae_report(vae, device, check, set_factors=True))
    report["vae_by_size"] = {size: vae_report(vae, device, check, set_factors=False, size=size) for size in sizes}
    return vae, report


def image_tokens(height: int, width: int) -> int:
    return (height // 16) * (width // 16)


@functools.lru_cache(maxsize=None)
def _size_shift(height: int, width: int) -> tuple[Any, float]:
    """(a scheduler of SCHEDULER, the mu FluxPipeline computes at this size): made once per size, not per step."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    mu = calculate_shift(image_tokens(height, width), SCHEDULER["base_image_seq_len"],
                         SCHEDULER["max_image_seq_len"], SCHEDULER["base_shift"], SCHEDULER["max_shift"])
    return FlowMatchEulerDiscreteScheduler(**SCHEDULER), mu


def shifted_sigmas(sigma: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Noise levels moved by the shift a FluxPipeline run at this size samples with (diffusers' own mu and shift
    functions, from SCHEDULER), so training and sampling agree on what a noise level means at each size."""
    scheduler, mu = _size_shift(height, width)
    return scheduler.time_shift(mu, 1.0, sigma)


@torch.no_grad()
def encode_images(vae: Any, scenes: list, device: str, chunk: int = 256,
                  size: tuple[int, int] = (SIZE, SIZE)) -> torch.Tensor:
    """Packed latents [N, tokens, 64] (bf16) of the scenes drawn at size (height, width)."""
    from diffusers import FluxPipeline

    height, width = size
    chunk = max(1, chunk * SIZE * SIZE // (height * width))
    out = []
    for i in range(0, len(scenes), chunk):
        x = render_batch(scenes[i:i + chunk], size, device)
        z = (vae.encode(x).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
        out.append(FluxPipeline._pack_latents(z, z.shape[0], 16, height // 8, width // 8).to(torch.bfloat16))
    return torch.cat(out)


class Bucket:
    """The training latents of one size: scene indices into the captioned set, and their packed latents."""

    def __init__(self, size: str, index: torch.Tensor, latents: torch.Tensor, weight: float = 1.0) -> None:
        self.size, self.index, self.latents, self.weight = size, index, latents, weight
        self.height, self.width = parse_size(size)
        self.tokens = image_tokens(self.height, self.width)


def make_buckets(vae: Any, scenes: list[Scene], sizes: list[str], device: str, tokens_per_size: int,
                 seed: int) -> list[Bucket]:
    """Per size, a random subset of the captioned scenes (about `tokens_per_size` image tokens of them) encoded at
    that size; 256x256 counts twice in the draw of a step's size (the size most requests use)."""
    g = torch.Generator().manual_seed(seed)
    buckets = []
    for size in sizes:
        h, w = parse_size(size)
        n = min(len(scenes), max(1, tokens_per_size // image_tokens(h, w)))
        index = torch.randperm(len(scenes), generator=g)[:n]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            latents = encode_images(vae, [scenes[i] for i in index.tolist()], device, size=(h, w))
        buckets.append(Bucket(size, index.to(device), latents, weight=2.0 if size == f"{SIZE}x{SIZE}" else 1.0))
        print(f"bucket {size}: {n} scenes", flush=True)
    return buckets


def _attention_backends(name: str) -> Any:
    """A context choosing SDPA backends for training: 'default' (torch's own choice) or 'flash' (flash, then
    memory-efficient)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "default":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def extent_targets(img_ids: torch.Tensor) -> torch.Tensor:
    """[tokens, 2]: each image token's centre as fractions of the image's height and width (what the extent head
    reads from the image stream), from FluxPipeline's image ids (0, row, column)."""
    rows, cols = img_ids[:, 1].max() + 1, img_ids[:, 2].max() + 1
    return torch.stack([(img_ids[:, 1] + 0.5) / rows, (img_ids[:, 2] + 0.5) / cols], dim=-1)


class Trainee(nn.Module):
    """Everything that trains in stage 3: the transformer, both text encoders, the T5 probe and the extent head.

    The extent head (training only, like the probe) reads each image token's place as fractions of the image's
    sides from the image stream after the double blocks. FLUX's RoPE and the text tokens at position zero tell a
    token where it is in tokens, not how large the image is; a caption's "right third" is a fraction of the width,
    so a model that draws at several sizes has to work the extent out from attention over the whole image. The
    head's loss asks for that early instead of leaving it to the flow loss alone (`--extent-weight`; 0: off)."""

    def __init__(self, text: dict[str, Any]) -> None:
        from diffusers import FluxTransformer2DModel

        super().__init__()
        self.transformer = FluxTransformer2DModel(**TRANSFORMER)
        self.clip, self.t5 = text["text_encoder"], text["text_encoder_2"]
        self.probe = SceneProbe(T5["d_model"])
        # made last: the random streams of everything above are those of runs made before the head existed
        self.extent = nn.Linear(self.transformer.inner_dim, 2)

    def losses(self, x0: torch.Tensor, clip_ids: torch.Tensor, t5_ids: torch.Tensor, targets: dict[str, torch.Tensor],
               noise: torch.Tensor, sigma: torch.Tensor, img_ids: torch.Tensor, txt_ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flow loss, T5 probe loss, extent loss)."""
        seq, pooled = encode_ids({"text_encoder": self.clip, "text_encoder_2": self.t5}, clip_ids, t5_ids)
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        kept: list[torch.Tensor] = []
        # a double block returns (text stream, image stream)
        hook = self.transformer.transformer_blocks[-1].register_forward_hook(lambda m, a, out: kept.append(out[1]))
        try:
            pred = self.transformer(hidden_states=xt, encoder_hidden_states=seq, pooled_projections=pooled,
                                    timestep=sigma, img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
        finally:
            hook.remove()
        where = self.extent(kept[-1]).float()
        extent = F.mse_loss(where, extent_targets(img_ids).to(where).expand_as(where))
        return F.mse_loss(pred.float(), noise - x0), probe_loss(self.probe(seq), targets), extent


def train_transformer(trainee: Trainee, buckets: list[Bucket], clip_ids: torch.Tensor, t5_ids: torch.Tensor,
                      targets: dict[str, torch.Tensor], device: str, seconds: float, batch: int, seed: int,
                      precision: str = "fp32", attention: str = "default", probe_weight: float = 0.1,
                      ema_decay: float = 0.999, max_steps: int | None = None, lr: float = 6e-4,
                      warmup: int = 300, extent_weight: float = 0.0) -> dict[str, Any]:
    """Train `trainee` in place for `seconds` (or `max_steps`); its weights end as their moving average. Each step
    draws one size (by the buckets' weights) and about `batch` x 256 image tokens of it: batch x 256 / tokens
    images, so every step costs about the same."""
    from diffusers import FluxPipeline

    torch.manual_seed(seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    trainee.to(device).train()
    params = [p for p in trainee.parameters()]
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    img_ids = [FluxPipeline._prepare_latent_image_ids(1, b.height // 16, b.width // 16, device, torch.float32)
               for b in buckets]
    txt_ids = torch.zeros(T5_TOKENS, 3, device=device)
    g = torch.Generator(device).manual_seed(seed)
    pick = torch.Generator().manual_seed(seed)
    weights = torch.tensor([b.weight for b in buckets])
    t0, step, flow_hist, probe_hist, extent_hist = time.time(), 0, [], [], []
    flow_by_size: dict[str, list[float]] = {b.size: [] for b in buckets}
    steps_by_size = {b.size: 0 for b in buckets}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16")
    while time.time() - t0 < seconds and (max_steps is None or step < max_steps):
        k = int(torch.multinomial(weights, 1, generator=pick))
        b = buckets[k]
        rows = max(1, batch * 256 // b.tokens)
        pos = torch.randint(0, b.latents.shape[0], (rows,), device=device, generator=g)
        idx = b.index[pos]
        x0 = b.latents[pos].float()
        noise = torch.randn(x0.shape, device=device, generator=g)
        sigma = shifted_sigmas(torch.sigmoid(torch.randn(rows, device=device, generator=g)), b.height, b.width)
        with autocast, _attention_backends(attention):
            flow, probe, extent = trainee.losses(x0, clip_ids[idx], t5_ids[idx],
                                                 {k: v[idx] for k, v in targets.items()}, noise, sigma, img_ids[k],
                                                 txt_ids)
            loss = flow + probe_weight * probe + extent_weight * extent
        steps_by_size[b.size] += 1
        if steps_by_size[b.size] % 20 == 0:
            flow_by_size[b.size].append(flow.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        frac = min(1.0, (time.time() - t0) / seconds) if max_steps is None else step / max_steps
        for grp in opt.param_groups:  # linear warm-up, then cosine over the time budget
            grp["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - min(ema_decay, (1 + step) / (10 + step)))
        if step % 50 == 0:
            flow_hist.append(flow.item())
            probe_hist.append(probe.item())
            extent_hist.append(extent.item())
        if step % 1000 == 0:
            print(f"transformer step {step}: flow {flow.item():.4f} probe {probe.item():.4f} "
                  f"extent {extent.item():.4f} ({time.time() - t0:.0f} s)", flush=True)
        step += 1
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    trainee.eval()

    def tail(h: list[float]) -> float:
        return float(sum(h[-20:]) / max(1, len(h[-20:])))

    return {"transformer_steps": step, "transformer_seconds": time.time() - t0,
            "transformer_final_loss": tail(flow_hist), "probe_final_loss": tail(probe_hist),
            "extent_final_loss": tail(extent_hist), "extent_weight": extent_weight,
            "transformer_params": sum(p.numel() for p in trainee.transformer.parameters()),
            "precision": precision, "attention": attention, "steps_by_size": steps_by_size,
            "final_loss_by_size": {k: tail(v) if v else None for k, v in flow_by_size.items()}}


def probe_precision(attention: str, device: str = "cuda", batch: int = 256) -> None:
    """One bf16 training step of the real shapes on random data (run in a child process by `choose_precision`)."""
    torch.manual_seed(0)
    text = build_text(device)
    trainee = Trainee(text)
    scenes = [sample_scene(random.Random(i)) for i in range(batch)]
    clip_ids, t5_ids = tokenize(text, [caption(s) for s in scenes])
    targets = {k: v.to(device) for k, v in probe_targets(scenes).items()}
    latents = torch.randn(batch, (SIZE // 16) ** 2, 64, device=device, dtype=torch.bfloat16)
    bucket = Bucket(f"{SIZE}x{SIZE}", torch.arange(batch, device=device), latents)
    train_transformer(trainee, [bucket], clip_ids.to(device), t5_ids.to(device), targets, device, 60.0, batch, 0,
                      precision="bf16", attention=attention, max_steps=3)
    torch.cuda.synchronize()


def choose_precision(device: str) -> tuple[str, str, dict[str, Any]]:
    """(precision, attention backends, what each probe said): bf16 where a child-process probe passes."""
    if not device.startswith("cuda"):
        return "fp32", "default", {}
    said: dict[str, Any] = {}
    for attention in ("default", "flash"):
        r = subprocess.run([sys.executable, "-m", "model.toy.train", "--probe-bf16", attention, "--device", device],
                           capture_output=True, text=True, timeout=300, env=os.environ)
        said[attention] = "ok" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1][:300]
        print(f"bf16 probe ({attention} attention): {said[attention]}", flush=True)
        if r.returncode == 0:
            return "bf16", attention, said
    return "fp32", "default", said


def load_trained(folder: Path, device: str) -> tuple[dict[str, Any], Any, Any]:
    """(text components, VAE, transformer) of a folder this script wrote, in float32 on `device`."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    f32 = dict(torch_dtype=torch.float32)
    text = {"tokenizer": AutoTokenizer.from_pretrained(folder / "tokenizer"),
            "tokenizer_2": AutoTokenizer.from_pretrained(folder / "tokenizer_2"),
            "text_encoder": CLIPTextModel.from_pretrained(folder / "text_encoder", **f32).to(device),
            "text_encoder_2": T5EncoderModel.from_pretrained(folder / "text_encoder_2", **f32).to(device)}
    vae = AutoencoderKL.from_pretrained(folder / "vae", **f32).to(device).eval()
    return text, vae, FluxTransformer2DModel.from_pretrained(folder / "transformer", **f32)


def _statement_sizes(folder: Path) -> list[str]:
    """The sizes a folder this script wrote says it was trained at (a decoder-only run keeps them)."""
    from model.loading import trained_sizes

    return trained_sizes(str(folder)) or [f"{SIZE}x{SIZE}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "flux-toy"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vae-steps", type=int, default=1500)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--vae-seconds", type=float, default=90.0, help="stop the VAE earlier than --vae-steps")
    ap.add_argument("--vae-stats-scenes", type=int, default=256)
    ap.add_argument("--vae-fg-weight", type=float, default=8.0, help="extra loss weight on shape pixels")
    ap.add_argument("--tune-decoder-seconds", type=float, default=0.0,
                    help="with --resume: first train the VAE decoder alone (encoder frozen: same latents) this long")
    ap.add_argument("--tune-decoder-lr", type=float, default=3e-4)
    ap.add_argument("--tune-encoder", action="store_true",
                    help="with --tune-decoder-seconds: the encoder trains too (new latents: train the transformer on)")
    ap.add_argument("--vae-sizes", nargs="+", default=[f"{SIZE}x{SIZE}"],
                    help="sizes ('WxH') the VAE (or its tuning) trains at; its report covers each")
    ap.add_argument("--scenes", type=int, default=TRAIN_SCENES)
    ap.add_argument("--transformer-seconds", type=float, default=270.0)
    ap.add_argument("--transformer-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    ap.add_argument("--batch", type=int, default=256, help="images of 256x256 per step (fewer of larger sizes)")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES_TRAINED), help="sizes to train at ('WxH')")
    ap.add_argument("--tokens-per-size", type=int, default=6_000_000,
                    help="image tokens of training latents per size (256 per 256x256 image)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=300, help="learning-rate warm-up steps")
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    ap.add_argument("--probe-weight", type=float, default=0.1)
    ap.add_argument("--extent-weight", type=float, default=0.0,
                    help="weight of the extent head's loss (each image token's place as fractions of the sides)")
    ap.add_argument("--resume", default=None, help="a folder this script wrote: keep its VAE and tokenizers, and go "
                    "on training its transformer and text encoders")
    ap.add_argument("--report", default=None, help="JSON with the training figures (default: <out>/train.json)")
    ap.add_argument("--probe-bf16", choices=("default", "flash"), default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.probe_bf16:
        probe_precision(a.probe_bf16, a.device)
        return 0
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    t_start = time.time()
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    if a.precision == "auto":
        precision, attention, probes = choose_precision(a.device)
    else:
        precision, attention, probes = a.precision, "flash" if a.precision == "bf16" else "default", {}
    if a.resume:
        text, vae, start = load_trained(Path(a.resume), a.device)
        report: dict[str, Any] = {"resumed_from": a.resume}
        if a.tune_decoder_seconds > 0:
            check = [sample_scene(random.Random(a.seed + 1000 + i)) for i in range(a.vae_stats_scenes)]

            def by_size() -> dict[str, dict[str, float]]:
                return {size: vae_report(vae, a.device, check, set_factors=False, size=size) for size in a.vae_sizes}

            report["before_decoder_tuning"] = by_size()
            report.update(fit_vae(vae, a.device, a.vae_steps, a.vae_batch, a.seed + 4, a.tune_decoder_seconds,
                                  decoder_only=not a.tune_encoder, fg_weight=a.vae_fg_weight, lr=a.tune_decoder_lr,
                                  sizes=tuple(a.vae_sizes)))
            report["vae_by_size"] = by_size()
            print(f"VAE tuned: {report}", flush=True)
    else:
        text, start = build_text(a.device), None
        vae, report = train_vae(a.device, a.vae_steps, a.vae_batch, a.seed + 1, a.vae_seconds, a.vae_stats_scenes,
                                a.vae_fg_weight, tuple(a.vae_sizes))
        print(f"vae: {report}", flush=True)
    report["bf16_probes"] = probes
    trainee = Trainee(text)
    if start is not None:
        trainee.transformer.load_state_dict(start.state_dict())
    if a.transformer_seconds > 0:  # (0: keep the resumed transformer and text encoders as they are)
        scenes = training_scenes(a.scenes, a.seed)
        t0 = time.time()
        clip_ids, t5_ids = tokenize(text, [caption(s) for s in scenes])
        targets = {k: v.to(a.device) for k, v in probe_targets(scenes).items()}
        buckets = make_buckets(vae, scenes, a.sizes, a.device, a.tokens_per_size, a.seed + 5)
        report["dataset_seconds"] = time.time() - t0
        report["scenes"] = a.scenes
        report["scenes_by_size"] = {b.size: int(b.latents.shape[0]) for b in buckets}
        print(f"dataset: {a.scenes} scenes, {report['scenes_by_size']} in {report['dataset_seconds']:.0f} s",
              flush=True)
        report.update(train_transformer(trainee, buckets, clip_ids.to(a.device), t5_ids.to(a.device), targets,
                                        a.device, a.transformer_seconds, a.batch, a.seed + 3, precision, attention,
                                        a.probe_weight, max_steps=a.transformer_steps, lr=a.lr, warmup=a.warmup,
                                        extent_weight=a.extent_weight))
        del buckets
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae.to(torch.float16),
                        transformer=trainee.transformer.to(torch.float16),
                        text_encoder=trainee.clip.to(torch.float16), text_encoder_2=trainee.t5.to(torch.float16),
                        tokenizer=text["tokenizer"], tokenizer_2=text["tokenizer_2"])
    out = Path(a.out)
    pipe.save_pretrained(out, safe_serialization=True)
    from model.loading import write_statement

    # what /v1/models states (requests at other sizes are told), and previews by its VAE (a decode costs little here)
    write_statement(out, trained_sizes=list(a.sizes) if a.transformer_seconds > 0 or not a.resume
                    else _statement_sizes(Path(a.resume)), previews="vae")
    report["weights_mb"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    report["total_seconds"] = time.time() - t_start
    report["command"] = "python -m model.toy.train " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(a.report or out / "train.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
