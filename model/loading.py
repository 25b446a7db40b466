"""Load a pipeline fully offline, with our transformer in place of diffusers' (its family: model/family.py).

`load_pipeline` accepts a local diffusers-format folder (FLUX.1) or a preset name (see `model.presets`). A folder is
checked piece by piece first, so a missing or broken folder fails with `ModelLoadError` naming the piece, instead of
a deep traceback from diffusers or an attempt to reach the Hub.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from model import presets
from model.family import ModelFamily, families, family_of
from model.pipeline import FluxServePipeline
from model.preview import use_vae_previews
from model.request import DEFAULT_MODEL

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


def _single_file_family(keys: set[str]) -> ModelFamily | None:
    """The family whose original single-file layout has these keys, or None."""
    return next((f for f in families() if {f.single_file.key, f.single_file.prefix + f.single_file.key} & keys), None)


def single_file_transformer(sub: str | os.PathLike[str], family: ModelFamily | None = None) -> Path | None:
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
    found = _single_file_family(keys)
    return files[0] if found is not None and (family is None or found == family) else None


def _file_shapes(path: Path, prefix: str) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a safetensors file, `prefix` stripped, from its header only (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k.removeprefix(prefix): tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def load_single_file_transformer(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                                 config: dict[str, Any] | None = None, family: ModelFamily | None = None) -> torch.nn.Module:
    """Our transformer from an original-layout single file, through diffusers' own key conversion (the family's).
    Every converted key must match a parameter."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        sd = load_file(str(path))
    except Exception as exc:
        raise ModelLoadError(path, "transformer", f"unreadable single file ({type(exc).__name__}: {exc})") from exc
    family = family or _single_file_family(set(sd)) or families()[0]  # unknown keys: the first family's error
    original = family.single_file
    cls = family.transformer_class()
    sd = {k.removeprefix(original.prefix): v for k, v in sd.items()}
    try:
        cfg = {**original.config({k: tuple(v.shape) for k, v in sd.items()}), **(config or {})}
    except KeyError as exc:
        raise ModelLoadError(path, "transformer", f"not a {family.title} checkpoint (missing {exc})") from None
    width = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    if width != original.width:
        raise ModelLoadError(path, "transformer", f"diffusers' single-file conversion supports {family.title}'s width "
                                                  f"{original.width} only, this checkpoint is {width} wide")
    converted = original.convert(dict(sd))
    with torch.device("meta"):
        model = cls(**cfg)
    missing, unexpected = model.load_state_dict(converted, strict=False, assign=True)
    if missing or unexpected:
        raise ModelLoadError(path, "transformer", f"checkpoint does not match {cls.__name__}: missing {missing}, "
                                                  f"unexpected {unexpected}")
    return model.to(dtype).eval()


def folder_family(root: Path) -> ModelFamily:
    """The model family of a folder: its model_index.json `_class_name`; for a transformer/ folder alone, its
    config.json's or its single file's keys."""
    for where in ("model_index.json", "transformer/config.json"):
        if (root / where).is_file():
            try:
                return family_of(json.loads((root / where).read_text()).get("_class_name", ""))
            except ValueError as exc:
                raise ModelLoadError(root, where, str(exc)) from None
    for file in sorted((root / "transformer").glob("*.safetensors")):
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            found = _single_file_family(set(f.keys()))
        if found is not None:
            return found
    raise ModelLoadError(root, "model_index.json", "missing")


def check_folder(path: str | os.PathLike[str]) -> Path:
    """Check that `path` looks like a complete diffusers folder of a family fluxserve serves; raise ModelLoadError
    naming what is not."""
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
    family = folder_family(root)
    for component, groups in family.components.items():
        entry = model_index.get(component)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[1]):
            raise ModelLoadError(root, component, "not listed in model_index.json")
        sub = root / component
        if not sub.is_dir():
            raise ModelLoadError(root, component, f"subfolder {component}/ missing")
        if component == "transformer" and single_file_transformer(sub, family) is not None:
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
    """Load transformer/ of a folder (diffusers layout: single file or sharded safetensors; or one file in the
    original single-file layout) into the family's transformer class (or `cls`), requiring every checkpoint key to
    match a parameter and vice versa."""
    _offline()
    root = Path(folder)
    family = folder_family(root)
    cls = cls or family.transformer_class()
    single = single_file_transformer(root / "transformer", family)
    if single is not None:
        return _load_single(root, single, dtype, cls, family)
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


