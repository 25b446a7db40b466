"""The FLUX.1 family (dev, schnell): everything fluxserve asks of it (model/family.py) in one place.

The transformer itself is `model/flux.py`; this module says which diffusers classes go with it, how many T5 tokens
a prompt gets, how its linears shard for tensor parallelism (declaratively, applied by `tp/shard.py`), how the high
tier converts it (fused projections, fp8 layers) and how an original single-file checkpoint is read.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torch import nn

from kernels.fp8 import fp8_refusal
from kernels.modulate import set_norm_fp8
from model.family import ModelFamily, TPRule
from model.linear import FP8, FP8_WEIGHT_ONLY, Linear, convertible, is_fp8

# T5 tokens per prompt, as diffusers uses each model: FluxPipeline's default (512, also its maximum) for FLUX.1-dev;
# FLUX.1-schnell (no guidance embedding) is documented and run with 256. A tokenizer with a smaller
# model_max_length (the tiny presets) lowers it further.
T5_TOKENS_DEV = 512
T5_TOKENS_SCHNELL = 256


def text_tokens(pipe: Any) -> int:
    default = T5_TOKENS_DEV if pipe.transformer.config.guidance_embeds else T5_TOKENS_SCHNELL
    return min(default, int(pipe.tokenizer_2.model_max_length))


def _single_mlp_split(block: Any, layer: Any) -> tuple[int, ...]:
    """The single block's proj_out input: [attention | MLP], each column-sharded."""
    return (layer.in_features - block.mlp_hidden_dim, block.mlp_hidden_dim)


def _qkv(block: Any, layer: Any) -> tuple[int, ...]:
    return (layer.out_features // 3,) * 3


def _qkv_mlp(block: Any, layer: Any) -> tuple[int, ...]:
    return (*_qkv(block, SimpleNamespace(out_features=layer.out_features - block.mlp_hidden_dim)),
            block.mlp_hidden_dim)


# Megatron layout. Per double block 4 all-reduces (attention out, text attention out, the two FF down-projections),
# per single block 1 (proj_out over [attention | MLP]); the AdaLN linears (they index the full hidden dim), the QK
# norms (per head), the embedders and the final layers stay replicated, so the residual stream between blocks is
# the same tensor on every rank. The fused projections shard by heads: each rank holds its heads of q, k and v.
TP_PLAN = (
    TPRule("transformer_blocks.*.attn.to_[qkv]", "column"),
    TPRule("transformer_blocks.*.attn.add_[qkv]_proj", "column"),
    TPRule("transformer_blocks.*.attn.to_qkv", "column", _qkv),
    TPRule("transformer_blocks.*.attn.to_added_qkv", "column", _qkv),
    TPRule("transformer_blocks.*.attn.to_out.0", "row"),
    TPRule("transformer_blocks.*.attn.to_add_out", "row"),
    TPRule("transformer_blocks.*.ff*.net.0.proj", "column"),  # the tanh-GELU site (FluxGELU) keeps its layer's name
    TPRule("transformer_blocks.*.ff*.net.2", "row"),
    TPRule("single_transformer_blocks.*.attn.to_[qkv]", "column"),
    TPRule("single_transformer_blocks.*.proj_mlp", "column"),
    TPRule("single_transformer_blocks.*.to_qkv_mlp", "column", _qkv_mlp),
    TPRule("single_transformer_blocks.*.proj_out", "row", _single_mlp_split),
)


def fuse_projections(model: Any) -> None:
    """Every block's q/k/v (single blocks: q/k/v + MLP up-projection) as one GEMM. Not bit-exact."""
    model.fuse_qkv_projections()


def quantize_fp8(model: Any, adaln: bool = True) -> dict[str, str]:
    """Every block linear that takes a token activation becomes an fp8 `model.linear.Linear` (e4m3 weights, per-row
    activation scales; the bf16 weights are dropped). Not bit-exact. `adaln`: the AdaLN modulation linears (one row
    per image, a quarter of the weights) become weight-only fp8 layers (bf16 activations, half the weight bytes to
    read); else they stay bf16. Returns {layer: why it stayed bf16}; raises ValueError where fp8 cannot run."""
    reason = fp8_refusal(model.device, model.dtype)
    if reason is not None:
        raise ValueError(reason)
    kept: dict[str, str] = {}
    # By name, so that each replaced bf16 layer is freed as soon as its fp8 form is in: the conversion's peak is
    # the model plus one layer, not the bf16 and fp8 models together.
    for name in [n for n, m in model.named_modules() if "_blocks." in n and isinstance(m, (nn.Linear, Linear))]:
        parent_name, _, attr = name.rpartition(".")
        is_adaln = parent_name.rpartition(".")[2] in ("norm", "norm1", "norm1_context")
        if is_adaln and not adaln:
            continue
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, attr)
        why = convertible(layer)
        if why is not None:
            kept[name] = why
        else:
            plain = layer if isinstance(layer, Linear) else Linear.from_linears([layer])
            setattr(parent, attr, plain.quantized(FP8_WEIGHT_ONLY if is_adaln else FP8))
    _quantize_at_norms(model)
    return kept


