"""The README's main command: serve the embedded default and answer one request.

    python -m deployments.demo [--config serve_config.yaml] [--out fluxserve-demo.png] [--once] [--host H] [--port P]

Starts `serve run <config>` as a child process, waits until the app answers (Serve prints "Submitted" before the
replicas are up, so readiness is a real HTTP check), asks for one image per quality tier, writes the lossless PNG,
prints what came back, and keeps serving until Ctrl-C or SIGTERM (or exits at once with --once); either signal
stops `serve run` (which takes its Ray down) before the demo returns.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from model.request import DEFAULT_PROMPT

if TYPE_CHECKING:
    from deployments.config import AppArgs


_EXAMPLE = "a large blue square in the center, on a white background"


def ray_env() -> dict[str, str]:
    """Environment for a local Ray: no usage reporting; session files under a short path (unix sockets)."""
    return {
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "rayfs")),
    }


def _http(url: str, body: dict[str, Any] | None = None, accept: str = "application/json",
          timeout: float = 600.0) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", "Accept": accept})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_ready(base: str, child: subprocess.Popen, timeout_s: float) -> None:
    """Poll /readyz until it answers 200 (every pool has a running replica); fail early if `serve run` died or a
    pool failed to start (Serve gave up on it: its reason, e.g. CUDA out of memory, is in the error)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"`serve run` exited with status {child.returncode} before the app was ready")
        try:
            status, _, content = _http(base + "/readyz", timeout=5)
            if status == 200:
                return
            body = json.loads(content or b"{}") if status == 503 else {}
            if body.get("status") == "failed":
                failed = {pool: p["error"] for pool, p in body.get("pools", {}).items() if "error" in p}
                raise RuntimeError("the app failed to start: " + "; ".join(f"pool {pool}: {why}"
                                                                          for pool, why in failed.items()))
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the app did not become ready within {timeout_s:.0f} s")


def sigint_as_default() -> None:
    """preexec_fn for a `serve run` child: SIGINT back to its default disposition. A process started in the
    background by a non-interactive shell inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt, so `serve run` would ignore the SIGINT that asks it to shut down."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def preflight(cfg: dict[str, Any]) -> list["AppArgs"]:
    """What would fail every replica of the config's applications, found before anything starts (`serve run` would
    keep running and retry them): args that do not parse, an API-keys file that cannot be read, a model folder that
    is missing or incomplete. Raises ValueError or model.loading.ModelLoadError with the reason; returns each
    application's parsed args."""
    from deployments.app import check_args

    return [check_args(app.get("args")) for app in cfg.get("applications", [])]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the demo the way Ctrl-C does: `serve run` and its Ray go down first


def stop(child: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGINT lets `serve run` shut Serve and Ray down cleanly (~8 s, more while replicas finish the requests they
    hold); kill only if it hangs past `grace_s`."""
    if child.poll() is None:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="serve_config.yaml")
    p.add_argument("--out", default="fluxserve-demo.png")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--once", action="store_true", help="stop serving after the demo requests")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--host", default=None, help="address the app listens on (default: the config's http_options)")
    p.add_argument("--port", type=int, default=None, help="port the app listens on (default: the config's)")
    p.add_argument("--check", action="store_true",
                   help="only check the config (args, API-keys file, model folder): exit 0, or 2 with the reason")
    args = p.parse_args(argv)

    cfg = yaml.safe_load(Path(args.config).read_text())
    moved = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    cfg.setdefault("http_options", {}).update(moved)
    from model.loading import ModelLoadError

    try:
        apps = preflight(cfg)
    except (ValueError, ModelLoadError) as exc:
        print(f"error: {args.config}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.config}: ok", flush=True)
        return 0
    http = cfg.get("http_options", {})
    host = http.get("host", "127.0.0.1")
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{http.get('port', 8000)}"
    serve_bin = shutil.which("serve", path=os.path.dirname(sys.executable)) or shutil.which("serve")
    if serve_bin is None:
        print("error: the `serve` command (ray[serve]) is not installed; run `bash .ci/setup` first", file=sys.stderr)
        return 2

    # Ctrl-C and SIGTERM both end in `stop(child)`, also when a script started the demo with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    env = {**os.environ, **ray_env()}
    Path(env["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    config_path = args.config
    if moved:  # serve run reads host and port from the config: hand it a copy with them
        fd, config_path = tempfile.mkstemp(prefix="fluxserve-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg, f)
    print(f"starting: serve run {args.config}  (app on {base})", flush=True)
    t0 = time.monotonic()
    child = subprocess.Popen([serve_bin, "run", config_path], env=env, preexec_fn=sigint_as_default)
    try:
        wait_ready(base, child, args.ready_timeout)
        print(f"ready after {time.monotonic() - t0:.1f} s", flush=True)
        for quality in ("lossless", "high"):
            body = {"prompt": args.prompt, "seed": 42, "quality": quality}
            t = time.monotonic()
            status, headers, content = _http(base + "/v1/images/generations", body, accept="image/png")
            took = time.monotonic() - t
            if status != 200:
                print(f"{quality}: HTTP {status}: {content.decode(errors='replace')}", file=sys.stderr)
                return 1
            out = Path(args.out) if quality == "lossless" else Path(args.out).with_suffix(".high.png")
            out.write_bytes(content)
            info = {k: v for k, v in headers.items() if k.lower().startswith("x-")}
            print(f"{quality}: wrote {out} in {took:.2f} s, {time.monotonic() - t0:.1f} s after start ({len(content)} "
                  f"bytes, md5 {hashlib.md5(content).hexdigest()}) {info}", flush=True)
        print(f"\ntry it yourself:\n  curl -s {base}/v1/images/generations -H 'Content-Type: application/json' "
              f"-H 'Accept: image/png' -d '{{\"prompt\": \"{_EXAMPLE}\", \"seed\": 1}}' -o shapes.png\n"
              f"  API docs: {base}/docs", flush=True)
        if not args.once:
            print("serving; Ctrl-C to stop", flush=True)
            child.wait()
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        # in-flight requests may take up to their deadline to finish (the replicas' graceful shutdown)
        stop(child, max((a.request_timeout_s for a in apps), default=0.0) + 60.0)
        if config_path != args.config:
            os.unlink(config_path)


if __name__ == "__main__":
    sys.exit(main())
