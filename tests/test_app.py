"""The application builder's wiring without a running Ray: what `serve run` hands Serve for each pool.

(The bound's behaviour under a burst, with Serve running: tests/test_serve.py::test_a_burst_past_the_queue_bound_is_shed.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

from deployments.app import build_app_with_options  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from model.request import QUALITIES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _pools(raw_args: dict) -> dict[str, object]:
    """The pool deployments bound under the ingress, by name."""
    ingress = build_app_with_options(raw_args)._bound_deployment
    pools = {}
    for arg in ingress.init_args:
        bound = getattr(arg, "_bound_deployment", None)
        if bound is not None and bound.name in QUALITIES:
            pools[bound.name] = bound
    assert sorted(pools) == sorted(QUALITIES)
    return pools


@pytest.mark.parametrize("bound", [1, 7, 64, -1])
def test_the_configured_queue_bound_reaches_every_pool_unchanged(bound: int) -> None:
    """Catches a builder that drops, clamps or hard-codes `max_queued_requests` (the burst test bounds loosely on
    purpose, so it would not see 64 become 63 or -1 become a bound)."""
    for name, deployment in _pools({"max_queued_requests": bound}).items():
        assert deployment.max_queued_requests == bound, name


@pytest.mark.parametrize("config", ["serve_config.yaml", "serve_config.h200.yaml"])
def test_the_shipped_configs_queue_bound_is_what_serve_gets(config: str) -> None:
    """`serve run` applies the YAML's `deployments:` entries over the builder's options: none may set a pool's
    queue bound to something other than `args.max_queued_requests`."""
    app = yaml.safe_load((ROOT / config).read_text())["applications"][0]
    args = AppArgs.parse(app["args"])
    for name, deployment in _pools(app["args"]).items():
        assert deployment.max_queued_requests == args.max_queued_requests, (config, name)
    for entry in app.get("deployments", []):
        if entry["name"] in QUALITIES:
            assert entry.get("max_queued_requests", args.max_queued_requests) == args.max_queued_requests, entry


def test_a_bad_queue_bound_fails_the_build() -> None:
    for bad in (0, -2):
        with pytest.raises(ValueError, match="max_queued_requests must be >= 1 or -1"):
            build_app_with_options({"max_queued_requests": bad})


@pytest.mark.parametrize("args, reason", [
    ({"model": "/nonexistent/FLUX.1-dev"}, "does not exist or is not a directory"),
    ({"api_keys_file": "/nonexistent/keys.txt"}, "API keys file '/nonexistent/keys.txt': No such file or directory"),
    ({"pools": {"lossless": {"fp8": True}}}, "lossless"),
])
def test_a_config_that_cannot_serve_stops_the_demo_before_serve_starts(tmp_path, capsys, monkeypatch, args: dict,
                                                                     reason: str) -> None:
    """A missing model folder, an unreadable API-keys file or args that do not parse: the demo says why on stderr
    and exits 2 before starting `serve run` (which would keep running, its replicas failing and retrying)."""
    import yaml

    from deployments import demo

    shipped = Path(__file__).resolve().parents[1] / "serve_config.yaml"
    config = yaml.safe_load(shipped.read_text())
    config["applications"][0]["args"].update(args)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(demo.subprocess, "Popen", lambda *a, **k: pytest.fail("serve run was started"))
    assert demo.main(["--config", str(path), "--once"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and reason in err, err
    assert [a.model for a in demo.preflight(yaml.safe_load(shipped.read_text()))] == ["toy"]  # the shipped config passes
    assert demo.main(["--config", str(path), "--check"]) == 2 and reason in capsys.readouterr().err


def test_the_demo_check_passes_the_shipped_configs_and_starts_nothing(capsys, monkeypatch) -> None:
    """`--check` is the config check alone (for `... --check && serve run serve_config.yaml`): 0 and "ok"."""
    from deployments import demo

    monkeypatch.setattr(demo.subprocess, "Popen", lambda *a, **k: pytest.fail("serve run was started"))
    shipped = Path(__file__).resolve().parents[1] / "serve_config.yaml"
    assert demo.main(["--config", str(shipped), "--check"]) == 0
    assert capsys.readouterr().out.strip() == f"{shipped}: ok"


def test_the_demo_serves_on_the_host_and_port_it_is_given(tmp_path, monkeypatch) -> None:
    """`--host` / `--port` reach `serve run` (through a copy of the config, which is removed afterwards) and the
    demo's own requests go there (to 127.0.0.1 for a wildcard host)."""
    import yaml

    from deployments import demo

    seen: dict = {}

    class Exited:  # alive for one readiness poll, then gone
        returncode = 1
        polls = iter([None])

        def poll(self) -> int | None:
            return next(self.polls, 1)

    def popen(cmd, **kwargs):
        seen["config"] = yaml.safe_load(Path(cmd[-1]).read_text())
        seen["path"] = cmd[-1]
        return Exited()

    monkeypatch.setattr(demo.subprocess, "Popen", popen)
    def http(url, *a, **k):
        seen.setdefault("urls", []).append(url)
        raise ConnectionError("nothing listens")

    monkeypatch.setattr(demo, "_http", http)
    shipped = str(Path(__file__).resolve().parents[1] / "serve_config.yaml")
    with pytest.raises(RuntimeError, match="exited with status 1 before the app was ready"):
        demo.main(["--config", shipped, "--host", "0.0.0.0", "--port", "8123", "--once"])
    assert seen["config"]["http_options"]["host"] == "0.0.0.0" and seen["config"]["http_options"]["port"] == 8123
    assert seen["config"]["applications"] == yaml.safe_load(Path(shipped).read_text())["applications"]
    assert not Path(seen["path"]).exists() and seen["path"] != shipped
    assert seen["urls"] == ["http://127.0.0.1:8123/readyz"]


