"""Can PEFT's LoRA tail `y + lora_B(t) * s` (t = lora_A(x), rank r) run as one Triton pass, bit for bit?

PEFT's order rounds three times: cuBLAS's bf16 GEMM `t B^T` (K = r), the product with the Python float `s`, and the
sum with the base layer's output `y`. A fused pass keeps all three roundings in registers; what it cannot choose is
how the tensor cores sum a K = r dot product, so this probe asks whether Triton's `tl.dot` sums it as cuBLAS does
for FLUX's adapter shapes, and what the fused pass costs against PEFT's three kernels.

    python bench/lora_exact_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU hosts: the probe needs a GPU anyway
    triton = None


if triton is not None:

    @triton.jit
    def _lora_tail_kernel(y_ptr, t_ptr, b_ptr, out_ptr, M, N, s, R: tl.constexpr, BM: tl.constexpr,
                          BN: tl.constexpr, KSTEP: tl.constexpr):
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.static_range(0, R, KSTEP):
            rk = k0 + tl.arange(0, KSTEP)
            t = tl.load(t_ptr + rm[:, None] * R + rk[None, :], mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_ptr + rn[None, :] * R + rk[:, None], mask=rn[None, :] < N, other=0.0)
            acc = tl.dot(t, b, acc)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        lora = acc.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        lora = (lora * s).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        y = tl.load(y_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], (y + lora).to(tl.bfloat16, fp_downcast_rounding="rtne"),
                 mask=mask)


def fused_tail(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, s: float, kstep: int | None = None,
               block: tuple[int, int] = (64, 128)) -> torch.Tensor:
    """`y + F.linear(t, b) * s` in one pass (bf16, contiguous)."""
    M, N = y.shape
    r = t.shape[1]
    out = torch.empty_like(y)
    bm, bn = block
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _lora_tail_kernel[grid](y, t, b, out, M, N, s, R=r, BM=bm, BN=bn, KSTEP=kstep or r, num_warps=4,
                            enable_fp_fusion=False)
    return out


def _ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# FLUX.1 adapter layers at 1024x1024: (rows, output columns): q/v/out (3072), MLP in (12288), text rows (512).
SHAPES = [(4096, 3072), (4608, 3072), (4608, 12288), (512, 3072), (2, 3072), (4096 * 4, 3072)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64, 128])  # (tl.dot takes K >= 16)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    rows = []
    for r in a.ranks:
        for M, N in SHAPES:
            for kstep in sorted({16, r}):
                equal_t = equal_out = True
                for seed in range(a.seeds):
                    g = torch.Generator(device="cuda").manual_seed(seed)
                    t = torch.randn(M, r, device="cuda", generator=g).bfloat16()
                    b = (torch.randn(N, r, device="cuda", generator=g) * 0.05).bfloat16()
                    y = torch.randn(M, N, device="cuda", generator=g).bfloat16()
                    s = 0.75
                    ref_t = F.linear(t, b)
                    ref = y + ref_t * s  # PEFT's tail
                    got_t = fused_tail(torch.zeros_like(y), t, b, 1.0, kstep)
                    got = fused_tail(y, t, b, s, kstep)
                    equal_t &= bool(torch.equal(got_t, ref_t))
                    equal_out &= bool(torch.equal(got, ref))
                row = {"rank": r, "rows": M, "cols": N, "kstep": kstep, "dot_equal": equal_t, "tail_equal": equal_out}
                if kstep == r:
                    row["peft_tail_ms"] = _ms(lambda: y + F.linear(t, b) * s)
                    row["fused_tail_ms"] = _ms(lambda: fused_tail(y, t, b, s, kstep))
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "all_equal": all(r["tail_equal"] for r in rows), "rows": rows}
    print("all equal:", result["all_equal"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
