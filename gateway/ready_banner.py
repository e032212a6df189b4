"""The lines `loragate serve` prints once the gateway listens: where, which models, and a
request to paste."""

from __future__ import annotations

import os

from gateway.config import GatewayConfig


def ready_banner(config: GatewayConfig, tokenizer_dir: str, adapters: dict[str, str]) -> str:
    """The banner for a gateway serving the model of tokenizer_dir and these adapters (the
    admin key is never printed: the curl reads it from the environment)."""
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    base = f"http://{f'[{host}]' if ':' in host else host}:{config.port}"
    model = config.served_model_name or os.path.basename(tokenizer_dir.rstrip("/"))
    # The admin key itself never goes to the terminal (or to a log that keeps it).
    auth = ("    -H \"Authorization: Bearer $LORAGATE_ADMIN_KEY\" \\\n"
            if config.admin_key else "")
    lines = [f"loragate gateway listening on {base} (OpenAI API under {base}/v1)",
             f"models: {model} (base){''.join(', ' + a for a in sorted(adapters))}",
             "try:",
             f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
             f"{auth}    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", "
             f"\"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32, "
             f"\"temperature\": 0}}'"]
    if config.admin_key:
        lines.append("  (with LORAGATE_ADMIN_KEY set to the admin key; tenants use their own "
                     "keys)")
    if adapters:
        lines.append(f"  (set \"model\" to an adapter name, e.g. \"{sorted(adapters)[0]}\", "
                     f"to use it)")
    return "\n".join(lines)
