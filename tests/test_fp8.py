"""The high tier's lifetime forms: fused q/k/v projections and fp8 linear layers (kernels/fp8.py, model/flux.py
`fuse_qkv_projections` / `quantize_fp8`, the pipeline's `convert_for_high`, the pool config and the engine).

CPU: the quantization kernel in Triton's interpreter against its eager twin; the eager twin against the definition;
the fp8 layer's stacking; the refusals; fused projections == unfused (fp32); the fp8 wiring of a whole model (with the
fp8 GEMM's CPU twin) within a bound of bf16; a converted pipeline refuses lossless; config errors; the engine keeps
bf16 where fp8 is refused. GPU (`-m gpu`): Triton quantization == eager, `_scaled_mm` layer against its dequantized
reference, FLUX.1-dev-width blocks in fp8 within a bound, a converted tiny pipeline (graph replay == eager).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
import kernels.fp8 as fp8
import model.execution as execution
import model.flux as flux_mod
import model.flux1 as flux1
from deployments.config import AppArgs
from kernels.modulate import layer_norm_modulate, norm_fp8
from model.flux import FluxTransformer
from model.flux1 import quantize_fp8
from model.linear import FP8, FP8_WEIGHT_ONLY, Linear, convertible, is_fp8, linear_cat_gelu
from model.loading import load_pipeline
from model.pipeline import GenerationRequest
from tests._inputs import random_flux
from tests._interpret import run_in_interpreter

SMALL = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=32,
             num_attention_heads=4, joint_attention_dim=48, pooled_projection_dim=24, guidance_embeds=True,
             axes_dims_rope=(8, 12, 12))
TXT, IMG = 7, 24


def _model(dtype: torch.dtype = torch.float32, device: str = "cpu", **cfg) -> FluxTransformer:
    torch.manual_seed(0)
    m = FluxTransformer(**{**SMALL, **cfg})
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return m.to(device=device, dtype=dtype).eval()


def _inputs(batch: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 1,
            txt: int = TXT, img: int = IMG, width: int = 16, joint: int = 48, pooled: int = 24) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, img, width, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(batch, txt, joint, generator=g).to(device, dtype),
        pooled_projections=torch.randn(batch, pooled, generator=g).to(device, dtype),
        timestep=torch.full((batch,), 0.6).to(device, dtype),
        guidance=torch.full((batch,), 3.5, device=device),
        txt_ids=torch.zeros(txt, 3, device=device),
        img_ids=torch.stack([torch.zeros(img), torch.arange(img) // 6, torch.arange(img) % 6], -1).float().to(device),
        return_dict=False,
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---------------------------------------------------------------------------------------------------------------
# Quantization: definition, kernel (interpreter), layer
# ---------------------------------------------------------------------------------------------------------------


def test_eager_row_quantization_maps_each_rows_amax_to_the_fp8_maximum() -> None:
    x = torch.randn(6, 40, dtype=torch.float64).to(torch.bfloat16) * torch.tensor([1e-3, 1, 10, 100, 0, 3])[:, None]
    x = x.to(torch.bfloat16)
    q, scale = fp8.quantize_rows_eager(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    amax = x.float().abs().amax(-1, keepdim=True)
    assert torch.equal(scale, amax.clamp(min=fp8.MIN_AMAX) / fp8.FP8_MAX)
    assert torch.equal(q[4].float(), torch.zeros(40))  # an all-zero row stays zero, with a finite scale
    nonzero = [0, 1, 2, 3, 5]
    assert torch.equal(q[nonzero].float().abs().amax(-1), torch.full((5,), 448.0))
    # e4m3: 3 mantissa bits, so |x - dequant| <= 2^-4 |x| over the normal range
    back = q.float() * scale
    normal = x.float().abs() >= scale * 2.0 ** -6
    assert ((back - x.float()).abs() <= x.float().abs() * 2.0 ** -4 + 1e-30)[normal].all()


def test_eager_quantization_of_two_parts_shares_one_scale_and_applies_the_gelu() -> None:
    a, b = torch.randn(3, 16).to(torch.bfloat16), (torch.randn(3, 32) * 4).to(torch.bfloat16)
    q, scale = fp8.quantize_rows_eager(a, b, gelu_b=True)
    joined = torch.cat([a.float(), F.gelu(b.float(), approximate="tanh")], -1)
    q_ref, scale_ref = fp8.quantize_rows_eager(joined)
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(scale, scale_ref)


_QUANT_PROBE = r"""
import torch
from kernels import _fp8_triton as T
from kernels.fp8 import quantize_rows_eager, with_spare
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    base = torch.randn(9, 3000 + 48) * 3
    base[4] = 0  # an all-zero row
    base[5, 7] = 1e4  # one large outlier
    base[6, 48:] = -base[6, 48:].abs()  # b all negative: gelu's amax is in its dip, not at max(b)
    a = base.to(dtype)[:, :48]  # a column slice: row stride 3048
    b = base.to(dtype)[:, 48:]  # a second part longer than one block (2048): the loops wrap
    for bb, gelu in ((None, False), (b, False), (b, True)):
        q, s = T.quantize_rows(a, bb, gelu)
        qe, se = quantize_rows_eager(a, bb, gelu)
        assert q.dtype == torch.float8_e4m3fn and q.shape == qe.shape, (q.dtype, q.shape)
        assert torch.allclose(s, se, rtol=2e-6, atol=0), (dtype, gelu, (s - se).abs().max())
        qf, qef = q.float(), qe.float()
        diff = qf != qef
        if not gelu:
            assert not diff.any(), (dtype, int(diff.sum()))
        else:  # the interpreter's tanh (from exp) is not CUDA's: a few values round to the neighbouring fp8 value
            assert diff.float().mean() < 2e-3, (dtype, int(diff.sum()))
            one_step = (qf - qef).abs() <= torch.maximum(qf.abs(), qef.abs()) * 2.0 ** -3 + 2.0 ** -9
            assert one_step[diff].all()
    # rows left 40 columns longer (spare, for adapter inputs): the same values in the first K, a longer row stride
    qw, sw = T.quantize_rows(a, b, True, out=with_spare(a.shape[0], q.shape[1], 40, a.device))
    assert qw.shape == q.shape and qw.stride() == (q.shape[1] + 40, 1) and qw.dtype == torch.float8_e4m3fn
    assert torch.equal(qw.float(), qf) and torch.equal(sw, s)
q, s = T.quantize_rows(torch.zeros(0, 32), None, False)
assert q.shape == (0, 32) and s.shape == (0, 1)
# bf16 values into a strided fp8 block, saturating (an adapter's x A^T into its rows' spare columns)
src = (torch.randn(37, 48) * 300).bfloat16()
dst = torch.zeros(37, 100, dtype=torch.float8_e4m3fn)
T.copy_saturated(src, dst[:, 20:68])
assert torch.equal(dst[:, 20:68].float(), src.float().clamp(-448, 448).to(torch.float8_e4m3fn).float())
assert not dst[:, :20].float().any() and not dst[:, 68:].float().any() and dst.float().abs().max() == 448
print("fp8 quantization ok")
"""


def test_quantization_kernel_in_the_interpreter_equals_its_eager_twin() -> None:
    """Indexing, masks over several blocks, strided rows, both parts, the GELU and the zero row (the interpreter's
    own fp8 cast is wrong, so there the kernel writes fp32 and torch rounds: the GPU test covers the cast)."""
    run_in_interpreter(_QUANT_PROBE, "fp8 quantization ok")


_LN_QUANT_PROBE = r"""
import torch
from kernels import _fp8_triton as T
from kernels.fp8 import layer_norm_modulate_fp8_eager, with_spare
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    base = torch.randn(2, 5, 40 + 200) * 3
    base[1, 2] = 0.5  # a constant row: only the shift survives the norm
    x = base.to(dtype)[..., 40:]  # D = 200 (masked block of 256), row stride 240, batch stride 1200
    scale, shift = (torch.randn(2, 200) * 0.5).to(dtype), (torch.randn(2, 200)).to(dtype)
    shift[1] = 0  # and a zero shift: the constant row is all zeros (its scale: MIN_AMAX / 448)
    q, s = T.ln_modulate_quantize(x, scale, shift, 1e-6)
    ref = layer_norm_modulate_fp8_eager(x, scale, shift, 1e-6)
    assert q.dtype == torch.float8_e4m3fn and q.shape == ref.q.shape == (10, 200), (q.dtype, q.shape)
    assert torch.allclose(s, ref.scale, rtol=1e-5, atol=0), (dtype, (s - ref.scale).abs().max())
    qf, qef = q.float(), ref.q.float()
    diff = qf != qef  # the statistics' summation order differs from aten's: a rare value crosses a rounding point
    assert diff.float().mean() < 2e-3, (dtype, int(diff.sum()))
    assert ((qf - qef).abs() <= torch.maximum(qf.abs(), qef.abs()) * 2.0 ** -3 + 2.0 ** -9)[diff].all()
    assert (qf[7] == 0).all() and s[7].item() == (torch.tensor(1e-12) / 448.0).item()  # fp32
    qw, sw = T.ln_modulate_quantize(x, scale, shift, 1e-6, out=with_spare(10, 200, 16, x.device))  # longer rows
    assert qw.shape == (10, 200) and qw.stride() == (216, 1) and torch.equal(qw.float(), qf) and torch.equal(sw, s)
