"""The kernels' dispatch hands each Triton kernel exactly its operands (CPU: the device check pretended true, every
kernel entry replaced by a spy that records its arguments and answers with the eager twin of what it received).

A kernel call with a wrong or dropped operand (a scale for a shift, the text norm's eps where there is no text, the
shape an fp8 result stands for) runs only on CUDA; on a GPU the exact gate then rejects the kernel and the eager twin
answers, so the output stays right and only the kernel's speed is lost. These tests catch such a call on the CPU:
each asserts the arguments the kernel got, that it ran, and, for gated kernels, that the gate accepted it."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels.modulate as modulate
import kernels.rope as rope
from kernels import _fp8_triton, _high_triton, _lossless_triton
from kernels.exact import ExactGate
from kernels.fp8 import Fp8Rows, layer_norm_modulate_fp8_eager

B, T, I, H, D = 2, 3, 5, 2, 16


class Spy:
    """Stands for a kernel entry: records each call's arguments, answers with `answer(*args, **kwargs)`."""

    def __init__(self, answer: Callable[..., Any]) -> None:
        self.answer, self.calls = answer, []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.answer(*args, **kwargs)


def same(got: tuple, want: tuple) -> bool:
    """Argument lists equal entry by entry: tensors and modules by identity, the rest by value."""
    return len(got) == len(want) and all(
        (g is w) if isinstance(w, (torch.Tensor, nn.Module)) else (type(g) is type(w) and g == w)
        for g, w in zip(got, want))


@pytest.fixture
def fresh_gates(monkeypatch) -> None:
    """Gates with no verdicts (a verdict from another test would skip the verification this one checks)."""
    for module, names in ((rope, ("GATE", "RMS_GATE")), (modulate, ("GATE", "LN_GATE"))):
        for name in names:
            monkeypatch.setattr(module, name, ExactGate(getattr(module, name).name))


def _pretend(device: torch.device) -> bool:
    """A device check that takes the CPU for CUDA (and, like the real one, reads the device it is given)."""
    return device.type in ("cuda", "cpu")


@pytest.fixture
def as_cuda(monkeypatch, fresh_gates) -> None:
    monkeypatch.setattr(rope, "_device_supported", _pretend)
    monkeypatch.setattr(modulate, "_device_supported", _pretend)


def _rope_operands(with_text: bool) -> tuple:
    g = torch.Generator().manual_seed(0)
    txt = torch.randn(B, T, H, D, generator=g) if with_text else None
    img = torch.randn(B, I, H, D, generator=g)
    S = I + (T if with_text else 0)
    return txt, img, torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)


def _norms(with_text: bool) -> tuple[nn.RMSNorm | None, nn.RMSNorm]:
    torch.manual_seed(1)
    text = nn.RMSNorm(D, eps=1e-5).requires_grad_(False) if with_text else None
    image = nn.RMSNorm(D, eps=1e-6).requires_grad_(False)
    for n in (text, image):
        if n is not None:
            n.weight.uniform_(0.5, 1.5)
    return text, image


@pytest.mark.parametrize("with_text", [True, False])
def test_rope_cat_hands_its_kernel_the_streams_and_tables(as_cuda, monkeypatch, with_text: bool) -> None:
    """Catches a stream, a table or the gate's key dropped or swapped in the RoPE(+cat) call."""
    txt, img, cos, sin = _rope_operands(with_text)
    spy = Spy(lambda t, i, c, s: rope.rope_cat_eager(t, i, c, s))
    monkeypatch.setattr(_lossless_triton, "rope_cat", spy)
    out = rope.rope_cat(txt, img, cos, sin)
    assert torch.equal(out, rope.rope_cat_eager(txt, img, cos, sin))
    assert len(spy.calls) == 1 and same(spy.calls[0][0], (txt, img, cos, sin))
    assert rope.GATE._verdict == {rope._signature(txt, img, cos, sin): True}


