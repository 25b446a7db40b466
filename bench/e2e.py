"""End-to-end FLUX.1 benchmark on one GPU: stock diffusers vs our lossless tier vs our high tier.

Same weights for all three (default: the flux-dev-random preset, FLUX.1-dev architecture, random bf16 weights built
on the GPU), same process, same request. Every timed call goes prompt -> PNG bytes through the same harness
(`model.pipeline.run_flux_pipeline` for diffusers, `FluxServePipeline.generate` for ours, which adds only the
mount/unmount of the GELU sites), timed with a device synchronize on both sides. Variants are interleaved within each
repeat so clock/thermal drift hits them equally; the reported time is the median over repeats after warm-up runs.

Correctness is checked on the timed runs themselves: lossless latents torch.equal to diffusers' and PNG md5 equal;
PSNR/SSIM of high vs lossless.

  python bench/e2e.py                                   # full: 1024x1024, 50 and 28 steps, 3 repeats
  python bench/e2e.py --steps 4 --size 512 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.loading import load_pipeline  # noqa: E402
from model.metrics import psnr, ssim  # noqa: E402
from model.pipeline import GenerationRequest, md5, run_flux_pipeline  # noqa: E402


def sdpa_backend(batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> str:
    """The SDPA backend PyTorch picks for FLUX's joint attention at this shape (what both models run)."""
    q = torch.randn(batch, heads, tokens, head_dim, device="cuda", dtype=dtype)
    try:
        choice = torch._fused_sdp_choice(q, q, q, None, 0.0, False)
        from torch.nn.attention import SDPBackend

        return SDPBackend(choice).name
    except Exception as exc:  # private API: report rather than crash the benchmark
        return f"unknown ({type(exc).__name__}: {exc})"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def run_steps(ours: Any, reference: Any, steps: int, size: int, args: argparse.Namespace) -> dict[str, Any]:
    def req(quality: str) -> GenerationRequest:
        return GenerationRequest(prompt=args.prompt, height=size, width=size, steps=steps, guidance=args.guidance,
                                 seed=args.seed, quality=quality)

    variants: dict[str, Callable[[], tuple[torch.Tensor, bytes, int]]] = {
        "baseline": lambda: (lambda lat, png: (lat[0], png[0], 0))(*run_flux_pipeline(reference, [req("lossless")])),
        "lossless": lambda: (lambda r: (r.latents, r.png, r.mounted_sites))(ours.generate([req("lossless")])[0]),
        "high": lambda: (lambda r: (r.latents, r.png, r.mounted_sites))(ours.generate([req("high")])[0]),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    last: dict[str, tuple[torch.Tensor, bytes, int]] = {}
    for i in range(args.warmup + args.repeats):
        this: dict[str, float] = {}
        for name, fn in variants.items():
            this[name], last[name] = timed(fn)
            if i >= args.warmup:
                times[name].append(this[name])
        kind = "warm-up" if i < args.warmup else "repeat"
        print(f"  steps={steps} {kind} {i}: " + ", ".join(f"{k} {v:.3f}s" for k, v in this.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    (b_lat, b_png, _), (l_lat, l_png, _), (h_lat, h_png, h_sites) = last["baseline"], last["lossless"], last["high"]
    p = psnr(h_png, l_png)
    return {
        "steps": steps,
        "size": size,
        "baseline_s": med["baseline"],
        "lossless_s": med["lossless"],
        "high_s": med["high"],
        "lossless_speedup_pct": 100.0 * (med["baseline"] / med["lossless"] - 1.0),
        "high_speedup_pct": 100.0 * (med["baseline"] / med["high"] - 1.0),
        "lossless_latents_equal": bool(torch.equal(b_lat, l_lat)),
        "lossless_png_md5_equal": md5(b_png) == md5(l_png),
        "psnr_high_db": None if math.isinf(p) else p,
        "high_identical_to_lossless": math.isinf(p),
        "ssim_high": ssim(h_png, l_png),
        "high_mounted_sites": h_sites,
        "png_md5": {"baseline": md5(b_png), "lossless": md5(l_png), "high": md5(h_png)},
        "times_s": times,
    }


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    lines = [
        f"# End-to-end FLUX.1 on {result['gpu']}",
        "",
        f"Model `{result['model']}` ({result['dtype']}), prompt -> PNG bytes, batch 1, median of "
        f"{result['repeats']} repeats after {result['warmup']} warm-up run(s) per variant, variants interleaved. "
        f"torch {result['torch']}, diffusers {result['diffusers']}, SDPA backend {result['sdpa_backend']}.",
        "",
        "| steps | size | diffusers eager (s) | lossless (s) | high (s) | lossless speed-up | high speed-up | "
        "lossless latents equal | lossless PNG md5 equal | high PSNR (dB) | high SSIM | GELU sites mounted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        psnr_text = "inf (identical)" if r["high_identical_to_lossless"] else f"{r['psnr_high_db']:.2f}"
        lines.append(
            f"| {r['steps']} | {r['size']}x{r['size']} | {r['baseline_s']:.3f} | {r['lossless_s']:.3f} | "
            f"{r['high_s']:.3f} | {r['lossless_speedup_pct']:+.2f}% | {r['high_speedup_pct']:+.2f}% | "
            f"{r['lossless_latents_equal']} | {r['lossless_png_md5_equal']} | {psnr_text} | {r['ssim_high']:.5f} | "
            f"{r['high_mounted_sites']} |")
    lines += ["", "Command:", "", "```", result["command"], "```", "",
              f"Build of the model: {result['build_s']:.1f} s (ours) + {result['reference_build_s']:.1f} s "
              f"(diffusers reference). Raw numbers: `{Path(result['json']).name}`.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flux-dev-random", help="preset or local FLUX.1 folder")
    ap.add_argument("--steps", type=int, nargs="+", default=[50, 28])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompt", default="a photo of a red fox in fresh snow, golden hour, 35mm film")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--guidance", type=float, default=3.5)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to dry-run the script")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "e2e-h200.json"))
    ap.add_argument("--md", default=None, help="markdown summary (default: --out with .md)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/e2e.py needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    command = "python bench/e2e.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    build_s, ours = timed(lambda: load_pipeline(args.model, device=args.device, dtype=dtype))
    ref_build_s, reference = timed(ours.diffusers_reference)
    gib = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    print(f"built {args.model}: ours {build_s:.1f}s, reference {ref_build_s:.1f}s; {gib:.1f} GiB allocated",
          flush=True)
    cfg = ours.transformer.config
    text_tokens = min(512, ours.pipe.tokenizer_2.model_max_length)
    tokens = (args.size // 16) ** 2 + text_tokens
    backend = (sdpa_backend(1, cfg.num_attention_heads, tokens, cfg.attention_head_dim, dtype)
               if args.device.startswith("cuda") else "cpu")

    runs = [run_steps(ours, reference, s, args.size, args) for s in args.steps]
    import diffusers

    result: dict[str, Any] = {**{k: v for k, v in runs[0].items() if k not in ("png_md5", "times_s")},
                              "sdpa_backend": backend, "torch": torch.__version__}
    result.update(
        runs=runs, model=args.model, dtype=args.dtype, repeats=args.repeats, warmup=args.warmup,
        gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        diffusers=diffusers.__version__, python=platform.python_version(),
        build_s=build_s, reference_build_s=ref_build_s, command=command, json=str(args.out),
        max_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        gelu_impl=os.environ.get("FLUXSERVE_GELU_IMPL", "auto"),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    md = Path(args.md) if args.md else out.with_suffix(".md")
    write_markdown(md, result)
    print(md.read_text())
    ok = all(r["lossless_latents_equal"] and r["lossless_png_md5_equal"] for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
