"""Our FluxTransformer vs diffusers' FluxTransformer2DModel: bit-exactness, weights, loading, sites.

CPU tests use a small random config that has every block type (2 double + 2 single blocks, 4 heads x 32,
RoPE axes (8, 12, 12)); every parameter is random (AdaLN and norm_out linears included, so no gate is zero), at a
realistic scale (std 0.02, like a trained DiT's): the residual stream stays near unit variance, so a wrong epsilon
or a changed reduction order moves bits. (At std 0.2 the stream grows to variance 1e4-1e6 and such bugs vanish
below fp32 rounding.)
"""

from __future__ import annotations

import inspect

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.models.transformers import transformer_flux as dflux

import kernels
import kernels.gelu
import model.flux as flux
from model.flux import FluxAttention, FluxFusedGELUProj, FluxGELU, FluxTransformer
from tests._inputs import random_flux

SMALL = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=48,
    pooled_projection_dim=24,
    axes_dims_rope=(8, 12, 12),
)
TXT, IMG = 7, 24  # text / image tokens


INIT_STD = 0.02


def _randomize(module: torch.nn.Module, seed: int, std: float = INIT_STD) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _pair(guidance_embeds: bool) -> tuple[FluxTransformer2DModel, FluxTransformer]:
    ref = FluxTransformer2DModel(**SMALL, guidance_embeds=guidance_embeds)
    _randomize(ref, seed=1 + guidance_embeds)
    ours = FluxTransformer(**SMALL, guidance_embeds=guidance_embeds)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref.eval(), ours.eval()


@pytest.fixture(scope="module")
def pairs() -> dict[bool, tuple[FluxTransformer2DModel, FluxTransformer]]:
    return {g: _pair(g) for g in (True, False)}


