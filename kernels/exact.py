"""A bit-exact gate for lossless fused kernels: trust a kernel for an input signature only after it matched eager.

On the first sight of a signature (shapes, strides, dtypes, devices of the inputs) the fused and the eager chain
both run and are compared by `torch.equal` (NaNs at the same places count as equal). A match enables the kernel
for that signature; a mismatch or a kernel error disables it for that signature (one warning), and the eager
result is what the caller gets either way. No verification happens while torch.compile traces or a CUDA graph
captures (a compare would sync): an unverified signature then runs eager. CPU tensors always run eager.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from . import switches

logger = logging.getLogger(__name__)

Signature = tuple


def tensor_signature(*tensors: torch.Tensor) -> Signature:
    """What a kernel's exactness can depend on: shape, strides, dtype and device of every operand."""
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, except that NaN == NaN at the same positions (random-weight models can produce NaNs)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)))


def cannot_verify_now() -> bool:
    """While torch.compile traces or a CUDA graph captures, no comparison can run (it would sync)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class ExactGate:
    """Per-signature on/off switch for one fused kernel, decided by comparing with eager once."""

    def __init__(self, name: str, doc: str = "") -> None:
        self.name = name
        self._switch = switches.register(name, True, doc or f"fused kernel {name} (bit-exact gate)")
        self._verdict: dict[Signature, bool] = {}
        self.fast_calls = 0  # launches of the fused kernel that produced the returned result

    @property
    def enabled(self) -> bool:
        """The gate's switch in `kernels.switches` (off: always eager; benchmarks, debugging)."""
        return self._switch.value

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._switch.value = bool(value)

    def verdicts(self) -> dict[Signature, bool]:
        return dict(self._verdict)

    def verified(self, signature: Signature) -> bool:
        """Has the kernel matched eager for this signature (so `fast` runs without a comparison)?"""
        return self._verdict.get(signature) is True

    def verdict(self, signature: Signature) -> bool | None:
        """The comparison's outcome for this signature: True (fast runs), False (eager), None (not compared yet)."""
        return self._verdict.get(signature)

    def reset(self) -> None:
        self._verdict.clear()
        self.fast_calls = 0

    def run(
        self,
        signature: Signature | None,
        fast: Callable[[], torch.Tensor],
        eager: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """`fast()` if it is known to equal `eager()` for this signature; else eager (verifying once if possible).

        signature None means the inputs are outside what the kernel supports: eager.
        """
        if signature is None or not self.enabled or torch.compiler.is_compiling():
            return eager()
        verdict = self._verdict.get(signature)
        if verdict is True:
            self.fast_calls += 1
            return fast()
        if verdict is False or cannot_verify_now():
            return eager()
        expected = eager()
        try:
            got = fast()
        except Exception as exc:  # noqa: BLE001 - a compiler/launch failure must degrade to eager
            self._verdict[signature] = False
            logger.warning("%s: fused kernel failed for %s (%s: %s); eager for this signature",
                           self.name, signature, type(exc).__name__, exc)
            return expected
        ok = same_values(got, expected)
        self._verdict[signature] = ok
        if not ok:
            logger.warning("%s: fused kernel differs from eager for %s; eager for this signature", self.name, signature)
        return expected
