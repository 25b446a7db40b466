"""Shard a fully loaded transformer in place for tensor parallelism, by its family's declarative plan.

The plan (`model.family.ModelFamily.tp_plan`; FLUX.1's in model/flux1.py) names the column- and row-parallel linear
layers by module path; every other layer stays replicated. Each matched layer becomes this rank's share of a
`model.linear.Linear` (a plain one, or one already converted: weights and scales shard alike), and the attention
modules of `attention_path` read their local head count from `heads`. A FLUX.1 double block then all-reduces 4
times, a single block once: FLUX.1-dev 19 * 4 + 38 * 1 = 114 all-reduces per forward; the residual stream, the
residual-gate sites and everything between blocks run unchanged (residual-gate fusion stays bit-exact with eager at
the same TP degree).

Works on our transformer and on diffusers' (same module tree; the latter is the eager reference in tests).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from model.family import family_of
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


def _shard(layer: nn.Module, parallel: Column | Row) -> nn.Module:
    """This rank's share of a plain or already converted linear layer (weights and scales alike), or of a PEFT LoRA
    layer with its adapters (`_shard_adapted`)."""
    if isinstance(layer, Linear):
        return layer.sharded(parallel)
    if _is_lora_layer(layer):
        return _shard_adapted(layer, parallel)
    if type(layer) is not nn.Linear:  # an adapter layer of another kind: its adapter would be silently dropped
        raise TypeError(f"cannot shard a {type(layer).__module__}.{type(layer).__qualname__}: only plain linear "
                        "and PEFT LoRA linear layers shard")
    return Linear.from_linears([layer], parallel=parallel)


def _is_lora_layer(layer: nn.Module) -> bool:
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # no PEFT, no adapters
        return False
    return isinstance(layer, LoraLinear)


def _shard_adapted(layer: nn.Module, parallel: Column | Row) -> nn.Module:
    """A PEFT LoRA linear (`base(x) + B(A(x)) * scaling` per active adapter), sharded in place so that each rank adds
    its share of every adapter's term: column-parallel, B keeps this rank's output rows (A whole); row-parallel, A
    keeps this rank's input columns and all-reduces its rank-r output (B whole), because the base layer's sum over
    ranks is already done when PEFT adds the term. Per-request switching (set_adapters) is unchanged."""
    if layer.merged or any(layer.lora_variant.get(n) is not None for n in layer.lora_A):
        raise TypeError("cannot shard a LoRA layer with merged weights or an adapter variant (e.g. DoRA)")
    layer.base_layer = _shard(layer.base_layer, parallel)
    _shard_adapter_side(layer, parallel, list(layer.lora_A.keys()))
    return layer


def _shard_adapter_side(layer: nn.Module, parallel: Column | Row, names: list[str]) -> None:
    """Column-parallel: B of each named adapter keeps this rank's output rows; row-parallel: A its input columns."""
    sharded_side = layer.lora_B if isinstance(parallel, Column) else layer.lora_A
    for name in names:
        sharded_side[name] = _shard(sharded_side[name], parallel)


def shard_adapter(model: nn.Module, name: str, layers: list[str]) -> None:
    """Shard adapter `name`, added to a sharded model while it serves (`model.adapters.load_adapter`, which returned
    `layers`), as `_shard_adapted` shards one loaded before sharding: by each layer's base, whose parallel style
    (and blocks) the sharding recorded. A layer whose base stayed replicated keeps the adapter whole."""
    if tp_info(model) is None:
        return
    with torch.no_grad():
        for path in layers:
            layer = model.get_submodule(path)
            base = layer.get_base_layer()
            if isinstance(base, Linear) and isinstance(base.parallel, (Column, Row)) and base.parallel.world > 1:
                _shard_adapter_side(layer, base.parallel, [name])


def shard_transformer(model: nn.Module, rank: int, world_size: int, group: dist.ProcessGroup | None = None
                      ) -> nn.Module:
    """Shard `model` (fully loaded on this rank) in place for rank `rank` of `world_size` by its family's TP plan;
    returns it.

    Each shard is a copy, so a full weight is freed as soon as the model held its last reference. Raises ValueError
    when the head count is not divisible by world_size (nothing is changed).
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
        family = family_of(model)
        with torch.no_grad():
            for name, layer in list(model.named_modules()):
                rule = family.tp_rule(name)
                if rule is None:
                    continue
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name)
                blocks = None if rule.blocks is None else tuple(rule.blocks(parent, layer))
                style = Column if rule.style == "column" else Row
                setattr(parent, attr, _shard(layer, style(rank, world_size, group, blocks=blocks)))
            for name, attn in model.named_modules():
                if fnmatch.fnmatchcase(name, family.attention_path):
                    # Processors read the local head count from attn.heads (diffusers' reshapes by head_dim alone).
                    attn.heads = attn.heads // world_size
                    if hasattr(attn, "inner_dim"):
                        attn.inner_dim = attn.inner_dim // world_size
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
