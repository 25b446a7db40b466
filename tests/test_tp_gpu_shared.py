"""tp 2 high on one GPU: two ranks share GPU 0 over gloo (the test mode of a sharded GPU path), each building the
served high form at tp > 1 plus fp8 (fp8 + fused projections + fast norms + 8-bit attention) with `build_pipeline`.

Checked against tp 1 with the same form in this process: both ranks give the same image, PSNR >= 40 dB against tp 1
(a row-parallel fp8 layer quantizes each rank's input columns per row: not bit-equal); and lossless at tp 2 stays
byte-identical with the exact fused kernels on and off (the gates). Speed is not measured here (gloo through host
memory); bench/tp_speed.py measures it on a machine with a GPU per rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._inputs import png_psnr
from tests.test_tp import JOIN_TIMEOUT_S, report_rank, spawn_ranks

pytestmark = pytest.mark.gpu
WORLD = 2
PSNR_MIN_DB = 40.0
EXACT_GATES = ("residual_gate_add", "modulate", "layer_norm_modulate", "rope_cat", "rms_rope_cat", "gelu_tanh_into")


def _form(tiny_path: str, tier: str):
    from model.form import ServingForm

    high = dict(fp8=True, fused_projections=True, fast_norm=True, attention8=True) if tier == "high" else {}
    return ServingForm(model=str(tiny_path), device="cuda:0", dtype="bfloat16", **high)


def _requests(tier: str):
    from model.pipeline import GenerationRequest

    return [GenerationRequest("a red fox in the snow", height=128, width=128, steps=4, seed=7, quality=tier)]


def _rank_main(rank: int, port: int, tiny_path: str, outdir: str) -> None:
    report_rank(rank, outdir, lambda res: _rank_body(rank, port, tiny_path, res))


def _rank_body(rank: int, port: int, tiny_path: str, res: dict) -> None:
    import kernels
    from tp.shard import agree_all_ranks
    from tp.worker import TPWorker

    for i, tier in enumerate(("high", "lossless")):
        worker = TPWorker(rank, WORLD, _form(tiny_path, tier), port=port + i, backend="gloo", timeout_s=120.0)
        res[f"{tier}_setup"] = worker.setup()
        res[f"{tier}_form"] = worker.pipe.form
        agree = lambda ok: agree_all_ranks(ok, worker.ctrl_group)  # noqa: E731,B023
        (r,) = worker.pipe.generate(_requests(tier), agree=agree)
        res[tier] = (r.latents, r.png, r.ran)
        if tier == "lossless":  # every exact fused kernel off: eager ops only
            with kernels.switches.override(**{name: False for name in EXACT_GATES}):
                (plain,) = worker.pipe.generate(_requests(tier), agree=agree)
            res["lossless_plain"] = (plain.latents, plain.png)
        worker.shutdown()


@pytest.fixture(scope="module")
def shared_run(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from kernels.fp8 import fp8_refusal

    if fp8_refusal(torch.device("cuda", 0), torch.bfloat16) is not None:
        pytest.skip("needs fp8 GEMMs (compute capability >= 8.9)")
    return spawn_ranks(_rank_main, WORLD, tiny_path, tmp_path_factory.mktemp("tp-shared"), JOIN_TIMEOUT_S)


def test_tp2_high_with_fp8_matches_tp1_and_the_ranks_agree(shared_run: dict, tiny_path: Path) -> None:
    import torch

    from model.build import build_pipeline

    r0, r1 = shared_run[0], shared_run[1]
    assert r0["high_form"].techniques() == {"fp8", "fused_projections", "fast_norm", "attention8"}
    lat0, png0, ran0 = r0["high"]
    lat1, png1, _ = r1["high"]
    assert torch.equal(lat0, lat1) and png0 == png1
    assert ran0.fp8_layers > 0 and ran0.fused_projections and ran0.fast_norm_sites > 0 and ran0.attention8_sites > 0
    (ref,) = build_pipeline(_form(str(tiny_path), "high")).generate(_requests("high"))
    assert png_psnr(png0, ref.png) >= PSNR_MIN_DB, png_psnr(png0, ref.png)


def test_tp2_lossless_is_the_same_with_the_exact_kernels_off(shared_run: dict) -> None:
    import torch

    lat, png, ran = shared_run[0]["lossless"]
    plain_lat, plain_png = shared_run[0]["lossless_plain"]
    assert torch.equal(lat, plain_lat) and png == plain_png
    assert ran.fp8_layers == 0 and not ran.fused_projections
