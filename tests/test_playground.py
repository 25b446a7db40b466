"""The playground page as the ingress fills it in, without a browser (the page in Chromium: tests/test_serve.py,
`-k playground`): what the page is told about the server, and that nothing from the server can break out of its
script or its base URL."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")

from deployments import auth  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from deployments.playground import playground_page  # noqa: E402
from model.request import DEFAULT_PROMPT  # noqa: E402


def _config(page: str) -> dict:
    return json.loads(re.search(r"const CONFIG = (.*);\n", page).group(1))


def test_the_playground_is_told_the_servers_defaults_limits_and_key_rule() -> None:
    args = AppArgs.parse({"model": "toy", "default_size": "512x256", "default_steps": 9,
                          "limits": {"max_side": 1024, "max_pixels": 512 * 512, "max_steps": 40}})
    page = playground_page(args, "toy", "/api")
    cfg = _config(page)
    assert cfg["model"] == "toy" and cfg["default_size"] == "512x256" and cfg["default_steps"] == 9
    assert cfg["max_steps"] == 40 and cfg["api_keys"] is False and cfg["prompt"] == DEFAULT_PROMPT
    assert cfg["sizes"] == ["256x256", "512x256", "512x512"]  # the offered sizes the limits admit, by pixel count
    assert '<base href="/api/">' in page and "__BASE__" not in page and "__CONFIG__" not in page
    wide = AppArgs.parse({"model": "toy", "limits": {"max_side": 1360, "max_pixels": 1360 * 768}})
    assert _config(playground_page(wide, "toy"))["sizes"] == [  # by pixels, then by name: the same on every start
        "256x256", "512x512", "768x768", "1024x768", "768x1024", "1360x768", "768x1360"]  # 1024x1024: too many pixels
    for prefix in ("/api/", "/prefiX"):  # one slash after the prefix, whether it ends in one or not
        assert f'<base href="{prefix.rstrip("/")}/">' in playground_page(args, "toy", prefix)
    auth.set_keys(frozenset({"sk-a"}))
    try:
        assert _config(playground_page(args, "toy"))["api_keys"] is True
        assert '<base href="/">' in playground_page(args, "toy")
    finally:
        auth.set_keys(frozenset())


def test_nothing_the_server_names_can_close_the_pages_script_or_base() -> None:
    """A model folder's name and a route prefix are the server's, but they reach HTML: a name holding "</script>"
    stays inside the JSON, a prefix holding a quote stays inside the attribute."""
    args = AppArgs.parse({"model": "toy"})
    page = playground_page(args, 'flux-</script><img src=x onerror=alert(1)>', '/a"b')
    assert page.count("</script>") == 1  # the page's own
    assert _config(page)["model"] == 'flux-</script><img src=x onerror=alert(1)>'
    assert '<base href="/a&quot;b/">' in page
