"""LoRA adapters loaded and unloaded while a pipeline serves (the runtime adapter API), on any transformer it serves:
unsharded or a TP rank's shard.

diffusers' loader (and PEFT under it) only wraps plain `nn.Linear` layers, and a served transformer may hold sharded
`model.linear.Linear` layers. So an adapter is loaded by diffusers itself, with the pipeline's own
`load_lora_weights` (same conversion of the file's format, same PEFT config, same text-encoder part), into a
skeleton of the transformer (its architecture, no weights: `_skeleton`), and its per-adapter entries are then moved
into the served transformer's layers: into the PEFT layer already there (an adapter loaded at start wrapped it), or
the skeleton's PEFT layer itself, put around the served base layer. The adapter's tensors end on the base layer's
device and dtype, as PEFT puts them. A TP rank then shards the new adapter (`tp.shard.shard_adapter`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _is_peft_layer(module: nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def _skeleton(served: nn.Module) -> nn.Module:
    """The served transformer's architecture with no weights: a meta-device model whose linear layers hold a
    broadcast zero (no memory) on the served device and dtype, so PEFT makes and places an adapter's tensors there as
    it does for the served model itself."""
    weight = next(served.parameters())
    zero = torch.zeros((), device=weight.device, dtype=served.dtype)
    with torch.device("meta"):
        skeleton = type(served).from_config(served.config)
    for layer in skeleton.modules():
        if type(layer) is nn.Linear:  # (PEFT reads a base layer's device and dtype from its weight)
            layer.weight = nn.Parameter(zero.expand(layer.out_features, layer.in_features), requires_grad=False)
    return skeleton


def _base_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shapes of a model's own parameters (a PEFT layer's base under its original name; adapters left out)."""
    return {n.replace(".base_layer.", "."): tuple(p.shape) for n, p in model.named_parameters() if "lora_" not in n}


def _move_entries(src: nn.Module, dst: nn.Module, name: str) -> None:
    """Every per-adapter entry of `name` in PEFT layer `src` (its ModuleDicts, ParameterDicts and plain dicts:
    A, B, r, alpha, scaling, dropout, variants) into PEFT layer `dst`."""
    for attr, value in {**src.__dict__, **src._modules}.items():
        if attr.startswith("_") or not isinstance(value, (dict, nn.ModuleDict, nn.ParameterDict)):
            continue
        if name in value:
            getattr(dst, attr)[name] = value[name]


def _loaded_skeleton(pipe: Any, name: str, path: str, skeleton: nn.Module) -> nn.Module:
    """`skeleton` (the served transformer's architecture) with adapter file `path` loaded as `name` by the pipeline's
    own loader; its text-encoder part, if any, goes into the pipeline's real text encoders."""
    served = pipe.transformer
    shapes = _base_shapes(skeleton)
    pipe.transformer = skeleton
    try:
        pipe.load_lora_weights(str(path), adapter_name=name)
    finally:
        pipe.transformer = served
    if _base_shapes(skeleton) != shapes or getattr(skeleton, "_transformer_norm_layers", None):
        # a Control LoRA widens the input projection and replaces norms: the model itself changes
        pipe.delete_adapters([name])
        raise ValueError(f"adapter file {path} reshapes the model (a Control LoRA): load it at start (args.loras)")
    return skeleton


def read_adapter(pipe: Any, name: str, path: str, model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor,
                                                                                       float]]:
    """Adapter file `path` as the unfused model's per-layer tensors {layer: (A [r, K], B [N, r], alpha / r)}, read
    by the pipeline's own loader into a skeleton of `model` (the model's diffusers class; `model` itself is not
    touched): for adapters served beside converted layers (model/adapter_slots.py). Its text-encoder part, if any,
    stays in the pipeline's text encoders (PEFT; `switch_text_adapters` turns it on per batch)."""
    skeleton = _loaded_skeleton(pipe, name, path, _skeleton(model))
    out = {}
    for layer_name, layer in skeleton.named_modules():
        if not _is_peft_layer(layer) or name not in getattr(layer, "lora_A", {}):
            continue
        if getattr(layer, "use_dora", {}).get(name) or getattr(layer, "lora_bias", {}).get(name):
            pipe.delete_adapters([name])
            raise ValueError(f"adapter file {path}: DoRA and LoRA biases are not served beside converted layers")
        out[layer_name] = (layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach(),
                           float(layer.scaling[name]))
    return out


TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


def text_adapters(pipe: Any) -> set[str]:
    """The adapters with a text-encoder part in `pipe`'s text encoders (diffusers loads that part there with PEFT)."""
    return {name for c in TEXT_ENCODERS for name in (getattr(getattr(pipe, c, None), "peft_config", None) or {})}


def switch_text_adapters(pipe: Any, loras: tuple[tuple[str, float], ...]) -> None:
    """Switch on exactly the text-encoder parts of `loras` ((name, scale), as `set_adapters` takes them) in each of
    `pipe`'s text encoders, and the rest off."""
    from diffusers.loaders.lora_base import (disable_lora_for_text_encoder, enable_lora_for_text_encoder,
                                             set_adapters_for_text_encoder)

    for c in TEXT_ENCODERS:
        encoder = getattr(pipe, c, None)
        held = getattr(encoder, "peft_config", None) or {}
        mine = [(n, float(s)) for n, s in loras if n in held]
        if mine:
            set_adapters_for_text_encoder([n for n, _ in mine], encoder, [s for _, s in mine])
            enable_lora_for_text_encoder(encoder)
        elif held:
            disable_lora_for_text_encoder(encoder)


def load_adapter(pipe: Any, name: str, path: str) -> list[str]:
    """Load adapter file `path` as `name` into diffusers pipeline `pipe` while it serves. Returns the module paths of
    the transformer's layers the adapter now reaches (a TP rank shards those)."""
    served = pipe.transformer
    skeleton = _loaded_skeleton(pipe, name, path, _skeleton(served))
    reached = []
    for path_, layer in skeleton.named_modules():
        if not _is_peft_layer(layer) or name not in getattr(layer, "lora_A", {}):
            continue
        parent_name, _, attr = path_.rpartition(".")
        parent = served.get_submodule(parent_name) if parent_name else served
        target = getattr(parent, attr)
        if _is_peft_layer(target):
            _move_entries(layer, target, name)
        else:  # the skeleton's PEFT layer around the served base layer
            layer.base_layer = target
            setattr(parent, attr, layer)
            target = layer
        target._move_adapter_to_device_of_base_layer(name)
        reached.append(path_)
    if reached:  # (an adapter of the text encoder only reaches none)
        served.peft_config = {**getattr(served, "peft_config", {}), name: skeleton.peft_config[name]}
        served._hf_peft_config_loaded = True
    return reached


def unload_adapter(pipe: Any, name: str) -> None:
    """Remove adapter `name` from every component of `pipe` (its layers' entries and configs; diffusers' own
    `delete_adapters`), freeing its tensors."""
    pipe.delete_adapters([name])


def unload_text_part(pipe: Any, name: str) -> None:
    """Remove adapter `name`'s text-encoder part, if it has one: all an adapter served beside converted layers leaves
    in the pipeline's own components."""
    if name in text_adapters(pipe):
        unload_adapter(pipe, name)
