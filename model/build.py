"""The one builder of a serving pipeline: `build_pipeline(form)` (model/form.py says what a form is).

The in-process engine and every TP rank call it, so a TP rank is a local pipeline plus a process group.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable

import torch

from kernels import cache as kernel_cache
from model import loading
from model.form import BATCH_DEFAULTS, ServingForm
from model.pipeline import FluxServePipeline
from model.request import torch_dtype

logger = logging.getLogger(__name__)

# Warm-up batches' steps (compiled or not): shapes do not depend on the step count; 2 steps also exercise the
# second call of each compiled or captured graph.
WARMUP_STEPS = 2


def build_pipeline(form: ServingForm, shard: Callable[[torch.nn.Module], None] | None = None,
                   agree: Callable[[bool], bool] | None = None) -> FluxServePipeline:
    """Load -> adapters -> shard -> convert -> warm (adapter slots: after converting): a pipeline serving `form` (its `form` records what was built:
    fp8 where it cannot run is refused with a warning and bf16 kept). `shard(transformer)`: a TP rank's in-place
    sharding of the loaded transformer (after a fused adapter is merged into its weights, before conversion).
    `agree`: a TP rank's agreement hook for the warm-up batches (see `FluxServePipeline.generate`)."""
    t0 = time.perf_counter()
    kernel_cache.use(form.kernel_cache_dir)  # before anything compiles
    pipe = loading.load_pipeline(form.model, device=form.device, dtype=torch_dtype(form.dtype))
    if form.loras and form.adapter_slots is None:
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
    if form.adapter_slots is not None:  # beside the converted, sharded layers: loaded after both
        pipe.enable_adapter_slots(form.adapter_slots, rows=max(form.warm_batch_sizes, default=1))
        pipe.load_loras(dict(form.loras))
    if form.compile:
        pipe.enable_compile(list(form.warm_sizes), steps=WARMUP_STEPS, batch_sizes=list(form.warm_batch_sizes))
        logger.info("compiled for sizes %s, batch sizes %s in %.1f s", form.warm_sizes, form.warm_batch_sizes,
                    pipe.compile_warmup_s)
    if form.cuda_graphs:
        # Captured on a shape's first batch: the warm-up's, for the warm set; other shapes' first request.
        pipe.enable_cuda_graphs()
    if form.warm_quality is not None and not form.compile:  # (a compiled form warmed up while compiling)
        pipe.warm_up(list(form.warm_sizes), list(form.warm_batch_sizes), form.warm_quality, WARMUP_STEPS,
                     agree=agree)
    logger.info("built %s in %.1f s", pipe.form, time.perf_counter() - t0)
    return pipe


def form_report(form: ServingForm) -> dict[str, Any]:
    """The built form as plain values (engine stats)."""
    return {"techniques": sorted(form.techniques()), "refused": dict(form.refused)}


def warmup_report(pipe: FluxServePipeline) -> dict[str, Any]:
    """What the warm-up ran before the replica took traffic (engine stats)."""
    return {"warmup": [dict(item) for item in pipe.warmup]}
