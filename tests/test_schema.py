"""Request validation without Ray: every limit of `deployments.schema.validate` at its boundary.

Each bound is tried just inside (accepted, with the value carried into the jobs) and just outside (a BadRequest
naming the field). The serve suite checks that a BadRequest becomes a 400 over HTTP; here the limits themselves.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("pydantic")  # the HTTP model; absent on GPU boxes that only run `-m gpu`

from deployments.config import AppArgs, Limits  # noqa: E402
from deployments.schema import SEED_MAX, BadRequest, ImageRequest, validate  # noqa: E402
from tests._inputs import data_url, png_bomb  # noqa: E402

LIMITS = Limits(min_side=64, max_side=1024, max_pixels=512 * 1024, size_multiple=16, min_steps=2, max_steps=50,
                max_n=3, max_prompt_chars=40, max_guidance=12.0)
RAW_ARGS = {"default_size": "256x256", "default_steps": 4, "default_guidance": 3.5, "request_timeout_s": 30,
            "limits": LIMITS.__dict__}
ARGS = AppArgs.parse(RAW_ARGS)
MODEL = "tiny"


def _validate(args: AppArgs = ARGS, **body: Any):
    return validate(ImageRequest(**{"prompt": "a red fox", **body}), args, MODEL)


# (field, value just inside, value just outside, the 400's whole message: a reason a user reads, so pinned whole)
SIZE_FORM = 'size must be "WxH" with integer W and H (e.g. "256x256"), got '
LOSSLESS_CACHE = ("step_cache is for the high pool only: it is not bit-exact, and the lossless pool must stay "
                  "byte-identical to eager diffusers (this request asks for quality 'lossless')")
BOUNDS = [
    ("n", {"n": 1}, {"n": 0}, "n must be between 1 and 3, got 0"),
    ("n", {"n": 3}, {"n": 4}, "n must be between 1 and 3, got 4"),
    ("steps", {"steps": 2}, {"steps": 1}, "steps must be between 2 and 50, got 1"),
    ("steps", {"steps": 50}, {"steps": 51}, "steps must be between 2 and 50, got 51"),
    ("guidance", {"guidance": 0.0}, {"guidance": -1e-9}, "guidance must be between 0 and 12.0, got -1e-09"),
    ("guidance", {"guidance": 12.0}, {"guidance": 12.000001}, "guidance must be between 0 and 12.0, got 12.000001"),
    ("guidance", {"guidance": 12}, {"guidance": 13}, "guidance must be between 0 and 12.0, got 13.0"),
    ("prompt", {"prompt": "x" * 40}, {"prompt": "x" * 41}, "prompt is too long: 41 characters, at most 40"),
    ("prompt", {"prompt": " x "}, {"prompt": " \t\n"}, "prompt must not be empty"),
    ("size", {"size": "64x64"}, {"size": "48x64"}, "size 48x64 is too small: each side must be >= 64"),
    ("size", {"size": "64x64"}, {"size": "64x48"}, "size 64x48 is too small: each side must be >= 64"),
    ("size", {"size": "1024x512"}, {"size": "1040x256"}, "size 1040x256 is too large: each side must be <= 1024"),
    ("size", {"size": "512x1024"}, {"size": "256x1040"}, "size 256x1040 is too large: each side must be <= 1024"),
    ("size", {"size": "1024x512"}, {"size": "1024x528"}, "size 1024x528 is too large: at most 524288 pixels"),
    ("size", {"size": "80x64"}, {"size": "72x64"},
     "size 72x64: width and height must be positive multiples of 16 (72 is not a positive multiple of 16)"),
    ("size", {"size": "64x80"}, {"size": "64x72"},
     "size 64x72: width and height must be positive multiples of 16 (72 is not a positive multiple of 16)"),
    ("size", {"size": "256x256"}, {"size": "256X256"}, SIZE_FORM + "'256X256'"),
    ("size", {"size": "256x256"}, {"size": " 256x256"}, SIZE_FORM + "' 256x256'"),
    ("size", {"size": "256x256"}, {"size": "1234567x16"}, SIZE_FORM + "'1234567x16'"),
    ("seed", {"seed": 0}, {"seed": -1}, f"seed must be between 0 and {SEED_MAX}, got -1"),
    ("seed", {"seed": SEED_MAX}, {"seed": SEED_MAX + 1}, f"seed must be between 0 and {SEED_MAX}, got {SEED_MAX + 1}"),
    # n images take seeds seed .. seed + n - 1: the last one must still be a valid seed
    ("seed", {"seed": SEED_MAX - 2, "n": 3}, {"seed": SEED_MAX - 1, "n": 3},
     f"seed must be between 0 and {SEED_MAX - 2}, got {SEED_MAX - 1}"),
    ("timeout_s", {"timeout_s": 30}, {"timeout_s": 30.001}, "timeout_s must be between 1 and 30, got 30.001"),
    ("timeout_s", {"timeout_s": 1}, {"timeout_s": 0.999}, "timeout_s must be between 1 and 30, got 0.999"),
    ("timeout_s", {"timeout_s": 1.0}, {"timeout_s": 5e-324}, "timeout_s must be between 1 and 30, got 5e-324"),
    ("timeout_s", {"timeout_s": 1}, {"timeout_s": -1}, "timeout_s must be between 1 and 30, got -1"),
    ("quality", {"quality": "high"}, {"quality": "High"},
     "unknown quality 'High'; expected one of ['lossless', 'high', 'auto', 'standard', 'hd']"),
    ("model", {"model": MODEL}, {"model": "dall-e-3"}, "unknown model 'dall-e-3'; this server serves 'tiny'"),
    ("step_cache", {"step_cache": 0.999, "quality": "high"}, {"step_cache": 1, "quality": "high"},
     "step_cache must be a number in [0, 1), got 1"),
    ("step_cache", {"step_cache": 0, "quality": "high"}, {"step_cache": -1e-9, "quality": "high"},
     "step_cache must be a number in [0, 1), got -1e-09"),
    ("step_cache", {"step_cache": 0.1, "quality": "high"}, {"step_cache": 0.1, "quality": "lossless"}, LOSSLESS_CACHE),
    ("step_cache", {"step_cache": 0.1, "quality": "high"}, {"step_cache": 0.1}, LOSSLESS_CACHE),  # the default tier
    ("partial_images", {"stream": True, "partial_images": 3}, {"stream": True, "partial_images": 4},
     "partial_images must be between 0 and 3, got 4"),
    ("partial_images", {"stream": True, "partial_images": 0}, {"stream": True, "partial_images": -1},
     "partial_images must be between 0 and 3, got -1"),
    ("output_compression", {"output_format": "jpeg", "output_compression": 100},
     {"output_format": "jpeg", "output_compression": 101}, "output_compression must be between 0 and 100, got 101"),
    ("output_compression", {"output_format": "webp", "output_compression": 0},
     {"output_format": "webp", "output_compression": -1}, "output_compression must be between 0 and 100, got -1"),
]


@pytest.mark.parametrize("param,inside,outside,message", BOUNDS,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BOUNDS)])
def test_each_bound_accepts_inside_and_names_the_field_outside(param: str, inside: dict, outside: dict,
                                                               message: str) -> None:
    v = _validate(**inside)
    assert len(v.jobs) == inside.get("n", 1)
    with pytest.raises(BadRequest) as exc:
        _validate(**outside)
    assert exc.value.param == param
    assert exc.value.message == message


def test_accepted_values_reach_the_jobs() -> None:
    v = _validate(n=3, seed=SEED_MAX - 2, size="1024x512", steps=50, guidance=12, quality="high", timeout_s=7)
    assert [j.seed for j in v.jobs] == [SEED_MAX - 2, SEED_MAX - 1, SEED_MAX]
    assert {(j.height, j.width, j.steps, j.guidance, j.quality) for j in v.jobs} == {(512, 1024, 50, 12.0, "high")}
    assert isinstance(v.jobs[0].guidance, float)
    assert v.size == "1024x512" and v.timeout_s == 7.0


def test_a_request_step_cache_reaches_its_jobs_and_splits_batches() -> None:
    from model.request import validate_batch

    cached = _validate(n=2, quality="high", step_cache=0.25).jobs
    assert [j.step_cache for j in cached] == [0.25, 0.25] and isinstance(cached[0].step_cache, float)
    plain = _validate(quality="high").jobs[0]
    assert plain.step_cache is None  # the pool's setting
    assert cached[0].batch_key() != plain.batch_key()
    with pytest.raises(ValueError, match="all requests of a batch must share step_cache"):
        validate_batch([cached[0], plain])
    tp2 = AppArgs.parse({"pools": {"high": {"tp": 2}}})  # the ranks agree on each skip (tests/test_tp_high.py)
    assert _validate(tp2, quality="high", step_cache=0.1).jobs[0].step_cache == 0.1
    assert _validate(tp2, quality="high").jobs[0].step_cache is None


def test_defaults_come_from_the_config() -> None:
    v = _validate()
    (job,) = v.jobs
    assert (job.height, job.width, job.steps, job.guidance, job.quality) == (256, 256, 4, 3.5, "lossless")
    assert v.timeout_s == 30.0 and v.size == "256x256"
    assert 0 <= job.seed < 2**31  # a random seed when none is asked for, reported back through the job


def test_random_seeds_are_31_bit_and_spread() -> None:
    """A request without a seed gets one below 2**31 (any client stores it as an int32), drawn over that range."""
    seeds = [_validate().jobs[0].seed for _ in range(64)]
    assert all(0 <= s < 2**31 for s in seeds) and max(seeds) >= 2**30


def test_random_seeds_differ_between_requests() -> None:
    seeds = {_validate().jobs[0].seed for _ in range(8)}
    assert len(seeds) > 1


def test_max_pixels_below_max_side_squared_is_enforced() -> None:
    # max_side allows 1024 per side, but only 300_000 pixels in all: 512x512 (262_144) passes, 576x576 does not.
    args = replace(ARGS, limits=replace(LIMITS, max_pixels=300_000))
    assert _validate(args, size="512x512").jobs[0].height == 512
    assert _validate(args, size="1024x256").jobs[0].width == 1024
    for size in ("576x576", "1024x320"):
        with pytest.raises(BadRequest) as exc:
            _validate(args, size=size)
        assert exc.value.param == "size" and "at most 300000 pixels" in exc.value.message


def test_default_size_outside_the_limits_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="args.default_size: size 2048x2048 is too large"):
        AppArgs.parse({"default_size": "2048x2048", "limits": {"max_side": 1024}})
    with pytest.raises(ValueError, match="at most 100000 pixels"):
        AppArgs.parse({"default_size": "512x512", "limits": {"max_pixels": 100_000}})


@pytest.mark.parametrize("body,field", [
    ({"prompt": 5}, "prompt"), ({"n": "2"}, "n"), ({"steps": 4.5}, "steps"), ({"seed": "1"}, "seed"),
    ({"guidance": "3"}, "guidance"), ({"size": [256, 256]}, "size"), ({"response_format": "link"}, "response_format"),
    ({"colour": "red"}, "colour"), ({"step_cache": "0.1"}, "step_cache"), ({"step_cache": True}, "step_cache"),
])
def test_the_http_model_is_strict_about_types(body: dict, field: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as exc:
        ImageRequest(**{"prompt": "x", **body})
    assert exc.value.errors()[0]["loc"][0] == field


# ------------------------------------------------------------------------------------------- OpenAI field rules


@pytest.mark.parametrize("asked,tier", [(None, "lossless"), ("auto", "lossless"), ("standard", "lossless"),
                                        ("hd", "lossless"), ("lossless", "lossless"), ("high", "high")])
def test_quality_words_map_to_tiers(asked: str | None, tier: str) -> None:
    body = {} if asked is None else {"quality": asked}
    assert _validate(**body).jobs[0].quality == tier


def test_auto_quality_follows_the_configured_default() -> None:
    high_default = replace(ARGS, default_quality="high")
    assert _validate(high_default, quality="auto").jobs[0].quality == "high"
    assert _validate(high_default).jobs[0].quality == "high"
    assert _validate(high_default, quality="hd").jobs[0].quality == "lossless"  # hd asks for the best image
    with pytest.raises(ValueError, match="args.default_quality must be one of"):
        AppArgs.parse({"default_quality": "ultra"})


@pytest.mark.parametrize("word", ["low", "medium", "ultra"])
def test_unknown_quality_words_name_the_accepted_ones(word: str) -> None:
    with pytest.raises(BadRequest) as exc:
        _validate(quality=word)
    assert exc.value.param == "quality"
    assert exc.value.message == (f"unknown quality {word!r}; expected one of "
                                 "['lossless', 'high', 'auto', 'standard', 'hd']")


def test_size_auto_is_the_configured_default() -> None:
    v = _validate(size="auto")
    assert v.size == "256x256" and (v.jobs[0].height, v.jobs[0].width) == (256, 256)


def test_output_format_and_compression_rules() -> None:
    assert (_validate().output_format, _validate().output_compression) == ("png", 100)
    v = _validate(output_format="jpeg", output_compression=0)
    assert (v.output_format, v.output_compression) == ("jpeg", 0)
    assert _validate(output_format="webp").output_compression == 100
    with pytest.raises(BadRequest) as exc:
        _validate(output_format="png", output_compression=50)
    assert exc.value.param == "output_compression"
    assert exc.value.message == "output_compression applies to jpeg and webp only (png is lossless)"


@pytest.mark.parametrize("body,field", [({"background": "transparent"}, "background"),
                                        ({"moderation": "strict"}, "moderation"),
                                        ({"output_format": "gif"}, "output_format")])
def test_refused_openai_values_name_the_field(body: dict, field: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as exc:
        ImageRequest(**{"prompt": "x", **body})
    assert exc.value.errors()[0]["loc"][0] == field
    ImageRequest(prompt="x", background="opaque", moderation="low", user="u-1")  # the accepted values


def test_encode_image_keeps_png_bytes_and_reencodes_lossy_formats() -> None:
    import io

    import numpy as np
    from PIL import Image

    from deployments.schema import encode_image
    from model.png import png_bytes

    rgb = (np.arange(64 * 48 * 3) % 251).astype(np.uint8).reshape(48, 64, 3)
    png = png_bytes(Image.fromarray(rgb))
    assert encode_image(png, "png", 100) is png  # the lossless contract's bytes, untouched
    for fmt, magic in (("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")):
        best, worst = encode_image(png, fmt, 100), encode_image(png, fmt, 5)
        assert best.startswith(magic) and worst.startswith(magic) and len(worst) < len(best)
        im = Image.open(io.BytesIO(best))
        assert im.format == fmt.upper() and im.size == (64, 48)


def test_stream_and_url_delivery_rules() -> None:
    v = _validate(stream=True, partial_images=3)
    assert (v.stream, v.partial_images, v.response_format) == (True, 3, "b64_json")
    assert _validate(stream=True).partial_images == 0
    assert _validate(response_format="url", n=2).response_format == "url"
    refused = [({"partial_images": 1}, "partial_images", "partial_images needs stream: true"),
               ({"stream": True, "n": 2}, "n", "stream: true needs n == 1, got 2"),
               ({"stream": True, "response_format": "url"}, "response_format",
                "streamed images are sent as b64_json; response_format url is not streamed")]
    for body, param, message in refused:
        with pytest.raises(BadRequest) as exc:
            _validate(**body)
        assert (exc.value.param, exc.value.message) == (param, message), body
    # a store that keeps images for any time at all serves URLs; 0 keeps none
    assert _validate(replace(ARGS, image_url_ttl_s=0.5), response_format="url").response_format == "url"
    with pytest.raises(BadRequest) as exc:
        _validate(replace(ARGS, image_url_ttl_s=0), response_format="url")
    assert (exc.value.param, exc.value.message) == (
        "response_format", "this server keeps no images (image_url_ttl_s is 0): use b64_json")
    with pytest.raises(Exception):
        ImageRequest(prompt="x", stream="yes")  # strict bool


def test_edit_form_stream_fields() -> None:
    from deployments.schema import validate_edit
    from tests._inputs import random_png

    files = {"image": random_png(1)}
    v = validate_edit({"prompt": "a", "stream": "true", "partial_images": "2"}, files, ARGS, MODEL)
    assert (v.stream, v.partial_images) == (True, 2)
    assert validate_edit({"prompt": "a", "stream": "false"}, files, ARGS, MODEL).stream is False
    with pytest.raises(BadRequest) as exc:
        validate_edit({"prompt": "a", "stream": "maybe"}, files, ARGS, MODEL)
    assert (exc.value.param, exc.value.message) == ("stream", "stream must be true or false, got 'maybe'")
    # the served model's name reaches the same checks as a generation's
    assert len(validate_edit({"prompt": "a", "model": MODEL}, files, ARGS, MODEL).jobs) == 1
    with pytest.raises(BadRequest) as exc:
        validate_edit({"prompt": "a", "model": "dall-e-2"}, files, ARGS, MODEL)
    assert (exc.value.param, exc.value.message) == ("model", "unknown model 'dall-e-2'; this server serves 'tiny'")


def test_edit_form_step_cache() -> None:
    from deployments.schema import validate_edit
    from tests._inputs import random_png

    files = {"image": random_png(1)}
    (job,) = validate_edit({"prompt": "a", "quality": "high", "step_cache": "0.2"}, files, ARGS, MODEL).jobs
    assert job.step_cache == 0.2 and job.image == files["image"]
    with pytest.raises(BadRequest, match="step_cache must be a number, got 'some'"):
        validate_edit({"prompt": "a", "quality": "high", "step_cache": "some"}, files, ARGS, MODEL)
    with pytest.raises(BadRequest, match="step_cache is for the high pool only"):
        validate_edit({"prompt": "a", "step_cache": "0.2"}, files, ARGS, MODEL)


LORA_ARGS = AppArgs.parse({**RAW_ARGS, "loras": {n: f"/models/{n}.safetensors" for n in "abcde"}})


def test_naming_an_adapter_on_a_server_without_any() -> None:
    with pytest.raises(BadRequest) as exc:
        _validate(lora=[{"name": "ink", "scale": 1.0}])
    assert (exc.value.param, exc.value.message) == ("lora", "unknown LoRA adapter 'ink'; this server serves none")


@pytest.mark.parametrize("inside, outside, message", [
    ([("a", 1.0)] * 1 + [("b", 1.0), ("c", 1.0), ("d", 1.0)], [(n, 1.0) for n in "abcde"],
     "at most 4 LoRA adapters per request, got 5"),
    ([("a", 8.0)], [("a", 8.000001)], "LoRA scale must be finite and within +-8.0, got 8.000001"),
    ([("a", -8.0)], [("a", -8.000001)], "within +-8.0, got -8.000001"),
    ([("a", 0.0)], [("a", float("nan"))], "LoRA scale must be finite"),
    ([("a", 1.0), ("b", 1.0)], [("a", 1.0), ("a", 0.5)], "LoRA adapter 'a' is named twice"),
    ([("e", 1.0)], [("f", 1.0)], "unknown LoRA adapter 'f'; this server serves ['a', 'b', 'c', 'd', 'e']"),
])
def test_lora_bounds_accept_inside_and_refuse_just_outside(inside: list, outside: list, message: str) -> None:
    """`max_loras` and `max_lora_scale` at their edges (a `<` for `<=` or a dropped `abs` fails here)."""
    def body(refs: list) -> dict:
        return {"lora": [{"name": n, "scale": s} for n, s in refs]}

    assert _validate(LORA_ARGS, **body(inside)).jobs[0].loras == tuple(sorted((n, float(s)) for n, s in inside))
    with pytest.raises(BadRequest) as exc:
        _validate(LORA_ARGS, **body(outside))
    assert exc.value.param == "lora" and message in exc.value.message, exc.value.message


def test_edit_strength_and_image_bytes_at_their_bounds() -> None:
    """strength in (0, 1] and the image byte bound (limits.max_image_bytes), each just inside and just outside."""
    from deployments.config import Limits
    from deployments.schema import validate_edit

    MAX_EDIT_IMAGE_BYTES = Limits().max_image_bytes
    from tests._inputs import random_png

    png = random_png(1)
    files = {"image": png}
    for inside in ("1", "1e-9"):
        assert validate_edit({"prompt": "a", "strength": inside}, files, ARGS, MODEL).jobs[0].strength == float(inside)
    for outside in ("1.0000001", "0", "-0.5"):
        with pytest.raises(BadRequest) as exc:
            validate_edit({"prompt": "a", "strength": outside}, files, ARGS, MODEL)
        assert exc.value.param == "strength" and "strength must be in (0, 1]" in exc.value.message
    # PNG readers stop at IEND: trailing bytes make an image of exactly the limit's size
    exact = png + b"\0" * (MAX_EDIT_IMAGE_BYTES - len(png))
    for name in ("image", "mask"):
        ok = {"image": png, name: exact}
        assert len(validate_edit({"prompt": "a"}, ok, ARGS, MODEL).jobs) == 1
        with pytest.raises(BadRequest) as exc:
            validate_edit({"prompt": "a"}, {**ok, name: exact + b"\0"}, ARGS, MODEL)
        assert exc.value.param == name
        assert f"{name} is too large: {MAX_EDIT_IMAGE_BYTES + 1} bytes, at most {MAX_EDIT_IMAGE_BYTES}" in exc.value.message


def _png(w: int, h: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _gif(w: int, h: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="GIF")
    return buf.getvalue()


EDIT_ACCEPTED = ", ".join(repr(f) for f in sorted(set(ImageRequest.model_fields) | {"image", "mask", "strength"}))
# (form fields, files, the 400's param, its whole message)
EDIT_REFUSED = [
    ({"prompt": "a"}, {}, "image", "an edit needs an image file (multipart field `image`)"),
    ({"prompt": "a"}, {"mask": "png"}, "image", "an edit needs an image file (multipart field `image`)"),
    ({"prompt": "a", "colour": "red"}, {"image": "png"}, "colour",
     f"unknown field(s) ['colour']; accepted: [{EDIT_ACCEPTED}]"),
    ({"prompt": "a", "zz": "1", "aa": "2"}, {"image": "png"}, "aa",
     f"unknown field(s) ['aa', 'zz']; accepted: [{EDIT_ACCEPTED}]"),
    ({"prompt": "a"}, {"image": "junk"}, "image", None),  # PIL's reason follows; checked by prefix below
    ({"prompt": "a"}, {"image": "png", "mask": "junk"}, "mask", None),
    ({"prompt": "a"}, {"image": "png", "mask": "png80"}, "mask", "mask must be the size of the image (64x48), got 80x64"),
    ({"prompt": "a", "strength": "lots"}, {"image": "png"}, "strength", "strength must be a number, got 'lots'"),
    ({"prompt": "a", "steps": "many"}, {"image": "png"}, "steps", "steps must be a number, got 'many'"),
    ({"prompt": "a", "lora": "ink"}, {"image": "png"}, "lora",
     'lora must be a JSON list like [{"name": "ink", "scale": 0.8}], got \'ink\''),
    ({"prompt": "a", "quality": "lossless", "seed": "1", "size": "64x64", "output_format": "gif"}, {"image": "png"},
     "output_format", "Input should be 'png', 'jpeg' or 'webp'"),
    ({"prompt": "a", "steps": "1"}, {"image": "png"}, "steps", "steps must be between 2 and 50, got 1"),
    ({"prompt": "a"}, {"image": "png10"}, "image",
     "image is 10x10; an edit without `size` is made at the image's size rounded down to a multiple of 16: "
     "size 0x0: width and height must be positive multiples of 16 (0 is not a positive multiple of 16)"),
    ({"prompt": "a", "strength": "0.5"}, {"image": "png"}, "image",
     "image is 64x48; an edit without `size` is made at the image's size rounded down to a multiple of 16: "
     "size 64x48 is too small: each side must be >= 64"),
    ({"prompt": "a"}, {"image": "gif"}, "image", "image is not a readable image (PNG, JPEG or WebP)"),
    ({"prompt": "a"}, {"image": "png", "mask": "bomb"}, "mask",
     "mask is 12000x12000 (144000000 pixels); at most 16777216 pixels are accepted"),
]


@pytest.mark.parametrize("fields, files, param, message", EDIT_REFUSED,
                         ids=[f"{i}-{r[2]}" for i, r in enumerate(EDIT_REFUSED)])
def test_edit_form_errors_name_the_field_with_the_whole_reason(fields: dict, files: dict, param: str,
                                                               message: str | None) -> None:
    """Each refusal of `validate_edit` (the multipart edit form) at the unit level: the field the 400 names and its
    whole message (the serve suite sees a few of them through HTTP only)."""
    from deployments.schema import validate_edit

    data = {"png": _png(64, 48), "png80": _png(80, 64), "junk": b"not an image at all", "png10": _png(10, 10),
            "gif": _gif(64, 48), "bomb": png_bomb(12000, 12000)}
    with pytest.raises(BadRequest) as exc:
        validate_edit(fields, {k: data[v] for k, v in files.items()}, ARGS, MODEL)
    assert exc.value.param == param, exc.value.message
    if message is None:
        assert exc.value.message.startswith(f"{param} is not a readable image (")
    else:
        assert exc.value.message == message


def test_an_edit_takes_its_size_from_the_image_and_carries_image_mask_and_strength() -> None:
    """Size "auto" (or none): the image's own, each side rounded down to a multiple of 16 (width first); the jobs
    carry the very bytes of the image and the mask, and the strength given."""
    from deployments.schema import validate_edit

    image, mask = _png(100, 70), _png(100, 70)
    for size in ({}, {"size": "auto"}):
        v = validate_edit({"prompt": "a", "n": "2", "strength": "0.25", **size}, {"image": image, "mask": mask},
                          ARGS, MODEL)
        assert v.size == "96x64"
        assert [(j.width, j.height, j.image, j.mask, j.strength) for j in v.jobs] == [(96, 64, image, mask, 0.25)] * 2
    v = validate_edit({"prompt": "a", "size": "64x64"}, {"image": image}, ARGS, MODEL)
    assert (v.size, v.jobs[0].mask, v.jobs[0].strength) == ("64x64", None, 0.6)  # GenerationRequest's default


def test_a_fused_adapter_refuses_named_ones() -> None:
    fused = AppArgs.parse({**RAW_ARGS, "loras": {"ink": "/models/ink.safetensors"}, "fuse_lora": True})
    with pytest.raises(BadRequest) as exc:
        _validate(fused, lora=[{"name": "ink", "scale": 1.0}])
    assert (exc.value.param, exc.value.message) == (
        "lora", "adapter 'ink' is fused into this deployment's weights: every image uses it, and a request names no "
                "adapter")
    assert _validate(fused).jobs[0].loras == ()


@pytest.mark.parametrize("limits, words", [
    ({"max_body_bytes": 0}, "args.limits.max_body_bytes must be a number > 0, got 0"),
    ({"max_form_files": -1}, "args.limits.max_form_files must be a number > 0, got -1"),
    ({"max_image_bytes": "20MB"}, "args.limits.max_image_bytes must be a number > 0, got '20MB'"),
    ({"max_input_pixels": 4096 * 4096 + 1}, "may lower the input-image ceiling, not raise it: at most 16777216"),
])
def test_limits_that_cannot_hold_are_config_errors(limits: dict, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        AppArgs.parse({"limits": limits})
    assert AppArgs.parse({"limits": {"max_input_pixels": 1024 * 1024}}).limits.max_input_pixels == 1024 * 1024


# The body fields of OpenAI's images API reference (generations, and the edit's form): a client written for it may
# send any of them.
OPENAI_GENERATION_FIELDS = {
    "prompt": "a red fox", "background": "auto", "model": MODEL, "moderation": "auto", "n": 1,
    "output_compression": 90, "output_format": "jpeg", "partial_images": 1, "quality": "auto",
    "response_format": "b64_json", "size": "64x64", "stream": True, "style": "natural", "user": "u-1",
    "safety_identifier": "hashed-user-1",
}


def test_every_field_of_openais_reference_is_accepted() -> None:
    """Catches an OpenAI field answered with 400 "unknown field" (a client written for OpenAI would fail on it)."""
    from deployments.schema import validate_edit

    v = validate(ImageRequest(**OPENAI_GENERATION_FIELDS), ARGS, MODEL)
    assert v.jobs[0].prompt == "a red fox" and v.stream
    edit = {k: str(x).lower() if isinstance(x, bool) else str(x) for k, x in OPENAI_GENERATION_FIELDS.items()}
    edit.update(input_fidelity="high", stream="false")
    del edit["partial_images"]
    v = validate_edit(edit, {"image": _png(64, 64), "mask": _png(64, 64)}, ARGS, MODEL)
    assert v.jobs[0].image is not None and v.jobs[0].mask is not None


@pytest.mark.parametrize("field, value", [("style", "photographic"), ("input_fidelity", "max"),
                                          ("safety_identifier", 7)])
def test_the_openai_fields_we_ignore_still_refuse_values_openai_would_refuse(field: str, value: Any) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ImageRequest(prompt="x", **{field: value})


def test_a_json_edit_reads_as_the_same_form_as_multipart() -> None:
    """OpenAI's JSON edit body (images and mask as base64 data: URLs, typed fields) -> the same validated jobs as
    the multipart form with the same values. Catches a dropped mask, a field lost on the way, typed values
    re-parsed as text."""
    from deployments.schema import json_edit, validate_edit

    image, mask = _png(64, 64), _png(64, 64)
    fields, files = json_edit({"prompt": "a fox", "images": [{"image_url": data_url(image)}],
                               "mask": {"image_url": data_url(mask)}, "n": 2, "steps": 3, "strength": 0.5,
                               "seed": 9, "stream": False})
    assert files == {"image": image, "mask": mask}
    from_json = validate_edit(fields, files, ARGS, MODEL, typed=True)
    from_form = validate_edit({"prompt": "a fox", "n": "2", "steps": "3", "strength": "0.5", "seed": "9",
                               "stream": "false"}, {"image": image, "mask": mask}, ARGS, MODEL)
    assert from_json.jobs == from_form.jobs and len(from_json.jobs) == 2 and from_json.jobs[0].strength == 0.5


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x"}, "images", "a list of exactly one"),
    ({"prompt": "x", "images": []}, "images", "a list of exactly one"),
    ({"prompt": "x", "images": [{"image_url": "data:image/png;base64,AA=="}] * 2}, "images", "FLUX edits one image"),
    ({"prompt": "x", "image": "x.png"}, "image", "names its image as `images"),
    ({"prompt": "x", "images": [{"image_url": "https://example.com/a.png"}]}, "images[0]",
     "must be a base64 data: URL (this server downloads nothing)"),
    ({"prompt": "x", "images": [{"file_id": "file-1"}]}, "images[0]", "file_id is not supported"),
    ({"prompt": "x", "images": [{"image_url": "data:image/png;base64,%%%"}]}, "images[0]", "does not decode"),
    ({"prompt": "x", "images": ["data:image/png;base64,AA=="]}, "images[0]", "must be an object"),
    ({"prompt": "x", "images": [{"image_url": "data:image/png;base64,AA=="}], "mask": "m.png"}, "mask",
     "must be an object"),
    (["not", "an", "object"], None, "request body must be a JSON object"),
])
def test_json_edit_refusals_name_the_field(body: Any, param: str | None, words: str) -> None:
    from deployments.schema import json_edit

    with pytest.raises(BadRequest) as exc:
        json_edit(body)
    assert exc.value.param == param and words in exc.value.message, exc.value.message


def test_a_json_edits_typed_values_are_checked_as_they_are() -> None:
    """A JSON `"n": "2"` is a string, not a number: refused as the JSON generations route refuses it."""
    from deployments.schema import json_edit, validate_edit

    fields, files = json_edit({"prompt": "x", "images": [{"image_url": data_url(_png(64, 64))}], "n": "2"})
    with pytest.raises(BadRequest) as exc:
        validate_edit(fields, files, ARGS, MODEL, typed=True)
    assert exc.value.param == "n"
    fields["n"], fields["strength"] = 1, True
    with pytest.raises(BadRequest, match="strength must be a number, got True"):
        validate_edit(fields, files, ARGS, MODEL, typed=True)
