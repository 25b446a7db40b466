"""How one batch runs a transformer's forward, scoped to the calling thread, and the First-Block step cache.

Kept out of the model file: the model's forward asks `execution_of(self)` and follows what it finds (compiled block
runners, CUDA-graph replay, a step cache); `model.tiers.applied_tier` sets it for a batch with `running`. Nothing
here is stored on the model, so two threads (or a finished batch) never see another batch's choice.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from model.graphs import StepGraphs


class FirstBlockCache:
    """A step cache for one batch (First-Block-Cache): when the first double block's residual changed by less than
    `threshold` (mean absolute change over mean magnitude) since the last fully computed step, skip every other
    block and reuse that step's image residual of the skipped blocks. Not bit-exact (high tier only).

    The decision reads one scalar per step back to the host, so a step with the cache is never one CUDA graph: the
    embeddings and the first block run eager, and the blocks after it are their own graph (see `cached_step`).
    """

    def __init__(self, threshold: float, agree: Callable[[bool], bool] | None = None) -> None:
        if not threshold >= 0:
            raise ValueError(f"step cache threshold must be >= 0, got {threshold!r}")
        self.threshold = float(threshold)
        # TP ranks: one decision for all (a step is skipped only where every rank would skip it), so the ranks never
        # run different blocks and meet at different collectives.
        self.agree = agree
        self.computed = 0  # steps that ran every block
        self.skipped = 0  # steps that reused the cached residual
        # (first-block residual, residual of every later block) of the last computed step
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def can_skip(self, first_residual: torch.Tensor) -> bool:
        if self._last is None or self._last[0].shape != first_residual.shape:
            return False
        prev = self._last[0]
        change = (first_residual - prev).abs().mean() / prev.abs().mean().clamp_min(1e-12)
        skip = bool(change < self.threshold)
        return skip if self.agree is None else self.agree(skip)

    def skip(self, after_first: torch.Tensor) -> torch.Tensor:
        """A skipped step's image hidden states: the first block's output plus the cached rest residual."""
        self.skipped += 1
        return after_first + self._last[1]

    def store(self, first_residual: torch.Tensor, rest_residual: torch.Tensor) -> None:
        """A computed step: its first-block residual and the residual of every block after it."""
        self.computed += 1
        self._last = (first_residual, rest_residual)


@dataclass(frozen=True)
class StepExecution:
    """How one batch runs a transformer's forward: compiled block runners (double, single) and/or CUDA-graph
    replay (a `model.graphs.StepGraphs`). None of it is stored on the model: `running` scopes it to the calling
    thread for one batch, so two threads (or a finished batch) never see another batch's choice."""

    transformer: nn.Module
    block_runners: tuple[Any, Any] | None = None
    step_graphs: StepGraphs | None = None
    step_cache: FirstBlockCache | None = None


_EXECUTION: ContextVar[StepExecution | None] = ContextVar("fluxserve_step_execution", default=None)


@contextmanager
def running(transformer: nn.Module, *, block_runners: tuple[Any, Any] | None = None,
            step_graphs: StepGraphs | None = None,
            step_cache: FirstBlockCache | None = None) -> Iterator[StepExecution]:
    """Run `transformer`'s forwards in this thread with these block runners / step graphs / step cache until the
    block ends."""
    if block_runners is not None and step_graphs is not None:
        raise ValueError("compiled block runners never replay CUDA graphs: pass one or the other")
    token = _EXECUTION.set(StepExecution(transformer, block_runners, step_graphs, step_cache))
    try:
        yield _EXECUTION.get()
    finally:
        _EXECUTION.reset(token)


def execution_of(transformer: nn.Module) -> StepExecution | None:
    """The execution `running` set for `transformer` in this thread, or None (eager blocks, no graphs)."""
    ex = _EXECUTION.get()
    return ex if ex is not None and ex.transformer is transformer else None


def cached_step(model: nn.Module, ex: StepExecution, hidden_states: torch.Tensor,
                encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor], return_dict: bool) -> Any:
    """A transformer step under `ex.step_cache` (the model calls it after its embeddings): the first double block,
    then either the cached residual of the others or all of them (replayed from a CUDA graph where `ex.step_graphs`
    allows it: the same kernels as eager), then the model's output layers."""
    cache = ex.step_cache
    encoder_hidden_states, after_first = model._block_runners()[0](
        model.transformer_blocks[0], hidden_states, encoder_hidden_states, temb, image_rotary_emb)
    first_residual = after_first - hidden_states
    if cache.can_skip(first_residual):
        return model._output(cache.skip(after_first), temb, return_dict)
    rest = dict(hidden_states=after_first, encoder_hidden_states=encoder_hidden_states, temb=temb,
                rope_cos=image_rotary_emb[0], rope_sin=image_rotary_emb[1])
    if ex.step_graphs is not None:
        hidden_states = ex.step_graphs(model, model._blocks_after_first, rest)
    else:
        hidden_states = model._blocks_after_first(**rest)
    cache.store(first_residual, hidden_states - after_first)
    return model._output(hidden_states, temb, return_dict)
