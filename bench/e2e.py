"""End-to-end FLUX.1 (or FLUX.1 Kontext) benchmark on one GPU: stock diffusers vs our lossless tier vs our high tier.

Same weights for all three (default: the flux-dev-random preset, FLUX.1-dev architecture, random bf16 weights built
on the GPU), same process, same request. Every timed call goes prompt -> PNG bytes through the same harness
(`model.pipeline.run_flux_pipeline` for diffusers, `FluxServePipeline.generate` for ours, which adds only the
mount/unmount of the GELU sites), timed with a device synchronize on both sides. Variants are interleaved within each
repeat so clock/thermal drift hits them equally; the reported time is the median over repeats after warm-up runs.

Correctness is checked on the timed runs themselves: lossless latents torch.equal to diffusers' and PNG md5 equal;
PSNR/SSIM of high vs lossless; with --cuda-graphs, lossless+graphs equal to diffusers and high+graphs equal to high.

  python bench/e2e.py                                   # full: 1024x1024, 50 and 28 steps, 3 repeats
  python bench/e2e.py --steps 4 --size 512 --repeats 1  # smoke
  python bench/e2e.py --high-compile                    # adds high_compiled: high with torch.compile'd blocks
  python bench/e2e.py --high-fast-norm                  # adds high_fast_norm: high + fast LayerNorm+modulate
  python bench/e2e.py --cuda-graphs                     # adds lossless+graphs, high+graphs: CUDA-graph steps
  python bench/e2e.py --high-default                    # adds high_default: the high pool's default set
  python bench/e2e.py --high-default --cuda-graphs      # ... and high_default_graphs: the same, CUDA-graph steps
  python bench/e2e.py --model flux-kontext-random --edit --high-default --cuda-graphs   # FLUX.1 Kontext edits
"""

from __future__ import annotations

import argparse
import copy
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

from model.loading import diffusers_reference, load_pipeline, model_family  # noqa: E402
from model.metrics import psnr, ssim  # noqa: E402
from model.pipeline import FluxServePipeline, GenerationRequest, md5, run_flux_pipeline  # noqa: E402
from model.features import HIGH_DEFAULTS  # noqa: E402


