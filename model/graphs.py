"""CUDA-graph replay of the transformer step: one captured `FluxTransformer` forward per input signature.

Why: a FLUX.1 step launches ~1500 kernels, and where the host cannot launch them as fast as the GPU runs them, a
replayed graph (all launched at once) closes the gaps. At 1024^2, batch 1 the gaps mostly overlap GPU work, so the
gain there is small (bench/results/e2e-h200.md). It is bit-identical to the
eager forward by construction: the same kernels with the same launch configurations read static input buffers that
have the caller's exact layout (shape, strides, dtype, 16-byte alignment class), so every Python-side choice the
forward made while it was captured (ExactGate verdicts, GELU per-shape dispatch, Triton specialisations) is the one
eager would make for the caller's tensors.

Tensor parallelism: a sharded transformer's collectives are captured with the kernels where the group's backend
allows it (NCCL: the whole step is one graph); otherwise (gloo, the shared-GPU test mode) each collective ends a
graph segment and runs eagerly between two replayed segments, on the same buffers (`model.linear`'s
`collectives_between_graphs`). Every rank captures and replays the same segments, so the collectives still meet.

Keying: shapes/strides/dtypes/device of every tensor argument, which optional arguments are None, the plain
arguments (`return_dict`, ...), the model's TP rank and world size, a caller-provided `mode` (the pipeline passes the quality tier and the numbers of
mounted GELU sites and fast-norm sites: a mounted transformer runs other kernels), and global switches read at run time (kernel fast
paths, SDPA backends, matmul precision, determinism). Per key, the first call runs the eager forward twice (where the
ExactGate verdicts and the GELU timing decisions are taken, and cuBLAS/Triton/cuDNN set themselves up), captures a
third run into a graph, then replays it; later calls copy their inputs into the static buffers and replay.

What a graph cannot see, and so needs `reset()`: weights replaced rather than updated in place (`.to()`, sharding,
loading a LoRA), or `kernels.gelu.clear_gelu_dispatch_cache()`.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from typing import Any, Callable, Hashable

import torch
from torch.utils._pytree import tree_map_only

from kernels import switches
from model.linear import collectives_between_graphs, parallel_of

logger = logging.getLogger(__name__)

EagerForward = Callable[..., Any]
_CONTROLNET_ARGS = ("controlnet_block_samples", "controlnet_single_block_samples")
_PLAIN = (bool, int, float, str)  # non-tensor arguments baked into a graph, so keyed by value
_ALIGN = 16  # bytes: Triton specialises pointers on divisibility by 16; cuBLAS picks kernels by alignment too


def _compact(t: torch.Tensor) -> torch.Tensor:
    """`t` with each broadcast dimension (stride 0, size > 1) narrowed to one element: the memory it really reads."""
    for d in range(t.dim()):
        if t.stride(d) == 0 and t.size(d) > 1:
            t = t.narrow(d, 0, 1)
    return t


def _non_overlapping(t: torch.Tensor) -> bool:
    """Sufficient test that no two elements share memory (so a buffer with these strides can be written)."""
    dims = sorted((t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            return False
        span = stride * size
    return True


def _layout_reason(t: torch.Tensor) -> str | None:
    """Why a static buffer cannot reproduce `t`'s layout exactly, or None."""
    if not _non_overlapping(_compact(t)):
        return "layout"
    if t.data_ptr() % _ALIGN:
        return "unaligned"
    return None


def _describe(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device)
    if value is None or value == {}:  # FluxPipeline passes joint_attention_kwargs={} by default
        return None
    return (type(value).__name__, value)


def _kernel_state() -> tuple:
    """What changes which kernels the forward launches (a graph keeps the ones it was captured with): every switch
    of `kernels.switches`, and torch's math and attention backend flags. Reading them costs a few microseconds."""
    cuda = torch.backends.cuda
    return (
        switches.signature(),
        torch.get_float32_matmul_precision(), cuda.matmul.allow_bf16_reduced_precision_reduction,
        cuda.matmul.allow_fp16_reduced_precision_reduction, torch.backends.cudnn.allow_tf32,
        cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(), cuda.cudnn_sdp_enabled(),
        torch.are_deterministic_algorithms_enabled(), torch.is_inference_mode_enabled(),
    )


