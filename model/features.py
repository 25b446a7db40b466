"""Every technique a replica can run, declared once: the feature table.

A row says what the technique is (exact or not, for the replica's lifetime or per batch), where it runs, what it
cannot run with, whether a replica at tp > 1 admits it and whether `high` turns it on by default. The config's
refusals and defaults (`deployments/config.py`), `HIGH_DEFAULTS`, the tier plan's checks (`model/tiers.py`), the
options table of the README and `python -m model features` all read this table; none of them names a technique.

Adding a technique: one row here, its implementation, its tests (ARCHITECTURE.md, "Add a technique").

Torch-free on purpose: the ingress and the config parser import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping

from model.request import _DTYPE_ALIASES, DTYPES  # the dtype names and their short forms, one place

Scope = Literal["replica", "batch"]


@dataclass(frozen=True)
class Feature:
    name: str
    summary: str
    # Bit-identical to eager diffusers: the lossless pool may run it. A non-exact technique is for `high` only.
    exact: bool
    # "replica": set up once when a replica starts (a converted transformer, compiled blocks, captured graphs, a
    # fused adapter); "batch": switched on and off around each batch.
    scope: Scope
    # Where a deployment sets it: "pool" (args.pools.<pool>.<option>), "app" (args.<option>, every pool), or None
    # (not an option: part of every high batch).
    where: Literal["pool", "app"] | None = None
    option: str | None = None  # the config key; defaults to `name`
    also: tuple[str, ...] = ()  # other app options that turn it on too
    option_type: type = bool  # bool; float for a threshold, int for a size (null: off)
    # Where it runs; elsewhere it is refused by the config ("config") or the sites stay on their exact kernels
    # ("exact"), or the replica keeps bf16 with a warning ("warn").
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = DTYPES
    elsewhere: Literal["config", "exact", "warn"] = "exact"
    # Other technique -> why the two cannot run in one pool (declared on one of the two rows).
    excludes: Mapping[str, str] = field(default_factory=dict)
    # None: a replica at tp > 1 admits it; else why it does not.
    tp_refusal: str | None = None
    # `high` turns it on by default where the pool's other settings admit it, and where every technique in
    # `default_with` is on too (it was measured fast only together with them).
    high_default: bool = False
    default_with: tuple[str, ...] = ()
    # On, it stands in for that technique (a fused adapter for per-request ones).
    instead_of: str | None = None
    # Switched per batch at module sites (kernels/sites.py, the group named after the technique).
    site: bool = False

    @property
    def key(self) -> str:
        return self.option or self.name

    def where_in(self, pool: str) -> str:
        """The config path a user sets it at, for messages."""
        return f"args.pools.{pool}.{self.key}" if self.where == "pool" else f"args.{self.key}"

    def runs_on(self, device: str, dtype: str) -> bool:
        """Whether its kernels run for a model on `device` ("cpu", "cuda", "cuda:1") in `dtype` (a DTYPES name)."""
        return device.split(":")[0] in self.devices and dtype in self.dtypes


_HALF = ("bfloat16", "float16")
_COMPILE_SLOWER = ("compiled, the converted form's kernels and 8-bit attention give way to Inductor's passes and SDPA, "
                   "measured slower (bench/results/high-h200.md)")

FEATURES: tuple[Feature, ...] = (
    Feature("gelu_sites", "Linear + tanh-GELU sites through the fused GEMM epilogue", exact=False, scope="batch",
            devices=("cuda",), dtypes=_HALF, site=True,
            excludes={"fp8": "fp8 layers take their GELU inside the quantization pass: no GELU sites to mount"}),
    Feature("fast_norm", "LayerNorm + AdaLN modulation and QK RMSNorm + RoPE through their single-pass fast kernels",
            exact=False, scope="batch", where="pool", devices=("cuda",), dtypes=_HALF, high_default=True, site=True),
    Feature("attention8", "8-bit attention: cuDNN's fp8 SDPA on Hopper, else the Triton int8 Q K^T / fp8 P V kernel",
            exact=False, scope="batch", where="pool", devices=("cuda",), dtypes=_HALF, high_default=True,
            default_with=("cuda_graphs",), site=True),
    Feature("fast_vae", "the VAE decode through a channels-last copy of the decoder, each GroupNorm and the SiLU after "
            "it in one pass", exact=False, scope="batch", where="pool", devices=("cuda",), dtypes=_HALF,
            high_default=True),
    Feature("fused_projections", "q/k/v (and the single block's MLP up-projection) as one GEMM each", exact=False,
            scope="replica", where="pool", high_default=True),
    Feature("fp8", "e4m3 linear layers: per-channel weight and per-row activation scales, torch._scaled_mm",
            exact=False, scope="replica", where="pool", devices=("cuda",), dtypes=("bfloat16",), elsewhere="warn",
            high_default=True),
    Feature("compile", "the transformer blocks through regional torch.compile, compiled at replica start",
            exact=False, scope="replica", where="pool",
            tp_refusal="not built: each block's in-place all-reduces would split its compiled region, and compiled "
                       "blocks measured slower than the served high form at tp 1 (bench/results/high-h200.md)",
            excludes={"fused_projections": _COMPILE_SLOWER, "fp8": _COMPILE_SLOWER, "attention8": _COMPILE_SLOWER,
                      "cuda_graphs": "a compiled batch never replays graphs"}),
    Feature("cuda_graphs", "each transformer step replayed from a CUDA graph (bit-identical to eager)", exact=True,
            scope="replica", where="pool", devices=("cuda",), elsewhere="config"),
    Feature("step_cache", "First-Block step cache: a step whose first block changed little reuses the rest's "
            "residual", exact=False, scope="batch", where="pool", option="step_cache_threshold", option_type=float),
    Feature("lora", "LoRA adapters loaded once (at start, or at runtime from `lora_dir`), switched on per batch as "
            "requests name them", exact=True, scope="batch", where="app", option="loras", option_type=dict,
            also=("lora_dir",),
            excludes={"compile": "LoRA under torch.compile is not built yet",
                      "fp8": "fp8 converts the linears the adapters wrap; fuse the one adapter (fuse_lora)",
                      "fused_projections": "fused projections convert the linears the adapters wrap; fuse the one "
                                           "adapter (fuse_lora)"}),
    Feature("fused_lora", "one adapter merged into the weights at start: part of the model, a step costs the base's",
            exact=True, scope="replica", where="app", option="fuse_lora", instead_of="lora",
            excludes={"compile": "LoRA under torch.compile is not built yet"}),
    Feature("adapter_slots", "the app's adapters served with the pool's converted layers (fp8, fused projections, "
            "sharded; inside each fp8 GEMM where they fit fp8): each image's adapters composed into fixed per-layer "
            "buffers before its batch, so a captured step replays for any adapters and a batch mixes them; the value "
            "is the rank one image may use",
            exact=False, scope="replica", where="pool", option="adapter_rank", option_type=int, instead_of="lora",
            excludes={"compile": "adapter buffers under torch.compile are not built",
                      "fused_lora": "a fused adapter leaves no per-request adapters to serve"}),
)

BY_NAME: dict[str, Feature] = {f.name: f for f in FEATURES}
POOL_OPTIONS: tuple[Feature, ...] = tuple(f for f in FEATURES if f.where == "pool")
HIGH_DEFAULTS: frozenset[str] = frozenset(f.name for f in FEATURES if f.high_default)


def is_on(value: Any) -> bool:
    """A technique's setting that turns it on: True, or a threshold that is set (0.0 included)."""
    return value is not None and value is not False


