"""Per-step time of our lossless FluxTransformer vs diffusers, per fusion (a script, not a test).

FLUX.1-dev width (3072 = 24 x 128 heads, T5 4096, CLIP 768, guidance), `--layers`/`--single` blocks (default the
full 19 + 38), 1024^2 (4096 image + 512 text tokens), bf16, default (diffusers) init. Variants, interleaved over
`--rounds` rounds (the spread between rounds is the noise floor); each fusion is added on top of the line above it:
  diffusers | ours, every fusion off | + residual-gate | + RoPE(+cat) | + QK RMSNorm in the RoPE pass
  | + modulation | + LayerNorm in the modulation pass | + single block writes proj_out's input in place (aten's
  GELU into the slice) | + our GELU kernel into that slice
The last line is the lossless tier as configured by the library defaults. Every variant's output is compared with
diffusers' (torch.equal; NaNs at equal places count as equal). One torch.profiler step per end point attributes
GPU time to kernel groups (what the fusions removed).

Usage: python bench/lossless_fusions.py [--layers 19 --single 38 --batch 1 --reps 8 --out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers import FluxTransformer2DModel  # noqa: E402

from kernels import gelu as kgelu  # noqa: E402
from kernels import modulate as kmod  # noqa: E402
from kernels import residual as kres  # noqa: E402
from kernels import rope as krope  # noqa: E402
from kernels import switches  # noqa: E402
from kernels.exact import same_values  # noqa: E402
from model.flux import FluxTransformer  # noqa: E402

# fusion (in the order they are stacked) -> its switch in kernels.switches
SWITCHES = {
    "residual": "residual_gate_add",
    "rope": "rope_cat",
    "rms": "rms_rope_cat",
    "modulate": "modulate",
    "layernorm": "layer_norm_modulate",
    "in_place": "single_block_in_place",
    "gelu_into": "gelu_tanh_into",
}
FUSIONS = tuple(SWITCHES)
VARIANTS: list[tuple[str, tuple[str, ...] | None]] = [
    ("diffusers", ()),  # (the fusion switches do not touch the reference model)
    ("ours, every fusion off", ()),
    ("+ residual-gate kernel", FUSIONS[:1]),
    ("+ RoPE(+cat) kernel", FUSIONS[:2]),
    ("+ QK RMSNorm in the RoPE pass", FUSIONS[:3]),
    ("+ modulation kernel", FUSIONS[:4]),
    ("+ LayerNorm in the modulation pass", FUSIONS[:5]),
    ("+ single block: proj_out input in place (aten GELU)", FUSIONS[:6]),
    ("+ our GELU kernel into that slice", FUSIONS),
    ("ours, library defaults", None),
]
# what the library runs by default (the lossless tier as served): fusion -> on?
DEFAULTS = {f: switches.get(name) for f, name in SWITCHES.items()}


def set_fusions(on: tuple[str, ...] | None) -> None:
    """Turn exactly the fusions in `on` on; on=None: the library defaults."""
    for f, name in SWITCHES.items():
        switches.set(name, DEFAULTS[f] if on is None else f in on)


def make_inputs(batch: int, device: str, dtype: torch.dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    ys, xs = torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij")
    return dict(
        hidden_states=torch.randn(batch, 4096, 64, device=device, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, 512, 4096, device=device, generator=g).to(dtype),
        pooled_projections=torch.randn(batch, 768, device=device, generator=g).to(dtype),
        timestep=torch.full((batch,), 0.75, device=device, dtype=dtype),
        guidance=torch.full((batch,), 3.5, device=device, dtype=dtype),
        txt_ids=torch.zeros(512, 3, device=device),
        img_ids=torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(-1, 3).float().to(device),
        return_dict=False,
    )


def step_ms(model: torch.nn.Module, inputs: dict, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(**inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


GROUPS = [  # first match wins: our kernels before the generic names they contain
    ("attention (SDPA)", ("fmha", "flash", "cudnn", "attention", "sdpa")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("our RMSNorm+RoPE(+cat) kernel", ("_rms_rope_cat_kernel",)),
    ("our RoPE(+cat) kernel", ("_rope_cat_kernel",)),
    ("our LayerNorm+modulate kernel", ("_ln_modulate_exact_kernel",)),
    ("our modulate kernel", ("_modulate_kernel",)),
    ("our residual kernel", ("_residual_gate_add_kernel",)),
    ("our GELU-into-slice kernel", ("_gelu_tanh_kernel",)),
    ("cat", ("cat", "concat")),
    ("norms (aten)", ("layer_norm", "rms_norm", "norm")),
    ("gelu", ("gelu",)),
]


def profile_groups(model: torch.nn.Module, inputs: dict) -> dict[str, float]:
    """GPU ms per kernel group for one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(**inputs)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if not us:
            continue
        name = evt.key.lower()
        group = next((g for g, keys in GROUPS if any(k in name for k in keys)), "other elementwise/copies")
        out[group] = out.get(group, 0.0) + us / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=19)
    ap.add_argument("--single", type=int, default=38)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=str, default="")
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    t0 = time.time()
    cfg = dict(num_layers=args.layers, num_single_layers=args.single, guidance_embeds=True)
    torch.manual_seed(0)
    with torch.device(dev):
        ref = FluxTransformer2DModel(**cfg).to(dtype).eval()
        ours = FluxTransformer(**cfg).to(dtype).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    inputs = make_inputs(args.batch, dev, dtype)
    print(f"built in {time.time() - t0:.1f}s; params {sum(p.numel() for p in ref.parameters()) / 1e9:.2f} B", flush=True)

    results: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
    exact: dict[str, bool] = {}
    with torch.no_grad():
        expected = ref(**inputs)[0]
        finite = bool(torch.isfinite(expected).all())
        for _ in range(args.rounds):
            for name, on in VARIANTS:
                model = ref if name == "diffusers" else ours
                set_fusions(on)
                for _ in range(2):  # warm-up: compilation and first-sight verification happen here
                    out = model(**inputs)[0]
                exact[name] = exact.get(name, True) and same_values(out, expected)
                results[name].extend(step_ms(model, inputs, args.reps))
        set_fusions(())
        prof_off = profile_groups(ours, inputs)
        set_fusions(None)
        prof_on = profile_groups(ours, inputs)
        prof_ref = profile_groups(ref, inputs)

    base = statistics.median(results["diffusers"])
    lines = [
        f"# Lossless fusions: FluxTransformer vs diffusers on {torch.cuda.get_device_name()}",
        "",
        f"Command: `python bench/lossless_fusions.py --layers {args.layers} --single {args.single} "
        f"--batch {args.batch} --reps {args.reps} --rounds {args.rounds}`",
        f"torch {torch.__version__}, bf16, {args.layers} double + {args.single} single blocks at FLUX.1-dev width, "
        f"batch {args.batch}, 1024^2 (4096 image + 512 text tokens), diffusers default init "
        f"(output finite: {finite}); SDPA backend: PyTorch's default choice (same call for both models).",
        "",
        "| variant | median ms/step | min | max | vs diffusers | output == diffusers |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, _ in VARIANTS:
        t = results[name]
        med = statistics.median(t)
        lines.append(
            f"| {name} | {med:.2f} | {min(t):.2f} | {max(t):.2f} | {100 * (base - med) / base:+.2f}% | {exact[name]} |"
        )
    lines += ["", "GPU time per kernel group, one step (ms; torch.profiler):", "",
              "| group | diffusers | ours, fusions off | ours, library defaults (lossless) |", "|---|---:|---:|---:|"]
    for group in sorted(set(prof_off) | set(prof_on) | set(prof_ref)):
        lines.append(
            f"| {group} | {prof_ref.get(group, 0):.2f} | {prof_off.get(group, 0):.2f} | {prof_on.get(group, 0):.2f} |"
        )
    lines.append(
        f"| total | {sum(prof_ref.values()):.2f} | {sum(prof_off.values()):.2f} | {sum(prof_on.values()):.2f} |"
    )
    gates = {"rope": krope.GATE, "rms+rope": krope.RMS_GATE, "modulate": kmod.GATE, "layernorm+modulate": kmod.LN_GATE,
             "gelu into slice": kgelu.GELU_INTO_GATE}
    lines += ["", "gate verdicts: " + ", ".join(f"{k} {sorted(set(g.verdicts().values()))}" for k, g in gates.items())
              + f"; residual fast path disabled: {kres.fast_path_disabled()}; library defaults: "
              + ", ".join(f"{f}={v}" for f, v in DEFAULTS.items())]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
