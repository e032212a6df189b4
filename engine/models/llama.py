"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat, unpadded batch of tokens.

The families differ only in switches of ModelShape: q/k/v biases (Qwen2), a per-head
RMSNorm of q and k before rope (Qwen3), a sliding attention window (Mistral). Each layer
fixes at construction which window's attention metadata and which rope table it reads, so
models whose layers differ (Gemma, engine/models/gemma.py, built from these parts) cost the
others nothing.

Parameter names equal the Hugging Face checkpoint's, except the merged projections: q/k/v
(``self_attn.qkv_proj``) and gate/up (``mlp.gate_up_proj``) are one GEMM each, whose weights
the loader concatenates from the checkpoint's tensors (engine/models/loader.py). Every
forward takes T tokens of any number of requests at once; only attention needs to know
where one request ends (AttentionMetadata).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.cpu_kernels import FusedOps
from engine.models.shape import ModelShape
from lora.cpu_gemm import linear
from lora.layers import LoraLinear
from lora.ops import LoraBatchMetadata

RopeTables = list[tuple[torch.Tensor, torch.Tensor]]
"""Per rope kind (ModelShape.rope_kinds): the step's cos and sin, each [T, 1, head_dim]."""
StepMetadata = Mapping[int | None, AttentionMetadata]
"""The step's attention metadata per sliding window (None: full attention)."""
NormFactory = Callable[[int, float], nn.Module]
"""(dim, eps) -> an RMSNorm module."""

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "gelu_pytorch_tanh": partial(nn.functional.gelu, approximate="tanh"),
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, H, D] and k [T, Hkv, D] with cos, sin [T, 1, D]."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


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

    def __init__(self, shape: ModelShape, layer: int, norm: NormFactory = RMSNorm) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shape.num_heads, shape.num_kv_heads, shape.head_dim)
        self.sliding_window = shape.layer_windows[layer]
        self.rope = shape.layer_rope[layer]
        self.softcap = shape.attn_softcap
        h = shape.hidden_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one GEMM; checkpoints and adapters still name them apart (the
        # loader concatenates their weights, LoraLinear keeps one adapter slice each).
        self.qkv_proj = LoraLinear(h, (("q_proj", self.q_size), ("k_proj", self.kv_size),
                                       ("v_proj", self.kv_size)), bias=shape.qkv_bias)
        self.o_proj = LoraLinear(self.q_size, (("o_proj", h),), bias=shape.o_bias)
        # Qwen3, Gemma 3: RMSNorm over each head's head_dim features, one weight for all heads.
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if shape.qk_norm:
            self.q_norm = norm(self.head_dim, shape.rms_norm_eps)
            self.k_norm = norm(self.head_dim, shape.rms_norm_eps)
        self.scale = shape.attn_scale
        self.fused: FusedOps | None = None
        """Set by LlamaForFlatBatch.use_fused_ops: rope in place by the compiled op."""

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        ropes: RopeTables,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metas: StepMetadata,
        lora: LoraBatchMetadata | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = ropes[self.rope]
        q, k, v = self.qkv_proj(x, lora).split((self.q_size, self.kv_size, self.kv_size), -1)
        q = q.view(t, self.num_heads, self.head_dim)  # views into the [T, q + 2 kv] output
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # before rope, as Qwen3 does
        if self.fused is not None:
            self.fused.rotary_(q, k, cos, sin)  # in place: q, k are this step's own tensors
        else:
            q, k = apply_rope(q, k, cos, sin)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], metas[self.sliding_window],
                              self.scale, self.softcap)
        return self.o_proj(out.reshape(t, self.q_size), lora)


