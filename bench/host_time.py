"""Is an eager transformer step bound by the host? The host's time to issue a step against the GPU's time to run it.

Per variant (bench/high.py's names; `lossless` is ours under its plan, `diffusers` the stock transformer):

- `step_ms`: synchronized wall time per step at `--size` (`--steps-per-call` steps per plan entry, as a batch runs
  them): about max(host, GPU) where the two overlap, more where the step synchronizes.
- `gpu_busy_ms`, `gpu_gaps_ms`: at `--size`, the step's summed kernel time and the GPU's idle time between its first
  and last kernel (bench/step_timeline.py's profile; one step per plan entry).
- `host_ms`: wall time per step at `--host-size` with `--host-text-tokens`, where the kernels are tiny and the GPU
  waits for the host: the host's cost of a step (launches, Python, library calls), which barely depends on the
  token count. Its own `gpu_busy_ms` is reported to show that the GPU is idle there.
- the CUDA runtime and driver calls of a step at `--size` by host time (a synchronizing call shows here), the
  synchronizing calls torch reports (`torch.cuda.set_sync_debug_mode`), and the host time of the functions a step
  spends it in at `--host-size` (inclusive, per call and per step; the wrapper adds well under a microsecond);
  the same at `--size` on CUDA, host time where the step has GPU gaps (where the host runs ahead of the GPU, a
  launch may also wait for room in the stream's queue).

A spin kernel cannot stand in for the small size: a stream holds about a thousand pending launches, and a step has
more. Random weights (flux-dev-random): timing only.

  python bench/host_time.py --out bench/results/host-time-h200.json
  python bench/host_time.py --model tiny --device cpu --size 256 --repeats 1 --only lossless  # dry run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import shlex
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import _sync  # noqa: E402
from bench.high import VARIANTS, build_variants, lossless_step_fn, step_fn, step_inputs, time_steps  # noqa: E402
from model.loading import diffusers_reference, load_pipeline  # noqa: E402

EAGER_HIGH = "high + fp8 + fused_projections + fast_norm + fp8_norm_producer + fast_accum"
DEFAULT_VARIANTS = ["diffusers", "lossless", EAGER_HIGH, f"{EAGER_HIGH} + attention8",
                    f"{EAGER_HIGH} + attention8 (Triton)", f"{EAGER_HIGH} + attention8 + cuda_graphs"]

# (module, attribute path, label): the functions whose host time is taken, patched where the step looks them up.
HOST_FUNCTIONS = [
    ("model.flux", "run_double_block", "double block"),
    ("model.flux", "run_single_block", "single block"),
    ("model.flux", "FluxAttention.attend", "attention with its QK norm + RoPE (FluxAttention.attend)"),
    ("model.flux", "rope_attention_fp8", "cuDNN fp8 attention path (rope_attention_fp8)"),
    ("kernels.attention", "cudnn_fp8_refusal", "  its refusal checks"),
    ("kernels.rope", "rms_rope_fast", "fast QK RMSNorm + RoPE kernel (rms_rope_fast)"),
    ("kernels._attention_fp8_triton", "tokens_fp8", "  v to fp8 (two launches)"),
    ("kernels.attention", "_CudnnFp8Graph.__call__", "  cuDNN fp8 SDPA (variant pack, workspace, execute)"),
    ("kernels._attention_fp8_triton", "dequantize", "  output back to bf16"),
    ("kernels.attention", "fp8_attention", "Triton 8-bit attention (quantize q, k, v + kernel)"),
    ("kernels.attention", "sdpa", "SDPA"),
    ("model.flux", "rms_rope_cat", "QK RMSNorm + RoPE on the SDPA path (rms_rope_cat)"),
    ("model.linear", "Linear.forward", "linear layers (fp8 and sharded)"),
    ("kernels.fp8", "quantize_rows", "row quantization (quantize_rows)"),
]


@contextlib.contextmanager
def host_timers(targets: list[tuple[str, str, str]]) -> Iterator[dict[str, list[float]]]:
    """Wrap each importable target so that its calls add (count, seconds) to the yielded {label: [calls, s]}."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    undo: list[tuple[Any, str, Any]] = []
    for module_name, path, label in targets:
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:  # e.g. the Triton modules where triton is missing
            continue
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)

        def wrapper(*a: Any, __f: Callable[..., Any] = original, __t: list[float] = totals[label],
                    **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return __f(*a, **k)
            finally:
                __t[0] += 1
                __t[1] += time.perf_counter() - t0

        setattr(owner, attr, wrapper)
        undo.append((owner, attr, original))
    try:
        yield totals
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)