def _load_single(root: Path, single: Path, dtype: torch.dtype, cls: type, family: ModelFamily) -> torch.nn.Module:
    """transformer/ holds one original-layout file: ours through diffusers' key conversion; diffusers' own class
    (the reference) through its `from_single_file`, an independent path."""
    config_file = root / "transformer" / "config.json"
    config = None
    if config_file.is_file():
        config = {k: v for k, v in json.loads(config_file.read_text()).items() if not k.startswith("_")}
    if cls is family.transformer_class():
        return load_single_file_transformer(single, dtype, config, family)
    import tempfile

    cfg = {**family.single_file.config(_file_shapes(single, family.single_file.prefix)), **(config or {})}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({"_class_name": cls.__name__, **cfg}))
        return cls.from_single_file(str(single), config=tmp, local_files_only=True, **_dtype_kwarg(dtype)).eval()


# Library warnings every replica and TP rank would log that say nothing an operator can act on, by logger: each
# dropped message's start (only those; everything else from the same logger still shows).
QUIET_WARNINGS: dict[str, tuple[str, ...]] = {
    # diffusers: the pipeline's transformer is not its own class. Ours is a stand-in by design (the same modules and
    # parameter names, model/flux.py).
    "diffusers.pipelines.pipeline_utils": ("Expected types for transformer:",),
    # transformers: an image processor class resolved without torchvision. FLUX pipelines list an optional image
    # encoder's processor (IP-Adapter), which nothing here uses.
    "transformers.utils.import_utils": ("`CLIPImageProcessor` requires torchvision",
                                        "`SiglipImageProcessor` requires torchvision"),
}


