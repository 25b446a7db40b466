"""Score an image against a scene caption from its pixels alone: the fraction of stated attributes that hold.

Each shape states four attributes (colour, kind, size, place), and the background states one. The background is
read from the image's border. For each stated shape, the checker looks at the grid cell its place names. There,
the pixels that differ from the background form the blob. Its median colour gives the nearest named colour. Its
area gives the size (the threshold is halfway, in log scale, between a small and a large shape's area). Its fill
of the bounding box gives the kind (triangle 1/2, circle pi/4, square 1). Its centroid near the cell's centre
gives the place. A cell with no blob fails all four attributes of its shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from model.toy.scenes import BACKGROUNDS, GRID, PLACES, RADIUS, SHAPE_COLOURS, Scene, parse_caption

_FILL = {"triangle": 0.5, "circle": math.pi / 4, "square": 1.0}
_WINDOW = 0.15  # half side of the cell window, as a fraction of the image side
_PLACE_TOLERANCE = 0.08  # how far the blob's centroid may sit from the cell's centre (fraction of the side)
_FOREGROUND_DISTANCE = 60.0  # RGB distance from the background that makes a pixel part of a blob


def _nearest(rgb: np.ndarray, palette: dict[str, tuple[int, int, int]]) -> str:
    names = list(palette)
    d = [float(np.linalg.norm(rgb - np.array(palette[n], dtype=np.float64))) for n in names]
    return names[int(np.argmin(d))]


@dataclass(frozen=True)
class ShapeReading:
    found: bool
    colour: str | None = None
    kind: str | None = None
    size: str | None = None
    centred: bool = False


def read_cell(img: np.ndarray, place: str, background_rgb: np.ndarray) -> ShapeReading:
    # cell centres at the grid's fractions of each side, extents in fractions of the shorter side (as drawn)
    side = min(img.shape[0], img.shape[1])
    row, col = PLACES[place]
    cy, cx = GRID[row] * img.shape[0], GRID[col] * img.shape[1]
    h = _WINDOW * side
    y0, y1, x0, x1 = (int(round(v)) for v in (cy - h, cy + h, cx - h, cx + h))
    window = img[max(y0, 0):y1, max(x0, 0):x1].astype(np.float64)
    mask = np.linalg.norm(window - background_rgb, axis=-1) > _FOREGROUND_DISTANCE
    small_area = math.pi * (RADIUS["small"] * side) ** 2
    area = float(mask.sum())
    if area < 0.3 * small_area:
        return ShapeReading(False)
    ys, xs = np.nonzero(mask)
    colour = _nearest(np.median(window[mask], axis=0), SHAPE_COLOURS)
    large_area = math.pi * (RADIUS["large"] * side) ** 2
    size = "large" if area > math.sqrt(small_area * large_area) else "small"
    fill = area / float((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    kind = min(_FILL, key=lambda k: abs(_FILL[k] - fill))
    # the centroid of the blob's bounding box (a triangle's area centroid is not its box's centre)
    by, bx = (ys.min() + ys.max()) / 2 + max(y0, 0), (xs.min() + xs.max()) / 2 + max(x0, 0)
    centred = math.hypot(by - cy, bx - cx) <= _PLACE_TOLERANCE * side
    return ShapeReading(True, colour, kind, size, centred)


def background_of(img: np.ndarray) -> tuple[str, np.ndarray]:
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]]).astype(np.float64)
    rgb = np.median(border, axis=0)
    return _nearest(rgb, BACKGROUNDS), rgb


@dataclass(frozen=True)
class Score:
    held: int
    stated: int
    details: dict[str, bool]
    # (stated colour, colour read) of each shape found whose colour is wrong: which colours the model mixes up
    confusions: tuple[tuple[str, str], ...] = ()

    @property
    def fraction(self) -> float:
        return self.held / self.stated


def score(img: np.ndarray, scene: Scene | str) -> Score:
    """How much of `scene` (or a caption of the grammar) the image [H, W, 3] uint8 shows."""
    if isinstance(scene, str):
        scene = parse_caption(scene)
    img = np.asarray(img)[..., :3]
    background, rgb = background_of(img)
    details = {"background": background == scene.background}
    confusions = []
    for i, s in enumerate(scene.shapes):
        r = read_cell(img, s.place, rgb)
        details.update({f"{i}.colour": r.found and r.colour == s.colour, f"{i}.kind": r.found and r.kind == s.kind,
                        f"{i}.size": r.found and r.size == s.size, f"{i}.place": r.found and r.centred})
        if r.found and r.colour != s.colour:
            confusions.append((s.colour, r.colour))
    return Score(sum(details.values()), len(details), details, tuple(confusions))


@dataclass(frozen=True)
class Adherence:
    fraction: float  # stated attributes that hold, over all images
    per_prompt: list[float]
    failed: dict[str, int]  # attribute kind -> how often it failed
    # "stated->read" -> how often a shape of the stated colour was drawn in the other (e.g. "orange->yellow")
    confusions: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"adherence": self.fraction, "per_prompt": self.per_prompt, "failed": self.failed,
                "colour_confusions": self.confusions}


def score_all(images: Iterable[np.ndarray], scenes: Iterable[Scene | str]) -> Adherence:
    """Many images, each against its scene or caption: the fraction of all stated attributes that hold, each
    image's own fraction, and which kinds of attribute failed how often."""
    held = stated = 0
    per_prompt, failed, confusions = [], {}, {}
    for img, scene in zip(images, scenes):
        s = score(img, scene)
        held, stated = held + s.held, stated + s.stated
        per_prompt.append(s.fraction)
        for key, ok in s.details.items():
            if not ok:
                kind = key.split(".")[-1]
                failed[kind] = failed.get(kind, 0) + 1
        for stated_colour, read in s.confusions:
            key = f"{stated_colour}->{read}"
            confusions[key] = confusions.get(key, 0) + 1
    return Adherence(held / stated, per_prompt, failed, dict(sorted(confusions.items(), key=lambda kv: -kv[1])))
