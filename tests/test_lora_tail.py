"""PEFT's LoRA term in one fused pass (`kernels.lora.lora_tail`, hooked onto PEFT's layers by `model/peft_tail.py`):
the kernel keeps PEFT's three roundings (interpreter on the CPU, the GPU against cuBLAS), the hook computes exactly
what PEFT's forward computes and hands every state it does not cover back to PEFT, and a served pipeline's adapters
go through it while staying byte-identical to stock diffusers."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from tests._interpret import run_in_interpreter

peft = pytest.importorskip("peft")

_KERNEL_PROBE = r"""
import torch
from kernels import lora as L
from kernels import _lossless_triton as K
torch.manual_seed(0)
n = 0
# fp16 and fp32 (the interpreter has no bf16; the GPU test covers it). Integer A-products are exact in any summation
# order, and large enough that fp16 rounds them: a missing rounding step or a wrong operand shows.
for dtype in (torch.float16, torch.float32):
    for (M, N, r) in ((70, 200, 32), (5, 130, 16), (64, 128, 64)):  # ragged row and column blocks
        t = torch.randint(-16, 17, (M, r)).to(dtype)
        b = torch.randint(-16, 17, (N, r)).to(dtype)
        y = (torch.randn(M, N) * 1000).to(dtype)
        got = K.lora_tail(y, t, b, 0.3)
        want = L.lora_tail_eager(y, t, b, 0.3)
        assert torch.equal(got, want), (dtype, M, N, r, (got.double() - want.double()).abs().max())
        n += 1
# the op on [B, S, *] rows with the device check passed: verified once against eager, then fused
L._device_supported = lambda device: True
y3 = y = (torch.randn(2, 7, 48) * 1000).half()
t3 = t = torch.randint(-16, 17, (2, 7, 16)).half()
b3 = b = torch.randint(-16, 17, (48, 16)).half()
for _ in range(2):
    assert torch.equal(L.lora_tail(y, t, b, 0.3), L.lora_tail_eager(y, t, b, 0.3))
assert L.GATE.fast_calls == 1 and list(L.GATE.verdicts().values()) == [True], L.GATE.verdicts()
n += 1
# two adapters' terms in one pass: PEFT's two sums, each rounded (ranks may differ)
for dtype in (torch.float16, torch.float32):
    for (M, N, r, r2) in ((70, 200, 32, 16), (64, 128, 16, 16)):
        t, t2 = torch.randint(-16, 17, (M, r)).to(dtype), torch.randint(-16, 17, (M, r2)).to(dtype)
        b, b2 = torch.randint(-16, 17, (N, r)).to(dtype), torch.randint(-16, 17, (N, r2)).to(dtype)
        y = (torch.randn(M, N) * 1000).to(dtype)
        got = K.lora_tail2(y, t, b, 0.3, t2, b2, -0.7)
        want = L.lora_tail_eager(L.lora_tail_eager(y, t, b, 0.3), t2, b2, -0.7)
        assert torch.equal(got, want), (dtype, M, N, r, r2)
        n += 1
t2 = torch.randint(-16, 17, (2, 7, 32)).half()
b2 = torch.randint(-16, 17, (48, 32)).half()
calls = L.GATE.fast_calls
for _ in range(2):  # through add_terms (three terms: two in one pass, then one)
    got = L.add_terms(y3, [(t3, b3, 0.3), (t2, b2, -0.7), (t3, b3, 0.5)])
    want = L.lora_tail_eager(L.lora_tail_eager(L.lora_tail_eager(y3, t3, b3, 0.3), t2, b2, -0.7), t3, b3, 0.5)
    assert torch.equal(got, want)
# the pair compared once, then fused; the third term (a shape seen above) fused both times
assert L.GATE.fast_calls == calls + 3 and sum(1 for k in L.GATE.verdicts() if k[0] == "two terms") == 1
n += 1
# the term inside the GELU pass into a column slice: the same bits as the term's kernel, then the GELU's
for dtype in (torch.float16, torch.float32):
    for (M, N, r) in ((70, 200, 32), (5, 130, 16)):
        t = torch.randint(-16, 17, (M, r)).to(dtype) / 64
        b = torch.randint(-16, 17, (N, r)).to(dtype) / 64
        y = (torch.randn(M, N) * 3).to(dtype)
        buf = torch.full((M, N + 24), 7.0, dtype=dtype)
        K.gelu_tanh_lora(y, t, b, 0.3, buf[:, 24:])
        chain = torch.empty_like(y)
        K.gelu_tanh(K.lora_tail(y, t, b, 0.3), chain)
        assert torch.equal(buf[:, 24:], chain), (dtype, M, N, r)
        assert bool((buf[:, :24] == 7.0).all())
        n += 1
