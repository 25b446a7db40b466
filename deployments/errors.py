"""The errors the serving layers hand each other, and the HTTP status each one becomes at the ingress."""

from __future__ import annotations


class BadRequest(Exception):
    """An invalid request: a 400 with `param` (the field) and `message` (the reason)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple:  # crosses Ray calls (a registry or a replica raises it): both fields travel
        return BadRequest, (self.param, self.message)


class PoolUnavailable(RuntimeError):
    """The pool cannot serve right now (a TP rank died, the replica is shutting down): a 503."""


class GenerationFailed(RuntimeError):
    """The pipeline raised while generating: a 500 with the reason."""


class OutOfMemory(RuntimeError):
    """The device ran out of memory for this batch; the replica freed it and serves on: a 503 with Retry-After."""