class _StaticInput:
    """A persistent buffer with one caller tensor's exact sizes and strides (broadcast dims stay stride 0)."""

    def __init__(self, like: torch.Tensor) -> None:
        compact = _compact(like)
        self.base = torch.empty_strided(compact.size(), compact.stride(), dtype=like.dtype, device=like.device)
        self.view = self.base.expand(like.size())
        assert self.view.stride() == like.stride(), (self.view.stride(), like.stride())

    def fill(self, value: torch.Tensor) -> None:
        self.base.copy_(_compact(value))


Segment = tuple[torch.cuda.CUDAGraph, Callable[[], object] | None]


class _CapturedStep:
    """One captured forward: its static inputs, its graph segments (each followed by the collective that ended it,
    if any; one segment when nothing split it) and the static output."""

    def __init__(self, segments: list[Segment], device: torch.device, inputs: dict[str, _StaticInput],
                 output: Any) -> None:
        self.segments = segments
        self.device = device
        self.inputs = inputs
        self.output = output

    def replay(self, kwargs: dict[str, Any]) -> Any:
        with torch.cuda.device(self.device):
            for name, static in self.inputs.items():
                static.fill(kwargs[name])  # on the caller's stream, like the replay
            for graph, collective in self.segments:
                graph.replay()
                if collective is not None:
                    collective()
        # A clone: the next replay overwrites the static output, and diffusers may still hold this one (true CFG
        # runs the transformer twice per step).
        return tree_map_only(torch.Tensor, torch.Tensor.clone, self.output)

    def release(self) -> None:
        for graph, _ in self.segments:
            graph.reset()
        self.segments = []
        self.inputs.clear()
        self.output = None


