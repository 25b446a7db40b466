"""Builder for `serve run serve_config.yaml` (import_path: deployments.app:build_app).

Wiring lives here; sizing (replicas, autoscaling, actor options) lives in the YAML `deployments:`
entries, which override these defaults by deployment name ("Ingress", "lossless", "high").
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from ray.serve import Application

from deployments.adapters import Adapters
from deployments.config import AppArgs, PoolArgs
from deployments.files import ImageFiles
from deployments.ingress import Ingress
from deployments.replica import FluxReplica
from model.loading import check_source
from model.request import QUALITIES
from tp.dist import resolve_backend


def model_name(args: AppArgs) -> str:
    """Name reported by /v1/models: the preset, or the checkpoint folder's name."""
    return "flux-" + os.path.basename(os.path.normpath(args.model)) if os.sep in args.model else args.model


def pool_options(pool: str, p: PoolArgs, args: AppArgs) -> dict[str, Any]:
    """Deployment options a pool needs for its TP degree."""
    opts: dict[str, Any] = {
        "name": pool,
        # A replica must be able to hold a full batch, or @serve.batch never fills one.
        "max_ongoing_requests": max(2 * args.max_batch_size, 4),
        # Bounded queue at the callers (the ingress): a burst past it is shed (BackPressureError -> 503).
        "max_queued_requests": args.max_queued_requests,
        # A replica being stopped (scale-down, redeploy, app shutdown) takes no new request and finishes those it
        # holds, for as long as a request may take.
        "graceful_shutdown_timeout_s": args.request_timeout_s,
    }
    if p.tp > 1:
        resolve_backend(p.backend, args.device, p.ranks_share_gpu)  # a backend that cannot run fails the build
        # One bundle per rank; the coordinator actor sits in bundle 0 and takes no CPU of its own.
        opts["placement_group_bundles"] = [dict(p.rank_resources) for _ in range(p.tp)]
        opts["placement_group_strategy"] = "STRICT_PACK"
        opts["ray_actor_options"] = {"num_cpus": 0}
    return opts


def check_args(raw_args: dict[str, Any] | None, model_here: bool = True) -> AppArgs:
    """What would fail every replica, found before any starts: args that do not parse, an API-keys file that cannot
    be read, and (model_here: the replicas run on this machine) a model folder that is missing or incomplete. Raises
    ValueError or model.loading.ModelLoadError with the reason."""
    args = AppArgs.parse(raw_args)
    args.load_api_keys()
    if model_here:
        check_source(args.model)
        if args.lora_dir is not None and not os.path.isdir(os.path.expanduser(args.lora_dir)):
            raise ValueError(f"args.lora_dir {args.lora_dir!r} is not a folder")
    return args


def build_app(raw_args: dict[str, Any]) -> Application:
    """The builder `serve run` calls (Serve requires exactly one parameter: the YAML args).

    Serve builds a config file's app in a task of its own and, when the build fails, marks the app failed while
    `serve run` keeps running and every route answers 404. Under a local `serve run <config>` (the Ray it started
    runs this task) a config that cannot serve stops it instead: the reason on its stderr, exit status 15."""
    driver = serve_run_driver()
    try:
        check_args(raw_args, model_here=driver is not None)
        return build_app_with_options(raw_args)
    except Exception as exc:
        if driver is not None:
            stop_serve_run(driver, f"fluxserve: the app cannot start: {exc}")
        raise


def serve_run_driver(pid: int | None = None) -> int | None:
    """The `serve run` process among this process's ancestors (the Ray it started runs this task), or None (a Ray
    started with `ray start`, as on a cluster, or not Linux)."""
    pid = os.getppid() if pid is None else pid
    for _ in range(8):  # worker -> raylet -> the driver that started them, with room for wrappers
        if pid <= 1:
            return None
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            return None
        if b"run" in argv[1:] and any(os.path.basename(a) == b"serve" for a in argv[:2]):
            return pid
        pid = int(stat.rsplit(b")", 1)[1].split()[1])  # the field after the process's (name) and state
    return None


def stop_serve_run(pid: int, reason: str) -> None:
    """Write `reason` to the `serve run` process's stderr and send it SIGTERM, which Ray's driver turns into exit
    status 15 after shutting its local Ray down."""
    try:
        with open(f"/proc/{pid}/fd/2", "w") as err:
            err.write(reason.rstrip() + "\n")
    except OSError:
        pass
    os.kill(pid, signal.SIGTERM)


def build_app_with_options(
    raw_args: dict[str, Any], deployment_options: dict[str, dict[str, Any]] | None = None
) -> Application:
    """Parse the args and bind the ingress to the two pools.

    deployment_options: per-deployment `.options()` for Python callers (tests, benches) that deploy with
    `serve.run` instead of a config file; `serve run serve_config.yaml` uses the YAML `deployments:` instead.
    """
    args = check_args(raw_args, model_here=False)  # a keys file that cannot be read fails here, not in the ingress
    plain = args.to_dict()
    extra = deployment_options or {}
    unknown = set(extra) - {"Ingress", "ImageFiles", "Adapters", *QUALITIES}
    if unknown:
        raise ValueError(f"deployment_options: unknown deployment(s) {sorted(unknown)}")
    pools = {
        q: FluxReplica.options(**{**pool_options(q, args.pools[q], args), **extra.get(q, {})}).bind(q, plain)
        for q in QUALITIES
    }
    files = ImageFiles.options(**extra.get("ImageFiles", {})).bind(args.image_url_ttl_s, args.image_url_max_bytes)
    adapters = None if args.lora_dir is None else Adapters.options(**extra.get("Adapters", {})).bind(
        args.lora_dir, sorted(args.loras), args.limits.max_runtime_adapters)
    ingress = {"graceful_shutdown_timeout_s": args.request_timeout_s, **extra.get("Ingress", {})}
    return Ingress.options(**ingress).bind(
        pools["lossless"], pools["high"], files, plain, model_name(args), adapters
    )
