"""model/linear.py in one process: one layer family, a quantization method composed with a parallel style.

Each rank's layer runs in its own thread and the collectives the layers use (`all_reduce_sum`, `all_reduce_max`,
`all_gather_last_dim`) meet at a barrier, reducing or concatenating in rank order. This checks the sharding
arithmetic (which rows and columns a rank holds, block layouts, the bias added once) against the unsharded
`nn.Linear`, and that quantizing and sharding commute, in milliseconds. (Real process groups over gloo, and the whole
sharded FLUX transformer: tests/test_tp.py.)
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import model.linear as L
from kernels.fp8 import FP8 as E4M3
from kernels.fp8 import quantize_rows_eager


class _Group:
    """Stands in for a process group of `size` ranks, each running in its own thread."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots: dict[int, torch.Tensor] = {}
        self.reduces = 0

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        parts = [self.slots[r] for r in range(self.size)]
        self.barrier.wait()  # every rank has read before the next exchange writes
        return parts


class _Rank:
    def __init__(self, group: _Group, rank: int) -> None:
        self.group, self.rank = group, rank


@pytest.fixture()
def collectives(monkeypatch) -> None:
    def all_reduce_sum(tensor: torch.Tensor, group: _Rank) -> torch.Tensor:
        parts = group.group.exchange(group.rank, tensor)
        if group.rank == 0:
            group.group.reduces += 1
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return tensor.copy_(total)

    def all_reduce_max(tensor: torch.Tensor, group: _Rank) -> torch.Tensor:
        return tensor.copy_(torch.stack(group.group.exchange(group.rank, tensor)).amax(dim=0))

    def all_gather_last_dim(tensor: torch.Tensor, group: _Rank, world_size: int) -> torch.Tensor:
        assert world_size == group.group.size
        return torch.cat(group.group.exchange(group.rank, tensor.contiguous()), dim=-1)

    monkeypatch.setattr(L, "all_reduce_sum", all_reduce_sum)
    monkeypatch.setattr(L, "all_reduce_max", all_reduce_max)
    monkeypatch.setattr(L, "all_gather_last_dim", all_gather_last_dim)


