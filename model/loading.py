"""Load a FLUX.1 pipeline fully offline, with our transformer in place of diffusers'.

`load_pipeline` accepts a local diffusers-format FLUX.1 folder or a preset name (see `model.presets`). A folder is
checked piece by piece first, so a missing or broken folder fails with `ModelLoadError` naming the piece, instead of
a deep traceback from diffusers or an attempt to reach the Hub.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from model import presets
from model.pipeline import FluxServePipeline
from model.request import DEFAULT_MODEL

# Components FluxPipeline needs, and the files each must have (any one name of a group suffices).
_REQUIRED: dict[str, list[tuple[str, ...]]] = {
    "scheduler": [("scheduler_config.json",)],
    "vae": [("config.json",), ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json")],
    "text_encoder": [("config.json",), ("model.safetensors", "model.safetensors.index.json")],
    "text_encoder_2": [("config.json",), ("model.safetensors", "model.safetensors.index.json")],
    "tokenizer": [("tokenizer.json", "vocab.json")],
    "tokenizer_2": [("tokenizer.json", "spiece.model")],
    "transformer": [("config.json",), ("diffusion_pytorch_model.safetensors",
                                       "diffusion_pytorch_model.safetensors.index.json")],
}


class ModelLoadError(RuntimeError):
    """A model folder is missing or broken. `component` names the piece (e.g. "transformer", "model_index.json")."""

    def __init__(self, path: str | os.PathLike[str], component: str, detail: str) -> None:
        self.path = str(path)
        self.component = component
        self.detail = detail
        super().__init__(f"cannot load FLUX.1 pipeline from {self.path}: {component}: {detail}")


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    # diffusers renamed `torch_dtype` to `dtype` (0.42 warns on the old name); older releases only know the old one.
    try:
        from diffusers.utils import deprecation_utils

        if hasattr(deprecation_utils, "_resolve_dtype"):
            return {"dtype": dtype}
    except ImportError:
        pass
    return {"torch_dtype": dtype}


def _offline() -> None:
    # Nothing here may reach the network: a folder is local by definition and presets are built in code.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# A transformer in the original (BFL) single-file layout: transformer/ holds one .safetensors file with these keys.
_ORIGINAL_KEY = "double_blocks.0.img_attn.qkv.weight"
_ORIGINAL_PREFIX = "model.diffusion_model."


def single_file_transformer(sub: str | os.PathLike[str]) -> Path | None:
    """The one original-layout .safetensors file in `sub` (a transformer/ folder), or None (diffusers layout)."""
    from safetensors import safe_open

    sub = Path(sub)
    if (sub / "diffusion_pytorch_model.safetensors").is_file() or (
            sub / "diffusion_pytorch_model.safetensors.index.json").is_file():
        return None
    files = sorted(sub.glob("*.safetensors"))
    if len(files) != 1:
        return None
    try:
        with safe_open(str(files[0]), framework="pt") as f:
            keys = set(f.keys())
    except Exception:  # not a safetensors file: the diffusers-layout check reports the folder
        return None
    return files[0] if {_ORIGINAL_KEY, _ORIGINAL_PREFIX + _ORIGINAL_KEY} & keys else None


def _file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a safetensors file, prefix stripped, from its header only (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k.removeprefix(_ORIGINAL_PREFIX): tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _original_config(sd: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """FluxTransformer config of an original-layout checkpoint (key -> shape, prefix stripped). The RoPE axes are
    not in a checkpoint: FLUX.1's (16, 56, 56) unless transformer/config.json says otherwise."""
    head_dim = sd["double_blocks.0.img_attn.norm.query_norm.scale"][0]
    inner = sd["img_in.weight"][0]
    return dict(
        patch_size=1, in_channels=sd["img_in.weight"][1], out_channels=sd["final_layer.linear.weight"][0],
        num_layers=len({k.split(".")[1] for k in sd if k.startswith("double_blocks.")}),
        num_single_layers=len({k.split(".")[1] for k in sd if k.startswith("single_blocks.")}),
        attention_head_dim=head_dim, num_attention_heads=inner // head_dim,
        joint_attention_dim=sd["txt_in.weight"][1], pooled_projection_dim=sd["vector_in.in_layer.weight"][1],
        guidance_embeds="guidance_in.in_layer.weight" in sd, axes_dims_rope=(16, 56, 56),
    )


