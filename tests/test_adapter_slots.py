"""Adapters served beside converted layers (model/adapter_slots.py): each image's adapters composed into fixed
per-layer buffers before its batch, on plain, stacked, fp8 and sharded `model.linear.Linear` layers.

Checked against independent references: a layer's output against `x W^T + b + s (alpha / r) (x A^T) B^T` computed
from the adapter file's own tensors per source layer; a pipeline with slots against the same adapters loaded by
diffusers/PEFT into the unconverted model; a mixed batch against each image alone; the buffers' addresses across
adapter switches (what a captured CUDA graph reads). (The GPU forms: tests/test_fp8.py and test_graphs.py.)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kernels import fp8 as fp8_ops
from kernels import switches
from model import adapter_slots
from model.adapter_slots import WIDE_HEADROOM, AdapterSlots
from model.linear import FP8, Column, Linear, Row, spare_columns
from model.pipeline import GenerationRequest

peft = pytest.importorskip("peft")

from model.adapters import text_adapters  # noqa: E402
from model.loading import load_pipeline  # noqa: E402
from tests._inputs import write_random_lora  # noqa: E402
from tests.test_linear import collectives  # noqa: E402,F401  (the fixture: threads' collectives at a barrier)


def _ab(g: torch.Generator, k: int, n: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(r, k, generator=g) * 0.3, torch.randn(n, r, generator=g) * 0.3


class _Parent(nn.Module):
    """A parent module holding the stacked layer `qkv` (parts to_q, to_k, to_v) and a plain `out`."""

    def __init__(self, k: int = 32, n: int = 48) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.src = [nn.Linear(k, n), nn.Linear(k, n), nn.Linear(k, 2 * n)]
        for lin in self.src:
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) / 8
            lin.bias.data = torch.randn(lin.bias.shape, generator=g) / 8
        self.qkv = Linear.from_linears(self.src, names=("to_q", "to_k", "to_v"))
        self.out = nn.Linear(n, k)


def _reference(x: torch.Tensor, sources: list[nn.Linear], terms: dict[int, list[tuple]]) -> torch.Tensor:
    """cat over the sources of x W^T + b + sum of s * scaling * (x A^T) B^T, in float64."""
    outs = []
    for i, lin in enumerate(sources):
        y = x.double() @ lin.weight.double().t() + lin.bias.double()
        for a, b, scaling, s in terms.get(i, []):
            y = y + s * scaling * (x.double() @ a.double().t()) @ b.double().t()
        outs.append(y)
    return torch.cat(outs, -1)


def test_a_stacked_layer_adds_each_rows_adapters_to_their_own_parts() -> None:
    """Row 0: adapter ink on to_q and to_v; row 1: none; row 2: ink at 0.5 and fog (to_k only) together. Would catch
    a term written into another part's columns or rows, a scale or alpha / r dropped, a row's offset reused."""
    torch.manual_seed(0)
    model = _Parent()
    slots = AdapterSlots(model, rank=16, rows=2)
    assert isinstance(model.out, Linear) and model.out.parts == ()  # every linear can carry a side
    g = torch.Generator().manual_seed(1)
    ink_q, ink_v, fog_k = _ab(g, 32, 48, 4), _ab(g, 32, 96, 4), _ab(g, 32, 48, 8)
    reached = slots.add("ink", {"to_q": (*ink_q, 0.5), "to_v": (*ink_v, 0.5)})
    slots.add("fog", {"to_k": (*fog_k, 2.0)})
    assert reached == ["qkv"] and slots.adapters["fog"].rank == 8
    rows = [(("ink", 1.0),), (), (("fog", 1.0), ("ink", 0.5))]
    assert slots.compose(rows)
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        got = model.qkv(x)
    want = [_reference(x[0], model.src, {0: [(*ink_q, 0.5, 1.0)], 2: [(*ink_v, 0.5, 1.0)]}),
            _reference(x[1], model.src, {}),
            _reference(x[2], model.src, {0: [(*ink_q, 0.5, 0.5)], 1: [(*fog_k, 2.0, 1.0)], 2: [(*ink_v, 0.5, 0.5)]})]
    for row in range(3):
        torch.testing.assert_close(got[row].double(), want[row], rtol=1e-5, atol=1e-5)
    slots.off()
    assert slots.state.on is False
    with torch.no_grad():
        torch.testing.assert_close(model.qkv(x).double(), _reference(x, model.src, {}), rtol=1e-5, atol=1e-5)


def test_three_adapters_on_one_projection_each_keep_their_own_rank_rows() -> None:
    """One image naming three adapters of one projection: each occupies its own rows of the part's rank budget (4 +
    4 + 8 of 16). Would catch an offset reset or overwritten between adapters."""
    model = _Parent()
    slots = AdapterSlots(model, rank=16)
    g = torch.Generator().manual_seed(7)
    terms = {name: (*_ab(g, 32, 48, r), 1.0) for name, r in (("a", 4), ("b", 4), ("c", 8))}
    for name, term in terms.items():
        slots.add(name, {"to_q": term})
    slots.compose([(("a", 1.0), ("b", -0.5), ("c", 2.0))])
    x = torch.randn(1, 3, 32, generator=g)
    with torch.no_grad():
        got = model.qkv(x)[0]
    want = _reference(x[0], model.src, {0: [(*terms["a"][:3], 1.0), (*terms["b"][:3], -0.5), (*terms["c"][:3], 2.0)]})
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_switching_adapters_keeps_every_buffer_in_place() -> None:
    """What a captured step reads stays where it was: composing other adapters (or none, then again) writes into the
    same buffers, and the same set twice is not composed again. Would catch buffers reallocated per batch."""
    model = _Parent()
    slots = AdapterSlots(model, rank=16, rows=2)
    g = torch.Generator().manual_seed(2)
    assert slots.version == 0 and slots.rows == 2
    slots.add("ink", {"to_q": (*_ab(g, 32, 48, 4), 1.0), "out": (*_ab(g, 48, 32, 4), 1.0)})
    slots.add("fog", {"to_v": (*_ab(g, 32, 96, 16), 1.0)})
    assert slots.version == 2  # one per layer that gained buffers (fog's layer had them)
    sides = [model.qkv.side, model.out.side]
    # rows x (parts x rank) x features: three parts for the stacked layer, one for the plain one
    assert (model.qkv.side.a.shape, model.qkv.side.bt.shape) == ((2, 48, 32), (2, 48, 192))
    assert (model.out.side.a.shape, model.out.side.bt.shape) == ((2, 16, 48), (2, 16, 32))
    where = [t.data_ptr() for s in sides for t in s.buffers()]
    version = slots.version
    fills = []
    original = slots._fill
    slots._fill = lambda key: (fills.append(key), original(key))
    for rows in ([(("ink", 1.0),)], [(("fog", 0.3),), (("ink", 1.0),)], [()], [(("ink", 1.0),)], [(("ink", 1.0),)]):
        slots.compose(rows)
        assert [t.data_ptr() for s in sides for t in s.buffers()] == where and slots.version == version
    assert len(fills) == 3  # the last set repeated, and no adapters at all, compose nothing
    assert not torch.count_nonzero(model.out.side.a[1])  # row 1 of the previous batch was cleared
    assert slots.compose([()] * 3) is False and slots.state.on is False  # no adapters: nothing grows, sides off
    assert slots.rows == 2
    slots.compose([(("ink", 1.0),)] * 3)  # a larger batch grows the buffers (graphs must be captured again)
    assert slots.rows == 3 and slots.version == version + 1 and model.qkv.side.a.shape[0] == 3


def test_a_switch_is_a_few_multi_tensor_ops_over_contiguous_single_dtype_lists(monkeypatch) -> None:
    """On CUDA a multi-tensor op takes its one-launch path only for lists of one dtype whose tensors are dense; a
    stacked layer's B^T block as a strided column range, or one list mixing bf16, fp8 bytes and fp32 scales, falls
    back to one kernel per tensor (a switch of FLUX.1-dev's layers: about a thousand launches). Catches either coming
    back: every list a switch hands the foreach ops is one dtype of contiguous tensors, bar one of the fp8 layers'
    weight columns that hold B (strided by nature: a wide side's B sits in its weight), and it still draws right."""
    model = _Parent()
    model.proj = Linear.from_linears([nn.Linear(64, 32)]).to(torch.bfloat16).quantized(FP8)  # bytes, fp32
    slots = AdapterSlots(model, rank=16, rows=2)
    g = torch.Generator().manual_seed(4)
    terms = {"to_q": (*_ab(g, 32, 48, 4), 1.0), "to_v": (*_ab(g, 32, 96, 8), 1.0), "out": (*_ab(g, 48, 32, 4), 1.0),
             "proj": (*_ab(g, 64, 32, 4), 1.0)}
    slots.add("ink", terms)
    lists: list[list[torch.Tensor]] = []
    for op in ("_foreach_zero_", "_foreach_copy_", "_foreach_mul_"):
        real = getattr(torch, op)
        monkeypatch.setattr(torch, op, lambda first, *rest, _real=real: (lists.append(list(first)), _real(first, *rest))[1])
    slots.compose([(("ink", 0.5),)])
    slots.compose([(("ink", 2.0),), (("ink", 1.0),)])
    assert lists and all(len({t.dtype for t in group}) == 1 for group in lists)
    weight = model.proj.side.weight
    for group in lists:
        strided = [t.is_contiguous() for t in group].count(False)
        assert strided in (0, len(group)), "a list mixing strided and dense tensors"
        assert not strided or all(t.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
                                  for t in group)
    assert {t.dtype for group in lists for t in group} >= {torch.float32, torch.uint8}
    x = torch.randn(2, 3, 32, generator=g)
    with torch.no_grad():
        got = model.qkv(x)
    for row, scale in ((0, 2.0), (1, 1.0)):
        want = _reference(x[row], model.src, {0: [(*terms["to_q"][:3], scale)], 2: [(*terms["to_v"][:3], scale)]})
        torch.testing.assert_close(got[row].double(), want, rtol=1e-5, atol=1e-5)


def test_a_switch_back_reuses_the_copy_plans_made_the_first_time() -> None:
    """Where each adapter goes in a row is worked out once (a few views per served layer) and kept: switching to
    another adapter and back reuses the first plan. Catches plans rebuilt on every switch (host time per switch
    growing with the layer count)."""
    model = _Parent()
    slots = AdapterSlots(model, rank=16, rows=1)
    g = torch.Generator().manual_seed(6)
    slots.add("ink", {"to_q": (*_ab(g, 32, 48, 4), 1.0)})
    slots.add("fog", {"to_v": (*_ab(g, 32, 96, 4), 1.0)})
    slots.compose([(("ink", 1.0),)])
    first = slots._plans[(0, 0, "ink")]
    assert isinstance(first, adapter_slots._Plan) and first.dst
    slots.compose([(("fog", 1.0),)])
    slots.compose([(("ink", 0.5),)])
    assert slots._plans[(0, 0, "ink")] is first and set(slots._plans) == {(0, 0, "ink"), (0, 0, "fog")}


def test_a_bf16_layers_adapters_are_kept_in_bf16_and_still_draw_right() -> None:
    """On a bf16 model each adapter's A and B^T are stored in bf16 (half the memory of fp32 copies; the buffers
    they are copied into are bf16 too), scaled in fp32 before their one rounding. Catches terms kept in fp32 or
    made in the default dtype."""
    model = _Parent().to(torch.bfloat16)
    model.src = [lin.to(torch.bfloat16) for lin in model.src]
    slots = AdapterSlots(model, rank=16, rows=1)
    g = torch.Generator().manual_seed(8)
    a, b = _ab(g, 32, 48, 4)
    slots.add("ink", {"to_q": (a.to(torch.bfloat16), b.to(torch.bfloat16), 0.75)})
    (term,) = slots.adapters["ink"].terms["qkv"]
    assert term.a.dtype == term.bt.dtype == torch.bfloat16 == model.qkv.side.a.dtype == model.qkv.side.bt.dtype
    # B^T rows: B (bf16) times 0.75 rounded once to bf16, zero outside to_q's columns
    torch.testing.assert_close(term.bt[:, :48], (b.to(torch.bfloat16).float() * 0.75).to(torch.bfloat16).t(),
                               rtol=0, atol=0)
    assert not torch.count_nonzero(term.bt[:, 48:])
    slots.compose([(("ink", 1.0),)])
    x = torch.randn(1, 3, 32, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        got = model.qkv(x)[0]
    want = _reference(x[0], model.src, {0: [(a.to(torch.bfloat16), b.to(torch.bfloat16), 0.75, 1.0)]})
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_a_switch_after_growing_or_reloading_a_name_composes_the_adapters_now_served(monkeypatch) -> None:
    """Switching reuses each (row, adapter)'s copy plan and zeroes only what the last batch wrote. Composing ink,
    then a larger batch (new buffers), then ink unloaded and another file loaded under its name: each batch's output
    is the reference of the adapters it names. Would catch a plan kept across the growth (copies into the old
    buffers) or across the reload (the old file's tensors), or a region of the last batch left unzeroed."""
    model = _Parent()
    slots = AdapterSlots(model, rank=16, rows=1)
    g = torch.Generator().manual_seed(11)
    ink, fog, ink2 = _ab(g, 32, 48, 8), _ab(g, 32, 48, 4), _ab(g, 32, 48, 8)
    slots.add("ink", {"to_q": (*ink, 1.0)})
    slots.add("fog", {"to_q": (*fog, 1.0)})
    x = torch.randn(2, 3, 32, generator=g)

    def check(rows: list, terms: list[list[tuple]]) -> None:
        slots.compose(rows)
        with torch.no_grad():
            got = model.qkv(x[:len(rows)])
        for row, t in enumerate(terms):
            torch.testing.assert_close(got[row].double(), _reference(x[row], model.src, {0: t}), rtol=1e-5, atol=1e-5)

    check([(("ink", 1.0), ("fog", 1.0))], [[(*ink, 1.0, 1.0), (*fog, 1.0, 1.0)]])
    check([(("fog", 1.0),)], [[(*fog, 1.0, 1.0)]])  # ink's slots (rank 0..8) of the last batch are zero again
    plan = slots._plans[(0, 0, "fog")]
    check([(("ink", 1.0), ("fog", 1.0))], [[(*ink, 1.0, 1.0), (*fog, 1.0, 1.0)]])
    check([(("fog", 2.0),)], [[(*fog, 1.0, 2.0)]])
    assert slots._plans[(0, 0, "fog")] is plan  # a set seen before reuses its plan: a switch makes no new views
    kept = list(slots._plans)
    monkeypatch.setattr(adapter_slots, "MAX_PLANS", len(kept))  # at the bound a new plan drops the oldest
    check([(("fog", 1.0), ("ink", 1.0))], [[(*fog, 1.0, 1.0), (*ink, 1.0, 1.0)]])  # ink at offset 4: a new plan
    assert list(slots._plans) == kept[1:] + [(0, 4, "ink")]
    check([(("ink", 1.0),), (("fog", 0.5),)], [[(*ink, 1.0, 1.0)], [(*fog, 1.0, 0.5)]])  # grown to two rows
    slots.remove("ink")
    slots.add("ink", {"to_q": (*ink2, 1.0)})
    check([(("fog", 0.5),), (("ink", 1.0),)], [[(*fog, 1.0, 0.5)], [(*ink2, 1.0, 1.0)]])
    check([(("ink", 1.0),), ()], [[(*ink2, 1.0, 1.0)], []])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_fp8_layer_takes_its_adapters_inside_its_gemm_on_quantized_rows_and_on_plain_ones(device: str) -> None:
    """An fp8 layer (torch._scaled_mm on CUDA, its twin on the CPU) multiplies [x | x A^T] by [W | B]^T: given rows
    a pass quantized with spare columns, rows without (copied into wider ones) and bf16 rows, each batch row's
    adapter term is the reference's within fp8 rounding, and the base product is the layer's own. Would catch the
    fp8 A's scales, the factor c moved from B to x A^T, the request's scale, an image's columns, or the spare
    columns not honoured."""
    g = torch.Generator().manual_seed(3)
    plain = Linear.from_linears([nn.Linear(64, 32)]).to(device=device, dtype=torch.bfloat16)
    layer = plain.quantized(FP8)
    parent = nn.Module()
    parent.proj = layer
    slots = AdapterSlots(parent, rank=16)
    assert slots.rows == 1
    # unit rows of A (as trained adapters have), an update of some percent of the weight: what fits fp8 beside it
    a, b = torch.randn(8, 64, generator=g) / 8, torch.randn(32, 8, generator=g) * 0.02
    slots.add("ink", {"proj": (a, b, 0.5)})
    a, b = a.to(device), b.to(device)
    side, term = layer.side, slots.adapters["ink"].terms["proj"][0]
    assert side.wide and side.width == 16 and side.weight.shape == (32, 64 + 16) and not slots.beside
    assert layer.weight.data_ptr() == side.weight.data_ptr() and layer.weight.shape == (32, 64)  # the first K columns
    # fp8 A per rank row times c, B / (c w) in fp8: together B's values; x A^T's side in its room
    c = term.wide.a8_scale / (a.abs().amax(1) / torch.finfo(torch.float8_e4m3fn).max)
    got_b = term.wide.b8.float() * c * layer.weight_scale.t()
    assert (got_b - 0.5 * b).norm() / (0.5 * b).norm() < 0.04
    assert (c * a.norm(dim=1) <= 1 / WIDE_HEADROOM).all()
    slots.compose([(("ink", 0.8),), (("ink", -1.0),)])  # two rows: the sides grow (the weight moves again)
    side = layer.side
    assert side.spare == 2 * 16 and spare_columns(layer) == 32 and side.weight.shape == (32, 64 + 32)
    assert layer.weight.data_ptr() == side.weight.data_ptr()
    x = torch.randn(2, 6, 64, generator=g).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        base = layer.quant.apply(layer, x, layer.bias)
        for spare in (32, 0, None):
            given = x if spare is None else fp8_ops.Fp8Rows(
                *fp8_ops.quantize_rows(x.reshape(-1, 64), spare=spare), x.shape)
            term = (layer(given) - base).double()
            for row, s in enumerate((0.8, -1.0)):
                want = s * 0.5 * (x[row].double() @ a.double().t()) @ b.double().t()
                # fp8 x, A, x A^T and B, and the bf16 rounding of a base many times the term; a scale off by 20% fails
                assert (term[row] - want).norm() / want.norm() < 0.15, (spare, row)
        slots.off()
        assert spare_columns(layer) == 0
        assert torch.equal(layer(x), base)
    assert side.a8.dtype == torch.float8_e4m3fn and side.a8_scale[1].abs().max() > 0


def test_an_adapter_too_strong_for_fp8_columns_goes_beside_the_layer_and_still_draws_right() -> None:
    """An update as large as the weight itself does not fit fp8 columns in the weight's own scales: the layer takes
    that adapter (and the ones it held, moved with it) after its GEMM instead, its weight back to its own columns.
    Would catch a saturated term served silently, or the held adapter lost in the move."""
    g = torch.Generator().manual_seed(5)
    layer = Linear.from_linears([nn.Linear(64, 32)]).to(torch.bfloat16).quantized(FP8)
    parent = nn.Module()
    parent.proj = layer
    slots = AdapterSlots(parent, rank=16)
    weak, strong = _ab(g, 64, 32, 4), _ab(g, 64, 32, 4)
    slots.add("weak", {"proj": (weak[0], weak[1] * 0.02, 1.0)})
    assert layer.side.wide
    slots.add("strong", {"proj": (*strong, 1.0)})
    assert not layer.side.wide and slots.beside == {"proj"} and layer.weight.is_contiguous()
    x = torch.randn(1, 6, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        base = layer.quant.apply(layer, x, layer.bias)
        for name, (a, b) in (("weak", (weak[0], weak[1] * 0.02)), ("strong", strong)):
            slots.compose([((name, 1.0),)])
            term = (layer(x) - base).double()[0]
            want = (x[0].double() @ a.double().t()) @ b.double().t()
            assert (term - want).norm() / want.norm() < 0.05, name


def test_a_wide_terms_factor_sits_between_what_b_and_x_a_need_and_a_rank_without_b_keeps_one() -> None:
    """`_wide_term` by hand: rank j needs c >= max_n |B_jn| / (w_n 448) (B's fp8 columns) and c <= 1 / (H ||A_j||)
    (x A^T's side), takes their geometric mean; equal bounds still fit, one past does not; a rank whose B is zero
    keeps c = 1 (no 0/0). Would catch either bound or the mean changed, or a zero rank divided by zero."""
    w = torch.tensor([0.5, 0.25])  # two output channels' weight scales
    a = torch.tensor([[1.2, 1.6], [0.0, 0.5], [1.0, 0.0]])  # ||A_j|| = 2, 0.5, 1
    bt = torch.tensor([[56.0, 0.0], [0.0, 7.0], [0.0, 0.0]])  # need = 56/0.5/448 = 0.25, 7/0.25/448 = 1/16, -
    b8, c = adapter_slots._wide_term(a, bt, w)
    room = 1 / (WIDE_HEADROOM * torch.tensor([2.0, 0.5, 1.0]))
    assert room[0] >= 0.25 and room[1] >= 1 / 16
    torch.testing.assert_close(c, torch.stack([(0.25 * room[0]).sqrt(), (room[1] / 16).sqrt(), torch.tensor(1.0)]))
    torch.testing.assert_close(b8.float().t() * c[:, None] * w, bt, rtol=1 / 16, atol=0)
    assert b8.shape == (2, 3) and b8.is_contiguous() and torch.isfinite(b8.float()).all()
    at_edge = bt.clone()
    at_edge[0, 0] = room[0] * 0.5 * 448  # need == room: fits, c == need
    _, c_edge = adapter_slots._wide_term(a, at_edge, w)
    torch.testing.assert_close(c_edge[0], room[0])
    at_edge[0, 0] *= 1.01
    assert adapter_slots._wide_term(a, at_edge, w) is None


def test_the_switch_decides_the_form_of_a_side_when_it_is_made() -> None:
    """`adapters_in_fp8_gemm` off: an fp8 layer's adapters go after its GEMM and its weight stays its
    own; a side made while it was on stays inside the GEMM and takes adapters loaded after it is switched off. Would
    catch the switch ignored, or a later adapter without its in-GEMM form."""
    g = torch.Generator().manual_seed(10)
    parent = nn.Module()
    parent.one = Linear.from_linears([nn.Linear(64, 32)]).to(torch.bfloat16).quantized(FP8)
    parent.two = Linear.from_linears([nn.Linear(64, 32)]).to(torch.bfloat16).quantized(FP8)
    slots = AdapterSlots(parent, rank=16)
    mild = [(torch.randn(4, 64, generator=g) / 8, torch.randn(32, 4, generator=g) * 0.01, 1.0) for _ in range(3)]
    slots.add("a", {"one": mild[0]})  # (switched on: the default)
    with switches.override(adapters_in_fp8_gemm=False):
        assert switches.get("adapters_in_fp8_gemm") is False
        slots.add("b", {"one": mild[1], "two": mild[2]})
    assert parent.one.side.wide and not parent.two.side.wide and parent.two.weight.is_contiguous()
    x = torch.randn(1, 6, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        for name, layer, (a, b, _) in (("b", parent.one, mild[1]), ("b", parent.two, mild[2])):
            slots.compose([((name, 1.0),)])
            got = (layer(x) - layer.quant.apply(layer, x, layer.bias)).double()[0]
            want = (x[0].double() @ a.double().t()) @ b.double().t()
            assert (got - want).norm() < 0.15 * want.norm()


def test_a_weight_only_fp8_layer_keeps_its_adapters_beside_it() -> None:
    """The AdaLN modulation layers (weight-only fp8: a few bf16 rows, no quantized input) cannot take columns in their
    input: their adapters are added after the GEMV, and still draw right."""
    from model.linear import FP8_WEIGHT_ONLY

    g = torch.Generator().manual_seed(8)
    layer = Linear.from_linears([nn.Linear(64, 48)]).to(torch.bfloat16).quantized(FP8_WEIGHT_ONLY)
    parent = nn.Module()
    parent.proj = layer
    slots = AdapterSlots(parent, rank=16)
    a, b = torch.randn(4, 64, generator=g) / 8, torch.randn(48, 4, generator=g) * 0.01
    slots.add("ink", {"proj": (a, b, 1.0)})
    assert not adapter_slots.wide_form(layer) and not layer.side.wide and layer.weight.is_contiguous()
    x = torch.randn(1, 1, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        base = layer(x)
        slots.compose([(("ink", 1.0),)])
        term = (layer(x) - base).double()[0]
    want = (x[0].double() @ a.double().t()) @ b.double().t()
    assert (term - want).norm() / want.norm() < 0.05


def test_moving_layers_beside_zeroes_what_was_composed_and_keeps_every_adapter(monkeypatch) -> None:
    """Two fp8 layers with a moderate adapter inside their GEMMs, composed once; then a strong adapter on one of
    them moves that layer beside (its weight back to its own columns, captured graphs stale), and a batch naming only
    the strong one leaves the other layer without any term (nothing left from the last batch), and `move_beside()`
    moves the rest. Also: more rows than the shared column of ones holds. Would catch the move not zeroing the
    buffers, dropping a layer's adapters, or the graphs not told."""
    monkeypatch.setattr(adapter_slots, "ONES_PER_ROW", 2)
    monkeypatch.setattr(adapter_slots, "_ONES", {})
    g = torch.Generator().manual_seed(9)
    parent = nn.Module()
    parent.one = Linear.from_linears([nn.Linear(64, 32)]).to(torch.bfloat16).quantized(FP8)
    parent.two = Linear.from_linears([nn.Linear(64, 32)]).to(torch.bfloat16).quantized(FP8)
    slots = AdapterSlots(parent, rank=16)
    mild = {name: (torch.randn(4, 64, generator=g) / 8, torch.randn(32, 4, generator=g) * 0.01, 1.0)
            for name in ("one", "two")}
    strong = (torch.randn(4, 64, generator=g), torch.randn(32, 4, generator=g), 1.0)
    slots.add("mild", mild)
    assert parent.one.side.wide and parent.two.side.wide
    x = torch.randn(1, 6, 64, generator=g).to(torch.bfloat16)

    def term(layer: Linear) -> torch.Tensor:
        return (layer(x) - layer.quant.apply(layer, x, layer.bias)).double()[0]

    def want(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (x[0].double() @ a.double().t()) @ b.double().t()

    with torch.no_grad():
        slots.compose([(("mild", 1.0),)])
        for name in ("one", "two"):
            got = term(getattr(parent, name))
            assert (got - want(*mild[name][:2])).norm() < 0.15 * want(*mild[name][:2]).norm(), name
        version = slots.version
        slots.add("strong", {"one": strong})
        assert slots.beside == {"one"} and not parent.one.side.wide and parent.two.side.wide
        assert parent.one.weight.is_contiguous() and slots.version > version
        slots.compose([(("strong", 1.0),)])
        assert (term(parent.one) - want(*strong[:2])).norm() < 0.05 * want(*strong[:2]).norm()
        assert torch.equal(parent.two(x), parent.two.quant.apply(parent.two, x, parent.two.bias))
        slots.move_beside()
        assert slots.beside == {"one", "two"} and not parent.two.side.wide and parent.two.weight.is_contiguous()
        slots.compose([(("mild", 1.0),)])
        got = term(parent.two)
        assert (got - want(*mild["two"][:2])).norm() < 0.15 * want(*mild["two"][:2]).norm()


@pytest.mark.parametrize("style", ["column", "row"])
def test_a_sharded_layers_ranks_sum_to_the_whole_layer(style: str) -> None:
    """Two ranks' shards of a stacked column-parallel layer, or of a row-parallel one (whose partial products the
    all-reduce sums), each composing its share: together they equal the unsharded layer with the adapter. Would
    catch a rank keeping the wrong output columns of a part or the wrong input columns of A."""
    g = torch.Generator().manual_seed(4)
    k, n = 32, 48
    srcs = [nn.Linear(k, n), nn.Linear(k, n)]
    terms = {"to_q": (*_ab(g, k, n, 4), 1.0), "to_k": (*_ab(g, k, n, 4), 0.5)}
    x = torch.randn(2, 3, k, generator=g)
    if style == "row":
        srcs, terms = srcs[:1], {"to_q": terms["to_q"]}

    def build(parallel):
        parent = nn.Module()
        names = ("to_q", "to_k")[:len(srcs)]
        if parallel is None:
            parent.proj = Linear.from_linears(srcs, names=names)
        else:
            parent.proj = Linear.from_linears(srcs, names=names).sharded(parallel)
        slots = AdapterSlots(parent, rank=16, rows=2)
        slots.add("ink", terms)
        slots.compose([(("ink", 1.0),), ()])
        return parent.proj

    whole = build(None)
    with torch.no_grad():
        want = whole(x)
        if style == "column":
            blocks = tuple(s.out_features for s in srcs)
            shards = [build(Column(r, 2, None, blocks=blocks)) for r in range(2)]
            halves = [s(x) for s in shards]  # each rank: its half of each part, part after part
            got = torch.cat([h[..., i * n // 2:(i + 1) * n // 2] for i in range(2) for h in halves], -1)
        else:
            shards = [build(Row(r, 2, None)) for r in range(2)]
            got = sum(s.quant.apply(s, x[..., r * k // 2:(r + 1) * k // 2], s.bias if s.parallel.bias_here else None)
                      for r, s in enumerate(shards))
            got = got.clone()
            for r, s in enumerate(shards):
                s.side.add(got, x[..., r * k // 2:(r + 1) * k // 2])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _fp8_case(seed: int) -> tuple[nn.Linear, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """A bf16 layer [64 -> 32], a rank-4 adapter (A, B) small enough to sit inside the fp8 GEMM, rows x, and
    `build(parallel)`: the layer (sharded by `parallel` unless None) in fp8 with the adapter inside its GEMM."""
    g = torch.Generator().manual_seed(seed)
    k, n = 64, 32
    src = nn.Linear(k, n).to(torch.bfloat16)
    a, b = torch.randn(4, k, generator=g) / 8, torch.randn(n, 4, generator=g) * 0.01
    x = torch.randn(1, 6, k, generator=g).to(torch.bfloat16)

    def build(parallel: Column | Row | None) -> Linear:
        parent = nn.Module()
        layer = Linear.from_linears([src])
        parent.proj = (layer if parallel is None else layer.sharded(parallel)).quantized(FP8)
        slots = AdapterSlots(parent, rank=16)
        slots.add("ink", {"proj": (a, b, 1.0)})
        slots.compose([(("ink", 1.0),)])
        assert parent.proj.side.wide
        return parent.proj

    return src, a, b, x, build


def test_a_column_parallel_fp8_layers_ranks_take_their_b_columns_inside_their_own_gemm() -> None:
    """Two ranks of a column-parallel fp8 layer, each with the adapter inside its GEMM (its share of B as its
    weight's extra columns, its own factors c): their outputs side by side are the unsharded fp8 layer's with the
    adapter (the same quantized x and W; only the factors differ), far closer than to the layer without it. Would
    catch a rank keeping another rank's B columns or none."""
    src, _, _, x, build = _fp8_case(11)
    whole = build(None)
    with torch.no_grad():
        want = whole(x).double()
        base = whole.quant.apply(whole, x, whole.bias).double()
        shards = [build(Column(r, 2, None)) for r in range(2)]
        assert all(s.weight.shape == (src.out_features // 2, src.in_features) for s in shards)
        got = torch.cat([s(x).double() for s in shards], -1)
    assert (got - want).norm() < 0.2 * (want - base).norm()


def test_a_row_parallel_fp8_layers_ranks_sum_their_shares_of_x_a_inside_their_own_gemm(collectives) -> None:
    """Two ranks of a row-parallel fp8 layer (threads whose collectives meet at a barrier, tests/test_linear.py),
    each with the adapter inside its GEMM: its input columns of A give its share of x A^T, B is whole on both, and the
    all-reduce that sums the ranks' GEMMs sums the adapter's shares too. Every rank ends with the same output, and
    the adapter's term in it (against the same sharded layer without adapters: each rank quantizes its own half of
    x, so the base differs from the unsharded layer's) is the unsharded layer's term. Would catch a rank using all
    of A (the term counted twice), another rank's columns, or its spare columns scaled by another rank's rows."""
    from tests.test_linear import _spmd

    src, _, _, x, build = _fp8_case(12)
    k, n = src.in_features, src.out_features
    whole = build(None)
    with torch.no_grad():
        want = whole(x).double()
        base = whole.quant.apply(whole, x, whole.bias).double()

    def rank(r: int, group) -> tuple[torch.Tensor, torch.Tensor]:
        layer = build(Row(r, 2, group))
        plain = Linear.from_linears([src]).sharded(Row(r, 2, group)).quantized(FP8)
        assert layer.weight.shape == plain.weight.shape == (n, k // 2)
        with torch.no_grad():
            mine = x[..., r * k // 2:(r + 1) * k // 2]
            return layer(mine).double(), plain(mine).double()

    (got, got_base), (other, _) = _spmd(2, rank)
    assert torch.equal(got, other)
    term, want_term = got - got_base, want - base
    assert (term - want_term).norm() < 0.2 * want_term.norm()


def test_refusals_say_why() -> None:
    model = _Parent()
    slots = AdapterSlots(model, rank=16)
    g = torch.Generator().manual_seed(5)
    with pytest.raises(ValueError, match="rank 32 at to_q; this pool serves adapters up to rank 16"):
        slots.add("wide", {"to_q": (*_ab(g, 32, 48, 32), 1.0)})
    with pytest.raises(ValueError, match="reaches to_z, which this model does not serve as a linear layer"):
        slots.add("lost", {"to_z": (*_ab(g, 32, 48, 4), 1.0)})
    with pytest.raises(ValueError, match="do not fit a layer of 32 -> 96"):
        slots.add("bent", {"to_v": (*_ab(g, 32, 48, 4), 1.0)})
    assert not slots.adapters and model.qkv.side is None
    slots.add("ink", {"to_q": (*_ab(g, 32, 48, 12), 1.0)})
    slots.add("fog", {"to_k": (*_ab(g, 32, 48, 8), 1.0)})
    with pytest.raises(ValueError, match=r"use rank 20 together; this pool composes at most rank 16"):
        slots.compose([(("ink", 1.0), ("fog", 1.0))])
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        slots.compose([(("nope", 1.0),)])
    with pytest.raises(ValueError, match="'ink' is loaded already"):
        slots.add("ink", {"to_q": (*_ab(g, 32, 48, 4), 1.0)})
    slots.remove("fog")
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'fog'; loaded: \['ink'\]"):
        slots.remove("fog")
    with pytest.raises(ValueError, match="multiple of 16"):
        AdapterSlots(_Parent(), rank=24)
    with pytest.raises(ValueError, match="convert before attaching adapters"):
        model.qkv.quantized(FP8)


# -- the pipeline --------------------------------------------------------------------------------------------------


def _req(loras: tuple = (), seed: int = 5, quality: str = "high") -> GenerationRequest:
    return GenerationRequest("a red fox", height=64, width=64, steps=2, seed=seed, loras=loras, quality=quality)


@pytest.fixture(scope="module")
def files(tiny_path: Path, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("slot-loras")
    pipe = load_pipeline(str(tiny_path))
    t = pipe.transformer
    return {"ink": str(write_random_lora(t, d / "ink.safetensors", 1)),
            "fog": str(write_random_lora(t, d / "fog.safetensors", 2, rank=8,
                                         targets=("attn.to_k", "ff.net.0.proj", "proj_out", "norm1.linear",
                                                  "proj_mlp"))),
            "clip": str(write_random_lora(t, d / "clip.safetensors", 3, text_encoder=pipe.pipe.text_encoder))}


@pytest.fixture(scope="module")
def peft_pipe(tiny_path: Path, files: dict[str, str]):
    pipe = load_pipeline(str(tiny_path))
    pipe.load_loras(files)
    return pipe


@pytest.fixture(scope="module")
def slot_pipe(tiny_path: Path, files: dict[str, str]):
    pipe = load_pipeline(str(tiny_path))
    pipe.convert_for_high(fused_projections=True)
    pipe.enable_adapter_slots(16, rows=3)
    pipe.load_loras(files)
    return pipe


SETS = ((("ink", 1.0),), (("fog", 0.7),), (("ink", 0.5), ("fog", 1.0)), (), (("clip", 0.8),),
        (("clip", 0.4), ("ink", 1.0)))  # (clip: an adapter with a text-encoder part)


def test_fused_projections_with_slots_draw_what_peft_draws_unfused(slot_pipe, peft_pipe) -> None:
    """The high form (fused q/k/v and MLP up-projection) with adapters in slots against the same files loaded by
    diffusers into the unconverted model (PEFT, the lossless path): the same latents up to float32 rounding of the
    reordered sums. Would catch a part's adapter in the wrong part, alpha / r lost, an adapter reaching a non-block
    layer (norm1.linear) dropped."""
    for loras in SETS:
        got = slot_pipe.generate([_req(loras)])[0]
        want = peft_pipe.generate([_req(loras, quality="lossless")])[0]
        torch.testing.assert_close(got.latents, want.latents, rtol=1e-4, atol=1e-4)
        assert got.ran.adapters == loras
    with_ink = slot_pipe.generate([_req(SETS[0])])[0].latents
    assert (with_ink - slot_pipe.generate([_req()])[0].latents).abs().max() > 1e-2  # the adapter matters


def test_a_batch_mixes_adapters_and_each_image_is_drawn_as_alone(slot_pipe) -> None:
    """Three requests with different adapters share one pipeline call; each image equals the same request alone
    (up to the batched GEMMs' rounding), and reports its own adapters. Would catch rows composed in the wrong order
    or one row's adapters applied to all."""
    batch = [_req(loras, seed=i) for i, loras in enumerate(SETS[:3])]
    got = slot_pipe.generate(batch)
    for i, r in enumerate(batch):
        alone = slot_pipe.generate([r])[0]
        torch.testing.assert_close(got[i].latents, alone.latents, rtol=1e-4, atol=1e-4)
        assert got[i].ran.adapters == r.loras
    from model.request import validate_batch

    with pytest.raises(ValueError, match="share loras"):
        validate_batch(batch)


def test_text_encoder_parts_follow_each_image_of_a_mixed_batch(slot_pipe, peft_pipe) -> None:
    """An adapter with a CLIP part on a slot pipeline: its text-encoder part stays in the text encoders (PEFT) and is
    switched on for the images that name it. Alone, each set draws what PEFT draws on the unconverted model; in one
    batch with images that name other text-encoder parts (or none), each prompt is encoded with its own and every
    image is drawn as alone. Would catch the CLIP part dropped, one image's text adapters applied to the whole
    batch, or the prompts' embeddings put back in the wrong rows."""
    for loras in SETS[4:]:
        got = slot_pipe.generate([_req(loras)])[0]
        want = peft_pipe.generate([_req(loras, quality="lossless")])[0]
        torch.testing.assert_close(got.latents, want.latents, rtol=1e-4, atol=1e-4)
    clip_alone = slot_pipe.generate([_req(SETS[4])])[0].latents
    assert (clip_alone - slot_pipe.generate([_req()])[0].latents).abs().max() > 1e-2
    batch = [_req(SETS[4], seed=0), _req(SETS[0], seed=1), _req(SETS[5], seed=2)]
    got = slot_pipe.generate(batch)
    for i, r in enumerate(batch):
        torch.testing.assert_close(got[i].latents, slot_pipe.generate([r])[0].latents, rtol=1e-4, atol=1e-4)
    # an image without text adapters between two that have the same one, each with its own prompt
    batch = [replace(_req(loras, seed=i), prompt=prompt)
             for i, (loras, prompt) in enumerate([(SETS[4], "a red fox"), (SETS[3], "a barn"), (SETS[4], "a kite")])]
    got = slot_pipe.generate(batch)
    for i, r in enumerate(batch):
        torch.testing.assert_close(got[i].latents, slot_pipe.generate([r])[0].latents, rtol=1e-4, atol=1e-4)


def test_slots_refuse_what_they_cannot_serve(slot_pipe, tiny_path: Path, files: dict[str, str], tiny_pipe,
                                            tmp_path: Path) -> None:
    """A lossless batch naming adapters is refused on a slot pipeline (not bit-exact); one naming none runs the
    layers' own kernels: byte-identical to the plain pipeline (every nn.Linear became a `Linear` calling F.linear)."""
    unconverted = load_pipeline(str(tiny_path))
    unconverted.enable_adapter_slots(16)
    unconverted.load_loras({"ink": files["ink"]})
    with pytest.raises(ValueError, match="high batches only"):
        unconverted.generate([_req(SETS[0], quality="lossless")])
    wide = write_random_lora(tiny_pipe.transformer, tmp_path / "wide.safetensors", 4, rank=32,
                             text_encoder=unconverted.pipe.text_encoder)
    with pytest.raises(ValueError, match="has rank 32"):
        unconverted.add_lora("wide", str(wide))
    assert text_adapters(unconverted.pipe) == set() and "wide" not in unconverted.loras  # nothing of it stays
    lossless = unconverted.generate([_req(quality="lossless")])[0]
    stock = tiny_pipe.generate([_req(quality="lossless")])[0]
    assert torch.equal(lossless.latents, stock.latents) and lossless.png == stock.png
    with pytest.raises(ValueError, match="loaded already"):
        slot_pipe.add_lora("ink", files["ink"])
    late = load_pipeline(str(tiny_path))
    late.load_loras({"ink": files["ink"]})
    with pytest.raises(ValueError, match="before loading adapters"):
        late.enable_adapter_slots(16)
    with pytest.raises(ValueError, match="cannot be fused"):
        slot_pipe.fuse_lora("ink")


@pytest.mark.parametrize("extra, what", [("lora_magnitude_vector", "DoRA"), ("lora_B.bias", "LoRA bias")])
def test_adapters_the_slots_cannot_compose_are_refused_and_leave_nothing(tiny_pipe, tiny_path: Path, tmp_path: Path,
                                                                         extra: str, what: str) -> None:
    """DoRA rescales the whole weight and a LoRA bias is no low-rank term: neither is served beside the layers. The
    refusal names the file and the reason; nothing of the adapter stays, its text-encoder part included (its name
    loads a plain file afterwards)."""
    from safetensors.torch import load_file, save_file

    plain = write_random_lora(tiny_pipe.transformer, tmp_path / "plain.safetensors", 5,
                              text_encoder=tiny_pipe.pipe.text_encoder)
    sd = load_file(str(plain))
    for key in [k for k in sd if k.startswith("transformer.") and k.endswith("lora_B.weight")]:
        sd[key.replace("lora_B.weight", extra)] = torch.ones(sd[key].shape[0])
    save_file(sd, str(tmp_path / "odd.safetensors"))
    pipe = load_pipeline(str(tiny_path))
    pipe.enable_adapter_slots(16)
    with pytest.raises(ValueError, match=r"odd.safetensors: DoRA and LoRA biases are not served beside"):
        pipe.add_lora("odd", str(tmp_path / "odd.safetensors"))
    assert "odd" not in pipe.loras and not pipe.adapter_slots.adapters and text_adapters(pipe.pipe) == set()
    assert pipe.add_lora("odd", str(plain))  # (diffusers' loader would refuse a name it still held)


def test_runtime_load_and_unload_into_slots(tiny_path: Path, files: dict[str, str], slot_pipe) -> None:
    """sync_loras on a slot pipeline: the adapter loaded while serving draws what the one loaded at start does
    (same tensors, same composition: torch.equal), and an unloaded one is refused."""
    pipe = load_pipeline(str(tiny_path))
    pipe.convert_for_high(fused_projections=True)
    pipe.enable_adapter_slots(16, rows=3)
    assert pipe.sync_loras({"fog": files["fog"]}) == {"added": ["fog"], "removed": []}
    assert pipe.sync_loras(files) == {"added": ["ink", "clip"], "removed": []}
    for loras in SETS:
        assert torch.equal(pipe.generate([_req(loras)])[0].latents, slot_pipe.generate([_req(loras)])[0].latents)
    pipe.sync_loras({"ink": files["ink"]})
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        pipe.generate([_req(SETS[1])])
    assert text_adapters(pipe.pipe) == set()  # the text-encoder part went with its adapter
    assert pipe.form.adapter_slots == 16 and "adapter_slots" in pipe.form.techniques()
    assert "lora" not in pipe.form.techniques()


def _tp_rank(rank: int, port: int, folder: str, outdir: str) -> None:
    from tests.test_tp import GROUP_TIMEOUT_S, WORLD, report_rank

    def body(res: dict) -> None:
        import json

        from model.form import ServingForm
        from tp.worker import TPWorker

        torch.set_num_threads(1)
        files = json.loads((Path(outdir) / "files.json").read_text())
        form = ServingForm(folder, fused_projections=True, adapter_slots=16, loras=(("ink", files["ink"]),),
                           warm_batch_sizes=(3,))
        worker = TPWorker(rank, WORLD, form, port=port, backend="gloo", timeout_s=GROUP_TIMEOUT_S)
        worker.setup()
        res["sync"] = worker.sync_loras(files)
        res["mixed"] = worker.generate([_req(loras, seed=i) for i, loras in enumerate(SETS[:3])])
        res["text"] = worker.generate([_req(SETS[4], seed=0), _req(SETS[0], seed=1)])

    report_rank(rank, outdir, body)


def test_tp2_ranks_compose_their_shares_of_each_images_adapters(files: dict[str, str], slot_pipe, tiny_path: Path,
                                                               tmp_path: Path) -> None:
    """Two gloo ranks, fused projections sharded by heads and MLP columns, adapters in slots (one at start, one
    loaded while serving), one mixed batch: each image equals tp 1's with the same adapters, up to the sharded sums'
    rounding. Would catch a rank adding a whole adapter term (the row-parallel all-reduce would double it) or the
    wrong share of a part."""
    import json

    from tests.test_tp import JOIN_TIMEOUT_S, WORLD, spawn_ranks

    (tmp_path / "files.json").write_text(json.dumps(files))
    run = spawn_ranks(_tp_rank, WORLD, tiny_path, tmp_path, JOIN_TIMEOUT_S)
    assert run[0]["sync"] == run[1]["sync"] == {"added": ["fog", "clip"], "removed": []}
    for i, loras in enumerate(SETS[:3]):
        got = run[0]["mixed"][i]
        torch.testing.assert_close(got.latents, slot_pipe.generate([_req(loras, seed=i)])[0].latents,
                                   rtol=1e-4, atol=1e-4)
        assert got.ran.adapters == loras
    for i, loras in enumerate((SETS[4], SETS[0])):  # text-encoder parts, per image, on each rank
        torch.testing.assert_close(run[0]["text"][i].latents, slot_pipe.generate([_req(loras, seed=i)])[0].latents,
                                   rtol=1e-4, atol=1e-4)


# -- configuration -------------------------------------------------------------------------------------------------


def test_a_high_pool_with_adapter_slots_keeps_its_converted_form_and_graphs() -> None:
    """`args.pools.high.adapter_rank` stands in for PEFT there: the high defaults (fp8, fused projections, fast norms,
    8-bit attention with graphs) stay on beside the app's adapters, while the lossless pool serves them by PEFT."""
    from deployments.config import AppArgs

    loras = {"ink": "ink.safetensors"}
    args = AppArgs.parse({"device": "cuda", "dtype": "bfloat16", "loras": loras,
                          "pools": {"high": {"adapter_rank": 32, "cuda_graphs": True}}})
    high, lossless = args.form("high").techniques(), args.form("lossless").techniques()
    assert {"adapter_slots", "fp8", "fused_projections", "fast_norm", "attention8", "cuda_graphs"} <= high
    assert "lora" not in high and "lora" in lossless and "adapter_slots" not in lossless
    assert args.form("high").adapter_slots == 32
    without = AppArgs.parse({"device": "cuda", "dtype": "bfloat16", "loras": loras})
    assert "fp8" not in without.form("high").techniques()  # PEFT's layers stay unconverted


@pytest.mark.parametrize("raw, message", [
    ({"pools": {"lossless": {"adapter_rank": 32}}}, "args.pools.lossless.adapter_rank is for the high pool only"),
    ({"pools": {"high": {"adapter_rank": 24}}}, "adapter_rank must be a multiple of 16"),
    ({"pools": {"high": {"adapter_rank": True}}}, "adapter_rank must be a multiple of 16"),
    ({"pools": {"high": {"adapter_rank": 32, "compile": True}}}, "adapter buffers under torch.compile"),
    ({"fuse_lora": True, "pools": {"high": {"adapter_rank": 32}}}, "a fused adapter leaves no per-request"),
])
def test_bad_adapter_slot_configs_are_errors(raw: dict, message: str) -> None:
    from deployments.config import AppArgs

    with pytest.raises(ValueError, match=message):
        AppArgs.parse({"loras": {"ink": "ink.safetensors"}, **raw})


@pytest.mark.gpu
def test_gpu_slots_on_the_fp8_graphed_form_switch_adapters_without_capture(tiny_path: Path,
                                                                          files: dict[str, str]) -> None:
    """On CUDA in bf16, the served high form (fused projections, fp8 layers, fast norms, 8-bit attention, CUDA
    graphs) with adapters in slots: after one capture per (batch size, adapters on/off), switching adapters replays
    the same graph (captures unchanged) and draws what the eager form draws (torch.equal: the same kernels); a mixed
    batch equals each image alone within the batched GEMMs' rounding; each adapter's image stays close to PEFT's
    lossless one."""
    from model.metrics import psnr

    def build(graphs: bool):
        pipe = load_pipeline(str(tiny_path), device="cuda", dtype=torch.bfloat16)
        pipe.take_high_defaults()
        pipe.enable_adapter_slots(16, rows=2)
        pipe.load_loras(files)
        if graphs:
            pipe.enable_cuda_graphs()
        return pipe

    graphed, eager = build(True), build(False)
    assert graphed.fp8_layers > 0 or graphed.fp8_refusal() is not None
    graphed.generate([_req(SETS[0])])
    captures = graphed.step_graphs.captures
    for loras in SETS[1:3]:
        got = graphed.generate([_req(loras)])[0]
        assert got.ran.graphed and torch.equal(got.latents, eager.generate([_req(loras)])[0].latents), loras
    assert graphed.step_graphs.captures == captures
    mixed = graphed.generate([_req(SETS[0], seed=1), _req(SETS[1], seed=2)])
    for r, loras, seed in zip(mixed, SETS[:2], (1, 2)):
        alone = graphed.generate([_req(loras, seed=seed)])[0]
        assert psnr(r.png, alone.png) >= 35, loras
    reference = load_pipeline(str(tiny_path), device="cuda", dtype=torch.bfloat16)
    reference.load_loras(files)
    for loras in SETS[:3]:
        got = graphed.generate([_req(loras)])[0]
        want = reference.generate([_req(loras, quality="lossless")])[0]
        print(f"slots high vs PEFT lossless {loras}: PSNR {psnr(got.png, want.png):.2f} dB")
        assert psnr(got.png, want.png) >= 20, loras


@pytest.mark.gpu
def test_gpu_adapters_inside_the_fp8_gemms_draw_what_adapters_beside_them_draw(tiny_path: Path,
                                                                              tmp_path: Path) -> None:
    """On CUDA, the served high form (graphed) with a moderate adapter (an update of about a percent of each
    weight) on every block projection: the layers take it inside their fp8 GEMMs (strided rows and weight through
    torch._scaled_mm), and the image is the one the same adapter gives added after each GEMM (the form an adapter
    too strong for fp8 takes) within fp8 rounding, and close to PEFT's lossless one."""
    from model import adapter_slots
    from model.metrics import psnr

    path = write_random_lora(load_pipeline(str(tiny_path)).transformer, tmp_path / "mild.safetensors", 7,
                             std=0.05, b_std=0.005)

    def build(wide: bool):
        pipe = load_pipeline(str(tiny_path), device="cuda", dtype=torch.bfloat16)
        pipe.take_high_defaults()
        pipe.enable_adapter_slots(16, rows=2)
        if not wide:
            pipe._slots.beside.update(name for name, layer in pipe._slots.layers.items()
                                      if adapter_slots.wide_form(layer))
        pipe.load_loras({"mild": str(path)})
        pipe.enable_cuda_graphs()
        return pipe

    wide, beside = build(True), build(False)
    fp8_rows = [layer for layer in wide._slots.layers.values()
                if layer.side is not None and adapter_slots.wide_form(layer)]
    assert fp8_rows and all(layer.side.wide for layer in fp8_rows) and not wide._slots.beside
    assert not any(layer.side.wide for layer in beside._slots.layers.values() if layer.side is not None)
    request = _req((("mild", 1.0),))
    got, alone = wide.generate([request])[0], beside.generate([request])[0]
    plain = wide.generate([_req(())])[0]
    assert got.ran.graphed
    reference = load_pipeline(str(tiny_path), device="cuda", dtype=torch.bfloat16)
    reference.load_loras({"mild": str(path)})
    want = reference.generate([_req((("mild", 1.0),), quality="lossless")])[0]
    print(f"inside vs beside {psnr(got.png, alone.png):.2f} dB, inside vs PEFT lossless {psnr(got.png, want.png):.2f} "
          f"dB, beside vs PEFT {psnr(alone.png, want.png):.2f} dB, adapter vs none {psnr(got.png, plain.png):.2f} dB")
    assert psnr(got.png, want.png) >= psnr(alone.png, want.png) - 1.0
    assert psnr(got.png, alone.png) >= 30


def test_a_layer_with_adapters_is_no_fused_gelu_site() -> None:
    """The fused GELU epilogue computes F.linear alone: a layer carrying adapter buffers must not be mounted there
    (its adapters would be skipped without a word). Would catch `fused_gelu_compatible` ignoring the side."""
    from kernels.gelu import can_fuse_linear_gelu

    model = _Parent()
    slots = AdapterSlots(model, rank=16)
    assert model.out.fused_gelu_compatible
    slots.add("ink", {"out": (*_ab(torch.Generator().manual_seed(6), 48, 32, 4), 1.0)})
    ok, reason = can_fuse_linear_gelu(model.out)
    assert not ok and "does not compute F.linear" in reason
