"""Fault injection for tests and drills: make chosen requests slow (or fail) at a denoising step, on purpose.

Off unless FLUXSERVE_FAULTS is set (to a JSON object), so production never pays more than one dict lookup per step.
Faults are keyed by the exact prompt, so a test can slow down its own request without touching any other one:

    FLUXSERVE_FAULTS='{"<prompt>": {"step_delay_s": 0.5}}'     each step of that prompt's batch sleeps 0.5 s
    FLUXSERVE_FAULTS='{"<prompt>": {"raise_at_step": 1, "error": "..."}}'   raise RuntimeError(error) after step 1
    FLUXSERVE_FAULTS='{"<prompt>": {"oom_at_step": 0}}'        raise torch.OutOfMemoryError after step 0
    FLUXSERVE_FAULTS='{"start:<pool>": {"error": "..."}}'      every replica of that pool fails as it starts

The variable is read by every process that runs a pipeline (Serve replicas and TP ranks inherit the environment of
the Ray cluster that started them), so tests set it before they start Ray.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

ENV = "FLUXSERVE_FAULTS"
_cache: tuple[str | None, dict[str, dict[str, Any]]] = (None, {})


def _faults() -> dict[str, dict[str, Any]]:
    global _cache
    raw = os.environ.get(ENV)
    if raw != _cache[0]:
        table = json.loads(raw) if raw else {}
        if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
            raise ValueError(f"{ENV} must be a JSON object of prompt -> fault object, got {raw!r}")
        _cache = (raw, table)
    return _cache[1]


def after_step(prompts: list[str], step: int) -> None:
    """Called after denoising step `step` (0-based) of a batch with these prompts."""
    table = _faults()
    if not table:
        return
    for prompt in prompts:
        fault = table.get(prompt)
        if fault is None:
            continue
        if fault.get("step_delay_s"):
            time.sleep(float(fault["step_delay_s"]))
        if fault.get("raise_at_step") == step:
            raise RuntimeError(str(fault.get("error", "injected fault")))
        if fault.get("oom_at_step") == step:
            import torch

            raise torch.OutOfMemoryError("injected fault: CUDA out of memory (model.faults)")


def at_start(pool: str) -> None:
    """Called as a replica of `pool` starts, before it builds anything: a `start:<pool>` fault raises there, as a
    model that cannot load (or a device out of memory) would."""
    fault = _faults().get(f"start:{pool}")
    if fault is not None:
        raise RuntimeError(str(fault.get("error", "injected fault")))
