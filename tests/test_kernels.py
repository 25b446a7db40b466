"""CPU tests of kernels/: residual-gate guards and failure handling, GELU guards and the mount protocol.

The fast paths are CUDA-only. Where a test must get past the device guard on CPU it monkeypatches
`_device_supported` (one function per module) and replaces the launcher with a spy, so the only thing
faked is "this device is CUDA" and "the kernel ran".
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import gelu as G
from kernels import residual as R
from tests._interpret import run_in_interpreter

HALF = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _clean_state():
    R.reset_fast_path()
    G.clear_gelu_dispatch_cache()
    yield
    R.reset_fast_path()
    G.clear_gelu_dispatch_cache()


def _inputs(B=2, S=5, D=16, dtype=torch.bfloat16, gate="b1d", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, S, D, generator=g).to(dtype)
    u = torch.randn(B, S, D, generator=g).to(dtype)
    if gate == "d":
        gt = torch.randn(D, generator=g).to(dtype)
    elif gate == "11d":
        gt = torch.randn(1, 1, D, generator=g).to(dtype)
    elif gate == "b1d":
        gt = torch.randn(B, 1, D, generator=g).to(dtype)
    elif gate == "chunk6":  # FLUX: linear(silu(temb)).chunk(6, dim=1)[k].unsqueeze(1)
        gt = torch.randn(B, 6 * D, generator=g).to(dtype).chunk(6, dim=1)[2].unsqueeze(1)
    elif gate == "chunk3":
        gt = torch.randn(B, 3 * D, generator=g).to(dtype).chunk(3, dim=1)[1].unsqueeze(1)
    else:
        raise ValueError(gate)
    return r, u, gt


class _LaunchSpy:
    """Stands in for the Triton launch: records the call (with its clip) and returns a fresh tensor that tests can
    recognise by identity, so "the kernel's result was returned" is checked by `is`, never by comparing the spy's
    own arithmetic with itself."""

    SENTINEL = 7.0

    def __init__(self, fail: Exception | None = None):
        self.calls: list[tuple] = []
        self.clips: list[float | None] = []
        self.results: list[torch.Tensor] = []
        self.fail = fail

    def __call__(self, residual, update, gate3, clip=None):
        self.calls.append((residual.shape, gate3.shape, gate3.stride()))
        self.clips.append(clip)
        if self.fail is not None:
            raise self.fail
        out = torch.full_like(residual, self.SENTINEL)
        self.results.append(out)
        return out


@pytest.fixture
def fake_cuda_residual(monkeypatch):
    """Pretend the CPU is a supported device for residual_gate_add and spy on the launch."""
    spy = _LaunchSpy()
    monkeypatch.setattr(R, "_device_supported", lambda device: True)
    monkeypatch.setattr(R, "_launch", spy)
    return spy


# ---------------------------------------------------------------- residual_gate_add: guards


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("gate", ["d", "11d", "b1d", "chunk6"])
def test_residual_on_cpu_is_the_eager_expression(dtype, gate, monkeypatch):
    spy = _LaunchSpy()
    monkeypatch.setattr(R, "_launch", spy)
    r, u, g = _inputs(dtype=dtype, gate=gate)
    out = kernels.residual_gate_add(r, u, g)
    assert torch.equal(out, r + g * u)
    assert spy.calls == []  # the CPU guard refused before any launch


def _clip_inputs(B: int = 2):
    """fp16 operands whose eager sum overflows to +-inf in places and is NaN in one place (inf - inf)."""
    r, u, g = _inputs(B=B, gate="chunk6")
    r, u, g = r.half() * 1e4, u.half() * 300, g.half() * 300
    r[0, 0, 0], u[0, 0, 0], g[0, 0, 0] = float("inf"), 1.0, -float("inf")  # inf + (-inf * 1) = NaN
    return r, u, g


def _clipped(r, u, g):
    """What diffusers computes at the two clipping sites: the eager add, then `.clip(-65504, 65504)`."""
    return (r + g * u).clip(-65504, 65504)


def test_clip_inputs_really_overflow() -> None:
    r, u, g = _clip_inputs()
    raw, ref = r + g * u, _clipped(r, u, g)
    assert torch.isinf(raw).any() and torch.isnan(raw).any()
    assert not torch.isinf(ref).any() and ref.nan_to_num(0).abs().max() == 65504 and torch.isnan(ref).sum() == 1


def test_residual_clip_reaches_the_kernel(fake_cuda_residual):
    r, u, g = _clip_inputs()
    out = kernels.residual_gate_add(r, u, g, clip=65504.0)
    assert out is fake_cuda_residual.results[-1] and fake_cuda_residual.clips == [65504.0]
    kernels.residual_gate_add(r, u, g)
    assert fake_cuda_residual.clips == [65504.0, None]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    from kernels.exact import same_values

    return same_values(a, b)


def test_residual_clip_on_an_unsupported_device_is_clipped_eager(monkeypatch):
    spy = _LaunchSpy()
    monkeypatch.setattr(R, "_launch", spy)
    r, u, g = _clip_inputs()
    assert _same(kernels.residual_gate_add(r, u, g, clip=65504.0), _clipped(r, u, g))
    assert spy.calls == []


def test_residual_clip_survives_a_kernel_failure_and_the_disabled_path(monkeypatch, caplog):
    """A failing launch falls back to eager with the clip (an unclipped fallback returns inf where diffusers clips),
    and so does every later call once the fast path is disabled."""
    spy = _LaunchSpy(fail=RuntimeError("launch failed"))
    monkeypatch.setattr(R, "_device_supported", lambda device: True)
    monkeypatch.setattr(R, "_launch", spy)
    r, u, g = _clip_inputs()
    with caplog.at_level(logging.WARNING, logger="kernels.residual"):
        first = kernels.residual_gate_add(r, u, g, clip=65504.0)
    assert _same(first, _clipped(r, u, g)) and not torch.isinf(first).any()
    assert kernels.fast_path_disabled() and len(spy.calls) == 1
    r2, u2, g2 = _clip_inputs(B=3)
    later = kernels.residual_gate_add(r2, u2, g2, clip=65504.0)
    assert _same(later, _clipped(r2, u2, g2)) and len(spy.calls) == 1  # disabled: eager, not retried
    assert _same(kernels.residual_gate_add(r2, u2, g2), r2 + g2 * u2)  # no clip asked: none applied


@pytest.mark.parametrize(
    "gate,B,stride0",
    [("d", 2, 0), ("11d", 2, 0), ("b1d", 2, 16), ("chunk6", 2, 96), ("chunk3", 3, 48), ("b1d", 1, 16)],
)
def test_residual_supported_gates_reach_the_kernel(fake_cuda_residual, gate, B, stride0):
    r, u, g = _inputs(B=B, gate=gate)
    out = kernels.residual_gate_add(r, u, g)
    assert out is fake_cuda_residual.results[-1]
    (res_shape, g_shape, g_stride), = fake_cuda_residual.calls
    assert res_shape == (B, 5, 16) and g_shape == (B, 1, 16)
    assert g_stride[2] == 1
    if B > 1:
        assert g_stride[0] == stride0  # per-sample gate rows are read through their real batch stride


def _refused_cases():
    r, u, g = _inputs(B=2)
    cases = {
        "fp32": (r.float(), u.float(), g.float()),
        "non_contiguous_residual": (r.transpose(0, 1).contiguous().transpose(0, 1), u, g),
        "non_contiguous_update": (r, u.transpose(1, 2).contiguous().transpose(1, 2), g),
        "mixed_dtype_gate": (r, u, g.float()),
        "mixed_dtype_update": (r, u.half(), g),
        "gate_full_bsd": (r, u, torch.randn(2, 5, 16).to(r.dtype)),
        "gate_bd_broadcasts_over_seq": (r, u, torch.randn(5, 16).to(r.dtype)),
        "gate_last_dim_strided": (r, u, torch.randn(2, 1, 32).to(r.dtype)[..., ::2]),
        "gate_4d": (r, u, g.unsqueeze(0)),
        "residual_2d": (r[0], u[0], g[0, 0]),
        "broadcast_residual": (r[:1], u, g),
    }
    return cases


@pytest.mark.parametrize("case", sorted(_refused_cases()))
def test_residual_unsupported_inputs_run_eager(fake_cuda_residual, case):
    r, u, g = _refused_cases()[case]
    out = kernels.residual_gate_add(r, u, g)
    assert torch.equal(out, r + g * u)
    assert out.dtype == (r + g * u).dtype
    assert fake_cuda_residual.calls == []


def test_residual_requires_grad_runs_eager(fake_cuda_residual):
    r, u, g = _inputs()
    u.requires_grad_(True)
    out = kernels.residual_gate_add(r, u, g)
    assert out.requires_grad and fake_cuda_residual.calls == []
    with torch.no_grad():
        assert kernels.residual_gate_add(r, u, g) is fake_cuda_residual.results[-1]
    assert len(fake_cuda_residual.calls) == 1


# ---------------------------------------------------------------- residual_gate_add: failures


def test_kernel_failure_warns_once_then_eager_for_the_process(monkeypatch, caplog):
    spy = _LaunchSpy(fail=RuntimeError("ptxas exploded"))
    monkeypatch.setattr(R, "_device_supported", lambda device: True)
    monkeypatch.setattr(R, "_launch", spy)
    r, u, g = _inputs()
    with caplog.at_level(logging.WARNING, logger="kernels.residual"):
        for _ in range(3):
            assert torch.equal(kernels.residual_gate_add(r, u, g), r + g * u)
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ptxas exploded" in warnings[0].getMessage()
    assert len(spy.calls) == 1  # disabled after the first failure: never retried
    assert kernels.fast_path_disabled()

    kernels.reset_fast_path()
    spy.fail = None
    kernels.residual_gate_add(r, u, g)
    assert len(spy.calls) == 2 and not kernels.fast_path_disabled()


def test_kernel_failure_while_compiling_raises(monkeypatch):
    monkeypatch.setattr(R, "_device_supported", lambda device: True)
    monkeypatch.setattr(R, "_launch", _LaunchSpy(fail=RuntimeError("no kernel for you")))
    monkeypatch.setattr(R, "_is_compiling", lambda: True)
    r, u, g = _inputs()
    with pytest.raises(RuntimeError, match="no kernel for you"):
        kernels.residual_gate_add(r, u, g)
    assert not kernels.fast_path_disabled()


def test_torch_compile_traces_the_custom_op(monkeypatch):
    spy = _LaunchSpy()
    monkeypatch.setattr(R, "_device_supported", lambda device: True)
    monkeypatch.setattr(R, "_launch", spy)
    torch._dynamo.reset()
    fn = torch.compile(kernels.residual_gate_add, backend="eager", fullgraph=True)
    r, u, g = _inputs(gate="chunk6")
    assert torch.equal(fn(r, u, g), torch.full_like(r, _LaunchSpy.SENTINEL))  # the op's result, not eager's
    assert len(spy.calls) == 1

    spy.fail = RuntimeError("compiled kernel failed")
    torch._dynamo.reset()
    fn = torch.compile(kernels.residual_gate_add, backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="compiled kernel failed"):
        fn(r, u, g)
    assert not kernels.fast_path_disabled()
    torch._dynamo.reset()


# ---------------------------------------------------------------- GELU: guards


def _linear(dtype=torch.bfloat16, bias=True, cls=nn.Linear, **attrs):
    torch.manual_seed(0)
    layer = cls(8, 12, bias=bias).to(dtype)
    for k, v in attrs.items():
        setattr(layer, k, v)
    return layer


def _column(gather_output: bool, world: int, quant=None) -> nn.Module:
    from model.linear import BF16, Column, Linear

    return Linear.from_linears([_linear()], quant=quant or BF16, parallel=Column(0, world, gather_output=gather_output))


class _QuantLinear(nn.Linear):  # a foreign nn.Linear subclass that does not opt in
    pass


@pytest.fixture
def fake_cuda_gelu(monkeypatch):
    allowed = {"on": True}
    monkeypatch.setattr(G, "_device_supported", lambda device: allowed["on"])
    return allowed


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda: _linear(bias=False), "no bias"),
        (lambda: _column(gather_output=True, world=2), "does not compute F.linear(x, weight, bias) locally"),
        (lambda: _linear(dtype=torch.float32), "torch.float32 is not fp16/bf16"),
        (lambda: _linear(cls=_QuantLinear), "unsupported layer type"),
        (lambda: nn.Conv1d(8, 12, 1).to(torch.bfloat16), "unsupported layer type"),
    ],
)
def test_gelu_static_refusals(fake_cuda_gelu, make, reason):
    ok, why = kernels.can_fuse_linear_gelu(make())
    assert not ok and reason in why


def test_gelu_static_accepts(fake_cuda_gelu):
    assert kernels.can_fuse_linear_gelu(_linear()) == (True, "ok")
    assert kernels.can_fuse_linear_gelu(_linear(torch.float16)) == (True, "ok")
    # column-parallel without a gather (TP FF up-projection) and a gathered layer at tp_size 1 are fine
    assert kernels.can_fuse_linear_gelu(_column(gather_output=False, world=2))[0]
    assert kernels.can_fuse_linear_gelu(_column(gather_output=True, world=1))[0]


def test_gelu_refuses_cpu_without_patching():
    ok, why = kernels.can_fuse_linear_gelu(_linear())
    assert not ok and "cpu" in why
    ok, why = kernels.can_fuse_linear_gelu(_linear(), torch.randn(2, 8).to(torch.bfloat16))
    assert not ok and "cpu" in why


def test_gelu_dynamic_refusals(fake_cuda_gelu):
    layer = _linear(torch.bfloat16)
    assert kernels.can_fuse_linear_gelu(layer, torch.randn(3, 8).to(torch.bfloat16)) == (True, "ok")
    ok, why = kernels.can_fuse_linear_gelu(layer, torch.randn(3, 8).half())
    assert not ok and "!= weight dtype" in why
    ok, why = kernels.can_fuse_linear_gelu(layer, torch.randn(3, 8))
    assert not ok and "not fp16/bf16" in why
    fake_cuda_gelu["on"] = False  # the input's device is checked at call time too
    ok, why = kernels.can_fuse_linear_gelu(layer, torch.randn(3, 8).to(torch.bfloat16))
    assert not ok and "cpu" in why


def test_fused_linear_gelu_on_cpu_is_tanh_not_the_erf_epilogue():
    layer = _linear(torch.float32)
    x = torch.randn(4, 8)
    out = kernels.fused_linear_gelu_tanh(x, layer.weight, layer.bias)
    assert torch.equal(out, F.gelu(F.linear(x, layer.weight, layer.bias), approximate="tanh"))
    # why the CPU guard exists: aten's CPU GELU epilogue is the erf GELU
    erf = torch._addmm_activation(layer.bias, x, layer.weight.t(), use_gelu=True)
    assert torch.allclose(erf, F.gelu(F.linear(x, layer.weight, layer.bias)), atol=1e-6)
    assert not torch.allclose(erf, out, atol=1e-6)


def test_gelu_dispatch_override_is_cached_and_validated(monkeypatch):
    layer = _linear()
    x2d = torch.randn(6, 8).to(torch.bfloat16)
    monkeypatch.setenv("FLUXSERVE_GELU_IMPL", "unfused")
    assert G._choose_impl(x2d, layer.weight, layer.bias) == "unfused"
    assert G.gelu_dispatch_table() == {(6, 12, 8, torch.bfloat16, None): "unfused"}
    G.clear_gelu_dispatch_cache()
    monkeypatch.setenv("FLUXSERVE_GELU_IMPL", "magic")
    with pytest.raises(ValueError, match="FLUXSERVE_GELU_IMPL='magic'"):
        G._choose_impl(x2d, layer.weight, layer.bias)


def test_gelu_dispatch_never_times_inside_a_cuda_graph_capture(monkeypatch, caplog):
    """No decision yet while a stream captures (CUDA events and syncs are illegal there): the unfused pair, not
    cached; a decision taken eagerly before is what the capture records."""
    def no_timing(*_a):
        raise AssertionError("timed inside a CUDA graph capture")

    layer = _linear()
    x2d = torch.randn(6, 8).to(torch.bfloat16)
    monkeypatch.delenv("FLUXSERVE_GELU_IMPL", raising=False)
    monkeypatch.setattr(G, "_decide_by_timing", no_timing)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with caplog.at_level(logging.WARNING, logger=G.__name__):
        assert G._choose_impl(x2d, layer.weight, layer.bias) == "unfused"
    assert any("inside a CUDA graph capture" in r.getMessage() for r in caplog.records)
    assert G.gelu_dispatch_table() == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(G, "_decide_by_timing", lambda *_a: ("cublaslt", {"unfused": 1.0, "cublaslt": 0.5}))
    assert G._choose_impl(x2d, layer.weight, layer.bias) == "cublaslt"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(G, "_decide_by_timing", no_timing)
    assert G._choose_impl(x2d, layer.weight, layer.bias) == "cublaslt"


class _FakeImpls:
    """Candidate GELU implementations on the CPU, each recording its name when called: the unfused pair, a fast
    one (close), a slow one whose name sorts first, one that is wrong by 10 %, one that fails."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def make(self, name: str, scale: float = 1.0, fail: bool = False):
        def impl(x, weight, bias):
            assert bias is not None, f"{name} called without the bias"
            self.calls.append(name)
            if fail:
                raise RuntimeError("boom")
            return G._unfused(x, weight, bias) * scale
        return impl


