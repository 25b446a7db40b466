"""8-bit attention (kernels/attention.py) against SDPA on one GPU (a script, not a test).

FLUX.1-dev's joint attention at 1024x1024 (4096 image + 512 text tokens, 24 heads of 128), batch 1 and 2: median GPU
time per call over CUDA-graph replays (bench/kernel_ops.graph_time_us), SDPA by backend, the Triton 8-bit path (int8
Q K^T, fp8 P V) whole and its two launches alone, cuDNN's fp8 SDPA (where nvidia-cudnn-frontend is installed) whole
as the model runs it and alone, and the relative error of each against fp32 attention on inputs shaped like FLUX's
(q and k RMS-normed per head, then scaled; v Gaussian). Synthetic inputs: the errors bound the kernel's arithmetic,
not an image's quality (bench/high.py measures that).

  python bench/attention.py --out bench/results/attention-h200.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernel_ops import graph_time_us, rel  # noqa: E402
from kernels import attention as A  # noqa: E402
from kernels import _attention_fp8_triton as T  # noqa: E402
from kernels import _high_triton as K  # noqa: E402


def inputs(batch: int, seq: int, heads: int, dim: int, qk_gain: float, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def normed() -> torch.Tensor:
        x = torch.randn(batch, seq, heads, dim, device="cuda", generator=g)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * qk_gain

    q, k = normed(), normed()
    v = torch.randn(batch, seq, heads, dim, device="cuda", generator=g)
    return tuple(t.bfloat16() for t in (q, k, v))


def _identity_rope(q: torch.Tensor, dim: int, gain: float = 1.0) -> tuple[torch.nn.RMSNorm, tuple[torch.Tensor, ...]]:
    """An RMSNorm of weight `gain` and RoPE tables that rotate by 0 (q and k here are normed already: re-norming
    them changes them by rounding only)."""
    norm = torch.nn.RMSNorm(dim, eps=1e-6).to(q.device, q.dtype).requires_grad_(False)  # else eager norms run
    with torch.no_grad():
        norm.weight.fill_(gain)
    S = q.shape[1]
    return norm, (torch.ones(S, dim, device=q.device), torch.zeros(S, dim, device=q.device))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention-h200.md"))
    ap.add_argument("--seq", type=int, default=4608)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--qk-gains", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    args = ap.parse_args()
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, results = [], []
    for B in args.batches:
        q, k, v = inputs(B, args.seq, args.heads, args.dim, 1.0)
        flops = 4 * B * args.heads * args.seq * args.seq * args.dim
        t = {"sdpa (default)": graph_time_us([lambda: A.sdpa(q, k, v)])}
        for name, be in (("sdpa cuDNN", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    t[name] = graph_time_us([lambda: A.sdpa(q, k, v)])
            except Exception as exc:  # a backend that refuses these inputs
                print(f"{name}: {exc!r}", flush=True)
        t["8-bit (quantize + attention)"] = graph_time_us([lambda: A.fp8_attention(q, k, v)])
        t["8-bit: quantize only"] = graph_time_us([lambda: T.quantize_qkv(q, k, v, A.VBLOCK)])
        pre = T.quantize_qkv(q, k, v, A.VBLOCK)
        out = torch.empty_like(q)
        t["8-bit: attention only"] = graph_time_us([lambda: T.attend_quantized(*pre, out)])
        if A.cudnn_fp8_refusal(q) is None:  # cuDNN's fp8 SDPA, fed the way the model feeds it
            norm, ident = _identity_rope(q, args.dim)
            qkv = ((None, q), (None, k), (None, v), (None, norm), (None, norm), *ident)
            t["cuDNN fp8 (QK norm + RoPE to fp8, v to fp8, attention, output to bf16)"] = graph_time_us(
                [lambda: A.rope_attention_fp8(*qkv)])
            q8, dq = K.rms_rope_fast(None, q, None, norm.weight, 0.0, norm.eps, *ident, fp8=True)
            v8, vs = T.tokens_fp8(None, v)
            graph = A._cudnn_graph(B, args.seq, args.heads, args.dim, q.device)
            t["cuDNN fp8: attention only"] = graph_time_us([lambda: graph(q8, q8, v8, dq, dq, vs)])
        else:
            print(f"cuDNN fp8: {A.cudnn_fp8_refusal(q)}", flush=True)
        best = T._attention_tuned.best_config
        for name, us in t.items():
            rows.append(f"| {B} | {name} | {us:.1f} | {flops / us / 1e6:.0f} |")
            print(rows[-1], flush=True)
        results.append({"batch": B, "us": t, "config": str(best)})
    err_rows = []
    for gain in args.qk_gains:
        q, k, v = inputs(1, args.seq, args.heads, args.dim, gain, seed=1)
        ref = A.sdpa(q.float(), k.float(), v.float())
        e = {"sdpa bf16": rel(A.sdpa(q, k, v), ref), "8-bit": rel(A.fp8_attention(q, k, v), ref),
             "8-bit vs its eager twin": rel(A.fp8_attention(q, k, v), A.fp8_attention_eager(q, k, v))}
        if A.cudnn_fp8_refusal(q) is None:
            # the norm's weight carries the gain here (the fp8 scale of q and k is bounded by it)
            norm, ident = _identity_rope(q, args.dim, gain)
            unit = (q.float() / gain).bfloat16(), (k.float() / gain).bfloat16()
            e["cuDNN fp8"] = rel(A.rope_attention_fp8((None, unit[0]), (None, unit[1]), (None, v), (None, norm),
                                                      (None, norm), *ident), ref)
        err_rows.append(f"| {gain} | " + " | ".join(f"{x:.2e}" for x in e.values()) + " |")
        print(err_rows[-1], flush=True)
        results.append({"qk_gain": gain, "rel_err": e})
    dev = torch.cuda.get_device_name()
    text = "\n".join([
        "# 8-bit attention vs SDPA", "", f"Command: `python3 {' '.join(sys.argv)}`", "",
        f"{dev}, torch {torch.__version__}, triton {triton.__version__}. S={args.seq}, {args.heads} heads of "
        f"{args.dim}, bf16 in and out. Median GPU time per call over CUDA-graph replays; TFLOP/s counts 4 B H S^2 D.",
        "", "| batch | path | us | TFLOP/s |", "|---|---|---|---|", *rows, "",
        "Relative error against fp32 attention (batch 1; q, k RMS-normed then scaled by the gain: larger gains, "
        "peakier softmax; synthetic inputs):", "",
        "| q/k gain | " + " | ".join(results[-1]["rel_err"]) + " |",
        "|---" * (len(results[-1]["rel_err"]) + 1) + "|", *err_rows, "",
    ])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
