"""Request/response models of the HTTP API and the checks the ingress applies before routing.

The pydantic model checks JSON types (strict: "4" is not an int) and documents the API in OpenAPI;
the limits that depend on the deployment (sizes, steps, n, prompt length) are checked in `validate`
so they can come from serve_config.yaml.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from deployments.config import AppArgs, pool_refusal
from deployments.errors import BadRequest
from model.family import ModelFamily
from model.preview import MAX_PARTIAL_IMAGES
from model.request import (
    QUALITIES,
    SEED_LIMIT,
    GenerationRequest,
    decode_image,
    decode_mask,
    format_size,
    step_cache_error,
)

SEED_MAX = SEED_LIMIT - 1

# OpenAI's quality words -> ours (None: the server's default tier). OpenAI's "high"/"hd" ask for the best image: that
# is our lossless tier; our own "high" keeps its meaning (the faster, approximate tier), so OpenAI's "high" is not
# an alias. gpt-image's "low"/"medium" promise a worse image than we are asked to make: refused with the list.
QUALITY_ALIASES: dict[str, str | None] = {"auto": None, "standard": None, "hd": "lossless"}


class LoraRef(BaseModel):
    """One LoRA adapter of a request: a name the server serves (`args.loras`) and its scale."""

    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    scale: StrictFloat | StrictInt = 1.0


class AdapterRequest(BaseModel):
    """`POST /v1/adapters`: load the adapter file `file` (relative to `args.lora_dir`) as `name`."""

    model_config = ConfigDict(extra="forbid")

    name: StrictStr = Field(description="the name requests use in `lora`: 1-64 of letters, digits, '_', '.', '-'")
    file: StrictStr = Field(description="a .safetensors file in the server's adapter folder (args.lora_dir)")


class ImageRequest(BaseModel):
    """OpenAI-style `POST /v1/images/generations` body plus fluxserve fields."""

    model_config = ConfigDict(extra="forbid")

    # json_schema_extra: the bounds that hold on every server, for the OpenAPI document (the configured ones, e.g.
    # max_n, are checked by `validate` with a reason)
    prompt: StrictStr = Field(description="Text prompt (non-empty).", json_schema_extra={"minLength": 1})
    n: StrictInt = Field(1, description="Number of images; image i uses seed + i.", json_schema_extra={"minimum": 1})
    size: StrictStr | None = Field(None, description='"WxH", both multiples of 16, or "auto"; default from config.',
                                   json_schema_extra={"pattern": "^(auto|[0-9]+x[0-9]+)$"})
    quality: StrictStr = Field(
        "auto",
        description="lossless: byte-identical to diffusers; high: faster, not bit-exact; auto/standard: the server's "
                    "default tier; hd: lossless.",
        json_schema_extra={"enum": [*QUALITIES, *QUALITY_ALIASES]},
    )
    steps: StrictInt | None = Field(None, description="Denoising steps; default from config.",
                                    json_schema_extra={"minimum": 1})
    guidance: StrictFloat | StrictInt | None = Field(None, description="Guidance scale; default from config.",
                                                     json_schema_extra={"minimum": 0})
    seed: StrictInt | None = Field(None, description="Seed of the first image; random (and reported) if absent.",
                                   json_schema_extra={"minimum": 0, "maximum": SEED_LIMIT - 1})
    response_format: Literal["b64_json", "url"] = Field(
        "b64_json", description="b64_json, or url: the image is kept by the server for image_url_ttl_s seconds and "
                                "served at the URL (refused when the server keeps no images)."
    )
    stream: StrictBool = Field(False, description="Server-sent events: partial images while it denoises, then the "
                                                 "completed image (n must be 1).")
    partial_images: StrictInt | None = Field(
        None, description=f"Previews streamed before the final image, 0-{MAX_PARTIAL_IMAGES} (stream only; default 0).",
        json_schema_extra={"minimum": 0, "maximum": MAX_PARTIAL_IMAGES},
    )
    model: StrictStr | None = Field(None, description="Accepted for OpenAI clients; must match /v1/models if set.")
    timeout_s: StrictFloat | StrictInt | None = Field(
        None, description="Per-request deadline (seconds), at most the server's request_timeout_s.",
        json_schema_extra={"exclusiveMinimum": 0},
    )
    user: StrictStr | None = Field(None, description="Ignored; accepted for OpenAI clients.")
    safety_identifier: StrictStr | None = Field(None, description="Ignored; accepted for OpenAI clients.")
    style: Literal["vivid", "natural"] | None = Field(
        None, description="Accepted for OpenAI clients (dall-e-3's); FLUX has no style presets, so it is ignored.")
    input_fidelity: Literal["high", "low"] | None = Field(
        None, description="Accepted for OpenAI clients (edits); ignored: how closely an edit follows its image is "
                          "`strength`.")
    output_format: Literal["png", "jpeg", "webp"] = Field(
        "png", description="png (the lossless contract holds for its bytes), or lossy jpeg / webp."
    )
    output_compression: StrictInt | None = Field(
        None, description="jpeg / webp quality 0-100 (default 100); not for png.",
        json_schema_extra={"minimum": 0, "maximum": 100},
    )
    background: Literal["auto", "opaque"] = Field("auto", description="Images are opaque; transparent is refused.")
    moderation: Literal["auto", "low"] = Field("auto", description="Accepted for OpenAI clients; no moderation runs.")
    lora: list[LoraRef] | None = Field(
        None, description='LoRA adapters the server serves, by name, with scales: [{"name": "ink", "scale": 0.8}].'
    )
    step_cache: StrictFloat | StrictInt | None = Field(
        None, description="quality high only: First-Block step cache threshold in [0, 1) for this request (a step "
                          "whose first block's output changed by less than this fraction reuses the last computed "
                          "step's other blocks; not bit-exact); 0 computes every step; default: the pool's setting.",
        json_schema_extra={"minimum": 0, "exclusiveMaximum": 1},
    )


class ImageDatum(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    seed: int


def encode_image(png: bytes, output_format: str, compression: int) -> bytes:
    """The replica's PNG as asked: unchanged for png (its bytes are the lossless contract), else re-encoded."""
    if output_format == "png":
        return png
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").save(buf, format=output_format.upper(), quality=compression)
    return buf.getvalue()


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None