print("OK", n)
"""


def test_the_lora_tail_kernel_keeps_peft_roundings_in_the_interpreter() -> None:
    """The real kernel in Triton's CPU interpreter equals PEFT's `y + F.linear(t, B) * s` bit for bit (fp16, fp32;
    ragged blocks), and the op on batched rows goes through its gate (one comparison, then the kernel); two adapters'
    terms in one pass equal PEFT's two sums (and `add_terms` pairs them); the GELU pass with the term inside equals
    the term's kernel followed by the GELU's, into a column slice. Catches a rounding step left out (after the dot,
    after the scale, between the two sums, before the GELU), B read transposed, masks past the edges, the slice's row
    stride ignored, a term of three dropped."""
    run_in_interpreter(_KERNEL_PROBE, "OK 16")


_RESIDUAL_PROBE = r"""
import torch
from kernels import residual as Res
from kernels import lora as L
from kernels import _residual_triton as K
torch.manual_seed(0)
n = 0
# residual + gate * (update + F.linear(t, B) * s): PEFT's three roundings, then eager's two; fp16 (values large
# enough that every rounding shows) and fp32; a shared gate (batch stride 0) and a per-image one; clip or none;
# S and D ragged against the tile.
for dtype in (torch.float16, torch.float32):
    for (B, S, D, r) in ((2, 70, 200, 32), (1, 5, 130, 16), (3, 64, 128, 16)):
        t = torch.randint(-16, 17, (B, S, r)).to(dtype)
        b = torch.randint(-16, 17, (D, r)).to(dtype)
        update = (torch.randn(B, S, D) * 1000).to(dtype)
        residual = (torch.randn(B, S, D) * 3000).to(dtype)
        for gate in (torch.randn(1, 1, D).to(dtype).expand(B, 1, D), torch.randn(B, 6 * D).to(dtype)[:, None, :D]):
            for clip in (None, 4000.0):
                got = K.launch_lora(residual, update, gate, t, b, 0.3, clip=clip)
                want = Res._eager(residual, L.lora_tail_eager(update, t, b, 0.3), gate, clip)
                assert torch.equal(got, want), (dtype, B, S, D, r, clip, (got.double() - want.double()).abs().max())
                n += 1
# through the op, the device check passed: one comparison against eager, then the kernel; two terms: PEFT's order
Res._device_supported = lambda device: True
L._device_supported = lambda device: True
t = torch.randint(-16, 17, (2, 7, 16)).half()
b = torch.randint(-16, 17, (48, 16)).half()
update, residual = (torch.randn(2, 7, 48) * 1000).half(), (torch.randn(2, 7, 48) * 1000).half()
gate = torch.randn(2, 1, 48).half()
for _ in range(2):
    got = Res.residual_gate_add(residual, update, gate, terms=[(t, b, 0.3)])
    assert torch.equal(got, Res._eager(residual, L.lora_tail_eager(update, t, b, 0.3), gate))
assert Res.LORA_GATE.fast_calls == 1 and list(Res.LORA_GATE.verdicts().values()) == [True], Res.LORA_GATE.verdicts()
two = [(t, b, 0.3), (t / 4, b, -0.7)]
got = Res.residual_gate_add(residual, update, gate, terms=two)
want = Res._eager(residual, L.lora_tail_eager(L.lora_tail_eager(update, *two[0]), *two[1]), gate)
assert torch.equal(got, want)
n += 1
print("OK", n)
"""


def test_the_residual_pass_with_a_term_keeps_peft_and_eager_roundings_in_the_interpreter() -> None:
    """The residual-gate pass that adds an adapter's term to its update first (the output projections' terms, handed
    over by `kernels.lora.deferred`) equals PEFT's output followed by eager's `residual + gate * update`, bit for
    bit, in the interpreter: fp16 / fp32, ragged tiles, shared and per-image gates, with and without the clip; the op
    verifies once then runs the kernel, and adds two terms in PEFT's order. Catches a rounding step left out, the
    next image's rows written, the gate's batch stride ignored, terms reordered."""
    run_in_interpreter(_RESIDUAL_PROBE, "OK 25")


def _peft_layer(dtype: torch.dtype = torch.bfloat16, **config) -> nn.Module:
    """A PEFT LoRA linear [24 -> 40] holding adapters "a" (rank 16) and "b" (rank 32), both active, B random (PEFT
    starts it at zero, which would hide every ordering mistake)."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(proj=nn.Linear(24, 40)))
    for name, r in (("a", 16), ("b", 32)):
        model = inject_adapter_in_model(LoraConfig(r=r, lora_alpha=7, target_modules=["proj"], **config), model,
                                        adapter_name=name)
    layer = model.proj
    with torch.no_grad():
        for name in ("a", "b"):
            layer.lora_B[name].weight.normal_()
    layer.set_adapter(["a", "b"])
    return layer.to(dtype).eval()


def _peft(layer: nn.Module, x: torch.Tensor, **kwargs) -> torch.Tensor:
    return type(layer).forward(layer, x, **kwargs)  # PEFT's own forward, whatever the instance's is


@pytest.fixture
def tail_calls(monkeypatch) -> list[tuple]:
    """Each term the hook adds through `lora_tail` (one term) or `lora_tail2` (two in one pass): (rank, scale)."""
    from kernels import lora

    calls: list[tuple] = []
    real, real2 = lora.lora_tail, lora.lora_tail2

    def spy(y, t, b, scale):
        calls.append((t.shape[-1], scale))
        return real(y, t, b, scale)

    def spy2(y, first, second):
        calls.extend((t.shape[-1], scale) for t, _, scale in (first, second))
        return real2(y, first, second)

    monkeypatch.setattr(lora, "lora_tail", spy)
    monkeypatch.setattr(lora, "lora_tail2", spy2)
    return calls


