"""GPU tests of kernels/: the residual kernel is bit-exact with eager, the fused GELU is close to linear + GELU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import gelu as G
from kernels import residual as R

pytestmark = pytest.mark.gpu

FLUX_SHAPES = [(1, 4096, 3072), (1, 512, 3072), (1, 4608, 3072), (2, 4096, 3072)]
GATES = ["d", "11d", "b1d", "chunk6", "chunk3"]


@pytest.fixture(autouse=True)
def _fresh():
    R.reset_fast_path()
    yield
    assert not R.fast_path_disabled(), "a kernel failure silently switched the fast path off"


def _gate(kind: str, B: int, D: int, dtype, gen, scale: float = 1.0) -> torch.Tensor:
    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    return {
        "d": lambda: rnd(D),
        "11d": lambda: rnd(1, 1, D),
        "b1d": lambda: rnd(B, 1, D),
        "chunk6": lambda: rnd(B, 6 * D).chunk(6, dim=1)[5].unsqueeze(1),  # AdaLN chunk: batch stride 6D
        "chunk3": lambda: rnd(B, 3 * D).chunk(3, dim=1)[2].unsqueeze(1),
    }[kind]()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", FLUX_SHAPES)
def test_residual_kernel_bit_exact_with_eager(shape, dtype):
    B, S, D = shape
    gen = torch.Generator(device="cuda").manual_seed(B * S + D + (dtype == torch.bfloat16))
    r = torch.randn(shape, generator=gen, device="cuda").to(dtype) * 4
    u = torch.randn(shape, generator=gen, device="cuda").to(dtype) * 4
    for kind in GATES:
        g = _gate(kind, B, D, dtype, gen)
        before = R.triton_calls()
        out = kernels.residual_gate_add(r, u, g)
        assert R.triton_calls() == before + 1, f"{kind}: the Triton path did not run"
        ref = r + g * u
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.equal(out, ref), (kind, (out.float() - ref.float()).abs().max().item())
    # the comparison can tell one rounding from two: a single-rounding (FMA) result differs from eager
    assert not torch.equal(torch.addcmul(r, g, u), r + g * u)


def test_residual_kernel_overflow_and_ties_fp16():
    gen = torch.Generator(device="cuda").manual_seed(1)
    B, S, D = 2, 300, 3072
    r = (torch.randn(B, S, D, generator=gen, device="cuda") * 1000).half()
    u = (torch.randn(B, S, D, generator=gen, device="cuda") * 300).half()
    g = _gate("chunk6", B, D, torch.float16, gen, scale=300)  # products past 65504 -> inf, as in eager
    out = kernels.residual_gate_add(r, u, g)
    ref = r + g * u
    assert torch.isinf(ref).any()
    assert torch.equal(out, ref)
    # diffusers' fp16 guard folded into the same pass: == `(r + g * u).clip(-65504, 65504)`
    before = R.triton_calls()
    clipped = kernels.residual_gate_add(r, u, g, clip=65504.0)
    assert R.triton_calls() == before + 1
    assert torch.equal(clipped, ref.clip(-65504, 65504)) and not torch.isinf(clipped).any()


def test_residual_noncontiguous_runs_eager_on_gpu():
    r = torch.randn(1, 3072, 512, device="cuda").bfloat16().transpose(1, 2)
    u = torch.randn(1, 512, 3072, device="cuda").bfloat16()
    g = torch.randn(3072, device="cuda").bfloat16()
    before = R.triton_calls()
    assert torch.equal(kernels.residual_gate_add(r, u, g), r + g * u)
    assert R.triton_calls() == before


def test_residual_under_torch_compile_inductor():
    torch._dynamo.reset()
    B, S, D = 2, 512, 3072
    r = torch.randn(B, S, D, device="cuda").bfloat16()
    u = torch.randn(B, S, D, device="cuda").bfloat16()
    ada = torch.randn(B, 6 * D, device="cuda").bfloat16()

    def f(r, u, ada):
        gate = ada.chunk(6, dim=1)[2].unsqueeze(1)
        return kernels.residual_gate_add(r, u, gate)

    before = R.triton_calls()
    out = torch.compile(f, fullgraph=True)(r, u, ada)
    assert R.triton_calls() > before
    assert torch.equal(out, r + ada.chunk(6, dim=1)[2].unsqueeze(1) * u)
    torch._dynamo.reset()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("impl", sorted(G.GELU_IMPLS))
@pytest.mark.parametrize("M,K,N", [(64, 256, 512), (512, 3072, 12288), (4096, 3072, 12288)])
def test_fused_gelu_impls_close_to_reference(impl, M, K, N):
    """Every implementation the dispatcher may pick: relative error vs an fp64 reference below 1e-2 (bf16
    operands) and within 1.5x of the unfused bf16 pair's own error."""
    gen = torch.Generator(device="cuda").manual_seed(M + K + N)
    x = torch.randn(M, K, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(N, K, generator=gen, device="cuda") / K**0.5).bfloat16()
    b = torch.randn(N, generator=gen, device="cuda").bfloat16()
    ref = F.gelu(x.double() @ w.double().t() + b.double(), approximate="tanh")
    out = G.GELU_IMPLS[impl](x, w, b)
    assert not torch.isnan(out).any()
    err, err_unfused = _rel_err(out, ref), _rel_err(F.gelu(F.linear(x, w, b), approximate="tanh"), ref)
    assert err < 1e-2 and err <= 1.5 * err_unfused + 1e-4, (impl, err, err_unfused)


def test_fused_linear_gelu_dispatch_decides_once_per_shape():
    G.clear_gelu_dispatch_cache()
    x = torch.randn(2, 256, 3072, device="cuda").bfloat16()
    lin = nn.Linear(3072, 12288, device="cuda", dtype=torch.bfloat16)
    out = kernels.fused_linear_gelu_tanh(x, lin.weight, lin.bias)
    assert out.shape == (2, 256, 12288)
    table = G.gelu_dispatch_table()
    assert list(table) == [(512, 12288, 3072, torch.bfloat16, x.device.index)]
    assert table[(512, 12288, 3072, torch.bfloat16, x.device.index)] in G.GELU_IMPLS
    ref = F.gelu(lin(x).double(), approximate="tanh")
    assert _rel_err(out, ref) < 1e-2


class _FF(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(256, 1024)
        self.out = nn.Linear(1024, 256)
        kernels.mark_fused_gelu_site(self, "proj")

    def forward(self, x):
        return self.out(kernels.gelu_site(self, "proj", x))


def test_mount_on_gpu_then_unmount_restores_bits(monkeypatch):
    monkeypatch.setenv("FLUXSERVE_GELU_IMPL", "cublaslt")  # force the fused path so the test sees it
    G.clear_gelu_dispatch_cache()
    torch.manual_seed(0)
    m = nn.Sequential(_FF(), _FF()).cuda().bfloat16()
    x = torch.randn(2, 64, 256, device="cuda").bfloat16()
    before = m(x)
    report = kernels.mount(m)
    assert report.ok and sorted(report.mounted) == ["0.proj", "1.proj"]
    fused = m(x)
    assert not torch.equal(fused, before)  # the epilogue really ran (different rounding)
    assert _rel_err(fused, before.double()) < 1e-2
    kernels.unmount(m)
    assert torch.equal(m(x), before)
    G.clear_gelu_dispatch_cache()
