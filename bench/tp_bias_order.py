"""Measure where the row-parallel bias should go: `python bench/tp_bias_order.py`.

Simulates a TP-way row split in one process (the all-reduce of partial products is a plain sum in rank order, as
gloo and a 2-rank NCCL ring compute it) and compares, against the unsharded F.linear (TP=1), adding the bias
(a) inside rank 0's local GEMM before the reduce, or (b) once after the reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPES = [(64, 256, 128), (300, 1024, 512), (77, 3072, 3072), (128, 12288, 512)]


def compare(dtype: torch.dtype, tp: int, seeds: int = 3) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    stats = {"rel_err_before": 0.0, "rel_err_after": 0.0, "equal_before": 0.0, "equal_after": 0.0}
    n = 0
    for m, k, out in SHAPES:
        for _ in range(seeds):
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(out, k, generator=g) / k**0.5).to(dtype)
            b = (0.1 * torch.randn(out, generator=g)).to(dtype)
            full = F.linear(x, w, b)
            cols = k // tp
            parts = [F.linear(x[:, i * cols : (i + 1) * cols], w[:, i * cols : (i + 1) * cols]) for i in range(tp)]
            after = parts[0]
            for p in parts[1:]:
                after = after + p
            after = after + b
            before = F.linear(x[:, :cols], w[:, :cols], b)
            for p in parts[1:]:
                before = before + p
            scale = full.double().abs().mean()
            for name, y in (("before", before), ("after", after)):
                stats[f"rel_err_{name}"] += ((y.double() - full.double()).abs().mean() / scale).item()
                stats[f"equal_{name}"] += (y == full).double().mean().item()
            n += 1
    return {key: v / n for key, v in stats.items()}


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for dtype in (torch.float32, torch.bfloat16):
        for tp in (2, 4):
            s = compare(dtype, tp)
            print(
                f"{str(dtype):15s} tp={tp}: mean rel err vs TP=1  bias-in-rank0-GEMM {s['rel_err_before']:.3g}  "
                f"bias-after-reduce {s['rel_err_after']:.3g} | bit-equal elements {s['equal_before']:.1%} vs "
                f"{s['equal_after']:.1%}"
            )


if __name__ == "__main__":
    main()
