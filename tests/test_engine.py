"""`deployments.engine.TPEngine` without Ray actors: stub ranks stand in for the TPWorker actors, so what a rank
failure does to the engine is checked in milliseconds: the engine is marked broken, its health check (and so the
replica's) fails, and every later request is refused as 503 without reaching a rank, so that Serve replaces the
replica. Also: every rank gets every call (SPMD), rank 0 answers, a cancel reaches every rank, a cancelled batch
does not retire the replica. (Real actors and a killed rank: tests/test_tp.py and tests/test_serve.py.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray")

import ray.exceptions  # noqa: E402

from deployments import engine as engine_mod  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from deployments.errors import PoolUnavailable  # noqa: E402
from deployments.replica import FluxReplica  # noqa: E402
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

    async def _generate(self, requests: list, steps: tuple) -> list | None:
        self.generate_calls += 1
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
    e = engine_mod.TPEngine(args, args.pools["high"])
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
    replica.engine = e
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
    assert (p.high_fast_norm, p.high_attention8, p.high_step_cache) == (True, False, 0.25)
    assert (p.fused_projections, p.fp8) == (True, False) and torch.get_num_threads() == 2
    form = high.stats()["high_form"]
    assert form["fused_projections"] and not form["fp8"] and "CUDA" in form["fp8_refused"], form
    assert any("fp8 refused" in r.getMessage() and "pool=high" in r.getMessage() for r in caplog.records)
    assert high.stats()["cuda_graphs"] == p.step_graphs.stats() and p.cuda_graphs_enabled
    job = [GenerationRequest("a red fox", height=64, width=64, steps=2, seed=1, quality="high")]
    (result,) = _run(high.generate(job, lambda: False))
    assert result.quality == "high" and result.png.startswith(b"\x89PNG") and result.timings["cached_steps"] >= 0
    assert _run(high.check_health()) is None and high.actor_names() == []
    high.release_memory()

    lossless = _local(tiny_path, "lossless", pools={"lossless": {"cpu_threads": 1}})
    assert lossless.stats() == {"cuda_graphs": None, "high_form": None}
    assert (lossless.pipe.fp8, lossless.pipe.fused_projections, lossless.pipe.high_step_cache) == (False, False, None)
    assert torch.get_num_threads() == 1


def test_the_local_engine_loads_and_fuses_adapters(tiny_path, threads, tmp_path) -> None:
    from model.loading import load_pipeline
    from tests._inputs import write_random_lora

    ink = str(write_random_lora(load_pipeline(str(tiny_path)).transformer, tmp_path / "ink.safetensors", 1))
    for pool in ("lossless", "high"):
        e = _local(tiny_path, pool, loras={"ink": ink})
        assert e.pipe.loras == {"ink": ink} and e.stats()["high_form"] is None  # adapters keep the high pool bf16
    fused = _local(tiny_path, "high", loras={"ink": ink}, fuse_lora=True)
    assert fused.pipe.fused_lora == ("ink", 1.0) and fused.pipe.loras == {}
    assert fused.stats()["high_form"]["fused_projections"]  # converted after the merge (fp8 refused on the CPU)
