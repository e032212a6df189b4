"""Hostile clients against a live gateway, each beside a victim that must not notice.

Part of benchmarks/reliability.py (`--parts adversarial` runs it alone). Six attacks:

1. hang-ups under load: two clients keep the engines in long prefills while --hangups
   streaming requests are reset (TCP RST) 20-600 ms after they were sent;
2. hostile parameters: out-of-range seeds, top_k, token ids, NaN, lone surrogates, huge
   lists, while a victim streams on the same engines;
3. a 2 MB prompt (completions and chat) while a victim streams;
4. chat bodies of nearly 8 MB made of tiny content parts (4096 messages x 60 empty parts)
   ending in an invalid field, sent back to back while a victim streams: what validating
   them costs the event loop every other request shares;
5. a flood of new grammars that each compile past the timeout (five at once, from
   127.0.0.1), and two seconds later a new small schema from another client address
   (127.0.0.2) and one from the flooding address: how long each waits for its turn;
6. a regex whose matching grows with every token (``((a|aa)*){1,100}c``, held to "a"
   tokens by allowed_token_ids) while a victim streams: how long the victim's stream
   stalls, and how the attacker is answered.

Counted: engines alive and ready afterwards, the busy clients' and victims' streams clean
(every token, no error event), the victims' longest gap between two streamed events, the
attackers' HTTP statuses (all must be 4xx), KV blocks still held once everything ended.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import socket
import struct
import time
from collections import Counter
from typing import Any

import httpx

HOSTILE_BODIES: dict[str, str] = {
    "seed 2**64": '{"seed": 18446744073709551616}',
    "seed -2**63-1": '{"seed": -9223372036854775809}',
    "top_k 2**63": '{"top_k": 9223372036854775808, "temperature": 1}',
    "temperature NaN": '{"temperature": NaN}',
    "top_p Infinity": '{"top_p": Infinity}',
    "max_tokens 2**40": '{"max_tokens": 1099511627776}',
    "logprobs 1000": '{"logprobs": 1000}',
    "token id 2**40": '{"prompt": [1099511627776]}',
    "token id -1": '{"prompt": [-1, 5]}',
    "lone surrogate": '{"prompt": "abc \\ud800 def"}',
    "stop list of 10,000": '{"stop": ' + json.dumps(["x"] * 10_000) + "}",
    "priority 2**70": '{"priority": 1180591620717411303424}',
}
"""Each merged into an otherwise valid completions body (prompt "hello", max_tokens 8)."""


def _merge(model: str, override: str) -> bytes:
    base = {"model": model, "prompt": "hello", "max_tokens": 8}
    # Merge as text: json.loads would turn NaN into a float and the surrogate into str.
    head = json.dumps(base)[:-1]
    return (head + ", " + override.strip()[1:]).encode()


async def _victim(client: httpx.AsyncClient, model: str, max_tokens: int) -> dict[str, Any]:
    """One long streamed request; its longest gap between events and whether it was clean."""
    body = {"model": model, "prompt": [5 + i % 300 for i in range(64)], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    start = time.monotonic()
    stamps: list[float] = []
    errors = 0
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            stamps.append(time.monotonic())
            event = json.loads(line[6:])
            errors += "error" in event
            tokens += bool(event.get("choices"))
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"status": response.status_code, "clean": errors == 0 and tokens >= max_tokens,
            "ttft_s": (stamps[0] - start) if stamps else None,
            "max_gap_s": max(gaps, default=0.0)}


def _reset_after(url: str, body: bytes, delay_s: float, path: str = "/v1/completions") -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        time.sleep(delay_s)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def hangups(url: str, model: str, count: int, seed: int = 11) -> dict[str, Any]:
    rng = random.Random(seed)
    stop = asyncio.Event()
    busy: list[dict[str, Any]] = []

    async def keep_busy(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            body = {"model": model, "prompt": [5 + i % 300 for i in range(1500)],
                    "max_tokens": 8, "stream": True, "ignore_eos": True}
            outcome: dict[str, Any] = {"clean": False}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                events = [json.loads(line[6:]) async for line in response.aiter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
                outcome = {"clean": response.status_code == 200
                           and not any("error" in e for e in events)}
            busy.append(outcome)

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        workers = [asyncio.create_task(keep_busy(client)) for _ in range(2)]
        resets = []
        for i in range(count):
            body = json.dumps({"model": model, "stream": True, "max_tokens": 64,
                               "prompt": [5 + (i + j) % 300 for j in range(rng.randint(40, 800))],
                               "ignore_eos": True}).encode()
            resets.append(asyncio.to_thread(_reset_after, url, body, rng.uniform(0.02, 0.6)))
            await asyncio.sleep(rng.uniform(0, 0.05))
        await asyncio.gather(*resets)
        stop.set()
        await asyncio.gather(*workers)
    return {"resets": count, "busy_requests": len(busy),
            "busy_clean": sum(b["clean"] for b in busy)}


async def hostile_parameters(url: str, model: str) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        victim = asyncio.create_task(_victim(client, model, 128))
        for _ in range(3):  # several rounds while the victim streams
            for name, override in HOSTILE_BODIES.items():
                response = await client.post("/v1/completions", content=_merge(model, override),
                                             headers={"Content-Type": "application/json"})
                statuses[name] = response.status_code
        return {"statuses": statuses, "victim": await victim}


async def big_prompt(url: str, model: str, megabytes: float = 2.0) -> dict[str, Any]:
    text = "lorem ipsum dolor sit amet " * int(megabytes * (1 << 20) / 27)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        victim = asyncio.create_task(_victim(client, model, 128))
        await asyncio.sleep(0.5)  # the victim is streaming
        started = time.monotonic()
        completion = await client.post("/v1/completions", json={
            "model": model, "prompt": text, "max_tokens": 4})
        chat = await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4})
        answered_s = time.monotonic() - started
        return {"prompt_bytes": len(text), "completions_status": completion.status_code,
                "chat_status": chat.status_code, "attacker_answered_s": answered_s,
                "victim": await victim}


async def many_parts(url: str, model: str, bodies: int = 8) -> dict[str, Any]:
    part = {"type": "text", "text": ""}
    body = json.dumps({"model": model, "temperature": 5,
                       "messages": [{"role": "user", "content": [part] * 60}] * 4096}).encode()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        victim = asyncio.create_task(_victim(client, model, 128))
        await asyncio.sleep(0.5)  # the victim is streaming
        statuses: list[int] = []
        answers: list[float] = []
        for _ in range(bodies):
            started = time.monotonic()
            response = await client.post("/v1/chat/completions", content=body,
                                         headers={"Content-Type": "application/json"})
            answers.append(time.monotonic() - started)
            statuses.append(response.status_code)
        return {"body_bytes": len(body), "statuses": statuses,
                "attacker_answered_max_s": max(answers), "victim": await victim}


async def grammar_flood(url: str, model: str, slow: int = 5) -> dict[str, Any]:
    """Statuses and times of the flood (each spec new: a run never meets its own cache) and
    of the two small schemas (see the module docstring)."""
    run_id = random.randrange(1 << 30)

    async def post(local: str, schema: dict[str, Any]) -> tuple[int, float]:
        transport = httpx.AsyncHTTPTransport(local_address=local)
        async with httpx.AsyncClient(base_url=url, timeout=600, transport=transport) as client:
            started = time.monotonic()
            response = await client.post("/v1/completions", json={
                "model": model, "prompt": "hello", "max_tokens": 4,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "s", "schema": schema}}})
            return response.status_code, time.monotonic() - started

    # A bounded repeat of a bounded repeat: xgrammar takes tens of seconds to compile one.
    flood = [asyncio.create_task(post("127.0.0.1", {
        "type": "string", "pattern": f"{run_id}x{i}([a-z]{{1,100}}){{1,100}}"}))
        for i in range(slow)]
    await asyncio.sleep(2.0)  # the flood is queued behind its first compile
    other, same = await asyncio.gather(
        post("127.0.0.2", {"type": "string", "maxLength": 3 + run_id % 97}),
        post("127.0.0.1", {"type": "string", "maxLength": 100 + run_id % 97}))
    flooded = await asyncio.gather(*flood)
    return {"flood_statuses": [status for status, _ in flooded],
            "flood_answered_max_s": max(seconds for _, seconds in flooded),
            "other_client": {"status": other[0], "answered_s": other[1]},
            "flooding_client": {"status": same[0], "answered_s": same[1]}}


async def costly_matching(url: str, model: str, max_tokens: int = 60) -> dict[str, Any]:
    """Two victims (one per engine, as the router spreads them) beside the attacker."""
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        tokenized = await client.post("/tokenize", json={"model": model, "prompt": "a",
                                                         "add_special_tokens": False})
        victims = [asyncio.create_task(_victim(client, model, 400)) for _ in range(2)]
        await asyncio.sleep(0.5)  # the victims are streaming
        started = time.monotonic()
        response = await client.post("/v1/completions", json={
            "model": model, "prompt": "hello", "max_tokens": max_tokens,
            "guided_regex": "((a|aa)*){1,100}c",
            "allowed_token_ids": tokenized.json()["tokens"]})
        answered_s = time.monotonic() - started
        error = response.json().get("error") or {}
        return {"status": response.status_code, "code": error.get("code"),
                "attacker_answered_s": answered_s,
                "victims": list(await asyncio.gather(*victims))}


def run(url: str, model: str, hangup_count: int) -> dict[str, Any]:
    """All six attacks in turn; what to check is in the module docstring."""
    report = {"hangups": asyncio.run(hangups(url, model, hangup_count)),
              "hostile_parameters": asyncio.run(hostile_parameters(url, model)),
              "big_prompt": asyncio.run(big_prompt(url, model)),
              "many_parts": asyncio.run(many_parts(url, model)),
              "grammar_flood": asyncio.run(grammar_flood(url, model)),
              "costly_matching": asyncio.run(costly_matching(url, model))}
    codes = Counter(report["hostile_parameters"]["statuses"].values())
    report["hostile_parameters"]["status_counts"] = {str(k): v for k, v in codes.items()}
    return report
