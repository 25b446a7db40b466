"""8-bit attention (kernels/attention.py: int8 Q K^T, fp8 P V) and its place in the high tier.

CPU: the Triton kernels in the interpreter against the eager twin (P unrounded there, as the interpreter runs them);
the eager twin within a bound of fp32 attention, and far from it when a scale is wrong; refusals fall back to SDPA
bit for bit; the tier plan, `applied_tier`, the pipeline and the config. GPU (`-m gpu`): the kernel against its
eager twin and fp32 attention on FLUX.1-dev-shaped heads, written into a strided view, and a high batch through it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import kernels.attention as A
from deployments.config import AppArgs
from kernels.attention import attention8_sites, set_attention8
from model.flux import FluxAttention, FluxTransformer
from model.loading import load_pipeline
from model.pipeline import GenerationRequest
from model.tiers import TierPlan, applied_tier, plan_tier
from tests._interpret import run_in_interpreter


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _qkv(B: int, S: int, H: int, D: int, gain: float = 1.5, seed: int = 0, device: str = "cpu",
         dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """q and k RMS-normed per head (as FLUX's QK norm leaves them) times `gain`, v Gaussian."""
    g = torch.Generator().manual_seed(seed)

    def normed() -> torch.Tensor:
        x = torch.randn(B, S, H, D, generator=g)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain

    return tuple(t.to(device, dtype) for t in (normed(), normed(), torch.randn(B, S, H, D, generator=g)))


_PROBE = r"""
import torch
from kernels import attention as A
from kernels import _attention_fp8_triton as T

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

torch.manual_seed(0)
for B, S, H, D in ((1, 200, 2, 64), (2, 256, 3, 32)):  # S past a 128 block (masked keys) and exactly two blocks
    qkv = torch.randn(B, S, 3 * H * D + 8)  # q, k, v as strided views of one projection output
    q, k, v = (qkv[..., i * H * D:(i + 1) * H * D].unflatten(-1, (H, D)) for i in range(3))
    q8, k8, v8t, qs, ks, vs = T.quantize_qkv(q, k, v, A.VBLOCK)
    s_pad = -(-S // 128) * 128
    assert q8.dtype == k8.dtype == torch.int8 and v8t.dtype == torch.float8_e4m3fn
    assert q8.shape == (B, H, s_pad, D) and v8t.shape == (B, H, D, s_pad)
    assert ks.shape == (B, H, s_pad // 128) and vs.shape == (B, H, D)
    assert (q8[:, :, S:] == 0).all() and (v8t[..., S:].float() == 0).all()  # padding is zero
    assert q8.abs().amax(-1)[:, :, :S].eq(127).all()  # each q row's amax maps to 127
    assert v8t.float().abs().amax(-1).eq(448).all()  # each v channel's amax maps to 448
    joint = torch.zeros(B, S, H * D + 5)
    out = joint[..., 5:].unflatten(-1, (H, D))  # written into a strided view
    T.attention(q, k, v, A.VBLOCK, out)
    twin = A.fp8_attention_eager(q, k, v, round_p=False)
    assert rel(out, twin) < 1e-5, (B, S, rel(out, twin))
    assert (joint[..., :5] == 0).all()
print("8-bit attention ok")
"""


def test_the_kernels_in_the_interpreter_equal_the_eager_twin() -> None:
    """Quantization layout (int8 q/k, transposed fp8 v, zero padding, scales), masked key blocks, two sizes of head,
    strided inputs and a strided output against the eager twin (which leaves P unrounded like the interpreter)."""
    run_in_interpreter(_PROBE, "8-bit attention ok")


@pytest.mark.parametrize("D", [32, 64, 128])
def test_the_eager_twin_stays_within_a_bound_of_fp32_attention(D: int) -> None:
    q, k, v = _qkv(1, 300, 4, D)
    ref = A.sdpa(q, k, v)
    err = _rel(A.fp8_attention_eager(q, k, v), ref)
    assert err < 0.06, err  # int8 logits + e4m3 P and V on random data (measured 0.03-0.04)
    assert _rel(A.fp8_attention_eager(q, k, v, round_p=False), ref) < err  # P's rounding is part of the error
    wrong = A.fp8_attention_eager(q, k * 2, v)  # what a lost k scale would do: the bound notices
    assert _rel(wrong, ref) > 0.2


_CUDNN_PREP_PROBE = r"""
import math
import torch
from kernels import _attention_fp8_triton as T
from kernels import _high_triton as K
from kernels.rope import rope_cat_eager
F8 = torch.float8_e4m3fn
torch.manual_seed(0)
for B, Tn, In, H, D in ((1, 3, 5, 2, 64), (2, 0, 4, 3, 32)):
    wide = lambda n: (torch.randn(B, n, 3 * H * D) * 2)[..., H * D:2 * H * D].half().unflatten(-1, (H, D))
    txt, img = (None if Tn == 0 else wide(Tn)), wide(In)
    # v: [text; image] in fp8 with one scale from the amax of both
    v8, scales = T.tokens_fp8(txt, img)
    joint = img.float() if txt is None else torch.cat([txt, img], 1).float()
    amax = joint.abs().amax()
    assert v8.dtype == F8 and v8.shape == joint.shape
    assert torch.equal(v8, (joint * (448.0 / amax)).clamp(-448, 448).to(F8))
    assert torch.allclose(scales, torch.stack([amax / 448, 448 / amax]))
    assert torch.allclose(T.dequantize(v8, scales[0:1], torch.float32), joint, rtol=0.07, atol=amax / 448 * 0.02)
    # q after the fast RMSNorm + RoPE, in fp8 with the weights' bound as its scale
    wt, wi = (torch.rand(D) + 0.5).half(), (torch.rand(D) * 3 - 1.5).half()
    ids = torch.randint(0, 64, (Tn + In, 3)).float()
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed
    cos, sin = FluxPosEmbed(10000, [D // 8, 3 * D // 8, D // 2])(ids)
    q8, descale = K.rms_rope_fast(txt, img, None if txt is None else wt, wi, 1e-6, 1e-6, cos, sin, fp8=True)
    bf = K.rms_rope_fast(txt, img, None if txt is None else wt, wi, 1e-6, 1e-6, cos, sin)
    wmax = max(wi.float().abs().max(), (wi if txt is None else wt).float().abs().max())
    assert q8.dtype == F8 and torch.allclose(descale, wmax * math.sqrt(D) / 448)
    got = q8.float() * descale
    assert ((got - bf.float()).abs() <= 0.07 * bf.float().abs() + 1e-3 * descale).all()
print("cuDNN prep ok")
"""


def test_the_cudnn_path_preparation_kernels_in_the_interpreter() -> None:
    """What cuDNN's fp8 attention is fed: v as one fp8 [text; image] tensor (values and both scales exactly as the
    eager formula), the fp8 output's dequantization, and q / k in fp8 from the fast RMSNorm + RoPE pass with the
    scale its norm weights bound."""
    run_in_interpreter(_CUDNN_PREP_PROBE, "cuDNN prep ok")


def test_cudnn_fp8_attention_refuses_cpu_and_the_switch_and_returns_none(caplog, monkeypatch) -> None:
    from kernels import switches

    q, k, v = _qkv(1, 40, 2, 128)
    assert "CUDA" in A.cudnn_fp8_refusal(q)
    with switches.override(attention8_cudnn=False):
        assert "switched off" in A.cudnn_fp8_refusal(q)
    norm = torch.nn.RMSNorm(128)
    cos, sin = torch.ones(40, 128), torch.zeros(40, 128)
    caplog.set_level(logging.WARNING, logger="kernels.attention")
    A._refusals_logged.clear()
    for _ in range(2):
        assert A.rope_attention_fp8((None, q), (None, k), (None, v), (None, norm), (None, norm), cos, sin) is None
    assert sum("cuDNN fp8 attention needs a CUDA device" in r.message for r in caplog.records) == 1
    # past the device checks: a v whose (heads, head size) rows are strided is refused before any kernel runs
    monkeypatch.setattr(A, "cudnn_fp8_refusal", lambda *a: None)
    strided_v = torch.randn(1, 40, 128, 2).transpose(2, 3)
    assert A.rope_attention_fp8((None, q), (None, k), (None, strided_v), (None, norm), (None, norm), cos, sin) is None
    assert any("rows are not contiguous" in r.message for r in caplog.records)


def test_refusals_fall_back_to_sdpa_bit_for_bit_and_are_logged_once(caplog) -> None:
    q, k, v = _qkv(1, 40, 2, 64)
    assert "CUDA" in A.fp8_attention_refusal(q, k, v)
    caplog.set_level(logging.WARNING, logger="kernels.attention")
    A._refusals_logged.clear()
    for _ in range(2):
        assert torch.equal(A.attention(q, k, v, fp8=True), A.sdpa(q, k, v))
    assert sum("fp8 attention refused" in r.message for r in caplog.records) == 1
    out = torch.empty(1, 40, 2, 64)
    assert A.attention(q, k, v, fp8=True, out=out) is out and torch.equal(out, A.sdpa(q, k, v))


def test_refusal_reasons() -> None:
    if not torch.cuda.is_available():
        pytest.skip("the reasons past the device check need a CUDA tensor")
    q, k, v = _qkv(1, 40, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert A.fp8_attention_refusal(q.float(), k.float(), v.float()) is not None
    assert "mask" in A.fp8_attention_refusal(q, k, v, torch.ones(1, 40, dtype=torch.bool, device="cuda"))
    q48, k48, v48 = _qkv(1, 40, 2, 48, device="cuda", dtype=torch.bfloat16)
    assert "head sizes" in A.fp8_attention_refusal(q48, k48, v48)


def test_the_lossless_plan_refuses_attention8_and_the_high_plan_takes_it() -> None:
    with pytest.raises(ValueError, match="lossless plan"):
        TierPlan("lossless", attention8=True)
    assert not plan_tier("lossless", attention8=True).attention8
    assert plan_tier("high", attention8=True) == TierPlan("high", mount_gelu=True, attention8=True)


def test_a_step_cache_batch_keeps_graphs_and_attention8(tiny_path: Path, monkeypatch) -> None:
    """A graphed pool took attention8 on the graphs' account; a step-cache batch there still replays the blocks
    after the first from a graph (`model.execution.FirstBlockCache`), so it keeps both, as a pool without graphs keeps
    the attention8 it asked for."""
    cached = plan_tier("high", attention8=True, cuda_graphs=True, step_cache=0.1)
    assert (cached.attention8, cached.cuda_graphs, cached.step_cache) == (True, True, 0.1)
    assert plan_tier("high", attention8=True, cuda_graphs=True).attention8
    assert plan_tier("high", attention8=True, step_cache=0.1).attention8
    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    monkeypatch.setattr(type(pipe), "runs", lambda self, technique: True)
    pipe.use(attention8=True)
    pipe.enable_cuda_graphs()
    for plan in (pipe.plan("high"), pipe.plan("high", step_cache=0.2)):
        assert plan.attention8 and plan.cuda_graphs
    assert pipe.plan("high", step_cache=0.2).step_cache == 0.2 and pipe.plan("high", step_cache=0).step_cache is None
    assert pipe.plan("high", cuda_graphs=False, step_cache=0.2).attention8


def test_applied_tier_switches_every_attention_and_restores_sdpa_even_on_error() -> None:
    model = FluxTransformer(in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=32,
                            num_attention_heads=4, joint_attention_dim=48, pooled_projection_dim=24,
                            axes_dims_rope=(8, 12, 12))
    with pytest.raises(RuntimeError, match="boom"):
        with applied_tier(model, TierPlan("high", attention8=True)) as report:
            assert report.attention8_sites == attention8_sites(model) == 3
            raise RuntimeError("boom")
    assert attention8_sites(model) == 0


def test_the_pipeline_plans_attention8_for_high_on_cuda_half_only(tiny_path: Path, monkeypatch) -> None:
    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    pipe.use(attention8=True)
    assert not pipe.plan("high").attention8  # CPU fp32: SDPA stays
    monkeypatch.setattr(type(pipe), "runs", lambda self, technique: True)
    assert pipe.plan("high").attention8 and not pipe.plan("lossless").attention8
    seen: list[int] = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a: seen.append(attention8_sites(m)))
    try:
        req = GenerationRequest("a red circle", height=64, width=64, steps=1, seed=0, quality="high")
        high = pipe.generate([req])[0]
        lossless = pipe.generate([GenerationRequest("a red circle", height=64, width=64, steps=1, seed=0)])[0]
    finally:
        hook.remove()
    n = sum(1 for m in pipe.transformer.modules() if isinstance(m, FluxAttention))
    assert high.ran.attention8_sites == n > 0 and lossless.ran.attention8_sites == 0 and seen == [n, 0]
    assert attention8_sites(pipe.transformer) == 0


@pytest.mark.parametrize("raw, message", [
    ({"pools": {"lossless": {"attention8": True}}}, "high pool only"),
    ({"pools": {"high": {"attention8": 1}}}, "true or false"),
    ({"pools": {"high": {"attention8": True, "compile": True}}}, "attention8 and compile exclude each other"),
])
def test_bad_attention8_options_are_config_errors(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AppArgs.parse(raw)


def test_attention8_is_on_by_default_for_the_high_pool_where_it_was_measured() -> None:
    def pools(high: dict) -> dict:
        return AppArgs.parse({"device": "cuda", "pools": {"high": high}}).pools

    graphed = pools({"cuda_graphs": True})
    assert graphed["high"].attention8 and not graphed["lossless"].attention8
    assert not pools({})["high"].attention8  # measured fast only with CUDA graphs
    assert not pools({"cuda_graphs": True, "attention8": False})["high"].attention8
    assert not pools({"compile": True})["high"].attention8  # it does not run compiled
    assert not pools({"tp": 2})["high"].attention8  # not measured sharded: asked for, it runs
    assert pools({"tp": 2, "attention8": True})["high"].attention8
    assert AppArgs().pools == AppArgs.parse({}).pools  # built without parse, the same defaults (one home)


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------

_needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an fp8 GPU")


@pytest.mark.gpu
@_needs_fp8
@pytest.mark.parametrize("S, D", [(4608, 128), (1000, 64), (300, 32)])
def test_gpu_kernel_against_its_twin_and_fp32_attention(S: int, D: int) -> None:
    q, k, v = _qkv(1, S, 24 if D == 128 else 4, D, gain=2.0, device="cuda", dtype=torch.bfloat16)
    out = A.attention(q, k, v, fp8=True)
    twin = A.fp8_attention_eager(q, k, v)
    ref = A.sdpa(q.float(), k.float(), v.float())
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert _rel(out, twin) < 0.02, _rel(out, twin)  # P rounded against the running max vs the global one
    assert _rel(out, ref) < 0.06, _rel(out, ref)


@pytest.mark.gpu
@_needs_fp8
def test_gpu_kernel_writes_into_a_strided_view() -> None:
    q, k, v = _qkv(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16)
    joint = torch.zeros(2, 333, 4 * 64 + 16, device="cuda", dtype=torch.bfloat16)
    out = joint[..., :256].unflatten(-1, (4, 64))
    assert A.attention(q, k, v, fp8=True, out=out) is out
    assert torch.equal(out, A.attention(q, k, v, fp8=True)) and (joint[..., 256:] == 0).all()


@pytest.mark.gpu
@_needs_fp8
def test_gpu_high_batch_with_attention8(tiny_path: Path) -> None:
    pipe = load_pipeline(str(tiny_path), device="cuda", dtype=torch.bfloat16)
    req = GenerationRequest("a red circle", height=128, width=128, steps=2, seed=0, quality="high")
    plain = pipe.generate([req])[0]
    pipe.use(attention8=True)
    r = pipe.generate([req])[0]
    assert r.ran.attention8_sites > 0 and attention8_sites(pipe.transformer) == 0
    assert _rel(r.latents, plain.latents) < 0.1 and not torch.equal(r.latents, plain.latents)


_needs_cudnn_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0)
    or A.cudnn_fp8_refusal(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)) is not None,
    reason="needs Hopper and nvidia-cudnn-frontend")