def sdpa_backend(batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> str:
    """The SDPA backend PyTorch picks for FLUX's joint attention at this shape (what both models run)."""
    q = torch.randn(batch, heads, tokens, head_dim, device="cuda", dtype=dtype)
    try:
        choice = torch._fused_sdp_choice(q, q, q, None, 0.0, False)
        from torch.nn.attention import SDPBackend

        return SDPBackend(choice).name
    except Exception as exc:  # private API: report rather than crash the benchmark
        return f"unknown ({type(exc).__name__}: {exc})"


def edit_image(size: int, seed: int) -> bytes:
    """A smooth seeded size x size picture (low-frequency colour fields, PNG bytes) as an edit's input."""
    from model.png import png_bytes
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 8, 8, generator=g)
    field = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    pixels = (field.clamp(0, 1)[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    return png_bytes(Image.fromarray(pixels))


def pipeline_copy(ours: FluxServePipeline) -> FluxServePipeline:
    """A pipeline over a copy of ours' transformer (text encoders and VAE shared, a scheduler of its own), to convert
    the way a high replica converts at start; it then serves high only. The copy's modules are new but hold ours'
    weight tensors, which the conversion replaces rather than changes: only the converted layers take new memory
    (three full-size bf16 transformers do not fit an 80 GB card)."""
    t = ours.transformer
    components = dict(ours.pipe.components)
    components["transformer"] = copy.deepcopy(t, memo={id(w): w for w in (*t.parameters(), *t.buffers())})
    components["scheduler"] = type(ours.pipe.scheduler).from_config(ours.pipe.scheduler.config)
    return FluxServePipeline(type(ours.pipe)(**components), source=ours.source)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


# Variants beside baseline/lossless/high, each reported against lossless (PSNR/SSIM) and high (latent diff).
OPTIONAL_HIGH_VARIANTS = ("high_compiled", "high_fast_norm", "high_default", "high_default_graphs")


def run_steps(ours: Any, reference: Any, steps: int, size: int, args: argparse.Namespace,
              high_pool: FluxServePipeline | None = None) -> dict[str, Any]:
    edit = {} if args.edit_image is None else {"image": args.edit_image, "strength": args.edit_strength}

    def req(quality: str) -> GenerationRequest:
        return GenerationRequest(prompt=args.prompt, height=size, width=size, steps=steps, guidance=args.guidance,
                                 seed=args.seed, quality=quality, **edit)

    variants: dict[str, Callable[[], tuple[torch.Tensor, bytes, int]]] = {
        "baseline": lambda: (lambda lat, png: (lat[0], png[0], 0))(*run_flux_pipeline(reference, [req("lossless")])),
        "lossless": lambda: (lambda r: (r.latents, r.png, r.ran.gelu_sites))(
            ours.generate([req("lossless")], cuda_graphs=False)[0]),
        "high": lambda: (lambda r: (r.latents, r.png, r.ran.gelu_sites))(
            ours.generate([req("high")], compiled=False, cuda_graphs=False)[0]),
    }
    if args.high_compile:
        # The compile warm-up for this size ran before (main); no timed call compiles.
        variants["high_compiled"] = lambda: (lambda r: (r.latents, r.png, r.ran.gelu_sites))(
            ours.generate([req("high")], compiled=True)[0])
    if args.high_fast_norm:
        def high_fast_norm() -> tuple[torch.Tensor, bytes, int]:
            ours.use(fast_norm=True)  # the high pool's `fast_norm: true`
            try:
                r = ours.generate([req("high")], compiled=False)[0]
            finally:
                ours.use(fast_norm=False)
            assert r.ran.fast_norm_sites > 0 or ours.device.type != "cuda", "fast_norm did not switch any site"
            return r.latents, r.png, r.ran.gelu_sites

        variants["high_fast_norm"] = high_fast_norm
    if high_pool is not None:
        variants["high_default"] = lambda: (lambda r: (r.latents, r.png, r.ran.gelu_sites))(
            high_pool.generate([req("high")], cuda_graphs=False)[0])
        if high_pool.cuda_graphs_enabled:
            variants["high_default_graphs"] = lambda: (lambda r: (r.latents, r.png, r.ran.gelu_sites))(
                high_pool.generate([req("high")], cuda_graphs=True)[0])
    if args.cuda_graphs:
        # The first call of each captures its graph (two eager steps + capture): the warm-up repeat pays that.
        variants["lossless+graphs"] = lambda: (lambda r: (r.latents, r.png, r.ran.gelu_sites))(
            ours.generate([req("lossless")], cuda_graphs=True)[0])
        variants["high+graphs"] = lambda: (lambda r: (r.latents, r.png, r.ran.gelu_sites))(
            ours.generate([req("high")], compiled=False, cuda_graphs=True)[0])
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
    extra: dict[str, Any] = {}
    for name in OPTIONAL_HIGH_VARIANTS:
        if name not in last:
            continue
        c_lat, c_png, c_sites = last[name]
        pc = psnr(c_png, l_png)
        extra.update({
            f"{name}_s": med[name],
            f"{name}_speedup_pct": 100.0 * (med["baseline"] / med[name] - 1.0),
            f"psnr_{name}_db": None if math.isinf(pc) else pc,
            f"{name}_identical_to_lossless": math.isinf(pc),
            f"ssim_{name}": ssim(c_png, l_png),
            f"{name}_mounted_sites": c_sites,
            f"{name}_max_abs_latent_diff_vs_high": float((c_lat.float() - h_lat.float()).abs().max()),
        })
    if "high_default_graphs" in last:  # graph replay runs the eager step's kernels: expected bit-identical
        extra["high_default_graphs_latents_equal_to_high_default"] = bool(
            torch.equal(last["high_default"][0], last["high_default_graphs"][0]))
    if "lossless+graphs" in last:
        g_lat, g_png, _ = last["lossless+graphs"]
        hg_lat, hg_png, hg_sites = last["high+graphs"]
        pg = psnr(hg_png, l_png)
        extra.update({
            "lossless_graphs_s": med["lossless+graphs"],
            "lossless_graphs_speedup_pct": 100.0 * (med["baseline"] / med["lossless+graphs"] - 1.0),
            "lossless_graphs_vs_lossless_pct": 100.0 * (med["lossless"] / med["lossless+graphs"] - 1.0),
            "lossless_graphs_latents_equal": bool(torch.equal(b_lat, g_lat)),  # against diffusers
            "lossless_graphs_png_md5_equal": md5(b_png) == md5(g_png),
            "high_graphs_s": med["high+graphs"],
            "high_graphs_speedup_pct": 100.0 * (med["baseline"] / med["high+graphs"] - 1.0),
            "high_graphs_vs_high_pct": 100.0 * (med["high"] / med["high+graphs"] - 1.0),
            # same kernels as eager high: expected bit-identical to it
            "high_graphs_latents_equal_to_high": bool(torch.equal(h_lat, hg_lat)),
            "high_graphs_png_md5_equal_to_high": md5(h_png) == md5(hg_png),
            "psnr_high_graphs_db": None if math.isinf(pg) else pg,
            "ssim_high_graphs": ssim(hg_png, l_png),
            "high_graphs_mounted_sites": hg_sites,
        })
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
        **extra,
        "png_md5": {"baseline": md5(b_png), "lossless": md5(l_png), "high": md5(h_png),
                    **{k: md5(last[k][1]) for k in OPTIONAL_HIGH_VARIANTS if k in last},
                    **{k: md5(last[k][1]) for k in ("lossless+graphs", "high+graphs") if k in last}},
        "times_s": times,
    }


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    lines = [
        f"# End-to-end {'FLUX.1 Kontext' if result['family'] == 'flux1-kontext' else 'FLUX.1'} on {result['gpu']}",
        "",
        (f"An edit of a {result['size']}x{result['size']} input image (strength {result['edit_strength']}). "
         if result["edit"] else "") +
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
    notes = {
        "high_compiled": lambda: (
            "high with regionally compiled blocks (torch.compile, dynamic=False), compiled and warmed up before "
            f"timing in {result['compile_warmup_s']:.1f} s; graphs compiled during the timed and warm-up runs after "
            f"that: {result['compiled_graphs_during_timing']}."),
        "high_fast_norm": lambda: (
            "high plus the fast single-pass LayerNorm+modulate kernel on every norm site (serve config "
            "`pools.high.fast_norm: true`; not bit-exact)."),
        "high_default": lambda: (
            f"the high pool's default set ({', '.join(sorted(HIGH_DEFAULTS))}; fp8 where it can run) on a converted "
            "copy of the transformer, as a high replica holds it; no CUDA graphs."),
        "high_default_graphs": lambda: (
            "high_default with every step replayed from a CUDA graph (captured in the warm-up run), as a high pool "
            "with `cuda_graphs: true` runs it; latents equal to high_default's (per step count): "
            f"{[r.get('high_default_graphs_latents_equal_to_high_default') for r in result['runs']]}."),
    }
    for name in OPTIONAL_HIGH_VARIANTS:
        if not any(f"{name}_s" in r for r in result["runs"]):
            continue
        lines += [
            "",
            f"`{name}`: {notes[name]()}",
            "",
            f"| steps | size | {name} (s) | speed-up vs diffusers | PSNR vs lossless (dB) | SSIM vs lossless | "
            "max abs latent diff vs high | GELU sites mounted |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in result["runs"]:
            psnr_text = ("inf (identical)" if r[f"{name}_identical_to_lossless"]
                         else f"{r[f'psnr_{name}_db']:.2f}")
            lines.append(
                f"| {r['steps']} | {r['size']}x{r['size']} | {r[f'{name}_s']:.3f} | "
                f"{r[f'{name}_speedup_pct']:+.2f}% | {psnr_text} | {r[f'ssim_{name}']:.5f} | "
                f"{r[f'{name}_max_abs_latent_diff_vs_high']:.3g} | {r[f'{name}_mounted_sites']} |")
    if any("lossless_graphs_s" in r for r in result["runs"]):
        stats = result["cuda_graphs"]
        lines += [
            "",
            f"`+graphs`: every transformer step replayed from a CUDA graph, captured on first use (in the warm-up "
            f"run unless --warmup 0); graph cache after the run: {stats['captures']} captures, {stats['replays']} "
            f"replays, {stats['eager_fallbacks']} eager fallbacks {stats['fallback_reasons'] or ''}.",
            "",
            "| steps | size | lossless+graphs (s) | vs diffusers | vs lossless | latents equal to diffusers | "
            "PNG md5 equal to diffusers | high+graphs (s) | vs diffusers | vs high | latents equal to high | "
            "PNG md5 equal to high |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["runs"]:
            lines.append(
                f"| {r['steps']} | {r['size']}x{r['size']} | {r['lossless_graphs_s']:.3f} | "
                f"{r['lossless_graphs_speedup_pct']:+.2f}% | {r['lossless_graphs_vs_lossless_pct']:+.2f}% | "
                f"{r['lossless_graphs_latents_equal']} | {r['lossless_graphs_png_md5_equal']} | "
                f"{r['high_graphs_s']:.3f} | {r['high_graphs_speedup_pct']:+.2f}% | "
                f"{r['high_graphs_vs_high_pct']:+.2f}% | "
                f"{r['high_graphs_latents_equal_to_high']} | {r['high_graphs_png_md5_equal_to_high']} |")
    lines += ["", "Command:", "", "```", result["command"], "```", "",
              f"Build of the model: {result['build_s']:.1f} s (ours) + {result['reference_build_s']:.1f} s "
              f"(diffusers reference). Raw numbers: `{Path(result['json']).name}`.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    from model import prompt_cache

    prompt_cache.disable_by_default()  # every timed call encodes its prompt, as diffusers does
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
    ap.add_argument("--high-compile", action="store_true",
                    help="also time high with torch.compile'd transformer blocks (variant high_compiled)")
    ap.add_argument("--high-fast-norm", action="store_true",
                    help="also time high with the fast LayerNorm+modulate kernel (variant high_fast_norm)")
    ap.add_argument("--high-default", action="store_true",
                    help="also time the high pool's default set on a converted copy (variant high_default)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="also time lossless and high with CUDA-graph replay of each step (lossless+graphs, "
                         "high+graphs)")
    ap.add_argument("--edit", action="store_true",
                    help="time an edit of a --size x --size input image (a smooth seeded picture): FLUX.1 Kontext "
                         "conditions every step on it; FLUX.1 runs image-to-image at its default strength")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to dry-run the script")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "e2e-h200.json"))
    ap.add_argument("--md", default=None, help="markdown summary (default: --out with .md)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/e2e.py needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    command = "python bench/e2e.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    family = model_family(args.model)
    args.edit_image = edit_image(args.size, args.seed) if args.edit else None
    args.edit_strength = family.strength(None)
    build_s, ours = timed(lambda: load_pipeline(args.model, device=args.device, dtype=dtype))
    ref_build_s, reference = timed(lambda: diffusers_reference(ours))
    gib = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    print(f"built {args.model}: ours {build_s:.1f}s, reference {ref_build_s:.1f}s; {gib:.1f} GiB allocated",
          flush=True)
    cfg = ours.transformer.config
    text_tokens = min(512, ours.pipe.tokenizer_2.model_max_length)
    # a Kontext edit's input image adds its own latent tokens (Kontext resizes a square one to 1024x1024)
    image_tokens = (1024 // 16) ** 2 if args.edit and family.edits == "reference" else 0
    tokens = (args.size // 16) ** 2 + image_tokens + text_tokens
    backend = (sdpa_backend(1, cfg.num_attention_heads, tokens, cfg.attention_head_dim, dtype)
               if args.device.startswith("cuda") else "cpu")

    compile_warmup_s = None
    if args.high_compile:
        compile_warmup_s = ours.enable_compile([(args.size, args.size)], steps=2)
        print(f"compiled high blocks for {args.size}x{args.size} in {compile_warmup_s:.1f}s", flush=True)
    if args.cuda_graphs:
        ours.enable_cuda_graphs()
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    high_pool = None
    if args.high_default:
        high_pool = pipeline_copy(ours)
        high_pool.take_high_defaults()
        if args.cuda_graphs:
            high_pool.enable_cuda_graphs()
    runs = [run_steps(ours, reference, s, args.size, args, high_pool) for s in args.steps]
    graphs_during_timing = counters["stats"]["unique_graphs"] - graphs_before
    import diffusers

    result: dict[str, Any] = {**{k: v for k, v in runs[0].items() if k not in ("png_md5", "times_s")},
                              "sdpa_backend": backend, "torch": torch.__version__}
    result.update(
        runs=runs, model=args.model, family=family.name, edit=args.edit,
        edit_strength=args.edit_strength if args.edit else None, dtype=args.dtype, repeats=args.repeats,
        warmup=args.warmup,
        gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        diffusers=diffusers.__version__, python=platform.python_version(),
        build_s=build_s, reference_build_s=ref_build_s, command=command, json=str(args.out),
        max_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        gelu_impl=os.environ.get("FLUXSERVE_GELU_IMPL", "auto"),
    )
    if ours.step_graphs is not None:
        result["cuda_graphs"] = ours.step_graphs.stats()
    if compile_warmup_s is not None:
        # Dynamo graphs compiled after the warm-up: 0 means no timed call paid a (re)compile.
        result.update(compile_warmup_s=compile_warmup_s, compiled_graphs_during_timing=graphs_during_timing)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    md = Path(args.md) if args.md else out.with_suffix(".md")
    write_markdown(md, result)
    print(md.read_text())
    # Graph replay must not change a bit: lossless+graphs == diffusers, high+graphs == eager high.
    ok = all(r["lossless_latents_equal"] and r["lossless_png_md5_equal"]
             and r.get("lossless_graphs_latents_equal", True) and r.get("lossless_graphs_png_md5_equal", True)
             and r.get("high_graphs_latents_equal_to_high", True) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
