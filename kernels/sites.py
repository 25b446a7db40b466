"""One protocol for the modules whose kernels a quality tier switches per batch (kernels know sites, not models).

A module marks each of its sites once (`mark(module, "fast_norm")`, `mark(module, "gelu_sites:proj")`: a group,
and after a colon what the site is within the module); its forward asks `on(module, kind)`; a tier sets the sites of
a whole model in one walk (`switch`) and sets them back off in one walk after the batch. A group may be checked:
its sites are then switched on all or none, each site's check must pass (the fused GELU epilogue's guard), and an
`agree` hook may turn a local yes into everyone's verdict (TP ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from torch import nn

_ATTR = "_fluxserve_sites"


def mark(module: nn.Module, kind: str) -> None:
    """Declare a site of `module` (off until a tier switches it)."""
    sites = module.__dict__.get(_ATTR)
    if sites is None:
        sites = {}
        object.__setattr__(module, _ATTR, sites)
    sites.setdefault(kind, False)


def unmark(module: nn.Module, kind: str) -> None:
    """The site is gone (e.g. its layer was merged into a wider one)."""
    sites = module.__dict__.get(_ATTR)
    if sites is not None:
        sites.pop(kind, None)


def on(module: nn.Module, kind: str) -> bool:
    """Is the site switched on? (The instance dict, not getattr: this runs at every site call.)"""
    sites = module.__dict__.get(_ATTR)
    return bool(sites) and sites.get(kind, False)


def marked(module: nn.Module, kind: str) -> bool:
    sites = module.__dict__.get(_ATTR)
    return bool(sites) and kind in sites


def group_of(kind: str) -> str:
    return kind.partition(":")[0]


def iter_sites(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(qualified name, module, kind) of every site in `model`."""
    for prefix, module in model.named_modules():
        sites = module.__dict__.get(_ATTR)
        if sites:
            for kind in list(sites):
                _, _, what = kind.partition(":")
                name = ".".join(p for p in (prefix, what or group_of(kind)) if p)
                yield name, module, kind


def count(model: nn.Module, group: str) -> int:
    """How many sites of `group` are switched on."""
    return sum(1 for _, module, kind in iter_sites(model) if group_of(kind) == group and on(module, kind))


@dataclass
class Switched:
    """What a `switch` did: per group, the sites now on (qualified names) and the checked ones refused."""

    on: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, dict[str, str]] = field(default_factory=dict)

    def count(self, group: str) -> int:
        return len(self.on.get(group, []))


Check = Callable[[nn.Module, str], tuple[bool, str]]


def switch(model: nn.Module, groups: Mapping[str, bool], checks: Mapping[str, Check] | None = None,
           agree: Callable[[bool], bool] | None = None) -> Switched:
    """Set every site of the named groups on or off in one walk over `model` (other groups are left as they are).

    A group with a check (`checks[group](module, kind) -> (ok, reason)`) goes on all or none: any refusal, or a
    False from `agree` (called once per checked group switched on, with this process's verdict), leaves it off.
    """
    checks = checks or {}
    report = Switched()
    pending: dict[str, list[tuple[str, dict, str]]] = {}
    for name, module, kind in iter_sites(model):
        group = group_of(kind)
        if group not in groups:
            continue
        sites = module.__dict__[_ATTR]
        sites[kind] = False
        if not groups[group]:
            continue
        check = checks.get(group)
        if check is not None:
            ok, reason = check(module, kind)
            if not ok:
                report.refused.setdefault(group, {})[name] = reason
                continue
        pending.setdefault(group, []).append((name, sites, kind))
    for group, wanted in groups.items():
        if not wanted:
            continue
        ok = not report.refused.get(group)
        if group in checks and agree is not None:
            ok = agree(ok)
        if ok:
            for name, sites, kind in pending.get(group, []):
                sites[kind] = True
            report.on[group] = [name for name, _, _ in pending.get(group, [])]
    return report
