"""FluxServePipeline: diffusers' FluxPipeline driven with our transformer, one uniform batch at a time.

We do not re-implement the pipeline: text encoding, latent preparation, the scheduler loop and VAE decoding are
diffusers' own. What this adds: per-request seeds (one torch.Generator per request, so a request's image does not
depend on its batch mates), the quality tiers (GELU sites mounted only for a "high" batch, always unmounted after),
cooperative cancellation between steps, and deterministic PNG bytes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from model import faults, peft_tail, prompt_cache, vae
from model.family import family_of
from model.features import HIGH_DEFAULTS, feature
from model.form import BATCH_DEFAULTS, ServingForm
from model.preview import PreviewSink, previewer_of
from model.png import result_png
from model.request import GenerationRequest, Quality, decode_image, decode_mask, validate_batch
from model.tiers import Ran, TierPlan, applied_tier, plan_tier

if TYPE_CHECKING:  # torch is imported lazily: the ingress imports the request types without needing torch
    import torch

    from model.graphs import StepGraphs

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    png: bytes | None  # None until `encode_pngs` (a batch generated with encode=False): then `image` holds it
    latents: torch.Tensor  # final latents of this request, unpacked [16, H/8, W/8], on the CPU
    seed: int
    quality: Quality
    ran: Ran = Ran()  # what the batch ran with (sites per kernel kind, the transformer's form, graphs, adapters)
    timings: dict[str, float] = field(default_factory=dict)
    image: Any = field(default=None, repr=False)  # the decoded PIL image while its PNG is not encoded yet


def encode_pngs(results: list[GenerationResult]) -> list[GenerationResult]:
    """Encode the PNGs a batch left pending (generate(encode=False)): a replica does it after letting go of its
    pipeline, so the next batch denoises meanwhile. The bytes are what generate() would have made."""
    for r in results:
        if r.png is None:
            r.png, r.image = result_png(r.image, r.quality), None
    return results


class GenerationCancelled(RuntimeError):
    """`should_stop()` returned True between two denoising steps."""


def md5(data: bytes | torch.Tensor) -> str:
    """md5 of bytes, or of a tensor's raw CPU bytes (dtype and shape are not hashed)."""
    if not isinstance(data, (bytes, bytearray)):  # a tensor
        import torch

        t = data.detach().cpu().contiguous()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.md5(data).hexdigest()


def max_sequence_length(pipe: Any) -> int:
    """Text-encoder tokens per prompt for this pipeline's model, as its family runs it."""
    return family_of(pipe).text_tokens(pipe)


def request_generators(requests: list[GenerationRequest]) -> list["torch.Generator"]:
    """One CPU generator per request. CPU: the initial noise of a seed is the same on every device (diffusers draws
    on the CPU for a CPU generator, then moves it); one per request: a request's noise never depends on its batch."""
    import torch

    return [torch.Generator("cpu").manual_seed(r.seed) for r in requests]


def _sync(device: "torch.device") -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def edit_pipeline(pipe: Any, inpaint: bool) -> Any:
    """The family's image-to-image / inpainting diffusers pipeline sharing `pipe`'s components (built once per
    pipe); for a family whose edits take the image as a reference (Kontext), `pipe` itself."""
    family = family_of(pipe)
    if family.edits == "reference":
        return pipe
    cls = family.pipeline_classes()["inpaint" if inpaint else "img2img"]
    cache = pipe.__dict__.setdefault("_fluxserve_edit_pipelines", {})
    if cls not in cache:
        cache[cls] = cls(**pipe.components)
        prompts = prompt_cache.cache_of(pipe)
        if prompts is not None:  # the edit pipelines share the base's prompt cache (keyed by class too)
            prompts.install(cache[cls])
    return cache[cls]


