"""Command line: `python -m model generate ...` and `python -m model verify ...`.

generate: one image from a prompt to a PNG file (progress bar over the denoising steps).
verify:   runs stock diffusers (reference), our lossless tier and our high tier on the same request; prints latent
          and PNG md5s, PSNR/SSIM of high vs lossless, and, for a caption of the toy world, the scene checker's score
          of both; exit status 1 if lossless is not byte-identical to the reference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from model.presets import preset_names
from model.request import (DEFAULT_MODEL, DEFAULT_PROMPT, DEFAULT_STEPS, DEFAULT_STRENGTH, DTYPES, QUALITIES,
                           GenerationRequest, dtype_name, parse_size, validate_batch)

_DTYPE_CHOICES = sorted({*DTYPES, "fp32", "bf16", "fp16"})


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--size", default="256x256", help="WxH, multiples of 16 (default 256x256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--guidance", type=float, default=3.5)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset name ({', '.join(preset_names())}) or a local "
                   f"diffusers FLUX.1 / FLUX.1 Kontext folder (default: {DEFAULT_MODEL})")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=_DTYPE_CHOICES,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _device_dtype(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = dtype_name(args.dtype) if args.dtype else ("bfloat16" if device.type == "cuda" else "float32")
    return device, getattr(torch, name)


def _request(args: argparse.Namespace, quality: str) -> GenerationRequest:
    h, w = parse_size(args.size)  # a SizeError is a ValueError: exit status 2 with the reason
    edit: dict = {}
    if getattr(args, "image", None):
        from model.loading import model_family

        family = model_family(args.model)
        edit = {"image": Path(args.image).read_bytes(), "strength": family.strength(args.strength),
                "mask": Path(args.mask).read_bytes() if args.mask else None}
        error = family.edit_error(args.mask is not None, edit["strength"])
        if error is not None:
            raise ValueError(error)
    elif getattr(args, "mask", None):
        raise ValueError("--mask needs --image")
    return GenerationRequest(prompt=args.prompt, height=h, width=w, steps=args.steps, guidance=args.guidance,
                             seed=args.seed, quality=quality, step_cache=getattr(args, "step_cache", None), **edit)


def cmd_generate(args: argparse.Namespace) -> int:
    from model.loading import load_pipeline
    from model.pipeline import md5

    req = _request(args, args.quality)
    validate_batch([req])  # fail on bad flags before spending seconds on loading
    device, dtype = _device_dtype(args)
    pipe = load_pipeline(args.model, device=device, dtype=dtype)
    result = pipe.generate([req], progress=not args.no_progress)[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(result.png)
    print(json.dumps({"out": str(out), "png_md5": md5(result.png), "latents_md5": md5(result.latents),
                      "quality": result.quality, "ran": result.ran.as_dict(), "device": str(device),
                      "dtype": str(dtype).removeprefix("torch."), "timings": result.timings}, indent=2))
    return 0


def verify(pipe: Any, request: Any, progress: bool = False) -> dict[str, Any]:
    """Reference (stock diffusers), lossless and high on one request; returns the comparison as a dict. The
    pipeline is converted for high after the lossless run (as the high pool is), so it serves high only after."""
    import torch

    from model.metrics import psnr, ssim
    from model.loading import diffusers_reference
    from model.pipeline import md5, run_flux_pipeline

    reference = diffusers_reference(pipe)
    t0 = time.perf_counter()
    ref_lat, ref_png = run_flux_pipeline(reference, [request], progress=progress)
    t1 = time.perf_counter()
    del reference
    lossless = pipe.generate([request.__class__(**{**vars(request), "quality": "lossless"})], progress=progress)[0]
    # high with the high pool's default techniques: converted once (fp8 where it can run), fast norms, 8-bit attention
    fp8_refused = pipe.fp8_refusal()
    form = pipe.take_high_defaults()
    high = pipe.generate([request.__class__(**{**vars(request), "quality": "high"})], progress=progress)[0]
    report = pipe.last_mount_report
    refused = dict(getattr(report, "refused", {}) or {})
    p = psnr(high.png, lossless.png)
    from model.toy.adherence import caption_score

    return {
        "reference": {"latents_md5": md5(ref_lat[0]), "png_md5": md5(ref_png[0]), "seconds": t1 - t0},
        "lossless": {"latents_md5": md5(lossless.latents), "png_md5": md5(lossless.png),
                     "seconds": lossless.timings["total_s"]},
        "high": {"latents_md5": md5(high.latents), "png_md5": md5(high.png), "seconds": high.timings["total_s"],
                 "ran": high.ran.as_dict(),
                 "refused_example": next(iter(refused.items()), None),
                 "fp8": form["fp8"], "fused_projections": form["fused_projections"], "fp8_refused": fp8_refused},
        "lossless_latents_equal": bool(torch.equal(lossless.latents, ref_lat[0])),
        "lossless_png_equal": lossless.png == ref_png[0],
        "psnr_high_vs_lossless_db": None if math.isinf(p) else p,
        "high_identical_to_lossless": math.isinf(p),
        "ssim_high_vs_lossless": ssim(high.png, lossless.png),
        # the toy world's scene checker (model/toy/checker.py), when the prompt is one of its captions
        "caption_score": {"lossless": caption_score(lossless.png, request.prompt),
                          "high": caption_score(high.png, request.prompt)},
    }


def cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from model.loading import load_pipeline

    req = _request(args, "lossless")
    validate_batch([req])
    device, dtype = _device_dtype(args)
    pipe = load_pipeline(args.model, device=device, dtype=dtype)
    res = verify(pipe, req, progress=not args.no_progress)
    res.update(model=args.model, device=str(device), dtype=str(dtype).removeprefix("torch."), torch=torch.__version__)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        ok = res["lossless_latents_equal"] and res["lossless_png_equal"]
        print(f"model {args.model} on {device} ({res['dtype']}), {args.size}, {args.steps} steps, "
              f"seed {args.seed}")
        print(f"{'':10} {'latents md5':34} {'png md5':34} seconds")
        for k in ("reference", "lossless", "high"):
            r = res[k]
            print(f"{k:10} {r['latents_md5']:34} {r['png_md5']:34} {r['seconds']:.3f}")
        print(f"lossless == reference: latents {res['lossless_latents_equal']}, png {res['lossless_png_equal']}"
              f" -> {'OK' if ok else 'MISMATCH'}")
        h = res["high"]
        psnr_text = "inf (identical)" if res["high_identical_to_lossless"] else f"{res['psnr_high_vs_lossless_db']:.2f}"
        fp8_text = "fp8" if h["fp8"] else f"bf16 (fp8 refused: {h['fp8_refused']})"
        ran = h["ran"]
        print(f"high: fused projections, {fp8_text}, {ran['gelu_sites']} GELU sites mounted, "
              f"{ran['fast_norm_sites']} fast norm sites, {ran['attention8_sites']} 8-bit attention sites")
        print(f"high vs lossless: PSNR {psnr_text} dB, SSIM {res['ssim_high_vs_lossless']:.5f}")
        cs = res["caption_score"]
        if cs["lossless"] is not None:
            print(f"scene checker (stated attributes that hold): lossless {cs['lossless']:.2f}, high {cs['high']:.2f}")
    return 0 if res["lossless_latents_equal"] and res["lossless_png_equal"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate one image to a PNG file")
    _common(g)
    g.add_argument("--quality", choices=QUALITIES, default="lossless")
    g.add_argument("--out", required=True, help="PNG file to write")
    g.add_argument("--image", help="edit this image (FLUX.1: image-to-image, resized to --size by diffusers; "
                   "FLUX.1 Kontext: the prompt says what to change)")
    g.add_argument("--mask", help="inpaint: white where the image is repainted (needs --image; not for Kontext)")
    g.add_argument("--strength", type=float, default=None,
                   help=f"how far an edit may move from --image, (0, 1] (default {DEFAULT_STRENGTH}; Kontext: none)")
    g.add_argument("--step-cache", type=float, default=None,
                   help="--quality high only: First-Block step cache threshold in [0, 1) (not bit-exact)")
    v = sub.add_parser("verify", help="reference vs lossless vs high, side by side")
    _common(v)
    v.add_argument("--json", action="store_true", help="print the comparison as JSON")
    f = sub.add_parser("features", help="the techniques a replica can run (model/features.py), as a table")
    f.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    if args.command == "features":
        from model import features

        print(json.dumps(features.as_dicts(), indent=1) if args.json else features.table_markdown(), end="\n"
              if args.json else "")
        return 0
    try:
        return cmd_generate(args) if args.command == "generate" else cmd_verify(args)
    except (ValueError, OSError) as exc:  # bad request knobs, unknown preset, an unreadable --image / --mask
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from model.loading import ModelLoadError

        if isinstance(exc, ModelLoadError):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
