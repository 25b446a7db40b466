"""Shared pytest fixtures for fluxserve.

- `gpu` marker: tests marked `@pytest.mark.gpu` are skipped when CUDA is absent.
- `tiny_path`: the tiny preset, built once per session into a temporary FLUXSERVE_CACHE.
- `tiny_pipe`: a FluxServePipeline loaded from `tiny_path` (CPU, float32), shared by the session.
- `kontext_path`: the tiny-kontext preset (FLUX.1 Kontext's pipeline), built once per session.

Heavy imports (torch, diffusers) stay inside the fixtures/hooks so collecting a test file that needs none of
them stays cheap.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # One Ray token auth setting for the whole session, set before anything imports ray: Ray reads RAY_AUTH_MODE and
    # RAY_AUTH_TOKEN once per process, so a test file that imports ray early would otherwise pin "disabled" (or
    # another token) for every Ray the later tests start in this process.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("gpu" in item.keywords for item in items):
        return
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fluxserve_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A per-session preset cache. Exported as FLUXSERVE_CACHE for the whole session so that subprocesses and
    Ray workers started by later tests find the already-built tiny preset instead of rebuilding it."""
    cache = tmp_path_factory.mktemp("fluxserve-cache")
    previous = os.environ.get("FLUXSERVE_CACHE")
    os.environ["FLUXSERVE_CACHE"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("FLUXSERVE_CACHE", None)
    else:
        os.environ["FLUXSERVE_CACHE"] = previous


@pytest.fixture(scope="session")
def tiny_path(fluxserve_cache: Path) -> Path:
    """Folder of the tiny preset (diffusers format), built once per session."""
    from model.presets import ensure_preset

    return ensure_preset("tiny", cache_dir=fluxserve_cache)


@pytest.fixture(scope="session")
def kontext_path(fluxserve_cache: Path) -> Path:
    """Folder of the tiny-kontext preset (FluxKontextPipeline, diffusers format), built once per session."""
    from model.presets import ensure_preset

    return ensure_preset("tiny-kontext", cache_dir=fluxserve_cache)


@pytest.fixture(scope="session")
def tiny_pipe(tiny_path: Path):
    """The tiny preset loaded through the public loader (CPU, float32)."""
    import torch

    from model.loading import load_pipeline

    return load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