def _spmd(size: int, fn: Callable[[int, _Rank], Any], group: _Group | None = None) -> list[Any]:
    """fn(rank, group handle) on `size` threads at once; their results in rank order."""
    group = group or _Group(size)
    out: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank, _Rank(group, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _linear(n_in: int, n_out: int, bias: bool = True, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias, dtype=dtype)


def _col(full: nn.Linear, r: int, size: int, g: Any = None, **kw: Any) -> L.Linear:
    return L.Linear.from_linears([full], parallel=L.Column(r, size, g, **kw))


def _row(full: nn.Linear, r: int, size: int, g: Any = None, blocks: Any = None) -> L.Linear:
    return L.Linear.from_linears([full], parallel=L.Row(r, size, g, blocks=None if blocks is None else tuple(blocks)))


@pytest.mark.parametrize("size", [2, 3])
def test_a_column_shard_holds_its_rows_and_gathers_the_full_output(collectives, size: int) -> None:
    full = _linear(8, 12)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    n = 12 // size

    def rank(r: int, g: _Rank) -> tuple:
        local = _col(full, r, size, g)
        gathered = _col(full, r, size, g, gather_output=True)
        return local, local(x), gathered(x), local.full_weight()

    for r, (layer, y, y_full, (w, b)) in enumerate(_spmd(size, rank)):
        rows = slice(r * n, (r + 1) * n)
        assert torch.equal(layer.weight, full.weight[rows]) and torch.equal(layer.bias, full.bias[rows])
        assert layer.weight.data_ptr() != full.weight.data_ptr()  # owns its storage: the full layer can go
        assert torch.allclose(y, full(x)[..., rows], rtol=0, atol=1e-12) and y.shape == (2, 5, n)
        assert torch.allclose(y_full, full(x), rtol=0, atol=1e-12)
        assert torch.equal(w, full.weight) and torch.equal(b, full.bias)
        assert repr(layer).endswith(f"(in_features=8, out_features=12, bias=True, bf16, column rank {r}/{size})")


def test_a_column_shard_of_blocks_holds_its_part_of_each(collectives) -> None:
    """A fused q/k/v projection sharded by heads: each rank holds its rows of q, of k and of v (not a third of the
    stacked rows), and the full weight gathers back in block order."""
    full = _linear(8, 12)

    def rank(r: int, g: _Rank) -> tuple:
        layer = _col(full, r, 2, g, blocks=(4, 4, 4))
        return layer, layer.full_weight()

    for r, (layer, (w, b)) in enumerate(_spmd(2, rank)):
        rows = torch.cat([torch.arange(s + 2 * r, s + 2 * r + 2) for s in (0, 4, 8)])
        assert torch.equal(layer.weight, full.weight[rows]) and torch.equal(layer.bias, full.bias[rows])
        assert torch.equal(w, full.weight) and torch.equal(b, full.bias)


def test_a_bias_free_column_shard_and_one_rank() -> None:
    full = _linear(8, 12, bias=False)
    only = _col(full, 0, 1, gather_output=True)
    x = torch.randn(3, 8, dtype=torch.float64)
    assert only.bias is None and torch.equal(only(x), full(x))  # tp 1 gathers nothing


@pytest.mark.parametrize("blocks", [None, [8, 16], [8, 4, 12]])
def test_row_shards_sum_to_the_full_layer_with_the_bias_added_once(collectives, blocks) -> None:
    """Rank r holds the columns of its shard of each input block ([attn | mlp] for the single block's proj_out),
    its input is [block0 shard r | block1 shard r]; rank 0 alone adds the bias, inside its own GEMM; one reduce."""
    full = _linear(24, 6)
    x = torch.randn(2, 3, 24, dtype=torch.float64)
    sizes = blocks or [24]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def shard_of(t: torch.Tensor, r: int) -> torch.Tensor:
        return torch.cat([t[..., s + r * (n // 2): s + (r + 1) * (n // 2)] for s, n in zip(starts, sizes)], dim=-1)

    def rank(r: int, g: _Rank) -> tuple:
        layer = _row(full, r, 2, g, blocks)
        partial = F.linear(shard_of(x, r), layer.weight)
        return layer, layer(shard_of(x, r)), partial, layer.full_weight()

    results = _spmd(2, rank)
    for r, (layer, y, partial, (w, b)) in enumerate(results):
        assert torch.equal(layer.weight, shard_of(full.weight, r)) and torch.equal(layer.bias, full.bias)
        assert torch.allclose(y, full(x), rtol=0, atol=1e-12)
        assert torch.equal(w, full.weight) and torch.equal(b, full.bias)
    (l0, y0, p0, _), (_, y1, p1, _) = results
    # the bias inside rank 0's GEMM, then the sum: bit for bit that order, not bias after the reduce
    in_gemm = F.linear(shard_of(x, 0), l0.weight, l0.bias) + p1
    assert torch.equal(y0, in_gemm) and torch.equal(y1, in_gemm)
    assert repr(l0).endswith("bf16, row rank 0/2" + (f" blocks {sizes})" if blocks else ")"))


def test_one_reduce_per_row_parallel_call_and_none_at_tp_1(collectives) -> None:
    full = _linear(8, 4)
    x = torch.randn(3, 8, dtype=torch.float64)
    group = _Group(2)

    def rank(r: int, g: _Rank) -> None:
        layer = _row(full, r, 2, g)
        layer(x[..., r * 4:(r + 1) * 4])
        layer(x[..., r * 4:(r + 1) * 4])

    _spmd(2, rank, group)
    assert group.reduces == 2
    solo = _row(full, 0, 1)
    assert torch.equal(solo(x), F.linear(x, full.weight, full.bias))  # no collective without a group
    free = _row(_linear(8, 4, bias=False), 0, 1)
    assert free.bias is None and torch.equal(free(x), F.linear(x, free.weight))


def test_shapes_that_do_not_split_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError) as exc:
        _col(_linear(8, 10), 0, 3)
    assert str(exc.value) == "out_features=10 is not divisible by the tensor-parallel size 3"
    with pytest.raises(ValueError) as exc:
        _row(_linear(24, 6), 0, 2, blocks=[9, 15])
    assert str(exc.value) == "input block=9 is not divisible by the tensor-parallel size 2"
    with pytest.raises(ValueError, match="already sharded"):
        _col(_linear(8, 12), 0, 2).sharded(L.Column(0, 2))


@pytest.mark.parametrize("trainable", [False, True])
def test_shards_keep_the_full_layers_requires_grad_and_fp8_never_trains(trainable: bool) -> None:
    full = _linear(8, 12).requires_grad_(trainable)
    col = _col(full, 1, 2)
    row = _row(_linear(12, 8).requires_grad_(trainable), 1, 2)
    assert {p.requires_grad for p in (*col.parameters(), *row.parameters())} == {trainable}
    assert not any(p.requires_grad for p in L.Linear.from_linears([full]).quantized(L.FP8).parameters())


# -- quantization x parallel style -------------------------------------------------------------------------------


def test_fp8_holds_what_the_per_channel_quantizer_gives() -> None:
    """The fp8 method's weight and scales are what per-row quantization gives a weight row (one scale per output
    channel, held as [1, N]), the bias bf16; the layer multiplies by the dequantized weight (CPU: the GEMM's eager
    twin)."""
    full = _linear(32, 16, dtype=torch.bfloat16)
    layer = L.Linear.from_linears([full]).quantized(L.FP8)
    q, scale = quantize_rows_eager(full.weight.detach())
    scale = scale.t()
    assert layer.weight.dtype == E4M3 and torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale, scale) and layer.bias.dtype == torch.bfloat16
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    ref = F.linear(x.float(), full.weight.float(), full.bias.float())
    assert (layer(x).float() - ref).abs().max() < 0.1 * ref.abs().max()
    assert L.is_fp8(layer) and not L.is_fp8(L.Linear.from_linears([full])) and not layer.fused_gelu_compatible
    with pytest.raises(ValueError, match="already fp8"):
        layer.quantized(L.FP8_WEIGHT_ONLY)


def _state(layer: L.Linear) -> dict[str, torch.Tensor]:
    return {k: (v.view(torch.uint8) if v.dtype == E4M3 else v) for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("style", ["column", "column_blocks", "row", "row_blocks"])
@pytest.mark.parametrize("quant", ["bf16", "fp8", "fp8_weight_only"])
def test_quantizing_and_sharding_commute(collectives, style: str, quant: str) -> None:
    """shard(convert(layer)) and convert(shard(layer)) hold equal tensors on every rank (fp8: the same scales, a
    row-parallel layer's channel maxima taken over all ranks) and give equal outputs; those outputs join to the
    unsharded converted layer's within its rounding. Catches a row-parallel scale taken over local columns only."""
    full = _linear(64, 48, dtype=torch.bfloat16)
    method = {"bf16": L.BF16, "fp8": L.FP8, "fp8_weight_only": L.FP8_WEIGHT_ONLY}[quant]
    whole = L.Linear.from_linears([full]).quantized(method)
    x = torch.randn(20, 64, dtype=torch.bfloat16)  # more rows than the weight-only path takes

    def parallel(r: int, g: _Rank) -> L.Replicated:
        return {"column": L.Column(r, 2, g), "column_blocks": L.Column(r, 2, g, blocks=(16, 32)),
                "row": L.Row(r, 2, g), "row_blocks": L.Row(r, 2, g, blocks=(16, 48))}[style]

    def local_input(r: int) -> torch.Tensor:
        if style == "row":
            return x[:, r * 32:(r + 1) * 32]
        if style == "row_blocks":
            return torch.cat([x[:, r * 8:(r + 1) * 8], x[:, 16 + r * 24:16 + (r + 1) * 24]], dim=-1)
        return x

    def rank(r: int, g: _Rank) -> tuple:
        a = L.Linear.from_linears([full]).quantized(method).sharded(parallel(r, g))
        b = L.Linear.from_linears([full]).sharded(parallel(r, g)).quantized(method)
        return _state(a), _state(b), a(local_input(r)), b(local_input(r))

    outs = _spmd(2, rank)
    for sa, sb, ya, yb in outs:
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        assert torch.equal(ya, yb)
    joined = torch.cat([o[2] for o in outs], dim=-1) if style.startswith("column") else outs[0][2]
    if style == "column_blocks":  # rank r holds its rows of each block: back to block order
        joined = torch.cat([outs[0][2][:, :8], outs[1][2][:, :8], outs[0][2][:, 8:], outs[1][2][:, 8:]], dim=-1)
    ref = whole(x).float()
    if style.startswith("row") and method.fp8:
        # each rank quantizes its own input columns per row: the sum of the ranks' dequantized products
        ref = whole.bias.float()
        for r in range(2):
            q, s = quantize_rows_eager(local_input(r))
            cols = L.Row(r, 2, blocks=parallel(r, None).blocks).index(64, "in")
            ref = ref + (q.float() * s) @ whole.dequantized_weight()[:, cols].t()
    assert (joined.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()  # the output's bf16 rounding


def test_a_stacked_layer_computes_the_concatenation() -> None:
    parts = [_linear(8, n, seed=i) for i, n in enumerate((4, 4, 6))]
    stacked = L.Linear.from_linears(parts)
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(stacked(x), torch.cat([F.linear(x, p.weight, p.bias) for p in parts], dim=-1))
    with pytest.raises(ValueError, match="share in_features"):
        L.Linear.from_linears([_linear(8, 4), _linear(6, 4)])
    with pytest.raises(ValueError, match="a bias or none"):
        L.Linear.from_linears([_linear(8, 4), _linear(8, 4, bias=False)])


def test_a_stack_names_its_parts_keeps_the_style_asked_and_one_layer_is_not_copied() -> None:
    """`names` give a stack its parts without dropping the parallel style it was asked for; a count that does not
    match says so; a one-layer "stack" holds the source's own tensors (a conversion's peak memory is the model plus
    one layer). Catches the style dropped on the named path, an unhelpful error, and a copy of every fused layer."""
    parts = [_linear(8, n, seed=i) for i, n in enumerate((4, 6))]
    named = L.Linear.from_linears(parts, parallel=L.Column(1, 2), names=("q", "v"))
    assert named.parts == (("q", 4), ("v", 6)) and named.parallel == L.Column(1, 2)
    assert torch.equal(named.weight, torch.cat([p.weight for p in parts])[L.Column(1, 2).index(10, "out")])
    with pytest.raises(ValueError, match="^1 names for 2 stacked linears$"):
        L.Linear.from_linears(parts, names=("q",))
    one = L.Linear.from_linears(parts[:1])
    assert one.weight.data_ptr() == parts[0].weight.data_ptr() and one.bias.data_ptr() == parts[0].bias.data_ptr()


def test_column_shards_stack_into_the_block_sharded_stack(collectives) -> None:
    """Fusing q/k/v after sharding (a TP rank converts after it shards) holds what sharding the fused layer by its
    blocks holds: each rank its rows of each part. Other styles do not stack."""
    parts = [_linear(8, 12, seed=i) for i in range(3)]

    def rank(r: int, g: _Rank) -> tuple:
        after = L.Linear.from_linears([_col(p, r, 2, g) for p in parts])
        before = L.Linear.from_linears(parts).sharded(L.Column(r, 2, g, blocks=(12, 12, 12)))
        return after, before

    for after, before in _spmd(2, rank):
        assert after.parallel == before.parallel and after.out_features == before.out_features == 36
        assert torch.equal(after.weight, before.weight) and torch.equal(after.bias, before.bias)
    with pytest.raises(ValueError, match="only column-parallel layers of one group stack"):
        L.Linear.from_linears([_row(parts[0], 0, 1), _col(parts[1], 0, 2)])


def test_layer_form_parameters_buffers_and_repr() -> None:
    """What a layer registers (the fp8 scale a buffer, never a parameter; a bias-free layer's bias None; nothing
    trainable unless asked) and how it names itself, style and blocks included."""
    w = torch.randn(4, 8)
    plain = L.Linear(8, 4, {"weight": w})
    assert plain.bias is None and not plain.weight.requires_grad and repr(plain) == (
        "Linear(in_features=8, out_features=4, bias=False, bf16)")
    assert torch.equal(plain.dequantized_weight(), w)
    fp8 = L.Linear.from_linears([_linear(8, 16, dtype=torch.float32)], quant=L.FP8_WEIGHT_ONLY)
    assert "weight_scale" in dict(fp8.named_buffers()) and "weight_scale" not in dict(fp8.named_parameters())
    assert repr(fp8) == "Linear(in_features=8, out_features=16, bias=True, fp8 weight-only)"
    col = L.Linear.from_linears([_linear(8, 12)], parallel=L.Column(1, 2, blocks=(4, 8), gather_output=True))
    assert repr(col) == "Linear(in_features=8, out_features=12, bias=True, bf16, column rank 1/2 blocks [4, 8] gathered)"
    row = _row(_linear(8, 4), 0, 2)
    assert repr(row) == "Linear(in_features=8, out_features=4, bias=True, bf16, row rank 0/2)"


def test_stacking_sharded_layers_keeps_their_style_and_form(collectives) -> None:
    """A single column-sharded layer, or several, stack into a column layer with their blocks, their trainability
    and the asked method; a column layer that already has blocks, a gathered one, or an asked style are refused."""
    parts = [_linear(8, 12, seed=i).requires_grad_(True) for i in range(2)]

    def rank(r: int, g: _Rank) -> tuple:
        cols = [_col(p, r, 2, g) for p in parts]
        one = L.Linear.from_linears(cols[:1])
        both = L.Linear.from_linears(cols, quant=L.FP8)
        refused = []
        for bad in ([L.Linear.from_linears([parts[0]], parallel=L.Column(r, 2, g, blocks=(6, 6))), cols[1]],
                    [_col(parts[0], r, 2, g, gather_output=True), cols[1]]):
            with pytest.raises(ValueError, match="only column-parallel layers of one group stack"):
                L.Linear.from_linears(bad)
            refused.append(True)
        with pytest.raises(ValueError, match="only column-parallel layers of one group stack"):
            L.Linear.from_linears(cols, parallel=L.Column(r, 2, g))
        return one, both, refused

    for r, (one, both, refused) in enumerate(_spmd(2, rank)):
        assert one.parallel.blocks == (12,) and torch.equal(one.weight, parts[0].weight[r * 6:(r + 1) * 6])
        assert one.in_features == 8 and one.out_features == 12 and one.weight.requires_grad
        assert both.quant == L.FP8 and both.in_features == 8 and both.out_features == 24 and both.parallel.blocks == (12, 12)
        assert refused == [True, True]


def test_a_world_1_row_layer_quantizes_without_a_collective(collectives) -> None:
    layer = _row(_linear(32, 16, dtype=torch.float32), 0, 1).quantized(L.FP8)  # the fake collectives need a group
    assert layer.quant == L.FP8 and layer.weight_scale.shape == (1, 16)


def test_stacking_refusals_are_whole_sentences() -> None:
    with pytest.raises(ValueError) as exc:
        L.Linear.from_linears([L.Linear.from_linears([_linear(16, 16, dtype=torch.float32)], quant=L.FP8)] * 2)
    assert str(exc.value) == "fp8 layers cannot be stacked: fuse projections before quantizing"


def test_fp8_on_the_cpu_is_the_gemms_eager_twin_and_the_gelu_goes_into_the_quantization() -> None:
    """On the CPU an fp8 layer multiplies with `scaled_mm_eager` exactly (not whatever torch._scaled_mm does there);
    `linear_cat_gelu` quantizes [a | gelu(b)] in one pass from b (not a bf16-rounded GELU); a weight-only layer fed
    more than WEIGHT_ONLY_ROWS rows in 3-D quantizes them like any fp8 layer."""
    from kernels import fp8 as ops

    torch.manual_seed(0)
    layer = L.Linear.from_linears([_linear(48, 32, dtype=torch.bfloat16)], quant=L.FP8)
    x = torch.randn(5, 48, dtype=torch.bfloat16)
    q, s = ops.quantize_rows_eager(x)
    assert torch.equal(layer(x), ops.scaled_mm_eager(q, layer.weight, s, layer.weight_scale, layer.bias))
    a, b = torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(5, 32, dtype=torch.bfloat16)
    q, s = ops.quantize_rows_eager(a, b, gelu_b=True)
    assert torch.equal(L.linear_cat_gelu(layer, a, b), layer.matmul(q, s))
    assert not torch.equal(L.linear_cat_gelu(layer, a, b),
                           layer(torch.cat([a, torch.nn.functional.gelu(b, approximate="tanh")], -1)))
    wo = L.Linear.from_linears([_linear(48, 32, dtype=torch.bfloat16)], quant=L.FP8_WEIGHT_ONLY)
    many = torch.randn(2, 10, 48, dtype=torch.bfloat16)  # 20 rows: more than the GEMV takes
    q, s = ops.quantize_rows_eager(many.reshape(20, 48))
    assert torch.equal(wo(many).reshape(20, 32), wo.matmul(q, s))


def test_stacked_column_layers_hold_the_asked_method_and_refuse_gathering(collectives) -> None:
    parts = [_linear(16, 32, seed=i, dtype=torch.bfloat16) for i in range(2)]

    def rank(r: int, g: _Rank) -> tuple:
        stacked = L.Linear.from_linears([_col(p, r, 2, g) for p in parts], quant=L.FP8)
        with pytest.raises(ValueError, match="only column-parallel layers of one group stack"):
            L.Linear.from_linears([_col(p, r, 2, g, gather_output=True) for p in parts])
        return stacked

    for stacked in _spmd(2, rank):
        assert stacked.weight.dtype == E4M3 and stacked.weight_scale.shape == (1, 32)


def test_collectives_split_a_graph_capture_only_where_the_backend_cannot_be_captured(monkeypatch) -> None:
    """While a CUDA graph is captured (`collectives_between_graphs`), a gloo collective is handed to the capture's
    `split` instead of running (it runs between two replayed segments, on the same buffers), and an NCCL one runs
    inside the capture. Bugs caught: a collective run during a gloo capture (it would read buffers the captured
    kernels have not written), one handed over with a copy of its buffers (the replayed graphs would never see the
    result), an NCCL collective split (a whole-step graph cut into 114 pieces), a gather whose output the split
    collective does not fill."""
    calls: list[str] = []

    def fake_all_reduce(t, op, group):
        calls.append("reduce")
        t.mul_(2)  # as if a second rank held the same values

    def fake_all_gather(parts, t, group):
        calls.append("gather")
        for p in parts:
            p.copy_(t)

    backend = {"name": "gloo"}
    monkeypatch.setattr(L.dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(L.dist, "all_gather", fake_all_gather)
    monkeypatch.setattr(L.dist, "get_backend", lambda group: backend["name"])
    kept: list = []
    x = torch.ones(3)
    with L.collectives_between_graphs(kept.append):
        assert L.all_reduce_sum(x, None) is x and calls == [] and torch.equal(x, torch.ones(3))
        gathered = L.all_gather_last_dim(torch.full((2, 1), 5.0), None, 2)
        assert calls == [] and len(kept) == 2
        kept[0]()
        kept[1]()
        assert torch.equal(x, torch.full((3,), 2.0))  # reduced in place, where the next segment reads it
        # the gather's parts were allocated before the split: the concatenation (the next segment) reads them
        assert gathered.shape == (2, 2) and calls == ["reduce", "gather"]
        backend["name"] = "nccl"
        L.all_reduce_sum(x, None)
        assert calls[-1] == "reduce" and len(kept) == 2 and torch.equal(x, torch.full((3,), 4.0))
    backend["name"] = "gloo"
    L.all_reduce_sum(x, None)  # no capture: runs
    assert calls[-1] == "reduce" and len(kept) == 2 and torch.equal(x, torch.full((3,), 8.0))


def test_a_models_parallel_signature_is_its_sharded_layers_rank_and_world(collectives) -> None:  # noqa: F811
    full = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    assert L.parallel_of(full) == (0, 1)

    def rank(r: int, g) -> tuple[int, int]:
        model = nn.Sequential(L.Linear.from_linears([full[0]], parallel=L.Column(r, 2, g)),
                              L.Linear.from_linears([full[1]], parallel=L.Row(r, 2, g)))
        return L.parallel_of(model)

    assert _spmd(2, rank) == [(0, 2), (1, 2)]
