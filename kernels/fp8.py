"""FP8 (e4m3) ops for the `high` tier's linear layers (not bit-exact; the layer is `model.linear.Linear` with its
`FP8` method): weights quantized once per output channel, activations quantized per row by one Triton pass,
`torch._scaled_mm` with bias and bf16 output.

An activation is quantized in the same pass that would otherwise only copy or activate it: `quantize_rows(a, b)`
reads `a` and optionally a second part `b` (with tanh-GELU applied to it), finds each row's absolute maximum over
both and writes one fp8 row `[a | gelu(b)]` plus its fp32 scale. So `linear(cat([a, gelu(b)]))` (the single
block's proj_out) and `linear(gelu(h))` (the FF down-projection) need no bf16 intermediate at all. Likewise
`kernels.modulate.layer_norm_modulate(..., fp8=True)` quantizes the modulated LayerNorm row in the norm's own
pass and hands the consumers an `Fp8Rows` (the q/k/v and MLP up-projections take it as it is: one quantization
for all of them).

Where fp8 does not apply (no CUDA, a GPU before Ada/Hopper, fp16 or fp32 models, shapes `_scaled_mm` refuses),
`fp8_refusal` says why and the caller keeps its bf16 layer; every op here has an eager twin used on the CPU. A GEMM
that cuBLAS refuses at run time (a problem it has no algorithm for) falls back in `scaled_mm`, once per problem.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import switches

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_AMAX = 1e-12  # an all-zero row gets this amax (a finite scale, zeros stay zeros)
# On: checked and timed on the H200 (bench/results/high-h200-session10.md: ~2% per step with graphs, same PSNR); the
# switch stays for benchmarks that measure the consumers' separate quantization pass.
LN_PRODUCER = switches.register(
    "fp8_norm_producer", True, "fp8 norm sites quantize their modulated LayerNorm rows in the norm's own pass")
# Hopper's fp8 tensor-core accumulator keeps fewer bits than fp32; without fast accumulation the GEMM promotes the
# partial sums to fp32 registers every few k-steps, at a cost in speed. On: measured faster at the same PSNR
# (bench/results/fp8-gemm-h200.md, high-h200-session11.md); the switch stays for benchmarks and tests.
FAST_ACCUM = switches.register(
    "fp8_fast_accum", True, "fp8 GEMMs accumulate in the tensor cores' own precision (no periodic fp32 promotion)")
# cuBLAS has no fast-accumulation row-scaled algorithm for a few rows at FLUX's long reductions (K = 12288, 15360:
# M <= 42 refused on an H100, bench/results/fp8-rows-h100.md), which a 64x64 image's 16 tokens hit; the promoting
# one takes every M, and so few rows cost a weight read either way.
FAST_ACCUM_MIN_ROWS = 64


def fast_accumulation(rows: int) -> bool:
    """Whether an fp8 GEMM of `rows` rows asks cuBLAS for fast accumulation: the switch, from FAST_ACCUM_MIN_ROWS."""
    return FAST_ACCUM.value and rows >= FAST_ACCUM_MIN_ROWS


# Layers fed at most this many rows (the AdaLN modulation: one row per image) skip the activation quantization and
# read their fp8 weight in a weight-only GEMV: the GEMM there is a weight read, and bf16 weights are twice the bytes.
WEIGHT_ONLY_ROWS = 16


@dataclass(frozen=True)
class Fp8Rows:
    """An activation quantized per row: fp8 `q` [M, K], fp32 `scale` [M, 1], standing for a tensor of `shape`
    [..., K] (M its leading elements). An fp8 `model.linear.Linear` takes it in place of that tensor.

    `q` may be the first K columns of wider rows (`spare` columns past K, left unwritten by the producer): a layer
    with per-request adapters writes its adapter inputs there and multiplies the wider rows in one GEMM
    (model/adapter_slots.py)."""

    q: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size

    @property
    def spare(self) -> int:
        """Columns past K in q's rows (0 for contiguous rows)."""
        return self.q.stride(0) - self.q.shape[1] if self.q.dim() == 2 else 0

    def wide(self, columns: int) -> torch.Tensor:
        """q's rows with `columns` of their spare columns: [M, K + columns], a view."""
        if columns > self.spare:
            raise ValueError(f"{columns} spare columns asked of rows that have {self.spare}")
        return self.q.as_strided((self.q.shape[0], self.q.shape[1] + columns), (self.q.stride(0), 1))