def run_flux_pipeline(pipe: Any, requests: list[GenerationRequest], progress: bool = False,
                      should_stop: Callable[[], bool] | None = None,
                      previews: PreviewSink | None = None, encode: bool = True,
                      embeds: tuple[Any, Any] | None = None) -> tuple[list[torch.Tensor], list[Any]]:
    """Run any diffusers FluxPipeline (ours or the stock reference) on one uniform batch.

    Returns (unpacked final latents per request on the CPU, PNG bytes per request; encode=False: the PIL images).
    The same call is used for our pipeline and for the reference, so the two can only differ through their
    transformers. `previews`: partial images after the steps it names (model/preview.py); they only read the latents.
    `embeds`: the batch's prompts already encoded (prompt, pooled), in place of encoding them here.
    """
    import torch

    validate_batch(requests, mixed_adapters=True)  # (the caller switches adapters on: FluxServePipeline checks them)
    first = requests[0]
    steps = first.denoising_steps
    if should_stop is not None and should_stop():
        raise GenerationCancelled("cancelled before the first step")
    final: dict[str, torch.Tensor] = {}

    prompts = [r.prompt for r in requests]

    previewer = previewer_of(pipe) if previews is not None and previews.steps else None

    def on_step_end(_pipe: Any, i: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        previous = final.get("latents")
        final["latents"] = kwargs["latents"]  # packed [B, tokens, 64]; no device sync here
        if previewer is not None and i in previews.steps:
            # the scheduler has stepped: its sigmas[step_index] is the sigma these latents are at
            sigmas, j = _pipe.scheduler.sigmas, _pipe.scheduler.step_index
            pngs = previewer.pngs(kwargs["latents"], previous, float(sigmas[j - 1]), float(sigmas[j]),
                                  first.height, first.width)
            previews.emit(previews.steps.index(i), i, pngs)
        faults.after_step(prompts, i)
        if should_stop is not None and i + 1 < steps and should_stop():
            raise GenerationCancelled(f"cancelled after step {i + 1} of {steps}")
        return {}

    generators = request_generators(requests)
    family = family_of(pipe)
    edit: dict[str, Any] = family.size_kwargs(first.height, first.width)
    if first.image is not None:
        error = family.edit_error(first.mask is not None, first.strength)
        if error is not None:
            raise ValueError(error)
        # diffusers' own edit pipeline over the same components (no weight is copied)
        edit["image"] = [decode_image(first.image, "image")] * len(requests)
        if family.edits == "strength":
            edit["strength"] = float(first.strength)
            if first.mask is not None:
                edit["mask_image"] = [decode_mask(first.mask)] * len(requests)
        pipe = edit_pipeline(pipe, inpaint=first.mask is not None)
    pipe.set_progress_bar_config(disable=not progress, desc=f"{first.quality} {first.width}x{first.height}")
    images = pipe(
        **edit,
        **(dict(prompt=prompts) if embeds is None else dict(prompt_embeds=embeds[0], pooled_prompt_embeds=embeds[1])),
        height=first.height,
        width=first.width,
        num_inference_steps=first.steps,
        guidance_scale=first.guidance,
        generator=generators,
        output_type="pil",
        callback_on_step_end=on_step_end,
        callback_on_step_end_tensor_inputs=["latents"],
        max_sequence_length=max_sequence_length(pipe),
    ).images
    latents = pipe._unpack_latents(final["latents"], first.height, first.width, pipe.vae_scale_factor)
    latents = latents.cpu()
    pngs = [result_png(im, first.quality) if encode else im for im in images]
    return [latents[i].clone() for i in range(len(requests))], pngs


def _warm_batches(sizes: list[tuple[int, int]], batch_sizes: list[int] | tuple[int, ...], steps: int,
                  quality: str) -> Iterator[list[GenerationRequest]]:
    """One `quality` batch of `steps` steps per (height, width) and batch size, as a warm-up runs them."""
    for height, width in sizes:
        for b in batch_sizes:
            yield [GenerationRequest("warm-up", height=int(height), width=int(width), steps=steps, seed=i,
                                     quality=quality) for i in range(int(b))]


class FluxServePipeline:
    """One FLUX.1 pipeline (our transformer inside diffusers' FluxPipeline) serving uniform batches."""

    def __init__(self, pipe: Any, source: str | None = None, folder: str | Path | None = None) -> None:
        self.pipe = pipe
        # repeated prompts skip the text encoders (exact: model/prompt_cache.py); the stock reference has none
        self.prompt_cache = prompt_cache.PromptCache()
        self.prompt_cache.install(pipe)
        self.source = source
        self.folder = Path(folder) if folder is not None else None
        # What this pipeline serves with (model.form.ServingForm): one frozen value, replaced by the builder's
        # steps below (`use`, `load_loras`, `fuse_lora`, `convert_for_high`, `enable_compile`, `enable_cuda_graphs`).
        self.form = ServingForm(model=str(source or folder or ""), device=str(self.device),
                                dtype=str(self.dtype).removeprefix("torch."))
        self.last_mount_report: Any = None
        # (double, single) compiled block runners for "high" batches; None until enable_compile().
        self._compiled_runners: tuple[Any, Any] | None = None
        self.compile_warmup_s: float | None = None
        # CUDA graphs of the transformer step; None until enable_cuda_graphs().
        self._step_graphs: StepGraphs | None = None
        self.warmup: tuple[dict[str, Any], ...] = ()  # what warm_up ran: size, batch, quality, seconds
        self._shapes_seen: set[tuple] = set()  # (width, height, batch, quality, streamed) of every batch run
        self._warming = False
        self.fp8_layers = 0  # fp8 linear layers the conversion made (reported in each result's `ran`)
        # Adapters served beside converted layers (enable_adapter_slots); None: adapters go through PEFT.
        self._slots: Any = None
        # generate() mounts/unmounts sites on the shared transformer: never let two batches interleave.
        self._lock = threading.Lock()

    @property
    def fp8(self) -> bool:
        return self.form.fp8

    @property
    def fused_projections(self) -> bool:
        return self.form.fused_projections

    @property
    def loras(self) -> dict[str, str]:
        """The adapters loaded once (`load_loras`): name -> file; a batch activates the ones its requests name."""
        return dict(self.form.loras)

    @property
    def fused_lora(self) -> tuple[str, float] | None:
        """(name, scale) of the adapter `fuse_lora` merged into the weights, or None."""
        return self.form.fused_lora

    def use(self, **defaults: Any) -> ServingForm:
        """Set what high batches switch on by default: the form's per-batch pool techniques of the feature table
        (`fast_norm=True`, `attention8=True`, `step_cache=0.1`; a request may still set its own step cache).
        Returns the new form."""
        unknown = set(defaults) - BATCH_DEFAULTS
        if unknown:
            raise ValueError(f"use(): {sorted(unknown)} are not per-batch techniques; those are {sorted(BATCH_DEFAULTS)}")
        self.form = replace(self.form, **defaults)
        return self.form

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def device(self) -> torch.device:
        return self.pipe.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pipe.transformer.dtype

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.pipe.transformer.config.guidance_embeds)

    @property
    def compile_enabled(self) -> bool:
        return self._compiled_runners is not None

    @property
    def block_runners(self) -> tuple[Any, Any] | None:
        """The (double, single) compiled block runners `enable_compile` made, or None."""
        return self._compiled_runners

    @property
    def cuda_graphs_enabled(self) -> bool:
        return self._step_graphs is not None

    @property
    def step_graphs(self) -> StepGraphs | None:
        """The CUDA-graph cache (its counters: captures, replays, eager_fallbacks), or None."""
        return self._step_graphs

    def enable_cuda_graphs(self, max_graphs: int = 8) -> StepGraphs:
        """Replay each transformer step from a CUDA graph (removes the host launch gaps between its kernels).

        Bit-identical to eager for both tiers (same kernels on the same input layouts), so lossless stays
        byte-identical to diffusers. Graphs are captured on first use, one per (tier and mounted sites, batch size,
        resolution, prompt length), at most `max_graphs` kept (LRU) in one shared memory pool. A compiled high batch
        never replays graphs. Without CUDA every step runs eager (counted in `step_graphs.eager_fallbacks`).
        """
        from model.graphs import StepGraphs

        if self._step_graphs is None:
            self._step_graphs = StepGraphs(max_graphs=max_graphs)
        elif max_graphs != self._step_graphs.max_graphs:
            self._step_graphs.reset()
            self._step_graphs = StepGraphs(max_graphs=max_graphs)
        self.form = replace(self.form, cuda_graphs=True)
        if self.device.type != "cuda":
            logger.warning("CUDA graphs enabled on %s: every step will run eager", self.device)
        return self._step_graphs

    def disable_cuda_graphs(self) -> None:
        """Back to eager steps; frees every captured graph."""
        if self._step_graphs is not None:
            with self._lock:
                self._step_graphs.reset()
                self._step_graphs = None
                self.form = replace(self.form, cuda_graphs=False)

    def enable_compile(self, sizes: list[tuple[int, int]], steps: int = 2,
                       batch_sizes: tuple[int, ...] | list[int] = (1,)) -> float:
        """Run "high" batches through regionally compiled transformer blocks and compile them now.

        One `torch.compile(dynamic=False)` per block type (double, single): every block of a type shares the
        graph, so compile time does not grow with depth. Lossless batches never use it (they must stay
        bit-identical to eager diffusers). Warm-up: for each (height, width) and batch size, one eager high batch
        first (the per-shape GELU dispatch is decided there by timing, never inside a trace), then one compiled
        high batch of `steps` steps; graphs are specialised on shapes, so a request of a warmed size and batch size
        never compiles. Returns the warm-up time in seconds.
        """
        import torch
        import torch._dynamo

        from model.flux import run_double_block, run_single_block

        if not sizes or steps < 1 or not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"enable_compile needs sizes, steps >= 1, batch sizes >= 1; got {sizes}, {steps}, "
                             f"{batch_sizes}")
        # One graph per (size, batch size) and block type: let Dynamo keep them all rather than fall back to eager.
        needed = len(sizes) * len(batch_sizes)
        if torch._dynamo.config.recompile_limit < needed:
            torch._dynamo.config.recompile_limit = needed
        if self._compiled_runners is None:
            self._compiled_runners = (torch.compile(run_double_block, dynamic=False),
                                      torch.compile(run_single_block, dynamic=False))
        self.form = replace(self.form, compile=True, warm_sizes=tuple((int(h), int(w)) for h, w in sizes),
                            warm_batch_sizes=tuple(int(b) for b in batch_sizes))
        t0 = time.perf_counter()
        for batch in _warm_batches(sizes, batch_sizes, steps, "high"):
            self.generate(batch, compiled=False)
            self.generate(batch, compiled=True)
        self.compile_warmup_s = time.perf_counter() - t0
        return self.compile_warmup_s

    def warm_up(self, sizes: list[tuple[int, int]], batch_sizes: list[int], quality: str,
                steps: int, agree: Callable[[bool], bool] | None = None) -> list[dict[str, Any]]:
        """One `quality` batch per (height, width) and batch size, and one streamed request per size, before any
        request: what a shape's first batch does once (Triton compilation and autotuning, the exactness gates'
        checks, the GELU dispatch's timing, cuDNN plans, CUDA-graph capture, the preview path) is done here. Each
        item's time is logged and kept in `warmup`."""
        items = []
        # After the batches, the streamed path once per size (n = 1; a preview needs a step after the first and
        # before the last).
        streamed = [([r], PreviewSink(steps=(1,), emit=lambda *_: None))
                    for (r,) in _warm_batches(sizes, [1], max(steps, 3), quality)]
        plain = [(batch, None) for batch in _warm_batches(sizes, batch_sizes, steps, quality)]
        self._warming = True
        try:
            for batch, previews in plain + streamed:
                t0 = time.perf_counter()
                self.generate(batch, agree=agree, previews=previews)
                items.append({"size": f"{batch[0].width}x{batch[0].height}", "batch": len(batch), "quality": quality,
                              "stream": previews is not None, "s": round(time.perf_counter() - t0, 3)})
                logger.info("warm-up %s x%d %s%s: %.2f s", items[-1]["size"], len(batch), quality,
                            " streamed" if previews else "", items[-1]["s"])
        finally:
            self._warming = False
        self.warmup = (*self.warmup, *items)
        return items

    @property
    def adapter_slots(self) -> Any:
        """The adapters served beside the layers (`model.adapter_slots.AdapterSlots`), or None."""
        return self._slots

    def enable_adapter_slots(self, rank: int, rows: int = 1) -> None:
        """Serve adapters beside the transformer's layers as they are (converted, sharded) instead of through PEFT:
        each image's adapters, up to `rank` in all per projection, composed into fixed buffers before its batch
        (model/adapter_slots.py), for batches of up to `rows` images (more grow them). High batches only (not
        bit-exact); after any conversion. Adapters load with `load_loras` / `add_lora` as before."""
        from model.adapter_slots import AdapterSlots

        if self.loras:
            raise ValueError("enable adapter slots before loading adapters: those loaded went into PEFT layers")
        if self.fused_lora is not None:
            raise ValueError("a fused adapter leaves no per-request adapters to serve")
        with self._lock:
            if self._slots is None:
                self._slots = AdapterSlots(self.transformer, rank, rows)
                self.form = replace(self.form, adapter_slots=int(rank))
                self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Captured steps hold the layers' old tensors (adapter buffers grown, PEFT layers added or freed): capture
        again on the next batch."""
        if self._step_graphs is not None:
            self._step_graphs.reset()
        if self._slots is not None:
            self._slots.graphs_dropped()

    def load_loras(self, loras: dict[str, str]) -> None:
        """Load LoRA files (any format diffusers' FLUX LoRA loader reads) once, each under its name, all inactive:
        a batch switches on the adapters its requests name (no reload). Fused projections / fp8 layers must come
        after (the adapters wrap the plain linears)."""
        if self._slots is not None:
            for name, path in loras.items():
                self.add_lora(name, path)
            return
        if (self.fp8 or self.fused_projections) and loras:
            raise ValueError("load LoRAs before converting for high: the adapters target the unfused bf16 linears, "
                             "or serve them beside the converted layers (enable_adapter_slots)")
        with self._lock:
            for name, path in loras.items():
                if name in self.loras:
                    continue
                self.pipe.load_lora_weights(str(path), adapter_name=name)
                self.form = replace(self.form, loras=(*self.form.loras, (name, str(path))))
            if self.loras:
                self.pipe.disable_lora()
                peft_tail.install(self.transformer)
            self._drop_graphs()

    def add_lora(self, name: str, path: str) -> list[str]:
        """Load one more adapter while serving (the runtime adapter API), inactive until a batch names it: diffusers'
        loader on a skeleton, its layers then moved into the served transformer, sharded or not (model/adapters.py).
        Returns the layers it reaches (a TP rank shards the adapter there). Not on a converted transformer, like
        `load_loras`."""
        from model.adapters import load_adapter, read_adapter, unload_text_part

        if self._slots is None and (self.fp8 or self.fused_projections or self.fused_lora is not None):
            raise ValueError("adapters cannot be added to a converted transformer or one with a fused adapter")
        if name in self.loras:
            raise ValueError(f"adapter {name!r} is loaded already; unload it first")
        with self._lock:
            if self._slots is not None:
                tensors = read_adapter(self.pipe, name, path, self.transformer)
                try:
                    reached = self._slots.add(name, tensors)
                except ValueError:
                    unload_text_part(self.pipe, name)  # (the reading loaded it)
                    raise
                if self._slots.graphs_stale():  # a layer gained buffers
                    self._drop_graphs()
            else:
                reached = load_adapter(self.pipe, name, path)
                self.pipe.disable_lora()
                peft_tail.install(self.transformer)
                self._drop_graphs()
            self.form = replace(self.form, loras=(*self.form.loras, (name, str(path))))
        return reached

    def remove_lora(self, name: str) -> None:
        """Unload an adapter (loaded at start or since), freeing its tensors; batches naming it are then refused."""
        from model.adapters import unload_adapter, unload_text_part

        if name not in self.loras:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.loras)}")
        with self._lock:
            if self._slots is not None:
                self._slots.remove(name)  # (the buffers stay: captured steps stay valid)
                unload_text_part(self.pipe, name)
            else:
                unload_adapter(self.pipe, name)
                self._drop_graphs()
                peft_tail.install(self.transformer)  # regrouped: the removed adapter's stacked A's are freed
            self.form = replace(self.form, loras=tuple(x for x in self.form.loras if x[0] != name))

    def sync_loras(self, wanted: dict[str, str],
                   added: Callable[[str, list[str]], None] | None = None) -> dict[str, list[str]]:
        """Make the loaded adapters exactly `wanted` (name -> file): unload the others and those whose file changed,
        load the missing. `added(name, layers)` after each load into PEFT layers (a TP rank shards the new adapter
        there; adapter slots shard their own). Returns the names added and removed."""
        loaded = self.loras
        removed = [n for n, f in loaded.items() if wanted.get(n) != f]
        for name in removed:
            self.remove_lora(name)
        new = [n for n in wanted if n not in self.loras]
        for name in new:
            layers = self.add_lora(name, wanted[name])
            if added is not None and self._slots is None:
                added(name, layers)
        return {"added": new, "removed": removed}

    def adapter_errors(self, rows: list[tuple[tuple[str, float], ...]]) -> list[str | None]:
        """Per image of a batch to be: why its adapters cannot be composed into the slots together (past the rank
        budget, unknown), or None; all None without slots (PEFT batches share one set)."""
        return [None if self._slots is None else self._slots.row_error(tuple(r)) for r in rows]

    def fuse_lora(self, name: str, scale: float = 1.0) -> None:
        """Fuse one loaded adapter into the weights for good (diffusers' fuse_lora, then unload_lora_weights): no
        adapter layers remain, so a step costs what the base model's does, and the high-tier conversion may follow.
        The adapter is then part of the model: batches name no adapters."""
        if name not in self.loras:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.loras)}")
        if self._slots is not None:
            raise ValueError("adapters served beside the layers cannot be fused: fuse before enabling adapter slots")
        with self._lock:
            self.pipe.enable_lora()
            self.pipe.set_adapters([name], [float(scale)])
            # every part of the adapter, as a user's fuse_lora() does (an adapter's CLIP part included)
            self.pipe.fuse_lora(components=["transformer", "text_encoder"], lora_scale=1.0, adapter_names=[name])
            self.pipe.unload_lora_weights()
            self.prompt_cache.clear()
            self.form = replace(self.form, loras=(), fused_lora=(name, float(scale)))
            self._drop_graphs()

    def _activate_loras(self, requests: list[GenerationRequest]) -> tuple[Any, Any] | None:
        """Switch on the adapters the batch names: each image's own, composed into the slots; else (PEFT) the
        batch's one set. With slots, adapters' text-encoder parts are switched on for the batch when its images
        agree on them; where they differ, each group of prompts is encoded with its own, and the embeddings
        (prompt, pooled) are returned for the batch."""
        if self._slots is not None:
            if requests[0].quality != "high" and any(r.loras for r in requests):
                raise ValueError("adapters served beside the layers are not bit-exact: high batches only")
            self._slots.compose([r.loras for r in requests])
            if self._slots.graphs_stale():  # the buffers grew for a larger batch
                self._drop_graphs()
            return self._text_parts(requests)
        loras = requests[0].loras
        unknown = [name for name, _ in loras if name not in self.loras]
        if unknown:
            raise ValueError(f"unknown LoRA adapter(s) {unknown}; loaded: {sorted(self.loras)}")
        if not self.loras:
            return
        if loras:
            self.pipe.enable_lora()
            self.pipe.set_adapters([n for n, _ in loras], [float(s) for _, s in loras])
        else:
            self.pipe.disable_lora()

    def _text_parts(self, requests: list[GenerationRequest]) -> tuple[Any, Any] | None:
        """A slot batch's adapters' text-encoder parts (PEFT, in the text encoders): one set switched on for the
        whole batch, or, where images name different ones, their prompts encoded group by group."""
        from model.adapters import switch_text_adapters, text_adapters

        held = text_adapters(self.pipe)
        if not held:
            return None
        sets = [tuple((n, s) for n, s in r.loras if n in held) for r in requests]
        if len(set(sets)) == 1:
            switch_text_adapters(self.pipe, sets[0])
            return None
        import torch

        embeds: list[Any] = [None] * len(requests)
        for group in dict.fromkeys(sets):
            rows = [i for i, t in enumerate(sets) if t == group]
            switch_text_adapters(self.pipe, group)
            prompt, pooled, _ = self.pipe.encode_prompt(
                prompt=[requests[i].prompt for i in rows], prompt_2=None, device=self.device,
                max_sequence_length=max_sequence_length(self.pipe))
            for j, i in enumerate(rows):
                embeds[i] = (prompt[j], pooled[j])
        switch_text_adapters(self.pipe, ())
        return torch.stack([e[0] for e in embeds]), torch.stack([e[1] for e in embeds])

    def fp8_refusal(self) -> str | None:
        """Why fp8 layers cannot run for this pipeline's transformer, or None when they can."""
        from kernels.fp8 import fp8_refusal

        return fp8_refusal(self.device, self.dtype)

    def convert_for_high(self, *, fp8: bool = False, fused_projections: bool = False,
                         fp8_adaln: bool = True) -> dict[str, Any]:
        """Give the transformer the high tier's lifetime form, once (a high replica at start): q/k/v (+ the single
        blocks' MLP up-projection) as one GEMM each, and/or fp8 linear layers. The replaced weights are freed;
        from then on the pipeline serves "high" batches only (a lossless plan raises). Not bit-exact.

        fp8 where it cannot run (no CUDA, pre-Ada GPU, fp16/fp32 model) raises ValueError with the reason, before
        anything is changed. `fp8_adaln=False` keeps the AdaLN modulation linears bf16 (benchmarks compare).
        Returns what was done: {"fp8": bool, "fused_projections": bool, "kept_bf16": {...}}.
        """
        if fp8:
            reason = self.fp8_refusal()
            if reason is not None:
                raise ValueError(f"fp8 refused: {reason}")
        kept: dict[str, str] = {}
        with self._lock:
            if fused_projections and not self.fused_projections:
                if self.fp8:
                    raise ValueError("fuse projections before quantizing to fp8")
                family_of(self.transformer).fuse_projections(self.transformer)
                self.form = replace(self.form, fused_projections=True)
            if fp8 and not self.fp8:
                from model.linear import is_fp8

                kept = family_of(self.transformer).quantize_fp8(self.transformer, fp8_adaln)
                self.form = replace(self.form, fp8=True)
                self.fp8_layers = sum(is_fp8(m) for m in self.transformer.modules())
            self._drop_graphs()  # captured with the old layers
        self.release_memory()  # the replaced bf16 weights
        return {"fp8": self.fp8, "fused_projections": self.fused_projections, "kept_bf16": kept}

    def take_high_defaults(self) -> dict[str, Any]:
        """Take the high tier's default techniques (`HIGH_DEFAULTS`) whatever the pool settings a config would weigh:
        converted once (fp8 only where it can run), fast norms and 8-bit attention in high batches. Returns
        `convert_for_high`'s report."""
        form = self.convert_for_high(fp8="fp8" in HIGH_DEFAULTS and self.fp8_refusal() is None,
                                     fused_projections="fused_projections" in HIGH_DEFAULTS)
        self.use(fast_norm="fast_norm" in HIGH_DEFAULTS, attention8="attention8" in HIGH_DEFAULTS,
                 fast_vae="fast_vae" in HIGH_DEFAULTS)
        return form

    def plan(self, quality: Quality, compiled: bool | None = None, cuda_graphs: bool | None = None,
             step_cache: float | None = None) -> TierPlan:
        """The tier plan of a batch of `quality` under this pipeline's settings. `compiled` (default: after
        `enable_compile`) applies to high batches only; `cuda_graphs` (default: after `enable_cuda_graphs`) to
        either tier except a compiled high batch or one with a step cache; the form's fast_norm, attention8 and fast_vae on
        CUDA fp16/bf16 only (elsewhere the sites stay exact). `step_cache`: the batch's threshold (default:
        the form's; 0: every step computed)."""
        if compiled is None:
            compiled = self.compile_enabled
        if compiled and quality == "high" and self._compiled_runners is None:
            raise ValueError("compiled=True needs enable_compile() first")
        if cuda_graphs is None:
            cuda_graphs = self.cuda_graphs_enabled
        if cuda_graphs and self._step_graphs is None:
            raise ValueError("cuda_graphs=True needs enable_cuda_graphs() first")
        if quality != "high" and (self.fp8 or self.fused_projections):
            raise ValueError(f"this pipeline's transformer was converted for the high tier (fp8={self.fp8}, "
                             f"fused_projections={self.fused_projections}): it cannot serve {quality!r} batches")
        form = self.form
        return plan_tier(quality, fast_norm=form.fast_norm and self.runs("fast_norm"),
                         attention8=form.attention8 and self.runs("attention8"), compiled=compiled,
                         cuda_graphs=cuda_graphs, fp8=form.fp8, fused_projections=form.fused_projections,
                         step_cache=(form.step_cache if step_cache is None else step_cache) or None,
                         fast_vae=form.fast_vae and self.runs("fast_vae"))

    def generate(self, requests: list[GenerationRequest], progress: bool = False,
                 should_stop: Callable[[], bool] | None = None,
                 compiled: bool | None = None, cuda_graphs: bool | None = None,
                 agree: Callable[[bool], bool] | None = None,
                 previews: PreviewSink | None = None, encode: bool = True) -> list[GenerationResult]:
        """Generate one uniform batch under its tier's plan (`plan`), applied for this batch only
        (`model.tiers.applied_tier`). "high" mounts the GELU sites; if the kernels refuse (e.g. on the CPU) it runs
        unfused and every result's `ran.gelu_sites` is 0. agree: the TP ranks' agreement on the mount (see
        applied_tier). previews: partial images while it denoises (the results do not change). encode=False: the
        PNGs are left to `encode_pngs`, outside this pipeline's lock."""
        validate_batch(requests, mixed_adapters=self._slots is not None)
        quality = requests[0].quality
        plan = self.plan(quality, compiled, cuda_graphs, step_cache=requests[0].step_cache)
        with self._lock:
            t0 = time.perf_counter()
            embeds = self._activate_loras(requests)
            replays = self._step_graphs.replays if self._step_graphs is not None else 0
            try:
                with applied_tier(self.transformer, plan, block_runners=self._compiled_runners,
                                  step_graphs=self._step_graphs, agree=agree,
                                  adapters=requests[0].loras if self._slots is None else self._slots.state.on
                                  ) as report, vae.decoding(self.pipe, plan.fast_vae):
                    if report.mount_report is not None:
                        self.last_mount_report = report.mount_report
                    t1 = time.perf_counter()
                    latents, images = run_flux_pipeline(self.pipe, requests, progress, should_stop, previews,
                                                        encode=False, embeds=embeds)
            finally:
                if self._slots is not None:
                    self._slots.off()
            _sync(self.device)
            t2 = time.perf_counter()
            graphed = self._step_graphs is not None and self._step_graphs.replays > replays
        timings = {"mount_s": t1 - t0, "pipeline_s": t2 - t1, "total_s": t2 - t0, "batch_size": float(len(requests))}
        shape = (requests[0].width, requests[0].height, len(requests), quality, previews is not None)
        if shape not in self._shapes_seen:
            self._shapes_seen.add(shape)
            if self.warmup and not self._warming:  # a warmed replica's first batch of a shape it did not warm up
                logger.info("first %s batch of %dx%d x%d%s, outside the warm set: %.2f s", quality, *shape[:3],
                            " streamed" if previews is not None else "", t2 - t0)
        if report.step_cache is not None:
            timings["cached_steps"] = float(report.step_cache.skipped)
        ran = Ran(gelu_sites=report.mounted_sites, fast_norm_sites=report.fast_norm_sites,
                  attention8_sites=report.attention8_sites, fp8_layers=self.fp8_layers,
                  fused_projections=self.fused_projections, compiled=plan.compiled, graphed=graphed,
                  step_cache=plan.step_cache, fast_vae=plan.fast_vae, adapters=requests[0].loras,
                  fused_adapter=self.fused_lora)
        results = [GenerationResult(png=None, image=im, latents=lat, seed=r.seed, quality=quality,
                                    ran=ran if r.loras == ran.adapters else replace(ran, adapters=r.loras),
                                    timings=dict(timings)) for r, lat, im in zip(requests, latents, images)]
        return encode_pngs(results) if encode else results

    def release_memory(self) -> None:
        """Hand freed device memory back (after a failed, e.g. out-of-memory, batch, or after a conversion)."""
        import gc

        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def runs(self, technique: str) -> bool:
        """Whether `technique`'s kernels run for this pipeline's device and dtype (the feature table's `runs_on`);
        where they do not, its sites stay on their exact kernels."""
        return feature(technique).runs_on(self.form.device, self.form.dtype)
