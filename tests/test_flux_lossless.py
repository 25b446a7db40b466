"""Lossless-tier fusions used by model/flux.py: RoPE(+cat) and AdaLN modulation kernels, and their exactness gate.

CPU: the gate's logic (verify once per signature, disable on mismatch/failure with one warning, no verification
while compiling or capturing) and the eager references against diffusers. GPU: each Triton kernel == its eager
chain by torch.equal on FLUX.1 shapes, B = 1 and 2.
"""

from __future__ import annotations

import logging

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import AdaLayerNormZero

from kernels import exact
from kernels.exact import ExactGate, same_values, tensor_signature
from kernels.modulate import modulate, modulate_eager
from kernels.rope import apply_rope_eager, rope_cat, rope_cat_eager


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
    monkeypatch.setattr(exact, "_cannot_verify_now", lambda: True)
    gate.run(("s",), fast, eager)
    assert (fast.calls, eager.calls) == (0, 1) and gate.verdicts() == {}
    monkeypatch.setattr(exact, "_cannot_verify_now", lambda: False)
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
