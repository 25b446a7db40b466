"""The high tier per technique on one GPU: transformer step time, end-to-end time, PSNR/SSIM against lossless.

One process, one set of weights (default: the flux-dev-random preset, FLUX.1-dev architecture, random bf16 weights:
PSNR/SSIM then measure numerical closeness, not image quality). Each variant is its own transformer (a deep copy
of ours, converted the way a high replica converts at start) inside the same diffusers pipeline components.

Step: one transformer forward at `--size` (4096 image + 512 text tokens at 1024^2), batch 1 and 2, variants
interleaved within each repeat, median of `--repeats` after warm-ups. End to end: prompt -> PNG for diffusers eager,
lossless and the high set (`--e2e-repeats`, interleaved); quality: one image per variant and step count, PSNR/SSIM of
its PNG against lossless's. A profile of the high set's step groups CUDA kernel time by family. `--torchao` adds the
outside yardstick (stock diffusers + torchao fp8 + regional compile) to the step loops, when torchao is installed.

  python bench/high.py --out bench/results/high-h200.json
  python bench/high.py --model tiny --device cpu --size 256 --steps 2 --repeats 1 --e2e-repeats 1  # dry run
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from unittest import mock
from typing import Any, Callable

import torch
from torch._dynamo.utils import counters

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernels.switches  # noqa: E402
from bench.e2e import _sync, pipeline_copy, timed  # noqa: E402
from bench.kernel_ops import rel  # noqa: E402
from model.linear import is_fp8  # noqa: E402
from model.loading import diffusers_reference, load_pipeline  # noqa: E402
from model.metrics import psnr, ssim  # noqa: E402
from model.pipeline import FluxServePipeline, GenerationRequest, md5, run_flux_pipeline  # noqa: E402
from model.tiers import applied_tier, plan_tier  # noqa: E402

PSNR_BAR_DB, SSIM_BAR = 30.0, 0.95


@dataclass(frozen=True)
class Variant:
    name: str
    fused_projections: bool = False
    fp8: bool = False
    fast_norm: bool = False
    cuda_graphs: bool = False
    mount_gelu: bool = True  # the current high tier's GELU sites (no effect where fp8 takes the GELU)
    step_cache: float | None = None  # First-Block-Cache threshold: end to end only (a single step never skips)
    norm_producer: bool = False  # fp8 forms: norms quantize their own output (switch fp8_norm_producer)
    attention8: bool = False  # 8-bit attention instead of SDPA (cuDNN fp8 where it applies, else the Triton kernel)
    fast_accum: bool = False  # fp8 forms: GEMMs without periodic fp32 promotion (switch fp8_fast_accum)
    fp8_adaln: bool = True  # fp8 forms: the AdaLN linears as weight-only fp8 layers (False: kept bf16)
    compiled: bool = False  # blocks through the pipeline's regional torch.compile (compiled before timing)
    attention8_cudnn: bool = True  # attention8 through cuDNN's fp8 SDPA where it applies (False: the Triton kernel)
    fast_vae: bool = False  # the VAE decode through its channels-last copy (end to end only)

    def switches(self) -> Any:
        """The kernel switches this variant sets around each of its calls (step and end to end)."""
        return kernels.switches.override(fp8_norm_producer=self.norm_producer, fp8_fast_accum=self.fast_accum,
                                         attention8_cudnn=self.attention8_cudnn)

    @property
    def form(self) -> tuple[bool, bool, bool]:
        """The lifetime form its transformer is converted to: (fused_projections, fp8, fp8 AdaLN)."""
        return self.fused_projections, self.fp8, self.fp8 and self.fp8_adaln


# The form a GPU high pool serves with cuda_graphs: model.features.HIGH_DEFAULTS, the fp8 switches at their defaults.
SERVED_HIGH = ("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + fast_accum + attention8 + cuda_graphs"
               " + fast_vae")

VARIANTS = [
    Variant("high (GELU sites)"),
    Variant("high + fast_norm", fast_norm=True),
    Variant("high + fused_projections", fused_projections=True),
    Variant("high + fp8", fp8=True),
    Variant("high + fp8 + fused_projections", fp8=True, fused_projections=True),
    Variant("high + fp8 + fused_projections + fast_norm", fp8=True, fused_projections=True, fast_norm=True),
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer", fp8=True, fused_projections=True,
            fast_norm=True, norm_producer=True),
    Variant("high + fp8 + fused_projections + fast_norm + cuda_graphs", fp8=True, fused_projections=True,
            fast_norm=True, cuda_graphs=True),
    Variant("high + attention8", attention8=True),
    Variant("high + fp8 + fused_projections + fast_norm + attention8", fp8=True, fused_projections=True,
            fast_norm=True, attention8=True),
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + attention8", fp8=True,
            fused_projections=True, fast_norm=True, norm_producer=True, attention8=True),
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + cuda_graphs", fp8=True,
            fused_projections=True, fast_norm=True, norm_producer=True, cuda_graphs=True),
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + attention8 + cuda_graphs", fp8=True,
            fused_projections=True, fast_norm=True, norm_producer=True, attention8=True, cuda_graphs=True),
    Variant("high + fp8 + fused_projections + step_cache 0.1", fp8=True, fused_projections=True, step_cache=0.1),
    Variant("high + fp8 (AdaLN bf16) + fused_projections + fast_norm + fp8_norm_producer + cuda_graphs", fp8=True,
            fused_projections=True, fast_norm=True, norm_producer=True, cuda_graphs=True, fp8_adaln=False),
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + fast_accum + cuda_graphs", fp8=True,
            fused_projections=True, fast_norm=True, norm_producer=True, fast_accum=True, cuda_graphs=True),
    Variant("high + fp8 + fused_projections + fast_accum", fp8=True, fused_projections=True, fast_accum=True),
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + fast_accum + attention8 + cuda_graphs",
            fp8=True, fused_projections=True, fast_norm=True, norm_producer=True, fast_accum=True, attention8=True,
            cuda_graphs=True),
    Variant(SERVED_HIGH, fp8=True, fused_projections=True, fast_norm=True, norm_producer=True, fast_accum=True,
            attention8=True, cuda_graphs=True, fast_vae=True),
    # torch.compile on top of the converted form: under a trace our kernels but the residual-gate add take their
    # eager twins (Inductor writes those passes); 8-bit attention does not run compiled, and a compiled batch replays
    # no CUDA graphs.
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + fast_accum", fp8=True,
            fused_projections=True, fast_norm=True, norm_producer=True, fast_accum=True),
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + fast_accum + compile", fp8=True,
            fused_projections=True, fast_norm=True, norm_producer=True, fast_accum=True, compiled=True),
    # The step cache on the served form: eager (how a graphed pool ran a cached batch before the blocks after the
    # first got their own graph), and graphed (first block eager, the rest replayed). End to end only.
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + fast_accum + step_cache 0.1", fp8=True,
            fused_projections=True, fast_norm=True, norm_producer=True, fast_accum=True, step_cache=0.1),
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + fast_accum + attention8 + cuda_graphs"
            " + step_cache 0.1", fp8=True, fused_projections=True, fast_norm=True, norm_producer=True, fast_accum=True,
            attention8=True, cuda_graphs=True, step_cache=0.1),
    # 8-bit attention without CUDA graphs (an eager end-to-end run of it was slow: bench/host_time.py asks why),
    # through cuDNN and through the Triton kernel.
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + fast_accum + attention8", fp8=True,
            fused_projections=True, fast_norm=True, norm_producer=True, fast_accum=True, attention8=True),
    Variant("high + fp8 + fused_projections + fast_norm + fp8_norm_producer + fast_accum + attention8 (Triton)",
            fp8=True, fused_projections=True, fast_norm=True, norm_producer=True, fast_accum=True, attention8=True,
            attention8_cudnn=False),
]


TORCHAO = "diffusers + torchao fp8 + compile"


def torchao_recipe(reference: Any) -> tuple[Any | None, str | None]:
    """The outside yardstick the issue names: stock diffusers' transformer (a copy of the reference's) with torchao's
    fp8 (dynamic per-row activation and per-row weight scales) and regional torch.compile of its repeated blocks
    (`compile_repeated_blocks(fullgraph=True)`; it compiles on its first call). (a stand-in with a `.transformer`,
    or None with the reason it cannot be built)."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as exc:
        return None, f"torchao is not installed ({exc})"
    try:
        transformer = copy.deepcopy(reference.transformer).requires_grad_(False)
        quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        transformer.compile_repeated_blocks(fullgraph=True)
    except Exception as exc:  # noqa: BLE001 - a yardstick that cannot be built is reported, not fatal
        return None, f"{type(exc).__name__}: {exc}"
    return SimpleNamespace(transformer=transformer), None