def _quantize_at_norms(model: Any) -> None:
    """Norm sites whose every consumer is now an fp8 linear quantize their own output (one pass, no bf16
    activation); a site with a consumer left in bf16 keeps handing out tensors."""
    def fp8(*layers: Any) -> bool:
        return all(is_fp8(layer) for layer in layers)

    for block in model.transformer_blocks:
        set_norm_fp8(block.norm1, fp8(*block.attn.projections(text=False)))
        set_norm_fp8(block.norm1_context, fp8(*block.attn.projections(text=True)))
        set_norm_fp8(block, block.ff.gelu_in_down_proj and block.ff_context.gelu_in_down_proj)
    for block in model.single_transformer_blocks:
        set_norm_fp8(block.norm, is_fp8(block.proj_out) and fp8(*block.norm_consumers()))


# -- the original (BFL) single-file layout: transformer/ holds one .safetensors file with these keys --------------

def _original_config(sd: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """FluxTransformer config of an original-layout checkpoint (key -> shape, prefix stripped). The RoPE axes are
    not in a checkpoint: FLUX.1's (16, 56, 56) unless transformer/config.json says otherwise."""
    head_dim = sd["double_blocks.0.img_attn.norm.query_norm.scale"][0]
    inner = sd["img_in.weight"][0]
    return dict(
        patch_size=1, in_channels=sd["img_in.weight"][1], out_channels=sd["final_layer.linear.weight"][0],
        num_layers=len({k.split(".")[1] for k in sd if k.startswith("double_blocks.")}),
        num_single_layers=len({k.split(".")[1] for k in sd if k.startswith("single_blocks.")}),
        attention_head_dim=head_dim, num_attention_heads=inner // head_dim,
        joint_attention_dim=sd["txt_in.weight"][1], pooled_projection_dim=sd["vector_in.in_layer.weight"][1],
        guidance_embeds="guidance_in.in_layer.weight" in sd, axes_dims_rope=(16, 56, 56),
    )


def _convert_single_file(sd: dict[str, Any]) -> dict[str, Any]:
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    return convert_flux_transformer_checkpoint_to_diffusers(sd)


def _transformer() -> type:
    from model.flux import FluxTransformer

    return FluxTransformer


def _reference() -> type:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel


def _pipelines() -> dict[str, type]:
    from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxPipeline

    return {"text": FluxPipeline, "img2img": FluxImg2ImgPipeline, "inpaint": FluxInpaintPipeline}


FAMILY = ModelFamily(
    name="flux1",
    title="FLUX.1",
    pipeline_class_names=("FluxPipeline",),
    transformer_class=_transformer,
    reference_transformer_class=_reference,
    pipeline_classes=_pipelines,
    components={
        "scheduler": [("scheduler_config.json",)],
        "vae": [("config.json",), ("diffusion_pytorch_model.safetensors",
                                   "diffusion_pytorch_model.safetensors.index.json")],
        "text_encoder": [("config.json",), ("model.safetensors", "model.safetensors.index.json")],
        "text_encoder_2": [("config.json",), ("model.safetensors", "model.safetensors.index.json")],
        "tokenizer": [("tokenizer.json", "vocab.json")],
        "tokenizer_2": [("tokenizer.json", "spiece.model")],
        "transformer": [("config.json",), ("diffusion_pytorch_model.safetensors",
                                           "diffusion_pytorch_model.safetensors.index.json")],
    },
    text_tokens=text_tokens,
    tp_plan=TP_PLAN,
    attention_path="*transformer_blocks.*.attn",
    fuse_projections=fuse_projections,
    quantize_fp8=quantize_fp8,
    single_file=SimpleNamespace(key="double_blocks.0.img_attn.qkv.weight", prefix="model.diffusion_model.",
                                config=_original_config, convert=_convert_single_file,
                                # diffusers' converter splits the single blocks' fused projection at this width
                                width=3072),
)
