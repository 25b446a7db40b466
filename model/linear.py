"""One linear layer family: a quantization method (how the weight is held and multiplied) composed with a parallel
style (which part of the weight this rank holds, and what joins the ranks' outputs).

    Linear.from_linear(nn_linear)                              bf16 (the model's dtype), replicated
    layer.quantized(FP8) / layer.quantized(FP8_WEIGHT_ONLY)    fp8 weights, per-output-channel scales
    layer.sharded(Column(rank, world, group, blocks=...))      this rank's output rows (of each block)
    layer.sharded(Row(rank, world, group, blocks=...))         this rank's input columns, one all-reduce

The two conversions commute: `quantized(sharded(x))` and `sharded(quantized(x))` hold the same tensors on every
rank, because a weight's scale is per output channel and a row-parallel layer takes its channels' absolute maxima
over all ranks (`Row.channel_amax`) before quantizing its columns. Each parameter says which of its dimensions is
the output (and which the input), so sharding slices weight, scale and bias alike, whatever the method.

Bias order in a row-parallel layer (measured, `python bench/tp_bias_order.py`): the bias is added exactly once,
inside rank 0's local GEMM, before the all-reduce; that keeps TP=2 closer to TP=1 than adding it after the reduce,
because TP=1's GEMM also accumulates the bias before its single rounding.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels import fp8 as fp8_ops

# ---------------------------------------------------------------------------------------------------------------
# Collectives (every one the layers make goes through these three: tests replace them)
# ---------------------------------------------------------------------------------------------------------------

# Set by a CUDA-graph capture (model.graphs) that cannot hold a group's collectives: `split(op)` ends the graph
# segment being captured, keeps `op` to run between that segment and the next at replay, and starts the next one.
_SPLIT: ContextVar[Callable[[Callable[[], object]], None] | None] = ContextVar("fluxserve_collective_split",
                                                                              default=None)


@contextmanager
def collectives_between_graphs(split: Callable[[Callable[[], object]], None]) -> Iterator[None]:
    """While a graph is captured: each collective of a group whose backend cannot be captured (gloo: the host does
    the work) is handed to `split` instead of running; NCCL collectives are captured with the kernels."""
    token = _SPLIT.set(split)
    try:
        yield
    finally:
        _SPLIT.reset(token)


def _collective(op: Callable[[], object], group: dist.ProcessGroup | None) -> None:
    split = _SPLIT.get()
    if split is None or dist.get_backend(group) == "nccl":
        op()
    else:
        split(op)  # its inputs and outputs are already allocated: the graphs around it read and write them in place


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum across the group."""
    _collective(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group), group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place maximum across the group."""
    _collective(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group), group)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None, world_size: int) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    local = tensor.contiguous()
    _collective(lambda: dist.all_gather(parts, local, group=group), group)
    return torch.cat(parts, dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# Parallel styles
# ---------------------------------------------------------------------------------------------------------------


def _split(total: int, world: int, what: str) -> int:
    if total % world:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {world}")
    return total // world


def _local_index(blocks: Sequence[int], rank: int, world: int, what: str) -> torch.Tensor:
    """Indices of rank `rank`'s slice of each block of a dimension made of `blocks`, block after block."""
    parts, offset = [], 0
    for full in blocks:
        n = _split(full, world, what)
        parts.append(torch.arange(offset + rank * n, offset + (rank + 1) * n))
        offset += full
    return torch.cat(parts)


@dataclass(frozen=True)
class Replicated:
    """Every rank holds the whole layer (tp 1, and the layers TP leaves replicated)."""

    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = None
    blocks: tuple[int, ...] | None = None

    def index(self, size: int, dim: str) -> torch.Tensor | None:
        """The indices this rank keeps of a `dim` ("out" / "in") dimension of `size`; None: all of it."""
        return None

    @property
    def bias_here(self) -> bool:
        return True

    @property
    def local_is_output(self) -> bool:
        """This rank's `F.linear(x, weight, bias)` is the layer's output (no collective joins it)."""
        return True

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def channel_amax(self, amax: torch.Tensor) -> torch.Tensor:
        return amax


