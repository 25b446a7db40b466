"""The fp8 activation quantization pass (kernels/_fp8_triton.quantize_rows) at FLUX.1-dev's shapes (a script).

Per call, median GPU time over CUDA-graph replays (bench/kernel_ops.graph_time_us) and the bandwidth it reaches
(bf16 read once + fp8 written; the second pass's re-read is not counted), with the GELU's amax taken from each row's
max (`gelu_from_max`, the default) and per element (the earlier kernel), side by side. Gaussian inputs (x 2).

  python bench/fp8_quant.py --out bench/results/fp8-quant-h200.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernel_ops import graph_time_us  # noqa: E402
from kernels import _fp8_triton as T  # noqa: E402

# (name, rows, width of a, width of b, GELU on b, calls per step at 1024x1024)
SHAPES = [
    ("single block proj_out input [attn | gelu(mlp)]", 4608, 3072, 12288, True, 38),
    ("double block ff down input, image (gelu)", 4096, 0, 12288, True, 19),
    ("double block ff down input, text (gelu)", 512, 0, 12288, True, 19),
    ("double block to_out input, image", 4096, 3072, 0, False, 19),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fp8-quant-h200.md"))
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, results = [], []
    for name, M, KA, KB, gelu, per_step in SHAPES:
        x = (torch.randn(M, KA + max(KB, 1), device="cuda", generator=g) * 2).bfloat16()
        a, b = x[:, :KA], (x[:, KA:KA + KB] if KB else None)
        t = {}
        for mode in (False, True):
            t[mode] = graph_time_us([lambda: T.quantize_rows(a, b, gelu, gelu_from_max=mode)])
        q0, s0 = T.quantize_rows(a, b, gelu, gelu_from_max=False)
        q1, s1 = T.quantize_rows(a, b, gelu, gelu_from_max=True)
        same = bool(torch.equal(s0, s1) and torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)))
        gbs = M * (KA + KB) * 3 / 1e3  # bytes per us -> GB/s
        rows.append(f"| {name} | {M} x ({KA} + {KB}) | {t[False]:.1f} | {t[True]:.1f} | {t[False] / t[True]:.2f} | "
                    f"{gbs / t[True]:.0f} | {per_step * (t[False] - t[True]) / 1000:.2f} | {same} |")
        print(rows[-1], flush=True)
        results.append({"name": name, "M": M, "KA": KA, "KB": KB, "gelu": gelu, "per_step": per_step,
                        "us_per_element_gelu": t[False], "us_from_max": t[True], "bitwise_same": same})
    text = "\n".join([
        "# fp8 activation quantization at FLUX.1-dev shapes", "", f"Command: `python3 {' '.join(sys.argv)}`", "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}. Median GPU time per call over CUDA-graph "
        "replays; GB/s counts the bf16 read once and the fp8 write.", "",
        "| site | shape | us, GELU per element in the amax pass | us, GELU of the row max | speed-up | GB/s | "
        "ms saved per step | same bytes |", "|---|---|---|---|---|---|---|---|", *rows, "",
    ])
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
