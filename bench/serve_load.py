"""Load test of a running fluxserve app (e.g. `serve run serve_config.yaml`), on 127.0.0.1 only.

Phases:
  1. direct: the same request through `model.loading.load_pipeline(...).generate` in this process
     (the cost of the image itself, with the replica's torch thread count);
  2. serial: one client, one request at a time over HTTP: latency - direct = what Serve adds
     (HTTP + proxy + ingress + handle + batch queue + replica), and the server-side share of it
     (ingress_total_s - the replica's pipeline time) reported by the app;
  3. load: `--clients` concurrent clients for `--requests` requests (bounded by `--max-seconds`):
     throughput, p50/p99 latency, errors by status.

Example:
  RAY_USAGE_STATS_ENABLED=0 serve run serve_config.yaml &   # wait for it
  python bench/serve_load.py --model tiny --clients 4 --requests 64 --out bench/results/serve-load-cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from collections import Counter
from typing import Any
from urllib.parse import urlparse

import httpx

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def body(a: argparse.Namespace, seed: int) -> dict[str, Any]:
    return {"prompt": a.prompt, "size": a.size, "steps": a.steps, "quality": a.quality, "seed": seed}


def direct_times(a: argparse.Namespace) -> list[float]:
    import torch

    from model.loading import load_pipeline
    from model.pipeline import GenerationRequest

    torch.set_num_threads(a.direct_threads)
    pipe = load_pipeline(a.model, device="cpu", dtype=torch.float32)
    w, h = (int(x) for x in a.size.split("x"))
    req = GenerationRequest(prompt=a.prompt, height=h, width=w, steps=a.steps, guidance=3.5, seed=0,
                            quality=a.quality)
    pipe.generate([req])  # warm-up
    out = []
    for i in range(a.serial):
        req.seed = i
        t0 = time.perf_counter()
        pipe.generate([req])
        out.append(time.perf_counter() - t0)
    return out


async def serial(a: argparse.Namespace, c: httpx.AsyncClient) -> tuple[list[float], list[float]]:
    lat, server_overhead = [], []
    await c.post(a.url + "/v1/images/generations", json=body(a, 0))  # warm-up
    for i in range(a.serial):
        t0 = time.perf_counter()
        r = await c.post(a.url + "/v1/images/generations", json=body(a, i))
        lat.append(time.perf_counter() - t0)
        r.raise_for_status()
        t = r.json()["timings"]
        server_overhead.append(t["ingress_total_s"] - t["replica_batch_s"])
    return lat, server_overhead


async def load(a: argparse.Namespace, c: httpx.AsyncClient) -> dict[str, Any]:
    lat: list[float] = []
    statuses: Counter[str] = Counter()
    batch_sizes: Counter[int] = Counter()
    queued: Counter[int] = Counter()
    next_id = 0
    stop_at = time.perf_counter() + a.max_seconds

    async def client() -> None:
        nonlocal next_id
        while next_id < a.requests and time.perf_counter() < stop_at:
            i = next_id
            next_id += 1
            t0 = time.perf_counter()
            try:
                r = await c.post(a.url + "/v1/images/generations", json=body(a, 1000 + i))
                statuses[str(r.status_code)] += 1
                if r.status_code == 200:
                    lat.append(time.perf_counter() - t0)
                    batch_sizes[r.json()["batch_sizes"][0]] += 1
                    queued[r.json()["queued_together"][0]] += 1
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(a.clients)])
    wall = time.perf_counter() - t0
    return {"lat": lat, "statuses": statuses, "wall": wall, "batch_sizes": batch_sizes, "queued": queued}


async def main_async(a: argparse.Namespace) -> str:
    async with httpx.AsyncClient(timeout=a.timeout) as c:
        ser, srv_over = await serial(a, c)
        res = await load(a, c)
    direct = direct_times(a) if a.model else []
    lines = [
        "# fluxserve load test",
        "",
        f"Command: `python {' '.join(sys.argv)}`",
        f"Host: {platform.node()}, {platform.processor() or platform.machine()}, python {platform.python_version()}",
        f"Request: size {a.size}, steps {a.steps}, quality {a.quality}",
        "",
        "## Serial (1 client)",
        f"- HTTP latency: p50 {pct(ser, 50) * 1e3:.1f} ms, p99 {pct(ser, 99) * 1e3:.1f} ms (n={len(ser)})",
        f"- server-side overhead (ingress_total_s - replica pipeline time): p50 "
        f"{pct(srv_over, 50) * 1e3:.2f} ms",
    ]
    if direct:
        d50, s50 = statistics.median(direct), statistics.median(ser)
        over = s50 - d50
        lines += [
            f"- direct pipeline.generate in-process: p50 {d50 * 1e3:.1f} ms (n={len(direct)}, "
            f"{a.direct_threads} torch thread(s))",
            f"- Serve path overhead (HTTP p50 - direct p50): {over * 1e3:.1f} ms = {100 * over / s50:.1f}% "
            f"of this request",
            f"- the same overhead against one 50-step 1024^2 FLUX.1-dev image on an H200 (8.6 s, "
            f"design.md): {100 * over / 8.6:.2f}%",
        ]
    lat = res["lat"]
    n_ok = len(lat)
    lines += [
        "",
        f"## Load ({a.clients} concurrent clients, {a.requests} requests, cap {a.max_seconds:g} s)",
        f"- completed OK: {n_ok} in {res['wall']:.1f} s -> {n_ok / res['wall']:.2f} images/s",
        f"- latency: p50 {pct(lat, 50) * 1e3:.1f} ms, p99 {pct(lat, 99) * 1e3:.1f} ms",
        f"- statuses: {dict(res['statuses'])}",
        f"- errors: {sum(v for k, v in res['statuses'].items() if k != '200')}",
        f"- pipeline batch sizes seen (requests): {dict(sorted(res['batch_sizes'].items()))}",
        f"- requests collected per @serve.batch call: {dict(sorted(res['queued'].items()))}",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-seconds", type=float, default=300)
    p.add_argument("--serial", type=int, default=10, help="serial (and direct) repetitions")
    p.add_argument("--size", default="256x256")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quality", default="lossless", choices=["lossless", "high"])
    p.add_argument("--prompt", default="a lighthouse on a cliff at dusk")
    p.add_argument("--model", default="", help="also time the pipeline directly (preset or folder)")
    p.add_argument("--direct-threads", type=int, default=1, help="match the replica's cpu_threads")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default="")
    a = p.parse_args()
    if urlparse(a.url).hostname not in LOCAL_HOSTS:
        p.error("--url must point at 127.0.0.1/localhost")
    if not (1 <= a.clients <= 64 and 1 <= a.requests <= 10000 and 0 < a.max_seconds <= 3600):
        p.error("clients must be 1..64, requests 1..10000, max-seconds 0..3600")
    report = asyncio.run(main_async(a))
    print(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
