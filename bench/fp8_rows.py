"""Which row counts M cuBLAS accepts for the fp8 GEMM (`torch._scaled_mm` as `kernels.fp8.scaled_mm` calls it:
row-wise scales, bias, bf16 out) at the FLUX.1 linear shapes, with fast accumulation on and off; and whether a
`high` request at the smallest sizes the server admits runs on a converted pipeline, with the fallbacks
(`kernels.fp8.REFUSED`) it took. `kernels.fp8.FAST_ACCUM_MIN_ROWS` should cover every fast-accumulation refusal
found here, so that no request pays for a refusal.

A request's rows are its image tokens (h/16 * w/16 per image) or text tokens: a 64x64 image has 16, so the GEMM must
take every M the request limits allow, not only the 1024x1024 ones the benches time. Per (K, N) it lists the M
that failed, with the error, and for each failure whether the same GEMM with M padded to a multiple of 16 ran.

  python bench/fp8_rows.py --out bench/results/fp8-rows-h100.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import fp8  # noqa: E402

# (K, N) of the FLUX.1-dev linears: x_embedder, context_embedder, q/k/v, fused q/k/v, FF up, FF down, the single
# block's fused q/k/v + MLP up, its proj_out, the final proj_out.
SHAPES = [(64, 3072), (4096, 3072), (3072, 3072), (3072, 9216), (3072, 12288), (12288, 3072), (3072, 21504),
          (15360, 3072), (3072, 64)]
ROWS = sorted({*range(1, 49), 64, 80, 100, 128, 255, 256, 257, 1000, 1024, 4096, 4608})


def gemm(M: int, K: int, N: int, fast: bool) -> None:
    dev = torch.device("cuda")
    lin = torch.nn.Linear(K, N, device=dev, dtype=torch.bfloat16)
    layer = Linear.from_linears([lin], quant=FP8)
    q, s = fp8.quantize_rows(torch.randn(M, K, device=dev, dtype=torch.bfloat16))
    # the op itself, not the layer: the layer's 64-row rule and its fallback would hide what cuBLAS refuses
    torch._scaled_mm(q, layer.weight.t(), scale_a=s, scale_b=layer.weight_scale, bias=layer.bias,
                     out_dtype=torch.bfloat16, use_fast_accum=fast)
    torch.cuda.synchronize()


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def probe_gemms() -> list[dict]:
    rows = []
    for K, N in SHAPES:
        for fast in (True, False):
            failed = {}
            for M in ROWS:
                try:
                    gemm(M, K, N, fast)
                except RuntimeError as exc:
                    padded = -(-M // 16) * 16
                    try:
                        gemm(padded, K, N, fast)
                        pad_ok = True
                    except RuntimeError:
                        pad_ok = False
                    failed[M] = {"error": short(exc), "padded_to": padded, "padded_ok": pad_ok}
            rows.append({"K": K, "N": N, "fast_accum": fast, "failed": failed})
            print(f"K={K} N={N} fast={fast}: failed M {sorted(failed)}", flush=True)
    return rows


def probe_requests(model: str, sides: list[tuple[int, int]]) -> list[dict]:
    from model.loading import load_pipeline
    from model.request import GenerationRequest

    pipe = load_pipeline(model, device="cuda", dtype=torch.bfloat16)
    form = pipe.take_high_defaults()
    out = []
    for h, w in sides:
        req = GenerationRequest(prompt="a red cube on a table", height=h, width=w, steps=2, quality="high")
        try:
            pipe.generate([req])
            out.append({"size": f"{w}x{h}", "ok": True})
        except Exception as exc:  # noqa: BLE001 - each size's outcome is the result
            out.append({"size": f"{w}x{h}", "ok": False, "error": short(exc)})
        print(f"high {w}x{h}: {out[-1]}", flush=True)
    fallbacks = {"x".join(map(str, key)): err for key, err in fp8.REFUSED.items()}  # M x K x N x fast
    return [{"form": {k: v for k, v in form.items() if k != "kept_bf16"}, "fallbacks": fallbacks}, *out]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flux-dev-random")
    ap.add_argument("--sides", default="64x64,64x80,80x64,96x96,128x128,256x256",
                    help="HxW list of high requests to run (empty: none)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/fp8_rows.py needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "python": platform.python_version(),
              "command": "python bench/fp8_rows.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows_probed": ROWS, "gemms": probe_gemms()}
    sides = [tuple(int(v) for v in s.split("x")) for s in args.sides.split(",") if s]
    if sides:
        result["requests"] = probe_requests(args.model, sides)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
