"""Lossless-tier fusions used by model/flux.py: RoPE(+cat) and AdaLN modulation kernels, and their exactness gate.

CPU: the gate's logic (verify once per signature, disable on mismatch/failure with one warning, no verification
while compiling or capturing) and the eager references against diffusers. GPU: each Triton kernel == its eager
chain by torch.equal on FLUX.1 shapes, B = 1 and 2.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import AdaLayerNormZero

from kernels import exact
from kernels.exact import ExactGate, same_values, tensor_signature
from kernels.modulate import modulate, modulate_eager
from kernels.rope import apply_rope_eager, rope_cat, rope_cat_eager
from tests._interpret import run_in_interpreter


def _tables(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, 64, (seq, 3), generator=g).float()
    return FluxPosEmbed(10000, [dim // 8, 3 * dim // 8, dim // 2])(ids)


# ------------------------------------------------------------------------------------------------ gate (CPU)


class _Counter:
    def __init__(self, value: torch.Tensor) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.value.clone()


def test_gate_verifies_once_then_trusts_the_kernel() -> None:
    gate = ExactGate("t")
    x = torch.randn(4, 5)
    sig = tensor_signature(x)
    fast, eager = _Counter(x), _Counter(x)
    assert torch.equal(gate.run(sig, fast, eager), x)
    assert (fast.calls, eager.calls) == (1, 1) and gate.verdicts() == {sig: True}
    for _ in range(3):
        gate.run(sig, fast, eager)
    assert (fast.calls, eager.calls, gate.fast_calls) == (4, 1, 3)


def test_gate_disables_a_mismatching_signature_and_logs_once(caplog) -> None:
    gate = ExactGate("t")
    x = torch.randn(4, 5)
    other = torch.randn(8)
    wrong = x.clone()
    wrong[1, 2] = torch.nextafter(wrong[1, 2], torch.tensor(1e9))  # one ulp off
    fast, eager = _Counter(wrong), _Counter(x)
    with caplog.at_level(logging.WARNING, logger=exact.__name__):
        for _ in range(3):
            assert torch.equal(gate.run(tensor_signature(x), fast, eager), x)
    assert fast.calls == 1 and eager.calls == 3 and gate.fast_calls == 0
    assert len([r for r in caplog.records if "differs from eager" in r.getMessage()]) == 1
    # Other signatures are judged on their own.
    ok_fast, ok_eager = _Counter(other), _Counter(other)
    gate.run(tensor_signature(other), ok_fast, ok_eager)
    gate.run(tensor_signature(other), ok_fast, ok_eager)
    assert gate.verdicts()[tensor_signature(other)] is True and ok_fast.calls == 2


def test_gate_disables_a_failing_kernel(caplog) -> None:
    gate = ExactGate("t")
    x = torch.randn(3)

    def boom() -> torch.Tensor:
        raise RuntimeError("no kernel today")

    with caplog.at_level(logging.WARNING, logger=exact.__name__):
        assert torch.equal(gate.run(("s",), boom, lambda: x), x)
        assert torch.equal(gate.run(("s",), boom, lambda: x), x)
    assert gate.verdicts() == {("s",): False}
    assert sum("no kernel today" in r.getMessage() for r in caplog.records) == 1


def test_gate_never_verifies_while_compiling_or_capturing(monkeypatch) -> None:
    gate = ExactGate("t")
    x = torch.randn(3)
    fast, eager = _Counter(x), _Counter(x)
    monkeypatch.setattr(exact, "cannot_verify_now", lambda: True)
    gate.run(("s",), fast, eager)
    assert (fast.calls, eager.calls) == (0, 1) and gate.verdicts() == {}
    monkeypatch.setattr(exact, "cannot_verify_now", lambda: False)
    gate.run(("s",), fast, eager)  # now it may verify
    assert fast.calls == 1 and gate.verdicts() == {("s",): True}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    gate.run(("s",), fast, eager)  # under torch.compile: always the traceable eager chain
    assert fast.calls == 1 and eager.calls == 3


def test_gate_none_signature_and_global_switch_run_eager() -> None:
    gate = ExactGate("t")
    x = torch.randn(3)
    fast, eager = _Counter(x), _Counter(x)
    gate.run(None, fast, eager)
    gate.enabled = False
    gate.run(("s",), fast, eager)
    assert fast.calls == 0 and eager.calls == 2 and gate.verdicts() == {}


def test_same_values_nan_and_ulp() -> None:
    a = torch.tensor([1.0, float("nan"), -0.0])
    assert same_values(a, torch.tensor([1.0, float("nan"), 0.0]))
    assert not same_values(a, torch.tensor([1.0, 2.0, 0.0]))
    assert not same_values(a, torch.tensor([torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)), float("nan"), 0]))
    assert not same_values(a, a.to(torch.float64))


# ------------------------------------------------------------------------------------------ eager refs (CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rope_eager_is_diffusers_apply_rotary_emb(dtype: torch.dtype) -> None:
    txt, img = torch.randn(2, 5, 3, 16).to(dtype), torch.randn(2, 7, 3, 16).to(dtype)
    cos, sin = _tables(12, 16)
    want = apply_rotary_emb(torch.cat([txt, img], dim=1), (cos, sin), sequence_dim=1)
    assert torch.equal(rope_cat_eager(txt, img, cos, sin), want)
    assert torch.equal(rope_cat(txt, img, cos, sin), want)  # CPU: the public entry runs eager
    cos7, sin7 = cos[:7], sin[:7]
    assert torch.equal(rope_cat(None, img, cos7, sin7), apply_rotary_emb(img, (cos7, sin7), sequence_dim=1))
    assert torch.equal(apply_rope_eager(img, cos7, sin7), apply_rotary_emb(img, (cos7, sin7), sequence_dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_modulate_eager_is_diffusers_adaln(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    adaln = AdaLayerNormZero(32).to(dtype)
    x, emb = torch.randn(2, 9, 32).to(dtype), torch.randn(2, 32).to(dtype)
    with torch.no_grad():
        want = adaln(x, emb=emb)[0]
        shift, scale = adaln.linear(adaln.silu(emb)).chunk(6, dim=1)[:2]
    assert torch.equal(modulate(adaln.norm(x), scale, shift), want)
    assert torch.equal(modulate_eager(adaln.norm(x), scale, shift), want)


# ------------------------------------------------------------------------------------------------ GPU kernels

FLUX_SHAPES = [(1, 512, 4096), (2, 512, 4096)]  # (B, text tokens, image tokens) at 1024^2
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_SHAPES, ids=lambda s: f"B{s[0]}")
def test_gpu_rope_cat_kernel_equals_eager(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    from kernels import _lossless_triton

    B, T, I = shape
    H, D = 24, 128
    dev = "cuda"
    txt = (torch.randn(B, T, H, D, device=dev) * 3).to(dtype)
    img = (torch.randn(B, I, H, D, device=dev) * 3).to(dtype)
    cos, sin = (t.to(dev) for t in _tables(T + I, D))
    for t, c, s in ((txt, cos, sin), (None, cos[T:].contiguous(), sin[T:].contiguous())):
        out = _lossless_triton.rope_cat(t, img, c, s)
        assert torch.equal(out, rope_cat_eager(t, img, c, s))
    # Through the gate: verified on first sight, then the kernel serves the call.
    from kernels.rope import GATE

    GATE.reset()  # other tests in this session may have verified this signature already
    rope_cat(txt, img, cos, sin)
    assert torch.equal(rope_cat(txt, img, cos, sin), rope_cat_eager(txt, img, cos, sin))
    assert GATE.fast_calls == 1 and all(GATE.verdicts().values())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_SHAPES, ids=lambda s: f"B{s[0]}")
def test_gpu_modulate_kernel_equals_eager(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    from kernels import _lossless_triton
    from kernels.modulate import GATE

    B, T, I = shape
    D, dev = 3072, "cuda"
    emb6 = torch.randn(B, 6 * D, device=dev).to(dtype)  # AdaLN-Zero output: chunks have batch stride 6D
    emb3 = torch.randn(B, 3 * D, device=dev).to(dtype)
    for S in (T, I, T + I):
        x = torch.randn(B, S, D, device=dev).to(dtype)
        for emb in (emb6, emb3):
            shift, scale = emb.chunk(emb.shape[1] // D, dim=1)[:2]
            assert torch.equal(_lossless_triton.modulate(x, scale, shift), modulate_eager(x, scale, shift))
    GATE.reset()  # other tests in this session may have verified this signature already
    modulate(x, scale, shift)
    assert torch.equal(modulate(x, scale, shift), modulate_eager(x, scale, shift))
    assert GATE.fast_calls == 1 and all(GATE.verdicts().values())


_ELEMENTWISE_INTERPRET_PROBE = r"""
import torch
import tests.test_flux_lossless as T
from kernels import _lossless_triton as K
from kernels.modulate import modulate_eager
from kernels.rope import rope_cat_eager
torch.manual_seed(0)
n = 0
# fp16 and fp32 (the interpreter rounds fp16 like the GPU; bf16 it truncates, so bf16 is checked on the GPU only).
for dtype in (torch.float16, torch.float32):
    # modulate: several row blocks, a ragged column block, chunked [B, 6D] scale/shift views (batch stride 6D)
    for (B, S, D) in ((2, 5, 1100), (1, 9, 64)):
        normed = (torch.randn(B, S, D) * 2).to(dtype)
        shift, scale = torch.randn(B, 6 * D).to(dtype).chunk(6, dim=1)[:2]
        got = K.modulate(normed, scale, shift, config={"BLOCK_S": 4, "BLOCK_D": 256, "num_warps": 4})
        assert torch.equal(got, modulate_eager(normed, scale, shift)), ("modulate", dtype, B, S, D)
        n += 1
    # rope_cat: text + image rows into the joint tensor, image only, strided (B, S) views of a wider projection
    for (B, Tn, In, H, D) in ((2, 3, 5, 3, 32), (1, 0, 7, 2, 64)):
        cos, sin = T._tables(Tn + In, D)
        img = (torch.randn(B, In, 2 * H * D) * 3).to(dtype)[..., : H * D].unflatten(-1, (H, D))
        txt = None if Tn == 0 else (torch.randn(B, Tn, H * D) * 3).to(dtype).unflatten(-1, (H, D))
        got = K.rope_cat(txt, img, cos, sin, config={"BLOCK": 64, "num_warps": 4})
        assert torch.equal(got, rope_cat_eager(txt, img, cos, sin)), ("rope_cat", dtype, B, Tn, In)
        n += 1
