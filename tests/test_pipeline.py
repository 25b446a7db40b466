"""FluxServePipeline on the tiny preset (CPU): the bit-exact contract against stock diffusers, per-request seeds,
quality tiers, cancellation, loading errors, the CLI."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
from model.loading import ModelLoadError, diffusers_reference, load_pipeline
from model.metrics import to_array
from model.pipeline import (
    FluxServePipeline,
    GenerationCancelled,
    GenerationRequest,
    md5,
    request_generators,
    run_flux_pipeline,
    validate_batch,
)


def _stock_diffusers(path: Path, dtype: torch.dtype = torch.float32):
    """A FluxPipeline built by diffusers alone (its own FluxTransformer2DModel, its own loader): no fluxserve code."""
    from diffusers import FluxPipeline

    from model.loading import _dtype_kwarg

    pipe = FluxPipeline.from_pretrained(path, **_dtype_kwarg(dtype), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# The tiny presets' T5 tokenizer declares 32 tokens (model_max_length); stock diffusers is told so explicitly. The
# stock defaults (512 for dev, 256 for schnell) are pinned on a copy whose T5 allows 512 (test_t5_length_*).
TINY_T5_TOKENS = 32


def _stock_run(pipe, prompts: list[str], seeds: list[int], steps: int, size: int, guidance: float = 3.5,
               max_sequence_length: int | None = TINY_T5_TOKENS):
    """Latents (unpacked) and PNG bytes from stock diffusers, through its own output paths. max_sequence_length None:
    diffusers' own default (the argument is not passed)."""
    common = dict(prompt=prompts, height=size, width=size, num_inference_steps=steps, guidance_scale=guidance)
    if max_sequence_length is not None:
        common["max_sequence_length"] = max_sequence_length
    packed = pipe(**common, generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="latent").images
    latents = pipe._unpack_latents(packed, size, size, pipe.vae_scale_factor)
    images = pipe(**common, generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pil").images
    pngs = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        pngs.append(buf.getvalue())
    return latents, pngs


@pytest.fixture(scope="module")
def stock_tiny(tiny_path):
    return _stock_diffusers(tiny_path)


def test_transformer_is_ours(tiny_pipe: FluxServePipeline) -> None:
    from diffusers import FluxTransformer2DModel

    from model.flux import FluxTransformer

    assert type(tiny_pipe.transformer) is FluxTransformer
    assert not isinstance(tiny_pipe.transformer, FluxTransformer2DModel)
    assert tiny_pipe.guidance_embeds


def test_lossless_bit_exact_vs_stock_diffusers(tiny_pipe: FluxServePipeline, stock_tiny) -> None:
    req = GenerationRequest("a red fox in the snow, watercolor", steps=4, seed=7)
    ours = tiny_pipe.generate([req])[0]
    ref_latents, ref_png = _stock_run(stock_tiny, [req.prompt], [req.seed], req.steps, req.height)
    assert ours.latents.shape == (16, 32, 32)
    assert torch.equal(ours.latents, ref_latents[0])
    assert md5(ours.latents) == md5(ref_latents[0])
    assert hashlib.md5(ours.png).hexdigest() == hashlib.md5(ref_png[0]).hexdigest()
    assert ours.ran.gelu_sites == 0 and ours.quality == "lossless" and ours.seed == 7
    # the images are real images, not a constant
    from PIL import Image

    px = torch.tensor(list(Image.open(io.BytesIO(ours.png)).tobytes()), dtype=torch.float32)
    assert px.std() > 1.0


def test_lossless_bit_exact_batch_of_two_vs_stock_diffusers(tiny_pipe, stock_tiny) -> None:
    reqs = [GenerationRequest("a lighthouse at night", seed=1, steps=3, width=256, height=256),
            GenerationRequest("a bowl of ramen, studio lighting", seed=2, steps=3)]
    ours = tiny_pipe.generate(reqs)
    ref_latents, ref_png = _stock_run(stock_tiny, [r.prompt for r in reqs], [1, 2], 3, 256)
    for i, res in enumerate(ours):
        assert torch.equal(res.latents, ref_latents[i])
        assert res.png == ref_png[i]
    assert not torch.equal(ours[0].latents, ours[1].latents)


def test_lossless_bit_exact_bf16_cpu(tiny_path) -> None:
    ours = load_pipeline(str(tiny_path), dtype=torch.bfloat16)
    assert ours.transformer.dtype == torch.bfloat16
    req = GenerationRequest("a robot, pixel art", steps=2, seed=3, height=128, width=192)
    res = ours.generate([req])[0]
    stock = _stock_diffusers(tiny_path, torch.bfloat16)
    common = dict(height=128, width=192, num_inference_steps=2, guidance_scale=3.5,
                  max_sequence_length=TINY_T5_TOKENS)
    packed = stock(req.prompt, **common, generator=torch.Generator().manual_seed(3), output_type="latent").images
    ref = stock._unpack_latents(packed, 128, 192, stock.vae_scale_factor)[0]
    assert res.latents.dtype == torch.bfloat16 and res.latents.shape == (16, 16, 24)
    assert torch.equal(res.latents, ref)


def test_schnell_variant_has_no_guidance_and_is_bit_exact(fluxserve_cache) -> None:
    from model.presets import ensure_preset

    path = ensure_preset("tiny-schnell", cache_dir=fluxserve_cache)
    ours = load_pipeline(str(path))
    assert not ours.guidance_embeds
    req = GenerationRequest("a sailing ship", steps=2, seed=11)
    res = ours.generate([req])[0]
    ref_latents, ref_png = _stock_run(_stock_diffusers(path), [req.prompt], [11], 2, 256)
    assert torch.equal(res.latents, ref_latents[0]) and res.png == ref_png[0]
    # no guidance embedder: the guidance value cannot change anything
    other = ours.generate([GenerationRequest("a sailing ship", steps=2, seed=11, guidance=9.0)])[0]
    assert torch.equal(other.latents, res.latents)


def _with_t5_max(src: Path, dest: Path, tokens: int) -> Path:
    """A copy of a preset folder whose T5 tokenizer declares `tokens` as its maximum (same vocabulary and weights)."""
    shutil.copytree(src, dest)
    cfg_path = dest / "tokenizer_2" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_max_length"] = tokens
    cfg_path.write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("preset,stock_tokens", [("tiny", None), ("tiny-schnell", 256)], ids=["dev", "schnell"])
def test_t5_length_is_stock_diffusers_default(fluxserve_cache, tmp_path, monkeypatch, preset: str,
                                              stock_tokens: int | None) -> None:
    """With a T5 that takes 512 tokens, lossless equals stock diffusers called as its docs do: FluxPipeline's own
    default for dev (nothing passed: 512 tokens), max_sequence_length=256 for schnell. The encoder must see exactly
    that many tokens (the padding changes T5's output, so a wrong length changes the image)."""
    from diffusers import FluxPipeline

    from model.presets import ensure_preset

    path = _with_t5_max(ensure_preset(preset, cache_dir=fluxserve_cache), tmp_path / preset, 512)
    ours = load_pipeline(str(path))
    seen: list[int] = []
    real_t5 = FluxPipeline._get_t5_prompt_embeds

    def spy(self, *args, **kwargs):
        out = real_t5(self, *args, **kwargs)
        seen.append(out.shape[1])
        return out

    monkeypatch.setattr(FluxPipeline, "_get_t5_prompt_embeds", spy)
    req = GenerationRequest("a tall lighthouse on a cliff", steps=2, seed=4, height=128, width=128)
    res = ours.generate([req])[0]
    ref_latents, ref_png = _stock_run(_stock_diffusers(path), [req.prompt], [4], 2, 128,
                                      max_sequence_length=stock_tokens)
    assert seen == [stock_tokens or 512] * 3  # ours, then the stock latent and PIL runs
    assert torch.equal(res.latents, ref_latents[0]) and res.png == ref_png[0]


def test_diffusers_reference_matches_lossless(tiny_pipe) -> None:
    from diffusers import FluxTransformer2DModel

    ref = diffusers_reference(tiny_pipe)
    assert type(ref.transformer) is FluxTransformer2DModel
    req = GenerationRequest("an old library", steps=2, seed=5)
    latents, pngs = run_flux_pipeline(ref, [req])
    res = tiny_pipe.generate([req])[0]
    assert torch.equal(res.latents, latents[0]) and res.png == pngs[0]
    # no progress bar unless asked (a replica's log would fill with one per batch), and one named by the batch if so
    assert ref._progress_bar_config == {"disable": True, "desc": f"lossless {req.width}x{req.height}"}
    run_flux_pipeline(ref, [req], progress=True)
    assert ref._progress_bar_config == {"disable": False, "desc": f"lossless {req.width}x{req.height}"}


def test_png_is_deterministic_and_metadata_free(tiny_pipe) -> None:
    req = GenerationRequest("a neon sign", steps=2, seed=9)
    a = tiny_pipe.generate([req])[0]
    b = tiny_pipe.generate([req])[0]
    assert a.png == b.png and torch.equal(a.latents, b.latents)
    from PIL import Image

    im = Image.open(io.BytesIO(a.png))
    assert im.format == "PNG" and im.size == (256, 256) and im.mode == "RGB"
    assert not im.info.keys() - {"dpi", "gamma"}  # no text/time chunks
    assert b"tIME" not in a.png and b"tEXt" not in a.png


# ---------------------------------------------------------------------------------------------------------------
# Per-request seeds and batching
# ---------------------------------------------------------------------------------------------------------------


def test_initial_noise_per_request_is_independent_of_the_batch(tiny_pipe) -> None:
    pipe = tiny_pipe.pipe
    a, b, c = (GenerationRequest("x", seed=s) for s in (1, 2, 3))

    def noise(reqs):
        lat, _ = pipe.prepare_latents(len(reqs), 16, 256, 256, torch.float32, torch.device("cpu"),
                                      request_generators(reqs))
        return lat

    alone = noise([a])[0]
    assert torch.equal(noise([a, b])[0], alone)
    assert torch.equal(noise([c, a])[1], alone)
    assert torch.equal(noise([b])[0], noise([a, b])[1])
    assert not torch.equal(noise([b])[0], alone)


def test_request_result_does_not_depend_on_batch_mates(tiny_pipe) -> None:
    """Same batch size, different companions and positions: bit-identical result for request A."""
    a = GenerationRequest("a red fox", seed=1, steps=3)
    b = GenerationRequest("a cup of coffee, macro photograph", seed=2, steps=3)
    c = GenerationRequest("a snowy village under the stars", seed=99, steps=3)
    ab = tiny_pipe.generate([a, b])
    ca = tiny_pipe.generate([c, a])
    assert torch.equal(ab[0].latents, ca[1].latents)
    assert ab[0].png == ca[1].png


def test_batch_of_two_equals_each_request_alone(tiny_pipe) -> None:
    """The contract: a request's image does not depend on what it is batched with.

    What we found on CPU (MKL sgemm, torch 2.13): a GEMM row's result depends on the number of rows M of the GEMM
    (M=1 takes a GEMV path, M=2..3 and M>=4 use different blockings), not on the values or position of the other
    rows. FLUX's conditioning path runs GEMMs with M = batch size (timestep/guidance/pooled-text embedders and every
    AdaLN modulation linear), so a batch of 2 and a batch of 1 can differ in the last bits. The initial noise is per
    request and batch-independent, and for a fixed batch size the result is independent of the companions (both
    tested above). So: if batched == alone, pass. If not, the premise is proven on the model itself: stock diffusers
    must show the very same batch dependence (ours batched == diffusers batched and ours alone == diffusers alone,
    bit for bit), and the difference must stay at rounding level; only then does the test XFAIL, with the numbers.
    """
    a = GenerationRequest("a red fox", seed=1, steps=3)
    b = GenerationRequest("a dragon, oil on canvas", seed=2, steps=3)
    batched = tiny_pipe.generate([a, b])
    alone = [tiny_pipe.generate([r])[0] for r in (a, b)]
    equal = [torch.equal(x.latents, y.latents) for x, y in zip(batched, alone)]
    if all(equal):
        assert all(x.png == y.png for x, y in zip(batched, alone))
        return
    ref = diffusers_reference(tiny_pipe)
    ref_batched, _ = run_flux_pipeline(ref, [a, b])
    ref_alone = [run_flux_pipeline(ref, [r])[0][0] for r in (a, b)]
    for ours_b, ours_a, theirs_b, theirs_a in zip(batched, alone, ref_batched, ref_alone):
        assert torch.equal(ours_b.latents, theirs_b), "batched: ours differs from stock diffusers at the same batch"
        assert torch.equal(ours_a.latents, theirs_a), "alone: ours differs from stock diffusers"
    diff = max((x.latents - y.latents).abs().max().item() for x, y in zip(batched, alone))
    scale = max(y.latents.abs().max().item() for y in alone)
    # Seen: 1.4e-7 of scale (a few fp32 ulp); the bound leaves an order of magnitude, no more.
    assert diff <= 2e-6 * scale, f"batched vs alone differ by {diff} (latent scale {scale}): more than GEMM rounding"
    pytest.xfail(f"CPU GEMM results depend on the batch size M (stock diffusers too, bit for bit): batched vs alone "
                 f"max |diff| {diff:.3g} at latent scale {scale:.3g}")


def test_batch_must_be_uniform(tiny_pipe) -> None:
    with pytest.raises(ValueError, match="share steps"):
        tiny_pipe.generate([GenerationRequest("a", steps=2), GenerationRequest("b", steps=3)])
    with pytest.raises(ValueError, match="share quality"):
        tiny_pipe.generate([GenerationRequest("a"), GenerationRequest("b", quality="high")])
    with pytest.raises(ValueError, match="share width"):
        validate_batch([GenerationRequest("a"), GenerationRequest("b", width=128)])
    with pytest.raises(ValueError, match="multiple of 16"):
        tiny_pipe.generate([GenerationRequest("a", height=250)])
    with pytest.raises(ValueError, match="quality must be one of"):
        tiny_pipe.generate([GenerationRequest("a", quality="medium")])
    with pytest.raises(ValueError, match="empty batch"):
        tiny_pipe.generate([])
    with pytest.raises(ValueError, match="steps"):
        validate_batch([GenerationRequest("a", steps=0)])
    with pytest.raises(ValueError, match="seed"):
        validate_batch([GenerationRequest("a", seed=-1)])


# ---------------------------------------------------------------------------------------------------------------
# Quality tiers and cancellation
# ---------------------------------------------------------------------------------------------------------------


def test_high_on_cpu_runs_unfused_reports_zero_and_leaves_model_unmounted(tiny_pipe) -> None:
    req = GenerationRequest("a cat", seed=4, steps=2)
    high = tiny_pipe.generate([GenerationRequest("a cat", seed=4, steps=2, quality="high")])[0]
    assert high.quality == "high" and high.ran.gelu_sites == 0
    assert kernels.mounted_sites(tiny_pipe.transformer) == []
    report = tiny_pipe.last_mount_report
    assert not report.ok and report.refused  # the kernels said why (CPU / float32)
    lossless = tiny_pipe.generate([req])[0]
    # unfused == lossless: the same latents and pixels (a high PNG is written by the parallel encoder: other bytes)
    assert torch.equal(high.latents, lossless.latents) and np.array_equal(to_array(high.png), to_array(lossless.png))


class _SiteSpy:
    """Records how many GELU sites are mounted each time the transformer runs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[int] = []
        self._h = model.register_forward_pre_hook(lambda m, a: self.seen.append(len(kernels.mounted_sites(m))))

    def close(self) -> None:
        self._h.remove()


def test_high_batch_mounts_then_unmounts_and_lossless_never_sees_a_mounted_site(tiny_pipe, monkeypatch) -> None:
    """Force the guards to accept on CPU (the fused call itself falls back to the unfused pair off CUDA), to check
    the pipeline's mount discipline: mounted during a high batch only, unmounted after, also after a cancel."""
    import kernels.gelu as gelu

    monkeypatch.setattr(gelu, "can_fuse_linear_gelu", lambda layer, x=None: (True, "forced by test"))
    model = tiny_pipe.transformer
    n_sites = 2 * model.config.num_layers + model.config.num_single_layers  # ff, ff_context per double; proj_mlp
    spy = _SiteSpy(model)
    try:
        high = tiny_pipe.generate([GenerationRequest("a fox", steps=2, quality="high")])[0]
        assert high.ran.gelu_sites == n_sites
        assert spy.seen == [n_sites, n_sites]
        assert kernels.mounted_sites(model) == []
        spy.seen.clear()
        lossless = tiny_pipe.generate([GenerationRequest("a fox", steps=2)])[0]
        assert lossless.ran.gelu_sites == 0 and spy.seen == [0, 0]
        # a lossless batch after a crash that left sites mounted: the pipeline unmounts first
        kernels.mount(model)
        spy.seen.clear()
        tiny_pipe.generate([GenerationRequest("a fox", steps=2)])
        assert spy.seen == [0, 0]
        # cancelled high batch: still unmounted afterwards
        with pytest.raises(GenerationCancelled):
            tiny_pipe.generate([GenerationRequest("a fox", steps=3, quality="high")], should_stop=lambda: bool(spy.seen))
        assert kernels.mounted_sites(model) == []
    finally:
        spy.close()
        kernels.unmount(model)


def test_should_stop_cancels_between_steps(tiny_pipe) -> None:
    calls: list[int] = []
    spy = _SiteSpy(tiny_pipe.transformer)
    try:
        def stop_after_two() -> bool:
            calls.append(len(spy.seen))
            return len(spy.seen) >= 2

        with pytest.raises(GenerationCancelled) as exc:
            tiny_pipe.generate([GenerationRequest("x", steps=5)], should_stop=stop_after_two)
        assert str(exc.value) == "cancelled after step 2 of 5"
        assert len(spy.seen) == 2  # the transformer ran exactly twice
        spy.seen.clear()
        with pytest.raises(GenerationCancelled) as exc:
            tiny_pipe.generate([GenerationRequest("x", steps=5)], should_stop=lambda: True)
        assert str(exc.value) == "cancelled before the first step"
        assert spy.seen == []
        # never asked to stop: all steps run; should_stop polled between steps only (steps - 1 times)
        calls.clear()
        tiny_pipe.generate([GenerationRequest("x", steps=3)], should_stop=lambda: calls.append(1) and False)
        assert len(calls) == 1 + 2  # once before the first step, then between steps
    finally:
        spy.close()


def test_progress_bar_toggles(tiny_pipe, capsys) -> None:
    tiny_pipe.generate([GenerationRequest("x", steps=2)], progress=True)
    assert "2/2" in capsys.readouterr().err
    tiny_pipe.generate([GenerationRequest("x", steps=2)], progress=False)
    assert "2/2" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Loading: folders, shards, errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture()
def tiny_copy(tiny_path, tmp_path) -> Path:
    dst = tmp_path / "flux"
    shutil.copytree(tiny_path, dst)
    return dst


def test_sharded_transformer_loads_identically(tiny_copy, tiny_pipe) -> None:
    from diffusers import FluxTransformer2DModel

    tr = FluxTransformer2DModel.from_pretrained(tiny_copy, subfolder="transformer")
    shutil.rmtree(tiny_copy / "transformer")
    tr.save_pretrained(tiny_copy / "transformer", max_shard_size="2MB")
    shards = sorted(p.name for p in (tiny_copy / "transformer").glob("*.safetensors"))
    assert len(shards) >= 3 and (tiny_copy / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    sharded = load_pipeline(str(tiny_copy))
    ref = tiny_pipe.transformer.state_dict()
    got = sharded.transformer.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    # and a missing shard is named
    (tiny_copy / "transformer" / shards[1]).unlink()
    with pytest.raises(ModelLoadError, match=shards[1]) as err:
        load_pipeline(str(tiny_copy))
    assert err.value.component == "transformer"


@pytest.mark.parametrize(
    "breakage, component, message",
    [
        ("no_folder", "folder", "does not exist"),
        ("no_index", "model_index.json", "missing"),
        ("bad_index", "model_index.json", "not valid JSON"),
        ("no_transformer_weights", "transformer", "diffusion_pytorch_model.safetensors"),
        ("truncated_transformer", "transformer", "Unable to load weights"),
        ("renamed_key", "transformer", "does not match"),
        ("no_vae", "vae", "subfolder vae/ missing"),
        ("no_t5_weights", "text_encoder_2", "model.safetensors"),
        ("no_tokenizer", "tokenizer_2", "tokenizer.json"),
    ],
)
def test_broken_folder_errors_name_the_piece(tiny_copy, breakage, component, message) -> None:
    root = tiny_copy
    weights = root / "transformer" / "diffusion_pytorch_model.safetensors"
    if breakage == "no_folder":
        root = root / "nope"
    elif breakage == "no_index":
        (root / "model_index.json").unlink()
    elif breakage == "bad_index":
        (root / "model_index.json").write_text("{not json")
    elif breakage == "no_transformer_weights":
        weights.unlink()
    elif breakage == "truncated_transformer":
        weights.write_bytes(weights.read_bytes()[: 1000])
    elif breakage == "renamed_key":
        from safetensors.torch import load_file, save_file

        sd = load_file(weights)
        sd["not_a_flux_parameter"] = sd.pop("proj_out.bias")
        save_file(sd, weights, metadata={"format": "pt"})
    elif breakage == "no_vae":
        shutil.rmtree(root / "vae")
    elif breakage == "no_t5_weights":
        (root / "text_encoder_2" / "model.safetensors").unlink()
    elif breakage == "no_tokenizer":
        (root / "tokenizer_2" / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=message) as err:
        load_pipeline(str(root))
    assert err.value.component == component
    assert component in str(err.value)


def test_unknown_preset_name_is_a_missing_folder() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_pipeline("flux-nonexistent-preset")


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------


def test_cli_generate_writes_the_same_png_as_the_api(tiny_path, tiny_pipe, tmp_path, capsys) -> None:
    from model.__main__ import main

    out = tmp_path / "img.png"
    rc = main(["generate", "--prompt", "a forest cabin", "--steps", "3", "--size", "128x64", "--seed", "12",
               "--out", str(out), "--model", str(tiny_path), "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    api = tiny_pipe.generate([GenerationRequest("a forest cabin", steps=3, width=128, height=64, seed=12)])[0]
    assert out.read_bytes() == api.png
    assert printed["png_md5"] == hashlib.md5(api.png).hexdigest() and printed["ran"]["gelu_sites"] == 0


def test_cli_verify_passes_on_tiny_and_reports(tiny_path, capsys) -> None:
    from model.__main__ import main

    rc = main(["verify", "--model", str(tiny_path), "--steps", "2", "--size", "128x128", "--json", "--no-progress"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert res["lossless_latents_equal"] and res["lossless_png_equal"]
    assert res["reference"]["png_md5"] == res["lossless"]["png_md5"]
    high = res["high"]  # as the high pool runs it: fused projections; on the CPU fp8 is refused
    assert high["fused_projections"] and not high["fp8"] and "CUDA" in high["fp8_refused"]
    assert high["ran"]["gelu_sites"] == 0
    assert high["ran"]["fast_norm_sites"] == high["ran"]["attention8_sites"] == 0  # CPU fp32: the plan keeps them off
    assert res["high_identical_to_lossless"] or res["psnr_high_vs_lossless_db"] > 40
    assert res["ssim_high_vs_lossless"] == pytest.approx(1.0, abs=1e-3)


def test_cli_verify_runs_the_high_pools_default_techniques(tiny_path, monkeypatch, capsys) -> None:
    """Where the plan admits them (CUDA fp16/bf16, faked here), verify's high batch switches on the fast norms and
    8-bit attention, as the high pool does by default (their kernels then refuse the CPU tensors and fall back)."""
    from model.__main__ import main
    from model.pipeline import FluxServePipeline
    from model.features import HIGH_DEFAULTS

    assert {"fast_norm", "attention8"} <= HIGH_DEFAULTS
    monkeypatch.setattr(FluxServePipeline, "runs", lambda self, technique: True)
    rc = main(["verify", "--model", str(tiny_path), "--steps", "2", "--size", "64x64", "--json", "--no-progress"])
    high = json.loads(capsys.readouterr().out)["high"]
    assert rc == 0 and high["ran"]["fast_norm_sites"] > 0 and high["ran"]["attention8_sites"] > 0, high


def test_cli_verify_exits_1_on_mismatch(tiny_path, monkeypatch, capsys) -> None:
    """If our transformer drifted from diffusers by one ulp in one bias, verify must fail."""
    from model import loading
    from model.__main__ import main

    real_load = loading.load_pipeline

    def drifting_load(*args, **kwargs):
        pipe = real_load(*args, **kwargs)
        with torch.no_grad():
            b = pipe.transformer.proj_out.bias
            b.copy_(torch.nextafter(b, torch.full_like(b, float("inf"))))
        return pipe

    monkeypatch.setattr(loading, "load_pipeline", drifting_load)  # the CLI imports the loader at call time
    rc = main(["verify", "--model", str(tiny_path), "--steps", "2", "--size", "64x64", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1 and "MISMATCH" in out


def test_cli_rejects_bad_size(capsys) -> None:
    from model.__main__ import main

    assert main(["generate", "--size", "100x100", "--out", "/nonexistent/x.png"]) == 2
    assert "multiple of 16" in capsys.readouterr().err


def test_fast_norm_switches_for_high_batches_only(tiny_pipe, monkeypatch) -> None:
    """The form's fast_norm: every norm site is switched during a high batch and back after; a lossless batch never sees
    a switched site. On CPU the switch is refused (fast kernel is CUDA half only), so nothing changes by default."""
    from kernels.modulate import fast_norm_sites, set_fast_norm

    model = tiny_pipe.transformer
    # norm1, norm1_context, the norm2 pair and the attention's QK norms of a double block; a single block's norm and
    # its attention's QK norms
    n_sites = 4 * model.config.num_layers + 2 * model.config.num_single_layers
    assert set_fast_norm(model, True) == n_sites and set_fast_norm(model, False) == 0
    req, high_req = GenerationRequest("a fox", steps=2, seed=3), GenerationRequest("a fox", steps=2, seed=3,
                                                                                     quality="high")
    tiny_pipe.use(fast_norm=True)
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append(fast_norm_sites(m)))
    try:
        assert tiny_pipe.generate([high_req])[0].ran.fast_norm_sites == 0 and seen == [0, 0]  # CPU: refused
        monkeypatch.setattr(type(tiny_pipe), "runs", lambda self, technique: True)
        seen.clear()
        high = tiny_pipe.generate([high_req])[0]
        assert high.ran.fast_norm_sites == n_sites and seen == [n_sites, n_sites]
        assert fast_norm_sites(model) == 0
        seen.clear()
        lossless = tiny_pipe.generate([req])[0]
        assert lossless.ran.fast_norm_sites == 0 and seen == [0, 0]
        # off CUDA a switched site still computes the exact path: same bytes as lossless
        assert torch.equal(high.latents, lossless.latents)
        set_fast_norm(model, True)  # left on by a crash: the next batch switches it off first
        seen.clear()
        tiny_pipe.generate([req])
        assert seen == [0, 0]
    finally:
        hook.remove()
        tiny_pipe.use(fast_norm=False)
        set_fast_norm(model, False)


def test_fault_injection_slows_or_fails_only_its_prompt(tiny_pipe, monkeypatch) -> None:
    """model.faults: off without FLUXSERVE_FAULTS; with it, only the named prompt's batches are slowed / failed."""
    import json
    import time

    from model import faults

    faults.after_step(["anything"], 0)  # off: a no-op
    monkeypatch.setenv(faults.ENV, json.dumps({"slow one": {"step_delay_s": 0.2},
                                               "bad one": {"raise_at_step": 1, "error": "injected OOM"}}))
    t0 = time.perf_counter()
    tiny_pipe.generate([GenerationRequest("slow one", steps=2, height=64, width=64)])
    assert time.perf_counter() - t0 >= 0.4
    with pytest.raises(RuntimeError, match="injected OOM"):
        tiny_pipe.generate([GenerationRequest("bad one", steps=3, height=64, width=64)])
    t0 = time.perf_counter()
    res = tiny_pipe.generate([GenerationRequest("other", steps=2, height=64, width=64)])[0]
    assert time.perf_counter() - t0 < 0.4 and res.png[:4] == b"\x89PNG"
    monkeypatch.setenv(faults.ENV, "[1, 2]")
    with pytest.raises(ValueError, match="FLUXSERVE_FAULTS must be a JSON object"):
        faults.after_step(["x"], 0)


def test_previews_leave_the_image_unchanged_and_come_after_their_steps(tiny_pipe) -> None:
    """Partial images only read the latents: the result equals the run without previews (torch.equal latents, same
    PNG bytes); one PNG per request of the batch at each chosen step, at the image's size."""
    from PIL import Image

    from model.preview import PreviewSink, preview_steps

    reqs = [GenerationRequest("a kite", height=64, width=128, steps=6, seed=s) for s in (1, 2)]
    got: list = []
    steps = preview_steps(6, 3)
    assert steps == (2, 3, 4)
    with_previews = tiny_pipe.generate(reqs, previews=PreviewSink(steps, lambda k, i, pngs: got.append((k, i, pngs))))
    plain = tiny_pipe.generate(reqs)
    for a, b in zip(with_previews, plain):
        assert torch.equal(a.latents, b.latents) and a.png == b.png
    assert [(k, i) for k, i, _ in got] == [(0, 2), (1, 3), (2, 4)]
    for _, _, pngs in got:
        assert len(pngs) == 2 and all(Image.open(io.BytesIO(p)).size == (128, 64) for p in pngs)


def test_preview_steps_spread_and_bounds() -> None:
    from model.preview import preview_steps

    assert preview_steps(28, 3) == (7, 14, 20)
    assert preview_steps(28, 1) == (14,)
    assert preview_steps(28, 0) == () and preview_steps(2, 3) == ()
    assert preview_steps(4, 2) == (1, 2) and preview_steps(5, 2) == (2, 3)  # distinct even when few
    assert preview_steps(4, 3) == (1, 2)  # fewer steps than previews asked: one per inner step
    with pytest.raises(ValueError, match="between 0 and 3"):
        preview_steps(10, 4)


def test_preview_map_recovers_colours_of_a_picture_it_was_not_fitted_on(tiny_pipe) -> None:
    """The latent -> RGB fit generalises: on a held-out picture encoded by the same VAE, the preview's colours
    correlate with the picture's (8x8 averages). The tiny preset's VAE has random weights, so the bar is low; a
    broken fit (wrong layout or scaling) scores about zero."""
    import torch.nn.functional as F

    from model.preview import _fit_picture

    from model.preview import LatentPreviewer

    pipe = tiny_pipe.pipe
    w = LatentPreviewer(pipe).weights()  # fitted here, not taken from a cache an earlier test filled
    picture = _fit_picture(256, seed=7)[None]
    with torch.no_grad():
        z = (pipe.vae.encode(picture).latent_dist.mean - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    rgb = torch.einsum("bchw,cd->bdhw", z.float(), w[:-1]) + w[-1][None, :, None, None]
    corr = torch.corrcoef(torch.stack([rgb.flatten(), F.avg_pool2d(picture, 8).flatten()]))[0, 1]
    assert corr > 0.2, float(corr)


def test_each_result_reports_what_its_batch_ran(tiny_path) -> None:
    """`GenerationResult.ran` (the JSON `ran` over HTTP) says what ran, not only the GELU sites: nothing for a
    lossless batch; the request's step cache; the converted form (fused projections; fp8 is refused on the CPU, so
    no fp8 layers); CUDA graphs asked for but not replayed on the CPU. Catches a report that keeps a default or
    reads the pool's settings instead of the batch's."""
    from model.tiers import Ran

    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)

    def req(**kw) -> GenerationRequest:
        return GenerationRequest("a red fox", height=64, width=64, steps=2, seed=1, **kw)

    assert pipe.generate([req()])[0].ran == Ran()
    assert pipe.generate([req(quality="high", step_cache=0.5)])[0].ran == Ran(step_cache=0.5)
    pipe.use(step_cache=0.25)
    assert pipe.generate([req(quality="high")])[0].ran == Ran(step_cache=0.25)
    pipe.convert_for_high(fused_projections=True)
    pipe.enable_cuda_graphs()
    high = pipe.generate([req(quality="high", step_cache=0.0)])[0]
    assert high.ran == Ran(fused_projections=True)  # 0: every step computed; no graph replays on the CPU
    assert high.ran.as_dict() == {"gelu_sites": 0, "fast_norm_sites": 0, "attention8_sites": 0, "fp8_layers": 0,
                                  "fused_projections": True, "compiled": False, "graphed": False,
                                  "step_cache": None, "fast_vae": False, "adapters": [], "fused_adapter": None}
    assert Ran(adapters=(("ink", 0.5),), fused_adapter=("sun", 1.0)).as_dict()["adapters"] == [
        {"name": "ink", "scale": 0.5}]
    assert Ran(fused_adapter=("sun", 1.0)).as_dict()["fused_adapter"] == {"name": "sun", "scale": 1.0}


def test_loading_does_not_warn_that_our_transformer_is_not_diffusers(tiny_path: Path) -> None:
    """diffusers' type check of a pipeline's components flags our transformer (a stand-in by design), and
    transformers warns that an image processor nothing here uses lacks torchvision: those warnings are dropped from
    the logs, and only those."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logs = [logging.getLogger(n) for n in ("diffusers.pipelines.pipeline_utils", "transformers.utils.import_utils")]
    for log in logs:
        log.addHandler(handler)
    try:
        load_pipeline(str(tiny_path))
        logs[0].warning("Expected types for transformer: (A,), got B.")
        logs[0].warning("Expected types for vae: (A,), got B.")
        logs[1].warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to ...")
        logs[1].warning("`Other` requires torchvision (not installed)")
    finally:
        for log in logs:
            log.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["Expected types for vae: (A,), got B.",
                                                 "`Other` requires torchvision (not installed)"]


def test_warm_a_shape_outside_the_warm_set_is_logged_once_with_its_time(tiny_path: Path, caplog) -> None:
    """A warmed replica names the first batch of each shape it did not warm up, with what it cost (that is where a
    cold kernel compile or graph capture shows); warmed shapes and repeats stay quiet."""
    import logging

    from model.pipeline import GenerationRequest

    pipe = load_pipeline(str(tiny_path))
    pipe.warm_up([(64, 64)], [1], "lossless", steps=2)
    req = lambda h, w, b=1: [GenerationRequest("x", height=h, width=w, steps=2, seed=i) for i in range(b)]  # noqa: E731
    with caplog.at_level(logging.INFO, logger="model.pipeline"):
        pipe.generate(req(64, 64))
        pipe.generate(req(64, 96))
        pipe.generate(req(64, 96))
        pipe.generate(req(64, 64, 2))
    cold = [r.getMessage() for r in caplog.records if "outside the warm set" in r.getMessage()]
    assert [m.split(":")[0] for m in cold] == ["first lossless batch of 96x64 x1, outside the warm set",
                                               "first lossless batch of 64x64 x2, outside the warm set"], cold


def test_a_batch_may_leave_its_pngs_to_encode_later_and_they_are_the_same_bytes(tiny_pipe) -> None:
    from model.pipeline import encode_pngs

    batch = [GenerationRequest("a red fox", height=64, width=64, steps=2, seed=s) for s in (1, 2)]
    pending = tiny_pipe.generate(batch, encode=False)
    assert [r.png for r in pending] == [None, None] and all(r.image.size == (64, 64) for r in pending)
    done = tiny_pipe.generate(batch)
    assert [r.png for r in encode_pngs(pending)] == [r.png for r in done] and pending[0].image is None
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(pending, done))
