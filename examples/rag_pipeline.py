"""A RAG backend on loragate: BM25 retrieval over a real corpus, cache-friendly prompts, two
tenants with their own adapters, streamed answers, and a summary from the gateway's metrics.

    loragate serve --admin-key secret            # (or ./dev.sh serve --admin-key secret)
    python examples/rag_pipeline.py --admin-key secret

With --admin-key the script creates two tenants (docs-team, support-team), gives each its own
adapter (registered through the admin API from the demo adapters' directories) and a key,
and asks through those keys; without it (a gateway in open mode) it uses the demo adapters
directly and keeps the tenants apart with a cache_salt each. On the default model
(SmolLM2-135M-Instruct) the answers are real, if short of what a larger model would say; on a
random-weight model from `loragate make-demo` they are gibberish, and the retrieval, the prompt
layout, the streaming, the adapters and the prefix cache work all the same.

Prompt layout (stable, so repeated documents become cached prefixes): the system prompt, then
the retrieved passages in ascending passage id, then the question.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import Passage, Retriever, load_passages

SYSTEM_PROMPT = (
    "You are the documentation assistant of a Python platform team. Answer only from the "
    "documents given below; quote the relevant rule, name the construct it applies to, and "
    "say so plainly when the documents do not contain the answer. Keep answers short."
)
QUESTIONS = {
    "docs-team": [
        "How does the with statement call __enter__ and __exit__?",
        "What does the global statement do inside a function?",
        "How are augmented assignment statements like += evaluated?",
        "What happens when a with statement has several context managers?",
        "How does try/finally interact with return?",
        "What is the difference between global and nonlocal?",
    ],
    "support-team": [
        "How do I write an async for loop?",
        "What does the await expression do?",
        "How does the with statement call __enter__ and __exit__?",
        "How are slicings evaluated?",
        "What does the assert statement do when optimizations are on?",
        "How do async with statements work?",
    ],
}


@dataclass
class TenantRun:
    name: str
    model: str
    api_key: str
    cache_salt: str | None
    ttft_s: list[float] = field(default_factory=list)
    tokens: int = 0


def build_messages(passages: list[Passage], question: str) -> list[ChatCompletionMessageParam]:
    documents = "\n\n".join(f"[doc {p.passage_id}: {p.topic}]\n{p.text}" for p in passages)
    return [{"role": "system", "content": f"{SYSTEM_PROMPT}\n\nDocuments:\n{documents}"},
            {"role": "user", "content": question}]


def setup_tenants(base_url: str, admin_key: str | None) -> list[TenantRun]:
    """Two tenants with an adapter each (see the module docstring)."""
    if admin_key is None:
        first, second = served_adapters(base_url)
        return [TenantRun("docs-team", first, "unused", "docs-team"),
                TenantRun("support-team", second, "unused", "support-team")]
    headers = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=60.0) as admin:
        listed = admin.get("/admin/adapters").json()
        paths = {a["name"]: a["path"] for a in listed}
        public = sorted(a["name"] for a in listed if a["owner"] is None)
        if len(public) < 2:
            raise SystemExit("the gateway serves fewer than two public adapters: start it on "
                             "a model with an adapters/ directory, or pass --lora twice")
        runs = []
        for tenant, demo, adapter in (("docs-team", public[0], "docs-bot"),
                                      ("support-team", public[1], "support-bot")):
            admin.post("/admin/tenants", json={"tenant_id": tenant, "rpm": 600})  # 409 if rerun
            if adapter not in paths:
                admin.post("/admin/adapters", json={
                    "name": adapter, "path": paths[demo], "owner": tenant}).raise_for_status()
            key = admin.post(f"/admin/tenants/{tenant}/keys").json()["key"]
            runs.append(TenantRun(tenant, adapter, key, None))
    return runs


def served_adapters(base_url: str) -> tuple[str, str]:
    """The first two adapters the gateway serves (open mode: every adapter is listed)."""
    models = httpx.get(base_url + "/v1/models", timeout=60.0).json()["data"]
    adapters = sorted(m["id"] for m in models if m.get("parent"))
    if len(adapters) < 2:
        raise SystemExit("the gateway serves fewer than two adapters: start it on a model "
                         "with an adapters/ directory, or pass --lora twice")
    return adapters[0], adapters[1]


def ask(client: OpenAI, run: TenantRun, messages: list[ChatCompletionMessageParam],
        max_tokens: int, temperature: float) -> None:
    start = time.perf_counter()
    first: float | None = None
    extra = {"cache_salt": run.cache_salt} if run.cache_salt else {}
    stream = client.chat.completions.create(
        model=run.model, messages=messages, max_tokens=max_tokens, temperature=temperature, seed=1,
        stream=True, stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            run.tokens += chunk.usage.completion_tokens
    print()
    run.ttft_s.append(first if first is not None else time.perf_counter() - start)


def histogram_mean(text: str, name: str) -> float:
    total = sum(float(v) for v in re.findall(rf"^{name}_sum(?:{{[^}}]*}})? (\S+)", text, re.M))
    count = sum(float(v) for v in re.findall(rf"^{name}_count(?:{{[^}}]*}})? (\S+)", text, re.M))
    return total / count if count else 0.0


def summary(base_url: str, runs: list[TenantRun], admin_key: str | None, rounds: int) -> None:
    print("\n=== summary ===")
    for run in runs:
        # Each round asks the same questions: from the second on, every prompt is cached.
        per_round = len(run.ttft_s) // rounds
        by_round = ", ".join(
            f"{statistics.median(run.ttft_s[r * per_round:(r + 1) * per_round]) * 1000:.0f} ms"
            for r in range(rounds))
        print(f"{run.name:<13} model={run.model:<12} requests={len(run.ttft_s)} "
              f"TTFT p50 by round: {by_round}; completion tokens={run.tokens}")
    # /metrics and /instances are the operator's: they need the admin key when one is set.
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    metrics = httpx.get(base_url + "/metrics", headers=headers, timeout=10.0).text
    ttft = histogram_mean(metrics, "loragate_gateway_time_to_first_token_seconds")
    e2e = histogram_mean(metrics, "loragate_gateway_e2e_request_latency_seconds")
    print(f"gateway: mean TTFT {ttft * 1000:.0f} ms, mean E2E {e2e * 1000:.0f} ms")
    for instance in httpx.get(base_url + "/instances", headers=headers, timeout=10.0).json():
        print(f"engine {instance['instance_id']}: prefix-cache hit rate "
              f"{instance['prefix_hit_rate']:.1%} (since it started), resident adapters "
              f"{instance['resident']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--admin-key", default=None)
    parser.add_argument("--k", type=int, default=3, help="passages per question")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (the default): greedy, the same answer every time")
    parser.add_argument("--rounds", type=int, default=1,
                        help="ask every question this many times (repeats hit the cache)")
    args = parser.parse_args(argv)

    passages = load_passages()
    retriever = Retriever(passages)
    print(f"corpus: {len(passages)} passages from the Python Language Reference")
    runs = setup_tenants(args.base_url, args.admin_key)
    for _ in range(args.rounds):
        for index in range(max(len(q) for q in QUESTIONS.values())):
            for run in runs:
                questions = QUESTIONS[run.name]
                if index >= len(questions):
                    continue
                question = questions[index]
                found = retriever.search(question, args.k)
                print(f"\n[{run.name} -> {run.model}] {question}\n  retrieved: "
                      f"{', '.join(f'{p.passage_id}:{p.topic}' for p in found)}\n  answer: ",
                      end="")
                client = OpenAI(base_url=args.base_url + "/v1", api_key=run.api_key)
                ask(client, run, build_messages(found, question), args.max_tokens,
                    args.temperature)
    summary(args.base_url, runs, args.admin_key, args.rounds)


if __name__ == "__main__":
    main()
