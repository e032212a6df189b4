"""ModelShape: the numbers of a checkpoint's config that the engine needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from engine.models.rope import check_rope
from lora.targets import SUPPORTED_MODULES, LoraTargets

CAUSAL_LM_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
"""model_type -> its causal-LM class in transformers: the families the engine serves."""
SUPPORTED_MODEL_TYPES = tuple(CAUSAL_LM_CLASSES)
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
"""Served by engine/models/gemma.py: (1 + weight) RMSNorms, a norm before and after both
attention and the MLP, GeGLU, embeddings scaled by sqrt(hidden_size)."""
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_architecture(model_type: object, architectures: object) -> None:
    """Raise ValueError naming the checkpoint's architecture unless the engine serves it.

    model_type and architectures are config.json's own fields (read before transformers
    parses the config, so a model type transformers does not know gets this message too).
    A listed architecture must be one of the served causal-LM classes: a Llama-shaped
    checkpoint with another head (``LlamaForSequenceClassification``) is refused.
    """
    names = [str(a) for a in architectures] if isinstance(architectures, list) else []
    served = ", ".join(f"{cls} ({t})" for t, cls in CAUSAL_LM_CLASSES.items())
    if not isinstance(model_type, str) or model_type not in CAUSAL_LM_CLASSES:
        arch = f" (architecture {', '.join(names)})" if names else ""
        raise ValueError(f"model type {model_type!r} is not supported{arch}; "
                         f"supported: {served}")
    if names and not set(names) & set(CAUSAL_LM_CLASSES.values()):
        raise ValueError(f"architecture {', '.join(names)} is not supported (model type "
                         f"{model_type!r} is served as {CAUSAL_LM_CLASSES[model_type]}); "
                         f"supported: {served}")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a checkpoint's config that the engine needs.

    Everything that differs between layers (window, rope) is a per-layer tuple decided here
    at load, so the forward never branches per token.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    """Qwen3, Gemma 3: RMSNorm over each query and key head before rope."""
    o_bias: bool
    mlp_bias: bool
    layer_windows: tuple[int | None, ...]
    """Per layer: the sliding window W (a query at position p sees keys in (p - W, p]), or
    None for full causal attention. Mistral: W on every layer; Gemma: W on the
    "sliding_attention" layers only."""
    rope_kinds: tuple[str | None, ...]
    """The rope tables the model keeps: (None,) is the config's one rope; Gemma 3 has two,
    the global ("full_attention") and the local ("sliding_attention") one."""
    layer_rope: tuple[int, ...]
    """Per layer: index into rope_kinds."""
    attn_scale: float
    """Softmax scale of attention scores: head_dim ** -0.5; Gemma: query_pre_attn_scalar
    ** -0.5."""
    hidden_act: str = "silu"
    """Activation of the gated MLP: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)."""
    attn_softcap: float | None = None
    """Gemma 2: scores become cap * tanh(scores / cap) before the mask and softmax."""
    final_softcap: float | None = None
    """Gemma 2 / 3: logits become cap * tanh(logits / cap)."""

    @property
    def is_gemma(self) -> bool:
        return self.model_type in GEMMA_MODEL_TYPES

    def lora_targets(self) -> LoraTargets:
        """The (in, out) features of each projection an adapter may patch."""
        h, i = self.hidden_size, self.intermediate_size
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        dims = {"q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out),
                "o_proj": (q_out, h), "gate_proj": (h, i), "up_proj": (h, i),
                "down_proj": (i, h)}
        return LoraTargets(self.num_layers, tuple(dims[m] for m in SUPPORTED_MODULES),
                           self.model_type)

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelShape:
        model_type = config.model_type
        check_architecture(model_type, getattr(config, "architectures", None))
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if model_type in GEMMA_MODEL_TYPES:
            family = _gemma_fields(config)
        else:
            family = _llama_fields(config)
            family["attn_scale"] = head_dim ** -0.5
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            **family,
        )


def _llama_fields(config: PretrainedConfig) -> dict[str, Any]:
    """The switches of Llama, Mistral, Qwen2 and Qwen3."""
    model_type = config.model_type
    check_rope(config)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
    attention_bias = bool(getattr(config, "attention_bias", False))
    sliding_window: int | None = None
    if model_type == "mistral":
        sliding_window = getattr(config, "sliding_window", None)
    if model_type == "qwen2":
        attention_bias = True  # Qwen2 has q/k/v biases and no o bias, by definition
    if model_type in ("qwen2", "qwen3") and getattr(config, "use_sliding_window", False):
        # Qwen's window covers only some layers (max_window_layers): not served.
        raise ValueError(f"{model_type} with use_sliding_window=True is not supported")
    return dict(
        qkv_bias=attention_bias,
        qk_norm=model_type == "qwen3",
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        layer_windows=(sliding_window,) * config.num_hidden_layers,
        rope_kinds=(None,),
        layer_rope=(0,) * config.num_hidden_layers,
    )


def _gemma_fields(config: PretrainedConfig) -> dict[str, Any]:
    """The switches of Gemma 2 and Gemma 3 (text), as transformers' modeling_gemma2/3 use
    them. Gemma 3 has q/k norms and a local rope for its sliding layers; its attention
    ignores ``attn_logit_softcapping`` (transformers' Gemma3Attention never applies it:
    Gemma 3 replaced the soft-capping with the q/k norms), so the engine ignores it too."""
    model_type = config.model_type
    gemma3 = model_type == "gemma3_text"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{model_type} with hidden_activation {act!r} is not supported "
                         f"(only gelu_pytorch_tanh)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{model_type} with use_bidirectional_attention=True (an embedding "
                         f"model) is not supported")
    layer_types = tuple(config.layer_types)
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown or len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"{model_type} layer_types must name one of {', '.join(LAYER_TYPES)} "
                         f"per layer ({config.num_hidden_layers}), got {list(layer_types)}")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"{model_type} has sliding_attention layers but sliding_window "
                         f"{window!r} is not a positive integer")
    rope_kinds: tuple[str | None, ...] = LAYER_TYPES if gemma3 else (None,)
    for kind in rope_kinds:
        check_rope(config, kind)
    attention_bias = bool(getattr(config, "attention_bias", False))
    final_cap = getattr(config, "final_logit_softcapping", None)
    attn_cap = None if gemma3 else getattr(config, "attn_logit_softcapping", None)
    return dict(
        qkv_bias=attention_bias,
        qk_norm=gemma3,
        o_bias=attention_bias,
        mlp_bias=False,
        layer_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
        rope_kinds=rope_kinds,
        layer_rope=tuple(rope_kinds.index(t) if gemma3 else 0 for t in layer_types),
        hidden_act=act,
        attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attn_softcap=float(attn_cap) if attn_cap else None,
        final_softcap=float(final_cap) if final_cap else None,
    )
