"""Opt-in compiled "high" tier (regional torch.compile of the transformer blocks) on the tiny preset, CPU fp32.

One module-scoped pipeline is compiled once (Inductor on CPU); every test here reuses it. On the CPU the GELU sites
refuse to mount, so compiled high is compared with eager (unmounted) high: same math, Inductor's own kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from deployments.config import AppArgs
from model.execution import execution_of
from model.loading import diffusers_reference, load_pipeline
from model.pipeline import FluxServePipeline, GenerationRequest, run_flux_pipeline

SIZE = 64
WARM_BATCH_SIZES = (1, 2)
# Inductor's fused fp32 kernels reorder reductions: measured max |diff| of the final latents ~5e-7 (2 steps).
LATENT_ATOL = 1e-4


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _has_runners(m: torch.nn.Module) -> bool:
    ex = execution_of(m)
    return ex is not None and ex.block_runners is not None


class _RunnerSpy:
    """Records, at each transformer call, whether compiled block runners were installed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[bool] = []
        self._h = model.register_forward_pre_hook(lambda m, a: self.seen.append(_has_runners(m)))

    def close(self) -> None:
        self._h.remove()


@pytest.fixture(scope="module")
def compiled(tiny_path: Path) -> dict[str, Any]:
    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    before = _graphs()
    seconds = pipe.enable_compile([(SIZE, SIZE)], steps=2, batch_sizes=WARM_BATCH_SIZES)
    return {"pipe": pipe, "warmup_graphs": _graphs() - before, "warmup_s": seconds}


def _req(prompt: str, seed: int, steps: int = 2, quality: str = "high") -> GenerationRequest:
    return GenerationRequest(prompt, height=SIZE, width=SIZE, steps=steps, seed=seed, quality=quality)


def test_warm_up_compiles_one_graph_per_block_type_and_batch_size(compiled) -> None:
    # double + single block, per warmed batch size (dynamic=False specialises on the batch dimension)
    assert compiled["warmup_graphs"] == 2 * len(WARM_BATCH_SIZES)
    assert compiled["pipe"].compile_enabled and compiled["warmup_s"] > 0


def test_compiled_high_is_close_to_eager_high(compiled) -> None:
    pipe: FluxServePipeline = compiled["pipe"]
    spy = _RunnerSpy(pipe.transformer)
    try:
        fast = pipe.generate([_req("a red fox", 3), _req("a cat", 4)])
        assert spy.seen == [True, True]
        spy.seen.clear()
        slow = pipe.generate([_req("a red fox", 3), _req("a cat", 4)], compiled=False)
        assert spy.seen == [False, False]
    finally:
        spy.close()
    for f, s in zip(fast, slow):
        assert f.quality == s.quality == "high"
        torch.testing.assert_close(f.latents, s.latents, atol=LATENT_ATOL, rtol=0)


def test_no_recompiles_across_requests_of_a_warmed_shape(compiled) -> None:
    pipe: FluxServePipeline = compiled["pipe"]
    graphs, recompiles = _graphs(), sum(counters["recompiles"].values())
    spy = _RunnerSpy(pipe.transformer)
    try:
        pipe.generate([_req("a fox", 11)])
        pipe.generate([_req("a snowy forest at dawn", 12, steps=3)])
        pipe.generate([_req("x", 13), _req("y", 14)])
        pipe.generate([GenerationRequest("a fox", height=SIZE, width=SIZE, steps=2, seed=15, guidance=5.0,
                                         quality="high")])
    finally:
        spy.close()
    assert spy.seen == [True] * (2 + 3 + 2 + 2)  # every step ran the compiled blocks
    assert _graphs() == graphs
    assert sum(counters["recompiles"].values()) == recompiles


def test_lossless_after_compiled_high_is_still_bit_identical_to_diffusers(compiled) -> None:
    pipe: FluxServePipeline = compiled["pipe"]
    pipe.generate([_req("a fox", 21)])  # compiled high batch first, same process and transformer
    assert execution_of(pipe.transformer) is None
    spy = _RunnerSpy(pipe.transformer)
    try:
        ours = pipe.generate([_req("a fox", 21, quality="lossless")])[0]
    finally:
        spy.close()
    assert spy.seen == [False, False]
    reference = diffusers_reference(pipe)
    reference.set_progress_bar_config(disable=True)
    ref_latents, ref_pngs = run_flux_pipeline(reference, [_req("a fox", 21, quality="lossless")])
    assert torch.equal(ours.latents, ref_latents[0])
    assert ours.png == ref_pngs[0]


def test_compiled_needs_enable_compile_and_checks_its_arguments(tiny_pipe) -> None:
    assert not tiny_pipe.compile_enabled
    with pytest.raises(ValueError, match="enable_compile"):
        tiny_pipe.generate([_req("a fox", 1)], compiled=True)
    for bad in ({"sizes": []}, {"sizes": [(SIZE, SIZE)], "steps": 0}, {"sizes": [(SIZE, SIZE)], "batch_sizes": ()}):
        with pytest.raises(ValueError, match="enable_compile needs"):
            tiny_pipe.enable_compile(**bad)
    assert not tiny_pipe.compile_enabled


# ---------------------------------------------------------------------------------------------------------------
# Serve config and replica wiring (no Ray needed)
# ---------------------------------------------------------------------------------------------------------------


