"""The toy preset's world: procedural scenes of 1-3 flat shapes on a plain background, and their captions.

A scene is a background colour plus shapes, each with a kind (circle, square, triangle), a colour, a size (small,
large) and a place on a 3x3 grid (top left ... bottom right). Colours within a scene are distinct (a shape is
named by its colour), places are distinct, and no shape takes the background's colour. `caption` writes the scene
in one fixed grammar, and `parse_caption` reads it back, so the checker can score an image against any caption
of the grammar. Drawing is deterministic and vectorised in torch (a batch at a time, on any device).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

KINDS = ("circle", "square", "triangle")
SIZES = ("small", "large")
# RGB of each named colour (also what the checker matches pixels against)
SHAPE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40),
    "purple": (140, 60, 180), "orange": (245, 140, 30),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"white": (245, 245, 245), "black": (20, 20, 20),
                                                "gray": (128, 128, 128)}
COLOURS = {**SHAPE_COLOURS, **BACKGROUNDS}
# place -> (row, column) on the 3x3 grid, and its words in a caption
PLACES: dict[str, tuple[int, int]] = {
    "top left": (0, 0), "top": (0, 1), "top right": (0, 2), "left": (1, 0), "center": (1, 1), "right": (1, 2),
    "bottom left": (2, 0), "bottom": (2, 1), "bottom right": (2, 2),
}
_PLACE_WORDS = {"left": "on the left", "right": "on the right", "center": "in the center"}
GRID = (0.2, 0.5, 0.8)  # cell centres as a fraction of the side
RADIUS = {"small": 0.075, "large": 0.13}  # half extent as a fraction of the side (large shapes never touch)


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    size: str
    place: str


@dataclass(frozen=True)
class Scene:
    background: str
    shapes: tuple[Shape, ...]


def sample_scene(rng: random.Random, max_shapes: int = 3) -> Scene:
    background = rng.choice(sorted(BACKGROUNDS))
    n = rng.randint(1, max_shapes)
    colours = rng.sample(sorted(SHAPE_COLOURS), n)
    places = rng.sample(sorted(PLACES), n)
    return Scene(background, tuple(Shape(rng.choice(KINDS), c, rng.choice(SIZES), p) for c, p in zip(colours, places)))


def place_words(place: str) -> str:
    return _PLACE_WORDS.get(place, f"at the {place}")


def caption(scene: Scene) -> str:
    """'a large red circle on the left, a small yellow square at the top, on a black background'."""
    parts = [f"a {s.size} {s.colour} {s.kind} {place_words(s.place)}" for s in scene.shapes]
    return ", ".join(parts) + f", on a {scene.background} background"


_SHAPE_RE = re.compile(r"^an? (small|large) (\w+) (circle|square|triangle) (?:on the|at the|in the) ([a-z ]+)$")


def parse_caption(text: str) -> Scene:
    """The scene a caption of this grammar states; ValueError naming the part it cannot read."""
    *shape_parts, tail = [p.strip() for p in text.strip().split(",")]
    m = re.match(r"^on an? (\w+) background$", tail)
    if not m or m.group(1) not in BACKGROUNDS:
        raise ValueError(f"cannot read the background in {tail!r}")
    shapes = []
    for part in shape_parts:
        s = _SHAPE_RE.match(part)
        if not s or s.group(2) not in SHAPE_COLOURS or s.group(4) not in PLACES:
            raise ValueError(f"cannot read the shape in {part!r}")
        shapes.append(Shape(s.group(3), s.group(2), s.group(1), s.group(4)))
    return Scene(m.group(1), tuple(shapes))


def _hw(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def render_batch(scenes: list[Scene], size: int | tuple[int, int] = 256,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """Scenes drawn as float RGB in [-1, 1], [B, 3, H, W] (what the VAE and the training see); `size` is a side or
    (height, width).

    Cell centres sit at the GRID fractions of each side; a shape's extent is a fraction of the shorter side, so
    shapes keep their form in a wide image. Vectorised over the batch: shape slot k of every scene is drawn at once
    (scenes with fewer shapes leave the slot's mask empty). Each scalar is rounded to float32 once, as a Python
    number is in a tensor op, so a scene draws the same pixels whatever batch it is in."""
    height, width = _hw(size)
    short = min(height, width)
    b, slots = len(scenes), max((len(s.shapes) for s in scenes), default=0)
    ys = (torch.arange(height, device=device, dtype=torch.float32) + 0.5) / height
    xs = (torch.arange(width, device=device, dtype=torch.float32) + 0.5) / width
    yy, xx = (c[None] for c in torch.meshgrid(ys, xs, indexing="ij"))
    img = torch.tensor([BACKGROUNDS[s.background] for s in scenes], device=device, dtype=torch.float32)
    img = img[:, :, None, None].expand(b, 3, height, width).clone()
    kinds = {k: i for i, k in enumerate(KINDS)}
    for k in range(slots):
        rows = [(s.shapes[k] if k < len(s.shapes) else None) for s in scenes]
        # per scene: cy, cx, r, r*r, r*0.886, 2r, kind index, present
        p = [(GRID[PLACES[t.place][0]], GRID[PLACES[t.place][1]], RADIUS[t.size], RADIUS[t.size] ** 2,
              RADIUS[t.size] * 0.886, 2 * RADIUS[t.size], kinds[t.kind], 1) if t else (0, 0, 1, 1, 1, 2, 0, 0)
             for t in rows]
        cy, cx, r, r2, half, r2x, kind, present = (
            torch.tensor(col, device=device, dtype=torch.float32)[:, None, None] for col in zip(*p))
        # offsets in units of the shorter side (a square image scales by exactly 1)
        dy, dx = (yy - cy) * (height / short), (xx - cx) * (width / short)
        mask = torch.zeros(b, height, width, dtype=torch.bool, device=device)
        for i in {kinds[t.kind] for t in rows if t}:  # only the kinds this slot draws
            if i == 0:
                m = dy * dy + dx * dx <= r2
            elif i == 1:
                m = (dy.abs() <= half) & (dx.abs() <= half)  # the circle's area
            else:
                h = (dy + r) / r2x  # upward triangle in the box [-r, r]^2: 0 at the apex, 1 at the base
                m = (h >= 0) & (h <= 1) & (dx.abs() <= r * h)
            mask |= m & (kind == i) & (present > 0)
        colour = torch.tensor([SHAPE_COLOURS[t.colour] if t else (0, 0, 0) for t in rows], device=device,
                              dtype=torch.float32)[:, :, None, None]
        img = torch.where(mask[:, None], colour, img)
    return img / 127.5 - 1.0


def render(scene: Scene, size: int | tuple[int, int] = 256) -> "torch.Tensor":
    """One scene as uint8 RGB [H, W, 3] on the CPU."""
    x = render_batch([scene], size)[0]
    return ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0)