@pytest.fixture
def fake_dispatch(monkeypatch):
    """GELU_IMPLS replaced by `_FakeImpls`, candidates in a fixed order, and `_time_impl` answering from `times`
    (ms per impl) for the impl its callable runs."""
    impls = _FakeImpls()
    table = {"unfused": impls.make("unfused"), "zippy": impls.make("zippy", 1.0001),
             "another": impls.make("another", 1.0001), "wrong": impls.make("wrong", 1.1),
             "broken": impls.make("broken", fail=True)}
    monkeypatch.setattr(G, "GELU_IMPLS", table)
    monkeypatch.setenv("FLUXSERVE_GELU_CANDIDATES", "unfused,wrong,broken,another,zippy")
    monkeypatch.delenv("FLUXSERVE_GELU_IMPL", raising=False)
    times = {"unfused": 1.0, "another": 0.8, "zippy": 0.5}

    def timed(fn):
        impls.calls.clear()
        fn()  # the timed callable must run the candidate
        (name,) = impls.calls
        return times[name]

    monkeypatch.setattr(G, "_time_impl", timed)
    G.clear_gelu_dispatch_cache()
    yield impls, times
    G.clear_gelu_dispatch_cache()


def _gelu_operands():
    layer = _linear(torch.float32)
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1)) * 4, layer.weight, layer.bias


