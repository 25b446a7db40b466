"""The feature table (model/features.py) is the one place a technique's rules live: the config's refusals and
defaults, HIGH_DEFAULTS, the tier plan's checks, the README's table and `python -m model features` derive from it."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest

from deployments.config import AppArgs, PoolArgs
from model import features
from model.features import FEATURES, HIGH_DEFAULTS, POOL_OPTIONS, exclusion, feature

ROOT = Path(__file__).resolve().parents[1]
TP_REFUSED = [f for f in POOL_OPTIONS if f.tp_refusal is not None]


def _on(f: features.Feature) -> object:
    return {float: 0.1, int: 32}.get(f.option_type, True)


@pytest.mark.parametrize("f", TP_REFUSED, ids=lambda f: f.name)
def test_each_row_tp_does_not_admit_is_refused_at_tp_2_with_its_reason(f: features.Feature) -> None:
    """Catches a config that lets a technique through at tp > 1 that its row refuses, or words it otherwise."""
    device = "cuda" if f.elsewhere == "config" else "cpu"
    others = {g.key: False for g in POOL_OPTIONS if g.high_default}  # the defaults out of the way
    with pytest.raises(ValueError) as exc:
        AppArgs.parse({"device": device, "pools": {"high": {**others, "tp": 2, f.key: _on(f)}}})
    assert str(exc.value) == f"args.pools.high.{f.key} is not supported with tp > 1 (got tp=2): {f.tp_refusal}"


def test_a_row_changed_in_the_table_alone_changes_the_config(monkeypatch) -> None:
    """The refusal comes from the row, not from code naming the technique: give fast_norm (admitted at tp > 1) a
    made-up reason and the config refuses it with that reason; without the change it is accepted."""
    raw = {"pools": {"high": {"tp": 2, "fast_norm": True}}}
    assert AppArgs.parse(raw).pools["high"].fast_norm
    planted = dataclasses.replace(feature("fast_norm"), tp_refusal="a reason only this test knows")
    monkeypatch.setitem(features.BY_NAME, "fast_norm", planted)
    with pytest.raises(ValueError) as exc:
        AppArgs.parse(raw)
    assert str(exc.value) == ("args.pools.high.fast_norm is not supported with tp > 1 (got tp=2): "
                              "a reason only this test knows")


def test_config_code_names_no_pool_technique() -> None:
    """deployments/config.py holds no string or attribute naming a pool technique: its rules are the table's."""
    tree = ast.parse((ROOT / "deployments" / "config.py").read_text())
    keys = {f.key for f in POOL_OPTIONS} | {f.name for f in POOL_OPTIONS}
    named = sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in keys}
                   | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in keys
                      and not (isinstance(n.value, ast.Name) and n.value.id == "re")})  # (re.compile)
    assert named == []


def test_pool_args_has_one_field_per_pool_option_with_its_off_value() -> None:
    pool = PoolArgs()
    for f in POOL_OPTIONS:
        assert getattr(pool, f.key) is (False if f.option_type is bool else None), f.name
    assert pool.techniques() == frozenset()


@pytest.mark.parametrize("f", [f for f in POOL_OPTIONS if not f.exact], ids=lambda f: f.name)
def test_the_lossless_pool_refuses_each_non_exact_option(f: features.Feature) -> None:
    with pytest.raises(ValueError) as exc:
        AppArgs.parse({"pools": {"lossless": {f.key: _on(f)}}})
    assert str(exc.value) == (f"args.pools.lossless.{f.key} is for the high pool only: it is not bit-exact, and the "
                              "lossless pool must stay byte-identical to eager diffusers")


def test_exact_options_are_admitted_in_the_lossless_pool() -> None:
    exact = [f for f in POOL_OPTIONS if f.exact]
    assert exact  # (CUDA-graph replay)
    for f in exact:
        assert getattr(AppArgs.parse({"device": "cuda", "pools": {"lossless": {f.key: True}}}).pools["lossless"],
                       f.key)


@pytest.mark.parametrize("a, b", [(a.name, b.name) for a, b in combinations(POOL_OPTIONS, 2)
                                  if exclusion(a.name, b.name)])
def test_each_excluded_pair_is_refused_in_either_order_with_its_reason(a: str, b: str) -> None:
    fa, fb = feature(a), feature(b)
    raw = {"device": "cuda", "pools": {"high": {fa.key: _on(fa), fb.key: _on(fb)}}}
    with pytest.raises(ValueError) as exc:
        AppArgs.parse(raw)
    assert str(exc.value).endswith(f"exclude each other: {exclusion(a, b)}; choose one")
    assert {fa.key, fb.key} <= set(str(exc.value).replace(":", " ").replace(".", " ").split())


def test_device_bound_options_are_refused_elsewhere() -> None:
    for f in (f for f in POOL_OPTIONS if f.elsewhere == "config"):
        with pytest.raises(ValueError) as exc:
            AppArgs.parse({"device": "cpu", "pools": {"lossless": {f.key: True}}})
        assert str(exc.value) == f"args.pools.lossless.{f.key} needs device: cuda (got device: 'cpu')"


