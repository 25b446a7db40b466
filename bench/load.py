"""Sustained mixed load on a running fluxserve app (127.0.0.1 only): does it hold, and does its memory stay flat?

A fixed mix of requests from `--clients` concurrent clients for `--seconds` (or `--requests`): both tiers, two
sizes, a stream with previews, an edit, and `response_format: url` followed by fetching the image. Reports
throughput, p50 / p95 / p99 latency per kind, answers by status, requests lost (no HTTP answer), and the resident
memory of every Ray actor process (`ray::...`) sampled every `--sample-s` seconds: its growth from the run's second
minute to its last (`rss_growth_pct`), so a leak shows as growth under a steady load.

    .venv/bin/python -m deployments.demo --port 8000 &        # or serve run serve_config.yaml; wait for /readyz
    python bench/load.py --seconds 600 --out bench/results/load-cpu.json      # writes .json and .md
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import LOCAL_HOSTS, pct  # noqa: E402

PROMPT = "a small red circle on the right, on a white background"


def _mix(size: str, wide: str) -> list[tuple[str, dict[str, Any]]]:
    """(kind, request) of one round of the mix; seeds are filled in per request."""
    gen = {"prompt": PROMPT}
    return [
        ("gen-lossless", {**gen, "size": size}),
        ("gen-high", {**gen, "size": size, "quality": "high"}),
        ("gen-lossless-wide", {**gen, "size": wide}),
        ("gen-high", {**gen, "size": size, "quality": "high"}),
        ("stream-high", {**gen, "size": size, "quality": "high", "stream": True, "partial_images": 2}),
        ("edit-lossless", {**gen, "size": size, "strength": "0.6"}),
        ("url-lossless", {**gen, "size": size, "response_format": "url"}),
        ("gen-lossless", {**gen, "size": size}),
    ]


def actor_rss() -> dict[str, int]:
    """Resident KB of each Ray actor process on this machine, by its actor name (the process title `ray::<name>`
    without the method it is running), summed over processes of one name."""
    out: dict[str, int] = defaultdict(int)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if not title.startswith("ray::"):
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[title.split(" ")[0].split(".")[0]] += int(line.split()[1])
        except OSError:
            continue
    return dict(out)


async def one(c: httpx.AsyncClient, url: str, kind: str, req: dict[str, Any], image: bytes) -> tuple[str, float]:
    """Send one request of `kind`; -> (status or error name, seconds)."""
    t0 = time.perf_counter()
    if kind.startswith("edit"):
        fields = {k: str(v) for k, v in req.items()}
        r = await c.post(url + "/v1/images/edits", data=fields, files={"image": ("in.png", image, "image/png")})
    elif req.get("stream"):
        async with c.stream("POST", url + "/v1/images/generations", json=req) as r:
            done = False
            async for line in r.aiter_lines():
                done = done or (line.startswith("data: ") and '.completed"' in line[:200])
            if r.status_code == 200 and not done:
                return "stream-without-completed", time.perf_counter() - t0
    else:
        r = await c.post(url + "/v1/images/generations", json=req)
        if r.status_code == 200 and req.get("response_format") == "url":
            got = await c.get(r.json()["data"][0]["url"])
            if got.status_code != 200:
                return f"url-{got.status_code}", time.perf_counter() - t0
    return str(r.status_code), time.perf_counter() - t0


async def run(a: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=a.timeout) as c:
        r = await c.post(a.url + "/v1/images/generations", json={"prompt": PROMPT, "size": a.size, "seed": 1})
        r.raise_for_status()
        image = base64.b64decode(r.json()["data"][0]["b64_json"])  # the edit input
        mix = _mix(a.size, a.wide)
        results: list[tuple[str, str, float, float]] = []  # (kind, status, seconds, start offset)
        samples: list[tuple[float, dict[str, int]]] = []
        issued = 0
        t_start = time.perf_counter()
        stop_at = t_start + a.seconds

        async def client() -> None:
            nonlocal issued
            while issued < a.requests and time.perf_counter() < stop_at:
                i = issued
                issued += 1
                kind, req = mix[i % len(mix)]
                t = time.perf_counter() - t_start
                try:
                    status, s = await one(c, a.url, kind, {**req, "seed": 10_000 + i}, image)
                except httpx.HTTPError as exc:
                    status, s = f"lost:{type(exc).__name__}", time.perf_counter() - t_start - t
                results.append((kind, status, s, t))

        async def sampler() -> None:
            while time.perf_counter() < stop_at and issued < a.requests:
                samples.append((time.perf_counter() - t_start, actor_rss()))
                await asyncio.sleep(a.sample_s)
            samples.append((time.perf_counter() - t_start, actor_rss()))

        await asyncio.gather(sampler(), *[client() for _ in range(a.clients)])
        wall = time.perf_counter() - t_start
    return {"results": results, "samples": samples, "wall": wall}


def per_tier(by_kind: dict[str, dict[str, Any]], wall: float) -> dict[str, float]:
    """Images answered per second by each tier over the whole run (a kind's name says its tier)."""
    return {tier: round(sum(v["ok"] for k, v in by_kind.items() if tier in k.split("-")) / wall, 3)
            for tier in ("lossless", "high")}


def summarize(a: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    results, samples, wall = raw["results"], raw["samples"], raw["wall"]
    ok = [r for r in results if r[1] == "200"]
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({r[0] for r in results}):
        lat = [r[2] for r in ok if r[0] == kind]
        by_kind[kind] = {"requests": sum(1 for r in results if r[0] == kind), "ok": len(lat),
                         "p50_s": round(pct(lat, 50), 3), "p95_s": round(pct(lat, 95), 3),
                         "p99_s": round(pct(lat, 99), 3)}
    statuses = Counter(r[1] for r in results)
    # memory: each actor's mean RSS over the run's second minute against its last minute (or, for a shorter run,
    # its second and last tenths)
    span = 60.0 if wall >= 180 else wall / 10
    early = [s for t, s in samples if span <= t < 2 * span]
    late = [s for t, s in samples if t >= wall - span]
    growth = {}
    for name in sorted({n for _, s in samples for n in s}):
        e = [s[name] for s in early if name in s]
        la = [s[name] for s in late if name in s]
        if e and la:
            growth[name] = {"rss_mb_early": round(statistics.mean(e) / 1024, 1),
                            "rss_mb_late": round(statistics.mean(la) / 1024, 1),
                            "growth_pct": round(100 * (statistics.mean(la) / statistics.mean(e) - 1), 1)}
    lat_all = [r[2] for r in ok]
    return {
        "command": "python bench/load.py " + shlex.join(sys.argv[1:]),
        "host": f"{platform.node()}, {os.cpu_count()} CPUs",
        "seconds": round(wall, 1), "clients": a.clients, "size": a.size, "wide": a.wide,
        "requests": len(results), "ok": len(ok),
        "errors_5xx": sum(v for k, v in statuses.items() if k[:1] == "5"),
        "errors_4xx": sum(v for k, v in statuses.items() if k[:1] == "4"),
        "lost": sum(v for k, v in statuses.items() if k.startswith("lost:")),  # no HTTP answer at all
        "other_failures": sum(v for k, v in statuses.items() if not k[:1].isdigit() and not k.startswith("lost:")),
        "statuses": dict(statuses),
        "p50_s": round(pct(lat_all, 50), 3), "p95_s": round(pct(lat_all, 95), 3), "p99_s": round(pct(lat_all, 99), 3),
        "images_per_s": round(len(ok) / wall, 3),
        "images_per_s_by_tier": per_tier(by_kind, wall),
        "by_kind": by_kind,
        "rss_growth_pct_max": max((g["growth_pct"] for g in growth.values()), default=None),
        "rss_by_actor": growth,
        "rss_samples": len(samples),
    }


def markdown(r: dict[str, Any]) -> str:
    rows = "\n".join(f"| {k} | {v['requests']} | {v['ok']} | {v['p50_s']} | {v['p95_s']} | {v['p99_s']} |"
                     for k, v in r["by_kind"].items())
    mem = "\n".join(f"| `{k}` | {v['rss_mb_early']} | {v['rss_mb_late']} | {v['growth_pct']} |"
                    for k, v in r["rss_by_actor"].items())
    return (f"# Sustained mixed load: {r['requests']} requests in {r['seconds']} s, {r['clients']} clients\n\n"
            f"Host: {r['host']}. Command:\n\n```\n{r['command']}\n```\n\n"
            f"{r['ok']} answered 200, {r['errors_5xx']} 5xx, {r['errors_4xx']} 4xx, {r['lost']} lost "
            f"(statuses {r['statuses']}); {r['images_per_s']} requests/s answered "
            f"({', '.join(f'{t} {v}' for t, v in r['images_per_s_by_tier'].items())}); latency p50 {r['p50_s']} s, "
            f"p95 {r['p95_s']} s, p99 {r['p99_s']} s. Largest actor RSS growth from the second minute to the last: "
            + (f"{r['rss_growth_pct_max']}%.\n\n" if r["rss_growth_pct_max"] is not None
               else "not measured (too short a run for two sampling windows).\n\n") +
            "| kind | requests | 200 | p50 s | p95 s | p99 s |\n| --- | --- | --- | --- | --- | --- |\n" + rows +
            "\n\n| actor process | RSS MB, second minute | RSS MB, last minute | growth % |\n"
            "| --- | --- | --- | --- |\n" + mem + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--size", default="256x256")
    p.add_argument("--wide", default="384x256")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=None, help=".json path (a .md of the same name is written beside it)")
    a = p.parse_args(argv)
    if urlparse(a.url).hostname not in LOCAL_HOSTS:
        p.error("--url must point at 127.0.0.1/localhost")
    result = summarize(a, asyncio.run(run(a)))
    print(markdown(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
        Path(a.out).with_suffix(".md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