@pytest.mark.gpu
@_needs_cudnn_fp8
@pytest.mark.parametrize("B, T", [(1, 512), (2, 0)])
def test_gpu_cudnn_fp8_attention_against_fp32(B: int, T: int) -> None:
    """FLUX.1-dev-shaped heads (4096 image tokens, 24 heads of 128) from a fused projection's strided views: q and k
    through RMSNorm + RoPE, v, the fp8 attention against fp32 attention of the eager normed and rotated q, k."""
    from kernels.rope import rope_cat_eager

    H, D, I, dev = 24, 128, 4096, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    norms = [torch.nn.RMSNorm(D, eps=1e-6).to(dev, torch.bfloat16) for _ in range(4)]
    with torch.no_grad():
        for n in norms:
            n.weight.copy_(torch.rand(D, device=dev, generator=g) + 0.5)
        qkv_t, qkv_i = (torch.randn(B, n, 3 * H * D, device=dev, generator=g).bfloat16() for n in (T, I))
        split = lambda t: [t[..., i * H * D:(i + 1) * H * D].unflatten(-1, (H, D)) for i in range(3)]
        (qt, kt, vt), (qi, ki, vi) = split(qkv_t), split(qkv_i)
        txt = (lambda x: x) if T else (lambda x: None)
        from tests.test_flux_lossless import _tables

        cos, sin = (t.to(dev) for t in _tables(T + I, D))
        out = A.rope_attention_fp8((txt(qt), qi), (txt(kt), ki), (txt(vt), vi), (txt(norms[0]), norms[1]),
                                   (txt(norms[2]), norms[3]), cos, sin)
        q = rope_cat_eager(txt(norms[0](qt.float())) if T else None, norms[1](qi.float()), cos, sin)
        k = rope_cat_eager(txt(norms[2](kt.float())) if T else None, norms[3](ki.float()), cos, sin)
        v = torch.cat([vt, vi], 1).float() if T else vi.float()
        ref = A.sdpa(q, k, v)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert _rel(out, ref) < 0.1, _rel(out, ref)
    assert _rel(A.sdpa(q, k, v * 2), ref) > 0.5  # the bound would notice a lost scale


