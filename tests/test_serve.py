"""Ray Serve product tests: a real local Ray Serve on CPU with the tiny preset.

One Ray per test session (fixture `serve_app`): the app is deployed once with a fixed replica count per pool
(autoscaling is tested in an app of its own), so stats, batching and routing never depend on a pool resizing.
Nothing depends on the machine's speed: requests that must be slow (deadlines, cancellation, a rank killed
mid-batch, a busy replica that makes others queue) carry a prompt that `model.faults` slows down by a fixed delay
per step. Ports are free ports, never fixed ones; the `serve run serve_config.yaml` smoke test runs in its own Ray
(a subprocess) on a copy of the config with a free port, so the file passes in any order.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import os
import threading
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests._inputs import data_url
from tests._ports import free_port

requests = pytest.importorskip("requests")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.serve, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
APP = "fluxserve"


# The high pool runs at TP=2 over gloo in these tests (two TPWorker ranks in a STRICT_PACK placement group).
TP_HIGH = 2
# What a request that ran the plain model reports (model.tiers.Ran as JSON)
NOTHING_RAN = {"gelu_sites": 0, "fast_norm_sites": 0, "attention8_sites": 0, "fp8_layers": 0, "fused_projections": False,
               "compiled": False, "graphed": False, "step_cache": None, "fast_vae": False, "adapters": [],
               "fused_adapter": None}
# Prompts that model.faults slows down (seconds per denoising step), in every Ray process these tests start.
SLOW = "slow request for a deadline test"
BLOCKER = "blocker request keeping a replica busy"
BURST = "burst request busy for a moment"  # many of them queue: a shorter delay keeps the burst test short
STEP_DELAY_S = {SLOW: 0.5, BLOCKER: 0.5, BURST: 0.15}
OOM = "request that runs out of memory"


def _ray_env(tmp_root: str) -> dict[str, str]:
    """Environment for a test-owned Ray: no usage stats, token auth on but its token kept out of $HOME,
    short session dir (unix-socket path limit), autoscaling metrics pushed often enough for a test."""
    return {
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"],  # the session's (conftest): Ray reads it once per process
        "RAY_TMPDIR": tmp_root,
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
        "FLUXSERVE_FAULTS": json.dumps({**{p: {"step_delay_s": d} for p, d in STEP_DELAY_S.items()},
                                        OOM: {"oom_at_step": 0}}),
    }


def _md5(b: bytes) -> str:
    return hashlib.md5(b).hexdigest()


def _direct_png(pipe: Any, **kw: Any) -> bytes:
    from model.pipeline import GenerationRequest

    return _direct(pipe, GenerationRequest(**kw))


def _direct(pipe: Any, request: Any) -> bytes:
    """The pipeline's PNG for `request` in this process, at the replicas' torch thread count (cpu_threads 1): on the
    CPU an edit's bytes depend on the thread count (stock diffusers alike), so the comparison holds it equal."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return pipe.generate([request])[0].png
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# Smoke: the README's main command, in its own Ray, over HTTP on 127.0.0.1.
# --------------------------------------------------------------------------------------------------


def test_serve_run_config_smoke(fluxserve_cache: Path, tiny_path: Path) -> None:
    import yaml

    from deployments.demo import sigint_as_default

    with tempfile.TemporaryDirectory(prefix="rs", dir="/tmp") as rt, open(Path(rt, "serve-run.log"), "wb") as logf:
        env = {**os.environ, **_ray_env(rt), "FLUXSERVE_CACHE": str(fluxserve_cache)}
        env.pop("RAY_ADDRESS", None)
        # The shipped config, unchanged but for its HTTP port: a free one, so nothing else on the machine matters.
        config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
        http_port = free_port()
        config["http_options"]["port"] = http_port
        config_path = Path(rt, "serve_config.yaml")
        config_path.write_text(yaml.safe_dump(config))
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("serve")), "run", str(config_path)],
            # Output to a file: an unread pipe fills up with Ray's forwarded logs and blocks serve run.
            cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=sigint_as_default,  # a background CI shell hands its children SIGINT ignored
        )
        try:
            deadline = time.time() + 150
            r = None
            while time.time() < deadline:
                if proc.poll() is not None:
                    pytest.fail("serve run exited early:\n" + Path(rt, "serve-run.log").read_text()[-3000:])
                try:
                    r = requests.post(
                        f"http://127.0.0.1:{http_port}/v1/images/generations",
                        json={"prompt": "a red fox", "seed": 3},
                        headers={"Accept": "image/png"}, timeout=30,
                    )
                    if r.status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                time.sleep(1)
            assert r is not None and r.status_code == 200, getattr(r, "text", "no answer")
            assert r.headers["content-type"] == "image/png"
            from PIL import Image

            img = Image.open(io.BytesIO(r.content))
            assert img.size == (256, 256)
            assert r.headers["X-Seed"] == "3" and r.headers["X-Pool"] == "lossless"
            assert "Warning" not in r.headers  # 256x256: the toy's trained size
            # another size: served, with a Warning header naming the sizes /v1/models states
            models = requests.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=10).json()["data"][0]
            assert models["trained_sizes"] == ["256x256"]
            wide = requests.post(f"http://127.0.0.1:{http_port}/v1/images/generations",
                                 json={"prompt": "a red fox", "seed": 3, "size": "512x256", "steps": 2}, timeout=60)
            assert wide.status_code == 200 and len(wide.json()["data"]) == 1
            assert set(wide.json()["data"][0]) == {"b64_json", "url", "seed"}  # the response model's shape still
            assert wide.headers["Warning"] == ('299 fluxserve "toy was trained at 256x256 only; at 512x256 it may not '
                                               'draw the prompt"')
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                pytest.fail("serve run did not stop within 60 s of SIGINT; its log ends:\n"
                            + Path(rt, "serve-run.log").read_text(errors="replace")[-4000:])


@pytest.mark.parametrize("broken", ["keys", "model"])
def test_serve_run_of_a_config_that_cannot_serve_exits_with_the_reason(fluxserve_cache: Path, broken: str) -> None:
    """`serve run <config>` with a keys file that does not exist, or a model folder that does not: the process
    exits non-zero within seconds, the reason on its stderr, and leaves no Ray behind (Ray's CLI alone would keep
    running while every route answers 404)."""
    import yaml

    from deployments.demo import sigint_as_default

    with tempfile.TemporaryDirectory(prefix="rs", dir="/tmp") as rt:
        env = {**os.environ, **_ray_env(rt), "FLUXSERVE_CACHE": str(fluxserve_cache)}
        env.pop("RAY_ADDRESS", None)
        config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
        config["http_options"]["port"] = free_port()
        args = config["applications"][0]["args"]
        missing = str(Path(rt, "nowhere", "keys.txt" if broken == "keys" else "FLUX.1-dev"))
        args["api_keys_file" if broken == "keys" else "model"] = missing
        config_path = Path(rt, "serve_config.yaml")
        config_path.write_text(yaml.safe_dump(config))
        t0 = time.time()
        proc = subprocess.Popen([str(Path(sys.executable).with_name("serve")), "run", str(config_path)],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=sigint_as_default)
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail("serve run kept running with a config that cannot serve")
        took = time.time() - t0
        text = err.decode(errors="replace")
        assert proc.returncode != 0, text[-2000:]
        assert "fluxserve: the app cannot start: " in text and missing in text, text[-2000:]
        assert took < 60, took
        for _ in range(30):  # its Ray's processes (their command lines name its temp folder) go down with it
            leftover = subprocess.run(["pgrep", "-f", rt], capture_output=True, text=True).stdout.split()
            if not leftover:
                break
            time.sleep(0.5)
        assert not leftover, f"processes of its Ray still running: {leftover}"


def test_the_demo_stops_with_the_reason_when_a_pool_cannot_start(fluxserve_cache: Path, tmp_path: Path) -> None:
    """The README's main command with every replica of the high pool failing as it starts (an injected fault, as a
    model that does not fit the GPU would): Serve gives up after its retries, `/readyz` says "failed" with the
    exception, and the demo exits non-zero with it well before its ready timeout, leaving no Ray behind. Bug caught:
    the demo waiting out --ready-timeout in silence (seen on an H100 whose two pools ran out of memory at start)."""
    import yaml

    with tempfile.TemporaryDirectory(prefix="rf", dir="/tmp") as rt:
        error = "injected start fault: CUDA out of memory"
        env = {**os.environ, **_ray_env(rt), "FLUXSERVE_CACHE": str(fluxserve_cache), "RAY_TMPDIR": rt,
               "FLUXSERVE_FAULTS": json.dumps({"start:high": {"error": error}})}
        env.pop("RAY_ADDRESS", None)
        config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
        config["http_options"]["port"] = free_port()
        config_path = tmp_path / "serve_config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        t0 = time.time()
        try:
            run = subprocess.run([sys.executable, "-m", "deployments.demo", "--config", str(config_path), "--once",
                                  "--ready-timeout", "240", "--out", str(tmp_path / "demo.png")], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=300, start_new_session=True)
        finally:
            left = subprocess.run(["pgrep", "-f", rt], capture_output=True, text=True).stdout.split()
            subprocess.run(["pkill", "-9", "-f", rt])
        took = time.time() - t0
        out = run.stdout + run.stderr
        assert run.returncode != 0 and "the app failed to start: pool high: " in out and error in out, out[-3000:]
        assert "pool lossless" not in out.split("the app failed to start: ")[-1], out[-3000:]
        assert took < 180, took  # Serve's three tries, not the 240 s timeout
        assert left == [], f"{len(left)} processes of the demo's Ray session still running"
        assert not (tmp_path / "demo.png").exists()


