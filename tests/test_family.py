"""The model-family seam (model/family.py, FLUX.1's in model/flux1.py): what loading, the pipeline, TP sharding and
the conversions ask of a family, and the declarative TP plan applied to whole transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model.family import family_of, families
from model.flux import FluxTransformer
from model.flux1 import FAMILY
from model.linear import Column, Linear, Row
from model.loading import ModelLoadError, check_folder
from tests.test_linear import _spmd, collectives  # noqa: F401 - the threaded ranks and their fake collectives
from tp.shard import shard_transformer

SMALL = dict(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=4,
             joint_attention_dim=24, pooled_projection_dim=12, axes_dims_rope=(2, 2, 4))


def test_a_model_is_found_by_its_class_names_and_an_unknown_one_is_refused() -> None:
    from diffusers import FluxImg2ImgPipeline, FluxPipeline, FluxTransformer2DModel

    assert family_of("FluxPipeline") is FAMILY and family_of(FluxTransformer(**SMALL)) is FAMILY
    assert FAMILY.transformer_class() is FluxTransformer and FAMILY.reference_transformer_class() is FluxTransformer2DModel
    assert FAMILY.pipeline_classes()["text"] is FluxPipeline and FAMILY.pipeline_classes()["img2img"] is FluxImg2ImgPipeline
    assert [f.name for f in families()] == ["flux1", "flux1-kontext"] and families()[0] is FAMILY
    with pytest.raises(ValueError) as exc:
        family_of("Flux2Pipeline")
    assert str(exc.value) == ("no model family for 'Flux2Pipeline'; fluxserve serves ['FluxKontextPipeline', "
                              "'FluxPipeline']")


def test_a_folder_of_another_family_is_a_load_error_naming_it(tiny_path: Path, tmp_path: Path) -> None:
    folder = tmp_path / "other"
    shutil.copytree(tiny_path, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusion3Pipeline"}))
    with pytest.raises(ModelLoadError) as exc:
        check_folder(folder)
    assert exc.value.component == "model_index.json" and "no model family for 'StableDiffusion3Pipeline'" in str(exc.value)
    assert check_folder(tiny_path) == Path(tiny_path)


def test_the_tp_plan_shards_what_the_megatron_layout_says() -> None:
    """Every block linear a FLUX.1 rank shards, by name; the AdaLN linears, embedders and final layers stay
    replicated (nn.Linear), and the fused projections have their rules too."""
    model = FluxTransformer(**SMALL)
    styles = {name: FAMILY.tp_rule(name).style for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and FAMILY.tp_rule(name) is not None}
    double = {f"transformer_blocks.0.{n}": s for n, s in {
        "attn.to_q": "column", "attn.to_k": "column", "attn.to_v": "column", "attn.add_q_proj": "column",
        "attn.add_k_proj": "column", "attn.add_v_proj": "column", "attn.to_out.0": "row", "attn.to_add_out": "row",
        "ff.net.0.proj": "column", "ff.net.2": "row", "ff_context.net.0.proj": "column", "ff_context.net.2": "row"}.items()}
    single = {f"single_transformer_blocks.0.{n}": s for n, s in {
        "attn.to_q": "column", "attn.to_k": "column", "attn.to_v": "column", "proj_mlp": "column",
        "proj_out": "row"}.items()}
    assert {k: v for k, v in styles.items() if k.startswith(("transformer_blocks.0.", "single_transformer_blocks.0."))
            } == {**double, **single}
    assert len(styles) == 2 * (len(double) + len(single))
    for name in ("transformer_blocks.1.attn.to_qkv", "transformer_blocks.1.attn.to_added_qkv",
                 "single_transformer_blocks.1.to_qkv_mlp"):
        assert FAMILY.tp_rule(name).style == "column" and FAMILY.tp_rule(name).blocks is not None
    for name in ("transformer_blocks.0.norm1.linear", "x_embedder", "proj_out", "context_embedder"):
        assert FAMILY.tp_rule(name) is None


def _inputs() -> dict:
    g = torch.Generator().manual_seed(3)
    return dict(hidden_states=torch.randn(2, 16, 16, generator=g), encoder_hidden_states=torch.randn(2, 5, 24, generator=g),
                pooled_projections=torch.randn(2, 12, generator=g), timestep=torch.tensor([0.3, 0.7]),
                img_ids=torch.stack([torch.zeros(16), torch.arange(16.) // 4, torch.arange(16.) % 4], -1),
                txt_ids=torch.zeros(5, 3), return_dict=False)


@pytest.mark.parametrize("fused", [False, True, "after"], ids=["unfused", "fused_projections", "fused_after_sharding"])
def test_a_whole_transformer_sharded_by_the_plan_matches_tp_1(collectives, fused) -> None:  # noqa: F811
    """Two ranks (threads, fake collectives) run the plan-sharded transformer; their outputs equal each other and
    tp 1's within fp32 reduction order. With fused projections each rank holds its own heads of q, k and v: a plan
    that cut the stacked rows in halves would mix q of some heads with k of others and miss by far more."""
    torch.manual_seed(0)
    reference = FluxTransformer(**SMALL).eval()
    if fused:
        FAMILY.fuse_projections(reference)
    with torch.no_grad():
        expected = reference(**_inputs())[0]

    models = []
    for _ in range(2):  # built here: threads would share the random generator while initialising
        torch.manual_seed(0)
        models.append(FluxTransformer(**SMALL).eval())
        if fused is True:
            FAMILY.fuse_projections(models[-1])

    def rank(r: int, g) -> torch.Tensor:
        model = models[r]
        shard_transformer(model, r, 2, g)
        if fused == "after":  # as a TP rank builds: shard, then convert
            FAMILY.fuse_projections(model)
        styles = {type(m.parallel) for m in model.modules() if isinstance(m, Linear)}
        assert styles == {Column, Row} and model.transformer_blocks[0].attn.heads == 2
        with torch.no_grad():
            return model(**_inputs())[0]

    out0, out1 = _spmd(2, rank)
    assert torch.equal(out0, out1)
    assert torch.allclose(out0, expected, rtol=1e-5, atol=1e-5), (out0 - expected).abs().max()


def test_fp8_layers_convert_after_sharding_and_ranks_agree(collectives, monkeypatch) -> None:  # noqa: F811
    """A TP rank quantizes its shards (the CPU runs the fp8 ops' eager twins): both ranks give the same output, and
    it is as close to tp 1's fp8 model as fp8 is to the unquantized one (a row-parallel layer quantizes each rank's
    input columns per row, so tp 2 is not bit-equal to tp 1)."""
    import model.flux1 as flux1
    from kernels.fp8 import shape_refusal

    monkeypatch.setattr(flux1, "fp8_refusal", lambda device, dtype: None)
    monkeypatch.setattr(flux1, "convertible", lambda lin: shape_refusal(lin.in_features, lin.out_features))
    big = {**SMALL, "attention_head_dim": 16, "axes_dims_rope": (4, 6, 6)}  # fp8 GEMMs: widths divisible by 16
    models = []
    for _ in range(3):
        torch.manual_seed(0)
        models.append(FluxTransformer(**big).eval())
    with torch.no_grad():
        exact = models[2](**_inputs())[0]
        FAMILY.quantize_fp8(models[2])
        tp1 = models[2](**_inputs())[0]

    def rank(r: int, g) -> torch.Tensor:
        shard_transformer(models[r], r, 2, g)
        FAMILY.quantize_fp8(models[r])
        assert all(m.quant.fp8 for m in models[r].modules() if isinstance(m, Linear) and m.parallel.world > 1)
        with torch.no_grad():
            return models[r](**_inputs())[0]

    out0, out1 = _spmd(2, rank)
    assert torch.equal(out0, out1)
    fp8_error = (tp1 - exact).abs().max()
    assert 0 < (out0 - tp1).abs().max() <= fp8_error, ((out0 - tp1).abs().max(), fp8_error)
