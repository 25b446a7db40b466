"""FluxReplica: one replica of a quality pool (lossless or high).

tp == 1: the pipeline runs in this process (in a worker thread, so the event loop keeps accepting
requests and answering health checks while a batch denoises).
tp > 1: this actor is a coordinator in bundle 0 of its placement group and drives one TPWorker
actor per rank (deployments/tp_group.py).

Requests arrive one image at a time (`generate(job)`); `@serve.batch` collects them and the batch
handler runs one pipeline call per group of compatible jobs (same size/steps/guidance/quality), so
every image keeps its own seed and a batched lossless image equals the same request served alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from deployments.config import COMPILE_WARMUP_STEPS, AppArgs, compile_warmup_plan
from deployments.schema import Job

logger = logging.getLogger("ray.serve")


class PoolUnavailable(RuntimeError):
    """The pool cannot serve right now (a TP rank died, the replica is shutting down): a 503."""


class GenerationFailed(RuntimeError):
    """The pipeline raised while generating: a 500 with the reason."""


@dataclass
class _Ticket:
    job: Job
    # Set by generate() when its caller gave up (ingress timeout, client gone): the batch handler's
    # should_stop() stops a group once every ticket in it is cancelled.
    cancelled: threading.Event = field(default_factory=threading.Event)


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _assigned_cpus() -> int:
    import ray

    try:
        return int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0))
    except Exception:
        return 0


@serve.deployment(max_ongoing_requests=8)
class FluxReplica:
    """One replica of a pool; bound twice by the builder (names "lossless" and "high")."""

    def __init__(self, pool: str, args: dict[str, Any]) -> None:
        self.pool = pool
        self.args = AppArgs.parse(args)
        self.pool_args = self.args.pools[pool]
        self._batch_count = 0
        self._cancelled_batches = 0
        self._images = 0
        self._busy = asyncio.Lock()
        self._tp = None
        self._pipe = None
        # The batch queue is per process (one replica per process): configure it from the YAML args.
        self._batched.set_max_batch_size(self.args.max_batch_size)
        wait = self.pool_args.batch_wait_timeout_s
        if wait is None:
            wait = 0.0 if self.pool_args.batch_invariant else self.args.batch_wait_timeout_s
        self._batched.set_batch_wait_timeout_s(wait)
        if self.pool_args.tp == 1:
            import torch

            from model.loading import load_pipeline

            threads = self.pool_args.cpu_threads or _assigned_cpus() or os.cpu_count() or 1
            torch.set_num_threads(int(threads))
            self._pipe = load_pipeline(
                self.args.model, device=self.args.device, dtype=_torch_dtype(self.args.dtype)
            )
            self._pipe.high_fast_norm = self.pool_args.fast_norm
            if self.pool_args.compile:
                self._warm_up_compile()
            if self.pool_args.cuda_graphs:
                # Captured lazily: the first request of each batch size / resolution pays two eager steps and the
                # capture, every later step replays.
                self._pipe.enable_cuda_graphs()
        else:
            from deployments.tp_group import TPGroup

            self._tp = TPGroup(self.args, self.pool_args)
            self._tp.start()
        logger.info("FluxReplica pool=%s tp=%d ready", pool, self.pool_args.tp)

    def _warm_up_compile(self) -> None:
        """Compile the high pool's blocks before the replica reports ready, for every size and batch size it
        can be asked for (graphs are shape-specialised), so no request pays compilation."""
        sizes, batch_sizes = compile_warmup_plan(self.args, self.pool)
        seconds = self._pipe.enable_compile(sizes, steps=COMPILE_WARMUP_STEPS, batch_sizes=batch_sizes)
        logger.info("FluxReplica pool=%s: compiled for sizes %s, batch sizes %s in %.1f s", self.pool, sizes,
                    batch_sizes, seconds)

    async def generate(self, job: Job) -> dict[str, Any]:
        """Generate one image; returns png bytes, seed, timings, pool, batch size."""
        ticket = _Ticket(job)
        try:
            status, value = await self._batched(ticket)
        except asyncio.CancelledError:
            ticket.cancelled.set()
            raise
        if status == "ok":
            return value
        raise value

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.05)
    async def _batched(self, tickets: list[_Ticket]) -> list[tuple[str, Any]]:
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(tickets):
            groups.setdefault(t.job.batch_key(), []).append(i)
        out: list[tuple[str, Any] | None] = [None] * len(tickets)
        for idx in groups.values():
            # Batch-invariant pools run each request alone (see PoolArgs.batch_invariant).
            chunks = [[i] for i in idx] if self.pool_args.batch_invariant else [idx]
            for chunk in chunks:
                try:
                    results = await self._run_chunk([tickets[i] for i in chunk], len(idx))
                    for i, r in zip(chunk, results):
                        out[i] = ("ok", r)
                except Exception as exc:  # every ticket of the call gets the reason, none is dropped
                    for i in chunk:
                        out[i] = ("err", exc)
        return out  # type: ignore[return-value]

    async def _run_chunk(self, chunk: list[_Ticket], queued_together: int) -> list[dict[str, Any]]:
        """One pipeline call for compatible tickets; stops between steps once all its callers are gone."""
        from model.pipeline import GenerationCancelled, GenerationRequest

        requests = [
            GenerationRequest(
                prompt=t.job.prompt,
                height=t.job.height,
                width=t.job.width,
                steps=t.job.steps,
                guidance=t.job.guidance,
                seed=t.job.seed,
                quality=t.job.quality,
            )
            for t in chunk
        ]

        def should_stop() -> bool:
            return all(t.cancelled.is_set() for t in chunk)

        self._batch_count += 1
        try:
            async with self._busy:  # one pipeline call at a time per replica
                t0 = time.perf_counter()
                if self._tp is None:
                    results = await asyncio.to_thread(self._pipe.generate, requests, should_stop=should_stop)
                else:
                    results = await self._tp.generate(requests, should_stop)
        except GenerationCancelled:
            self._cancelled_batches += 1
            raise
        except PoolUnavailable:
            raise
        except Exception as exc:
            logger.exception("pool %s: generation failed", self.pool)
            raise GenerationFailed(f"{type(exc).__name__}: {exc}") from None
        wall = time.perf_counter() - t0
        self._images += len(results)
        return [
            {
                "png": r.png,
                "seed": int(r.seed),
                "quality": r.quality,
                "mounted_sites": int(r.mounted_sites),
                "timings": {**{k: float(v) for k, v in r.timings.items()}, "replica_batch_s": wall},
                "pool": self.pool,
                "batch_size": len(chunk),  # requests in the pipeline call that made this image
                "queued_together": queued_together,  # compatible requests collected in one @serve.batch call
            }
            for r in results
        ]

    async def stats(self) -> dict[str, Any]:
        """Counters for tests and operators (this replica only)."""
        return {
            "pool": self.pool,
            "tp": self.pool_args.tp,
            "batches": self._batch_count,
            "cancelled_batches": self._cancelled_batches,
            "images": self._images,
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            # captures / replays / eager fallbacks of the CUDA-graph cache (None: graphs off)
            "cuda_graphs": None if self._pipe is None or self._pipe.step_graphs is None
            else self._pipe.step_graphs.stats(),
        }

    async def actor_names(self) -> dict[str, Any]:
        """Ray actor names of this replica and its TP ranks (operators and fault-injection tests)."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "namespace": ctx.namespace,
            "replica": ctx.get_actor_name(),
            "ranks": self._tp.actor_names() if self._tp is not None else [],
        }

    async def check_health(self) -> None:
        """A dead rank makes the replica unhealthy so Serve replaces it."""
        if self._tp is not None:
            await self._tp.check_health()

    def __del__(self) -> None:
        if self._tp is not None:
            self._tp.shutdown()
