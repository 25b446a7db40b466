"""The lossless tier's norm and elementwise kernels on one GPU, per call (a script, not a test).

1. Which FMA contraction choices of our aten-order LayerNorm kernel reproduce torch's CUDA LayerNorm statistics
   (mean and rstd from `torch.native_layer_norm`, bit for bit) on FLUX rows; the library default must be one.
2. LayerNorm + AdaLN modulation, time per call at the FLUX shapes (bf16, CUDA-graph replays, inputs rotated past
   L2): eager `F.layer_norm` + modulation (3 elementwise ops), aten LayerNorm + our modulate kernel, the fused
   exact kernel with either lane tree (lossless), and the fused fast kernel (quality "high", not bit-exact, with
   its max abs error against eager).
3. QK RMSNorm + RoPE(+cat): which FMA choice for the sum of squares matches torch's CUDA rms_norm (the
   library default must), and time per call: eager diffusers (2 RMSNorms, cat, eager RoPE), 2 RMSNorms + our
   RoPE/cat kernel, and the fused kernel.
4. tanh-GELU into the single block's proj_out input (a column slice, 4608 x 12288 of 15360 columns): aten's
   `gelu(out=slice)`, aten into a contiguous tensor (the cat path's GELU, before its copy), and our kernel.

5. (--rope-tiles, alone) the RMSNorm+RoPE pass's launch tiles: heads per program x warps.

Usage: python bench/lossless_ops.py [--out bench/results/lossless-ops-h200.md] [--search] [--rope-tiles]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_ops import L2_BYTES, graph_time_us  # noqa: E402
from kernels import _high_triton as H  # noqa: E402
from kernels import _lossless_triton as K  # noqa: E402
from kernels.modulate import modulate, modulate_eager  # noqa: E402

SHAPES = [(1, 4096, 3072), (1, 512, 3072), (1, 4608, 3072), (2, 4608, 3072)]
EPS = 1e-6


def _inputs(B: int, S: int, D: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Activations of a DiT drift far from zero mean: offset rows so the mean/variance paths are exercised.
    x = (torch.randn(B, S, D, device="cuda", generator=g) * 4
         + torch.randn(B, S, 1, device="cuda", generator=g) * 8).to(dtype)
    emb = torch.randn(B, 6 * D, device="cuda", generator=g).to(dtype)
    shift, scale = emb.chunk(6, dim=1)[:2]
    return x, scale, shift


def variant_search(dtype: torch.dtype, variants: list[tuple]) -> tuple[list[str], list[tuple]]:
    cases = [_inputs(B, S, D, dtype, seed) for seed, (B, S, D) in enumerate(SHAPES[:3])]
    cases.append(_inputs(1, 64, 64, dtype, 7))  # most threads idle: exercises the empty-state combines
    rows, good = [f"| variant (fma mean, fma m2, combine-mean form, fma combine-m2) | rows with equal mean "
                  f"| rows with equal rstd | outputs equal |", "|---|---|---|---|"], []
    for v in variants:
        n_rows = eq_mean = eq_rstd = 0
        out_eq = True
        for x, scale, shift in cases:
            B, S, D = x.shape
            mean, rstd = torch.empty(B * S, device="cuda"), torch.empty(B * S, device="cuda")
            out = K.ln_modulate_exact(x, scale, shift, EPS, variant=v, stats=(mean, rstd))
            _, ref_mean, ref_rstd = torch.native_layer_norm(x, (D,), None, None, EPS)
            n_rows += B * S
            eq_mean += int((mean == ref_mean.reshape(-1)).sum())
            eq_rstd += int((rstd == ref_rstd.reshape(-1)).sum())
            out_eq &= torch.equal(out, modulate_eager(F.layer_norm(x, (D,), eps=EPS), scale, shift))
        if eq_mean == n_rows and eq_rstd == n_rows and out_eq:
            good.append(v)
        rows.append(f"| {v} | {eq_mean}/{n_rows} | {eq_rstd}/{n_rows} | {out_eq} |")
        print(rows[-1], flush=True)
    return rows, good


def bench_times(dtype: torch.dtype) -> list[str]:
    rows = ["| shape | eager LN + eager modulate us | aten LN + our modulate kernel us | fused exact, tl.reduce tree us "
            "| fused exact, explicit tree us | fused fast us (high) | exact (both trees): torch.equal "
            "| fast: max abs err (eager max abs) |", "|---|---|---|---|---|---|---|---|"]
    for B, S, D in SHAPES:
        nsets = min(32, max(2, math.ceil(4 * L2_BYTES / (2 * B * S * D * 2))))
        sets = [_inputs(B, S, D, dtype, 100 + i) for i in range(nsets)]

        def eager(s):
            return modulate_eager(F.layer_norm(s[0], (D,), eps=EPS), s[1], s[2])

        x, scale, shift = sets[0]
        ref = eager(sets[0])
        exact_ok = all(torch.equal(K.ln_modulate_exact(x, scale, shift, EPS, tree=t), ref)
                       for t in ("reduce", "explicit"))
        fast_err = (H.ln_modulate_fast(x, scale, shift, EPS).float() - ref.float()).abs().max().item()
        t_eager = graph_time_us([lambda s=s: eager(s) for s in sets])
        t_prev = graph_time_us([lambda s=s: K.modulate(F.layer_norm(s[0], (D,), eps=EPS), s[1], s[2]) for s in sets])
        t_exact = graph_time_us([lambda s=s: K.ln_modulate_exact(s[0], s[1], s[2], EPS, tree="reduce") for s in sets])
        t_explicit = graph_time_us([lambda s=s: K.ln_modulate_exact(s[0], s[1], s[2], EPS, tree="explicit")
                                    for s in sets])
        t_fast = graph_time_us([lambda s=s: H.ln_modulate_fast(s[0], s[1], s[2], EPS) for s in sets])
        rows.append(f"| ({B}, {S}, {D}) | {t_eager:.1f} | {t_prev:.1f} | {t_exact:.1f} | {t_explicit:.1f} | {t_fast:.1f} | {exact_ok} "
                    f"| {fast_err:.3g} ({ref.float().abs().max().item():.3g}) |")
        print(rows[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def _qk(B: int, T: int, I: int, dtype: torch.dtype, seed: int) -> tuple:
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    H, D = 24, 128
    g = torch.Generator(device="cuda").manual_seed(seed)
    txt = (torch.randn(B, T, H * D, device="cuda", generator=g) * 3).to(dtype).unflatten(-1, (H, D))
    img = (torch.randn(B, I, H * D, device="cuda", generator=g) * 3).to(dtype).unflatten(-1, (H, D))
    norms = [torch.nn.RMSNorm(D, eps=1e-6).to("cuda", dtype) for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.copy_(torch.rand(D, generator=torch.Generator().manual_seed(seed)) + 0.5)
    ids = torch.randint(0, 64, (T + I, 3), generator=torch.Generator().manual_seed(seed)).float()
    cos, sin = (t.cuda() for t in FluxPosEmbed(10000, [16, 56, 56])(ids))
    return txt, img, norms[0], norms[1], cos, sin


@torch.no_grad()
def rms_rope(dtype: torch.dtype) -> list[str]:
    from kernels.rope import rope_cat, rope_cat_eager

    rows = [f"| FMA in the sum of squares ({dtype}) | outputs equal (B=1 and B=2, 512 + 4096 tokens) |", "|---|---|"]
    cases = [_qk(B, 512, 4096, dtype, B) for B in (1, 2)]
    for fma in (False, True):
        ok = all(torch.equal(K.rms_rope_cat(t, i, nt.weight, ni.weight, 1e-6, 1e-6, c, s, fma_squares=fma),
                             rope_cat_eager(nt(t), ni(i), c, s)) for t, i, nt, ni, c, s in cases)
        rows.append(f"| {fma}{' (default)' if fma == K.RMS_FMA_SQUARES else ''} | {ok} |")
        print(rows[-1], flush=True)
    return rows


@torch.no_grad()
def rms_rope_times(dtype: torch.dtype) -> list[str]:
    from kernels.rope import rope_cat_eager

    rows = ["| q or k, (B, text, image) | eager diffusers us | RMSNorm x2 + our RoPE/cat kernel us (previous "
            "lossless) | fused RMSNorm+RoPE+cat us | speed-up vs previous |", "|---|---|---|---|---|"]
    for B, T, I in ((1, 512, 4096), (2, 512, 4096)):
        sets = [_qk(B, T, I, dtype, 10 + k) for k in range(6)]
        t_eager = graph_time_us([lambda a=a: rope_cat_eager(a[2](a[0]), a[3](a[1]), a[4], a[5]) for a in sets])
        t_prev = graph_time_us([lambda a=a: K.rope_cat(a[2](a[0]), a[3](a[1]), a[4], a[5]) for a in sets])
        t_fused = graph_time_us([lambda a=a: K.rms_rope_cat(a[0], a[1], a[2].weight, a[3].weight, 1e-6, 1e-6, a[4],
                                                            a[5]) for a in sets])
        rows.append(f"| ({B}, {T}, {I}) | {t_eager:.1f} | {t_prev:.1f} | {t_fused:.1f} | {t_prev / t_fused:.2f}x |")
        print(rows[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def rms_rope_tiles(dtype: torch.dtype) -> list[str]:
    """The fused RMSNorm+RoPE+cat pass per launch tile (heads per program, warps): time per call, each output equal
    to the default tile's (the per-head sums run in one order whatever the tile)."""
    rows = ["| heads per program x warps | us per call (1, 512, 4096) | equal to the default tile |", "|---|---|---|"]
    sets = [_qk(1, 512, 4096, dtype, 20 + k) for k in range(6)]
    want = [K.rms_rope_cat(a[0], a[1], a[2].weight, a[3].weight, 1e-6, 1e-6, a[4], a[5]) for a in sets]
    for heads, warps in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        tile = {"heads": heads, "num_warps": warps}
        t = graph_time_us([lambda a=a: K.rms_rope_cat(a[0], a[1], a[2].weight, a[3].weight, 1e-6, 1e-6, a[4], a[5],
                                                      tile=tile) for a in sets])
        ok = all(torch.equal(K.rms_rope_cat(a[0], a[1], a[2].weight, a[3].weight, 1e-6, 1e-6, a[4], a[5], tile=tile),
                             w) for a, w in zip(sets, want))
        default = " (default)" if {**K.RMS_ROPE_TILE, "heads": K.RMS_ROPE_TILE["heads"] or 8} == tile else ""
        rows.append(f"| {heads} x {warps}{default} | {t:.1f} | {ok} |")
        print(rows[-1], flush=True)
    return rows