def build_variants(ours: FluxServePipeline, variants: list[Variant],
                   compile_plan: tuple[list[tuple[int, int]], list[int]] = ([], [])
                   ) -> tuple[dict[str, FluxServePipeline], dict[str, str]]:
    """One pipeline per variant. Variants of one form (fused_projections, fp8) share one transformer: the
    unconverted form is ours itself; each converted form is a deep copy of ours converted the way a high replica
    converts at start (fp8 forms first, while the least memory is held). Text encoders and VAE are shared. A
    compiled variant compiles for `compile_plan` ((height, width) sizes, batch sizes) as a compiled replica does."""
    forms: dict[tuple[bool, bool, bool], Any] = {(False, False, False): ours.pipe}
    errors: dict[str, str] = {}
    for key in sorted({v.form for v in variants} - {(False, False, False)}, key=lambda k: not k[1]):
        pipe = None
        try:
            pipe = pipeline_copy(ours)
            pipe.convert_for_high(fused_projections=key[0], fp8=key[1], fp8_adaln=key[2])
        except Exception as exc:  # a refused technique (e.g. fp8 on the CPU) is reported, not fatal
            errors[str(key)] = f"{type(exc).__name__}: {exc}"
            pipe = None  # the copy: freed before the next form is made
            gc.collect()
            continue
        forms[key] = pipe.pipe
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    built: dict[str, FluxServePipeline] = {}
    for v in variants:
        key = v.form
        if key not in forms:
            errors[v.name] = errors[str(key)]
            continue
        pipe = FluxServePipeline(forms[key], source=ours.source)
        # the converted copy's form, as its converting pipeline recorded it
        pipe.form = replace(pipe.form, fused_projections=key[0], fp8=key[1])
        pipe.fp8_layers = sum(is_fp8(m) for m in pipe.transformer.modules())
        pipe.use(fast_norm=v.fast_norm, attention8=v.attention8, step_cache=v.step_cache, fast_vae=v.fast_vae)
        if v.cuda_graphs:
            pipe.enable_cuda_graphs()
        if v.compiled:
            try:
                with v.switches():
                    pipe.enable_compile(compile_plan[0], steps=2, batch_sizes=compile_plan[1])
            except Exception:
                errors[v.name] = traceback.format_exc()[-2000:]
                continue
            print(f"variant {v.name!r} compiled in {pipe.compile_warmup_s:.1f}s", flush=True)
        built[v.name] = pipe
    return built, {k: e for k, e in errors.items() if not k.startswith("(")}


