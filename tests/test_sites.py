"""kernels/sites.py: the one protocol of per-batch kernel sites, and a tier applied in one walk over the model."""

from __future__ import annotations

import pytest
from torch import nn

from kernels import sites
from model.flux import FluxTransformer
from model.tiers import SITE_GROUPS, applied_tier, plan_tier

SMALL = dict(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
             joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))


def _tree() -> nn.Module:
    root = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    sites.mark(root[0], "a")
    sites.mark(root[1], "a")
    sites.mark(root[1], "b:left")
    sites.mark(root[2], "b:right")
    return root


def test_switch_sets_the_named_groups_and_leaves_the_others() -> None:
    root = _tree()
    done = sites.switch(root, {"a": True})
    assert done.on == {"a": ["0.a", "1.a"]} and sites.on(root[0], "a") and not sites.on(root[1], "b:left")
    sites.switch(root, {"b": True})
    assert sites.on(root[0], "a") and sites.on(root[2], "b:right")  # "a" untouched by a switch of "b"
    assert sites.switch(root, {"a": False, "b": False}).on == {} and sites.count(root, "a") == 0
    assert not sites.on(nn.Linear(1, 1), "a") and not sites.marked(root[0], "b")
    sites.unmark(root[1], "b:left")
    assert [k for _, _, k in sites.iter_sites(root)] == ["a", "a", "b:right"]


def test_a_checked_group_goes_on_all_or_none_and_follows_agree() -> None:
    root = _tree()
    refuse_right = {"b": lambda module, kind: (kind != "b:right", "no right")}
    done = sites.switch(root, {"a": True, "b": True}, refuse_right)
    assert done.refused == {"b": {"2.right": "no right"}} and "b" not in done.on
    assert sites.count(root, "b") == 0 and sites.count(root, "a") == 2  # the unchecked group is not held back
    verdicts = []
    done = sites.switch(root, {"b": True}, {"b": lambda m, k: (True, "ok")},
                        agree=lambda ok: verdicts.append(ok) or False)  # another rank refused
    assert verdicts == [True] and sites.count(root, "b") == 0 and done.on == {}
    sites.switch(root, {"b": True}, {"b": lambda m, k: (True, "ok")}, agree=lambda ok: ok)
    assert sites.count(root, "b") == 2


def test_a_tier_is_applied_and_restored_in_one_walk_each(monkeypatch) -> None:
    """Applying a plan walks the model once (every site set to the plan: on, or off where a previous batch left
    it), and restoring lossless after the batch once more."""
    model = FluxTransformer(**SMALL)
    walks = []
    real = nn.Module.named_modules

    def counting(self, *a, **k):
        if self is model:
            walks.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(nn.Module, "named_modules", counting)
    sites.switch(model, {"fast_norm": True})  # left on by someone else
    walks.clear()
    with applied_tier(model, plan_tier("high", attention8=True)) as report:
        assert len(walks) == 1 and report.attention8_sites == 2 and report.fast_norm_sites == 0
        inside = {g: sites.count(model, g) for g in SITE_GROUPS}  # (three more walks, the test's own)
    assert len(walks) == 1 + 3 + 1
    assert inside == {"gelu_sites": 0, "fast_norm": 0, "attention8": 2}  # CPU fp32: the GELU sites refuse
    assert all(sites.count(model, g) == 0 for g in SITE_GROUPS)
    assert set(SITE_GROUPS) == {"gelu_sites", "fast_norm", "attention8"}


@pytest.mark.parametrize("group", ["gelu_sites", "fast_norm", "attention8"])
def test_the_transformer_marks_every_site_group(group: str) -> None:
    assert sum(1 for _, _, k in sites.iter_sites(FluxTransformer(**SMALL)) if sites.group_of(k) == group) > 0


def test_site_answers_are_booleans_and_absent_things_are_fine() -> None:
    """`on` answers False (not None) for an off, unknown or unmarked site; unmarking what is not marked and switching
    a group no module has are no-ops; a kind's name after its group may itself hold a colon."""
    root = _tree()
    assert sites.on(root[0], "a") is False and sites.on(root[0], "b:left") is False
    assert sites.on(nn.Linear(1, 1), "a") is False
    sites.switch(root, {"a": True})
    sites.switch(root, {"a": False})
    assert sites.on(root[0], "a") is False
    assert sites.marked(root[1], "b:left") and not sites.marked(root[0], "b:left") and not sites.marked(nn.Linear(1, 1), "a")
    sites.unmark(root[0], "never:marked")
    sites.unmark(nn.Linear(1, 1), "a")
    assert sites.switch(root, {"absent": True}).on == {"absent": []}
    assert sites.switch(root, {"absent": True}, {"absent": lambda m, k: (True, "ok")}).on == {"absent": []}
    sites.mark(root[2], "c:x:y")
    assert ("2.x:y", "c:x:y") in [(n, k) for n, _, k in sites.iter_sites(root)]
