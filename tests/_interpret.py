"""Run a probe script with Triton's CPU interpreter (TRITON_INTERPRET=1): our real kernels, indexing and masks
included, on machines without a GPU. The interpreter must be switched on before triton is imported, hence a fresh
Python per probe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_in_interpreter(probe: str, expect: str, timeout_s: float = 300) -> None:
    """Run `probe` (Python source) in the interpreter from the repo root; it must exit 0 and print `expect`."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0 and expect in proc.stdout, proc.stdout + proc.stderr