def test_rows_wider_than_the_passes_32_bit_offsets_reach_stay_eager(monkeypatch) -> None:
    """The LoRA passes address a tile by 32-bit offsets from its first row: rows (or, for the GELU pass, an output
    row stride) past `MAX_ROW` elements get no kernel signature, so they run eager. Catches the bound dropped."""
    from kernels import gelu, lora

    monkeypatch.setattr(lora, "_device_supported", lambda device: True)
    monkeypatch.setattr(gelu, "_into_device_supported", lambda device: True)
    y, t, b = torch.zeros(2, 4, 48).half(), torch.zeros(2, 4, 16).half(), torch.zeros(48, 16).half()
    assert lora.signature(y, t, b) is not None
    monkeypatch.setattr(lora, "MAX_ROW", 32)
    assert lora.signature(y, t, b) is None
    monkeypatch.setattr(lora, "MAX_ROW", 48)  # (rows of exactly MAX_ROW are taken)
    assert lora.signature(y, t, b) is not None
    y, t = y[0], t[0]
    launched, apart = [], []
    monkeypatch.setattr(gelu.GELU_LORA_GATE, "run", lambda *a: launched.append(a))
    monkeypatch.setattr(lora, "lora_tail", lambda h, *a: apart.append("term") or h)
    monkeypatch.setattr(gelu, "gelu_tanh_into", lambda h, out: apart.append("gelu") or out)
    gelu._gelu_tanh_lora_into(y, torch.zeros(4, 64).half()[:, 8:56], t, b, 0.5)  # out rows 64 apart
    assert launched == [] and apart == ["term", "gelu"]


def test_the_hook_adds_each_active_adapter_as_peft_does(tail_calls) -> None:
    """A hooked PEFT layer's output equals PEFT's forward bit for bit (bf16, two adapters of different ranks and
    scales, a batch of rows), through one tail per active adapter in PEFT's order with PEFT's scaling; a second
    install does not hook twice. Catches an adapter skipped or added twice, the scale ignored or squared, the order of
    the two sums swapped, the base layer's output lost."""
    from diffusers.hooks import HookRegistry

    from model.peft_tail import HOOK, install

    layer = _peft_layer()
    x = torch.randn(3, 5, 24).bfloat16()
    want = _peft(layer, x)
    assert install(layer) == 1 and install(layer) == 1
    assert list(HookRegistry.check_if_exists_or_initialize(layer).hooks) == [HOOK]
    assert torch.equal(layer(x), want)
    assert tail_calls == [(16, layer.scaling["a"]), (32, layer.scaling["b"])]
    layer.set_scale("b", 0.25)
    tail_calls.clear()
    assert torch.equal(layer(x), _peft(layer, x)) and tail_calls[1] == (32, layer.scaling["b"])


def test_a_consumer_that_asks_gets_the_base_output_and_the_terms_to_add() -> None:
    """Inside `kernels.lora.deferred(layer)` that hooked layer returns its base output and leaves (t, B, scale) per
    active adapter, in PEFT's order, which `add_terms` turns into PEFT's output; another adapter layer called inside
    (an attention's q before its output projection) adds its own; so does a second call of the layer; a state the
    hook does not cover leaves nothing and returns PEFT's whole output. Catches terms added twice (by the layer and
    by the consumer), lost, reordered, taken from the wrong layer, or kept for a later call."""
    from kernels import lora
    from model.peft_tail import install

    layer, other = _peft_layer(), _peft_layer()
    install(layer)
    install(other)
    x = torch.randn(3, 24).bfloat16()
    with lora.deferred(layer) as terms:
        first = other(x)
        y = layer(x)
        after = layer(x)
    assert torch.equal(first, _peft(other, x))
    assert torch.equal(y, layer.base_layer(x)) and torch.equal(after, _peft(layer, x))
    assert [(t.shape[-1], b is layer.lora_B[n].weight, s) for (t, b, s), n in zip(terms, "ab")] == [
        (16, True, layer.scaling["a"]), (32, True, layer.scaling["b"])]
    assert torch.equal(lora.add_terms(y, terms), _peft(layer, x))
    layer.merge(adapter_names=["a"])
    with lora.deferred(layer) as terms:
        got = layer(x)
    assert terms == [] and torch.equal(got, _peft(layer, x))


def test_consumers_ask_for_terms_only_once_adapter_layers_are_hooked(monkeypatch) -> None:
    """Before any adapter layer is hooked a block's `deferred` takes no terms (no bookkeeping per block and step);
    after `install` it does. Catches the skip left on once layers defer (their terms added by no one or twice)."""
    from kernels import lora
    from model.peft_tail import install

    monkeypatch.setattr(lora, "_ACCEPTING", False)
    layer = _peft_layer()
    x = torch.randn(3, 24).bfloat16()
    with lora.deferred(layer) as terms:
        assert lora.defer(layer, [(x, x, 1.0)]) is False
    assert terms == []
    install(layer)
    with lora.deferred(layer) as terms:
        y = layer(x)
    assert len(terms) == 2 and torch.equal(lora.add_terms(y, terms), _peft(layer, x))


def test_the_gelu_pass_adds_every_term_it_is_handed_in_order(tail_calls) -> None:
    """Two adapters on the MLP up-projection: the GELU pass into a slice adds both terms, in PEFT's order, before
    the GELU (one term goes inside its own pass; more through `add_terms` first). Catches terms dropped, reordered
    or applied after the GELU."""
    from kernels import lora
    from kernels.gelu import gelu_tanh_into
    from model.peft_tail import install

    layer = _peft_layer()
    install(layer)
    x = torch.randn(2, 3, 24).bfloat16()
    for adapters in (["a", "b"], ["a"]):
        layer.set_adapter(adapters)
        buf = torch.zeros(2, 3, 48, dtype=torch.bfloat16)
        with torch.no_grad():  # (served: inference; out= writes take no autograd)
            with lora.deferred(layer) as terms:
                h = layer(x)
            assert len(terms) == len(adapters)
            gelu_tanh_into(h, buf[..., 8:], terms)
            want = torch.nn.functional.gelu(_peft(layer, x), approximate="tanh")
        assert torch.equal(buf[..., 8:], want) and not buf[..., :8].any()


