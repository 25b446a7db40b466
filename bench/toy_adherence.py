"""Prompt adherence of a toy-world pipeline (held-out captions, scene checker) per tier, and its CPU speed.

    python bench/toy_adherence.py --model <folder from model.toy.train> --device cuda   # lossless, high variants
    python bench/toy_adherence.py --model toy --device cpu    # lossless, high, and seconds per 256x256 image

Writes bench/results/toy-adherence[-<device>].json (adherence per variant, n_prompts, cpu_seconds_256 on the
CPU, weights_mb) and prints it.
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
from model.toy.adherence import held_out_prompts, measure  # noqa: E402

DEFAULT_STEPS = 16
STEP_CACHE_THRESHOLDS = (0.05, 0.1, 0.2, 0.4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="toy", help="the toy preset, or a folder written by python -m model.toy.train")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
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

    def run(name: str, pipe: Any, quality: str, **setup: Any) -> None:
        t0 = time.perf_counter()
        adh, results = measure(pipe, prompts, quality=quality, steps=a.steps)
        # the steps each image's batch took from the step cache, as a fraction of its steps
        cached = sum(r.timings.get("cached_steps", 0.0) for r in results) / (len(results) * a.steps)
        result["adherence"][name] = {**adh.to_dict(), "seconds": time.perf_counter() - t0,
                                     "cached_steps_fraction": cached, **setup}
        print(f"{name}: adherence {adh.fraction:.4f} failed {adh.failed} colour confusions {adh.confusions} "
              f"cached steps {cached:.2f}", flush=True)

    pipe = load_pipeline(a.model, device=a.device, dtype=torch.float32)
    run("lossless", pipe, "lossless")
    if a.device == "cpu":
        from model.request import GenerationRequest

        run("high", pipe, "high")
        result["adherence_high"] = result["adherence"]["high"]["adherence"]
        for threshold in STEP_CACHE_THRESHOLDS:  # First-Block step cache (issue 15) on trained weights
            pipe.use(step_cache=threshold)
            run(f"high_step_cache_{threshold}", pipe, "high", step_cache=threshold)
        pipe.use(step_cache=None)

        times = []
        for i in range(5):
            t0 = time.perf_counter()
            pipe.generate([GenerationRequest(prompts[i % len(prompts)], height=256, width=256, steps=a.steps, seed=i)])
            times.append(time.perf_counter() - t0)
        result["cpu_seconds_256"] = statistics.median(times)
        print(f"CPU: {result['cpu_seconds_256']:.3f} s per 256x256 image at {a.steps} steps "
              f"({torch.get_num_threads()} threads)", flush=True)
    else:
        run("high_fp32", pipe, "high")
        bf16 = load_pipeline(a.model, device=a.device, dtype=torch.bfloat16)
        run("lossless_bf16", bf16, "lossless")
        bf16.use(fast_norm=True)
        run("high_bf16", bf16, "high", fast_norm=True)
        bf16.use(step_cache=0.1)
        run("high_bf16_step_cache_0.1", bf16, "high", fast_norm=True, step_cache=0.1)
        bf16.use(step_cache=None)
        bf16.use(attention8=True)
        run("high_bf16_attention8", bf16, "high", fast_norm=True, attention8=True)
        bf16.use(attention8=False)
        form = bf16.convert_for_high(fp8=bf16.fp8_refusal() is None, fused_projections=True)
        run("high_bf16_converted", bf16, "high", fast_norm=True, form=form)
        bf16.use(attention8=True)
        with switches.override(fp8_norm_producer=True):
            run("high_bf16_converted_attention8_norm_producer", bf16, "high", fast_norm=True, form=form,
                attention8=True, fp8_norm_producer=True)
        result["adherence_high"] = result["adherence"]["high_bf16"]["adherence"]
    result["adherence_lossless"] = result["adherence"]["lossless"]["adherence"]
    out = Path(a.out or ROOT / "bench" / "results" / f"toy-adherence-{a.device.split(':')[0]}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "adherence"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
