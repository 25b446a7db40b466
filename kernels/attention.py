"""Joint attention: SDPA (exact: diffusers' native backend, the lossless path) or 8-bit attention (`high`).

`attention(q, k, v, mask, fp8=...)` takes q, k, v as [B, S, H, D] (the layout the projections produce) and returns
[B, S, H, D]. With `fp8=True` and no refusal, q and k are quantized to int8 (q per token, k per 128-token block),
v to fp8 e4m3 (per channel), and Q K^T runs in int8, P V in fp8, both accumulating in 32 bits
(kernels/_attention_fp8_triton.py): not bit-exact, for the high tier only. `fp8_attention_refusal` says why it
cannot run (no CUDA, a GPU before Ada, fp32, a mask, a head size other than 32, 64 or 128); the caller then gets
SDPA, and the refusal is logged once per reason.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import sites, switches
from .fp8 import FP8, FP8_MAX, MIN_AMAX, to_fp8

logger = logging.getLogger(__name__)

VBLOCK = 128  # tokens per k scale: the Triton kernels' block, and the eager twin's
_HEAD_DIMS = (32, 64, 128)
_refusals_logged: set[str] = set()

# The site group of the feature table's `attention8` (kernels/sites.py): an attention module marks it and passes
# `attention8(self)` as `fp8=` to `attention`.
GROUP = "attention8"


def mark_attention8_site(module: nn.Module) -> None:
    sites.mark(module, GROUP)


def attention8(module: nn.Module) -> bool:
    return sites.on(module, GROUP)


def set_attention8(model: nn.Module, on: bool) -> int:
    """Switch every attention site of `model` to 8-bit attention (`on`, high tier, not bit-exact; refused per call
    where it cannot run) or back to SDPA; returns how many are on."""
    return sites.switch(model, {GROUP: on}).count(GROUP)


def attention8_sites(model: nn.Module) -> int:
    """How many attention sites of `model` run 8-bit attention."""
    return sites.count(model, GROUP)


def _warn_refusal_once(reason: str, template: str) -> None:
    """Log `template % reason` the first time this process refuses for `reason` (refusals repeat every call)."""
    if reason not in _refusals_logged:
        _refusals_logged.add(reason)
        logger.warning(template, reason)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' native attention backend: [B, S, H, D] in, permuted views into SDPA, [B, S, H, D] out."""
    if attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
        attn_mask = attn_mask.unsqueeze(1).unsqueeze(1)
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
    return out.permute(0, 2, 1, 3)


def _input_refusal(path: str, query: torch.Tensor, attn_mask: torch.Tensor | None, capability: tuple[int, int],
                   gpus: str) -> str | None:
    """The refusals both 8-bit paths share: torch.compile, device, compute capability, dtype, mask."""
    if torch.compiler.is_compiling():  # a cuDNN graph and our launchers are called, not traced
        return f"{path} does not run under torch.compile"
    if query.device.type != "cuda":
        return f"{path} needs a CUDA device (inputs are on {query.device})"
    if torch.cuda.get_device_capability(query.device) < capability:
        return f"{path} needs compute capability >= {capability[0]}.{capability[1]} ({gpus})"
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"{path} takes bf16/fp16 inputs, got {query.dtype}"
    if attn_mask is not None:
        return f"{path} has no mask support"
    return None


