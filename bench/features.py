"""What a LoRA adapter and an image edit cost on the GPU, and that `lossless` stays byte-identical with them.

One process, one set of weights (default: the flux-dev-random preset, FLUX.1-dev architecture, random bf16 weights),
1024x1024. Variants, interleaved within each repeat, median over repeats after a warm-up:
  text        lossless text-to-image (`steps` steps)
  lora        the same with one LoRA adapter active (rank `--lora-rank` on q/v/out, FF down and the single blocks'
              MLP / output projections; PEFT layers through diffusers' loader)
  lora_fused  the adapter fused into the weights (`fuse_lora`, a pool serving one adapter); timed after the others
Also timed: switching the active adapter set between batches, and loading / unloading an adapter while serving (the
runtime path of `POST / DELETE /v1/adapters`).
  img2img     an edit at `--strength` (runs strength x steps denoising steps, plus the VAE encode)
  inpaint     the same with a mask
Each variant's last image is compared with stock diffusers (the reference pipeline with diffusers' transformer, the
same adapter file, the same edit pipelines): PNG md5 and latents must be equal. Random weights: speed is what this
measures; the images themselves mean nothing.

  python bench/features.py                          # full: 1024x1024, 28 steps, 3 repeats
  python bench/features.py --size 256 --steps 2 --repeats 1 --model tiny --device cpu --dtype float32   # dry run
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
from model.loading import diffusers_reference, load_pipeline  # noqa: E402
from model.pipeline import GenerationRequest, md5, run_flux_pipeline  # noqa: E402
from tests._inputs import random_png, write_random_lora  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from model import prompt_cache

    prompt_cache.disable_by_default()  # every timed call encodes its prompt, as diffusers does
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flux-dev-random")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--strength", type=float, default=0.6)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "features-h200.json"))
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/features.py needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    command = "python bench/features.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    dtype = getattr(torch, args.dtype)
    build_s, ours = timed(lambda: load_pipeline(args.model, device=args.device, dtype=dtype))
    ref_s, reference = timed(lambda: diffusers_reference(ours))
    print(f"built {args.model}: ours {build_s:.1f}s, reference {ref_s:.1f}s", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="features"))
    lora = write_random_lora(ours.transformer, tmp / "adapter.safetensors", seed=1, rank=args.lora_rank, std=2e-3)
    second = write_random_lora(ours.transformer, tmp / "second.safetensors", seed=2, rank=args.lora_rank, std=2e-3)
    ours.load_loras({"adapter": str(lora)})
    reference.load_lora_weights(str(lora), adapter_name="adapter")
    image = random_png(3, (args.size, args.size))
    mask = random_png(4, (args.size, args.size), mask=True)

    base = dict(prompt="a photo of a red fox in fresh snow", height=args.size, width=args.size, steps=args.steps,
                seed=0)
    requests = {
        "text": GenerationRequest(**base),
        "lora": GenerationRequest(**base, loras=(("adapter", 1.0),)),
        "img2img": GenerationRequest(**base, image=image, strength=args.strength),
        "inpaint": GenerationRequest(**base, image=image, mask=mask, strength=args.strength),
    }
    times: dict[str, list[float]] = {k: [] for k in requests}
    last: dict[str, Any] = {}
    for i in range(args.warmup + args.repeats):
        for name, req in requests.items():
            t, [last[name]] = timed(lambda: ours.generate([req]))
            if i >= args.warmup:
                times[name].append(t)
        print(f"  {'warm-up' if i < args.warmup else 'repeat'} {i}: "
              + ", ".join(f"{k} {v[-1] if v else float('nan'):.3f}s" for k, v in times.items()), flush=True)

    equal: dict[str, dict[str, bool]] = {}
    for name, req in requests.items():
        if name == "lora":
            reference.enable_lora()
            reference.set_adapters(["adapter"], [1.0])
        else:
            reference.disable_lora()
        ref_latents, ref_pngs = run_flux_pipeline(reference, [req])
        equal[name] = {"latents": bool(torch.equal(ref_latents[0], last[name].latents)),
                       "png_md5": md5(ref_pngs[0]) == md5(last[name].png)}
        print(f"  {name}: equal to stock diffusers {equal[name]}", flush=True)

    # Adapters while serving: switching the active set between two batches (what a batch naming other adapters
    # costs before its first step), and loading / unloading one through the runtime path (POST / DELETE
    # /v1/adapters), whose images must equal stock diffusers with the same file loaded its own way.
    def switch() -> None:
        for loras in ((("adapter", 1.0),), ()):
            ours._activate_loras([GenerationRequest(**base, loras=loras)])

    switch_s = [timed(switch)[0] / 2 for _ in range(20)]
    add_s, remove_s = [], []
    for _ in range(3):
        add_s.append(timed(lambda: ours.add_lora("second", str(second)))[0])
        remove_s.append(timed(lambda: ours.remove_lora("second"))[0])
    ours.add_lora("second", str(second))
    runtime = GenerationRequest(**base, loras=(("second", 1.0),))
    got = ours.generate([runtime])[0]
    reference.load_lora_weights(str(second), adapter_name="second")
    reference.enable_lora()
    reference.set_adapters(["second"], [1.0])
    ref_latents, ref_pngs = run_flux_pipeline(reference, [runtime])
    equal["lora_runtime"] = {"latents": bool(torch.equal(ref_latents[0], got.latents)),
                             "png_md5": md5(ref_pngs[0]) == md5(got.png)}
    reference.delete_adapters(["second"])
    ours.remove_lora("second")
    print(f"  adapter switch {1000 * statistics.median(switch_s):.2f} ms, runtime load "
          f"{statistics.median(add_s):.2f} s, unload {statistics.median(remove_s):.3f} s, equal to stock diffusers "
          f"{equal['lora_runtime']}", flush=True)

    # A pool serving one adapter fuses it (fuse_lora): timed after the others (the fusion cannot be undone here).
    ours.fuse_lora("adapter")
    times["lora_fused"] = []
    for i in range(args.warmup + args.repeats):
        t, [last["lora_fused"]] = timed(lambda: ours.generate([requests["text"]]))
        if i >= args.warmup:
            times["lora_fused"].append(t)
    reference.enable_lora()
    reference.set_adapters(["adapter"], [1.0])
    reference.fuse_lora(components=["transformer"], lora_scale=1.0, adapter_names=["adapter"])
    reference.unload_lora_weights()
    ref_latents, ref_pngs = run_flux_pipeline(reference, [requests["text"]])
    equal["lora_fused"] = {"latents": bool(torch.equal(ref_latents[0], last["lora_fused"].latents)),
                           "png_md5": md5(ref_pngs[0]) == md5(last["lora_fused"].png)}
    print(f"  lora_fused: {statistics.median(times['lora_fused']):.3f}s, equal to stock diffusers fused "
          f"{equal['lora_fused']}", flush=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    denoise = {"text": args.steps, "lora": args.steps, "lora_fused": args.steps,
               "img2img": requests["img2img"].denoising_steps,
               "inpaint": requests["inpaint"].denoising_steps}
    result = {
        "command": command, "model": args.model, "size": args.size, "steps": args.steps, "strength": args.strength,
        "lora_rank": args.lora_rank, "dtype": args.dtype, "repeats": args.repeats,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__, "median_s": med, "denoising_steps": denoise,
        # whole call / denoising steps: includes the text encoders and the VAE, spread over the steps
        "ms_per_denoising_step": {k: 1000 * med[k] / denoise[k] for k in med},
        "lora_overhead": med["lora"] / med["text"] - 1.0,
        "lora_fused_overhead": med["lora_fused"] / med["text"] - 1.0,  # timed after the others, not interleaved
        "adapter_switch_ms": 1000 * statistics.median(switch_s),  # one set_adapters / disable_lora, host side
        "runtime_adapter_load_s": statistics.median(add_s), "runtime_adapter_unload_s": statistics.median(remove_s),
        "equal_to_diffusers": equal, "random_weights": True,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if all(all(v.values()) for v in equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