def runtime_calls(fn: Callable[[], Any], steps: int, top: int = 10) -> dict[str, dict[str, float]]:
    """CUDA runtime / driver calls of `fn` (running `steps` steps) by host time: {name: {calls, ms}} per step."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    calls = {e.key: {"calls": e.count / steps, "ms": e.cpu_time_total / 1000 / steps} for e in prof.key_averages()
             if e.key.startswith("cuda") or (e.key.startswith("cu") and e.key[2:3].isupper())}
    calls.pop("cudaDeviceSynchronize", None)  # the one after the steps, not theirs
    return dict(sorted(calls.items(), key=lambda kv: -kv[1]["ms"])[:top])


def sync_sites(fn: Callable[[], Any]) -> list[str]:
    """Where torch reported a synchronizing CUDA call during one run of `fn` (file:line: message)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _sync()
    return sorted({f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:80]}" for w in caught
                   if "synchroniz" in str(w.message)})


def function_times(fn: Callable[[], Any], steps: int) -> dict[str, dict[str, float]]:
    """Wall time inside each of HOST_FUNCTIONS during one run of `fn` (`steps` steps): {label: {calls, ms}} per step.
    Host time where the GPU waits for the host; where the host runs ahead, a launch may also wait for queue room."""
    with host_timers(HOST_FUNCTIONS) as totals, torch.no_grad():
        fn()
        _sync()
    return {k: {"calls": c / steps, "ms": s * 1000 / steps} for k, (c, s) in totals.items() if c}


def wall_ms(fn: Callable[[], Any], steps: int, warmup: int, repeats: int) -> float:
    """Median synchronized wall time per step of `fn` (running `steps` steps), by bench/high.py's timer."""
    return time_steps({"fn": fn}, warmup, repeats)["fn"]["median_ms"] / steps


def gpu_profile(fn: Callable[[], Any]) -> dict[str, float]:
    """Kernel time, idle gaps and kernels of one step of `fn` (one step per call): the mean of three profiled."""
    from bench.step_timeline import timeline

    per_step = timeline(fn, steps=3)["steps"]
    return {k: sum(s[k] for s in per_step) / len(per_step) for k in ("busy_ms", "gap_ms", "kernels")}


def measure(name: str, fns: dict[str, Callable[[], Any]], steps: int, args: argparse.Namespace) -> dict[str, Any]:
    """fns: "full" / "small" (`steps` steps per call) and "full1" / "small1" (one step per call). The host-size
    part is reported apart when it fails (a kernel may refuse so few tokens), the full-size part kept."""
    cuda = torch.cuda.is_available()
    row: dict[str, Any] = {"step_ms": wall_ms(fns["full"], steps, args.warmup, args.repeats)}
    if cuda:
        full = gpu_profile(fns["full1"])
        row.update(gpu_busy_ms=full["busy_ms"], gpu_gaps_ms=full["gap_ms"], kernels=full["kernels"],
                   runtime_calls=runtime_calls(fns["full"], steps), sync_sites=sync_sites(fns["full"]),
                   functions_full=function_times(fns["full"], steps))
    try:
        row["host_ms"] = wall_ms(fns["small"], steps, args.warmup, args.repeats)
        row["functions"] = function_times(fns["small"], steps)
        if cuda:
            row["small_gpu_busy_ms"] = gpu_profile(fns["small1"])["busy_ms"]
    except Exception as exc:  # noqa: BLE001 - the full-size figures stand without it
        row["host_error"] = f"{type(exc).__name__}: {exc}"
    if cuda and "host_ms" in row:
        row["bound"] = "host" if row["host_ms"] > row["gpu_busy_ms"] else "GPU"
    print(f"  {name}: " + ", ".join(f"{k} {row[k]:.2f}" for k in ("step_ms", "gpu_busy_ms", "gpu_gaps_ms", "host_ms")
                                    if k in row)
          + f", bound: {row.get('bound', '-')}, sync sites {len(row.get('sync_sites', []))}"
          + (f", host size failed: {row['host_error']}" if "host_error" in row else ""), flush=True)
    return row