def test_gelu_dispatch_keeps_the_fastest_correct_candidate_and_says_why_not_the_others(fake_dispatch) -> None:
    """Bugs caught: the relative difference taken against the wrong norm, a wrong candidate timed anyway, a
    rejection that stops the loop, the fastest picked by name instead of time, a timed callable that does not
    run the candidate on the real operands (the bias dropped), the reasons not recorded."""
    impls, times = fake_dispatch
    best, timings = G._decide_by_timing(*_gelu_operands())
    assert best == "zippy"
    assert timings["wrong"] == "rejected: rel diff 1.00e-01"
    assert timings["broken"] == "failed: RuntimeError: boom"
    assert timings["unfused"] == 1.0 and timings["another"] == 0.8 and timings["zippy"] == 0.5
    assert set(timings) == {"unfused", "wrong", "broken", "another", "zippy"}


@pytest.mark.parametrize("zippy, expected", [(1.99, "unfused"), (1.98, "zippy"), (1.5, "zippy"), (3.0, "unfused")])
def test_gelu_dispatch_swaps_numerics_only_for_a_real_gain(fake_dispatch, zippy: float, expected: str) -> None:
    """A candidate must beat the unfused pair (2 ms here) by 1 % (`_MIN_GAIN`): within that, timing noise would
    swap numerics for nothing. Bugs caught: the condition inverted, `>=` for `>`, the gain divided instead of
    multiplied, the fallback name misspelt."""
    impls, times = fake_dispatch
    times.update(unfused=2.0, another=4.0, zippy=zippy)
    assert G._decide_by_timing(*_gelu_operands())[0] == expected