def _inputs(batch: int, dtype: torch.dtype, guidance: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.stack(
        [torch.zeros(IMG), torch.arange(IMG) // 6, torch.arange(IMG) % 6], dim=-1
    ).float()
    inputs = dict(
        hidden_states=torch.randn(batch, IMG, SMALL["in_channels"], generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, TXT, SMALL["joint_attention_dim"], generator=g).to(dtype),
        pooled_projections=torch.randn(batch, SMALL["pooled_projection_dim"], generator=g).to(dtype),
        timestep=torch.rand(batch, generator=g).to(dtype),
        txt_ids=torch.zeros(TXT, 3),
        img_ids=img_ids,
        return_dict=False,
    )
    if guidance:
        inputs["guidance"] = torch.full((batch,), 3.5).to(dtype)
    return inputs


def _run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("guidance", [True, False], ids=["guidance", "no-guidance"])
@pytest.mark.parametrize("batch", [1, 2])
def test_equal_to_diffusers(pairs, dtype: torch.dtype, guidance: bool, batch: int) -> None:
    ref, ours = pairs[guidance]
    ref.to(dtype), ours.to(dtype)
    try:
        inputs = _inputs(batch, dtype, guidance, seed=batch)
        expected, got = _run(ref, inputs), _run(ours, inputs)
        assert expected.shape == (batch, IMG, SMALL["in_channels"])
        assert expected.abs().sum() > 0 and torch.isfinite(expected).all()
        assert torch.equal(got, expected)
    finally:
        ref.to(torch.float32), ours.to(torch.float32)


def test_return_dict_and_cache_context(pairs) -> None:
    ref, ours = pairs[True]
    inputs = _inputs(1, torch.float32, True)
    inputs.pop("return_dict")
    with ours.cache_context("cond"):
        got = ours(**inputs)
    assert type(got).__name__ == "Transformer2DModelOutput"
    assert torch.equal(got.sample, ref(**inputs).sample)


def test_init_signature_matches_diffusers() -> None:
    ours = inspect.signature(FluxTransformer.__init__).parameters
    theirs = inspect.signature(FluxTransformer2DModel.__init__).parameters
    assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in theirs.values()]
    fours = inspect.signature(FluxTransformer.forward).parameters
    ftheirs = inspect.signature(FluxTransformer2DModel.forward).parameters
    assert [(p.name, p.default) for p in fours.values()] == [(p.name, p.default) for p in ftheirs.values()]


def test_state_dict_strict_both_ways(pairs) -> None:
    ref, ours = pairs[True]
    ref_sd, ours_sd = ref.state_dict(), ours.state_dict()
    assert list(ours_sd) == list(ref_sd)
    assert all(ours_sd[k].shape == ref_sd[k].shape for k in ref_sd)
    # ours -> a fresh diffusers model, strictly, and it computes the same thing.
    back = FluxTransformer2DModel(**SMALL, guidance_embeds=True)
    back.load_state_dict(ours_sd, strict=True)
    inputs = _inputs(2, torch.float32, True)
    assert torch.equal(_run(back, inputs), _run(ours, inputs))
    # A missing key is refused under strict loading.
    broken = dict(ref_sd)
    broken.pop("single_transformer_blocks.1.proj_mlp.bias")
    with pytest.raises(RuntimeError, match="proj_mlp.bias"):
        FluxTransformer(**SMALL, guidance_embeds=True).load_state_dict(broken, strict=True)


def test_from_pretrained_sharded_diffusers_folder_and_back(pairs, tmp_path) -> None:
    ref, _ = pairs[True]
    ref.save_pretrained(tmp_path / "diffusers", max_shard_size="300KB")
    shards = sorted(p.name for p in (tmp_path / "diffusers").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "diffusers" / "diffusion_pytorch_model.safetensors.index.json").exists()

    ours = FluxTransformer.from_pretrained(tmp_path / "diffusers")
    assert isinstance(ours, FluxTransformer)
    assert ours.config.in_channels == SMALL["in_channels"] and ours.config.guidance_embeds is True
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    # Compare with diffusers loaded from the same files: loaded weights are views into the safetensors buffers
    # with other memory alignment than `ref`'s, and CPU GEMMs round differently by alignment.
    theirs = FluxTransformer2DModel.from_pretrained(tmp_path / "diffusers")
    inputs = _inputs(1, torch.float32, True)
    assert torch.equal(_run(ours, inputs), _run(theirs, inputs))

    ours.save_pretrained(tmp_path / "ours")
    again = FluxTransformer.from_pretrained(tmp_path / "ours", torch_dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16
    theirs = FluxTransformer2DModel.from_pretrained(tmp_path / "ours")
    for k, v in ref.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v), k
        assert torch.equal(again.state_dict()[k], v.to(torch.bfloat16)), k


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple]:
    calls: list[tuple] = []
    real = getattr(flux, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(flux, name, spy)
    return calls


def test_every_residual_gate_and_gelu_site_goes_through_kernels(pairs, monkeypatch) -> None:
    ref, ours = pairs[True]
    gate_calls = _count_calls(monkeypatch, "residual_gate_add")
    gelu_calls = _count_calls(monkeypatch, "gelu_site")
    inputs = _inputs(2, torch.float32, True)
    assert torch.equal(_run(ours, inputs), _run(ref, inputs))
    n_double, n_single = SMALL["num_layers"], SMALL["num_single_layers"]
    assert len(gate_calls) == 4 * n_double + n_single
    # gates are [B, 1, D] views of the AdaLN output (batch stride 6D / 3D), as diffusers broadcasts them.
    dim = SMALL["num_attention_heads"] * SMALL["attention_head_dim"]
    assert all(g.shape == (2, 1, dim) for _, _, g in gate_calls)
    assert {g.stride(0) for _, _, g in gate_calls} == {6 * dim, 3 * dim}
    assert len(gelu_calls) == 2 * n_double + n_single
    assert all(isinstance(m, FluxFusedGELUProj) for m, _, _ in gelu_calls[: 2 * n_double])


def test_gelu_site_structure() -> None:
    m = FluxTransformer(**SMALL)
    ff0 = m.transformer_blocks[0].ff.net[0]
    assert isinstance(ff0, FluxFusedGELUProj) and type(ff0.proj) is torch.nn.Linear
    assert type(m.transformer_blocks[0].ff.net[2]) is torch.nn.Linear
    assert isinstance(m.transformer_blocks[1].ff_context.net[0], FluxFusedGELUProj)
    names = kernels.gelu.site_names(m)
    assert names == [
        "transformer_blocks.0.ff.net.0.proj",
        "transformer_blocks.0.ff_context.net.0.proj",
        "transformer_blocks.1.ff.net.0.proj",
        "transformer_blocks.1.ff_context.net.0.proj",
        "single_transformer_blocks.0.proj_mlp",
        "single_transformer_blocks.1.proj_mlp",
    ]
    assert kernels.mounted_sites(m) == []  # unmounted by default


def test_flux_gelu_wraps_any_linear_like_module() -> None:
    class ScaledLinear(torch.nn.Linear):  # a stand-in for tp/'s column-parallel linear
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    torch.manual_seed(0)
    layer = ScaledLinear(8, 16)
    site = FluxGELU(layer)
    x = torch.randn(2, 3, 8)
    assert torch.equal(site(x), torch.nn.functional.gelu(layer(x), approximate="tanh"))
    assert kernels.gelu.site_names(site) == ["proj"]


def test_mount_routes_every_site_and_unmount_restores(pairs, monkeypatch) -> None:
    """Mounted on CPU (device guard patched), the fused call runs at every site with that site's operands."""
    ref, ours = pairs[False]
    ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    try:
        inputs = _inputs(2, torch.bfloat16, False)
        expected = _run(ref, inputs)
        monkeypatch.setattr(kernels.gelu, "_device_supported", lambda device: True)
        calls: list[tuple[int, ...]] = []
        perturb = {"on": False}

        def fake_fused(x, weight, bias):
            calls.append(tuple(x.shape))
            out = torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias), approximate="tanh")
            return out * 1.5 if perturb["on"] else out

        monkeypatch.setattr(kernels.gelu, "fused_linear_gelu_tanh", fake_fused)
        report = kernels.mount(ours)
        assert report.ok and len(report.mounted) == 6
        # Fused call == the unfused pair here: the output must not move, and every site must have used it, except
        # the single blocks' when they write the GELU straight into proj_out's input (the exact path is the faster
        # one there, see kernels.gelu.gelu_site); with that write switched off they fuse too.
        n_double, n_single = SMALL["num_layers"], SMALL["num_single_layers"]
        for in_place in (True, False):
            with kernels.switches.override(single_block_in_place=in_place):
                calls.clear()
                assert torch.equal(_run(ours, inputs), expected)
            assert calls.count((2, IMG, 128)) == n_double
            assert calls.count((2, TXT, 128)) == n_double
            assert calls.count((2, TXT + IMG, 128)) == (0 if in_place else n_single)
        perturb["on"] = True
        assert not torch.equal(_run(ours, inputs), expected)
        kernels.unmount(ours)
        assert kernels.mounted_sites(ours) == []
        calls.clear()
        assert torch.equal(_run(ours, inputs), expected) and calls == []
    finally:
        kernels.unmount(ours)
        ref.to(torch.float32), ours.to(torch.float32)


