"""fluxserve kernels: fused ops for FLUX-style DiT blocks, each with a native (eager) path and guards that fall back.

Knows nothing of models. (The submodule `kernels.modulate` keeps its name, so its op is `kernels.modulate.modulate`.) Every op computes exactly what its `*_eager` twin computes unless it says otherwise; the CUDA
kernels run only where their guard admits the inputs (and, for the exact ones, after `ExactGate` saw them match eager).

Lossless (bit-exact with eager):
- `residual_gate_add`           residual + gate * update (+ diffusers' fp16 clip), one pass   (kernels/residual.py)
                                (`terms=`: an adapter's term added to the update inside the same pass)
- `modulate.modulate`           AdaLN modulation normed * (1 + scale) + shift                   (kernels/modulate.py)
- `layer_norm_modulate`         LayerNorm (aten's CUDA reduction order) + modulation            (kernels/modulate.py)
- `rope_cat`, `rms_rope_cat`    QK RMSNorm + RoPE of [text; image] into the joint tensor        (kernels/rope.py)
- `gelu_tanh_into`              tanh-GELU written into a column slice                           (kernels/gelu.py)
- `lora.lora_tail`              a LoRA term in PEFT's order, y + F.linear(t, B) * s, one pass    (kernels/lora.py)
                                (`lora.deferred(layer)`: a consumer takes that layer's terms into its own pass,
                                the GELU's or the residual-gate's)
- `attention.sdpa`              diffusers' native attention backend ([B, S, H, D] in and out)   (kernels/attention.py)

High tier (not bit-exact):
- `fused_linear_gelu_tanh`      Linear + tanh-GELU in one GEMM epilogue, per-shape dispatch     (kernels/gelu.py)
- `layer_norm_modulate(..., fast=True)`  single-pass LayerNorm + modulation (kernels/_high_triton.py)
- `fp8.scaled_mm`               e4m3 rows x e4m3 weights (per-row / per-channel scales), bf16 out (kernels/fp8.py)
- `fp8.weight_only_linear`      a few bf16 rows against an fp8 weight (the AdaLN modulation)    (kernels/_fp8_triton.py)
- `fp8.quantize_rows`           per-row fp8 quantization of `[a | gelu(b)]` in one pass        (kernels/_fp8_triton.py)
                                (its rows may be longer than K: `fp8.Fp8Rows.spare`, room for adapter inputs)
- `fp8.copy_saturated`          values into (strided) fp8 columns, saturating, in one pass      (kernels/_fp8_triton.py)
- `fp8.rows_times_into`         fp8 rows x an adapter's fp8 A into their spare columns, one pass (kernels/_fp8_triton.py)
- `groupnorm.group_norm`        GroupNorm (+ SiLU) over channels-last activations, one pass     (kernels/groupnorm.py)
- `layer_norm_modulate(..., fp8=True)`  LayerNorm + modulation quantized per row in the same pass (`fp8.Fp8Rows`)
- `attention.attention(..., fp8=True)`  int8 Q K^T, fp8 P V (kernels/_attention_fp8_triton.py); SDPA where refused
- `rope.rms_rope_cat(..., fast=True)`  QK RMSNorm + RoPE in one non-exact pass (kernels/_high_triton.py)
- `attention.rope_attention_fp8`  QK RMSNorm + RoPE to fp8, v to fp8, cuDNN's fp8 SDPA (Hopper, nvidia-cudnn-frontend)

Sites and switches:
- GELU sites: `mark_fused_gelu_site`, `gelu_site`, `mount` / `unmount` (all-or-nothing), `mounted_sites`
  (`gelu.unmark_fused_gelu_site` when a site's layer is merged away)
- `switches`: the one registry of kernel on/off switches (`switches.signature()`, `switches.override(...)`)
"""

from . import fp8, switches
from .gelu import (
    MountReport,
    can_fuse_linear_gelu,
    fused_linear_gelu_tanh,
    gelu_site,
    gelu_tanh_into,
    mark_fused_gelu_site,
    mount,
    mounted_sites,
    unmount,
)
from .modulate import layer_norm_modulate
from .residual import fast_path_disabled, reset_fast_path, residual_gate_add
from .rope import rms_rope_cat, rope_cat

__all__ = [
    "MountReport",
    "can_fuse_linear_gelu",
    "fast_path_disabled",
    "fp8",
    "fused_linear_gelu_tanh",
    "gelu_site",
    "gelu_tanh_into",
    "layer_norm_modulate",
    "mark_fused_gelu_site",
    "mount",
    "mounted_sites",
    "reset_fast_path",
    "residual_gate_add",
    "rms_rope_cat",
    "rope_cat",
    "switches",
    "unmount",
]