def test_gelu_dispatch_decides_once_per_shape_and_logs_its_timings(fake_dispatch, monkeypatch, caplog) -> None:
    """`_choose_impl` times a shape once (later calls read the cached choice), keeps the timings behind it for
    `gelu_dispatch_timings`, and logs them in microseconds. Bugs caught: no cache (every call times again), the
    timings not kept, the bias not passed to the timing, the log's unit."""
    impls, _ = fake_dispatch
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x2d, weight, bias = _gelu_operands()
    with caplog.at_level(logging.INFO, logger=G.__name__):
        assert G._choose_impl(x2d, weight, bias) == "zippy"
    key = (6, 12, 8, torch.float32, None)
    assert G.gelu_dispatch_table() == {key: "zippy"}
    timings = G.gelu_dispatch_timings()
    assert timings[key]["zippy"] == 0.5 and timings[key]["wrong"].startswith("rejected")
    assert any("'zippy': '500.0us'" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    n = len(impls.calls)
    assert G._choose_impl(x2d, weight, bias) == "zippy" and len(impls.calls) == n  # cached: nothing runs again
    assert kernels.fused_linear_gelu_tanh(x2d, weight, bias).shape == (6, 12)  # the CPU never dispatches
    assert len(impls.calls) == n


@pytest.mark.parametrize("cached, expected", [(None, "cublaslt"), ("unfused", "unfused"), ("cublaslt", "cublaslt"),
                                              ("triton_tma", "cublaslt")])
def test_gelu_dispatch_inside_a_trace_takes_a_traceable_choice_without_timing(monkeypatch, cached, expected) -> None:
    """Under torch.compile: the eager decision if traceable, else the cuBLASLt epilogue; never timed, nothing
    cached. Bugs caught: the traceable test inverted, the fallback misnamed, a cache lookup by the wrong key."""
    x2d, weight, bias = _gelu_operands()
    G.clear_gelu_dispatch_cache()
    if cached is not None:
        G._gelu_choice[(6, 12, 8, torch.float32, None)] = cached
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(G, "_decide_by_timing", lambda *_a: pytest.fail("timed inside a trace"))
    try:
        assert G._choose_impl(x2d, weight, bias) == expected
    finally:
        G.clear_gelu_dispatch_cache()


def test_gelu_timing_is_the_median_per_call_after_a_warm_up(monkeypatch) -> None:
    """`_time_impl`: 3 untimed warm-up calls, 7 timed batches of 4 back-to-back calls, the median per call. Bugs
    caught: other counts, the batch time multiplied instead of divided, another order statistic."""
    elapsed = iter([40.0, 8.0, 12.0, 4.0, 28.0, 16.0, 20.0])  # ms per batch: per call 10, 2, 3, 1, 7, 4, 5

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:
            return next(elapsed)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    calls = []
    assert G._time_impl(lambda: calls.append(1)) == 4.0
    assert len(calls) == 3 + 7 * 4


def test_a_gelu_site_checks_the_input_it_is_given(fake_cuda_gelu, monkeypatch) -> None:
    """A mounted site runs the fused call only where the dynamic check passes on the call's input: an input whose
    dtype differs from the weight's runs the unfused pair. Bug caught: the site checking the layer only (the input
    dropped from the check). Also the refusal of a layer that gathers its output names its type."""
    from kernels import sites

    module = nn.Module()
    module.proj = _linear(torch.bfloat16)
    sites.mark(module, f"{G.GROUP}:proj")
    sites.switch(module, {G.GROUP: True})
    fused = []
    monkeypatch.setattr(G, "fused_linear_gelu_tanh",
                        lambda x, w, b: fused.append((x.dtype, b is module.proj.bias)) or F.gelu(F.linear(x, w, b)))
    G.gelu_site(module, "proj", torch.randn(3, 8).to(torch.bfloat16))
    assert fused == [(torch.bfloat16, True)]
    x = torch.randn(3, 8).half()
    with pytest.raises(RuntimeError):  # the unfused pair runs the layer as it is: fp16 input, bf16 weight
        G.gelu_site(module, "proj", x)
    assert fused == [(torch.bfloat16, True)]
    # an input on another (supported) device than the weight's is refused too
    ok, why = kernels.can_fuse_linear_gelu(module.proj, torch.empty(3, 8, dtype=torch.bfloat16, device="meta"))
    assert (ok, why) == (False, "input on meta (weight on cpu)")
    ok, why = kernels.can_fuse_linear_gelu(_column(gather_output=True, world=2))
    assert why.startswith("Linear does not compute F.linear(x, weight, bias) locally (")


# ---------------------------------------------------------------- GELU: site protocol


class _FF(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(8, 12, bias=bias)
        self.out = nn.Linear(12, 8)
        kernels.mark_fused_gelu_site(self, "proj")

    def forward(self, x):
        return self.out(kernels.gelu_site(self, "proj", x))


class _Block(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.ff = _FF()
        self.proj_mlp = nn.Linear(8, 8, bias=bias)
        kernels.mark_fused_gelu_site(self, "proj_mlp")

    def forward(self, x):
        return self.ff(x) + kernels.gelu_site(self, "proj_mlp", x)


class _Tiny(nn.Module):
    def __init__(self, bad_bias_in_block1: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block(bias=not bad_bias_in_block1)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


SITES = ["blocks.0.ff.proj", "blocks.0.proj_mlp", "blocks.1.ff.proj", "blocks.1.proj_mlp"]


def _tiny(**kw) -> _Tiny:
    torch.manual_seed(0)
    return _Tiny(**kw).to(torch.bfloat16)


@pytest.fixture
def fused_spy(monkeypatch):
    calls = []
    real = G.fused_linear_gelu_tanh

    def spy(x, weight, bias):
        calls.append(tuple(weight.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(G, "fused_linear_gelu_tanh", spy)
    return calls


def test_unmounted_site_is_exactly_linear_then_tanh_gelu():
    m = _tiny()
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    got = kernels.gelu_site(m.blocks[0].ff, "proj", x)
    layer = m.blocks[0].ff.proj
    ref = F.gelu(x @ layer.weight.t() + layer.bias, approximate="tanh")  # independent of nn.Linear.forward
    assert torch.allclose(got.float(), ref.float(), atol=2e-2)
    assert torch.equal(got, F.gelu(layer(x), approximate="tanh"))


def test_mount_refuses_on_cpu_and_mounts_nothing():
    m = _tiny()
    report = kernels.mount(m)
    assert not report.ok and report.mounted == []
    assert sorted(report.refused) == SITES
    assert all("cpu" in why for why in report.refused.values())
    assert kernels.mounted_sites(m) == []


def test_mount_is_all_or_nothing(fake_cuda_gelu, fused_spy):
    m = _tiny(bad_bias_in_block1=True)
    report = kernels.mount(m)
    assert report.mounted == [] and report.refused == {"blocks.1.proj_mlp": "layer has no bias"}
    assert kernels.mounted_sites(m) == []
    m(torch.randn(2, 3, 8).to(torch.bfloat16))
    assert fused_spy == []  # refused mount: every site ran unfused


def test_mount_unmount_idempotent_and_bit_exact_restore(fake_cuda_gelu, fused_spy):
    m = _tiny()
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    before = m(x)
    report = kernels.mount(m)
    assert report.ok and sorted(report.mounted) == SITES and report.refused == {}
    assert sorted(kernels.mount(m).mounted) == SITES  # mounting twice is harmless
    assert sorted(kernels.mounted_sites(m)) == SITES
    m(x)
    assert sorted(fused_spy) == [(8, 8), (8, 8), (12, 8), (12, 8)]  # every mounted site went through the fused call

    kernels.unmount(m)
    kernels.unmount(m)
    assert kernels.mounted_sites(m) == []
    fused_spy.clear()
    assert torch.equal(m(x), before)
    assert fused_spy == []


def test_mounted_site_runs_unfused_when_dynamic_guard_fails(fake_cuda_gelu, fused_spy):
    m = _tiny()
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    before = m(x)
    assert kernels.mount(m).ok
    fake_cuda_gelu["on"] = False  # e.g. the input arrives on a device the fused call does not support
    assert torch.equal(m(x), before)
    assert fused_spy == []
    assert len(kernels.mounted_sites(m)) == 4  # still mounted: the decision is per call


def test_site_state_survives_deepcopy_and_to(fake_cuda_gelu):
    m = _tiny()
    assert kernels.mount(m).ok
    c = copy.deepcopy(m)
    assert sorted(kernels.mounted_sites(c)) == SITES
    kernels.unmount(c)
    assert kernels.mounted_sites(c) == [] and sorted(kernels.mounted_sites(m)) == SITES  # independent copies
    m.to(torch.float16)
    assert sorted(kernels.mounted_sites(m)) == SITES
    assert "_fluxserve_gelu_sites" not in str(list(m.state_dict()))
    # a dtype the guard refuses makes the whole mount refuse again
    m.to(torch.float32)
    assert not kernels.mount(m).ok
    assert kernels.mounted_sites(m) == []


# ---------------------------------------------------------------- the Triton kernel itself, on CPU

_INTERPRET_PROBE = r"""
import torch
from kernels import _residual_triton as T
from kernels.residual import _gate_as_b1d
torch.manual_seed(0)
n = 0
for B, S, D in [(1, 33, 96), (2, 17, 64), (3, 5, 48)]:
    r = torch.randn(B, S, D).half(); u = torch.randn(B, S, D).half()
    gates = [torch.randn(D).half(), torch.randn(1, 1, D).half(), torch.randn(B, 1, D).half(),
             torch.randn(B, 6 * D).half().chunk(6, dim=1)[4].unsqueeze(1)]
    for g in gates:
        cfg = dict(BLOCK_S=4, BLOCK_D=32, num_warps=4)  # tiles that leave ragged edges in S and D
        out = T.launch(r, u, _gate_as_b1d(r, g), config=cfg)
        assert torch.equal(out, r + g * u), (B, S, D, g.shape, (out.float() - (r + g * u).float()).abs().max())
        n += 1
# fp16 overflow guard folded into the kernel: == eager `(r + g * u).clip(-65504, 65504)`, inf and NaN included
r = (torch.randn(2, 9, 40) * 6e4).half(); u = (torch.randn(2, 9, 40) * 300).half()
g = (torch.randn(2, 3 * 40) * 300).half().chunk(3, dim=1)[2].unsqueeze(1)
r[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 65504.0]).half()
ref = (r + g * u).clip(-65504, 65504)
assert torch.isinf(r + g * u).any() and not torch.isinf(ref).any() and torch.isnan(ref).any()
out = T.launch(r, u, _gate_as_b1d(r, g), config=dict(BLOCK_S=4, BLOCK_D=32, num_warps=4), clip=65504.0)
assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
n += 1
print("OK", n)
"""


def test_triton_kernel_indexing_in_the_interpreter():
    """Runs the real Triton kernel in Triton's CPU interpreter: indexing, masks and gate strides, fp16.

    (bf16 is checked on the GPU only: the interpreter's fp32->bf16 cast truncates instead of rounding.)"""
    run_in_interpreter(_INTERPRET_PROBE, "OK 13", timeout_s=120)


_GEMM_GELU_PROBE = r"""
import torch, triton
from kernels import _gemm_gelu_triton as G
torch.manual_seed(0)
n = 0
for dtype in (torch.float32, torch.float16):
    for (M, N, K) in ((70, 300, 100), (5, 64, 32)):  # ragged M, N and K tiles; a single tile
        x = torch.randn(M, K).to(dtype)
        w = (torch.randn(N, K) / K**0.5).to(dtype)
        b = torch.randn(N).to(dtype)
        out = torch.full((M, N), float("nan"), dtype=dtype)
        BM, BN, BK = 32, 64, 32  # one fixed config: the autotuner needs a GPU to time
        grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
        G._mm_gelu_kernel.fn[grid](x, w, b, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                   BM=BM, BN=BN, BK=BK, GROUP_M=2)
        y = torch.nn.functional.linear(x.double(), w.double(), b.double())
        ref = torch.nn.functional.gelu(y, approximate="tanh")
        err = (out.double() - ref).abs()
        if dtype == torch.float32:  # the math: a wrong GELU constant is ~5e-6 of |y| away
            assert (err <= 2e-6 * (y.abs() + 1)).all(), (M, N, K, (err / (y.abs() + 1)).max().item())
        else:  # fp16 output: one rounding of the fp32 result
            assert (err <= 2.0**-10 * ref.abs() + 1e-4).all(), (M, N, K, err.max().item())
        n += 1
print("OK", n)
"""


def test_gemm_gelu_kernel_in_the_interpreter():
    """The Triton GEMM + bias + tanh-GELU kernel (a `high` candidate) in the CPU interpreter: every output element
    written, ragged tiles masked, and the epilogue's math against a float64 reference (fp32: a few ulp)."""
    run_in_interpreter(_GEMM_GELU_PROBE, "OK 4")


def test_gelu_dispatch_picks_fastest_correct_impl_with_margin(monkeypatch):
    """The per-shape decision logic, with the timer replaced (CUDA events do not exist on CPU)."""
    layer = _linear(torch.float32)
    x2d = torch.randn(6, 8)
    exact = G._unfused

    def wrong(x, w, b):
        return exact(x, w, b) * 1.5

    def broken(x, w, b):
        raise RuntimeError("no such kernel")

    impls = {"unfused": exact, "slightly_faster": lambda *a: exact(*a), "wrong_but_fast": wrong, "broken": broken}
    fake_ms = {"unfused": 1.0, "slightly_faster": 0.995, "wrong_but_fast": 0.1}
    monkeypatch.setattr(G, "GELU_IMPLS", impls)
    monkeypatch.setenv("FLUXSERVE_GELU_CANDIDATES", "slightly_faster,wrong_but_fast,broken")
    name_of = {f: n for n, f in impls.items()}
    # _decide_by_timing times `lambda f=impl: f(...)`: recover which impl a thunk runs from its default
    monkeypatch.setattr(G, "_time_impl", lambda thunk: fake_ms[name_of[thunk.__defaults__[0]]])
    best, timings = G._decide_by_timing(x2d, layer.weight, layer.bias)
    assert best == "unfused"  # 0.5% faster is inside the noise margin
    assert timings["wrong_but_fast"].startswith("rejected") and timings["broken"].startswith("failed")

    fake_ms["slightly_faster"] = 0.9
    best, _ = G._decide_by_timing(x2d, layer.weight, layer.bias)
    assert best == "slightly_faster"


def test_gelu_dispatch_candidates(monkeypatch):
    monkeypatch.delenv("FLUXSERVE_GELU_CANDIDATES", raising=False)
    assert G._candidates() == ["unfused", "cublaslt"]  # Triton GEMMs are opt-in (they lost on H200)
    monkeypatch.setenv("FLUXSERVE_GELU_CANDIDATES", "cublaslt, triton_tma")
    assert G._candidates() == ["unfused", "cublaslt", "triton_tma"]
    monkeypatch.setenv("FLUXSERVE_GELU_CANDIDATES", "cublaslt,nope")
    with pytest.raises(ValueError, match="unknown \\['nope'\\]"):
        G._candidates()


def test_the_residual_fast_path_takes_exactly_the_gates_eager_broadcasts_alike(monkeypatch) -> None:
    """Which inputs the Triton residual-gate kernel takes (it must reproduce eager bit for bit, so only layouts
    whose broadcasting it repeats), checked on the guard itself with a CUDA device pretended: a per-channel gate
    [D], [1, 1, D] or [B, 1, D] (any batch stride); not a [B, D] gate (eager aligns its B with the sequence), a
    4-d gate, a wrong width, a 0-d gate, a channel stride other than 1, a shape mismatch or an empty input."""
    import kernels.residual as R

    monkeypatch.setattr(R, "_device_supported", lambda device: True)
    B, L, D = 2, 3, 4
    r = torch.randn(B, L, D, dtype=torch.bfloat16)
    u = torch.randn(B, L, D, dtype=torch.bfloat16)

    def gate(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.bfloat16)

    taken = {"[D]": gate(D), "[1,1,D]": gate(1, 1, D), "[B,1,D]": gate(B, 1, D),
             "chunk of [B,6D]": gate(B, 6 * D)[:, None, D:2 * D]}
    for name, g in taken.items():
        g3 = R._fast_path_args(r, u, g)
        assert g3 is not None and g3.shape == (B, 1, D), name
        assert torch.equal(g3.expand(B, L, D), (g * torch.ones_like(r)).expand(B, L, D)), name
    assert R._gate_as_b1d(r, gate(D)).stride(0) == 0  # one gate shared by the batch, not copied
    refused = {"[B,D]": gate(B, D), "[1,1,1,D]": gate(1, 1, 1, D), "[D+1]": gate(D + 1), "0-d": torch.tensor(0.5, dtype=torch.bfloat16),
               "[B,L,D]": gate(B, L, D), "[3,1,D]": gate(3, 1, D), "channel stride 2": gate(B, 1, 2 * D)[..., ::2]}
    for name, g in refused.items():
        assert R._fast_path_args(r, u, g) is None, name
    assert R._fast_path_args(r, u[:, :2], gate(D)) is None  # update of another shape
    empty = torch.empty(B, 0, D, dtype=torch.bfloat16)
    assert R._fast_path_args(empty, empty.clone(), gate(D)) is None
    assert R._fast_path_args(r[..., :2].contiguous(), u[..., :2].contiguous(), gate(2)) is not None  # D = 2
    narrow = gate(B, 1, 4)[..., ::2]  # D = 2 with channel stride 2
    assert R._fast_path_args(r[..., :2].contiguous(), u[..., :2].contiguous(), narrow) is None
