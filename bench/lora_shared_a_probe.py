"""Layers that read one input (an attention's q, k and v; a single block's q, k, v and MLP-in) each multiply it by
their LoRA A in PEFT's order: one cuBLAS GEMM `x A_i^T` per layer, each reading all of x. Does one GEMM against the
stacked A's, `x [A_1; ...; A_p]^T`, give each layer's columns bit for bit, and what does it save, at FLUX.1's
shapes? (cuBLAS chooses its kernel per shape, split-K included, so equality is a per-shape, per-GPU fact.)

    python bench/lora_shared_a_probe.py --out probe.json
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
from kernels.lora import RANKS  # noqa: E402


def _ms(fn) -> float:
    return stream_time_us(fn) / 1e3  # median over batches of back-to-back launches


# (tokens per image, K) at 1024x1024: image rows, text rows, a single block's joined rows; 2 to 4 layers share them
# (q and v; q, k and v; a single block's q, k, v and MLP-in).
SHAPES = [(tokens, 3072, parts) for tokens in (4096, 512, 4608) for parts in (2, 3, 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=list(RANKS[:3]))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    rows = []
    for r in a.ranks:
        for tokens, k, parts in SHAPES:
            for batch in a.batches:
                m = tokens * batch
                equal = True
                for seed in range(a.seeds):
                    g = torch.Generator(device="cuda").manual_seed(seed)
                    x = torch.randn(batch, tokens, k, device="cuda", generator=g).bfloat16()
                    mats = [(torch.randn(r, k, device="cuda", generator=g) * 0.02).bfloat16() for _ in range(parts)]
                    stacked = torch.cat(mats)
                    both = F.linear(x, stacked)
                    for i, w in enumerate(mats):
                        equal &= bool(torch.equal(both[..., i * r:(i + 1) * r], F.linear(x, w)))
                row = {"rank": r, "rows": m, "k": k, "parts": parts, "equal": equal,
                       "apart_ms": _ms(lambda: [F.linear(x, w) for w in mats]),
                       "stacked_ms": _ms(lambda: F.linear(x, stacked))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "all_equal": all(r["equal"] for r in rows), "rows": rows}
    write_probe(result, a.out)


if __name__ == "__main__":
    main()