class ErrorResponse(BaseModel):
    """Every error the API answers, in OpenAI's shape."""

    error: ErrorDetail


class ImageResponse(BaseModel):
    created: int
    data: list[ImageDatum]
    model: str
    quality: str
    output_format: str
    pool: str
    seeds: list[int]
    ran: dict[str, Any]  # what the images ran with: model.tiers.Ran
    size: str
    steps: int
    guidance: float
    timings: dict[str, float]
    batch_sizes: list[int]  # per image: requests in the pipeline call that generated it
    queued_together: list[int]  # per image: compatible requests collected in its @serve.batch call


@dataclass(frozen=True)
class Validated:
    """An accepted request: one GenerationRequest per image (seeds seed .. seed + n - 1), its deadline and size."""

    jobs: list[GenerationRequest]
    timeout_s: float
    size: str
    output_format: str = "png"
    output_compression: int = 100
    response_format: str = "b64_json"
    stream: bool = False
    partial_images: int = 0
    # The adapters loaded through the API (name -> file) when a job names one of them: the replica loads this set
    # before running it. None: the jobs name none.
    adapters: dict[str, str] | None = None


def validate(req: ImageRequest, args: AppArgs, model_name: str, runtime: Mapping[str, str] | None = None
             ) -> Validated:
    """Apply the deployment's limits and defaults; raise BadRequest with the first problem found. `runtime`: the
    adapters loaded through the API (name -> file), which requests may name besides `args.loras`."""
    lim = args.limits
    quality = QUALITY_ALIASES.get(req.quality, req.quality) or args.default_quality
    if quality not in QUALITIES:
        raise BadRequest("quality", f"unknown quality {req.quality!r}; expected one of "
                                    f"{[*QUALITIES, *QUALITY_ALIASES]}")
    if not req.prompt.strip():
        raise BadRequest("prompt", "prompt must not be empty")
    if len(req.prompt) > lim.max_prompt_chars:
        raise BadRequest(
            "prompt", f"prompt is too long: {len(req.prompt)} characters, at most {lim.max_prompt_chars}"
        )
    if not 1 <= req.n <= lim.max_n:
        raise BadRequest("n", f"n must be between 1 and {lim.max_n}, got {req.n}")
    steps = args.default_steps if req.steps is None else req.steps
    if not lim.min_steps <= steps <= lim.max_steps:
        raise BadRequest("steps", f"steps must be between {lim.min_steps} and {lim.max_steps}, got {steps}")
    guidance = float(args.default_guidance if req.guidance is None else req.guidance)
    if not 0.0 <= guidance <= lim.max_guidance:
        raise BadRequest("guidance", f"guidance must be between 0 and {lim.max_guidance}, got {guidance}")
    size = args.default_size if req.size in (None, "auto") else req.size
    height, width = lim.check_size(size)
    if req.seed is not None and not 0 <= req.seed <= SEED_MAX - (req.n - 1):
        raise BadRequest("seed", f"seed must be between 0 and {SEED_MAX - (req.n - 1)}, got {req.seed}")
    seed = secrets.randbelow(2**31) if req.seed is None else req.seed
    if req.model is not None and req.model != model_name:
        raise BadRequest("model", f"unknown model {req.model!r}; this server serves {model_name!r}")
    timeout_s = args.request_timeout_s
    if req.timeout_s is not None:
        if not lim.min_timeout_s <= req.timeout_s <= args.request_timeout_s:
            raise BadRequest(
                "timeout_s", f"timeout_s must be between {lim.min_timeout_s:g} and {args.request_timeout_s:g}, got "
                             f"{req.timeout_s}"
            )
        timeout_s = float(req.timeout_s)
    compression = 100 if req.output_compression is None else req.output_compression
    if req.output_compression is not None and req.output_format == "png":
        raise BadRequest("output_compression", "output_compression applies to jpeg and webp only (png is lossless)")
    if not 0 <= compression <= 100:
        raise BadRequest("output_compression", f"output_compression must be between 0 and 100, got {compression}")
    _check_delivery(req, args)
    loras = _loras(req.lora or [], args, runtime or {})
    _check_step_cache(req.step_cache, quality, args)
    jobs = [GenerationRequest(req.prompt, height, width, steps, guidance, seed + i, quality, loras,
                              step_cache=None if req.step_cache is None else float(req.step_cache))
            for i in range(req.n)]
    return Validated(jobs=jobs, timeout_s=timeout_s, size=format_size(height, width),
                     output_format=req.output_format, output_compression=compression,
                     response_format=req.response_format, stream=req.stream, partial_images=req.partial_images or 0,
                     adapters=dict(runtime) if runtime and any(n in runtime for n, _ in loras) else None)


