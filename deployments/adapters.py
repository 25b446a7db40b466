"""Adapters loaded through the API while the app serves: one registry (a small Serve deployment, so every ingress
replica sees the same set), name -> file under `args.lora_dir`.

`POST /v1/adapters` registers one and loads it on a replica of each pool, which checks the file (a bad one is
unregistered again and the reason answered); every other replica loads it before the first batch that names it
(the ingress hands each job naming a registered adapter the registry's set; the replica makes its pipeline's set
equal before running: `PoolReplica.run_chunk`). `DELETE /v1/adapters/{name}` unregisters it; replicas drop it at
their next sync. The set is kept in `<lora_dir>/.fluxserve-adapters.json` when that folder is writable, so a
restarted registry still knows it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from ray import serve

from deployments.config import ADAPTER_NAME
from deployments.errors import BadRequest

logger = logging.getLogger("ray.serve")

STATE_FILE = ".fluxserve-adapters.json"


def adapter_folder(lora_dir: str) -> Path:
    """The adapter folder as files in it are named: absolute, links resolved."""
    return Path(lora_dir).expanduser().resolve()


class NotFound(LookupError):
    """No such adapter: a 404."""


class AdapterStore:
    """The registry itself (plain Python; the deployment below holds one)."""

    def __init__(self, lora_dir: str, configured: list[str], max_count: int) -> None:
        self.root = adapter_folder(lora_dir)
        self.configured = frozenset(configured)  # loaded at start from args.loras: not the API's to change
        self.max_count = int(max_count)
        self._adapters: dict[str, str] = {}
        try:
            kept = json.loads((self.root / STATE_FILE).read_text())
            self._adapters = {n: str(f) for n, f in kept.items() if Path(f).is_file()} if isinstance(kept, dict) else {}
        except (OSError, ValueError):
            pass

    def list(self) -> dict[str, str]:
        return dict(self._adapters)

    def add(self, name: str, file: str) -> dict[str, str]:
        """Register `file` (relative to the folder) as `name`; BadRequest with the reason if it cannot be."""
        if not isinstance(name, str) or not ADAPTER_NAME.match(name):
            raise BadRequest("name", f"adapter name must be 1-64 of letters, digits, '_', '.', '-', got {name!r}")
        if name in self.configured or name in self._adapters:
            raise BadRequest("name", f"adapter {name!r} is loaded already"
                                     + (" (args.loras)" if name in self.configured else "; delete it first"))
        if len(self._adapters) >= self.max_count:
            raise BadRequest(None, f"at most {self.max_count} adapters may be loaded through the API "
                                     "(args.limits.max_runtime_adapters); delete one first")
        self._adapters[name] = self.resolve(file)
        self._save()
        return self.list()

    def remove(self, name: str) -> dict[str, str]:
        if name not in self._adapters:
            where = " (it is args.loras', loaded at start)" if name in self.configured else ""
            raise NotFound(f"no adapter {name!r} loaded through the API{where}")
        del self._adapters[name]
        self._save()
        return self.list()

    def resolve(self, file: str) -> str:
        """The adapter file `file` names inside the folder, as an absolute path; BadRequest if it is outside it, not a
        .safetensors file or not there."""
        if not isinstance(file, str) or not file or "\0" in file:
            raise BadRequest("file", f"file must name a .safetensors file in the adapter folder, got {file!r}")
        path = (self.root / file).resolve()
        if not path.is_relative_to(self.root) or path == self.root:
            raise BadRequest("file", f"file {file!r} is outside the adapter folder")
        if path.suffix != ".safetensors":
            raise BadRequest("file", f"file {file!r} is not a .safetensors file")
        if not path.is_file():
            raise BadRequest("file", f"no file {file!r} in the adapter folder")
        return str(path)

    def _save(self) -> None:
        try:
            fd, tmp = tempfile.mkstemp(prefix=".fluxserve-adapters-", dir=self.root)
            with os.fdopen(fd, "w") as f:
                json.dump(self._adapters, f)
            os.replace(tmp, self.root / STATE_FILE)
        except OSError as exc:  # a read-only folder: the set lives as long as this replica
            logger.warning("adapters: the set is not kept on disk (%s)", exc)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Adapters:  # pragma: no mutate block
    """The registry's deployment: one replica, so every ingress replica sees one set."""

    def __init__(self, lora_dir: str, configured: list[str], max_count: int) -> None:
        self.store = AdapterStore(lora_dir, configured, max_count)

    def list(self) -> dict[str, str]:
        return self.store.list()

    def add(self, name: str, file: str) -> dict[str, str]:
        return self.store.add(name, file)

    def remove(self, name: str) -> dict[str, str]:
        return self.store.remove(name)
