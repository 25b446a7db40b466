"""FastAPI ingress: validates, routes by `quality` to the pool's DeploymentHandle, maps failures to JSON.

Every accepted request ends in exactly one response: the image(s), or a 4xx/5xx JSON error with a
reason. A deadline (`request_timeout_s`, or the request's smaller `timeout_s`) bounds the wait; on
expiry the pool calls are cancelled, so the replica stops the batch between steps.
"""

# No `from __future__ import annotations` here: FastAPI (through serve.ingress) needs real annotations.

import asyncio
import base64
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle
from ray.serve.metrics import Counter, Gauge, Histogram

from deployments import auth, body
from deployments.adapters import adapter_folder
from deployments.playground import playground_page
from deployments.config import AppArgs
from deployments.errors import BadRequest, GenerationFailed, OutOfMemory, PoolUnavailable
from deployments.schema import (
    AdapterRequest,
    ErrorResponse,
    ImageRequest,
    ImageResponse,
    Validated,
    encode_image,
    json_edit,
    validate,
    validate_edit,
)
from model.loading import model_family, trained_sizes
from model.request import QUALITIES, format_size

logger = logging.getLogger("ray.serve")

api = FastAPI(
    title="fluxserve",
    version="0.1.0",
    description="FLUX.1 text-to-image: a bit-exact `lossless` pool and a fused `high` pool.",
)


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": type_, "param": param}}
    )


# What each error status means, documented on the routes that answer it (the OpenAPI document is what clients and
# the schema fuzzer hold the app to).
_ERRORS = {
    400: "invalid request (reason in error.message)",
    401: "missing or invalid API key (only when API keys are on)",
    404: "unknown, or expired",
    413: "request body too large",
    500: "generation failed",
    503: "pool unavailable or overloaded (Retry-After says when to try again), or not ready",
    504: "deadline exceeded",
}


def _adapter_api_off() -> JSONResponse:
    return _error(404, "the adapter API is off: this deployment sets no args.lora_dir", "not_found")


# A 200 of the image routes: JSON (the response model), the raw image, or server-sent events.
_IMAGES_OK: dict[str, Any] = {
    "content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}, "text/event-stream": {}},
    "description": "JSON; the raw image with `Accept: image/<output_format>` and n == 1; events with `stream: true`",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, each with the error body's schema."""
    return {code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in codes}


def _edit_form() -> dict[str, Any]:
    """The multipart edit's fields for the OpenAPI document (the route reads the form itself): the image and mask
    files, `strength`, and the generation fields that are one value each."""
    props = ImageRequest.model_json_schema()["properties"]
    scalar = {k: v for k, v in props.items() if v.get("type") in ("string", "integer", "number", "boolean")
              or all(a.get("type") in ("string", "integer", "number", "boolean", "null") for a in v.get("anyOf", [{}]))}
    return {"type": "object", "required": ["image", "prompt"], "properties": {
        "image": {"type": "string", "format": "binary", "description": "PNG, JPEG or WebP"},
        "mask": {"type": "string", "format": "binary", "description": "white = repaint; the image's size"},
        "strength": {"type": "number", "description": "(0, 1], default 0.6"}, **scalar}}


def _edit_json(form: dict[str, Any]) -> dict[str, Any]:
    """The JSON edit's body for the OpenAPI document, from the form's (`_edit_form`): OpenAI's `images` / `mask` as
    base64 data: URLs, the other fields alike."""
    ref = {"type": "object", "required": ["image_url"],
           "properties": {"image_url": {"type": "string", "description": "data:image/png;base64,..."}}}
    return {"type": "object", "required": ["images", "prompt"], "properties": {
        "images": {"type": "array", "items": ref, "minItems": 1, "maxItems": 1}, "mask": ref,
        **{k: v for k, v in form["properties"].items() if k not in ("image", "mask")}}}


_EDIT_FORM = _edit_form()
_EDIT_JSON = _edit_json(_EDIT_FORM)


@api.exception_handler(StarletteHTTPException)
async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Starlette's own answers (an unknown path, a method a route does not take) in OpenAI's shape, not {"detail"}.
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    response = _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)
    response.headers.update(exc.headers or {})
    return response