def feature(name: str) -> Feature:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown technique {name!r}; the feature table has {sorted(BY_NAME)}") from None


def app_techniques(options: Mapping[str, Any]) -> frozenset[str]:
    """The techniques that app-level options (`args:` keys -> values) turn on for every pool."""
    return standing_in({f.name for f in FEATURES if f.where == "app" and any(options.get(k) for k in (f.key, *f.also))})


def standing_in(on: Iterable[str]) -> frozenset[str]:
    """Techniques `on`, less those another of them stands in for (`instead_of`: a fused adapter, adapter slots)."""
    on = frozenset(on)
    return on - {f.instead_of for f in FEATURES if f.name in on}


def exclusion(a: str, b: str) -> str | None:
    """Why techniques `a` and `b` cannot run together (declared on either row), or None."""
    return feature(a).excludes.get(b) or feature(b).excludes.get(a)


def refusal(name: str, *, pool: str, tp: int, device: str, on: Iterable[str] = (),
            subject: str | None = None) -> str | None:
    """Why technique `name` cannot run in pool `pool` (a quality) at `tp` ranks on `device` beside the techniques
    `on`, as a message naming its config key (or `subject`, e.g. a request field); or None. The one rule the config,
    its defaults and the API apply."""
    f = feature(name)
    where = subject or f.where_in(pool)
    if not f.exact and pool != "high":
        return (f"{where} is for the high pool only: it is not bit-exact, and the {pool} pool must stay "
                "byte-identical to eager diffusers")
    if tp > 1 and f.tp_refusal is not None:
        return f"{where} is not supported with tp > 1 (got tp={tp}): {f.tp_refusal}"
    if f.elsewhere == "config" and device.split(":")[0] not in f.devices:
        return f"{where} needs device: {' or '.join(f.devices)} (got device: {device!r})"
    for other in (g.name for g in FEATURES if g.name in on):  # table order: the same message in every process
        if other != name:
            why = exclusion(name, other)
            if why is not None:
                return f"{where} and {feature(other).key} exclude each other: {why}; choose one"
    return None


_SHORT = {name: short for short, name in _DTYPE_ALIASES.items()}


def table_markdown() -> str:
    """The options table of the README (`python -m model features` prints it; a test keeps the README equal)."""
    rows = ["| technique | config | exact | scope | runs on | tp > 1 | high default | cannot run with |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in FEATURES:
        config = "always in high" if f.where is None else " or ".join(
            [f"`{f.where_in('<pool>')}`", *(f"`args.{k}`" for k in f.also)])
        dtypes = "" if f.dtypes == DTYPES else " " + "/".join(_SHORT[d] for d in f.dtypes)
        runs = ("any" if f.devices == ("cpu", "cuda") else "/".join(f.devices)) + dtypes
        default = ("yes" + (f" (with {', '.join(f.default_with)})" if f.default_with else "")) if f.high_default else "no"
        excluded = sorted({o for o in BY_NAME if o != f.name and exclusion(f.name, o)})
        rows.append(f"| `{f.name}`: {f.summary} | {config} | {'yes' if f.exact else 'no'} | {f.scope} | {runs} | "
                    f"{'yes' if f.tp_refusal is None else 'no: ' + f.tp_refusal} | {default} | "
                    f"{', '.join(excluded) or '-'} |")
    return "\n".join(rows) + "\n"


def as_dicts() -> list[dict[str, Any]]:
    """The table as plain values (`python -m model features --json`)."""
    return [{"name": f.name, "summary": f.summary, "exact": f.exact, "scope": f.scope, "config": f.where and f.key,
             "devices": list(f.devices), "dtypes": list(f.dtypes), "tp": f.tp_refusal is None,
             "tp_refusal": f.tp_refusal, "high_default": f.high_default, "default_with": list(f.default_with),
             "excludes": sorted(o for o in BY_NAME if o != f.name and exclusion(f.name, o))} for f in FEATURES]