def test_a_gelu_site_without_a_buffer_takes_its_layers_terms_into_the_gelu_pass(monkeypatch) -> None:
    """The double blocks' feed-forward (a GELU site that allocates its output): an adapter layer there hands its terms
    to the GELU's pass as the single blocks' MLP does, the same bits as GELU(PEFT's output); a plain layer keeps
    aten's GELU. Catches the terms added twice or lost, or the plain site sent through the pass."""
    from kernels import gelu
    from model.peft_tail import install

    handed: list[int] = []
    real = gelu.gelu_tanh_into
    monkeypatch.setattr(gelu, "gelu_tanh_into",
                        lambda h, out, terms=(): handed.append(len(terms)) or real(h, out, terms))
    layer = _peft_layer()
    install(layer)
    site = nn.Module()
    site.proj = layer
    x = torch.randn(2, 3, 24).bfloat16()
    with torch.no_grad():
        for adapters in (["a", "b"], ["a"]):
            layer.set_adapter(adapters)
            got = gelu.gelu_site(site, "proj", x)
            assert torch.equal(got, torch.nn.functional.gelu(_peft(layer, x), approximate="tanh"))
        assert handed == [2, 1, 0]  # (one term, on the CPU: its own pass, then the GELU's)
        site.proj = layer.base_layer
        assert torch.equal(gelu.gelu_site(site, "proj", x),
                           torch.nn.functional.gelu(layer.base_layer(x), approximate="tanh"))
    assert handed == [2, 1, 0]


def test_an_adapter_trained_with_dropout_serves_through_the_tail(tail_calls) -> None:
    """Dropout in eval mode (a served model) passes its input through, so the hook covers it: the same output as
    PEFT's forward, through the tail. Catches such adapters sent to PEFT's slower path (or dropout applied)."""
    from model.peft_tail import install

    layer = _peft_layer(lora_dropout=0.5)
    install(layer)
    x = torch.randn(4, 24).bfloat16()
    assert torch.equal(layer(x), _peft(layer, x)) and len(tail_calls) == 2


@pytest.mark.parametrize("state", ["disabled", "merged", "adapter_names", "dtype", "dora", "dropout"])
def test_states_the_hook_does_not_cover_run_pefts_own_forward(state: str, tail_calls) -> None:
    """Adapters off, merged, per-row adapter names, an input PEFT would cast, DoRA, dropout in training: the hook
    hands the call to PEFT's forward (the same output, no tail). Catches the fused pass run where PEFT does
    something else (a merged adapter added twice, DoRA's magnitude ignored, dropout skipped while training)."""
    from model.peft_tail import install

    layer = _peft_layer(**({"use_dora": True} if state == "dora" else
                           {"lora_dropout": 0.5} if state == "dropout" else {}))
    install(layer)
    x, kwargs = torch.randn(4, 24).bfloat16(), {}
    if state == "disabled":
        layer.enable_adapters(False)
    elif state == "merged":
        layer.merge(adapter_names=["a"])
    elif state == "adapter_names":
        kwargs = {"adapter_names": ["a", "b", "__base__", "a"]}
    elif state == "dtype":  # an fp32 layer with bf16 adapters: PEFT casts the input for them
        layer.float()
        for name in ("a", "b"):
            layer.lora_A[name].bfloat16(), layer.lora_B[name].bfloat16()
        x = x.float()
    elif state == "dropout":
        layer.train()
    if state == "dropout":
        torch.manual_seed(1)
        got = layer(x)
        torch.manual_seed(1)
        want = _peft(layer, x)
    else:
        got, want = layer(x, **kwargs), _peft(layer, x, **kwargs)
    assert torch.equal(got, want) and tail_calls == []


class _Trio(nn.Module):
    """Three layers that read one input (as a block's q, k, v do), declared as the blocks declare them, each with
    adapters "a" (rank 16) and "b" (rank 32); integer weights, so any summation order gives the same sums (the gate's
    verdict is then the same on every BLAS) while a product handed to the wrong layer still shows."""

    def __init__(self) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        super().__init__()
        self.q, self.k, self.v = nn.Linear(24, 40), nn.Linear(24, 40), nn.Linear(24, 40)
        for name, r in (("a", 16), ("b", 32)):
            inject_adapter_in_model(LoraConfig(r=r, lora_alpha=7, target_modules=["q", "k", "v"]), self,
                                    adapter_name=name)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=g))
        for layer in self.layers():
            layer.set_adapter(["a", "b"])

    def layers(self) -> tuple[nn.Module, ...]:
        return self.q, self.k, self.v

    def shared_input_groups(self) -> tuple[tuple[nn.Module, ...], ...]:
        return (self.layers(),)


def _a_calls(model: nn.Module) -> list[str]:
    """Names of the LoRA A modules as they are called (each layer multiplying its own input)."""
    calls: list[str] = []
    for name, m in model.named_modules():
        if name.endswith(("lora_A.a", "lora_A.b")):
            m.register_forward_hook(lambda mod, args, out, name=name: calls.append(name))
    return calls


