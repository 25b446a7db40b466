"""Free TCP ports for the servers the tests start (Ray's GCS, dashboard, Serve's HTTP proxy, metrics).

A port the OS hands out for `bind(("127.0.0.1", 0))` lies in its ephemeral range, where Ray's own processes bind
their many gRPC servers the same way: such a port can be taken between the test picking it and the server binding
it (a proxy then fails with "Failed to bind to address"). Ports are picked below that range instead, above Ray's
worker ports (10002-19999 by default).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOW = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port nothing listens on now, outside the ephemeral range where it can be (else any free port)."""
    high = _ephemeral_low()
    for _ in range(200 if high - _LOW > 1000 else 0):
        port = random.randrange(_LOW, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
