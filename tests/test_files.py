"""`deployments.files.FileStore`, the store behind `response_format: "url"`: time and byte bounds at their edges,
eviction order, byte accounting, unguessable ids. (Through HTTP with Serve: tests/test_serve.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from deployments.files import FileStore  # noqa: E402


def _store(ttl_s: float = 10, max_bytes: int = 10) -> tuple[FileStore, list[float]]:
    now = [0.0]
    return FileStore(ttl_s=ttl_s, max_bytes=max_bytes, clock=lambda: now[0]), now


def test_file_store_expires_and_evicts_the_oldest() -> None:
    store, now = _store()
    a = store.put(b"aaaa", "image/png")
    b = store.put(b"bbbb", "image/jpeg")
    assert store.get(a) == (b"aaaa", "image/png") and store.get(b) == (b"bbbb", "image/jpeg")
    c = store.put(b"cccc", "image/png")  # 12 bytes > 10: the oldest goes
    assert store.get(a) is None and store.get(b) is not None and store.get(c) is not None
    assert len({a, b, c}) == 3 and len(a) >= 24  # random, unguessable ids
    now[0] = 10.0  # b and c expire together (same ttl)
    assert store.get(b) is None and store.get(c) is None
    with pytest.raises(ValueError, match="an image of 11 bytes does not fit the store \\(10 bytes\\)"):
        store.put(b"x" * 11, "image/png")


def test_an_image_lives_exactly_its_ttl() -> None:
    """Kept while now < put time + ttl, gone at it (catches `>=` for `>` in the expiry test and a ttl off by any
    amount)."""
    store, now = _store(ttl_s=10)
    now[0] = 5.0
    f = store.put(b"ab", "image/png")
    now[0] = 14.999
    assert store.get(f) == (b"ab", "image/png")
    now[0] = 15.0
    assert store.get(f) is None


def test_bytes_fill_to_the_limit_exactly_and_are_given_back() -> None:
    """An image that fills the store to max_bytes exactly evicts nothing; one more byte evicts the oldest only;
    expired and evicted images give their bytes back (a store that forgot to subtract would evict forever)."""
    store, now = _store(ttl_s=10, max_bytes=10)
    a = store.put(b"a" * 4, "image/png")
    b = store.put(b"b" * 6, "image/png")  # 10 of 10
    assert store.get(a) and store.get(b)
    c = store.put(b"c" * 4, "image/png")  # 14 > 10: a (4 bytes) goes, b stays
    assert store.get(a) is None and store.get(b) and store.get(c)
    d = store.put(b"d" * 10, "image/png")  # the whole store: b and c go
    assert store.get(b) is None and store.get(c) is None and store.get(d) == (b"d" * 10, "image/png")
    now[0] = 20.0  # d expires: its 10 bytes come back
    assert store.get(d) is None
    e, f = store.put(b"e" * 5, "image/png"), store.put(b"f" * 5, "image/png")
    assert store.get(e) and store.get(f)  # 10 of 10 again, nothing evicted
    assert store.put(b"", "image/png") and store.get(e) and store.get(f)  # an empty image fits a full store


def test_expired_images_go_before_live_ones_are_evicted() -> None:
    """On put, expired images are dropped first: a full store whose images all expired evicts none of the new."""
    store, now = _store(ttl_s=10, max_bytes=10)
    old = store.put(b"o" * 10, "image/png")
    now[0] = 11.0
    new = store.put(b"n" * 10, "image/png")
    assert store.get(old) is None and store.get(new) == (b"n" * 10, "image/png")


def test_unknown_ids_and_media_types_round_trip() -> None:
    store, _ = _store()
    f = store.put(b"x", "image/webp")
    assert store.get(f) == (b"x", "image/webp")
    assert store.get("nope") is None and store.get(f + "x") is None and store.get(f[:-1]) is None
    ids = {store.put(b"", "image/png") for _ in range(200)}
    assert len(ids) == 200 and all(len(i) >= 24 for i in ids)