@torch.no_grad()
def gelu_into_times(dtype: torch.dtype) -> list[str]:
    from torch.nn.functional import gelu

    rows = ["| (B, tokens, GELU columns of proj_out input) | aten gelu(out=slice) us | aten gelu, contiguous us "
            "| our kernel into the slice us | kernel == aten (torch.equal) |", "|---|---|---|---|---|"]
    for B in (1, 2):
        S, A, F_ = 4608, 3072, 12288
        sets = [((torch.randn(B, S, F_, device="cuda") * 3).to(dtype),
                 torch.empty(B, S, A + F_, device="cuda", dtype=dtype)) for _ in range(4)]
        h, buf = sets[0]
        K.gelu_tanh(h.view(-1, F_), buf.view(-1, A + F_)[:, A:])
        ok = torch.equal(buf[..., A:], gelu(h, approximate="tanh"))
        t_slice = graph_time_us([lambda a=a: torch._C._nn.gelu(a[0], approximate="tanh", out=a[1][..., A:])
                                 for a in sets])
        t_contig = graph_time_us([lambda a=a: gelu(a[0], approximate="tanh") for a in sets])
        t_ours = graph_time_us([lambda a=a: K.gelu_tanh(a[0].view(-1, F_), a[1].view(-1, A + F_)[:, A:])
                                for a in sets])
        rows.append(f"| ({B}, {S}, {F_}) | {t_slice:.1f} | {t_contig:.1f} | {t_ours:.1f} | {ok} |")
        print(rows[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/lossless-ops-h200.md")
    ap.add_argument("--search", action="store_true", help="try every FMA variant of the LayerNorm kernel")
    ap.add_argument("--rope-tiles", action="store_true",
                    help="only time the RMSNorm+RoPE pass's launch tiles (heads per program x warps)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    import triton

    lines = ["# Lossless norm and elementwise kernels", "", f"Command: `python3 {' '.join(sys.argv)}`", "",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
             f"library default variant {K.LN_FMA_VARIANT}.", ""]
    # --search: all 24 variants in bf16, then the other dtypes re-check the bf16 survivors and the default (each
    # variant is a compile: minutes). Default: the library's variant only, in every dtype.
    if args.rope_tiles:
        lines += ["## QK RMSNorm + RoPE(+cat): launch tiles (bf16, H=24, D=128)", ""] + rms_rope_tiles(torch.bfloat16)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        return
    variants = (list(itertools.product((False, True), (False, True), (0, 1, 2), (False, True))) if args.search
                else [K.LN_FMA_VARIANT])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        lines += [f"## FMA variants vs torch.native_layer_norm ({dtype})", ""]
        rows, good = variant_search(dtype, variants)
        lines += rows + ["", f"Matching every row: {good}; default matches: {K.LN_FMA_VARIANT in good}", ""]
        variants = sorted(set(good) | {K.LN_FMA_VARIANT})
    lines += ["## LayerNorm + modulate: time per call (bf16)", ""] + bench_times(torch.bfloat16)
    lines += ["", "## QK RMSNorm + RoPE(+cat) vs torch's rms_norm", ""]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        lines += rms_rope(dtype) + [""]
    lines += ["## QK RMSNorm + RoPE(+cat): time per call (bf16, H=24, D=128)", ""] + rms_rope_times(torch.bfloat16)
    lines += ["", "## tanh-GELU into a column slice: time per call (bf16)", ""] + gelu_into_times(torch.bfloat16)
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