print("OK", n)
"""


def test_modulate_and_rope_cat_kernels_in_the_interpreter() -> None:
    """The real modulate and RoPE(+cat) kernels in Triton's CPU interpreter: fp16 and fp32, equal to eager bit for
    bit (no FMA, the same rounding points), with ragged blocks and strided operands."""
    run_in_interpreter(_ELEMENTWISE_INTERPRET_PROBE, "OK 8")


# ------------------------------------------------------------------------------ LayerNorm + modulate (lossless)


def welford_row_stats_cuda_order(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """aten's CUDA vectorised LayerNorm statistics (128 threads x 4-element vectors, Welford, shuffle-down tree,
    then the 4-warp tree), written with fp32 torch ops and no FMA; x2d [M, N] fp32 -> (mean [M], var [M])."""
    M, N = x2d.shape
    nvec = N // 4
    t = torch.arange(128)
    mean, m2, cnt = (torch.zeros(M, 128) for _ in range(3))
    for it in range(-(-nvec // 128)):
        vec = it * 128 + t
        valid = vec < nvec
        for ii in range(4):
            v = x2d[:, (vec * 4 + ii).clamp(max=N - 1)]
            delta = v - mean
            new_cnt = cnt + 1
            new_mean = mean + delta * (1 / new_cnt)
            new_m2 = m2 + delta * (v - new_mean)
            mean, m2, cnt = (torch.where(valid, a, b) for a, b in ((new_mean, mean), (new_m2, m2), (new_cnt, cnt)))

    def combine(mB, sB, cB, mA, sA, cA):
        delta, count = mB - mA, cA + cB
        coef = 1 / count
        nA, nB = cA * coef, cB * coef
        mean = nA * mA + nB * mB
        s = (sA + sB) + delta * delta * cA * nB
        ok = count > 0
        return torch.where(ok, mean, 0.0), torch.where(ok, s, 0.0), count

    state = [a.reshape(M, 4, 32) for a in (mean, m2, cnt)]
    for o in (16, 8, 4, 2, 1):
        state = combine(*(a[..., :o] for a in state), *(a[..., o:2 * o] for a in state))
    state = [a.reshape(M, 4) for a in state]
    state = combine(*(a[:, :2] for a in state), *(a[:, 2:] for a in state))
    mean, m2, _ = combine(*(a[:, :1] for a in state), *(a[:, 1:] for a in state))
    return mean[:, 0], m2[:, 0] / N


def test_welford_emulation_is_a_layer_norm() -> None:
    """The CPU emulation of aten's CUDA order computes LayerNorm statistics (to fp32 rounding)."""
    x = torch.randn(6, 3072) * 3 + 5
    for N in (3072, 64, 520):
        mean, var = welford_row_stats_cuda_order(x[:, :N])
        assert torch.allclose(mean, x[:, :N].double().mean(1).float(), rtol=1e-5, atol=1e-5)
        assert torch.allclose(var, x[:, :N].double().var(1, unbiased=False).float(), rtol=1e-4)