print("fp8 layer norm ok")
"""


def test_the_norm_that_quantizes_its_output_in_the_interpreter_equals_its_eager_twin() -> None:
    """LayerNorm + modulation + per-row fp8 in one kernel: masks (D not a power of two), strided rows, batch
    offsets of the modulation, a constant row (all zeros after the norm) against the fp32 eager definition."""
    run_in_interpreter(_LN_QUANT_PROBE, "fp8 layer norm ok")


def test_the_fp8_norm_is_the_quantized_fp32_norm_and_close_to_quantizing_the_rounded_one() -> None:
    torch.manual_seed(2)
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    scale, shift = torch.randn(2, 64, dtype=torch.bfloat16) * 0.3, torch.randn(2, 64, dtype=torch.bfloat16)
    rows = layer_norm_modulate(x, scale, shift, 1e-6, fp8=True)
    assert isinstance(rows, fp8.Fp8Rows) and rows.shape == x.shape and rows.q.shape == (14, 64)
    y = F.layer_norm(x.float(), (64,), eps=1e-6) * (1 + scale.float()[:, None]) + shift.float()[:, None]
    q, s = fp8.quantize_rows_eager(y.reshape(14, 64))
    assert torch.equal(rows.q.float(), q.float()) and torch.equal(rows.scale, s)
    # what the consumer would have quantized without the producer: the bf16 norm's rows
    q16, s16 = fp8.quantize_rows_eager(layer_norm_modulate(x, scale, shift, 1e-6).reshape(14, 64))
    assert _rel(rows.q.float() * rows.scale, q16.float() * s16) < 0.03
    layer = Linear.from_linears([nn.Linear(64, 32, dtype=torch.bfloat16)], quant=FP8)
    assert torch.equal(layer(rows), layer.matmul(rows.q, rows.scale).view(2, 7, 32))


def test_fp8_linear_stacks_layers_and_matches_its_dequantized_reference_on_cpu() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(64, n) for n in (32, 32, 48)]
    stacked = Linear.from_linears(layers, quant=FP8)
    singles = [Linear.from_linears([lin], quant=FP8) for lin in layers]
    assert stacked.weight.dtype == torch.float8_e4m3fn and stacked.out_features == 112
    # per-output-channel scales: stacking quantizes each row exactly as the layer alone does
    assert torch.equal(stacked.weight.float(), torch.cat([s.weight.float() for s in singles]))
    assert torch.equal(stacked.weight_scale, torch.cat([s.weight_scale for s in singles], dim=1))
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    y = stacked(x)
    assert y.shape == (2, 5, 112) and y.dtype == torch.bfloat16
    exact = torch.cat([F.linear(x.float(), lin.weight, lin.bias) for lin in layers], -1)
    assert _rel(y, exact) < 0.05
    q, s = fp8.quantize_rows_eager(x.reshape(-1, 64))
    ref = ((q.float() * s) @ stacked.dequantized_weight().t() + stacked.bias.float()).to(torch.bfloat16)
    assert torch.equal(y.reshape(-1, 112), ref)
    with pytest.raises(ValueError, match="in_features"):
        Linear.from_linears([nn.Linear(64, 16), nn.Linear(32, 16)], quant=FP8)


def test_linear_cat_gelu_on_a_plain_linear_is_the_eager_expression() -> None:
    lin = nn.Linear(48, 8)
    a, b = torch.randn(2, 3, 16), torch.randn(2, 3, 32)
    assert torch.equal(linear_cat_gelu(lin, a, b), lin(torch.cat([a, F.gelu(b, approximate="tanh")], -1)))
    down = nn.Linear(32, 8)
    assert torch.equal(linear_cat_gelu(down, None, b), down(F.gelu(b, approximate="tanh")))


def test_refusals_say_why() -> None:
    assert "CUDA" in fp8.fp8_refusal(torch.device("cpu"), torch.bfloat16)
    assert "divisible by 16" in fp8.shape_refusal(3072, 3070)
    assert fp8.shape_refusal(3072, 9216) is None
    assert "Conv1d is not a linear layer" in convertible(nn.Conv1d(4, 4, 1))
    assert "CUDA" in convertible(nn.Linear(32, 32))
    with pytest.raises(ValueError, match="CUDA"):
        quantize_fp8(_model(torch.bfloat16))


_NOT_SUPPORTED = ("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic( ltHandle, "
                  "computeDesc.descriptor(), Adesc.descriptor(), ...)`")


@pytest.fixture
def gemm_operands(monkeypatch) -> tuple:
    """An fp8 layer's GEMM operands on the CPU, an empty refusal table, and a list the fake `_scaled_mm`s record
    their `use_fast_accum` into."""
    monkeypatch.setattr(fp8, "REFUSED", {})
    torch.manual_seed(0)
    layer = Linear.from_linears([nn.Linear(64, 48, dtype=torch.bfloat16)], quant=FP8)
    q, s = fp8.quantize_rows_eager(torch.randn(5, 64).to(torch.bfloat16))
    return (q, layer.weight, s, layer.weight_scale, layer.bias), []


def test_a_gemm_cublas_refuses_with_fast_accumulation_runs_without_it_from_then_on(
        gemm_operands, monkeypatch, caplog) -> None:
    ops, calls = gemm_operands

    def refuses_fast(q, w_t, *, use_fast_accum, **kw):  # answers 7s where it accepts the problem
        calls.append(use_fast_accum)
        if use_fast_accum:
            raise RuntimeError(_NOT_SUPPORTED)
        return torch.full((q.shape[0], w_t.shape[1]), 7.0, dtype=torch.bfloat16)

    monkeypatch.setattr(torch, "_scaled_mm", refuses_fast)
    sevens = torch.full((5, 48), 7.0, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="kernels.fp8"):
        assert torch.equal(fp8.scaled_mm(*ops, fast=True), sevens)
        assert torch.equal(fp8.scaled_mm(*ops, fast=True), sevens)
    assert calls == [True, False, False]  # the refused form is not asked again
    assert list(fp8.REFUSED) == [(5, 64, 48, True)] and "CUBLAS_STATUS_NOT_SUPPORTED" in fp8.REFUSED[(5, 64, 48, True)]
    assert len([r for r in caplog.records if "refused by cuBLAS" in r.getMessage()]) == 1
    # another row count is another problem: it tries fast accumulation again
    q6, s6 = fp8.quantize_rows_eager(torch.randn(6, 64).to(torch.bfloat16))
    assert torch.equal(fp8.scaled_mm(q6, ops[1], s6, ops[3], ops[4], fast=True), torch.full((6, 48), 7.0).bfloat16())
    assert calls[3:] == [True, False]


def test_a_gemm_cublas_refuses_in_every_form_runs_the_eager_twin(gemm_operands, monkeypatch) -> None:
    ops, calls = gemm_operands

    def refuses(q, w_t, *, use_fast_accum, **kw):
        calls.append(use_fast_accum)
        raise RuntimeError(_NOT_SUPPORTED)

    monkeypatch.setattr(torch, "_scaled_mm", refuses)
    twin = fp8.scaled_mm_eager(*ops)
    assert torch.equal(fp8.scaled_mm(*ops, fast=True), twin)
    assert torch.equal(fp8.scaled_mm(*ops, fast=True), twin)
    assert calls == [True, False]
    q, w, s, ws, b = ops
    assert torch.equal(twin, ((q.float() * s) @ (w.float() * ws.t()).t() + b.float()).to(torch.bfloat16))
    calls.clear()
    fp8.REFUSED.clear()
    assert torch.equal(fp8.scaled_mm(*ops, fast=False), twin) and calls == [False]


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: an illegal memory access was encountered"),
                                   torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 216.00 MiB")])
def test_other_gemm_errors_are_raised_not_taken_for_a_refusal(gemm_operands, monkeypatch, error) -> None:
    ops, calls = gemm_operands

    def fails(q, w_t, *, use_fast_accum, **kw):
        calls.append(use_fast_accum)
        raise error

    monkeypatch.setattr(torch, "_scaled_mm", fails)
    with pytest.raises(type(error), match=str(error)[:20]):
        fp8.scaled_mm(*ops, fast=True)
    assert calls == [True] and fp8.REFUSED == {}


# ---------------------------------------------------------------------------------------------------------------
# The model's forms
# ---------------------------------------------------------------------------------------------------------------


def test_fused_projections_compute_the_same_block_outputs_and_drop_the_separate_layers() -> None:
    m = _model()
    inputs = _inputs(2)
    with torch.no_grad():
        ref = m(**inputs)[0]
        params = sum(p.numel() for p in m.parameters())
        m.fuse_qkv_projections()
        got = m(**inputs)[0]
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (got - ref).abs().max()
    assert sum(p.numel() for p in m.parameters()) == params  # moved, not copied
    attn = m.transformer_blocks[0].attn
    assert not hasattr(attn, "to_q") and not hasattr(attn, "add_v_proj") and attn.to_qkv.out_features == 3 * 128
    single = m.single_transformer_blocks[0]
    assert not hasattr(single, "proj_mlp") and single.to_qkv_mlp.out_features == 3 * 128 + 512
    # the single blocks' GELU sites went with proj_mlp; the double blocks' FF sites still mount
    sites = kernels.gelu.site_names(m)
    assert sites and all(".ff" in name for name in sites), sites


def test_fused_projections_are_idempotent_and_refuse_fp8_layers() -> None:
    m = _model()
    m.fuse_qkv_projections()
    fused = m.transformer_blocks[0].attn.to_qkv
    m.fuse_qkv_projections()
    assert m.transformer_blocks[0].attn.to_qkv is fused
    quantized = Linear.from_linears([nn.Linear(16, 16)], quant=FP8)
    with pytest.raises(ValueError, match="fuse projections before quantizing"):
        Linear.from_linears([quantized, quantized])


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """Let the conversion run on the CPU (the layers then multiply with their dequantized CPU twin)."""
    monkeypatch.setattr(flux1, "fp8_refusal", lambda device, dtype: None)
    monkeypatch.setattr(flux1, "convertible",
                        lambda lin: fp8.shape_refusal(lin.in_features, lin.out_features))


def _fake_quantized_twin(m: FluxTransformer, converted: FluxTransformer) -> FluxTransformer:
    """`m` (same form as `converted` before quantizing) with each layer that `converted` holds in fp8 emulated in
    eager: the fp8 layer's dequantized weight, and its input rounded per row through fp8 by a pre-hook."""
    def fake_quant(_mod, args):
        x = args[0]
        q, scale = fp8.quantize_rows_eager(x.reshape(-1, x.shape[-1]))
        return ((q.float() * scale).to(x.dtype).view(x.shape),)

    layers = dict(converted.named_modules())
    for name, mod in m.named_modules():
        if is_fp8(layers.get(name)):
            with torch.no_grad():
                mod.weight.copy_(layers[name].dequantized_weight())
            if not layers[name].quant.weight_only:  # weight-only layers (a few rows) keep their bf16 input
                mod.register_forward_pre_hook(fake_quant)
    return m


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_conversion_of_a_model_converts_every_token_linear_and_stays_close(fp8_on_cpu, fused: bool) -> None:
    """Wiring: the converted model equals its eager fp8 emulation closely (a GELU in the wrong place, a swapped
    q/k/v or a missed layer would not); against bf16 it differs by what fp8 rounding costs at random weights."""
    import copy

    m = _model(torch.bfloat16)
    inputs = _inputs(2, torch.bfloat16)
    with torch.no_grad():
        ref = m(**inputs)[0]
        if fused:
            m.fuse_qkv_projections()
        twin = copy.deepcopy(m)
        kept = quantize_fp8(m)
        with kernels.switches.override(fp8_norm_producer=False):  # the consumers quantize the bf16 norm rows
            assert not any(norm_fp8(mod) for mod in m.modules())
            got = m(**inputs)[0]
        emulated = _fake_quantized_twin(twin, m)(**inputs)[0]
    assert kept == {}
    assert _rel(got, emulated) < 0.03, _rel(got, emulated)
    linears = {name: mod for name, mod in m.named_modules()
               if isinstance(mod, (nn.Linear, Linear)) and "_blocks." in name}
    assert all(is_fp8(mod) for mod in linears.values())
    # the AdaLN linears (one row per image) are weight-only, every token linear quantizes its activation
    weight_only = sorted(name for name, mod in linears.items() if mod.quant.weight_only)
    assert len(weight_only) == 2 * len(m.transformer_blocks) + len(m.single_transformer_blocks), weight_only
    assert all(name.rsplit(".", 2)[-2].startswith("norm") for name in weight_only), weight_only
    assert all(ff.gelu_in_down_proj for ff in m.modules() if isinstance(ff, flux_mod.FluxFeedForward))
    assert all(b.mlp_gelu_in_proj_out for b in m.single_transformer_blocks)
    assert _rel(got, ref) < 0.4, _rel(got, ref)  # random weights: fp8's cost here is no quality figure
    # with the producer on (the default), every norm site quantizes its own output (3 per double block, 1 per single
    # block) instead of its consumers quantizing the bf16 norm, and the model stays as close to its emulation
    assert sum(norm_fp8(mod) for mod in m.modules()) == (3 * len(m.transformer_blocks)
                                                         + len(m.single_transformer_blocks))
    with torch.no_grad():
        produced = m(**inputs)[0]
    assert _rel(produced, emulated) < 0.03 and _rel(produced, got) < 0.03


