"""Column- and row-parallel linear layers (Megatron-style) over a torch.distributed process group.

Column-parallel: each rank holds a contiguous block of output features (rows of W and the matching bias
entries) and computes its slice of the output; no communication unless `gather_output`.
Row-parallel: each rank holds a block of input features (columns of W) and receives the matching slice of the
activation (the output of a column-parallel layer); the partial products are summed with one all-reduce.

Bias order in the row-parallel layer (measured, `python bench/tp_bias_order.py`): the bias is added exactly once,
inside rank 0's local GEMM (`F.linear(x_0, W_0, b)`), before the all-reduce. That keeps TP=2 closer to TP=1
than adding it after the reduce, because TP=1's GEMM also accumulates the bias into its dot product before its
single rounding: on CPU at TP=2, mean |TP2 - TP1| / mean |TP1| was 1.01e-7 (in GEMM) vs 1.18e-7 (after) in
fp32 and 1.66e-3 vs 2.15e-3 in bf16, with 44% vs 32% (fp32) and 62% vs 56% (bf16) of elements bit-equal to TP=1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum across the group. Every row-parallel reduce goes through here (tests wrap it to count)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None, world_size: int) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_sizes(total: int, world_size: int, what: str) -> int:
    if total % world_size:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {world_size}")
    return total // world_size


class ColumnParallelLinear(nn.Module):
    """y[..., shard] = x @ W[shard].T + b[shard]; with gather_output the shards are all-gathered to the full y.

    `weight` / `bias` are this rank's shard, so `F.linear(x, weight, bias)` is the local output (what the fused
    GELU site protocol calls when the layer is mounted; the guard refuses gather_output=True at tp_size>1).
    The constructor leaves the shard uninitialised (fill it with load_state_dict); `from_linear` slices a full layer.
    """

    # The local computation is exactly `x @ weight.T + bias`: the fused Linear+GELU path may replace it.
    fused_gelu_compatible = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_rank: int,
        tp_size: int,
        group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features  # full (unsharded) width
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        self.gather_output = gather_output
        self.out_per_rank = _split_sizes(out_features, tp_size, "out_features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        tp_rank: int,
        tp_size: int,
        group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
    ) -> "ColumnParallelLinear":
        """This rank's shard of a full nn.Linear (rows [rank*n, (rank+1)*n) of W); the copy owns its storage, so
        the full weight can be freed."""
        # Built on the meta device (no allocation), then given the real shard.
        layer = cls(
            linear.in_features, linear.out_features, linear.bias is not None, tp_rank=tp_rank, tp_size=tp_size,
            group=group, gather_output=gather_output, device="meta",
        )
        n = layer.out_per_rank
        rows = slice(tp_rank * n, (tp_rank + 1) * n)
        layer.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=linear.weight.requires_grad)
        layer.bias = (
            None
            if linear.bias is None
            else nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=linear.bias.requires_grad)
        )
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output and self.tp_size > 1:
            y = all_gather_last_dim(y, self.group, self.tp_size)
        return y

    @torch.no_grad()
    def full_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W, b) of the unsharded layer, all-gathered (collective: every rank must call it)."""
        w = all_gather_last_dim(self.weight.t(), self.group, self.tp_size).t().contiguous()
        b = None if self.bias is None else all_gather_last_dim(self.bias, self.group, self.tp_size)
        return w, b

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} ({self.out_per_rank} on rank "
            f"{self.tp_rank}/{self.tp_size}), bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """y = sum_r x_r @ W[:, cols_r].T + b, one all-reduce; input is already split (input_is_parallel).

    `input_blocks`: the full input is a concatenation of independently column-sharded blocks (FLUX single-block
    proj_out takes cat([attn, mlp])); then rank r's input is [block0 shard r | block1 shard r | ...] and its
    weight columns are picked block by block in that order. None means one block of in_features.
    `bias` is stored on every rank (replicated, so a gather is local) but only rank 0 adds it (see module doc).
    The constructor leaves the shard uninitialised (fill it with load_state_dict); `from_linear` slices a full layer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_rank: int,
        tp_size: int,
        group: dist.ProcessGroup | None = None,
        input_blocks: list[int] | tuple[int, ...] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # full sizes
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        blocks = [in_features] if input_blocks is None else [int(b) for b in input_blocks]
        if sum(blocks) != in_features:
            raise ValueError(f"input_blocks {blocks} do not add up to in_features={in_features}")
        self.input_blocks = blocks
        self.block_per_rank = [_split_sizes(b, tp_size, "input block") for b in blocks]
        self.in_per_rank = sum(self.block_per_rank)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def _local_columns(self) -> torch.Tensor:
        cols, offset = [], 0
        for full, n in zip(self.input_blocks, self.block_per_rank):
            start = offset + self.tp_rank * n
            cols.append(torch.arange(start, start + n))
            offset += full
        return torch.cat(cols)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        tp_rank: int,
        tp_size: int,
        group: dist.ProcessGroup | None = None,
        input_blocks: list[int] | tuple[int, ...] | None = None,
    ) -> "RowParallelLinear":
        layer = cls(
            linear.in_features, linear.out_features, linear.bias is not None, tp_rank=tp_rank, tp_size=tp_size,
            group=group, input_blocks=input_blocks, device="meta",
        )
        w = linear.weight.detach()
        cols = layer._local_columns().to(w.device)
        # index_select copies: the shard owns its storage.
        layer.weight = nn.Parameter(w.index_select(1, cols).contiguous(), requires_grad=linear.weight.requires_grad)
        layer.bias = (
            None
            if linear.bias is None
            else nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        )
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce_sum(y, self.group)

    @torch.no_grad()
    def full_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W, b) of the unsharded layer, all-gathered (collective: every rank must call it)."""
        gathered = all_gather_last_dim(self.weight, self.group, self.tp_size)  # [out, tp * in_per_rank]
        per_rank = gathered.split(self.in_per_rank, dim=1)
        blocks = []
        for i, n in enumerate(self.block_per_rank):
            start = sum(self.block_per_rank[:i])
            blocks.extend(part[:, start : start + n] for part in per_rank)
        w = torch.cat(blocks, dim=1)
        return w, None if self.bias is None else self.bias.detach().clone()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_per_rank} on rank {self.tp_rank}/{self.tp_size}, "
            f"blocks {self.input_blocks}), out_features={self.out_features}, bias={self.bias is not None}"
        )
