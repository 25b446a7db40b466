"""The H200 cluster config and its KubeRay manifest, checked without starting anything: the config parses (our
args and Ray Serve's own schema), its resource arithmetic fits the stated node, and the committed RayService is the
one the generator makes from the config, valid against KubeRay's fields."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")

from deployments import cluster  # noqa: E402
from deployments.config import AppArgs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "serve_config.h200.yaml"
MANIFEST = ROOT / "deployments" / "kuberay" / "rayservice.h200.yaml"


def _config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def test_h200_config_parses_as_our_args_and_as_a_serve_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = _config()
    ServeDeploySchema.model_validate(config)
    [app] = config["applications"]
    args = AppArgs.parse(app["args"])
    assert (args.device, args.dtype, args.pools["lossless"].tp, args.pools["high"].tp) == ("cuda", "bfloat16", 1, 2)
    # fused projections shard with their heads and fp8 layers with their scales (model/features.py)
    assert args.pools["high"].fused_projections and args.pools["high"].fp8


def test_h200_config_fits_one_eight_gpu_node_at_max_replicas() -> None:
    config = _config()
    shape = cluster.shape_of(yaml.safe_load(MANIFEST.read_text()))
    assert (shape.nodes, shape.gpus_per_node) == (1, 8)
    assert cluster.check(config, shape) == []
    reps = cluster.replicas_at_most(config["applications"][0])
    by = {name: [r for r in reps if r.deployment == name] for name in ("lossless", "high", "Ingress", "ImageFiles")}
    assert [len(v) for v in by.values()] == [4, 2, 2, 1]
    assert {r.gpus for r in by["lossless"]} == {1.0} and {r.gpus for r in by["high"]} == {2.0}  # tp 2: 2 bundles
    assert sum(r.gpus for r in reps) == 8


def test_the_check_refuses_what_does_not_fit() -> None:
    config = _config()
    six = cluster.check(config, cluster.NodeShape(gpus_per_node=6))
    assert six and all("does not fit" in p for p in six)
    # a tp 2 replica is one STRICT_PACK placement group: two 1-GPU nodes cannot hold it, even with 2 GPUs in all
    small = cluster.check(config, cluster.NodeShape(nodes=8, gpus_per_node=1))
    assert any("a high replica (2 GPUs" in p for p in small)
    few_cpus = cluster.check(config, cluster.NodeShape(cpus_per_node=16))
    assert few_cpus


def test_committed_manifest_is_the_generated_one_and_valid_kuberay() -> None:
    from tests._kuberay import RayService

    manifest = yaml.safe_load(MANIFEST.read_text())
    shape = cluster.shape_of(manifest)
    assert manifest == cluster.rayservice(_config(), shape)  # regenerate: python -m deployments.cluster kuberay ...
    RayService.model_validate(manifest)
    embedded = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert embedded == {"applications": _config()["applications"]}
    worker = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"


@pytest.mark.parametrize("edit, words", [
    (lambda m: m["spec"]["rayClusterConfig"].update(workerGroupSpec=[]), "workerGroupSpec"),
    (lambda m: m["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"num-gpus": 0}), "string"),
    (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("minReplicas"), "minReplicas"),
    (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
     ["resources"]["limits"].update(cpu="lots"), "not a resource quantity"),
    (lambda m: m.update(apiVersion="ray.io/v1alpha1"), "apiVersion"),
])
def test_the_kuberay_model_catches_manifest_mistakes(edit, words: str) -> None:
    from pydantic import ValidationError

    from tests._kuberay import RayService

    manifest = yaml.safe_load(MANIFEST.read_text())
    edit(manifest)
    with pytest.raises(ValidationError, match=words):
        RayService.model_validate(manifest)


def test_cli_check_and_generate(capsys) -> None:
    assert cluster.main(["check", str(CONFIG)]) == 0
    assert "fits: 9 replicas at most, 8 GPUs" in capsys.readouterr().out
    assert cluster.main(["check", str(CONFIG), "--gpus-per-node", "4"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert cluster.main(["kuberay", str(CONFIG)]) == 0
    body = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert body == [ln for ln in MANIFEST.read_text().splitlines() if not ln.startswith("#")]  # byte for byte