class MLP(nn.Module):
    """Gated feed-forward: SwiGLU, or GeGLU (tanh-approximated GELU) for Gemma."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        h, i, b = shape.hidden_size, shape.intermediate_size, shape.mlp_bias
        # gate and up in one GEMM (merged like q/k/v in Attention).
        self.gate_up_proj = LoraLinear(h, (("gate_proj", i), ("up_proj", i)), bias=b)
        self.down_proj = LoraLinear(i, (("down_proj", h),), bias=b)
        self.act = _ACTIVATIONS[shape.hidden_act]
        self.silu = shape.hidden_act == "silu"
        self.fused: FusedOps | None = None
        """Set by LlamaForFlatBatch.use_fused_ops: SiLU-and-multiply by the compiled op."""

    def forward(self, x: torch.Tensor, lora: LoraBatchMetadata | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if self.fused is not None and self.silu:
            return self.down_proj(self.fused.silu_and_mul(gate_up), lora)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, lora)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block with residuals."""

    def __init__(self, shape: ModelShape, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(shape, layer)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, ropes: RopeTables,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metas: StepMetadata,
                lora: LoraBatchMetadata | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ropes, kv_cache, metas, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor, ropes: RopeTables,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], metas: StepMetadata,
                      lora: LoraBatchMetadata | None, fused: FusedOps,
                      next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with each residual add fused into the norm after it: h is
        input_layernorm(residual) on entry; returns (next_norm(out), out) for this layer's
        output ``out`` (the next layer's input norm, or the model's final one)."""
        attn = self.self_attn(h, ropes, kv_cache, metas, lora)
        norm = self.post_attention_layernorm
        h, residual = fused.add_rms_norm(attn, residual, norm.weight, norm.eps)
        return fused.add_rms_norm(self.mlp(h, lora), residual, next_norm.weight, next_norm.eps)


class DecoderModel(nn.Module):
    """Embedding, layers and final norm (the checkpoint's ``model.`` prefix)."""

    def __init__(self, shape: ModelShape, layer: Callable[[ModelShape, int], nn.Module],
                 norm: NormFactory) -> None:
        super().__init__()
        # Given its weight, the embedding skips its random init: the weights are the
        # checkpoint's (loader.py), and normal_ under a device context imports torch._dynamo
        # (a second of every engine's start).
        self.embed_tokens = nn.Embedding(
            shape.vocab_size, shape.hidden_size,
            _weight=torch.empty(shape.vocab_size, shape.hidden_size))
        self.layers = nn.ModuleList(layer(shape, i) for i in range(shape.num_layers))
        self.norm = norm(shape.hidden_size, shape.rms_norm_eps)


class LlamaForFlatBatch(nn.Module):
    """The whole causal LM. forward() returns hidden states; compute_logits() applies the
    LM head to the rows that are sampled only.

    cos, sin: [len(shape.rope_kinds), max_positions, head_dim] rope tables.
    """

    layer_class: Callable[[ModelShape, int], nn.Module] = DecoderLayer
    norm_class: NormFactory = RMSNorm

    def __init__(self, shape: ModelShape, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        self.model = DecoderModel(shape, self.layer_class, self.norm_class)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.fused_ops: FusedOps | None = None
        """The compiled ops in use (use_fused_ops), None: eager ops."""
        self._fused_layers: list[DecoderLayer] = []
        """The layers run by forward_fused (Llama-style layers and norms, with fused_ops)."""

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Run rope and SiLU-and-multiply through ``ops`` (None: the eager ops again), and for
        Llama-style layers and norms the residual adds and RMSNorms too (other layer or norm
        classes keep theirs: Gemma's norms scale by 1 + weight, after the cast)."""
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.fused = ops
        self.fused_ops = ops
        layers = [m for m in self.model.layers if isinstance(m, DecoderLayer)]
        fusable = (ops is not None and self.norm_class is RMSNorm
                   and len(layers) == len(self.model.layers))
        self._fused_layers = layers if fusable else []

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metas: StepMetadata,
        lora: LoraBatchMetadata | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed(input_ids)
        cos = self.rope_cos[:, positions].to(x.dtype).unsqueeze(2)  # [K, T, 1, head_dim]
        sin = self.rope_sin[:, positions].to(x.dtype).unsqueeze(2)
        ropes = list(zip(cos.unbind(0), sin.unbind(0), strict=True))
        if self._fused_layers and self.fused_ops is not None:
            return self._forward_fused(x, ropes, kv_caches, metas, lora, self.fused_ops)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, ropes, kv_cache, metas, lora)
        return self.model.norm(x)

    def _forward_fused(self, x: torch.Tensor, ropes: RopeTables,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metas: StepMetadata,
                       lora: LoraBatchMetadata | None, fused: FusedOps) -> torch.Tensor:
        layers = self._fused_layers
        first = layers[0].input_layernorm
        h, residual = fused.rms_norm(x, first.weight, first.eps), x
        final = self.model.norm
        assert isinstance(final, RMSNorm)  # a condition of _fused_layers
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final
            h, residual = layer.forward_fused(h, residual, ropes, kv_cache, metas, lora, fused,
                                              nxt)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight, self.lm_head.bias).float()
