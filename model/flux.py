"""Our FLUX.1 transformer: diffusers' parameter names and numerics, with our own fused sites.

`FluxTransformer` is a drop-in for diffusers' `FluxTransformer2DModel` (0.42.1): same config/`__init__` signature,
same state-dict keys (strict loading both ways), same forward signature and return type. Unmounted, its output is
bit-identical to diffusers' (each op below repeats diffusers' op, operand order and dtype casts). What differs is
structure: the attention, the residual-gate sites, the FF and the single-block MLP are written here, so that
`kernels` can fuse them (residual-gate add, GELU sites) and `tp/` can shard them in place (attention reads its head
count from `attn.heads` at run time).

Small pieces whose output we reuse unchanged come from diffusers: the RoPE tables (`FluxPosEmbed`), the
timestep/guidance/text embedders and the final `AdaLayerNormContinuous`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.attention import AttentionMixin
from diffusers.models.cache_utils import CacheMixin
from diffusers.models.embeddings import (
    CombinedTimestepGuidanceTextProjEmbeddings,
    CombinedTimestepTextProjEmbeddings,
)
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import AdaLayerNormContinuous
from diffusers.models.transformers.transformer_flux import FluxPosEmbed
from diffusers.utils import apply_lora_scale, logging

from kernels import gelu_site, lora, mark_fused_gelu_site, residual_gate_add, switches
from kernels.attention import attention, attention8, mark_attention8_site, rope_attention_fp8
from kernels.gelu import unmark_fused_gelu_site
from kernels.modulate import fast_norm, layer_norm_modulate, mark_norm_site, norm_fp8
from kernels.rope import rms_rope_cat
from model.execution import cached_step, execution_of
from model.linear import Linear, is_fp8, linear_cat_gelu, spare_columns

logger = logging.get_logger(__name__)

# The single block writes attention and GELU straight into proj_out's input instead of cat-ing them (same values,
# one full-width copy less). A switch only so bench/lossless_fusions.py can measure it.
IN_PLACE = switches.register("single_block_in_place", True,
                             "single block writes attention and GELU into proj_out's input (no cat)")


def _fp16_clip(x: torch.Tensor) -> float | None:
    """diffusers clips fp16 block outputs to the fp16 range (+-65504); other dtypes are not clipped."""
    return 65504.0 if x.dtype == torch.float16 else None


# ---------------------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------------------


class FluxGELU(nn.Module):
    """A tanh-GELU up-projection site: `gelu_tanh(self.proj(x))`, routed through `kernels.gelu_site`.

    `proj` may be any linear-like module: an `nn.Linear` (TP=1) or tp/'s column-parallel linear with
    `gather_output=False` (TP>1). Unmounted this is exactly diffusers' `GELU(approximate="tanh")`.
    """

    def __init__(self, proj: nn.Module) -> None:
        super().__init__()
        self.proj = proj
        mark_fused_gelu_site(self, "proj")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gelu_site(self, "proj", hidden_states)


class FluxFusedGELUProj(FluxGELU):
    """`ff.net.0` of a double block: owns its `nn.Linear`, so the checkpoint path stays `ff.net.0.proj.weight`."""

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True) -> None:
        super().__init__(nn.Linear(dim_in, dim_out, bias=bias))


class FluxFeedForward(nn.Module):
    """diffusers `FeedForward(activation_fn="gelu-approximate")`: net = [GELU site, Dropout, Linear]."""

    def __init__(self, dim: int, dim_out: int | None = None, mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        inner_dim = int(dim * mult)
        self.net = nn.ModuleList(
            [FluxFusedGELUProj(dim, inner_dim), nn.Dropout(dropout), nn.Linear(inner_dim, dim_out or dim)]
        )

    @property
    def gelu_in_down_proj(self) -> bool:
        """High tier, fp8: the GELU runs inside the down-projection's input quantization (no bf16 activation)."""
        return is_fp8(self.net[0].proj) and is_fp8(self.net[2])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.gelu_in_down_proj:  # (Dropout: p=0 at inference)
            return linear_cat_gelu(self.net[2], None, self.net[0].proj(hidden_states))
        for module in self.net:
            hidden_states = module(hidden_states)
        return hidden_states