@pytest.mark.gpu
@_needs_cudnn_fp8
def test_gpu_transformer_with_cudnn_fp8_attention_replays_from_a_graph_and_stays_close() -> None:
    from model.graphs import StepGraphs

    torch.manual_seed(0)
    model = FluxTransformer(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
                            num_attention_heads=2, joint_attention_dim=48, pooled_projection_dim=24,
                            axes_dims_rope=(16, 56, 56)).to("cuda", torch.bfloat16)
    S, T = 256, 32
    inputs = dict(hidden_states=torch.randn(1, S, 16, device="cuda", dtype=torch.bfloat16),
                  encoder_hidden_states=torch.randn(1, T, 48, device="cuda", dtype=torch.bfloat16),
                  pooled_projections=torch.randn(1, 24, device="cuda", dtype=torch.bfloat16),
                  timestep=torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16),
                  img_ids=torch.randint(0, 16, (S, 3), device="cuda").float(),
                  txt_ids=torch.zeros(T, 3, device="cuda"), return_dict=False)
    with torch.no_grad():
        ref = model(**inputs)[0]
        plan = TierPlan("high", attention8=True, cuda_graphs=True)
        graphs = StepGraphs()
        outs = []
        for _ in range(4):  # eager warm-ups, capture, replay
            with applied_tier(model, plan, step_graphs=graphs) as report:
                assert report.attention8_sites == 2
                outs.append(model(**inputs)[0].clone())
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert 1e-4 < _rel(outs[0], ref) < 0.1, _rel(outs[0], ref)