def fp8_attention_refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attn_mask: torch.Tensor | None = None) -> str | None:
    """Why fp8 attention cannot run on these inputs, or None when it can."""
    reason = _input_refusal("fp8 attention", query, attn_mask, (8, 9), "Ada/Hopper")
    if reason is not None:
        return reason
    if query.shape[-1] not in _HEAD_DIMS:
        return f"fp8 attention supports head sizes {_HEAD_DIMS}, got {query.shape[-1]}"
    if not (query.shape == key.shape == value.shape):
        return f"fp8 attention needs q, k, v of one shape, got {tuple(query.shape)}, {tuple(key.shape)}, " \
               f"{tuple(value.shape)}"
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return "fp8 attention needs unit last strides"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def _blocks(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[B, S, H, D] fp32 -> zero-padded [B, S_pad / VBLOCK, VBLOCK, H, D] and S."""
    B, S, H, D = t.shape
    pad = -S % VBLOCK
    return F.pad(t, (0, 0, 0, 0, 0, pad)).view(B, -1, VBLOCK, H, D), S


def _int8(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = amax.clamp(min=MIN_AMAX) / 127.0
    y = x / scale
    return torch.trunc(y + 0.5 * torch.sign(y)), scale  # half away from zero, as the kernel rounds


def fp8_attention_eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        round_p: bool = True) -> torch.Tensor:
    """The Triton kernel's arithmetic in eager fp32 (tests): the same quantization of q, k (int8) and v (e4m3),
    dequantized, softmax in fp32 and P rounded to e4m3 after scaling by 448 (relative to the row's global max, where
    the kernel uses its running max: close, not equal; `round_p=False` leaves P unrounded, as Triton's CPU
    interpreter runs the kernel)."""
    q = query.float()
    q8, qs = _int8(q, q.abs().amax(dim=-1, keepdim=True))
    kb, S = _blocks(key.float())
    k8, ks = _int8(kb, kb.abs().amax(dim=(2, 4), keepdim=True))
    k = (k8 * ks).flatten(1, 2)[:, :S]
    v = value.float()
    v8, vs = to_fp8(v, v.abs().amax(dim=1, keepdim=True))  # one scale per channel over all tokens
    v8s = v8.float() * (vs / FP8_MAX)  # v's scale and P's 1/448 applied after the product
    qh = (q8 * qs).permute(0, 2, 1, 3)
    s = qh @ k.permute(0, 2, 3, 1) / math.sqrt(query.shape[-1])
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    p8 = (p * FP8_MAX).to(FP8).float() if round_p else p * FP8_MAX
    out = (p8 @ v8s.permute(0, 2, 1, 3)) / denom
    return out.permute(0, 2, 1, 3).to(query.dtype)


def fp8_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 attention of [B, S, H, D] q, k, v on CUDA (see `fp8_attention_refusal`), into `out` when given."""
    from . import _attention_fp8_triton

    return _attention_fp8_triton.attention(query, key, value, VBLOCK, out)


# ----------------------------------------------------------------------------------------------------------------
# cuDNN's fp8 attention (Hopper): q, k, v and the output in fp8 e4m3 with one scale per tensor
# ----------------------------------------------------------------------------------------------------------------

CUDNN_FP8 = switches.register(
    "attention8_cudnn", True,
    "8-bit attention through cuDNN's fp8 SDPA where it applies (Hopper or newer, nvidia-cudnn-frontend installed, "
    "head size 128, after QK RMSNorm + RoPE); off: the Triton int8 Q K^T / fp8 P V kernel")
_CUDNN_HEAD_DIM = 128
_cudnn_lock = threading.Lock()
_cudnn_graphs: dict[tuple[Any, ...], "_CudnnFp8Graph"] = {}
_cudnn_handles: dict[int, Any] = {}


def cudnn_fp8_refusal(query: torch.Tensor, attn_mask: torch.Tensor | None = None) -> str | None:
    """Why cuDNN's fp8 attention cannot take q of this kind, or None when it can."""
    if not CUDNN_FP8.value:
        return "cuDNN fp8 attention is switched off (attention8_cudnn)"
    reason = _input_refusal("cuDNN fp8 attention", query, attn_mask, (9, 0), "Hopper")
    if reason is not None:
        return reason
    if query.shape[-1] != _CUDNN_HEAD_DIM:
        return f"cuDNN fp8 attention is built for head size {_CUDNN_HEAD_DIM}, got {query.shape[-1]}"
    try:
        import cudnn
    except ImportError:
        return "nvidia-cudnn-frontend is not installed"
    if cudnn.backend_version() < 90100:
        return f"cuDNN fp8 attention needs cuDNN >= 9.1, found {cudnn.backend_version()}"
    return None


# Each tensor of the graph by uid: a variant pack keyed by uid fits a graph built here and one loaded from the cache.
_CUDNN_UIDS = {name: uid for uid, name in enumerate(("q", "k", "v", "o", "descale_q", "descale_k", "descale_v",
                                                     "descale_s", "scale_s", "scale_o", "amax_s", "amax_o"), 1)}


class _CudnnFp8Graph:
    """cuDNN's fp8 SDPA forward built for one (B, S, H, D, device): inputs and output are [B, S, H, D] in memory
    (what the projections produce), seen by cuDNN as [B, H, S, D] with strides; inference only, no mask. Its built
    plan is kept in the kernel cache (kernels/cache.py) where one is set: `source` says "cache" or "built"."""

    def __init__(self, B: int, S: int, H: int, D: int, device: torch.device) -> None:
        import cudnn

        from . import cache

        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _cudnn_handles:
            with torch.cuda.device(index):
                _cudnn_handles[index] = cudnn.create_handle()
        self.handle = _cudnn_handles[index]
        key = (B, S, H, D, torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index),
               cudnn.backend_version(), getattr(cudnn, "__version__", ""))
        self.graph, self.source = cache.cached_plan("cudnn-sdpa-fp8", key, load=self._load,
                                                    build=lambda: self._build(B, S, H, D),
                                                    save=lambda g: bytes(g.serialize()))
        self.workspace_bytes = max(1, self.graph.get_workspace_size())
        # P = softmax in [0, 1] goes to fp8 scaled by 448 (e4m3's largest value), as the Triton kernel does.
        self.p_scales = torch.tensor([1.0 / FP8_MAX, FP8_MAX], dtype=torch.float32, device=device)

    def _build(self, B: int, S: int, H: int, D: int) -> Any:
        import cudnn

        dt = cudnn.data_type
        g = cudnn.pygraph(io_data_type=dt.HALF, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                          handle=self.handle)
        dims, strides = [B, H, S, D], [S * H * D, D, H * D, 1]
        q, k, v = (g.tensor(name=n, dim=dims, stride=strides, data_type=dt.FP8_E4M3) for n in "qkv")
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        scalars = [g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT) for n in names]
        dq, dk, dv, ds, ss, so = scalars
        o, _, amax_s, amax_o = g.sdpa_fp8(
            q=q, k=k, v=v, descale_q=dq, descale_k=dk, descale_v=dv, descale_s=ds, scale_s=ss,
            scale_o=so, is_inference=True, attn_scale=1.0 / math.sqrt(D), use_causal_mask=False)
        # Only fp8 outputs exist on Hopper (cuDNN's bf16 output needs Blackwell).
        o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(dt.FP8_E4M3)
        for t in (amax_s, amax_o):
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT)
        for name, t in zip(("q", "k", "v", "o", *names, "amax_s", "amax_o"), (q, k, v, o, *scalars, amax_s, amax_o)):
            t.set_uid(_CUDNN_UIDS[name])
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g

    def _load(self, data: bytes) -> Any:
        import cudnn

        g = cudnn.pygraph(handle=self.handle)
        try:
            g.deserialize(self.handle, list(data))
        except TypeError:  # a cudnn-frontend whose deserialize takes the data only
            g.deserialize(list(data))
        return g

    def variant_pack(self, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                     descale_k: torch.Tensor, v_scales: torch.Tensor, o8: torch.Tensor,
                     amax: torch.Tensor) -> dict[int, torch.Tensor]:
        """The graph's tensor uids -> their buffers for one execute: v_scales is (v's scale, the output's scale),
        amax takes cuDNN's two reported maxima."""
        one, u = (1, 1, 1, 1), _CUDNN_UIDS
        return {u["q"]: q8, u["k"]: k8, u["v"]: v8, u["o"]: o8, u["descale_q"]: descale_q.view(one),
                u["descale_k"]: descale_k.view(one), u["descale_v"]: v_scales[0:1].view(one),
                u["descale_s"]: self.p_scales[0:1].view(one), u["scale_s"]: self.p_scales[1:2].view(one),
                u["scale_o"]: v_scales[1:2].view(one), u["amax_s"]: amax[0:1].view(one),
                u["amax_o"]: amax[1:2].view(one)}

    def __call__(self, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                 descale_k: torch.Tensor, v_scales: torch.Tensor) -> torch.Tensor:
        import cudnn

        o8 = torch.empty_like(q8)
        amax = torch.empty(2, dtype=torch.float32, device=q8.device)  # cuDNN reports amax of P and O: unused
        # a workspace per call from torch's stream-ordered allocator (safe with CUDA graphs and several streams)
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=q8.device)
        pack = self.variant_pack(q8, k8, v8, descale_q, descale_k, v_scales, o8, amax)
        with _cudnn_lock:  # one handle per device: its stream is set per call
            cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
            self.graph.execute(pack, workspace, handle=self.handle)
        return o8