def _compiled_runners(**kw) -> tuple:
    return (torch.compile(flux_mod.run_double_block, dynamic=False, **kw),
            torch.compile(flux_mod.run_single_block, dynamic=False, **kw))


def test_a_converted_model_traces_whole_under_torch_compile(fp8_on_cpu) -> None:
    """torch.compile on top of the fp8 + fused form: every block traces as one graph (fullgraph: no break at the
    fp8 layers, the norms' `Fp8Rows` or the fused GELU quantization) and computes what eager does, except that the
    AdaLN layers quantize their one row per image (the weight-only GEMV is a launcher, not traced)."""
    m = _model(torch.bfloat16)
    m.fuse_qkv_projections()
    quantize_fp8(m)
    inputs = _inputs(2, torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = m(**inputs)[0]
        with execution.running(m, block_runners=_compiled_runners(backend="aot_eager", fullgraph=True)):
            compiled = m(**inputs)[0]
        for layer in m.modules():  # eager with the AdaLN rows quantized too: the compiled form's arithmetic
            if is_fp8(layer):
                layer.quant = FP8
        quantized_adaln = m(**inputs)[0]
    assert torch.equal(compiled, quantized_adaln)  # aot_eager runs the same aten ops as the eager twins
    assert _rel(compiled, eager) < 0.05, _rel(compiled, eager)


def test_fp8_conversion_can_keep_the_adaln_linears_in_bf16(fp8_on_cpu) -> None:
    m = _model(torch.bfloat16)
    quantize_fp8(m, adaln=False)
    plain = sorted(name for name, mod in m.named_modules() if type(mod) is nn.Linear and "_blocks." in name)
    assert plain and all(name.rsplit(".", 2)[-2].startswith("norm") for name in plain), plain
    assert not any(mod.quant.weight_only for mod in m.modules() if is_fp8(mod))


def test_weight_only_layers_keep_a_few_rows_in_bf16_and_quantize_more() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).bfloat16()
    layer = Linear.from_linears([lin], quant=FP8_WEIGHT_ONLY)
    w = layer.dequantized_weight()
    for rows in (1, 2, fp8.WEIGHT_ONLY_ROWS):
        x = torch.randn(rows, 64).bfloat16()
        exact = x.float() @ w.t() + layer.bias.float()
        # the activation is not rounded through fp8: within bf16's rounding of the exact product, where the
        # quantized GEMM is a few percent off
        assert _rel(layer(x), exact) < 2 ** -8, _rel(layer(x), exact)
        assert _rel(layer.matmul(*fp8.quantize_rows_eager(x)), exact) > 2 ** -6
        assert torch.equal(layer(x), fp8.weight_only_linear_eager(x, layer.weight, layer.weight_scale, layer.bias))
    x = torch.randn(fp8.WEIGHT_ONLY_ROWS + 1, 64).bfloat16()
    q, s = fp8.quantize_rows_eager(x)
    assert torch.equal(layer(x), layer.matmul(q, s))  # more rows: the quantized GEMM
    with pytest.raises(ValueError, match="at most"):
        fp8.weight_only_linear(x, layer.weight, layer.weight_scale, layer.bias)
    assert repr(layer).endswith("fp8 weight-only)")


def test_weight_only_kernel_in_the_interpreter_equals_its_eager_twin() -> None:
    """Masks over N and K (80 x 200 against 32 x 64 tiles), 1, 3 and 16 rows, with and without a bias."""
    run_in_interpreter(_WEIGHT_ONLY_IN_INTERPRETER, "weight-only ok")


def test_rows_times_a_kernel_in_the_interpreter_is_the_fp32_product_cast_once() -> None:
    """The adapter input pass (`rows_times_into`): fp8 rows (ragged M, K past one tile) times an fp8 A of 48 rows
    (a stacked layer's width: not a power of two), scaled per A row, saturated into the spare columns of wider rows
    and nowhere else; each value is the fp32 product cast to e4m3 once (the eager twin rounds to bf16 first: within
    one e4m3 step of it)."""
    run_in_interpreter(_ROWS_TIMES_IN_INTERPRETER, "rows times a ok")


