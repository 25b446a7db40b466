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
- an fp8 layer (switch `adapters_in_fp8_gemm`) multiplies the terms inside its own GEMM: its weight gains
  `rows x width` columns past K holding each batch row's B (fp8, in the weight's own per-channel scales), and its input rows as many columns, where each
  image's rows get `x A^T` (quantized in the rows' own scales), so `[x | x A^T] [W | B]^T = x W^T + x A^T B^T` in
  one `torch._scaled_mm`: no second pass over the layer's output. (Each rank j of A, B is scaled by a factor c_j
  moved from B to x A^T so that both fit fp8, `_wide_term`; an adapter too strong for that range beside its
  layer's fp8 weight sends the layer to the form below.) The producers of fp8 rows leave those columns
  (`kernels.fp8.Fp8Rows.spare`, `model.linear.spare_columns`);
- any other layer adds `(x_b A_b^T) B_b^T` for each batch row b beside its own GEMM;
  both before the ranks' outputs are joined: a row-parallel layer's partial products are summed by the all-reduce it
  already makes.

The buffers never move: a step captured once replays for any adapters within the rank budget, so switching adapters
captures nothing, and one batch may hold images with different adapters. Not bit-exact (the terms are summed in
another order than PEFT's, and an fp8 input's adapter product is fp8): the high tier's. The lossless tier keeps
PEFT's exact path (model/adapters.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from kernels import fp8 as fp8_ops
from kernels import switches
from model.linear import Linear
from model.request import adapter_rank_error

logger = logging.getLogger(__name__)

Rows = Sequence[tuple[tuple[str, float], ...]]  # each batch row's (adapter name, scale) pairs
# Copy plans kept per (row, rank offset, adapter), oldest dropped past this: a plan is a few views per served layer.
MAX_PLANS = 256


# x A^T's side of a wide term is expected at most FP8_MAX / WIDE_HEADROOM (an estimate: |x A_j| / max|x| <=
# ||A_j||), for outlier tokens and request scales above 1.
WIDE_HEADROOM = 1.0
# Rows of ones (the unit row scales of the x A^T GEMM) kept per batch row; more rows get their own.
ONES_PER_ROW = 65536


_ONES: dict[torch.device, torch.Tensor] = {}


def _ones(device: torch.device, rows: int) -> torch.Tensor:
    """A [rows, 1] fp32 column of ones, shared by the sides on `device` (made where no graph is being captured)."""
    ones = _ONES.get(device)
    if ones is None or ones.shape[0] < rows:
        ones = _ONES[device] = torch.ones(rows, 1, device=device, dtype=torch.float32)
    return ones


@dataclass
class _State:
    on: bool = False  # the batch has adapters: every side adds its rows' terms


# Read when a layer's side is made (bench/lora_slots.py times both forms: --no-in-gemm).
IN_GEMM = switches.register("adapters_in_fp8_gemm", True,
                            "fp8 layers take per-request adapters inside their GEMM (fp8 columns of the weight and "
                            "the input) instead of after it")


def fp8_rows_layer(layer: Linear) -> bool:
    """An fp8 layer fed by quantized rows (not a weight-only one): it can take its adapters inside its GEMM."""
    return layer.quant.fp8 and not layer.quant.weight_only


def wide_form(layer: Linear) -> bool:
    """Whether a side made for `layer` now takes its adapters inside the layer's GEMM (the switch on)."""
    return IN_GEMM.value and fp8_rows_layer(layer)