@dataclass(frozen=True)
class Column(Replicated):
    """This rank's share of the output features: of each output block (`blocks`, e.g. q, k, v of a fused
    projection, so that each rank holds its own heads of all three) or of the whole. No communication unless
    `gather_output`."""

    gather_output: bool = False

    @property
    def local_is_output(self) -> bool:
        return not (self.gather_output and self.world > 1)

    def index(self, size: int, dim: str) -> torch.Tensor | None:
        if dim != "out" or self.world == 1:
            return None
        return _local_index(self.blocks or (size,), self.rank, self.world, "out_features")

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        if self.gather_output and self.world > 1:
            return all_gather_last_dim(y, self.group, self.world)
        return y


@dataclass(frozen=True)
class Row(Replicated):
    """This rank's share of the input features (of each input block: FLUX's single-block proj_out takes
    cat([attention, mlp]), each column-sharded); the partial products are summed by one all-reduce, the bias added
    on rank 0 only, inside its GEMM."""

    def index(self, size: int, dim: str) -> torch.Tensor | None:
        if dim != "in" or self.world == 1:
            return None
        return _local_index(self.blocks or (size,), self.rank, self.world, "input block")

    @property
    def bias_here(self) -> bool:
        return self.rank == 0

    @property
    def local_is_output(self) -> bool:
        return self.world == 1

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.world == 1 else all_reduce_sum(y, self.group)

    def channel_amax(self, amax: torch.Tensor) -> torch.Tensor:
        # A weight row (output channel) is spread over the ranks: its scale is the maximum over all of them.
        return all_reduce_max(amax, self.group) if self.world > 1 else amax


REPLICATED = Replicated()

# ---------------------------------------------------------------------------------------------------------------
# Quantization methods
# ---------------------------------------------------------------------------------------------------------------

# A parameter's dimensions: which one is the output features, which the input features (None: not sharded).
_DIMS = {"weight": ("out", "in"), "weight_scale": (None, "out"), "bias": ("out",)}


@dataclass(frozen=True)
class Plain:
    """The weight as loaded (the model's dtype): `F.linear`."""

    name: str = "bf16"
    fp8: bool = False

    def quantize(self, weight: torch.Tensor, parallel: Replicated) -> dict[str, torch.Tensor]:
        return {"weight": weight}

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


