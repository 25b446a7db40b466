"""tp/layers.py in one process: each rank's layer runs in its own thread and the two collectives the layers use
(`all_reduce_sum`, `all_gather_last_dim`) meet at a barrier, summing or concatenating in rank order. This checks
the sharding arithmetic (which rows and columns a rank holds, the [attn | mlp] block layout, the bias added once)
against the unsharded `nn.Linear`, in milliseconds. (Real process groups over gloo, and the whole sharded FLUX
transformer: tests/test_tp.py.)
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tp.layers as L


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

    def all_gather_last_dim(tensor: torch.Tensor, group: _Rank, world_size: int) -> torch.Tensor:
        assert world_size == group.group.size
        return torch.cat(group.group.exchange(group.rank, tensor.contiguous()), dim=-1)

    monkeypatch.setattr(L, "all_reduce_sum", all_reduce_sum)
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


def _linear(n_in: int, n_out: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias, dtype=torch.float64)


@pytest.mark.parametrize("size", [2, 3])
def test_a_column_shard_holds_its_rows_and_gathers_the_full_output(collectives, size: int) -> None:
    full = _linear(8, 12)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    n = 12 // size

    def rank(r: int, g: _Rank) -> tuple:
        local = L.ColumnParallelLinear.from_linear(full, r, size, group=g)
        gathered = L.ColumnParallelLinear.from_linear(full, r, size, group=g, gather_output=True)
        return local, local(x), gathered(x), local.full_weight()

    for r, (layer, y, y_full, (w, b)) in enumerate(_spmd(size, rank)):
        rows = slice(r * n, (r + 1) * n)
        assert torch.equal(layer.weight, full.weight[rows]) and torch.equal(layer.bias, full.bias[rows])
        assert layer.weight.data_ptr() != full.weight.data_ptr()  # owns its storage: the full layer can go
        assert torch.allclose(y, full(x)[..., rows], rtol=0, atol=1e-12) and y.shape == (2, 5, n)
        assert torch.allclose(y_full, full(x), rtol=0, atol=1e-12)
        assert torch.equal(w, full.weight) and torch.equal(b, full.bias)
        assert repr(layer).endswith(f"(in_features=8, out_features=12 ({n} on rank {r}/{size}), bias=True, "
                                    "gather_output=False)")


def test_a_bias_free_column_shard_and_one_rank() -> None:
    full = _linear(8, 12, bias=False)
    only = L.ColumnParallelLinear.from_linear(full, 0, 1, gather_output=True)
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
        layer = L.RowParallelLinear.from_linear(full, r, 2, group=g, input_blocks=blocks)
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
    assert repr(l0).endswith(f"(in_features=24 (12 on rank 0/2, blocks {sizes}), out_features=6, bias=True)")


def test_one_reduce_per_row_parallel_call_and_none_at_tp_1(collectives) -> None:
    full = _linear(8, 4)
    x = torch.randn(3, 8, dtype=torch.float64)
    group = _Group(2)

    def rank(r: int, g: _Rank) -> None:
        layer = L.RowParallelLinear.from_linear(full, r, 2, group=g)
        layer(x[..., r * 4:(r + 1) * 4])
        layer(x[..., r * 4:(r + 1) * 4])

    _spmd(2, rank, group)
    assert group.reduces == 2
    solo = L.RowParallelLinear.from_linear(full, 0, 1)
    assert torch.equal(solo(x), F.linear(x, full.weight, full.bias))  # no collective without a group
    free = L.RowParallelLinear.from_linear(_linear(8, 4, bias=False), 0, 1)
    assert free.bias is None and torch.equal(free(x), F.linear(x, free.weight))


def test_shapes_that_do_not_split_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError) as exc:
        L.ColumnParallelLinear(8, 10, tp_rank=0, tp_size=3)
    assert str(exc.value) == "out_features=10 is not divisible by the tensor-parallel size 3"
    with pytest.raises(ValueError) as exc:
        L.RowParallelLinear(24, 6, tp_rank=0, tp_size=2, input_blocks=[8, 15])
    assert str(exc.value) == "input_blocks [8, 15] do not add up to in_features=24"
    with pytest.raises(ValueError) as exc:
        L.RowParallelLinear(24, 6, tp_rank=0, tp_size=2, input_blocks=[9, 15])
    assert str(exc.value) == "input block=9 is not divisible by the tensor-parallel size 2"
    empty = L.ColumnParallelLinear(8, 12, tp_rank=1, tp_size=2, dtype=torch.float64)
    assert empty.weight.shape == (6, 8) and empty.weight.dtype == torch.float64 and empty.bias.shape == (6,)
    assert empty.bias.dtype == torch.float64 and not empty.gather_output  # gathering is asked for, not a default
    assert L.ColumnParallelLinear(8, 12, bias=False, tp_rank=0, tp_size=2).bias is None
    row = L.RowParallelLinear(24, 6, bias=False, tp_rank=1, tp_size=2, input_blocks=[8, 16])
    assert row.weight.shape == (6, 12) and row.bias is None and row.block_per_rank == [4, 8]
    row = L.RowParallelLinear(24, 6, tp_rank=1, tp_size=2, dtype=torch.float64)
    assert (row.weight.dtype, row.bias.dtype, row.bias.shape) == (torch.float64, torch.float64, (6,))


@pytest.mark.parametrize("trainable", [False, True])
def test_shards_keep_the_full_layers_requires_grad(trainable: bool) -> None:
    full = _linear(8, 12).requires_grad_(trainable)
    col = L.ColumnParallelLinear.from_linear(full, 1, 2)
    row = L.RowParallelLinear.from_linear(_linear(12, 8).requires_grad_(trainable), 1, 2)
    assert {p.requires_grad for p in (*col.parameters(), *row.parameters())} == {trainable}
