"""The gateway's OpenAI-compatible API, driven by the official `openai` client: models,
completions and chat (streamed and whole), sampling fields (logprobs: test_logprobs.py;
concurrency and disconnects: test_concurrency.py). Against the package's live engine +
gateway (conftest.py).
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from transformers import PreTrainedTokenizerBase

from tests.live_servers import LiveServer
from tests.openai_api.helpers import (
    CONTEXT,
    GREEDY,
    MAX_TOKENS,
    MESSAGES,
    NO_EOS,
    PROMPT,
    SEEDED,
    chat_prompt_tokens,
    model_name,
)


# -------------------------------------------------------------------------------- models
def test_models_lists_the_base_model_and_every_adapter(client: openai.OpenAI,
                                                       base_model: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [base_model, "a0", "a1"]
    assert all(m.object == "model" and m.owned_by == "loragate" for m in models)
    assert [getattr(m, "parent", None) for m in models] == [None, base_model, base_model]
    assert {getattr(m, "max_model_len", None) for m in models} == {CONTEXT}  # vLLM's


def _same_usage(again: CompletionUsage | None, first: CompletionUsage) -> bool:
    """The same counts, except that the repeat read at least as much from the prefix cache
    (the first run left its prompt's blocks there)."""
    assert again is not None and again.prompt_tokens_details is not None
    assert first.prompt_tokens_details is not None
    cached = (again.prompt_tokens_details.cached_tokens or 0,
              first.prompt_tokens_details.cached_tokens or 0)
    return (again.prompt_tokens, again.completion_tokens, again.total_tokens) == (
        first.prompt_tokens, first.completion_tokens, first.total_tokens) \
        and cached[0] >= cached[1]


# --------------------------------------------------------------------------- completions
@pytest.mark.parametrize("model", ["base", "a0"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_completion_stream_matches_the_whole_response(
        client: openai.OpenAI, tokenizer: PreTrainedTokenizerBase, base_model: str,
        model: str, sampling: dict[str, Any]) -> None:
    request: dict[str, Any] = {"model": model_name(model, base_model), "prompt": PROMPT,
                               "max_tokens": MAX_TOKENS, "extra_body": NO_EOS, **sampling}
    whole = client.completions.create(**request)
    assert whole.object == "text_completion" and whole.model == request["model"]
    (choice,) = whole.choices
    assert (choice.index, choice.finish_reason, choice.logprobs) == (0, "length", None)
    prompt_tokens = len(tokenizer(PROMPT)["input_ids"])
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens,
            whole.usage.total_tokens) == (prompt_tokens, MAX_TOKENS,
                                          prompt_tokens + MAX_TOKENS)

    chunks = list(client.completions.create(**request, stream=True,
                                            stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks] == \
        [None] * (len(text_chunks) - 1) + ["length"]
    assert all(c.usage is None and c.object == "text_completion" for c in text_chunks)
    assert len({c.id for c in chunks}) == 1
    assert usage_chunk.choices == [] and _same_usage(usage_chunk.usage, whole.usage)


# ---------------------------------------------------------------------------------- chat
@pytest.mark.parametrize("model", ["base", "a1"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chat_stream_matches_the_whole_response(
        client: openai.OpenAI, tokenizer: PreTrainedTokenizerBase, base_model: str,
        model: str, sampling: dict[str, Any]) -> None:
    request: dict[str, Any] = {"model": model_name(model, base_model), "messages": MESSAGES,
                               "max_tokens": MAX_TOKENS, "extra_body": NO_EOS, **sampling}
    whole = client.chat.completions.create(**request)
    assert whole.object == "chat.completion" and whole.model == request["model"]
    (choice,) = whole.choices
    assert (choice.index, choice.finish_reason, choice.logprobs) == (0, "length", None)
    assert choice.message.role == "assistant" and choice.message.content is not None
    prompt_tokens = chat_prompt_tokens(tokenizer, MESSAGES)
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens,
            whole.usage.total_tokens) == (prompt_tokens, MAX_TOKENS,
                                          prompt_tokens + MAX_TOKENS)

    chunks = list(client.chat.completions.create(**request, stream=True,
                                                 stream_options={"include_usage": True}))
    *deltas, usage_chunk = chunks
    # The role alone first, as OpenAI and vLLM stream it.
    assert (deltas[0].choices[0].delta.role, deltas[0].choices[0].delta.content) == \
        ("assistant", "")
    assert all(c.choices[0].delta.role is None for c in deltas[1:])
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == \
        choice.message.content
    assert [c.choices[0].finish_reason for c in deltas] == \
        [None] * (len(deltas) - 1) + ["length"]
    assert all(c.usage is None and c.object == "chat.completion.chunk" for c in deltas)
    assert usage_chunk.choices == [] and _same_usage(usage_chunk.usage, whole.usage)


def test_max_tokens_and_max_completion_tokens_end_with_length(client: openai.OpenAI,
                                                              base_model: str) -> None:
    short = client.completions.create(model=base_model, prompt=PROMPT, max_tokens=3,
                                      extra_body=NO_EOS)
    assert short.choices[0].finish_reason == "length"
    assert short.usage is not None and short.usage.completion_tokens == 3
    chat = client.chat.completions.create(model=base_model, messages=MESSAGES,
                                          max_completion_tokens=4, extra_body=NO_EOS)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 4


def test_stop_strings_end_the_text_before_them(client: openai.OpenAI,
                                               base_model: str) -> None:
    request: dict[str, Any] = {"model": base_model, "prompt": PROMPT, "max_tokens": 16,
                               "temperature": 0, "extra_body": NO_EOS}
    full = client.completions.create(**request).choices[0].text
    stop = full[6:8]
    expected = full[:full.index(stop)]
    cut = client.completions.create(**request, stop=stop)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    assert _stop_reason(cut.choices[0]) == stop  # vLLM's: what stopped it
    assert cut.usage is not None and cut.usage.completion_tokens < 16
    streamed = list(client.completions.create(**request, stop=[stop, "never-generated"],
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert _stop_reason(streamed[-1].choices[0]) == stop
    assert all("stop_reason" not in (c.choices[0].model_extra or {}) for c in streamed[:-1])

    chat_request: dict[str, Any] = {"model": base_model, "messages": MESSAGES,
                                    "max_tokens": 16, "temperature": 0, "extra_body": NO_EOS}
    content = client.chat.completions.create(**chat_request).choices[0].message.content
    assert content is not None
    stop = content[4:6]
    chat = client.chat.completions.create(**chat_request, stop=[stop])
    assert chat.choices[0].message.content == content[:content.index(stop)]
    assert chat.choices[0].finish_reason == "stop"
    assert _stop_reason(chat.choices[0]) == stop


def _stop_reason(choice: Any) -> Any:
    extra = choice.model_extra or {}
    assert "stop_reason" in extra, "vLLM's stop_reason is on every finished choice"
    return extra["stop_reason"]


def test_stop_reason_names_the_stop_token_and_is_null_otherwise(
        client: openai.OpenAI, tokenizer: PreTrainedTokenizerBase, base_model: str) -> None:
    request: dict[str, Any] = {"model": base_model, "prompt": PROMPT, "max_tokens": 8,
                               "temperature": 0}
    full = client.completions.create(**request, extra_body={**NO_EOS,
                                                            "return_token_ids": True})
    assert full.choices[0].finish_reason == "length"
    assert _stop_reason(full.choices[0]) is None
    stop_id = (full.choices[0].model_extra or {})["token_ids"][3]
    cut = client.completions.create(**request, extra_body={**NO_EOS,
                                                           "stop_token_ids": [stop_id]})
    assert cut.choices[0].finish_reason == "stop"
    assert _stop_reason(cut.choices[0]) == stop_id
    # An end-of-sequence token stops with no stop_reason (vLLM's): make EOS the only choice.
    eos = tokenizer.eos_token_id
    assert isinstance(eos, int)
    ended = client.completions.create(**request, extra_body={"allowed_token_ids": [eos]})
    assert (ended.choices[0].finish_reason, _stop_reason(ended.choices[0])) == ("stop", None)


def test_sampling_controls_reach_the_engine(client: openai.OpenAI,
                                           tokenizer: PreTrainedTokenizerBase,
                                           base_model: str) -> None:
    # OpenAI's logit_bias and penalties, and vLLM's extras through extra_body.
    request: dict[str, Any] = {"model": base_model, "prompt": PROMPT, "max_tokens": 6,
                               "temperature": 0}
    biased = client.completions.create(**request, logit_bias={"42": 100},
                                       extra_body=NO_EOS).choices[0].text
    assert biased == tokenizer.decode([42] * 6)
    allowed = client.completions.create(**request, extra_body={
        **NO_EOS, "allowed_token_ids": [11, 12]}).choices[0].text
    assert set(tokenizer(allowed, add_special_tokens=False)["input_ids"]) <= {11, 12}
    plain = client.completions.create(**request, extra_body=NO_EOS).choices[0].text
    penalized = client.completions.create(**request, frequency_penalty=2.0, extra_body={
        **NO_EOS, "repetition_penalty": 2.0}).choices[0].text
    assert penalized != plain
    harder = client.completions.create(**request, extra_body={  # vLLM takes such values
        **NO_EOS, "repetition_penalty": 3.5}).choices[0].text
    assert harder != plain
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**request, extra_body={"repetition_penalty": 101})
    stop = plain[2:4]
    kept = client.completions.create(**request, stop=[stop], extra_body={
        **NO_EOS, "include_stop_str_in_output": True}).choices[0]
    assert (kept.text, kept.finish_reason) == (plain[:plain.index(stop)] + stop, "stop")
    with pytest.raises(openai.BadRequestError) as caught:  # past the vocabulary
        client.completions.create(**request, extra_body={"allowed_token_ids": [10**6]})
    assert "allowed_token_ids" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**request, extra_body={"min_tokens": 7})
    assert "min_tokens" in str(caught.value)


def test_truncate_prompt_tokens_and_add_special_tokens(client: openai.OpenAI,
                                                      tokenizer: PreTrainedTokenizerBase,
                                                      base_model: str) -> None:
    # The kept tail of a long prompt answers as that tail sent alone (as token ids).
    ids = tokenizer(PROMPT * 40)["input_ids"]
    request: dict[str, Any] = {"model": base_model, "max_tokens": 5, "temperature": 0}
    cut = client.completions.create(**request, prompt=PROMPT * 40,
                                    extra_body={**NO_EOS, "truncate_prompt_tokens": 7})
    tail = client.completions.create(**request, prompt=ids[-7:], extra_body=NO_EOS)
    assert cut.usage is not None and cut.usage.prompt_tokens == 7
    assert cut.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(model=base_model, messages=MESSAGES, max_tokens=2,
                                          extra_body={**NO_EOS, "truncate_prompt_tokens": 3})
    assert chat.usage is not None and chat.usage.prompt_tokens == 3
    # -1 keeps the context's worth (vLLM's): a short prompt whole; more than the context
    # cannot be kept, 0 keeps nothing: both refused.
    whole = client.completions.create(**request, prompt=PROMPT * 40,
                                      extra_body={**NO_EOS, "truncate_prompt_tokens": -1})
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    for keep in (CONTEXT + 1, 0):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**request, prompt=PROMPT,
                                      extra_body={"truncate_prompt_tokens": keep})
        assert refused.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]
    plain = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert len(tokenizer(PROMPT)["input_ids"]) == len(plain) + 1  # the tokenizer adds a BOS
    bare = client.completions.create(**request, prompt=PROMPT,
                                     extra_body={**NO_EOS, "add_special_tokens": False})
    assert bare.usage is not None and bare.usage.prompt_tokens == len(plain)


def test_a_request_without_a_model_runs_on_the_base_model(gateway: LiveServer,
                                                          base_model: str) -> None:
    """As vLLM serves its model when none is named."""
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        named, unnamed = (httpx.post(gateway.url + path, timeout=30.0, json={
            **body, **model, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            for model in ({"model": base_model}, {}))
        assert unnamed.status_code == 200, unnamed.text
        assert unnamed.json()["model"] == base_model
        assert unnamed.json()["choices"] == named.json()["choices"]


def test_top_k_past_the_vocabulary_keeps_every_token(client: openai.OpenAI,
                                                     base_model: str) -> None:
    """A common way to say "no top-k" (vLLM takes it): the same draws as top_k -1."""
    request: dict[str, Any] = {"model": base_model, "prompt": "hello", "max_tokens": 8,
                               "temperature": 1.0, "seed": 3}
    unbounded = client.completions.create(**request, extra_body={"top_k": 10**6})
    disabled = client.completions.create(**request, extra_body={"top_k": -1})
    assert unbounded.choices[0].text == disabled.choices[0].text


def test_logprob_bounds_as_in_vllm(client: openai.OpenAI, base_model: str) -> None:
    """Up to 20 alternatives on completions too (vLLM's max_logprobs), and top_logprobs: 0
    (its default) without logprobs; an empty allow-list would allow nothing: a 400."""
    done = client.completions.create(model=base_model, prompt=PROMPT, max_tokens=2,
                                     temperature=0, logprobs=20, extra_body={
                                         "return_tokens_as_token_ids": True})  # unique keys
    assert done.choices[0].logprobs is not None
    tops = done.choices[0].logprobs.top_logprobs
    assert tops is not None and [len(top) for top in tops] == [20, 20]
    chat = client.chat.completions.create(model=base_model, messages=MESSAGES, max_tokens=2,
                                          top_logprobs=0)
    assert chat.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=base_model, prompt=PROMPT, max_tokens=2,
                                  extra_body={"allowed_token_ids": []})
    assert refused.value.body["param"] == "allowed_token_ids"  # type: ignore[index]


def test_chat_template_options_shape_the_prompt(client: openai.OpenAI,
                                                tokenizer: PreTrainedTokenizerBase,
                                                base_model: str) -> None:
    # The prompt the engine saw, counted, against transformers' own rendering.
    started = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]

    def prompt_tokens(messages: list[dict[str, str]], **extra: object) -> int:
        response = client.chat.completions.create(model=base_model, messages=messages,  # type: ignore[arg-type]
                                                  max_tokens=1, extra_body=extra)
        assert response.usage is not None
        return response.usage.prompt_tokens

    def reference(messages: list[dict[str, str]], **options: Any) -> int:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, **options)
        return len(tokenizer(str(rendered), add_special_tokens=False)["input_ids"])

    opened = prompt_tokens(MESSAGES)
    assert opened == reference(MESSAGES, add_generation_prompt=True)
    closed = prompt_tokens(MESSAGES, add_generation_prompt=False)
    assert closed == reference(MESSAGES, add_generation_prompt=False) < opened
    continued = prompt_tokens(started, add_generation_prompt=False,
                              continue_final_message=True)
    assert continued == reference(started, continue_final_message=True)
    assert prompt_tokens(MESSAGES, chat_template_kwargs={"enable_thinking": False}) == opened
    for bad in ({"continue_final_message": True},  # with add_generation_prompt (default)
                {"add_generation_prompt": False, "continue_final_message": True},  # user last
                {"chat_template_kwargs": {"tokenize": False}}):
        with pytest.raises(openai.BadRequestError):
            prompt_tokens(MESSAGES if "chat_template_kwargs" in bad or len(bad) == 2
                          else started, **bad)


def test_chat_echo_starts_the_content_with_the_last_message(client: openai.OpenAI,
                                                             base_model: str) -> None:
    # vLLM's chat echo: the continued assistant text, then what the model wrote after it.
    started = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    args: dict[str, Any] = {"model": base_model, "messages": started, "max_tokens": 6,
                            "temperature": 0}
    options = {**NO_EOS, "add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(**args, extra_body=options).choices[0]
    echoed = client.chat.completions.create(**args, extra_body={**options, "echo": True})
    assert echoed.choices[0].message.content == "The answer is" + (plain.message.content or "")
    assert echoed.usage is not None and echoed.usage.completion_tokens == 6
    streamed = list(client.chat.completions.create(**args, stream=True,
                                                   extra_body={**options, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == \
        echoed.choices[0].message.content
    # A user message last, answered by the assistant: not the answer's role, not echoed.
    asked = client.chat.completions.create(model=base_model, messages=MESSAGES, max_tokens=4,
                                           temperature=0, extra_body={**NO_EOS, "echo": True})
    alone = client.chat.completions.create(model=base_model, messages=MESSAGES, max_tokens=4,
                                           temperature=0, extra_body=NO_EOS)
    assert asked.choices[0].message.content == alone.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=base_model, messages=MESSAGES, max_tokens=4, extra_body={"echo": True},
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice="required")
    assert refused.value.body["param"] == "echo"  # type: ignore[index]


def test_an_adapter_changes_the_greedy_output(client: openai.OpenAI, base_model: str) -> None:
    texts = {model: client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                              temperature=0, extra_body=NO_EOS
                                              ).choices[0].text
             for model in (base_model, "a0", "a1")}
    assert len(set(texts.values())) == 3, texts
    again = client.completions.create(model="a0", prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body=NO_EOS)
    assert again.choices[0].text == texts["a0"]
