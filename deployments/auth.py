"""Optional API keys for the HTTP app: every route but the probes (/healthz, /readyz) needs `Authorization: Bearer <key>` once keys are set.

The keys live here, in a module, because Serve serves a frozen (pickled) copy of the FastAPI app and of the ingress
class: module-level functions and this module's state are shared by reference, so the ingress sets the keys once
(`set_keys`) and the middleware of the app actually served reads them. Keys are never logged.
"""

from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

_keys: frozenset[str] = frozenset()


def set_keys(keys: frozenset[str]) -> None:
    global _keys
    _keys = frozenset(keys)


# The routes a load balancer's liveness and readiness probes reach without a key (exact paths: a suffix test would
# exempt any route ending so).
EXEMPT_PATHS = ("/healthz", "/readyz")


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
    """HTTP middleware: a 401 JSON error unless keys are off, the path is exactly a probe's, or the bearer key is
    known."""
    if _keys and _route_path(request) not in EXEMPT_PATHS:
        if not _authorized(request.headers.get("authorization", "")):
            return JSONResponse(
                status_code=401, headers={"WWW-Authenticate": "Bearer"},
                content={"error": {"message": "missing or invalid API key (send Authorization: Bearer <key>)",
                                   "type": "authentication_error", "param": None}},
            )
    return await call_next(request)
