"""The VAE decode of one image, per form: stock diffusers (what lossless runs), a channels-last copy alone, the high
tier's `fast_vae` copy (channels-last, GroupNorm + SiLU in one pass: model/vae.py), and, as a yardstick,
`torch.compile` of the channels-last copy (Inductor's fused norms; its compile time reported apart).

Latents are random normal at `--size` (decoded as the pipeline decodes: unscaled, shifted); with a random-weights
preset the images say how close the forms are numerically, not how good they look. Forms interleaved within each
repeat, median of `--repeats` after warm-ups, one device.

  python bench/vae_decode.py --out bench/results/vae-decode-h100.json
  python bench/vae_decode.py --model tiny --device cpu --size 128 --repeats 1 --no-compile  # dry run
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import _sync, timed  # noqa: E402
from bench.kernel_ops import rel  # noqa: E402
from model.loading import load_pipeline  # noqa: E402
from model.metrics import psnr, ssim  # noqa: E402
from model.vae import fast_decoder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flux-dev-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile yardstick")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vae-decode.json"))
    args = ap.parse_args(argv)
    command = "python bench/vae_decode.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    pipe = load_pipeline(args.model, device=args.device, dtype=torch.bfloat16).pipe
    vae = pipe.vae
    factor = pipe.vae_scale_factor
    g = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn(1, vae.config.latent_channels, args.size // factor, args.size // factor, generator=g)
    z = (latents.to(vae.device, vae.dtype) / vae.config.scaling_factor) + vae.config.shift_factor
    z_cl = z.contiguous(memory_format=torch.channels_last)

    channels_last = copy.deepcopy(vae.decoder).to(memory_format=torch.channels_last)
    fast = fast_decoder(vae.decoder)
    forms: dict[str, Callable[[], torch.Tensor]] = {
        "stock": lambda: vae.decoder(z),
        "channels_last": lambda: channels_last(z_cl),
        "fast_vae": lambda: fast(z_cl),
    }
    errors: dict[str, str] = {}
    compile_s = None
    if not args.no_compile:
        try:
            compiled = torch.compile(copy.deepcopy(vae.decoder).to(memory_format=torch.channels_last))
            with torch.no_grad():
                compile_s, _ = timed(lambda: compiled(z_cl))
            forms["compiled_channels_last"] = lambda: compiled(z_cl)
        except Exception:  # noqa: BLE001 - a yardstick that cannot be built is reported
            errors["compiled_channels_last"] = traceback.format_exc()[-2000:]

    times: dict[str, list[float]] = {k: [] for k in forms}
    with torch.no_grad():
        for i in range(args.warmup + args.repeats):
            for name, fn in forms.items():
                t, _ = timed(fn)
                if i >= args.warmup:
                    times[name].append(t * 1000)
        outputs = {name: fn() for name, fn in forms.items()}
    _sync()
    ref = outputs["stock"]

    def to_pixels(image: torch.Tensor) -> Any:  # the PIL image the pipeline would make of it
        return pipe.image_processor.postprocess(image, output_type="pil")[0]

    ref_pixels = to_pixels(ref)
    rows = {}
    for name, out in outputs.items():
        pixels = to_pixels(out)
        p = psnr(pixels, ref_pixels)
        rows[name] = {"median_ms": statistics.median(times[name]), "min_ms": min(times[name]),
                      "max_ms": max(times[name]), "speedup_vs_stock": None,
                      "rel_err_vs_stock": rel(out.float(), ref.float()),
                      "psnr_db_vs_stock": None if math.isinf(p) else p,
                      "ssim_vs_stock": ssim(pixels, ref_pixels) if min(pixels.size) >= 11 else None}
    for r in rows.values():
        r["speedup_vs_stock"] = rows["stock"]["median_ms"] / r["median_ms"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device.startswith("cuda") else "cpu"
    import diffusers

    report = {"command": command, "device": device, "model": args.model, "size": args.size,
              "torch": torch.__version__, "diffusers": diffusers.__version__, "python": platform.python_version(),
              "random_weights": "random" in args.model,
              "forms": rows, "compile_s": compile_s, "errors": errors,
              "fast_vae_ms": rows["fast_vae"]["median_ms"], "stock_ms": rows["stock"]["median_ms"],
              "fast_vae_speedup": rows["fast_vae"]["speedup_vs_stock"],
              "fast_vae_psnr_db": rows["fast_vae"]["psnr_db_vs_stock"], "timestamp": time.strftime("%Y-%m-%d %H:%M")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for name, r in rows.items():
        print(f"{name}: {r['median_ms']:.2f} ms ({r['speedup_vs_stock']:.2f}x), PSNR {r['psnr_db_vs_stock']}, "
              f"rel err {r['rel_err_vs_stock']:.2e}", flush=True)
    for name, e in errors.items():
        print(f"{name} not built: {e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
