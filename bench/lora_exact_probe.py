"""Does the LoRA pass (`kernels/_lossless_triton.py` `lora_tail`) add PEFT's `y + lora_B(t) * s` bit for bit, and
what does it cost against PEFT's three kernels, at FLUX.1's adapter shapes?

PEFT's order rounds three times: cuBLAS's bf16 GEMM `t B^T` (K = r), the product with the Python float `s`, and the
sum with the base layer's output `y`. The pass keeps all three roundings; what it cannot choose is how the tensor
cores sum a K = r dot product, so this probe asks whether Triton's `tl.dot` sums it as cuBLAS does (the dot alone,
y = 0 and s = 1, and the whole tail), rank by rank and shape by shape, with the pass's own gate out of the way.

    python bench/lora_exact_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_ops import stream_time_us, write_probe  # noqa: E402
from kernels.lora import RANKS, lora_tail_eager  # noqa: E402


def _ms(fn) -> float:
    return stream_time_us(fn) / 1e3  # median over batches of back-to-back launches


# FLUX.1 adapter layers at 1024x1024: (rows, output columns): q/v/out (3072), MLP in (12288), text rows (512).
SHAPES = [(4096, 3072), (4608, 3072), (4608, 12288), (512, 3072), (2, 3072), (4096 * 4, 3072)]


def gelu_passes(rank: int = 16) -> list[dict]:
    """The tanh-GELU passes into a single block's joint buffer (a column slice), with and without one adapter's term,
    beside aten's GELU into a contiguous output (what full bandwidth looks like here): ms and GB/s moved."""
    import triton

    from kernels import _lossless_triton as K
    from kernels._lossless_triton import gelu_tanh, gelu_tanh_lora

    out = []
    for m, n, width in ((4608, 12288, 15360), (4096, 12288, 12288)):
        g = torch.Generator(device="cuda").manual_seed(0)
        y = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        t = torch.randn(m, rank, device="cuda", generator=g).bfloat16()
        b = (torch.randn(n, rank, device="cuda", generator=g) * 0.05).bfloat16()
        joint = torch.empty(m, width, device="cuda", dtype=y.dtype)
        dst = joint[:, width - n:]
        moved = 2 * y.numel() * y.element_size() / 1e9
        row = {"rows": m, "cols": n, "rank": rank,
               "aten_contiguous_ms": _ms(lambda: F.gelu(y, approximate="tanh")),
               "aten_into_slice_ms": _ms(lambda: torch._C._nn.gelu(y, approximate="tanh", out=dst)),
               "triton_into_slice_ms": _ms(lambda: gelu_tanh(y, dst)),
               "triton_lora_into_slice_ms": _ms(lambda: gelu_tanh_lora(y, t, b, 0.75, dst))}
        row.update({k.replace("_ms", "_gbps"): round(moved / (v / 1e3), 1) for k, v in list(row.items())
                    if k.endswith("_ms")})
        # the plain pass's fixed tile (GELU_CONFIG) against others
        row["triton_into_slice_ms_by_tile"] = {
            f"{block}x{warps}": _ms(lambda: K._gelu_tanh_kernel[(m, triton.cdiv(n, block))](
                y, dst, n, y.stride(0), dst.stride(0), BETA=K._GELU_BETA, KAPPA=K._GELU_KAPPA,
                TY=K._TL_DTYPE[y.dtype], FMA_INNER=K.GELU_FMA_INNER, BLOCK=block, INTERPRET=False,
                enable_fp_fusion=False, num_warps=warps))
            for block, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16))}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--gelu-only", action="store_true", help="only the GELU passes' timings")
    p.add_argument("--out")
    a = p.parse_args()
    if a.gelu_only:
        a.ranks = []
    import triton

    from kernels._lossless_triton import lora_tail

    rows = []
    for r in a.ranks:
        for M, N in SHAPES:
            equal_t = equal_out = True
            for seed in range(a.seeds):
                g = torch.Generator(device="cuda").manual_seed(seed)
                t = torch.randn(M, r, device="cuda", generator=g).bfloat16()
                b = (torch.randn(N, r, device="cuda", generator=g) * 0.05).bfloat16()
                y = torch.randn(M, N, device="cuda", generator=g).bfloat16()
                s = 0.75
                equal_t &= bool(torch.equal(lora_tail(torch.zeros_like(y), t, b, 1.0), F.linear(t, b)))
                equal_out &= bool(torch.equal(lora_tail(y, t, b, s), lora_tail_eager(y, t, b, s)))
            row = {"rank": r, "rows": M, "cols": N, "dot_equal": equal_t, "tail_equal": equal_out,
                   "peft_tail_ms": _ms(lambda: lora_tail_eager(y, t, b, s)),
                   "fused_tail_ms": _ms(lambda: lora_tail(y, t, b, s))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "all_equal": all(r["tail_equal"] for r in rows) if rows else None, "rows": rows, "gelu": gelu_passes()}
    write_probe(result, a.out)


if __name__ == "__main__":
    main()