def test_layers_reading_one_input_take_their_a_products_from_one_gemm() -> None:
    """q, k, v on one input: each adapter's x A^T for the three from one GEMM against their stacked A's (after the
    gate compared it once per adapter), each layer's output equal to PEFT's bit for bit; k on another input
    multiplies its own. Catches a layer handed another layer's (or another adapter's) product, a product kept for a
    different input, the stacked GEMM skipped after the gate agreed."""
    from model.peft_tail import SHARED_A_GATE, install

    model = _Trio().bfloat16().eval()
    x = torch.randint(-3, 4, (2, 5, 24)).bfloat16()
    want = [_peft(m, x) for m in model.layers()]
    install(model)
    calls = _a_calls(model)
    SHARED_A_GATE.reset()
    with torch.no_grad():
        for _ in range(2):
            assert all(torch.equal(m(x), w) for m, w in zip(model.layers(), want))
        assert calls == [] and sorted(SHARED_A_GATE.verdicts().values()) == [True, True]
        assert SHARED_A_GATE.fast_calls == 2  # the second round: one GEMM per adapter for the three layers
        other = torch.randint(-3, 4, (2, 5, 24)).bfloat16()
        assert torch.equal(model.q(x), want[0]) and torch.equal(model.k(other), _peft(model.k, other))
        assert torch.equal(model.v(x), want[2])


def test_products_no_layer_takes_keep_no_input_alive_and_inactive_adapters_stay_out() -> None:
    """q on an input computes k's and v's products too; if they never come, the input is still freed (a block's
    activations must not outlive it). k with only adapter "a" active: q, k, v still equal PEFT. Catches the group
    holding its input strongly, an inactive adapter's term added."""
    import gc
    import weakref

    from model.peft_tail import install

    model = _Trio().bfloat16().eval()
    install(model)
    x = torch.randint(-3, 4, (2, 5, 24)).bfloat16()
    with torch.no_grad():
        model.q(x)
    held = weakref.ref(x)
    del x
    gc.collect()
    assert held() is None
    model.k.set_adapter(["a"])
    x = torch.randint(-3, 4, (4, 24)).bfloat16()
    want = [_peft(m, x) for m in model.layers()]
    calls = _a_calls(model)
    with torch.no_grad():
        for _ in range(2):  # (the first round compares)
            assert all(torch.equal(m(x), w) for m, w in zip(model.layers(), want))
    assert calls == []  # "b" on q and v alone is a pair: one GEMM still


def test_the_stacked_as_kept_follows_the_weights_and_splits_any_widths() -> None:
    """The stacked A's are kept between calls and made again when a member's A changes in place (the old stack kept
    for graphs that may read it); ranks that differ between the layers (a rank pattern) split by their widths; a new
    input shape is compared on its own. Catches a stale stack, a stack freed under a graph, widths mixed up, one
    verdict reused for another shape."""
    from peft import LoraConfig, inject_adapter_in_model

    from model.peft_tail import SHARED_A_GATE, _hook, install

    model = _Trio()
    inject_adapter_in_model(LoraConfig(r=16, lora_alpha=7, target_modules=["q", "k", "v"], rank_pattern={"k": 32}),
                            model, adapter_name="c")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".c." in name or name.endswith(".c.weight"):
                p.copy_(torch.randint(-2, 3, p.shape, generator=g))
    model = model.bfloat16().eval()
    for m in model.layers():
        m.set_adapter(["a", "c"])
    install(model)
    group = _hook(model.q).group
    SHARED_A_GATE.reset()
    x = torch.randint(-3, 4, (2, 3, 24)).bfloat16()
    with torch.no_grad():
        for _ in range(2):
            assert all(torch.equal(m(x), _peft(m, x)) for m in model.layers())
        first = group._stacked["a"][1]
        model.q(x), model.k(x), model.v(x)
        assert group._stacked["a"][1] is first  # kept
        model.k.lora_A["a"].weight.add_(1)
        assert all(torch.equal(m(x), _peft(m, x)) for m in model.layers())
        assert group._stacked["a"][1] is not first and group._retired == [first]
        assert sorted(s[-1] for s in SHARED_A_GATE.verdicts()) == [(16, 16, 16), (16, 32, 16)]  # (the widths)
        wide = torch.randint(-3, 4, (2, 5, 24)).bfloat16()
        assert all(torch.equal(m(wide), _peft(m, wide)) for m in model.layers())
        assert len(SHARED_A_GATE.verdicts()) == 4


def test_under_autograd_or_while_a_graph_captures_unverified_each_layer_multiplies_its_own(monkeypatch) -> None:
    """With autograd on, the stacked copy would cut A's gradient: each layer runs its own A (the gradient reaches
    A); with the switch `lora_shared_a` off, and while nothing can be compared (a capture) and the gate has no
    verdict, each layer runs its own A too. Catches the shared GEMM under autograd, switched off, or unverified."""
    from kernels import exact, switches
    from model.peft_tail import SHARED_A_GATE, install

    model = _Trio().bfloat16().eval()
    install(model)
    SHARED_A_GATE.reset()
    x = torch.randint(-3, 4, (3, 24)).bfloat16()
    with torch.enable_grad():
        model.q(x).float().sum().backward()
    assert model.q.lora_A["a"].weight.grad is not None and SHARED_A_GATE.verdicts() == {}
    with torch.no_grad():
        want = [_peft(m, x) for m in model.layers()]
    calls = _a_calls(model)
    with torch.no_grad(), switches.override(lora_shared_a=False):  # the switch off: the same
        assert all(torch.equal(m(x), w) for m, w in zip(model.layers(), want))
    assert len(calls) == 3 * 2 and SHARED_A_GATE.verdicts() == {}
    monkeypatch.setattr(exact, "cannot_verify_now", lambda: True)
    monkeypatch.setattr("model.peft_tail.cannot_verify_now", lambda: True)
    with torch.no_grad():
        assert all(torch.equal(m(x), w) for m, w in zip(model.layers(), want))
    assert len(calls) == 2 * 3 * 2 and SHARED_A_GATE.verdicts() == {}