@dataclass(frozen=True)
class Fp8(Plain):
    """e4m3 weights with one fp32 scale per output channel; activations quantized per row (or handed over as
    `Fp8Rows` by the pass that produced them) into `torch._scaled_mm`, bf16 out. `weight_only`: inputs of at most
    `WEIGHT_ONLY_ROWS` rows (the AdaLN modulation: one per image) stay bf16 and go through the weight-only GEMV."""

    name: str = "fp8"
    fp8: bool = True
    weight_only: bool = False

    def quantize(self, weight: torch.Tensor, parallel: Replicated) -> dict[str, torch.Tensor]:
        w = weight.detach().float()
        amax = parallel.channel_amax(w.abs().amax(dim=1, keepdim=True))
        q, scale = fp8_ops.to_fp8(w, amax)
        return {"weight": q, "weight_scale": scale.t().contiguous()}

    def matmul(self, layer: Linear, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """fp8 [M, K] with fp32 scale [M, 1] -> bf16 [M, N]."""
        return fp8_ops.rows_matmul(q, layer.weight, scale, layer.weight_scale, bias)

    def apply(self, layer: Linear, x: torch.Tensor | fp8_ops.Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        n = layer.weight.shape[0]
        if isinstance(x, fp8_ops.Fp8Rows):  # quantized by the pass that produced it
            return self.matmul(layer, x.q, x.scale, bias).view(*x.shape[:-1], n)
        # (Under torch.compile the GEMV's launcher is not traced: the layer takes the quantized GEMM instead.)
        if (self.weight_only and x.shape[:-1].numel() <= fp8_ops.WEIGHT_ONLY_ROWS
                and not torch.compiler.is_compiling()):
            y = fp8_ops.weight_only_linear(fp8_ops._rows(x), layer.weight, layer.weight_scale, bias)
            return y.view(*x.shape[:-1], n)
        q, scale = fp8_ops.quantize_rows(x)
        return self.matmul(layer, q, scale, bias).view(*x.shape[:-1], n)


BF16 = Plain()
FP8 = Fp8()
FP8_WEIGHT_ONLY = Fp8(weight_only=True)

# ---------------------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------------------


class Linear(nn.Module):
    """`y = x @ W.T + b` held by a quantization method (`quant`) and computed in a parallel style (`parallel`).

    `in_features` / `out_features` are the full (unsharded) sizes; `weight` (and `weight_scale`, `bias`) are this
    rank's. Built from `nn.Linear`s (`from_linears`: stacked along the output, so q/k/v become one GEMM); the
    source weights are not kept.
    """

    def __init__(self, in_features: int, out_features: int, tensors: dict[str, torch.Tensor | None], *,
                 quant: Plain = BF16, parallel: Replicated = REPLICATED, requires_grad: bool = False,
                 parts: tuple[tuple[str, int], ...] = ()) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant, self.parallel = quant, parallel
        # A stacked layer's sources, in output order: (name relative to this layer's parent, out_features); an
        # adapter made for the unfused model finds its share of this layer by them (model/adapter_slots.py).
        self.parts = parts
        # Per-request adapters beside this layer's GEMM (model.adapter_slots.Side), attached after conversion.
        self.side: Any = None
        trainable = requires_grad and not quant.fp8
        for name, t in tensors.items():
            if name == "weight_scale":
                self.register_buffer(name, t)
            else:
                self.register_parameter(name, None if t is None else nn.Parameter(t, requires_grad=trainable))
        if "bias" not in tensors:
            self.register_parameter("bias", None)

    @classmethod
    def from_linears(cls, linears: Sequence[nn.Module], quant: Plain = BF16,
                     parallel: Replicated = REPLICATED, names: Sequence[str] = ()) -> Linear:
        """One layer computing `cat([l(x) for l in linears], -1)` (a single one: the same layer), quantized and
        sharded as asked. Column-parallel layers of one group stack into one column-parallel layer whose blocks
        are theirs: each rank keeps its own share of each (fused q/k/v at tp > 1: this rank's heads of all three).
        `names`: the sources' names beside the new layer (its `parts`)."""
        if names:
            if len(names) != len(linears):
                raise ValueError(f"{len(names)} names for {len(linears)} stacked linears")
            layer = cls.from_linears(linears, quant, parallel)
            layer.parts = tuple(zip(names, (lin.out_features for lin in linears)))
            return layer
        first = linears[0]
        if any(is_fp8(lin) for lin in linears):
            raise ValueError("fp8 layers cannot be stacked: fuse projections before quantizing")
        styles = {lin.parallel if isinstance(lin, Linear) else REPLICATED for lin in linears}
        if styles != {REPLICATED}:
            (style,) = styles if len(styles) == 1 else (None,)
            if not isinstance(style, Column) or style.gather_output or style.blocks or parallel != REPLICATED:
                raise ValueError(f"only column-parallel layers of one group stack (got {sorted(map(str, styles))})")
            local = Linear.from_linears([Linear(lin.weight.shape[1], lin.weight.shape[0], lin._tensors())
                                         for lin in linears], quant)
            blocks = tuple(lin.out_features for lin in linears)
            return Linear(first.in_features, sum(blocks), local._tensors(), quant=quant,
                          parallel=replace(style, blocks=blocks), requires_grad=first.weight.requires_grad)
        if any(lin.in_features != first.in_features for lin in linears):
            raise ValueError("stacked linears must share in_features")
        with_bias = [lin.bias is not None for lin in linears]
        if any(with_bias) != all(with_bias):
            raise ValueError("stacked linears must all have a bias or none")
        with torch.no_grad():
            weight = _stack([lin.weight.detach() for lin in linears])
            bias = _stack([lin.bias.detach() for lin in linears]) if all(with_bias) else None
            layer = cls(first.in_features, weight.shape[0], {"weight": weight, "bias": bias},
                        requires_grad=first.weight.requires_grad)
            return layer.sharded(parallel).quantized(quant)

    @property
    def fused_gelu_compatible(self) -> bool:
        """The local computation is exactly `F.linear(x, weight, bias)` (what the fused GELU site calls): no adapter
        side path either."""
        return not self.quant.fp8 and self.parallel.local_is_output and self.side is None

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in _DIMS if hasattr(self, name)}

    @torch.no_grad()
    def sharded(self, parallel: Replicated) -> Linear:
        """This layer as rank `parallel.rank` of `parallel.world` holds it (a copy; `self` must be unsharded)."""
        if self.parallel.world != 1:
            raise ValueError(f"layer is already sharded ({self.parallel})")
        self._no_side("sharding")
        tensors = {}
        for name, t in self._tensors().items():
            if t is not None:
                for dim, role in enumerate(_DIMS[name]):
                    size = self.out_features if role == "out" else self.in_features
                    idx = parallel.index(size, role) if role else None
                    if idx is not None:
                        t = t.index_select(dim, idx.to(t.device))
                t = t.detach()
            tensors[name] = t
        return Linear(self.in_features, self.out_features, tensors, quant=self.quant, parallel=parallel,
                      requires_grad=self.weight.requires_grad, parts=self.parts)

    @torch.no_grad()
    def quantized(self, quant: Plain) -> Linear:
        """This layer with its weight held by `quant` (from the plain weight only; the bias kept, in bf16 for fp8)."""
        if quant == self.quant:
            return self
        if self.quant.fp8:
            raise ValueError(f"layer is already {self.quant.name}: quantize from the plain weight")
        self._no_side("quantizing")
        tensors = quant.quantize(self.weight, self.parallel)
        bias = self.bias
        tensors["bias"] = None if bias is None else (bias.detach().to(torch.bfloat16) if quant.fp8 else bias.detach())
        return Linear(self.in_features, self.out_features, tensors, quant=quant, parallel=self.parallel,
                      parts=self.parts)

    def _no_side(self, what: str) -> None:
        if self.side is not None:
            raise ValueError(f"{what} would drop this layer's adapter buffers: convert before attaching adapters")

    def forward(self, x: torch.Tensor | fp8_ops.Fp8Rows) -> torch.Tensor:
        """x: [batch, ..., in_features] (or those rows quantized); the adapter side path, when on, adds each batch
        row's adapters to the local product, before the ranks' outputs are joined."""
        bias = self.bias if self.parallel.bias_here else None
        side = self.side if self.side is not None and self.side.on else None
        if side is not None and side.wide:  # the adapters' terms inside this layer's GEMM
            return self.parallel.finish(side.matmul(self, x, bias))
        y = self.quant.apply(self, x, bias)
        if side is not None:
            y = side.add(y, x)
        return self.parallel.finish(y)

    def matmul(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """fp8 layers: rows some other pass quantized (fp8 [M, K], scale [M, 1]) -> [M, N], joined as forward (each
        row its own batch row)."""
        return self(fp8_ops.Fp8Rows(q, scale, q.shape))

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this rank multiplies by, in fp32 (tests and error reports)."""
        w = self.weight.float()
        return w * self.weight_scale.t() if self.quant.fp8 else w

    @torch.no_grad()
    def full_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W, b) of the unsharded plain layer (collective for a sharded one: every rank must call it)."""
        p = self.parallel
        if p.world == 1:
            return self.weight.detach().clone(), None if self.bias is None else self.bias.detach().clone()
        gathered = all_gather_last_dim(self.weight.t() if isinstance(p, Column) else self.weight, p.group, p.world)
        if isinstance(p, Column):
            blocks = p.blocks or (self.out_features,)
            parts = gathered.t().split(self.weight.shape[0], dim=0)  # per rank: its rows of every block
            w = _unshard(parts, blocks, p.world, 0)
            b = None if self.bias is None else _unshard(
                all_gather_last_dim(self.bias, p.group, p.world).split(self.bias.shape[0]), blocks, p.world, 0)
            return w, b
        blocks = p.blocks or (self.in_features,)
        w = _unshard(gathered.split(self.weight.shape[1], dim=1), blocks, p.world, 1)
        return w, None if self.bias is None else self.bias.detach().clone()

    def extra_repr(self) -> str:
        p = self.parallel
        shard = "" if p.world == 1 else f", {type(p).__name__.lower()} rank {p.rank}/{p.world}" + (
            f" blocks {list(p.blocks)}" if p.blocks else "") + (" gathered" if getattr(p, "gather_output", False) else "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.quant.name}" + (" weight-only" if getattr(self.quant, "weight_only", False) else "") + shard)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `tensors` one after the other; one tensor is taken as it is (no copy: a conversion's peak stays
    the model plus one layer)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _unshard(per_rank: Sequence[torch.Tensor], blocks: Sequence[int], world: int, dim: int) -> torch.Tensor:
    """The full tensor from each rank's slices (each rank: its slice of every block, block after block)."""
    out, start = [], 0
    for full in blocks:
        n = full // world
        out.extend(part.narrow(dim, start, n) for part in per_rank)
        start += n
    return torch.cat(out, dim=dim)


def parallel_of(model: nn.Module) -> tuple[int, int]:
    """(rank, world size) of a model's sharded layers; (0, 1) when none is sharded."""
    for m in model.modules():
        if isinstance(m, Linear) and m.parallel.world > 1:
            return m.parallel.rank, m.parallel.world
    return 0, 1


def is_fp8(layer: nn.Module | None) -> bool:
    return isinstance(layer, Linear) and layer.quant.fp8


def convertible(linear: nn.Module) -> str | None:
    """Why `linear` cannot be quantized to fp8, or None."""
    if is_fp8(linear):
        return "already fp8"
    if type(linear) is not nn.Linear and not isinstance(linear, Linear):
        return f"{type(linear).__name__} is not a linear layer"
    reason = fp8_ops.fp8_refusal(linear.weight.device, linear.weight.dtype)
    return reason or fp8_ops.shape_refusal(linear.in_features, linear.out_features)


def plain_weight(layer: nn.Module) -> torch.Tensor | None:
    """The W for which `layer(x)` is `F.linear(x, W)` bit for bit (a bias-free plain layer, or a bias-free
    unconverted `Linear` whose local product is its output), else None."""
    if type(layer) is nn.Linear or (isinstance(layer, Linear) and layer.fused_gelu_compatible):
        return layer.weight if layer.bias is None else None
    return None


def spare_columns(*layers: nn.Module | None) -> int:
    """Columns past K that the rows quantized for these layers must have (`kernels.fp8.Fp8Rows.spare`): the most any
    of them writes its adapters' inputs into now (model/adapter_slots.py); 0 without adapters on."""
    spare = 0
    for layer in layers:  # (a loop: Dynamo traces no max() over a generator)
        if isinstance(layer, Linear) and layer.side is not None and layer.side.on:
            spare = max(spare, layer.side.spare)
    return spare


def linear_cat_gelu(linear: nn.Module, a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """`linear(cat([a, gelu_tanh(b)], -1))` (`a` may be None): an fp8 layer quantizes both parts and applies the GELU
    in one pass, with no bf16 intermediate; any other layer runs the eager expression."""
    if is_fp8(linear):
        q, scale = fp8_ops.quantize_rows(b[..., :0] if a is None else a, b, gelu_b=True,  # no `a`: zero width
                                         spare=spare_columns(linear))
        return linear(fp8_ops.Fp8Rows(q, scale, torch.Size((*b.shape[:-1], q.shape[1]))))
    act = F.gelu(b, approximate="tanh")
    return linear(act if a is None else torch.cat([a, act], dim=-1))