class FluxAdaLayerNormZero(nn.Module):
    """AdaLN-Zero of a double block (diffusers `AdaLayerNormZero`, layer_norm, no class embedding).

    `linear(silu(emb))` gives `chunks` vectors, shift and scale first; forward returns the modulated norm of x
    followed by the remaining chunks (gate_msa, shift_mlp, scale_mlp, gate_mlp here; gate_msa for the single block).
    """

    chunks = 6

    def __init__(self, embedding_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, self.chunks * embedding_dim, bias=bias)
        self.norm = nn.LayerNorm(embedding_dim, elementwise_affine=False, eps=1e-6)
        mark_norm_site(self)

    def forward(self, x: torch.Tensor, emb: torch.Tensor,
                consumers: Sequence[nn.Module] = ()) -> tuple[torch.Tensor, ...]:
        """consumers: the layers the normed rows feed (fp8 rows leave the columns their adapters need)."""
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, *rest = emb.chunk(self.chunks, dim=1)
        fp8 = norm_fp8(self)
        return (layer_norm_modulate(x, scale_msa, shift_msa, self.norm.eps, fast=fast_norm(self), fp8=fp8,
                                    spare=spare_columns(*consumers) if fp8 else 0), *rest)


class FluxAdaLayerNormZeroSingle(FluxAdaLayerNormZero):
    """AdaLN-Zero of a single block (diffusers `AdaLayerNormZeroSingle`): shift, scale, gate."""

    chunks = 3


