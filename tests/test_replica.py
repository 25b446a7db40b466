"""`deployments.replica.PoolReplica` without Serve: how one `@serve.batch` call's requests become pipeline calls,
how failures become the API's errors, what a stream yields, and the counters. A scripted engine stands in for the
pipeline. (The same replica under real Serve, batching by timing and over HTTP: tests/test_serve.py.)
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("ray")

import torch  # noqa: E402

from deployments.config import AppArgs  # noqa: E402
from deployments.errors import BadRequest, GenerationFailed, OutOfMemory, PoolUnavailable  # noqa: E402
from deployments.replica import PoolReplica, _Ticket  # noqa: E402
from model.pipeline import GenerationCancelled, GenerationResult  # noqa: E402
from model.request import GenerationRequest  # noqa: E402
from model.tiers import Ran  # noqa: E402


class _Engine:
    """Answers each call with one result per request (its seed in the PNG bytes), or raises what it is told to for
    requests whose prompt names it; records every call and whether two ever overlapped."""

    def __init__(self) -> None:
        self.calls: list[list[GenerationRequest]] = []
        self.stops: list[bool] = []
        self.released = 0
        self.running = 0
        self.overlapped = False
        self.previews_at: tuple[int, ...] = ()
        self.hold = asyncio.Event()
        self.hold.set()

    async def generate(self, requests, should_stop, previews=None) -> list[GenerationResult]:
        self.calls.append(list(requests))
        self.running += 1
        self.overlapped |= self.running > 1
        try:
            if previews is not None:
                for index, step in enumerate(previews.steps):
                    previews.emit(index, step, [f"preview {index} at {step}".encode()])
            await asyncio.sleep(0.01)
            await self.hold.wait()
            self.stops.append(should_stop())
            failure = {"boom": RuntimeError("boom"), "oom": torch.OutOfMemoryError("CUDA out of memory"),
                       "cancel": GenerationCancelled("cancelled after step 1 of 2"),
                       "dead": PoolUnavailable("a TP rank died: RayActorError")}.get(requests[0].prompt)
            if failure is not None:
                raise failure
            return [GenerationResult(png=b"png %d" % r.seed, latents=torch.zeros(1), seed=r.seed, quality=r.quality,
                                     ran=Ran(gelu_sites=3), timings={"total_s": 0.5}) for r in requests]
        finally:
            self.running -= 1

    def release_memory(self) -> None:
        self.released += 1

    def stats(self) -> dict[str, Any]:
        return {"cuda_graphs": None}


def _job(seed: int, prompt: str = "a red fox", size: int = 64, steps: int = 2) -> GenerationRequest:
    return GenerationRequest(prompt, height=size, width=size, steps=steps, seed=seed)


def _replica(pool: str = "high", **raw: Any) -> tuple[PoolReplica, _Engine]:
    engine = _Engine()
    return PoolReplica(pool, AppArgs.parse(raw), engine), engine


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_compatible_requests_share_a_call_and_each_gets_its_own_image() -> None:
    """Tickets are grouped by batch key (one engine call per group, in arrival order within it); each ticket gets the
    result of its own request, with the group's size and its call's batch size."""
    replica, engine = _replica("high")
    tickets = [_Ticket(_job(1)), _Ticket(_job(2, size=128)), _Ticket(_job(3)), _Ticket(_job(4, size=128))]
    out = _run(replica.run_tickets(tickets))
    assert [[r.seed for r in call] for call in engine.calls] == [[1, 3], [2, 4]]
    assert [status for status, _ in out] == ["ok"] * 4
    assert [value["png"] for _, value in out] == [b"png 1", b"png 2", b"png 3", b"png 4"]
    first = out[0][1]
    assert (first["seed"], first["pool"], first["quality"], first["ran"]["gelu_sites"]) == (1, "high", "lossless", 3)
    assert (first["batch_size"], first["queued_together"]) == (2, 2)
    assert first["timings"]["total_s"] == 0.5 and 0 < first["timings"]["replica_batch_s"] < 30
    assert replica.counters() == {"pool": "high", "tp": 1, "batches": 2, "cancelled_batches": 0, "images": 4,
                                  "out_of_memory": 0, "cuda_graphs": None}


def test_a_batch_invariant_pool_runs_each_request_alone() -> None:
    replica, engine = _replica("lossless")
    assert replica.pool_args.batch_invariant  # the lossless pool's default
    out = _run(replica.run_tickets([_Ticket(_job(1)), _Ticket(_job(2))]))
    assert [[r.seed for r in call] for call in engine.calls] == [[1], [2]]
    assert [(v["batch_size"], v["queued_together"]) for _, v in out] == [(1, 2), (1, 2)]


@pytest.mark.parametrize("prompt, error, message", [
    ("boom", GenerationFailed, "RuntimeError: boom"),
    ("oom", OutOfMemory, "out of memory generating 2 image(s) at 64x64; the replica freed its memory and keeps "
                         "serving: retry, or ask for fewer or smaller images"),
    ("cancel", GenerationCancelled, "cancelled after step 1 of 2"),
    ("dead", PoolUnavailable, "a TP rank died: RayActorError"),
])
def test_a_failed_call_answers_every_ticket_of_it_and_spares_the_others(prompt: str, error: type,
                                                                          message: str) -> None:
    """A pipeline error is a 500 with its reason, out of memory a 503 after the memory is released (and counted),
    a cancelled batch and a dead pool pass through as they are; the other group of the same call is served."""
    replica, engine = _replica("high")
    tickets = [_Ticket(_job(1, prompt)), _Ticket(_job(2, size=128)), _Ticket(_job(3))]  # two groups
    out = _run(replica.run_tickets(tickets))
    assert [s for s, _ in out] == ["err", "ok", "err"]
    assert out[0][1] is out[2][1] and type(out[0][1]) is error and str(out[0][1]) == message
    counters = replica.counters()
    assert (counters["out_of_memory"], engine.released) == ((1, 1) if prompt == "oom" else (0, 0))
    assert counters["cancelled_batches"] == (1 if prompt == "cancel" else 0)
    assert (counters["batches"], counters["images"]) == (2, 1)
    _run(replica.run_tickets(tickets))  # counters add up
    counters = replica.counters()
    assert (counters["out_of_memory"], counters["cancelled_batches"]) == (
        2 * (prompt == "oom"), 2 * (prompt == "cancel"))
    assert (counters["batches"], counters["images"]) == (4, 2)


def test_a_call_stops_only_when_every_caller_is_gone() -> None:
    replica, engine = _replica("high")
    gone, waiting = _Ticket(_job(1)), _Ticket(_job(2))
    gone.cancelled.set()
    _run(replica.run_tickets([gone, waiting]))
    both = [_Ticket(_job(3)), _Ticket(_job(4))]
    for t in both:
        t.cancelled.set()
    _run(replica.run_tickets(both))
    assert engine.stops == [False, True]


def test_one_pipeline_call_at_a_time() -> None:
    replica, engine = _replica("high")

    async def two() -> None:
        await asyncio.gather(replica.run_chunk([_Ticket(_job(1))], 1), replica.run_chunk([_Ticket(_job(2))], 1))

    _run(two())
    assert len(engine.calls) == 2 and not engine.overlapped


def test_a_stream_yields_its_previews_then_the_final_image() -> None:
    replica, engine = _replica("high")

    async def collect() -> list[dict]:
        return [e async for e in replica.stream(_job(5, steps=8), 2)]

    events = _run(collect())
    assert [e.get("partial_image_index") for e in events[:-1]] == [0, 1]
    assert [e["step"] for e in events[:-1]] == [3, 5]  # model.preview.preview_steps(8, 2)
    assert events[0]["png"] == b"preview 0 at 3"
    final = events[-1]["final"]
    assert (final["png"], final["batch_size"], final["queued_together"]) == (b"png 5", 1, 1)


def test_a_stream_raises_its_batchs_error_and_a_closed_stream_stops_its_work() -> None:
    replica, engine = _replica("high")

    async def failing() -> None:
        async for _ in replica.stream(_job(5, "boom"), 0):
            pass

    with pytest.raises(GenerationFailed, match="RuntimeError: boom"):
        _run(failing())

    async def closed_early() -> None:
        engine.hold.clear()
        stream = replica.stream(_job(6, steps=8), 1)
        assert (await stream.__anext__())["partial_image_index"] == 0
        await stream.aclose()  # the client went away
        engine.hold.set()
        await asyncio.sleep(0.05)

    _run(closed_early())
    assert engine.stops[-1] is True  # the pipeline was told to stop at its next step


@pytest.mark.parametrize("raw, pool, wait", [
    ({}, "lossless", 0.0),  # batch-invariant: each request runs alone, waiting would only add latency
    ({}, "high", 0.05),  # the app's batch_wait_timeout_s
    ({"batch_wait_timeout_s": 0.2}, "high", 0.2),
    ({"pools": {"high": {"batch_wait_timeout_s": 0.01}}, "batch_wait_timeout_s": 0.2}, "high", 0.01),
    ({"pools": {"lossless": {"batch_wait_timeout_s": 0.03}}}, "lossless", 0.03),
])
def test_batch_wait_follows_the_pool_then_the_app(raw: dict, pool: str, wait: float) -> None:
    replica, _ = _replica(pool, **raw)
    assert replica.batch_wait_s == wait


def test_a_stream_closed_before_its_work_failed_leaves_no_unretrieved_error() -> None:
    """The abandoned work's error is retrieved when it ends (else asyncio logs "Task exception was never
    retrieved" for every client that left a failing stream)."""
    import gc

    replica, engine = _replica("high")
    reported: list[dict] = []

    async def closed_then_failed() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        engine.hold.clear()
        stream = replica.stream(_job(6, "boom", steps=8), 1)
        assert (await stream.__anext__())["partial_image_index"] == 0
        await stream.aclose()
        engine.hold.set()  # the work now fails with nobody listening
        await asyncio.sleep(0.05)
        gc.collect()
        await asyncio.sleep(0)

    _run(closed_then_failed())
    assert [c.get("message") for c in reported] == []


