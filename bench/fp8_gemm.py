"""The fp8 GEMMs of the high tier at FLUX.1-dev's shapes (a script): fast accumulation, and the weight-only GEMV
of the AdaLN modulation.

1. Token GEMMs (rows = tokens): bf16 `F.linear` against `model.linear.Linear.matmul` (fp8) (`torch._scaled_mm`, per-row and
   per-channel scales) with the `fp8_fast_accum` switch off and on; relative error of each against the fp32 product
   of the same fp8 operands.
2. AdaLN modulation (one row per image): bf16 `F.linear` against the weight-only fp8 GEMV and against quantizing
   the row and running `_scaled_mm`; relative error against the fp32 product of the bf16 row and the fp8 weight.

Median GPU time per call over CUDA-graph replays (bench/kernel_ops.graph_time_us). Each call set cycles through
`--sets` distinct weights (and inputs), so a weight is not served from L2 by the previous call. Random operands.

  python bench/fp8_gemm.py --out bench/results/fp8-gemm-h200.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernel_ops import graph_time_us, rel  # noqa: E402
from kernels import fp8, switches  # noqa: E402

# (name, rows, K, N, calls per step at 1024x1024, batch 1)
TOKEN_GEMMS = [
    ("double block q/k/v fused, image", 4096, 3072, 9216, 19),
    ("double block q/k/v fused, text", 512, 3072, 9216, 19),
    ("double block to_out, image", 4096, 3072, 3072, 19),
    ("double block ff up, image", 4096, 3072, 12288, 19),
    ("double block ff down, image", 4096, 12288, 3072, 19),
    ("double block ff up, text", 512, 3072, 12288, 19),
    ("double block ff down, text", 512, 12288, 3072, 19),
    ("single block q/k/v + mlp up", 4608, 3072, 21504, 38),
    ("single block proj_out", 4608, 15360, 3072, 38),
]
# (name, K, N, calls per step)
ADALN = [
    ("double block norm1 / norm1_context", 3072, 18432, 38),
    ("single block norm", 3072, 9216, 38),
]


def _layers(K: int, N: int, sets: int, weight_only: bool = False) -> list[tuple[nn.Linear, Linear]]:
    out = []
    for _ in range(sets):
        lin = nn.Linear(K, N, device="cuda", dtype=torch.bfloat16)
        out.append((lin, Linear.from_linears([lin], quant=FP8_WEIGHT_ONLY if weight_only else FP8)))
    return out


def token_gemms(sets: int) -> tuple[list[str], list[dict]]:
    rows, results = [], []
    for name, M, K, N, per_step in TOKEN_GEMMS:
        layers = _layers(K, N, sets)
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        qs = [fp8.quantize_rows(x) for x in xs]
        t_bf16 = graph_time_us([lambda lin=lin, x=x: F.linear(x, lin.weight, lin.bias) for (lin, _), x in
                                zip(layers, xs)])
        t, err = {}, {}
        ref = (qs[0][0].float() * qs[0][1]) @ layers[0][1].dequantized_weight().t() + layers[0][1].bias.float()
        for fast in (False, True):
            with switches.override(fp8_fast_accum=fast):
                t[fast] = graph_time_us([lambda f=f, q=q: f.matmul(*q) for (_, f), q in zip(layers, qs)])
                err[fast] = rel(layers[0][1].matmul(*qs[0]), ref)
        tflops = 2 * M * K * N / 1e6  # per us -> TFLOP/s
        rows.append(f"| {name} | {M} x {K} -> {N} | {t_bf16:.1f} | {t[False]:.1f} | {t[True]:.1f} | "
                    f"{t[False] / t[True]:.2f} | {tflops / t[False]:.0f} | {tflops / t[True]:.0f} | "
                    f"{err[False]:.1e} | {err[True]:.1e} | {per_step * (t[False] - t[True]) / 1000:.2f} |")
        print(rows[-1], flush=True)
        results.append({"name": name, "M": M, "K": K, "N": N, "per_step": per_step, "us_bf16": t_bf16,
                        "us_fp8": t[False], "us_fp8_fast_accum": t[True], "rel_err_fp8": err[False],
                        "rel_err_fp8_fast_accum": err[True]})
        del layers, xs, qs
        torch.cuda.empty_cache()
    return rows, results


def adaln(sets: int, batches: list[int]) -> tuple[list[str], list[dict]]:
    rows, results = [], []
    for name, K, N, per_step in ADALN:
        layers = _layers(K, N, sets, weight_only=True)
        for B in batches:
            xs = [torch.randn(B, K, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
            t_bf16 = graph_time_us([lambda lin=lin, x=x: F.linear(x, lin.weight, lin.bias) for (lin, _), x in
                                    zip(layers, xs)])
            t_wo = graph_time_us([lambda f=f, x=x: f(x) for (_, f), x in zip(layers, xs)])
            f0 = layers[0][1]
            ref = xs[0].float() @ f0.dequantized_weight().t() + f0.bias.float()
            try:  # _scaled_mm with a single row: not every build takes it
                t_q = graph_time_us([lambda f=f, x=x: f.matmul(*fp8.quantize_rows(x)) for (_, f), x in
                                     zip(layers, xs)])
                e_q = rel(f0.matmul(*fp8.quantize_rows(xs[0])), ref)
            except RuntimeError as exc:
                print(f"quantized row + _scaled_mm at {B} rows: {exc}", flush=True)
                t_q = e_q = float("nan")
            e_wo = rel(f0(xs[0]), ref)
            e_bf16 = rel(F.linear(xs[0], layers[0][0].weight, layers[0][0].bias), ref)
            gbs = K * N / 1e3  # fp8 weight bytes per us -> GB/s
            rows.append(f"| {name} | {B} x {K} -> {N} | {t_bf16:.1f} | {t_wo:.1f} | {t_q:.1f} | "
                        f"{t_bf16 / t_wo:.2f} | {gbs / t_wo:.0f} | {e_wo:.1e} | {e_q:.1e} | {e_bf16:.1e} | "
                        f"{per_step * (t_bf16 - t_wo) / 1000:.2f} |")
            print(rows[-1], flush=True)
            results.append({"name": name, "B": B, "K": K, "N": N, "per_step": per_step, "us_bf16": t_bf16,
                            "us_weight_only_fp8": t_wo, "us_quantized_fp8": t_q, "rel_err_weight_only": e_wo,
                            "rel_err_quantized": e_q, "rel_err_bf16_weight_vs_fp8_weight": e_bf16})
        del layers
        torch.cuda.empty_cache()
    return rows, results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fp8-gemm-h200.md"))
    ap.add_argument("--sets", type=int, default=4, help="distinct weights cycled per timing (L2 stays cold)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    torch.manual_seed(0)
    token_rows, token_results = token_gemms(args.sets)
    adaln_rows, adaln_results = adaln(args.sets, args.batches)
    text = "\n".join([
        "# fp8 GEMMs at FLUX.1-dev shapes", "", f"Command: `python3 {' '.join(sys.argv)}`", "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}. Median GPU time per call (us) over CUDA-graph "
        f"replays, {args.sets} distinct weights cycled. Random operands.", "",
        "## Token GEMMs: fp8 with and without fast accumulation", "",
        "Error: relative (Frobenius) against the fp32 product of the same fp8 operands.", "",
        "| GEMM | shape | us bf16 | us fp8 | us fp8 fast accum | speed-up | TFLOP/s fp8 | TFLOP/s fast | "
        "rel. err. fp8 | rel. err. fast | ms saved per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *token_rows, "",
        "## AdaLN modulation: weight-only fp8 GEMV", "",
        "Error: relative against the fp32 product of the bf16 row and the fp8 weight; the last error column is "
        "what the bf16 weight differs from its fp8 form by (the cost of fp8 weights at random values).", "",
        "| linear | shape | us bf16 | us weight-only fp8 | us quantized row + _scaled_mm | speed-up | GB/s | "
        "rel. err. weight-only | rel. err. quantized row | bf16 vs fp8 weight | ms saved per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *adaln_rows, "",
    ])
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"token_gemms": token_results,
                                                               "adaln": adaln_results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