def step_inputs(pipe: FluxServePipeline, batch: int, size: int, text_tokens: int) -> dict[str, Any]:
    cfg = pipe.transformer.config
    dev, dt = pipe.device, pipe.dtype
    g = torch.Generator(device="cpu").manual_seed(batch)
    side = size // 16
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return dict(
        hidden_states=torch.randn(batch, side * side, cfg.in_channels, generator=g).to(dev, dt),
        encoder_hidden_states=torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g).to(dev, dt),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(dev, dt),
        timestep=torch.full((batch,), 0.5).to(dev, dt),
        guidance=torch.full((batch,), 3.5, device=dev) if cfg.guidance_embeds else None,
        txt_ids=torch.zeros(text_tokens, 3, device=dev),
        img_ids=torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(-1, 3).float().to(dev),
        return_dict=False,
    )


def _forwards(transformer: Any, inputs: dict[str, Any], calls: int) -> Any:
    """`calls` forwards back to back; the last one's output."""
    for _ in range(calls):
        out = transformer(**inputs)
    return out


def step_fn(pipe: FluxServePipeline | Any, v: Variant | None, inputs: dict[str, Any],
            calls: int = 1) -> Callable[[], Any]:
    """`calls` transformer forwards under the variant's plan, entered once (None: a stock module, called as is). One
    call per entry times a step with the batch's setup; several time steps the way a batch runs them."""
    transformer = pipe.transformer
    if v is None:
        return lambda: _forwards(transformer, inputs, calls)
    plan = pipe.plan("high", compiled=v.compiled, cuda_graphs=v.cuda_graphs)
    if not v.mount_gelu:
        plan = plan_tier("high", fast_norm=plan.fast_norm, attention8=plan.attention8, cuda_graphs=plan.cuda_graphs,
                         fp8=plan.fp8, fused_projections=plan.fused_projections, compiled=plan.compiled)

    def call() -> Any:
        with v.switches(), applied_tier(transformer, plan, block_runners=pipe.block_runners,
                                        step_graphs=pipe.step_graphs):
            return _forwards(transformer, inputs, calls)

    return call


def lossless_step_fn(pipe: FluxServePipeline, inputs: dict[str, Any], calls: int = 1,
                     graphs: bool = False) -> Callable[[], Any]:
    """Lossless forwards, eager or (graphs: the pipeline's CUDA graphs on) replayed as the lossless pool serves."""
    plan = pipe.plan("lossless", compiled=False, cuda_graphs=graphs)

    def call() -> Any:
        with applied_tier(pipe.transformer, plan, step_graphs=pipe.step_graphs if graphs else None):
            return _forwards(pipe.transformer, inputs, calls)

    return call


