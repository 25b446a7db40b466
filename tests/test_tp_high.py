"""The high tier at tp 2 on the CPU (gloo, two spawned ranks): a TP rank builds the same form as a tp 1 replica
(`model.build.build_pipeline`) and shards it; fused projections, a fused adapter and the step cache run on it, and
per-request adapters on a second pipeline whose LoRA layers shard with their base layers.

Checked against a tp 1 pipeline built from the same form in this process: both ranks give the same latents and
skip the same steps (the cache's decision is agreed over the control group), and the image stays within fp32's
reduction-order noise of tp 1 (a row-parallel layer sums per-rank partial products)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._inputs import png_psnr
from tests.test_tp import JOIN_TIMEOUT_S, report_rank, spawn_ranks

WORLD = 2
PSNR_MIN_DB = 40.0
STEPS = 6


def _form(tiny_path: str, lora: str):
    from model.form import ServingForm

    return ServingForm(model=str(tiny_path), device="cpu", dtype="float32", fused_projections=True,
                       loras=(("ink", lora),), fused_lora=("ink", 1.0), warm_quality="high",
                       warm_sizes=((64, 64),), warm_batch_sizes=(1, 2))


def _requests(step_cache: float | None = None, loras: tuple = ()):
    from model.pipeline import GenerationRequest

    return [GenerationRequest("a red fox in the snow", height=64, width=64, steps=STEPS, seed=5, quality="high",
                              step_cache=step_cache, loras=loras)]


def _lora_form(tiny_path: str, lora: str):
    from model.form import ServingForm

    return ServingForm(model=str(tiny_path), device="cpu", dtype="float32", loras=(("ink", lora),))


# per-request adapter sets: none, the adapter at two scales (set_adapters switches them per batch)
LORA_SETS = ((), (("ink", 1.0),), (("ink", 0.5),))


def _rank_main(rank: int, port: int, tiny_path: str, outdir: str) -> None:
    report_rank(rank, outdir, lambda res: _rank_body(rank, port, tiny_path, outdir, res))


def _rank_body(rank: int, port: int, tiny_path: str, outdir: str, res: dict) -> None:
    import torch

    from tp.shard import agree_all_ranks
    from tp.worker import TPWorker

    torch.set_num_threads(1)  # two ranks on two cores
    worker = TPWorker(rank, WORLD, _form(tiny_path, os.path.join(outdir, "ink.safetensors")), port=port,
                      backend="gloo", timeout_s=60.0)
    res["setup"] = worker.setup()
    res["form"] = worker.pipe.form
    agree = lambda ok: agree_all_ranks(ok, worker.ctrl_group)  # noqa: E731
    for threshold in (0.9, 0.0):
        (r,) = worker.pipe.generate(_requests(threshold), agree=agree)
        res[threshold] = (r.latents, r.png, r.timings.get("cached_steps"), r.ran)
    # Per-request adapters: the LoRA layers (PEFT's) are sharded with their base layers, on the same group.
    from model.build import build_pipeline
    from tp.shard import shard_transformer

    adapted = build_pipeline(_lora_form(tiny_path, os.path.join(outdir, "ink.safetensors")),
                             shard=lambda t: shard_transformer(t, rank, WORLD, worker.group))
    res["lora_layers"] = sorted({type(m).__name__ for m in adapted.transformer.modules()
                                 if hasattr(m, "lora_A") and m.lora_A})
    for loras in LORA_SETS:
        (r,) = adapted.generate(_requests(loras=loras))
        res[loras] = r.latents
    worker.shutdown()


@pytest.fixture(scope="module")
def high_run(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from model.loading import load_pipeline
    from tests._inputs import write_random_lora

    outdir = tmp_path_factory.mktemp("tp-high")
    write_random_lora(load_pipeline(str(tiny_path)).transformer, outdir / "ink.safetensors", 3)
    return {"ranks": spawn_ranks(_rank_main, WORLD, tiny_path, outdir, JOIN_TIMEOUT_S), "outdir": outdir}


def test_both_ranks_agree_and_match_tp_1(high_run: dict, tiny_path: Path) -> None:
    import torch

    from model.build import build_pipeline

    ranks = high_run["ranks"]
    for r in range(WORLD):
        assert ranks[r]["setup"]["heads_per_rank"] == 2
        # every rank warmed up the same batches before setup returned (in step: the ranks' collectives met)
        assert [(i["size"], i["batch"], i["quality"], i["stream"]) for i in ranks[r]["setup"]["warmup"]] == [
            ("64x64", 1, "high", False), ("64x64", 2, "high", False), ("64x64", 1, "high", True)]
        assert ranks[r]["form"].techniques() == {"fused_projections", "fused_lora"}
    tp1 = build_pipeline(_form(str(tiny_path), str(high_run["outdir"] / "ink.safetensors")))
    for threshold in (0.9, 0.0):
        (ref,) = tp1.generate(_requests(threshold))
        lat0, png0, cached0, ran0 = ranks[0][threshold]
        lat1, png1, cached1, ran1 = ranks[1][threshold]
        assert torch.equal(lat0, lat1) and png0 == png1 and cached0 == cached1  # one decision for both ranks
        assert cached0 == ref.timings.get("cached_steps")
        assert bool(cached0) == (threshold > 0)  # the loose threshold skips on these random weights; 0 runs no cache
        assert ran0.fused_projections and ran0.fused_adapter == ("ink", 1.0) and ran0.step_cache == (threshold or None)
        scale = ref.latents.abs().max()
        assert (lat0 - ref.latents).abs().max() <= 1e-4 * scale, (lat0 - ref.latents).abs().max()
        assert png_psnr(png0, ref.png) >= PSNR_MIN_DB


def test_the_step_cache_skips_only_where_every_rank_would() -> None:
    """The cache hands its local verdict to `agree` and follows the answer: a rank that would skip does not when
    another would not (else the ranks would run different blocks and meet at different collectives)."""
    import torch

    from model.execution import FirstBlockCache

    asked = []
    cache = FirstBlockCache(0.5, agree=lambda ok: asked.append(ok) or False)
    residual = torch.ones(2, 3)
    assert not cache.can_skip(residual) and asked == []  # nothing cached yet: no step can skip, nothing to agree
    cache.store(residual, torch.zeros(2, 3))
    assert not cache.can_skip(residual * 1.01) and asked == [True]  # would skip here; another rank would not
    assert FirstBlockCache(0.5, agree=lambda ok: ok).can_skip  # (the tp 1 path: no hook)
    alone = FirstBlockCache(0.5)
    alone.store(residual, torch.zeros(2, 3))
    assert alone.can_skip(residual * 1.01)


def test_per_request_adapters_at_tp_2_match_tp_1(high_run: dict, tiny_path: Path) -> None:
    """Adapters switched per request on sharded LoRA layers: column layers keep their share of B, row layers their
    share of A with A's output all-reduced. A row layer that kept A whole would add its term once per rank (twice
    the adapter); one that skipped the all-reduce would add half of it; both miss tp 1 by far more than the bound."""
    import torch

    from model.build import build_pipeline

    ranks = high_run["ranks"]
    assert ranks[0]["lora_layers"] == ["Linear"]  # PEFT's LoRA linear, still in place after sharding
    tp1 = build_pipeline(_lora_form(str(tiny_path), str(high_run["outdir"] / "ink.safetensors")))
    refs = {}
    for loras in LORA_SETS:
        (ref,) = tp1.generate(_requests(loras=loras))
        refs[loras] = ref.latents
        assert torch.equal(ranks[0][loras], ranks[1][loras])
        scale = ref.latents.abs().max()
        assert (ranks[0][loras] - ref.latents).abs().max() <= 1e-4 * scale, (ranks[0][loras] - ref.latents).abs().max()
    # the adapter changes the image, by its scale (else the comparisons above would not see it)
    full = (refs[LORA_SETS[1]] - refs[()]).abs().max()
    half = (refs[LORA_SETS[2]] - refs[()]).abs().max()
    assert full > 100 * 1e-4 * refs[()].abs().max() and half < full
