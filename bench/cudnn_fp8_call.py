"""Host cost of one eager cuDNN fp8 SDPA call (`kernels.attention._CudnnFp8Graph`), and whether it blocks the host.

Per sequence length (24 heads of 128, batch 1), after five warm-up calls, 50 calls each:
- `call_host_us` / `call_wall_us`: our whole call (allocations, variant pack, set_stream, execute) without and with
  the final synchronize;
- `execute_host_us`: the frontend's Python `execute` with a prebuilt pack and workspace;
- `cpp_execute_host_us`: its C++ `_execute` with uid -> pointer ints (the floor of any Python wrapper);
- `refusal_us`: `cudnn_fp8_refusal` alone;
- `execute_behind_busy_gpu_us`: one execute issued behind ~50 ms of queued GEMMs (a call that synchronized would
  take about that long), then `then_sync_us` to drain the queue.
Then a torch profiler table of three calls. Timing only (random inputs).

  python bench/cudnn_fp8_call.py --out bench/results/cudnn-fp8-call-h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.attention import _cudnn_graph, cudnn_fp8_refusal  # noqa: E402


def per_call_us(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def measure(S: int, H: int, D: int, n: int) -> dict[str, float]:
    dev = torch.device("cuda")
    g = _cudnn_graph(1, S, H, D, dev)
    q8, k8, v8 = (torch.randn(1, S, H, D, device=dev).to(torch.float8_e4m3fn) for _ in range(3))
    dq, dk, vs = torch.ones(1, device=dev), torch.ones(1, device=dev), torch.ones(2, device=dev)
    for _ in range(5):
        g(q8, k8, v8, dq, dk, vs)
    torch.cuda.synchronize()
    r: dict[str, float] = {"workspace_bytes": g.workspace_bytes}
    t = time.perf_counter()
    r["call_host_us"] = per_call_us(lambda: g(q8, k8, v8, dq, dk, vs), n)
    torch.cuda.synchronize()
    r["call_wall_us"] = (time.perf_counter() - t) / n * 1e6
    o8, amax = torch.empty_like(q8), torch.empty(2, device=dev)
    ws = torch.empty(g.workspace_bytes, dtype=torch.uint8, device=dev)
    pack = g.variant_pack(q8, k8, v8, dq, dk, vs, o8, amax)
    torch.cuda.synchronize()
    r["execute_host_us"] = per_call_us(lambda: g.graph.execute(pack, ws, handle=g.handle), n)
    torch.cuda.synchronize()
    uids, wsp = {uid: v.data_ptr() for uid, v in pack.items()}, ws.data_ptr()
    r["cpp_execute_host_us"] = per_call_us(lambda: g.graph._execute(uids, wsp, g.handle), n)
    torch.cuda.synchronize()
    r["refusal_us"] = per_call_us(lambda: cudnn_fp8_refusal(q8), n)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(40):
        a @ a
    t = time.perf_counter()
    g.graph._execute(uids, wsp, g.handle)
    r["execute_behind_busy_gpu_us"] = (time.perf_counter() - t) * 1e6
    t = time.perf_counter()
    torch.cuda.synchronize()
    r["then_sync_us"] = (time.perf_counter() - t) * 1e6
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4608, 272])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cudnn-fp8-call-h100.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA (cuDNN's fp8 attention)")
        return 2
    out = {}
    for S in args.tokens:
        out[S] = measure(S, 24, 128, args.calls)
        print(S, json.dumps(out[S]), flush=True)
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    g = _cudnn_graph(1, args.tokens[0], 24, 128, dev)
    q8, k8, v8 = (torch.randn(1, args.tokens[0], 24, 128, device=dev).to(torch.float8_e4m3fn) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g(q8, k8, v8, torch.ones(1, device=dev), torch.ones(1, device=dev), torch.ones(2, device=dev))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "command": "python " + " ".join(sys.argv), "tokens": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
