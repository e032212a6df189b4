"""ModelShape: the numbers of a checkpoint's config that the engine needs."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from engine.models.rope import check_rope

CAUSAL_LM_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""model_type -> its causal-LM class in transformers: the families the engine serves."""
SUPPORTED_MODEL_TYPES = tuple(CAUSAL_LM_CLASSES)


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
    """The numbers of a checkpoint's config that the engine needs."""

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
    """Qwen3: RMSNorm over each query and key head before rope."""
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelShape:
        model_type = config.model_type
        check_architecture(model_type, getattr(config, "architectures", None))
        check_rope(config)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        sliding_window: int | None = None
        if model_type == "mistral":
            sliding_window = getattr(config, "sliding_window", None)
        if model_type == "qwen2":
            attention_bias = True  # Qwen2 has q/k/v biases and no o bias, by definition
        if model_type in ("qwen2", "qwen3") and getattr(config, "use_sliding_window", False):
            # Qwen's window covers only some layers (max_window_layers): not served.
            raise ValueError(f"{model_type} with use_sliding_window=True is not supported")
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
            qkv_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_window=sliding_window,
        )
