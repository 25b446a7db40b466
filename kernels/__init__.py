"""fluxserve kernels: the bit-exact residual-gate fusion and the Linear + tanh-GELU site protocol."""

from .gelu import (
    MountReport,
    can_fuse_linear_gelu,
    fused_linear_gelu_tanh,
    gelu_site,
    mark_fused_gelu_site,
    mount,
    mounted_sites,
    unmount,
)
from .residual import fast_path_disabled, reset_fast_path, residual_gate_add

__all__ = [
    "MountReport",
    "can_fuse_linear_gelu",
    "fast_path_disabled",
    "fused_linear_gelu_tanh",
    "gelu_site",
    "mark_fused_gelu_site",
    "mount",
    "mounted_sites",
    "reset_fast_path",
    "residual_gate_add",
    "unmount",
]