@api.exception_handler(RequestValidationError)
async def _on_invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's default is a 422 with pydantic internals; answer like OpenAI: 400 and one readable reason.
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return _error(400, f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}",
                      "invalid_request_error")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "missing":
        msg = f"missing required field {param!r}"
    elif first.get("type") == "extra_forbidden":
        msg = f"unknown field {param!r}"
    elif first.get("type") in ("model_attributes_type", "dict_type"):
        msg = "request body must be a JSON object"
    else:
        msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid body")
    return _error(400, msg, "invalid_request_error", param)


api.add_middleware(body.BodyLimit)  # inside the key check: a request without a key is refused before its body is read
api.middleware("http")(auth.require_api_key)


# Helpers sit above the deployment class: @serve.deployment serializes the class when it is
# defined, so module globals it uses must already exist.
def _cancel(responses: list) -> None:
    for r in responses:
        try:
            r.cancel()
        except Exception:  # already finished or failed: nothing to cancel
            pass


RETRY_AFTER_S = 1  # what a shed or out-of-memory request is told to wait before trying again
# The replica (or one of its TP ranks) died under a request. Every job carries its seed, so the ingress re-runs it
# once (Serve routes it to a live replica) and it answers the bytes it would have had.
REPLICA_GONE = (PoolUnavailable, ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)


def _retry_later(response: JSONResponse) -> JSONResponse:
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _reason(e: BaseException) -> str:
    # RayTaskError wraps the remote traceback; the first line of the cause is the useful reason.
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return text[-1] if text else type(cause).__name__


def _failure(pool: str, e: BaseException, timeout_s: float) -> tuple[int, JSONResponse]:
    """The HTTP answer to a pool call that failed with `e` (every failure gets a JSON reason)."""
    if isinstance(e, asyncio.TimeoutError):
        return 504, _error(504, f"deadline of {timeout_s:g} s exceeded in pool {pool!r}; the request was cancelled",
                           "timeout")
    if isinstance(e, BadRequest):
        return 400, _error(400, e.message, "invalid_request_error", e.param)
    if isinstance(e, OutOfMemory):
        return 503, _retry_later(_error(503, f"pool {pool!r}: {_reason(e)}", "out_of_memory"))
    if isinstance(e, BackPressureError):
        logger.warning("pool %s overloaded: %r", pool, e)
        return 503, _retry_later(_error(503, f"pool {pool!r} is at capacity: {_reason(e)}", "overloaded"))
    if isinstance(e, (*REPLICA_GONE, RequestCancelledError)):
        logger.warning("pool %s unavailable: %r", pool, e)
        return 503, _retry_later(_error(503, f"pool {pool!r} unavailable: {_reason(e)}", "unavailable"))
    if isinstance(e, GenerationFailed):
        return 500, _error(500, f"generation failed in pool {pool!r}: {_reason(e)}", "server_error")
    # anything else still gets a JSON answer, never a hang or a drop
    logger.exception("pool %s: unexpected error", pool)
    return 500, _error(500, f"internal error in pool {pool!r}: {type(e).__name__}: {_reason(e)}", "server_error")


def readiness(app: Any, pools: list[str]) -> tuple[bool, dict[str, Any]]:
    """(ready, body) from Serve's status of this application (`serve.status().applications[name]`, None while it is
    unknown): ready when every pool has a running replica; per pool, its replicas by state. A pool with no running
    replica that Serve gave up starting (DEPLOY_FAILED) makes the status "failed", with Serve's reason as its
    `error`, so whoever waits for readiness can stop waiting and say why."""
    detail = {}
    for pool in pools:
        deployment = app.deployments.get(pool) if app is not None else None
        states = {str(getattr(state, "value", state)).lower(): int(n)
                  for state, n in (deployment.replica_states if deployment is not None else {}).items()}
        detail[pool] = {"ready": states.get("running", 0) > 0, "replicas": states}
        status = str(getattr(getattr(deployment, "status", None), "value", "")).lower()
        if status == "deploy_failed" and not detail[pool]["ready"]:
            detail[pool]["error"] = _startup_failure(getattr(deployment, "message", "") or "")
    ready = all(p["ready"] for p in detail.values())
    failed = any("error" in p for p in detail.values())
    return ready, {"status": "ready" if ready else "failed" if failed else "starting", "pools": detail}


