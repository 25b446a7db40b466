"""Application arguments (the `args:` block of serve_config.yaml), parsed once by the builder.

Kept free of Ray and torch imports so the ingress and the tests can use it cheaply.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from deployments.errors import BadRequest
from model.request import (DEFAULT_MODEL, DEFAULT_STEPS, DTYPES, HIGH_DEFAULTS, QUALITIES, SizeError,
                           step_cache_error)
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
    max_lora_scale: float = 8.0  # |scale| of each

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
class PoolArgs:
    """One pool of FluxReplica: `tp` ranks per replica, each reserving `rank_resources`."""

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
    # High pool only (tp == 1): run the transformer blocks through torch.compile (regional, dynamic=False),
    # compiled at replica start for `compile_sizes` ("WxH"; default: [default_size]) at every batch size up to
    # max_batch_size, so no request pays compilation. The lossless pool refuses it: compiled kernels round
    # differently, and lossless must stay byte-identical to eager diffusers.
    compile: bool = False
    compile_sizes: list[str] | None = None
    # High pool only: LayerNorm + AdaLN modulation and QK RMSNorm + RoPE through their fast kernels (CUDA
    # fp16/bf16; not bit-exact: bench/results/e2e-h200-high-variants.md and high-h200.md give speed and PSNR/SSIM).
    # On by default for the high pool (AppArgs.parse); the lossless pool refuses it.
    fast_norm: bool = False
    # High pool only: 8-bit attention: cuDNN's fp8 attention where it applies (Hopper, nvidia-cudnn-frontend, head
    # size 128; kernels.attention.cudnn_fp8_refusal), else the Triton int8 Q K^T / fp8 P V kernel (CUDA fp16/bf16,
    # head size 32, 64 or 128), else SDPA. Not bit-exact: speed and PSNR/SSIM in bench/results/high-h200.md.
    # On by default for the high pool with cuda_graphs (tp 1, not compiled: AppArgs.parse; it does not run
    # compiled); there a request's step cache runs eager, and without attention8 (model.tiers.plan_tier). The
    # lossless pool refuses it.
    attention8: bool = False
    # Either pool (tp == 1, device cuda): replay each transformer step from a CUDA graph, captured on the first
    # request of each batch size / resolution (removes the host launch gaps; bit-identical, so lossless stays
    # byte-identical to diffusers). Not with compile: a compiled high batch never replays graphs.
    cuda_graphs: bool = False
    # High pool only (tp == 1, not with compile): the transformer converted once at replica start and held in
    # that form (the replica then serves high only). fused_projections: q/k/v (+ the single block's MLP
    # up-projection) as one GEMM each. fp8: e4m3 linear layers with per-channel weight and per-row activation
    # scales (CUDA, compute capability >= 8.9, bf16; elsewhere refused with a warning and bf16 kept). Not bit-exact;
    # speed and PSNR/SSIM per technique: bench/results/high-h200.md. On by default for the high pool where tp is 1
    # and compile is off (AppArgs.parse).
    fused_projections: bool = False
    fp8: bool = False
    # High pool only: First-Block-Cache (a step whose first block's residual changed by less than this fraction
    # since the last computed step reuses that step's residual of the other blocks). Not bit-exact; off (null) by
    # default: its quality can only be judged on trained weights. Not with cuda_graphs. A request may set its own
    # (`step_cache`: 0 computes every step) where the pool could run one (`step_cache_refusal`).
    step_cache_threshold: float | None = None

    @property
    def ranks_share_gpu(self) -> bool:
        """tp > 1 ranks that each take a fraction of a GPU (several ranks on one device)."""
        return self.tp > 1 and 0 < float(self.rank_resources.get("GPU", 0)) < 1


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
    # Not with tp > 1 or compile yet; the high pool then keeps its linears unconverted (no fp8 / fused projections).
    loras: dict[str, str] = field(default_factory=dict)
    # With exactly one adapter in `loras`: fuse it into the weights once per replica (scale 1). The adapter is then
    # part of the model: every image uses it, requests name no adapter, a step costs what the base model's does,
    # and the high pool converts (fp8 / fused projections) as without adapters.
    fuse_lora: bool = False
    limits: Limits = field(default_factory=Limits)
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
        pools: dict[str, PoolArgs] = {}
        for q in QUALITIES:
            given = pools_raw.get(q) or {}
            # HIGH_DEFAULTS are on for the high pool where its other settings admit them: the converted form where
            # tp is 1, it is not compiled and carries no unfused LoRAs (asked for explicitly elsewhere, it is an
            # error below); 8-bit attention where it was measured fast, with steps replayed from CUDA graphs (an
            # eager run of it was slow: bench/results/e2e-h200-high-default.md); the fast norms anywhere (off CUDA
            # fp16/bf16 the exact kernels run).
            measured_form = q == "high" and given.get("tp", 1) == 1 and not given.get("compile", False)
            convert = measured_form and (not raw.get("loras") or bool(raw.get("fuse_lora")))
            admits = {"fused_projections": convert, "fp8": convert, "fast_norm": q == "high",
                      "attention8": measured_form and bool(given.get("cuda_graphs", False))}
            p = {"batch_invariant": q == "lossless", **{k: k in HIGH_DEFAULTS and ok for k, ok in admits.items()},
                 **given}
            _reject_unknown(p, PoolArgs, f"args.pools.{q}")
            pool = PoolArgs(**p)
            if not isinstance(pool.tp, int) or pool.tp < 1:
                raise ValueError(f"args.pools.{q}.tp must be an integer >= 1, got {pool.tp!r}")
            _check_compile(pool, q)
            _check_high_only_switch(pool, q, "fast_norm")
            _check_high_only_switch(pool, q, "attention8")
            for key in ("fused_projections", "fp8"):
                _check_high_only_switch(pool, q, key)
                if getattr(pool, key) and pool.tp != 1:
                    raise ValueError(f"args.pools.{q}.{key} is not supported with tp > 1 yet (got tp={pool.tp}): the "
                                     "sharded layers are not converted")
            for key in ("fused_projections", "fp8", "attention8"):
                if getattr(pool, key) and pool.compile:
                    raise ValueError(f"args.pools.{q}.{key} and compile exclude each other: compiled, the converted "
                                     "form's kernels and 8-bit attention give way to Inductor's passes and SDPA, "
                                     "measured slower (bench/results/high-h200.md); choose one")
            _check_cuda_graphs(pool, q)
            _check_step_cache(pool, q)
            pools[q] = pool
        _check_loras(raw.get("loras"), pools, raw.get("fuse_lora", False))
        args = AppArgs(limits=Limits(**limits_raw), pools=pools, **raw)
        for q, pool in pools.items():
            if pool.cuda_graphs and not str(args.device).startswith("cuda"):
                raise ValueError(f"args.pools.{q}.cuda_graphs needs device: cuda (got device: {args.device!r}); "
                                 "CUDA graphs cannot run on the CPU")
        for q, pool in pools.items():
            for size in args.compile_sizes(q):
                parse_size(size, f"args.pools.{q}.compile_sizes")
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

    def compile_sizes(self, pool: str) -> list[str]:
        """The "WxH" sizes a compiled pool warms up at start ([] when the pool does not compile)."""
        p = self.pools[pool]
        if not p.compile:
            return []
        return list(p.compile_sizes) if p.compile_sizes else [self.default_size]


API_KEYS_ENV = "FLUXSERVE_API_KEYS_FILE"

# Shapes do not depend on the step count; 2 steps also exercise the second call of each graph.
COMPILE_WARMUP_STEPS = 2


def compile_warmup_plan(args: AppArgs, pool: str) -> tuple[list[tuple[int, int]], list[int]]:
    """((height, width) sizes, batch sizes) a compiled pool must warm up: every pipeline call it can make."""
    sizes = [parse_size(s, f"args.pools.{pool}.compile_sizes") for s in args.compile_sizes(pool)]
    # A batch-invariant pool runs one request per pipeline call; otherwise a call holds 1..max_batch_size.
    top = 1 if args.pools[pool].batch_invariant else args.max_batch_size
    return sizes, list(range(1, top + 1))


def parse_size(size: str, where: str = "size") -> tuple[int, int]:
    """A config "WxH" -> (height, width); ValueError naming `where` otherwise."""
    try:
        return parse_request_size(str(size), where)
    except SizeError as exc:
        raise ValueError(f"{where}: expected 'WxH' ({exc})") from None


def _check_compile(pool: PoolArgs, name: str) -> None:
    if not isinstance(pool.compile, bool):
        raise ValueError(f"args.pools.{name}.compile must be true or false, got {pool.compile!r}")
    if not pool.compile:
        return
    if name != "high":
        raise ValueError(f"args.pools.{name}.compile: torch.compile is for the high pool only; the {name} pool "
                         "must stay byte-identical to eager diffusers")
    if pool.tp != 1:
        raise ValueError(f"args.pools.{name}.compile is not supported with tp > 1 (got tp={pool.tp})")
    if pool.compile_sizes is not None and not isinstance(pool.compile_sizes, list):
        raise ValueError(f"args.pools.{name}.compile_sizes must be a list of 'WxH', got {pool.compile_sizes!r}")


def _check_high_only_switch(pool: PoolArgs, name: str, key: str) -> None:
    value = getattr(pool, key)
    if not isinstance(value, bool):
        raise ValueError(f"args.pools.{name}.{key} must be true or false, got {value!r}")
    if value and name != "high":
        raise ValueError(f"args.pools.{name}.{key} is for the high pool only: it is not bit-exact, and the {name} "
                         "pool must stay byte-identical to eager diffusers")


def _check_cuda_graphs(pool: PoolArgs, name: str) -> None:
    if not isinstance(pool.cuda_graphs, bool):
        raise ValueError(f"args.pools.{name}.cuda_graphs must be true or false, got {pool.cuda_graphs!r}")
    if not pool.cuda_graphs:
        return
    if pool.tp != 1:
        raise ValueError(f"args.pools.{name}.cuda_graphs is not supported with tp > 1 (got tp={pool.tp}): the "
                         "ranks' collectives are not captured")
    if pool.compile:
        raise ValueError(f"args.pools.{name}: cuda_graphs and compile exclude each other (a compiled batch never "
                         "replays graphs); choose one")


_LORA_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _check_loras(loras: Any, pools: dict[str, PoolArgs], fuse: Any = False) -> None:
    if not isinstance(fuse, bool):
        raise ValueError(f"args.fuse_lora must be true or false, got {fuse!r}")
    if fuse and (not isinstance(loras, dict) or len(loras) != 1):
        raise ValueError(f"args.fuse_lora needs exactly one adapter in args.loras, got {loras!r}")
    if loras is None:
        return
    if not isinstance(loras, dict):
        raise ValueError(f"args.loras must map adapter names to .safetensors files, got {loras!r}")
    for name, path in loras.items():
        if not isinstance(name, str) or not _LORA_NAME.match(name):
            raise ValueError(f"args.loras: adapter name {name!r} must be 1-64 of letters, digits, '_', '.', '-'")
        if not isinstance(path, str) or not path:
            raise ValueError(f"args.loras.{name} must be a file path, got {path!r}")
    if not loras:
        return
    for q, pool in pools.items():
        if pool.tp != 1:
            raise ValueError(f"args.loras is not supported with tp > 1 yet (pool {q} has tp={pool.tp})")
        if pool.compile:
            raise ValueError(f"args.loras is not supported with compile yet (pool {q})")
        if pool.cuda_graphs and not fuse:
            raise ValueError(f"args.loras: pool {q} has cuda_graphs on; a captured step would replay the adapter set "
                             "it was captured with. Turn cuda_graphs off for per-request adapters, or fuse the one "
                             "adapter (fuse_lora)")
        if (pool.fp8 or pool.fused_projections) and not fuse:
            raise ValueError(f"args.loras: pool {q} has fp8 / fused_projections on, which convert the linears the "
                             "adapters wrap; turn them off for a deployment that serves LoRAs, or fuse its one adapter (fuse_lora)")


def step_cache_refusal(pool: PoolArgs, name: str) -> str | None:
    """Why pool `name` cannot run a First-Block step cache, set in its config or asked for by a request; or None."""
    if name != "high":
        return (f"the step cache is for the high pool only: skipped steps are not bit-exact, and the {name} pool "
                "must stay byte-identical to eager diffusers")
    if pool.tp != 1:
        return (f"the step cache is not supported with tp > 1 yet (pool {name} has tp={pool.tp}): every rank would "
                "have to take the same skip decision")
    return None


def _check_step_cache(pool: PoolArgs, name: str) -> None:
    t = pool.step_cache_threshold
    if t is None:
        return
    error = step_cache_error(t)
    if error is not None:
        raise ValueError(f"args.pools.{name}.step_cache_threshold {error} (or null)")
    refusal = step_cache_refusal(pool, name)
    if refusal is not None:
        raise ValueError(f"args.pools.{name}.step_cache_threshold: {refusal}")


def _reject_unknown(raw: dict[str, Any], cls: type, where: str) -> None:
    known = {f.name for f in fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