@pytest.mark.parametrize("with_text", [True, False])
def test_rms_rope_cat_hands_its_kernels_weights_and_each_streams_eps(as_cuda, monkeypatch, with_text: bool) -> None:
    """Catches the text norm's weight or eps read where there is no text, the two eps swapped, the
    fast path taking the exact kernel (or both), and the fp8 flag not passed on."""
    txt, img, cos, sin = _rope_operands(with_text)
    norm_t, norm_i = _norms(with_text)

    def eager(t, i, wt, wi, et, ei, c, s, **_: Any) -> torch.Tensor:
        def rms(x, w, eps):
            return F.rms_norm(x, (D,), w, eps)
        return rope.rope_cat(None if t is None else rms(t, wt, et), rms(i, wi, ei), c, s)

    exact, fast = Spy(eager), Spy(eager)
    monkeypatch.setattr(_lossless_triton, "rms_rope_cat", exact)
    monkeypatch.setattr(_high_triton, "rms_rope_fast", fast)
    want_args = (txt, img, None if txt is None else norm_t.weight, norm_i.weight, 0.0 if txt is None else 1e-5, 1e-6,
                 cos, sin)
    reference = rope.rope_cat_eager(None if txt is None else norm_t(txt), norm_i(img), cos, sin)

    assert torch.equal(rope.rms_rope_cat(txt, img, norm_t, norm_i, cos, sin), reference)
    assert len(exact.calls) == 1 and same(exact.calls[0][0], want_args) and not fast.calls
    assert rope.RMS_GATE._verdict == {rope._rms_signature(txt, img, norm_t, norm_i, cos, sin): True}

    assert torch.equal(rope.rms_rope_cat(txt, img, norm_t, norm_i, cos, sin, fast=True), reference)
    assert len(fast.calls) == 1 and same(fast.calls[0][0], want_args) and fast.calls[0][1] == {"fp8": False}
    assert len(exact.calls) == 1  # the fast path answered alone

    rope.rms_rope_fast(txt, img, norm_t, norm_i, cos, sin, fp8=True)
    assert same(fast.calls[1][0], want_args) and fast.calls[1][1] == {"fp8": True}


def test_rms_rope_fast_is_none_where_the_exact_kernel_would_not_run(as_cuda, monkeypatch) -> None:
    """Catches the fast kernel launched on a layout the guard refuses."""
    txt, img, cos, sin = _rope_operands(True)
    norm_t, norm_i = _norms(True)
    spy = Spy(lambda *a, **k: pytest.fail("the fast kernel ran on a layout it does not take"))
    monkeypatch.setattr(_high_triton, "rms_rope_fast", spy)
    assert rope.rms_rope_fast(txt, img[..., :8], norm_t, norm_i, cos, sin) is None  # a head size of another norm


