"""CUDA-graph replay of the transformer step (model/graphs.py) and its wiring (pipeline, serve config, replica).

CPU: every call falls back to eager and equals the plain forward; the fallback reasons; the cache policy (keys, LRU,
capture failure) with the CUDA mechanics replaced by a stand-in; static buffer layouts; the pipeline switch; config
errors and replica wiring. (The GELU dispatch guard inside a capture: tests/test_kernels.py.)
GPU (`-m gpu`): replays torch.equal eager (B=1, 2, new input values, return_dict, mounted high, FLUX.1-dev width), LRU
eviction with real graphs, pipeline latents/PNGs with graphs == without, a real CUDA error inside a capture.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kernels
import kernels.gelu as G
import model.graphs as graphs_mod
from deployments.config import AppArgs
from model.execution import execution_of, running
from model.flux import FluxTransformer, run_double_block, run_single_block
from model.graphs import StepGraphs
from model.loading import load_pipeline
from model.pipeline import GenerationRequest
from tests._inputs import random_flux

SMALL = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=32,
             num_attention_heads=4, joint_attention_dim=48, pooled_projection_dim=24, guidance_embeds=True,
             axes_dims_rope=(8, 12, 12))
TXT, IMG = 7, 24


def _model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> FluxTransformer:
    m = FluxTransformer(**SMALL)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m.to(device, dtype).eval()


def _inputs(batch: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
            img: int = IMG) -> dict[str, Any]:
    """Inputs shaped like FluxPipeline's (guidance is a stride-0 `expand`, as diffusers passes it)."""
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.stack([torch.zeros(img), torch.arange(img) // 6, torch.arange(img) % 6], dim=-1).float()
    cpu = dict(
        hidden_states=torch.randn(batch, img, SMALL["in_channels"], generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, TXT, SMALL["joint_attention_dim"], generator=g).to(dtype),
        pooled_projections=torch.randn(batch, SMALL["pooled_projection_dim"], generator=g).to(dtype),
        timestep=torch.rand(batch, generator=g).to(dtype),
        txt_ids=torch.zeros(TXT, 3),
        img_ids=img_ids,
    )
    out: dict[str, Any] = {k: v.to(device) for k, v in cpu.items()}
    out["guidance"] = torch.full([1], 3.5, device=device, dtype=torch.float32).expand(batch)
    out["return_dict"] = False
    return out


_ATTACHED: dict[int, StepGraphs] = {}  # model id -> the graphs `_graphed` runs it with (the model holds none)


def _attach(m: FluxTransformer, sg: StepGraphs) -> StepGraphs:
    _ATTACHED[id(m)] = sg
    return sg


def _detach(m: FluxTransformer) -> None:
    _ATTACHED.pop(id(m), None)


def _eager(m: FluxTransformer, inputs: dict[str, Any]) -> torch.Tensor:
    assert execution_of(m) is None
    with torch.no_grad():
        return m(**inputs)[0]


def _graphed(m: FluxTransformer, inputs: dict[str, Any]) -> torch.Tensor:
    with running(m, step_graphs=_ATTACHED[id(m)]), torch.no_grad():
        return m(**inputs)[0]


# ---------------------------------------------------------------------------------------------------------------
# CPU: eager fallbacks
# ---------------------------------------------------------------------------------------------------------------


def test_cpu_falls_back_to_eager_with_the_plain_forwards_result() -> None:
    m = _model()
    sg = _attach(m, StepGraphs())
    for batch in (1, 2):
        inputs = _inputs(batch, seed=batch)
        assert torch.equal(_graphed(m, inputs), _eager(m, inputs))
    with running(m, step_graphs=sg), torch.no_grad():
        as_dict = m(**{**_inputs(1, seed=1), "return_dict": True})
    assert type(as_dict).__name__ == "Transformer2DModelOutput"
    assert torch.equal(as_dict.sample, _eager(m, _inputs(1, seed=1)))
    assert sg.stats()["fallback_reasons"] == {"cpu": 3}
    assert (sg.captures, sg.replays, sg.eager_fallbacks) == (0, 0, 3)


@pytest.mark.parametrize("reason", ["grad", "joint_attention_kwargs", "controlnet", "training"])
def test_each_unsupported_call_runs_eager_for_its_reason(reason: str) -> None:
    """The checks that come before the device check, so they are told apart on the CPU too."""
    m = _model()
    inputs = _inputs(2, seed=3)
    expected = _eager(m, inputs)
    sg = _attach(m, StepGraphs())
    grad = reason == "grad"
    if reason == "joint_attention_kwargs":
        inputs["joint_attention_kwargs"] = {"unused": 1}
    elif reason == "controlnet":
        # zero residuals keep the result comparable with the plain forward
        inputs["controlnet_block_samples"] = [torch.zeros(2, IMG, m.inner_dim)]
    elif reason == "training":
        m.train()  # dropout p=0: same values
    with running(m, step_graphs=sg), torch.set_grad_enabled(grad):
        assert torch.equal(m(**inputs)[0].detach(), expected)
    assert sg.stats()["fallback_reasons"] == {reason: 1}


def test_graphs_and_compiled_runners_never_run_together_and_leave_no_state_on_the_model() -> None:
    m = _model()
    with pytest.raises(ValueError, match="never replay"):
        with running(m, block_runners=(run_double_block, run_single_block), step_graphs=StepGraphs()):
            pass
    sg = StepGraphs()
    with running(m, step_graphs=sg) as ex:
        assert execution_of(m) is ex and execution_of(_model()) is None  # scoped to this transformer
    assert execution_of(m) is None
    assert not any(isinstance(v, StepGraphs) for v in vars(m).values())


# ---------------------------------------------------------------------------------------------------------------
# CPU: the cache policy, with the CUDA mechanics replaced
# ---------------------------------------------------------------------------------------------------------------


class _StandInStep:
    """A "graph" that replays by calling the eager forward: the policy is under test, not CUDA."""

    def __init__(self, eager: Any) -> None:
        self.eager = eager
        self.released = False
        self.segments = [(None, None)]  # one graph, no collective between segments

    def replay(self, kwargs: dict[str, Any]) -> Any:
        assert not self.released
        return self.eager(**kwargs)

    def release(self) -> None:
        self.released = True


class _PolicyOnly(StepGraphs):
    def __init__(self, *args: Any, fail_with: Exception | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_with = fail_with
        self.steps: list[_StandInStep] = []

    def eager_reason(self, module: torch.nn.Module, kwargs: dict[str, Any]) -> str | None:
        reason = super().eager_reason(module, kwargs)
        return None if reason == "cpu" else reason

    def _capture(self, eager: Any, kwargs: dict[str, Any]) -> _StandInStep:
        if self.fail_with is not None:
            raise self.fail_with
        self.steps.append(_StandInStep(eager))
        return self.steps[-1]


def test_keys_cover_shapes_optional_args_return_dict_and_mode_but_not_values() -> None:
    sg = StepGraphs()
    a, b = _inputs(2, seed=1), _inputs(2, seed=2)
    assert sg.key(a) == sg.key(b)  # values are copied in, not keyed
    assert sg.key(a) != sg.key(_inputs(1, seed=1))
    assert sg.key(a) != sg.key(_inputs(2, seed=1, img=36))
    assert sg.key(a) != sg.key({**a, "guidance": None})
    assert sg.key({**a, "joint_attention_kwargs": {}}) == sg.key({**a, "joint_attention_kwargs": None})
    with torch.no_grad():  # FluxPipeline passes {}: not an argument that prevents replay
        assert sg.eager_reason(_model(), {**a, "joint_attention_kwargs": {}}) == "cpu"
    assert sg.key(a) != sg.key({**a, "return_dict": True})
    assert sg.key(a) != sg.key({**a, "guidance": a["guidance"].contiguous()})  # strides are part of the layout
    assert sg.key(a) != sg.key({k: v.to(torch.bfloat16) if k == "hidden_states" else v for k, v in a.items()})
    before = sg.key(a)
    sg.mode = ("high", 4)
    high = sg.key(a)
    assert high != before
    kernels.modulate.GATE.enabled = False  # a kernel switch changes the kernels, so the key
    try:
        assert sg.key(a) != high
    finally:
        kernels.modulate.GATE.enabled = True
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # so does the SDPA backend choice
        assert sg.key(a) != high
    assert sg.key(a) == high


def _every_switch() -> list[str]:
    """Every registered kernel switch, after importing every kernels module (each registers its own at import)."""
    import importlib
    import pkgutil

    from kernels import switches

    for info in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"kernels.{info.name}")
    names = switches.names()
    # the model's and the kernels' switches known when this test was written are still registered
    assert {"residual_gate_add", "rope_cat", "rms_rope_cat", "modulate", "layer_norm_modulate", "gelu_tanh_into",
            "single_block_in_place", "fp8_fast_accum", "fp8_norm_producer", "attention8_cudnn"} <= set(names), names
    return names


@pytest.mark.parametrize("switch", _every_switch())
def test_a_graph_is_never_replayed_across_a_kernel_switch_change(switch: str) -> None:
    """Every registered kernel switch is part of the graph key (the loop is over the registry, so a switch added
    later is covered, and a key that leaves one out fails): flipping one captures a new graph instead of replaying
    the one captured with the old kernels; flipping it back replays that one again."""
    from kernels import switches

    m = _model()
    sg = _attach(m, _PolicyOnly(max_graphs=4))
    inputs = _inputs(1, seed=1)
    _graphed(m, inputs)
    _graphed(m, inputs)
    assert (sg.captures, sg.replays) == (1, 2)
    with switches.override(**{switch: not switches.get(switch)}):
        assert torch.equal(_graphed(m, inputs), _eager(m, inputs))
        assert (sg.captures, sg.replays) == (2, 3)  # a new capture: the old graph was not replayed
    _graphed(m, inputs)
    assert (sg.captures, sg.replays) == (2, 4)  # back to the first graph


def test_lru_bound_eviction_and_reuse() -> None:
    m = _model()
    sg = _attach(m, _PolicyOnly(max_graphs=2))
    for batch, seed in ((1, 1), (2, 2), (1, 3), (3, 4), (2, 5)):
        inputs = _inputs(batch, seed)
        assert torch.equal(_graphed(m, inputs), _eager(m, inputs))
    # B=1 and B=2 captured; B=1 hit (now most recent); B=3 evicts B=2; B=2 again evicts B=1
    assert (sg.captures, sg.replays, sg.evictions, sg.eager_fallbacks) == (4, 5, 2, 0)
    assert [s.released for s in sg.steps] == [True, True, False, False]
    assert sg.stats()["graphs"] == 2
    sg.mode = "other"
    _graphed(m, _inputs(2, 6))
    assert sg.captures == 5
    sg.reset()
    assert sg.stats()["graphs"] == 0 and all(s.released for s in sg.steps)


def test_a_failed_capture_warns_once_and_that_signature_stays_eager(caplog) -> None:
    m = _model()
    sg = _attach(m, _PolicyOnly(fail_with=RuntimeError("operation not permitted when stream is capturing")))
    inputs = _inputs(2, seed=7)
    with caplog.at_level(logging.WARNING, logger=graphs_mod.__name__):
        assert torch.equal(_graphed(m, inputs), _eager(m, inputs))
        sg.fail_with = None  # would capture now, but the signature is marked eager for good
        assert torch.equal(_graphed(m, _inputs(2, seed=8)), _eager(m, _inputs(2, seed=8)))
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
    assert (sg.capture_failures, sg.captures, sg.replays) == (1, 0, 0)
    assert sg.stats()["fallback_reasons"] == {"capture_failed": 2}
    _graphed(m, _inputs(1, seed=9))  # another signature still captures
    assert sg.captures == 1


def test_an_error_of_the_eager_warm_up_is_raised_not_hidden() -> None:
    m = _model()

    class WarmupFails(_PolicyOnly):
        def _capture(self, eager: Any, kwargs: dict[str, Any]) -> Any:
            try:
                raise ValueError("shape mismatch in block 3")
            except ValueError as exc:
                raise graphs_mod._WarmupError() from exc

    sg = _attach(m, WarmupFails())
    with pytest.raises(ValueError, match="shape mismatch"):
        _graphed(m, _inputs(1, seed=1))
    assert sg.capture_failures == 0  # the next call tries again


@pytest.mark.parametrize("t, reason", [
    (torch.zeros(4, 6)[:, ::2], None),  # a strided slice: reproducible
    (torch.zeros(1, 6).expand(3, 6), None),  # broadcast: reproducible (stride 0 kept)
    (torch.zeros(6).as_strided((3, 3), (1, 1)), "layout"),  # overlapping: a buffer cannot be written like it
    (torch.zeros(8)[1:], "unaligned"),
])
def test_static_buffers_reproduce_the_callers_layout(t: torch.Tensor, reason: str | None) -> None:
    assert graphs_mod._layout_reason(t) == reason
    if reason is None:
        static = graphs_mod._StaticInput(t)
        assert static.view.shape == t.shape and static.view.stride() == t.stride()
        base = t._base if t._base is not None else t
        view = torch.randn(base.shape).as_strided(t.shape, t.stride(), t.storage_offset())  # t's layout, new values
        static.fill(view)
        assert torch.equal(static.view, view)


def test_max_graphs_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_graphs"):
        StepGraphs(max_graphs=0)


# ---------------------------------------------------------------------------------------------------------------
# CPU: pipeline switch
# ---------------------------------------------------------------------------------------------------------------


def _graphs_mode(mod: torch.nn.Module) -> Any:
    ex = execution_of(mod)
    return None if ex is None or ex.step_graphs is None else ex.step_graphs.mode


class _StepSpy:
    """Records the step graphs' mode (None: no graphs) at each transformer call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[Any] = []
        self._h = model.register_forward_pre_hook(
            lambda mod, _a: self.seen.append(_graphs_mode(mod)))

    def close(self) -> None:
        self._h.remove()


def _req(seed: int, quality: str = "lossless", steps: int = 2) -> GenerationRequest:
    return GenerationRequest("a red fox", height=64, width=64, steps=steps, seed=seed, quality=quality)


def test_pipeline_uses_graphs_per_batch_with_its_mode_never_compiled(tiny_path: Path) -> None:
    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="enable_cuda_graphs"):
        pipe.generate([_req(1)], cuda_graphs=True)
    plain = pipe.generate([_req(1)])[0]
    sg = pipe.enable_cuda_graphs(max_graphs=3)
    assert pipe.cuda_graphs_enabled and pipe.step_graphs is sg and sg.max_graphs == 3
    spy = _StepSpy(pipe.transformer)
    try:
        graphed = pipe.generate([_req(1)])[0]
        assert spy.seen == [("lossless", 0, 0, 0, ())] * 2  # (tier, GELU, fast norm, 8-bit attention sites, adapters)
        assert execution_of(pipe.transformer) is None  # only during its batch
        spy.seen.clear()
        pipe.generate([_req(2, "high")])
        assert spy.seen == [("high", 0, 0, 0, ())] * 2  # the CPU mounts nothing
        spy.seen.clear()
        pipe.generate([_req(1)], cuda_graphs=False)
        assert spy.seen == [None] * 2
        # Eager functions stand in for the compiled runners: under test is the switch, not torch.compile.
        pipe._compiled_runners = (run_double_block, run_single_block)
        spy.seen.clear()
        pipe.generate([_req(3, "high")])
        assert spy.seen == [None] * 2
    finally:
        spy.close()
    assert torch.equal(graphed.latents, plain.latents) and graphed.png == plain.png
    assert sg.stats()["fallback_reasons"] == {"cpu": 4}


# ---------------------------------------------------------------------------------------------------------------
# Serve config and replica wiring (no Ray needed)
# ---------------------------------------------------------------------------------------------------------------


def test_cuda_graphs_config_both_pools_on_cuda() -> None:
    args = AppArgs.parse({"device": "cuda", "pools": {"lossless": {"cuda_graphs": True},
                                                      "high": {"cuda_graphs": True}}})
    assert args.pools["lossless"].cuda_graphs and args.pools["high"].cuda_graphs
    assert not AppArgs.parse(None).pools["lossless"].cuda_graphs  # off by default


def test_cuda_graphs_at_tp_2_take_the_whole_high_set() -> None:
    """At tp > 1 graphs are admitted (the collectives are captured, or run between graph segments), and with them
    the high pool's defaults include 8-bit attention, as at tp 1."""
    args = AppArgs.parse({"device": "cuda", "pools": {"high": {"cuda_graphs": True, "tp": 2},
                                                      "lossless": {"cuda_graphs": True, "tp": 4}}})
    high = args.pools["high"]
    assert high.tp == 2 and high.cuda_graphs and high.fp8 and high.fused_projections and high.fast_norm
    assert high.attention8 and args.pools["lossless"].cuda_graphs and args.pools["lossless"].tp == 4
    assert args.form("high").techniques() >= {"cuda_graphs", "attention8", "fp8", "fused_projections", "fast_norm"}


@pytest.mark.parametrize("raw, message", [
    ({"device": "cpu", "pools": {"lossless": {"cuda_graphs": True}}},
     r"args\.pools\.lossless\.cuda_graphs needs device: cuda .*'cpu'"),
    ({"pools": {"high": {"cuda_graphs": True}}}, r"args\.pools\.high\.cuda_graphs needs device: cuda"),
    ({"device": "cuda", "pools": {"high": {"cuda_graphs": "yes"}}}, "cuda_graphs must be true or false"),
    ({"device": "cuda", "pools": {"high": {"cuda_graphs": True, "compile": True}}},
     "compile and cuda_graphs exclude each other: a compiled batch never replays graphs"),
])
def test_bad_cuda_graphs_options_are_config_errors(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AppArgs.parse(raw)


# In a subprocess: importing Ray in this process would fix its auth mode before tests/test_serve.py sets it.
_REPLICA_SCRIPT = """
import model.loading
from deployments.replica import FluxReplica

class Pipe:
    form = None
    def __init__(self):
        self.graphs = []
        self.events = []
    def use(self, **defaults):
        pass
    def enable_cuda_graphs(self, max_graphs=8):
        self.graphs.append(max_graphs)
        self.events.append("graphs")
    def warm_up(self, sizes, batch_sizes, quality, steps, agree=None):
        self.events.append(("warm", quality))

pipes = []
model.loading.load_pipeline = lambda *a, **k: pipes.append(Pipe()) or pipes[-1]
cls = FluxReplica.func_or_class
for pool, on in (("lossless", True), ("high", False)):
    form = {"fp8": False, "fused_projections": False} if pool == "high" else {}  # (tests/test_fp8.py)
    raw = {"device": "cuda", "pools": {pool: {"cuda_graphs": on, "cpu_threads": 1, **form}}}
    cls(pool, raw)
assert [p.graphs for p in pipes] == [[8], []], [p.graphs for p in pipes]
# the warm-up runs with graphs on, so that it captures them before the replica takes traffic
assert [p.events for p in pipes] == [["graphs", ("warm", "lossless")], [("warm", "high")]], [p.events for p in pipes]
print("graphs wiring ok")
"""


def test_replica_enables_cuda_graphs_when_its_pool_asks() -> None:
    done = subprocess.run([sys.executable, "-c", _REPLICA_SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0 and "graphs wiring ok" in done.stdout, done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_model() -> FluxTransformer:
    return _model("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
def test_gpu_replay_equals_eager_and_copies_new_inputs(gpu_model: FluxTransformer, batch: int) -> None:
    m = gpu_model
    sg = _attach(m, StepGraphs())
    try:
        first_in, second_in = _inputs(batch, 10 + batch, "cuda", torch.bfloat16), _inputs(batch, 20, "cuda",
                                                                                          torch.bfloat16)
        first_ref, second_ref = _eager(m, first_in), _eager(m, second_in)
        assert not torch.equal(first_ref, second_ref)
        first = _graphed(m, first_in)
        assert (sg.captures, sg.replays, sg.eager_fallbacks) == (1, 1, 0), sg.stats()
        second = _graphed(m, second_in)
        assert (sg.captures, sg.replays) == (1, 2)
        assert torch.equal(first, first_ref)
        assert torch.equal(second, second_ref)  # inputs are copied in, not captured by value
        assert torch.equal(first, first_ref)  # the first output is a clone the replay did not overwrite
        with running(m, step_graphs=sg), torch.no_grad():
            as_dict = m(**{**first_in, "return_dict": True})
        assert torch.equal(as_dict.sample, first_ref) and sg.captures == 2  # return_dict: its own graph
    finally:
        _detach(m)


@pytest.mark.gpu
def test_gpu_mounted_high_replays_its_eager_kernels_decided_before_capture(gpu_model: FluxTransformer,
                                                                          monkeypatch) -> None:
    m = gpu_model
    decided_while_capturing: list[bool] = []
    real = G._decide_by_timing

    def spy(*args: Any) -> Any:
        decided_while_capturing.append(torch.cuda.is_current_stream_capturing())
        return real(*args)

    monkeypatch.setattr(G, "_decide_by_timing", spy)
    monkeypatch.setattr(G, "_gelu_choice", {})
    monkeypatch.setattr(G, "_gelu_timings", {})
    report = kernels.mount(m)
    assert report.ok and kernels.mounted_sites(m), report.refused
    sg = _attach(m, StepGraphs())
    sg.mode = ("high", len(kernels.mounted_sites(m)))
    try:
        inputs = _inputs(2, 5, "cuda", torch.bfloat16)
        got = _graphed(m, inputs)
        assert decided_while_capturing and not any(decided_while_capturing)
        expected = _eager(m, inputs)  # mounted eager, with the decisions the capture used
        assert torch.equal(got, expected)
        assert sg.captures == 1 and sg.replays == 1
    finally:
        kernels.unmount(m)
        _detach(m)


@pytest.mark.gpu
def test_gpu_lru_eviction_frees_and_recaptures(gpu_model: FluxTransformer) -> None:
    m = gpu_model
    sg = _attach(m, StepGraphs(max_graphs=1))
    try:
        for batch, seed in ((1, 1), (2, 2), (1, 3)):
            inputs = _inputs(batch, seed, "cuda", torch.bfloat16)
            assert torch.equal(_graphed(m, inputs), _eager(m, inputs))
        assert (sg.captures, sg.evictions, sg.stats()["graphs"]) == (3, 2, 1)
    finally:
        _detach(m)


@pytest.mark.gpu
def test_gpu_flux_dev_width_replay_equals_eager() -> None:
    """FLUX.1-dev width (3072, 24 x 128 heads, the production SDPA backend and kernel shapes) at 1 + 1 blocks,
    1024^2 (4096 image + 512 text tokens), bf16."""
    m = random_flux(device="cuda", num_layers=1, num_single_layers=1, guidance_embeds=True)
    ys, xs = torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij")
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 4096, 64, device="cuda", generator=g).to(torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 512, 4096, device="cuda", generator=g).to(torch.bfloat16),
        pooled_projections=torch.randn(1, 768, device="cuda", generator=g).to(torch.bfloat16),
        timestep=torch.full((1,), 0.7, device="cuda", dtype=torch.bfloat16),
        guidance=torch.full((1,), 3.5, device="cuda", dtype=torch.float32),
        txt_ids=torch.zeros(512, 3, device="cuda"),
        img_ids=torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(-1, 3).float().cuda(),
        return_dict=False,
    )
    expected = _eager(m, inputs)
    sg = _attach(m, StepGraphs())
    assert torch.equal(_graphed(m, inputs), expected)
    inputs["timestep"] = torch.full((1,), 0.3, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(_graphed(m, inputs), _eager(m, inputs))
    assert (sg.captures, sg.replays, sg.eager_fallbacks) == (1, 2, 0), sg.stats()


@pytest.fixture(scope="module")
def gpu_pipe(tiny_path: Path):
    return load_pipeline(str(tiny_path), device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_pipeline_graphs_give_the_same_latents_and_pngs(gpu_pipe) -> None:
    sg = gpu_pipe.enable_cuda_graphs()
    try:
        for quality in ("lossless", "high", "lossless"):
            for batch in ([_req(3, quality, 4)], [_req(3, quality, 4), _req(4, quality, 4)]):
                replays = sg.replays
                eager = gpu_pipe.generate(batch, cuda_graphs=False)
                graphed = gpu_pipe.generate(batch, cuda_graphs=True)
                assert sg.replays - replays == 4, sg.stats()  # every step replayed
                for e, g in zip(eager, graphed):
                    assert e.ran.gelu_sites == g.ran.gelu_sites and (quality == "lossless") == (g.ran.gelu_sites == 0)
                    assert torch.equal(e.latents, g.latents), (quality, len(batch))
                    assert e.png == g.png
        # (lossless, high) x (B=1, B=2); the second lossless round replays the first round's graphs
        assert sg.captures == 4 and sg.eager_fallbacks == 0, sg.stats()
    finally:
        gpu_pipe.disable_cuda_graphs()


@pytest.mark.gpu
def test_gpu_step_cache_replays_the_blocks_after_the_first_and_equals_eager(gpu_pipe) -> None:
    """A step-cache batch on a graphed pool: the first block eager (its residual decides on the host), the others
    replayed from one graph per signature: the same skips, latents and PNG as the eager cached batch."""
    sg = gpu_pipe.enable_cuda_graphs()
    try:
        batch = [GenerationRequest("a red fox", height=64, width=64, steps=6, seed=3, quality="high",
                                   step_cache=0.9)]  # random tiny weights: a loose threshold so that steps skip
        eager = gpu_pipe.generate(batch, cuda_graphs=False)[0]
        captures, replays = sg.captures, sg.replays
        graphed = gpu_pipe.generate(batch, cuda_graphs=True)[0]
        skipped = graphed.timings["cached_steps"]
        assert 1 <= skipped <= 5 and skipped == eager.timings["cached_steps"]
        assert sg.captures - captures == 1 and sg.replays - replays == 6 - skipped, sg.stats()
        assert torch.equal(eager.latents, graphed.latents) and eager.png == graphed.png
        again = gpu_pipe.generate(batch, cuda_graphs=True)[0]  # replays the graph captured above
        assert sg.captures - captures == 1 and torch.equal(again.latents, eager.latents)
    finally:
        gpu_pipe.disable_cuda_graphs()


# Last: a real CUDA error inside a capture (not just a Python exception) must leave the process usable.
@pytest.mark.gpu
def test_gpu_illegal_sync_inside_capture_falls_back_and_later_captures_work(gpu_model: FluxTransformer,
                                                                            monkeypatch, caplog) -> None:
    m = gpu_model
    real = type(m.norm_out).forward

    def syncing(self: Any, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            x.sum().item()  # a device sync: illegal while capturing
        return real(self, x, emb)

    monkeypatch.setattr(type(m.norm_out), "forward", syncing)
    sg = _attach(m, StepGraphs())
    try:
        inputs = _inputs(3, 1, "cuda", torch.bfloat16)
        with caplog.at_level(logging.WARNING, logger=graphs_mod.__name__):
            assert torch.equal(_graphed(m, inputs), _eager(m, inputs))
            assert torch.equal(_graphed(m, inputs), _eager(m, inputs))
        assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
        assert (sg.capture_failures, sg.captures) == (1, 0)
        other = _inputs(1, 2, "cuda", torch.bfloat16)
        assert torch.equal(_graphed(m, other), _eager(m, other))
        assert (sg.captures, sg.replays) == (1, 1), sg.stats()
    finally:
        _detach(m)


def test_a_peft_batch_is_keyed_by_its_adapter_set_and_scales(tiny_path: Path, tmp_path: Path) -> None:
    """PEFT adapters (the lossless pool's) may be captured once the mode names the active set with its scales: each
    set and scale is its own graph, and adding or removing an adapter drops every graph (their tensors moved). Would
    catch a graph of one set replayed for another (the mode without the adapters) or PEFT still refused."""
    pytest.importorskip("peft")
    from tests._inputs import write_random_lora

    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    ink = write_random_lora(pipe.transformer, tmp_path / "ink.safetensors", 1)
    fog = write_random_lora(pipe.transformer, tmp_path / "fog.safetensors", 2)
    pipe.load_loras({"ink": str(ink)})
    sg = pipe.enable_cuda_graphs()
    spy = _StepSpy(pipe.transformer)
    try:
        for loras in ((("ink", 1.0),), (("ink", 0.5),), ()):
            spy.seen.clear()
            pipe.generate([GenerationRequest("a red fox", height=64, width=64, steps=2, seed=1, loras=loras)])
            assert spy.seen == [("lossless", 0, 0, 0, loras)] * 2
    finally:
        spy.close()
    with torch.no_grad():
        assert sg.adapters_keyed and sg.eager_reason(pipe.transformer, {"x": torch.zeros(1)}) == "cpu"  # not "peft"
        sg.adapters_keyed = False
        assert sg.eager_reason(pipe.transformer, {"x": torch.zeros(1)}) == "peft"
    resets = []
    sg.reset = lambda: resets.append(1)
    pipe.add_lora("fog", str(fog))
    pipe.remove_lora("fog")
    assert len(resets) == 2
