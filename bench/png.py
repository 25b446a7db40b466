"""PNG encoding per tier at the served sizes: Pillow's bytes (`lossless`) against the parallel writer (`high`).

Three kinds of 1024x1024 picture: smooth gradients with edges (photo-like), the toy's flat scenes, and fine noise
over gradients (what random FLUX weights draw). Median of `--repeats` after one warm-up, both encoders interleaved.

  python bench/png.py --out bench/results/png-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model import png  # noqa: E402


def pictures(size: tuple[int, int]) -> dict[str, np.ndarray]:
    from model.toy.scenes import render, sample_scene

    h, w = size
    rng = np.random.default_rng(0)
    field = np.cumsum(rng.normal(size=(h, w, 3)), axis=1)
    smooth = ((field - field.min()) / (field.max() - field.min()) * 255).astype(np.uint8)
    noisy = np.clip(smooth.astype(np.int16) + rng.integers(-24, 25, smooth.shape), 0, 255).astype(np.uint8)
    toy = render(sample_scene(random.Random(1)), (h, w)).numpy()
    return {"smooth": smooth, "toy scene": np.ascontiguousarray(toy), "noise over gradients": noisy}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    from PIL import Image

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1024x1024")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "png-cpu.json"))
    args = ap.parse_args(argv)
    w, h = (int(v) for v in args.size.split("x"))
    rows = {}
    for name, pixels in pictures((h, w)).items():
        image = Image.fromarray(pixels)
        fns = {"lossless": lambda: png.result_png(image, "lossless"), "high": lambda: png.result_png(image, "high")}
        times: dict[str, list[float]] = {k: [] for k in fns}
        sizes = {}
        for i in range(1 + args.repeats):
            for k, fn in fns.items():
                t = time.perf_counter()
                data = fn()
                if i:
                    times[k].append(time.perf_counter() - t)
                sizes[k] = len(data)
        ms = {k: statistics.median(v) * 1000 for k, v in times.items()}
        rows[name] = {"lossless_ms": ms["lossless"], "high_ms": ms["high"], "speedup": ms["lossless"] / ms["high"],
                      "lossless_bytes": sizes["lossless"], "high_bytes": sizes["high"],
                      "size_ratio": sizes["high"] / sizes["lossless"]}
        print(name, rows[name], flush=True)
    result = {"size": args.size, "repeats": args.repeats, "cpu_count": os.cpu_count(), "cpu": cpu_name(),
              "python": platform.python_version(), "bands": png.BANDS, "level": png.LEVEL,
              "pictures": rows, "command": "python bench/png.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# PNG encoding per tier, {args.size}: {result['cpu']}, {os.cpu_count()} cores", "",
             "`lossless`: Pillow at its default level (the bytes `image.save(path)` writes); `high`: the parallel "
             "writer (model/png.py), the same pixels. Median of "
             f"{args.repeats} after a warm-up.", "",
             "| picture | lossless ms | high ms | speed-up | high bytes / lossless bytes |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {k} | {r['lossless_ms']:.1f} | {r['high_ms']:.1f} | {r['speedup']:.2f}x | {r['size_ratio']:.3f} |"
              for k, r in rows.items()]
    lines += ["", "```", result["command"], "```", ""]
    Path(args.out).with_suffix(".md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