class StepGraphs:
    """CUDA graphs of one transformer's forward, an LRU of at most `max_graphs` signatures sharing one memory pool.

    Pass to `model.execution.running(transformer, step_graphs=...)`; the forward then calls
    `self(module, module._forward_eager, kwargs)`.
    Falls back to the eager forward (never capturing) for CPU tensors, autograd, torch.compile tracing, a capture
    already in progress, a diffusers cache, LoRA/PEFT layers, `joint_attention_kwargs`,
    ControlNet inputs, layouts a static buffer cannot reproduce, and signatures whose capture failed once.
    Counters: `captures`, `replays`, `eager_fallbacks` (with `fallback_reasons`), `evictions`, `capture_failures`.
    """

    def __init__(self, max_graphs: int = 8, warmup_runs: int = 2) -> None:
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be an integer >= 1, got {max_graphs!r}")
        if warmup_runs < 1:
            raise ValueError(f"warmup_runs must be >= 1 (decisions must never be taken during capture), got "
                             f"{warmup_runs!r}")
        self.max_graphs = max_graphs
        self.warmup_runs = warmup_runs
        # Part of every key: what the caller knows changes kernels (e.g. (quality, mounted GELU sites)).
        self.mode: Hashable = None
        # The caller's mode names the active adapters (PEFT's set and scales): a PEFT model may then be captured.
        self.adapters_keyed = False
        self.captures = 0
        self.replays = 0
        self.eager_fallbacks = 0
        self.evictions = 0
        self.capture_failures = 0
        self.fallback_reasons: Counter[str] = Counter()
        self._graphs: OrderedDict[tuple, _CapturedStep] = OrderedDict()
        self._eager_keys: set[tuple] = set()  # signatures whose capture failed: eager for good
        self._pool: Any = None  # one pool for all graphs: replays are serialised, so their temporaries can overlap
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._parallel: dict[int, tuple[int, int]] = {}  # id(transformer) -> (TP rank, world size)
        self._lock = threading.Lock()

    def stats(self) -> dict[str, Any]:
        return {"graphs": len(self._graphs), "max_graphs": self.max_graphs, "captures": self.captures,
                "replays": self.replays, "eager_fallbacks": self.eager_fallbacks, "evictions": self.evictions,
                "capture_failures": self.capture_failures, "fallback_reasons": dict(self.fallback_reasons),
                "segments": sum(len(step.segments) for step in self._graphs.values())}

    def reset(self) -> None:
        """Drop every graph (and the eager-only marks): needed after weights are replaced, not updated in place."""
        with self._lock:
            for step in self._graphs.values():
                step.release()
            self._graphs.clear()
            self._eager_keys.clear()
            self._pool = None
            self._streams.clear()
            self._parallel.clear()

    # -- policy ------------------------------------------------------------------------------------------------

    def eager_reason(self, module: torch.nn.Module, kwargs: dict[str, Any]) -> str | None:
        """Why this call must run eagerly (a short reason), or None if it may replay a graph."""
        if torch.compiler.is_compiling():
            return "compiling"
        if torch.is_grad_enabled():
            return "grad"
        if module.training:
            return "training"
        if torch.is_autocast_enabled("cuda"):
            return "autocast"  # not keyed (FluxPipeline never autocasts): run it as it comes
        if getattr(module, "is_cache_enabled", False):
            return "cache"  # diffusers' step caches decide per call from values
        if getattr(module, "_hf_peft_config_loaded", False) and not self.adapters_keyed:
            return "peft"  # the active adapters and their scales are Python state set per batch: keyed by the mode
        if kwargs.get("joint_attention_kwargs"):
            return "joint_attention_kwargs"
        if any(kwargs.get(name) is not None for name in _CONTROLNET_ARGS):
            return "controlnet"
        devices = set()
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                devices.add(value.device)
            elif value is not None and value != {} and not isinstance(value, _PLAIN):
                return "argument"  # baked into a graph, so it would have to be keyed by value
        if not devices or any(d.type != "cuda" for d in devices):
            return "cpu"
        if len(devices) > 1:
            return "devices"
        if torch.cuda.is_current_stream_capturing():
            return "capturing"  # someone else's capture: run inside it
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                reason = _layout_reason(value)
                if reason is not None:
                    return reason
        return None

    def key(self, kwargs: dict[str, Any], module: torch.nn.Module | None = None) -> tuple:
        """The graph key of a call (no device check: see `eager_reason`)."""
        parallel = (0, 1) if module is None else self._parallel.get(id(module))
        if parallel is None:  # looked up once per transformer: sharding replaces weights, which needs reset() anyway
            parallel = self._parallel[id(module)] = parallel_of(module)
        return (self.mode, parallel, _kernel_state(),
                tuple((name, _describe(kwargs[name])) for name in sorted(kwargs)))

    # -- running -----------------------------------------------------------------------------------------------

    def __call__(self, module: torch.nn.Module, eager: EagerForward, kwargs: dict[str, Any]) -> Any:
        """`eager(**kwargs)`, from a replayed graph where possible."""
        reason = self.eager_reason(module, kwargs)
        if reason is not None:
            return self._eager(eager, kwargs, reason)
        key = self.key(kwargs, module)
        with self._lock:
            if key in self._eager_keys:
                return self._eager(eager, kwargs, "capture_failed")
            step = self._graphs.get(key)
            if step is None:
                step = self._capture_for(key, eager, kwargs)
                if step is None:
                    return self._eager(eager, kwargs, "capture_failed")
            else:
                self._graphs.move_to_end(key)
            out = step.replay(kwargs)
            self.replays += 1
            return out

    def _eager(self, eager: EagerForward, kwargs: dict[str, Any], reason: str) -> Any:
        self.eager_fallbacks += 1
        self.fallback_reasons[reason] += 1
        return eager(**kwargs)

    def _capture_for(self, key: tuple, eager: EagerForward, kwargs: dict[str, Any]) -> _CapturedStep | None:
        while len(self._graphs) >= self.max_graphs:  # evict first, so the new capture can reuse the memory
            _, old = self._graphs.popitem(last=False)
            old.release()
            self.evictions += 1
        try:
            step = self._capture(eager, kwargs)
        except _WarmupError as exc:
            raise exc.__cause__ from None  # the eager forward itself fails: not a graph problem, let it raise
        except Exception as exc:  # noqa: BLE001 - any capture failure degrades this signature to eager
            self.capture_failures += 1
            self._eager_keys.add(key)
            # A failed capture can leave its stream registered with the pool: use fresh ones for later captures.
            self._pool = None
            self._streams.clear()
            logger.warning("CUDA graph capture failed (%s: %s); this input signature runs eager from now on: %s",
                           type(exc).__name__, exc, _short_key(key))
            return None
        self._graphs[key] = step
        self.captures += 1
        return step

    def _capture(self, eager: EagerForward, kwargs: dict[str, Any]) -> _CapturedStep:
        """Capture: hook point of the graph mechanics (warm-up, capture on a side stream)."""
        device = next(v.device for v in kwargs.values() if isinstance(v, torch.Tensor))
        with torch.cuda.device(device):
            inputs = {name: _StaticInput(v) for name, v in kwargs.items() if isinstance(v, torch.Tensor)}
            for name, static in inputs.items():
                static.fill(kwargs[name])
            static_kwargs = {**kwargs, **{name: static.view for name, static in inputs.items()}}
            caller = torch.cuda.current_stream()
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            stream.wait_stream(caller)
            # Outer stream context: restores the caller's stream even if the capture's own exit raises.
            with torch.cuda.stream(stream):
                try:
                    # Warm-up on the capture stream (its cuBLAS workspace, Triton compilation, the ExactGate
                    # verdicts and GELU timing decisions): nothing may be decided, timed or synced while capturing.
                    for _ in range(self.warmup_runs):
                        eager(**static_kwargs)
                except Exception as exc:
                    raise _WarmupError() from exc
                segments, output = _capture_segments(lambda: eager(**static_kwargs), self._pool, stream)
            caller.wait_stream(stream)
        return _CapturedStep(segments, device, inputs, output)


