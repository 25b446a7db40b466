"""The engine seam: what a FluxReplica runs its batches on, so the replica itself never branches on `tp`.

An engine takes one uniform batch of GenerationRequests and returns their GenerationResults; it also answers health
checks and reports its counters. `make_engine` picks one from the pool's settings:

- `LocalEngine` (tp == 1): the pipeline in this process, run in a worker thread so the event loop keeps accepting
  requests and answering health checks while a batch denoises.
- `TPEngine` (tp > 1): this actor is a coordinator in bundle 0 of its placement group and drives one `tp.worker`
  TPWorker actor per rank. It submits every rank's call in one loop and awaits them together (SPMD): never a subset,
  or the ranks fall out of step in their collectives. The await is shielded so an abandoned request cannot cancel
  some ranks and not others.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable, Protocol

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import AppArgs, PoolArgs
from deployments.errors import PoolUnavailable
from model.build import build_pipeline, form_report, warmup_report
from model.form import ServingForm
from model.pipeline import GenerationCancelled, GenerationResult
from model.preview import PreviewSink
from model.request import GenerationRequest
from tp.dist import find_free_port, resolve_backend

logger = logging.getLogger("ray.serve")

HEALTH_TIMEOUT_S = 10.0
CANCEL_POLL_S = 0.05


class Engine(Protocol):
    # The results' PNGs are left pending (their `image`): the replica encodes each after the batch call returns
    # (`PoolReplica.finish`), while the next batch runs.
    async def generate(self, requests: list[GenerationRequest], should_stop: Callable[[], bool],
                       previews: PreviewSink | None = None) -> list[GenerationResult]: ...

    async def check_health(self) -> None: ...

    async def sync_adapters(self, wanted: dict[str, str]) -> dict[str, list[str]]: ...

    # Per image: why its adapters cannot share the engine's composed batch (FluxServePipeline.adapter_errors).
    async def adapter_errors(self, rows: list[tuple[tuple[str, float], ...]]) -> list[str | None]: ...

    def stats(self) -> dict[str, Any]: ...

    def actor_names(self) -> list[str]: ...

    def shutdown(self) -> None: ...

    def release_memory(self) -> None: ...


def make_engine(args: AppArgs, pool: str) -> Engine:
    """The engine for one replica of `pool`: in-process at tp == 1, one actor per rank above."""
    pool_args = args.pools[pool]
    if pool_args.tp == 1:
        return LocalEngine(args, pool)
    engine = TPEngine(args, pool_args, args.form(pool))
    engine.start()
    return engine


def _assigned_cpus() -> int:
    if not ray.is_initialized():  # outside Ray (scripts, tests): no assignment, and asking would start a local Ray
        return 0
    try:
        return int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0))
    except Exception:  # outside a Ray actor (tests, scripts): no assignment to read
        return 0


class LocalEngine:
    """tp == 1: the pipeline in this process, built into the pool's form (model.build.build_pipeline)."""

    def __init__(self, args: AppArgs, pool: str) -> None:
        import torch

        self.args, self.pool = args, pool
        threads = args.pools[pool].cpu_threads or _assigned_cpus() or os.cpu_count() or 1
        torch.set_num_threads(int(threads))
        self.pipe = build_pipeline(args.form(pool))

    async def generate(self, requests: list[GenerationRequest], should_stop: Callable[[], bool],
                       previews: PreviewSink | None = None) -> list[GenerationResult]:
        return await asyncio.to_thread(self.pipe.generate, requests, should_stop=should_stop, previews=previews,
                                       encode=False)

    async def check_health(self) -> None:
        return None  # a live process is a live engine: the batch runs in this actor

    async def sync_adapters(self, wanted: dict[str, str]) -> dict[str, list[str]]:
        """The pipeline's adapters made exactly `wanted` (name -> file), between batches."""
        return await asyncio.to_thread(self.pipe.sync_loras, wanted)

    async def adapter_errors(self, rows: list[tuple[tuple[str, float], ...]]) -> list[str | None]:
        return self.pipe.adapter_errors(rows)

    def stats(self) -> dict[str, Any]:
        graphs = self.pipe.step_graphs
        return {"cuda_graphs": None if graphs is None else graphs.stats(), "form": form_report(self.pipe.form),
                **warmup_report(self.pipe)}

    def actor_names(self) -> list[str]:
        return []

    def shutdown(self) -> None:
        return None

    def release_memory(self) -> None:
        self.pipe.release_memory()


def _rank_actor_class() -> Any:
    """TPWorker with `ping` and `cancel` in their own concurrency groups: neither may queue behind the
    batch that `generate` is running."""
    from tp.worker import TPWorker

    class FluxTPRank(TPWorker):
        @ray.method(concurrency_group="health")
        def ping(self) -> Any:
            return super().ping()

        @ray.method(concurrency_group="control")
        def cancel(self) -> None:
            super().cancel()

        @ray.method(concurrency_group="control")
        def take_previews(self) -> list:
            return super().take_previews()

    return ray.remote(concurrency_groups={"health": 1, "control": 1})(FluxTPRank)


