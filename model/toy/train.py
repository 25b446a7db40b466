"""Train the `toy` preset: a small FLUX.1 pipeline that draws what its caption says (model/toy/scenes.py's world).

    python -m model.toy.train --out model/toy/weights            # on the H200 (the timings in the results file)

1. Tokenizers built in code from captions of the grammar. CLIP-L / T5 layouts at toy width, random and frozen:
   each word still reaches the transformer as its own vector, through FluxPipeline's real text path.
2. The FLUX VAE layout (16 latent channels, 8x) trained as an autoencoder on rendered scenes. Its
   scaling/shift factors are then set from the latents' statistics.
3. A small FLUX.1 transformer (diffusers' FluxTransformer2DModel, so diffusers' parameter names; 256x256 images:
   256 image tokens) trained with rectified flow on the VAE latents of captioned scenes (velocity target
   noise - x0, sigma ~ logit-normal), for a fixed wall-time budget.
4. The pipeline saved in diffusers format (float16 weights), loaded later by `model.loading.load_pipeline` like any
   FLUX.1 folder.

Seeded (scenes, initial weights, batches). A GPU run reproduces the same *distribution* of results, not the same
bits: the transformer trains for a time budget, and GPU kernels do not promise run-to-run bitwise equality. The
first run (bench/results/toy-train-h200.md) is too short to follow its captions. The transformer trains in fp32:
bf16 autocast failed there in its first backward.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from model.toy.scenes import caption, render_batch, sample_scene

SIZE = 256
T5_TOKENS = 40
TRANSFORMER = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=4,
                   attention_head_dim=32, num_attention_heads=6, joint_attention_dim=64, pooled_projection_dim=64,
                   guidance_embeds=False, axes_dims_rope=(8, 12, 12))
CLIP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, projection_dim=64)
T5 = dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, relative_attention_num_buckets=16,
          relative_attention_max_distance=64)
VAE = dict(block_out_channels=(16, 32, 64, 64), layers_per_block=1, norm_num_groups=16, sample_size=SIZE)
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
TRAIN_SCENES = 60000  # default size of the captioned training set
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
        **{"vocab_size": len(tokenizer), **CLIP}, max_position_embeddings=77, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    t5 = T5EncoderModel(T5Config(
        **{"vocab_size": len(tokenizer_2), **T5}, feed_forward_proj="gated-gelu", dropout_rate=0.0,
        is_encoder_decoder=False, use_cache=False, pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id))
    return {"tokenizer": tokenizer, "tokenizer_2": tokenizer_2, "text_encoder": clip.to(device).eval(),
            "text_encoder_2": t5.to(device).eval()}


def train_vae(device: str, steps: int, batch: int, seed: int, seconds: float = float("inf"),
              stats_scenes: int = 256) -> tuple[Any, dict[str, float]]:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, act_fn="silu", latent_channels=16,
                        scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,
                        force_upcast=True, mid_block_add_attention=True, **VAE).to(device)
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    rng = random.Random(seed)
    t0, loss = time.time(), torch.tensor(0.0)
    done = 0
    for step in range(steps):
        if time.time() - t0 > seconds:
            break
        done = step + 1
        x = render_batch([sample_scene(rng) for _ in range(batch)], SIZE, device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            post = vae.encode(x).latent_dist
            z = post.sample()
            rec = vae.decode(z).sample
        kl = post.kl().mean()
        loss = F.l1_loss(rec.float(), x) + F.mse_loss(rec.float(), x) + 1e-7 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for g in opt.param_groups:
            g["lr"] = 1e-3 * 0.5 * (1 + math.cos(math.pi * (step + 1) / steps))
        if step % 200 == 0:
            print(f"vae step {step}: loss {loss.item():.4f} ({time.time() - t0:.0f} s)", flush=True)
    vae.eval()
    with torch.no_grad():
        x = render_batch([sample_scene(rng) for _ in range(stats_scenes)], SIZE, device)
        z = torch.cat([vae.encode(x[i:i + 64]).latent_dist.mean for i in range(0, stats_scenes, 64)])
        shift, scale = z.mean().item(), 1.0 / z.std().item()
        rec = torch.cat([vae.decode(z[i:i + 64]).sample for i in range(0, stats_scenes, 64)])
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return vae, {"vae_steps": done, "vae_loss": loss.item(), "vae_seconds": time.time() - t0,
                 "vae_recon_l1": float((rec - x).abs().mean()), "shift_factor": shift, "scaling_factor": scale}


@torch.no_grad()
def encode_text(text: dict[str, Any], captions: list[str], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 sequence embeddings, CLIP pooled embeddings) exactly as FluxPipeline.encode_prompt makes them."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline(scheduler=None, vae=None, transformer=None, **text)
    seqs, pooled = [], []
    for i in range(0, len(captions), 512):
        p, pp, _ = pipe.encode_prompt(captions[i:i + 512], prompt_2=None, device=torch.device(device),
                                      max_sequence_length=T5_TOKENS)
        seqs.append(p.to(torch.bfloat16))
        pooled.append(pp.to(torch.bfloat16))
    return torch.cat(seqs), torch.cat(pooled)


@torch.no_grad()
def encode_images(vae: Any, scenes: list, device: str) -> torch.Tensor:
    from diffusers import FluxPipeline

    out = []
    for i in range(0, len(scenes), 256):
        x = render_batch(scenes[i:i + 256], SIZE, device)
        z = (vae.encode(x).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
        out.append(FluxPipeline._pack_latents(z, z.shape[0], 16, SIZE // 8, SIZE // 8).to(torch.bfloat16))
    return torch.cat(out)


def train_transformer(latents: torch.Tensor, seqs: torch.Tensor, pooled: torch.Tensor, device: str, seconds: float,
                      batch: int, seed: int) -> tuple[Any, dict[str, float]]:
    from diffusers import FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = FluxTransformer2DModel(**TRANSFORMER).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.99), weight_decay=0.01)
    img_ids = FluxPipeline._prepare_latent_image_ids(1, SIZE // 16, SIZE // 16, device, torch.float32)
    txt_ids = torch.zeros(T5_TOKENS, 3, device=device)
    g = torch.Generator(device).manual_seed(seed)
    n, t0, step, losses = latents.shape[0], time.time(), 0, []
    warmup = 300
    while time.time() - t0 < seconds:
        idx = torch.randint(0, n, (batch,), device=device, generator=g)
        x0 = latents[idx].float()
        noise = torch.randn(x0.shape, device=device, generator=g)
        sigma = torch.sigmoid(torch.randn(batch, device=device, generator=g))
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        with torch.autocast("cuda", enabled=False):  # fp32 (TF32 matmuls): the model is small and launch-bound
            pred = model(hidden_states=xt, encoder_hidden_states=seqs[idx].float(), pooled_projections=pooled[idx].float(),
                         timestep=sigma, img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        frac = min(1.0, (time.time() - t0) / seconds)
        for grp in opt.param_groups:  # linear warm-up, then cosine over the time budget
            grp["lr"] = 6e-4 * min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        opt.step()
        losses.append(loss.item()) if step % 50 == 0 else None
        if step % 1000 == 0:
            print(f"transformer step {step}: loss {loss.item():.4f} ({time.time() - t0:.0f} s)", flush=True)
        step += 1
    model.eval()
    return model, {"transformer_steps": step, "transformer_seconds": time.time() - t0,
                   "transformer_final_loss": float(sum(losses[-20:]) / max(1, len(losses[-20:]))),
                   "transformer_params": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "weights"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vae-steps", type=int, default=1500)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--vae-seconds", type=float, default=90.0, help="stop the VAE earlier than --vae-steps")
    ap.add_argument("--vae-stats-scenes", type=int, default=256)
    ap.add_argument("--scenes", type=int, default=TRAIN_SCENES)
    ap.add_argument("--transformer-seconds", type=float, default=270.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--report", default=None, help="JSON with the training figures (default: <out>/train.json)")
    a = ap.parse_args(argv)
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    t_start = time.time()
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    text = build_text(a.device)
    vae, report = train_vae(a.device, a.vae_steps, a.vae_batch, a.seed + 1, a.vae_seconds, a.vae_stats_scenes)
    scenes = training_scenes(a.scenes, a.seed)
    t0 = time.time()
    seqs, pooled = encode_text(text, [caption(s) for s in scenes], a.device)
    latents = encode_images(vae, scenes, a.device)
    report["dataset_seconds"] = time.time() - t0
    report["scenes"] = a.scenes
    print(f"dataset: {a.scenes} scenes in {report['dataset_seconds']:.0f} s", flush=True)
    model, tr = train_transformer(latents, seqs, pooled, a.device, a.transformer_seconds, a.batch, a.seed + 3)
    report.update(tr)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae.to(torch.float16),
                        transformer=model.to(torch.float16), text_encoder=text["text_encoder"].to(torch.float16),
                        text_encoder_2=text["text_encoder_2"].to(torch.float16), tokenizer=text["tokenizer"],
                        tokenizer_2=text["tokenizer_2"])
    out = Path(a.out)
    pipe.save_pretrained(out, safe_serialization=True)
    report["weights_mb"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    report["total_seconds"] = time.time() - t_start
    report["command"] = "python -m model.toy.train " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    Path(a.report or out / "train.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