def _mod_operands(dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    W = 32
    return (torch.randn(B, I, W, generator=g).to(dtype), torch.randn(B, W, generator=g).to(dtype),
            torch.randn(B, W, generator=g).to(dtype))


def test_modulate_hands_its_kernel_normed_scale_and_shift(as_cuda, monkeypatch) -> None:
    """Catches scale and shift swapped or dropped in the modulate call."""
    x, scale, shift = _mod_operands()
    spy = Spy(modulate.modulate_eager)
    monkeypatch.setattr(_lossless_triton, "modulate", spy)
    assert torch.equal(modulate.modulate(x, scale, shift), modulate.modulate_eager(x, scale, shift))
    assert len(spy.calls) == 1 and same(spy.calls[0][0], (x, scale, shift))
    assert modulate.GATE._verdict == {modulate._signature(x, scale, shift): True}


def test_layer_norm_modulate_hands_each_kernel_its_operands_and_eps(as_cuda, monkeypatch) -> None:
    """The exact pass (lossless), the fast pass (high) and the fp8-quantizing pass each get (x, scale, shift, eps);
    the fp8 result stands for x's shape."""
    x, scale, shift = _mod_operands()
    eps = 1e-6
    exact = Spy(lambda a, sc, sh, e: modulate.layer_norm_modulate_eager(a, sc, sh, e))
    fast = Spy(lambda a, sc, sh, e: modulate.layer_norm_modulate_eager(a, sc, sh, e))
    quant = Spy(lambda a, sc, sh, e, out: (lambda r: (out.copy_(r.q), r.scale))(
        layer_norm_modulate_fp8_eager(a, sc, sh, e)))
    monkeypatch.setattr(_lossless_triton, "ln_modulate_exact", exact)
    monkeypatch.setattr(_high_triton, "ln_modulate_fast", fast)
    monkeypatch.setattr(_fp8_triton, "ln_modulate_quantize", quant)
    reference = modulate.layer_norm_modulate_eager(x, scale, shift, eps)

    assert torch.equal(modulate.layer_norm_modulate(x, scale, shift, eps), reference)
    assert len(exact.calls) == 1 and same(exact.calls[0][0], (x, scale, shift, eps)) and not fast.calls
    assert modulate.LN_GATE._verdict == {modulate._ln_signature(x, scale, shift, eps): True}

    assert torch.equal(modulate.layer_norm_modulate(x, scale, shift, eps, fast=True), reference)
    assert len(fast.calls) == 1 and same(fast.calls[0][0], (x, scale, shift, eps)) and len(exact.calls) == 1

    rows = modulate.layer_norm_modulate(x, scale, shift, eps, fp8=True)
    want = layer_norm_modulate_fp8_eager(x, scale, shift, eps)
    assert isinstance(rows, Fp8Rows) and rows.shape == x.shape
    assert torch.equal(rows.q.float(), want.q.float()) and torch.equal(rows.scale, want.scale)
    assert len(quant.calls) == 1 and same(quant.calls[0][0], (x, scale, shift, eps))
    assert len(fast.calls) == 1 and len(exact.calls) == 1
    rows = modulate.layer_norm_modulate(x, scale, shift, eps, fp8=True, spare=32)  # rows with room for adapters
    assert quant.calls[1][1]["out"].stride(0) == x.shape[2] + 32 and rows.spare == 32
    assert torch.equal(rows.q.float(), want.q.float())


def test_layer_norm_modulate_takes_its_twins_where_the_fast_passes_do_not_apply(as_cuda, monkeypatch) -> None:
    """fp32 rows (the fast and fp8 passes take half precision only) go to the eager fp8 twin and to the lossless
    path; the kernels are not called with them."""
    x, scale, shift = _mod_operands(torch.float32)
    never = Spy(lambda *a: pytest.fail("a half-precision kernel got fp32 rows"))
    monkeypatch.setattr(_high_triton, "ln_modulate_fast", never)
    monkeypatch.setattr(_fp8_triton, "ln_modulate_quantize", never)
    exact = Spy(lambda a, sc, sh, e: modulate.layer_norm_modulate_eager(a, sc, sh, e))
    monkeypatch.setattr(_lossless_triton, "ln_modulate_exact", exact)
    rows = modulate.layer_norm_modulate(x, scale, shift, 1e-6, fp8=True)
    want = layer_norm_modulate_fp8_eager(x, scale, shift, 1e-6)
    assert torch.equal(rows.q.float(), want.q.float()) and rows.shape == x.shape
    assert torch.equal(modulate.layer_norm_modulate(x, scale, shift, 1e-6, fast=True),
                       modulate.layer_norm_modulate_eager(x, scale, shift, 1e-6))
    assert len(exact.calls) == 1 and same(exact.calls[0][0], (x, scale, shift, 1e-6))


# -- fp8: the row quantization pass, the weight-only GEMV, the GEMM ------------------------------------------------

import kernels.fp8 as fp8  # noqa: E402


@pytest.fixture
def fp8_as_cuda(monkeypatch) -> None:
    monkeypatch.setattr(fp8, "_device_supported", _pretend)


@pytest.mark.parametrize("gelu_b", [False, True])
def test_quantize_rows_hands_its_pass_both_parts_as_rows_and_the_gelu_flag(fp8_as_cuda, monkeypatch,
                                                                           gelu_b: bool) -> None:
    """Catches a part not made into unit-strided rows, the GELU flag lost, a device check on the wrong
    tensor, and a dtype the pass does not take sent to it."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 3, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(2, 3, 32, 2, generator=g).to(torch.bfloat16)[..., 0]  # strided: made unit-strided rows first
    spy = Spy(lambda a, b, gelu, out: (lambda q, s: (out.copy_(q), s))(*fp8.quantize_rows_eager(a, b, gelu)))
    monkeypatch.setattr(_fp8_triton, "quantize_rows", spy)
    q, scale = fp8.quantize_rows(a, b, gelu_b=gelu_b)
    (ga, gb, gflag), kw = spy.calls[0]
    assert len(spy.calls) == 1 and gflag is gelu_b and kw["out"].shape == (6, 48) and kw["out"].is_contiguous()
    assert ga.shape == (6, 16) and gb.shape == (6, 32) and gb.stride(-1) == 1
    assert torch.equal(ga, a.reshape(6, 16)) and torch.equal(gb, b.reshape(6, 32))
    want_q, want_s = fp8.quantize_rows_eager(a.reshape(6, 16), b.reshape(6, 32), gelu_b)
    assert torch.equal(q.float(), want_q.float()) and torch.equal(scale, want_s)
    spy.calls.clear()
    fp8.quantize_rows(a)
    assert spy.calls[0][0][1] is None and spy.calls[0][0][2] is False
    spy.calls.clear()
    fp8.quantize_rows(a.double())  # a dtype the pass does not take: the twin
    assert not spy.calls


def test_weight_only_linear_hands_its_gemv_bf16_rows_and_the_weight_with_its_scale_and_bias(fp8_as_cuda,
                                                                                            monkeypatch) -> None:
    """Catches rows not cast to bf16, the scale or bias dropped, and the twin fed the wrong input."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 16, generator=g)
    w, ws = fp8.to_fp8(torch.randn(32, 16, generator=g), torch.ones(32, 1))
    ws = ws.t().contiguous()
    bias = torch.randn(32, generator=g).to(torch.bfloat16)
    spy = Spy(fp8.weight_only_linear_eager)
    monkeypatch.setattr(_fp8_triton, "weight_only_linear", spy)
    out = fp8.weight_only_linear(x, w, ws, bias)
    (gx, gw, gws, gb), _ = spy.calls[0]
    assert gx.dtype == torch.bfloat16 and torch.equal(gx, x.to(torch.bfloat16))
    assert gw is w and gws is ws and gb is bias
    assert torch.equal(out, fp8.weight_only_linear_eager(x.to(torch.bfloat16), w, ws, bias))
    monkeypatch.setattr(fp8, "_device_supported", lambda device: False)  # elsewhere: the twin, on x as it is
    assert torch.equal(fp8.weight_only_linear(x, w, ws, bias), fp8.weight_only_linear_eager(x, w, ws, bias))
    assert len(spy.calls) == 1


@pytest.mark.parametrize("rows", [16, 128])
def test_rows_matmul_takes_the_gemm_with_fast_accumulation_by_row_count(fp8_as_cuda, monkeypatch, rows: int) -> None:
    """Catches the bias dropped, the fast-accumulation rule ignored, and the twin fed the wrong rows."""
    g = torch.Generator().manual_seed(5)
    q, s = fp8.quantize_rows_eager(torch.randn(rows, 16, generator=g))
    w, ws = fp8.to_fp8(torch.randn(32, 16, generator=g), torch.ones(32, 1))
    ws = ws.t().contiguous()
    bias = torch.randn(32, generator=g).to(torch.bfloat16)
    spy = Spy(lambda *a: fp8.scaled_mm_eager(*a[:5]))
    monkeypatch.setattr(fp8, "scaled_mm", spy)
    out = fp8.rows_matmul(q, w, s, ws, bias)
    assert len(spy.calls) == 1 and same(spy.calls[0][0], (q, w, s, ws, bias, fp8.fast_accumulation(rows)))
    assert torch.equal(out, fp8.scaled_mm_eager(q, w, s, ws, bias))
    monkeypatch.setattr(fp8, "_device_supported", lambda device: False)  # elsewhere: the twin
    assert torch.equal(fp8.rows_matmul(q, w, s, ws, bias), fp8.scaled_mm_eager(q, w, s, ws, bias))
    assert len(spy.calls) == 1


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("fast", [True, False])
def test_scaled_mm_hands_torch_scaled_mm_the_transposed_weight_both_scales_and_the_bias(monkeypatch, fast: bool,
                                                                                       traced: bool) -> None:
    """Both calls of the op: the eager one (inside the refusal handling) and the one torch.compile traces."""
    if traced:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    g = torch.Generator().manual_seed(6)
    q, s = fp8.quantize_rows_eager(torch.randn(8, 16, generator=g))
    w, ws = fp8.to_fp8(torch.randn(32, 16, generator=g), torch.ones(32, 1))
    ws = ws.t().contiguous()
    bias = torch.randn(32, generator=g).to(torch.bfloat16)
    seen = []

    def fake(a, b, *, scale_a, scale_b, bias, out_dtype, use_fast_accum):
        seen.append(dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                         use_fast_accum=use_fast_accum))
        return fp8.scaled_mm_eager(a, b.t(), scale_a, scale_b, bias)

    monkeypatch.setattr(torch, "_scaled_mm", fake)
    out = fp8.scaled_mm(q, w, s, ws, bias, fast)
    (call,) = seen
    assert call["a"] is q and call["b"].shape == (16, 32) and call["b"].stride() == (1, 16)
    assert call["b"].data_ptr() == w.data_ptr()  # the weight itself, transposed as a view
    assert call["scale_a"] is s and call["scale_b"] is ws and call["bias"] is bias
    assert call["out_dtype"] == torch.bfloat16 and call["use_fast_accum"] is fast
    assert torch.equal(out, fp8.scaled_mm_eager(q, w, s, ws, bias))