class TPEngine:
    """tp > 1: this actor coordinates one TPWorker actor per placement-group bundle (SPMD; see the module doc)."""

    def __init__(self, args: AppArgs, pool: PoolArgs, form: ServingForm) -> None:
        self.args = args
        self.pool = pool
        self.form = form  # what every rank builds (model.build.build_pipeline), then shards
        self.workers: list[Any] = []
        self._names: list[str] = []
        self._setup: list[dict[str, Any]] = []  # what each rank's setup() reported (its warm-up included)
        self.broken: str | None = None  # set on the first rank failure; the replica is then unhealthy

    def start(self) -> None:
        from ray.util import get_current_placement_group

        pg = get_current_placement_group()
        if pg is None or len(pg.bundle_specs) != self.pool.tp:
            raise RuntimeError(
                f"tp={self.pool.tp} needs a placement group with {self.pool.tp} bundles "
                f"(got {None if pg is None else len(pg.bundle_specs)}); see deployments.app.pool_options"
            )
        ctx = ray.get_runtime_context()
        # All bundles are on this node (STRICT_PACK), so rank 0's rendezvous can be a port picked here.
        master_addr = ray.util.get_node_ip_address()
        port = find_free_port(master_addr)
        backend = resolve_backend(self.pool.backend, self.args.device, self.pool.ranks_share_gpu)
        cls = _rank_actor_class()
        threads = int(self.pool.cpu_threads or self.pool.rank_resources.get("CPU", 1) or 1)
        for rank, bundle in enumerate(pg.bundle_specs):
            name = f"fluxserve-rank{rank}-{ctx.get_actor_id()}"
            w = cls.options(
                name=name,
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=rank, placement_group_capture_child_tasks=True
                ),
                # env_vars only: a PYTHONPATH here would replace the inherited one (workers lose ray).
                runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": str(threads)}},
            ).remote(
                rank=rank,
                world_size=self.pool.tp,
                form=self.form,
                backend=backend,
                master_addr=master_addr,
                port=port,
                timeout_s=self.pool.collective_timeout_s,
                cpu_threads=threads,
            )
            self.workers.append(w)
            self._names.append(name)
        # setup() joins the process group: every rank must be running it at once.
        self._setup = ray.get([w.setup.remote() for w in self.workers])

    def actor_names(self) -> list[str]:
        return list(self._names)

    async def generate(self, requests: list[GenerationRequest], should_stop: Callable[[], bool],
                       previews: PreviewSink | None = None) -> list[GenerationResult]:
        """One batch on all ranks; rank 0's results. `should_stop()` true -> every rank is asked to cancel
        (the ranks agree on the step to stop at among themselves). Previews are made on rank 0 and collected
        from it while the batch runs."""
        if self.broken:
            raise PoolUnavailable(self.broken)
        steps = previews.steps if previews is not None else ()
        refs = [w.generate.remote(requests, steps, False) for w in self.workers]  # rank 0 leaves its PNGs to us
        batch = asyncio.ensure_future(asyncio.gather(*refs))

        async def forward_previews() -> None:
            if previews is not None and steps:
                for index, step, pngs in await self.workers[0].take_previews.remote():
                    previews.emit(index, step, pngs)

        async def watch_cancel() -> None:
            cancelled = False
            while not batch.done():
                if not cancelled and should_stop():
                    for w in self.workers:
                        w.cancel.remote()
                    cancelled = True
                await forward_previews()
                await asyncio.sleep(CANCEL_POLL_S)

        watcher = asyncio.ensure_future(watch_cancel())
        try:
            results = await asyncio.shield(batch)
            await watcher  # it ends with the batch; a preview it has taken is emitted, never dropped
        except GenerationCancelled:
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self.broken = f"a TP rank died: {type(e).__name__}"
            raise PoolUnavailable(self.broken) from None
        except Exception as e:
            # After a failure inside a collective the ranks may be out of step: retire this replica.
            self.broken = f"a TP rank failed: {type(e).__name__}"
            raise
        finally:
            watcher.cancel()
        await forward_previews()  # the ones made after the watcher's last look
        return results[0]

    async def sync_adapters(self, wanted: dict[str, str]) -> dict[str, list[str]]:
        """Every rank's adapters made exactly `wanted` (SPMD, between batches; each shards what it loads). A rank
        that cannot load a file fails alike on every rank (same file, same model): nothing is out of step."""
        if self.broken:
            raise PoolUnavailable(self.broken)
        try:
            return (await asyncio.gather(*[w.sync_loras.remote(wanted) for w in self.workers]))[0]
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self.broken = f"a TP rank died: {type(e).__name__}"
            raise PoolUnavailable(self.broken) from None

    async def adapter_errors(self, rows: list[tuple[tuple[str, float], ...]]) -> list[str | None]:
        """Rank 0's answer (every rank holds the same adapters)."""
        if self.broken:
            raise PoolUnavailable(self.broken)
        return await self.workers[0].adapter_errors.remote(rows)

    async def check_health(self) -> None:
        if self.broken:
            raise RuntimeError(self.broken)
        try:
            await asyncio.wait_for(
                asyncio.gather(*[w.ping.remote() for w in self.workers]), timeout=HEALTH_TIMEOUT_S
            )
        except Exception as e:
            self.broken = f"a TP rank failed its health check: {type(e).__name__}"
            raise RuntimeError(self.broken) from None

    def shutdown(self) -> None:
        # Best effort: the ranks are owned by this replica, so Ray ends them with it anyway.
        for w in self.workers:
            try:
                w.shutdown.remote()
            except Exception:  # already dead: nothing to release
                pass
        self.workers = []

    def stats(self) -> dict[str, Any]:
        return {"cuda_graphs": None, "warmup": self._setup[0]["warmup"] if self._setup else []}

    def release_memory(self) -> None:
        return None  # a rank that ran out of memory failed its collective: the group is retired (see generate)
