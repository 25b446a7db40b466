"""Application arguments (the `args:` block of serve_config.yaml), parsed once by the builder.

Kept free of Ray and torch imports so the ingress and the tests can use it cheaply.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace
from typing import Any

from deployments.errors import BadRequest
from model.features import FEATURES, POOL_OPTIONS, Feature, app_techniques, is_on, refusal, standing_in
from model.form import ServingForm
from model.request import (DEFAULT_MODEL, DEFAULT_STEPS, DTYPES, MAX_INPUT_PIXELS, QUALITIES, SizeError,
                           adapter_rank_error, step_cache_error)
from model.request import parse_size as parse_request_size


@dataclass(frozen=True)
class Limits:
    """What the ingress accepts; anything outside is a 400 with the reason."""

    min_side: int = 64
    max_side: int = 2048
    max_pixels: int = 1024 * 1024 * 2
    size_multiple: int = 16
    min_steps: int = 1
    max_steps: int = 100
    max_n: int = 4
    max_prompt_chars: int = 2000
    max_guidance: float = 30.0
    max_loras: int = 4  # LoRA adapters one request may combine
    max_runtime_adapters: int = 8  # adapters loaded through the API (`lora_dir`) at once, in every replica
    max_lora_scale: float = 8.0  # |scale| of each
    # A request's own deadline (`timeout_s`) at least this: a shorter one could only end in a 504.
    min_timeout_s: float = 1.0
    # Edit inputs: bytes of one image or mask, and pixels its header may state (checked before decoding).
    max_image_bytes: int = 20 * 1024 * 1024
    max_input_pixels: int = MAX_INPUT_PIXELS
    # A request body (413 past it, before it is read whole), and a multipart body's parts.
    max_body_bytes: int = 48 * 1024 * 1024
    max_form_files: int = 4
    max_form_fields: int = 64

    def check_size(self, size: str) -> tuple[int, int]:
        """A request's "WxH" -> (height, width) within these limits; BadRequest("size", reason) otherwise."""
        try:
            height, width = parse_request_size(size)
        except SizeError as exc:
            raise BadRequest("size", str(exc)) from None
        if width % self.size_multiple or height % self.size_multiple:
            raise BadRequest("size", f"size {size}: width and height must be multiples of {self.size_multiple}")
        if min(width, height) < self.min_side:
            raise BadRequest("size", f"size {size} is too small: each side must be >= {self.min_side}")
        if max(width, height) > self.max_side:
            raise BadRequest("size", f"size {size} is too large: each side must be <= {self.max_side}")
        if width * height > self.max_pixels:
            raise BadRequest("size", f"size {size} is too large: at most {self.max_pixels} pixels")
        return height, width


@dataclass(frozen=True)
class PoolSettings:
    """One pool of FluxReplica, bar its techniques: `tp` ranks per replica, each reserving `rank_resources`."""

    tp: int = 1
    # Resources of one rank's bundle when tp > 1 (e.g. {"CPU": 4, "GPU": 1} on the H200 box).
    rank_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    # torch intra-op threads inside the replica / rank (Ray forces OMP_NUM_THREADS=1 in actors).
    cpu_threads: int | None = None
    # Process-group backend for tp > 1 (tp.dist.resolve_backend): None is NCCL on CUDA, gloo on the CPU. Ranks
    # that share a GPU (rank_resources GPU < 1) need gloo, which carries CUDA tensors through host memory: for
    # testing the sharded GPU path on one GPU, not for speed.
    backend: str | None = None
    # True: compatible requests are still collected per @serve.batch call, but each runs as its own
    # pipeline call, so an image never depends on what else was in flight: GEMM rounding depends on the batch
    # size (tests/test_pipeline.py shows it, stock diffusers alike), so the lossless pool defaults to True; the
    # high pool batches for throughput.
    batch_invariant: bool = False
    # How long a batch waits to fill. None: 0 for a batch-invariant pool (batching saves it no compute,
    # so waiting would be pure latency), else the app-level batch_wait_timeout_s.
    batch_wait_timeout_s: float | None = None
    # tp > 1: rendezvous and collective timeout; a rank that dies mid-batch makes the others raise after it.
    collective_timeout_s: float = 120.0
    # The sizes ("WxH", default: [default_size]) a replica warms up at start, at every batch size it can be asked
    # for (a compiled pool compiles for them), so no request of those shapes pays compilation.
    compile_sizes: list[str] | None = None
    # Before it takes traffic, a replica (every TP rank) runs one batch of its tier per warm size and batch size:
    # kernels compile and tune, exactness checks and per-shape choices are taken, CUDA graphs are captured.
    warm_up: bool = True

    @property
    def ranks_share_gpu(self) -> bool:
        """tp > 1 ranks that each take a fraction of a GPU (several ranks on one device)."""
        return self.tp > 1 and 0 < float(self.rank_resources.get("GPU", 0)) < 1

    def techniques(self) -> frozenset[str]:
        """The pool options of the feature table this pool turns on (a threshold that is set counts as on)."""
        return frozenset(f.name for f in POOL_OPTIONS if is_on(getattr(self, f.key)))