def test_lossless_pool_refuses_compile() -> None:
    with pytest.raises(ValueError, match=r"args\.pools\.lossless\.compile is for the high pool only.*byte-identical"):
        AppArgs.parse({"pools": {"lossless": {"compile": True}}})


@pytest.mark.parametrize(
    "high, message",
    [
        ({"compile": "yes"}, "compile must be true or false"),
        ({"compile": True, "tp": 2}, "not supported with tp > 1"),
        ({"compile": True, "compile_sizes": "64x64"}, "must be a list"),
        ({"compile": True, "compile_sizes": ["64x60"]}, "multiples of 16"),
        ({"compile": True, "compile_sizes": ["big"]}, "expected 'WxH'"),
    ],
)
def test_bad_high_compile_options_are_config_errors(high: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AppArgs.parse({"pools": {"high": high}})


def test_fast_norm_is_a_high_pool_switch() -> None:
    assert AppArgs.parse({"pools": {"high": {"fast_norm": True}}}).pools["high"].fast_norm is True
    assert AppArgs.parse(None).pools["high"].fast_norm is True  # on by default for the high pool
    assert AppArgs.parse({"pools": {"high": {"fast_norm": False}}}).pools["high"].fast_norm is False
    assert AppArgs.parse(None).pools["lossless"].fast_norm is False
    with pytest.raises(ValueError, match=r"args\.pools\.lossless\.fast_norm is for the high pool only.*byte-identical"):
        AppArgs.parse({"pools": {"lossless": {"fast_norm": True}}})
    with pytest.raises(ValueError, match=r"args\.pools\.high\.fast_norm must be true or false"):
        AppArgs.parse({"pools": {"high": {"fast_norm": "on"}}})


def test_high_pool_compile_warm_up_plan() -> None:
    from deployments.config import warm_plan

    args = AppArgs.parse({"default_size": "256x128", "max_batch_size": 3, "pools": {"high": {"compile": True}}})
    assert args.pools["high"].compile and not args.pools["lossless"].compile
    assert warm_plan(args, "high") == ([(128, 256)], [1, 2, 3])
    assert warm_plan(args, "lossless") == ([(128, 256)], [1])  # batch-invariant: one request per call
    sized = AppArgs.parse({"pools": {"high": {"compile": True, "compile_sizes": ["64x64", "128x64"],
                                              "batch_invariant": True}}})
    assert warm_plan(sized, "high") == ([(64, 64), (64, 128)], [1])
    assert not AppArgs.parse(None).form("high").compile  # off by default


def test_the_builder_warms_up_the_pools_compile_plan(monkeypatch) -> None:
    """A compiled pool's form carries every size and batch size it can be asked for, and `build_pipeline` compiles
    for all of them before the replica serves (a wrong plan would leave a request to pay compilation)."""
    from model import loading
    from model.build import WARMUP_STEPS, build_pipeline

    calls = []

    class Pipe:
        form = None

        def use(self, **defaults):
            self.defaults = defaults

        def enable_compile(self, sizes, steps, batch_sizes):
            calls.append((sizes, steps, batch_sizes))
            self.compile_warmup_s = 1.5

    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: Pipe())
    form = AppArgs.parse({"max_batch_size": 2, "pools": {"high": {"compile": True}}}).form("high")
    assert build_pipeline(form).defaults == {"fast_norm": True, "attention8": False, "fast_vae": True, "step_cache": None}
    assert calls == [([(256, 256)], WARMUP_STEPS, [1, 2])]


# ---------------------------------------------------------------------------------------------------------------
# Kernels under a trace
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decided, expected", [("unfused", "unfused"), ("triton_tma", "cublaslt"), (None, "cublaslt")])
def test_gelu_dispatch_never_times_inside_a_trace(monkeypatch, decided: str | None, expected: str) -> None:
    """Traced (fullgraph, no break): the eagerly decided impl if traceable, else the fixed cuBLASLt epilogue; the
    timing path must not run. On the CPU the two are told apart by their numbers (the CPU epilogue is erf GELU)."""
    import kernels.gelu as G

    def no_timing(*_a):
        raise AssertionError("timed inside a trace")

    monkeypatch.setattr(G, "_decide_by_timing", no_timing)
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g) for s in ((8, 16), (32, 16), (32,)))
    monkeypatch.setattr(G, "_gelu_choice", {} if decided is None else
                        {(8, 32, 16, torch.float32, None): decided})
    fn = torch.compile(lambda x, w, b: G.GELU_IMPLS[G._choose_impl(x, w, b)](x, w, b), backend="eager",
                       fullgraph=True)
    out = fn(x, w, b)
    torch.testing.assert_close(out, G.GELU_IMPLS[expected](x, w, b), rtol=0, atol=0)
    other = "cublaslt" if expected == "unfused" else "unfused"
    assert not torch.allclose(out, G.GELU_IMPLS[other](x, w, b), atol=1e-4)
    assert G._gelu_choice == ({} if decided is None else {(8, 32, 16, torch.float32, None): decided})  # not cached


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"default_size": "big"}, r"args\.default_size: size must be \"WxH\""),
        ({"default_size": "250x256"}, r"args\.default_size: .*multiples of 16"),
        ({"default_size": "4096x4096"}, r"args\.default_size: .*too large"),
        ({"default_size": "512x512", "limits": {"max_side": 256}}, r"args\.default_size: .*<= 256"),
    ],
)
def test_default_size_is_checked_at_config_parse(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AppArgs.parse(raw)
