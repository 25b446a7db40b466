"""Presets: offline, deterministic, atomic builds; the full-size presets have FLUX.1's architecture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from model import presets
from model.presets import ensure_preset, folder_digest


def test_tiny_build_is_deterministic(tiny_path: Path, tmp_path: Path) -> None:
    again = ensure_preset("tiny", cache_dir=tmp_path)
    assert again != tiny_path
    a, b = folder_digest(tiny_path), folder_digest(again)
    assert "transformer/diffusion_pytorch_model.safetensors" in a and "tokenizer_2/tokenizer.json" in a
    assert a == b


def test_tiny_is_a_plain_diffusers_flux_folder(tiny_path: Path) -> None:
    import json

    index = json.loads((tiny_path / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    cfg = json.loads((tiny_path / "transformer" / "config.json").read_text())
    assert (cfg["num_layers"], cfg["num_single_layers"], cfg["num_attention_heads"], cfg["attention_head_dim"]) == (
        2, 2, 4, 32)
    assert cfg["guidance_embeds"] is True and list(cfg["axes_dims_rope"]) == [8, 12, 12]
    vae = json.loads((tiny_path / "vae" / "config.json").read_text())
    assert vae["latent_channels"] == 16 and len(vae["block_out_channels"]) == 4  # 8x downsampling like FLUX
    total = sum(p.stat().st_size for p in tiny_path.rglob("*") if p.is_file())
    assert total < 20 * 2**20


def test_ensure_preset_reuses_the_cache(tiny_path: Path, fluxserve_cache: Path, monkeypatch) -> None:
    def must_not_build(*a, **k):
        raise AssertionError("rebuilt a cached preset")

    monkeypatch.setattr(presets, "save_preset", must_not_build)
    assert ensure_preset("tiny", cache_dir=fluxserve_cache) == tiny_path
    # the default cache dir comes from FLUXSERVE_CACHE (set for the session by conftest)
    assert os.environ["FLUXSERVE_CACHE"] == str(fluxserve_cache)
    assert presets.cache_dir() == fluxserve_cache
    assert ensure_preset("tiny") == tiny_path


def test_load_pipeline_by_preset_name_uses_the_cache(tiny_path: Path, monkeypatch) -> None:
    from model.loading import load_pipeline

    monkeypatch.setattr(presets, "save_preset", lambda *a, **k: pytest.fail("rebuilt"))
    pipe = load_pipeline("tiny")
    assert pipe.folder == tiny_path and pipe.source == "tiny"


def test_cache_dir_default(monkeypatch) -> None:
    monkeypatch.delenv("FLUXSERVE_CACHE", raising=False)
    assert presets.cache_dir() == Path.home() / ".cache" / "fluxserve"
    monkeypatch.setenv("FLUXSERVE_CACHE", "~/elsewhere")
    assert presets.cache_dir() == Path.home() / "elsewhere"


def test_failed_build_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    real = presets.save_preset

    def crash_after_writing(name, dest):
        real(name, dest)  # a complete-looking folder exists in the temp dir when the crash happens
        raise RuntimeError("disk full")

    monkeypatch.setattr(presets, "save_preset", crash_after_writing)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_preset("tiny", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unknown_and_in_memory_presets_are_refused_on_disk(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        ensure_preset("nope", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="in memory only"):
        presets.save_preset("flux-dev-random", tmp_path / "x")


# FLUX.1-dev's transformer has 11,901,408,320 parameters; schnell lacks the guidance embedder (10,229,760 fewer).
@pytest.mark.parametrize("name, guidance, t5_len, n_params", [
    ("flux-dev-random", True, 512, 11_901_408_320),
    ("flux-schnell-random", False, 256, 11_891_178_560),
])
def test_full_size_presets_have_flux1_architecture(name: str, guidance: bool, t5_len: int, n_params: int) -> None:
    """Built on the meta device (no memory, no init cost): parameter counts of FLUX.1 and its encoders."""
    comps = presets.build_components(name, "meta", torch.bfloat16)
    count = {k: sum(p.numel() for p in comps[k].parameters()) for k in ("transformer", "text_encoder",
                                                                         "text_encoder_2", "vae")}
    assert count["transformer"] == n_params
    assert 4.7e9 < count["text_encoder_2"] < 4.8e9  # T5 v1.1 XXL encoder
    assert 1.2e8 < count["text_encoder"] < 1.3e8  # CLIP ViT-L/14 text tower
    assert 8.0e7 < count["vae"] < 8.5e7  # FLUX VAE (16 latent channels)
    tr = comps["transformer"]
    assert tr.config.guidance_embeds is guidance and tuple(tr.config.axes_dims_rope) == (16, 56, 56)
    assert next(tr.parameters()).dtype == torch.bfloat16 and next(tr.parameters()).is_meta
    assert comps["tokenizer_2"].model_max_length == t5_len and comps["tokenizer"].model_max_length == 77
    assert comps["scheduler"].config.use_dynamic_shifting is guidance  # dev: resolution-dependent shift


def test_tokenizers_are_built_locally_and_deterministic(monkeypatch) -> None:
    from model.tokenizer_build import build_clip_tokenizer, build_t5_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a, b = build_clip_tokenizer(), build_clip_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    ids = a("A Red fox, at sunset!", padding="max_length", max_length=77, truncation=True).input_ids
    assert len(ids) == 77 and ids[0] == a.bos_token_id
    assert a.unk_token_id not in ids[: ids.index(a.eos_token_id)]
    assert a.decode(ids, skip_special_tokens=True) == "a red fox , at sunset !"
    t, u = build_t5_tokenizer(), build_t5_tokenizer()
    assert t.backend_tokenizer.to_str() == u.backend_tokenizer.to_str()
    enc = t("a red fox at sunset", padding="max_length", max_length=16, truncation=True).input_ids
    assert enc[-1] == t.pad_token_id == 0 and t.eos_token_id in enc and t.unk_token_id not in enc
    assert t.decode(enc, skip_special_tokens=True) == "a red fox at sunset"


def test_in_memory_preset_path_with_a_tiny_spec(monkeypatch) -> None:
    """The path flux-*-random take (built on the device, no disk): ours holds the weights, the reference shares
    the encoders/VAE, has diffusers' own transformer with equal weights, and lossless == reference."""
    import dataclasses

    from diffusers import FluxTransformer2DModel

    from model.flux import FluxTransformer
    from model.loading import diffusers_reference, load_pipeline
    from model.pipeline import GenerationRequest, run_flux_pipeline

    spec = dataclasses.replace(presets.PRESETS["tiny"], name="tiny-in-memory", on_disk=False)
    monkeypatch.setitem(presets.PRESETS, "tiny-in-memory", spec)
    built = {}
    build = presets.build_components

    def spy(*args, **kwargs):
        components = build(*args, **kwargs)
        built["transformer"] = components["transformer"]
        return components

    monkeypatch.setattr(presets, "build_components", spy)
    pipe = load_pipeline("tiny-in-memory", device="cpu", dtype=torch.float32)
    assert pipe.folder is None and type(pipe.transformer) is FluxTransformer
    # ours holds the very tensors diffusers' transformer was built with (a copy would double the peak at full size)
    made = dict(built["transformer"].named_parameters())
    assert all(p.data_ptr() == made[k].data_ptr() for k, p in pipe.transformer.named_parameters())
    ref = diffusers_reference(pipe)
    assert type(ref.transformer) is FluxTransformer2DModel
    assert ref.vae is pipe.pipe.vae and ref.text_encoder_2 is pipe.pipe.text_encoder_2
    a, b = pipe.transformer.state_dict(), ref.transformer.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(a[k].data_ptr() != b[k].data_ptr() for k in a)  # a copy: mounting ours can never touch the reference
    # the in-memory build is the same random model as the on-disk tiny preset (same recipe, same seed)
    from model.presets import ensure_preset

    disk = load_pipeline(str(ensure_preset("tiny")))
    d = disk.transformer.state_dict()
    assert all(torch.equal(a[k], d[k]) for k in a)
    req = GenerationRequest("a cat", steps=2, seed=1)
    lat, png = run_flux_pipeline(ref, [req])
    res = pipe.generate([req])[0]
    assert torch.equal(res.latents, lat[0]) and res.png == png[0]
