"""The playground page the ingress serves at `/`: `playground.html` (plain HTML and JS, no build step, nothing from
elsewhere) with what it needs to know about this server filled in."""

from __future__ import annotations

import functools
import html
import json
from pathlib import Path

from deployments import auth
from deployments.config import AppArgs
from deployments.errors import BadRequest
from model.request import DEFAULT_PROMPT

_PLAYGROUND = Path(__file__).with_name("playground.html")
# Sizes the page offers (those within the server's limits); any "WxH" may be typed.
_PLAYGROUND_SIZES = ("256x256", "512x512", "768x768", "1024x1024", "1360x768", "768x1360", "1024x768", "768x1024")


def playground_page(args: AppArgs, model_name: str, root_path: str = "", edits: str = "strength") -> str:
    """The page with what it needs to know about this server filled in: the model, how it edits (`edits`, the model
    family's: "strength" offers a mask and strength, "reference" neither), the defaults, the sizes within the limits,
    and whether it must ask for an API key. URLs in it are relative to `root_path` (the route prefix)."""
    sizes = {args.default_size, *(s for s in _PLAYGROUND_SIZES if _within(args, s))}
    config = {"model": model_name, "default_size": args.default_size, "default_steps": args.default_steps,
              "max_steps": args.limits.max_steps, "sizes": sorted(sizes, key=lambda s: (_pixels(s), s)),
              "api_keys": auth.required(), "prompt": DEFAULT_PROMPT, "edits": edits}
    script_safe = json.dumps(config).replace("<", "\\u003c")  # no "</script>" can close the page's script
    return (_template().replace("__BASE__", html.escape(root_path.rstrip("/") + "/"))
            .replace("__CONFIG__", script_safe))


@functools.cache
def _template() -> str:
    return _PLAYGROUND.read_text()  # once per process, not per page view


def _pixels(size: str) -> int:
    w, h = size.split("x")
    return int(w) * int(h)


def _within(args: AppArgs, size: str) -> bool:
    try:
        args.limits.check_size(size)
    except BadRequest:
        return False
    return True