_ROWS_TIMES_IN_INTERPRETER = """
import torch
from kernels import _fp8_triton as T
from kernels.fp8 import quantize_rows_eager, rows_times_eager, with_spare
torch.manual_seed(0)
for M, K, W in ((70, 200, 48), (5, 96, 16)):
    q, _ = quantize_rows_eager(torch.randn(M, K))
    a, a_scale = quantize_rows_eager(torch.randn(W, K))
    a_scale = a_scale.reshape(-1) * 3.0
    a_scale[0] = 1e3  # saturates: +-448, not inf or nan
    rows = with_spare(M, K, W + 8, "cpu")
    rows.copy_(q)
    wide = rows.as_strided((M, K + W + 8), (rows.stride(0), 1))
    wide[:, K:].view(torch.uint8).fill_(0x7F)  # nan in e4m3: any column the pass should not write stays so
    T.rows_times_into(rows, a, a_scale, wide[:, K:K + W])
    exact = (q.float() @ a.float().t()) * a_scale
    want = exact.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    got = wide[:, K:K + W].float()
    assert torch.equal(rows.float(), q.float())
    assert torch.isnan(wide[:, K + W:].float()).all()
    assert (got[:, 0].abs() == 448).all(), got[:, 0]
    step = want.abs().clamp(min=2 ** -6) * 2 ** -3  # one e4m3 step (3 mantissa bits)
    assert ((got - want).abs() <= step).all() and (got == want).float().mean() > 0.97, (got - want).abs().max()
    twin = torch.empty(M, W, dtype=torch.float8_e4m3fn)
    rows_times_eager(q, a, a_scale, twin)
    assert ((twin.float() - got).abs() <= 2 * step).all()
print("rows times a ok")
"""


_WEIGHT_ONLY_IN_INTERPRETER = """
import torch
from kernels import _fp8_triton as T
from kernels.fp8 import quantize_rows_eager, weight_only_linear_eager
torch.manual_seed(0)
w, ws = quantize_rows_eager(torch.randn(80, 200))
ws = ws.t().contiguous()
bias = torch.randn(80).bfloat16()
for rows, b in ((1, bias), (3, None), (16, bias)):
    x = torch.randn(rows, 200).bfloat16()
    y = T.weight_only_linear(x, w, ws, b)
    ref = weight_only_linear_eager(x, w, ws, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 80)
    # fp32 sums in another order: at most one bf16 rounding step apart
    assert torch.allclose(y.float(), ref.float(), rtol=2 ** -7, atol=1e-3), (y.float() - ref.float()).abs().max()
print("weight-only ok")
"""


def test_fp8_layers_where_a_shape_is_refused_stay_bf16_and_are_reported(fp8_on_cpu) -> None:
    m = _model(torch.bfloat16, num_attention_heads=3, attention_head_dim=24, axes_dims_rope=(8, 8, 8))  # width 72
    kept = quantize_fp8(m)
    assert kept and all("divisible by 16" in why for why in kept.values())
    assert not any(is_fp8(mod) for mod in m.modules())
    assert not any(ff.gelu_in_down_proj for ff in m.modules() if isinstance(ff, flux_mod.FluxFeedForward))
    with kernels.switches.override(fp8_norm_producer=True):  # their consumers are bf16: the norms hand out tensors
        assert not any(norm_fp8(mod) for mod in m.modules())
    with torch.no_grad():
        assert torch.isfinite(m(**_inputs(1, torch.bfloat16, width=16))[0]).all()


# ---------------------------------------------------------------------------------------------------------------
# Pipeline, config, engine
# ---------------------------------------------------------------------------------------------------------------


def _req(quality: str = "high", seed: int = 3) -> GenerationRequest:
    return GenerationRequest("a red fox", height=64, width=64, steps=2, seed=seed, quality=quality)


def test_a_pipeline_converted_for_high_serves_high_only(tiny_path: Path) -> None:
    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    before = pipe.generate([_req()])[0]
    with pytest.raises(ValueError, match="fp8 refused: .*CUDA"):
        pipe.convert_for_high(fp8=True, fused_projections=True)
    assert not pipe.fused_projections  # a refusal changes nothing
    form = pipe.convert_for_high(fused_projections=True)
    assert form == {"fp8": False, "fused_projections": True, "kept_bf16": {}}
    after = pipe.generate([_req()])[0]
    assert torch.allclose(after.latents, before.latents, rtol=1e-4, atol=1e-4)
    assert pipe.plan("high").fused_projections
    with pytest.raises(ValueError, match="cannot serve 'lossless'"):
        pipe.generate([_req("lossless")])


