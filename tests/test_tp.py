"""Tensor parallelism: 2 ranks on CPU (gloo), one process group spawned once per module, many checks in it.

The ranks run `_rank_main` (in spawned processes) and save what they saw; the tests below assert on it, so every
property is reported as its own test while the ~10 s of per-process imports are paid once.

Tolerance of TP=2 vs TP=1 (fp32): a row-parallel layer sums per-rank partial dot products, so each output
element is rounded at a different point than in the single GEMM of TP=1 (a few ulps per layer, compounded over
the blocks). We bound max|TP2 - TP1| by 1e-5 * max|TP1| (~80 fp32 ulps at the output's scale); a sharding mistake
(wrong columns, bias added twice or never, heads mixed up) moves outputs by orders of magnitude more.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest

WORLD = 2
GROUP_TIMEOUT_S = 30.0  # process-group timeout inside the spawned ranks
JOIN_TIMEOUT_S = 240.0  # the whole spawned group, so a bug can never hang the suite
MISSING_RANK_TIMEOUT_S = 2.0
HUNG_TIMEOUT_S = 2.0
TP_VS_TP1_REL_TOL = 1e-5
PSNR_MIN_DB = 40.0


def _requests(quality: str = "lossless"):
    from model.pipeline import GenerationRequest

    return [
        GenerationRequest(prompt="a red fox in the snow", height=128, width=128, steps=3, seed=11, quality=quality),
        GenerationRequest(prompt="a lighthouse at dusk", height=128, width=128, steps=3, seed=12, quality=quality),
    ]


def _transformer_inputs(model, dtype):
    import torch

    cfg = model.config
    g = torch.Generator().manual_seed(123)
    batch, img, txt = 2, 64, 8
    return dict(
        hidden_states=torch.randn(batch, img, cfg.in_channels, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt, cfg.joint_attention_dim, generator=g).to(dtype),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(dtype),
        timestep=torch.tensor([0.7, 0.3]).to(dtype),
        img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(8.0), indexing="ij"), -1)
        .reshape(-1, 3),
        txt_ids=torch.zeros(txt, 3),
        guidance=torch.tensor([3.5, 3.5]).to(dtype) if cfg.guidance_embeds else None,
        return_dict=False,
    )


def _forward(model, dtype, device: str = "cpu"):
    import torch

    inputs = _transformer_inputs(model, dtype)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        return model(**inputs)[0].cpu()


def _check_missing_rank(rank: int, res: dict) -> None:
    """Join a group whose other rank never comes: must raise within about the timeout."""
    from tp.dist import find_free_port, init_tp

    t0 = time.monotonic()
    try:
        init_tp(rank, WORLD, "gloo", port=find_free_port(), timeout_s=MISSING_RANK_TIMEOUT_S)
        res["missing_rank"] = ("no error", time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - the type is what we report
        res["missing_rank"] = (type(exc).__name__, time.monotonic() - t0)


def _rank_checks(rank: int, port: int, tiny_path: str, res: dict) -> None:
    import torch
    from diffusers import FluxTransformer2DModel

    import kernels.gelu as kgelu
    from model.loading import diffusers_reference, load_transformer
    from model import linear as tp_layers
    from model.linear import Column, Linear, Row
    from tp.shard import gather_full_state_dict, mount_all_ranks, shard_transformer
    from tp.worker import TPWorker

    torch.set_num_threads(1)  # two ranks on two cores
    _check_missing_rank(rank, res)

    from model.form import ServingForm

    worker = TPWorker(rank, WORLD, ServingForm(str(tiny_path), device="cpu", dtype="float32"), port=port,
                      backend="gloo", timeout_s=GROUP_TIMEOUT_S)
    res["setup"] = worker.setup()
    group = worker.group
    res["ping"] = worker.ping()

    # Full pipeline at TP=2 (rank 0 returns the results).
    res["lossless"] = worker.generate(_requests("lossless"))
    # The same batch through stock diffusers (its own transformer class and loader), sharded the same way.
    from model.pipeline import run_flux_pipeline

    reference = diffusers_reference(worker.pipe)
    shard_transformer(reference.transformer, rank, WORLD, group)
    res["eager_pipeline"] = run_flux_pipeline(reference, _requests("lossless"))
    del reference
    # The worker's transformer shards gather back to the checkpoint's weights.
    full = load_transformer(Path(tiny_path), torch.float32)
    gathered = gather_full_state_dict(worker.pipe.transformer)
    expected = full.state_dict()
    res["pipe_roundtrip"] = (sorted(gathered) == sorted(expected)) and all(
        torch.equal(gathered[k], expected[k]) for k in expected
    )

    # "high" batches: mounting is agreed across ranks. Guards refuse on CPU, so make one or both ranks accept.
    real_guard = kgelu.can_fuse_linear_gelu
    accept = lambda layer, x=None: (True, "ok (test)")  # noqa: E731
    for name, accepting_ranks in (("high_refused", ()), ("high_mixed", (0,)), ("high_all", (0, 1))):
        kgelu.can_fuse_linear_gelu = accept if rank in accepting_ranks else real_guard
        try:
            ok, report = mount_all_ranks(worker.pipe.transformer, worker.ctrl_group)
            mounted = len(kgelu.mounted_sites(worker.pipe.transformer))
            kgelu.unmount(worker.pipe.transformer)
            out = worker.generate(_requests("high"))
        finally:
            kgelu.can_fuse_linear_gelu = real_guard
        res[name] = {"ok": ok, "local_ok": report.ok, "mounted": mounted, "results": out,
                     "left_mounted": len(kgelu.mounted_sites(worker.pipe.transformer))}

    # Cancel on one rank (from inside its first transformer call): both ranks stop after the same step.
    from model.pipeline import GenerationCancelled

    handle = None
    if rank == 1:
        handle = worker.pipe.transformer.register_forward_pre_hook(lambda *_: worker.cancel())
    try:
        worker.generate(_requests("lossless"))
        res["cancel"] = "not cancelled"
    except GenerationCancelled as exc:
        res["cancel"] = str(exc)
    finally:
        if handle is not None:
            handle.remove()
    res["after_cancel"] = worker.generate(_requests("lossless"))

    # Replicas that loaded different weights are refused on every rank (before sharding would hide it).
    from tp.shard import check_replicas_identical

    other = load_transformer(Path(tiny_path), torch.float32)
    if rank == 1:
        with torch.no_grad():
            other.single_transformer_blocks[1].proj_out.bias[3] += 1e-3
    try:
        check_replicas_identical(other, group)
        res["replicas_mismatch"] = "no error"
    except RuntimeError as exc:
        res["replicas_mismatch"] = str(exc)
    del other

    # Transformer level: ours and diffusers' (the eager reference), same checkpoint, TP=1 then TP=2; and an exact
    # answer independent of the sharding code: the unsharded model in float64.
    ref_tp1 = _forward(full, torch.float32)
    full64 = load_transformer(Path(tiny_path), torch.float64)
    res["fp64"] = _forward(full64, torch.float64)
    del full64
    eager = FluxTransformer2DModel.from_pretrained(Path(tiny_path) / "transformer", torch_dtype=torch.float32)
    shard_transformer(full, rank, WORLD, group)
    shard_transformer(eager, rank, WORLD, group)
    res["layer_types"] = {
        "ff_up": type(full.transformer_blocks[0].ff.net[0]).__name__,
        "ff_up_proj": type(full.transformer_blocks[0].ff.net[0].proj.parallel).__name__,
        "ff_up_gather": full.transformer_blocks[0].ff.net[0].proj.parallel.gather_output,
        "ff_down": type(full.transformer_blocks[0].ff.net[2].parallel).__name__,
        "proj_mlp": type(full.single_transformer_blocks[0].proj_mlp.parallel).__name__,
        "proj_out": type(full.single_transformer_blocks[0].proj_out.parallel).__name__,
        "norm1": type(full.transformer_blocks[0].norm1.linear).__name__,
        "heads": full.transformer_blocks[0].attn.heads,
        "single_heads": full.single_transformer_blocks[0].attn.heads,
    }
    calls = []
    real_reduce = tp_layers.all_reduce_sum

    def counting_reduce(tensor, grp):
        calls.append(tuple(tensor.shape))
        return real_reduce(tensor, grp)

    tp_layers.all_reduce_sum = counting_reduce
    try:
        ours_tp2 = _forward(full, torch.float32)
    finally:
        tp_layers.all_reduce_sum = real_reduce
    res["all_reduces"] = len(calls)
    res["tp1"], res["tp2"] = ref_tp1, ours_tp2
    res["eager_tp2"] = _forward(eager, torch.float32)
    full.to(torch.bfloat16)
    eager.to(torch.bfloat16)
    res["bf16_ours_tp2"], res["bf16_eager_tp2"] = _forward(full, torch.bfloat16), _forward(eager, torch.bfloat16)

    # Layers in isolation: gathered column output and row-parallel reduce against nn.Linear.
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(48, 40)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 48, generator=g))
        lin.bias.copy_(torch.randn(40, generator=g))
    x = torch.randn(3, 48, generator=g)
    col = Linear.from_linears([lin], parallel=Column(rank, WORLD, group, gather_output=True))
    row = Linear.from_linears([lin], parallel=Row(rank, WORLD, group, blocks=(16, 32)))
    x_local = torch.cat([x[:, rank * 8 : rank * 8 + 8], x[:, 16 + rank * 16 : 16 + rank * 16 + 16]], dim=1)
    with torch.no_grad():
        res["col_gathered"], res["row_out"], res["lin_out"] = col(x), row(x_local), lin(x)
    # The constructor builds the same layer from the shard's tensors (what loading a sharded checkpoint would give).
    col2 = Linear(48, 40, dict(col.state_dict()), parallel=col.parallel)
    row2 = Linear(48, 40, dict(row.state_dict()), parallel=row.parallel)
    with torch.no_grad():
        res["constructed_equal"] = torch.equal(col2(x), res["col_gathered"]) and torch.equal(
            row2(x_local), res["row_out"]
        )
    res["col_full_ok"] = all(torch.equal(a, b) for a, b in zip(col.full_weight(), (lin.weight, lin.bias)))
    res["row_full_ok"] = all(torch.equal(a, b) for a, b in zip(row.full_weight(), (lin.weight, lin.bias)))
    # The documented bias order, written out by hand (no tp/ code): rank 0 adds the bias inside its own GEMM, then
    # the partial outputs are summed (rank 0 + rank 1). A wide reduction, so a bias added after the sum rounds
    # differently somewhere.
    big = torch.nn.Linear(512, 64)
    with torch.no_grad():
        big.weight.copy_(torch.randn(64, 512, generator=g) / 512**0.5)
        big.bias.copy_(torch.randn(64, generator=g))
    xb = torch.randn(16, 512, generator=g)
    big_row = Linear.from_linears([big], parallel=Row(rank, WORLD, group))
    with torch.no_grad():
        halves = [(xb[:, :256], big.weight[:, :256]), (xb[:, 256:], big.weight[:, 256:])]
        res["row_bias_inside"] = (torch.nn.functional.linear(*halves[0], big.bias)
                                  + torch.nn.functional.linear(*halves[1]))
        res["row_bias_after"] = (torch.nn.functional.linear(*halves[0]) + torch.nn.functional.linear(*halves[1])
                                 + big.bias)
        res["row_big"] = big_row(xb[:, rank * 256 : (rank + 1) * 256])
    res["guard_gathered"] = kgelu.can_fuse_linear_gelu(col)
    res["guard_local"] = kgelu.can_fuse_linear_gelu(Linear.from_linears([lin], parallel=Column(rank, WORLD, group)))

    # Hung rank: rank 1 stays alive but skips a collective on a group with a 2 s timeout; rank 0 must raise.
    import torch.distributed as dist

    hung_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=HUNG_TIMEOUT_S))
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=hung_group)
            res["hung_rank"] = ("no error", time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001
            res["hung_rank"] = (type(exc).__name__, time.monotonic() - t0)
    dist.barrier(group=group)

    # Dead rank: rank 1 leaves (its results are saved first by the caller); rank 0's next batch must fail fast.
    if rank == 0:
        time.sleep(1.0)
        t0 = time.monotonic()
        try:
            worker.generate(_requests("lossless"))
            res["dead_rank"] = ("no error", time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001
            res["dead_rank"] = (f"{type(exc).__name__}: {exc}"[:300], time.monotonic() - t0)


def _rank_main(rank: int, port: int, tiny_path: str, outdir: str) -> None:
    # Exits without tearing the group down: rank 1 leaving abruptly is the dead-rank check.
    report_rank(rank, outdir, lambda res: _rank_checks(rank, port, tiny_path, res))


def report_rank(rank: int, outdir: str, body) -> None:
    """Run `body(res)` in a spawned rank, save what it put in `res` (or the error) for the parent, and leave without
    tearing the process group down."""
    import torch

    res: dict = {}
    try:
        body(res)
    except BaseException:  # noqa: BLE001 - reported to the parent
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    os._exit(0)


def spawn_ranks(target, world: int, tiny_path: Path, outdir: Path, timeout_s: float) -> dict:
    """Run `target(rank, port, tiny_path, outdir)` in `world` spawned processes; each saves `rank{r}.pt`.

    Bounded: ranks still alive after `timeout_s` (the whole group) are killed and the caller's test fails.
    Returns {rank: saved dict, "wall_s": seconds}; a rank that saved an "error" fails the caller.
    """
    import multiprocessing as mp

    import torch

    from tp.dist import find_free_port

    ctx = mp.get_context("spawn")
    port = find_free_port()
    procs = [ctx.Process(target=target, args=(r, port, str(tiny_path), str(outdir))) for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, timeout_s - (time.monotonic() - t0)))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} still running after {timeout_s} s"
    results: dict = {}
    for r in range(world):
        path = outdir / f"rank{r}.pt"
        assert path.exists(), f"rank {r} died without results (exit code {procs[r].exitcode})"
        results[r] = torch.load(path, weights_only=False)
        assert "error" not in results[r], f"rank {r} failed:\n{results[r]['error']}"
    results["wall_s"] = time.monotonic() - t0
    return results


@pytest.fixture(scope="module")
def tp_run(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return spawn_ranks(_rank_main, WORLD, tiny_path, tmp_path_factory.mktemp("tp-run"), JOIN_TIMEOUT_S)


def _psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _decode(png: bytes):
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_setup_shards_heads_and_reports(tp_run: dict) -> None:
    for r in range(WORLD):
        assert tp_run[r]["setup"]["rank"] == r
        assert tp_run[r]["setup"]["heads_per_rank"] == 4 // WORLD  # tiny preset: 4 heads
        assert tp_run[r]["ping"]["ready"] is True
        assert tp_run[r]["pipe_roundtrip"] is True, f"rank {r}: gathered shards differ from the checkpoint"


def test_layer_layout(tp_run: dict) -> None:
    types = tp_run[0]["layer_types"]
    assert types == {
        "ff_up": "FluxFusedGELUProj",  # the GELU site keeps its module, its layer sharded
        "ff_up_proj": "Column",
        "ff_up_gather": False,
        "ff_down": "Row",
        "proj_mlp": "Column",
        "proj_out": "Row",
        "norm1": "Linear",  # AdaLN stays replicated
        "heads": 2,
        "single_heads": 2,
    }


def test_all_reduces_per_forward(tp_run: dict) -> None:
    # tiny preset: 2 double blocks x 4 + 2 single blocks x 1.
    assert tp_run[0]["all_reduces"] == 2 * 4 + 2 * 1
    assert tp_run[1]["all_reduces"] == tp_run[0]["all_reduces"]


def test_tp2_transformer_close_to_tp1(tp_run: dict) -> None:
    import torch

    tp1, tp2 = tp_run[0]["tp1"], tp_run[0]["tp2"]
    assert torch.equal(tp2, tp_run[1]["tp2"]), "ranks disagree on the replicated output"
    err = (tp2 - tp1).abs().max().item()
    assert err <= TP_VS_TP1_REL_TOL * tp1.abs().max().item(), err
    assert not torch.equal(tp1, torch.zeros_like(tp1))


def test_tp2_as_accurate_as_tp1_against_float64(tp_run: dict) -> None:
    """Against an answer no sharding code touched (the unsharded model in float64), TP=2 in fp32 must be about as
    accurate as TP=1 in fp32: a sharding mistake (a wrong head or column slice, a bias added twice, a missing
    reduce) is orders of magnitude further off than fp32 rounding."""
    import torch

    exact = tp_run[0]["fp64"]
    scale = exact.abs().max().item()
    err_tp1 = (tp_run[0]["tp1"].double() - exact).abs().max().item()
    err_tp2 = (tp_run[0]["tp2"].double() - exact).abs().max().item()
    assert 0 < err_tp1 < 1e-5 * scale, (err_tp1, scale)  # fp32 rounding, and not float64 by accident
    assert err_tp2 <= 4 * err_tp1, (err_tp2, err_tp1)
    assert torch.equal(tp_run[1]["fp64"], exact)


def test_row_parallel_bias_order_is_pinned(tp_run: dict) -> None:
    """model/linear.py: the bias is added once, inside rank 0's GEMM, before the all-reduce (`python
    bench/tp_bias_order.py` measured this order closer to TP=1). Bit for bit against the hand-written order."""
    import torch

    inside, after = tp_run[0]["row_bias_inside"], tp_run[0]["row_bias_after"]
    assert not torch.equal(inside, after), "the probe cannot tell the two orders apart"
    for r in range(WORLD):
        assert torch.equal(tp_run[r]["row_big"], inside)


def test_tp2_ours_bit_exact_with_eager_at_same_tp(tp_run: dict) -> None:
    import torch

    for r in range(WORLD):
        assert torch.equal(tp_run[r]["tp2"], tp_run[r]["eager_tp2"])
        assert torch.equal(tp_run[r]["bf16_ours_tp2"], tp_run[r]["bf16_eager_tp2"])


def test_parallel_layers_against_linear(tp_run: dict) -> None:
    import torch

    for r in range(WORLD):
        res = tp_run[r]
        torch.testing.assert_close(res["col_gathered"], res["lin_out"], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(res["row_out"], res["lin_out"], rtol=1e-6, atol=1e-5)
        assert res["col_full_ok"] and res["row_full_ok"]
        assert res["constructed_equal"]
    assert torch.equal(tp_run[0]["row_out"], tp_run[1]["row_out"])


def test_guard_refuses_gathered_column_parallel(tp_run: dict) -> None:
    ok, reason = tp_run[0]["guard_gathered"]
    assert not ok and "gather" in reason
    ok, reason = tp_run[0]["guard_local"]
    assert not ok and "gather" not in reason  # refused here only because this is fp32 on a CPU


def test_tp2_pipeline_close_to_tp1(tp_run: dict, tiny_pipe) -> None:
    import torch

    assert tp_run[1]["lossless"] is None  # only rank 0 returns results
    tp2 = tp_run[0]["lossless"]
    tp1 = tiny_pipe.generate(_requests("lossless"))
    assert [r.seed for r in tp2] == [11, 12]
    for a, b in zip(tp2, tp1):
        torch.testing.assert_close(a.latents, b.latents, rtol=1e-4, atol=1e-4)
        assert _psnr(_decode(a.png), _decode(b.png)) >= PSNR_MIN_DB
    assert not torch.equal(tp2[0].latents, tp2[1].latents)


def test_tp2_pipeline_byte_identical_to_diffusers_at_tp2(tp_run: dict) -> None:
    import torch

    latents, pngs = tp_run[0]["eager_pipeline"]
    ours = tp_run[0]["lossless"]
    assert len(ours) == len(latents) == 2
    for a, lat, png in zip(ours, latents, pngs):
        assert torch.equal(a.latents, lat)
        assert a.png == png


def test_mount_all_or_nothing_across_ranks(tp_run: dict) -> None:
    import torch

    lossless = tp_run[0]["lossless"]
    for name, expect_ok in (("high_refused", False), ("high_mixed", False), ("high_all", True)):
        for r in range(WORLD):
            res = tp_run[r][name]
            assert res["ok"] is expect_ok, (name, r)
            assert res["left_mounted"] == 0
        # tiny preset: 2 GELU sites per double block + 1 per single block.
        expected_sites = 6 if expect_ok else 0
        assert [tp_run[r][name]["mounted"] for r in range(WORLD)] == [expected_sites] * WORLD, name
        results = tp_run[0][name]["results"]
        assert [res.ran.gelu_sites for res in results] == [expected_sites] * 2, name
        assert [res.quality for res in results] == ["high", "high"]
        # CPU: the "fused" call is the unfused pair, so every variant reproduces the lossless image.
        for a, b in zip(results, lossless):
            assert torch.equal(a.latents, b.latents), name
    assert tp_run[0]["high_mixed"]["local_ok"] is True  # rank 0 alone accepted, then backed out
    assert tp_run[1]["high_mixed"]["local_ok"] is False


def test_cancel_on_one_rank_stops_all_at_the_same_step(tp_run: dict) -> None:
    import torch

    assert tp_run[0]["cancel"] == tp_run[1]["cancel"] == "cancelled after step 1 of 3"
    # The next batch runs normally (the flag is per batch) and reproduces the first one.
    for a, b in zip(tp_run[0]["after_cancel"], tp_run[0]["lossless"]):
        assert torch.equal(a.latents, b.latents)


def test_ranks_with_different_weights_are_refused(tp_run: dict) -> None:
    for r in range(WORLD):
        msg = tp_run[r]["replicas_mismatch"]
        assert "rank 1 holds different weights" in msg and "single_transformer_blocks.1.proj_out.bias" in msg, msg


def test_missing_rank_errors_within_timeout(tp_run: dict) -> None:
    for r in range(WORLD):
        kind, elapsed = tp_run[r]["missing_rank"]
        assert kind in ("DistStoreError", "DistNetworkError", "TimeoutError", "RuntimeError"), kind
        assert elapsed < MISSING_RANK_TIMEOUT_S * 5 + 2, elapsed


def test_hung_rank_errors_after_group_timeout(tp_run: dict) -> None:
    kind, elapsed = tp_run[0]["hung_rank"]
    assert kind != "no error"
    assert HUNG_TIMEOUT_S * 0.9 <= elapsed < HUNG_TIMEOUT_S * 3 + 2, (kind, elapsed)


def test_dead_rank_errors_not_hangs(tp_run: dict) -> None:
    msg, elapsed = tp_run[0]["dead_rank"]
    assert msg != "no error"
    assert elapsed < GROUP_TIMEOUT_S + 5, (msg, elapsed)


def test_heads_not_divisible_is_a_clear_error(tiny_path: Path) -> None:
    import torch

    from model.loading import load_transformer
    from tp.shard import shard_transformer, tp_info

    model = load_transformer(tiny_path, torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"num_attention_heads=4 .*tensor-parallel size 3"):
        shard_transformer(model, 0, 3, None)
    assert tp_info(model) is None
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_single_rank_shard_is_identity(tiny_path: Path) -> None:
    import torch

    from model.loading import load_transformer
    from tp.shard import shard_transformer

    model = load_transformer(tiny_path, torch.float32)
    ref = _forward(model, torch.float32)
    shard_transformer(model, 0, 1, None)
    assert torch.equal(_forward(model, torch.float32), ref)


def test_backend_rule() -> None:
    """One rule for every caller: NCCL on CUDA, gloo on the CPU; ranks sharing a GPU need gloo; NCCL needs CUDA."""
    from tp.dist import default_backend, resolve_backend

    assert default_backend("cuda") == "nccl" and default_backend("cuda:1") == "nccl" and default_backend("cpu") == "gloo"
    assert resolve_backend("gloo", "cuda", ranks_share_gpu=True) == "gloo"
    assert resolve_backend("gloo", "cuda") == "gloo"
    assert resolve_backend(None, "cpu", ranks_share_gpu=True) == "gloo"  # no GPU to share: the CPU rule
    for backend, device, shared, words in ((None, "cuda", True, "ranks that share a GPU need backend: gloo"),
                                           ("nccl", "cuda", True, "ranks that share a GPU need backend: gloo"),
                                           ("nccl", "cpu", False, "backend nccl needs device cuda"),
                                           ("mpi", "cpu", False, "backend must be one of")):
        with pytest.raises(ValueError, match=words):
            resolve_backend(backend, device, ranks_share_gpu=shared)