class _AdapterEngine(_Engine):
    """Also records adapter syncs; a file named "bad" fails to load."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[dict[str, str]] = []

    async def sync_adapters(self, wanted: dict[str, str]) -> dict[str, list[str]]:
        self.syncs.append(dict(wanted))
        if "bad" in wanted.values():
            raise ValueError("Target modules {'x'} not found in the base model")
        return {"added": sorted(wanted), "removed": []}


def test_a_job_naming_an_api_adapter_loads_the_registry_set_first_and_once() -> None:
    engine = _AdapterEngine()
    replica = PoolReplica("lossless", AppArgs.parse({"loras": {"ink": "/a/ink.safetensors"}, "lora_dir": "/a"}),
                          engine)
    job = GenerationRequest("a", seed=1, loras=(("fog", 1.0),))

    async def run() -> list:
        first = await replica.run_tickets([_Ticket(job, {"fog": "/a/fog.safetensors"})])
        again = await replica.run_tickets([_Ticket(job, {"fog": "/a/fog.safetensors"}), _Ticket(job, None)])
        bad = await replica.run_tickets([_Ticket(job, {"fog": "/a/fog.safetensors", "x": "bad"})])
        after = await replica.run_tickets([_Ticket(job, {"fog": "/a/fog.safetensors"})])
        return [first, again, bad, after]

    first, again, bad, after = asyncio.run(run())
    assert [s for s, _ in first + again + after] == ["ok"] * 4
    # the set loaded is args.loras plus the registry's, before the batch; the same set is not loaded again
    assert engine.syncs[:2] == [{"ink": "/a/ink.safetensors", "fog": "/a/fog.safetensors"},
                                {"ink": "/a/ink.safetensors", "fog": "/a/fog.safetensors", "x": "bad"}]
    (status, err), = bad
    assert status == "err" and isinstance(err, BadRequest) and err.param == "lora"
    assert "could not be loaded: ValueError: Target modules" in err.message
    assert len(engine.calls) == 4  # the failed sync ran no batch ...
    assert len(engine.syncs) == 3  # ... and the next job syncs again from scratch


class _SlowImage:
    """A decoded image whose PNG encoding takes a while and notes what the replica was doing meanwhile."""

    def __init__(self, replica: PoolReplica, engine: _Engine, seed: int) -> None:
        self.replica, self.engine, self.seed = replica, engine, seed
        self.seen: dict[str, Any] = {}

    def save(self, buf: Any, format: str, **options: Any) -> None:
        import time

        self.seen["locked"] = self.replica._busy.locked()
        before = len(self.engine.calls)
        time.sleep(0.3)
        self.seen["batches_meanwhile"] = len(self.engine.calls) - before
        buf.write(b"png of %d" % self.seed)


def test_pngs_are_encoded_after_the_batch_call_so_the_next_batch_runs_meanwhile() -> None:
    """The engines leave PNGs pending; a batch call returns them so (Serve then starts the next batch call), and
    each request encodes its own (`finish`, as FluxReplica.generate and streams do) while the next batch runs."""
    replica, engine = _replica("lossless")
    images: list[_SlowImage] = []
    real = engine.generate

    async def pending(requests, should_stop, previews=None):
        results = await real(requests, should_stop, previews)
        for r in results:
            images.append(_SlowImage(replica, engine, r.seed))
            r.png, r.image = None, images[-1]
        return results

    engine.generate = pending
    returned: list = []

    async def request(seed: int) -> dict:  # what FluxReplica.generate does with its ticket
        ((status, value),) = await replica.run_tickets([_Ticket(GenerationRequest("a", seed=seed))])
        returned.append(value["png"])
        return await replica.finish(value)

    async def run() -> list:
        first = asyncio.ensure_future(request(1))
        await asyncio.sleep(0.05)
        return await asyncio.gather(first, request(2))

    a, b = asyncio.run(run())
    assert returned == [None, None]  # the batch calls returned before any encoding
    assert (a["png"], b["png"]) == (b"png of 1", b"png of 2") and "image" not in a
    assert [im.seen["locked"] for im in images] == [False, False]  # never while holding the pipeline
    assert images[0].seen["batches_meanwhile"] == 1  # the second batch ran while the first encoded
    assert not engine.overlapped  # and still one pipeline call at a time


def test_finish_encodes_each_result_as_its_tier_writes_pngs() -> None:
    """A pending image is encoded by its result's tier: Pillow's bytes for `lossless`, the parallel writer's (same
    pixels) for `high` (model/png.py). Catches the replica encoding every tier one way."""
    import numpy as np
    from PIL import Image

    from model.png import parallel_png, png_bytes

    replica, _ = _replica("high")
    pixels = (np.arange(48 * 40 * 3) % 253).astype(np.uint8).reshape(48, 40, 3)
    for quality, want in (("lossless", png_bytes(Image.fromarray(pixels))), ("high", parallel_png(pixels))):
        done = asyncio.run(replica.finish({"png": None, "image": Image.fromarray(pixels), "quality": quality}))
        assert done["png"] == want and "image" not in done, quality


class _SlotEngine(_Engine):
    """An engine composing each image's adapters: a set naming "wide" cannot join a batch."""

    async def adapter_errors(self, rows) -> list[str | None]:
        return ["rank 64 together; at most 32" if any(n == "wide" for n, _ in r) else None for r in rows]


