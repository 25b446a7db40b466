"""The kernel cache (kernels/cache.py): where Triton, Inductor and cuDNN keep what they built, so a restarted
replica warms from disk. The GPU side (a cuDNN plan stored, loaded and computing the same bits) is in
tests/test_attention.py."""

from __future__ import annotations

import os

import pytest

from kernels import cache


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(cache, "_plans", None)
    for env in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(env, raising=False)
    yield


def test_use_points_triton_inductor_and_cudnn_plans_into_one_folder(tmp_path, fresh) -> None:
    """Catches a library left on its default (Triton's ~/.triton or Inductor's /tmp folder do not survive a pod)."""
    got = cache.use(str(tmp_path / "k"))
    root = (tmp_path / "k").resolve()
    assert got == {"triton": str(root / "triton"), "inductor": str(root / "inductor"), "cudnn": str(root / "cudnn")}
    assert os.environ["TRITON_CACHE_DIR"] == got["triton"] and os.environ["TORCHINDUCTOR_CACHE_DIR"] == got["inductor"]
    assert all(os.path.isdir(p) for p in got.values()) and cache.plan_folder() == root / "cudnn"
    import triton

    assert triton.knobs.cache.dir == got["triton"]  # read at compile time, so setting it after import works
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == got["inductor"]


def test_no_folder_changes_nothing(fresh) -> None:
    assert cache.use(None) == {} and cache.plan_folder() is None
    assert "TRITON_CACHE_DIR" not in os.environ


def test_a_plan_is_built_once_then_loaded_per_key(tmp_path, fresh) -> None:
    """Second process (same key) loads; another key builds its own. Catches a key that ignores a field (a plan of
    another shape or GPU loaded) and a store that never writes."""
    cache.use(str(tmp_path))
    builds: list[tuple] = []

    def get(key: tuple) -> tuple:
        return cache.cached_plan("demo", key, load=lambda b: ("loaded", b.decode()),
                                 build=lambda: builds.append(key) or ("built", repr(key)), save=lambda p: p[1].encode())

    assert get((1, 2)) == (("built", "(1, 2)"), "built")
    assert get((1, 2)) == (("loaded", "(1, 2)"), "cache")
    assert get((1, 3)) == (("built", "(1, 3)"), "built")
    assert builds == [(1, 2), (1, 3)] and len(list((tmp_path / "cudnn").iterdir())) == 2


def test_a_plan_that_cannot_be_loaded_or_saved_is_built_never_fatal(tmp_path, fresh, caplog) -> None:
    """A cache written by another library version, or a read-only folder, costs a build, never the replica."""
    cache.use(str(tmp_path))

    def boom(_):
        raise RuntimeError("bad")

    assert cache.cached_plan("x", (1,), load=boom, build=lambda: "p", save=lambda p: b"stale") == ("p", "built")
    assert cache.cached_plan("x", (1,), load=boom, build=lambda: "q", save=boom) == ("q", "built")
    assert "could not be loaded" in caplog.text and "not stored" in caplog.text
    assert cache.cached_plan("x", (2,), load=boom, build=lambda: "r", save=boom) == ("r", "built")
    assert cache.cached_plan("x", (2,), load=lambda b: "never", build=lambda: "s", save=lambda p: b"") == ("s", "built")


def test_without_a_folder_plans_are_built_in_memory(fresh) -> None:
    calls = []
    for _ in range(2):
        assert cache.cached_plan("x", (1,), load=lambda b: "no", build=lambda: calls.append(1) or "p",
                                 save=lambda p: b"p") == ("p", "built")
    assert len(calls) == 2


def test_triton_autotuning_results_are_kept_in_the_cache(monkeypatch) -> None:
    """Every autotuned kernel of ours keeps its timing results on disk (Triton's cache_results), so a restart does
    not time configurations again. Catches a kernel declared with plain triton.autotune."""
    import inspect

    import triton

    if "cache_results" not in inspect.signature(triton.autotune).parameters:
        pytest.skip("this Triton cannot keep autotuning results")
    from kernels import _attention_fp8_triton, _fp8_triton, _gemm_gelu_triton, _high_triton

    tuners = [_attention_fp8_triton._attention_tuned, _fp8_triton._quant_rows_tuned, _fp8_triton._weight_only_tuned,
              _gemm_gelu_triton._mm_gelu_kernel, _gemm_gelu_triton._mm_gelu_tma_kernel,
              _high_triton._rms_rope_fast_tuned]
    if triton.knobs.runtime.interpret:
        pytest.skip("the interpreter never caches autotuning")
    assert all(t.cache_results for t in tuners)


def test_no_kernel_declares_its_autotuner_around_the_cache() -> None:
    """A new kernel written with plain `triton.autotune` would tune again on every restart."""
    from pathlib import Path

    root = Path(cache.__file__).parent
    plain = [p.name for p in root.glob("*.py") if p.name != "cache.py" and "triton.autotune(" in p.read_text()]
    assert plain == []


def test_a_replica_built_from_the_config_keeps_its_kernels_in_the_configured_folder(tiny_path, tmp_path, fresh) -> None:
    """`args.kernel_cache_dir` reaches the builder every replica and TP rank calls (AppArgs.form ->
    model.build.build_pipeline), which points the caches there before anything compiles. Catches the setting
    dropped on its way (form or builder)."""
    from deployments.config import AppArgs
    from model.build import build_pipeline

    folder = str(tmp_path / "kc")
    args = AppArgs.parse({"model": str(tiny_path), "default_size": "64x64", "kernel_cache_dir": folder,
                          "pools": {"high": {"warm_up": False}}})
    form = args.form("high")
    assert form.kernel_cache_dir == folder
    build_pipeline(form)
    assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "kc" / "triton").resolve())
    assert cache.plan_folder() == (tmp_path / "kc" / "cudnn").resolve()


def test_the_kuberay_manifest_mounts_a_writable_volume_at_the_kernel_cache(tmp_path) -> None:
    """Without the mount the folder would be the pod's own disk: gone with the pod."""
    from deployments import cluster

    app = {"name": "a", "import_path": "deployments.app:build_app", "args": {"kernel_cache_dir": "/kc"}}
    shape = cluster.NodeShape(nodes=1, gpus_per_node=8, cpus_per_node=64, memory_per_node="512Gi")
    spec = cluster.rayservice({"applications": [app]}, shape)["spec"]["rayClusterConfig"]
    worker = spec["workerGroupSpecs"][0]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in worker["containers"][0]["volumeMounts"]}
    assert mounts["/kc"]["name"] == "kernel-cache" and not mounts["/kc"].get("readOnly")
    assert {"name": "kernel-cache", "persistentVolumeClaim": {"claimName": "fluxserve-kernel-cache"}} in worker["volumes"]
    plain = cluster.rayservice({"applications": [{**app, "args": {}}]}, shape)["spec"]["rayClusterConfig"]
    assert "kernel-cache" not in str(plain)
