"""Benchmark of kernels/ on one GPU (a script, not a test).

1. residual_gate_add vs the eager pair `residual + gate * update` on the FLUX shapes (bf16, AdaLN chunk gate):
   median GPU time per call (CUDA-graph replays, inputs rotated past L2), GB/s counting the 3 big tensors the
   fused kernel must move, and % of a device-to-device copy rate measured in the same run.
2. Linear(3072 -> 12288) + tanh-GELU at 512/4096/4608 rows and twice that (B=2): F.linear alone, F.linear then
   F.gelu, the cuBLASLt GELU epilogue, every other registered implementation, and what the per-shape dispatch picks.

Usage: python bench/kernel_ops.py [--out bench/results/kernels-h200.md]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels import gelu as G  # noqa: E402
from kernels import residual as R  # noqa: E402

L2_BYTES = 60 * 2**20
RESIDUAL_SHAPES = [(1, 4096, 3072), (1, 512, 3072), (1, 4608, 3072), (2, 4096, 3072)]
GELU_ROWS = [512, 4096, 4608, 1024, 8192, 9216]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative (Frobenius) error of `a` against `b`, in fp32."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def graph_time_us(calls: list[Callable[[], object]], reps: int = 30) -> float:
    """Median GPU time of one call: all `calls` (one per input set) captured in one CUDA graph, replayed `reps`
    times; launch gaps and Python overhead are out of the number."""
    for c in calls:  # warm-up: compilation/autotuning happens here, not under capture
        c()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def host_time_us(call: Callable[[], object], n: int = 200) -> float:
    """Wall time per call issued back to back from Python (includes launch overhead)."""
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / n


def stream_time_us(call: Callable[[], object], reps: int = 20, batch: int = 5) -> float:
    """Median GPU time per call over batches of back-to-back launches on the stream (no graph)."""
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(batch):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / batch)
    return statistics.median(times)


def write_probe(result: dict, out: str | None) -> None:
    """A probe's end: its `all_equal` verdict printed, the result written as JSON to `out` (if given)."""
    print("all equal:", result["all_equal"])
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


