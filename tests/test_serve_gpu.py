"""The Ray Serve app on one GPU: the lossless pool at tp 1 and the high pool at tp 2 with its two ranks sharing the
GPU (fractional GPUs, gloo: tp.dist.resolve_backend's testing mode). Skipped without CUDA or Ray.

The model is FLUX.1-dev's transformer width with few blocks and random weights (the tiny preset's text encoders and
VAE), written to a folder and loaded like any local FLUX.1 folder. Over HTTP: lossless PNG bytes equal stock
diffusers' (the contract), the high pool answers with its GELU sites mounted on both ranks, and its image differs
from lossless by what the tier admits (reported as PSNR; random weights make it a weak quality figure).
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
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=True)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": str(dev_width_folder), "dtype": "bfloat16", "device": "cuda", "default_size": f"{SIZE}x{SIZE}",
        "default_steps": STEPS, "request_timeout_s": 240,
        "pools": {"lossless": {"tp": 1},
                  "high": {"tp": 2, "backend": "gloo", "rank_resources": {"CPU": 1, "GPU": 0.4}}},
    }
    opts = {"lossless": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1, "num_gpus": 0.2}},
            "high": {"num_replicas": 1}, "Ingress": {"ray_actor_options": {"num_cpus": 0.1}}}
    serve.run(build_app_with_options(args, opts), name="gpu", route_prefix="/")
    yield {"url": f"http://127.0.0.1:{port}", "folder": dev_width_folder}
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
    assert high.json()["ran"]["gelu_sites"] > 0  # agreed on both ranks (a refusal anywhere mounts nowhere)

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
    quality = {"psnr_db": psnr(a, b), "ssim": ssim(a, b), "high_mounted_sites": high.json()["ran"]["gelu_sites"],
               "lossless_s": lossless.json()["timings"]["ingress_total_s"],
               "high_tp2_s": high.json()["timings"]["ingress_total_s"]}
    record_property("one_gpu_app", quality)
    print("one-GPU app:", quality)
    assert quality["psnr_db"] > 20.0
