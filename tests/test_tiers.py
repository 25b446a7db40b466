"""model/tiers.py: a tier is a value (TierPlan) and one context applies it to a transformer and restores lossless."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import gelu as G
from kernels.modulate import fast_norm_sites
from model.execution import execution_of
from kernels.attention import attention8_sites
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
    plan = TierPlan("high", mount_gelu=True, fast_norm=True, attention8=True, compiled=True, step_cache=0.2)
    runners = (run_double_block, run_single_block)
    with pytest.raises(RuntimeError, match="boom"):
        with applied_tier(model, plan, block_runners=runners) as report:
            assert report.mounted_sites == 3 and len(kernels.mounted_sites(model)) == 3
            assert report.fast_norm_sites == fast_norm_sites(model) > 0
            assert report.attention8_sites == attention8_sites(model) == 2  # one per block
            assert execution_of(model).block_runners is runners and execution_of(model).step_graphs is None
            assert execution_of(model).step_cache is report.step_cache and report.step_cache.threshold == 0.2
            raise RuntimeError("boom")
    assert kernels.mounted_sites(model) == [] and fast_norm_sites(model) == 0 and execution_of(model) is None
    assert attention8_sites(model) == 0


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


LOSSLESS_REFUSAL = ("a lossless plan may not switch on non-exact kernels, compiled blocks or a converted (fp8 / "
                    "fused-projection) transformer: ")


@pytest.mark.parametrize("switch", [{"mount_gelu": True}, {"fast_norm": True}, {"attention8": True},
                                    {"compiled": True}, {"fp8": True}, {"fused_projections": True},
                                    {"step_cache": 0.1}, {"step_cache": 0.0}])
def test_a_lossless_plan_refuses_each_non_exact_switch_alone(switch: dict) -> None:
    """One switch at a time, so a check that needs two of them together (an `and` for an `or`) fails here."""
    with pytest.raises(ValueError) as exc:
        TierPlan("lossless", **switch)
    assert str(exc.value) == LOSSLESS_REFUSAL + repr(TierPlan("high", **switch)).replace("'high'", "'lossless'")
    TierPlan("high", **switch)  # the same switch on a high plan is fine (bar the pairs below)
    assert TierPlan("lossless", cuda_graphs=True).cuda_graphs  # graph replay runs the same kernels: allowed


def test_plans_that_contradict_themselves_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError) as exc:
        TierPlan("high", fp8=True, mount_gelu=True)
    assert str(exc.value) == "fp8 layers take their GELU inside the quantization pass: no GELU sites to mount"
    with pytest.raises(ValueError) as exc:
        TierPlan("high", compiled=True, cuda_graphs=True)
    assert str(exc.value) == "a compiled batch never replays graphs"


def test_plan_tier_carries_the_form_and_the_step_cache_to_high_only() -> None:
    assert plan_tier("high", fp8=True, fused_projections=True, step_cache=0.3, attention8=True) == TierPlan(
        "high", fp8=True, fused_projections=True, step_cache=0.3, attention8=True)  # fp8 takes the GELU: no mount
    assert plan_tier("high", fused_projections=True) == TierPlan("high", mount_gelu=True, fused_projections=True)
    assert plan_tier("lossless", step_cache=0.3, attention8=True, cuda_graphs=True) == TierPlan(
        "lossless", cuda_graphs=True)
    with pytest.raises(ValueError, match="lossless plan"):
        plan_tier("lossless", fp8=True)  # a converted transformer cannot serve lossless
    with pytest.raises(ValueError, match="lossless plan"):
        plan_tier("lossless", fused_projections=True)


def test_ran_as_json_names_every_field() -> None:
    """`Ran.as_dict` is the API's `ran` object: every field under its own name, adapters as name/scale objects."""
    from model.tiers import Ran

    ran = Ran(gelu_sites=1, fast_norm_sites=2, attention8_sites=3, fp8_layers=4, fused_projections=True,
              compiled=True, graphed=False, step_cache=0.5, fast_vae=True, adapters=(("ink", 0.8), ("sun", -1.0)),
              fused_adapter=("oil", 1.0))
    assert ran.as_dict() == {"gelu_sites": 1, "fast_norm_sites": 2, "attention8_sites": 3, "fp8_layers": 4,
                             "fused_projections": True, "compiled": True, "graphed": False, "step_cache": 0.5,
                             "fast_vae": True,
                             "adapters": [{"name": "ink", "scale": 0.8}, {"name": "sun", "scale": -1.0}],
                             "fused_adapter": {"name": "oil", "scale": 1.0}}
    assert Ran().as_dict()["fused_adapter"] is None and Ran().as_dict()["adapters"] == []
