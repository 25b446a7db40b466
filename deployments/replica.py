"""FluxReplica: one replica of a quality pool (lossless or high).

The replica batches and accounts (`PoolReplica`, plain Python); its engine (deployments/engine.py) runs the batches:
in this process at tp == 1, on one actor per rank at tp > 1. The replica never looks at `tp` itself. `FluxReplica`
is the Serve deployment around it.

Requests arrive one image at a time (`generate(job)`); `@serve.batch` collects them and the batch
handler runs one pipeline call per group of compatible jobs (same size/steps/guidance/quality, and adapters unless
the pool composes each image's own: `adapter_rank`), so every image keeps its own seed and a batched lossless image
equals the same request served alone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import ray
from ray import serve

from deployments.config import AppArgs
from deployments.engine import Engine, make_engine
from deployments.errors import BadRequest, GenerationFailed, OutOfMemory, PoolUnavailable
from model import faults
from model.pipeline import GenerationCancelled
from model.preview import PreviewSink, preview_steps
from model.png import result_png
from model.request import GenerationRequest

logger = logging.getLogger("ray.serve")


@dataclass
class _Ticket:
    job: GenerationRequest
    # The adapters loaded through the API (name -> file) when the job names one: loaded before it runs.
    adapters: dict[str, str] | None = None
    # Set by generate() when its caller gave up (ingress timeout, client gone): the batch handler's
    # should_stop() stops a group once every ticket in it is cancelled.
    cancelled: threading.Event = field(default_factory=threading.Event)


def _is_out_of_memory(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError)


class PoolReplica:
    """The work of one pool replica, without Serve: it groups the requests one `@serve.batch` call collected into
    pipeline calls, runs them on its engine, maps failures to the API's errors and counts. `FluxReplica` below is
    the Serve shell around it (tests drive this class directly)."""

    def __init__(self, pool: str, args: AppArgs, engine: Engine) -> None:
        self.pool = pool
        self.args = args
        self.pool_args = args.pools[pool]
        self.engine = engine
        self._batch_count = 0
        self._cancelled_batches = 0
        self._images = 0
        self._out_of_memory = 0
        self._busy = asyncio.Lock()
        self._runtime_adapters: dict[str, str] = {}  # the API's adapters this replica's pipeline holds
        # The pool composes each image's adapters (model/adapter_slots.py): one batch may mix them.
        self._mixed_adapters = self.pool_args.adapter_rank is not None

    @property
    def batch_wait_s(self) -> float:
        """How long a `@serve.batch` call waits to fill: the pool's own setting, else none for a batch-invariant
        pool (its requests run alone anyway) and the app's `batch_wait_timeout_s` for the others."""
        wait = self.pool_args.batch_wait_timeout_s
        if wait is None:
            wait = 0.0 if self.pool_args.batch_invariant else self.args.batch_wait_timeout_s
        return wait

    async def run_tickets(self, tickets: list[_Ticket]) -> list[tuple[str, Any]]:
        """One `@serve.batch` call: ("ok", result) or ("err", exception) per ticket, in order."""
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(tickets):
            groups.setdefault(t.job.batch_key(self._mixed_adapters), []).append(i)
        out: list[tuple[str, Any] | None] = [None] * len(tickets)
        for idx in groups.values():
            # Batch-invariant pools run each request alone (see PoolArgs.batch_invariant).
            chunks = [[i] for i in idx] if self.pool_args.batch_invariant else [idx]
            for chunk in chunks:
                try:
                    results = await self.run_chunk([tickets[i] for i in chunk], len(idx))
                    for i, r in zip(chunk, results):
                        out[i] = ("err", r) if isinstance(r, Exception) else ("ok", r)
                except Exception as exc:  # every ticket of the call gets the reason, none is dropped
                    for i in chunk:
                        out[i] = ("err", exc)
        return out  # type: ignore[return-value]

    async def run_chunk(self, chunk: list[_Ticket], queued_together: int,
                        previews: PreviewSink | None = None) -> list[dict[str, Any] | BadRequest]:
        """One pipeline call for compatible tickets; stops between steps once all its callers are gone. A ticket
        whose adapters cannot join the composed batch gets its BadRequest in its place (all of them: raised)."""
        requests = [t.job for t in chunk]
        refused: dict[int, BadRequest] = {}

        def should_stop() -> bool:
            return all(t.cancelled.is_set() for t in chunk)

        self._batch_count += 1
        wanted = next((t.adapters for t in chunk if t.adapters is not None), None)
        try:
            async with self._busy:  # one pipeline call at a time per replica
                if wanted is not None:
                    await self._sync_adapters(wanted)
                if self._mixed_adapters and any(len(r.loras) > 1 for r in requests):
                    errors = await self.engine.adapter_errors([r.loras for r in requests])
                    refused = {i: BadRequest("lora", e) for i, e in enumerate(errors) if e is not None}
                    if len(refused) == len(requests):
                        raise refused[0]
                    requests = [r for i, r in enumerate(requests) if i not in refused]
                t0 = time.perf_counter()
                results = await self.engine.generate(requests, should_stop, previews)
        except GenerationCancelled:
            self._cancelled_batches += 1
            raise
        except (PoolUnavailable, BadRequest):
            raise
        except Exception as exc:
            if _is_out_of_memory(exc):
                # This batch fails alone: free what it held, count it, keep serving.
                self._out_of_memory += 1
                self.engine.release_memory()
                logger.warning("pool %s: out of memory (%d images at %dx%d); memory released", self.pool,
                               len(requests), requests[0].width, requests[0].height)
                raise OutOfMemory(f"out of memory generating {len(requests)} image(s) at "
                                  f"{requests[0].width}x{requests[0].height}; the replica freed its memory and "
                                  "keeps serving: retry, or ask for fewer or smaller images") from None
            logger.exception("pool %s: generation failed", self.pool)
            raise GenerationFailed(f"{type(exc).__name__}: {exc}") from None
        wall = time.perf_counter() - t0
        self._images += len(results)
        done = [
            {
                "png": r.png,  # None until `finish` encodes `image`, after the batch call has returned
                "image": r.image,
                "seed": int(r.seed),
                "quality": r.quality,
                "ran": r.ran.as_dict(),
                "timings": {**{k: float(v) for k, v in r.timings.items()}, "replica_batch_s": wall},
                "pool": self.pool,
                "batch_size": len(requests),  # requests in the pipeline call that made this image
                "queued_together": queued_together,  # compatible requests collected in one @serve.batch call
            }
            for r in results
        ]
        return [refused[i] if i in refused else done.pop(0) for i in range(len(chunk))]

    async def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Encode a result's PNG if its batch left it pending. Each request does it in its own call, after the batch
        call returned: the next batch gathers and denoises meanwhile."""
        image = result.pop("image", None)
        if result["png"] is None:
            result["png"] = await asyncio.to_thread(result_png, image, result["quality"])
        return result

    async def sync_adapters(self, wanted: dict[str, str]) -> list[str]:
        """Load the API's adapters `wanted` now (between batches), dropping those no longer in it; returns the names
        loaded. A file that does not load is a BadRequest with diffusers' reason."""
        async with self._busy:
            return await self._sync_adapters(wanted)

    async def _sync_adapters(self, wanted: dict[str, str]) -> list[str]:
        if wanted == self._runtime_adapters:
            return []
        try:
            done = await self.engine.sync_adapters({**self.args.loras, **wanted})
        except PoolUnavailable:
            raise
        except Exception as exc:  # the engine holds the adapters that did load: the next sync starts from there
            self._runtime_adapters = {}
            raise BadRequest("lora", f"an adapter could not be loaded: {type(exc).__name__}: {exc}") from None
        self._runtime_adapters = dict(wanted)
        logger.info("pool %s: adapters loaded %s, dropped %s", self.pool, done["added"], done["removed"])
        return done["added"]

    async def stream(self, job: GenerationRequest, partial_images: int,
                     adapters: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """One image with up to `partial_images` previews while it denoises: yields {"partial_image_index",
        "step", "png"} per preview, then {"final": <what a batch returns for it>}. It runs as its own pipeline call
        (a batch of one, so its final image equals the same request served alone, byte for byte in the lossless
        pool). The caller going away (a closed stream) stops the work at the next step."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def emit(index: int, step: int, pngs: list[bytes]) -> None:  # any thread: the pipeline's or the loop's
            event = {"partial_image_index": index, "step": step, "png": pngs[0]}
            loop.call_soon_threadsafe(events.put_nowait, ("partial", event))

        ticket = _Ticket(job, adapters)
        sink = PreviewSink(preview_steps(job.denoising_steps, partial_images), emit)
        work = asyncio.ensure_future(self.run_chunk([ticket], 1, previews=sink))
        work.add_done_callback(lambda _: events.put_nowait(("done", None)))
        try:
            while True:
                kind, event = await events.get()
                if kind == "done":
                    break
                yield event
            yield {"final": await self.finish(work.result()[0])}  # raises the batch's error, as a batch would
        finally:
            if not work.done():  # the stream was closed or cancelled before the image was done
                ticket.cancelled.set()
                work.add_done_callback(lambda w: w.cancelled() or w.exception())  # retrieved: no loop warning

    def counters(self) -> dict[str, Any]:
        """This replica's counters, with its engine's (CUDA-graph captures / replays, the high form)."""
        return {
            "pool": self.pool,
            "tp": self.pool_args.tp,
            "batches": self._batch_count,
            "cancelled_batches": self._cancelled_batches,
            "images": self._images,
            "out_of_memory": self._out_of_memory,
            **self.engine.stats(),
        }


# mutmut cannot wrap the methods of a class that Serve has wrapped: the logic is PoolReplica's, mutated there
@serve.deployment(max_ongoing_requests=8)
class FluxReplica:  # pragma: no mutate block
    """One replica of a pool; bound twice by the builder (names "lossless" and "high")."""

    def __init__(self, pool: str, args: dict[str, Any]) -> None:
        faults.at_start(pool)
        parsed = AppArgs.parse(args)
        self.core = PoolReplica(pool, parsed, make_engine(parsed, pool))
        # The batch queue is per process (one replica per process): configure it from the YAML args.
        self._batched.set_max_batch_size(parsed.max_batch_size)
        self._batched.set_batch_wait_timeout_s(self.core.batch_wait_s)
        logger.info("FluxReplica pool=%s tp=%d ready", pool, self.core.pool_args.tp)

    async def generate(self, job: GenerationRequest, adapters: dict[str, str] | None = None) -> dict[str, Any]:
        """Generate one image; returns png bytes, seed, timings, pool, batch size. `adapters`: the API's adapters
        when the job names one of them (loaded first)."""
        ticket = _Ticket(job, adapters)
        try:
            status, value = await self._batched(ticket)
        except asyncio.CancelledError:
            ticket.cancelled.set()
            raise
        if status == "ok":
            return await self.core.finish(value)
        raise value

    async def generate_stream(self, job: GenerationRequest, partial_images: int,
                              adapters: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """`PoolReplica.stream` as a Serve streaming call."""
        async for event in self.core.stream(job, partial_images, adapters):
            yield event

    async def sync_adapters(self, wanted: dict[str, str]) -> list[str]:
        """`PoolReplica.sync_adapters` (the adapter API loads a new adapter on one replica of each pool)."""
        return await self.core.sync_adapters(wanted)

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.05)
    async def _batched(self, tickets: list[_Ticket]) -> list[tuple[str, Any]]:
        return await self.core.run_tickets(tickets)

    async def stats(self) -> dict[str, Any]:
        """Counters for tests and operators (this replica only)."""
        return {**self.core.counters(), "replica_id": serve.get_replica_context().replica_id.unique_id,
                "node_id": ray.get_runtime_context().get_node_id()}

    async def actor_names(self) -> dict[str, Any]:
        """Ray actor names of this replica and its TP ranks (operators and fault-injection tests)."""
        ctx = ray.get_runtime_context()
        return {
            "namespace": ctx.namespace,
            "replica": ctx.get_actor_name(),
            "ranks": self.core.engine.actor_names(),
        }

    async def check_health(self) -> None:
        """A dead rank makes the replica unhealthy so Serve replaces it."""
        await self.core.engine.check_health()

    def __del__(self) -> None:
        core = getattr(self, "core", None)  # absent if __init__ failed before the engine was made
        if core is not None:
            core.engine.shutdown()