# -- the GELU: its exact pass into a column slice, and the fused GEMM candidates ------------------------------------

import kernels.gelu as gelu  # noqa: E402
from kernels import _gemm_gelu_triton  # noqa: E402


def test_gelu_tanh_into_hands_its_pass_the_rows_of_the_input_and_of_the_slice(monkeypatch) -> None:
    """First sight: the kernel writes a scratch tensor while the gate compares (eager has already filled the slice);
    once verified it writes the slice itself. Each time it gets [M, N] row views of the input and the destination."""
    monkeypatch.setattr(gelu, "_into_device_supported", _pretend)
    monkeypatch.setattr(gelu, "GELU_INTO_GATE", ExactGate("gelu_tanh_into"))
    h = torch.randn(2, 3, 8, dtype=torch.float16)
    buf = torch.zeros(2, 3, 20, dtype=torch.float16)
    out = buf[..., 4:12]  # a column slice: rows strided by 20

    def kernel(src, dst):
        dst.copy_(F.gelu(src.float(), approximate="tanh").to(src.dtype))

    spy = Spy(kernel)
    monkeypatch.setattr(_lossless_triton, "gelu_tanh", spy)
    want = F.gelu(h, approximate="tanh")
    for call in range(2):
        assert gelu.gelu_tanh_into(h, out) is out and torch.equal(out, want)
        src, dst = spy.calls[call][0]
        assert src.shape == (6, 8) and src.data_ptr() == h.data_ptr() and torch.equal(src, h.reshape(6, 8))
        assert dst.shape == (6, 8) and dst.stride() == ((8, 1) if call == 0 else (20, 1))
        assert (dst.data_ptr() == out.data_ptr()) is (call == 1)  # scratch first, the slice once verified
    assert gelu.GELU_INTO_GATE.verified(gelu._gelu_into_signature(h, out))
    assert torch.equal(buf[..., :4], torch.zeros(2, 3, 4, dtype=torch.float16))  # nothing outside the slice


