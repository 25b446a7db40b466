"""The model-family seam: what fluxserve asks of a family of diffusion models, and which family a model belongs to.

A family module (`model/flux1.py` for FLUX.1 dev and schnell) fills one `ModelFamily`: its transformer class and
diffusers' reference class, the diffusers pipeline classes for text, image-to-image and inpainting, how many text
tokens a prompt gets, the declarative tensor-parallel plan, the high tier's conversions and how to read an original
single-file checkpoint. Loading, the pipeline, the TP sharding and the conversions ask the family; none of them
names FLUX.1. A new family is a new module registered in `_MODULES` (FLUX.1 Kontext: `model/flux1_kontext.py`,
FLUX.1's transformer with another pipeline).
"""

from __future__ import annotations

import fnmatch
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

from model.request import DEFAULT_STRENGTH

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class TPRule:
    """Linear layers whose module path matches `path` (fnmatch) are `style`-parallel. `blocks(parent, layer)` gives
    the dimension's blocks each rank takes its share of (a fused q/k/v: the three; a row layer fed by several
    column-sharded blocks: theirs); None: one block."""

    path: str
    style: Literal["column", "row"]
    blocks: Callable[[Any, Any], tuple[int, ...]] | None = None


@dataclass(frozen=True)
class ModelFamily:
    name: str
    title: str  # for messages ("FLUX.1")
    pipeline_class_names: tuple[str, ...]  # model_index.json `_class_name`s this family loads
    transformer_class: Callable[[], type]  # ours (lazy: importing a family module loads no torch)
    reference_transformer_class: Callable[[], type]  # diffusers' own (the eager reference of the tests)
    # "text" (and for `edits="strength"`: "img2img", "inpaint") -> diffusers pipeline class
    pipeline_classes: Callable[[], dict[str, type]]
    # The components its text pipeline needs, and the files each must have (any one name of a group suffices).
    components: dict[str, list[tuple[str, ...]]]
    text_tokens: Callable[[Any], int]  # text-encoder tokens per prompt for a loaded diffusers pipeline
    tp_plan: tuple[TPRule, ...]  # sharded linears; everything else stays replicated
    attention_path: str  # modules whose `heads` (and `inner_dim`) divide by the TP size
    fuse_projections: Callable[[nn.Module], None]  # the high tier's fused q/k/v (not bit-exact)
    quantize_fp8: Callable[[nn.Module, bool], dict[str, str]]  # the high tier's fp8 layers: {kept layer: why}
    single_file: Any  # the original single-file layout: its key, prefix, config reader and converter
    # How an edit request (an input image) runs: "strength", the image-to-image / inpainting pipelines start part-way
    # down the schedule from the noised image (a mask restricts where); "reference", the text pipeline takes the
    # image as a condition of every step from pure noise (strength 1, no mask).
    edits: Literal["strength", "reference"] = "strength"
    # Call arguments the family's pipelines need for an output of (height, width), beyond diffusers' common ones.
    size_kwargs: Callable[[int, int], dict[str, Any]] = lambda height, width: {}

    def strength(self, given: float | None) -> float:
        """An edit's strength: the one given, else this family's default (a reference edit runs from pure noise)."""
        if given is not None:
            return given
        return 1.0 if self.edits == "reference" else DEFAULT_STRENGTH

    def edit_error(self, mask: bool, strength: float) -> str | None:
        """Why an edit with (or without) a mask and this strength cannot run on this family, or None."""
        if self.edits == "reference":
            if mask:
                return f"{self.title} edits by instruction from the whole image: it takes no mask"
            if strength != 1:
                return (f"strength does not apply to {self.title} (every step is conditioned on the image, from pure "
                        f"noise): leave it out, got {strength}")
        return None

    def tp_rule(self, module_path: str) -> TPRule | None:
        """The TP rule of the layer at `module_path` (first match), or None: replicated."""
        return next((r for r in self.tp_plan if fnmatch.fnmatchcase(module_path, r.path)), None)


# family name -> the module that defines it (as FAMILY)
_MODULES = {"flux1": "model.flux1", "flux1-kontext": "model.flux1_kontext"}


def families() -> list[ModelFamily]:
    return [importlib.import_module(m).FAMILY for m in _MODULES.values()]


def family_of(model: Any) -> ModelFamily:
    """The family of a model_index.json class name, a diffusers pipeline (by its class, subclasses too: families
    may share a transformer), or a transformer, ours or diffusers' (the first family with that class: what a
    transformer alone decides, its TP plan and conversions, is then the same for every family sharing it)."""
    if isinstance(model, str):
        name = model
    else:
        for family in families():
            if isinstance(model, tuple(family.pipeline_classes().values())):
                return family
        name = type(model).__name__
    for family in families():
        if name in family.pipeline_class_names or name in (family.transformer_class().__name__,
                                                            family.reference_transformer_class().__name__):
            return family
    known = sorted(n for f in families() for n in f.pipeline_class_names)
    raise ValueError(f"no model family for {name!r}; fluxserve serves {known}")
