"""End to end and per step at TP = 1, 2 (and 4 where there are 4 GPUs), both tiers, against diffusers eager, in one run.

    python bench/tp_speed.py                                  # flux-dev-random, 1024x1024, 28 steps, cuda
    python bench/tp_speed.py --model tiny --device cpu --size 64 --steps 4 --worlds 1 2   # a smoke run

Each TP = N run is N spawned ranks (`tp.worker.TPWorker`, the form the served pool builds: `AppArgs.form`, so the high
tier takes what the feature table admits at that tp), NCCL when there is a GPU per rank. With fewer GPUs than ranks,
the ranks share GPU 0 over gloo (the test mode): the run then checks that it works and says that its times are not
speed. Per step = (time of `--steps` steps - time of 1 step) / (steps - 1), so the text encoders and the VAE cancel.
Writes `bench/results/tp-speed-<gpu>.json` and `.md` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _requests(args: argparse.Namespace, tier: str, steps: int) -> list:
    from model.request import GenerationRequest

    return [GenerationRequest("a photo of a red fox in fresh snow", height=args.size, width=args.size, steps=steps,
                              seed=0, quality=tier)]


def _form(args: argparse.Namespace, tier: str, world: int) -> Any:
    from deployments.config import AppArgs

    pool = {"tp": world, "warm_up": False}  # (_timed warms up the shapes it measures)
    if args.device == "cuda":
        pool["cuda_graphs"] = True
    raw = {"model": args.model, "device": args.device, "dtype": args.dtype, "default_size": f"{args.size}x{args.size}",
           "pools": {tier: pool}}
    return AppArgs.parse(raw).form(tier)


def _timed(generate: Any, args: argparse.Namespace, tier: str) -> dict[str, float]:
    """Median seconds of `--steps` steps and of 1 step (after a warm-up of each), and the per-step difference."""
    out: dict[str, float] = {}
    for steps in (1, args.steps):
        generate(_requests(args, tier, steps))  # warm-up (graph capture, autotuning)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            generate(_requests(args, tier, steps))
            times.append(time.perf_counter() - t0)
        out[f"e2e_{steps}_s"] = statistics.median(times)
    out["step_ms"] = 1000 * (out[f"e2e_{args.steps}_s"] - out["e2e_1_s"]) / max(1, args.steps - 1)
    return out


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, tier: str, gpus: int, out: str) -> None:
    import torch

    result: dict[str, Any] = {}
    try:
        from dataclasses import replace

        from tp.shard import agree_all_ranks
        from tp.worker import TPWorker

        shared = args.device == "cuda" and gpus < world
        device = args.device if args.device != "cuda" else f"cuda:{0 if shared else rank}"
        worker = TPWorker(rank, world, replace(_form(args, tier, world), device=device), port=port,
                          backend="gloo" if args.device != "cuda" or shared else "nccl", timeout_s=600.0)
        result["setup"] = worker.setup()
        result["form"] = sorted(worker.pipe.form.techniques())

        def generate(requests: list) -> Any:
            r = worker.pipe.generate(requests, agree=lambda ok: agree_all_ranks(ok, worker.ctrl_group))
            if args.device == "cuda":
                torch.cuda.synchronize()
            return r

        result.update(_timed(generate, args, tier))
        result["shared_gpu"] = shared
    except BaseException:  # noqa: BLE001 - reported
        result["error"] = traceback.format_exc()[-3000:]
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    os._exit(0)


def _spawn(world: int, args: argparse.Namespace, tier: str, gpus: int, tmp: Path) -> dict[str, Any]:
    import multiprocessing as mp

    from tp.dist import find_free_port

    out = tmp / f"tp{world}-{tier}.json"
    ctx = mp.get_context("spawn")
    port = find_free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, tier, gpus, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(args.timeout)
        if p.is_alive():
            p.kill()
    return json.loads(out.read_text()) if out.exists() else {"error": "rank 0 wrote nothing (killed or crashed)"}


def main(argv: list[str] | None = None) -> int:
    from model import prompt_cache

    prompt_cache.disable_by_default()  # every timed call encodes its prompt, as diffusers does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flux-dev-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worlds", type=int, nargs="+", default=None, help="TP sizes (default: 1, 2, and 4 with 4 GPUs)")
    ap.add_argument("--tiers", nargs="+", default=["lossless", "high"])
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one TP run may take")
    ap.add_argument("--out", default=None, help="output stem (default bench/results/tp-speed-<gpu>)")
    args = ap.parse_args(argv)

    import tempfile

    import torch

    from model.loading import diffusers_reference, load_pipeline
    from model.pipeline import run_flux_pipeline
    from model.request import torch_dtype

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    gpu = torch.cuda.get_device_name(0) if gpus else "cpu"
    worlds = args.worlds or ([1, 2, 4] if gpus >= 4 else [1, 2])
    results: dict[str, Any] = {"gpu": gpu, "gpus": gpus, "torch": torch.__version__, "argv": sys.argv[1:], "runs": {}}

    # diffusers eager, in this process
    ours = load_pipeline(args.model, device=args.device, dtype=torch_dtype(args.dtype))
    stock = diffusers_reference(ours)
    del ours

    def run_stock(requests: list) -> Any:
        out = run_flux_pipeline(stock, requests)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return out

    results["diffusers"] = _timed(run_stock, args, "lossless")
    del stock
    if args.device == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for tier in args.tiers:
                r = _spawn(world, args, tier, gpus, Path(tmp))
                results["runs"][f"tp{world} {tier}"] = r
                print(f"tp {world} {tier}: {r.get('e2e_%d_s' % args.steps)} s, {r.get('step_ms')} ms/step"
                      + (f" ERROR {r['error'][-300:]}" if "error" in r else ""), flush=True)

    stem = Path(args.out) if args.out else ROOT / "bench" / "results" / f"tp-speed-{gpu.replace(' ', '-').lower()}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    base = results["diffusers"]
    lines = [f"# TP speed on {gpus} x {gpu}" if gpus else "# TP on the CPU (a smoke run: not speed)", "",
             f"`{args.model}` ({args.dtype}), {args.size}x{args.size}, {args.steps} steps, median of {args.repeats}; "
             "per step = (all steps - 1 step) / (steps - 1). Random weights: times only.", "",
             "| run | techniques | end to end s | x diffusers | step ms | x diffusers | note |",
             "| --- | --- | --- | --- | --- | --- | --- |",
             f"| diffusers eager | - | {base[f'e2e_{args.steps}_s']:.3f} | 1.00 | {base['step_ms']:.1f} | 1.00 | |"]
    for name, r in results["runs"].items():
        if "error" in r:
            lines.append(f"| {name} | - | - | - | - | - | failed: `{r['error'].strip().splitlines()[-1]}` |")
            continue
        e2e, step = r[f"e2e_{args.steps}_s"], r["step_ms"]
        note = "ranks share one GPU (gloo): not speed" if r.get("shared_gpu") else ""
        lines.append(f"| {name} | {', '.join(r['form']) or '-'} | {e2e:.3f} | {base[f'e2e_{args.steps}_s'] / e2e:.2f} | "
                     f"{step:.1f} | {base['step_ms'] / step:.2f} | {note} |")
    lines += ["", "Command:", "", "```", "python bench/tp_speed.py " + " ".join(sys.argv[1:]), "```"]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