def test_the_fused_gemm_candidates_get_the_rows_the_weight_and_the_bias(monkeypatch) -> None:
    """Catches the weight not transposed, the GELU epilogue off, or an operand dropped in a candidate."""
    x2d, w, b = torch.randn(6, 8), torch.randn(4, 8), torch.randn(4)
    seen = []

    def addmm_activation(bias, mat1, mat2, *, use_gelu):
        seen.append((bias, mat1, mat2, use_gelu))
        return F.gelu(torch.addmm(bias, mat1, mat2), approximate="tanh")

    monkeypatch.setattr(torch, "_addmm_activation", addmm_activation)
    out = gelu._cublaslt_epilogue(x2d, w, b)
    ((bias, mat1, mat2, use_gelu),) = seen
    assert bias is b and mat1 is x2d and use_gelu is True
    assert mat2.data_ptr() == w.data_ptr() and torch.equal(mat2, w.t())
    assert torch.allclose(out, gelu._unfused(x2d, w, b))
    for wrapper, name in ((gelu._triton_mm, "mm_gelu"), (gelu._triton_tma, "mm_gelu_tma")):
        spy = Spy(lambda a, weight, bias: gelu._unfused(a, weight, bias))
        monkeypatch.setattr(_gemm_gelu_triton, name, spy)
        assert torch.equal(wrapper(x2d, w, b), gelu._unfused(x2d, w, b))
        assert len(spy.calls) == 1 and same(spy.calls[0][0], (x2d, w, b))