def test_a_pair_reading_one_input_shares_its_gemm_too() -> None:
    """A group of two (q and v, as a block with k unadapted declares): one GEMM per adapter after the comparison.
    Catches groups of two left apart."""
    from model.peft_tail import SHARED_A_GATE, install

    model = _Trio().bfloat16().eval()
    model.shared_input_groups = lambda: ((model.q, model.v),)
    install(model)
    x = torch.randint(-3, 4, (3, 24)).bfloat16()
    with torch.no_grad():
        want = [_peft(m, x) for m in (model.q, model.v)]
        SHARED_A_GATE.reset()
        calls = _a_calls(model)
        for _ in range(2):
            assert torch.equal(model.q(x), want[0]) and torch.equal(model.v(x), want[1])
    assert calls == [] and SHARED_A_GATE.fast_calls == 2


def test_a_layer_whose_a_is_in_another_dtype_stays_out_of_the_stack() -> None:
    """k's A in fp32 beside bf16 q and v (PEFT casts k's input): the group does not stack it, and every layer equals
    PEFT. Catches a stack of mixed dtypes."""
    from model.peft_tail import install

    model = _Trio().bfloat16().eval()
    model.k.lora_A["a"].float(), model.k.lora_B["a"].float()
    install(model)
    x = torch.randint(-3, 4, (3, 24)).bfloat16()
    with torch.no_grad():
        for _ in range(2):
            assert all(torch.equal(m(x), _peft(m, x)) for m in model.layers())


def test_where_the_stacked_gemm_differs_each_layer_multiplies_its_own(monkeypatch, caplog) -> None:
    """A stacked product whose columns differ from a layer's own GEMM (as cuBLAS may for some shapes): the gate
    refuses that signature once, and every layer runs its own A, equal to PEFT. Catches the stacked result used
    without or against the comparison."""
    import types

    import torch.nn.functional as F

    from model import peft_tail

    def linear(x, w, bias=None):  # a GEMM that rounds differently past 32 output columns (only the stacked ones)
        y = F.linear(x, w, bias)
        return y + 1 if w.shape[0] > 32 else y

    monkeypatch.setattr(peft_tail, "F", types.SimpleNamespace(linear=linear))
    model = _Trio().bfloat16().eval()
    x = torch.randint(-3, 4, (3, 24)).bfloat16()
    want = [_peft(m, x) for m in model.layers()]
    peft_tail.install(model)
    calls = _a_calls(model)
    peft_tail.SHARED_A_GATE.reset()
    with torch.no_grad():
        for _ in range(2):
            assert all(torch.equal(m(x), w) for m, w in zip(model.layers(), want))
    assert sorted(peft_tail.SHARED_A_GATE.verdicts().values()) == [False, False]
    # round 1 took the products the comparison made; round 2: each layer its own A, per adapter
    assert peft_tail.SHARED_A_GATE.fast_calls == 0 and len(calls) == 3 * 2
    assert any("differs from eager" in r.getMessage() for r in caplog.records)