def _block_pair(single: bool, dtype: torch.dtype, std: float = INIT_STD):
    dim, heads, head_dim = 128, 4, 32
    if single:
        ref = dflux.FluxSingleTransformerBlock(dim, heads, head_dim)
        ours = flux.FluxSingleTransformerBlock(dim, heads, head_dim)
    else:
        ref = dflux.FluxTransformerBlock(dim, heads, head_dim)
        ours = flux.FluxTransformerBlock(dim, heads, head_dim)
    _randomize(ref, seed=7, std=std)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref.to(dtype), ours.to(dtype)


@pytest.mark.parametrize("single", [False, True], ids=["double", "single"])
def test_fp16_overflow_clip_matches_diffusers(single: bool) -> None:
    """Drive a block into fp16 overflow: diffusers clips the text stream (double) / whole output (single)."""
    ref, ours = _block_pair(single, torch.float16, std=0.2)  # large updates, so the gate below overflows
    # A huge last gate (bias of the AdaLN linear's last gate chunk) overflows the final residual add only.
    for block in (ref, ours):
        adaln = block.norm.linear if single else block.norm1_context.linear
        with torch.no_grad():
            adaln.bias[-128:] += 3e4
    g = torch.Generator().manual_seed(3)
    h = torch.randn(1, IMG, 128, generator=g).half()
    e = torch.randn(1, TXT, 128, generator=g).half()
    temb = torch.randn(1, 128, generator=g).half()
    cos, sin = dflux.FluxPosEmbed(10000, [8, 12, 12])(torch.randint(0, 8, (TXT + IMG, 3)).float())
    with torch.no_grad():
        want = ref(h, e, temb, image_rotary_emb=(cos, sin))
        got = ours(h, e, temb, image_rotary_emb=(cos, sin))
    clipped = want[0] if not single else torch.cat(want, dim=1)
    assert (clipped.abs() == 65504).any()  # the clip fired
    for w, o in zip(want, got):
        assert torch.equal(o, w)