def _startup_failure(message: str) -> str:
    """Serve's DEPLOY_FAILED message cut to what a person acts on: its first line and the exception its traceback
    ends with (the rest is in the controller's log)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ... ".join(lines if len(lines) <= 2 else [lines[0], lines[-1]])


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class ClosingStream(StreamingResponse):
    """A StreamingResponse that calls `on_close` however it ends. A body generator's own `finally` is not enough: a
    client that leaves before Starlette starts iterating the body (while the headers go out) leaves the generator
    unstarted, and an unstarted generator never runs its `finally`. `on_close` must be idempotent."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@serve.deployment(max_ongoing_requests=64)
@serve.ingress(api)
class Ingress:
    def __init__(
        self, lossless: DeploymentHandle, high: DeploymentHandle, files: DeploymentHandle, args: dict[str, Any],
        model_name: str, adapters: DeploymentHandle | None = None,
    ) -> None:
        self.args = AppArgs.parse(args)
        self.files = files
        self.adapters = adapters  # the registry of adapters loaded through the API (None: args.lora_dir unset)
        keys = self.args.load_api_keys()
        auth.set_keys(keys)
        body.configure(self.args.limits.max_body_bytes)
        logger.info("ingress: API keys %s", f"required ({len(keys)} keys)" if keys else "off")  # never the keys
        self.model_name = model_name
        self.pools: dict[str, DeploymentHandle] = {"lossless": lossless, "high": high}
        self.m_requests = Counter(
            "fluxserve_requests",
            description="Image requests by pool and HTTP status.",
            tag_keys=("pool", "status"),
        )
        self.m_latency = Histogram(
            "fluxserve_request_latency_s",
            description="End-to-end latency at the ingress (seconds), successful requests.",
            boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300],
            tag_keys=("pool",),
        )
        self.m_inflight = Gauge(
            "fluxserve_in_flight", description="Requests in flight per pool.", tag_keys=("pool",)
        )
        self._inflight = {q: 0 for q in QUALITIES}
        for q in QUALITIES:
            self.m_inflight.set(0, tags={"pool": q})
        self.retries = {q: 0 for q in QUALITIES}  # requests re-run after their replica went away
        # the sizes the model's folder says it was trained at (None: it says nothing, and nothing is warned)
        self.trained_sizes = trained_sizes(self.args.model)
        self.family = model_family(self.args.model)  # how edits run on it (FLUX.1: strength and masks; Kontext: none)
        self._warned_sizes: set[str] = set()

    def _enter(self, pool: str) -> None:
        self._inflight[pool] += 1
        self.m_inflight.set(self._inflight[pool], tags={"pool": pool})

    def _leave(self, pool: str) -> None:
        self._inflight[pool] -= 1
        self.m_inflight.set(self._inflight[pool], tags={"pool": pool})

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per pool (the `fluxserve_in_flight` gauge), streams included; for handles and tests."""
        return dict(self._inflight)

    def retried(self) -> dict[str, int]:
        """Requests per pool re-run once because their replica went away; for handles and tests."""
        return dict(self.retries)

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        """Liveness of the ingress; pool replicas are health-checked by Serve itself."""
        return {"status": "ok", "model": self.model_name, "pools": list(self.pools)}

    @api.get("/readyz", responses=_errors(503))
    async def readyz(self) -> JSONResponse:
        """Readiness: 200 when every pool has a running replica (Serve counts a replica as running once its
        constructor, which builds and warms its pipeline, has returned), else 503; per pool, its replicas by state.
        Read from the Serve controller, so a pool busy with batches is still ready."""
        app = (await asyncio.to_thread(serve.status)).applications.get(serve.get_replica_context().app_name)
        ready, body = readiness(app, list(self.pools))
        return JSONResponse(body, status_code=200 if ready else 503)

    @api.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground(self, request: Request) -> HTMLResponse:
        """The playground page: one file of HTML and JS in the package (no build step, nothing from a CDN). Exempt
        from API keys like the probes: it holds no data and asks for a key itself when keys are on."""
        return HTMLResponse(playground_page(self.args, self.model_name, request.scope.get("root_path", ""),
                                            self.family.edits))

    @api.get("/v1/models", responses=_errors(401))
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "owned_by": "fluxserve",
                    "qualities": list(QUALITIES),
                    "tp": {q: self.args.pools[q].tp for q in QUALITIES},
                    # adapters a request may name (a fused one is part of the model and named by none)
                    "loras": [a["id"] for a in (await self.list_adapters())["data"]],
                    "trained_sizes": self.trained_sizes,  # null: the model's folder does not say
                    "family": self.family.name,
                    # how /v1/images/edits uses the image: "strength" (image-to-image, masks inpaint) or
                    # "reference" (edits by instruction, no mask or strength)
                    "edits": self.family.edits,
                }
            ],
        }

    @api.post(
        "/v1/images/generations",
        response_model=ImageResponse,
        responses={200: _IMAGES_OK, **_errors(400, 401, 413, 500, 503, 504)},
    )
    async def generations(self, body: ImageRequest, request: Request, response: Response) -> Any:
        try:
            v = validate(body, self.args, self.model_name, await self._runtime_adapters(body.lora))
        except BadRequest as e:
            return self._refuse(e)
        return await self._serve(v, request, response, "image_generation")

    @api.get("/v1/adapters", responses=_errors(401))
    async def list_adapters(self) -> dict[str, Any]:
        """The LoRA adapters requests may name: those loaded at start (`args.loras`) and through this API."""
        runtime = await self.adapters.list.remote() if self.adapters is not None else {}
        data = [{"id": n, "object": "adapter", "source": "args.loras"} for n in sorted(self.args.loras)]
        data += [{"id": n, "object": "adapter", "source": "api", "file": self._adapter_file(f)}
                 for n, f in sorted(runtime.items())]
        return {"object": "list", "data": [] if self.args.fuse_lora else data}

    @api.post("/v1/adapters", responses=_errors(400, 401, 404, 503))
    async def load_adapter(self, body: AdapterRequest) -> Any:
        """Load a LoRA adapter file from the server's adapter folder (`args.lora_dir`) under a name, on every replica
        of both pools (one of each now, which checks it; the others before their first batch that names it)."""
        if self.adapters is None:
            return _adapter_api_off()
        try:
            state = await self.adapters.add.remote(body.name, body.file)
        except BadRequest as e:
            return self._refuse(e)
        try:
            await self._sync_pools(state)
        except Exception as e:  # the file does not load: unregister it again, and answer why
            await self._sync_pools(await self.adapters.remove.remote(body.name), return_exceptions=True)
            if isinstance(e, BadRequest):
                return _error(400, f"adapter {body.name!r} does not load: {e.message}", "invalid_request_error",
                              "file")
            return _failure("adapters", e, self.args.request_timeout_s)[1]
        logger.info("adapter %s loaded from %s", body.name, state[body.name])
        return {"id": body.name, "object": "adapter", "source": "api", "file": self._adapter_file(state[body.name])}

    @api.delete("/v1/adapters/{name}", responses=_errors(401, 404))
    async def unload_adapter(self, name: str) -> Any:
        """Unload an adapter loaded through this API: requests may no longer name it; replicas free it (one of each
        pool now, the others at their next adapter change)."""
        if self.adapters is None:
            return _adapter_api_off()
        try:
            state = await self.adapters.remove.remote(name)
        except LookupError as e:
            return _error(404, str(e.args[0] if e.args else e), "not_found")
        await self._sync_pools(state, return_exceptions=True)
        return {"id": name, "object": "adapter", "deleted": True}

    async def _sync_pools(self, state: dict[str, str], return_exceptions: bool = False) -> None:
        """The API's adapter set `state` loaded on one replica of each pool now (the others sync before their next
        batch naming one)."""
        await asyncio.gather(*(self.pools[q].sync_adapters.remote(state) for q in QUALITIES),
                             return_exceptions=return_exceptions)

    def _adapter_file(self, path: str) -> str:
        """An adapter file as the API names it: relative to the adapter folder."""
        return os.path.relpath(path, adapter_folder(self.args.lora_dir or "/"))

    @api.get("/v1/images/files/{file_id}", name="image_file", responses={
        200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}, "description": "the image"},
        **_errors(401, 404)})
    async def image_file(self, file_id: str) -> Any:
        """An image kept for `response_format: "url"` (until it expires or the store needs the room)."""
        found = await self.files.get.remote(file_id)
        if found is None:
            return _error(404, f"no image {file_id!r}: unknown, or expired (images are kept "
                               f"{self.args.image_url_ttl_s:g} s)", "not_found")
        data, media_type = found
        return Response(content=data, media_type=media_type)

    @api.post(
        "/v1/images/edits",
        response_model=ImageResponse,
        responses={200: _IMAGES_OK, **_errors(400, 401, 413, 500, 503, 504)},
        openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _EDIT_FORM},
                                                                     "application/json": {"schema": _EDIT_JSON}}}},
    )
    async def edits(self, request: Request, response: Response) -> Any:
        """OpenAI's edit, as a multipart form (`image`, optional `mask`, `prompt` and the generation fields as form
        values, plus `strength`) or as JSON (`images: [{"image_url": <base64 data: URL>}]`, optional `mask:
        {"image_url": ...}`); image-to-image without a mask, inpainting with one."""
        ctype = request.headers.get("content-type", "")
        typed = ctype.startswith("application/json")
        try:
            if typed:
                fields, files = json_edit(await request.json())
            elif ctype.startswith("multipart/form-data"):
                fields, files = await self._edit_form(request)
            else:
                raise ValueError(f"got Content-Type {ctype!r}")
        except BadRequest as e:
            return self._refuse(e)
        except Exception as e:  # not JSON or multipart, a broken part: the parsers raise several types
            return self._refuse(BadRequest(None, f"the body must be multipart/form-data or JSON ({_reason(e)})"))
        try:
            # decoding images takes CPU time: off the event loop, so other requests keep flowing meanwhile
            v = await asyncio.to_thread(validate_edit, fields, files, self.args, self.model_name, typed,
                                        self.family, await self._runtime_adapters(fields.get("lora")))
        except BadRequest as e:
            return self._refuse(e)
        return await self._serve(v, request, response, "image_edit")

    async def _runtime_adapters(self, named: Any) -> dict[str, str] | None:
        """The adapters loaded through the API (name -> file) when a request names any adapter and the API is on:
        read from the registry for each such request, so every ingress replica sees adds and deletes at once."""
        if self.adapters is None or not named:
            return None
        return await self.adapters.list.remote()

    def _refuse(self, e: BadRequest) -> JSONResponse:
        """A request refused before it reaches a pool: counted, and answered 400 with the reason."""
        self.m_requests.inc(tags={"pool": "none", "status": "400"})
        return _error(400, e.message, "invalid_request_error", e.param)

    async def _edit_form(self, request: Request) -> tuple[dict[str, Any], dict[str, bytes]]:
        """A multipart edit's text fields and files (the first file of each name)."""
        fields: dict[str, Any] = {}
        files: dict[str, bytes] = {}
        limits = self.args.limits
        form = await request.form(max_files=limits.max_form_files, max_fields=limits.max_form_fields)
        for key, value in form.multi_items():
            name = key.removesuffix("[]")  # the openai client may send `image[]`
            if isinstance(value, str):
                fields[name] = value
            elif name not in files:
                files[name] = await value.read()
        return fields, files

    async def _serve(self, v: Validated, request: Request, response: Response, kind: str) -> Any:
        """Route validated jobs to their pool and answer (`_answer`); an image size the model was not trained at is
        served with a `Warning` header saying so (and logged once per size), never silently. `response` is FastAPI's
        injected one: its headers go out with a JSON answer, which stays serialized by the route's response model."""
        answer = await self._answer(v, request, kind)
        warning = self._size_warning(v)
        if warning is not None and (isinstance(answer, dict) or answer.status_code < 400):
            (response if isinstance(answer, dict) else answer).headers["Warning"] = warning
        return answer

    def _size_warning(self, v: Validated) -> str | None:
        size = format_size(v.jobs[0].height, v.jobs[0].width)
        if self.trained_sizes is None or size in self.trained_sizes:
            return None
        text = (f"{self.model_name} was trained at {', '.join(self.trained_sizes)} only; at {size} it may not draw "
                "the prompt")
        if size not in self._warned_sizes:
            self._warned_sizes.add(size)
            logger.warning("ingress: %s (the first request at that size; later ones carry a Warning header)", text)
        return f'299 fluxserve "{text}"'

    async def _answer(self, v: Validated, request: Request, kind: str) -> Any:
        """Route validated jobs to their pool and answer (JSON with b64 images or URLs, one raw image, or a stream
        of server-sent events whose types start with `kind`)."""
        pool = v.jobs[0].quality
        media_type = f"image/{v.output_format}"
        wants_raw = media_type in request.headers.get("accept", "")
        if wants_raw and (len(v.jobs) != 1 or v.stream):
            self.m_requests.inc(tags={"pool": pool, "status": "400"})
            return _error(400, f"Accept: {media_type} needs n == 1 and no stream (use JSON for several images)",
                          "invalid_request_error", "n")
        if v.stream:
            return await self._stream(v, kind)
        t0 = time.perf_counter()
        self._enter(pool)
        try:
            status, payload = await self._dispatch(pool, v.jobs, v.timeout_s, v.adapters)
        finally:
            self._leave(pool)
        self.m_requests.inc(tags={"pool": pool, "status": str(status)})
        if status != 200:
            return payload
        results: list[dict[str, Any]] = payload
        elapsed = time.perf_counter() - t0
        self.m_latency.observe(elapsed, tags={"pool": pool})
        first = v.jobs[0]
        timings = {"ingress_total_s": elapsed}
        for r in results:  # the slowest image bounds the request; report its replica timings
            for k, val in r["timings"].items():
                timings[k] = max(timings.get(k, 0.0), val)
        images = [r["png"] for r in results] if v.output_format == "png" else await asyncio.to_thread(
            lambda: [encode_image(r["png"], v.output_format, v.output_compression) for r in results])
        if wants_raw:
            r = results[0]
            return Response(
                content=images[0],
                media_type=media_type,
                headers={
                    "X-Seed": str(r["seed"]),
                    "X-Pool": r["pool"],
                    "X-Quality": r["quality"],
                    "X-Ran": json.dumps(r["ran"], separators=(",", ":")),
                    "X-Total-Time-S": f"{elapsed:.4f}",
                },
            )
        if v.response_format == "url":
            ids = await asyncio.gather(*[self.files.put.remote(im, media_type) for im in images])
            data = [{"url": str(request.url_for("image_file", file_id=i))
                     + auth.signed_query(i, self.args.image_url_ttl_s), "seed": r["seed"]}
                    for i, r in zip(ids, results)]
        else:
            data = [{"b64_json": base64.b64encode(im).decode(), "seed": r["seed"]} for im, r in zip(images, results)]
        return {
            "created": int(time.time()),
            "data": data,
            "model": self.model_name,
            "quality": results[0]["quality"],
            "output_format": v.output_format,
            "pool": results[0]["pool"],
            "seeds": [r["seed"] for r in results],
            "ran": results[0]["ran"],  # one request's images run under one tier and form
            "size": v.size,
            "steps": first.steps,
            "guidance": first.guidance,
            "timings": timings,
            "batch_sizes": [r["batch_size"] for r in results],
            "queued_together": [r["queued_together"] for r in results],
        }

    async def _stream(self, v: Validated, kind: str) -> Any:
        """Server-sent events: `<kind>.partial_image` per preview, then `<kind>.completed` with the final image (the
        same bytes as unstreamed), or an `error` event. A failure before the first event keeps its HTTP status; a
        closed stream or an expired deadline cancels the work."""
        pool, job = v.jobs[0].quality, v.jobs[0]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + v.timeout_s
        t0 = time.perf_counter()
        self._enter(pool)  # left by close() below however the stream ends, or here when nothing was sent
        events = self.pools[pool].options(stream=True).generate_stream.remote(job, v.partial_images, v.adapters)

        async def next_event() -> tuple[int, Any]:
            try:
                return 200, await asyncio.wait_for(events.__anext__(), timeout=max(deadline - loop.time(), 0.0))
            except asyncio.CancelledError:
                events.cancel()
                raise
            except StopAsyncIteration:
                return 500, _error(500, f"pool {pool!r} ended the stream without an image", "server_error")
            except Exception as e:
                events.cancel()
                return _failure(pool, e, v.timeout_s)

        try:
            status, first = await next_event()
        except BaseException:
            self._leave(pool)
            raise
        if status != 200:  # nothing sent yet: answer with the status itself
            self._leave(pool)
            self.m_requests.inc(tags={"pool": pool, "status": str(status)})
            return first
        common = {"size": v.size, "quality": pool, "background": "opaque", "output_format": v.output_format}

        def encoded(png: bytes) -> str:
            return base64.b64encode(encode_image(png, v.output_format, v.output_compression)).decode()

        ended = {"status": 200, "closed": False}

        def close() -> None:  # once, however the stream ends
            if not ended["closed"]:
                ended["closed"] = True
                self._leave(pool)
                self.m_requests.inc(tags={"pool": pool, "status": str(ended["status"])})
                events.cancel()  # a no-op once the stream has ended; else the client left: stop the work

        async def body() -> Any:
            status, event = 200, first
            try:
                while status == 200:
                    if "final" in event:
                        r = event["final"]
                        timings = {**r["timings"], "ingress_total_s": time.perf_counter() - t0}
                        yield _sse(f"{kind}.completed", {
                            "type": f"{kind}.completed", "b64_json": await asyncio.to_thread(encoded, r["png"]),
                            "created_at": int(time.time()), **common, "seed": r["seed"], "timings": timings,
                            "ran": r["ran"]})
                        self.m_latency.observe(time.perf_counter() - t0, tags={"pool": pool})
                        return
                    yield _sse(f"{kind}.partial_image", {
                        "type": f"{kind}.partial_image", "b64_json": await asyncio.to_thread(encoded, event["png"]),
                        "partial_image_index": event["partial_image_index"], "created_at": int(time.time()),
                        **common})
                    status, event = await next_event()
                    ended["status"] = status
                error = json.loads(event.body)["error"]
                yield _sse("error", {"type": "error", "error": error})
            finally:
                close()

        return ClosingStream(body(), on_close=close, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _dispatch(self, pool: str, jobs: list, timeout_s: float,
                        adapters: dict[str, str] | None = None) -> tuple[int, Any]:
        """Send each image to the pool (with the API's adapters when the jobs name one); (200, results) or
        (status, JSONResponse)."""
        handle = self.pools[pool]
        responses: list = []  # every call made, retries included, for cancellation

        async def _one(job: Any) -> dict[str, Any]:
            responses.append(handle.generate.remote(job, adapters))
            try:
                return await responses[-1]
            except REPLICA_GONE as e:
                logger.warning("pool %s: the replica went away under a request (%r); re-running it once", pool, e)
                self.retries[pool] += 1
                responses.append(handle.generate.remote(job, adapters))
                return await responses[-1]

        async def _gather() -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(_one(j) for j in jobs)))

        try:
            return 200, await asyncio.wait_for(_gather(), timeout=timeout_s)
        except asyncio.CancelledError:  # the HTTP client went away: stop the work it asked for
            _cancel(responses)
            raise
        except Exception as e:
            _cancel(responses)
            return _failure(pool, e, timeout_s)