def test_a_pipeline_hooks_every_adapter_layer_it_loads(tiny_path: Path, tmp_path: Path, tail_calls,
                                                      monkeypatch) -> None:
    """Adapters loaded at start and while serving (PEFT) end hooked, and a lossless batch with them runs its terms
    through the tail (rank 16: the kernel's) and equals stock diffusers with PEFT bit for bit (here the CPU, so the
    tail's eager twin; the GPU test below runs the kernel); a single block whose MLP up-projection has an adapter
    still writes its GELU straight into proj_out's input (no cat), the adapter's term left to that pass; the output
    projections' terms (attention out, FF down, proj_out) go to the residual-gate pass after them, and the double
    blocks' FF up-projection's to their GELU's pass. Catches a load path that leaves its layers unhooked, an adapted
    proj_mlp sent back to the cat, a term added twice or never.""" 
    from diffusers.hooks import HookRegistry

    import kernels.gelu
    from model import flux

    into: list[bool] = []
    real_site, real_into = flux.gelu_site, kernels.gelu.gelu_tanh_into
    handed: list[tuple[bool, int]] = []  # (into a fresh buffer, not a slice; terms) per GELU pass

    def site(module, attr, x, out=None):
        if attr == "proj_mlp":
            into.append(out is not None)
        return real_site(module, attr, x, out=out)

    def gelu_into(h, out, terms=()):
        handed.append((out.is_contiguous(), len(terms)))
        return real_into(h, out, terms)

    monkeypatch.setattr(flux, "gelu_site", site)
    monkeypatch.setattr(kernels.gelu, "gelu_tanh_into", gelu_into)
    real_residual, to_residual = flux.residual_gate_add, []

    def residual(*args, terms=(), **kw):
        to_residual.append(len(terms))
        return real_residual(*args, terms=terms, **kw)

    monkeypatch.setattr(flux, "residual_gate_add", residual)

    from model.loading import diffusers_reference, load_pipeline
    from model.pipeline import GenerationRequest, run_flux_pipeline
    from model.peft_tail import HOOK, install
    from tests._inputs import write_random_lora

    def hooked() -> list[bool]:
        return [HookRegistry.check_if_exists_or_initialize(m).get_hook(HOOK) is not None
                for m in ours.transformer.modules() if isinstance(m, peft.tuners.lora.Linear)]

    ours = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    # on layers apart, so that the adapter loaded while serving brings PEFT layers of its own
    files = {n: str(write_random_lora(ours.transformer, tmp_path / f"{n}.safetensors", s, rank=16, targets=targets))
             for n, s, targets in (("ink", 1, ("attn.to_q", "proj_mlp")),
                                   ("sun", 2, ("attn.to_v", "ff.net.0.proj", "ff.net.2", "attn.to_out.0", "proj_out")))}
    ref = diffusers_reference(ours)
    ours.load_loras({"ink": files["ink"]})
    assert hooked() and all(hooked())
    first = len(hooked())
    ours.add_lora("sun", files["sun"])
    assert len(hooked()) > first and all(hooked())
    adapted = hooked()
    assert install(ours.transformer) == len(adapted)  # (counts the layers it hooked)
    for name, path in files.items():
        ref.load_lora_weights(path, adapter_name=name)
    ref.set_adapters(["ink", "sun"], [0.8, 0.5])
    req = GenerationRequest("a red fox", height=64, width=64, steps=2, seed=5, loras=(("ink", 0.8), ("sun", 0.5)))
    from model.peft_tail import SHARED_A_GATE

    SHARED_A_GATE.reset()
    got = ours.generate([req])[0]
    lat, png = run_flux_pipeline(ref, [req])
    assert torch.equal(got.latents, lat[0]) and got.png == png[0]
    # ink's q and MLP-in of a single block read one input: their A's were multiplied as one (whichever way the gate
    # found this CPU's GEMM to go, the bytes above are PEFT's)
    assert SHARED_A_GATE.verdicts()
    assert len(tail_calls) >= 2 * len(adapted) and {r for r, _ in tail_calls} == {16}
    # each proj_mlp site hands ink's term to the GELU pass (which, on the CPU, adds it and calls itself again)
    assert into and all(into) and [n for fresh, n in handed if not fresh].count(1) == len(into)
    # and each double block's FF hands sun's up-projection term to its GELU pass (two steps)
    ups = [n for n, m in ours.transformer.named_modules() if isinstance(m, peft.tuners.lora.Linear)
           and n.endswith("ff.net.0.proj")]
    assert ups and [n for fresh, n in handed if fresh].count(1) == 2 * len(ups)
    # one term per adapted output projection per forward (two steps), none elsewhere
    outputs = [n for n, m in ours.transformer.named_modules() if isinstance(m, peft.tuners.lora.Linear)
               and n.endswith(("attn.to_out.0", "ff.net.2", "proj_out"))]
    assert outputs and to_residual.count(1) == 2 * len(outputs) and set(to_residual) == {0, 1}
    # an adapter removed while serving leaves no stacked copy of its A's behind
    from model.peft_tail import _hook

    def stacked() -> set[str]:
        return {n for m in ours.transformer.modules() if isinstance(m, peft.tuners.lora.Linear)
                and _hook(m).group is not None for n in _hook(m).group._stacked}

    assert "ink" in stacked()
    ours.remove_lora("ink")
    assert "ink" not in stacked()


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [16, 32, 64, 128])
def test_gpu_the_lora_tail_kernel_sums_as_cublas_does(rank: int) -> None:
    """On CUDA in bf16, at FLUX.1's adapter shapes, the kernel equals PEFT's eager chain (cuBLAS's K = r GEMM, the
    scale, the sum) bit for bit, so the gate lets it run. Fails where Triton's tensor-core dot sums a K = r product
    otherwise than cuBLAS (the gate would then keep eager: exact, without the speed)."""
    from kernels import lora as L

    L.GATE.reset()
    g = torch.Generator(device="cuda").manual_seed(rank)
    for rows, cols in ((4096, 3072), (4608, 12288), (512, 3072), (2, 3072)):
        t = torch.randn(1, rows, rank, device="cuda", generator=g).bfloat16()
        b = (torch.randn(cols, rank, device="cuda", generator=g) * 0.05).bfloat16()
        y = torch.randn(1, rows, cols, device="cuda", generator=g).bfloat16()
        for _ in range(2):
            assert torch.equal(L.lora_tail(y, t, b, 0.75), L.lora_tail_eager(y, t, b, 0.75)), (rows, cols)
    assert all(L.GATE.verdicts().values()) and L.GATE.fast_calls == 4, L.GATE.verdicts()


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [(16, 16), (16, 32)])
def test_gpu_two_adapters_in_one_pass_equal_pefts_two_sums(ranks: tuple[int, int]) -> None:
    """On CUDA in bf16, at FLUX.1's adapter shapes, two adapters' terms in one pass (`lora_tail2`, what `add_terms`
    runs for a pair) equal PEFT's two eager sums bit for bit, so the gate lets the pass run."""
    from kernels import lora as L

    L.GATE.reset()
    g = torch.Generator(device="cuda").manual_seed(sum(ranks))
    for rows, cols in ((4096, 3072), (4608, 12288), (512, 3072)):
        y = torch.randn(1, rows, cols, device="cuda", generator=g).bfloat16()
        terms = [(torch.randn(1, rows, r, device="cuda", generator=g).bfloat16(),
                  (torch.randn(cols, r, device="cuda", generator=g) * 0.05).bfloat16(), s)
                 for r, s in zip(ranks, (0.75, -0.5))]
        for _ in range(2):
            want = L.lora_tail_eager(L.lora_tail_eager(y, *terms[0]), *terms[1])
            assert torch.equal(L.add_terms(y, terms), want), (rows, cols)
    assert all(L.GATE.verdicts().values()) and L.GATE.fast_calls == 3, L.GATE.verdicts()


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [16, 64])
def test_gpu_the_residual_pass_with_a_term_equals_peft_then_the_residual(rank: int) -> None:
    """On CUDA in bf16, at FLUX.1's output projections (image stream 4096 x 3072, text 512 x 3072, the joint
    4608 x 3072; a per-image gate of the AdaLN's chunks; the text stream's clip): the residual-gate pass with the
    term inside equals PEFT's output followed by eager's residual, so its gate lets it run."""
    from kernels import lora as L
    from kernels import residual as R

    R.LORA_GATE.reset()
    g = torch.Generator(device="cuda").manual_seed(rank)
    for batch, rows, clip in ((1, 4096, None), (2, 512, 65504.0), (1, 4608, None)):
        t = torch.randn(batch, rows, rank, device="cuda", generator=g).bfloat16()
        b = (torch.randn(3072, rank, device="cuda", generator=g) * 0.05).bfloat16()
        update = torch.randn(batch, rows, 3072, device="cuda", generator=g).bfloat16()
        residual = (torch.randn(batch, rows, 3072, device="cuda", generator=g) * 8).bfloat16()
        gate = torch.randn(batch, 6 * 3072, device="cuda", generator=g).bfloat16()[:, None, 3072:6144]
        want = R._eager(residual, L.lora_tail_eager(update, t, b, 0.75), gate, clip)
        for _ in range(2):
            got = R.residual_gate_add(residual, update, gate, clip, terms=[(t, b, 0.75)])
            assert torch.equal(got, want), (batch, rows)
    assert all(R.LORA_GATE.verdicts().values()) and R.LORA_GATE.fast_calls == 3, R.LORA_GATE.verdicts()