def test_compile_time_reciprocals_round_like_fp32_division() -> None:
    """The exact LayerNorm kernel folds 1/n as a Python double rounded to fp32 (a compile-time constant); that must
    equal fp32 division's correctly rounded 1/n for every per-lane count it can meet."""
    from kernels._lossless_triton import _MAX_LANE_COUNT

    n = torch.arange(1, _MAX_LANE_COUNT + 1, dtype=torch.float64)
    assert torch.equal((1.0 / n).float(), 1.0 / n.float())


_LN_INTERPRET_PROBE = r"""
import torch
import tests.test_flux_lossless as T
from kernels import _high_triton as H
from kernels import _lossless_triton as K
torch.manual_seed(0)
n = 0
for (B, S, D) in ((1, 3, 3072), (2, 2, 64), (1, 2, 520)):  # 6 full iterations; most threads idle; a ragged last one
    x = (torch.randn(B, S, D) * 4 + 3).half()
    emb = torch.randn(B, 6 * D).half()
    shift, scale = emb.chunk(6, dim=1)[:2]
    got_mean, got_rstd = torch.empty(B * S), torch.empty(B * S)
    out = K.ln_modulate_exact(x, scale, shift, 1e-6, variant=(False, False, 0, False), stats=(got_mean, got_rstd))
    mean, var = T.welford_row_stats_cuda_order(x.float().reshape(-1, D))
    assert torch.equal(got_mean, mean), (B, S, D)  # same reduction order: same bits
    rstd = 1.0 / torch.sqrt(var + 1e-6)
    assert torch.allclose(got_rstd, rstd, rtol=3e-7, atol=0), (B, S, D)  # the rsqrt itself may differ by an ulp
    normed = (got_rstd[:, None] * (x.float().reshape(-1, D) - mean[:, None])).half().reshape(B, S, D)
    ref = normed * (1 + scale[:, None]) + shift[:, None]
    assert torch.equal(out, ref), (B, S, D)
    # The fast (high-tier) kernel: one rounding of the fp32 math, so in fp16 within an ulp of the float64 formula...
    xd, shd, scd = x.double(), shift.double()[:, None], scale.double()[:, None]
    want = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-6) * (1 + scd) + shd
    fast = H.ln_modulate_fast(x, scale, shift, 1e-6)
    assert ((fast.double() - want).abs() <= 2.0**-10 * want.abs() + 2.0**-24).all(), (B, S, D)
    # ...and in fp32 within a few ulp of the row's scale (a biased variance or a wrong eps is ~1e-3 away).
    x32, sc32, sh32 = x.float(), scale.float(), shift.float()
    fast32 = H.ln_modulate_fast(x32, sc32, sh32, 1e-6)
    err = (fast32.double() - want).abs().amax(-1) / want.abs().amax(-1)
    assert err.max() < 1e-6, (B, S, D, err.max().item())
    n += 1
print("OK", n)
"""