def _check_delivery(req: ImageRequest, args: AppArgs) -> None:
    """How the image is sent back: streamed or not, b64_json or a URL."""
    if req.partial_images is not None:
        if not req.stream:
            raise BadRequest("partial_images", "partial_images needs stream: true")
        if not 0 <= req.partial_images <= MAX_PARTIAL_IMAGES:
            raise BadRequest("partial_images", f"partial_images must be between 0 and {MAX_PARTIAL_IMAGES}, got "
                                               f"{req.partial_images}")
    if req.stream and req.n != 1:
        raise BadRequest("n", f"stream: true needs n == 1, got {req.n}")
    if req.response_format == "url":
        if req.stream:
            raise BadRequest("response_format", "streamed images are sent as b64_json; response_format url is not "
                                                "streamed")
        if args.image_url_ttl_s <= 0:
            raise BadRequest("response_format", "this server keeps no images (image_url_ttl_s is 0): use b64_json")


def _check_step_cache(threshold: float | None, quality: str, args: AppArgs) -> None:
    """A request's own step cache threshold: valid, and for a pool that can run the cache."""
    if threshold is None:
        return
    error = step_cache_error(threshold)
    if error is not None:
        raise BadRequest("step_cache", f"step_cache {error}")
    refusal = pool_refusal(args, quality, "step_cache", subject="step_cache")
    if refusal is not None:
        raise BadRequest("step_cache", f"{refusal} (this request asks for quality {quality!r})")


