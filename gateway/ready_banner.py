"""The lines `loragate serve` prints once the gateway listens: where, which models, and a
request to paste."""

from __future__ import annotations

import os

from gateway.auth import StateView
from gateway.config import GatewayConfig


def ready_banner(config: GatewayConfig, tokenizer_dir: str, view: StateView) -> str:
    """The banner for a gateway serving the model of tokenizer_dir, with the state it
    started on: the public adapters in it, and whether requests need a key (no key is ever
    printed: the curl reads it from the environment)."""
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    base = f"http://{f'[{host}]' if ':' in host else host}:{config.port}"
    model = config.served_model_name or os.path.basename(tokenizer_dir.rstrip("/"))
    adapters = sorted(name for name, record in view.snapshot.adapters.items()
                      if record.owner is None and not record.deleting)
    # Tenants in the state (an earlier start's) need their keys even without an admin key.
    key, says = ("LORAGATE_ADMIN_KEY", "the admin key; tenants use their own keys") \
        if config.admin_key else ("LORAGATE_API_KEY", "a tenant's API key: the state holds "
                                  "tenants, and without --admin-key only their keys work")
    auth = f"    -H \"Authorization: Bearer ${key}\" \\\n" if (
        config.admin_key or not view.open_mode) else ""
    lines = [f"loragate gateway listening on {base} (OpenAI API under {base}/v1)",
             f"models: {model} (base){''.join(', ' + a for a in adapters)}",
             "try:",
             f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
             f"{auth}    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", "
             f"\"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32, "
             f"\"temperature\": 0}}'"]
    if auth:
        lines.append(f"  (with {key} set to {says})")
    if adapters:
        lines.append(f"  (set \"model\" to an adapter name, e.g. \"{adapters[0]}\", to use it)")
    return "\n".join(lines)
