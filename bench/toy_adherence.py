"""Prompt adherence of a toy-world pipeline (held-out captions, scene checker) per tier, and its CPU speed.

    python bench/toy_adherence.py --model <folder from model.toy.train> --device cuda   # lossless, high variants
    python bench/toy_adherence.py --model toy --device cpu    # lossless, high, and seconds per 256x256 image
    python bench/toy_adherence.py --model toy --sizes 256x256 512x512 1024x1024 1360x768   # per size too

Writes bench/results/toy-adherence[-<device>].json (adherence per variant at 256x256, n_prompts, cpu_seconds_256
on the CPU, weights_mb; `by_size`: lossless and high at each of --sizes, seconds per image) and prints it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import switches  # noqa: E402
from model.loading import load_pipeline  # noqa: E402
from model.request import parse_size  # noqa: E402
from model.toy.adherence import held_out_prompts, measure  # noqa: E402

DEFAULT_STEPS = 16
STEP_CACHE_THRESHOLDS = (0.05, 0.1, 0.2, 0.4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="toy", help="the toy preset, or a folder written by python -m model.toy.train")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--sizes", nargs="+", default=["256x256"],
                    help="sizes ('WxH') for by_size: lossless and high at each (the variants run at 256x256)")
    ap.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                    help="every high variant at 256x256 (the step cache thresholds, the converted forms)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    command = "python bench/toy_adherence.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    prompts = held_out_prompts(a.prompts)
    from model.presets import SHIPPED

    folder = SHIPPED.get(a.model, Path(a.model))
    result: dict[str, Any] = {
        "command": command, "model": a.model, "device": a.device, "n_prompts": len(prompts), "steps": a.steps,
        "weights_mb": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "adherence": {},
    }

    def run(name: str, pipe: Any, quality: str, size: str = "256x256", into: dict | None = None,
            **setup: Any) -> float:
        t0 = time.perf_counter()
        adh, results = measure(pipe, prompts, quality=quality, steps=a.steps, size=parse_size(size))
        # the steps each image's batch took from the step cache, as a fraction of its steps
        cached = sum(r.timings.get("cached_steps", 0.0) for r in results) / (len(results) * a.steps)
        (result["adherence"] if into is None else into)[name] = {
            **adh.to_dict(), "seconds": time.perf_counter() - t0, "cached_steps_fraction": cached, **setup}
        print(f"{size} {name}: adherence {adh.fraction:.4f} failed {adh.failed} colour confusions {adh.confusions} "
              f"cached steps {cached:.2f}", flush=True)
        return adh.fraction

    pipe = load_pipeline(a.model, device=a.device, dtype=torch.float32)
    on_cpu = a.device == "cpu"
    # the high tier as a pool serves it: on the CPU the same fp32 pipeline; on a GPU bf16 with the fast norms
    high = pipe if on_cpu else load_pipeline(a.model, device=a.device, dtype=torch.bfloat16)
    high_name = "high" if on_cpu else "high_bf16"
    if not on_cpu:
        high.use(fast_norm=True)
    result["by_size"] = {}
    for size in a.sizes:
        row: dict[str, Any] = {"variants": {}}
        t0 = time.perf_counter()
        row["adherence_lossless"] = run("lossless", pipe, "lossless", size, row["variants"])
        row["seconds_per_image_lossless"] = (time.perf_counter() - t0) / len(prompts)
        row["adherence_high"] = run(high_name, high, "high", size, row["variants"])
        result["by_size"][size] = row
    if "256x256" in result["by_size"]:
        result["adherence_lossless"] = result["by_size"]["256x256"]["adherence_lossless"]
        result["adherence_high"] = result["by_size"]["256x256"]["adherence_high"]
    if a.variants and on_cpu:
        for threshold in STEP_CACHE_THRESHOLDS:  # First-Block step cache (issue 15) on trained weights
            pipe.use(step_cache=threshold)
            run(f"high_step_cache_{threshold}", pipe, "high", step_cache=threshold)
        pipe.use(step_cache=None)
    elif a.variants:
        run("high_fp32", pipe, "high")
        run("lossless_bf16", high, "lossless")
        high.use(step_cache=0.1)
        run("high_bf16_step_cache_0.1", high, "high", fast_norm=True, step_cache=0.1)
        high.use(step_cache=None)
        high.use(attention8=True)
        run("high_bf16_attention8", high, "high", fast_norm=True, attention8=True)
        high.use(attention8=False)
        form = high.convert_for_high(fp8=high.fp8_refusal() is None, fused_projections=True)
        run("high_bf16_converted", high, "high", fast_norm=True, form=form)
        high.use(attention8=True)
        with switches.override(fp8_norm_producer=True):
            run("high_bf16_converted_attention8_norm_producer", high, "high", fast_norm=True, form=form,
                attention8=True, fp8_norm_producer=True)
    if on_cpu:  # seconds per image, median of 5 warm calls, at 256x256 and 512x512
        from model.request import GenerationRequest

        for side in (256, 512):
            times = []
            for i in range(6):
                t0 = time.perf_counter()
                pipe.generate([GenerationRequest(prompts[i % len(prompts)], height=side, width=side, steps=a.steps,
                                                 seed=i)])
                times.append(time.perf_counter() - t0)
            result[f"cpu_seconds_{side}"] = statistics.median(times[1:])
            print(f"CPU: {result[f'cpu_seconds_{side}']:.3f} s per {side}x{side} image at {a.steps} steps "
                  f"({torch.get_num_threads()} threads)", flush=True)
    out = Path(a.out or ROOT / "bench" / "results" / f"toy-adherence-{a.device.split(':')[0]}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "adherence"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