def _loras(refs: list[LoraRef], args: AppArgs, runtime: Mapping[str, str]) -> tuple[tuple[str, float], ...]:
    """The request's adapters as (name, scale) pairs sorted by name (one batch key per set, whatever the order)."""
    lim = args.limits
    if refs and args.fuse_lora:
        raise BadRequest("lora", f"adapter {next(iter(args.loras))!r} is fused into this deployment's weights: every "
                                 "image uses it, and a request names no adapter")
    if len(refs) > lim.max_loras:
        raise BadRequest("lora", f"at most {lim.max_loras} LoRA adapters per request, got {len(refs)}")
    seen: set[str] = set()
    for ref in refs:
        if ref.name not in args.loras and ref.name not in runtime:
            served = sorted({*args.loras, *runtime}) or "none"
            raise BadRequest("lora", f"unknown LoRA adapter {ref.name!r}; this server serves {served}")
        if ref.name in seen:
            raise BadRequest("lora", f"LoRA adapter {ref.name!r} is named twice")
        seen.add(ref.name)
        if not math.isfinite(ref.scale) or abs(ref.scale) > lim.max_lora_scale:
            raise BadRequest("lora", f"LoRA scale must be finite and within +-{lim.max_lora_scale}, got {ref.scale}")
    return tuple(sorted((ref.name, float(ref.scale)) for ref in refs))


# -- POST /v1/images/edits ---------------------------------------------------------------------------------------

_FORM_INTS = ("n", "steps", "seed", "output_compression", "partial_images")
_FORM_FLOATS = ("guidance", "timeout_s", "step_cache")
_FORM_BOOLS = {"true": True, "false": False, "1": True, "0": False}


def _form_value(name: str, value: str) -> Any:
    if name == "lora":  # a JSON list in a form field: [{"name": "ink", "scale": 0.8}]
        try:
            return json.loads(value)
        except ValueError:
            raise BadRequest(name, f'lora must be a JSON list like [{{"name": "ink", "scale": 0.8}}], got {value!r}') from None
    if name == "stream":
        if value.strip().lower() not in _FORM_BOOLS:
            raise BadRequest(name, f"{name} must be true or false, got {value!r}")
        return _FORM_BOOLS[value.strip().lower()]
    try:
        if name in _FORM_INTS:
            return int(value)
        if name in _FORM_FLOATS:
            return float(value)
    except ValueError:
        raise BadRequest(name, f"{name} must be a number, got {value!r}") from None
    return value


