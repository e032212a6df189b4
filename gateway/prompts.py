"""Prompts -> token ids at the OpenAI edge: bounded before any work, tokenized off the event
loop, and chat contents that cannot forge the template's control tokens.

Cost: tokenizing is linear in the text, about a second per MB on one CPU core. On the event
loop that freezes every stream of the gateway, so text above INLINE_CHARS goes to a small
thread pool (HF fast tokenizers release the GIL while they encode). A semaphore of the pool's
size keeps a flood waiting in asyncio, not in the pool's queue; small prompts skip the pool
entirely, so they never wait behind big ones. Nothing here mutates the tokenizer after
construction (no per-call truncation, padding or split_special_tokens), which is what makes
sharing one tokenizer between the loop and the workers safe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import re
import secrets
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jinja2
from transformers import PreTrainedTokenizerBase

from engine.http.errors import ApiError
from gateway.chat_documents import template_takes_documents
from gateway.openai_chat_protocol import ChatCompletionRequest
from gateway.tool_calls import template_takes_tools

MIN_PROMPT_CHARS = 32768
"""Floor of the character cap (max_chars), so small contexts still take unusually dense
text."""
INLINE_CHARS = 4096
"""Prompts up to this many characters are tokenized on the event loop (tens of
microseconds: cheaper than a thread hop, and never queued behind a big prompt)."""
INLINE_MESSAGES = 16
"""Conversations of more messages go to the pool whatever their size (a template loop each)."""
TAIL_MARGIN_TOKENS = 256
"""Tokens more than a truncated prompt keeps, tokenized from its end (tail_chars): a cut
changes only the tokens of the word or symbol run it falls in, which these absorb (checked:
PromptEncoder._kept_ids)."""
WORKERS = 4
"""Tokenizer threads per gateway: enough to keep a few big prompts moving at once, few enough
that a flood of them cannot take every core from the engines on the same host."""
_TEXT = TypeVar("_TEXT")


class PromptEncoder:
    """Token ids of completion prompts and chat conversations (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, workers: int = WORKERS) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.tokenizer = tokenizer
        self._pool = concurrent.futures.ThreadPoolExecutor(workers,
                                                           thread_name_prefix="tokenize")
        self._slots = asyncio.Semaphore(workers)
        self.longest_token = max(map(len, tokenizer.get_vocab()), default=1)
        """Characters in the vocabulary's longest entry: no token covers more characters of
        a text (byte-level vocabularies spell a byte as one character, and every character
        of a text is at least one byte)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # A normalizer may move characters about: no tail is then provably the same.
        self._pre_tokenizer = backend.pre_tokenizer if backend is not None and \
            backend.normalizer is None else None
        self._controls = _control_tokens(tokenizer)
        self._controls_re = re.compile(_trie_pattern(self._controls) or "(?!)")
        self._newline = self._encode("\n")
        # Each control token as plain text, computed once: split_special_tokens flips a flag
        # on the shared Rust tokenizer, which must not happen while workers use it.
        self._as_text = {token: self._piece(token, split=True) for token in self._controls}
        self._encode("")  # leaves split_special_tokens off again

    def max_chars(self, context: int) -> int:
        """The most characters of text that `context` tokens can hold: a longer prompt
        cannot fit, so it is refused without being tokenized."""
        return max(MIN_PROMPT_CHARS, context * self.longest_token)

    def check_chars(self, chars: int, context: int, param: str) -> None:
        """400 context_length_exceeded when `chars` characters cannot fit the context."""
        limit = self.max_chars(context)
        if chars > limit:
            raise ApiError(400, f"This model's maximum context length is {context} tokens; "
                           f"{param} holds {chars} characters, more than {context} tokens "
                           f"can spell (at most {self.longest_token} characters each)",
                           code="context_length_exceeded", param=param)

    def tail_chars(self, keep_tokens: int) -> int:
        """Characters from a text's end that hold more than its last ``keep_tokens`` tokens
        and a margin (TAIL_MARGIN_TOKENS): a truncated prompt's tokens come from its tail
        alone, so a client cannot make the gateway tokenize megabytes it will throw away."""
        return (keep_tokens + TAIL_MARGIN_TOKENS) * self.longest_token

    # ----------------------------------------------------------------------- async API
    async def encode_prompt(self, text: str, add_special_tokens: bool = True,
                            keep_tokens: int | None = None) -> list[int]:
        """A completion prompt's ids, as the client wrote it: the raw prompt is the
        client's own, so control tokens in it are control tokens (it may carry a template).
        add_special_tokens: the tokenizer's own (e.g. a BOS) around it. keep_tokens: only
        the last ones are wanted (truncate_prompt_tokens): the text's tail is tokenized, and
        its last keep_tokens ids are the whole text's."""
        if keep_tokens is not None:
            return await self._run(len(text), functools.partial(
                self._kept_ids, keep=keep_tokens, add_special_tokens=add_special_tokens), text)
        return await self._run(len(text), self._prompt_ids if add_special_tokens
                               else self._encode, text)

    async def encode_chat_request(self, chat: ChatCompletionRequest, context: int,
                                  keep_tokens: int | None = None) -> list[int]:
        """The ids a chat request sends: its messages, tools and documents rendered by the
        model's chat template (tools or documents a template does not take go in a system
        message: gateway/tool_calls.py, gateway/chat_documents.py); control-token text
        inside a message, a tool or a document is encoded as plain
        text. Refused (context_length_exceeded) without tokenizing when its contents, or
        then its rendered text, are longer than ``context`` tokens can spell, unless only
        its last ``keep_tokens`` are wanted (as encode_prompt's, of the rendered text).
        Built, rendered and tokenized off the event loop unless small (many messages cost a
        template loop each; tools and calls are serialized and parsed on the way). 400
        (param messages) if the template fails."""
        if keep_tokens is None:
            self.check_chars(chat.prompt_chars(), context, "messages")
        inline = len(chat.messages) <= INLINE_MESSAGES and not chat.tools and \
            not chat.documents and not any(m.tool_calls for m in chat.messages)
        cost = chat.prompt_chars() if inline else INLINE_CHARS + 1
        try:
            return await self._run(cost, functools.partial(
                self._chat_request_ids, keep=keep_tokens,
                context=context if keep_tokens is None else None), chat)
        except (jinja2.TemplateError, ValueError, RecursionError) as exc:  # the last: a
            # backstop, the edge bounds what the template nests (TemplateKwargs)
            raise ApiError(400, f"chat template failed: {exc}", param="messages") from None

    async def _run(self, cost: int, fn: Callable[[_TEXT], list[int]], arg: _TEXT
                   ) -> list[int]:
        if cost <= INLINE_CHARS:
            return fn(arg)
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        try:
            job = self._pool.submit(fn, arg)
        except BaseException:
            self._slots.release()
            raise

        def free(_: concurrent.futures.Future[list[int]]) -> None:
            # The slot stays taken until the thread is really done, even when the caller
            # gave up (a cancelled await cannot stop a running thread).
            with contextlib.suppress(RuntimeError):  # the loop closed first
                loop.call_soon_threadsafe(self._slots.release)

        job.add_done_callback(free)
        return await asyncio.wrap_future(job)

    # ----------------------------------------------------------- work (any thread)
    def _encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return [int(t) for t in ids]

    def _prompt_ids(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=True)

    def _piece(self, text: str, split: bool = False) -> list[int]:
        """Ids of text from the middle of a prompt. Encoded after a newline that is then
        dropped, so SentencePiece tokenizers do not add the prefix space they give the start
        of a string (the approach of transformers' sanitize_control_tokens)."""
        kwargs: dict[str, Any] = {"add_special_tokens": False}
        if split:
            kwargs["split_special_tokens"] = True
        ids = [int(t) for t in self.tokenizer("\n" + text, **kwargs)["input_ids"]]
        if ids[:len(self._newline)] == self._newline:
            return ids[len(self._newline):]
        return [int(t) for t in self.tokenizer(text, **kwargs)["input_ids"]]

    def _chat_request_ids(self, chat: ChatCompletionRequest, keep: int | None,
                          context: int | None) -> list[int]:
        in_template = template_takes_tools(self.tokenizer.chat_template)
        documents_in_template = template_takes_documents(self.tokenizer.chat_template)
        options = chat.template_options()
        tools = chat.template_tools()
        if tools is not None and in_template:
            options["tools"] = tools
        documents = chat.template_documents()
        if documents is not None and documents_in_template:
            options["documents"] = documents
        return self._chat_ids(chat.template_messages(in_template, documents_in_template),
                              options, keep, context)

    def _kept_ids(self, text: str, keep: int, add_special_tokens: bool = False) -> list[int]:
        """The last ``keep`` ids of the text's tokenization: from its tail (tail_chars) when
        that provably gives the same ids, else from the whole text. Proof: the tokenizer
        merges within the pieces its pre-tokenizer splits a text into, so a cut changes the
        piece it falls in, and the splitting is back in step with the whole text's once that
        piece ends; the kept ids must start after the tail's second piece. A long run that
        is one piece (a thousand "a"s) fails the check and is tokenized whole."""
        limit = self.tail_chars(keep)
        if len(text) > limit and self._pre_tokenizer is not None:
            tail = text[-limit:]
            encoded = self.tokenizer(tail, add_special_tokens=add_special_tokens,
                                     return_offsets_mapping=True)
            ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
            pieces = self._pre_tokenizer.pre_tokenize_str(tail)
            if len(ids) > keep and len(pieces) > 2 and pieces[1][1][1] <= offsets[-keep][0]:
                return [int(t) for t in ids[-keep:]]
        return self._encode(text, add_special_tokens)[-keep:]

    def _chat_ids(self, messages: list[dict[str, Any]], options: dict[str, Any],
                  keep: int | None = None, context: int | None = None) -> list[int]:
        """The ids of the rendered conversation (options: apply_chat_template's keyword
        arguments), or its last ``keep`` (from its tail by _kept_ids, unless control-token
        text was swapped in); ApiError when the rendered text is too long for ``context``."""
        if self.tokenizer.chat_template is None:
            raise ValueError("the model's tokenizer has no chat template")
        # Control tokens typed inside a message are swapped for a marker no client can
        # guess before rendering; the rendered text is then encoded piece by piece, the
        # template's own control tokens as control tokens, the markers as the plain text of
        # the token they replaced. A conversation with no control-token text takes the
        # one-piece path, identical to apply_chat_template(tokenize=True).
        mark = f"\ue000{secrets.token_hex(8)}:"
        index = {token: i for i, token in enumerate(self._controls)}
        marked = 0

        def swap(match: re.Match[str]) -> str:
            return f"{mark}{index[match.group()]}\ue000"

        def swap_json(value: Any) -> Any:
            # Tool definitions and call arguments are rendered too: the same swap, inside
            # their JSON strings (the marker is valid JSON string text).
            nonlocal marked
            text, count = self._controls_re.subn(swap, json.dumps(value))
            marked += count
            return json.loads(text) if count else value

        safe = []
        for message in messages:
            content, count = self._controls_re.subn(swap, message["content"])
            marked += count
            safe.append({**message, "content": content})
            if "tool_calls" in message:
                safe[-1]["tool_calls"] = swap_json(message["tool_calls"])
        for rendered_data in ("tools", "documents"):
            if rendered_data in options:
                options = {**options, rendered_data: swap_json(options[rendered_data])}
        rendered = str(self.tokenizer.apply_chat_template(safe, tokenize=False, **options))
        if context is not None:
            # A marker (~23 characters) may be longer than the text it stands for: a few
            # characters over per marker, far within the cap's slack (it takes every token
            # to be as long as the longest).
            self.check_chars(len(rendered), context, "messages")
        if not marked:
            return self._encode(rendered) if keep is None else self._kept_ids(rendered, keep)
        pieces = re.split(re.escape(mark) + r"(\d+)\ue000", rendered)
        ids = self._encode(pieces[0])
        for i, piece in enumerate(pieces[1:], start=1):
            if i % 2:  # a marker: the control token it replaced, as plain text
                ids.extend(self._as_text[self._controls[int(piece)]])
            elif piece:
                ids.extend(self._piece(piece))
        return ids if keep is None else ids[-keep:]


def _control_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The tokenizer's special tokens: the strings a chat template uses as control tokens."""
    tokens: set[str] = {str(t) for t in tokenizer.all_special_tokens}
    tokens |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted(t for t in tokens if t and not t.isspace())


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching any of `words`, longest first, factored as a trie: Python's re tries
    a flat alternation one word at a time at every position (hundreds of special tokens
    sharing a prefix take ~1 s per MB with the GIL held); a trie needs one pass."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        alternatives = [re.escape(char) + emit(child)
                        for char, child in sorted(node.items()) if char]
        if not alternatives:
            return ""
        ends_here = "" in node
        if len(alternatives) == 1 and not ends_here:
            return alternatives[0]
        group = "(?:" + "|".join(alternatives) + ")"
        return group + "?" if ends_here else group

    return emit(trie)