def time_outside_transformer(pipe: FluxServePipeline, fn: Callable[[], Any]) -> tuple[float, dict[str, float]]:
    """Seconds of one call of `fn` spent outside `pipe`'s transformer forwards, and how much of that went to the
    text encoders, the VAE decode, the decoded tensor to PIL images (`postprocess`: on the host) and the PNG encoding
    (`rest`: everything else: latents, scheduler, host copies).
    Each timed region is bracketed by a device synchronize, so the call runs a little slower than untimed."""
    import model.pipeline as pipeline_module

    inside: dict[str, float] = defaultdict(float)
    start: dict[str, float] = {}

    def pre(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            _sync()
            start[name] = time.perf_counter()
        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            _sync()
            inside[name] += time.perf_counter() - start[name]
        return hook

    def timed_call(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            pre(name)()
            try:
                return call(*a, **k)
            finally:
                post(name)()
        return wrapper

    inner = pipe.pipe
    modules = [("transformer", pipe.transformer), ("text_encoders", inner.text_encoder),
               ("text_encoders", inner.text_encoder_2)]
    hooks = [h for name, m in modules if m is not None
             for h in (m.register_forward_pre_hook(pre(name)), m.register_forward_hook(post(name)))]
    timed_calls = [(inner.vae, "decode", "vae_decode"), (inner.image_processor, "postprocess", "postprocess"),
                   (pipeline_module, "result_png", "png")]
    try:
        with ExitStack() as patched:
            for owner, attr, name in timed_calls:  # (an instance's method comes back as the class's after the block)
                patched.enter_context(mock.patch.object(owner, attr, timed_call(name, getattr(owner, attr))))
            total, _ = timed(fn)
    finally:
        for h in hooks:
            h.remove()
    outside = total - inside.pop("transformer", 0.0)
    parts = {k: inside.get(k, 0.0) for k in ("text_encoders", "vae_decode", "postprocess", "png")}
    parts["rest"] = outside - sum(parts.values())
    return outside, parts


def time_steps(fns: dict[str, Callable[[], Any]], warmup: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median / min / max ms per fn, interleaved; Dynamo graphs compiled meanwhile add to `recompiles_while_timing`
    (a compiled variant was compiled before: steady state compiles nothing)."""
    times: dict[str, list[float]] = defaultdict(list)
    graphs_before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for i in range(warmup + repeats):
            for name, fn in fns.items():
                t, _ = timed(fn)
                if i >= warmup:
                    times[name].append(t * 1000)
    counters["fluxserve"]["recompiles_while_timing"] += counters["stats"]["unique_graphs"] - graphs_before
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)} for k, v in times.items()}


def kernel_family(name: str) -> str:
    """The family a CUDA kernel's name belongs to (the profiles of bench/high.py and bench/step_timeline.py)."""
    name = name.lower()
    if "weight_only" in name:  # the AdaLN's weight-only fp8 GEMV (a Triton kernel)
        return "GEMM"
    if "quant_rows" in name or "ln_modulate_quant" in name:
        return "fp8 activation quantization (Triton)"
    if any(s in name for s in ("quantize_qkv", "tokens_fp8", "_dequant_kernel")):
        return "attention: 8-bit quantization (inputs, output)"
    if any(s in name for s in ("fmha", "flash", "attention", "sdpa", "cudnn")):
        return "attention"
    if any(s in name for s in ("gemm", "xmma", "cutlass", "nvjet", "matmul", "_mm_", "sm90", "cublas")):
        return "GEMM"
    if "triton" in name or name.startswith("_"):
        return "Triton fused glue (norms, RoPE, residual, GELU)"
    return "other (aten elementwise, copies, reductions)"


def kernel_times(fn: Callable[[], Any], runs: int = 1) -> dict[str, float]:
    """CUDA kernel time (ms per call of `fn`) by kernel name over `runs` calls, from torch.profiler (the kernels of
    CUDA-graph replays included where CUPTI reports them)."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        _sync()
    times: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if us:
            times[evt.key] += us / 1000.0 / runs
    return dict(times)


def kernel_families(fn: Callable[[], Any], runs: int = 3) -> dict[str, float]:
    """CUDA kernel time per step (ms) by family, from torch.profiler."""
    with torch.no_grad():
        fn()
        times = kernel_times(fn, runs)
    fam: dict[str, float] = defaultdict(float)
    for name, ms in times.items():
        fam[kernel_family(name)] += ms
    return dict(sorted(fam.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    from model import prompt_cache

    prompt_cache.disable_by_default()  # every timed call encodes its prompt, as diffusers does
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flux-dev-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, nargs="+", default=[28, 50], help="end-to-end step counts (quality)")
    ap.add_argument("--e2e-steps", type=int, default=50, help="step count of the end-to-end timing")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--e2e-repeats", type=int, default=3)
    ap.add_argument("--prompt", default="a photo of a red fox in fresh snow, golden hour, 35mm film")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-batch", type=int, default=8,
                    help="steps per plan entry for the in-batch step time (0: skip it)")
    ap.add_argument("--only", nargs="+", default=None, help="variant names to run (default: all)")
    ap.add_argument("--high-set", default=SERVED_HIGH,
                    help="the variant reported as `high` (default: the form a GPU high pool with cuda_graphs runs: "
                         "model.features.HIGH_DEFAULTS, with the fp8 switches on by default, graphed)")
    ap.add_argument("--torchao", action="store_true",
                    help=f"also time `{TORCHAO}` in the same loops (compiles for minutes on its first calls)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "high-h200.json"))
    args = ap.parse_args(argv)
    command = "python bench/high.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    dtype = torch.bfloat16

    build_s, ours = timed(lambda: load_pipeline(args.model, device=args.device, dtype=dtype))
    reference = diffusers_reference(ours)
    text_tokens = min(512, ours.pipe.tokenizer_2.model_max_length)
    print(f"built {args.model} in {build_s:.1f}s", flush=True)

    chosen = [v for v in VARIANTS if args.only is None or v.name in args.only]
    if args.only is not None and len(chosen) != len(set(args.only)):
        raise SystemExit(f"--only: unknown variant(s) {sorted(set(args.only) - {v.name for v in chosen})}")
    variants, errors = build_variants(ours, chosen, ([(args.size, args.size)], args.batches))
    for name, err in errors.items():
        print(f"variant {name!r} not built: {err}", flush=True)
    by_name = {v.name: v for v in chosen}
    yardstick = None
    if args.torchao:
        yardstick, why = torchao_recipe(reference)
        if why is not None:
            errors[TORCHAO] = why
            print(f"{TORCHAO} not built: {why}", flush=True)
    if torch.cuda.is_available():
        print(f"memory allocated: {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)

    # -- transformer step ----------------------------------------------------------------------------------------
    step: dict[str, Any] = {}
    torchao_compile_s: dict[str, float] = {}
    for batch in args.batches:
        fns: dict[str, Callable[[], Any]] = {}
        inputs = step_inputs(ours, batch, args.size, text_tokens)
        fns["diffusers"] = step_fn(reference, None, inputs)
        if yardstick is not None:
            fns[TORCHAO] = step_fn(yardstick, None, inputs)
            try:  # its first calls compile (no autograd: inference): timed apart, outside the loop's warm-ups
                with torch.no_grad():
                    torchao_compile_s[f"batch{batch}"], _ = timed(lambda: [fns[TORCHAO]() for _ in range(2)])
            except Exception:
                errors[f"{TORCHAO} batch {batch}"] = traceback.format_exc()[-2000:]
                del fns[TORCHAO]
        fns["lossless"] = lossless_step_fn(ours, inputs)
        # the step as the lossless pool serves it: replayed from a CUDA graph (on a CPU dry run: eager, the same path)
        ours.enable_cuda_graphs()
        fns["lossless_graphs"] = lossless_step_fn(ours, inputs, graphs=True)
        for name, pipe in variants.items():
            if by_name[name].step_cache is None:
                fns[name] = step_fn(pipe, by_name[name], inputs)
        try:
            step[f"batch{batch}"] = time_steps(fns, args.warmup, args.repeats)
        except Exception:
            errors[f"step batch {batch}"] = traceback.format_exc()[-2000:]
            print(errors[f"step batch {batch}"], flush=True)
            continue
        for name, t in step[f"batch{batch}"].items():
            print(f"  step batch {batch}: {name}: {t['median_ms']:.2f} ms", flush=True)
        if args.in_batch > 0:  # steps as a batch runs them: the plan entered once for `in_batch` steps
            n = args.in_batch
            many = {"diffusers": step_fn(reference, None, inputs, n), "lossless": lossless_step_fn(ours, inputs, n)}
            if "lossless_graphs" in fns:
                many["lossless_graphs"] = lossless_step_fn(ours, inputs, n, graphs=True)
            if TORCHAO in fns:
                many[TORCHAO] = step_fn(yardstick, None, inputs, n)
            many.update({name: step_fn(variants[name], by_name[name], inputs, n) for name in fns if name in variants})
            try:
                for name, t in time_steps(many, 1, max(3, args.repeats // 2)).items():
                    step[f"batch{batch}"][name]["in_batch_ms"] = t["median_ms"] / n
                    print(f"  step batch {batch} within a batch: {name}: {t['median_ms'] / n:.2f} ms", flush=True)
            except Exception:
                errors[f"in-batch step batch {batch}"] = traceback.format_exc()[-2000:]
                print(errors[f"in-batch step batch {batch}"], flush=True)
        with torch.no_grad():  # closeness of one step's output to lossless, per variant
            base = fns["lossless"]()[0].float()
            if "lossless_graphs" in fns:  # a replayed step is the eager step, bit for bit
                step[f"batch{batch}"]["lossless_graphs"]["equal_to_eager"] = bool(
                    torch.equal(fns["lossless_graphs"]()[0].float(), base))
            for name in [n for n in [*variants, TORCHAO] if n in fns]:
                out = fns[name]()[0].float()
                step[f"batch{batch}"][name]["rel_err_vs_lossless"] = rel(out, base)

    # -- end to end: quality per variant and step count, timing of diffusers / lossless / the high set ------------
    def req(quality: str, steps: int) -> GenerationRequest:
        return GenerationRequest(args.prompt, height=args.size, width=args.size, steps=steps, seed=args.seed,
                                 quality=quality)

    def high_generate(pipe: FluxServePipeline, v: Variant, fast_vae: bool | None = None) -> Any:
        """The variant's high image; `fast_vae` given: with the VAE decode in that form instead of the variant's."""
        if fast_vae is not None:
            pipe.use(fast_vae=fast_vae)
        try:
            with v.switches():
                return pipe.generate([req("high", args.e2e_steps)], compiled=v.compiled)
        finally:
            pipe.use(fast_vae=v.fast_vae)

    quality: dict[str, dict[str, Any]] = defaultdict(dict)
    md5_equal: dict[int, bool] = {}
    for steps in args.steps:
        lat_ref, png_ref = run_flux_pipeline(reference, [req("lossless", steps)])
        lossless = ours.generate([req("lossless", steps)], cuda_graphs=False)[0]
        md5_equal[steps] = md5(png_ref[0]) == md5(lossless.png) and bool(torch.equal(lat_ref[0], lossless.latents))
        for name, pipe in variants.items():
            try:
                with by_name[name].switches():
                    r = pipe.generate([req("high", steps)], compiled=by_name[name].compiled)[0]
            except Exception:
                errors[f"e2e {name} {steps}"] = traceback.format_exc()[-2000:]
                continue
            p = psnr(r.png, lossless.png)
            quality[name][str(steps)] = {"psnr_db": None if math.isinf(p) else p, "ssim": ssim(r.png, lossless.png),
                                         "cached_steps": r.timings.get("cached_steps")}
            print(f"  quality {steps} steps: {name}: {quality[name][str(steps)]}", flush=True)

    high_name = args.high_set if args.high_set in variants else None
    e2e: dict[str, Any] = {}
    outside_s, outside_parts = None, {}
    if high_name is not None:
        ours.enable_cuda_graphs()  # for lossless_graphs; the other calls name cuda_graphs=False
        fns = {
            "diffusers": lambda: run_flux_pipeline(reference, [req("lossless", args.e2e_steps)]),
            "lossless": lambda: ours.generate([req("lossless", args.e2e_steps)], cuda_graphs=False),
            "high": lambda: high_generate(variants[high_name], by_name[high_name]),
            # the lossless pool's served form replays graphed steps (byte-identical: tests/test_graphs_gpu.py)
            "lossless_graphs": lambda: ours.generate([req("lossless", args.e2e_steps)], cuda_graphs=True),
        }
        if by_name[high_name].fast_vae:  # the same image with diffusers' VAE decode: what fast_vae saves
            fns["high_stock_vae"] = lambda: high_generate(variants[high_name], by_name[high_name], fast_vae=False)
        if yardstick is not None and TORCHAO not in errors:
            ao_pipe = type(reference)(**{**reference.components, "transformer": yardstick.transformer})
            fns[TORCHAO] = lambda: run_flux_pipeline(ao_pipe, [req("lossless", args.e2e_steps)])
        for name in variants:  # the step cache shows only end to end
            if by_name[name].step_cache is not None:
                fns[name] = (lambda n: lambda: high_generate(variants[n], by_name[n]))(name)
        times: dict[str, list[float]] = defaultdict(list)
        for i in range(1 + args.e2e_repeats):
            for name, fn in fns.items():
                t, _ = timed(fn)
                if i:
                    times[name].append(t)
        e2e = {k: statistics.median(v) for k, v in times.items()}
        print(f"  e2e {args.e2e_steps} steps: {e2e}", flush=True)
        outside = [time_outside_transformer(variants[high_name], fns["high"]) for _ in range(args.e2e_repeats)]
        outside_s = statistics.median(o for o, _ in outside)
        outside_parts = {k: statistics.median(parts[k] for _, parts in outside) for k in outside[0][1]}

    profile: dict[str, float] = {}
    profile_lossless: dict[str, float] = {}
    if high_name is not None and torch.cuda.is_available():
        inputs = step_inputs(ours, 1, args.size, text_tokens)
        try:
            profile = kernel_families(step_fn(variants[high_name], by_name[high_name], inputs))
            profile_lossless = kernel_families(lossless_step_fn(ours, inputs))
        except Exception:
            errors["profile"] = traceback.format_exc()[-2000:]

    b1 = step.get("batch1", {})
    techniques = []
    for v in chosen:
        row: dict[str, Any] = {"name": v.name, "fused_projections": v.fused_projections, "fp8": v.fp8,
                               "fast_norm": v.fast_norm, "cuda_graphs": v.cuda_graphs, "step_cache": v.step_cache,
                               "fp8_norm_producer": v.norm_producer, "attention8": v.attention8,
                               "fp8_fast_accum": v.fast_accum, "fp8_adaln": v.fp8 and v.fp8_adaln,
                               "compiled": v.compiled, "fast_vae": v.fast_vae}
        if v.compiled and v.name in variants:
            row["compile_warmup_s"] = variants[v.name].compile_warmup_s
        if v.name in e2e:
            row["e2e_s"] = e2e[v.name]
            row["e2e_speedup_vs_diffusers"] = e2e["diffusers"] / e2e[v.name]
        if v.name in errors:
            row["error"] = errors[v.name]
        for key, s in step.items():
            if v.name in s:
                row[f"step_ms_{key}"] = s[v.name]["median_ms"]
                row[f"speedup_vs_diffusers_{key}"] = s["diffusers"]["median_ms"] / s[v.name]["median_ms"]
                row[f"rel_err_vs_lossless_{key}"] = s[v.name].get("rel_err_vs_lossless")
                if "in_batch_ms" in s[v.name]:
                    row[f"step_ms_in_batch_{key}"] = s[v.name]["in_batch_ms"]
                    row[f"speedup_in_batch_vs_diffusers_{key}"] = (s["diffusers"]["in_batch_ms"]
                                                                   / s[v.name]["in_batch_ms"])
        row["quality"] = quality.get(v.name, {})
        q = row["quality"]
        row["meets_bar"] = bool(q) and all(
            (x["psnr_db"] is None or x["psnr_db"] >= PSNR_BAR_DB) and x["ssim"] >= SSIM_BAR for x in q.values())
        techniques.append(row)

    high_q = quality.get(high_name or "", {})
    last_steps = str(args.steps[-1])
    import diffusers

    result = {
        "model": args.model, "size": f"{args.size}x{args.size}", "steps": args.steps, "e2e_steps": args.e2e_steps,
        "torch": torch.__version__, "diffusers": diffusers.__version__, "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "random_weights": args.model.endswith("random") or args.model.startswith("tiny"),
        "high_set": high_name,
        "step_ms_diffusers": b1.get("diffusers", {}).get("median_ms"),
        "step_ms_lossless": b1.get("lossless", {}).get("median_ms"),
        "step_ms_high": b1.get(high_name or "", {}).get("median_ms"),
        "high_step_speedup": (b1["diffusers"]["median_ms"] / b1[high_name]["median_ms"]
                              if high_name in b1 else None),
        "step_ms_high_in_batch": b1.get(high_name or "", {}).get("in_batch_ms"),
        "high_step_speedup_in_batch": (b1["diffusers"]["in_batch_ms"] / b1[high_name]["in_batch_ms"]
                                       if "in_batch_ms" in b1.get(high_name or "", {}) else None),
        "in_batch_steps": args.in_batch,
        "step_ms_torchao_recipe": b1.get(TORCHAO, {}).get("median_ms"),
        "step_ms_torchao_recipe_in_batch": b1.get(TORCHAO, {}).get("in_batch_ms"),
        "high_vs_torchao_recipe_in_batch": (b1[TORCHAO]["in_batch_ms"] / b1[high_name]["in_batch_ms"]
                                            if "in_batch_ms" in b1.get(TORCHAO, {})
                                            and "in_batch_ms" in b1.get(high_name or "", {}) else None),
        "torchao_compile_s": torchao_compile_s,
        "recompiles_while_timing": counters["fluxserve"]["recompiles_while_timing"],
        "graph_breaks": dict(counters["graph_break"]),
        "high_e2e_speedup": e2e["diffusers"] / e2e["high"] if e2e else None,
        "e2e_s": e2e,
        "psnr_high_db": high_q.get(last_steps, {}).get("psnr_db"),
        "ssim_high": high_q.get(last_steps, {}).get("ssim"),
        "lossless_png_md5_equal": all(md5_equal.values()) if md5_equal else None,
        "lossless_equal_by_steps": md5_equal,
        "techniques": techniques,
        "step": step,
        "profile_high_step_ms_by_family": profile,
        "profile_lossless_step_ms_by_family": profile_lossless,
        "outside_transformer_s": outside_s,
        "outside_transformer_parts_s": outside_parts,
        "errors": errors,
        "repeats": args.repeats, "warmup": args.warmup, "e2e_repeats": args.e2e_repeats,
        "command": command,
    }
    result.update(perf_summary(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_markdown(out.with_suffix(".md"), result)
    print(out.with_suffix(".md").read_text())
    gc.collect()
    return 0 if result["lossless_png_md5_equal"] else 1


def perf_summary(r: dict[str, Any]) -> dict[str, Any]:
    """The figures the performance issue asks for, by its names, from one run's result: per-step times at batch 1,
    speed-ups against diffusers eager, end to end as the pools serve (lossless graphed), and the seconds of a `high`
    image outside its transformer's forwards (`time_outside_transformer`, which synchronizes around every region and
    so also counts the host work a plain call overlaps with the GPU) and its share of that image; and the same by
    subtraction (the image's time less its steps at the step time measured apart), which keeps that overlap."""
    e2e, b1 = r["e2e_s"], r["step"].get("batch1", {})

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    lossless_e2e = e2e.get("lossless_graphs", e2e.get("lossless"))
    return {
        "diffusers_step_ms": r["step_ms_diffusers"],
        "lossless_step_ms": r["step_ms_lossless"],
        "high_step_ms": r["step_ms_high"],
        "lossless_step_speedup": ratio(r["step_ms_diffusers"], r["step_ms_lossless"]),
        "lossless_graphs_step_ms": b1.get("lossless_graphs", {}).get("median_ms"),
        "lossless_graphs_step_speedup": ratio(r["step_ms_diffusers"], b1.get("lossless_graphs", {}).get("median_ms")),
        "lossless_graphs_step_equal_to_eager": b1.get("lossless_graphs", {}).get("equal_to_eager"),
        "high_step_speedup": r["high_step_speedup"],
        "lossless_e2e_speedup": ratio(e2e.get("diffusers"), lossless_e2e),
        "high_e2e_speedup": r["high_e2e_speedup"],
        "torchao_e2e_speedup": ratio(e2e.get("diffusers"), e2e.get(TORCHAO)),
        "torchao_step_ms": b1.get(TORCHAO, {}).get("median_ms"),
        "outside_transformer_s": r["outside_transformer_s"],
        "outside_transformer_share": ratio(r["outside_transformer_s"], e2e.get("high")),
        "outside_transformer_by_subtraction_s": (None if e2e.get("high") is None or r["step_ms_high"] is None
                                                 else e2e["high"] - r["e2e_steps"] * r["step_ms_high"] / 1000),
        "outside_transformer_by_subtraction_share": (None if e2e.get("high") is None or r["step_ms_high"] is None
                                                     else 1 - r["e2e_steps"] * r["step_ms_high"] / 1000 / e2e["high"]),
    }


def write_markdown(path: Path, r: dict[str, Any]) -> None:
    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"# High tier per technique on {r['gpu']}",
        "",
        f"Model `{r['model']}` (bf16{', random weights: PSNR/SSIM measure numerical closeness, not image quality' if r['random_weights'] else ''}), "
        f"{r['size']}, torch {r['torch']}, diffusers {r['diffusers']}. Step: one transformer forward, median of "
        f"{r['repeats']} after {r['warmup']} warm-ups, variants interleaved. Quality: PSNR/SSIM of the PNG against "
        f"lossless, seed 0, bar {PSNR_BAR_DB:.0f} dB / {SSIM_BAR}.",
        "",
        "| variant | step ms (B=1) | x diffusers | step ms (B=2) | x diffusers | rel. err. of one step | "
        + " | ".join(f"PSNR {s} steps | SSIM {s} steps" for s in r["steps"]) + " | meets bar |",
        "|---|---|---|---|---|---|" + "---|---|" * len(r["steps"]) + "---|",
    ]
    b1, b2 = r["step"].get("batch1", {}), r["step"].get("batch2", {})

    def vs_diffusers(b: dict, key: str, field: str) -> str:
        ok = key != "diffusers" and field in b.get(key, {}) and field in b.get("diffusers", {})
        return f(b["diffusers"][field] / b[key][field], ".2f") if ok else "-"

    references = ["diffusers", "lossless"] + [k for k in ("lossless_graphs", TORCHAO) if k in b1 or k in b2]
    for key in references:
        s1, s2 = b1.get(key, {}), b2.get(key, {})
        lines.append(f"| {key} | {f(s1.get('median_ms'), '.2f')} | {vs_diffusers(b1, key, 'median_ms')} | "
                     f"{f(s2.get('median_ms'), '.2f')} | {vs_diffusers(b2, key, 'median_ms')} | "
                     f"{f(s1.get('rel_err_vs_lossless'), '.2e')} | "
                     + " | ".join("- | -" for _ in r["steps"]) + " | - |")
    for t in r["techniques"]:
        q = t["quality"]
        cells = " | ".join(f"{f(q.get(str(s), {}).get('psnr_db'), '.2f')} | {f(q.get(str(s), {}).get('ssim'), '.4f')}"
                           for s in r["steps"])
        lines.append(
            f"| {t['name']} | {f(t.get('step_ms_batch1'), '.2f')} | {f(t.get('speedup_vs_diffusers_batch1'), '.2f')} | "
            f"{f(t.get('step_ms_batch2'), '.2f')} | {f(t.get('speedup_vs_diffusers_batch2'), '.2f')} | "
            f"{f(t.get('rel_err_vs_lossless_batch1'), '.2e')} | {cells} | {t['meets_bar']} |")
    if any("step_ms_in_batch_batch1" in t for t in r["techniques"]):
        lines += ["", f"Steps as a batch runs them (the plan entered once for {r['in_batch_steps']} consecutive steps, "
                      "so the per-batch setup is spread over them), ms per step:", "",
                  "| variant | B=1 | x diffusers | B=2 | x diffusers |", "|---|---|---|---|---|"]
        for key in references:
            ms = [bb.get(key, {}).get("in_batch_ms") for bb in (b1, b2)]
            lines.append(f"| {key} | {f(ms[0], '.2f')} | {vs_diffusers(b1, key, 'in_batch_ms')} | {f(ms[1], '.2f')} | "
                         f"{vs_diffusers(b2, key, 'in_batch_ms')} |")
        for t in r["techniques"]:
            lines.append(f"| {t['name']} | {f(t.get('step_ms_in_batch_batch1'), '.2f')} | "
                         f"{f(t.get('speedup_in_batch_vs_diffusers_batch1'), '.2f')} | "
                         f"{f(t.get('step_ms_in_batch_batch2'), '.2f')} | "
                         f"{f(t.get('speedup_in_batch_vs_diffusers_batch2'), '.2f')} |")
    cached = [t for t in r["techniques"] if t.get("step_cache") is not None]
    for t in cached:
        steps_text = ", ".join(f"{s} steps: {q.get('cached_steps')} skipped" for s, q in t["quality"].items())
        lines += ["", f"`{t['name']}`: end to end {f(t.get('e2e_s'), '.3f')} s "
                      f"({f(t.get('e2e_speedup_vs_diffusers'), '.2f')}x diffusers); {steps_text}. Random weights have "
                      "no real step-to-step behaviour: this says nothing of the cache's quality on a trained model."]
    lines += ["", f"High set: `{r['high_set']}`. Step speed-up over diffusers (B=1): "
              f"{f(r['high_step_speedup'], '.2f')}x. End to end ({r['e2e_steps']} steps, median of "
              f"{r['e2e_repeats']}): {r['e2e_s']} -> {f(r['high_e2e_speedup'], '.2f')}x. Lossless PNG md5 and "
              f"latents equal to diffusers: {r['lossless_png_md5_equal']} ({r['lossless_equal_by_steps']}).", ""]
    if r.get("high_vs_torchao_recipe_in_batch") is not None:
        lines += [f"The high set against `{TORCHAO}` (batch 1, in a batch): "
                  f"{f(r['high_vs_torchao_recipe_in_batch'], '.2f')}x; the recipe's compile (its first two calls): "
                  f"{r['torchao_compile_s']} s.", ""]
    compiled = [t for t in r["techniques"] if t.get("compiled")]
    for t in compiled:
        breaks = r["graph_breaks"]
        lines += [f"`{t['name']}`: compiled and warmed up in {f(t.get('compile_warmup_s'), '.1f')} s before timing; "
                  f"Dynamo graphs compiled while timing (every variant): {r['recompiles_while_timing']}; graph "
                  f"breaks: {sum(breaks.values())}{' ' + str(breaks) if breaks else ''}.", ""]
    lines += ["Summary (batch 1; end to end as the pools serve, lossless graphed):", "", "| key | value |", "|---|---|"]
    lines += [f"| `{k}` | {r[k] if isinstance(r.get(k), bool) else f(r.get(k), '.3f')} |"
              for k in perf_summary(r)]
    lines.append("")
    if r.get("outside_transformer_parts_s"):
        lines += ["Outside the transformer, one `high` image (s): " + ", ".join(
            f"{k} {v:.3f}" for k, v in r["outside_transformer_parts_s"].items()) + ".", ""]
    profiles = {"high set": r["profile_high_step_ms_by_family"], "lossless": r.get("profile_lossless_step_ms_by_family")}
    if any(profiles.values()):
        families = list(dict.fromkeys(k for p in profiles.values() if p for k in p))
        lines += ["Profile of one step (B=1, CUDA kernel time per step, ms):", "",
                  "| family | " + " | ".join(profiles) + " |", "|---|" + "---|" * len(profiles)]
        lines += [f"| {k} | " + " | ".join(f((p or {}).get(k), '.2f') for p in profiles.values()) + " |"
                  for k in families]
        lines.append("")
    if r["errors"]:
        lines += ["Errors / refusals:", ""] + [f"- {k}: `{v.strip().splitlines()[-1]}`" for k, v in r["errors"].items()]
        lines.append("")
    lines += ["Command:", "", "```", r["command"], "```", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
