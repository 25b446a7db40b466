"""One tensor-parallel rank: joins the group, loads the pipeline, shards its transformer, runs SPMD batches.

Plain object (tests, scripts) and Ray actor body alike: `ray.remote(TPWorker)` works, nothing here imports Ray.
Every rank must receive the same `generate(requests)` call (the coordinator submits all ranks together); all
ranks then run the identical pipeline (text encoders, VAE and scheduler replicated, same seeds) and meet at the
transformer's all-reduces. Rank 0 returns the results, the others None.

Failure model: a rank that never joins makes `setup()` raise after `timeout_s`; a rank that dies makes the
survivors' next collective raise (gloo: connection closed or the group timeout; NCCL: the watchdog aborts the
process after the timeout), so the caller sees an error, never a hang.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from model.build import build_pipeline, warmup_report
from model.form import ServingForm
from model.request import GenerationRequest

from .dist import DEFAULT_PORT, DEFAULT_TIMEOUT_S, default_backend, init_tp, shutdown_tp
from .shard import agree_all_ranks, check_replicas_identical, shard_adapter, shard_transformer

class TPWorker:
    """One rank: `form` is what every rank of the replica builds (model.build.build_pipeline), then shards."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        form: ServingForm,
        master_addr: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cpu_threads: int | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.form = form
        self.device = form.device
        self.master_addr, self.port = master_addr, port
        self.backend = backend or default_backend(form.device)
        self.timeout_s = timeout_s
        self.cpu_threads = cpu_threads
        self.group = None
        self.ctrl_group = None
        self.pipe = None
        self._cancel = threading.Event()
        self._previews: list[tuple[int, int, list[bytes]]] = []  # rank 0's partial images, until taken
        self._previews_lock = threading.Lock()

    def setup(self) -> dict[str, Any]:
        """Join the group, then build the form on this rank's device, sharding the transformer once loaded."""
        if self.cpu_threads:  # Ray pins OMP_NUM_THREADS=1 in actors
            torch.set_num_threads(int(self.cpu_threads))
        device = torch.device(self.device)
        if device.type == "cuda":
            if device.index is None:  # under Ray each rank sees only its own GPU
                device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        self.device = str(device)
        t0 = time.perf_counter()
        self.group = init_tp(
            self.rank, self.world_size, self.backend, self.master_addr, self.port, self.timeout_s,
            device=device if device.type == "cuda" else None,
        )
        # Control-plane agreements (cancel, mount) run on a CPU gloo group so they never force a CUDA sync.
        self.ctrl_group = self.group if self.backend == "gloo" else dist.new_group(
            backend="gloo", timeout=timedelta(seconds=self.timeout_s)
        )
        t1 = time.perf_counter()
        loaded: list[float] = []

        def shard(transformer: torch.nn.Module) -> None:
            loaded.append(time.perf_counter())
            check_replicas_identical(transformer, self.ctrl_group)
            shard_transformer(transformer, self.rank, self.world_size, self.group)

        pipe = build_pipeline(replace(self.form, device=self.device), shard=shard, agree=self._agree)
        t2 = loaded[0]
        self.pipe = pipe
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "backend": self.backend,
            "device": self.device,
            "heads_per_rank": int(pipe.transformer.transformer_blocks[0].attn.heads)
            if len(pipe.transformer.transformer_blocks)
            else None,
            "init_s": t1 - t0,
            "load_s": t2 - t1,
            "build_s": time.perf_counter() - t2,
            **warmup_report(pipe),
        }

    def generate(self, requests: list[GenerationRequest], preview_steps: tuple[int, ...] = (),
                 encode: bool = True) -> list | None:
        """Run one batch (SPMD: every rank gets the same call). Rank 0 returns the results, others None.
        preview_steps: rank 0 keeps partial images after these steps for `take_previews`. encode=False: rank 0's
        results carry their images, for the caller to encode (the replica does, after the batch) while the ranks run
        the next batch."""
        from model.preview import PreviewSink

        if self.pipe is None:
            raise RuntimeError("TPWorker.setup() has not run")
        self._cancel.clear()
        with self._previews_lock:
            self._previews = []
        previews = PreviewSink(tuple(preview_steps), self._keep_preview) if preview_steps and self.rank == 0 else None
        # A "high" batch mounts on every rank or on none: ranks that disagree would compute different GELUs (same
        # shapes, silently different images). The mount's local verdict is agreed over the control group; a refusal
        # anywhere runs the batch unmounted everywhere (reported as mounted_sites=0).
        results = self.pipe.generate(list(requests), should_stop=self._should_stop,
                                     agree=self._agree, previews=previews, encode=encode)
        return results if self.rank == 0 else None

    def sync_loras(self, wanted: dict[str, str]) -> dict[str, list[str]]:
        """The loaded adapters made exactly `wanted` (SPMD: every rank gets the same call between batches); an
        adapter loaded now is sharded as those loaded before sharding are."""
        if self.pipe is None:
            raise RuntimeError("TPWorker.setup() has not run")
        return self.pipe.sync_loras(wanted, added=lambda name, layers: shard_adapter(self.pipe.transformer, name,
                                                                                     layers))

    def adapter_errors(self, rows: list[tuple[tuple[str, float], ...]]) -> list[str | None]:
        if self.pipe is None:
            raise RuntimeError("TPWorker.setup() has not run")
        return self.pipe.adapter_errors(rows)

    def _agree(self, ok: bool) -> bool:
        """This rank's verdict agreed over the control group (every rank or none), for the pipeline's hooks."""
        return agree_all_ranks(ok, self.ctrl_group)

    def _keep_preview(self, index: int, step: int, pngs: list[bytes]) -> None:
        with self._previews_lock:
            self._previews.append((index, step, pngs))

    def take_previews(self) -> list[tuple[int, int, list[bytes]]]:
        """The partial images made since the last call (rank 0; call it while `generate` runs)."""
        with self._previews_lock:
            taken, self._previews = self._previews, []
        return taken

    def _should_stop(self) -> bool:
        # Ranks must stop at the same step: agree on "any rank was asked to cancel" (one tiny all-reduce per
        # step; the coordinator normally cancels all ranks together).
        flag = torch.tensor([1 if self._cancel.is_set() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctrl_group)
        return bool(flag.item())

    def cancel(self) -> None:
        """Ask the running batch to stop at the next step boundary (call it from another thread / concurrency
        group while `generate` runs)."""
        self._cancel.set()

    def ping(self) -> dict[str, Any]:
        """Liveness, answered without touching the process group (may run while a batch is in flight)."""
        return {"rank": self.rank, "ready": self.pipe is not None, "pid": os.getpid()}

    def shutdown(self) -> None:
        self.pipe = None
        shutdown_tp()
        self.group = self.ctrl_group = None
