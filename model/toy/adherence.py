"""Prompt adherence of a pipeline on the toy world: generated images scored by the scene checker.

The held-out prompts are captions of the grammar drawn with their own seed and never among the training captions
(`model.toy.train.training_scenes` with its default run seed); each prompt has a fixed image seed.
"""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np

from model.toy.checker import Adherence, score, score_all
from model.toy.scenes import caption, sample_scene
from model.toy.train import TRAIN_SCENES, training_scenes

HELD_OUT_SEED = 12345


def training_captions(n: int = TRAIN_SCENES, seed: int = 0) -> set[str]:
    return {caption(s) for s in training_scenes(n, seed)}


def held_out_prompts(n: int, exclude: set[str] | None = None, seed: int = HELD_OUT_SEED) -> list[str]:
    """`n` captions of the grammar that are not training captions (all distinct)."""
    exclude = training_captions() if exclude is None else exclude
    rng, out = random.Random(seed), []
    while len(out) < n:
        c = caption(sample_scene(rng))
        if c not in exclude and c not in out:
            out.append(c)
    return out


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def caption_score(png: bytes, text: str) -> float | None:
    """The checker's score of one PNG against `text`; None when `text` is not a caption of the toy world."""
    from model.toy.scenes import parse_caption

    try:
        parse_caption(text)
    except ValueError:
        return None
    return score(_pixels(png), text).fraction


def adherence_of_pngs(prompts: list[str], pngs: list[bytes]) -> Adherence:
    return score_all((_pixels(png) for png in pngs), prompts)


def measure(pipe: Any, prompts: list[str], quality: str = "lossless", steps: int = 16, batch: int = 8,
            first_seed: int = 0, size: tuple[int, int] = (256, 256)) -> tuple[Adherence, list[Any]]:
    """Generate one image per prompt (seed first_seed + i) at size (height, width) through `pipe` (a
    FluxServePipeline) and score them; returns the score and the GenerationResults."""
    from model.request import GenerationRequest

    height, width = size
    results: list[Any] = []
    for i in range(0, len(prompts), batch):
        reqs = [GenerationRequest(p, height=height, width=width, steps=steps, seed=first_seed + i + k,
                                  quality=quality)
                for k, p in enumerate(prompts[i:i + batch])]
        results += pipe.generate(reqs)
    return adherence_of_pngs(prompts, [r.png for r in results]), results
