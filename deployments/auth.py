"""Optional API keys for the HTTP app: every route but the probes (/healthz, /readyz) and the playground page (/)
needs `Authorization: Bearer <key>` once keys are set; an image URL may carry a signature instead (`<img src>` and
browsers send no bearer header).

The keys live here, in a module, because Serve serves a frozen (pickled) copy of the FastAPI app and of the ingress
class: module-level functions and this module's state are shared by reference, so the ingress sets the keys once
(`set_keys`) and the middleware of the app actually served reads them. Keys are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

_keys: frozenset[str] = frozenset()
# The HMAC key of signed image URLs, derived from the API keys: every ingress replica reading the same keys file
# signs alike with no secret to hand around, and removing a key from the file voids the URLs signed before.
_url_secret = b""


def set_keys(keys: frozenset[str]) -> None:
    global _keys, _url_secret
    _keys = frozenset(keys)
    _url_secret = hashlib.sha256(b"fluxserve image urls\0" + b"\0".join(sorted(k.encode() for k in _keys))).digest()


def required() -> bool:
    """Whether requests need a key (the keys are set)."""
    return bool(_keys)


# The routes a load balancer's liveness and readiness probes reach without a key, and the playground page (it holds
# no data; it asks for a key itself). Exact paths: a suffix test would exempt any route ending so.
EXEMPT_PATHS = ("/", "/healthz", "/readyz")
# Where kept images are served: a GET there passes with a valid, unexpired signature instead of a key.
FILES_PATH = "/v1/images/files/"


def _signature(file_id: str, expires: int) -> str:
    return hmac.new(_url_secret, f"{file_id}:{expires}".encode(), hashlib.sha256).hexdigest()


def signed_query(file_id: str, ttl_s: float, now: float | None = None) -> str:
    """The query string that lets an image URL be fetched without a key until the image expires (`?expires=<unix
    s>&signature=<hex>`); empty when keys are off."""
    if not _keys:
        return ""
    expires = int((time.time() if now is None else now) + ttl_s) + 1
    return f"?expires={expires}&signature={_signature(file_id, expires)}"


def _signed_file(path: str, query: Any) -> bool:
    """A kept image's path with a signature that matches its id and an expiry still ahead."""
    file_id = path[len(FILES_PATH):]
    expires, signature = query.get("expires", ""), query.get("signature", "")
    if not path.startswith(FILES_PATH) or not file_id or "/" in file_id:
        return False
    if not (expires.isascii() and expires.isdigit() and len(expires) <= 12):
        return False
    if int(expires) <= time.time():
        return False
    return hmac.compare_digest(signature.encode(), _signature(file_id, int(expires)).encode())


def _authorized(header: str) -> bool:
    scheme, _, token = header.partition(" ")
    # compare_digest against every key: the time taken does not tell how much of a key matched. Bytes, since on str
    # it raises for non-ASCII text, which a header decoded as latin-1 may hold.
    given = token.strip().encode()
    matches = [hmac.compare_digest(given, k.encode()) for k in _keys]
    return scheme.lower() == "bearer" and any(matches)


def _route_path(request: Request) -> str:
    """The path below the app's mount point (Serve's route prefix arrives as the ASGI root_path)."""
    path, root = request.url.path, request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def require_api_key(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
    """HTTP middleware: a 401 JSON error unless keys are off, the path is exactly an exempt one, the bearer key is
    known, or the request fetches a kept image by its signed URL."""
    path = _route_path(request)
    if _keys and path not in EXEMPT_PATHS:
        signed = request.method in ("GET", "HEAD") and _signed_file(path, request.query_params)
        if not signed and not _authorized(request.headers.get("authorization", "")):
            return JSONResponse(
                status_code=401, headers={"WWW-Authenticate": "Bearer"},
                content={"error": {"message": "missing or invalid API key (send Authorization: Bearer <key>)",
                                   "type": "authentication_error", "param": None}},
            )
    return await call_next(request)
