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


def render_batch(scenes: list[Scene], size: int = 256, device: str | torch.device = "cpu") -> torch.Tensor:
    """Scenes drawn as float RGB in [-1, 1], [B, 3, size, size] (what the VAE and the training see)."""
    coords = (torch.arange(size, device=device, dtype=torch.float32) + 0.5) / size
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    out = torch.empty(len(scenes), 3, size, size, device=device)
    for b, scene in enumerate(scenes):
        img = torch.tensor(BACKGROUNDS[scene.background], device=device, dtype=torch.float32)[:, None, None]
        img = img.expand(3, size, size).clone()
        for s in scene.shapes:
            row, col = PLACES[s.place]
            cy, cx, r = GRID[row], GRID[col], RADIUS[s.size]
            dy, dx = yy - cy, xx - cx
            if s.kind == "circle":
                mask = dy * dy + dx * dx <= r * r
            elif s.kind == "square":
                mask = (dy.abs() <= r * 0.886) & (dx.abs() <= r * 0.886)  # the circle's area
            else:  # upward triangle in the box [-r, r]^2: apex at the top
                h = (dy + r) / (2 * r)  # 0 at the apex, 1 at the base
                mask = (h >= 0) & (h <= 1) & (dx.abs() <= r * h)
            colour = torch.tensor(SHAPE_COLOURS[s.colour], device=device, dtype=torch.float32)[:, None, None]
            img = torch.where(mask, colour, img)
        out[b] = img
    return out / 127.5 - 1.0


def render(scene: Scene, size: int = 256) -> "torch.Tensor":
    """One scene as uint8 RGB [size, size, 3] on the CPU."""
    x = render_batch([scene], size)[0]
    return ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0)