@pytest.mark.gpu
def test_gpu_the_gelu_pass_with_an_adapters_term_inside_equals_the_two_passes() -> None:
    """On CUDA in bf16, FLUX.1's single-block MLP (4608 x 12288, rank 16) into its slice of proj_out's input: the
    GELU pass with the term inside equals PEFT's output through aten's GELU, so its gate lets it run."""
    import kernels.gelu as G
    from kernels import lora as L

    G.GELU_LORA_GATE.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1, 4608, 12288, device="cuda", generator=g).bfloat16()
    t = torch.randn(1, 4608, 16, device="cuda", generator=g).bfloat16()
    b = (torch.randn(12288, 16, device="cuda", generator=g) * 0.05).bfloat16()
    want = torch.nn.functional.gelu(L.lora_tail_eager(h, t, b, 0.75), approximate="tanh")
    for _ in range(2):
        buf = torch.zeros(1, 4608, 3072 + 12288, device="cuda", dtype=torch.bfloat16)
        G.gelu_tanh_into(h, buf[..., 3072:], [(t, b, 0.75)])
        assert torch.equal(buf[..., 3072:], want) and not buf[..., :3072].any()
    assert all(G.GELU_LORA_GATE.verdicts().values()) and G.GELU_LORA_GATE.fast_calls == 1


@pytest.mark.gpu
def test_gpu_lossless_adapters_through_the_tail_are_byte_identical_to_stock_diffusers(tiny_path: Path,
                                                                                        tmp_path: Path) -> None:
    """On CUDA in bf16 a lossless batch with two rank-16 adapters runs their terms through the fused kernel (the
    gate's fast calls grow) and equals stock diffusers with PEFT: latents and PNG bytes; with one adapter the output
    projections' terms go inside the residual-gate pass (its gate's fast calls grow), equal too."""
    from kernels import lora as L
    from kernels import residual as R
    from model.loading import diffusers_reference, load_pipeline
    from model.pipeline import GenerationRequest, run_flux_pipeline
    from tests._inputs import LORA_TARGETS, write_random_lora

    ours = load_pipeline(str(tiny_path), device="cuda", dtype=torch.bfloat16)
    # ink reaches the double blocks' FF up-projections too: their terms go inside a GELU pass into a fresh buffer
    files = {n: str(write_random_lora(ours.transformer, tmp_path / f"{n}.safetensors", s, rank=16, b_std=0.05,
                                      targets=targets))
             for n, s, targets in (("ink", 1, (*LORA_TARGETS, "ff.net.0.proj")), ("sun", 2, LORA_TARGETS))}
    ref = diffusers_reference(ours)
    ours.load_loras(files)
    for name, path in files.items():
        ref.load_lora_weights(path, adapter_name=name)
    ref.set_adapters(["ink", "sun"], [0.8, 0.5])
    req = GenerationRequest("a red fox", height=256, width=256, steps=3, seed=5, loras=(("ink", 0.8), ("sun", 0.5)))
    from model.peft_tail import SHARED_A_GATE

    SHARED_A_GATE.reset()
    L.GATE.reset()
    ours.generate([req])  # the gate compares each shape once
    before = L.GATE.fast_calls
    got = ours.generate([req])[0]
    lat, png = run_flux_pipeline(ref, [req])
    assert torch.equal(got.latents, lat[0]) and got.png == png[0]
    assert L.GATE.fast_calls > before and all(L.GATE.verdicts().values()), L.GATE.verdicts()
    assert SHARED_A_GATE.verdicts()  # q, k, v (and MLP-in) share their A GEMM where cuBLAS sums alike
    one = GenerationRequest("a red fox", height=256, width=256, steps=3, seed=6, loras=(("ink", 0.8),))
    R.LORA_GATE.reset()
    ours.generate([one])
    before = R.LORA_GATE.fast_calls
    got = ours.generate([one])[0]
    ref.set_adapters(["ink"], [0.8])
    lat, png = run_flux_pipeline(ref, [one])
    assert torch.equal(got.latents, lat[0]) and got.png == png[0]
    assert R.LORA_GATE.fast_calls > before and all(R.LORA_GATE.verdicts().values()), R.LORA_GATE.verdicts()