def _option_field(f: Feature) -> tuple[str, Any, Any]:
    return (f.key, f.option_type, field(default=False)) if f.option_type is bool else (
        f.key, f.option_type | None, field(default=None))


# One field per pool option of the feature table (model/features.py says what each does and what it excludes).
PoolArgs = make_dataclass("PoolArgs", [_option_field(f) for f in POOL_OPTIONS], bases=(PoolSettings,), frozen=True,
                          namespace={"__doc__": "A pool's settings and its techniques (model.features.POOL_OPTIONS)."})


@dataclass(frozen=True)
class AppArgs:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    default_size: str = "256x256"
    default_steps: int = DEFAULT_STEPS
    default_guidance: float = 3.5
    # The tier of a request that asks for none, "auto" or "standard".
    default_quality: str = "lossless"
    max_batch_size: int = 4
    batch_wait_timeout_s: float = 0.05
    # Images a pool queues beyond what its replicas hold; past it the ingress sheds with 503 + Retry-After instead
    # of queueing without bound. -1: no bound.
    max_queued_requests: int = 64
    # Ingress-side deadline for one request (504 after it); a request may ask for less.
    request_timeout_s: float = 300.0
    # A file of API keys (one per line; blank lines and '#' comments ignored). Set, every route but /healthz needs
    # `Authorization: Bearer <key>`. Keys stay out of the config (Serve shows deployment args): the config names a
    # file, or the environment does (FLUXSERVE_API_KEYS_FILE, used when this is unset).
    api_keys_file: str | None = None
    # response_format "url": images are kept this long (seconds) and served at /v1/images/files/<id>; at most
    # image_url_max_bytes are kept (the oldest go first). 0: no image is kept and "url" is a 400.
    image_url_ttl_s: float = 3600.0
    image_url_max_bytes: int = 256 * 1024 * 1024
    # LoRA adapters every replica loads once at start: name -> local .safetensors file (a format diffusers' FLUX
    # LoRA loader reads). A request picks some by name with scales (`"lora": [{"name": ..., "scale": ...}]`).
    # The feature table says what adapters run with (`python -m model features`).
    loras: dict[str, str] = field(default_factory=dict)
    # With exactly one adapter in `loras`: fuse it into the weights once per replica (scale 1). The adapter is then
    # part of the model: every image uses it, requests name no adapter, a step costs what the base model's does,
    # and the high pool converts (fp8 / fused projections) as without adapters.
    fuse_lora: bool = False
    # A folder of adapter files that `POST /v1/adapters` may load while the app serves (by file name relative to it;
    # nothing outside it). None: the adapter API is off. Set, the pools serve per-request adapters (the feature
    # table's `lora` rules), even with none loaded yet.
    lora_dir: str | None = None
    limits: Limits = field(default_factory=Limits)
    # A folder every replica and TP rank keeps its built kernels in (Triton's compiled kernels and autotuning,
    # Inductor's caches, cuDNN's plans: kernels/cache.py), so a restarted replica warms from disk. None: each
    # library's own default (cuDNN plans then in memory only). The KubeRay manifest mounts a volume there.
    kernel_cache_dir: str | None = None
    # The pools' defaults are applied in one place, `parse` (HIGH_DEFAULTS where each pool's settings admit them).
    pools: dict[str, PoolArgs] = field(default_factory=lambda: AppArgs.parse({}).pools)

    @staticmethod
    def parse(raw: dict[str, Any] | None) -> "AppArgs":
        """Build from the YAML `args:` mapping; unknown keys are an error (typos must not pass silently)."""
        raw = dict(raw or {})
        _reject_unknown(raw, AppArgs, "args")
        limits_raw = raw.pop("limits", None) or {}
        _reject_unknown(limits_raw, Limits, "args.limits")
        pools_raw = raw.pop("pools", None) or {}
        unknown_pools = set(pools_raw) - set(QUALITIES)
        if unknown_pools:
            raise ValueError(f"args.pools: unknown pool(s) {sorted(unknown_pools)}; pools are {QUALITIES}")
        _check_loras(raw.get("loras"), raw.get("fuse_lora", False), raw.get("lora_dir"))
        app_on = app_techniques(raw)
        device = str(raw.get("device", "cpu"))
        pools: dict[str, PoolArgs] = {}
        for q in QUALITIES:
            given = pools_raw.get(q) or {}
            _reject_unknown(given, PoolArgs, f"args.pools.{q}")
            pool = PoolArgs(**{"batch_invariant": q == "lossless", **given})
            if not isinstance(pool.tp, int) or pool.tp < 1:
                raise ValueError(f"args.pools.{q}.tp must be an integer >= 1, got {pool.tp!r}")
            if pool.compile_sizes is not None and not isinstance(pool.compile_sizes, list):
                raise ValueError(f"args.pools.{q}.compile_sizes must be a list of 'WxH', got {pool.compile_sizes!r}")
            for f in POOL_OPTIONS:
                _check_option_type(f, getattr(pool, f.key), q)
            pools[q] = _with_defaults(pool, q, given, app_on, device)
            on = standing_in(pools[q].techniques() | app_on)
            for name in (f.name for f in FEATURES if f.name in on):
                reason = refusal(name, pool=q, tp=pool.tp, device=device, on=on)
                if reason is not None:
                    raise ValueError(reason)
        args = AppArgs(limits=Limits(**limits_raw), pools=pools, **raw)
        for f in fields(Limits):
            value = getattr(args.limits, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"args.limits.{f.name} must be a number > 0, got {value!r}")
        if args.limits.max_input_pixels > MAX_INPUT_PIXELS:  # the pipeline decodes edit inputs with that ceiling
            raise ValueError(f"args.limits.max_input_pixels may lower the input-image ceiling, not raise it: at most "
                             f"{MAX_INPUT_PIXELS}, got {args.limits.max_input_pixels}")
        if args.default_quality not in QUALITIES:
            raise ValueError(f"args.default_quality must be one of {QUALITIES}, got {args.default_quality!r}")
        if args.dtype not in DTYPES:
            raise ValueError(f"args.dtype must be one of {DTYPES}, got {args.dtype!r}")
        if args.max_queued_requests != -1 and args.max_queued_requests < 1:
            raise ValueError(f"args.max_queued_requests must be >= 1 or -1, got {args.max_queued_requests}")
        if args.max_batch_size < 1:
            raise ValueError("args.max_batch_size must be >= 1")
        if args.image_url_ttl_s < 0 or args.image_url_max_bytes < 1:
            raise ValueError("args.image_url_ttl_s must be >= 0 and args.image_url_max_bytes >= 1")
        if args.request_timeout_s <= 0:
            raise ValueError("args.request_timeout_s must be > 0")
        # default_size is what a request without `size` gets: check it against the same limits a request's size
        # meets, now, rather than answer every such request with a 400.
        try:
            args.limits.check_size(str(args.default_size))
        except BadRequest as exc:
            raise ValueError(f"args.default_size: {exc.message}") from None
        for q in pools:
            warm_plan(args, q)  # its sizes parse
        return args

    def load_api_keys(self) -> frozenset[str]:
        """The API keys to require (empty: no auth). A named file that cannot be read is an error, not "no auth"."""
        path = self.api_keys_file or os.environ.get(API_KEYS_ENV)
        if not path:
            return frozenset()
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as exc:
            raise ValueError(f"API keys file {path!r}: {exc.strerror}") from None
        keys = frozenset(ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#"))
        if not keys:
            raise ValueError(f"API keys file {path!r} holds no key")
        return keys

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def form(self, pool: str) -> ServingForm:
        """What a replica of `pool` is built into (model.build.build_pipeline), every rank alike."""
        p = self.pools[pool]
        sizes, batch_sizes = warm_plan(self, pool)
        fused = next(iter(self.loras)) if self.fuse_lora else None
        return ServingForm(model=self.model, device=self.device, dtype=self.dtype,
                           kernel_cache_dir=self.kernel_cache_dir,
                           loras=tuple(self.loras.items()), fused_lora=None if fused is None else (fused, 1.0),
                           warm_sizes=tuple(sizes), warm_batch_sizes=tuple(batch_sizes),
                           warm_quality=pool if p.warm_up else None,
                           **{f.name: getattr(p, f.key) for f in POOL_OPTIONS})


API_KEYS_ENV = "FLUXSERVE_API_KEYS_FILE"


def warm_plan(args: AppArgs, pool: str) -> tuple[list[tuple[int, int]], list[int]]:
    """((height, width) sizes, batch sizes) a replica of `pool` warms up at start: every pipeline call it can make
    at its configured sizes."""
    p = args.pools[pool]
    sizes = [parse_size(s, f"args.pools.{pool}.compile_sizes") for s in (p.compile_sizes or [args.default_size])]
    # A batch-invariant pool runs one request per pipeline call; otherwise a call holds 1..max_batch_size.
    top = 1 if p.batch_invariant else args.max_batch_size
    return sizes, list(range(1, top + 1))


def parse_size(size: str, where: str = "size") -> tuple[int, int]:
    """A config "WxH" -> (height, width); ValueError naming `where` otherwise."""
    try:
        return parse_request_size(str(size), where)
    except SizeError as exc:
        raise ValueError(f"{where}: expected 'WxH' ({exc})") from None


def _check_option_type(f: Feature, value: Any, pool: str) -> None:
    """A pool option has its feature's type: true/false, or a threshold (a number, null for off)."""
    if f.option_type is bool and not isinstance(value, bool):
        raise ValueError(f"{f.where_in(pool)} must be true or false, got {value!r}")
    if f.option_type is float and value is not None:
        error = step_cache_error(value)
        if error is not None:
            raise ValueError(f"{f.where_in(pool)} {error} (or null)")
    if f.option_type is int and value is not None:
        error = adapter_rank_error(value)
        if error is not None:
            raise ValueError(f"{f.where_in(pool)} {error} (or null)")


def _with_defaults(pool: PoolArgs, name: str, given: dict[str, Any], app_on: frozenset[str],
                   device: str) -> PoolArgs:
    """The high pool with `high`'s default techniques on where the pool does not set them, its other settings admit
    them (model.features.refusal) and the techniques each was measured with are on."""
    if name != "high":
        return pool
    for f in FEATURES:
        if not f.high_default or f.key in given:
            continue
        on = standing_in(pool.techniques() | app_on)
        if all(d in on for d in f.default_with) and refusal(f.name, pool=name, tp=pool.tp, device=device,
                                                             on=on) is None:
            pool = replace(pool, **{f.key: True})
    return pool


def pool_refusal(args: AppArgs, pool: str, name: str, subject: str | None = None) -> str | None:
    """Why pool `pool` of a parsed config cannot run technique `name` (e.g. asked for by a request), or None."""
    p = args.pools[pool]
    on = standing_in(p.techniques() | app_techniques(vars(args)))  # (no deep copy of the args per request)
    return refusal(name, pool=pool, tp=p.tp, device=args.device, on=on, subject=subject)


# An adapter name, in args.loras and through the API
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _check_loras(loras: Any, fuse: Any = False, lora_dir: Any = None) -> None:
    if not isinstance(fuse, bool):
        raise ValueError(f"args.fuse_lora must be true or false, got {fuse!r}")
    if lora_dir is not None:
        if not isinstance(lora_dir, str) or not lora_dir:
            raise ValueError(f"args.lora_dir must be a folder path, got {lora_dir!r}")
        if fuse:
            raise ValueError("args.lora_dir and args.fuse_lora exclude each other: a fused adapter is part of the "
                             "weights, and adapters loaded at runtime need the unfused layers; choose one")
    if fuse and (not isinstance(loras, dict) or len(loras) != 1):
        raise ValueError(f"args.fuse_lora needs exactly one adapter in args.loras, got {loras!r}")
    if loras is None:
        return
    if not isinstance(loras, dict):
        raise ValueError(f"args.loras must map adapter names to .safetensors files, got {loras!r}")
    for name, path in loras.items():
        if not isinstance(name, str) or not ADAPTER_NAME.match(name):
            raise ValueError(f"args.loras: adapter name {name!r} must be 1-64 of letters, digits, '_', '.', '-'")
        if not isinstance(path, str) or not path:
            raise ValueError(f"args.loras.{name} must be a file path, got {path!r}")


def _reject_unknown(raw: dict[str, Any], cls: type, where: str) -> None:
    known = {f.name for f in fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