@pytest.mark.parametrize("raw, message", [
    ({"pools": {"lossless": {"fp8": True}}}, "high pool only"),
    ({"pools": {"lossless": {"fused_projections": True}}}, "high pool only"),
    ({"pools": {"high": {"fp8": "yes"}}}, "true or false"),
    ({"pools": {"high": {"fused_projections": True, "compile": True}}}, "exclude each other"),
    ({"pools": {"high": {"fp8": True, "compile": True}}}, "measured slower"),
])
def test_bad_high_form_options_are_config_errors(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AppArgs.parse(raw)


_ENGINE_SCRIPT = """
import sys
from deployments.config import AppArgs
from deployments.engine import LocalEngine
args = AppArgs.parse({"model": sys.argv[1], "pools": {"high": {"fp8": True, "fused_projections": True}}})
engine = LocalEngine(args, "high")
form = engine.stats()["form"]
assert "fused_projections" in form["techniques"] and "fp8" not in form["techniques"], form
assert "CUDA" in form["refused"]["fp8"], form
assert LocalEngine(args, "lossless").stats()["form"] == {"techniques": [], "refused": {}}
print("engine form ok")
"""


def test_the_high_engine_converts_at_start_and_keeps_bf16_where_fp8_is_refused(tiny_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, str(tiny_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and "engine form ok" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------

_needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an fp8 GPU")


@pytest.mark.gpu
@_needs_fp8
@pytest.mark.parametrize("S", [4096, 512])
def test_gpu_norm_quantizing_its_output_against_eager(S: int) -> None:
    """The fp8 norm kernel at FLUX.1 width (image and text streams) against the fp32 eager definition."""
    torch.manual_seed(0)
    x = (torch.randn(2, S, 3072, device="cuda") * 4).to(torch.bfloat16)
    scale = (torch.randn(2, 3072, device="cuda") * 0.3).to(torch.bfloat16)
    shift = torch.randn(2, 3072, device="cuda").to(torch.bfloat16)
    rows = layer_norm_modulate(x, scale, shift, 1e-6, fp8=True)
    ref = fp8.layer_norm_modulate_fp8_eager(x, scale, shift, 1e-6)
    assert rows.q.dtype == torch.float8_e4m3fn and rows.q.shape == (2 * S, 3072)
    assert torch.allclose(rows.scale, ref.scale, rtol=1e-5, atol=0)
    qf, qef = rows.q.float(), ref.q.float()
    mismatch = qf != qef
    assert mismatch.float().mean() < 1e-3, int(mismatch.sum())
    assert ((qf - qef).abs() <= torch.maximum(qf.abs(), qef.abs()) * 2.0 ** -3 + 2.0 ** -9)[mismatch].all()


@pytest.mark.gpu
@_needs_fp8
@pytest.mark.parametrize("gelu", [False, True])
def test_gpu_quantization_kernel_against_eager(gelu: bool) -> None:
    torch.manual_seed(0)
    base = (torch.randn(4608, 3072 + 12288, device="cuda") * 2).to(torch.bfloat16)
    base[3] = 0
    base[5, 3072:] = -base[5, 3072:].abs()  # b all negative: gelu's amax lies in its dip, not at max(b)
    a, b = base[:, :3072], base[:, 3072:]
    q, s = fp8.quantize_rows(a, b, gelu_b=gelu)
    qe, se = fp8.quantize_rows_eager(a, b, gelu_b=gelu)
    assert torch.allclose(s, se, rtol=1e-6, atol=0)
    if gelu:  # the amax from each row's max gives the scales of the per-element amax pass
        from kernels import _fp8_triton

        q_all, s_all = _fp8_triton.quantize_rows(a, b, True, gelu_from_max=False)
        assert torch.allclose(s, s_all, rtol=1e-6, atol=0) and (q.float() != q_all.float()).float().mean() < 1e-5
        # the GELU's tanh from exp2 and a reciprocal against libdevice's tanh: a rare value crosses a rounding point
        # (measured 1.2e-4 of the values on the H200: bench/results/fp8-quant-h200.md)
        q_lib, s_lib = _fp8_triton.quantize_rows(a, b, True, exp_tanh=False)
        assert torch.allclose(s, s_lib, rtol=1e-6, atol=0) and (q.float() != q_lib.float()).float().mean() < 5e-4
    mismatch = (q.float() != qe.float())
    # where a tanh or division ulp crosses a rounding point
    assert mismatch.float().mean() < (5e-4 if gelu else 1e-4), int(mismatch.sum())
    qf, qef = q.float(), qe.float()
    assert ((qf - qef).abs() <= torch.maximum(qf.abs(), qef.abs()) * 2.0 ** -3 + 2.0 ** -9)[mismatch].all()


@pytest.mark.gpu
@_needs_fp8
def test_gpu_fp8_linear_against_its_dequantized_reference_and_bf16() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3072, 9216, device="cuda", dtype=torch.bfloat16)
    layer = Linear.from_linears([lin], quant=FP8)
    x = torch.randn(2, 2048, 3072, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    q, s = fp8.quantize_rows(x)
    ref = (q.float() * s) @ layer.dequantized_weight().t() + layer.bias.float()
    assert _rel(y.reshape(-1, 9216), ref) < 5e-3
    assert _rel(y, lin(x)) < 0.06
    # the GELU-in-quantization path
    down = Linear.from_linears([nn.Linear(9216, 3072, device="cuda", dtype=torch.bfloat16)], quant=FP8)
    h = lin(x)
    got = linear_cat_gelu(down, None, h)
    assert _rel(got, down(F.gelu(h, approximate="tanh"))) < 0.02


@pytest.mark.gpu
@_needs_fp8
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gpu_fp8_gemm_accumulation_at_the_longest_flux_reduction(fast_accum: bool) -> None:
    """The single block's proj_out (K = 15360, the longest sum): with or without the tensor cores' fast
    accumulation, the GEMM stays within 5e-3 of the fp32 product of the same fp8 operands."""
    torch.manual_seed(0)
    layer = Linear.from_linears([nn.Linear(15360, 3072, device="cuda", dtype=torch.bfloat16)], quant=FP8)
    x = torch.randn(4608, 15360, device="cuda", dtype=torch.bfloat16)
    q, s = fp8.quantize_rows(x)
    ref = (q.float() * s) @ layer.dequantized_weight().t() + layer.bias.float()
    with kernels.switches.override(fp8_fast_accum=fast_accum):
        y = layer.matmul(q, s)
    assert _rel(y, ref) < 5e-3, _rel(y, ref)


@pytest.mark.gpu
@_needs_fp8
@pytest.mark.parametrize("K", [12288, 15360])
@pytest.mark.parametrize("rows", [1, 16, 42, 64])
@pytest.mark.parametrize("forced", [False, True])
def test_gpu_fp8_gemm_takes_the_few_rows_of_the_smallest_images(monkeypatch, K: int, rows: int, forced: bool) -> None:
    """A 64x64 image is 16 tokens: the FF down-projection (K = 12288) and the single block's proj_out (K = 15360)
    must run on so few rows with fast accumulation switched on (cuBLAS refused them before FAST_ACCUM_MIN_ROWS).
    forced: fast accumulation even below that many rows, so that where this GPU refuses it (an H100 did below 43
    rows, fp8-rows-h100.md) the layer's fallback runs; either way the result is the fp8 product."""
    monkeypatch.setattr(fp8, "REFUSED", {})
    if forced:
        monkeypatch.setattr(fp8, "FAST_ACCUM_MIN_ROWS", 0)
    torch.manual_seed(0)
    layer = Linear.from_linears([nn.Linear(K, 3072, device="cuda", dtype=torch.bfloat16)], quant=FP8)
    q, s = fp8.quantize_rows(torch.randn(rows, K, device="cuda", dtype=torch.bfloat16))
    ref = (q.float() * s) @ layer.dequantized_weight().t() + layer.bias.float()
    with kernels.switches.override(fp8_fast_accum=True):
        y = layer.matmul(q, s)
    assert _rel(y, ref) < 5e-3, _rel(y, ref)
    # unforced, the 64-row rule leaves cuBLAS nothing to refuse; forced, only the fast form may be refused
    assert set(fp8.REFUSED) <= ({(rows, K, 3072, True)} if forced else set()), fp8.REFUSED


def test_fast_accumulation_starts_at_its_row_count_and_follows_its_switch() -> None:
    """The dispatch rule itself (on the CPU the layer never reaches it): below FAST_ACCUM_MIN_ROWS the promoting
    GEMM (cuBLAS refused fast accumulation for a 64x64 image's 16 rows), from it fast accumulation, never with the
    switch off. Catches `>` for `>=`, a lost switch and a changed threshold."""
    assert fp8.FAST_ACCUM_MIN_ROWS == 64  # bench/results/fp8-rows-h100.md measured the refusals below it
    with kernels.switches.override(fp8_fast_accum=True):
        assert [fp8.fast_accumulation(m) for m in (1, 16, 63, 64, 65, 4608)] == [False] * 3 + [True] * 3
    with kernels.switches.override(fp8_fast_accum=False):
        assert not any(fp8.fast_accumulation(m) for m in (1, 63, 64, 4608))


@pytest.mark.parametrize("cuda, capability, dtype, scaled_mm, reason", [
    (False, None, torch.bfloat16, True, "CUDA is not available"),
    (True, (8, 6), torch.bfloat16, True, "fp8 GEMMs need compute capability >= 8.9 (Ada/Hopper); this GPU is 8.6"),
    (True, (8, 9), torch.bfloat16, True, None),  # Ada
    (True, (9, 0), torch.bfloat16, True, None),  # Hopper
    (True, (9, 0), torch.float16, True, "fp8 GEMMs with row-wise scales write bf16; the model is torch.float16"),
    (True, (10, 0), torch.float32, True, "fp8 GEMMs with row-wise scales write bf16; the model is torch.float32"),
    (True, (9, 0), torch.bfloat16, False, "this torch has no torch._scaled_mm"),
    (True, (9, 0), torch.bfloat16, "no triton", "triton is not installed"),
])
def test_fp8_refusal_reasons_in_order(monkeypatch, cuda: bool, capability, dtype, scaled_mm: bool | str,
                                      reason: str | None) -> None:
    """The refusal rule on a CUDA device as this CPU machine pretends to see one (availability, compute capability
    from 8.9 asked of the model's device, bf16 only, `torch._scaled_mm` present, Triton installed), each reason
    whole; the CPU's own refusal names the device. The pretended GPU 0 is too old: a rule that asked the current
    device instead of the model's (GPU 1) would refuse."""
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: capability if device == torch.device("cuda", 1) else (7, 0))
    if scaled_mm is False:
        monkeypatch.delattr(torch, "_scaled_mm")
    if scaled_mm == "no triton":
        monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert fp8.fp8_refusal(torch.device("cuda", 1), dtype) == reason
    assert fp8.fp8_refusal(torch.device("cpu"), torch.bfloat16) == "fp8 GEMMs need a CUDA device (model is on cpu)"


def test_convertible_names_what_stops_a_layer(monkeypatch) -> None:
    assert convertible(Linear.from_linears([nn.Linear(16, 16)], quant=FP8)) == "already fp8"
    assert convertible(nn.Linear(32, 16)) == "fp8 GEMMs need a CUDA device (model is on cpu)"
    seen = []
    monkeypatch.setattr(fp8, "fp8_refusal", lambda device, dtype: seen.append((device.type, dtype)))
    assert convertible(nn.Linear(32, 16, dtype=torch.bfloat16)) is None and seen == [("cpu", torch.bfloat16)]
    assert convertible(nn.Linear(30, 16)) == "fp8 GEMM needs in/out features divisible by 16, got 30 -> 16"
    assert convertible(nn.Linear(32, 24)) == "fp8 GEMM needs in/out features divisible by 16, got 32 -> 24"


def test_scaled_mm_hands_torch_the_layers_operands(monkeypatch) -> None:
    """On the CPU, a stand-in for `torch._scaled_mm` that computes what the op is documented to compute
    (a [M, K] scaled by scale_a [M, 1] @ b [K, N] scaled by scale_b [1, N], + bias, in out_dtype) must give the eager
    twin's product: catches an operand, a scale or the bias passed wrong, or the output dtype dropped."""
    calls = []

    def documented(a, b, *, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False):
        calls.append(use_fast_accum)
        out = (a.float() * scale_a) @ (b.float() * scale_b)
        return (out if bias is None else out + bias.float()).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", documented)
    monkeypatch.setattr(fp8, "REFUSED", {})
    torch.manual_seed(0)
    layer = Linear.from_linears([nn.Linear(32, 48)], quant=FP8)
    q, s = fp8.quantize_rows(torch.randn(5, 32))
    for fast in (True, False):
        got = fp8.scaled_mm(q, layer.weight, s, layer.weight_scale, layer.bias, fast)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, fp8.scaled_mm_eager(q, layer.weight, s, layer.weight_scale, layer.bias))
    assert calls == [True, False]


def test_fp8_layer_form_bias_free_layers_and_repr() -> None:
    """The layer's parameters are what the GEMM needs (fp8 weight, fp32 channel scales [1, N], a bf16 bias, none
    trainable); a layer stacked from bias-free linears has no bias; stacking refusals say why."""
    torch.manual_seed(0)
    layer = Linear.from_linears([nn.Linear(32, 16), nn.Linear(32, 16)], quant=FP8)
    assert (layer.weight.dtype, layer.weight_scale.dtype, layer.bias.dtype) == (fp8.FP8, torch.float32, torch.bfloat16)
    assert layer.weight_scale.shape == (1, 32) and not any(p.requires_grad for p in layer.parameters())
    assert repr(layer) == "Linear(in_features=32, out_features=32, bias=True, fp8)"
    plain = [nn.Linear(32, 16, bias=False)]
    free = Linear.from_linears(plain, quant=FP8_WEIGHT_ONLY)
    assert free.bias is None
    assert repr(free) == "Linear(in_features=32, out_features=16, bias=False, fp8 weight-only)"
    x = torch.randn(3, 32)
    assert torch.equal(free(x), fp8.weight_only_linear_eager(x, free.weight, free.weight_scale, None))
    with pytest.raises(ValueError) as exc:
        Linear.from_linears([nn.Linear(32, 16), nn.Linear(16, 16)], quant=FP8)
    assert str(exc.value) == "stacked linears must share in_features"
    with pytest.raises(ValueError) as exc:
        Linear.from_linears([nn.Linear(32, 16), nn.Linear(32, 16, bias=False)], quant=FP8)
    assert str(exc.value) == "stacked linears must all have a bias or none"


def test_quantization_entry_points_default_to_no_gelu_and_check_shapes() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(4, 16), torch.randn(4, 16)
    plain = fp8.quantize_rows_eager(torch.cat([a, b], -1))
    for got in (fp8.quantize_rows_eager(a, b), fp8.quantize_rows(a, b)):  # no GELU unless asked
        assert torch.equal(got[0].float(), plain[0].float()) and torch.equal(got[1], plain[1])
    gelu = fp8.quantize_rows_eager(a, b, gelu_b=True)
    assert not torch.equal(gelu[1], plain[1])
    with pytest.raises(ValueError) as exc:
        fp8.quantize_rows(torch.randn(2, 3, 16), torch.randn(4, 16))
    assert str(exc.value) == "quantize_rows: (2, 3, 16) and (4, 16) have different leading shapes"
    w = Linear.from_linears([nn.Linear(32, 16)], quant=FP8_WEIGHT_ONLY)
    with pytest.raises(ValueError) as exc:
        fp8.weight_only_linear(torch.randn(17, 32), w.weight, w.weight_scale, w.bias)
    assert str(exc.value) == "weight_only_linear: 17 rows, at most 16"


def test_a_weight_only_layer_keeps_the_leading_shape() -> None:
    """A batch of one-row inputs [B, 1, K] (the AdaLN modulation's) comes back [B, 1, N], equal to its twin."""
    torch.manual_seed(0)
    layer = Linear.from_linears([nn.Linear(32, 48)], quant=FP8_WEIGHT_ONLY)
    x = torch.randn(3, 1, 32)
    y = layer(x)
    assert y.shape == (3, 1, 48)
    assert torch.equal(y.reshape(3, 48), fp8.weight_only_linear_eager(x.reshape(3, 32), layer.weight,
                                                                      layer.weight_scale, layer.bias))


@pytest.mark.gpu
@_needs_fp8
def test_gpu_scaled_mm_gets_fast_accumulation_by_row_count(monkeypatch) -> None:
    """A spy on `torch._scaled_mm`: the layer asks for fast accumulation at 64 rows and more, not at 63 or 16, and
    never with the switch off; the GEMM's other arguments are the layer's own (row scales, channel scales, bias)."""
    monkeypatch.setattr(fp8, "REFUSED", {})
    calls = []
    real = torch._scaled_mm

    def spy(a, b, **kw):
        calls.append((a.shape[0], kw["use_fast_accum"], kw["scale_a"].shape, kw["scale_b"].shape, kw["bias"] is not None,
                      kw["out_dtype"]))
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    torch.manual_seed(0)
    layer = Linear.from_linears([nn.Linear(3072, 1024, device="cuda", dtype=torch.bfloat16)], quant=FP8)
    for switch in (True, False):
        with kernels.switches.override(fp8_fast_accum=switch):
            for rows in (16, 63, 64, 256):
                calls.clear()
                layer(torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16))
                assert calls == [(rows, switch and rows >= 64, (rows, 1), (1, 1024), True, torch.bfloat16)], calls


