"""A quality tier as a value: what it switches on (`TierPlan`), and the one place that applies it to a transformer.

`plan_tier` turns a request's quality and the pipeline's settings into a frozen `TierPlan`; `applied_tier` switches a
transformer to that plan for one batch and restores the lossless state after it, whatever happens inside. The
pipeline uses it for every batch and the TP ranks reach it through the pipeline, passing an `agree` hook so that a
`high` batch mounts its fused sites on every rank or on none.

Lossless is the plan with everything off: unmounted sites, exact norms, eager blocks; only CUDA-graph replay (which
replays the same kernels) may be on.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator

from kernels import attention, gelu, modulate, sites
from model.execution import FirstBlockCache, running
from model.features import FEATURES, exclusion, feature, is_on
from model.request import Quality

if TYPE_CHECKING:
    import torch

    from model.graphs import StepGraphs


@dataclass(frozen=True)
class TierPlan:
    quality: Quality
    mount_gelu: bool = False  # Linear + tanh-GELU sites through the fused epilogue (not bit-exact)
    fast_norm: bool = False  # LayerNorm + modulate and QK RMSNorm + RoPE through their fast kernels (not bit-exact)
    attention8: bool = False  # 8-bit attention (int8 Q K^T, fp8 P V) instead of SDPA (not bit-exact)
    compiled: bool = False  # the blocks through their regional torch.compile graphs
    cuda_graphs: bool = False  # each step replayed from a CUDA graph (bit-identical to eager)
    fast_vae: bool = False  # the VAE decode through its channels-last copy (model/vae.py; not bit-exact)
    # The transformer's lifetime form (converted once when a high replica starts, not per batch): fp8 linear layers,
    # and q/k/v (+ the single block's MLP up-projection) as one GEMM each.
    fp8: bool = False
    fused_projections: bool = False
    # First-Block-Cache threshold (model.execution.FirstBlockCache), a fresh cache per batch; None: every step computed.
    step_cache: float | None = None

    def __post_init__(self) -> None:
        on = self.techniques()
        if self.quality == "lossless" and any(not feature(name).exact for name in on):
            raise ValueError(f"a lossless plan may not switch on non-exact kernels, compiled blocks or a converted "
                             f"(fp8 / fused-projection) transformer: {self}")
        for a, b in _CONTRADICTIONS:
            if a in on and b in on:
                raise ValueError(exclusion(a, b))

    def techniques(self) -> frozenset[str]:
        """The feature-table techniques this plan switches on (model/features.py)."""
        return frozenset(name for attr, name in _TECHNIQUE_OF.items() if is_on(getattr(self, attr)))


# TierPlan field -> its row of the feature table.
_TECHNIQUE_OF = {"mount_gelu": "gelu_sites", "fast_norm": "fast_norm", "attention8": "attention8",
                 "compiled": "compile", "cuda_graphs": "cuda_graphs", "fp8": "fp8",
                 "fused_projections": "fused_projections", "step_cache": "step_cache", "fast_vae": "fast_vae"}
# Pairs of the table's exclusions that no single batch can run (the others are a pool's choice, measured).
_CONTRADICTIONS = (("gelu_sites", "fp8"), ("compile", "cuda_graphs"))


def plan_tier(quality: Quality, *, fast_norm: bool = False, attention8: bool = False, compiled: bool = False,
              cuda_graphs: bool = False, fp8: bool = False, fused_projections: bool = False,
              step_cache: float | None = None, fast_vae: bool = False) -> TierPlan:
    """The plan of one batch: `high` mounts the GELU sites (unless fp8 layers take the GELU) and takes the opt-ins
    it is given; `lossless` none of them. CUDA graphs apply to either tier, except inside a compiled batch (a
    step-cache batch replays the blocks after the first from a graph: `model.execution.FirstBlockCache`).
    fp8 / fused_projections describe the transformer's form: a lossless plan for a converted transformer raises."""
    high = quality == "high"
    cache = step_cache if high else None
    return TierPlan(quality, mount_gelu=high and not fp8, fast_norm=high and fast_norm,
                    attention8=high and attention8,
                    compiled=high and compiled,
                    cuda_graphs=cuda_graphs and not (high and compiled), fp8=fp8,
                    fused_projections=fused_projections, step_cache=cache, fast_vae=high and fast_vae)


