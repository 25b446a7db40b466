"""Where built kernels persist across processes: Triton's compiled kernels and autotuning results, Inductor's
caches and cuDNN's built execution plans under one folder, so a restarted replica warms from disk instead of
compiling, tuning and planning again.

`use(folder)` points them there (a replica calls it before building, through `model.build.build_pipeline`); without
it every library keeps its own default and cuDNN plans are built in memory only. Entries are keyed by what makes two
builds differ (shapes, GPU, library versions), so one folder may be shared by replicas of different GPUs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

_plans: Path | None = None


def use(folder: str | None) -> dict[str, str]:
    """Keep kernel caches under `folder` (created if missing): Triton in triton/, Inductor in inductor/, cuDNN plans
    in cudnn/. None changes nothing. Returns {cache: path} of what was set."""
    global _plans
    if folder is None:
        return {}
    root = Path(folder).expanduser().resolve()
    where = {"TRITON_CACHE_DIR": root / "triton", "TORCHINDUCTOR_CACHE_DIR": root / "inductor"}
    for env, path in where.items():
        path.mkdir(parents=True, exist_ok=True)
        os.environ[env] = str(path)  # both libraries read these when they next compile, not at import
    _plans = root / "cudnn"
    _plans.mkdir(parents=True, exist_ok=True)
    return {"triton": str(where["TRITON_CACHE_DIR"]), "inductor": str(where["TORCHINDUCTOR_CACHE_DIR"]),
            "cudnn": str(_plans)}


def plan_folder() -> Path | None:
    """The cuDNN plan folder `use` set, or None (plans are then not persisted)."""
    return _plans


def _plan_path(kind: str, key: tuple[Any, ...]) -> Path | None:
    if _plans is None:
        return None
    return _plans / f"{kind}-{hashlib.sha256(repr((kind, key)).encode()).hexdigest()[:32]}.bin"


def cached_plan(kind: str, key: tuple[Any, ...], load: Callable[[bytes], Any], build: Callable[[], Any],
                save: Callable[[Any], bytes]) -> tuple[Any, str]:
    """A built plan of `kind` for `key`: `load(bytes)` of the stored one where the folder has it, else `build()`
    (then stored as `save(plan)`). A stored plan that cannot be loaded, or a plan that cannot be saved, is logged
    and the plan built or kept in memory: a cache never makes a build fail. -> (plan, "cache" | "built")."""
    path = _plan_path(kind, key)
    if path is not None and path.exists():
        try:
            return load(path.read_bytes()), "cache"
        except Exception as exc:  # noqa: BLE001 - e.g. written by another library version: rebuild it
            logger.warning("%s plan %s could not be loaded (%s); building it", kind, path.name, exc)
    plan = build()
    if path is not None:
        try:
            data = save(plan)
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:  # atomic: ranks may race
                tmp.write(data)
            os.replace(tmp.name, path)
        except Exception as exc:  # noqa: BLE001
            logger.warning("%s plan for %s not stored (%s)", kind, key, exc)
    return plan, "built"


def autotune(configs: list[Any], key: list[str]) -> Callable[[Any], Any]:
    """`triton.autotune` whose choices are kept in Triton's cache (where this Triton can keep them), so a restarted
    process does not time its configurations again."""
    import inspect

    import triton

    kwargs = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(configs=configs, key=key, **kwargs)
