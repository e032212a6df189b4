"""What the fault tests share: tiny-model engines with 2 sequence slots (a third and fourth
request on one engine wait in its queue without a token), gateways in front of them, and
the request bodies and checks of a stream that ended normally."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.live_http import metric
from tests.live_servers import LiveServer, start_engine, start_gateway

MODEL = "tiny"
ENGINE_FLAGS = ("--num-kv-blocks", "512", "--max-num-seqs", "2")
GATEWAY_FLAGS = ("--served-model-name", MODEL)
PROMPT = list(range(40, 64))  # 24 tokens: room for 1000 new ones in the 1024-token context


@dataclass
class Fleet:
    """The processes one test module starts (all at once, then waited for together) and
    stops at its end."""

    model_dir: Path
    log_dir: Path
    started: list[LiveServer] = field(default_factory=list)

    def engine(self) -> LiveServer:
        self.started.append(start_engine(self.model_dir, self.log_dir, *ENGINE_FLAGS))
        return self.started[-1]

    def gateway(self, engines: list[LiveServer], *extra: str) -> LiveServer:
        self.started.append(start_gateway(self.model_dir, [e.url for e in engines],
                                          self.log_dir, *GATEWAY_FLAGS, *extra))
        return self.started[-1]

    def wait_ready(self) -> None:
        for server in self.started:
            server.wait_ready()

    def stop(self) -> None:
        for server in self.started:
            server.stop()


def body(max_tokens: int, stream: bool = False, prompt: list[int] | None = None,
         **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "prompt": prompt or PROMPT, "max_tokens": max_tokens,
                         "temperature": 0.0, "ignore_eos": True, "stream": stream, **extra}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


def assert_completed(events: list[Any], max_tokens: int) -> None:
    """A stream that ended normally: tokens, finish_reason "length", usage, [DONE]."""
    assert events[-1] == "[DONE]"
    assert not [e for e in events[:-1] if "error" in e], events
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == max_tokens
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    if events[0]["choices"][0]["logprobs"] is not None:  # every event carries its tokens
        counts = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events[:-2]]
        assert min(counts) >= 1 and sum(counts) == max_tokens, counts


def generated(engine: LiveServer) -> float:
    return metric(httpx.get(engine.url + "/metrics").text, "loragate_generation_tokens_total")
