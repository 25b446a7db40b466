"""Time to ready and the first request after it: does a warmed replica answer its first request at warm speed?

    python bench/warmup.py                          # flux-dev-random, high pool as served on a GPU, 1024x1024
    python bench/warmup.py --model tiny --device cpu --dtype float32 --size 64 --steps 2 --out /tmp/w.json   # smoke

Each start is a fresh process building the pool's form as a replica does (`AppArgs.form(pool)` ->
`model.build.build_pipeline`, warm-up included): `ready_s` is that build. Then, per warm size and batch size, the
first request (new prompt, new seeds) and the median of `--repeats` more: `first_over_warm` is their ratio. One size
outside the warm set shows what a cold shape still costs. Two starts share one kernel-cache folder
(`args.kernel_cache_dir`: Triton, Inductor, cuDNN plans): the first with it empty (`ready_s`), the second with what
the first left (`ready_s_warm_cache`).
Writes `--out` (.json) and the same name .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _form(args: argparse.Namespace) -> Any:
    from deployments.config import AppArgs

    pool = {"cuda_graphs": True} if args.device.startswith("cuda") else {}
    return AppArgs.parse({"model": args.model, "device": args.device, "dtype": args.dtype,
                          "default_size": f"{args.size}x{args.size}", "max_batch_size": args.max_batch_size,
                          "kernel_cache_dir": args.kernel_cache, "pools": {args.pool: pool}}).form(args.pool)


def _start(args: argparse.Namespace) -> dict[str, Any]:
    """One replica start in this process: ready time, then first and warm latencies per warm-set item."""
    from model.build import build_pipeline
    from model.request import GenerationRequest

    form = _form(args)
    t0 = time.perf_counter()
    pipe = build_pipeline(form)
    ready_s = time.perf_counter() - t0

    def run(height: int, width: int, b: int, seed: int) -> float:
        batch = [GenerationRequest(f"a lighthouse on a cliff, take {seed}", height=height, width=width,
                                   steps=args.steps, seed=seed + i, quality=args.pool) for i in range(b)]
        t = time.perf_counter()
        pipe.generate(batch)
        return time.perf_counter() - t

    items = []
    shapes = [(h, w, b, True) for h, w in form.warm_sizes for b in form.warm_batch_sizes]
    shapes.append((args.size, args.size + 128, 1, False))  # outside the warm set
    for h, w, b, warmed in shapes:
        first = run(h, w, b, 1000)
        warm = statistics.median(run(h, w, b, 2000 + 10 * r) for r in range(args.repeats))
        items.append({"size": f"{w}x{h}", "batch": b, "warm_set": warmed, "first_s": round(first, 3),
                      "warm_s": round(warm, 3), "first_over_warm": round(first / warm, 3)})
    return {"ready_s": round(ready_s, 2), "warmup": list(pipe.warmup), "items": items}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flux-dev-random")
    ap.add_argument("--pool", default="high", choices=("lossless", "high"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--max-batch-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: bench/results/warmup-<gpu>.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kernel-cache", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_start(args)))
        return 0
    raw = argv if argv is not None else sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="fluxserve-kernel-cache-") as cache:
        starts = []
        for _ in range(2):  # empty cache, then the cache the first start left
            out = subprocess.run([sys.executable, __file__, *raw, "--child", "--kernel-cache", cache],
                                 capture_output=True, text=True, check=True)
            starts.append(json.loads(out.stdout.strip().splitlines()[-1]))
    import torch

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    cold, warm_cache = starts
    warmed = [i for i in cold["items"] if i["warm_set"]]
    result = {"gpu": gpu, "torch": torch.__version__, "command": "python bench/warmup.py " + shlex.join(raw),
              "model": args.model, "pool": args.pool, "steps": args.steps,
              "warm_set": [(i["size"], i["batch"]) for i in warmed],
              "ready_s": cold["ready_s"], "ready_s_warm_cache": warm_cache["ready_s"],
              "first_over_warm_max": max(i["first_over_warm"] for i in warmed),
              "outside_warm_set_extra_s": [round(i["first_s"] - i["warm_s"], 3) for i in cold["items"]
                                           if not i["warm_set"]],
              "starts": starts}
    out = Path(args.out or ROOT / "bench" / "results" / f"warmup-{gpu.split()[-1].lower() if gpu else 'cpu'}.json")
    out.write_text(json.dumps(result, indent=1))
    rows = [f"| {i['size']} | {i['batch']} | {'yes' if i['warm_set'] else 'no'} | {i['first_s']} | {i['warm_s']} | "
            f"{i['first_over_warm']} |" for i in cold["items"]]
    items = [f"| {a['size']} x{a['batch']}{' streamed' if a.get('stream') else ''} | {a['s']} | {b['s']} |"
             for a, b in zip(cold["warmup"], warm_cache["warmup"])]
    out.with_suffix(".md").write_text(
        f"# Warm-up before ready: {args.model}, pool {args.pool}, {gpu}\n\nRandom weights: times only.\n\n"
        f"Ready (build + warm-up): {cold['ready_s']} s with empty kernel caches, {warm_cache['ready_s']} s with the "
        f"caches the first start left. Largest first / warm over the warm set: {result['first_over_warm_max']}.\n\n"
        "| size | batch | in the warm set | first request s | warm s (median) | first / warm |\n"
        "| --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + f"\n\nCommand:\n\n```\n{result['command']}\n```\n"
        "\nWarm-up items (s) with empty kernel caches and with what the first start left:\n\n"
        "| item | empty caches | warm caches |\n| --- | --- | --- |\n" + "\n".join(items) + "\n")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
