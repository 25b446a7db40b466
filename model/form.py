"""What a replica serves with for its lifetime: `ServingForm`, a frozen value.

A form is the model, where it runs, its techniques (the feature table's names, model/features.py) and the defaults
of its high batches. `deployments.config.AppArgs.form(pool)` makes one from a pool's settings;
`model.build.build_pipeline(form)` loads, shards (a TP rank passes its sharding), converts and warms a pipeline into
it. Torch-free: the config imports it.

What a request may choose per batch (quality, its own step cache, adapters) is not here: it is the request's
(`model.request.GenerationRequest`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from model.features import BY_NAME, FEATURES, is_on, standing_in


@dataclass(frozen=True)
class ServingForm:
    """A replica's (or TP rank's) lifetime form. Technique fields carry the feature table's names."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    # Where built kernels persist across restarts (kernels/cache.py); None: each library's default.
    kernel_cache_dir: str | None = None
    # Replica lifetime: the transformer's converted form, adapters, compiled blocks and captured graphs.
    fused_projections: bool = False
    fp8: bool = False
    loras: tuple[tuple[str, str], ...] = ()  # (name, .safetensors file), loaded once, switched per batch
    fused_lora: tuple[str, float] | None = None  # (name, scale): an adapter merged into the weights at start
    cuda_graphs: bool = False
    compile: bool = False
    # The adapters served beside the converted layers (model/adapter_slots.py): the rank one image may use; None:
    # adapters go through PEFT on the unconverted layers.
    adapter_slots: int | None = None
    # The (height, width) sizes and batch sizes warmed up at start (a compiled form compiles for each), and the
    # tier whose batches the warm-up runs (the pool's; None: no warm-up).
    warm_sizes: tuple[tuple[int, int], ...] = ()
    warm_batch_sizes: tuple[int, ...] = ()
    warm_quality: str | None = None
    # High batches' defaults: switched on around each high batch (a request may set its own step cache).
    fast_norm: bool = False
    attention8: bool = False
    fast_vae: bool = False
    step_cache: float | None = None
    # Where fp8 was asked for but cannot run (the builder keeps bf16): why.
    refused: tuple[tuple[str, str], ...] = field(default=())

    def techniques(self) -> frozenset[str]:
        """The feature-table techniques this form turns on."""
        on = {f.name for f in fields(self) if f.name in BY_NAME and is_on(getattr(self, f.name))}
        if self.loras and self.fused_lora is None:
            on.add("lora")
        return standing_in(on)


# The high-batch defaults a form carries: the table's per-batch pool techniques.
BATCH_DEFAULTS: frozenset[str] = frozenset(f.name for f in FEATURES if f.scope == "batch" and f.where == "pool")