def test_attention_module_takes_the_cudnn_path_result_and_falls_back_when_it_refuses(monkeypatch) -> None:
    """FluxAttention.attend with attention8 on: what `rope_attention_fp8` returns is the result (flattened, or written
    into `out`); when it returns None (refused) the module runs its own path, here the exact eager one on CPU."""
    import model.flux as flux

    torch.manual_seed(0)
    attn = flux.FluxAttention(query_dim=64, heads=2, dim_head=32, added_kv_proj_dim=64)
    q, k, v = (torch.randn(1, 6, 2, 32) for _ in range(3))
    enc = tuple(torch.randn(1, 3, 2, 32) for _ in range(3))
    cos, sin = torch.ones(9, 32), torch.zeros(9, 32)
    with torch.no_grad():
        plain = attn.attend(q, k, v, enc, image_rotary_emb=(cos, sin))
        set_attention8(attn, True)
        assert torch.equal(attn.attend(q, k, v, enc, image_rotary_emb=(cos, sin)), plain)  # CPU: refused
        seen = []
        fake = torch.randn(1, 9, 2, 32)
        monkeypatch.setattr(flux, "rope_attention_fp8", lambda *a: seen.append(a) or fake)
        assert torch.equal(attn.attend(q, k, v, enc, image_rotary_emb=(cos, sin)), fake.flatten(2, 3))
        out = torch.zeros(1, 9, 64)
        assert attn.attend(q, k, v, enc, image_rotary_emb=(cos, sin), out=out) is out
        assert torch.equal(out, fake.flatten(2, 3))
    (qs, ks, vs, nq, nk, c, s, mask) = seen[0]
    assert qs == (enc[0], q) and ks == (enc[1], k) and vs == (enc[2], v) and mask is None
    assert nq == (attn.norm_added_q, attn.norm_q) and nk == (attn.norm_added_k, attn.norm_k)