@dataclass(frozen=True)
class Ran:
    """What one batch ran with, as each of its results reports it (HTTP: the JSON field `ran` and the header
    `X-Ran`): how many sites each non-exact kernel kind was switched on at, the transformer's form, how the steps
    ran, and the adapters. Zeros and False for a lossless batch, bar `graphed` (replay is bit-identical)."""

    gelu_sites: int = 0  # Linear + tanh-GELU sites through the fused epilogue
    fast_norm_sites: int = 0  # LayerNorm + modulate and QK RMSNorm + RoPE sites on their fast kernels
    attention8_sites: int = 0  # attention modules on 8-bit attention
    fp8_layers: int = 0  # fp8 linear layers of the transformer (its converted form)
    fused_projections: bool = False  # q/k/v (+ the single block's MLP up-projection) as one GEMM each
    compiled: bool = False  # the blocks ran through their compiled graphs
    graphed: bool = False  # steps (or, with a step cache, the blocks after the first) replayed from CUDA graphs
    step_cache: float | None = None  # the First-Block step cache threshold (skipped steps: timings.cached_steps)
    fast_vae: bool = False  # decoded by the VAE's channels-last copy (model/vae.py)
    adapters: tuple[tuple[str, float], ...] = ()  # LoRA adapters (name, scale) switched on for the batch
    fused_adapter: tuple[str, float] | None = None  # the adapter merged into the weights at start, if any

    def as_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("adapters", "fused_adapter")},
                "adapters": [{"name": n, "scale": s} for n, s in self.adapters],
                "fused_adapter": None if self.fused_adapter is None else dict(zip(("name", "scale"),
                                                                                  self.fused_adapter))}


@dataclass
class TierReport:
    """What a batch actually ran with (a plan's sites can be refused: then the batch runs them unfused)."""

    mounted_sites: int = 0
    fast_norm_sites: int = 0
    attention8_sites: int = 0
    mount_report: Any = None  # kernels.MountReport of the GELU mount, when the plan mounts
    step_cache: Any = None  # the batch's model.execution.FirstBlockCache (its computed / skipped step counts)


# The feature-table techniques switched at module sites (kernels/sites.py groups carry their names).
SITE_GROUPS: tuple[str, ...] = tuple(f.name for f in FEATURES if f.site)


def _restore_lossless(transformer: torch.nn.Module) -> None:
    sites.switch(transformer, {group: False for group in SITE_GROUPS})  # one walk (most of a batch's host setup)


@contextmanager
def applied_tier(transformer: torch.nn.Module, plan: TierPlan, *,
                 block_runners: tuple[Any, Any] | None = None, step_graphs: StepGraphs | None = None,
                 agree: Callable[[bool], bool] | None = None, adapters: Hashable = None) -> Iterator[TierReport]:
    """Switch `transformer` to `plan` for the block; back to lossless after it (also on errors and cancellation).
    adapters: what the batch's adapters make the forward run, for the graph key: PEFT's active set with its scales
    (a captured step replays only that set), or whether adapter side paths are on (model/adapter_slots.py).

    agree: called with this process's verdict and returns all ranks' (TP: a collective): once for "every GELU site
    mounts", so that a refusal anywhere unmounts everywhere, and at each step-cache decision, so that every rank
    skips the same steps.
    """
    report = TierReport()
    runners = graphs = None
    try:
        # One walk sets every site to the plan (off where the plan does not switch it: lossless never runs on a site
        # a previous batch left on); the GELU sites mount all or none, on every rank or on none.
        on = plan.techniques()
        switched = sites.switch(transformer, {group: group in on for group in SITE_GROUPS},
                                checks={gelu.GROUP: gelu.site_check}, agree=agree)
        if plan.mount_gelu:
            report.mount_report = gelu.MountReport(mounted=switched.on.get(gelu.GROUP, []),
                                                   refused=switched.refused.get(gelu.GROUP, {}))
        report.mounted_sites = switched.count(gelu.GROUP)
        report.fast_norm_sites = switched.count(modulate.GROUP)
        report.attention8_sites = switched.count(attention.GROUP)
        if plan.compiled:
            if block_runners is None:
                raise ValueError("a compiled plan needs the compiled block runners")
            runners = block_runners
        if plan.cuda_graphs:
            if step_graphs is None:
                raise ValueError("a CUDA-graph plan needs the step-graph cache")
            # Mounted / switched sites run other kernels than lossless: a separate graph per (tier, mounted GELU
            # sites, fast norm sites, 8-bit attention sites, adapter side paths on). (A transformer's fp8 / fused form is set before any
            # capture: converting drops the graphs.)
            step_graphs.mode = (plan.quality, report.mounted_sites, report.fast_norm_sites, report.attention8_sites,
                                adapters)
            step_graphs.adapters_keyed = adapters is not None
            graphs = step_graphs
        if plan.step_cache is not None:
            report.step_cache = FirstBlockCache(plan.step_cache, agree=agree)
        with running(transformer, block_runners=runners, step_graphs=graphs, step_cache=report.step_cache):
            yield report
    finally:
        _restore_lossless(transformer)