@pytest.mark.gpu
@_needs_fp8
@pytest.mark.parametrize("rows", [1, 2, 16])
def test_gpu_weight_only_layer_against_its_eager_twin(monkeypatch, rows: int) -> None:
    """The AdaLN modulation's shape (3072 -> 18432), bf16 rows against the fp8 weight, through the Triton GEMV:
    the eager twin is refused while the layer runs, so CUDA rows sent to it (a wrong device test) fail here."""
    torch.manual_seed(0)
    layer = Linear.from_linears([nn.Linear(3072, 18432, device="cuda", dtype=torch.bfloat16)],
                                quant=FP8_WEIGHT_ONLY)
    x = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16)
    twin = fp8.weight_only_linear_eager
    with monkeypatch.context() as m:
        m.setattr(fp8, "weight_only_linear_eager", lambda *a: pytest.fail("CUDA rows took the eager twin"))
        y = layer(x)
    ref = twin(x, layer.weight, layer.weight_scale, layer.bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 18432)
    assert torch.allclose(y.float(), ref.float(), rtol=2 ** -7, atol=1e-2), (y.float() - ref.float()).abs().max()


def _flux_dev_width(side: int) -> tuple[FluxTransformer, dict]:
    """Two double and two single FLUX.1-dev-width blocks (random bf16 weights, CUDA) and inputs of 512 text tokens and
    a side x side image."""
    m = random_flux(device="cuda", num_layers=2, num_single_layers=2, guidance_embeds=True)
    inputs = _inputs(1, torch.bfloat16, "cuda", txt=512, img=side * side, width=64, joint=4096, pooled=768)
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    inputs["img_ids"] = torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(-1, 3).float().cuda()
    return m, inputs


@pytest.mark.gpu
@_needs_fp8
@pytest.mark.parametrize("side", [64, 4])
def test_gpu_flux_dev_width_blocks_in_fp8_stay_close_to_bf16(side: int) -> None:
    """Side 4: a 64x64 image's 16 tokens, the fewest rows a request can bring to the image-only GEMMs."""
    m, inputs = _flux_dev_width(side)
    import copy

    with torch.no_grad():
        ref = m(**inputs)[0]
        m.fuse_qkv_projections()
        fused = m(**inputs)[0]
        twin = copy.deepcopy(m)
        assert quantize_fp8(m) == {}
        got = m(**inputs)[0]
        emulated = _fake_quantized_twin(twin, m)(**inputs)[0]
    assert _rel(fused, ref) < 0.01, _rel(fused, ref)
    # The wiring: the fp8 layers against their eager emulation (bf16 GEMMs on dequantized operands). At this width
    # random weights amplify the emulation's own bf16 roundings (measured 0.052, fp8 vs bf16 0.07); a misplaced GELU
    # or a swapped projection is far outside. The tight wiring bound is the CPU test above.
    assert _rel(got, emulated) < 0.08, _rel(got, emulated)
    assert _rel(got, ref) < 0.15, _rel(got, ref)  # random weights at 0.02: a bound, not a quality figure


@pytest.mark.gpu
@_needs_fp8
def test_gpu_compiled_fp8_blocks_stay_close_to_the_eager_fp8_form() -> None:
    """Inductor on top of the converted form (our kernels take their eager twins inside the trace): one graph per
    block type, close to eager fp8 at FLUX.1-dev width."""
    m, inputs = _flux_dev_width(32)
    with torch.no_grad():
        ref = m(**inputs)[0]
    m.fuse_qkv_projections()
    assert quantize_fp8(m) == {}
    torch._dynamo.reset()
    with torch.no_grad():
        eager = m(**inputs)[0]
        with execution.running(m, block_runners=_compiled_runners(fullgraph=True)):
            compiled = m(**inputs)[0]
    # The AdaLN rows quantized (not in eager) and Inductor's reduction orders, amplified by random weights at this
    # width: measured 0.081 (eager fp8 against its own emulation: 0.052, above); a misplaced GELU or a swapped
    # projection lands far outside. Both stay as close to bf16 as the eager fp8 form does.
    assert _rel(compiled, eager) < 0.12, _rel(compiled, eager)
    assert _rel(compiled, ref) < 0.15 and _rel(eager, ref) < 0.15, (_rel(compiled, ref), _rel(eager, ref))


@pytest.mark.gpu
@_needs_fp8
def test_gpu_pipeline_holds_its_fp8_form_and_graph_replay_equals_eager(tiny_path: Path) -> None:
    pipe = load_pipeline(str(tiny_path), device="cuda", dtype=torch.bfloat16)
    bytes_before = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    lossless = pipe.generate([_req("lossless")])[0]
    form = pipe.convert_for_high(fp8=True, fused_projections=True)
    assert form["fp8"] and form["fused_projections"] and form["kept_bf16"] == {}
    assert sum(p.numel() * p.element_size() for p in pipe.transformer.parameters()) < 0.75 * bytes_before
    sg = pipe.enable_cuda_graphs()
    try:
        eager = pipe.generate([_req(), _req(seed=4)], cuda_graphs=False)
        graphed = pipe.generate([_req(), _req(seed=4)], cuda_graphs=True)
        n_fp8 = sum(is_fp8(m) for m in pipe.transformer.modules())
        assert graphed[0].ran.graphed and not eager[0].ran.graphed and n_fp8 > 0
        assert graphed[0].ran.fp8_layers == eager[0].ran.fp8_layers == n_fp8 and graphed[0].ran.fused_projections
        assert sg.replays == 2 and sg.eager_fallbacks == 0, sg.stats()
        for e, g in zip(eager, graphed):
            assert torch.equal(e.latents, g.latents) and e.png == g.png
    finally:
        pipe.disable_cuda_graphs()
    assert _rel(eager[0].latents, lossless.latents) < 0.2  # random tiny weights: wiring, not quality
    assert is_fp8(pipe.transformer.single_transformer_blocks[0].to_qkv_mlp)  # still held
    with pytest.raises(ValueError, match="cannot serve 'lossless'"):
        pipe.generate([_req("lossless")])


