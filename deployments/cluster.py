"""Cluster sizing of a Serve config file, and the KubeRay RayService that runs it.

    python -m deployments.cluster check serve_config.h200.yaml --nodes 1 --gpus-per-node 8 --cpus-per-node 96
    python -m deployments.cluster kuberay serve_config.h200.yaml > deployments/kuberay/rayservice.h200.yaml

`check` adds up what every deployment can ask for at its largest (autoscaling max_replicas, or num_replicas) and
packs those replicas onto the stated nodes: a TP replica's ranks are one STRICT_PACK placement group, so it must
fit on one node. It starts nothing. `kuberay` writes a RayService (ray.io/v1) whose serveConfigV2 is the config's
applications, and whose worker group is the stated node shape, so the two cannot drift apart (a test regenerates
the committed manifest and compares).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import yaml

from deployments.app import pool_options
from deployments.config import AppArgs
from deployments.files import ImageFiles
from deployments.ingress import Ingress

# What Ray Serve reserves for a replica whose options name no CPUs.
SERVE_DEFAULT_CPUS = 1.0


@dataclass(frozen=True)
class NodeShape:
    """The GPU worker nodes a config is sized for (all alike), and the image the pods run."""

    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_node: int = 96
    memory_per_node: str = "1500Gi"
    image: str = "fluxserve:latest"
    ray_version: str = "2.60.0"


@dataclass(frozen=True)
class Replica:
    deployment: str
    gpus: float
    cpus: float


def _code_options(name: str, args: AppArgs) -> dict[str, Any]:
    """The options the code gives a deployment before the config's entry overrides them."""
    if name in args.pools:
        return pool_options(name, args.pools[name], args)
    deployment = {"Ingress": Ingress, "ImageFiles": ImageFiles}.get(name)
    if deployment is None:
        raise ValueError(f"unknown deployment {name!r}: the app has Ingress, ImageFiles and pools {list(args.pools)}")
    return {"ray_actor_options": dict(deployment.ray_actor_options or {})}


def replicas_at_most(app: dict[str, Any]) -> list[Replica]:
    """Every replica the application can run at once (autoscaling at max_replicas), with what each reserves."""
    args = AppArgs.parse(app.get("args"))
    entries = {d["name"]: d for d in app.get("deployments", [])}
    out: list[Replica] = []
    for name in ("Ingress", "ImageFiles", *args.pools):
        entry = entries.get(name, {})
        code = _code_options(name, args)
        actor = {**code.get("ray_actor_options", {}), **entry.get("ray_actor_options", {})}
        cpus = float(actor.get("num_cpus", SERVE_DEFAULT_CPUS))
        gpus = float(actor.get("num_gpus", 0))
        for bundle in code.get("placement_group_bundles", []):  # tp > 1: one bundle per rank
            cpus += float(bundle.get("CPU", 0))
            gpus += float(bundle.get("GPU", 0))
        scaling = entry.get("autoscaling_config")
        count = int(scaling["max_replicas"]) if scaling else int(entry.get("num_replicas", 1))
        out += [Replica(name, gpus, cpus)] * count
    return out


def check(config: dict[str, Any], shape: NodeShape) -> list[str]:
    """Problems that keep the config from fitting `shape` at its largest (empty: it fits): first-fit decreasing by
    GPUs, then CPUs, onto `shape.nodes` nodes."""
    problems: list[str] = []
    for app in config.get("applications", []):
        free = [[float(shape.gpus_per_node), float(shape.cpus_per_node)] for _ in range(shape.nodes)]
        for r in sorted(replicas_at_most(app), key=lambda r: (r.gpus, r.cpus), reverse=True):
            node = next((n for n in free if n[0] >= r.gpus and n[1] >= r.cpus), None)
            if node is None:
                problems.append(f"{app['name']}: a {r.deployment} replica ({r.gpus:g} GPUs, {r.cpus:g} CPUs) does not "
                                f"fit: {shape.nodes} node(s) of {shape.gpus_per_node} GPUs / {shape.cpus_per_node} "
                                "CPUs are full at max_replicas")
                continue
            node[0] -= r.gpus
            node[1] -= r.cpus
    return problems


