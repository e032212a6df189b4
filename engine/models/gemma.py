"""Gemma 2 and Gemma 3 (text) over a flat batch, built from the Llama-family parts.

What differs from Llama, as transformers' modeling_gemma2.py / modeling_gemma3.py define it:

- every RMSNorm scales by (1 + weight), in fp32, and casts back after the weight;
- each layer norms the attention and the MLP outputs too (four norms per layer);
- the MLP is GeGLU (tanh-approximated GELU), the attention scale query_pre_attn_scalar ** -0.5;
- the embeddings are multiplied by sqrt(hidden_size) rounded to the embedding dtype;
- sliding-window ("local") and full ("global") layers alternate (ModelShape.layer_windows);
  Gemma 3's local layers also read their own rope table, and Gemma 3 norms q and k;
- Gemma 2 soft-caps attention scores; both may soft-cap the final logits.

Parameter names equal the checkpoint's, as for Llama.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.llama import MLP, Attention, LlamaForFlatBatch, RopeTables, StepMetadata
from engine.models.shape import ModelShape
from lora.ops import LoraBatchMetadata


class GemmaRMSNorm(nn.Module):
    """RMSNorm times (1 + weight), all in fp32, cast back at the end (as transformers does;
    Llama's casts before the weight). The weight is stored as an offset from one."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    """Attention and MLP, each between a pre-norm and a post-norm, with residuals."""

    def __init__(self, shape: ModelShape, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(shape, layer, norm=GemmaRMSNorm)
        self.mlp = MLP(shape)
        h, eps = shape.hidden_size, shape.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, ropes: RopeTables,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metas: StepMetadata,
                lora: LoraBatchMetadata | None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), ropes, kv_cache, metas, lora)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x), lora)
        return x + self.post_feedforward_layernorm(mlp)


class GemmaForFlatBatch(LlamaForFlatBatch):
    """The Gemma causal LM: Gemma layers and norms, scaled embeddings, capped logits."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, shape: ModelShape, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__(shape, cos, sin)
        self.embed_scale = shape.hidden_size ** 0.5
        self._scale_in: dict[torch.dtype, float] = {}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        scale = self._scale_in.get(x.dtype)
        if scale is None:
            # transformers multiplies by the scale cast to the embedding dtype (bfloat16 turns
            # sqrt(3072) = 55.43 into 55.5); a Python float of that value multiplies alike.
            scale = self._scale_in[x.dtype] = float(
                torch.tensor(self.embed_scale).to(x.dtype))
        return x * scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.shape.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