# ---------------------------------------------------------------------------------------------------------------
# Step cache (First-Block-Cache)
# ---------------------------------------------------------------------------------------------------------------


class _BlockCalls:
    """Counts double-block calls (single blocks run through `forward_joint`, below any hook)."""

    def __init__(self, m: FluxTransformer) -> None:
        self.count = 0
        for block in m.transformer_blocks:
            block.register_forward_pre_hook(self._hit)

    def _hit(self, *_a) -> None:
        self.count += 1


def test_step_cache_reuses_the_rest_residual_when_the_first_block_barely_changed() -> None:
    m = _model()
    inputs = _inputs(2)
    calls = _BlockCalls(m)
    with torch.no_grad():
        full = m(**inputs)[0]
        calls.count = 0
        cache = execution.FirstBlockCache(threshold=0.05)
        with execution.running(m, step_cache=cache):
            first = m(**inputs)[0]  # computed: nothing cached yet
            same = m(**inputs)[0]  # same inputs: first residual unchanged -> skipped
            moved = m(**{**inputs, "hidden_states": inputs["hidden_states"] * 3})[0]  # a large change: computed
    assert torch.equal(first, full)
    assert (cache.computed, cache.skipped) == (2, 1)
    assert calls.count == 2 + 1 + 2  # both double blocks per computed step, the first one only when skipped
    assert torch.allclose(same, full, rtol=1e-5, atol=1e-5)  # skipped step: first block + the cached residual
    assert not torch.allclose(moved, full)


class _Taps:
    """Records, for uncached forwards, the image stream after the first double block, the hidden states entering
    the output norm (after every block) and the temb that norm gets: the pieces a skipped step is made of."""

    def __init__(self, m: FluxTransformer) -> None:
        self.first: list[torch.Tensor] = []
        self.last: list[tuple[torch.Tensor, torch.Tensor]] = []
        m.transformer_blocks[0].register_forward_hook(lambda _m, _a, out: self.first.append(out[1]))
        m.norm_out.register_forward_pre_hook(lambda _m, args: self.last.append((args[0], args[1])))


def test_a_skipped_step_reuses_the_latest_computed_steps_residual() -> None:
    """compute / skip / compute / skip, checked against full forwards: a computed step equals the uncached forward;
    a skipped step equals the output layers on (its own first block's output + the residual of every later block
    in the step computed last). Catches a reversed threshold comparison (the decisions flip), a cache that keeps
    its first stored residual (the second skip would add the first step's), and a skip that adds the first block's
    residual instead of the later blocks'."""
    m = _model()
    a = _inputs(1)
    near = lambda x, eps: {**x, "hidden_states": x["hidden_states"] * (1 + eps)}  # noqa: E731
    b = {**a, "hidden_states": a["hidden_states"] * 3 + 0.5}  # a large change of the first block's residual
    sequence = [a, near(a, 1e-4), b, near(b, 2e-4)]
    with torch.no_grad():
        taps = _Taps(m)
        full = [m(**x)[0] for x in sequence]  # every block, no cache
        cache = execution.FirstBlockCache(threshold=0.05)
        with execution.running(m, step_cache=cache):
            cached = []
            for x in sequence:
                before = cache.skipped
                cached.append((m(**x)[0], cache.skipped > before))
        assert [skipped for _, skipped in cached] == [False, True, False, True]
        assert (cache.computed, cache.skipped) == (2, 2)
        for i in (0, 2):
            assert torch.equal(cached[i][0], full[i])
        for i, latest in ((1, 0), (3, 2)):
            rest = taps.last[latest][0] - taps.first[latest]  # what the latest computed step's later blocks added
            temb = taps.last[i][1]
            expected = m.proj_out(m.norm_out(taps.first[i] + rest, temb))
            assert torch.equal(cached[i][0], expected), i
            assert not torch.allclose(cached[i][0], full[i], atol=0, rtol=0)  # a skip is not a full step
        # with the first step's residual instead of the latest one the last step would differ
        stale = m.proj_out(m.norm_out(taps.first[3] + (taps.last[0][0] - taps.first[0]), taps.last[3][1]))
        assert not torch.allclose(cached[3][0], stale, rtol=1e-3, atol=1e-3)


def test_the_step_cache_decides_by_the_relative_change_of_the_first_residual() -> None:
    """The rule itself, on hand-made residuals: skip when mean |new - last| / mean |last| is below the threshold
    (strictly), never before a computed step, never across a change of shape (another batch's residual)."""
    cache = execution.FirstBlockCache(threshold=0.1)
    last = torch.tensor([[1.0, -2.0, 3.0, -4.0]])  # mean |last| = 2.5
    assert not cache.can_skip(last)  # nothing computed yet
    cache.store(last, torch.ones(1, 4))
    assert cache.can_skip(last + torch.tensor([[0.2, -0.2, 0.2, -0.2]]))  # change 0.2 / 2.5 = 0.08
    assert not cache.can_skip(last + 0.25)  # 0.25 / 2.5 = 0.1: not below
    assert not cache.can_skip(last * 2)  # 1.0
    assert not cache.can_skip(torch.ones(2, 4))  # another shape: never compared
    assert torch.equal(cache.skip(torch.zeros(1, 4)), torch.ones(1, 4)) and cache.skipped == 1
    assert execution.FirstBlockCache(0.0).threshold == 0.0 and not execution.FirstBlockCache(0.0).can_skip(last)


class _RecordingGraphs:
    """Stands in for `model.graphs.StepGraphs`: records what the forward hands it and runs it eagerly."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def __call__(self, module: nn.Module, eager, kwargs: dict) -> object:
        self.calls.append((eager.__name__, tuple(sorted(kwargs))))
        return eager(**kwargs)


def test_step_cache_hands_only_the_blocks_after_the_first_to_the_step_graphs() -> None:
    """With graphs, a cached batch's computed step runs the first block eager (its residual decides on the host)
    and passes the others, tensors only, to the graphs; a skipped step passes nothing. Same results as without."""
    m = _model()
    inputs = _inputs(2)
    moved = {**inputs, "hidden_states": inputs["hidden_states"] * 3}
    outs = {}
    for graphed in (False, True):
        cache, graphs = execution.FirstBlockCache(threshold=0.05), _RecordingGraphs()
        with torch.no_grad(), execution.running(m, step_cache=cache, step_graphs=graphs if graphed else None):
            outs[graphed] = [m(**x)[0] for x in (inputs, inputs, moved)]
        assert (cache.computed, cache.skipped) == (2, 1)
    rest = ("_blocks_after_first", ("encoder_hidden_states", "hidden_states", "rope_cos", "rope_sin", "temb"))
    assert graphs.calls == [rest, rest]  # the two computed steps; the whole forward never
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))


def test_step_cache_threshold_zero_never_skips_and_the_lossless_plan_refuses_it() -> None:
    from model.tiers import TierPlan, plan_tier

    m = _model()
    inputs = _inputs(1)
    cache = execution.FirstBlockCache(0.0)
    with torch.no_grad(), execution.running(m, step_cache=cache):
        outs = [m(**inputs)[0] for _ in range(3)]
    assert (cache.computed, cache.skipped) == (3, 0) and all(torch.equal(o, outs[0]) for o in outs)
    assert plan_tier("lossless", step_cache=0.1).step_cache is None
    plan = plan_tier("high", step_cache=0.1, cuda_graphs=True)
    assert plan.step_cache == 0.1 and plan.cuda_graphs  # the blocks after the first replay their own graph
    with pytest.raises(ValueError, match="lossless plan"):
        TierPlan("lossless", step_cache=0.1)
    with pytest.raises(ValueError, match=">= 0"):
        execution.FirstBlockCache(-1)


def test_pipeline_step_cache_counts_skipped_steps(tiny_path: Path) -> None:
    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    base = pipe.generate([GenerationRequest("a red fox", height=64, width=64, steps=6, seed=1, quality="high")])[0]
    assert "cached_steps" not in base.timings
    pipe.use(step_cache=0.9)  # random tiny weights: a loose threshold so that some steps are skipped
    got = pipe.generate([GenerationRequest("a red fox", height=64, width=64, steps=6, seed=1, quality="high")])[0]
    assert 1 <= got.timings["cached_steps"] <= 5
    assert not torch.equal(got.latents, base.latents)
    lossless = pipe.generate([GenerationRequest("a red fox", height=64, width=64, steps=6, seed=1)])[0]
    assert "cached_steps" not in lossless.timings  # lossless never caches


def test_a_requests_step_cache_overrides_the_pools(tiny_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`GenerationRequest.step_cache`: a threshold of its own for one batch (the same images as a pool with that
    threshold), 0 for every step computed whatever the pool's, None for the pool's; lossless refuses it."""
    from model.__main__ import main

    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)

    def high(**kw: object) -> object:
        return pipe.generate([GenerationRequest("a red fox", height=64, width=64, steps=6, seed=1, quality="high",
                                                **kw)])[0]

    plain = high()
    asked = high(step_cache=0.9)  # the pool has no cache: the request's own
    assert 1 <= asked.timings["cached_steps"] <= 5 and not torch.equal(asked.latents, plain.latents)
    pipe.use(step_cache=0.9)
    pooled = high()
    assert torch.equal(pooled.latents, asked.latents) and pooled.png == asked.png
    off = high(step_cache=0.0)  # the pool caches, this request computes every step
    assert "cached_steps" not in off.timings and torch.equal(off.latents, plain.latents)
    with pytest.raises(ValueError, match="step_cache is for quality 'high' only"):
        pipe.generate([GenerationRequest("a red fox", height=64, width=64, steps=2, step_cache=0.1)])
    with pytest.raises(ValueError, match=r"step_cache must be a number in \[0, 1\)"):
        high(step_cache=1.0)
    # the CLI takes it too, and refuses it for lossless before loading anything
    assert main(["generate", "--model", str(tiny_path), "--step-cache", "0.1", "--out", "/nonexistent/x.png"]) == 2
    assert "step_cache is for quality 'high' only" in capsys.readouterr().err


