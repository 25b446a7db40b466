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
