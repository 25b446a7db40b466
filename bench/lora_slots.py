"""What per-request adapters cost as the pools serve them, every step replayed from a CUDA graph: the lossless pool's
PEFT adapters (one graph per adapter set), then the high pool's served form with adapters in slots
(model/adapter_slots.py) beside fp8 layers and fused projections.

One process, one set of weights (default: flux-dev-random, FLUX.1-dev architecture, random bf16 weights),
1024x1024. First lossless (PEFT): `lossless` without and `lossless_lora` with one adapter (each term through the
fused tail, or inside the single blocks' GELU pass: model/peft_tail.py), `lossless_lora_peft` the same with those
passes, the residual pass's term and the shared x A^T GEMM switched off (PEFT's kernels), graphed, and the graphed adapter image against the eager one and against PEFT's (PNG bytes). Then the same pipeline, its PEFT adapters unloaded, converted to the
high form. Each repeat interleaves, after a warm-up that captures every graph (median over repeats):
  base        high, batch 1, no adapter
  lora        high, batch 1, one adapter (rank `--lora-rank` on q/v/out, FF down and the single blocks' MLP / output
              projections)
  one4        high, batch 4, the same adapter on every image
  mixed4      high, batch 4, four different adapters, one per image
  lora_xa_two_kernels  lora with each layer's x A^T through a scaled_mm and a saturating copy (the one-pass
              `kernels.fp8.rows_times_into` switched off)
Then, unless --no-compare-beside, base and lora again with every adapter added after its layer's GEMM (the form an
adapter too strong for fp8 columns beside the weight takes) instead of inside the fp8 GEMMs.
Also: switching adapters between batches (composing another set into the buffers, synchronized), and the graph
captures during the timed repeats (0: switching adapters replays the captured steps). Random weights: speed is what
this measures; the images mean nothing.

  python bench/lora_slots.py --out bench/results/lora-slots-h200.json
  python bench/lora_slots.py --model tiny --device cpu --dtype float32 --size 64 --steps 2 --repeats 1 --out /tmp/s.json  # dry run
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import timed  # noqa: E402
from bench.high import kernel_times  # noqa: E402
from kernels import switches  # noqa: E402
from model.loading import load_pipeline  # noqa: E402
from model.metrics import psnr  # noqa: E402
from model.pipeline import GenerationRequest  # noqa: E402
from tests._inputs import write_random_lora  # noqa: E402


def _db(value: float) -> float | str:
    return round(value, 2) if value != float("inf") else "inf"  # (equal images: JSON has no infinity)


def kernel_ms(fn: Any) -> dict[str, float]:
    """CUDA kernel time (ms) by kernel name over one call of `fn` (`bench.high.kernel_times`); {} off CUDA."""
    return kernel_times(fn) if torch.cuda.is_available() else {}


def kernel_delta(base: dict[str, float], lora: dict[str, float], top: int = 15) -> dict[str, Any]:
    """Where an adapter image's extra kernel time goes: the names whose time grew most (ms per image), and totals."""
    names = set(base) | set(lora)
    delta = sorted(((lora.get(n, 0.0) - base.get(n, 0.0), n) for n in names), reverse=True)
    def row(d: float, n: str) -> dict[str, Any]:
        return {"kernel": n[:120], "ms": round(d, 3), "base_ms": round(base.get(n, 0.0), 3)}

    return {"base_ms": round(sum(base.values()), 2), "lora_ms": round(sum(lora.values()), 2),
            "grew": [row(d, n) for d, n in delta[:top]],
            "shrank": [row(d, n) for d, n in delta[::-1][:top] if d < 0]}