class FluxAttention(nn.Module):
    """FLUX joint attention (double block: with the text-stream projections; single block: `pre_only`).

    Parameter names are diffusers' `FluxAttention`'s. `heads` and `head_dim` are read at every call, so tp/ can
    swap the projections for sharded ones and set `heads = heads // tp` on a built model.
    """

    def __init__(
        self,
        query_dim: int,
        heads: int,
        dim_head: int,
        added_kv_proj_dim: int | None = None,
        bias: bool = True,
        out_bias: bool = True,
        eps: float = 1e-6,
        pre_only: bool = False,
    ) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim_head
        self.inner_dim = heads * dim_head
        self.query_dim = query_dim
        self.pre_only = pre_only
        self.added_kv_proj_dim = added_kv_proj_dim

        self.norm_q = nn.RMSNorm(dim_head, eps=eps)
        self.norm_k = nn.RMSNorm(dim_head, eps=eps)
        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_k = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_v = nn.Linear(query_dim, self.inner_dim, bias=bias)
        if not pre_only:
            self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, query_dim, bias=out_bias), nn.Dropout(0.0)])
        if added_kv_proj_dim is not None:
            self.norm_added_q = nn.RMSNorm(dim_head, eps=eps)
            self.norm_added_k = nn.RMSNorm(dim_head, eps=eps)
            self.add_q_proj = nn.Linear(added_kv_proj_dim, self.inner_dim, bias=True)
            self.add_k_proj = nn.Linear(added_kv_proj_dim, self.inner_dim, bias=True)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, self.inner_dim, bias=True)
            self.to_add_out = nn.Linear(self.inner_dim, query_dim, bias=out_bias)
        # High tier: q/k/v (and the text stream's) as one GEMM each, set by `fuse_projections`.
        self.to_qkv: nn.Module | None = None
        self.to_added_qkv: nn.Module | None = None
        mark_attention8_site(self)  # high tier, per batch: 8-bit attention instead of SDPA
        mark_norm_site(self)  # QK RMSNorm + RoPE: the fast kernel when the tier switches norms to it

    def fuse_projections(self) -> None:
        """q, k, v as one stacked linear (and add_q/k/v as another); the separate layers are dropped. Not bit-exact
        (one wider GEMM may take another cuBLAS kernel): high tier only."""
        if self.to_qkv is None:
            self.to_qkv = Linear.from_linears([self.to_q, self.to_k, self.to_v], names=("to_q", "to_k", "to_v"))
            del self.to_q, self.to_k, self.to_v
        if self.added_kv_proj_dim is not None and self.to_added_qkv is None:
            self.to_added_qkv = Linear.from_linears([self.add_q_proj, self.add_k_proj, self.add_v_proj],
                                                    names=("add_q_proj", "add_k_proj", "add_v_proj"))
            del self.add_q_proj, self.add_k_proj, self.add_v_proj

    def projections(self, text: bool) -> tuple[nn.Module, ...]:
        """The layers that project one stream's normed rows to q, k, v."""
        fused = self.to_added_qkv if text else self.to_qkv
        if fused is not None:
            return (fused,)
        return (self.add_q_proj, self.add_k_proj, self.add_v_proj) if text else (self.to_q, self.to_k, self.to_v)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.heads, self.head_dim))

    def _qkv(self, x: torch.Tensor, text: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fused = self.to_added_qkv if text else self.to_qkv
        if fused is not None:
            return tuple(self._heads(t) for t in fused(x).chunk(3, dim=-1))
        if text:
            return (self._heads(self.add_q_proj(x)), self._heads(self.add_k_proj(x)),
                    self._heads(self.add_v_proj(x)))
        return self._heads(self.to_q(x)), self._heads(self.to_k(x)), self._heads(self.to_v(x))

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """out (single-stream use, no encoder states): a [B, S, heads * head_dim] view to write the result into."""
        # q, k before their RMSNorm; the norm is applied in `attend` (fused with RoPE where there is RoPE).
        query, key, value = self._qkv(hidden_states, text=False)
        encoder_qkv = None
        if encoder_hidden_states is not None and self.added_kv_proj_dim is not None:
            encoder_qkv = self._qkv(encoder_hidden_states, text=True)
        hidden_states = self.attend(query, key, value, encoder_qkv, attention_mask, image_rotary_emb,
                                    out if encoder_hidden_states is None else None)
        if encoder_hidden_states is None:
            return hidden_states
        text_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [text_len, hidden_states.shape[1] - text_len], dim=1
        )
        hidden_states = self.to_out[1](self.to_out[0](hidden_states.contiguous()))
        encoder_hidden_states = self.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        encoder_qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of projected (not yet normed) q, k, v [B, S, heads, head_dim], the text stream's first when
        given: QK RMSNorm, RoPE, SDPA -> [B, S, heads * head_dim] (written into `out` when given)."""
        encoder_query = encoder_key = encoder_value = None
        if encoder_qkv is not None:
            encoder_query, encoder_key, encoder_value = encoder_qkv
        norm_added_q = self.norm_added_q if encoder_query is not None else None
        norm_added_k = self.norm_added_k if encoder_query is not None else None

        use8 = attention8(self)
        if use8 and image_rotary_emb is not None:
            # cuDNN's fp8 attention, q and k quantized by their norm pass (None where it does not apply).
            hidden_states = rope_attention_fp8(
                (encoder_query, query), (encoder_key, key), (encoder_value, value), (norm_added_q, self.norm_q),
                (norm_added_k, self.norm_k), *image_rotary_emb, attention_mask)
            if hidden_states is not None:
                if out is None:
                    return hidden_states.flatten(2, 3)
                out.copy_(hidden_states.flatten(2, 3))
                return out
        if encoder_value is not None:
            # Text tokens first, as in diffusers (the RoPE table is laid out txt_ids then img_ids).
            value = _cat_tokens(encoder_value, value)

        if image_rotary_emb is not None:
            # == apply_rope_eager(cat([norm(text), norm(image)])): on CUDA one fused pass per q / k from the projection
            # output to the joint rotated tensor (bit-exact gates).
            cos, sin = image_rotary_emb
            fast = fast_norm(self)
            query = rms_rope_cat(encoder_query, query, norm_added_q, self.norm_q, cos, sin, fast=fast)
            key = rms_rope_cat(encoder_key, key, norm_added_k, self.norm_k, cos, sin, fast=fast)
        else:
            query, key = self.norm_q(query), self.norm_k(key)
            if encoder_query is not None:
                query = torch.cat([norm_added_q(encoder_query), query], dim=1)
                key = torch.cat([norm_added_k(encoder_key), key], dim=1)

        if out is not None:
            # Into the caller's buffer: SDPA's result is copied there (the copy `flatten` would make anyway), the
            # 8-bit kernel writes there directly.
            attention(query, key, value, attention_mask, fp8=use8,
                      out=out.unflatten(-1, (query.shape[2], query.shape[3])))
            return out
        hidden_states = attention(query, key, value, attention_mask, fp8=use8)
        return hidden_states.flatten(2, 3).to(query.dtype)


class FluxTransformerBlock(nn.Module):
    """Double-stream (MMDiT) block. Residual-gate sites: img-attn, img-ff, txt-attn, txt-ff."""

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm1 = FluxAdaLayerNormZero(dim)
        self.norm1_context = FluxAdaLayerNormZero(dim)
        self.attn = FluxAttention(
            query_dim=dim, heads=num_attention_heads, dim_head=attention_head_dim, added_kv_proj_dim=dim, eps=eps
        )
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FluxFeedForward(dim=dim, dim_out=dim)
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff_context = FluxFeedForward(dim=dim, dim_out=dim)
        mark_norm_site(self)  # norm2 / norm2_context + their modulation

    def shared_input_groups(self) -> tuple[tuple[nn.Module, ...], ...]:
        """Layers that each read one tensor: the image stream's q, k, v and the text stream's (model/peft_tail.py
        multiplies their adapters' A's in one GEMM)."""
        return (self.attn.projections(text=False), self.attn.projections(text=True))

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(
            hidden_states, emb=temb, consumers=self.attn.projections(text=False))
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb, consumers=self.attn.projections(text=True)
        )
        # The output projections' adapter terms (if any) go to the residual-gate passes (kernels.lora.deferred).
        with lora.deferred(self.attn.to_out[0]) as out_terms, \
                lora.deferred(getattr(self.attn, "to_add_out", None)) as add_out_terms:
            attn_output, context_attn_output = self.attn(
                hidden_states=norm_hidden_states,
                encoder_hidden_states=norm_encoder_hidden_states,
                image_rotary_emb=image_rotary_emb,
            )

        # Image stream. diffusers: `h = h + gate.unsqueeze(1) * update` at each site.
        hidden_states = residual_gate_add(hidden_states, attn_output, gate_msa.unsqueeze(1), terms=out_terms)
        fast, fp8 = fast_norm(self), norm_fp8(self)
        norm_hidden_states = layer_norm_modulate(hidden_states, scale_mlp, shift_mlp, self.norm2.eps, fast=fast,
                                                 fp8=fp8, spare=spare_columns(self.ff.net[0].proj) if fp8 else 0)
        with lora.deferred(self.ff.net[2]) as ff_terms:
            ff_output = self.ff(norm_hidden_states)
        hidden_states = residual_gate_add(hidden_states, ff_output, gate_mlp.unsqueeze(1), terms=ff_terms)

        # Text stream.
        encoder_hidden_states = residual_gate_add(encoder_hidden_states, context_attn_output, c_gate_msa.unsqueeze(1),
                                                  terms=add_out_terms)
        norm_encoder_hidden_states = layer_norm_modulate(
            encoder_hidden_states, c_scale_mlp, c_shift_mlp, self.norm2_context.eps, fast=fast, fp8=fp8,
            spare=spare_columns(self.ff_context.net[0].proj) if fp8 else 0,
        )
        with lora.deferred(self.ff_context.net[2]) as ff_context_terms:
            context_ff_output = self.ff_context(norm_encoder_hidden_states)
        # diffusers clips only the text stream here (fp16 overflow guard); folded into the residual kernel.
        encoder_hidden_states = residual_gate_add(
            encoder_hidden_states, context_ff_output, c_gate_mlp.unsqueeze(1),
            clip=_fp16_clip(encoder_hidden_states), terms=ff_context_terms,
        )
        return encoder_hidden_states, hidden_states


class FluxSingleTransformerBlock(nn.Module):
    """Single-stream block: parallel attention + MLP over the joint [text; image] sequence.

    Residual-gate site: the block output. GELU site: (self, "proj_mlp").
    """

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.mlp_hidden_dim = int(dim * mlp_ratio)
        self.norm = FluxAdaLayerNormZeroSingle(dim)
        self.proj_mlp = nn.Linear(dim, self.mlp_hidden_dim)
        self.proj_out = nn.Linear(dim + self.mlp_hidden_dim, dim)
        self.attn = FluxAttention(
            query_dim=dim, heads=num_attention_heads, dim_head=attention_head_dim, eps=1e-6, pre_only=True
        )
        mark_fused_gelu_site(self, "proj_mlp")
        # High tier: q/k/v and the MLP up-projection as one GEMM, set by `fuse_projections`.
        self.to_qkv_mlp: nn.Module | None = None

    @property
    def mlp_gelu_in_proj_out(self) -> bool:
        """High tier (fused projections or fp8 proj_out): the MLP's GELU is applied inside proj_out's input pass
        (`linear_cat_gelu`; with fp8, no bf16 activation at all)."""
        return self.to_qkv_mlp is not None or is_fp8(self.proj_out)

    def fuse_projections(self) -> None:
        """attn q/k/v and proj_mlp as one stacked linear; the separate layers are dropped (high tier only)."""
        if self.to_qkv_mlp is None:
            attn = self.attn
            self.to_qkv_mlp = Linear.from_linears([attn.to_q, attn.to_k, attn.to_v, self.proj_mlp],
                                                  names=("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))
            del attn.to_q, attn.to_k, attn.to_v, self.proj_mlp
            unmark_fused_gelu_site(self, "proj_mlp")

    def norm_consumers(self) -> tuple[nn.Module, ...]:
        """The layers the block's norm feeds: q, k, v and the MLP up-projection (one stacked layer, fused)."""
        if self.to_qkv_mlp is not None:
            return (self.to_qkv_mlp,)
        return (*self.attn.projections(text=False), self.proj_mlp)

    def shared_input_groups(self) -> tuple[tuple[nn.Module, ...], ...]:
        """Layers that each read one tensor (model/peft_tail.py multiplies their adapters' A's in one GEMM)."""
        return (self.norm_consumers(),)

    def _update(self, norm_hidden_states: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """proj_out(cat([attention, gelu(proj_mlp(x))])) of the normed joint sequence, in the layers' form."""
        if self.mlp_gelu_in_proj_out:
            attn = self.attn
            if self.to_qkv_mlp is not None:
                width = attn.heads * attn.head_dim
                fused = self.to_qkv_mlp(norm_hidden_states)  # (at tp > 1 this rank's heads and MLP columns)
                q, k, v, mlp = fused.split([width] * 3 + [fused.shape[-1] - 3 * width], -1)
                attn_output = attn.attend(attn._heads(q), attn._heads(k), attn._heads(v),
                                          image_rotary_emb=image_rotary_emb)
            else:
                mlp = self.proj_mlp(norm_hidden_states)
                attn_output = attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb)
            return linear_cat_gelu(self.proj_out, attn_output, mlp)
        if (IN_PLACE.value and type(getattr(self.proj_mlp, "base_layer", self.proj_mlp)) is nn.Linear
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
            # diffusers: proj_out(cat([attn, gelu(proj_mlp(x))], dim=2)). Both halves are written straight into
            # their columns of the proj_out input (the values cat would copy there), saving a full-width copy.
            # proj_mlp may be a LoRA layer around the plain one (PEFT's `base_layer`): same width, same values.
            # (tp/ shards proj_mlp into another layer type: that path keeps the cat; so do autograd (out= ops
            # are not differentiable) and torch.compile.)
            B, S, _ = norm_hidden_states.shape
            attn_width = self.attn.heads * self.attn.head_dim
            joint_in = norm_hidden_states.new_empty(B, S, attn_width + self.proj_mlp.out_features)
            gelu_site(self, "proj_mlp", norm_hidden_states, out=joint_in[..., attn_width:])
            self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                      out=joint_in[..., :attn_width])
            return self.proj_out(joint_in)
        mlp_hidden_states = gelu_site(self, "proj_mlp", norm_hidden_states)
        attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb)
        return self.proj_out(torch.cat([attn_output, mlp_hidden_states], dim=2))

    def forward_joint(
        self,
        joint: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The block on the joint [text; image] sequence (what diffusers computes between its cat and split)."""
        norm_hidden_states, gate = self.norm(joint, emb=temb, consumers=self.norm_consumers())
        with lora.deferred(self.proj_out) as out_terms:  # proj_out's adapter terms: to the residual-gate pass
            update = self._update(norm_hidden_states, image_rotary_emb)
        return residual_gate_add(joint, update, gate.unsqueeze(1), clip=_fp16_clip(joint), terms=out_terms)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        text_len = encoder_hidden_states.shape[1]
        joint = self.forward_joint(torch.cat([encoder_hidden_states, hidden_states], dim=1), temb, image_rotary_emb)
        return joint[:, :text_len], joint[:, text_len:]


def _cat_tokens(txt: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
    """`torch.cat([txt, img], dim=1)`. Views of a fused projection's output (strided rows) are copied into their
    halves instead: torch.cat of non-contiguous inputs takes an unvectorised kernel several times slower."""
    if txt.is_contiguous() and img.is_contiguous():
        return torch.cat([txt, img], dim=1)
    out = img.new_empty((img.shape[0], txt.shape[1] + img.shape[1], *img.shape[2:]))
    out[:, :txt.shape[1]].copy_(txt)
    out[:, txt.shape[1]:].copy_(img)
    return out


def run_double_block(
    block: FluxTransformerBlock,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One double block; a plain function so `torch.compile` of it serves every block instance (regional)."""
    return block(hidden_states, encoder_hidden_states, temb, image_rotary_emb)


def run_single_block(
    block: FluxSingleTransformerBlock,
    joint: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """One single block on the joint sequence (see `run_double_block`)."""
    return block.forward_joint(joint, temb, image_rotary_emb)


class FluxTransformer(ModelMixin, ConfigMixin, PeftAdapterMixin, CacheMixin, AttentionMixin):
    """FLUX.1 transformer, drop-in for diffusers' `FluxTransformer2DModel` (same config, weights, forward)."""

    _supports_gradient_checkpointing = True
    _no_split_modules = ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    _skip_layerwise_casting_patterns = ["pos_embed", "norm"]
    _repeated_blocks = ["FluxTransformerBlock", "FluxSingleTransformerBlock"]

    @register_to_config
    def __init__(
        self,
        patch_size: int = 1,
        in_channels: int = 64,
        out_channels: int | None = None,
        num_layers: int = 19,
        num_single_layers: int = 38,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 4096,
        pooled_projection_dim: int = 768,
        guidance_embeds: bool = False,
        axes_dims_rope: tuple[int, int, int] = (16, 56, 56),
    ):
        super().__init__()
        self.out_channels = out_channels or in_channels
        self.inner_dim = num_attention_heads * attention_head_dim

        self.pos_embed = FluxPosEmbed(theta=10000, axes_dim=axes_dims_rope)
        embed_cls = CombinedTimestepGuidanceTextProjEmbeddings if guidance_embeds else CombinedTimestepTextProjEmbeddings
        self.time_text_embed = embed_cls(embedding_dim=self.inner_dim, pooled_projection_dim=pooled_projection_dim)
        self.context_embedder = nn.Linear(joint_attention_dim, self.inner_dim)
        self.x_embedder = nn.Linear(in_channels, self.inner_dim)

        self.transformer_blocks = nn.ModuleList(
            [FluxTransformerBlock(self.inner_dim, num_attention_heads, attention_head_dim) for _ in range(num_layers)]
        )
        self.single_transformer_blocks = nn.ModuleList(
            [
                FluxSingleTransformerBlock(self.inner_dim, num_attention_heads, attention_head_dim)
                for _ in range(num_single_layers)
            ]
        )
        self.norm_out = AdaLayerNormContinuous(self.inner_dim, self.inner_dim, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(self.inner_dim, patch_size * patch_size * self.out_channels, bias=True)
        self.gradient_checkpointing = False

    def fuse_qkv_projections(self) -> None:
        """Every block's q/k/v (single blocks: q/k/v + MLP up-projection) as one GEMM. Not bit-exact."""
        for block in self.transformer_blocks:
            block.attn.fuse_projections()
        for block in self.single_transformer_blocks:
            block.fuse_projections()

    @apply_lora_scale("joint_attention_kwargs")
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        pooled_projections: torch.Tensor = None,
        timestep: torch.LongTensor = None,
        img_ids: torch.Tensor = None,
        txt_ids: torch.Tensor = None,
        guidance: torch.Tensor = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        controlnet_block_samples=None,
        controlnet_single_block_samples=None,
        return_dict: bool = True,
        controlnet_blocks_repeat: bool = False,
    ) -> torch.Tensor | Transformer2DModelOutput:
        """Same arguments and result as diffusers' `FluxTransformer2DModel.forward` (see `_forward_eager`); inside
        `running(self, step_graphs=...)`, replayed from a CUDA graph where the inputs allow it (bit-identical)."""
        kwargs = dict(
            hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids, txt_ids=txt_ids,
            guidance=guidance, joint_attention_kwargs=joint_attention_kwargs,
            controlnet_block_samples=controlnet_block_samples,
            controlnet_single_block_samples=controlnet_single_block_samples, return_dict=return_dict,
            controlnet_blocks_repeat=controlnet_blocks_repeat,
        )
        ex = execution_of(self)
        if ex is not None and ex.step_graphs is not None and ex.step_cache is None:
            return ex.step_graphs(self, self._forward_eager, kwargs)
        return self._forward_eager(**kwargs)  # a step cache replays the graph of the blocks after the first

    def _forward_eager(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        pooled_projections: torch.Tensor = None,
        timestep: torch.LongTensor = None,
        img_ids: torch.Tensor = None,
        txt_ids: torch.Tensor = None,
        guidance: torch.Tensor = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        controlnet_block_samples=None,
        controlnet_single_block_samples=None,
        return_dict: bool = True,
        controlnet_blocks_repeat: bool = False,
    ) -> torch.Tensor | Transformer2DModelOutput:
        """Same arguments and result as diffusers' `FluxTransformer2DModel.forward`.

        Not supported (raise): IP-adapter embeddings in `joint_attention_kwargs`.
        """
        if joint_attention_kwargs and "ip_adapter_image_embeds" in joint_attention_kwargs:
            raise NotImplementedError("FluxTransformer does not support IP-adapter inputs")

        hidden_states = self.x_embedder(hidden_states)
        timestep = timestep.to(hidden_states.dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = (
            self.time_text_embed(timestep, pooled_projections)
            if guidance is None
            else self.time_text_embed(timestep, guidance, pooled_projections)
        )
        encoder_hidden_states = self.context_embedder(encoder_hidden_states)

        if txt_ids.ndim == 3:
            logger.warning("Passing `txt_ids` 3d torch.Tensor is deprecated; pass a 2d tensor")
            txt_ids = txt_ids[0]
        if img_ids.ndim == 3:
            logger.warning("Passing `img_ids` 3d torch.Tensor is deprecated; pass a 2d tensor")
            img_ids = img_ids[0]
        image_rotary_emb = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))

        ex = execution_of(self)
        if (ex is not None and ex.step_cache is not None and controlnet_block_samples is None
                and len(self.transformer_blocks) > 0):
            return cached_step(self, ex, hidden_states, encoder_hidden_states, temb, image_rotary_emb, return_dict)
        hidden_states = self._blocks(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                     controlnet_block_samples=controlnet_block_samples,
                                     controlnet_single_block_samples=controlnet_single_block_samples,
                                     controlnet_blocks_repeat=controlnet_blocks_repeat)
        return self._output(hidden_states, temb, return_dict)

    def _blocks(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor], first: int = 0,
                controlnet_block_samples=None, controlnet_single_block_samples=None,
                controlnet_blocks_repeat: bool = False) -> torch.Tensor:
        """The double blocks from index `first` on, then every single block: the image hidden states after them."""
        run_double, run_single = self._block_runners()
        for index_block in range(first, len(self.transformer_blocks)):
            encoder_hidden_states, hidden_states = run_double(
                self.transformer_blocks[index_block], hidden_states, encoder_hidden_states, temb, image_rotary_emb)
            if controlnet_block_samples is not None:
                interval = int(np.ceil(len(self.transformer_blocks) / len(controlnet_block_samples)))
                if controlnet_blocks_repeat:  # XLabs ControlNet
                    sample = controlnet_block_samples[index_block % len(controlnet_block_samples)]
                else:
                    sample = controlnet_block_samples[index_block // interval]
                hidden_states = hidden_states + sample

        # diffusers re-concatenates [text; image] at the start of every single block and splits at its end: the
        # split halves of one contiguous tensor concatenate back to that same tensor, so we keep the joint
        # sequence across blocks and skip the copies (bit-identical).
        text_len = encoder_hidden_states.shape[1]
        joint = None
        if len(self.single_transformer_blocks) > 0:
            joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        for index_block, block in enumerate(self.single_transformer_blocks):
            joint = run_single(block, joint, temb, image_rotary_emb)
            if controlnet_single_block_samples is not None:
                interval = int(np.ceil(len(self.single_transformer_blocks) / len(controlnet_single_block_samples)))
                image = joint[:, text_len:] + controlnet_single_block_samples[index_block // interval]
                joint = torch.cat([joint[:, :text_len], image], dim=1)
        return hidden_states if joint is None else joint[:, text_len:]

    def _block_runners(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """How this call runs a double and a single block (`run_double_block` / `run_single_block` signatures):
        through gradient checkpointing while training with it, else the batch's compiled runners or the plain ones."""
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            checkpoint = self._gradient_checkpointing_func
            return (lambda block, *args: checkpoint(block, *args),
                    lambda block, *args: checkpoint(block.forward_joint, *args))
        ex = execution_of(self)
        return (ex and ex.block_runners) or (run_double_block, run_single_block)

    def _blocks_after_first(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                            temb: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        """`_blocks` from the second double block on, with tensor arguments only (what a CUDA graph is keyed by)."""
        return self._blocks(hidden_states, encoder_hidden_states, temb, (rope_cos, rope_sin), first=1)

    def _output(self, hidden_states: torch.Tensor, temb: torch.Tensor,
                return_dict: bool) -> torch.Tensor | Transformer2DModelOutput:
        hidden_states = self.norm_out(hidden_states, temb)
        output = self.proj_out(hidden_states)
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)
