"""The TP ranks of one FluxReplica at tp > 1: one `tp.worker.TPWorker` actor per placement-group bundle.

The replica (a coordinator in bundle 0) submits every rank's call in one loop and awaits them together
(SPMD): never a subset, or the ranks fall out of step in their collectives. The await is shielded so an
abandoned request cannot cancel some ranks and not others; one batch runs at a time per replica.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import AppArgs, PoolArgs

logger = logging.getLogger("ray.serve")

HEALTH_TIMEOUT_S = 10.0
CANCEL_POLL_S = 0.05


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

    return ray.remote(concurrency_groups={"health": 1, "control": 1})(FluxTPRank)


class TPGroup:
    def __init__(self, args: AppArgs, pool: PoolArgs) -> None:
        self.args = args
        self.pool = pool
        self.workers: list[Any] = []
        self._names: list[str] = []
        self.broken: str | None = None  # set on the first rank failure; the replica is then unhealthy

    def start(self) -> None:
        from ray.util import get_current_placement_group

        from tp.dist import find_free_port

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
        backend = self.pool.backend or ("nccl" if self.args.device.startswith("cuda") else "gloo")
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
                model_path_or_preset=self.args.model,
                device=self.args.device,
                dtype=self.args.dtype,
                backend=backend,
                master_addr=master_addr,
                port=port,
                timeout_s=self.pool.collective_timeout_s,
                cpu_threads=threads,
                fast_norm=self.pool.fast_norm,
            )
            self.workers.append(w)
            self._names.append(name)
        # setup() joins the process group: every rank must be running it at once.
        ray.get([w.setup.remote() for w in self.workers])

    def actor_names(self) -> list[str]:
        return list(self._names)

    async def generate(self, requests: list[Any], should_stop: Callable[[], bool]) -> list[Any]:
        """One batch on all ranks; rank 0's results. `should_stop()` true -> every rank is asked to cancel
        (the ranks agree on the step to stop at among themselves)."""
        from deployments.replica import PoolUnavailable
        from model.pipeline import GenerationCancelled

        if self.broken:
            raise PoolUnavailable(self.broken)
        refs = [w.generate.remote(requests) for w in self.workers]
        batch = asyncio.ensure_future(asyncio.gather(*refs))

        async def watch_cancel() -> None:
            while not batch.done():
                if should_stop():
                    for w in self.workers:
                        w.cancel.remote()
                    return
                await asyncio.sleep(CANCEL_POLL_S)

        watcher = asyncio.ensure_future(watch_cancel())
        try:
            results = await asyncio.shield(batch)
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
        return results[0]

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