def write_markdown(path: Path, r: dict[str, Any]) -> None:
    def f(x: Any, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"# Host time against GPU time per transformer step on {r['gpu']}",
        "",
        f"Model `{r['model']}` (bf16, random weights: timing only), batch {r['batch']}, torch {r['torch']}. step: "
        f"synchronized wall time at {r['size']}x{r['size']} ({r['steps_per_call']} steps per plan entry, median of "
        f"{r['repeats']} after {r['warmup']} warm-ups); GPU busy / gaps: summed kernel time and idle time inside "
        f"one step at that size; host: wall time per step at {r['host_size']}x{r['host_size']} with "
        f"{r['host_text_tokens']} text tokens, where the GPU waits for the host (its GPU busy time beside it).",
        "",
        "| variant | step ms | GPU busy ms | GPU gaps ms | kernels | host ms | GPU busy ms at the host size | bound | "
        "sync sites |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in r["variants"].items():
        if "error" in row:
            lines.append(f"| {name} | not run: {row['error'][:120]} | | | | | | | |")
            continue
        lines.append(
            f"| {name} | {f(row['step_ms'])} | {f(row.get('gpu_busy_ms'))} | {f(row.get('gpu_gaps_ms'))} | "
            f"{f(row.get('kernels'), '.0f')} | {f(row.get('host_ms'))} | {f(row.get('small_gpu_busy_ms'))} | "
            f"{row.get('bound', '-')} | {len(row.get('sync_sites', []))} |")
    order = [label for _, _, label in HOST_FUNCTIONS]
    for name, row in r["variants"].items():
        if "error" in row:
            continue
        for key, where in (("functions", "the host size"), ("functions_full", f"{r['size']}x{r['size']}")):
            if not row.get(key):
                continue
            lines += ["", f"Time by function at {where}, `{name}` (inclusive; indented rows are parts of the cuDNN fp8 "
                      "attention path" + ("; host time where the step has GPU gaps, else launches also wait for queue "
                                          "room" if key == "functions_full" else "") + "):", "",
                      "| function | calls / step | us / call | ms / step |", "|---|---|---|---|"]
            for label in sorted(row[key], key=order.index):
                t = row[key][label]
                lines.append(f"| {label} | {t['calls']:.0f} | {1000 * t['ms'] / t['calls']:.1f} | {t['ms']:.2f} |")
        if row.get("runtime_calls"):
            lines += ["", f"CUDA runtime / driver calls per step at {r['size']}x{r['size']}, `{name}`: " + ", ".join(
                f"{k} {v['calls']:.0f}x {v['ms']:.2f} ms" for k, v in row["runtime_calls"].items())]
        if row.get("sync_sites"):
            lines += ["", "Synchronizing calls torch reported: " + "; ".join(f"`{s}`" for s in row["sync_sites"])]
        if row.get("host_error"):
            lines += ["", f"`{name}` at the host size failed: {row['host_error'][:300]}"]
    lines += ["", "Command:", "", "```", r["command"], "```", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    from model import prompt_cache

    prompt_cache.disable_by_default()  # every timed call encodes its prompt, as diffusers does
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flux-dev-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--host-size", type=int, default=64, help="image side where the step is host-bound")
    ap.add_argument("--host-text-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps-per-call", type=int, default=4, help="steps per plan entry (a batch's steps)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", nargs="+", default=DEFAULT_VARIANTS,
                    help="variants: diffusers, lossless and bench/high.py's names")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "host-time-h200.json"))
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/host_time.py needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    command = "python bench/host_time.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    known = {"diffusers", "lossless", *(v.name for v in VARIANTS)}
    if set(args.only) - known:
        raise SystemExit(f"--only: unknown variant(s) {sorted(set(args.only) - known)}")

    ours = load_pipeline(args.model, device=args.device, dtype=torch.bfloat16)
    chosen = [v for v in VARIANTS if v.name in args.only]
    built, errors = build_variants(ours, chosen)
    by_name = {v.name: v for v in chosen}
    text_tokens = min(512, ours.pipe.tokenizer_2.model_max_length)
    host_text_tokens = min(args.host_text_tokens, text_tokens)
    sizes = {"full": step_inputs(ours, args.batch, args.size, text_tokens),
             "small": step_inputs(ours, args.batch, args.host_size, host_text_tokens)}
    n = args.steps_per_call
    reference = diffusers_reference(ours) if "diffusers" in args.only else None
    rows: dict[str, Any] = {name: {"error": errors[name]} for name in args.only if name in errors}
    for name in args.only:
        if name in rows:
            continue
        fns: dict[str, Callable[[], Any]] = {}
        for size, inputs in sizes.items():
            for key, calls in ((size, n), (f"{size}1", 1)):
                if name == "diffusers":
                    fns[key] = step_fn(reference, None, inputs, calls)
                elif name == "lossless":
                    fns[key] = lossless_step_fn(ours, inputs, calls)
                else:  # under the variant's switches and plan
                    fns[key] = step_fn(built[name], by_name[name], inputs, calls)
        try:
            rows[name] = measure(name, fns, n, args)
        except Exception as exc:  # noqa: BLE001 - one variant's failure is reported, the others still run
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  {name}: {rows[name]['error']}", flush=True)
    result = {
        "model": args.model, "size": args.size, "host_size": args.host_size,
        "host_text_tokens": host_text_tokens, "batch": args.batch, "steps_per_call": n,
        "repeats": args.repeats, "warmup": args.warmup, "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "command": command, "variants": {name: rows[name] for name in args.only},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(out.with_suffix(".md"), result)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
