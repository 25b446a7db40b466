"""The FLUX.1 Kontext family (Kontext [dev]): FLUX.1's transformer, architecture and weight layout, driven by diffusers'
`FluxKontextPipeline`, which edits by instruction.

The transformer is FLUX.1's own (model/flux.py): Kontext appends the input image's latent tokens to the noisy ones
(position ids offset by 1 on the first axis) and keeps the prediction for the noisy tokens only, all inside diffusers'
pipeline. So everything FLUX.1 says about the transformer (TP plan, conversions, T5 length, single-file layout) holds
here unchanged; what differs is the pipeline and how an edit reaches it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from model.flux1 import FAMILY as FLUX1


def _pipelines() -> dict[str, type]:
    from diffusers import FluxKontextPipeline

    return {"text": FluxKontextPipeline}


def size_kwargs(height: int, width: int) -> dict[str, Any]:
    """`FluxKontextPipeline` rescales the output to `max_area` pixels (default 1024x1024) at the asked aspect ratio:
    the asked area keeps the asked size."""
    return {"max_area": height * width}


FAMILY = replace(
    FLUX1,
    name="flux1-kontext",
    title="FLUX.1 Kontext",
    pipeline_class_names=("FluxKontextPipeline",),
    pipeline_classes=_pipelines,
    edits="reference",
    size_kwargs=size_kwargs,
)
