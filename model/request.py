"""The request vocabulary shared by every layer: quality tiers, sizes, dtypes, one image request, its batch rules.

Torch-free on purpose: the ingress and the config parser import it without loading torch. The HTTP schema
(`deployments/schema.py`) is a pydantic model that converts to `GenerationRequest`; the CLI, the pipeline, the
replica and the TP ranks all speak `GenerationRequest` directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Literal

if TYPE_CHECKING:
    import PIL.Image
    import torch

Quality = Literal["lossless", "high"]
QUALITIES: tuple[Quality, ...] = ("lossless", "high")

# Canonical dtype names (what configs and results say) and the short forms the CLI also accepts.
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# What runs when nothing is named (the CLI, the server's args, the demo): the shipped `toy` preset
# (model/presets.py), which draws captions of its scene world at 256x256 in this many steps.
DEFAULT_MODEL = "toy"
DEFAULT_STEPS = 16
DEFAULT_PROMPT = "a large blue triangle in the center, a small yellow circle at the top left, on a black background"
# How far an image-to-image edit may go from its input when a request does not say (diffusers' `strength`).
DEFAULT_STRENGTH = 0.6
SIZE_MULTIPLE = 16  # FLUX packs 2x2 latent patches of the 8x VAE: pixel sides are multiples of 16
SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes 64-bit seeds; we keep them signed for JSON clients
_SIZE_RE = re.compile(r"^([0-9]{1,6})x([0-9]{1,6})$")


class SizeError(ValueError):
    """A size that is not "WxH" with positive multiples of SIZE_MULTIPLE."""


def parse_size(size: str, where: str = "size") -> tuple[int, int]:
    """ "WxH" (lower-case x, digits only) -> (height, width); SizeError naming `where` otherwise."""
    m = _SIZE_RE.match(str(size))
    if not m:
        raise SizeError(f'{where} must be "WxH" with integer W and H (e.g. "256x256"), got {size!r}')
    width, height = int(m.group(1)), int(m.group(2))
    for side in (width, height):
        if side < SIZE_MULTIPLE or side % SIZE_MULTIPLE:
            raise SizeError(f"{where} {size}: width and height must be positive multiples of {SIZE_MULTIPLE} "
                            f"({side} is not a positive multiple of {SIZE_MULTIPLE})")
    return height, width


def format_size(height: int, width: int) -> str:
    return f"{width}x{height}"


def dtype_name(name: str) -> str:
    """A canonical dtype name from a name, an alias or a torch dtype's str ("torch.bfloat16")."""
    key = str(name).removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (or {sorted(_DTYPE_ALIASES)}), got {name!r}")
    return key


def torch_dtype(name: "str | torch.dtype") -> "torch.dtype":
    import torch

    return name if isinstance(name, torch.dtype) else getattr(torch, dtype_name(name))


@dataclass(frozen=True)
class GenerationRequest:
    """One image: the prompt, the knobs a batch must share, its own seed, and the tier it is asked in."""

    prompt: str
    height: int = 256
    width: int = 256
    steps: int = 4
    guidance: float = 3.5
    seed: int = 0
    quality: Quality = "lossless"
    # LoRA adapters served by the deployment, by name, with their scales ((name, scale), ...); () for none.
    loras: tuple[tuple[str, float], ...] = ()
    # An edit: the input image (encoded bytes, e.g. PNG) for image-to-image, plus a mask (white = repaint) for
    # inpainting, and how far from the input the result may go (diffusers' `strength`). None: text-to-image.
    image: bytes | None = field(default=None, repr=False)
    mask: bytes | None = field(default=None, repr=False)
    strength: float = DEFAULT_STRENGTH
    # First-Block step cache threshold for this image (quality "high" only; `step_cache_error` says what is valid):
    # None takes the pool's setting, 0 computes every step.
    step_cache: float | None = None

    @property
    def denoising_steps(self) -> int:
        """Steps the pipeline runs: all of them for text-to-image; for an edit, the last `strength` of them (as
        diffusers' image-to-image pipelines start part-way down the schedule)."""
        if self.image is None:
            return self.steps
        return self.steps - int(max(self.steps - min(self.steps * self.strength, self.steps), 0))

    def edit_key(self) -> tuple | None:
        if self.image is None:
            return None
        digest = hashlib.sha256(self.image).hexdigest()
        mask = None if self.mask is None else hashlib.sha256(self.mask).hexdigest()
        return (digest, mask, self.strength)

    def batch_key(self, mixed_adapters: bool = False) -> tuple:
        """Only requests with equal keys may share one pipeline call (the adapter set and the edit included;
        `mixed_adapters`: a pipeline that composes each image's adapters, model/adapter_slots.py, mixes them)."""
        return (self.height, self.width, self.steps, self.guidance, self.quality,
                None if mixed_adapters else self.loras, self.edit_key(), self.step_cache)


