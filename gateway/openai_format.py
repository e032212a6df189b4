"""Engine StreamChunks -> OpenAI response objects (completion, chat, their stream chunks).

One formatter per request: it accumulates text, token ids, logprobs and the finish reason as
chunks arrive, emits stream events on the way, and builds the final object at the end.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from engine.prompt_logprobs import PromptLogprob
from engine.protocol import StreamChunk
from gateway.call_deltas import CallDeltas
from gateway.logprob_format import LOGPROB_FLOOR, Endpoint, Entry, LogprobFormatter, finite_logprob
from gateway.openai_protocol import StreamUsage
from gateway.text_offsets import TextOffsets
from gateway.token_bytes import TokenBytes
from gateway.tool_calls import ToolPlan, whole_calls

# Engine finish reasons -> OpenAI's ("abort" and "error" never reach a successful response).
_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def _finish(reason: str | None, called: bool, named: bool) -> str | None:
    """A chat choice's finish_reason: "tool_calls" when it ended by itself with whole calls
    (``called``: ToolPlan's whole_calls), except under a named tool_choice, which OpenAI
    (and vLLM) end with "stop"; an output cut at max_tokens stays "length", whatever calls
    it completed before the cut, and one a stop string cut mid-call "stop"."""
    return "tool_calls" if called and reason == "stop" and not named else reason


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class PromptEcho:
    """What a choice's prompt contributes to its response: its token ids (as the engine
    ran them) and, for ``echo``, its text."""

    token_ids: list[int]
    text: str = ""


@dataclass
class _Choice:
    """One choice's accumulated state (a prompt of a batch, or the one prompt)."""

    prompt: PromptEcho
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """vLLM's: the stop string or stop token id that ended it, else None."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    started: bool = False
    """Its first event was built (the role, the echoed prompt and the prompt's ids)."""
    offsets: list[int] = field(default_factory=list)
    """text_offset of each of its entries (completions with logprobs)."""
    generated: TextOffsets | None = None
    """Where its generated tokens' texts begin (after the echoed prompt's)."""
    content_sent: int = 0
    """Characters of its text streamed as content (chat with tools holds calls back)."""
    calls: CallDeltas | None = None
    """Its stream's calls sent as generated, where a grammar holds their shape."""
    called: bool = False
    """It ended with whole calls (whole_calls), once its stream ended."""


class ResponseFormatter:
    """Builds one request's OpenAI objects; ``top_logprobs`` None means no logprobs.

    vLLM's extras: ``return_token_ids`` adds the prompt's token ids and the generated ones
    (completions: both on the choice; chat: the prompt's on the response, the generated on
    the choice; streamed: the prompt's in the first event only, each event its new ids);
    ``tokens_as_ids`` names logprob tokens "token_id:<id>" instead of their text;
    ``prompt_logprobs`` (k) adds vLLM's per-position maps of the prompt tokens (completions:
    on the choice; chat: on the response). OpenAI's ``echo`` (completions) puts the prompt's
    text before the generated text and, with logprobs, its tokens before the generated ones
    (the first with a null logprob); ``drop_output`` (echo with max_tokens 0) reports the
    prompt alone, the one token the engine generated left out. vLLM's chat ``echo`` puts
    the prompt's text (the last message's, PromptEcho.text) before the content.

    A batch of prompts is one choice per prompt (``start``); chunks name their choice by
    index."""

    def __init__(self, endpoint: Endpoint, model: str, tokenizer: PreTrainedTokenizerBase,
                 top_logprobs: int | None, return_token_ids: bool = False,
                 tokens_as_ids: bool = False, token_bytes: TokenBytes | None = None,
                 echo: bool = False, prompt_logprobs: int | None = None,
                 drop_output: bool = False, tools: ToolPlan | None = None,
                 keep: int | None = None, skip_special_tokens: bool = True) -> None:
        self.endpoint = endpoint
        self.skip_special_tokens = skip_special_tokens
        """As the engine decodes the text (for text_offset)."""
        self.model = model
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        self.return_token_ids = return_token_ids
        self.logprobs = LogprobFormatter(endpoint, tokenizer, top_logprobs, tokens_as_ids,
                                         token_bytes or TokenBytes(tokenizer), prompt_logprobs)
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs
        self.drop_output = drop_output
        self.tools = tools if tools is not None and tools.active else None
        """Chat with tools the model may call: its text is parsed for calls."""
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.keep = keep
        """best_of: the sequences kept per prompt (the most likely), when fewer than run."""
        self.choices = [_Choice(PromptEcho([]))]
        self.group = 1

    @property
    def _named(self) -> bool:
        return self.tools is not None and self.tools.mode == "named"

    def start(self, prompts: list[PromptEcho], group: int = 1) -> None:
        """One choice per sequence, set once the prompts are tokenized (what the engines
        run, truncation included): ``group`` consecutive sequences per prompt (n,
        best_of)."""
        self.choices = [_Choice(p) for p in prompts]
        self.group = group

    def _groups(self) -> list[list[_Choice]]:
        return [self.choices[i:i + self.group] for i in range(0, len(self.choices), self.group)]

    @property
    def prompt_tokens(self) -> int:
        """Each prompt once, however many sequences it had (as OpenAI counts n)."""
        return sum(max(c.prompt_tokens for c in group) for group in self._groups())

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens read from an engine's prefix cache, each prompt once (its most
        cached sequence)."""
        return sum(max(c.cached_tokens for c in group) for group in self._groups())

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    # ------------------------------------------------------------- accumulation
    def add(self, chunk: StreamChunk, index: int = 0) -> tuple[list[Entry], str]:
        """Take one engine chunk of choice ``index``; returns its new logprob entries and
        text (the echoed prompt's first, on the choice's first chunk)."""
        choice = self.choices[index]
        choice.prompt_tokens = chunk.prompt_tokens or choice.prompt_tokens
        choice.cached_tokens = chunk.cached_tokens or choice.cached_tokens
        if chunk.prompt_logprobs is not None:
            choice.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            choice.finish_reason = "length" if self.drop_output else \
                _FINISH.get(chunk.finish_reason, "stop")
            choice.stop_reason = None if self.drop_output else chunk.stop_reason
        entries: list[Entry] = []
        text = ""
        with_offsets = self.endpoint == "completions" and self.top_logprobs is not None
        if self.echo and not choice.text:
            text = choice.prompt.text
            if self.top_logprobs is not None and self.endpoint == "completions":
                entries = self._prompt_entries(choice)  # chat's logprobs are its output's
            if with_offsets:
                # The echoed text is the prompt as sent; its tokens decode to it, special
                # tokens (a BOS the tokenizer added) as nothing.
                choice.offsets += TextOffsets(self.tokenizer, True).take(
                    choice.prompt.token_ids)
        if not self.drop_output:
            ids = chunk.delta_token_ids
            choice.token_ids.extend(ids)
            text += chunk.delta_text
            new = [(token_id, {k: finite_logprob(v) for k, v in step.items()})
                   for token_id, step in zip(ids, chunk.logprobs or [], strict=False)]
            entries += new
            if with_offsets:
                if choice.generated is None:
                    choice.generated = TextOffsets(self.tokenizer, self.skip_special_tokens,
                                                   len(text) - len(chunk.delta_text))
                choice.offsets += choice.generated.take([token_id for token_id, _ in new])
            choice.completion_tokens = chunk.completion_tokens or choice.completion_tokens
        choice.text.append(text)
        choice.entries.extend(entries)
        return entries, text

    def _prompt_entries(self, choice: _Choice) -> list[Entry]:
        scored = choice.prompt_logprobs or []
        entries: list[Entry] = []
        for pos, token_id in enumerate(choice.prompt.token_ids):
            entry = scored[pos] if pos < len(scored) else None
            if entry is None:
                entries.append((token_id, None))
                continue
            step = {t: finite_logprob(lp) for t, lp in entry.top}
            step[token_id] = finite_logprob(entry.logprob)
            entries.append((token_id, step))
        return entries

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` as OpenAI and
        vLLM name the prompt tokens served from a cache."""
        return _usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    # ------------------------------------------------------------------- objects
    def final(self) -> dict[str, Any]:
        kind = "chat.completion" if self.endpoint == "chat" else "text_completion"
        response: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created,
                                    "model": self.model, "choices": []}
        for index, choice in enumerate(self._kept()):
            text = "".join(choice.text)
            logprobs = self.logprobs.generated(choice.entries, choice.offsets)
            if self.endpoint == "chat":
                content, calls = self._calls(choice, text)
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
                body: dict[str, Any] = {"index": index, "message": message,
                                        "logprobs": logprobs,
                                        "finish_reason": _finish(choice.finish_reason,
                                                                 whole_calls(calls),
                                                                 self._named),
                                        "stop_reason": choice.stop_reason}
            else:
                body = {"index": index, "text": text, "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason}
            self._add_prompt_fields(response, body, choice, choice.token_ids, first=True)
            response["choices"].append(body)
        response["usage"] = self.usage()
        return response

    def _kept(self) -> list[_Choice]:
        """The choices a whole response returns: all, or best_of's ``keep`` most likely
        per prompt (by cumulative logprob of their tokens, best first)."""
        if self.keep is None or self.keep >= self.group:
            return self.choices
        kept = []
        for group in self._groups():
            ranked = sorted(group, key=lambda c: -sum(
                step.get(token, LOGPROB_FLOOR) for token, step in c.entries if step))
            kept += ranked[:self.keep]
        return kept

    def _calls(self, choice: _Choice, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished chat choice; from an output cut at max_tokens
        only the calls a forced array completed (ToolPlan.parse_cut)."""
        if self.tools is None or choice.finish_reason not in ("stop", "length"):
            return text, []
        if choice.finish_reason == "length":
            return self.tools.parse_cut(text)
        return self.tools.parse(text)

    def _content_delta(self, choice: _Choice, text: str, finished: bool
                       ) -> tuple[str, list[dict[str, Any]]]:
        """Chat with tools: the content of ``text`` (the output so far) that may be streamed
        now and, at the end, the calls (as stream deltas) unless they were streamed as
        generated."""
        assert self.tools is not None
        if not finished:
            upto = max(choice.content_sent, self.tools.streamable_prefix(text))
            delta, choice.content_sent = text[choice.content_sent:upto], upto
            return delta, []
        content, calls = self._calls(choice, text)
        choice.called = whole_calls(calls)
        # The whole response's content (the text itself when no call parsed), of which a
        # prefix was sent.
        rest = (content or "")[choice.content_sent:]
        choice.content_sent = len(text)
        if choice.calls is not None and choice.calls.opened:
            return rest, []
        return rest, [{"index": i, **call} for i, call in enumerate(calls)]

    def _add_prompt_fields(self, response: dict[str, Any], body: dict[str, Any],
                           choice: _Choice, token_ids: list[int], first: bool) -> None:
        """vLLM's return_token_ids and prompt_logprobs fields, where vLLM puts them."""
        where = response if self.endpoint == "chat" else body
        if self.return_token_ids:
            body["token_ids"] = list(token_ids)
            if first:
                where["prompt_token_ids"] = list(choice.prompt.token_ids)
        if self.prompt_logprobs is not None and first:
            where["prompt_logprobs"] = self.logprobs.prompt(choice.prompt_logprobs,
                                                            choice.prompt.token_ids)

    def stream_events(self, chunk: StreamChunk, usage: StreamUsage, index: int = 0
                      ) -> list[dict[str, Any]]:
        """The SSE payloads for one engine chunk of choice ``index`` (none when it carries
        nothing)."""
        choice = self.choices[index]
        entries, text = self.add(chunk, index)
        finish = choice.finish_reason if chunk.finished else None
        new_ids = [] if self.drop_output else chunk.delta_token_ids
        if (not text and not entries and finish is None and choice.started
                and not (self.return_token_ids and new_ids)):
            return []
        first = not choice.started
        choice.started = True
        new_offsets = choice.offsets[len(choice.offsets) - len(entries):]
        earlier = choice.entries[:len(choice.entries) - len(entries)]
        logprobs = self.logprobs.generated(entries, new_offsets,
                                           [token_id for token_id, _ in earlier])
        opening: list[dict[str, Any]] = []
        if self.endpoint == "chat":
            if first:  # as OpenAI and vLLM: the role alone, and the prompt's fields, first
                opening.append(self._role_event(choice, index, usage))
                first = False
            calls: list[dict[str, Any]] = []
            if self.tools is not None:
                output = "".join(choice.text)
                if choice.calls is None:
                    choice.calls = CallDeltas(self.tools)
                if self._named:  # its text is the call's arguments, never content
                    text, calls = "", choice.calls.named(output)
                else:
                    # Calls read as generated first: at the end, the content knows them.
                    streamed = choice.calls.read(output) \
                        if self.tools.reads_calls_as_generated else []
                    text, calls = self._content_delta(choice, output, finish is not None)
                    calls = streamed + calls
            if (not text and not calls and finish is None and logprobs is None
                    and not (self.return_token_ids and new_ids)):
                return opening  # nothing new, or all of it held back (a call may start)
            # Beside calls, and in a forced call (it never holds text), no text is a null
            # content, as OpenAI streams it.
            forced = self.tools is not None and self.tools.mode in ("required", "named")
            delta: dict[str, Any] = {"content": None if (calls or forced) and not text
                                     else text}
            if forced and not text and not calls and finish is not None:
                delta = {}  # a forced call's last chunk: the finish alone, as OpenAI ends it
            body: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": _finish(finish, choice.called,
                                                             self._named)}
            if calls and finish is None:  # a forced call's arguments as they come
                delta["tool_calls"] = calls
            elif calls:
                # The calls in a chunk of their own, the finish in the next with an empty
                # delta, as OpenAI ends a choice: clients close a call's arguments when a
                # later chunk comes (the openai SDK's arguments.done event).
                delta["tool_calls"] = calls
                body["finish_reason"] = None
                calls_event = self._event(body, usage, choice)
                self._add_prompt_fields(calls_event, body, choice, new_ids, first)
                opening.append(calls_event)
                first, new_ids = False, []
                body = {"index": index, "delta": {}, "logprobs": None,
                        "finish_reason": _finish(finish, choice.called, self._named)}
        else:
            body = {"index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": finish}
        if finish is not None:  # as vLLM: on the choice's last chunk only
            body["stop_reason"] = choice.stop_reason
        event = self._event(body, usage, choice)
        self._add_prompt_fields(event, body, choice, new_ids, first)
        return opening + [event]

    def _role_event(self, choice: _Choice, index: int, usage: StreamUsage) -> dict[str, Any]:
        """A chat choice's first stream event: its role with an empty content (and, when
        asked for, the prompt's token ids and logprobs)."""
        body: dict[str, Any] = {"index": index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}
        event = self._event(body, usage, choice, completion_tokens=0)
        self._add_prompt_fields(event, body, choice, [], first=True)
        return event

    def _event(self, body: dict[str, Any], usage: StreamUsage, choice: _Choice,
               completion_tokens: int | None = None) -> dict[str, Any]:
        """A stream event of ``choice``; with continuous_usage_stats its usage so far (as
        vLLM counts it: that choice's prompt and its tokens up to this event), else null
        until the last, choice-less event."""
        kind = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        event: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created,
                                 "model": self.model, "choices": [body]}
        if usage == "every_chunk":
            done = choice.completion_tokens if completion_tokens is None else completion_tokens
            event["usage"] = _usage(choice.prompt_tokens, done, choice.cached_tokens)
        elif usage != "none":
            event["usage"] = None
        return event

    def usage_event(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}