def test_a_pool_composing_adapters_mixes_them_in_one_call_and_refuses_only_the_image_that_cannot_join() -> None:
    """With `adapter_rank` set, requests differing only by adapters share one pipeline call; one whose set the engine
    cannot compose gets its own 400 naming `lora` while its batch mates are served. Would catch the adapters kept in
    the batch key (three calls), or one refused image failing the whole batch."""
    engine = _SlotEngine()
    replica = PoolReplica("high", AppArgs.parse({"loras": {"ink": "ink.safetensors", "fog": "fog.safetensors",
                                                           "wide": "wide.safetensors"},
                                                 "pools": {"high": {"adapter_rank": 32}}}), engine)
    jobs = [replace(_job(1), loras=(("ink", 1.0),)), replace(_job(2), loras=(("fog", 0.5), ("wide", 1.0))),
            replace(_job(3), loras=()), replace(_job(4), loras=(("fog", 0.5), ("ink", 1.0)))]
    out = _run(replica.run_tickets([_Ticket(j) for j in jobs]))
    assert [kind for kind, _ in out] == ["ok", "err", "ok", "ok"]
    assert isinstance(out[1][1], BadRequest) and out[1][1].param == "lora" and "at most 32" in out[1][1].message
    assert len(engine.calls) == 1 and [r.seed for r in engine.calls[0]] == [1, 3, 4]
    assert [r["batch_size"] for _, r in (out[0], out[2], out[3])] == [3, 3, 3]
    with pytest.raises(BadRequest, match="at most 32"):  # alone, the refusal is raised
        _run(replica.run_chunk([_Ticket(jobs[1])], 1))
    plain, _ = _replica(loras={"ink": "ink.safetensors"})
    _run(plain.run_tickets([_Ticket(j) for j in (jobs[0], jobs[2])]))
    assert len(plain.engine.calls) == 2  # PEFT pools keep one adapter set per call