@pytest.mark.gpu
@_needs_cudnn_fp8
def test_gpu_cudnn_plan_kept_in_the_kernel_cache_loads_and_computes_the_same_bits(tmp_path, monkeypatch) -> None:
    """A restarted replica takes cuDNN's built plan from the kernel cache (kernels/cache.py) instead of planning
    again, and the loaded plan computes what the built one does, bit for bit. Catches: the plan not stored, a
    stored plan not found (key drift), a loaded plan fed the wrong tensors (uids out of order)."""
    from kernels import cache

    monkeypatch.setattr(cache, "_plans", None)
    cache.use(str(tmp_path))
    B, S, H, D, dev = 1, 1024, 4, 128, torch.device("cuda")
    built = A._CudnnFp8Graph(B, S, H, D, dev)
    assert built.source == "built" and len(list((tmp_path / "cudnn").iterdir())) == 1
    loaded = A._CudnnFp8Graph(B, S, H, D, dev)
    assert loaded.source == "cache"
    g = torch.Generator(device=dev).manual_seed(0)
    q8, k8, v8 = (torch.randn(B, S, H, D, device=dev, generator=g).to(torch.float8_e4m3fn) for _ in range(3))
    dq, dk, vs = torch.full((1,), 0.5, device=dev), torch.full((1,), 0.25, device=dev), torch.tensor([1.0, 2.0], device=dev)
    a, b = built(q8, k8, v8, dq, dk, vs), loaded(q8, k8, v8, dq, dk, vs)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    swapped = loaded(k8, q8, v8, dq, dk, vs)  # the uid order matters: swapping q and k changes the result
    assert not torch.equal(a.view(torch.uint8), swapped.view(torch.uint8))
    monkeypatch.setattr(cache, "_plans", None)
