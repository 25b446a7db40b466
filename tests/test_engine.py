"""`deployments.engine.TPEngine` without Ray actors: stub ranks stand in for the TPWorker actors, so what a rank
failure does to the engine is checked in milliseconds: the engine is marked broken, its health check (and so the
replica's) fails, and every later request is refused as 503 without reaching a rank, so that Serve replaces the
replica. Also: every rank gets every call (SPMD), rank 0 answers, a cancel reaches every rank, a cancelled batch
does not retire the replica. (Real actors and a killed rank: tests/test_tp.py and tests/test_serve.py.)
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

pytest.importorskip("ray")

import ray.exceptions  # noqa: E402

from deployments import engine as engine_mod  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from deployments.errors import PoolUnavailable  # noqa: E402
from deployments.replica import FluxReplica, PoolReplica  # noqa: E402
from model.pipeline import GenerationCancelled  # noqa: E402
from model.request import GenerationRequest  # noqa: E402

JOB = [GenerationRequest("a red fox", height=64, width=64, steps=2, seed=1)]


class _Method:
    """`actor.method.remote(...)`: an awaitable for async methods, a plain call for fire-and-forget ones."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class _Rank:
    def __init__(self, rank: int, fails_with: BaseException | None = None, ping: str = "ok",
                 batch_s: float = 0.0) -> None:
        self.rank, self.fails_with, self.ping_mode, self.batch_s = rank, fails_with, ping, batch_s
        self.generate_calls = 0
        self.cancelled = False
        self.generate = _Method(self._generate)
        self.ping = _Method(self._ping)
        self.cancel = _Method(self._cancel)
        self.take_previews = _Method(self._take_previews)
        self.shutdown = _Method(lambda: None)

    async def _generate(self, requests: list, steps: tuple, encode: bool = True) -> list | None:
        self.generate_calls += 1
        self.encoded = encode
        await asyncio.sleep(self.batch_s)
        if self.fails_with is not None:
            raise self.fails_with
        if self.cancelled:
            raise GenerationCancelled("cancelled after step 1 of 2")
        return [f"image of rank {self.rank}"] * len(requests) if self.rank == 0 else None

    async def _ping(self) -> dict:
        if self.ping_mode == "hang":
            await asyncio.sleep(3600)
        if self.ping_mode == "dead":
            raise ray.exceptions.RayActorError(error_msg="the actor died unexpectedly")
        return {"rank": self.rank}

    def _cancel(self) -> None:
        self.cancelled = True

    async def _take_previews(self) -> list:
        return []


def _engine(*ranks: _Rank) -> engine_mod.TPEngine:
    args = AppArgs.parse({"pools": {"high": {"tp": len(ranks), "fp8": False, "fused_projections": False}}})
    e = engine_mod.TPEngine(args, args.pools["high"], args.form("high"))
    e.workers = list(ranks)
    return e


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_every_rank_gets_the_batch_and_rank_0_answers() -> None:
    ranks = [_Rank(0), _Rank(1), _Rank(2)]
    e = _engine(*ranks)
    assert _run(e.generate(JOB, lambda: False)) == ["image of rank 0"]
    assert [r.generate_calls for r in ranks] == [1, 1, 1]
    _run(e.check_health())
    assert e.broken is None


@pytest.mark.parametrize("failure, status", [
    (ray.exceptions.RayActorError(error_msg="the actor died unexpectedly"), "died"),
    (ray.exceptions.ActorUnavailableError("unavailable", None), "died"),
    (RuntimeError("gloo: connection closed by peer"), "failed"),
])
def test_a_rank_failure_retires_the_engine(failure: BaseException, status: str) -> None:
    """Catches an engine that keeps serving after a rank failed: its ranks may be out of step in their
    collectives, so every later batch could hang or mix ranks' states."""
    ranks = [_Rank(0), _Rank(1, fails_with=failure)]
    e = _engine(*ranks)
    expected = PoolUnavailable if status == "died" else RuntimeError
    with pytest.raises(expected):
        _run(e.generate(JOB, lambda: False))
    assert e.broken is not None and f"a TP rank {status}" in e.broken
    with pytest.raises(RuntimeError, match=f"a TP rank {status}"):
        _run(e.check_health())
    replica = FluxReplica.func_or_class.__new__(FluxReplica.func_or_class)  # the replica's own health check
    replica.core = PoolReplica("high", e.args, e)
    with pytest.raises(RuntimeError, match=f"a TP rank {status}"):
        _run(replica.check_health())
    ranks[1].fails_with = None  # even a recovered rank gets no more work from this engine
    with pytest.raises(PoolUnavailable, match=f"a TP rank {status}"):
        _run(e.generate(JOB, lambda: False))
    assert [r.generate_calls for r in ranks] == [1, 1]


