"""What a replica serves with for its lifetime (`ServingForm`), and the one builder that makes it (`build_pipeline`).

A form is a frozen value: the model, where it runs, its techniques (the feature table's names, model/features.py) and
the defaults of its high batches. `deployments.config.AppArgs.form(pool)` makes one from a pool's settings;
`build_pipeline(form)` loads, shards (a TP rank passes its sharding), converts and warms a pipeline into it. The
in-process engine and every TP rank call the same builder, so a TP rank is a local pipeline plus a process group.

What a request may choose per batch (quality, its own step cache, adapters) is not here: it is the request's
(`model.request.GenerationRequest`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable

from model.features import BY_NAME, FEATURES, is_on

if TYPE_CHECKING:
    import torch

    from model.pipeline import FluxServePipeline

logger = logging.getLogger(__name__)

# Shapes do not depend on the step count; 2 steps also exercise the second call of each graph.
COMPILE_WARMUP_STEPS = 2


@dataclass(frozen=True)
class ServingForm:
    """A replica's (or TP rank's) lifetime form. Technique fields carry the feature table's names."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    # Replica lifetime: the transformer's converted form, adapters, compiled blocks and captured graphs.
    fused_projections: bool = False
    fp8: bool = False
    loras: tuple[tuple[str, str], ...] = ()  # (name, .safetensors file), loaded once, switched per batch
    fused_lora: tuple[str, float] | None = None  # (name, scale): an adapter merged into the weights at start
    cuda_graphs: bool = False
    compile: bool = False
    # The (height, width) sizes and batch sizes warmed up at start (a compiled form compiles for each).
    warm_sizes: tuple[tuple[int, int], ...] = ()
    warm_batch_sizes: tuple[int, ...] = ()
    # High batches' defaults: switched on around each high batch (a request may set its own step cache).
    fast_norm: bool = False
    attention8: bool = False
    step_cache: float | None = None
    # Where fp8 was asked for but cannot run (the builder keeps bf16): why.
    refused: tuple[tuple[str, str], ...] = field(default=())

    def techniques(self) -> frozenset[str]:
        """The feature-table techniques this form turns on."""
        on = {f.name for f in fields(self) if f.name in BY_NAME and is_on(getattr(self, f.name))}
        if self.loras and self.fused_lora is None:
            on.add("lora")
        return frozenset(on)


# The pool options a form carries under their feature names.
FORM_TECHNIQUES: tuple[str, ...] = tuple(f.name for f in FEATURES if f.where == "pool")
# The high-batch defaults a form carries: the table's per-batch pool techniques.
BATCH_DEFAULTS: frozenset[str] = frozenset(f.name for f in FEATURES if f.scope == "batch" and f.where == "pool")


def build_pipeline(form: ServingForm, shard: Callable[[torch.nn.Module], None] | None = None) -> FluxServePipeline:
    """Load -> adapters -> shard -> convert -> warm: a pipeline serving `form` (its `form` records what was built:
    fp8 where it cannot run is refused with a warning and bf16 kept). `shard(transformer)`: a TP rank's in-place
    sharding of the loaded transformer (after a fused adapter is merged into its weights, before conversion)."""
    from model.loading import load_pipeline
    from model.request import torch_dtype

    t0 = time.perf_counter()
    pipe = load_pipeline(form.model, device=form.device, dtype=torch_dtype(form.dtype))
    if form.loras:
        pipe.load_loras(dict(form.loras))
        if form.fused_lora is not None:
            pipe.fuse_lora(*form.fused_lora)
    if shard is not None:
        shard(pipe.transformer)
    pipe.use(**{name: getattr(form, name) for name in BATCH_DEFAULTS})
    fp8 = form.fp8
    if fp8:
        reason = pipe.fp8_refusal()
        if reason is not None:
            logger.warning("fp8 refused (%s); serving without fp8", reason)
            pipe.form = replace(pipe.form, refused=(("fp8", reason),))
            fp8 = False
    if fp8 or form.fused_projections:
        pipe.convert_for_high(fp8=fp8, fused_projections=form.fused_projections)
    if form.compile:
        pipe.enable_compile(list(form.warm_sizes), steps=COMPILE_WARMUP_STEPS, batch_sizes=list(form.warm_batch_sizes))
        logger.info("compiled for sizes %s, batch sizes %s in %.1f s", form.warm_sizes, form.warm_batch_sizes,
                    pipe.compile_warmup_s)
    if form.cuda_graphs:
        # Captured lazily: the first request of each batch size / resolution pays two eager steps and the capture.
        pipe.enable_cuda_graphs()
    logger.info("built %s in %.1f s", pipe.form, time.perf_counter() - t0)
    return pipe


def form_report(form: ServingForm) -> dict[str, Any]:
    """The built form as plain values (engine stats)."""
    return {"techniques": sorted(form.techniques()), "refused": dict(form.refused)}