@pytest.mark.parametrize("raw, message", [
    ({"pools": {"lossless": {"step_cache_threshold": 0.1}}}, "high pool only"),
    ({"pools": {"high": {"step_cache_threshold": 1.5}}}, r"\[0, 1\)"),
    ({"pools": {"high": {"step_cache_threshold": True}}}, r"\[0, 1\)"),
])
def test_bad_step_cache_options_are_config_errors(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AppArgs.parse(raw)
    assert AppArgs.parse({"pools": {"high": {"step_cache_threshold": 0.1}}}).pools["high"].step_cache_threshold == 0.1
    graphed = AppArgs.parse({"device": "cuda", "pools": {"high": {"step_cache_threshold": 0.1, "cuda_graphs": True}}})
    assert graphed.pools["high"].cuda_graphs and graphed.pools["high"].step_cache_threshold == 0.1


def test_rows_of_strided_and_batched_activations_quantize_as_their_contiguous_copies() -> None:
    """`quantize_rows` takes [..., K] activations of any layout (a column slice of a wider buffer, a transposed
    view, leading batch dims): the rows are those of the contiguous copy. Bug caught: the layout fix-up dropped
    (a slice's rows read with the wrong stride, or no tensor at all)."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(2, 5, 48, generator=g, dtype=torch.float32)
    for a in (wide[..., 16:32], wide.transpose(1, 2), wide[..., ::2], wide[:, ::2, :]):  # the middle two: K strided
        q, scale = fp8.quantize_rows(a)
        q_ref, scale_ref = fp8.quantize_rows_eager(a.contiguous().reshape(-1, a.shape[-1]))
        assert q.shape == (a.shape[:-1].numel(), a.shape[-1])
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)


def _adapter_everywhere(slots, g: torch.Generator) -> dict:
    """A rank-4 adapter on every source layer the slots serve in fp8 with quantized rows (unit rows of A, B a few
    percent of W)."""
    tensors = {}
    for source, (served, part) in sorted(slots.origin.items()):
        layer = slots.layers[served]
        if not is_fp8(layer) or layer.quant.weight_only:
            continue
        sizes = [size for _, size in layer.parts] or [layer.out_features]
        k = layer.in_features
        tensors[source] = (torch.randn(4, k, generator=g) / k ** 0.5, torch.randn(sizes[part], 4, generator=g) * 0.01,
                           1.0)
    return tensors


def test_the_fp8_form_hands_each_adapter_layer_rows_with_the_room_it_needs(fp8_on_cpu, monkeypatch) -> None:
    """The converted form (fused projections, fp8, the norms and the GELU passes quantizing) with an adapter on
    every fp8 projection, served inside the GEMMs: each such layer gets its rows from the pass that made them with
    the spare columns its images' adapters need (no copy into wider rows; the attention outputs' layers quantize
    their own input), and the adapters change the output. Would catch a producer not asked for room (the norms'
    consumers, the GELU pass's layer). (The arithmetic of a wide layer: tests/test_adapter_slots.py.)"""
    import model.adapter_slots as slots_mod
    from kernels import switches

    m = _model(torch.bfloat16)
    m.fuse_qkv_projections()
    quantize_fp8(m)
    slots = slots_mod.AdapterSlots(m, rank=16, rows=2)
    with switches.override(adapters_in_fp8_gemm=True):
        slots.add("ink", _adapter_everywhere(slots, torch.Generator().manual_seed(6)))
    wide_layers = [layer for layer in slots.layers.values() if layer.side is not None and layer.side.wide]
    assert len(wide_layers) == 2 * 8 + 2 * 2  # double: q/k/v, out and FF up, down, per stream; single: 2
    seen: list[tuple[int, int]] = []
    real = slots_mod.Side.matmul

    def spy(self, layer, x, bias):
        seen.append((x.spare if isinstance(x, fp8.Fp8Rows) else -1, x.shape[0] * self.width))
        return real(self, layer, x, bias)

    inputs = _inputs(2, torch.bfloat16)
    with torch.no_grad(), monkeypatch.context() as mp:
        mp.setattr(slots_mod.Side, "matmul", spy)
        plain = m(**inputs)[0]
        slots.compose([(("ink", 1.0),), (("ink", -0.5),)])
        wide = m(**inputs)[0]
    assert len(seen) == len(wide_layers) and all(spare >= need for spare, need in seen if spare >= 0), seen
    assert sum(spare < 0 for spare, _ in seen) == 2 * 2, seen  # to_out and to_add_out of each double block
    assert _rel(wide, plain) > 1e-3


def test_rows_with_spare_columns_are_fp8_views_of_wider_rows_and_say_how_many() -> None:
    """`with_spare` and the eager quantization's `spare`: fp8 [M, K] views whose rows are K + spare long (the
    default: contiguous), `Fp8Rows.spare` / `wide` read them back, and asking for more room than there is fails.
    `copy_saturated` writes into such columns, saturating at both ends."""
    q = fp8.with_spare(3, 32, 16, torch.device("cpu"))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 32) and q.stride() == (48, 1)
    x = torch.randn(5, 32) * 10
    plain, _ = fp8.quantize_rows_eager(x)
    wide_q, scale = fp8.quantize_rows_eager(x, spare=16)
    assert plain.is_contiguous() and fp8.Fp8Rows(plain, scale, x.shape).spare == 0
    assert wide_q.dtype == torch.float8_e4m3fn and wide_q.stride() == (48, 1)
    assert torch.equal(wide_q.float(), plain.float())
    rows = fp8.Fp8Rows(wide_q, scale, x.shape)
    assert rows.spare == 16 and rows.wide(16).shape == (5, 48) and rows.wide(16).data_ptr() == wide_q.data_ptr()
    with pytest.raises(ValueError, match="17 spare columns asked of rows that have 16"):
        rows.wide(17)
    src = torch.tensor([[1000.0, -1000.0, 3.0, -0.5]] * 5).bfloat16()
    fp8.copy_saturated(src, rows.wide(16)[:, 32:36])
    assert rows.wide(16)[:, 32:36].float().tolist() == [[448.0, -448.0, 3.0, -0.5]] * 5
    assert torch.equal(rows.q.float(), plain.float())  # the first K columns untouched


@pytest.mark.gpu
@_needs_fp8
@pytest.mark.parametrize("M, K, W", [(4096, 3072, 16), (4608, 3072, 64), (512, 12288, 48), (9, 15360, 16)])
def test_gpu_rows_times_a_pass_against_the_fp32_product(M: int, K: int, W: int) -> None:
    """At FLUX.1's adapter shapes (q/v/out 3072, FF down 12288, proj_out 15360; a stacked width of 48 and 64):
    the one pass writes the spare columns within one e4m3 step of the fp32 product, give or take what Hopper's fp8
    tensor cores lose accumulating (a small fraction of the sum of |products|, as cuBLAS's fast accumulation), and
    agrees with its two-kernel twin to the same bound."""
    torch.manual_seed(0)
    q, _ = fp8.quantize_rows(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
    a, a_scale = fp8.quantize_rows(torch.randn(W, K, device="cuda", dtype=torch.bfloat16) * 0.02)
    a_scale = a_scale.reshape(-1) * 0.05
    rows = fp8.with_spare(M, K, W, q.device)
    rows.copy_(q)
    wide = rows.as_strided((M, K + W), (rows.stride(0), 1))
    fp8.rows_times_into(rows, a, a_scale, wide[:, K:])
    want = ((q.float() @ a.float().t()) * a_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    got = wide[:, K:].float()
    accumulated = (q.float().abs() @ a.float().abs().t()) * a_scale.abs()
    step = want.abs().clamp(min=2 ** -6) * 2 ** -3 + accumulated * 2 ** -9
    assert ((got - want).abs() <= step).all(), ((got - want).abs() / step).max()
    twin = torch.empty(M, W, device="cuda", dtype=torch.float8_e4m3fn)
    fp8.rows_times_eager(q, a, a_scale, twin)
    assert ((twin.float() - got).abs() <= 2 * step).all(), ((twin.float() - got).abs() / step).max()