def step_cache_error(threshold: object) -> str | None:
    """What is wrong with a First-Block step cache threshold (a pool's or a request's), or None: it must be a number
    in [0, 1), the fraction by which the first block's residual may change before a step is computed again."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        return f"must be a number in [0, 1), got {threshold!r}"
    return None


def adapter_rank_error(rank: object) -> str | None:
    """What is wrong with a pool's adapter rank budget (`adapter_rank`: the rank one image's adapters may use per
    projection), or None: a multiple of 16, as the fp8 GEMMs of the adapter side path need."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 16 or rank % 16:
        return f"must be a multiple of 16, got {rank!r}"
    return None


def validate_batch(requests: list[GenerationRequest], mixed_adapters: bool = False) -> None:
    """Raise ValueError unless `requests` is a non-empty, valid batch whose requests share every batch-level knob
    (the adapters too, unless `mixed_adapters`)."""
    if not requests:
        raise ValueError("empty batch")
    for r in requests:
        if not isinstance(r.prompt, str):
            raise ValueError("prompt must be a string")
        if r.quality not in QUALITIES:
            raise ValueError(f"quality must be one of {QUALITIES}, got {r.quality!r}")
        for name in ("height", "width"):
            v = getattr(r, name)
            if not isinstance(v, int) or v < SIZE_MULTIPLE or v % SIZE_MULTIPLE:
                raise ValueError(f"{name} must be a positive multiple of {SIZE_MULTIPLE}, got {v!r}")
        if not isinstance(r.steps, int) or r.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {r.steps!r}")
        if not isinstance(r.seed, int) or not 0 <= r.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {r.seed!r}")
        if not isinstance(r.loras, tuple) or not all(
                isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], (int, float))
                for x in r.loras):
            raise ValueError(f"loras must be a tuple of (name, scale) pairs, got {r.loras!r}")
        if len({name for name, _ in r.loras}) != len(r.loras):
            raise ValueError(f"an adapter may appear once per request, got {r.loras!r}")
        if r.mask is not None and r.image is None:
            raise ValueError("a mask needs an image")
        if r.image is not None and not (isinstance(r.strength, (int, float)) and 0 < r.strength <= 1):
            raise ValueError(f"strength must be in (0, 1], got {r.strength!r}")
        if r.step_cache is not None:
            error = step_cache_error(r.step_cache)
            if error is not None:
                raise ValueError(f"step_cache {error}")
            if r.quality != "high":
                raise ValueError(f"step_cache is for quality 'high' only (skipped steps are not bit-exact), got "
                                 f"quality {r.quality!r}")
    first = requests[0].batch_key(mixed_adapters)
    names = ("height", "width", "steps", "guidance", "quality", "loras", "image / mask / strength", "step_cache")
    for r in requests[1:]:
        for name, a, b in zip(names, first, r.batch_key(mixed_adapters)):
            if a != b:
                raise ValueError(f"all requests of a batch must share {name}: {a!r} vs {b!r}")


# Request images: the formats decoded, and the most pixels one may have (edit inputs are resized to the output size,
# at most 2048 a side): checked from the header, before any pixel is decoded, since a few KB of PNG can inflate to
# gigabytes.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
MAX_INPUT_PIXELS = 4096 * 4096


@contextlib.contextmanager
def _opened(data: bytes, what: str, max_pixels: int) -> Iterator["PIL.Image.Image"]:
    """The image in `data`, opened from its header only once its format and pixel count pass; every failure, there
    or while the caller decodes it, a ValueError naming `what`."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # PIL's own bomb warning: the size is checked here, with a lower bound
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
        with im:
            width, height = im.size
            if width * height > max_pixels:
                raise _TooManyPixels(f"{what} is {width}x{height} ({width * height} pixels); at most {max_pixels} "
                                     "pixels are accepted")
            yield im
    except _TooManyPixels as exc:
        raise ValueError(str(exc)) from None
    except UnidentifiedImageError:
        raise ValueError(f"{what} is not a readable image (PNG, JPEG or WebP)") from None
    except (Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        raise ValueError(f"{what} is not a readable image ({type(exc).__name__}: {exc})") from None


class _TooManyPixels(Exception):
    pass


def decode_image(data: bytes, what: str = "image", max_pixels: int = MAX_INPUT_PIXELS) -> "PIL.Image.Image":
    """Encoded image bytes -> an RGB PIL image. ValueError naming `what` if they are not a PNG, JPEG or WebP image,
    or if its header states more than `max_pixels` pixels (then nothing is decoded)."""
    with _opened(data, what, max_pixels) as im:
        im.load()
        return im.convert("RGB")


def decode_mask(data: bytes, max_pixels: int = MAX_INPUT_PIXELS) -> "PIL.Image.Image":
    """An edit's mask -> an RGB image, white where the image is repainted. A mask with transparency follows
    OpenAI's rule (repaint where it is fully transparent); one without keeps the inpainting rule (repaint where it
    is white), so a mask made for either API does what its author meant. Checked and decoded as `decode_image`."""
    with _opened(data, "mask", max_pixels) as im:
        im.load()
        if im.mode not in ("RGBA", "LA", "PA") and "transparency" not in im.info:
            return im.convert("RGB")
        alpha = im.convert("RGBA").getchannel("A")
    return alpha.point(lambda a: 255 if a == 0 else 0).convert("RGB")