def _cudnn_graph(B: int, S: int, H: int, D: int, device: torch.device) -> _CudnnFp8Graph:
    key = (B, S, H, D, str(device))
    with _cudnn_lock:
        graph = _cudnn_graphs.get(key)
        if graph is None:
            graph = _cudnn_graphs[key] = _CudnnFp8Graph(B, S, H, D, device)
    return graph


def rope_attention_fp8(
    q: tuple[torch.Tensor | None, torch.Tensor], k: tuple[torch.Tensor | None, torch.Tensor],
    v: tuple[torch.Tensor | None, torch.Tensor], norms_q: tuple[nn.Module | None, nn.Module],
    norms_k: tuple[nn.Module | None, nn.Module], cos: torch.Tensor, sin: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Joint attention from projected (not yet normed) q, k, v given as (text or None, image) [B, *, H, D] pairs,
    through cuDNN's fp8 SDPA (quality "high", not bit-exact): q and k leave the fast QK RMSNorm + RoPE pass in fp8
    (one scale each, bounded by their norm weights), v is quantized with its amax, the fp8 output (v's scale: an
    average of v rows is bounded by v) comes back in q's dtype. -> [B, T + I, H, D], or None where it does not apply
    (the refusal is logged once; the caller runs its own path)."""
    from . import _attention_fp8_triton
    from .rope import rms_rope_fast

    reason = cudnn_fp8_refusal(q[1], attn_mask)
    if reason is None and any(t is not None and (t.stride(3) != 1 or t.stride(2) != t.shape[3]) for t in v):
        reason = "cuDNN fp8 attention: v's (heads, head size) rows are not contiguous"
    q8 = k8 = None
    if reason is None:
        q8 = rms_rope_fast(q[0], q[1], norms_q[0], norms_q[1], cos, sin, fp8=True)
        k8 = rms_rope_fast(k[0], k[1], norms_k[0], norms_k[1], cos, sin, fp8=True)
        if q8 is None or k8 is None:
            reason = "cuDNN fp8 attention: the fast QK RMSNorm + RoPE pass does not apply to these inputs"
    if reason is not None:
        _warn_refusal_once(reason, "%s: another attention path kept")
        return None
    v8, v_scales = _attention_fp8_triton.tokens_fp8(v[0], v[1])
    B, S, H, D = v8.shape
    o8 = _cudnn_graph(B, S, H, D, v8.device)(q8[0], k8[0], v8, q8[1], k8[1], v_scales)
    return _attention_fp8_triton.dequantize(o8, v_scales[0:1], q[1].dtype)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              *, fp8: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, H, D] attention: SDPA, or with `fp8` the 8-bit kernel where `fp8_attention_refusal` admits the inputs.
    out: a [B, S, H, D] view (unit last stride) to write the result into; it is returned."""
    if fp8:
        reason = fp8_attention_refusal(query, key, value, attn_mask)
        if reason is None and out is not None and out.stride(-1) != 1:
            reason = "fp8 attention writes into outputs with a unit last stride only"
        if reason is None:
            return fp8_attention(query, key, value, out)
        _warn_refusal_once(reason, "fp8 attention refused, SDPA kept: %s")
    result = sdpa(query, key, value, attn_mask)
    if out is None:
        return result
    out.copy_(result)
    return out
