"""Hostile bodies without Ray: the request-body bound (`deployments.body.BodyLimit`, the real middleware on a
FastAPI app and as a bare ASGI app) and image headers checked before decoding (`model.request.decode_image`).

(Through the served app: tests/test_serve.py::test_hostile_bodies_get_4xx_and_the_app_keeps_serving.)
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from deployments import body  # noqa: E402

LIMIT = 1000


@pytest.fixture()
def bounded():
    body.configure(LIMIT)
    try:
        yield
    finally:
        body.configure(None)


def _app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(body.BodyLimit)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    return app


@pytest.mark.parametrize("size, status", [(LIMIT, 200), (LIMIT + 1, 413), (0, 200)])
def test_a_body_at_the_bound_passes_whole_and_one_byte_more_is_413(bounded, size: int, status: int) -> None:
    r = TestClient(_app()).post("/echo", content=b"x" * size)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json() == {"bytes": size}
    else:
        assert r.json() == {"error": {"message": f"request body is too large: {size} bytes, at most {LIMIT}",
                                      "type": "invalid_request_error", "param": None}}


def test_a_chunked_body_without_a_length_is_cut_at_the_bound(bounded) -> None:
    """No Content-Length (chunked upload): the middleware stops reading one chunk past the bound and answers 413;
    the route never runs. Catches a bound that trusts the header only."""
    r = TestClient(_app()).post("/echo", content=(b"y" * 300 for _ in range(10)))  # a generator: chunked
    assert r.status_code == 413 and "more than 1000" in r.json()["error"]["message"]


def _run(scope_headers: list, chunks: list[bytes]) -> tuple[list[dict], int, list]:
    """The middleware around a recording app, driven by hand: what it sent, how many messages it read, what the
    inner app received."""
    sent, inner = [], []
    reads = 0

    async def receive() -> dict:
        nonlocal reads
        reads += 1
        if reads <= len(chunks):
            return {"type": "http.request", "body": chunks[reads - 1], "more_body": reads < len(chunks)}
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, rcv, snd) -> None:
        inner.append(await rcv())
        inner.append(await rcv())  # after the body: the client's disconnect passes through
        await snd({"type": "http.response.start", "status": 204, "headers": []})
        await snd({"type": "http.response.body", "body": b""})

    scope = {"type": "http", "method": "POST", "path": "/", "headers": scope_headers}
    asyncio.run(body.BodyLimit(app)(scope, receive, send))
    return sent, reads, inner


def test_a_declared_length_over_the_bound_is_refused_before_reading_anything(bounded) -> None:
    sent, reads, inner = _run([(b"content-length", b"12000000000")], [b"z" * 10])
    assert reads == 0 and inner == [] and sent[0]["status"] == 413
    assert b"12000000000 bytes, at most 1000" in sent[1]["body"]


def test_a_body_in_parts_reaches_the_app_as_one_message_then_the_disconnect(bounded) -> None:
    sent, reads, inner = _run([], [b"a" * 400, b"b" * 400, b"c" * 200])
    assert inner == [{"type": "http.request", "body": b"a" * 400 + b"b" * 400 + b"c" * 200, "more_body": False},
                     {"type": "http.disconnect"}]
    assert sent[0]["status"] == 204 and reads == 4


def test_without_a_bound_nothing_is_buffered() -> None:
    body.configure(None)
    sent, reads, inner = _run([], [b"a" * 5000, b"b"])
    assert inner[0] == {"type": "http.request", "body": b"a" * 5000, "more_body": True}  # the app reads as it comes


def test_a_decompression_bomb_is_refused_from_its_header_in_little_time_and_memory() -> None:
    """A 12000 x 12000 PNG of a few hundred KB, and the same as a mask: refused with the pixel bound named, within
    100 ms and < 50 MB of peak memory in a fresh process (decoding it would take ~430 MB for the pixels alone).
    Catches a size check made after `load()` / `convert()`."""
    code = textwrap.dedent("""
        import resource, time, json
        from model.request import decode_image
        from tests._inputs import png_bomb
        data = png_bomb(12000, 12000)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = {}
        for what in ("image", "mask"):
            t = time.perf_counter()
            try:
                decode_image(data, what)
            except ValueError as exc:
                out[what] = [str(exc), time.perf_counter() - t]
        out["peak_growth_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        out["bytes"] = len(data)
        print(json.dumps(out))
    """)
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["bytes"] < 1_000_000
    for what in ("image", "mask"):
        message, seconds = out[what]
        assert message == f"{what} is 12000x12000 (144000000 pixels); at most 16777216 pixels are accepted"
        assert seconds < 0.1, seconds
    assert out["peak_growth_kb"] < 50 * 1024, out
