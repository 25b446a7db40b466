"""Time one FLUX transformer forward at TP=1 and TP=N: `python bench/tp_forward.py --world-size 2 --device cuda`.

Spawns N local processes (NCCL on CUDA, gloo on CPU). Rank 0 first times the unsharded model (TP=1); then every
rank shards the same seeded weights and the TP=N forward is timed, plus the all-reduce alone at the block output
shapes. Prints one table from rank 0; `--json PATH` writes the numbers. The transformer is built from a preset's
config with random weights directly on the device (no text encoders, no disk), so a full-size run needs only
the transformer's memory on each GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.request import DTYPES, torch_dtype  # noqa: E402



def _build(preset: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from model import presets
    from model.flux import FluxTransformer

    torch.manual_seed(0)  # the same weights on every rank (same device kind)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in the target dtype directly (no fp32 copy of a 12B model)
    try:
        with torch.device(device), torch.no_grad():
            model = FluxTransformer(**presets.PRESETS[preset].transformer)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def _inputs(model: torch.nn.Module, height: int, width: int, txt: int, device: torch.device, dtype: torch.dtype):
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    h, w = height // 16, width // 16  # packed 2x2 latents of an 8x VAE
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(h * 1.0), torch.arange(w * 1.0), indexing="ij"), -1)
    inputs = dict(
        hidden_states=torch.randn(1, h * w, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, txt, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.zeros(txt, 3),
        guidance=torch.tensor([3.5]) if cfg.guidance_embeds else None,
    )
    out = {k: (v.to(device, dtype) if k not in ("img_ids", "txt_ids") else v.to(device)) for k, v in inputs.items()
           if v is not None}
    return {**out, "return_dict": False}


def _time(fn, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Per-call wall times in ms (synchronised before reading the clock)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    from model import linear as tp_layers
    from tp.dist import init_tp
    from tp.shard import check_replicas_identical, shard_transformer

    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    dtype = torch_dtype(args.dtype)
    group = init_tp(rank, args.world_size, port=port, timeout_s=args.timeout_s,
                    device=device if device.type == "cuda" else None)
    model = _build(args.preset, device, dtype)
    check_replicas_identical(model, group)
    inputs = _inputs(model, args.height, args.width, args.txt_tokens, device, dtype)
    res: dict[str, Any] = {"world_size": args.world_size, "device": torch.cuda.get_device_name(device)
                           if device.type == "cuda" else "cpu", "dtype": args.dtype, "preset": args.preset,
                           "tokens": inputs["hidden_states"].shape[1] + args.txt_tokens}
    with torch.no_grad():
        if rank == 0:
            res["tp1_ms"] = _time(lambda: model(**inputs), device, args.warmup, args.reps)
            ref = model(**inputs)[0].float().cpu()
        dist.barrier(group)
        shard_transformer(model, rank, args.world_size, group)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        calls = []
        real = tp_layers.all_reduce_sum
        tp_layers.all_reduce_sum = lambda t, g: (calls.append(tuple(t.shape)), real(t, g))[1]
        out = model(**inputs)[0].float().cpu()
        tp_layers.all_reduce_sum = real
        res["all_reduces_per_forward"] = len(calls)
        res["tpN_ms"] = _time(lambda: model(**inputs), device, args.warmup, args.reps)
        # The communication alone: every all-reduce of one forward, back to back, on tensors of those shapes.
        bufs = [torch.randn(s, device=device).to(dtype) for s in calls]
        res["all_reduce_only_ms"] = _time(lambda: [dist.all_reduce(b, group=group) for b in bufs], device,
                                          args.warmup, args.reps)
    if rank == 0:
        res["max_abs_diff_vs_tp1"] = (out - ref).abs().max().item()
        res["max_abs_tp1"] = ref.abs().max().item()
        med = {k: statistics.median(res[k]) for k in ("tp1_ms", "tpN_ms", "all_reduce_only_ms")}
        print(f"{res['preset']} {res['tokens']} tokens {res['dtype']} on {res['device']} x{args.world_size}")
        print(f"  TP=1 forward            {med['tp1_ms']:9.2f} ms (median of {args.reps})")
        print(f"  TP={args.world_size} forward            {med['tpN_ms']:9.2f} ms  -> {med['tp1_ms'] / med['tpN_ms']:.2f}x")
        print(f"  all-reduces alone       {med['all_reduce_only_ms']:9.2f} ms  ({res['all_reduces_per_forward']} per forward)")
        print(f"  max |TP{args.world_size} - TP1|         {res['max_abs_diff_vs_tp1']:.3g} (max |TP1| {res['max_abs_tp1']:.3g})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    from tp.dist import find_free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--preset", default="tiny", help="a model.presets name (its transformer config)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--txt-tokens", type=int, default=512)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs that many GPUs ({torch.cuda.device_count()} visible)")
    mp.start_processes(_rank, args=(args, find_free_port()), nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
