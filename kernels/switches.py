"""The one registry of kernel switches: every on/off that changes which kernels a forward launches.

Each fused kernel's gate (`ExactGate`), the residual-gate fast path (which also turns itself off after a kernel
failure) and model-level variants (e.g. the single block writing into proj_out's input) register a named switch
here. Everything that must know "which kernels run now" reads it in one place:

- `signature()`: the current value of every switch, as one hashable tuple; the CUDA-graph cache keys on it, so a
  graph captured before a switch changed is never replayed after.
- `override(**values)`: set switches for a block of code and restore them (benchmarks measure fusions this way).

A switch is process-wide state; per-batch choices (a tier's mounted sites) live on the model, not here.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass
class Switch:
    name: str
    doc: str
    default: bool
    value: bool


_REGISTRY: dict[str, Switch] = {}


def register(name: str, default: bool, doc: str) -> Switch:
    """Declare a switch (once per name; a module reloaded by a test gets its existing switch back)."""
    switch = _REGISTRY.get(name)
    if switch is None:
        switch = _REGISTRY[name] = Switch(name, doc, bool(default), bool(default))
    return switch


def get(name: str) -> bool:
    return _lookup(name).value


def set(name: str, value: bool) -> None:  # noqa: A001 - the registry's verb
    _lookup(name).value = bool(value)


def names() -> list[str]:
    return sorted(_REGISTRY)


def signature() -> tuple[tuple[str, bool], ...]:
    """Every switch's current value, sorted by name."""
    return tuple((n, s.value) for n, s in sorted(_REGISTRY.items()))


@contextmanager
def override(**values: bool) -> Iterator[None]:
    """Set the named switches inside the block; every switch is restored after it."""
    saved = {n: s.value for n, s in _REGISTRY.items()}
    try:
        for name, value in values.items():
            set(name, value)
        yield
    finally:
        for n, v in saved.items():
            _REGISTRY[n].value = v


def _lookup(name: str) -> Switch:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown kernel switch {name!r}; known: {names()}") from None
