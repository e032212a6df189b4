"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat, unpadded batch of tokens.

The families differ only in switches of ModelShape: q/k/v biases (Qwen2), a per-head
RMSNorm of q and k before rope (Qwen3), a sliding attention window (Mistral).

Parameter names equal the Hugging Face checkpoint's, so a checkpoint loads with a plain
load_state_dict. Every forward takes T tokens of any number of requests at once; only
attention needs to know where one request ends (AttentionMetadata).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.models.shape import ModelShape
from lora.layers import LoraLinear
from lora.ops import LoraBatchMetadata


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(nn.Module):
    """Self-attention with GQA and rotary embeddings over paged KV."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shape.num_heads, shape.num_kv_heads, shape.head_dim)
        self.sliding_window = shape.sliding_window
        h = shape.hidden_size
        self.q_proj = LoraLinear(h, self.num_heads * self.head_dim, bias=shape.qkv_bias)
        self.k_proj = LoraLinear(h, self.num_kv_heads * self.head_dim, bias=shape.qkv_bias)
        self.v_proj = LoraLinear(h, self.num_kv_heads * self.head_dim, bias=shape.qkv_bias)
        self.o_proj = LoraLinear(self.num_heads * self.head_dim, h, bias=shape.o_bias)
        # Qwen3: RMSNorm over each head's head_dim features, one weight shared by all heads.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if shape.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, shape.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, shape.rms_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora: LoraBatchMetadata | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x, lora).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x, lora).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, lora).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # before rope, as Qwen3 does
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim), lora)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        h, i, b = shape.hidden_size, shape.intermediate_size, shape.mlp_bias
        self.gate_proj = LoraLinear(h, i, bias=b)
        self.up_proj = LoraLinear(h, i, bias=b)
        self.down_proj = LoraLinear(i, h, bias=b)

    def forward(self, x: torch.Tensor, lora: LoraBatchMetadata | None) -> torch.Tensor:
        gated = nn.functional.silu(self.gate_proj(x, lora)) * self.up_proj(x, lora)
        return self.down_proj(gated, lora)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block with residuals."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                lora: LoraBatchMetadata | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class DecoderModel(nn.Module):
    """Embedding, layers and final norm (the checkpoint's ``model.`` prefix)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaForFlatBatch(nn.Module):
    """The whole causal LM. forward() returns hidden states; compute_logits() applies the
    LM head to the rows that are sampled only."""

    def __init__(self, shape: ModelShape, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        self.model = DecoderModel(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: LoraBatchMetadata | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.model.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, head_dim]
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta, lora)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
