"""Original (single-file) FLUX.1 checkpoints: a folder whose transformer/ holds one file in the original layout
loads into our transformer through diffusers' key conversion, equal to the model that wrote it and to diffusers'
own `FluxTransformer2DModel.from_single_file`; the whole pipeline then stays byte-identical to stock diffusers.

The file is written by the test (FLUX.1 width 3072, the only width diffusers' converter splits, at 1 + 1 blocks) by
inverting the documented key layout below, so nothing is downloaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model.flux import FluxTransformer
from model.loading import ModelLoadError, load_pipeline, load_single_file_transformer, load_transformer
from tests._inputs import random_flux

CONFIG = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
              num_attention_heads=24, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
              axes_dims_rope=(16, 56, 56))


def _original_layout(sd: dict[str, torch.Tensor], num_layers: int, num_single: int) -> dict[str, torch.Tensor]:
    """diffusers keys -> the original single-file keys (BFL's flux layout)."""
    def cat(*names: str) -> torch.Tensor:
        return torch.cat([sd[n] for n in names], dim=0).contiguous()

    def swap(t: torch.Tensor) -> torch.Tensor:  # the original final AdaLN is (shift, scale); diffusers' (scale, shift)
        scale, shift = t.chunk(2, dim=0)
        return torch.cat([shift, scale], dim=0).contiguous()

    out: dict[str, torch.Tensor] = {}
    for orig, ours in (("time_in", "time_text_embed.timestep_embedder"), ("vector_in", "time_text_embed.text_embedder"),
                       ("guidance_in", "time_text_embed.guidance_embedder")):
        for w in ("weight", "bias"):
            out[f"{orig}.in_layer.{w}"] = sd[f"{ours}.linear_1.{w}"]
            out[f"{orig}.out_layer.{w}"] = sd[f"{ours}.linear_2.{w}"]
    for w in ("weight", "bias"):
        out[f"txt_in.{w}"] = sd[f"context_embedder.{w}"]
        out[f"img_in.{w}"] = sd[f"x_embedder.{w}"]
        out[f"final_layer.linear.{w}"] = sd[f"proj_out.{w}"]
        out[f"final_layer.adaLN_modulation.1.{w}"] = swap(sd[f"norm_out.linear.{w}"])
        for i in range(num_layers):
            b, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
            out[f"{o}img_mod.lin.{w}"] = sd[f"{b}norm1.linear.{w}"]
            out[f"{o}txt_mod.lin.{w}"] = sd[f"{b}norm1_context.linear.{w}"]
            out[f"{o}img_attn.qkv.{w}"] = cat(*(f"{b}attn.to_{x}.{w}" for x in "qkv"))
            out[f"{o}txt_attn.qkv.{w}"] = cat(*(f"{b}attn.add_{x}_proj.{w}" for x in "qkv"))
            out[f"{o}img_mlp.0.{w}"] = sd[f"{b}ff.net.0.proj.{w}"]
            out[f"{o}img_mlp.2.{w}"] = sd[f"{b}ff.net.2.{w}"]
            out[f"{o}txt_mlp.0.{w}"] = sd[f"{b}ff_context.net.0.proj.{w}"]
            out[f"{o}txt_mlp.2.{w}"] = sd[f"{b}ff_context.net.2.{w}"]
            out[f"{o}img_attn.proj.{w}"] = sd[f"{b}attn.to_out.0.{w}"]
            out[f"{o}txt_attn.proj.{w}"] = sd[f"{b}attn.to_add_out.{w}"]
        for i in range(num_single):
            b, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
            out[f"{o}modulation.lin.{w}"] = sd[f"{b}norm.linear.{w}"]
            out[f"{o}linear1.{w}"] = cat(f"{b}attn.to_q.{w}", f"{b}attn.to_k.{w}", f"{b}attn.to_v.{w}",
                                         f"{b}proj_mlp.{w}")
            out[f"{o}linear2.{w}"] = sd[f"{b}proj_out.{w}"]
    for i in range(num_layers):
        b, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for side, ours in (("img", ""), ("txt", "added_")):
            out[f"{o}{side}_attn.norm.query_norm.scale"] = sd[f"{b}attn.norm_{ours}q.weight"]
            out[f"{o}{side}_attn.norm.key_norm.scale"] = sd[f"{b}attn.norm_{ours}k.weight"]
    for i in range(num_single):
        b, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        out[f"{o}norm.query_norm.scale"] = sd[f"{b}attn.norm_q.weight"]
        out[f"{o}norm.key_norm.scale"] = sd[f"{b}attn.norm_k.weight"]
    return {f"model.diffusion_model.{k}": v for k, v in out.items()}  # as ComfyUI-style files carry them


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> tuple[Path, FluxTransformer]:
    model = random_flux(**CONFIG)
    path = tmp_path_factory.mktemp("single") / "flux1-test.safetensors"
    save_file(_original_layout(model.state_dict(), 1, 1), str(path))
    return path, model


def test_a_single_file_loads_into_our_transformer_equal_to_the_model_that_wrote_it(original) -> None:
    path, model = original
    loaded = load_single_file_transformer(path, dtype=torch.bfloat16)
    assert loaded.config.num_layers == 1 and loaded.config.num_single_layers == 1 and loaded.config.guidance_embeds
    assert loaded.config.joint_attention_dim == 32 and loaded.config.pooled_projection_dim == 32
    ours, theirs = loaded.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not any(b.is_meta for b in loaded.buffers()) and not any(p.is_meta for p in loaded.parameters())


def test_a_folder_with_a_single_file_transformer_loads_like_diffusers_from_single_file(original, tmp_path) -> None:
    from diffusers import FluxTransformer2DModel

    path, model = original
    (tmp_path / "transformer").mkdir()
    shutil.copy(path, tmp_path / "transformer" / path.name)
    ours = load_transformer(tmp_path, torch.bfloat16)
    theirs = load_transformer(tmp_path, torch.bfloat16, cls=FluxTransformer2DModel)  # diffusers' from_single_file
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 16, 64, generator=g).to(torch.bfloat16),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g).to(torch.bfloat16),
                  pooled_projections=torch.randn(1, 32, generator=g).to(torch.bfloat16),
                  timestep=torch.full((1,), 0.5, dtype=torch.bfloat16), guidance=torch.full((1,), 3.5),
                  txt_ids=torch.zeros(8, 3), img_ids=torch.stack([torch.zeros(16), torch.arange(16.) // 4,
                                                                  torch.arange(16.) % 4], -1), return_dict=False)
    with torch.no_grad():
        assert torch.equal(ours(**inputs)[0], theirs(**inputs)[0])
        assert torch.equal(ours(**inputs)[0], model(**inputs)[0])