def with_spare(rows: int, columns: int, spare: int, device: torch.device,
               dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """An uninitialized [rows, columns] tensor whose rows are `columns + spare` long (a view of them)."""
    return torch.empty((rows, columns + spare), dtype=dtype, device=device)[:, :columns]


def fp8_refusal(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why fp8 linears cannot run for a model on `device` in `dtype`, or None when they can."""
    if device.type != "cuda":
        return f"fp8 GEMMs need a CUDA device (model is on {device})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"fp8 GEMMs need compute capability >= 8.9 (Ada/Hopper); this GPU is {major}.{minor}"
    if dtype != torch.bfloat16:
        return f"fp8 GEMMs with row-wise scales write bf16; the model is {dtype}"
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def shape_refusal(in_features: int, out_features: int) -> str | None:
    """`_scaled_mm` needs K and N to be multiples of 16."""
    if in_features % 16 or out_features % 16:
        return f"fp8 GEMM needs in/out features divisible by 16, got {in_features} -> {out_features}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------------------------


def to_fp8(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in e4m3 with `amax` (broadcasting against x: a row's, a channel's) mapped to FP8_MAX, saturating; and the
    fp32 scale that multiplies it back."""
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows_eager(a: torch.Tensor, b: torch.Tensor | None = None, gelu_b: bool = False,
                        spare: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows`'s twin: rows of `cat([a, gelu(b) if gelu_b else b], -1)` in fp32 -> fp8, scale [M, 1]."""
    parts = [a.float()]
    if b is not None:
        parts.append(F.gelu(b.float(), approximate="tanh") if gelu_b else b.float())
    x = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    q, scale = to_fp8(x, x.abs().amax(dim=-1, keepdim=True))
    return _spread(q, spare), scale


def _spread(q: torch.Tensor, spare: int) -> torch.Tensor:
    """q [..., K] as [M, K] rows with `spare` columns past K (a copy into wider rows when spare > 0)."""
    q = q.reshape(-1, q.shape[-1])
    if not spare:
        return q
    out = with_spare(q.shape[0], q.shape[1], spare, q.device, q.dtype)
    out.copy_(q)
    return out


ROWS_TIMES = switches.register("fp8_rows_times_a", True,
                              "an adapter's x A^T into the rows' spare fp8 columns in one Triton pass (else a "
                              "scaled_mm and a saturating copy)")


def rows_times_eager(q: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, dst: torch.Tensor,
                     ones: torch.Tensor | None = None) -> None:
    """`rows_times_into`'s twin: the fp8 GEMM (unit row scales: `ones` [M, 1] where the caller keeps them) to bf16,
    then the saturating copy."""
    if ones is None:
        ones = torch.ones(q.shape[0], 1, device=q.device, dtype=torch.float32)
    copy_saturated(rows_matmul(q, a, ones, a_scale.reshape(1, -1), None), dst)


def rows_times_into(q: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, dst: torch.Tensor,
                    ones: torch.Tensor | None = None) -> None:
    """dst (fp8 [M, W], a view of rows' spare columns) = q [M, K] @ a [W, K]^T * a_scale [W] in e4m3, saturating:
    fp8 rows (their own scales left to the GEMM that reads dst) times an adapter's fp8 A. One pass on CUDA."""
    if ROWS_TIMES.value and _device_supported(q.device) and q.stride(-1) == 1 and dst.stride(-1) == 1 \
            and a.is_contiguous() and not torch.compiler.is_compiling():
        from . import _fp8_triton

        _fp8_triton.rows_times_into(q, a, a_scale, dst)
        return
    rows_times_eager(q, a, a_scale, dst, ones)


def copy_saturated(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (fp8 [M, W], maybe a strided view) = src [M, W] in e4m3, saturating at +-FP8_MAX: one pass on CUDA."""
    if _device_supported(src.device) and src.stride(-1) == 1 and dst.stride(-1) == 1 \
            and not torch.compiler.is_compiling():
        from . import _fp8_triton

        _fp8_triton.copy_saturated(src, dst)
        return
    dst.copy_(src.clamp(-FP8_MAX, FP8_MAX))


def _device_supported(device: torch.device) -> bool:
    """Where the Triton passes and `torch._scaled_mm` run (elsewhere the eager twins); one check, as in the other
    kernel modules."""
    return device.type == "cuda"


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., K] as [M, K] with a unit last stride (a view where the layout allows, else a copy)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def quantize_rows(a: torch.Tensor, b: torch.Tensor | None = None, gelu_b: bool = False,
                  spare: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantization of `[a | b]` ([..., Ka] and [..., Kb], same leading shape), tanh-GELU on `b` if
    `gelu_b`: returns (fp8 [M, Ka + Kb], fp32 scale [M, 1]) with M the leading elements. One pass on CUDA.
    `spare`: the rows are `spare` columns longer than that, unwritten (`Fp8Rows.spare`)."""
    a2 = _rows(a)
    b2 = None if b is None else _rows(b)
    if b2 is not None and b2.shape[0] != a2.shape[0]:
        raise ValueError(f"quantize_rows: {tuple(a.shape)} and {tuple(b.shape)} have different leading shapes")
    if (not _device_supported(a2.device) or a2.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or torch.compiler.is_compiling()):  # Dynamo traces the twin (Inductor writes its pass), not a launcher
        return quantize_rows_eager(a2, b2, gelu_b, spare)
    from . import _fp8_triton

    out = with_spare(a2.shape[0], a2.shape[1] + (0 if b2 is None else b2.shape[1]), spare, a2.device)
    return _fp8_triton.quantize_rows(a2, b2, gelu_b, out=out)


def weight_only_linear_eager(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                             bias: torch.Tensor | None) -> torch.Tensor:
    """The weight-only GEMV's twin: x [M, K] @ (fp8 weight [N, K] * scale [1, N])^T + bias, in fp32 -> bf16."""
    out = (x.float() @ weight.float().t()) * weight_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (M <= WEIGHT_ONLY_ROWS) against an fp8 weight with its activation kept as it is: one Triton GEMV
    reading the weight once on CUDA, the eager twin elsewhere."""
    if x.shape[0] > WEIGHT_ONLY_ROWS:
        raise ValueError(f"weight_only_linear: {x.shape[0]} rows, at most {WEIGHT_ONLY_ROWS}")
    if not _device_supported(x.device):
        return weight_only_linear_eager(x, weight, weight_scale, bias)
    from . import _fp8_triton

    return _fp8_triton.weight_only_linear(x.to(torch.bfloat16), weight, weight_scale, bias)


def layer_norm_modulate_fp8_eager(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                                   eps: float, spare: int = 0) -> Fp8Rows:
    """The eager twin of the fp8 norm (`layer_norm_modulate(..., fp8=True)`): the modulated LayerNorm in fp32 (no
    rounding to x's dtype), quantized."""
    D = x.shape[-1]
    y = F.layer_norm(x.float(), (D,), eps=eps) * (1 + scale.float()[:, None]) + shift.float()[:, None]
    q, s = quantize_rows_eager(y.reshape(-1, D), spare=spare)
    return Fp8Rows(q, s, x.shape)


# ---------------------------------------------------------------------------------------------------------------
# The GEMM
# ---------------------------------------------------------------------------------------------------------------

# (M, K, N, fast accumulation) that cuBLAS refused, with its error: the next call of that problem goes straight to
# the next form. FAST_ACCUM_MIN_ROWS avoids the refusals measured; this catches the ones no probe has seen (another
# GPU, another cuBLAS), so a request gets a slower GEMM instead of a 500.
REFUSED: dict[tuple[int, int, int, bool], str] = {}


def _refused_by_cublas(exc: RuntimeError) -> bool:
    """cuBLAS found no algorithm for the problem: raised before any launch, so nothing ran and a retry is safe."""
    return "CUBLAS_STATUS_NOT_SUPPORTED" in str(exc)


def scaled_mm_eager(q: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """The fp8 GEMM's twin: the dequantized operands multiplied in fp32 -> bf16 (CPU, and problems cuBLAS refuses)."""
    out = (q.float() * scale) @ (weight.float() * weight_scale.t()).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


def scaled_mm(q: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None, fast: bool) -> torch.Tensor:
    """fp8 q [M, K] (row scales [M, 1]) @ fp8 weight [N, K]^T (channel scales [1, N]) + bias -> bf16 [M, N] by
    `torch._scaled_mm`. Where cuBLAS refuses the problem: without fast accumulation, then the eager twin; each
    refusal is logged once and remembered."""
    if torch.compiler.is_compiling():  # traced as the plain op: no try/except or refusal table in the graph
        return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, bias=bias,
                                out_dtype=torch.bfloat16, use_fast_accum=fast)
    M, K, N = q.shape[0], q.shape[1], weight.shape[0]
    for use_fast in ((True, False) if fast else (False,)):
        key = (M, K, N, use_fast)
        if key in REFUSED:
            continue
        try:
            return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, bias=bias,
                                    out_dtype=torch.bfloat16, use_fast_accum=use_fast)
        except RuntimeError as exc:
            if not _refused_by_cublas(exc):
                raise
            REFUSED[key] = str(exc).splitlines()[0]
            logger.warning("fp8 GEMM %dx%d -> %d (fast accumulation %s) refused by cuBLAS (%s); %s from now on",
                           M, K, N, "on" if use_fast else "off", REFUSED[key],
                           "without fast accumulation" if use_fast else "the eager fp32 form")
    return scaled_mm_eager(q, weight, scale, weight_scale, bias)


def rows_matmul(q: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """fp8 rows [M, K] (scales [M, 1]) @ fp8 weight [N, K]^T (scales [1, N]) + bias -> bf16 [M, N] wherever the
    rows are: on CUDA `scaled_mm` with fast accumulation by row count (`fast_accumulation`), elsewhere the eager
    twin."""
    if not _device_supported(q.device):
        return scaled_mm_eager(q, weight, scale, weight_scale, bias)
    return scaled_mm(q, weight, scale, weight_scale, bias, fast_accumulation(q.shape[0]))