def test_layer_norm_modulate_kernels_in_the_interpreter() -> None:
    """The real Triton kernels in Triton's CPU interpreter: the exact one's thread/lane bookkeeping against the
    CPU emulation of aten's CUDA order, the fast one against the eager chain (fp16)."""
    run_in_interpreter(_LN_INTERPRET_PROBE, "OK 3")


@pytest.mark.gpu
@pytest.mark.parametrize("tree", ["reduce", "explicit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_SHAPES, ids=lambda s: f"B{s[0]}")
def test_gpu_layer_norm_modulate_exact_equals_eager(shape: tuple[int, int, int], dtype: torch.dtype, tree: str) -> None:
    """Same mean/rstd bits as torch.native_layer_norm, same output as the eager chain, with either spelling of the
    lane tree (tl.reduce's lowering, the explicit [warp, lane] one); then through the gate."""
    from kernels import _lossless_triton
    from kernels.modulate import LN_GATE, layer_norm_modulate, layer_norm_modulate_eager

    B, T, I = shape
    D, dev, eps = 3072, "cuda", 1e-6
    emb6 = torch.randn(B, 6 * D, device=dev).to(dtype)
    emb3 = torch.randn(B, 3 * D, device=dev).to(dtype)
    for S in (T, I, T + I):
        x = (torch.randn(B, S, D, device=dev) * 4 + torch.randn(B, S, 1, device=dev) * 8).to(dtype)
        for emb in (emb6, emb3):
            shift, scale = emb.chunk(emb.shape[1] // D, dim=1)[:2]
            mean, rstd = torch.empty(B * S, device=dev), torch.empty(B * S, device=dev)
            out = _lossless_triton.ln_modulate_exact(x, scale, shift, eps, stats=(mean, rstd), tree=tree)
            _, ref_mean, ref_rstd = torch.native_layer_norm(x, (D,), None, None, eps)
            assert torch.equal(mean, ref_mean.reshape(-1)) and torch.equal(rstd, ref_rstd.reshape(-1)), (
                "LN statistics differ from aten: run bench/lossless_ops.py to find the matching LN_FMA_VARIANT")
            assert torch.equal(out, layer_norm_modulate_eager(x, scale, shift, eps))
    LN_GATE.reset()
    assert LN_GATE.enabled  # the library default
    layer_norm_modulate(x, scale, shift, eps)
    assert torch.equal(layer_norm_modulate(x, scale, shift, eps), layer_norm_modulate_eager(x, scale, shift, eps))
    assert LN_GATE.fast_calls == 1 and all(LN_GATE.verdicts().values())


@pytest.mark.gpu
def test_gpu_layer_norm_modulate_falls_back_where_its_kernels_do_not_apply() -> None:
    """Inputs the one-pass kernels do not take, on CUDA: fp32 rows and a width above the fast kernel's 16384 run the
    lossless path bit for bit even with fast=True; an fp8 site given fp32 rows quantizes the fp32 norm eagerly; with
    the gate off, eager and no kernel launch. Catches a fallback handed its arguments in the wrong order (scale for
    shift, no eps) or a support test that lets such inputs reach a kernel."""
    from kernels import fp8
    from kernels.modulate import LN_GATE, layer_norm_modulate, layer_norm_modulate_eager

    torch.manual_seed(0)
    eps = 1e-5  # not the default, so a fallback that drops it shows

    def inputs(dtype: torch.dtype, D: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = (torch.randn(2, 24, D, device="cuda") * 3 + 1).to(dtype)
        return x, (torch.randn(2, D, device="cuda") * 0.5).to(dtype), torch.randn(2, D, device="cuda").to(dtype)

    def reference(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        n = F.layer_norm(x, (x.shape[-1],), eps=eps)  # diffusers' chain, each product rounded to x's dtype
        return n * (1 + scale[:, None]) + shift[:, None]

    LN_GATE.reset()
    for dtype, D in ((torch.float32, 256), (torch.bfloat16, 16388)):
        x, scale, shift = inputs(dtype, D)
        assert torch.equal(layer_norm_modulate(x, scale, shift, eps, fast=True), reference(x, scale, shift)), (dtype, D)
    x, scale, shift = inputs(torch.float32, 256)
    rows = layer_norm_modulate(x, scale, shift, eps, fp8=True)
    y = F.layer_norm(x, (256,), eps=eps) * (1 + scale[:, None]) + shift[:, None]
    q, s = fp8.quantize_rows_eager(y.reshape(-1, 256))
    assert rows.shape == x.shape and torch.equal(rows.q.float(), q.float()) and torch.equal(rows.scale, s)
    x, scale, shift = inputs(torch.bfloat16, 3072)
    LN_GATE.reset()
    LN_GATE.enabled = False
    try:
        assert torch.equal(layer_norm_modulate(x, scale, shift, eps), reference(x, scale, shift))
        assert LN_GATE.fast_calls == 0 and not LN_GATE.verdicts()
    finally:
        LN_GATE.enabled = True
    assert torch.equal(layer_norm_modulate_eager(x, scale, shift, eps), reference(x, scale, shift))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_layer_norm_modulate_fast_is_close(dtype: torch.dtype) -> None:
    """The high tier's fast kernel: not bit-exact, but within a couple of half-precision ulps of eager."""
    from kernels.modulate import layer_norm_modulate, layer_norm_modulate_eager

    B, S, D, eps = 2, 4608, 3072, 1e-6
    x = (torch.randn(B, S, D, device="cuda") * 4 + torch.randn(B, S, 1, device="cuda") * 8).to(dtype)
    shift, scale = torch.randn(B, 6 * D, device="cuda").to(dtype).chunk(6, dim=1)[:2]
    ref = layer_norm_modulate_eager(x, scale, shift, eps).float()
    got = layer_norm_modulate(x, scale, shift, eps, fast=True).float()
    # Eager rounds three times (normed, normed * (1 + scale), + shift); the fast kernel once. Each eager rounding
    # moves its value by at most half an ulp, so the difference is bounded by the magnitudes of the intermediates.
    normed = torch.nn.functional.layer_norm(x, (D,), eps=eps).float()
    prod = normed * (1 + scale.float()[:, None])
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)  # relative spacing of the half type
    bound = ulp * (ref.abs() + prod.abs() + normed.abs() * (1 + scale.float()[:, None]).abs()) + 1e-5
    assert ((got - ref).abs() <= bound).all(), ((got - ref).abs() / bound).max()
    assert not torch.equal(got, ref)  # it really ran the non-exact kernel (eager would be equal)


# ------------------------------------------------------------------------------------ QK RMSNorm + RoPE (lossless)


def rms_sum_squares_cuda_order(x2d: torch.Tensor) -> torch.Tensor:
    """torch's CUDA rms_norm sum of squares per row (lanes own 4 consecutive elements, shuffle-down tree), fp32 ops
    and no FMA; x2d [M, D] fp32 with D // 4 a power of two <= 32."""
    M, D = x2d.shape
    v = x2d.reshape(M, D // 4, 4)
    acc = v[..., 0] * v[..., 0]
    for i in (1, 2, 3):
        acc = acc + v[..., i] * v[..., i]
    lanes = D // 4
    while lanes > 1:
        lanes //= 2
        acc = acc[:, :lanes] + acc[:, lanes:2 * lanes]
    return acc[:, 0]


def test_rms_emulation_is_an_rms_norm() -> None:
    x = torch.randn(10, 128) * 3
    ms = rms_sum_squares_cuda_order(x) / 128
    assert torch.allclose(ms, x.double().pow(2).mean(1).float(), rtol=1e-5)


_RMS_INTERPRET_PROBE = r"""
import torch
import tests.test_flux_lossless as T
from kernels import _lossless_triton as K
from kernels.rope import apply_rope_eager
torch.manual_seed(0)
n = 0
for (B, Tn, In, H, D) in ((1, 3, 5, 4, 128), (2, 2, 3, 6, 64), (1, 0, 4, 3, 32)):
    txt = None if Tn == 0 else (torch.randn(B, Tn, H * D) * 3).half().unflatten(-1, (H, D))
    img = (torch.randn(B, In, H * D) * 3).half().unflatten(-1, (H, D))
    w_t, w_i = (torch.rand(D) + 0.5).half(), (torch.rand(D) + 0.5).half()
    ids = torch.randint(0, 64, (Tn + In, 3)).float()
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed
    cos, sin = FluxPosEmbed(10000, [D // 8, 3 * D // 8, D // 2])(ids)
    out = K.rms_rope_cat(txt, img, w_t if txt is not None else None, w_i, 1e-6, 1e-6, cos, sin, fma_squares=False)
    parts = []
    for t, w in ((txt, w_t), (img, w_i)):
        if t is None:
            continue
        x = t.float().reshape(-1, D)
        rstd = 1.0 / torch.sqrt(T.rms_sum_squares_cuda_order(x) / D + 1e-6)
        parts.append((w.float() * (rstd[:, None] * x)).half().reshape(t.shape))
    ref = apply_rope_eager(torch.cat(parts, dim=1), cos, sin)
    flips = (out != ref).float().mean().item()
    assert flips < 5e-3 and (out.float() - ref.float()).abs().max() < 0.02 * ref.float().abs().max(), (B, H, D, flips)
    # another launch tile (heads per program) writes the same bits
    heads = 2 if H % 2 == 0 else 1
    assert torch.equal(K.rms_rope_cat(txt, img, w_t if txt is not None else None, w_i, 1e-6, 1e-6, cos, sin,
                                      fma_squares=False, tile={"heads": heads, "num_warps": 2}), out)
    n += 1
print("OK", n)
"""


def test_rms_rope_cat_kernel_in_the_interpreter() -> None:
    """The real Triton kernel in the CPU interpreter (fp16): heads, pairs, text/image rows and weights are indexed
    right (rsqrt may differ by an ulp there, so a few flipped elements are allowed; the GPU test is exact)."""
    run_in_interpreter(_RMS_INTERPRET_PROBE, "OK 3")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_SHAPES, ids=lambda s: f"B{s[0]}")
def test_gpu_rms_rope_cat_equals_eager(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    from kernels import _lossless_triton
    from kernels.rope import RMS_GATE, rms_rope_cat

    B, T, I = shape
    H, D, dev = 24, 128, "cuda"
    norm_t, norm_i = (torch.nn.RMSNorm(D, eps=1e-6).to(dev, dtype) for _ in range(2))
    with torch.no_grad():
        norm_t.weight.copy_(torch.rand(D) + 0.5)
        norm_i.weight.copy_(torch.rand(D) + 0.5)
    txt = (torch.randn(B, T, H * D, device=dev) * 3).to(dtype).unflatten(-1, (H, D))
    img = (torch.randn(B, I, H * D, device=dev) * 3).to(dtype).unflatten(-1, (H, D))
    cos, sin = (t.to(dev) for t in _tables(T + I, D))
    with torch.no_grad():
        for t, nt, c, s in ((txt, norm_t, cos, sin), (None, None, cos[T:].contiguous(), sin[T:].contiguous())):
            ref = rope_cat_eager(None if t is None else nt(t), norm_i(img), c, s)
            got = _lossless_triton.rms_rope_cat(t, img, None if t is None else nt.weight, norm_i.weight, 1e-6, 1e-6,
                                                c, s)
            assert torch.equal(got, ref), ("run bench/lossless_ops.py: RMS_FMA_SQUARES may not match this torch build",
                                           (got != ref).float().mean().item())
        RMS_GATE.reset()
        rms_rope_cat(txt, img, norm_t, norm_i, cos, sin)
        assert torch.equal(rms_rope_cat(txt, img, norm_t, norm_i, cos, sin),
                           rope_cat_eager(norm_t(txt), norm_i(img), cos, sin))
        # image rows only (the single blocks' layout has no separate text part): no text norm to read
        c, s = cos[T:].contiguous(), sin[T:].contiguous()
        rms_rope_cat(None, img, None, norm_i, c, s)
        assert torch.equal(rms_rope_cat(None, img, None, norm_i, c, s), rope_cat_eager(None, norm_i(img), c, s))
    assert RMS_GATE.fast_calls == 2 and len(RMS_GATE.verdicts()) == 2 and all(RMS_GATE.verdicts().values())


_RMS_FAST_INTERPRET_PROBE = r"""
import torch
from kernels import _high_triton as K
from kernels.rope import rope_cat_eager
torch.manual_seed(0)
n = 0
# text + image, image only, rows views of a wider projection (row stride > H * D), heads not a multiple of a tile
for (B, Tn, In, H, D, wide) in ((1, 3, 5, 4, 128, False), (2, 2, 3, 3, 64, True), (1, 0, 4, 6, 32, True)):
    def rows(n):
        full = torch.randn(B, n, (2 if wide else 1) * H * D) * 3
        return full[..., :H * D].half().unflatten(-1, (H, D))
    txt, img = (None if Tn == 0 else rows(Tn)), rows(In)
    nt, ni = torch.nn.RMSNorm(D, eps=1e-6).half(), torch.nn.RMSNorm(D, eps=1e-5).half()
    with torch.no_grad():
        nt.weight.copy_(torch.rand(D) + 0.5)
        ni.weight.copy_(torch.rand(D) + 0.5)
        ids = torch.randint(0, 64, (Tn + In, 3)).float()
        from diffusers.models.transformers.transformer_flux import FluxPosEmbed
        cos, sin = FluxPosEmbed(10000, [D // 8, 3 * D // 8, D // 2])(ids)
        out = K.rms_rope_fast(txt, img, None if txt is None else nt.weight, ni.weight, 1e-6, 1e-5, cos, sin)
        ref = rope_cat_eager(None if txt is None else nt(txt.float()), ni(img.float()), cos, sin)
    assert out.dtype == torch.float16 and out.shape == ref.shape
    err = (out.float() - ref).abs().max().item()
    assert err < 4e-3 * ref.abs().max().item(), (B, H, D, err)
    n += 1
print("OK", n)
"""


def test_rms_rope_fast_kernel_in_the_interpreter() -> None:
    """The high tier's one-pass QK RMSNorm + RoPE in the CPU interpreter, against eager fp32 norms then RoPE: text
    and image rows (their own weights and eps), pairs, strided rows and a head count its tile does not divide."""
    run_in_interpreter(_RMS_FAST_INTERPRET_PROBE, "OK 3")


def test_rms_rope_cat_fast_on_cpu_is_the_lossless_path() -> None:
    txt, img = torch.randn(1, 3, 2, 16), torch.randn(1, 5, 2, 16)
    norm_t, norm_i = torch.nn.RMSNorm(16, eps=1e-6), torch.nn.RMSNorm(16, eps=1e-6)
    cos, sin = (t.float() for t in _tables(8, 16))
    from kernels.rope import rms_rope_cat

    with torch.no_grad():
        assert torch.equal(rms_rope_cat(txt, img, norm_t, norm_i, cos, sin, fast=True),
                           rope_cat_eager(norm_t(txt), norm_i(img), cos, sin))


def test_rms_rope_fast_dispatch_where_the_exact_kernel_would_apply(monkeypatch) -> None:
    """Where the exact kernel's signature holds, `fast=True` takes the high kernel (fp8 asked for by the attention
    path only); where it does not (here: CPU), None and the lossless path."""
    pytest.importorskip("triton")
    from kernels import _high_triton, rope

    txt, img = torch.randn(1, 3, 2, 16), torch.randn(1, 5, 2, 16)
    norm_t, norm_i = torch.nn.RMSNorm(16, eps=1e-6), torch.nn.RMSNorm(16, eps=1e-5)
    cos, sin = (t.float() for t in _tables(8, 16))
    assert rope.rms_rope_fast(txt, img, norm_t, norm_i, cos, sin) is None  # CPU: no signature
    calls = []
    monkeypatch.setattr(rope, "_rms_signature", lambda *a: ("sig",))
    monkeypatch.setattr(_high_triton, "rms_rope_fast", lambda *a, **k: calls.append((a, k)) or "kernel")
    assert rope.rms_rope_cat(txt, img, norm_t, norm_i, cos, sin, fast=True) == "kernel"
    assert rope.rms_rope_fast(None, img, None, norm_i, cos, sin, fp8=True) == "kernel"
    (a1, k1), (a2, k2) = calls
    assert a1[2] is norm_t.weight and a1[3] is norm_i.weight and a1[4:6] == (1e-6, 1e-5) and k1 == {"fp8": False}
    assert a2[0] is None and a2[2] is None and a2[4:6] == (0.0, 1e-5) and k2 == {"fp8": True}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_rms_rope_fast_is_close_to_the_exact_kernel(dtype: torch.dtype) -> None:
    from kernels import _high_triton, _lossless_triton
    from kernels.rope import rms_rope_cat

    B, T, I, H, D, dev = 2, 512, 4096, 24, 128, "cuda"
    norm_t, norm_i = (torch.nn.RMSNorm(D, eps=1e-6).to(dev, dtype) for _ in range(2))
    with torch.no_grad():
        norm_t.weight.copy_(torch.rand(D) + 0.5)
        norm_i.weight.copy_(torch.rand(D) + 0.5)
        wide = torch.randn(B, T + I, 3 * H * D, device=dev).to(dtype)  # q of a fused q/k/v projection: strided rows
        txt, img = (wide[:, :T, :H * D].unflatten(-1, (H, D)), wide[:, T:, :H * D].unflatten(-1, (H, D)))
        cos, sin = (t.to(dev) for t in _tables(T + I, D))
        exact = _lossless_triton.rms_rope_cat(txt, img, norm_t.weight, norm_i.weight, 1e-6, 1e-6, cos, sin)
        fast = _high_triton.rms_rope_fast(txt, img, norm_t.weight, norm_i.weight, 1e-6, 1e-6, cos, sin)
        assert torch.equal(rms_rope_cat(txt, img, norm_t, norm_i, cos, sin, fast=True), fast)
    ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}[dtype]
    assert (fast.float() - exact.float()).abs().max() <= 2 * ulp * exact.float().abs().max()


# ----------------------------------------------------------------------------- tanh-GELU into a slice (lossless)


def _slice_buffer(B: int, S: int, left: int, F: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """A [B, S, left + F] buffer filled with a sentinel, and its right column slice (what the single block's
    proj_out input looks like: attention columns, then GELU columns)."""
    buf = torch.full((B, S, left + F), 7.0, dtype=dtype, device=device)
    return buf, buf[..., left:]


def test_gelu_into_a_slice_is_eager_gelu_on_cpu() -> None:
    from kernels.gelu import GELU_INTO_GATE, gelu_tanh_into

    h = torch.randn(2, 5, 24).bfloat16()
    buf, out = _slice_buffer(2, 5, 8, 24, torch.bfloat16, "cpu")
    assert gelu_tanh_into(h, out) is out
    assert torch.equal(out, torch.nn.functional.gelu(h, approximate="tanh"))
    assert bool((buf[..., :8] == 7.0).all())  # the other columns are untouched
    assert GELU_INTO_GATE.verdicts() == {}  # CPU: eager, nothing to verify


_GELU_INTERPRET_PROBE = r"""
import torch
import tests.test_flux_lossless as T
from kernels import _lossless_triton as K
from kernels.gelu import _rows
torch.manual_seed(0)
n = 0
for (B, S, left, F) in ((1, 3, 8, 4000), (2, 2, 16, 48)):  # a ragged last column block; two batch rows
    h = (torch.randn(B, S, F) * 3).half()
    buf, out = T._slice_buffer(B, S, left, F, torch.float16, "cpu")
    K.gelu_tanh(_rows(h), _rows(out))
    ref = torch.nn.functional.gelu(h.double(), approximate="tanh")
    # The interpreter's tanh is exp-based (CUDA's tanhf on the GPU, bit-exact there: test below): here the fp16 result
    # is the rounding of the formula (half an ulp) up to that tanh's fp32 error, a few 1e-8 of |x|...
    bound = 2.0**-11 * ref.abs() + 2e-7 * h.double().abs() + 2.0**-24
    assert ((out.double() - ref).abs() <= bound).all(), (B, S, F)
    assert bool((buf[..., :left] == 7.0).all()), (B, S, F)
    # ...and in fp32, both FMA choices, within a few ulp of |x| (a wrong GELU constant is ~5e-6 of |x| away).
    for fma in (False, True):
        h32 = h.float().reshape(-1, F)
        out32 = torch.full_like(h32, float("nan"))
        K.gelu_tanh(h32, out32, fma_inner=fma)
        err = ((out32.double() - torch.nn.functional.gelu(h32.double(), approximate="tanh")).abs()
               / h32.double().abs().clamp_min(1e-3))
        assert err.max() < 5e-7, (B, S, F, fma, err.max().item())
    n += 1
print("OK", n)
"""


def test_gelu_into_kernel_in_the_interpreter() -> None:
    """The real Triton kernel in the CPU interpreter: rows, strides and the column mask are indexed right."""
    run_in_interpreter(_GELU_INTERPRET_PROBE, "OK 2")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_gelu_kernel_equals_aten_on_every_half_value(dtype: torch.dtype) -> None:
    """Every 16-bit pattern (infinities and NaNs too) through the kernel and through aten's tanh-GELU: the library's
    FMA choice must give the same bits."""
    from kernels import _lossless_triton as K

    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).cuda().reshape(64, 1024)
    ref = torch.nn.functional.gelu(x, approximate="tanh")
    got = {fma: K.gelu_tanh(x, torch.empty_like(x), fma_inner=fma) for fma in (False, True)}
    report = {fma: int((~((g == ref) | (g.isnan() & ref.isnan()))).sum()) for fma, g in got.items()}
    assert same_values(got[K.GELU_FMA_INNER], ref), f"mismatching values per FMA choice: {report}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B", [1, 2])
def test_gpu_gelu_into_a_slice_equals_eager(B: int, dtype: torch.dtype) -> None:
    """The single block's case (attention 3072 columns, then 12288 GELU columns, 4608 tokens), through the gate."""
    from kernels.gelu import GELU_INTO_GATE, gelu_tanh_into

    h = (torch.randn(B, 4608, 12288, device="cuda") * 3).to(dtype)
    ref = torch.nn.functional.gelu(h, approximate="tanh")
    GELU_INTO_GATE.reset()
    for _ in range(2):  # first: verified against aten (which fills out); second: the kernel alone
        buf, out = _slice_buffer(B, 4608, 3072, 12288, dtype, "cuda")
        assert gelu_tanh_into(h, out) is out
        assert same_values(out, ref) and bool((buf[..., :3072] == 7.0).all())
    assert GELU_INTO_GATE.fast_calls == 1 and list(GELU_INTO_GATE.verdicts().values()) == [True]