def _capture_segments(run: Callable[[], Any], pool: Any, stream: torch.cuda.Stream) -> tuple[list[Segment], Any]:
    """`run()` captured on `stream` into graphs sharing `pool`: one graph, or one per stretch between collectives
    that cannot be captured (each kept to run after its segment). Replayed in capture order, a segment finds the
    buffers of the ones before it where they were, since they all allocate from one pool. Each segment is captured
    by `torch.cuda.graph` itself (its synchronisation and allocator housekeeping before each capture)."""
    segments: list[Segment] = []
    current: list = []  # [graph, its open torch.cuda.graph context]

    def begin() -> None:
        graph = torch.cuda.CUDAGraph()
        context = torch.cuda.graph(graph, pool=pool, stream=stream)
        context.__enter__()
        current[:] = [graph, context]

    def split(collective: Callable[[], object]) -> None:
        graph, context = current
        context.__exit__(None, None, None)
        segments.append((graph, collective))
        begin()

    begin()
    try:
        with collectives_between_graphs(split):
            output = run()
    except BaseException as exc:
        current[1].__exit__(type(exc), exc, exc.__traceback__)  # the stream must leave capture mode
        raise
    current[1].__exit__(None, None, None)
    segments.append((current[0], None))
    return segments, output


class _WarmupError(Exception):
    """The eager warm-up raised (its cause): the caller's error, not a capture failure."""


def _short_key(key: tuple) -> str:
    mode, (rank, world), _, args = key
    shapes = {name: desc[1] for name, desc in args if isinstance(desc, tuple) and desc[0] == "tensor"}
    return f"mode={mode!r} shapes={shapes}" + (f" rank {rank}/{world}" if world > 1 else "")
