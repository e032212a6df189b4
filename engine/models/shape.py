"""ModelShape: the numbers of a checkpoint's config that the engine needs."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelShape:
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
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
            if getattr(config, "use_sliding_window", False):
                raise ValueError("Qwen2 with use_sliding_window=True is not supported")
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
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_window=sliding_window,
        )