def test_each_kernel_module_sends_cuda_tensors_to_its_kernels_and_keeps_cpu_ones_away() -> None:
    """The device checks every test above pretends: a CUDA device passes, the CPU does not (no GPU needed to ask).
    Catches a check that no device passes (every kernel silently off on the GPU)."""
    checks = [rope._device_supported, modulate._device_supported, fp8._device_supported, gelu._device_supported,
              gelu._into_device_supported]
    for check in checks:
        assert check(torch.device("cuda")) and check(torch.device("cuda", 1)), check
        assert not check(torch.device("cpu")) and not check(torch.device("meta")), check


def test_the_lora_tail_hands_its_kernel_rows_and_refuses_what_it_cannot_take(monkeypatch) -> None:
    """`kernels.lora.lora_tail` on [B, S, N] rows: the kernel gets y and t as [B*S, N] / [B*S, r] views of the same
    memory, B and the scale unchanged; the gate compares once, then the kernel answers. Inputs it cannot take (a
    rank it does not hold in registers, fp32, mixed dtypes, shapes that do not fit, strided rows, autograd) go to
    eager without a launch."""
    import kernels.lora as lora

    monkeypatch.setattr(lora, "GATE", ExactGate("lora_tail"))
    monkeypatch.setattr(lora, "_device_supported", _pretend)
    spy = Spy(lambda y, t, b, s: lora.lora_tail_eager(y, t, b, s))
    monkeypatch.setattr(_lossless_triton, "lora_tail", spy)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2, 3, 24, generator=g).half()
    t = torch.randn(2, 3, 16, generator=g).half()
    b = torch.randn(24, 16, generator=g).half()
    for _ in range(2):
        assert torch.equal(lora.lora_tail(y, t, b, 0.3), lora.lora_tail_eager(y, t, b, 0.3))
    (ky, kt, kb, ks), _ = spy.calls[0]
    assert ky.shape == (6, 24) and kt.shape == (6, 16) and ky.data_ptr() == y.data_ptr()
    assert kt.data_ptr() == t.data_ptr() and kb is b and ks == 0.3
    assert len(spy.calls) == 2 and lora.GATE.fast_calls == 1 and list(lora.GATE.verdicts().values()) == [True]
    spy.calls.clear()
    refused = {"rank 8": (y, t[..., :8], b[:, :8]), "fp32": (y.float(), t.float(), b.float()),
               "t's dtype": (y, t.float(), b), "B's dtype": (y, t, b.float()), "B's rows": (y, t, b[:16]),
               "t's rows": (y, t[:, :2], b), "strided y": (y[..., ::2], t, b[::2]),
               "strided t": (y, t.transpose(0, 1).contiguous().transpose(0, 1), b),
               "strided B": (y, t, b.t().contiguous().t()), "no rows": (y[:, :0], t[:, :0], b)}
    for why, args in refused.items():
        assert lora.signature(*args) is None, why
    with torch.enable_grad():
        for grads in ((True, False, False), (False, True, False), (False, False, True)):
            args = [a.detach().float().requires_grad_(g).half() if g else a for a, g in zip((y, t, b), grads)]
            assert lora.signature(*args) is None, grads
        lora.lora_tail(y.detach().requires_grad_(), t, b, 0.3)
    assert spy.calls == []
    monkeypatch.setattr(lora, "_device_supported", lambda device: False)
    lora.lora_tail(y.detach(), t, b, 0.3)
    assert spy.calls == [] and lora.signature(y, t, b) is None