def test_sigterm_stops_the_demo_and_leaves_nothing_running(fluxserve_cache: Path, tmp_path: Path) -> None:
    """The README's main command started in the background as a script would (SIGINT ignored), serving after its
    demo requests; SIGTERM to the demo alone: it exits 0 once `serve run` and its Ray are down, and no process of
    its Ray session is left. Bug caught: a demo that dies on SIGTERM and leaves `serve run` and Ray running."""
    import yaml

    with tempfile.TemporaryDirectory(prefix="rd", dir="/tmp") as rt:
        env = {**os.environ, **_ray_env(rt), "FLUXSERVE_CACHE": str(fluxserve_cache), "RAY_TMPDIR": rt}
        env.pop("RAY_ADDRESS", None)
        config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
        config["http_options"]["port"] = free_port()
        config_path = tmp_path / "serve_config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log = tmp_path / "demo.log"
        with open(log, "wb") as out:
            demo = subprocess.Popen([sys.executable, "-m", "deployments.demo", "--config", str(config_path),
                                     "--out", str(tmp_path / "demo.png")], cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
            left: list[str] = []
            try:
                deadline = time.time() + 240
                while time.time() < deadline and "serving; Ctrl-C to stop" not in log.read_text(errors="replace"):
                    assert demo.poll() is None, log.read_text(errors="replace")[-3000:]
                    time.sleep(1)
                assert "serving; Ctrl-C to stop" in log.read_text(errors="replace"), log.read_text()[-3000:]
                demo.send_signal(signal.SIGTERM)  # the demo alone, not its process group
                code = demo.wait(timeout=90)
            finally:
                left = subprocess.run(["pgrep", "-f", rt], capture_output=True, text=True).stdout.split()
                with contextlib.suppress(ProcessLookupError):  # whatever a failed run left behind goes too
                    os.killpg(demo.pid, signal.SIGKILL)
                subprocess.run(["pkill", "-9", "-f", rt])
                demo.wait()
        assert code == 0, log.read_text(errors="replace")[-3000:]
        assert left == [], f"{len(left)} processes of the demo's Ray session still running"
        assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------------
# Session app
# --------------------------------------------------------------------------------------------------


def test_runtime_adapters_load_serve_and_unload_through_the_api(serve_app: dict, tmp_path: Path) -> None:
    """`args.lora_dir` on, high pool at tp 2 serving adapters beside its fused projections (`adapter_rank`): POST
    /v1/adapters loads a file from the folder on both pools (lossless: PEFT; high: each tp 2 rank its share of the
    slots), requests name it (lossless: the bytes of a pipeline that loaded it at start; high at tp 2: close to
    them), two high requests with different adapters share one batch, an image past the rank budget is a 400, a file
    outside the folder or one that does not load is a 400 and stays unregistered, DELETE unloads it (then a 400 for
    a request naming it, a 404 for a second DELETE); without lora_dir the API is a 404."""
    import torch

    from model.loading import load_pipeline
    from model.pipeline import GenerationRequest
    from tests._inputs import data_url, png_psnr, random_png, write_random_lora

    folder = tmp_path / "loras"
    folder.mkdir()
    pipe = load_pipeline(serve_app["args"]["model"], device="cpu", dtype=torch.float32)
    fog = write_random_lora(pipe.transformer, folder / "fog.safetensors", 2, rank=8)
    ink = write_random_lora(pipe.transformer, folder / "ink.safetensors", 3, rank=4)
    write_random_lora(pipe.transformer, folder / "wide.safetensors", 4, rank=16)
    from safetensors.torch import save_file

    save_file({"transformer.nowhere.lora_A.weight": torch.ones(2, 4), "transformer.nowhere.lora_B.weight":
               torch.ones(4, 2)}, str(folder / "foreign.safetensors"))
    assert requests.post(serve_app["url"] + "/v1/adapters", json={"name": "fog", "file": "fog.safetensors"},
                         timeout=30).status_code == 404  # the session app sets no lora_dir
    high = {"tp": 2, "cpu_threads": 1, "backend": "gloo", "rank_resources": {"CPU": 0.5}, "fused_projections": True,
            "adapter_rank": 16}
    with _side_app(serve_app, "adapters", high=high, lora_dir=str(folder)) as app:
        url = app["url"]
        assert requests.get(url + "/v1/adapters", timeout=10).json()["data"] == []
        r = requests.post(url + "/v1/adapters", json={"name": "fog", "file": "fog.safetensors"}, timeout=120)
        assert r.status_code == 200 and r.json() == {"id": "fog", "object": "adapter", "source": "api",
                                                     "file": "fog.safetensors"}, r.text
        assert requests.get(url + "/v1/models", timeout=10).json()["data"][0]["loras"] == ["fog"]
        body = {"prompt": "a fox", "size": "64x64", "steps": 2, "seed": 4, "lora": [{"name": "fog", "scale": 0.8}]}
        pipe.load_loras({"fog": str(fog)})
        direct = _direct(pipe, GenerationRequest("a fox", height=64, width=64, steps=2, seed=4,
                                                 loras=(("fog", 0.8),)))
        plain = _direct(pipe, GenerationRequest("a fox", height=64, width=64, steps=2, seed=4))
        lossless = requests.post(url + "/v1/images/generations", json=body, timeout=120).json()
        assert base64.b64decode(lossless["data"][0]["b64_json"]) == direct and lossless["ran"]["adapters"]
        tp2 = requests.post(url + "/v1/images/generations", json={**body, "quality": "high"}, timeout=120).json()
        got = base64.b64decode(tp2["data"][0]["b64_json"])
        assert png_psnr(got, direct) >= 40 > png_psnr(got, plain), (png_psnr(got, direct), png_psnr(got, plain))
        assert tp2["ran"]["fused_projections"] and tp2["ran"]["adapters"] == [{"name": "fog", "scale": 0.8}]
        # two high requests with different adapters in one batch; one past the rank budget refused alone
        for name in ("ink", "wide"):
            assert requests.post(url + "/v1/adapters", json={"name": name, "file": f"{name}.safetensors"},
                                 timeout=120).status_code == 200
        pipe.load_loras({"ink": str(ink)})
        with ThreadPoolExecutor(2) as ex:
            futures = [ex.submit(requests.post, url + "/v1/images/generations", timeout=120, json=b) for b in (
                {**body, "quality": "high"}, {**body, "quality": "high", "seed": 5, "lora": [{"name": "ink"}]})]
            mixed = [f.result().json() for f in futures]
        assert [m["batch_sizes"] for m in mixed] == [[2], [2]], mixed
        ink_direct = _direct(pipe, GenerationRequest("a fox", height=64, width=64, steps=2, seed=5,
                                                     loras=(("ink", 1.0),)))
        assert png_psnr(base64.b64decode(mixed[0]["data"][0]["b64_json"]), direct) >= 40
        assert png_psnr(base64.b64decode(mixed[1]["data"][0]["b64_json"]), ink_direct) >= 40
        r = requests.post(url + "/v1/images/generations", timeout=120, json={
            **body, "quality": "high", "lora": [{"name": "fog"}, {"name": "wide"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora" and "rank 24" in r.text, r.text
        # streamed, and an edit: the job carries the set on those paths too
        with httpx.stream("POST", url + "/v1/images/generations", timeout=120, json={**body, "stream": True}) as r:
            events = _sse_events(r)
        assert events[-1][0] == "image_generation.completed" and base64.b64decode(events[-1][1]["b64_json"]) == direct
        source = random_png(5)
        edit = requests.post(url + "/v1/images/edits", timeout=120, json={
            **body, "images": [{"image_url": data_url(source)}], "strength": 0.7}).json()
        assert base64.b64decode(edit["data"][0]["b64_json"]) == _direct(pipe, GenerationRequest(
            "a fox", height=64, width=64, steps=2, seed=4, loras=(("fog", 0.8),), image=source, strength=0.7))
        for file, message in (("../fog.safetensors", "outside the adapter folder"),
                              ("foreign.safetensors", "adapter 'bad' does not load")):
            r = requests.post(url + "/v1/adapters", json={"name": "bad", "file": file}, timeout=120)
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert [a["id"] for a in requests.get(url + "/v1/adapters", timeout=10).json()["data"]] == ["fog", "ink", "wide"]
        assert requests.delete(url + "/v1/adapters/fog", timeout=60).json()["deleted"] is True
        r = requests.post(url + "/v1/images/generations", json=body, timeout=60)
        assert r.status_code == 400 and "unknown LoRA adapter 'fog'" in r.json()["error"]["message"], r.text
        assert requests.delete(url + "/v1/adapters/fog", timeout=60).status_code == 404


def test_kontext_edits_through_the_openai_client_equal_the_pipeline(serve_app: dict, kontext_path: Path,
                                                                    browser: Any, tmp_path: Path) -> None:
    """An app serving FLUX.1 Kontext (tiny-kontext): `/v1/models` says how it edits; `client.images.edit` with the
    model named answers the Kontext pipeline's bytes; a mask or a strength is a 400 with the reason; the playground's
    edit mode offers neither and shows the same bytes for the same edit."""
    openai = pytest.importorskip("openai")
    import torch

    from model.loading import load_pipeline
    from model.pipeline import GenerationRequest
    from tests._inputs import random_png

    with _side_app(serve_app, "kontext", model=str(kontext_path)) as app:
        model = requests.get(app["url"] + "/v1/models", timeout=10).json()["data"][0]
        assert (model["id"], model["family"], model["edits"]) == ("flux-tiny-kontext-v1", "flux1-kontext", "reference")
        client = openai.OpenAI(base_url=app["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
        image = random_png(1)
        res = client.images.edit(image=("in.png", image, "image/png"), prompt="make the fox red", model=model["id"],
                                 extra_body={"seed": 3, "steps": 2})
        pipe = load_pipeline(str(kontext_path), device="cpu", dtype=torch.float32)
        assert base64.b64decode(res.data[0].b64_json) == _direct(pipe, GenerationRequest(
            "make the fox red", height=64, width=64, steps=2, seed=3, image=image, strength=1.0))
        for extra, param, message in (({"mask": ("m.png", random_png(2, mask=True), "image/png")}, "mask",
                                       "FLUX.1 Kontext edits by instruction from the whole image: it takes no mask"),
                                      ({"data": {"strength": "0.5"}}, "strength",
                                       "strength does not apply to FLUX.1 Kontext")):
            files = {"image": ("in.png", image, "image/png"), **{k: v for k, v in extra.items() if k == "mask"}}
            r = requests.post(app["url"] + "/v1/images/edits", files=files,
                              data={"prompt": "a", **extra.get("data", {})}, timeout=30)
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == param and error["message"].startswith(message), r.text
        src = tmp_path / "in.png"
        src.write_bytes(image)
        page = browser.new_page()
        try:
            page.goto(app["url"] + "/")
            page.click("#mode-edit")
            assert not page.is_visible("#strength-edits") and not page.is_visible("#mask-canvas")
            page.set_input_files("#edit-image", str(src))
            page.wait_for_function("window.flux.editImage")
            _fill(page, "make the fox red", size=None, seed=3)
            page.click("#run")
            _wait_done(page, "lossless")
            assert _shown_png(page, "lossless") == base64.b64decode(res.data[0].b64_json)
        finally:
            page.close()


@pytest.fixture(scope="session")
def serve_app(tiny_path: Path, tiny_pipe: Any):
    rt = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    saved = {k: os.environ.get(k) for k in _ray_env(rt)}
    os.environ.update(_ray_env(rt))
    import ray
    from ray import serve

    from deployments.app import build_app_with_options

    # Logical CPUs: ingress + 2 lossless replicas + high pool (TP ranks) + slack; 2 physical cores.
    metrics_port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": str(tiny_path),
        "default_steps": 4,
        "max_batch_size": 4,
        "batch_wait_timeout_s": 0.2,
        "request_timeout_s": 60,
        "limits": {"max_side": 1024, "max_pixels": 1024 * 1024, "max_steps": 60, "max_n": 4,
                   "max_prompt_chars": 200},
        "pools": {
            # A fill wait on the lossless pool too, so the batching test sees two jobs collected together.
            "lossless": {"tp": 1, "cpu_threads": 1, "batch_wait_timeout_s": 0.2},
            "high": {"tp": TP_HIGH, "cpu_threads": 1, "backend": "gloo", "rank_resources": {"CPU": 1}},
        },
    }
    opts = {
        "lossless": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
        "high": {"num_replicas": 1, "health_check_period_s": 1, "health_check_timeout_s": 5},
        "Ingress": {"ray_actor_options": {"num_cpus": 0.1}},
    }
    serve.run(build_app_with_options(args, opts), name=APP, route_prefix="/")
    yield {"url": f"http://127.0.0.1:{port}", "pipe": tiny_pipe, "args": args,
           "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(rt, ignore_errors=True)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _post(app: dict, body: Any, raw: bool = False, headers: dict | None = None, timeout: float = 60):
    url = app["url"] + "/v1/images/generations"
    if raw:
        return requests.post(url, data=body, headers={"Content-Type": "application/json", **(headers or {})},
                             timeout=timeout)
    return requests.post(url, json=body, headers=headers or {}, timeout=timeout)


def _pool_stats(pool: str, app: str = APP) -> dict:
    """Counters summed over every running replica of the pool (each replica answers for itself: ask until every
    replica id has answered)."""
    from ray import serve

    handle = serve.get_deployment_handle(pool, app_name=app)
    want = _replicas(pool, app)
    seen: dict[str, dict] = {}
    deadline = time.time() + 30
    while len(seen) < want and time.time() < deadline:
        s = handle.stats.remote().result(timeout_s=30)
        seen[s["replica_id"]] = s
    assert len(seen) == want, f"{len(seen)} of {want} replicas of {pool!r} answered"
    first = next(iter(seen.values()))
    summed = {k: sum(s[k] for s in seen.values())
              for k in ("batches", "cancelled_batches", "images", "out_of_memory")}
    return {"pool": first["pool"], "tp": first["tp"], "replicas": len(seen), **summed}


def _replicas(pool: str, app: str = APP) -> int:
    from ray import serve

    d = serve.status().applications[app].deployments[pool]
    return int(d.replica_states.get("RUNNING", 0))


class _Blocker:
    """A request of BLOCKER's prompt running in the background: while it denoises, the pool's replica is busy and
    requests sent meanwhile queue in its @serve.batch, so they are collected together whatever the machine's speed."""

    def __init__(self, app: dict, quality: str = "lossless", steps: int = 3) -> None:
        self.response = None
        body = {"prompt": BLOCKER, "size": "64x64", "steps": steps, "seed": 0, "quality": quality}
        self._thread = threading.Thread(target=lambda: setattr(self, "response", _post(app, body, timeout=120)))

    def __enter__(self) -> "_Blocker":
        self._thread.start()
        time.sleep(0.5)  # the blocker reaches the replica (its first step alone takes STEP_DELAY_S)
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(120)
        assert self.response is not None and self.response.status_code == 200, self.response


# --------------------------------------------------------------------------------------------------
# Routing and results
# --------------------------------------------------------------------------------------------------


def test_lossless_routes_to_lossless_pool_and_equals_direct_pipeline(serve_app: dict) -> None:
    r = _post(serve_app, {"prompt": "a lighthouse at dusk", "seed": 11, "size": "256x256", "steps": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["pool"] == "lossless" and body["quality"] == "lossless"
    assert body["seeds"] == [11] and body["data"][0]["seed"] == 11
    assert body["ran"] == NOTHING_RAN
    assert body["size"] == "256x256" and body["steps"] == 4
    assert body["timings"]["ingress_total_s"] > 0
    png = base64.b64decode(body["data"][0]["b64_json"])
    direct = _direct_png(serve_app["pipe"], prompt="a lighthouse at dusk", height=256, width=256, steps=4,
                         guidance=3.5, seed=11, quality="lossless")
    assert _md5(png) == _md5(direct)


def test_high_routes_to_high_pool(serve_app: dict) -> None:
    r = _post(serve_app, {"prompt": "a lighthouse at dusk", "seed": 11, "quality": "high"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["pool"] == "high" and body["quality"] == "high"
    # CPU: the kernels' guards refuse every site (fused GELU is CUDA-only), fast norms and 8-bit attention run on
    # CUDA fp16/bf16 only; the tp 2 pool's ranks hold fused projections (fp8, its other default, is refused on a CPU).
    assert body["ran"] == {**NOTHING_RAN, "fused_projections": True}
    stats = _pool_stats("high")
    assert stats["pool"] == "high" and stats["tp"] == TP_HIGH and stats["images"] >= 1


def test_ready_when_every_pool_has_a_running_replica(serve_app: dict) -> None:
    """`/readyz` (no key needed, like `/healthz`): 200 with each pool's replicas by state once every pool has a
    running one, read from Serve's controller."""
    r = requests.get(serve_app["url"] + "/readyz", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ready" and set(body["pools"]) == {"lossless", "high"}
    assert all(p["ready"] and p["replicas"].get("running", 0) >= 1 for p in body["pools"].values()), body


def test_readiness_counts_running_replicas_per_pool() -> None:
    """The readiness rule on Serve's status objects: a pool with only starting replicas, or absent, or an app not
    known yet, is not ready. Bugs caught: any replica counted (a starting one is cold), one pool enough."""
    from types import SimpleNamespace

    from ray.serve._private.common import ReplicaState

    from deployments.ingress import readiness

    def app(**states: dict) -> SimpleNamespace:
        return SimpleNamespace(deployments={pool: SimpleNamespace(replica_states=s) for pool, s in states.items()})

    running, starting = {ReplicaState.RUNNING: 1}, {ReplicaState.STARTING: 2}
    assert readiness(app(lossless=running, high={ReplicaState.RUNNING: 2, ReplicaState.STARTING: 1}),
                     ["lossless", "high"]) == (True, {"status": "ready", "pools": {
                         "lossless": {"ready": True, "replicas": {"running": 1}},
                         "high": {"ready": True, "replicas": {"running": 2, "starting": 1}}}})
    assert readiness(app(lossless=running, high=starting), ["lossless", "high"])[1]["pools"]["high"] == {
        "ready": False, "replicas": {"starting": 2}}
    assert readiness(app(lossless=running, high=starting), ["lossless", "high"])[0] is False
    assert readiness(app(lossless=running), ["lossless", "high"]) == (False, {"status": "starting", "pools": {
        "lossless": {"ready": True, "replicas": {"running": 1}}, "high": {"ready": False, "replicas": {}}}})
    assert readiness(None, ["lossless"])[0] is False


def test_readiness_names_a_pool_serve_gave_up_starting_and_why() -> None:
    """A pool whose replicas keep failing in their constructor (Serve's DEPLOY_FAILED, e.g. CUDA out of memory while
    the model builds) makes /readyz say "failed" with Serve's first line and the exception it ends with, so a waiter
    stops at once; a failed update beside a running replica stays ready. Bugs caught: a failed pool reported as
    "starting" (the README's demo then waits out its whole timeout), the reason dropped, a running pool failed."""
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
    from ray.serve.schema import DeploymentStatusOverview

    from deployments.ingress import readiness

    message = ("The deployment failed to start 3 times in a row. This may be due to a problem with its constructor "
               "or initial health check failing. See controller logs for details. Error:\n"
               "Traceback (most recent call last):\n  File \"model/loading.py\", line 335, in _in_memory_preset\n"
               "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 108.00 MiB.\n")

    def dep(status: DeploymentStatus, states: dict) -> DeploymentStatusOverview:  # what serve.status() holds
        return DeploymentStatusOverview(status=status, status_trigger=DeploymentStatusTrigger.REPLICA_STARTUP_FAILED,
                                        replica_states=states, message=message)

    app = SimpleNamespace(deployments={"lossless": dep(DeploymentStatus.HEALTHY, {ReplicaState.RUNNING: 1}),
                                       "high": dep(DeploymentStatus.DEPLOY_FAILED, {})})
    ready, body = readiness(app, ["lossless", "high"])
    assert ready is False and body["status"] == "failed" and "error" not in body["pools"]["lossless"]
    assert body["pools"]["high"] == {"ready": False, "replicas": {}, "error": (
        "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or "
        "initial health check failing. See controller logs for details. Error: ... "
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 108.00 MiB.")}
    app.deployments["high"] = dep(DeploymentStatus.DEPLOY_FAILED, {ReplicaState.RUNNING: 1})  # a failed update
    assert readiness(app, ["lossless", "high"]) == (True, {"status": "ready", "pools": {
        "lossless": {"ready": True, "replicas": {"running": 1}}, "high": {"ready": True, "replicas": {"running": 1}}}})
    app.deployments["high"] = dep(DeploymentStatus.UPDATING, {ReplicaState.STARTING: 1})
    assert readiness(app, ["lossless", "high"])[1]["status"] == "starting"


def test_png_accept_header_and_random_seed_reported(serve_app: dict) -> None:
    r = _post(serve_app, {"prompt": "a cat"}, headers={"Accept": "image/png"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png" and r.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(r.headers["X-Ran"]) == NOTHING_RAN
    seed = int(r.headers["X-Seed"])
    direct = _direct_png(serve_app["pipe"], prompt="a cat", height=256, width=256, steps=4, guidance=3.5,
                         seed=seed, quality="lossless")
    assert _md5(r.content) == _md5(direct)


def _png_of(body: dict, i: int = 0) -> bytes:
    return base64.b64decode(body["data"][i]["b64_json"])


def test_lossless_batch_is_invariant_equal_to_solo_requests(serve_app: dict) -> None:
    # n=2 sends two jobs at once: one @serve.batch call collects both; the lossless pool then runs each
    # alone (batch_invariant), so each image equals the same request served alone and the pipeline's.
    with _Blocker(serve_app):
        r = _post(serve_app, {"prompt": "two boats", "n": 2, "seed": 100, "size": "128x128", "steps": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["seeds"] == [100, 101]
    assert body["queued_together"] == [2, 2], "the two images were not collected into one batch"
    assert body["batch_sizes"] == [1, 1]
    for i, seed in enumerate((100, 101)):
        solo = _post(serve_app, {"prompt": "two boats", "seed": seed, "size": "128x128", "steps": 3})
        assert solo.status_code == 200 and solo.json()["queued_together"] == [1]
        direct = _direct_png(serve_app["pipe"], prompt="two boats", height=128, width=128, steps=3,
                             guidance=3.5, seed=seed, quality="lossless")
        assert _md5(_png_of(body, i)) == _md5(_png_of(solo.json())) == _md5(direct)


def test_high_pool_batches_with_per_request_seeds(serve_app: dict) -> None:
    # The high pool runs compatible requests as one pipeline call; each image keeps its own seed, so it
    # matches its solo run up to the batch's rounding (GEMMs round differently at batch 2 vs 1).
    import numpy as np
    from PIL import Image

    with _Blocker(serve_app, quality="high"):
        r = _post(serve_app, {"prompt": "two boats", "n": 2, "seed": 7, "quality": "high", "size": "128x128",
                              "steps": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["batch_sizes"] == [2, 2] and body["seeds"] == [7, 8]
    imgs = [np.asarray(Image.open(io.BytesIO(_png_of(body, i))), dtype=np.int16) for i in range(2)]
    for i, seed in enumerate((7, 8)):
        direct = _direct_png(serve_app["pipe"], prompt="two boats", height=128, width=128, steps=3,
                             guidance=3.5, seed=seed, quality="high")
        ref = np.asarray(Image.open(io.BytesIO(direct)), dtype=np.int16)
        assert np.abs(imgs[i] - ref).max() <= 2  # same seed: at most rounding-level pixel differences
    assert np.abs(imgs[0] - imgs[1]).max() > 20  # different seeds: different images


def test_incompatible_requests_do_not_share_a_generate_call(serve_app: dict) -> None:
    async def both() -> list:
        async with httpx.AsyncClient(timeout=60) as c:
            url = serve_app["url"] + "/v1/images/generations"
            return await asyncio.gather(
                c.post(url, json={"prompt": "p", "seed": 5, "size": "128x128", "steps": 2}),
                c.post(url, json={"prompt": "p", "seed": 5, "size": "128x128", "steps": 3}),
                c.post(url, json={"prompt": "p", "seed": 5, "size": "128x64", "steps": 2}),
            )

    rs = asyncio.run(both())
    for r, (h, w, steps) in zip(rs, [(128, 128, 2), (128, 128, 3), (64, 128, 2)]):
        assert r.status_code == 200, r.text
        assert r.json()["batch_sizes"] == [1]
        direct = _direct_png(serve_app["pipe"], prompt="p", height=h, width=w, steps=steps, guidance=3.5,
                             seed=5, quality="lossless")
        assert _md5(base64.b64decode(r.json()["data"][0]["b64_json"])) == _md5(direct)


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------

BAD = [
    ({"prompt": "x", "quality": "ultra"}, "quality", "unknown quality 'ultra'"),
    ({"prompt": "x", "size": "256"}, "size", 'size must be "WxH"'),
    ({"prompt": "x", "size": "256x256x3"}, "size", 'size must be "WxH"'),
    ({"prompt": "x", "size": "250x256"}, "size", "multiples of 16"),
    ({"prompt": "x", "size": "2048x2048"}, "size", "too large"),
    ({"prompt": "x", "size": "32x256"}, "size", "too small"),
    ({"prompt": "x", "steps": 0}, "steps", "steps must be between 1 and 60"),
    ({"prompt": "x", "steps": 61}, "steps", "steps must be between 1 and 60"),
    ({"prompt": "x", "n": 0}, "n", "n must be between 1 and 4"),
    ({"prompt": "x", "n": 5}, "n", "n must be between 1 and 4"),
    ({"prompt": ""}, "prompt", "prompt must not be empty"),
    ({"prompt": "   "}, "prompt", "prompt must not be empty"),
    ({"prompt": "x" * 201}, "prompt", "prompt is too long: 201 characters, at most 200"),
    ({"prompt": "x", "seed": -1}, "seed", "seed must be between 0"),
    ({"prompt": "x", "guidance": -2}, "guidance", "guidance must be between 0"),
    ({"prompt": "x", "timeout_s": 0}, "timeout_s", "timeout_s must be between 1 and"),
    ({"prompt": "x", "model": "dall-e-3"}, "model", "unknown model 'dall-e-3'"),
    ({"prompt": 5}, "prompt", "prompt: Input should be a valid string"),
    ({"prompt": "x", "n": "2"}, "n", "n: Input should be a valid integer"),
    ({"prompt": "x", "steps": 4.5}, "steps", "steps: Input should be a valid integer"),
    ({"prompt": "x", "size": [256, 256]}, "size", "size: Input should be a valid string"),
    ({"prompt": "x", "response_format": "link"}, "response_format", "response_format: Input should be"),
    ({"prompt": "x", "colour": "red"}, "colour", "unknown field 'colour'"),
    ({"prompt": "x", "step_cache": 0.1}, "step_cache", "step_cache is for the high pool only"),
    ({"prompt": "x", "quality": "high", "step_cache": 1.5}, "step_cache", "step_cache must be a number in [0, 1)"),
    ({"n": 1}, "prompt", "missing required field 'prompt'"),
    (["prompt"], None, "request body must be a JSON object"),
]


@pytest.mark.parametrize("body,param,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_400_with_reason(serve_app: dict, body: Any, param: str | None, message: str) -> None:
    r = _post(serve_app, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_malformed_json_is_400(serve_app: dict) -> None:
    r = _post(serve_app, b'{"prompt": "x", ', raw=True)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("malformed JSON body")


def test_openai_client_with_openai_fields(serve_app: dict) -> None:
    """The official `openai` client: "auto" quality and size, the OpenAI tier words, output formats, and a refusal
    as a typed 400 carrying our reason."""
    openai = pytest.importorskip("openai")
    from deployments.schema import encode_image

    client = openai.OpenAI(base_url=serve_app["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)
    res = client.images.generate(prompt="a red fox", n=2, size="auto", quality="auto",
                                 extra_body={"seed": 3, "steps": 2})
    assert [d.seed for d in res.data] == [3, 4]  # our extension fields come through the client's model
    for i, seed in enumerate((3, 4)):
        direct = _direct_png(serve_app["pipe"], prompt="a red fox", height=256, width=256, steps=2, guidance=3.5,
                             seed=seed, quality="lossless")
        assert base64.b64decode(res.data[i].b64_json) == direct  # auto -> the default tier and size, byte-identical
    jpeg = client.images.generate(prompt="a red fox", size="128x128", quality="hd", output_format="jpeg",
                                  output_compression=80, extra_body={"seed": 3, "steps": 2})
    direct = _direct_png(serve_app["pipe"], prompt="a red fox", height=128, width=128, steps=2, guidance=3.5,
                         seed=3, quality="lossless")
    assert base64.b64decode(jpeg.data[0].b64_json) == encode_image(direct, "jpeg", 80)
    with pytest.raises(openai.BadRequestError) as exc:
        client.images.generate(prompt="a red fox", quality="low")
    assert exc.value.status_code == 400
    assert "unknown quality 'low'; expected one of" in str(exc.value)


def test_raw_jpeg_with_accept_header(serve_app: dict) -> None:
    r = _post(serve_app, {"prompt": "a cat", "seed": 9, "size": "64x64", "steps": 1, "output_format": "webp",
                          "output_compression": 50}, headers={"Accept": "image/webp"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/webp" and r.content[:4] == b"RIFF"
    assert r.headers["X-Seed"] == "9"


def test_png_accept_with_n_above_one_is_400(serve_app: dict) -> None:
    r = _post(serve_app, {"prompt": "x", "n": 2}, headers={"Accept": "image/png"})
    assert r.status_code == 400
    assert "needs n == 1" in r.json()["error"]["message"]


# --------------------------------------------------------------------------------------------------
# Service endpoints
# --------------------------------------------------------------------------------------------------


def test_health_models_openapi_metrics(serve_app: dict) -> None:
    h = requests.get(serve_app["url"] + "/healthz", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    m = requests.get(serve_app["url"] + "/v1/models", timeout=10).json()
    assert m["data"][0]["qualities"] == ["lossless", "high"]
    assert m["data"][0]["tp"] == {"lossless": 1, "high": TP_HIGH}
    spec = requests.get(serve_app["url"] + "/openapi.json", timeout=10)
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    assert "/v1/images/generations" in paths and "post" in paths["/v1/images/generations"]
    assert requests.get(serve_app["url"] + "/docs", timeout=10).status_code == 200
    # Every deployment is healthy from Serve's point of view (an autoscaling pool may be resizing).
    from ray import serve

    app = serve.status().applications[APP]
    assert app.status == "RUNNING"
    statuses = {d: s.status for d, s in app.deployments.items()}
    assert set(statuses) == {"Ingress", "ImageFiles", "lossless", "high"}
    assert all(s in ("HEALTHY", "UPSCALING", "DOWNSCALING") for s in statuses.values()), statuses


def test_prometheus_metrics_by_pool(serve_app: dict) -> None:
    ok = _post(serve_app, {"prompt": "metered", "seed": 2, "size": "64x64", "steps": 1, "quality": "high"})
    assert ok.status_code == 200
    assert _post(serve_app, {"prompt": "x", "quality": "ultra"}).status_code == 400
    deadline, text = time.time() + 30, ""
    want = ['ray_fluxserve_requests_total{', 'pool="high"', 'status="200"', 'ray_fluxserve_request_latency_s',
            'ray_fluxserve_in_flight']
    while time.time() < deadline:
        text = requests.get(serve_app["metrics"], timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith("ray_fluxserve_requests_total{")]
        if any('pool="high"' in ln and 'status="200"' in ln for ln in lines) and any(
            'status="400"' in ln for ln in lines
        ) and all(w in text for w in want):
            break
        time.sleep(1)
    lines = [ln for ln in text.splitlines() if ln.startswith("ray_fluxserve_")]
    assert any('pool="high"' in ln and 'status="200"' in ln and ln.startswith("ray_fluxserve_requests_total")
               for ln in lines), lines
    assert any('status="400"' in ln for ln in lines), lines
    assert any(ln.startswith("ray_fluxserve_request_latency_s_bucket") for ln in lines), lines
    assert any(ln.startswith("ray_fluxserve_in_flight") and 'pool="lossless"' in ln for ln in lines), lines


# --------------------------------------------------------------------------------------------------
# Timeout with cancellation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["lossless", "high"])
def test_deadline_gives_504_and_cancels_the_batch(serve_app: dict, pool: str) -> None:
    # high runs at TP=2: the replica asks every rank to cancel and the ranks stop at the same step.
    before = _pool_stats(pool)["cancelled_batches"]
    t0 = time.time()
    # SLOW sleeps STEP_DELAY_S per step: 20 steps take 10 s, so the 1 s deadline expires mid-denoise on any machine.
    r = _post(serve_app, {"prompt": SLOW, "size": "64x64", "steps": 20, "timeout_s": 1, "quality": pool})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["message"] == (
        f"deadline of 1 s exceeded in pool '{pool}'; the request was cancelled"
    )
    assert time.time() - t0 < 10
    deadline = time.time() + 20
    while time.time() < deadline and _pool_stats(pool)["cancelled_batches"] == before:
        time.sleep(0.5)
    assert _pool_stats(pool)["cancelled_batches"] == before + 1
    # The replica is free again: a normal request is served promptly.
    ok = _post(serve_app, {"prompt": "after", "seed": 1, "size": "128x128", "steps": 2, "quality": pool},
               timeout=30)
    assert ok.status_code == 200, ok.text


def test_cancelled_request_does_not_fail_its_batch_neighbour(serve_app: dict) -> None:
    # Same key, queued together in the lossless pool (each runs alone there): the first caller gives up
    # mid-denoise, so its own run stops early, and its neighbour still gets its image (the pipeline's bytes).
    # Both queue behind a blocker, so one @serve.batch call collects them. The quitter (SLOW: 10 steps take 5 s)
    # gives up after 2.5 s, while queued or mid-denoise; the neighbour's run is untouched.
    job = {"size": "128x128", "steps": 10}
    before = _pool_stats("lossless")["cancelled_batches"]

    async def both() -> list:
        async with httpx.AsyncClient(timeout=90) as c:
            url = serve_app["url"] + "/v1/images/generations"
            return await asyncio.gather(
                c.post(url, json={**job, "prompt": SLOW, "seed": 1, "timeout_s": 2.5}),
                c.post(url, json={**job, "prompt": "neighbours", "seed": 2}),
            )

    with _Blocker(serve_app):
        quitter, neighbour = asyncio.run(both())
    assert quitter.status_code == 504, quitter.text
    assert neighbour.status_code == 200, neighbour.text
    assert neighbour.json()["queued_together"] == [2]
    direct = _direct_png(serve_app["pipe"], prompt="neighbours", height=128, width=128, steps=10, guidance=3.5,
                         seed=2, quality="lossless")
    assert _md5(_png_of(neighbour.json())) == _md5(direct)
    deadline = time.time() + 20
    while time.time() < deadline and _pool_stats("lossless")["cancelled_batches"] == before:
        time.sleep(0.5)
    assert _pool_stats("lossless")["cancelled_batches"] == before + 1


# --------------------------------------------------------------------------------------------------
# Autoscaling
# --------------------------------------------------------------------------------------------------


AUTOSCALE_APP = "autoscale"


@contextlib.contextmanager
def _side_app(serve_app: dict, name: str, lossless_options: dict | None = None, high: dict | None = None,
              **args: Any):
    """A small app of its own next to the session app (tp 1 pools unless `high` gives the high pool's settings, one
    replica each unless `lossless_options` replaces the lossless pool's deployment options; the session's other
    args with `args` on top), at route prefix /<name>; deleted on exit."""
    from ray import serve

    from deployments.app import build_app_with_options

    full = {**serve_app["args"], **args,
            "pools": {"lossless": {"tp": 1, "cpu_threads": 1}, "high": high or {"tp": 1, "cpu_threads": 1}}}
    opts = {q: {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}} for q in ("lossless", "high")}
    if full["pools"]["high"].get("tp", 1) > 1:  # the coordinator sits in its first rank's bundle (app.py's options)
        opts["high"] = {"num_replicas": 1}
    opts["Ingress"] = {"ray_actor_options": {"num_cpus": 0.1}}
    if lossless_options is not None:
        opts["lossless"] = lossless_options
    serve.run(build_app_with_options(full, opts), name=name, route_prefix="/" + name)
    try:
        yield {**serve_app, "url": serve_app["url"] + "/" + name}
    finally:
        serve.delete(name)


@pytest.fixture
def autoscale_app(serve_app: dict):
    """An app whose lossless pool autoscales 1..2 (short delays)."""
    autoscaling = {
        "autoscaling_config": {
            "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
            "target_ongoing_requests": 1, "upscale_delay_s": 0.5, "downscale_delay_s": 3,
            "look_back_period_s": 2, "metrics_interval_s": 0.5,
        },
        "ray_actor_options": {"num_cpus": 1},
    }
    with _side_app(serve_app, AUTOSCALE_APP, lossless_options=autoscaling) as app:
        yield app


def test_lossless_pool_scales_up_under_load_and_back(autoscale_app: dict) -> None:
    assert _replicas("lossless", AUTOSCALE_APP) == 1
    stop = time.time() + 60
    seen_two = False

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal seen_two
        while not seen_two and time.time() < stop:
            # SLOW keeps each request ~1 s in the pool, so 6 clients hold ~6 ongoing requests on any machine.
            r = await c.post(autoscale_app["url"] + "/v1/images/generations",
                             json={"prompt": SLOW, "size": "64x64", "steps": 2})
            assert r.status_code == 200, r.text

    async def watcher() -> None:
        nonlocal seen_two
        while not seen_two and time.time() < stop:
            seen_two = _replicas("lossless", AUTOSCALE_APP) == 2
            await asyncio.sleep(0.5)

    async def drive() -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(watcher(), *[client(c) for _ in range(6)])

    t0 = time.time()
    asyncio.run(drive())
    assert seen_two, "lossless pool never reached 2 replicas under load"
    up_s = time.time() - t0
    assert _pool_stats("lossless", AUTOSCALE_APP)["replicas"] == 2
    deadline = time.time() + 40
    while time.time() < deadline and _replicas("lossless", AUTOSCALE_APP) != 1:
        time.sleep(0.5)
    assert _replicas("lossless", AUTOSCALE_APP) == 1, "lossless pool did not scale back to 1"
    # The session app's pools never moved.
    assert _replicas("lossless") == 1 and _replicas("high") == 1
    print(f"scaled 1->2 in {up_s:.1f}s")


@pytest.fixture(scope="class")
def auth_app(serve_app: dict, tmp_path_factory: pytest.TempPathFactory):
    """An app whose ingress requires API keys from a file (one for the tests of `TestApiKeys`)."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# fluxserve keys\nsk-test-one\n\nsk-test-two\n")
    with _side_app(serve_app, "auth", api_keys_file=str(keys)) as app:
        yield app


class TestApiKeys:
    """One app with API keys on for both tests (a side app costs ~30 s to start here)."""

    def test_api_keys_guard_every_route_but_healthz(self, auth_app: dict) -> None:
        openai = pytest.importorskip("openai")
        url = auth_app["url"]
        assert requests.get(url + "/healthz", timeout=10).status_code == 200
        for path in ("/v1/models", "/docs", "/openapi.json", "/v1/images/files/any-id"):
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-test-one"}):
                r = requests.get(url + path, headers=headers, timeout=10)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
                assert r.headers["WWW-Authenticate"] == "Bearer"
        ok = requests.get(url + "/v1/models", headers={"Authorization": "Bearer sk-test-two"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"]
        body = {"prompt": "a key", "size": "64x64", "steps": 1, "seed": 5}
        assert requests.post(url + "/v1/images/generations", json=body, timeout=60).status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test-one", max_retries=0, timeout=60)
        res = client.images.generate(prompt="a key", size="64x64", extra_body={"steps": 1, "seed": 5})
        direct = _direct_png(auth_app["pipe"], prompt="a key", height=64, width=64, steps=1, guidance=3.5, seed=5,
                             quality="lossless")
        assert base64.b64decode(res.data[0].b64_json) == direct
        with pytest.raises(openai.AuthenticationError) as exc:
            openai.OpenAI(base_url=url + "/v1", api_key="sk-nope", max_retries=0).models.list()
        assert exc.value.status_code == 401
        # a signed image URL opens without a key (an <img> tag sends none); unsigned or altered, it does not
        res = client.images.generate(prompt="a key", size="64x64", response_format="url", extra_body={"steps": 1, "seed": 5})
        signed = res.data[0].url
        assert "signature=" in signed and requests.get(signed, timeout=10).content == direct
        assert requests.get(signed.split("?")[0], timeout=10).status_code == 401
        assert requests.get(signed.replace("expires=", "expires=1"), timeout=10).status_code == 401


    def test_playground_asks_for_the_api_key_when_keys_are_on(self, browser: Any, auth_app: dict) -> None:
        """With keys on, the page itself opens without one (under the app's route prefix), shows its key field, gets the
        401's reason without a key and the image with one."""
        pg = browser.new_page()
        try:
            pg.goto(auth_app["url"] + "/")
            assert pg.is_visible("#key")
            _fill(pg, "a keyed playground test", seed=9)
            pg.click("#run")
            pg.wait_for_selector("#error", state="visible", timeout=30_000)
            assert pg.inner_text("#error").startswith("401: missing or invalid API key")
            pg.fill("#key", "sk-test-two")
            pg.click("#run")
            _wait_done(pg, "lossless")
            assert _shown_png(pg, "lossless") == _direct_png(auth_app["pipe"], prompt="a keyed playground test", height=64,
                                                             width=64, steps=2, guidance=3.5, seed=9, quality="lossless")
        finally:
            pg.close()


def test_unreadable_api_keys_file_fails_the_build(tmp_path: Path) -> None:
    from deployments.app import build_app_with_options

    with pytest.raises(ValueError, match="API keys file .*missing.txt"):
        build_app_with_options({"api_keys_file": str(tmp_path / "missing.txt")})
    empty = tmp_path / "empty.txt"
    empty.write_text("# no keys\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        build_app_with_options({"api_keys_file": str(empty)})


@pytest.mark.parametrize("pool", ["lossless", "high"])
def test_out_of_memory_fails_alone_and_the_replica_serves_on(serve_app: dict, pool: str) -> None:
    """A batch that runs out of device memory (injected: model.faults raises torch.OutOfMemoryError) is a 503 with
    the reason and Retry-After; on a TP pool the ranks' group is retired and the replica replaced; either way the
    next request is answered."""
    r = _post(serve_app, {"prompt": OOM, "size": "64x64", "steps": 2, "quality": pool})
    assert r.status_code == 503, r.text
    if pool == "lossless":  # tp 1: the replica itself caught it, freed memory and counted it
        assert "out of memory generating 1 image(s) at 64x64" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "out_of_memory" and r.headers["Retry-After"] == "1"
        assert _pool_stats(pool)["out_of_memory"] >= 1
    deadline, ok = time.time() + 60, None
    while time.time() < deadline:
        ok = _post(serve_app, {"prompt": "after the oom", "size": "64x64", "steps": 1, "seed": 1, "quality": pool})
        if ok.status_code == 200:
            break
        assert ok.status_code == 503, ok.text
        time.sleep(1)
    assert ok is not None and ok.status_code == 200, ok.text


@pytest.fixture
def burst_app(serve_app: dict):
    """One lossless replica that holds 4 requests and queues 2 more."""
    with _side_app(serve_app, "burst", max_batch_size=1, max_queued_requests=2) as app:
        yield app


def test_a_burst_beyond_capacity_is_shed_and_nothing_is_lost(burst_app: dict) -> None:
    """12 slow requests at once against a queue of 2: every request gets exactly one answer, either its own image
    (by its seed) or a 503 with Retry-After; none hangs, none is answered twice or with another's image.

    How many are served depends on how fast the router hands queued requests to the replica (its 4 slots) while the
    burst arrives, so only what the bound guarantees is asserted: the first max_queued_requests are admitted and
    served, and the burst is too large for all of them to be."""
    n = 12

    async def burst() -> list:
        async with httpx.AsyncClient(timeout=120) as c:
            url = burst_app["url"] + "/v1/images/generations"
            return await asyncio.gather(*[c.post(url, json={"prompt": SLOW, "size": "64x64", "steps": 2, "seed": i})
                                          for i in range(n)])

    answers = asyncio.run(burst())
    seen = [(r.status_code, r.text[:200] if r.status_code != 200 else "") for r in answers]
    ok = [i for i, r in enumerate(answers) if r.status_code == 200]
    shed = [i for i, r in enumerate(answers) if r.status_code == 503]
    assert len(ok) + len(shed) == n, seen
    assert len(ok) >= 2 and len(shed) >= 1, seen
    for i in ok:
        assert answers[i].json()["seeds"] == [i]
    pngs = {base64.b64decode(answers[i].json()["data"][0]["b64_json"]) for i in ok}
    assert len(pngs) == len(ok)  # distinct seeds, distinct images: nothing duplicated
    for i in shed:
        err = answers[i].json()["error"]
        assert err["type"] == "overloaded" and "at capacity" in err["message"], seen
        assert answers[i].headers["Retry-After"] == "1"
    later = _post(burst_app, {"prompt": "after the burst", "size": "64x64", "steps": 1})
    assert later.status_code == 200, (later.text, seen)


# --------------------------------------------------------------------------------------------------
# Failure: a dead pool actor gives a 5xx JSON, then Serve replaces it
# --------------------------------------------------------------------------------------------------


def test_retry_a_replica_killed_during_a_burst_loses_no_request(serve_app: dict) -> None:
    """A lossless replica killed while a burst of 60 seeded requests is in flight on both: every request answers 200
    with its seed's bytes (the ingress re-runs each one whose replica died, once, and counts it). Bug caught: no
    re-run (the requests on the dead replica answer 503)."""
    import ray
    from ray import serve

    n = 60
    lossless = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}}
    with _side_app(serve_app, "retry", lossless_options=lossless) as app:
        handle = serve.get_deployment_handle("lossless", app_name="retry")
        seen: dict[str, str] = {}
        deadline = time.time() + 60
        while len(seen) < 2 and time.time() < deadline:  # the router spreads calls: both replicas answer soon
            names = handle.actor_names.remote().result(timeout_s=30)
            seen[names["replica"]] = names["namespace"]
        assert len(seen) == 2, seen
        victim = sorted(seen)[0]
        # (a replica's runtime context reports the job's namespace; Serve registers its actors in its own)
        namespace = next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == victim)

        async def burst() -> list:
            async with httpx.AsyncClient(timeout=120) as c:
                url = app["url"] + "/v1/images/generations"
                tasks = [asyncio.create_task(c.post(url, json={"prompt": BURST, "size": "64x64", "steps": 1,
                                                                "seed": 100 + i})) for i in range(n)]
                await asyncio.sleep(1.5)  # every replica holds a batch by now; most of the 60 still queue
                ray.kill(ray.get_actor(victim, namespace=namespace), no_restart=True)
                return await asyncio.gather(*tasks)

        responses = asyncio.run(burst())
        retried = serve.get_deployment_handle("Ingress", app_name="retry").retried.remote().result(timeout_s=30)
    assert [r.status_code for r in responses] == [200] * n, [r.text for r in responses if r.status_code != 200]
    assert retried["lossless"] >= 1 and retried["high"] == 0
    for i, r in enumerate(responses):
        assert base64.b64decode(r.json()["data"][0]["b64_json"]) == _direct_png(
            serve_app["pipe"], prompt=BURST, height=64, width=64, steps=1, guidance=3.5, seed=100 + i,
            quality="lossless"), i


def test_shutdown_an_in_flight_request_finishes_when_its_app_is_deleted(serve_app: dict) -> None:
    """An app deleted (as on `serve run`'s Ctrl-C, a redeploy or a scale-down) while a request is in flight: the
    request still answers 200 with its seed's bytes, the replicas stopping only once it is done. Bug caught: a
    stopped replica dropping what it holds (the request would see a 5xx or a dropped connection)."""
    from ray import serve

    body = {"prompt": BLOCKER, "size": "64x64", "steps": 4, "seed": 5}  # ~2 s in the pool
    with _side_app(serve_app, "drain") as app:
        assert _post(app, {**body, "steps": 1}).status_code == 200  # up and warm
        result: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: result.update(r=_post(app, body, timeout=120)))
        worker.start()
        time.sleep(1.0)  # the request is denoising in the lossless replica
        t0 = time.monotonic()
        serve.delete("drain")  # (the fixture's own delete then finds nothing)
        deleted_after = time.monotonic() - t0
        worker.join(timeout=120)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert base64.b64decode(r.json()["data"][0]["b64_json"]) == _direct_png(
        serve_app["pipe"], prompt=BLOCKER, height=64, width=64, steps=4, guidance=3.5, seed=5, quality="lossless")
    assert deleted_after >= 0.5  # the deletion waited for the request


def test_dead_high_pool_gives_5xx_json_then_recovers(serve_app: dict) -> None:
    import ray

    names = _actor_names("high")
    # TP: kill rank 1 (the replica must notice through check_health); TP=1: kill the replica itself.
    name = names["ranks"][1] if TP_HIGH > 1 else names["replica"]
    victim = ray.get_actor(name, namespace=names["namespace"])

    async def scenario() -> tuple:
        async with httpx.AsyncClient(timeout=90) as c:
            url = serve_app["url"] + "/v1/images/generations"
            slow = asyncio.create_task(c.post(url, json={"prompt": SLOW, "quality": "high", "size": "64x64",
                                                         "steps": 30}))
            await asyncio.sleep(1.0)
            ray.kill(victim, no_restart=True)
            return await slow

    r = asyncio.run(scenario())
    assert r.status_code in (500, 503), r.text
    err = r.json()["error"]
    assert "pool 'high'" in err["message"]
    # Recovery means a new replica (and its TP ranks) loading the model: its time depends on the machine's load,
    # so a request that times out while it starts is "not yet", not a failure.
    deadline = time.time() + 120
    ok = None
    while time.time() < deadline:
        try:
            ok = _post(serve_app, {"prompt": "x", "quality": "high", "size": "128x128", "steps": 2}, timeout=30)
        except requests.exceptions.Timeout:
            continue
        if ok.status_code == 200:
            break
        assert ok.status_code in (500, 503), ok.text
        time.sleep(1)
    assert ok is not None and ok.status_code == 200, "high pool did not recover"


def _actor_names(pool: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(pool, app_name=APP).actor_names.remote().result(timeout_s=10)


@pytest.fixture
def lora_app(serve_app: dict, tiny_path: Path, tmp_path: Path):
    """An app serving one LoRA adapter (a random one, in diffusers/PEFT keys)."""
    pytest.importorskip("peft")
    from tests._inputs import write_random_lora

    path = write_random_lora(serve_app["pipe"].transformer, tmp_path / "ink.safetensors", seed=7,
                             targets=("attn.to_q", "attn.to_v", "ff.net.2"))
    with _side_app(serve_app, "lora", loras={"ink": str(path)}) as app:
        yield {**app, "lora_path": str(path)}


def test_a_request_picks_a_lora_by_name_byte_identical_to_stock_diffusers(lora_app: dict, tiny_path: Path) -> None:
    openai = pytest.importorskip("openai")
    import torch
    from diffusers import FluxPipeline

    from model.pipeline import GenerationRequest, max_sequence_length, request_generators
    from model.png import png_bytes

    client = openai.OpenAI(base_url=lora_app["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    body = {"seed": 3, "steps": 2, "quality": "lossless"}
    with_ink = client.images.generate(prompt="a red fox", size="64x64",
                                      extra_body={**body, "lora": [{"name": "ink", "scale": 0.7}]})
    plain = client.images.generate(prompt="a red fox", size="64x64", extra_body=body)
    stock = FluxPipeline.from_pretrained(str(tiny_path), torch_dtype=torch.float32, local_files_only=True)
    stock.load_lora_weights(lora_app["lora_path"], adapter_name="ink")
    stock.set_adapters(["ink"], [0.7])
    req = GenerationRequest("a red fox", height=64, width=64, steps=2, seed=3)
    image = stock(prompt=["a red fox"], height=64, width=64, num_inference_steps=2, guidance_scale=3.5,
                  generator=request_generators([req]), max_sequence_length=max_sequence_length(stock)).images[0]
    assert base64.b64decode(with_ink.data[0].b64_json) == png_bytes(image)
    assert with_ink.data[0].b64_json != plain.data[0].b64_json
    assert with_ink.model_extra["ran"]["adapters"] == [{"name": "ink", "scale": 0.7}]
    assert plain.model_extra["ran"]["adapters"] == []
    high = client.images.generate(prompt="a red fox", size="64x64",
                                  extra_body={**body, "quality": "high", "lora": [{"name": "ink"}]})
    assert high.data[0].b64_json
    with pytest.raises(openai.BadRequestError) as exc:
        client.images.generate(prompt="a red fox", size="64x64", extra_body={"lora": [{"name": "oil"}]})
    assert exc.value.status_code == 400 and "unknown LoRA adapter 'oil'; this server serves ['ink']" in str(exc.value)


def test_a_request_sets_its_own_step_cache_on_a_tp1_high_pool(serve_app: dict, tiny_path: Path) -> None:
    """The `step_cache` extension field through the openai client: the high pool (tp 1, no cache of its own) skips
    steps for that request only, with the bytes of the pipeline converted as the pool converts it; 0 computes
    every step."""
    openai = pytest.importorskip("openai")
    import torch

    from model.loading import load_pipeline
    from model.pipeline import GenerationRequest

    body = {"seed": 4, "steps": 6, "quality": "high"}
    with _side_app(serve_app, "cache") as app:
        client = openai.OpenAI(base_url=app["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
        cached = client.images.generate(prompt="a red fox", size="64x64", extra_body={**body, "step_cache": 0.9})
        zero = client.images.generate(prompt="a red fox", size="64x64", extra_body={**body, "step_cache": 0})
        plain = client.images.generate(prompt="a red fox", size="64x64", extra_body=body)
    assert 1 <= cached.model_extra["timings"]["cached_steps"] <= 5
    assert cached.model_extra["ran"] == {**NOTHING_RAN, "fused_projections": True, "step_cache": 0.9}
    assert plain.model_extra["ran"] == {**NOTHING_RAN, "fused_projections": True}  # the pool has no cache
    assert "cached_steps" not in zero.model_extra["timings"] and "cached_steps" not in plain.model_extra["timings"]
    assert zero.data[0].b64_json == plain.data[0].b64_json != cached.data[0].b64_json
    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    pipe.convert_for_high(fused_projections=True)  # the high pool's form (fp8 is refused on the CPU)
    direct = _direct(pipe, GenerationRequest("a red fox", height=64, width=64, steps=6, seed=4, quality="high",
                                             step_cache=0.9))
    assert base64.b64decode(cached.data[0].b64_json) == direct


def test_the_tp2_high_pool_takes_step_cache_and_per_request_lora(serve_app: dict, tiny_path: Path,
                                                                 tmp_path: Path) -> None:
    """At tp 2 (two gloo ranks) the high pool answers a step-cache request (one skip decision for both ranks: as
    many skipped steps as a tp 1 pipeline, the image within reduction-order noise of it) and, in an app serving an
    adapter, requests that name it or not (each adapter sharded with its layer)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("peft")
    import torch

    from model.loading import load_pipeline
    from model.pipeline import GenerationRequest
    from tests._inputs import png_psnr, write_random_lora

    client = openai.OpenAI(base_url=serve_app["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    body = {"seed": 4, "steps": 6, "quality": "high"}
    cached = client.images.generate(prompt="a red fox", size="64x64", extra_body={**body, "step_cache": 0.9})
    assert cached.model_extra["pool"] == "high" and _pool_stats("high")["tp"] == TP_HIGH
    assert cached.model_extra["ran"] == {**NOTHING_RAN, "fused_projections": True, "step_cache": 0.9}
    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    pipe.convert_for_high(fused_projections=True)
    (tp1,) = pipe.generate([GenerationRequest("a red fox", height=64, width=64, steps=6, seed=4, quality="high",
                                              step_cache=0.9)])
    assert cached.model_extra["timings"]["cached_steps"] == tp1.timings["cached_steps"] >= 1
    assert png_psnr(base64.b64decode(cached.data[0].b64_json), tp1.png) >= 40.0

    path = write_random_lora(serve_app["pipe"].transformer, tmp_path / "ink.safetensors", seed=7)
    # (half a logical CPU per rank: the session app's pools hold most of the 8)
    high = {"tp": 2, "cpu_threads": 1, "backend": "gloo", "rank_resources": {"CPU": 0.5}}
    with _side_app(serve_app, "tplora", high=high, loras={"ink": str(path)}) as app:
        client = openai.OpenAI(base_url=app["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
        inked = client.images.generate(prompt="a red fox", size="64x64",
                                       extra_body={**body, "lora": [{"name": "ink", "scale": 0.8}]})
        plain = client.images.generate(prompt="a red fox", size="64x64", extra_body=body)
    assert inked.model_extra["ran"] == {**NOTHING_RAN, "adapters": [{"name": "ink", "scale": 0.8}]}
    assert plain.model_extra["ran"] == NOTHING_RAN
    adapted = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    adapted.load_loras({"ink": str(path)})
    psnr = {}
    for res, loras in ((inked, (("ink", 0.8),)), (plain, ())):
        (ref,) = adapted.generate([GenerationRequest("a red fox", height=64, width=64, steps=6, seed=4,
                                                     quality="high", loras=loras)])
        psnr[loras] = png_psnr(base64.b64decode(res.data[0].b64_json), ref.png)
        assert psnr[loras] >= 40.0, loras
    # the adapter's effect is far above the tp 2 / tp 1 difference (else the comparison could not see a lost one)
    assert png_psnr(base64.b64decode(inked.data[0].b64_json), base64.b64decode(plain.data[0].b64_json)) < 35.0


def test_hostile_bodies_get_4xx_and_the_app_keeps_serving(serve_app: dict) -> None:
    """Through the served app (a side app with a small body bound): a decompression-bomb edit image and mask are
    400s naming the pixel bound, answered quickly; a body over the bound is a 413 whether its length is declared
    or it is sent chunked; too many multipart files is a 400; then a good edit still answers 200."""
    import requests

    from tests._inputs import png_bomb, random_png

    limits = {"max_body_bytes": 600_000, "max_form_files": 2}
    with _side_app(serve_app, "hostile", limits=limits) as app:
        url = app["url"] + "/v1/images/edits"
        bomb, good = png_bomb(12000, 12000), random_png(1)
        assert len(bomb) < limits["max_body_bytes"]
        for files in ({"image": bomb}, {"image": good, "mask": bomb}):
            t = time.perf_counter()
            r = requests.post(url, data={"prompt": "x", "steps": "2"}, files=files, timeout=60)
            took = time.perf_counter() - t
            name = "mask" if "mask" in files else "image"
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {"message": f"{name} is 12000x12000 (144000000 pixels); at most 16777216 "
                                                    "pixels are accepted", "type": "invalid_request_error",
                                         "param": name}
            assert took < 2.0, took  # (HTTP and Serve included; the check itself is ~20 ms)
        big = b"\0" * 700_000
        r = requests.post(url, data={"prompt": "x"}, files={"image": big}, timeout=60)
        assert r.status_code == 413 and "at most 600000" in r.json()["error"]["message"], r.text
        chunks = (big[i:i + 65536] for i in range(0, len(big), 65536))  # a generator: sent chunked, no length
        r = requests.post(app["url"] + "/v1/images/generations", data=chunks,
                          headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 413 and "more than 600000" in r.json()["error"]["message"], r.text
        r = requests.post(url, data={"prompt": "x"}, files=[("image", good), ("mask", good), ("extra", good)],
                          timeout=60)
        assert r.status_code == 400 and "Too many files" in r.json()["error"]["message"], r.text
        r = requests.post(url, data={"prompt": "x", "steps": "2"}, files={"image": good}, timeout=60)
        assert r.status_code == 200, r.text


def test_fuzz_the_api_from_its_own_openapi_schema(serve_app: dict, tmp_path: Path) -> None:
    """Schemathesis drives the served app from its own OpenAPI document (positive and negative cases, then stateful
    sequences; bounded limits so a valid request is cheap on the CPU), with API keys off and on (the second app with
    the adapter API on too): >= 500 generated requests each time, every response a documented status with a
    conforming body, never a 5xx; then the app still serves a good request."""
    import shutil

    import requests

    st = shutil.which("schemathesis", path=os.path.dirname(sys.executable))
    if st is None:
        pytest.skip("schemathesis is not installed")
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-fuzz-key\n")
    (tmp_path / "loras").mkdir()  # the adapter API on (an empty folder: every load is refused with a reason)
    limits = {"max_side": 128, "max_pixels": 128 * 128, "max_steps": 3, "max_n": 2, "max_prompt_chars": 200}
    for name, extra, headers in (("fuzz", {}, []),
                                 ("fuzzkeys", {"api_keys_file": str(keys), "lora_dir": str(tmp_path / "loras")},
                                  ["-H", "Authorization: Bearer sk-fuzz-key"])):
        with _side_app(serve_app, name, limits=limits, default_steps=2, default_size="64x64", **extra) as app:
            report = tmp_path / f"{name}.json"
            run = subprocess.run(
                [st, "run", app["url"] + "/openapi.json", "--url", app["url"], *headers, "--checks",
                 "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
                 "--max-examples", "120", "--seed", "7", "--workers", "2", "--request-timeout", "60", "--no-shrink",
                 "--report", "json", "--report-json-path", str(report)],
                capture_output=True, text=True, timeout=900, cwd=tmp_path)  # (its cache folder goes there)
            assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
            r = requests.post(app["url"] + "/v1/images/generations", json={"prompt": "x", "size": "64x64"},
                              headers=dict([headers[1].split(": ")]) if headers else {}, timeout=60)
            assert r.status_code == 200, r.text
        cases = json.loads(report.read_text())["test_cases"]
        assert cases["generated"] >= 500 and cases["with_failures"] == 0 and cases["errored"] == 0, (name, cases)


def test_unknown_routes_and_methods_answer_in_openais_error_shape(serve_app: dict) -> None:
    """FastAPI's own 404 and 405 come as {"error": {...}} like every other error, not {"detail": ...}; the 405
    keeps its Allow header."""
    import requests

    r = requests.get(serve_app["url"] + "/v1/images/generations", timeout=30)
    assert r.status_code == 405 and r.headers.get("allow") == "POST", (r.status_code, r.headers)
    assert r.json() == {"error": {"message": "GET /v1/images/generations: Method Not Allowed",
                                  "type": "invalid_request_error", "param": None}}
    r = requests.post(serve_app["url"] + "/v1/images/variations", json={}, timeout=30)
    assert r.status_code == 404 and r.json() == {"error": {"message": "POST /v1/images/variations: Not Found",
                                                           "type": "not_found", "param": None}}


def test_a_json_edit_answers_the_bytes_of_the_same_multipart_edit(serve_app: dict) -> None:
    """OpenAI's JSON edit (`images` and `mask` as base64 data: URLs) through the served app: the same PNG bytes as
    the multipart form with the same values; an http URL is a 400 naming the field (nothing is downloaded)."""
    import requests

    from tests._inputs import random_png

    image, mask = random_png(3), random_png(4, mask=True)
    url = serve_app["url"] + "/v1/images/edits"
    body = {"prompt": "a red fox", "seed": 5, "steps": 2, "strength": 0.7}
    as_json = requests.post(url, json={**body, "images": [{"image_url": data_url(image)}],
                                       "mask": {"image_url": data_url(mask)}}, timeout=120)
    as_form = requests.post(url, data={k: str(v) for k, v in body.items()},
                            files={"image": image, "mask": mask}, timeout=120)
    assert as_json.status_code == 200 and as_form.status_code == 200, (as_json.text, as_form.text)
    assert as_json.json()["data"][0]["b64_json"] == as_form.json()["data"][0]["b64_json"]
    r = requests.post(url, json={**body, "images": [{"image_url": "https://example.com/a.png"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "images[0]", r.text


def test_edits_through_the_openai_client_equal_the_pipeline(serve_app: dict) -> None:
    """`client.images.edit`: image-to-image and inpainting, byte-identical (lossless) to the pipeline called
    directly; the size defaults to the image's; bad images and masks are 400s with reasons."""
    openai = pytest.importorskip("openai")
    from model.pipeline import GenerationRequest
    from tests._inputs import random_png

    client = openai.OpenAI(base_url=serve_app["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    image, mask = random_png(1), random_png(2, mask=True)
    for m in (None, mask):
        kwargs = {"mask": ("mask.png", m, "image/png")} if m is not None else {}
        res = client.images.edit(image=("in.png", image, "image/png"), prompt="a red fox", **kwargs,
                                 extra_body={"seed": 3, "steps": 2, "strength": 0.7, "quality": "lossless"})
        direct = _direct(serve_app["pipe"], GenerationRequest("a red fox", height=64, width=64, steps=2, seed=3,
                                                              image=image, mask=m, strength=0.7))
        assert base64.b64decode(res.data[0].b64_json) == direct, m is not None
    url = serve_app["url"] + "/v1/images/edits"
    bad = [
        ({"image": ("x.png", b"not an image", "image/png")}, {"prompt": "a"}, "image is not a readable image"),
        ({"image": ("x.png", image, "image/png"),
          "mask": ("m.png", random_png(2, (32, 32), mask=True), "image/png")},
         {"prompt": "a"}, "mask must be the size of the image (64x64), got 32x32"),
        ({}, {"prompt": "a"}, "an edit needs an image"),
        ({"image": ("x.png", image, "image/png")}, {"prompt": "a", "strength": "2"}, "strength must be in (0, 1]"),
        ({"image": ("x.png", image, "image/png")}, {"prompt": "a", "steps": "two"}, "steps must be a number"),
        ({"image": ("x.png", image, "image/png")}, {"prompt": "a", "colour": "red"}, "unknown field(s) ['colour']"),
    ]
    for files, data, message in bad:
        # (no image: one unrelated part keeps the body multipart)
        r = requests.post(url, files=files or {"note": ("note.txt", b"", "text/plain")}, data=data, timeout=30)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (message, r.text)
    r = requests.post(url, json={"prompt": "a"}, timeout=30)  # JSON is OpenAI's other form of an edit
    assert r.status_code == 400 and r.json()["error"]["param"] == "images", r.text
    r = requests.post(url, data=b"prompt=a", headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 400 and "multipart/form-data or JSON" in r.json()["error"]["message"], r.text


# --------------------------------------------------------------------------------------------------
# Streaming (server-sent events) and response_format url
# --------------------------------------------------------------------------------------------------


def _sse_events(response: Any) -> list[tuple[str, dict]]:
    """(event, data) pairs of a text/event-stream body."""
    out, event = [], None
    for line in response.iter_lines():
        line = line.decode() if isinstance(line, bytes) else line
        if line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            out.append((event, json.loads(line[len("data: "):])))
    return out


@pytest.mark.parametrize("spec", ["2.0", "2.4"])
@pytest.mark.parametrize("leaves", [True, False])
def test_a_stream_closes_once_also_when_its_client_leaves_before_the_body_starts(spec: str, leaves: bool) -> None:
    """The ingress's stream cleanup (leave the in-flight gauge, count the request, cancel the work) runs exactly once
    however the response ends: here a client that is gone while the headers are sent, under both of Starlette's
    ASGI paths (2.4: the send fails; 2.0: a disconnect message wins the race). The body generator never starts then,
    so its own `finally` could not have done it."""
    from deployments.ingress import ClosingStream

    started, closed = [], []

    async def body() -> Any:
        started.append(True)
        yield b"event: x\ndata: {}\n\n"

    async def receive() -> dict:
        if leaves:
            return {"type": "http.disconnect"}
        await asyncio.sleep(30)
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        if leaves:
            if spec == "2.4":
                raise OSError("client gone")
            await asyncio.sleep(30)  # the disconnect wins
        sent.append(message)

    async def call() -> None:
        response = ClosingStream(body(), on_close=lambda: closed.append(True), media_type="text/event-stream")
        scope = {"type": "http", "asgi": {"spec_version": spec}}
        with contextlib.suppress(Exception):
            await asyncio.wait_for(response(scope, receive, send), timeout=10)

    asyncio.run(call())
    assert closed == [True]
    assert started == ([] if leaves else [True])
    if not leaves:
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


@pytest.mark.parametrize("pool", ["lossless", "high"])
def test_stream_sends_partial_images_then_the_unstreamed_bytes(serve_app: dict, pool: str) -> None:
    """`stream: true` through the official client: `partial_images` previews (PNG, the image's size) in order, then
    the completed image, byte-identical to the same request not streamed (the high pool runs at TP=2: its previews
    come from rank 0)."""
    openai = pytest.importorskip("openai")
    from PIL import Image

    client = openai.OpenAI(base_url=serve_app["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)
    job = {"seed": 5, "steps": 6, "quality": pool}
    events = list(client.images.generate(prompt="a blue kite", size="128x64", stream=True, partial_images=2,
                                         extra_body=job))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    for e in events:
        im = Image.open(io.BytesIO(base64.b64decode(e.b64_json)))
        assert im.format == "PNG" and im.size == (128, 64) and e.size == "128x64" and e.quality == pool
    plain = _post(serve_app, {"prompt": "a blue kite", "size": "128x64", **job})
    assert plain.status_code == 200, plain.text
    assert base64.b64decode(events[-1].b64_json) == _png_of(plain.json())
    assert events[-1].model_extra["seed"] == 5
    if pool == "lossless":
        direct = _direct_png(serve_app["pipe"], prompt="a blue kite", height=64, width=128, steps=6, guidance=3.5,
                             seed=5, quality="lossless")
        assert base64.b64decode(events[-1].b64_json) == direct


def test_stream_of_an_edit_and_without_previews(serve_app: dict) -> None:
    """Edits stream `image_edit.*` events (previews counted over the steps an edit runs); partial_images 0 sends the
    completed event alone."""
    openai = pytest.importorskip("openai")
    from model.pipeline import GenerationRequest
    from tests._inputs import random_png

    client = openai.OpenAI(base_url=serve_app["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)
    image = random_png(1)
    events = list(client.images.edit(image=("in.png", image, "image/png"), prompt="a red fox", stream=True,
                                     partial_images=1, extra_body={"seed": 3, "steps": 8, "strength": 0.5}))
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    direct = _direct(serve_app["pipe"], GenerationRequest("a red fox", height=64, width=64, steps=8, seed=3,
                                                          image=image, strength=0.5))
    assert base64.b64decode(events[-1].b64_json) == direct
    with httpx.stream("POST", serve_app["url"] + "/v1/images/generations", timeout=60,
                      json={"prompt": "a cat", "size": "64x64", "steps": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = _sse_events(r)
    assert [e for e, _ in got] == ["image_generation.completed"]
    assert got[0][1]["type"] == "image_generation.completed" and got[0][1]["output_format"] == "png"


def test_stream_refusals_and_an_early_failure_keep_their_status(serve_app: dict) -> None:
    """Streaming rules are 400s with reasons; a stream that fails before its first event is answered with the
    failure's own status (here an out-of-memory batch: 503 + Retry-After), not a 200 stream."""
    cases = [({"stream": True, "n": 2}, "stream: true needs n == 1"),
             ({"partial_images": 2}, "partial_images needs stream: true"),
             ({"stream": True, "partial_images": 4}, "partial_images must be between 0 and 3"),
             ({"stream": True, "response_format": "url"}, "streamed images are sent as b64_json")]
    for extra, message in cases:
        r = _post(serve_app, {"prompt": "x", "size": "64x64", **extra})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (extra, r.text)
    r = _post(serve_app, {"prompt": OOM, "size": "64x64", "steps": 2, "stream": True, "partial_images": 1})
    assert r.status_code == 503 and r.json()["error"]["type"] == "out_of_memory", r.text
    assert r.headers["Retry-After"] == "1"


def test_a_closed_stream_cancels_its_work(serve_app: dict) -> None:
    """The client reads the first preview of a slow 10-step image and hangs up: the replica stops the batch
    (counted as cancelled) and serves the next request."""
    before = _pool_stats("lossless")["cancelled_batches"]
    body = {"prompt": SLOW, "size": "64x64", "steps": 10, "stream": True, "partial_images": 3, "seed": 1}
    t0 = time.time()
    with httpx.stream("POST", serve_app["url"] + "/v1/images/generations", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                assert line == "event: image_generation.partial_image"
                break
    assert time.time() - t0 < 10 * STEP_DELAY_S[SLOW]  # left before the image could be done
    deadline = time.time() + 20
    while time.time() < deadline and _pool_stats("lossless")["cancelled_batches"] == before:
        time.sleep(0.5)
    assert _pool_stats("lossless")["cancelled_batches"] == before + 1
    assert _post(serve_app, {"prompt": "next", "size": "64x64", "steps": 1}).status_code == 200


def test_a_stream_counts_as_in_flight_until_its_last_event_or_its_client_leaving(serve_app: dict) -> None:
    """The ingress's in-flight count (the `fluxserve_in_flight` gauge) holds a stream from its request to its
    completed event, and to the moment a client that hangs up early is gone."""
    from ray import serve

    ingress = serve.get_deployment_handle("Ingress", app_name=APP)

    def in_flight() -> int:
        return ingress.in_flight.remote().result(timeout_s=30)["lossless"]

    def settles_at(value: int) -> bool:
        deadline = time.time() + 20
        while time.time() < deadline and in_flight() != value:
            time.sleep(0.2)
        return in_flight() == value

    before = in_flight()
    body = {"prompt": SLOW, "size": "64x64", "steps": 6, "stream": True, "partial_images": 2, "seed": 2}
    for read_to_the_end in (True, False):
        with httpx.stream("POST", serve_app["url"] + "/v1/images/generations", json=body, timeout=60) as r:
            assert r.status_code == 200
            kinds = []
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kinds.append(line[len("event: "):])
                    if len(kinds) == 1:
                        assert in_flight() == before + 1
                        if not read_to_the_end:
                            break
        if read_to_the_end:
            assert kinds[-1] == "image_generation.completed", kinds
        assert settles_at(before), (read_to_the_end, in_flight(), before)


def test_response_format_url_serves_the_image_from_the_app(serve_app: dict) -> None:
    """`response_format: "url"` through the official client: the URL serves the same bytes the b64 answer carries
    (the lossless pipeline's PNG); an unknown file id is a 404 JSON error."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=serve_app["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)
    res = client.images.generate(prompt="a boat", size="64x64", n=2, response_format="url",
                                 extra_body={"seed": 7, "steps": 2})
    assert [d.b64_json for d in res.data] == [None, None]
    for i, d in enumerate(res.data):
        assert d.url.startswith(serve_app["url"] + "/v1/images/files/")
        got = requests.get(d.url, timeout=30)
        assert got.status_code == 200 and got.headers["content-type"] == "image/png"
        assert got.content == _direct_png(serve_app["pipe"], prompt="a boat", height=64, width=64, steps=2,
                                          guidance=3.5, seed=7 + i, quality="lossless")
    missing = requests.get(serve_app["url"] + "/v1/images/files/nope", timeout=30)
    assert missing.status_code == 404 and "no image 'nope'" in missing.json()["error"]["message"]


def test_a_tp_pool_sharing_a_gpu_without_gloo_fails_the_build() -> None:
    """Fractional GPUs per rank (ranks on one device) with NCCL cannot run: the builder says why, before deploying."""
    from deployments.app import build_app_with_options

    shared = {"tp": 2, "rank_resources": {"CPU": 1, "GPU": 0.5}}
    with pytest.raises(ValueError, match="ranks that share a GPU need backend: gloo"):
        build_app_with_options({"device": "cuda", "pools": {"high": shared}})
    build_app_with_options({"device": "cuda", "pools": {"high": {**shared, "backend": "gloo"}}})  # testing mode


def test_openai_client_json_edit_alpha_mask_style_and_safety_identifier(serve_app: dict) -> None:
    """What a client written for OpenAI sends, through the official client: a JSON edit with data: URLs (its own
    request path), an OpenAI mask (opaque, transparent where to edit) in the multipart edit, and `style`,
    `safety_identifier`, `user`, `input_fidelity`, which change nothing. Each answer is byte-identical to the pipeline
    called directly with the white-where-repainted mask the alpha means."""
    openai = pytest.importorskip("openai")
    import numpy as np
    from PIL import Image

    from model.pipeline import GenerationRequest
    from model.png import png_bytes
    from tests._inputs import random_png

    image = random_png(5)
    hole = np.zeros((64, 64), dtype=bool)
    hole[8:40, 16:56] = True
    rgba = np.full((64, 64, 4), 255, dtype=np.uint8)
    rgba[..., :3] = np.asarray(Image.open(io.BytesIO(image)))  # OpenAI's masks are often the photo itself ...
    rgba[hole, 3] = 0  # ... made transparent where to edit
    alpha_mask = png_bytes(Image.fromarray(rgba, "RGBA"))
    white_mask = png_bytes(Image.fromarray(np.stack([np.where(hole, 255, 0).astype(np.uint8)] * 3, -1)))
    direct = _direct(serve_app["pipe"], GenerationRequest("a red fox", height=64, width=64, steps=2, seed=6,
                                                          image=image, mask=white_mask, strength=0.7))
    client = openai.OpenAI(base_url=serve_app["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    res = client.post("/images/edits", cast_to=openai.types.ImagesResponse, body={
        "prompt": "a red fox", "images": [{"image_url": data_url(image)}], "mask": {"image_url": data_url(alpha_mask)},
        "seed": 6, "steps": 2, "strength": 0.7, "input_fidelity": "high", "safety_identifier": "user-123"})
    assert base64.b64decode(res.data[0].b64_json) == direct
    res = client.images.edit(image=("in.png", image, "image/png"), mask=("mask.png", alpha_mask, "image/png"),
                             prompt="a red fox", user="u-1", extra_body={"seed": 6, "steps": 2, "strength": 0.7})
    assert base64.b64decode(res.data[0].b64_json) == direct
    res = client.images.generate(prompt="a red fox", size="64x64", style="natural", safety_identifier="user-123",
                                 user="u-1", extra_body={"seed": 6, "steps": 2})
    assert base64.b64decode(res.data[0].b64_json) == _direct_png(
        serve_app["pipe"], prompt="a red fox", height=64, width=64, steps=2, guidance=3.5, seed=6, quality="lossless")


# --------------------------------------------------------------------------------------------------
# The playground page in a real browser (Debian's Chromium, driven by Playwright)
# --------------------------------------------------------------------------------------------------

CHROMIUM = os.environ.get("FLUXSERVE_CHROMIUM", "/usr/bin/chromium")
# Flags for a headless Chromium on a machine without a network out (background connections would be refused).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser():
    # Per test: Playwright's sync API holds an event loop on this thread while it runs, and the Serve tests call
    # asyncio.run() and Ray's sync handles, which refuse to run inside one.
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; .ci/setup installs it)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, serve_app: dict):
    pg = browser.new_page(viewport={"width": 1280, "height": 860})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(serve_app["url"] + "/")
    yield pg
    pg.close()
    assert not errors, f"the page raised: {errors}"


def _fill(page: Any, prompt: str, size: str | None = "64x64", steps: int = 2, seed: int | None = 7,
          quality: str = "lossless", stream: bool = False) -> None:
    page.fill("#prompt", prompt)
    if size is not None:  # (edit mode hides it: an edit keeps its image's size)
        page.fill("#size", size)
    page.fill("#steps", str(steps))
    page.fill("#seed", "" if seed is None else str(seed))
    page.select_option("#quality", quality)
    page.set_checked("#stream", stream)


def _shown_png(page: Any, quality: str) -> bytes:
    src = page.get_attribute(f"#panel-{quality} img", "src")
    assert src and src.startswith("data:image/png;base64,"), src
    return base64.b64decode(src.split(",", 1)[1])


def _wait_done(page: Any, *qualities: str, timeout_ms: int = 60_000) -> None:
    for q in qualities:
        try:
            page.wait_for_function(f"document.getElementById('panel-{q}').dataset.state !== 'running'",
                                   timeout=timeout_ms)
        finally:
            state = page.get_attribute(f"#panel-{q}", "data-state")
        assert state == "done", (q, state, page.inner_text("#error"))


def test_playground_draws_both_tiers_side_by_side_with_their_difference(page: Any, serve_app: dict) -> None:
    """Generate with quality "both": each side shows its tier's image (the lossless one byte-identical to the
    pipeline called directly, the high one to the high pool's own answer), the difference view and its PSNR
    computed from the two, and both land in the gallery."""
    _fill(page, "a playground test", quality="both")
    page.click("#run")
    _wait_done(page, "lossless", "high")
    page.wait_for_function("document.getElementById('diff').dataset.psnr !== undefined")
    lossless, high = _shown_png(page, "lossless"), _shown_png(page, "high")
    assert lossless == _direct_png(serve_app["pipe"], prompt="a playground test", height=64, width=64, steps=2,
                                   guidance=3.5, seed=7, quality="lossless")
    body = {"prompt": "a playground test", "size": "64x64", "steps": 2, "seed": 7, "quality": "high"}
    assert high == base64.b64decode(_post(serve_app, body).json()["data"][0]["b64_json"])
    from PIL import Image
    import numpy as np

    a, b = (np.asarray(Image.open(io.BytesIO(x)).convert("RGB"), dtype=np.float64) for x in (lossless, high))
    mse = ((a - b) ** 2).mean()
    psnr = float(page.get_attribute("#diff", "data-psnr"))
    assert (mse == 0 and psnr == float("inf")) or abs(psnr - 10 * np.log10(255 ** 2 / mse)) < 1e-6, (psnr, mse)
    assert page.eval_on_selector_all("#gallery figure", "els => els.length") == 2
    assert not page.is_visible("#error")


def test_playground_streams_previews_before_the_final_image(page: Any, serve_app: dict) -> None:
    """With "stream previews" on, the panel shows partial images as they arrive, then the final image: the same
    bytes an unstreamed request gets."""
    _fill(page, "a streamed playground test", steps=4, seed=11, stream=True)
    page.click("#run")
    _wait_done(page, "lossless")
    events = page.evaluate("window.flux.events")
    kinds = [e["event"] for e in events if e["quality"] == "lossless"]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"], kinds
    assert page.get_attribute("#panel-lossless", "data-previews") == "2"
    assert _shown_png(page, "lossless") == _direct_png(serve_app["pipe"], prompt="a streamed playground test",
                                                       height=64, width=64, steps=4, guidance=3.5, seed=11,
                                                       quality="lossless")


def test_playground_edits_an_uploaded_image_with_a_painted_mask(page: Any, serve_app: dict, tmp_path: Path) -> None:
    """Edit mode: upload an image, paint over its top-left part, run. The mask the page sends is white where the
    brush went and black elsewhere, at the image's size; the image shown is what the API answers for that image and
    mask (so the page sends what it shows)."""
    from PIL import Image
    import numpy as np

    src = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(src)
    page.click("#mode-edit")
    page.set_input_files("#edit-image", str(src))
    page.wait_for_function("document.getElementById('mask-canvas').width === 64 && window.flux.editImage")
    box = page.locator("#mask-canvas").bounding_box()
    page.fill("#brush", "64")
    page.mouse.move(box["x"] + box["width"] * 0.1, box["y"] + box["height"] * 0.1)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.4, box["y"] + box["height"] * 0.4, steps=8)
    page.mouse.up()
    _fill(page, "an edited playground test", size=None, seed=3)
    page.click("#run")
    _wait_done(page, "lossless")
    mask_url = page.evaluate("window.flux.lastMask")
    mask = np.asarray(Image.open(io.BytesIO(base64.b64decode(mask_url.split(",", 1)[1]))).convert("L"))
    assert mask.shape == (64, 64) and set(np.unique(mask)) == {0, 255}
    assert mask[12:18, 12:18].min() == 255 and mask[40:, 40:].max() == 0  # painted where the brush went, only there
    image_url = data_url(src.read_bytes())
    body = {"prompt": "an edited playground test", "images": [{"image_url": image_url}], "mask": {"image_url": mask_url},
            "steps": 2, "seed": 3, "quality": "lossless", "strength": 0.6}
    r = requests.post(serve_app["url"] + "/v1/images/edits", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert _shown_png(page, "lossless") == base64.b64decode(r.json()["data"][0]["b64_json"])


def test_playground_shows_the_servers_reason_for_a_bad_size(page: Any, serve_app: dict) -> None:
    """A size the server refuses: the page shows the 400's own message, and the panel is marked failed."""
    _fill(page, "a refused playground test", size="72x64", quality="lossless")
    page.click("#run")
    page.wait_for_selector("#error", state="visible", timeout=30_000)
    expected = _post(serve_app, {"prompt": "x", "size": "72x64"}).json()["error"]["message"]
    assert page.inner_text("#error") == f"400: {expected}"
    assert page.get_attribute("#panel-lossless", "data-state") == "error"