def test_attention_reads_heads_at_run_time() -> None:
    """What tp/ does to a built model: keep the first half of the heads' projections and set heads //= 2."""
    torch.manual_seed(0)
    attn = FluxAttention(query_dim=64, heads=4, dim_head=16, pre_only=True).eval()
    _randomize(attn, seed=5)
    x = torch.randn(2, 10, 64)
    cos, sin = dflux.FluxPosEmbed(10000, [4, 6, 6])(torch.randint(0, 8, (10, 3)).float())
    with torch.no_grad():
        full = attn(x, image_rotary_emb=(cos, sin))
        for name in ("to_q", "to_k", "to_v"):
            old = getattr(attn, name)
            new = torch.nn.Linear(64, 32)
            new.weight.copy_(old.weight[:32]), new.bias.copy_(old.bias[:32])
            setattr(attn, name, new)
        attn.heads = 2
        half = attn(x, image_rotary_emb=(cos, sin))
    assert half.shape == (2, 10, 32)
    torch.testing.assert_close(half, full[..., :32], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_flux_dev_width_equal_to_diffusers() -> None:
    """FLUX.1-dev width (3072, 24 x 128 heads) at 2 + 2 blocks, 1024^2 (4096 image + 512 text tokens), bf16:
    ours with the Triton residual-gate, QK RMSNorm+RoPE(+cat), LayerNorm+modulation and GELU-into-slice kernels
    active == diffusers, bit for bit."""
    from kernels import gelu as kgelu
    from kernels import modulate as kmod
    from kernels import residual as kres
    from kernels import rope as krope

    cfg = dict(num_layers=2, num_single_layers=2, guidance_embeds=True)
    ref = random_flux(FluxTransformer2DModel, "cuda", **cfg)
    with torch.device("cuda"):
        ours = FluxTransformer(**cfg).to(torch.bfloat16).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    dev, bf = "cuda", torch.bfloat16
    for batch in (1, 2):
        g = torch.Generator(device=dev).manual_seed(batch)
        ys, xs = torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij")
        inputs = dict(
            hidden_states=torch.randn(batch, 4096, 64, device=dev, generator=g).to(bf),
            encoder_hidden_states=torch.randn(batch, 512, 4096, device=dev, generator=g).to(bf),
            pooled_projections=torch.randn(batch, 768, device=dev, generator=g).to(bf),
            timestep=torch.full((batch,), 0.7, device=dev, dtype=bf),
            guidance=torch.full((batch,), 3.5, device=dev, dtype=bf),
            txt_ids=torch.zeros(512, 3, device=dev),
            img_ids=torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(-1, 3).float().to(dev),
            return_dict=False,
        )
        before = kres.triton_calls()
        gates = (krope.RMS_GATE, kmod.LN_GATE, kgelu.GELU_INTO_GATE)
        fused_before = [g.fast_calls for g in gates]
        expected, got = _run(ref, inputs), _run(ours, inputs)
        got_again = _run(ours, inputs)  # every signature verified now: all fused kernels serve this one
        assert kres.triton_calls() - before == 2 * (4 * 2 + 2)  # every residual-gate site ran the Triton kernel
        # (the standalone modulate gate only runs inside the LayerNorm gate's eager reference, so it is not counted)
        assert all(g.fast_calls > n for g, n in zip(gates, fused_before))
        assert all(all(g.verdicts().values()) for g in gates)
        assert torch.isfinite(expected).all()
        assert torch.equal(got, expected)
        assert torch.equal(got_again, expected)


@pytest.mark.parametrize("batch", [1, 2])
def test_token_cat_of_fused_projection_views_equals_torch_cat(batch: int) -> None:
    """The double block's [text; image] value tensor: strided column views of a fused q/k/v output are copied into
    their halves (torch.cat of such views is a slow kernel); the result is torch.cat's, value for value."""
    qkv_t, qkv_i = torch.randn(batch, 3, 3 * 8), torch.randn(batch, 5, 3 * 8)
    v_t, v_i = (t[..., 16:].unflatten(-1, (2, 4)) for t in (qkv_t, qkv_i))
    assert not v_i.is_contiguous()
    got = flux._cat_tokens(v_t, v_i)
    assert got.is_contiguous() and torch.equal(got, torch.cat([v_t, v_i], dim=1))
    a, b = v_t.contiguous(), v_i.contiguous()
    assert torch.equal(flux._cat_tokens(a, b), torch.cat([a, b], dim=1))