def test_the_gelu_pass_with_an_adapters_term_hands_its_kernel_rows_and_falls_back_to_two_passes(monkeypatch) -> None:
    """`gelu_tanh_into(h, out, [(t, B, s)])`: the kernel gets [M, N] rows of h, t as [M, r], B and s, and writes a
    scratch tensor while its gate compares with the two passes (the term's, then the GELU's into the slice), the
    slice itself once verified. A term no kernel takes (rank 8) goes through the two passes without a launch."""
    import kernels.lora as lora

    monkeypatch.setattr(gelu, "_into_device_supported", _pretend)
    monkeypatch.setattr(lora, "_device_supported", _pretend)
    for module, name in ((gelu, "GELU_LORA_GATE"), (gelu, "GELU_INTO_GATE"), (lora, "GATE")):
        monkeypatch.setattr(module, name, ExactGate(getattr(module, name).name))
    both = Spy(lambda y, t, b, s, dst: dst.copy_(F.gelu(lora.lora_tail_eager(y, t, b, s), approximate="tanh")))
    monkeypatch.setattr(_lossless_triton, "gelu_tanh_lora", both)
    monkeypatch.setattr(_lossless_triton, "lora_tail", Spy(lora.lora_tail_eager))
    monkeypatch.setattr(_lossless_triton, "gelu_tanh",
                        Spy(lambda src, dst: dst.copy_(F.gelu(src, approximate="tanh"))))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 8, generator=g).half()
    t, b = torch.randn(2, 3, 16, generator=g).half(), torch.randn(8, 16, generator=g).half()
    buf = torch.zeros(2, 3, 20, dtype=torch.float16)
    out = buf[..., 4:12]
    want = F.gelu(lora.lora_tail_eager(h, t, b, 0.3), approximate="tanh")
    for call in range(2):
        assert gelu.gelu_tanh_into(h, out, [(t, b, 0.3)]) is out and torch.equal(out, want)
        (ky, kt, kb, ks, dst), _ = both.calls[call]
        assert ky.shape == (6, 8) and ky.data_ptr() == h.data_ptr() and kt.shape == (6, 16)
        assert kt.data_ptr() == t.data_ptr() and kb is b and ks == 0.3
        assert (dst.data_ptr() == out.data_ptr()) is (call == 1) and dst.stride() == ((8, 1) if call == 0 else (20, 1))
    assert gelu.GELU_LORA_GATE.fast_calls == 1 and list(gelu.GELU_LORA_GATE.verdicts().values()) == [True]
    assert torch.equal(buf[..., :4], torch.zeros(2, 3, 4, dtype=torch.float16))
    both.calls.clear()
    gelu.gelu_tanh_into(h, out, [(t[..., :8], b[:, :8], 0.3)])
    assert both.calls == [] and torch.equal(
        out, F.gelu(lora.lora_tail_eager(h, t[..., :8], b[:, :8], 0.3), approximate="tanh"))