def test_a_cancelled_batch_reaches_every_rank_and_keeps_the_engine() -> None:
    ranks = [_Rank(0, batch_s=0.2), _Rank(1, batch_s=0.2)]
    e = _engine(*ranks)
    with pytest.raises(GenerationCancelled):
        _run(e.generate(JOB, lambda: True))
    assert all(r.cancelled for r in ranks) and e.broken is None
    _run(e.check_health())
    for r in ranks:
        r.cancelled = False
    assert _run(e.generate(JOB, lambda: False)) == ["image of rank 0"]


@pytest.mark.parametrize("ping", ["hang", "dead"])
def test_a_rank_that_fails_its_ping_fails_the_health_check_for_good(ping: str, monkeypatch) -> None:
    monkeypatch.setattr(engine_mod, "HEALTH_TIMEOUT_S", 0.05)
    e = _engine(_Rank(0), _Rank(1, ping=ping))
    with pytest.raises(RuntimeError, match="a TP rank failed its health check"):
        _run(e.check_health())
    with pytest.raises(PoolUnavailable, match="health check"):
        _run(e.generate(JOB, lambda: False))


# -- LocalEngine (tp == 1), in this process ------------------------------------------------------------------------

@pytest.fixture()
def threads():
    """LocalEngine sets torch's thread count for its replica process: give it back to the test session after."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _local(tiny_path, pool: str, graphs: bool = False, **raw: Any) -> engine_mod.LocalEngine:
    from dataclasses import replace

    args = AppArgs.parse({"model": str(tiny_path), **raw})
    if graphs:  # the config allows CUDA graphs on a cuda device only; the engine's wiring is the same on the CPU
        args.pools[pool] = replace(args.pools[pool], cuda_graphs=True)
    return engine_mod.LocalEngine(args, pool)


def test_the_local_engine_serves_the_pools_settings(tiny_path, threads, caplog) -> None:
    """The high pool's settings reach its pipeline (fast norms, 8-bit attention, the step cache threshold, the
    converted form with fp8 refused on the CPU and logged, CUDA graphs asked for); the lossless pool's pipeline is
    left as loaded. A batch runs through `generate`, health is a no-op, stats report the form and the graphs."""
    import torch

    high = _local(tiny_path, "high", pools={"high": {"fp8": True, "fused_projections": True, "fast_norm": True,
                                                     "attention8": False, "step_cache_threshold": 0.25,
                                                     "cpu_threads": 2}},
                  graphs=True)
    p = high.pipe
    assert (p.form.fast_norm, p.form.attention8, p.form.step_cache) == (True, False, 0.25)
    assert (p.fused_projections, p.fp8) == (True, False) and torch.get_num_threads() == 2
    form = high.stats()["form"]
    assert form["techniques"] == ["cuda_graphs", "fast_norm", "fast_vae", "fused_projections", "step_cache"], form
    assert list(form["refused"]) == ["fp8"] and "CUDA" in form["refused"]["fp8"]
    assert any("fp8 refused" in r.getMessage() for r in caplog.records)
    assert high.stats()["cuda_graphs"] == p.step_graphs.stats() and p.cuda_graphs_enabled
    job = [GenerationRequest("a red fox", height=64, width=64, steps=2, seed=1, quality="high")]
    (result,) = _run(high.generate(job, lambda: False))
    assert result.png is None and result.image.size == (64, 64)  # left for the replica to encode
    from model.pipeline import encode_pngs

    encode_pngs([result])
    assert result.quality == "high" and result.png.startswith(b"\x89PNG") and result.timings["cached_steps"] >= 0
    assert result.image is None
    assert _run(high.check_health()) is None and high.actor_names() == []
    high.release_memory()

    lossless = _local(tiny_path, "lossless", pools={"lossless": {"cpu_threads": 1, "warm_up": False}})
    assert lossless.stats() == {"cuda_graphs": None, "form": {"techniques": [], "refused": {}}, "warmup": []}
    assert (lossless.pipe.fp8, lossless.pipe.fused_projections, lossless.pipe.form.step_cache) == (False, False, None)
    assert torch.get_num_threads() == 1


def test_warm_a_replica_runs_its_tier_at_every_warm_size_and_batch_size_before_serving(tiny_path, threads,
                                                                                      monkeypatch) -> None:
    """Before the engine exists (so before Serve routes to the replica), its pipeline has run one batch of the
    pool's tier per warm size and batch size (a batch-invariant pool: batch 1 only), each timed in the stats; a
    pool with `warm_up: false` runs none; then one streamed request per size, with its previews. Bugs caught: no
    warm-up, the other tier warmed, a batch size or size missed, the streamed path left cold."""
    from model.pipeline import FluxServePipeline

    ran: list[tuple] = []
    real = FluxServePipeline.generate

    previews: list[tuple[int, int]] = []

    def spy(self, requests, *a, **k):
        sink = k.get("previews")
        ran.append((requests[0].quality, requests[0].width, requests[0].height, len(requests), requests[0].steps,
                    sink is not None))
        if sink is not None:  # count what the streamed path really made (the sink's emit is a no-op)
            k["previews"] = type(sink)(sink.steps, lambda i, step, pngs: previews.append((step, len(pngs))))
        return real(self, requests, *a, **k)

    monkeypatch.setattr(FluxServePipeline, "generate", spy)
    high = _local(tiny_path, "high", max_batch_size=2, pools={"high": {"compile_sizes": ["64x64", "96x64"]}})
    assert ran == [("high", 64, 64, 1, 2, False), ("high", 64, 64, 2, 2, False), ("high", 96, 64, 1, 2, False),
                   ("high", 96, 64, 2, 2, False), ("high", 64, 64, 1, 3, True), ("high", 96, 64, 1, 3, True)]
    items = high.stats()["warmup"]
    assert [(i["size"], i["batch"], i["quality"], i["stream"]) for i in items] == [
        ("64x64", 1, "high", False), ("64x64", 2, "high", False), ("96x64", 1, "high", False),
        ("96x64", 2, "high", False), ("64x64", 1, "high", True), ("96x64", 1, "high", True)]
    assert all(i["s"] > 0 for i in items) and previews == [(1, 1), (1, 1)]  # each streamed warm-up made its preview
    ran.clear()
    lossless = _local(tiny_path, "lossless", max_batch_size=2)  # batch-invariant: one request per call
    assert ran == [("lossless", 256, 256, 1, 2, False), ("lossless", 256, 256, 1, 3, True)]
    assert len(lossless.stats()["warmup"]) == 2
    ran.clear()
    _local(tiny_path, "lossless", pools={"lossless": {"warm_up": False}})
    assert ran == []


def test_the_local_engine_loads_and_fuses_adapters(tiny_path, threads, tmp_path) -> None:
    from model.loading import load_pipeline
    from tests._inputs import write_random_lora

    ink = str(write_random_lora(load_pipeline(str(tiny_path)).transformer, tmp_path / "ink.safetensors", 1))
    for pool in ("lossless", "high"):
        e = _local(tiny_path, pool, loras={"ink": ink})
        assert e.pipe.loras == {"ink": ink}
        assert {"fp8", "fused_projections"}.isdisjoint(e.stats()["form"]["techniques"])  # adapters keep bf16
    fused = _local(tiny_path, "high", loras={"ink": ink}, fuse_lora=True)
    assert fused.pipe.fused_lora == ("ink", 1.0) and fused.pipe.loras == {}
    assert {"fused_lora", "fused_projections"} <= set(fused.stats()["form"]["techniques"])  # converted after the merge


# -- TPEngine.start: the ranks it asks Ray for ---------------------------------------------------------------------

class _FakeRankClass:
    """Stands in for the Ray actor class: records each `.options(...).remote(...)`; `setup.remote()` is a ref."""

    def __init__(self) -> None:
        self.started: list[tuple[dict, dict]] = []

    def options(self, **options: Any) -> Any:
        cls = self

        class _Bound:
            def remote(self, **kwargs: Any) -> Any:
                cls.started.append((options, kwargs))
                rank = _Rank(kwargs["rank"])
                rank.setup = _Method(lambda: {"rank": kwargs["rank"], "warmup": [{"size": "64x64", "rank": kwargs["rank"]}]})
                return rank

        return _Bound()


def _start(monkeypatch, pool: dict, device: str = "cpu", bundles: int | None = None, **raw: Any):
    import ray.util

    args = AppArgs.parse({"model": "tiny", "device": device, "dtype": "bfloat16", "pools": {"high": pool}, **raw})
    n = args.pools["high"].tp if bundles is None else bundles
    pg = type("PG", (), {"bundle_specs": [dict(args.pools["high"].rank_resources) for _ in range(n)]})()
    fake = _FakeRankClass()
    setups: list = []
    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: pg)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Ctx", (), {"get_actor_id": lambda self: "abc"})())
    monkeypatch.setattr(ray, "get", lambda refs: setups.extend(refs) or refs)
    monkeypatch.setattr(engine_mod, "find_free_port", lambda host: 29511 if host == "10.1.2.3" else 1)
    monkeypatch.setattr(engine_mod, "_rank_actor_class", lambda: fake)
    e = engine_mod.TPEngine(args, args.pools["high"], args.form("high"))
    e.start()
    return e, fake, setups, pg


def test_start_asks_for_one_rank_per_bundle_with_the_pools_settings(monkeypatch) -> None:
    """Each rank in its own bundle (index = rank), its resources, NCCL multicast off and its thread count in the
    environment, and the same rendezvous (this node's address, one free port), model, dtype, backend, timeout and
    per-batch options for every rank; `setup` is called on all ranks together (they join the group at once)."""
    pool = {"tp": 2, "fp8": False, "fused_projections": False, "rank_resources": {"CPU": 3}, "fast_norm": True,
            "attention8": False, "collective_timeout_s": 45.0}
    e, fake, setups, pg = _start(monkeypatch, pool)
    assert len(fake.started) == 2 and len(e.workers) == 2
    for rank, (options, kwargs) in enumerate(fake.started):
        assert options["name"] == f"fluxserve-rank{rank}-abc" and e.actor_names()[rank] == options["name"]
        assert (options["num_cpus"], options["num_gpus"]) == (3, 0)
        strategy = options["scheduling_strategy"]
        assert strategy.placement_group is pg and strategy.placement_group_bundle_index == rank
        assert strategy.placement_group_capture_child_tasks
        assert options["runtime_env"] == {"env_vars": {"NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "3"}}
        assert kwargs == {"rank": rank, "world_size": 2, "form": e.form, "backend": "gloo",
                          "master_addr": "10.1.2.3", "port": 29511, "timeout_s": 45.0, "cpu_threads": 3}
        assert (e.form.model, e.form.device, e.form.dtype, e.form.fast_norm, e.form.attention8) == (
            "tiny", "cpu", "bfloat16", True, False)
    assert [s["rank"] for s in setups] == [0, 1]
    assert e.stats()["warmup"] == [{"size": "64x64", "rank": 0}]  # rank 0's warm-up (every rank ran the same)


def test_start_takes_explicit_threads_and_gpu_bundles(monkeypatch) -> None:
    pool = {"tp": 2, "fp8": False, "fused_projections": False, "rank_resources": {"CPU": 4, "GPU": 1},
            "cpu_threads": 2, "backend": "nccl"}
    _, fake, _, _ = _start(monkeypatch, pool, device="cuda")
    options, kwargs = fake.started[1]
    assert (options["num_cpus"], options["num_gpus"]) == (4, 1)
    assert options["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "2" and kwargs["cpu_threads"] == 2
    assert (kwargs["backend"], kwargs["form"].device) == ("nccl", "cuda")


def test_start_refuses_a_placement_group_of_the_wrong_size(monkeypatch) -> None:
    pool = {"tp": 2, "fp8": False, "fused_projections": False}
    with pytest.raises(RuntimeError, match=r"tp=2 needs a placement group with 2 bundles \(got 3\)"):
        _start(monkeypatch, pool, bundles=3)


def test_make_engine_picks_by_tp(monkeypatch) -> None:
    made = []
    monkeypatch.setattr(engine_mod, "LocalEngine", lambda args, pool: made.append(("local", args, pool)) or "local")
    monkeypatch.setattr(engine_mod.TPEngine, "start", lambda self: made.append(("tp", self.args, self.pool.tp)))
    args = AppArgs.parse({"pools": {"high": {"tp": 2, "fp8": False, "fused_projections": False}}})
    assert engine_mod.make_engine(args, "lossless") == "local"
    tp = engine_mod.make_engine(args, "high")
    assert isinstance(tp, engine_mod.TPEngine) and made == [("local", args, "lossless"), ("tp", args, 2)]


def test_the_rank_actor_answers_ping_and_cancel_beside_a_running_batch() -> None:
    """ping and cancel (and take_previews) run in their own concurrency groups of one thread each: a health check
    or a cancel never queues behind the batch `generate` is running."""
    cls = engine_mod._rank_actor_class()
    assert cls._default_options["concurrency_groups"] == {"health": 1, "control": 1}
    assert cls.__ray_metadata__.method_meta.concurrency_group_for_methods == {
        "ping": "health", "cancel": "control", "take_previews": "control"}


def test_start_takes_gloo_for_ranks_sharing_a_gpu_and_one_thread_without_cpus(monkeypatch) -> None:
    pool = {"tp": 2, "fp8": False, "fused_projections": False, "rank_resources": {"GPU": 0.5}, "backend": "gloo"}
    _, fake, _, _ = _start(monkeypatch, pool, device="cuda")
    options, kwargs = fake.started[0]
    assert (kwargs["backend"], kwargs["cpu_threads"], options["num_cpus"], options["num_gpus"]) == ("gloo", 1, 0, 0.5)
    assert options["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"
    pool = {**pool, "rank_resources": {"CPU": 0, "GPU": 1}, "backend": None}
    _, fake, _, _ = _start(monkeypatch, pool, device="cuda")
    assert fake.started[0][1]["cpu_threads"] == 1 and fake.started[0][1]["backend"] == "nccl"


def test_start_outside_a_placement_group_names_what_it_needs(monkeypatch) -> None:
    import ray.util

    args = AppArgs.parse({"pools": {"high": {"tp": 2, "fp8": False, "fused_projections": False}}})
    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: None)
    with pytest.raises(RuntimeError) as exc:
        engine_mod.TPEngine(args, args.pools["high"], args.form("high")).start()
    assert str(exc.value) == ("tp=2 needs a placement group with 2 bundles (got None); see "
                              "deployments.app.pool_options")


def test_assigned_cpus_come_from_the_actor_or_are_none(monkeypatch) -> None:
    assert not ray.is_initialized()
    assert engine_mod._assigned_cpus() == 0 and not ray.is_initialized()  # asking never starts a local Ray
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    ctx = type("Ctx", (), {"get_assigned_resources": lambda self: {"CPU": 3.0, "GPU": 1.0}})()
    monkeypatch.setattr(ray, "get_runtime_context", lambda: ctx)
    assert engine_mod._assigned_cpus() == 3
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {
        "get_assigned_resources": lambda self: {"GPU": 1.0}})())
    assert engine_mod._assigned_cpus() == 0

    def outside() -> Any:
        raise RuntimeError("not in an actor")

    monkeypatch.setattr(ray, "get_runtime_context", outside)
    assert engine_mod._assigned_cpus() == 0


def test_rank_previews_and_messages_reach_the_caller() -> None:
    """Previews are taken from rank 0 only and emitted as it made them; the ranks are given the preview steps;
    a cancel is sent once per rank; failure reasons name the exception type."""
    from model.preview import PreviewSink

    ranks = [_Rank(0, batch_s=0.15), _Rank(1, batch_s=0.15)]
    asked: list[tuple] = []
    for r in ranks:
        r.generate = _Method(lambda reqs, steps, encode, r=r: asked.append((r.rank, steps, encode))
                             or r._generate(reqs, steps))
    ranks[0].take_previews = _Method(lambda: _async([(0, 3, [b"p0"]), (1, 5, [b"p1"])]))
    ranks[1].take_previews = _Method(lambda: _async([(9, 9, [b"wrong rank"])]))
    e = _engine(*ranks)
    got: list = []
    sink = PreviewSink((3, 5), lambda *a: got.append(a))
    assert _run(e.generate(JOB, lambda: False, sink)) == ["image of rank 0"]
    assert asked == [(0, (3, 5), False), (1, (3, 5), False)]  # rank 0 leaves its PNGs to the replica
    assert got[:2] == [(0, 3, [b"p0"]), (1, 5, [b"p1"])] and (9, 9, [b"wrong rank"]) not in got
    asked.clear()
    assert _run(e.generate(JOB, lambda: False)) == ["image of rank 0"] and asked == [(0, (), False), (1, (), False)]

    cancels = []
    for r in ranks:
        r.cancel = _Method(lambda r=r: cancels.append(r.rank) or setattr(r, "cancelled", True))
    with pytest.raises(GenerationCancelled):
        _run(e.generate(JOB, lambda: True))
    assert sorted(cancels) == [0, 1]  # once per rank, however many times the watcher looks

    dead = _engine(_Rank(0), _Rank(1, fails_with=ray.exceptions.RayActorError(error_msg="gone")))
    with pytest.raises(PoolUnavailable) as exc:
        _run(dead.generate(JOB, lambda: False))
    assert str(exc.value) == dead.broken == "a TP rank died: RayActorError"
    failed = _engine(_Rank(0), _Rank(1, fails_with=ValueError("x")))
    with pytest.raises(ValueError):
        _run(failed.generate(JOB, lambda: False))
    assert failed.broken == "a TP rank failed: ValueError"


def test_a_failed_health_check_names_its_reason_and_shutdown_ends_every_rank(monkeypatch) -> None:
    monkeypatch.setattr(engine_mod, "HEALTH_TIMEOUT_S", 0.05)
    e = _engine(_Rank(0), _Rank(1, ping="hang"))
    with pytest.raises(RuntimeError) as exc:
        _run(e.check_health())
    assert str(exc.value) == e.broken == "a TP rank failed its health check: TimeoutError"
    ended = []
    for r in e.workers:
        r.shutdown = _Method(lambda r=r: ended.append(r.rank))
    e.shutdown()
    assert ended == [0, 1] and e.workers == []
    e.shutdown()  # twice is harmless
    assert e.stats() == {"cuda_graphs": None, "warmup": []} and e.release_memory() is None


async def _async(value: Any) -> Any:
    return value


def test_the_local_engine_passes_stop_and_previews_and_its_device_and_dtype(tiny_path, threads, monkeypatch) -> None:
    import torch

    from model.preview import PreviewSink

    monkeypatch.setattr(engine_mod, "_assigned_cpus", lambda: 3)  # a Ray actor's CPU share, when none is set
    e = _local(tiny_path, "lossless", dtype="bfloat16", pools={"lossless": {"cpu_threads": None}})
    assert torch.get_num_threads() == 3 and e.pipe.dtype == torch.bfloat16 and e.pipe.device.type == "cpu"
    job = [GenerationRequest("a red fox", height=64, width=64, steps=4, seed=1)]
    with pytest.raises(GenerationCancelled):
        _run(e.generate(job, lambda: True))
    seen: list = []
    _run(e.generate(job, lambda: False, PreviewSink((1,), lambda *a: seen.append(a[:2]))))
    assert seen == [(0, 1)]
    monkeypatch.setattr(engine_mod, "_assigned_cpus", lambda: 0)  # outside an actor: the machine's cores
    _local(tiny_path, "lossless", pools={"lossless": {"cpu_threads": None}})
    assert torch.get_num_threads() == (os.cpu_count() or 1)


def test_fp8_alone_is_converted_or_refused_with_its_reason(tiny_path, threads) -> None:
    """A pool asking for fp8 without fused projections still converts (here: fp8 refused on the CPU, reported);
    one asking for neither is left as loaded, with no refusal to report."""
    only_fp8 = _local(tiny_path, "high", pools={"high": {"fp8": True, "fused_projections": False}})
    form = only_fp8.stats()["form"]
    assert {"fp8", "fused_projections"}.isdisjoint(form["techniques"]) and "CUDA" in form["refused"]["fp8"]
    fused = _local(tiny_path, "high", pools={"high": {"fp8": False, "fused_projections": True}})
    assert fused.stats()["form"]["refused"] == {} and "fused_projections" in fused.stats()["form"]["techniques"]