@pytest.mark.parametrize("raw, expected", [
    ({}, {"fast_norm", "fast_vae", "fp8", "fused_projections"}),  # attention8 waits for cuda_graphs
    ({"device": "cuda", "pools": {"high": {"cuda_graphs": True}}},
     {"fast_norm", "fast_vae", "fp8", "fused_projections", "attention8", "cuda_graphs"}),
    ({"pools": {"high": {"tp": 2}}}, {"fast_norm", "fast_vae", "fused_projections", "fp8"}),  # no graphs at tp > 1: no attention8
    ({"pools": {"high": {"compile": True}}}, {"fast_norm", "fast_vae", "compile"}),
    ({"loras": {"ink": "/x"}}, {"fast_norm", "fast_vae"}),  # per-request adapters keep the linears bf16
    ({"loras": {"ink": "/x"}, "fuse_lora": True, "device": "cuda", "pools": {"high": {"cuda_graphs": True}}},
     {"fast_norm", "fast_vae", "fp8", "fused_projections", "attention8", "cuda_graphs"}),
    ({"pools": {"high": {"fp8": False}}}, {"fast_norm", "fast_vae", "fused_projections"}),  # a default turned off stays off
])
def test_high_defaults_follow_the_table(raw: dict, expected: set) -> None:
    args = AppArgs.parse(raw)
    assert args.pools["high"].techniques() == expected
    assert args.pools["lossless"].techniques() <= {"cuda_graphs"}


def test_high_defaults_are_the_rows_marked_so() -> None:
    assert HIGH_DEFAULTS == {f.name for f in FEATURES if f.high_default} == {
        "fused_projections", "fp8", "fast_norm", "attention8", "fast_vae"}


def test_a_pools_form_carries_its_techniques() -> None:
    args = AppArgs.parse({"device": "cuda", "dtype": "bfloat16", "max_batch_size": 3,
                          "pools": {"high": {"cuda_graphs": True, "step_cache_threshold": 0.2}}})
    form = args.form("high")
    assert form.techniques() == args.pools["high"].techniques()
    assert (form.model, form.device, form.dtype, form.step_cache) == (args.model, "cuda", "bfloat16", 0.2)
    compiled = AppArgs.parse({"max_batch_size": 2, "pools": {"high": {"compile": True}}}).form("high")
    assert (compiled.warm_sizes, compiled.warm_batch_sizes) == (((256, 256),), (1, 2))


def test_the_readme_table_is_the_tables() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- features:begin -->\n", 1)[1].split("<!-- features:end -->", 1)[0]
    assert block == features.table_markdown()


def test_the_cli_prints_the_table() -> None:
    done = subprocess.run([sys.executable, "-m", "model", "features"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0 and done.stdout == features.table_markdown(), done.stderr
    done = subprocess.run([sys.executable, "-m", "model", "features", "--json"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    import json

    assert [row["name"] for row in json.loads(done.stdout)] == [f.name for f in FEATURES]


def test_lookups_and_where_a_technique_runs() -> None:
    """`feature` names the table on a typo; `runs_on` takes "cuda:N" as cuda and checks the dtype too; a device-bound
    option accepts an indexed CUDA device."""
    with pytest.raises(KeyError) as exc:
        feature("fp9")
    assert "unknown technique 'fp9'" in str(exc.value) and "'fp8'" in str(exc.value)
    assert feature("fast_norm").runs_on("cuda:1", "bfloat16") and feature("fast_norm").runs_on("cuda", "float16")
    assert not feature("fast_norm").runs_on("cuda", "float32") and not feature("fast_norm").runs_on("cpu", "bfloat16")
    assert feature("fp8").runs_on("cuda", "bfloat16") and not feature("fp8").runs_on("cuda", "float16")
    assert feature("step_cache").runs_on("cpu", "float32")
    assert AppArgs.parse({"device": "cuda:1", "pools": {"lossless": {"cuda_graphs": True}}}).pools["lossless"].cuda_graphs


def test_the_json_listing_carries_every_rule() -> None:
    rows = {row["name"]: row for row in features.as_dicts()}
    assert list(rows) == [f.name for f in FEATURES]
    assert rows["fp8"] == {"name": "fp8", "summary": feature("fp8").summary, "exact": False, "scope": "replica",
                           "config": "fp8", "devices": ["cuda"], "dtypes": ["bfloat16"], "tp": True,
                           "tp_refusal": None, "high_default": True, "default_with": [],
                           "excludes": ["compile", "gelu_sites", "lora"]}
    assert rows["step_cache"]["config"] == "step_cache_threshold" and rows["gelu_sites"]["config"] is None
    assert rows["attention8"]["default_with"] == ["cuda_graphs"] and rows["cuda_graphs"]["exact"] is True
    assert rows["compile"]["tp"] is False and rows["compile"]["tp_refusal"] == feature("compile").tp_refusal


def test_a_pool_with_several_exclusions_names_the_same_pair_in_every_process() -> None:
    """The refusal walks the other techniques in table order, not in a set's hash order: the message does not change
    from one process (hash seed) to the next."""
    code = ("from deployments.config import AppArgs\n"
            "try:\n    AppArgs.parse({'loras': {'ink': '/x'}, 'pools': {'high': {'compile': True, 'fp8': True}}})\n"
            "except ValueError as e:\n    print(e)")
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
            for seed in range(6)}
    assert len(seen) == 1 and next(iter(seen)).startswith("args.pools.high.fp8 and compile exclude each other"), seen