def test_the_demo_stops_waiting_when_a_pool_failed_to_start_and_says_why(monkeypatch) -> None:
    """/readyz answering "failed" (Serve gave up starting a pool) ends the demo's wait at once with the pool and its
    reason, instead of waiting out --ready-timeout; "starting" keeps it waiting. Bug caught: a failed start seen as
    not ready yet (the demo waited 300 s with no word while a GPU ran out of memory)."""
    import itertools
    import json

    from deployments import demo

    class Alive:
        returncode = None

        def poll(self) -> None:
            return None

    failed = {"status": "failed", "pools": {
        "lossless": {"ready": True, "replicas": {"running": 1}},
        "high": {"ready": False, "replicas": {}, "error": "The deployment failed to start 3 times ... "
                                                          "torch.OutOfMemoryError: CUDA out of memory."}}}
    answers = itertools.chain([{"status": "starting", "pools": {}}], itertools.repeat(failed))
    monkeypatch.setattr(demo, "_http", lambda url, *a, **k: (503, {}, json.dumps(next(answers)).encode()))
    monkeypatch.setattr(demo.time, "sleep", lambda s: None)
    with pytest.raises(RuntimeError) as err:
        demo.wait_ready("http://127.0.0.1:1", Alive(), timeout_s=3)  # TimeoutError after 3 s if it kept waiting
    assert str(err.value) == ("the app failed to start: pool high: The deployment failed to start 3 times ... "
                              "torch.OutOfMemoryError: CUDA out of memory.")
    monkeypatch.setattr(demo, "_http", lambda url, *a, **k: (503, {}, b'{"status": "starting", "pools": {}}'))
    with pytest.raises(TimeoutError):
        demo.wait_ready("http://127.0.0.1:1", Alive(), timeout_s=0.05)


@pytest.mark.parametrize("config", ["serve_config.yaml", "serve_config.h200.yaml", None])
def test_shutdown_a_stopped_replica_keeps_its_requests_for_as_long_as_one_may_take(config: str | None) -> None:
    """Scale-down, redeploy or shutdown: Serve stops routing to the replica, then waits up to its
    graceful_shutdown_timeout_s for what it holds before killing it. The ingress and every pool wait as long as a
    request may take (args.request_timeout_s); Serve's default (20 s) would cut a queued 1024x1024 batch short.
    (A request finishing while its app is deleted: tests/test_serve.py::test_shutdown_an_in_flight_request_finishes.)"""
    raw = yaml.safe_load((ROOT / config).read_text())["applications"][0]["args"] if config else {"request_timeout_s": 77}
    args = AppArgs.parse(raw)
    ingress = build_app_with_options(raw)._bound_deployment
    assert ingress._deployment_config.graceful_shutdown_timeout_s == args.request_timeout_s
    for name, deployment in _pools(raw).items():
        assert deployment._deployment_config.graceful_shutdown_timeout_s == args.request_timeout_s, name
    if config:
        for entry in yaml.safe_load((ROOT / config).read_text())["applications"][0].get("deployments", []):
            assert entry.get("graceful_shutdown_timeout_s", args.request_timeout_s) >= args.request_timeout_s, entry
