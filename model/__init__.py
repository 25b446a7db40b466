"""fluxserve model package: FLUX.1 pipeline, loading, presets.

Import-light on purpose (Ray workers and the ingress import `model` without wanting torch/diffusers at import
time): the public names below are resolved lazily on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FluxServePipeline": "model.pipeline",
    "GenerationRequest": "model.request",
    "GenerationResult": "model.pipeline",
    "GenerationCancelled": "model.pipeline",
    "QUALITIES": "model.request",
    "load_pipeline": "model.loading",
    "ModelLoadError": "model.loading",
    "ensure_preset": "model.presets",
    "PRESETS": "model.presets",
    "FluxTransformer": "model.flux",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
