"""Our top-level package is named `kernels`, like Hugging Face's hub-kernels package that diffusers (and
transformers) use optionally. diffusers decides with `_is_package_available("kernels")`: `find_spec` finds OUR
package (checked below, so this test is not vacuous), but the version lookup `importlib.metadata.version("kernels")`
needs a *distribution* named `kernels`; ours is `fluxserve`, so diffusers reports it unavailable and never runs
`from kernels import get_kernel`. If HF `kernels` is ever installed next to us, this test fails: rename then.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib.metadata as md, importlib.util, sys
spec = importlib.util.find_spec("kernels")
locations = list(spec.submodule_search_locations or []) if spec else []
assert any(str(p).rstrip("/").endswith("kernels") and "REPO" in str(p) for p in locations), locations
assert "kernels" not in sys.modules
try:
    md.version("kernels")
    raise SystemExit("a distribution named 'kernels' is installed: collision")
except md.PackageNotFoundError:
    pass

import diffusers
from diffusers import FluxPipeline, FluxTransformer2DModel
from diffusers.utils import is_kernels_available
from diffusers.models import attention_dispatch as ad
import transformers.utils.import_utils as tu
import torch

assert not is_kernels_available()
assert not tu.is_kernels_available()
try:
    ad._check_attention_backend_requirements(ad.AttentionBackendName.FLASH_HUB)
    raise SystemExit("hub attention backend accepted")
except RuntimeError as e:
    assert "`kernels` package isn't available" in str(e), e
q = torch.randn(1, 2, 4, 8)
out = ad.dispatch_attention_fn(q, q, q)  # default dispatch path
assert out.shape == (1, 2, 4, 8)
assert "kernels" not in sys.modules, sys.modules["kernels"]
print("OK")
""".replace("REPO", str(REPO))


@pytest.mark.parametrize("cwd", ["repo", "elsewhere"])
def test_diffusers_does_not_see_or_import_our_kernels_package(cwd, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO if cwd == "repo" else tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