def main(argv: list[str] | None = None) -> int:
    from model import prompt_cache

    prompt_cache.disable_by_default()  # every timed call encodes its prompt
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flux-dev-random")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--slot-rank", type=int, default=16, help="adapter_rank: the rank one image may use")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--no-in-gemm", dest="in_gemm", action="store_false",
                    help="serve the adapters after each layer's GEMM (the switch adapters_in_fp8_gemm off)")
    ap.add_argument("--no-compare-beside", dest="compare_beside", action="store_false",
                    help="skip timing the adapters added after each GEMM instead of inside the fp8 GEMMs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/lora_slots.py needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    command = "python bench/lora_slots.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                 else sys.argv[1:]))
    build_s, pipe = timed(lambda: load_pipeline(args.model, device=args.device, dtype=getattr(torch, args.dtype)))
    tmp = Path(tempfile.mkdtemp(prefix="lora-slots"))
    files = {f"a{i}": str(write_random_lora(pipe.transformer, tmp / f"a{i}.safetensors", seed=i, rank=args.lora_rank,
                                            std=2e-3)) for i in range(4)}
    graphs = pipe.enable_cuda_graphs() if args.device.startswith("cuda") else None

    def req(loras: tuple = (), seed: int = 0, quality: str = "high") -> GenerationRequest:
        return GenerationRequest("a photo of a red fox in fresh snow", height=args.size, width=args.size,
                                 steps=args.steps, seed=seed, quality=quality, loras=loras)

    # lossless: PEFT adapters, graphed per adapter set
    pipe.load_loras({"a0": files["a0"]})
    lossless = {"lossless": [req(quality="lossless")], "lossless_lora": [req((("a0", 1.0),), quality="lossless")],
                "lossless_lora_peft": [req((("a0", 1.0),), quality="lossless")]}
    times: dict[str, list[float]] = {k: [] for k in lossless}
    outs: dict[str, list] = {}
    for i in range(1 + args.repeats):
        for name, batch in lossless.items():
            # lossless_lora_peft: each adapter term as PEFT adds it (three kernels), the fused passes switched off
            fused = name != "lossless_lora_peft"
            with switches.override(lora_tail=fused, gelu_tanh_lora=fused, residual_gate_lora=fused,
                                   lora_shared_a=fused):
                t, outs[name] = timed(lambda: pipe.generate(batch))
            if i:
                times[name].append(t)
    out = outs["lossless_lora"]
    profiles = {"lossless": kernel_delta(kernel_ms(lambda: pipe.generate(lossless["lossless"])),
                                         kernel_ms(lambda: pipe.generate(lossless["lossless_lora"])))}
    eager = pipe.generate(lossless["lossless_lora"], cuda_graphs=False)[0]
    lossless_base = pipe.generate(lossless["lossless"])[0]
    lossless_equal = eager.png == out[0].png and bool(torch.equal(eager.latents, out[0].latents))
    tail_equal = outs["lossless_lora_peft"][0].png == out[0].png and bool(
        torch.equal(outs["lossless_lora_peft"][0].latents, out[0].latents))
    from kernels.lora import GATE as TAIL

    from model.peft_tail import SHARED_A_GATE

    tail, shared_a = ({"fast_calls": g.fast_calls, "signatures": len(g.verdicts()),
                       "signatures_equal": sum(g.verdicts().values())} for g in (TAIL, SHARED_A_GATE))
    print(f"lossless: {times}; graphed adapter image equal to eager: {lossless_equal}, fused tail equal to PEFT's "
          f"three kernels: {tail_equal}; tail gate {tail}; shared A gate {shared_a}", flush=True)
    pipe.remove_lora("a0")
    pipe.pipe.unload_lora_weights()  # no PEFT layer left: the high form converts plain linears
    if graphs is not None:
        pipe.disable_cuda_graphs()
    form = pipe.take_high_defaults()
    pipe.enable_adapter_slots(args.slot_rank, rows=4)
    with switches.override(adapters_in_fp8_gemm=args.in_gemm):  # read as each layer's side is made
        load_s, _ = timed(lambda: pipe.load_loras(files))
    graphs = pipe.enable_cuda_graphs() if args.device.startswith("cuda") else None
    print(f"built {args.model} in {build_s:.1f}s ({form}); 4 adapters loaded into slots in {load_s:.1f}s", flush=True)

    names = sorted(files)
    variants = {
        "base": [req()],
        "lora": [req((("a0", 1.0),))],
        "one4": [req((("a0", 1.0),), seed=i) for i in range(4)],
        "mixed4": [req(((n, 1.0),), seed=i) for i, n in enumerate(names)],
        # x A^T through a scaled_mm and a saturating copy instead of the one pass (switch fp8_rows_times_a off)
        "lora_xa_two_kernels": [req((("a0", 1.0),))],
    }

    def run(name: str, batch: list) -> Any:
        with switches.override(fp8_rows_times_a=name != "lora_xa_two_kernels"):
            return pipe.generate(batch)

    for name, batch in variants.items():  # warm-up: every graph captured
        run(name, batch)
    captures = graphs.captures if graphs is not None else 0
    times.update({k: [] for k in variants})
    last: dict[str, list] = {}
    for i in range(args.repeats):
        for name, batch in variants.items():
            t, last[name] = timed(lambda: run(name, batch))
            times[name].append(t)
        print(f"  repeat {i}: " + ", ".join(f"{k} {times[k][-1]:.3f}s" for k in variants), flush=True)
    slots = pipe.adapter_slots
    profiles["high"] = kernel_delta(kernel_ms(lambda: pipe.generate(variants["base"])),
                                    kernel_ms(lambda: pipe.generate(variants["lora"])))

    def switch(rows: list) -> None:
        slots.compose(rows)
        slots.off()

    switch_s = []
    for i in range(10):
        switch_s.append(timed(lambda: switch([((names[i % 4], 1.0),)]))[0])
    captured = (graphs.captures if graphs is not None else 0) - captures  # (before the form below drops graphs)
    inside = sum(layer.side is not None and layer.side.wide for layer in slots.layers.values())
    beside = sum(layer.side is not None and not layer.side.wide for layer in slots.layers.values())
    if args.compare_beside:  # the same adapters added after each GEMM (the form too strong an adapter takes)
        slots.move_beside()
        beside_variants = {"base_beside": variants["base"], "lora_beside": variants["lora"]}
        for batch in beside_variants.values():
            pipe.generate(batch)
        times.update({k: [] for k in beside_variants})
        for i in range(args.repeats):
            for name, batch in beside_variants.items():
                t, last[name] = timed(lambda: pipe.generate(batch))
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    report = {
        "command": command, "gpu": gpu, "torch": torch.__version__, "model": args.model, "size": args.size,
        "steps": args.steps, "lora_rank": args.lora_rank, "slot_rank": args.slot_rank, "repeats": args.repeats,
        "form": sorted(pipe.form.techniques()), "fp8_layers": pipe.fp8_layers,
        "seconds": med, "seconds_all": times,
        "lora_overhead_high_pct": round(100 * (med["lora"] / med["base"] - 1), 2),
        "lora_overhead_high_xa_two_kernels_pct": round(100 * (med["lora_xa_two_kernels"] / med["base"] - 1), 2),
        "lora_overhead_lossless_pct": round(100 * (med["lossless_lora"] / med["lossless"] - 1), 2),
        "lora_overhead_lossless_peft_pct": round(100 * (med["lossless_lora_peft"] / med["lossless"] - 1), 2),
        "lossless_lora_tail_png_equal_peft": tail_equal,
        "lora_tail_gate": tail,
        "lora_shared_a_gate": shared_a,
        "adapter_layers": {"inside_gemm": inside, "beside_gemm": beside},
        "lora_overhead_high_beside_pct": (round(100 * (med["lora_beside"] / med["base_beside"] - 1), 2)
                                          if "lora_beside" in med else None),
        "psnr_high_lora_inside_vs_beside_db": (_db(psnr(last["lora"][0].png, last["lora_beside"][0].png))
                                               if "lora_beside" in last else None),
        "lossless_lora_graphed_png_equal_eager": lossless_equal,
        # the same adapter, request and seed: high with slots against lossless with PEFT (random weights: weak)
        "psnr_high_lora_vs_lossless_lora_db": _db(psnr(last["lora"][0].png, eager.png)),
        "psnr_high_vs_lossless_db": _db(psnr(last["base"][0].png, lossless_base.png)),
        "mixed_batch_ratio": round(med["mixed4"] / med["one4"], 4),
        "adapter_switch_ms": round(1000 * statistics.median(switch_s), 3),
        "captures_during_timed_runs": captured,  # the slot repeats and switches (the beside form captures its own)
        "graph_stats": None if graphs is None else graphs.stats(),
        "kernels_lora_minus_base": profiles,  # one image each, profiled apart from the timed runs
        "note": "random weights: speed only",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("gpu", "seconds", "lora_overhead_high_pct", "lora_overhead_lossless_pct",
                                             "lora_overhead_lossless_peft_pct", "lossless_lora_tail_png_equal_peft",
                                             "lora_overhead_high_beside_pct", "adapter_layers",
                                             "lossless_lora_graphed_png_equal_eager",
                                             "psnr_high_lora_vs_lossless_lora_db", "mixed_batch_ratio",
                                             "adapter_switch_ms", "captures_during_timed_runs")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
