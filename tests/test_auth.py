"""API keys without Ray: the real `deployments.auth.require_api_key` middleware on a FastAPI app, driven by a table
of adversarial `Authorization` headers, and the /healthz exemption by exact path only.

(The served app with a keys file, through the `openai` client: tests/test_serve.py::TestApiKeys.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from deployments import auth  # noqa: E402

KEY, OTHER = "sk-test-Abc123_xyz", "sk-second-key-99"


@pytest.fixture()
def client():
    app = FastAPI()
    app.middleware("http")(auth.require_api_key)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz")
    def readyz() -> dict:
        return {"ready": True}

    @app.get("/v1/models")
    def models() -> dict:
        return {"data": []}

    @app.get("/v1/models/healthz")  # a route whose path merely ends like the exempt one
    def lookalike() -> dict:
        return {"secret": True}

    @app.get("/v1/images/files/{file_id}")
    def image_file(file_id: str) -> dict:
        return {"image": file_id}

    @app.post("/v1/images/files/{file_id}")
    def not_a_fetch(file_id: str) -> dict:
        return {"posted": file_id}

    auth.set_keys(frozenset({KEY, OTHER}))
    try:
        yield TestClient(app)
    finally:
        auth.set_keys(frozenset())


# Accepted: the scheme is case-insensitive (RFC 9110), whitespace around the token is the header's, not the key's.
ACCEPTED = [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"Bearer {OTHER}", f"Bearer {KEY} ", f"Bearer  {KEY}"]
# Refused: each a realistic way a sloppy check lets a caller in.
REFUSED = [
    "",                              # present but empty
    "Bearer",                        # scheme only
    "Bearer ",                       # empty bearer
    "Bearer   ",                     # blank bearer
    KEY,                             # the key with no scheme
    f"Basic {KEY}",                  # another scheme
    f"Token {KEY}",
    f"Bearer{KEY}",                  # no separator
    f"Bearer {KEY[:-1]}",            # a prefix of a key
    f"Bearer {KEY[:4]}",             # a short prefix ("sk-t")
    f"Bearer {KEY}x",                # an extension of a key
    f"Bearer x{KEY}",
    f"Bearer {KEY.upper()}",         # keys are case-sensitive
    f"Bearer {KEY} {OTHER}",         # two keys in one header
    f"Bearer {KEY},Bearer {OTHER}",
    f"Bearer {KEY}{OTHER}",          # two keys run together
    f"Bearer\t{KEY}",                # a tab is not the separator
    f"X Bearer {KEY}",
]


@pytest.mark.parametrize("header", ACCEPTED)
def test_a_known_bearer_key_passes(client: TestClient, header: str) -> None:
    r = client.get("/v1/models", headers={"Authorization": header})
    assert r.status_code == 200, (header, r.text)


@pytest.mark.parametrize("header", REFUSED)
def test_adversarial_authorization_headers_get_a_401_in_openai_shape(client: TestClient, header: str) -> None:
    """Catches a check that tests a prefix, `in`, a lowercased key, a missing scheme test, or `any` over an empty
    token."""
    r = client.get("/v1/models", headers={"Authorization": header})
    assert r.status_code == 401, (header, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {"error": {"message": "missing or invalid API key (send Authorization: Bearer <key>)",
                                  "type": "authentication_error", "param": None}}  # OpenAI's error shape
    assert KEY not in r.text and OTHER not in r.text  # a key never echoes back


def test_non_ascii_and_binary_tokens_are_refused_not_crashed(client: TestClient) -> None:
    """`hmac.compare_digest` raises TypeError on non-ASCII `str`: a header with a latin-1 byte must be a 401, not a
    500."""
    for raw in (b"Bearer \xe9t\xe9", b"Bearer " + KEY.encode() + b"\xff", b"Bearer \x00"):
        r = client.get("/v1/models", headers=[(b"authorization", raw)])
        assert r.status_code == 401, (raw, r.status_code, r.text)


def test_only_the_exact_healthz_path_skips_the_key(client: TestClient) -> None:
    """A path that merely ends in /healthz must not skip the check (it did: `endswith`). The readiness probe's path
    is exempt too (a Kubernetes probe sends no key), and nothing that merely contains it."""
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").json() == {"ready": True}
    assert client.get("/readyz/").status_code in (401, 404) and client.get("/v1/readyz").status_code == 401
    r = client.get("/v1/models/healthz")
    assert r.status_code == 401 and "secret" not in r.text
    assert client.get("/v1/models/healthz", headers={"Authorization": f"Bearer {KEY}"}).json() == {"secret": True}
    assert client.get("/v1/models").status_code == 401  # no header at all


def test_the_exemption_is_relative_to_the_mount_point(client: TestClient) -> None:
    """Under a route prefix (Serve passes it as the ASGI root_path) /healthz is the prefix's; a path that only
    ends in it is not exempt, nor is /healthz outside the prefix."""
    mounted = TestClient(client.app, root_path="/api")
    assert mounted.get("/api/healthz").status_code == 200
    assert mounted.get("/api/v1/models/healthz").status_code == 401
    assert mounted.get("/api/v1/models").status_code == 401
    assert mounted.get("/api/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def _signed(file_id: str, ttl_s: float = 60, now: float | None = None) -> str:
    return f"/v1/images/files/{file_id}" + auth.signed_query(file_id, ttl_s, now)


def test_signed_url_fetches_its_image_without_a_key_until_it_expires(client: TestClient, monkeypatch) -> None:
    """The URL a `response_format: "url"` answer carries works in an <img> tag (no bearer header) while its image
    is kept, then answers 401; it opens that image and no other route."""
    url = _signed("abc123")
    assert client.get(url).json() == {"image": "abc123"}
    assert client.head(url).status_code != 401
    assert client.post(url).status_code == 401  # a signature lets an image be read, nothing else
    assert client.get("/v1/images/files/abc123").status_code == 401  # unsigned
    expires = int(url.split("expires=")[1].split("&")[0])
    monkeypatch.setattr(auth.time, "time", lambda: expires - 0.5)
    assert client.get(url).status_code == 200
    monkeypatch.setattr(auth.time, "time", lambda: expires)
    r = client.get(url)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_a_signed_url_lasts_as_long_as_its_image_and_no_longer() -> None:
    """The expiry is the first whole second after now + ttl (the image is kept ttl seconds): not a second less, at
    most one more."""
    auth.set_keys(frozenset({KEY}))
    try:
        for now, ttl in ((1000.5, 60), (1000.0, 3600), (7.25, 0.5)):
            expires = int(auth.signed_query("abc", ttl, now=now).split("expires=")[1].split("&")[0])
            assert now + ttl < expires <= now + ttl + 1, (now, ttl, expires)
        assert auth.required()
    finally:
        auth.set_keys(frozenset())
    assert not auth.required()


def test_a_tampered_signed_url_is_refused(client: TestClient) -> None:
    """Each part of the URL is bound: another id, a later expiry, an altered or truncated signature, a signature
    made under other keys, a signature moved to another route, and junk expiries (unicode digits, huge numbers)."""
    url = _signed("abc123")
    path, query = url.split("?")
    expires, sig = (part.split("=")[1] for part in query.split("&"))
    flipped = ("0" if sig[0] != "0" else "1") + sig[1:]
    refused = [
        f"/v1/images/files/abc124?{query}",
        f"{path}?expires={int(expires) + 3600}&signature={sig}",
        f"{path}?expires={expires}&signature={flipped}",
        f"{path}?expires={expires}&signature={sig[:-1]}",
        f"{path}?expires={expires}&signature=",
        f"{path}?expires={expires}",
        f"{path}?signature={sig}",
        f"{path}?expires=%C2%B2&signature={sig}",
        f"{path}?expires={'9' * 5000}&signature={sig}",
        f"/v1/models?{query}",
        f"/v1/images/files/abc123/x?{query}",
        _signed("abc123/x"),  # an id with a slash: not a kept image's path, whatever it is signed for
        # a route outside the files' whose tail after the files' prefix length is signed as an id
        "/v1/models/healthz" + auth.signed_query("/v1/models/healthz"[len(auth.FILES_PATH):], 60),
    ]
    for bad in refused:
        assert client.get(bad).status_code == 401, bad
    auth.set_keys(frozenset({OTHER}))  # the keys changed: URLs signed under the old set are void
    assert client.get(url).status_code == 401
    assert client.get(_signed("abc123")).status_code == 200


def test_no_keys_means_no_check() -> None:
    app = FastAPI()
    app.middleware("http")(auth.require_api_key)
    app.get("/v1/models")(lambda: {"data": []})
    auth.set_keys(frozenset())
    assert TestClient(app).get("/v1/models").status_code == 200
    assert auth.signed_query("abc", 60) == ""  # nothing to sign with: image URLs stay plain