def rayservice(config: dict[str, Any], shape: NodeShape, name: str = "fluxserve") -> dict[str, Any]:
    """A KubeRay RayService running `config`'s applications on a CPU head pod and `shape` GPU worker pods."""
    serve_config = {"applications": config["applications"]}
    models = {"name": "models", "mountPath": "/models", "readOnly": True}

    def container(role: str, cpus: int, memory: str, gpus: int, caches: list[str] | None = None) -> dict[str, Any]:
        resources: dict[str, Any] = {"cpu": str(cpus), "memory": memory}
        if gpus:
            resources["nvidia.com/gpu"] = str(gpus)
        c: dict[str, Any] = {"name": f"ray-{role}", "image": shape.image,
                             "resources": {"limits": resources, "requests": dict(resources)},
                             "env": [{"name": "RAY_USAGE_STATS_ENABLED", "value": "0"},
                                     {"name": "NCCL_NVLS_ENABLE", "value": "0"}],
                             "volumeMounts": [models, *({"name": "kernel-cache", "mountPath": path}
                                                         for path in caches or [])]}
        if role == "head":
            c["ports"] = [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
                          {"containerPort": 10001, "name": "client"}, {"containerPort": 8000, "name": "serve"}]
        return c

    volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": "flux-models", "readOnly": True}}]
    # Where the replicas keep built kernels (args.kernel_cache_dir): a writable volume, so a restarted pod warms
    # from what an earlier one compiled.
    caches = sorted({app["args"]["kernel_cache_dir"] for app in config["applications"]
                     if app.get("args", {}).get("kernel_cache_dir")})
    cache_volume = {"name": "kernel-cache", "persistentVolumeClaim": {"claimName": "fluxserve-kernel-cache"}}
    worker_volumes = [*volumes, cache_volume] if caches else volumes
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": shape.ray_version,
                "headGroupSpec": {
                    # the head schedules no model replica: no GPUs, and a CPU count Ray does not hand to replicas
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {"spec": {"containers": [container("head", 8, "32Gi", 0)], "volumes": volumes}},
                },
                "workerGroupSpecs": [{
                    "groupName": "h200",
                    "replicas": shape.nodes,
                    "minReplicas": shape.nodes,
                    "maxReplicas": shape.nodes,
                    "rayStartParams": {},
                    "template": {"spec": {
                        "containers": [container("worker", shape.cpus_per_node, shape.memory_per_node,
                                                 shape.gpus_per_node, caches)],
                        "volumes": worker_volumes,
                    }},
                }],
            },
        },
    }


def shape_of(manifest: dict[str, Any]) -> NodeShape:
    """The node shape a RayService manifest states (its GPU worker group)."""
    group = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    container = group["template"]["spec"]["containers"][0]
    limits = container["resources"]["limits"]
    return NodeShape(nodes=int(group["maxReplicas"]), gpus_per_node=int(limits.get("nvidia.com/gpu", 0)),
                     cpus_per_node=int(limits["cpu"]), memory_per_node=limits["memory"], image=container["image"],
                     ray_version=manifest["spec"]["rayClusterConfig"]["rayVersion"])


class _ManifestDumper(yaml.SafeDumper):
    """Block-style multi-line strings (the embedded Serve config stays readable) and no YAML anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_ManifestDumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def dump_manifest(manifest: dict[str, Any]) -> str:
    return yaml.dump(manifest, Dumper=_ManifestDumper, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("check", "kuberay"))
    ap.add_argument("config")
    ap.add_argument("--nodes", type=int, default=NodeShape.nodes)
    ap.add_argument("--gpus-per-node", type=int, default=NodeShape.gpus_per_node)
    ap.add_argument("--cpus-per-node", type=int, default=NodeShape.cpus_per_node)
    ap.add_argument("--memory-per-node", default=NodeShape.memory_per_node)
    ap.add_argument("--image", default=NodeShape.image)
    a = ap.parse_args(argv)
    config = yaml.safe_load(open(a.config))
    shape = NodeShape(a.nodes, a.gpus_per_node, a.cpus_per_node, a.memory_per_node, a.image)
    if a.action == "kuberay":
        sys.stdout.write(f"# generated: python -m deployments.cluster kuberay {a.config}"
                         + "".join(f" {k} {v}" for k, v in (("--nodes", a.nodes), ("--gpus-per-node", a.gpus_per_node),
                                                            ("--cpus-per-node", a.cpus_per_node)))
                         + "\n# (do not edit by hand: tests/test_cluster.py regenerates and compares)\n")
        sys.stdout.write(dump_manifest(rayservice(config, shape)))
        return 0
    problems = check(config, shape)
    for p in problems:
        print(p)
    if not problems:
        reps = [r for app in config["applications"] for r in replicas_at_most(app)]
        print(f"fits: {len(reps)} replicas at most, {sum(r.gpus for r in reps):g} GPUs and {sum(r.cpus for r in reps):g} "
              f"CPUs of {shape.nodes * shape.gpus_per_node} GPUs / {shape.nodes * shape.cpus_per_node} CPUs")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
