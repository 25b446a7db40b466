"""Per-request LoRA adapters on a converted transformer (fused projections, fp8 layers, sharded), graph-static.

PEFT wraps plain `nn.Linear` layers and runs each active adapter inside the layer's call, with its scale a Python
number: a captured CUDA graph would replay the adapters it was captured with, and the high tier's stacked, fp8 or
sharded `model.linear.Linear` layers are not PEFT's to wrap. Here:

- an adapter is read once by diffusers' own loader (`model.adapters.read_adapter`) and kept per served layer in
  that layer's form: its A rows [r, K] (and their fp8 copy beside an fp8 layer) and its B, scaled by PEFT's
  `alpha / r`, transposed [r, N], each as this rank holds them (a stacked layer's part: zero outside its own
  output columns, so that composing copies whole rows);
- before each batch, each image's adapters (with the request's scales) are composed into per-layer buffers of a
  fixed shape (`Side`: [rows, parts x rank, K] and [rows, parts x rank, N]; zero past what a row uses), a few
  multi-tensor copies, skipped when the batch's adapters are the previous batch's;
- the layer adds `(x_b A_b^T) B_b^T` for each batch row b beside its own GEMM (an fp8 input's rows go through
  `torch._scaled_mm` against the fp8 A), before the ranks' outputs are joined: a row-parallel layer's partial
  products are summed by the all-reduce it already makes.

The buffers never move: a step captured once replays for any adapters within the rank budget, so switching adapters
captures nothing, and one batch may hold images with different adapters. Not bit-exact (the terms are summed in
another order than PEFT's, and an fp8 input's adapter product is fp8): the high tier's. The lossless tier keeps
PEFT's exact path (model/adapters.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from kernels import fp8 as fp8_ops
from model.linear import Linear
from model.request import adapter_rank_error

Rows = Sequence[tuple[tuple[str, float], ...]]  # each batch row's (adapter name, scale) pairs
# Copy plans kept per (row, rank offset, adapter), oldest dropped past this: a plan is a few views per served layer.
MAX_PLANS = 256


@dataclass
class _State:
    on: bool = False  # the batch has adapters: every side adds its rows' terms


class Side:
    """One layer's adapter buffers for a batch (this rank's shard): each row's A rows and B^T rows, `parts` x `rank`
    of them (a stacked layer's part p owns rows [p * rank, (p + 1) * rank)), zero past what the row's adapters use."""

    def __init__(self, layer: Linear, rows: int, rank: int, state: _State) -> None:
        n, k = layer.weight.shape
        dtype = torch.bfloat16 if layer.quant.fp8 else layer.weight.dtype
        device = layer.weight.device
        width = max(1, len(layer.parts)) * rank
        self.state = state
        self.a = torch.zeros(rows, width, k, device=device, dtype=dtype)
        self.bt = torch.zeros(rows, width, n, device=device, dtype=dtype)
        self.a8 = self.a8_scale = None
        if layer.quant.fp8:
            self.a8 = torch.zeros(rows, width, k, device=device, dtype=torch.float8_e4m3fn)
            self.a8_scale = torch.zeros(rows, 1, width, device=device, dtype=torch.float32)

    @property
    def on(self) -> bool:
        return self.state.on

    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.a, self.bt, self.a8, self.a8_scale) if t is not None]

    def add(self, y: torch.Tensor, x: torch.Tensor | fp8_ops.Fp8Rows) -> torch.Tensor:
        """y (the layer's local product, [batch, ..., N]) += each batch row's adapter terms; in place."""
        batch = x.shape[0]
        y3 = y.view(batch, -1, y.shape[-1])
        if isinstance(x, fp8_ops.Fp8Rows):
            per_row = x.q.shape[0] // batch
            for b in range(batch):
                rows = slice(b * per_row, (b + 1) * per_row)
                xa = fp8_ops.rows_matmul(x.q[rows], self.a8[b], x.scale[rows], self.a8_scale[b], None)
                y3[b].addmm_(xa, self.bt[b])
        else:
            x3 = x.reshape(batch, -1, x.shape[-1])
            y3.baddbmm_(torch.bmm(x3, self.a[:batch].transpose(1, 2)), self.bt[:batch])
        return y


@dataclass(frozen=True)
class _Term:
    """One adapter's share of one served layer, as this rank holds it."""

    part: int  # which part of a stacked layer (0 for a plain one)
    a: torch.Tensor  # [r, K_local]
    # [r, N_local]: B scaled by alpha / r, transposed, zero outside the part's columns: a switch copies whole rows
    # (contiguous, so the multi-tensor ops take their one-launch path on CUDA instead of one copy per block)
    bt: torch.Tensor
    a8: torch.Tensor | None  # fp8 A [r, K_local] beside an fp8 layer, with its per-row scales [r]
    a8_scale: torch.Tensor | None


@dataclass
class _Plan:
    """One adapter's copies into one batch row's buffers: destination views, their sources, the views a request's
    scale multiplies, and the destinations as bytes (to zero them when the next batch's adapters differ)."""

    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    scaled: list[torch.Tensor]
    zero: list[torch.Tensor]


@dataclass(frozen=True)
class _Adapter:
    rank: int  # the largest r over its layers (what a row's rank budget counts)
    terms: dict[str, list[_Term]]  # served layer path -> its terms


class AdapterSlots:
    """The adapters of one transformer (a TP rank's shard) served beside its layers, and the batch buffers they are
    composed into. `rank`: the most adapter rank one image may use per projection (its adapters' ranks summed);
    `rows`: the largest batch (the buffers grow, dropping captured graphs, if a larger one comes)."""

    def __init__(self, model: nn.Module, rank: int, rows: int = 1) -> None:
        error = adapter_rank_error(rank)
        if error is not None:
            raise ValueError(f"the adapter rank budget {error}")
        self.model, self.rank, self.rows = model, rank, max(1, rows)
        self.adapters: dict[str, _Adapter] = {}
        self.state = _State()
        self.version = 0  # bumped when layers gain or change buffers: captured graphs hold the old ones
        self._captured_at = 0  # the version the model's captured graphs (if any) were taken at
        self._composed: tuple | None = None
        # What switching adapters reuses: each (row, rank offset, adapter)'s buffer views with their sources, and the
        # regions the last fill wrote (everything else is zero), so a switch zeroes and copies only what it must.
        self._plans: dict[tuple[int, int, str], _Plan] = {}
        self._written: list[torch.Tensor] = []
        # Every linear of the model as a `Linear` (F.linear, the same kernels as nn.Linear), so any layer an adapter
        # reaches can carry a side; and where an unfused layer's adapter lands: name -> (served layer, part).
        with torch.no_grad():
            for name, layer in list(model.named_modules()):
                if type(layer) is nn.Linear:
                    parent_name, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(parent_name), attr, Linear.from_linears([layer]))
        self.layers: dict[str, Linear] = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
        self.origin: dict[str, tuple[str, int]] = {}
        for name, layer in self.layers.items():
            parent = name.rpartition(".")[0]
            for part, (source, _) in enumerate(layer.parts):
                self.origin[f"{parent}.{source}" if parent else source] = (name, part)
            if not layer.parts:
                self.origin[name] = (name, 0)

    # -- adapters --------------------------------------------------------------------------------------------------

    def add(self, name: str, tensors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> list[str]:
        """Serve adapter `name` from its unfused per-layer tensors {layer: (A [r, K], B [N, r], alpha / r)}, whole
        (this rank keeps its share). Returns the served layers it reaches. ValueError where it cannot be served."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is loaded already; unload it first")
        terms: dict[str, list[_Term]] = {}
        rank = 0
        with torch.no_grad():
            for source, (a, b, scaling) in tensors.items():
                if source not in self.origin:
                    raise ValueError(f"adapter {name!r} reaches {source}, which this model does not serve as a "
                                     "linear layer")
                served, part = self.origin[source]
                layer = self.layers[served]
                r = a.shape[0]
                if r > self.rank:
                    raise ValueError(f"adapter {name!r} has rank {r} at {source}; this pool serves adapters up to "
                                     f"rank {self.rank} (args.pools.<pool>.adapter_rank)")
                terms.setdefault(served, []).append(self._term(layer, part, a, b, scaling))
                rank = max(rank, r)
        self.adapters[name] = _Adapter(rank, terms)
        for served in terms:
            if self.layers[served].side is None:
                self.layers[served].side = Side(self.layers[served], self.rows, self.rank, self.state)
                self.version += 1
        self._composed = None
        return sorted(terms)

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters)}")
        del self.adapters[name]
        self._plans = {k: v for k, v in self._plans.items() if k[2] != name}
        self._composed = None

    def _term(self, layer: Linear, part: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> _Term:
        p, device = layer.parallel, layer.weight.device
        dtype = torch.bfloat16 if layer.quant.fp8 else layer.weight.dtype
        sizes = [size for _, size in layer.parts] or [layer.out_features]
        if a.shape[1] != layer.in_features or b.shape != (sizes[part], a.shape[0]):
            raise ValueError(f"adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a layer of "
                             f"{layer.in_features} -> {sizes[part]} features")
        a = a.to(device=device, dtype=torch.float32)
        b = b.to(device=device, dtype=torch.float32) * float(scaling)
        inputs = p.index(layer.in_features, "in")
        if inputs is not None:
            a = a.index_select(1, inputs.to(device))
        # This rank's output columns of the part: the local columns whose global index falls in the part's range.
        start = sum(sizes[:part])
        outputs = p.index(layer.out_features, "out")
        outputs = torch.arange(layer.out_features) if outputs is None else outputs
        local = ((outputs >= start) & (outputs < start + sizes[part])).nonzero().flatten()
        b = b.index_select(0, (outputs[local] - start).to(device))
        a8 = a8_scale = None
        if layer.quant.fp8:
            a8, scale = fp8_ops.to_fp8(a, a.abs().amax(dim=1, keepdim=True))
            a8_scale = scale.flatten()
        bt = torch.zeros(a.shape[0], layer.weight.shape[0], device=device, dtype=dtype)
        bt.index_copy_(1, local.to(device), b.t().to(dtype))
        return _Term(part, a.to(dtype), bt, a8, a8_scale)

    # -- batches ---------------------------------------------------------------------------------------------------

    def row_error(self, loras: tuple[tuple[str, float], ...]) -> str | None:
        """Why one image's adapters cannot be composed (unknown, or past the rank budget), or None."""
        unknown = [n for n, _ in loras if n not in self.adapters]
        if unknown:
            return f"unknown LoRA adapter(s) {unknown}; loaded: {sorted(self.adapters)}"
        used = sum(self.adapters[n].rank for n, _ in loras)
        if used > self.rank:
            return (f"the adapters {[n for n, _ in loras]} use rank {used} together; this pool composes at most rank "
                    f"{self.rank} per image (args.pools.<pool>.adapter_rank)")
        return None

    def compose(self, rows: Rows) -> bool:
        """Fill the buffers with each batch row's adapters (skipped when they are the last batch's) and switch the
        sides on if any row has one. Returns whether any has. ValueError (nothing changed) for a row that cannot be
        composed."""
        for loras in rows:
            error = self.row_error(tuple(loras))
            if error is not None:
                raise ValueError(error)
        key = tuple(tuple(r) for r in rows)
        if not any(key):
            self.state.on = False
            return False
        if len(rows) > self.rows:
            self._grow(len(rows))
        if key != self._composed:
            self._fill(key)
            self._composed = key
        self.state.on = True
        return True

    def off(self) -> None:
        self.state.on = False

    def graphs_stale(self) -> bool:
        """Whether buffers were made or grown since `graphs_dropped`: graphs captured before hold the old ones."""
        return self.version != self._captured_at

    def graphs_dropped(self) -> None:
        self._captured_at = self.version

    def _grow(self, rows: int) -> None:
        self.rows = rows
        for layer in self.layers.values():
            if layer.side is not None:
                layer.side = Side(layer, rows, self.rank, self.state)
        self.version += 1
        self._composed = None
        self._plans, self._written = {}, []  # views of the old buffers

    def _plan(self, row: int, offset: int, name: str) -> _Plan:
        """Where adapter `name` goes in batch row `row`, its rank slots starting at `offset` (made once, kept)."""
        plan = self._plans.get((row, offset, name))
        if plan is not None:
            return plan
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        scaled: list[torch.Tensor] = []
        for served, terms in self.adapters[name].terms.items():
            side = self.layers[served].side
            for term in terms:
                at = slice(term.part * self.rank + offset, term.part * self.rank + offset + term.a.shape[0])
                dst += [side.a[row, at], side.bt[row, at]]
                src += [term.a, term.bt]
                scaled.append(side.a[row, at])
                if term.a8 is not None:
                    dst += [side.a8[row, at].view(torch.uint8), side.a8_scale[row, 0, at]]
                    src += [term.a8.view(torch.uint8), term.a8_scale]
                    scaled.append(side.a8_scale[row, 0, at])
        plan = _Plan(dst, src, scaled, [t.view(torch.uint8) for t in dst])  # zero bytes: +0.0 in every format
        if len(self._plans) >= MAX_PLANS:
            del self._plans[next(iter(self._plans))]
        self._plans[(row, offset, name)] = plan
        return plan

    def _fill(self, key: tuple) -> None:
        """A few multi-tensor passes: zero what the last fill wrote, copy each term into its row's place, scale
        each copied A (and fp8 A scale) by the request's scale."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        scaled: list[torch.Tensor] = []
        scales: list[float] = []
        written: list[torch.Tensor] = []
        for row, loras in enumerate(key):
            offset = 0
            for name, scale in loras:
                plan = self._plan(row, offset, name)
                dst += plan.dst
                src += plan.src
                scaled += plan.scaled
                scales += [float(scale)] * len(plan.scaled)
                written += plan.zero
                offset += self.adapters[name].rank
        with torch.no_grad():
            if self._written:
                torch._foreach_zero_(self._written)  # bytes of contiguous regions: one list, one dtype
            # one list per dtype (bf16 A and B^T rows, fp8 A as bytes, fp32 fp8 scales): a list mixing dtypes takes
            # the per-tensor path on CUDA
            for group_dst, group_src in _by_dtype(dst, src).values():
                torch._foreach_copy_(group_dst, group_src)
            for group, group_scales in _by_dtype(scaled, scales).values():
                torch._foreach_mul_(group, group_scales)
        self._written = written


def _by_dtype(tensors: list[torch.Tensor], others: list) -> dict[torch.dtype, tuple[list[torch.Tensor], list]]:
    """`tensors` and the entries of `others` beside them, split by the tensors' dtype (order kept in each group)."""
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list]] = {}
    for t, o in zip(tensors, others):
        group = groups.setdefault(t.dtype, ([], []))
        group[0].append(t)
        group[1].append(o)
    return groups