def json_edit(body: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    """OpenAI's JSON edit (`images: [{"image_url": ...}]`, optional `mask: {"image_url": ...}`, the generation
    fields) -> the (fields, files) of the multipart form `validate_edit` takes. Images come as base64 `data:` URLs:
    nothing is downloaded; a `file_id` names OpenAI's file store, which this server does not have."""
    if not isinstance(body, dict):
        raise BadRequest(None, "request body must be a JSON object")
    fields = dict(body)
    images = fields.pop("images", None)
    if images is None and "image" in fields:
        raise BadRequest("image", 'a JSON edit names its image as `images: [{"image_url": '
                                  '"data:image/png;base64,..."}]`')
    if not isinstance(images, list) or len(images) != 1:
        raise BadRequest("images", 'a JSON edit needs `images`: a list of exactly one {"image_url": ...} (FLUX edits '
                                   'one image)')
    files = {"image": _data_url(images[0], "images[0]")}
    mask = fields.pop("mask", None)
    if mask is not None:
        files["mask"] = _data_url(mask, "mask")
    return fields, files


def _data_url(ref: Any, where: str) -> bytes:
    import base64
    import binascii

    if not isinstance(ref, dict) or set(ref) - {"image_url", "file_id"}:
        raise BadRequest(where, f"{where} must be an object {{\"image_url\": \"data:...;base64,...\"}}")
    if "file_id" in ref:
        raise BadRequest(where, f"{where}: file_id is not supported (no file store here); send image_url as a base64 "
                                "data: URL")
    url = ref.get("image_url")
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url[:100]:
        raise BadRequest(where, f"{where}.image_url must be a base64 data: URL (this server downloads nothing)")
    try:
        return base64.b64decode(url.split(",", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(where, f"{where}.image_url: the base64 data does not decode") from None


def validate_edit(fields: dict[str, Any], files: dict[str, bytes], args: AppArgs, model_name: str,
                  typed: bool = False, family: ModelFamily | None = None,
                  runtime: Mapping[str, str] | None = None) -> Validated:
    """An OpenAI-style multipart edit: `image` (+ optional `mask`, white = repaint) and the generation fields as form
    values (plus `strength`). The size defaults to the image's own, rounded down to a multiple of 16. `family`: the
    served model's (its edit rules and default strength; None: FLUX.1's image-to-image and inpainting)."""
    from dataclasses import replace

    from pydantic import ValidationError

    fields = dict(fields)
    strength_text = fields.pop("strength", None)
    known = set(ImageRequest.model_fields)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise BadRequest(unknown[0], f"unknown field(s) {unknown}; accepted: {sorted(known | {'image', 'mask', 'strength'})}")
    image = files.get("image")
    if image is None:
        raise BadRequest("image", "an edit needs an image file (multipart field `image`)")
    limits = args.limits
    for name, data in (("image", image), ("mask", files.get("mask"))):
        if data is not None and len(data) > limits.max_image_bytes:
            raise BadRequest(name, f"{name} is too large: {len(data)} bytes, at most {limits.max_image_bytes}")
    try:
        source = decode_image(image, "image", limits.max_input_pixels)
        mask_image = None if files.get("mask") is None else decode_mask(files["mask"], limits.max_input_pixels)
    except ValueError as exc:
        raise BadRequest("mask" if str(exc).startswith("mask") else "image", str(exc)) from None
    if mask_image is not None and mask_image.size != source.size:
        raise BadRequest("mask", f"mask must be the size of the image ({source.size[0]}x{source.size[1]}), got "
                                 f"{mask_image.size[0]}x{mask_image.size[1]}")
    sized_by_image = fields.get("size") in (None, "auto")
    if sized_by_image:
        multiple = limits.size_multiple
        fields["size"] = f"{source.size[0] // multiple * multiple}x{source.size[1] // multiple * multiple}"
    try:
        # form values are text to convert; a JSON edit's (typed) are checked as they are, as on generations
        req = ImageRequest(**{k: v if typed else _form_value(k, v) for k, v in fields.items()})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise BadRequest(str(err["loc"][0]) if err.get("loc") else None, f"{err.get('msg')}") from None
    edit: dict[str, Any] = {"image": image, "mask": files.get("mask")}
    strength = None
    if strength_text is not None:  # else the family's default
        try:
            if isinstance(strength_text, bool) or not isinstance(strength_text, (str, int, float)):
                raise ValueError
            strength = float(strength_text)
        except ValueError:
            raise BadRequest("strength", f"strength must be a number, got {strength_text!r}") from None
        if not 0 < strength <= 1:
            raise BadRequest("strength", f"strength must be in (0, 1], got {strength}")
    if family is not None:
        strength = family.strength(strength)
        error = family.edit_error(edit["mask"] is not None, strength)
        if error is not None:
            raise BadRequest("mask" if edit["mask"] is not None else "strength", error)
    if strength is not None:
        edit["strength"] = strength
    try:
        v = validate(req, args, model_name, runtime)
    except BadRequest as exc:
        if sized_by_image and exc.param == "size":  # say where the size came from, not only what is wrong with it
            raise BadRequest("image", f"image is {source.size[0]}x{source.size[1]}; an edit without `size` is made at "
                                      f"the image's size rounded down to a multiple of {limits.size_multiple}: "
                                      f"{exc.message}") from None
        raise
    jobs = [replace(j, **edit) for j in v.jobs]
    return replace(v, jobs=jobs)
