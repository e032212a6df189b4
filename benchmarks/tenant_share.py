"""One tenant's many-sample request beside another tenant's short one: how long the short one
waits while the engine's batch is full of the other tenant's sequences.

    python -m benchmarks.tenant_share [--model DIR] [--samples 128] [--max-tokens 200]

Starts `loragate serve` (one in-process engine, an admin key, two tenants of one tier), then:
the victim's 16-token chat alone (baseline); a completion with n=--samples x --max-tokens
from the hog; 5 s later (the hog's sequences fill the batch) the victim's chat again; the
victim once more after the hog ended. Prints each time and the hog's. With fair shares of
the batch (engine/tenant_share.py) the victim takes a slot of the hog's at once and answers
at the pace of a full batch's steps; without them it waits for the hog's sequences to end.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.gateway_process import start_gateway, stop_gateway
from benchmarks.tenancy_bench import ADMIN, make_tenant
from engine.default_model import default_model_dir


def _chat(url: str, key: str, model: str) -> float:
    started = time.monotonic()
    response = httpx.post(url + "/v1/chat/completions", timeout=900.0,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": model, "messages": [{"role": "user",
                                                              "content": "Say hi"}],
                                "max_tokens": 16, "temperature": 0})
    response.raise_for_status()
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args(argv)
    model = Path(args.model).name
    gateway = start_gateway(args.model, [], {}, Path(tempfile.mkdtemp(prefix="tenant-share-")),
                            "--admin-key", ADMIN)
    try:
        with httpx.Client(timeout=60.0) as client:
            hog_key, victim_key = (make_tenant(client, gateway.url, name)
                                   for name in ("hog", "victim"))
        report: dict[str, Any] = {"victim_alone_s": _chat(gateway.url, victim_key, model)}

        def hog() -> None:
            started = time.monotonic()
            httpx.post(gateway.url + "/v1/completions", timeout=1800.0,
                       headers={"Authorization": f"Bearer {hog_key}"},
                       json={"model": model, "prompt": "Once upon a time",
                             "n": args.samples, "max_tokens": args.max_tokens,
                             "temperature": 1.0, "ignore_eos": True}).raise_for_status()
            report["hog_s"] = time.monotonic() - started

        thread = threading.Thread(target=hog)
        thread.start()
        time.sleep(5.0)  # the hog's sequences are in the batch
        report["victim_beside_hog_s"] = _chat(gateway.url, victim_key, model)
        thread.join()
        report["victim_after_s"] = _chat(gateway.url, victim_key, model)
    finally:
        stop_gateway(gateway)
    print(json.dumps({k: round(v, 2) for k, v in report.items()}, indent=2))
    return report


if __name__ == "__main__":
    main()