def copy_rate_gbs() -> dict[str, float]:
    """Device-to-device copy rate (bytes read + written) of a 1 GiB buffer, three ways. Inside a CUDA graph a
    copy_ becomes a memcpy node, which ran far slower than the same copy on a stream in our first run: the
    ceiling is the best of them (an SM copy kernel is the honest reference for an SM kernel)."""
    n = 2**29  # 1 GiB of bf16 per buffer
    src = torch.randn(n // 4, device="cuda").bfloat16().repeat(4)
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    rates = {
        "copy_ on a stream": nbytes / stream_time_us(lambda: dst.copy_(src)) / 1e3,
        "copy_ in a CUDA graph": nbytes / graph_time_us([lambda: dst.copy_(src)], reps=20) / 1e3,
        "SM kernel torch.neg(src, out=dst)": nbytes / stream_time_us(lambda: torch.neg(src, out=dst)) / 1e3,
    }
    del src, dst
    torch.cuda.empty_cache()
    return rates


def bench_residual(copy_rates: dict[str, float], dtype: torch.dtype) -> list[str]:
    from kernels import _residual_triton as T

    copy_gbs = max(copy_rates.values())
    rows = [
        "Device-to-device copy rate (read + write, 1 GiB) measured in this run: "
        + ", ".join(f"{k}: {v:.0f} GB/s" for k, v in copy_rates.items())
        + f". '% of copy' uses the best, **{copy_gbs:.0f} GB/s**.",
        "",
        f"| shape ({str(dtype).replace('torch.', '')}, gate = AdaLN chunk view) | eager us | fused us | speed-up "
        "| fused GB/s | % of copy | eager / fused us, no graph | eager / fused host us/call | best tile (sweep) "
        "| torch.equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for B, S, D in RESIDUAL_SHAPES:
        per_set = 3 * B * S * D * 2
        nsets = min(64, max(2, math.ceil(4 * L2_BYTES / per_set)))
        sets = []
        for _ in range(nsets):
            r = torch.randn(B, S, D, device="cuda").to(dtype)
            u = torch.randn(B, S, D, device="cuda").to(dtype)
            g = torch.randn(B, 6 * D, device="cuda").to(dtype).chunk(6, dim=1)[2].unsqueeze(1)
            sets.append((r, u, g))
        exact = all(torch.equal(kernels.residual_gate_add(r, u, g), r + g * u) for r, u, g in sets[:2])
        eager_us = graph_time_us([lambda s=s: s[0] + s[2] * s[1] for s in sets])
        calls_before = R.triton_calls()
        fused_us = graph_time_us([lambda s=s: kernels.residual_gate_add(*s) for s in sets])
        assert R.triton_calls() > calls_before and not R.fast_path_disabled(), "fast path did not run"
        r, u, g = sets[0]
        eager_stream = stream_time_us(lambda: r + g * u)
        fused_stream = stream_time_us(lambda: kernels.residual_gate_add(r, u, g))
        eager_host = host_time_us(lambda: r + g * u)
        fused_host = host_time_us(lambda: kernels.residual_gate_add(r, u, g))
        sweep = {}
        for cfg in T._CONFIGS:
            c = dict(cfg.kwargs, num_warps=cfg.num_warps)
            sweep[f"{c['BLOCK_S']}x{c['BLOCK_D']}/w{c['num_warps']}"] = graph_time_us(
                [lambda s=s, c=c: T.launch(s[0], s[1], R._gate_as_b1d(s[0], s[2]), config=c) for s in sets]
            )
        best = min(sweep, key=sweep.__getitem__)
        gbs = per_set / fused_us / 1e3
        rows.append(
            f"| ({B}, {S}, {D}) | {eager_us:.1f} | {fused_us:.1f} | {eager_us / fused_us:.2f}x | {gbs:.0f} "
            f"| {100 * gbs / copy_gbs:.0f}% | {eager_stream:.1f} / {fused_stream:.1f} | {eager_host:.1f} / {fused_host:.1f} "
            f"| {best} {sweep[best]:.1f} us "
            f"| {exact} |"
        )
        print(rows[-1], flush=True)
        print("   tile sweep us:", {k: round(v, 1) for k, v in sweep.items()}, flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def bench_gelu(dtype: torch.dtype) -> list[str]:
    K, N = 3072, 12288
    torch.manual_seed(0)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(dtype)
    b = torch.randn(N, device="cuda").to(dtype)
    impls = {n: f for n, f in G.GELU_IMPLS.items() if n != "unfused"}
    head = " | ".join(f"{n} us (x vs lin+gelu)" for n in impls)
    rows = [
        f"| M x {K} -> {N} ({str(dtype).replace('torch.', '')}) | F.linear us (TFLOP/s) | linear+gelu us | {head} "
        "| dispatch picks | rel err vs fp64 (picked) |",
        "|---|---|---|" + "---|" * len(impls) + "---|---|",
    ]
    for M in GELU_ROWS:
        x = torch.randn(M, K, device="cuda").to(dtype)
        lin_us = graph_time_us([lambda: F.linear(x, w, b)] * 4)
        pair_us = graph_time_us([lambda: F.gelu(F.linear(x, w, b), approximate="tanh")] * 4)
        cells = []
        for name, fn in impls.items():
            try:
                t = graph_time_us([lambda fn=fn: fn(x, w, b)] * 4)
                cells.append(f"{t:.1f} ({pair_us / t:.3f}x)")
            except Exception as exc:  # an experimental impl must not sink the whole report
                cells.append(f"failed: {type(exc).__name__}")
                print(f"   {name} M={M} failed: {exc!r}", flush=True)
        G.clear_gelu_dispatch_cache()
        out = kernels.fused_linear_gelu_tanh(x, w, b)
        key = (M, N, K, dtype, x.device.index)
        picked = G.gelu_dispatch_table()[key]
        shown = {n: f"{t * 1e3:.1f}us" if isinstance(t, float) else t for n, t in G.gelu_dispatch_timings()[key].items()}
        print(f"   dispatch M={M}: {shown}", flush=True)
        ref = F.gelu(x.double() @ w.double().t() + b.double(), approximate="tanh")
        err = ((out.double() - ref).norm() / ref.norm()).item()
        tflops = 2 * M * N * K / lin_us / 1e6
        rows.append(
            f"| {M} | {lin_us:.1f} ({tflops:.0f}) | {pair_us:.1f} | {' | '.join(cells)} | {picked} | {err:.2e} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kernels-h200.md")
    ap.add_argument("--skip-gelu", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    import os

    import triton

    # Let the dispatch column consider every implementation (the library default leaves the Triton GEMMs out).
    os.environ.setdefault("FLUXSERVE_GELU_CANDIDATES", ",".join(G.GELU_IMPLS))

    dev = torch.cuda.get_device_name()
    lines = [
        "# kernels benchmark",
        "",
        f"Command: `python3 {' '.join(sys.argv)}`",
        "",
        f"{dev}, torch {torch.__version__}, triton {triton.__version__}. Times: median GPU time per call over "
        "CUDA-graph replays, inputs rotated past L2 (launch overhead excluded). 'no graph': back-to-back launches on "
        "the stream, one input set; 'host us/call': wall time per call issued from Python (includes launch "
        "overhead: when it exceeds the GPU time, the call is host-bound).",
        "",
        "## residual_gate_add vs eager `residual + gate * update`",
        "",
    ]
    copy_rates = copy_rate_gbs()
    print(f"copy: {copy_rates}", flush=True)
    lines += bench_residual(copy_rates, torch.bfloat16)
    if not args.skip_gelu:
        lines += ["", "## Linear + tanh-GELU", ""]
        lines += bench_gelu(torch.bfloat16)
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
