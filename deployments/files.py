"""Images kept for `response_format: "url"`: a small Serve deployment, so every ingress replica sees the same files.

Bounded in time (`image_url_ttl_s`) and in memory (`image_url_max_bytes`, the oldest go first); ids are random and
unguessable. The files are served by the ingress at GET /v1/images/files/<id> (behind the API keys when those are
set). In memory only: a restarted store has forgotten its images, and their URLs answer 404.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Callable

from ray import serve


class FileStore:
    """The store itself (plain Python; the deployment below holds one)."""

    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = float(ttl_s)
        self.max_bytes = int(max_bytes)
        self._now = clock
        # id -> (expiry, media type, data); one TTL for all, so insertion order is expiry order
        self._files: OrderedDict[str, tuple[float, str, bytes]] = OrderedDict()
        self._bytes = 0

    def put(self, data: bytes, media_type: str) -> str:
        if len(data) > self.max_bytes:
            raise ValueError(f"an image of {len(data)} bytes does not fit the store ({self.max_bytes} bytes)")
        self._expire()
        while self._bytes + len(data) > self.max_bytes:
            self._drop(next(iter(self._files)))
        file_id = secrets.token_urlsafe(18)
        self._files[file_id] = (self._now() + self.ttl_s, media_type, data)
        self._bytes += len(data)
        return file_id

    def get(self, file_id: str) -> tuple[bytes, str] | None:
        self._expire()
        item = self._files.get(file_id)
        return None if item is None else (item[2], item[1])

    def _expire(self) -> None:
        now = self._now()
        while self._files:
            first = next(iter(self._files))
            if self._files[first][0] > now:
                break
            self._drop(first)

    def _drop(self, file_id: str) -> None:
        self._bytes -= len(self._files.pop(file_id)[2])


# mutmut cannot wrap the methods of a class that Serve has wrapped (the logic is FileStore's): not mutated
@serve.deployment(num_replicas=1, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
class ImageFiles:  # pragma: no mutate block
    def __init__(self, ttl_s: float, max_bytes: int) -> None:
        self.store = FileStore(ttl_s, max_bytes)

    async def put(self, data: bytes, media_type: str) -> str:
        return self.store.put(data, media_type)

    async def get(self, file_id: str) -> tuple[bytes, str] | None:
        return self.store.get(file_id)