def test_a_single_file_pipeline_is_byte_identical_to_stock_diffusers(original, tiny_path: Path, tmp_path) -> None:
    """The tiny preset's components with the single-file transformer (its text dims match CONFIG's)."""
    from model.loading import diffusers_reference
    from model.pipeline import GenerationRequest, run_flux_pipeline

    path, _ = original
    folder = tmp_path / "flux"
    shutil.copytree(tiny_path, folder)
    shutil.rmtree(folder / "transformer")
    (folder / "transformer").mkdir()
    shutil.copy(path, folder / "transformer" / path.name)
    pipe = load_pipeline(str(folder), device="cpu", dtype=torch.bfloat16)
    ref = diffusers_reference(pipe)
    req = GenerationRequest("a red fox", height=64, width=64, steps=2, seed=3)
    got = pipe.generate([req])[0]
    lat, png = run_flux_pipeline(ref, [req])
    assert torch.equal(got.latents, lat[0]) and got.png == png[0]


def test_bad_single_files_are_load_errors(tmp_path) -> None:
    narrow = FluxTransformer(**{**CONFIG, "num_attention_heads": 2, "attention_head_dim": 64,
                                "axes_dims_rope": (16, 24, 24)})
    path = tmp_path / "narrow.safetensors"
    save_file(_original_layout(narrow.state_dict(), 1, 1), str(path))
    with pytest.raises(ModelLoadError, match="width 3072 only"):
        load_single_file_transformer(path)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="unreadable"):
        load_single_file_transformer(junk)
