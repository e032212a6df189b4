"""Retrieved documents (the chat request's ``documents``) through the live gateway, with the
official `openai` client: the tiny model's template reads no documents, so they reach the
model as a system message, which must be exactly the prompt, and the answer, of a request
that wrote that system message itself. Documents it cannot take are 400s naming them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from gateway.chat_documents import documents_system_text
from tests.live_servers import LiveServer

DOCUMENTS = [{"title": "Penguins", "text": "Emperor penguins are the tallest penguins."},
             {"text": "They live in Antarctica.", "source": "notes"}]
QUESTION = {"role": "user", "content": "Which penguins are the tallest?"}


def _answer(client: openai.OpenAI, model: str, messages: list[Any],
            documents: list[dict[str, str]] | None = None) -> tuple[str | None, int]:
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0,
        extra_body={"documents": documents} if documents is not None else None)
    assert reply.usage is not None
    return reply.choices[0].message.content, reply.usage.prompt_tokens


@pytest.mark.parametrize("system", [None, "Answer briefly."], ids=["alone", "after-system"])
def test_documents_reach_the_model_as_a_system_message(
        client: openai.OpenAI, gateway: LiveServer, base_model: str,
        system: str | None) -> None:
    asked = ([{"role": "system", "content": system}] if system else []) + [QUESTION]
    written = documents_system_text(DOCUMENTS)
    by_hand = [{"role": "system", "content": f"{system}\n\n{written}" if system else written},
               QUESTION]
    assert _answer(client, base_model, asked, DOCUMENTS) == _answer(client, base_model, by_hand)
    # /tokenize takes them as the chat endpoint does: the same ids.
    tokenized = [httpx.post(f"{gateway.url}/tokenize", json=body, timeout=30).json()["tokens"]
                 for body in ({"messages": asked, "documents": DOCUMENTS},
                              {"messages": by_hand})]
    assert tokenized[0] == tokenized[1]
    # No documents, or an empty list, is a request without them.
    assert _answer(client, base_model, [QUESTION], []) == _answer(client, base_model, [QUESTION])


@pytest.mark.parametrize("documents, param", [
    ([{"title": 1, "text": "x"}], "documents.[0].title"),
    ([{}], "documents.[0]"),
    ([{"text": "\ud800"}], "documents.[0].text"),
    ([{"": "x"}], "documents.[0]"),
    ("a page", "documents"),
    ([{f"k{i}": "v" for i in range(17)}], "documents.[0]"),
], ids=["number", "empty", "surrogate", "empty-key", "string", "too-many-fields"])
def test_documents_it_cannot_take_are_400s_naming_them(
        gateway: LiveServer, base_model: str, documents: Any, param: str) -> None:
    body = {"model": base_model, "messages": [QUESTION], "max_tokens": 4,
            "documents": documents}
    refused = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                         content=json.dumps(body),  # ASCII: a lone surrogate as its escape
                         headers={"Content-Type": "application/json"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"].startswith(param), refused.text


def test_documents_apply_to_messages_only_on_tokenize(gateway: LiveServer) -> None:
    refused = httpx.post(f"{gateway.url}/tokenize", timeout=30,
                         json={"prompt": "hi", "documents": DOCUMENTS})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "documents"