class _Quiet(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


for _name, _starts in QUIET_WARNINGS.items():
    logging.getLogger(_name).addFilter(_Quiet(_starts))


def load_diffusers_pipeline(folder: str | os.PathLike[str], transformer: torch.nn.Module,
                            device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """The family's diffusers text-to-image pipeline from `folder` with `transformer` substituted, on `device`."""
    _offline()
    root = Path(folder)
    family = folder_family(root)
    try:
        pipe = family.pipeline_classes()["text"].from_pretrained(root, transformer=transformer,
                                                                  **_dtype_kwarg(dtype), local_files_only=True)
    except Exception as exc:
        component = next((c for c in family.components if c in str(exc)), "pipeline components")
        raise ModelLoadError(root, component, f"{type(exc).__name__}: {exc}") from exc
    for module in (pipe.text_encoder, pipe.text_encoder_2, pipe.vae):
        module.eval()
    return pipe.to(device)


def _is_preset(name: str) -> bool:
    return name in presets.preset_names() and not Path(name).exists()  # a folder of that name wins


# What a model folder may state about itself beside its model_index.json (diffusers ignores the file; FLUX.1's own
# folders state nothing): `trained_sizes`, the "WxH" sizes its weights were trained at; `previews: "vae"`, stream
# previews decoded by its VAE (cheap for a small VAE) instead of the fitted linear map (model/preview.py).
STATEMENT_FILE = "fluxserve.json"


def write_statement(folder: Path, **fields: Any) -> None:
    (Path(folder) / STATEMENT_FILE).write_text(json.dumps(fields, indent=1) + "\n")


def _unbuilt_folder(name: str) -> Path | None:
    """The folder a model name points at without building anything: a shipped preset's or a local folder; None for
    a random-weights preset."""
    return presets.SHIPPED.get(name) if _is_preset(name) else Path(name).expanduser()


def statement(path_or_preset: str | os.PathLike[str]) -> dict[str, Any]:
    """What the model's folder states (empty where it states nothing or cannot be read). Never builds a preset."""
    folder = _unbuilt_folder(str(path_or_preset))
    try:
        stated = json.loads((folder / STATEMENT_FILE).read_text()) if folder else {}
    except (OSError, ValueError):
        return {}
    return stated if isinstance(stated, dict) else {}


def trained_sizes(path_or_preset: str | os.PathLike[str]) -> list[str] | None:
    """The "WxH" sizes the model's folder says it was trained at, or None where it says nothing (a FLUX.1 folder; a
    random-weights preset, which is trained at none)."""
    stated = statement(path_or_preset).get("trained_sizes")
    return [str(s) for s in stated] if isinstance(stated, list) and stated else None


def model_family(path_or_preset: str | os.PathLike[str]) -> ModelFamily:
    """The family of a preset or a model folder, from its spec or its model_index.json (nothing is loaded)."""
    folder = _unbuilt_folder(str(path_or_preset))
    return presets.preset_family(str(path_or_preset)) if folder is None else folder_family(folder)


def check_source(path_or_preset: str | os.PathLike[str]) -> None:
    """Raise ModelLoadError where `load_pipeline` would for a folder, without loading anything (a preset name is
    built or found on first use)."""
    if not _is_preset(str(path_or_preset)):
        check_folder(Path(str(path_or_preset)).expanduser())


def load_pipeline(path_or_preset: str | os.PathLike[str] = DEFAULT_MODEL, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> "FluxServePipeline":
    """A FluxServePipeline from a local diffusers FLUX.1 folder or a preset name, with our transformer."""

    name = str(path_or_preset)
    if _is_preset(name):
        folder = presets.preset_folder(name)
        if folder is None:
            return _in_memory_preset(name, device, dtype)
    else:
        folder = Path(name).expanduser()
    check_folder(folder)
    transformer = load_transformer(folder, dtype)
    pipe = load_diffusers_pipeline(folder, transformer, device, dtype)
    if statement(folder).get("previews") == "vae":
        use_vae_previews(pipe)
    return FluxServePipeline(pipe, source=name, folder=folder)


def _in_memory_preset(name: str, device: str | torch.device, dtype: torch.dtype) -> "FluxServePipeline":
    """Full-size random preset: build every component on `device`, then hand the random transformer weights to our
    class (strict: same names). Ours is made on the meta device and takes diffusers' tensors as they are, so one
    copy of the transformer is ever held: two pools building on one GPU at once then fit."""
    components = presets.build_components(name, device, dtype)
    reference = components["transformer"]
    family = presets.preset_family(name)
    with torch.device("meta"):
        ours = family.transformer_class().from_config(reference.config)
    ours.load_state_dict(reference.state_dict(), strict=True, assign=True)
    del reference
    components["transformer"] = ours.eval()
    pipe = family.pipeline_classes()["text"](**components)
    return FluxServePipeline(pipe, source=name, folder=None)


def diffusers_reference(pipe: FluxServePipeline) -> Any:
    """A stock diffusers pipeline of the family with diffusers' own transformer class and the same weights.

    From a folder, every component is loaded again by diffusers itself (an independent load path). For an
    in-memory preset there is no folder: the reference shares the text encoders, VAE and tokenizers, and gets
    diffusers' transformer holding a copy of our transformer's weights.
    """
    family = family_of(pipe.pipe)
    reference_cls = family.reference_transformer_class()
    if pipe.folder is not None:
        transformer = load_transformer(pipe.folder, pipe.dtype, cls=reference_cls)
        return load_diffusers_pipeline(pipe.folder, transformer, pipe.device, pipe.dtype)
    # no float32 detour: 24 GB vs 48 GB at full size
    with torch.device(pipe.device), presets.default_dtype(pipe.dtype):
        transformer = reference_cls.from_config(pipe.transformer.config)
    transformer.load_state_dict(pipe.transformer.state_dict(), strict=True)
    components = dict(pipe.pipe.components)
    components["transformer"] = transformer.eval()
    components["scheduler"] = type(pipe.pipe.scheduler).from_config(pipe.pipe.scheduler.config)
    return family.pipeline_classes()["text"](**components)
