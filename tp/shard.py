"""Shard a fully loaded FLUX transformer in place for tensor parallelism (Megatron layout).

Per double-stream block (4 all-reduces):
  attn.to_q/to_k/to_v, attn.add_q_proj/add_k_proj/add_v_proj  column-parallel by heads (no communication)
  attn.to_out.0, attn.to_add_out                               row-parallel   -> 2 all-reduces
  ff.net.0.proj, ff_context.net.0.proj (+ tanh-GELU)           column-parallel (FluxGELU, a fused-GELU site)
  ff.net.2, ff_context.net.2                                   row-parallel   -> 2 all-reduces
Per single-stream block (1 all-reduce):
  attn.to_q/to_k/to_v, proj_mlp (+ tanh-GELU site)             column-parallel
  proj_out                                                     row-parallel over cat([attn, mlp]) -> 1 all-reduce
  (rank r's input is [attn shard r | mlp shard r], so its weight columns are [attn cols of r | mlp cols of r])
Replicated: AdaLN modulation linears (they index the full hidden dim), the QK RMSNorms (over head_dim, after the
head split), time/text/guidance embedders, x_embedder, context_embedder, norm_out, proj_out, RoPE.
FLUX.1-dev: 19 * 4 + 38 * 1 = 114 all-reduces per transformer forward; every other activation stays
replicated, so the residual stream, the residual-gate sites and everything between blocks run unchanged
(residual-gate fusion stays bit-exact with eager at the same TP degree).

Works on our `model.flux.FluxTransformer` and on diffusers' `FluxTransformer2DModel` (same module tree; the
latter is the eager reference in tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from model.flux import FluxGELU

from model.linear import Column, Linear, Row

TP_ATTR = "_fluxserve_tp"


@dataclass(frozen=True)
class TPInfo:
    rank: int
    world_size: int
    group: dist.ProcessGroup | None


def tp_info(model: nn.Module) -> TPInfo | None:
    """The sharding a model carries (None when unsharded)."""
    return model.__dict__.get(TP_ATTR)


def _shard(layer: nn.Module, parallel: Column | Row) -> Linear:
    """This rank's share of a plain or already converted linear layer (weights and scales alike)."""
    if isinstance(layer, Linear):
        return layer.sharded(parallel)
    return Linear.from_linears([layer], parallel=parallel)


def _column(linear: nn.Module, info: TPInfo) -> Linear:
    return _shard(linear, Column(info.rank, info.world_size, info.group))


def _row(linear: nn.Module, info: TPInfo, input_blocks: list[int] | None = None) -> Linear:
    blocks = None if input_blocks is None else tuple(input_blocks)
    return _shard(linear, Row(info.rank, info.world_size, info.group, blocks=blocks))


def _shard_attention(attn: nn.Module, info: TPInfo) -> None:
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        layer = getattr(attn, name, None)
        if layer is not None:
            setattr(attn, name, _column(layer, info))
    to_out = getattr(attn, "to_out", None)
    if to_out is not None:
        to_out[0] = _row(to_out[0], info)
    if getattr(attn, "to_add_out", None) is not None:
        attn.to_add_out = _row(attn.to_add_out, info)
    # Processors read the local head count from attn.heads (diffusers' reshapes by head_dim alone).
    attn.heads = attn.heads // info.world_size
    if hasattr(attn, "inner_dim"):
        attn.inner_dim = attn.inner_dim // info.world_size


def _shard_feed_forward(ff: nn.Module, info: TPInfo) -> None:
    up = ff.net[0]
    col = _column(up.proj, info)
    if isinstance(up, FluxGELU):
        ff.net[0] = FluxGELU(col)  # column-parallel up-proj + tanh-GELU through the site protocol
    else:
        up.proj = col  # diffusers' GELU module: proj then gelu, unchanged
    ff.net[2] = _row(ff.net[2], info)


def shard_flux_transformer(
    model: nn.Module, rank: int, world_size: int, group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Shard `model` (fully loaded on this rank) in place for rank `rank` of `world_size`; returns it.

    Each shard is a copy, so a full weight is freed as soon as the model held its last reference. Raises ValueError when the head count is not divisible by world_size (nothing is changed).
    """
    if tp_info(model) is not None:
        raise RuntimeError(f"model is already sharded ({tp_info(model)})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    heads = int(model.config.num_attention_heads)
    if heads % world_size:
        raise ValueError(
            f"num_attention_heads={heads} is not divisible by the tensor-parallel size {world_size}"
        )
    info = TPInfo(rank, world_size, group)
    if world_size > 1:
        with torch.no_grad():
            for block in model.transformer_blocks:
                _shard_attention(block.attn, info)
                _shard_feed_forward(block.ff, info)
                _shard_feed_forward(block.ff_context, info)
            for block in model.single_transformer_blocks:
                _shard_attention(block.attn, info)
                dim = block.proj_out.in_features - block.proj_mlp.out_features
                block.proj_mlp = _column(block.proj_mlp, info)
                block.proj_out = _row(block.proj_out, info, input_blocks=[dim, block.proj_mlp.out_features])
    object.__setattr__(model, TP_ATTR, info)
    return model


@torch.no_grad()
def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a sharded model (collective: every rank calls it; all get the full dict).

    Keys are the original parameter names, so it can be compared with (or loaded into) an unsharded model.
    """
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():  # same order on every rank
        if isinstance(module, Linear) and module.parallel.world > 1:
            w, b = module.full_weight()
            state[f"{name}.weight"] = w
            if b is not None:
                state[f"{name}.bias"] = b
    return state


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL only moves CUDA tensors; gloo takes CPU ones.
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


@torch.no_grad()
def check_replicas_identical(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise RuntimeError on every rank unless every rank holds the same (unsharded) weights (collective).

    Sharding assumes each rank loaded the same checkpoint (or built the same seeded random preset); a rank with
    other weights would still run and silently produce a different image. Compares a per-parameter fingerprint
    (float64 sum and sum of squares), gathered on the CPU.
    """
    names, prints = [], []
    for name, p in model.named_parameters():
        names.append(name)
        p64 = p.detach().double()
        prints.append(torch.stack([p64.sum(), (p64 * p64).sum()]))
    local = torch.stack(prints) if prints else torch.zeros(0, 2, dtype=torch.float64)
    local = local.to(_comm_device(group))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    gathered = [g.cpu() for g in gathered]
    for r, other in enumerate(gathered[1:], start=1):
        diff = (other != gathered[0]).any(dim=1).nonzero()
        if len(diff):
            raise RuntimeError(
                f"rank {r} holds different weights than rank 0 (first: {names[int(diff[0])]}); every rank must "
                "load the same checkpoint before sharding"
            )


def mount_all_ranks(model: nn.Module, group: dist.ProcessGroup | None = None):
    """Mount the fused GELU sites on every rank or on none (collective).

    Mounts locally with `kernels.mount` (itself all-or-nothing), agrees on the outcome with a MIN all-reduce of
    the local ok flag, and unmounts locally if any rank refused. Returns (ok_on_all_ranks, local MountReport).
    """
    from kernels.gelu import mount, unmount  # submodule import: robust to a namespace-package install

    report = mount(model)
    if group is None:
        info = tp_info(model)
        group = info.group if info is not None else None
    ok = agree_all_ranks(report.ok, group)
    if not ok:
        unmount(model)
    return ok, report


def agree_all_ranks(ok: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank iff `ok` is true on every rank (collective: a MIN all-reduce); `ok` alone without a
    process group."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_comm_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