def load_single_file_transformer(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                                 config: dict[str, Any] | None = None) -> torch.nn.Module:
    """Our FluxTransformer from an original-layout single file, through diffusers' own key conversion
    (`convert_flux_transformer_checkpoint_to_diffusers`). Every converted key must match a parameter."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    from model.flux import FluxTransformer

    path = Path(path)
    try:
        sd = load_file(str(path))
    except Exception as exc:
        raise ModelLoadError(path, "transformer", f"unreadable single file ({type(exc).__name__}: {exc})") from exc
    sd = {k.removeprefix(_ORIGINAL_PREFIX): v for k, v in sd.items()}
    try:
        cfg = {**_original_config({k: tuple(v.shape) for k, v in sd.items()}), **(config or {})}
    except KeyError as exc:
        raise ModelLoadError(path, "transformer", f"not a FLUX.1 checkpoint (missing {exc})") from None
    if cfg["num_attention_heads"] * cfg["attention_head_dim"] != 3072:
        # diffusers' converter splits the single blocks' fused projection at FLUX.1's width
        raise ModelLoadError(path, "transformer", "diffusers' single-file conversion supports FLUX.1's width 3072 "
                                                  f"only, this checkpoint is {sd['img_in.weight'].shape[0]} wide")
    converted = convert_flux_transformer_checkpoint_to_diffusers(dict(sd))
    with torch.device("meta"):
        model = FluxTransformer(**cfg)
    missing, unexpected = model.load_state_dict(converted, strict=False, assign=True)
    if missing or unexpected:
        raise ModelLoadError(path, "transformer", f"checkpoint does not match FluxTransformer: missing {missing}, "
                                                  f"unexpected {unexpected}")
    return model.to(dtype).eval()


def check_folder(path: str | os.PathLike[str]) -> Path:
    """Check that `path` looks like a complete diffusers FLUX.1 folder; raise ModelLoadError naming what is not."""
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(root, "folder", "does not exist or is not a directory")
    index = root / "model_index.json"
    if not index.is_file():
        raise ModelLoadError(root, "model_index.json", "missing")
    try:
        model_index = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(root, "model_index.json", f"not valid JSON ({exc})") from None
    for component, groups in _REQUIRED.items():
        entry = model_index.get(component)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[1]):
            raise ModelLoadError(root, component, "not listed in model_index.json")
        sub = root / component
        if not sub.is_dir():
            raise ModelLoadError(root, component, f"subfolder {component}/ missing")
        if component == "transformer" and single_file_transformer(sub) is not None:
            continue
        for names in groups:
            if not any((sub / n).is_file() for n in names):
                raise ModelLoadError(root, component, f"missing {' or '.join(names)}")
        for shard_index in sub.glob("*.safetensors.index.json"):
            try:
                shards = set(json.loads(shard_index.read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError) as exc:
                raise ModelLoadError(root, component, f"broken shard index {shard_index.name} ({exc})") from None
            missing = sorted(s for s in shards if not (sub / s).is_file())
            if missing:
                raise ModelLoadError(root, component, f"missing weight shard(s) {', '.join(missing)}")
    return root


def load_transformer(folder: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                     cls: type | None = None) -> torch.nn.Module:
    """Load transformer/ of a FLUX.1 folder (diffusers layout: single file or sharded safetensors; or one file in
    the original single-file layout) into our FluxTransformer (or `cls`), requiring every checkpoint key to match a
    parameter and vice versa."""
    _offline()
    if cls is None:
        from model.flux import FluxTransformer as cls  # noqa: N813 - the class under its contract name
    root = Path(folder)
    single = single_file_transformer(root / "transformer")
    if single is not None:
        return _load_single(root, single, dtype, cls)
    try:
        model, info = cls.from_pretrained(root, subfolder="transformer", **_dtype_kwarg(dtype), local_files_only=True,
                                          output_loading_info=True)
    except Exception as exc:  # diffusers raises a zoo of types (OSError, ValueError, SafetensorError, ...)
        raise ModelLoadError(root, "transformer", f"{type(exc).__name__}: {exc}") from exc
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise ModelLoadError(root, "transformer", f"checkpoint does not match {cls.__name__}: {bad}")
    # requires_grad stays as diffusers leaves it (True): on CPU it changes aten's matmul folding of 3-D inputs
    # (hence the GEMM shape and the rounding), and lossless means "the same ops as stock diffusers".
    return model.eval()


def _load_single(root: Path, single: Path, dtype: torch.dtype, cls: type) -> torch.nn.Module:
    """transformer/ holds one original-layout file: ours through diffusers' key conversion; diffusers' own class
    (the reference) through its `from_single_file`, an independent path."""
    config_file = root / "transformer" / "config.json"
    config = None
    if config_file.is_file():
        config = {k: v for k, v in json.loads(config_file.read_text()).items() if not k.startswith("_")}
    from model.flux import FluxTransformer

    if cls is FluxTransformer:
        return load_single_file_transformer(single, dtype, config)
    import tempfile

    cfg = {**_original_config(_file_shapes(single)), **(config or {})}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({"_class_name": cls.__name__, **cfg}))
        return cls.from_single_file(str(single), config=tmp, local_files_only=True, **_dtype_kwarg(dtype)).eval()


def load_flux_pipeline(folder: str | os.PathLike[str], transformer: torch.nn.Module,
                       device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """diffusers FluxPipeline from `folder` with `transformer` substituted, moved to `device`."""
    from diffusers import FluxPipeline

    _offline()
    root = Path(folder)
    try:
        pipe = FluxPipeline.from_pretrained(root, transformer=transformer, **_dtype_kwarg(dtype),
                                            local_files_only=True)
    except Exception as exc:
        component = next((c for c in _REQUIRED if c in str(exc)), "pipeline components")
        raise ModelLoadError(root, component, f"{type(exc).__name__}: {exc}") from exc
    for module in (pipe.text_encoder, pipe.text_encoder_2, pipe.vae):
        module.eval()
    return pipe.to(device)


def load_pipeline(path_or_preset: str | os.PathLike[str] = DEFAULT_MODEL, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> "FluxServePipeline":
    """A FluxServePipeline from a local diffusers FLUX.1 folder or a preset name, with our transformer."""

    name = str(path_or_preset)
    if name in presets.preset_names() and not Path(name).exists():
        folder = presets.preset_folder(name)
        if folder is None:
            return _in_memory_preset(name, device, dtype)
    else:
        folder = Path(name).expanduser()
    check_folder(folder)
    transformer = load_transformer(folder, dtype)
    pipe = load_flux_pipeline(folder, transformer, device, dtype)
    return FluxServePipeline(pipe, source=name, folder=folder)


def _in_memory_preset(name: str, device: str | torch.device, dtype: torch.dtype) -> "FluxServePipeline":
    """Full-size random preset: build every component on `device`, then move the random transformer weights into
    our class (strict: same names) and drop diffusers' copy."""
    from diffusers import FluxPipeline

    from model.flux import FluxTransformer

    components = presets.build_components(name, device, dtype)
    reference = components["transformer"]
    with torch.device(device), presets.default_dtype(dtype):
        ours = FluxTransformer.from_config(reference.config)
    ours.load_state_dict(reference.state_dict(), strict=True)
    del reference
    components["transformer"] = ours.eval()
    pipe = FluxPipeline(**components)
    return FluxServePipeline(pipe, source=name, folder=None)


def diffusers_reference(pipe: FluxServePipeline) -> Any:
    """A stock diffusers FluxPipeline with diffusers' own FluxTransformer2DModel and the same weights.

    From a folder, every component is loaded again by diffusers itself (an independent load path). For an
    in-memory preset there is no folder: the reference shares the text encoders, VAE and tokenizers, and gets
    a FluxTransformer2DModel holding a copy of our transformer's weights.
    """
    from diffusers import FluxPipeline, FluxTransformer2DModel

    if pipe.folder is not None:
        transformer = load_transformer(pipe.folder, pipe.dtype, cls=FluxTransformer2DModel)
        return load_flux_pipeline(pipe.folder, transformer, pipe.device, pipe.dtype)
    # no float32 detour: 24 GB vs 48 GB at full size
    with torch.device(pipe.device), presets.default_dtype(pipe.dtype):
        transformer = FluxTransformer2DModel.from_config(pipe.transformer.config)
    transformer.load_state_dict(pipe.transformer.state_dict(), strict=True)
    components = dict(pipe.pipe.components)
    components["transformer"] = transformer.eval()
    components["scheduler"] = type(pipe.pipe.scheduler).from_config(pipe.pipe.scheduler.config)
    return FluxPipeline(**components)
