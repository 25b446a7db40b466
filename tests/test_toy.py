"""The toy world (model/toy): the scene checker agrees with the scene generator, notices each kind of mistake, and
captions round trip; held-out prompts are never training captions. (The trained preset itself is not shipped yet:
bench/results/toy-train-h200.md.)"""

from __future__ import annotations

import random

import pytest

from model.toy.checker import score
from model.toy.scenes import BACKGROUNDS, Scene, Shape, caption, parse_caption, render, sample_scene

def test_checker_agrees_with_the_generator() -> None:
    rng = random.Random(7)
    held = stated = 0
    for _ in range(200):
        scene = sample_scene(rng)
        s = score(render(scene).numpy(), caption(scene))
        held, stated = held + s.held, stated + s.stated
    assert held / stated >= 0.99


def test_checker_notices_each_kind_of_mistake() -> None:
    truth = Scene("black", (Shape("circle", "red", "large", "left"), Shape("square", "yellow", "small", "top right")))
    img = render(truth).numpy()
    assert score(img, truth).fraction == 1.0
    for wrong, key in [
        (Scene("white", truth.shapes), "background"),
        (Scene("black", (Shape("circle", "blue", "large", "left"), truth.shapes[1])), "0.colour"),
        (Scene("black", (Shape("triangle", "red", "large", "left"), truth.shapes[1])), "0.kind"),
        (Scene("black", (Shape("circle", "red", "small", "left"), truth.shapes[1])), "0.size"),
        (Scene("black", (truth.shapes[0], Shape("square", "yellow", "small", "bottom"))), "1.place"),
        (Scene("black", (truth.shapes[0], Shape("circle", "yellow", "small", "top right"))), "1.kind"),
    ]:
        s = score(img, wrong)
        assert not s.details[key] and s.held == s.stated - (4 if key == "1.place" else 1), (key, s.details)


def test_captions_round_trip_and_bad_ones_are_named() -> None:
    rng = random.Random(3)
    for _ in range(100):
        scene = sample_scene(rng)
        assert parse_caption(caption(scene)) == scene
    assert caption(Scene("gray", (Shape("triangle", "green", "small", "center"),))) == \
        "a small green triangle in the center, on a gray background"
    with pytest.raises(ValueError, match="background"):
        parse_caption("a small green triangle in the center, on a pink background")
    with pytest.raises(ValueError, match="shape"):
        parse_caption("a small green hexagon in the center, on a gray background")
    assert set(BACKGROUNDS) == {"white", "black", "gray"}


def test_held_out_prompts_are_not_training_captions() -> None:
    from model.toy.adherence import held_out_prompts, training_captions

    train = training_captions(2000)
    prompts = held_out_prompts(20, exclude=train)
    assert len(set(prompts)) == 20 and not set(prompts) & train
    assert all(parse_caption(p) for p in prompts)
