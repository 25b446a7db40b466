"""model/tiers.py: a tier is a value (TierPlan) and one context applies it to a transformer and restores lossless."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import gelu as G
from kernels.modulate import fast_norm_sites
from model.execution import execution_of
from model.flux import FluxTransformer, run_double_block, run_single_block
from model.tiers import TierPlan, applied_tier, plan_tier

SMALL = dict(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32, num_attention_heads=4,
             joint_attention_dim=48, pooled_projection_dim=24, axes_dims_rope=(8, 12, 12))


@pytest.fixture(scope="module")
def model() -> FluxTransformer:
    return FluxTransformer(**SMALL).to(torch.bfloat16).eval()


def test_plans_per_tier() -> None:
    assert plan_tier("lossless", fast_norm=True, compiled=True, cuda_graphs=True) == TierPlan(
        "lossless", cuda_graphs=True)
    assert plan_tier("high") == TierPlan("high", mount_gelu=True)
    assert plan_tier("high", fast_norm=True, compiled=True, cuda_graphs=True) == TierPlan(
        "high", mount_gelu=True, fast_norm=True, compiled=True)  # a compiled batch never replays graphs
    with pytest.raises(ValueError, match="lossless plan"):
        TierPlan("lossless", mount_gelu=True)
    with pytest.raises(ValueError, match="never replays"):
        TierPlan("high", compiled=True, cuda_graphs=True)


def test_high_plan_is_applied_then_lossless_restored_even_on_error(model, monkeypatch) -> None:
    monkeypatch.setattr(G, "_device_supported", lambda device: True)  # let the GELU sites mount on the CPU
    plan = TierPlan("high", mount_gelu=True, fast_norm=True, compiled=True)
    runners = (run_double_block, run_single_block)
    with pytest.raises(RuntimeError, match="boom"):
        with applied_tier(model, plan, block_runners=runners) as report:
            assert report.mounted_sites == 3 and len(kernels.mounted_sites(model)) == 3
            assert report.fast_norm_sites == fast_norm_sites(model) > 0
            assert execution_of(model).block_runners is runners and execution_of(model).step_graphs is None
            raise RuntimeError("boom")
    assert kernels.mounted_sites(model) == [] and fast_norm_sites(model) == 0 and execution_of(model) is None


def test_a_refusal_on_any_rank_unmounts_here(model, monkeypatch) -> None:
    monkeypatch.setattr(G, "_device_supported", lambda device: True)
    seen = []

    def agree(ok: bool) -> bool:
        seen.append(ok)
        return False  # another rank refused

    with applied_tier(model, plan_tier("high"), agree=agree) as report:
        assert seen == [True] and report.mounted_sites == 0 and kernels.mounted_sites(model) == []


def test_lossless_starts_from_a_clean_state(model, monkeypatch) -> None:
    monkeypatch.setattr(G, "_device_supported", lambda device: True)
    kernels.mount(model)  # left behind by someone else
    with applied_tier(model, plan_tier("lossless")) as report:
        assert kernels.mounted_sites(model) == [] and report.mounted_sites == 0 and report.mount_report is None