class Side:
    """One layer's adapter buffers for a batch (this rank's shard): each row's A rows and B^T rows, `parts` x `rank`
    of them (a stacked layer's part p owns rows [p * rank, (p + 1) * rank)), zero past what the row's adapters use.
    A wide side (`wide_form`) keeps each row's fp8 A and its scales, and each row's B in the layer's weight: the
    weight becomes the first K columns of `weight` [N, K + rows x width], row b's B in the width columns after
    K + b x width."""

    def __init__(self, layer: Linear, rows: int, rank: int, state: _State, wide: bool) -> None:
        n, k = layer.weight.shape
        dtype = torch.bfloat16 if layer.quant.fp8 else layer.weight.dtype
        device = layer.weight.device
        self.wide = wide
        width = max(1, len(layer.parts)) * rank
        self.width = -(-width // 16) * 16 if self.wide else width  # an fp8 GEMM's K is a multiple of 16
        self.state = state
        self.a = self.bt = self.a8 = self.a8_scale = self.weight = self.ones = None
        if not self.wide:
            self.a = torch.zeros(rows, width, k, device=device, dtype=dtype)
            self.bt = torch.zeros(rows, width, n, device=device, dtype=dtype)
        if layer.quant.fp8:
            self.a8 = torch.zeros(rows, self.width, k, device=device, dtype=torch.float8_e4m3fn)
            self.a8_scale = torch.zeros(rows, 1, self.width, device=device, dtype=torch.float32)
        if self.wide:
            with torch.no_grad():
                self.weight = torch.zeros(n, k + rows * self.width, device=device, dtype=layer.weight.dtype)
                self.weight[:, :k] = layer.weight
                layer.weight = nn.Parameter(self.weight[:, :k], requires_grad=False)
            self.ones = _ones(device, rows * ONES_PER_ROW)

    @property
    def on(self) -> bool:
        return self.state.on

    @property
    def spare(self) -> int:
        """Columns past K this layer's input rows need (0: not a wide side)."""
        return self.a8.shape[0] * self.width if self.wide else 0

    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.a, self.bt, self.a8, self.a8_scale, self.weight) if t is not None]

    def matmul(self, layer: Linear, x: torch.Tensor | fp8_ops.Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        """A wide side: the layer's local product with each batch row's adapter terms, in one GEMM over the input
        rows widened by x A^T (written into the rows' spare columns)."""
        n, k = layer.weight.shape
        if not isinstance(x, fp8_ops.Fp8Rows):
            x = fp8_ops.Fp8Rows(*fp8_ops.quantize_rows(x, spare=self.spare), x.shape)
        batch, width = x.shape[0], self.width
        columns = batch * width
        if x.spare < columns:  # rows from a pass that left no room: copied into wider ones
            q = fp8_ops.with_spare(x.q.shape[0], k, columns, x.q.device)
            q.copy_(x.q)
            x = fp8_ops.Fp8Rows(q, x.scale, x.shape)
        rows = x.wide(columns)
        extra = rows[:, k:]
        if batch > 1:
            extra.zero_()  # an image's rows carry no other image's terms
        per_row = x.q.shape[0] // batch
        ones = self.ones if per_row * batch <= self.ones.shape[0] else torch.ones_like(x.scale)
        for b in range(batch):
            mine = slice(b * per_row, (b + 1) * per_row)
            # x A^T c / s (s: the row's scale, which the GEMM multiplies back): unit row scales, A's scales times c
            fp8_ops.rows_times_into(x.q[mine], self.a8[b], self.a8_scale[b], extra[mine, b * width:(b + 1) * width],
                                    ones[:per_row])
        y = fp8_ops.rows_matmul(rows, self.weight[:, :k + columns], x.scale, layer.weight_scale, bias)
        return y.view(*x.shape[:-1], n)

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
    wide: _Wide | None = None  # the term inside an fp8 layer's GEMM (None: it does not fit there)


@dataclass(frozen=True)
class _Wide:
    """A term in a wide side's form: B / (c w) as fp8 columns of the layer's weight [N_local, r], and A's fp8 scales
    times c (c [r]; w the weight's channel scales)."""

    b8: torch.Tensor
    a8_scale: torch.Tensor


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
        self.beside: set[str] = set()  # fp8 layers an adapter too strong for their GEMM's fp8 columns went beside
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
        for served, layer_terms in terms.items():
            layer = self.layers[served]
            wide = (layer.side.wide if layer.side is not None else wide_form(layer)) and served not in self.beside
            if wide and any(term.wide is None for term in layer_terms):
                logger.warning("adapter %r at %s does not fit fp8 columns beside the layer's weight: its adapters "
                               "are added after the layer's GEMM", name, served)
                self.move_beside([served])
            if layer.side is None:
                wide = wide_form(layer) and served not in self.beside
                layer.side = Side(layer, self.rows, self.rank, self.state, wide)
                self.version += 1
        self._composed = None
        return sorted(terms)

    def move_beside(self, names: Sequence[str] | None = None) -> None:
        """Layers `names` (default: all) take every adapter after their GEMM from now on: where one adapter is too
        strong for fp8 columns beside the weight (and for benchmarks, which compare the two forms)."""
        for served in self.layers if names is None else names:
            layer = self.layers[served]
            if not fp8_rows_layer(layer) or served in self.beside:
                continue
            self.beside.add(served)
            if layer.side is not None and layer.side.wide:
                # every buffer written so far is zeroed first, as the plans (views of the old buffers) go
                with torch.no_grad():
                    self._zero_written()
                    layer.weight = nn.Parameter(layer.weight.contiguous(), requires_grad=False)  # its own K columns
                layer.side = Side(layer, self.rows, self.rank, self.state, False)
                self._plans, self._written, self._composed = {}, [], None
                self.version += 1

    def _zero_written(self) -> None:
        """Zero what the last fill wrote: bytes of contiguous regions, and the weights' strided columns."""
        for group, _ in _by_dtype(self._written, self._written).values():
            torch._foreach_zero_(group)

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
        bt = torch.zeros(a.shape[0], layer.weight.shape[0], device=device, dtype=torch.float32)
        bt.index_copy_(1, local.to(device), b.t())
        wide = None
        if fp8_rows_layer(layer):  # (whichever form its side takes: a side may be made or moved later)
            fit = _wide_term(a, bt, layer.weight_scale.flatten())
            wide = None if fit is None else _Wide(fit[0], a8_scale * fit[1])
        return _Term(part, a.to(dtype), bt.to(dtype), a8, a8_scale, wide)

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
                layer.side = Side(layer, rows, self.rank, self.state, layer.side.wide)
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
            layer = self.layers[served]
            side = layer.side
            for term in terms:
                at = slice(term.part * self.rank + offset, term.part * self.rank + offset + term.a.shape[0])
                if side.wide:  # fp8 A, its scales (the request's scale goes there), B into the weight's columns
                    first = layer.weight.shape[1] + row * side.width
                    dst += [side.a8[row, at].view(torch.uint8), side.a8_scale[row, 0, at],
                            side.weight[:, first + at.start:first + at.stop].view(torch.uint8)]
                    src += [term.a8.view(torch.uint8), term.wide.a8_scale, term.wide.b8.view(torch.uint8)]
                    scaled.append(side.a8_scale[row, 0, at])
                    continue
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
            self._zero_written()
            # one list per dtype (bf16 A and B^T rows, fp8 A as bytes, fp32 fp8 scales): a list mixing dtypes takes
            # the per-tensor path on CUDA
            for group_dst, group_src in _by_dtype(dst, src).values():
                torch._foreach_copy_(group_dst, group_src)
            for group, group_scales in _by_dtype(scaled, scales).values():
                torch._foreach_mul_(group, group_scales)
        self._written = written


def _by_dtype(tensors: list[torch.Tensor], others: list) -> dict[tuple, tuple[list[torch.Tensor], list]]:
    """`tensors` and the entries of `others` beside them, split by the tensors' dtype and whether they are
    contiguous (order kept in each group): one strided tensor sends a whole list down the per-tensor path."""
    groups: dict[tuple, tuple[list[torch.Tensor], list]] = {}
    for t, o in zip(tensors, others):
        group = groups.setdefault((t.dtype, t.is_contiguous()), ([], []))
        group[0].append(t)
        group[1].append(o)
    return groups


def _wide_term(a: torch.Tensor, bt: torch.Tensor,
               weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A term (A [r, K], B^T [r, N], fp32) inside the GEMM of an fp8 weight with channel scales `weight_scale` [N]:
    the weight's columns B[n, j] / (c_j w_n) and the input's x A_j^T c_j / s (s the row's scale, max|x| / 448). Each
    c_j lies between the least that keeps the B column within fp8 and the most that keeps x A_j^T's side within
    FP8_MAX / WIDE_HEADROOM by the estimate |x A_j^T| <= max|x| ||A_j||, at their geometric mean. Returns
    (fp8 [N, r], c [r]); None when there is no such c."""
    need = (bt.abs() / weight_scale).amax(dim=1) / fp8_ops.FP8_MAX  # c at least this
    room = 1.0 / (WIDE_HEADROOM * a.norm(dim=1).clamp(min=1e-30))  # and at most this
    used = need > 0
    if bool((need > room)[used].any()):
        return None
    c = torch.where(used, (need * room).sqrt(), torch.ones_like(need))
    b8 = (bt / (c[:, None] * weight_scale)).clamp(-fp8_ops.FP8_MAX, fp8_ops.FP8_MAX).to(torch.float8_e4m3fn)
    return b8.t().contiguous(), c
