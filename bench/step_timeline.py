"""Where a graphed transformer step's wall time goes: kernel time vs the gaps between kernels (a script).

The high tier replayed from a CUDA graph at batch 1 takes longer than the sum of its kernels' times. This replays
one step per variant under torch.profiler and reads the kernel timeline: kernels per step, their summed time, the
step's span (first kernel start to last kernel end) and the idle time between consecutive kernels, with the kernel
families that precede the largest gaps, and the kernels that take the most time. Random weights (flux-dev-random):
timing only.

  python bench/step_timeline.py --out bench/results/step-timeline-h200.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.high import VARIANTS, build_variants, kernel_family, lossless_step_fn, step_fn, step_inputs  # noqa: E402
from model.loading import load_pipeline  # noqa: E402


def timeline(fn: Callable[[], Any], steps: int = 3, top_kernels: int = 25) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    kernels = sorted(((e["ts"], e["dur"], e["name"]) for e in trace.get("traceEvents", [])
                      if e.get("cat") == "kernel" and "dur" in e), key=lambda k: k[0])
    # Split into steps at the largest gaps (the host synchronizes between steps).
    gaps = [(kernels[i + 1][0] - (kernels[i][0] + kernels[i][1]), i) for i in range(len(kernels) - 1)]
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[:steps - 1])
    bounds = [0, *[c + 1 for c in cuts], len(kernels)]
    per_step = []
    after: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # kernel name -> [calls, us], over all steps
    for a, b in zip(bounds, bounds[1:]):
        ks = kernels[a:b]
        busy = sum(k[1] for k in ks)
        for k in ks:
            by_name[k[2]][0] += 1
            by_name[k[2]][1] += k[1]
        span = ks[-1][0] + ks[-1][1] - ks[0][0]
        for i in range(len(ks) - 1):
            gap = ks[i + 1][0] - (ks[i][0] + ks[i][1])
            if gap > 0:
                after[kernel_family(ks[i][2]) + " -> " + kernel_family(ks[i + 1][2])] += gap / 1000 / steps
        small = [ks[i + 1][0] - (ks[i][0] + ks[i][1]) for i in range(len(ks) - 1)]
        per_step.append({"kernels": len(ks), "busy_ms": busy / 1000, "span_ms": span / 1000,
                         "gap_ms": (span - busy) / 1000,
                         "median_gap_us": statistics.median(small) if small else 0.0})
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top_kernels]
    return {"steps": per_step, "gap_ms_by_transition": dict(sorted(after.items(), key=lambda kv: -kv[1])[:8]),
            "top_kernels": [{"name": n, "calls_per_step": c / steps, "ms_per_step": us / 1000 / steps,
                             "family": kernel_family(n)} for n, (c, us) in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flux-dev-random")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=[
        "high + fp8 + fused_projections + fast_norm + fp8_norm_producer + cuda_graphs",
        "high + fp8 + fused_projections + fast_norm + fp8_norm_producer"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step-timeline-h200.md"))
    args = ap.parse_args()
    ours = load_pipeline(args.model, device="cuda", dtype=torch.bfloat16)
    chosen = [v for v in VARIANTS if v.name in args.variants]
    built, errors = build_variants(ours, chosen)
    inputs = step_inputs(ours, args.batch, args.size, min(512, ours.pipe.tokenizer_2.model_max_length))
    fns = {"lossless (eager)": lossless_step_fn(ours, inputs)}
    fns.update({v.name: step_fn(built[v.name], v, inputs) for v in chosen if v.name in built})
    results = {name: timeline(fn) for name, fn in fns.items()}
    rows = []
    for name, r in results.items():
        s = r["steps"][len(r["steps"]) // 2]
        rows.append(f"| {name} | {s['kernels']} | {s['busy_ms']:.2f} | {s['span_ms']:.2f} | {s['gap_ms']:.2f} | "
                    f"{s['median_gap_us']:.1f} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "# Kernel time and gaps in one transformer step", "",
        f"Command: `python3 {' '.join(sys.argv)}`", "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, `{args.model}` (random weights: timing only), "
        f"{args.size}x{args.size}, batch {args.batch}. One step under torch.profiler (the middle of 3): kernels, "
        "their summed time (busy), first start to last end (span), span - busy (gaps), median gap.", "",
        "| variant | kernels | busy ms | span ms | gaps ms | median gap us |", "|---|---|---|---|---|---|", *rows, "",
        "Gap time per step by the kernel families on either side (ms):", "",
        *[f"- {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["gap_ms_by_transition"].items())
          for name, r in results.items()],
        *[line for name, r in results.items() for line in (
            "", f"Kernels by time per step, {name}:", "", "| kernel | family | calls | ms |", "|---|---|---|---|",
            *[f"| `{k['name'][:90]}` | {k['family']} | {k['calls_per_step']:.0f} | {k['ms_per_step']:.2f} |"
              for k in r["top_kernels"]])],
        "", f"Variants not built: {errors}" if errors else "",
    ])
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
