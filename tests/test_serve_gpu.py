"""The Ray Serve app on one GPU: the lossless pool at tp 1 and the high pool at tp 2 with its two ranks sharing the
GPU (fractional GPUs, gloo: tp.dist.resolve_backend's testing mode). Skipped without CUDA or Ray.

The model is FLUX.1-dev's transformer width with few blocks and random weights (the tiny preset's text encoders and
VAE), written to a folder and loaded like any local FLUX.1 folder. Over HTTP: lossless PNG bytes equal stock
diffusers' (the contract); the tp 2 high pool, in the served high form (fp8, fused projections, fast norms, 8-bit
attention, CUDA graphs), answers a plain, a streamed and a step-cache request; a second app whose tp 2 high pool
serves an adapter answers per-request LoRA. Images are compared as PSNR (random weights: a weak quality figure).
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests._ports import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.serve]

SIZE = 512
STEPS = 4
# One double and one single block at FLUX.1-dev width: every rank shape of the full model, ~1 GB in bf16.
DEV_WIDTH_SMALL = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
                       num_attention_heads=24, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                       axes_dims_rope=(16, 56, 56))


@pytest.fixture(scope="module")
def dev_width_folder(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from tests._inputs import random_flux

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    folder = tmp_path_factory.mktemp("dev-width") / "flux-dev-width"
    shutil.copytree(tiny_path, folder)
    shutil.rmtree(folder / "transformer")
    model = random_flux(device="cuda", dtype=torch.bfloat16, seed=0, **DEV_WIDTH_SMALL)
    model.save_pretrained(folder / "transformer")
    del model
    torch.cuda.empty_cache()
    return folder


@pytest.fixture(scope="module")
def gpu_app(dev_width_folder: Path):
    ray = pytest.importorskip("ray")
    pytest.importorskip("fastapi")
    from ray import serve

    from deployments.app import build_app_with_options

    rt = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": rt})
    ray.init(num_cpus=12, num_gpus=1, include_dashboard=False, log_to_driver=True)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": str(dev_width_folder), "dtype": "bfloat16", "device": "cuda", "default_size": f"{SIZE}x{SIZE}",
        "default_steps": STEPS, "request_timeout_s": 240,
        "pools": {"lossless": {"tp": 1},
                  "high": {"tp": 2, "backend": "gloo", "rank_resources": {"CPU": 1, "GPU": 0.2},
                           "cuda_graphs": True}},  # with graphs the high defaults are the whole served set
    }
    opts = {"lossless": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1, "num_gpus": 0.1}},
            "high": {"num_replicas": 1}, "Ingress": {"ray_actor_options": {"num_cpus": 0.1}}}
    serve.run(build_app_with_options(args, opts), name="gpu", route_prefix="/")
    yield {"url": f"http://127.0.0.1:{port}", "folder": dev_width_folder, "args": args, "opts": opts}
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(rt, ignore_errors=True)


def test_one_gpu_app_lossless_tp1_equals_diffusers_and_high_tp2_mounts(gpu_app: dict, record_property) -> None:
    import numpy as np
    import requests
    import torch
    from PIL import Image

    from model.loading import diffusers_reference, load_pipeline
    from model.metrics import psnr, ssim
    from model.pipeline import GenerationRequest, run_flux_pipeline

    url = gpu_app["url"] + "/v1/images/generations"
    body = {"prompt": "a red fox in the snow", "seed": 7}
    lossless = requests.post(url, json={**body, "quality": "lossless"}, timeout=600)
    assert lossless.status_code == 200, lossless.text
    high = requests.post(url, json={**body, "quality": "high"}, timeout=600)
    assert high.status_code == 200, high.text
    assert lossless.json()["pool"] == "lossless" and high.json()["pool"] == "high"
    ran = high.json()["ran"]  # the served high set, on both ranks (a site refused anywhere is switched on nowhere)
    assert ran["fp8_layers"] > 0 and ran["fused_projections"] and ran["graphed"], ran
    assert ran["fast_norm_sites"] > 0 and ran["attention8_sites"] > 0, ran

    ours = load_pipeline(str(gpu_app["folder"]), device="cuda", dtype=torch.bfloat16)
    reference = diffusers_reference(ours)
    del ours
    _, [ref_png] = run_flux_pipeline(reference, [GenerationRequest(body["prompt"], height=SIZE, width=SIZE,
                                                                   steps=STEPS, seed=7)])
    got = base64.b64decode(lossless.json()["data"][0]["b64_json"])
    assert got == ref_png  # the contract: lossless bytes == stock diffusers, same weights, same GPU

    # streamed (previews made on the GPU; at tp 2 by rank 0): the final image is the unstreamed bytes
    import json

    for pool, plain in (("lossless", lossless), ("high", high)):
        events = []
        with requests.post(url, json={**body, "quality": pool, "stream": True, "partial_images": 2}, stream=True,
                           timeout=600) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines(decode_unicode=True):
                if line and line.startswith("data: "):
                    events.append(json.loads(line[len("data: "):]))
        assert [e["type"].rsplit(".", 1)[1] for e in events] == ["partial_image", "partial_image", "completed"], pool
        assert events[-1]["b64_json"] == plain.json()["data"][0]["b64_json"], pool

    a, b = (np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))) for r in
            (lossless, high))
    # a step-cache request on the graphed tp 2 form: one skip decision for both ranks, blocks after the first replayed
    cached = requests.post(url, json={**body, "quality": "high", "steps": 8, "step_cache": 0.9}, timeout=600)
    assert cached.status_code == 200, cached.text
    assert cached.json()["ran"]["step_cache"] == 0.9 and cached.json()["ran"]["graphed"], cached.json()["ran"]
    assert cached.json()["timings"]["cached_steps"] >= 1, cached.json()["timings"]

    quality = {"psnr_db": psnr(a, b), "ssim": ssim(a, b), "high_ran": ran,
               "cached_steps_of_8": cached.json()["timings"]["cached_steps"],
               "lossless_s": lossless.json()["timings"]["ingress_total_s"],
               "high_tp2_s": high.json()["timings"]["ingress_total_s"]}
    record_property("one_gpu_app", quality)
    print("one-GPU app:", quality)
    assert quality["psnr_db"] > 20.0


def test_one_gpu_app_tp2_high_pool_answers_per_request_lora(gpu_app: dict, tmp_path: Path, record_property) -> None:
    """A second app whose tp 2 high pool serves an adapter (its LoRA layers sharded with their base layers on both
    ranks sharing the GPU): a request naming it, one not, each against a tp 1 pipeline of the same form built here.
    A row-parallel LoRA term added on both ranks (or on one only) misses tp 1 by far more than the bound; the
    adapter's own effect is checked larger than the tp 2 / tp 1 difference."""
    pytest.importorskip("peft")
    import requests
    import torch
    from ray import serve

    from deployments.app import build_app_with_options
    from deployments.config import AppArgs
    from model.build import build_pipeline
    from model.loading import load_pipeline
    from model.request import GenerationRequest
    from tests._inputs import png_psnr, write_random_lora

    base = load_pipeline(str(gpu_app["folder"]), device="cpu", dtype=torch.float32)
    path = write_random_lora(base.transformer, tmp_path / "ink.safetensors", seed=7)
    del base
    args = {**gpu_app["args"], "loras": {"ink": str(path)},
            "pools": {"lossless": {"tp": 1}, "high": {"tp": 2, "backend": "gloo",
                                                      "rank_resources": {"CPU": 0.5, "GPU": 0.2}}}}
    opts = {**gpu_app["opts"], "lossless": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5,
                                                                                     "num_gpus": 0.1}}}
    serve.run(build_app_with_options(args, opts), name="gpulora", route_prefix="/gpulora")
    try:
        url = gpu_app["url"] + "/gpulora/v1/images/generations"
        body = {"prompt": "a red fox in the snow", "seed": 7, "quality": "high"}
        inked = requests.post(url, json={**body, "lora": [{"name": "ink", "scale": 0.8}]}, timeout=600)
        plain = requests.post(url, json=body, timeout=600)
    finally:
        serve.delete("gpulora")
    assert inked.status_code == 200 and plain.status_code == 200, (inked.text, plain.text)
    assert inked.json()["ran"]["adapters"] == [{"name": "ink", "scale": 0.8}] and plain.json()["ran"]["adapters"] == []
    form = AppArgs.parse({**args, "pools": {"high": {"tp": 1, "warm_up": False}}}).form("high")
    tp1 = build_pipeline(form)
    psnr = {}
    for res, loras in ((inked, (("ink", 0.8),)), (plain, ())):
        (ref,) = tp1.generate([GenerationRequest(body["prompt"], height=SIZE, width=SIZE, steps=STEPS, seed=7,
                                                 quality="high", loras=loras)])
        psnr[loras] = png_psnr(base64.b64decode(res.json()["data"][0]["b64_json"]), ref.png)
    effect = png_psnr(*(base64.b64decode(r.json()["data"][0]["b64_json"]) for r in (inked, plain)))
    record_property("one_gpu_app_lora", {"psnr_vs_tp1_db": {str(k): v for k, v in psnr.items()},
                                         "adapter_effect_psnr_db": effect})
    print("one-GPU app LoRA:", psnr, "adapter effect", effect)
    assert min(psnr.values()) >= 30.0 and effect < min(psnr.values()) - 5.0
