"""Documents for retrieval-augmented chat: the chat request's ``documents`` (vLLM's field, a
list of string-valued objects such as ``{"title": ..., "text": ...}``).

A chat template that reads a ``documents`` variable (Command-R, Granite and other RAG
templates) renders them itself, where the model was trained to find them. Any other template
would drop them without a word (as vLLM's server does), so there they go in a system message
instead, ahead of the conversation: the model reads them either way, and a pipeline that
sends the same documents again shares that prefix in the cache. Their text goes through the
same control-token guard as message contents (gateway/prompts.py): a retrieved page cannot
close the turn it sits in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import Field

from gateway.openai_text import Text

MAX_DOCUMENTS = 1024
MAX_DOCUMENT_FIELDS = 16

DocumentKey = Annotated[Text, Field(min_length=1, max_length=64)]
Document = Annotated[dict[DocumentKey, Text],
                     Field(min_length=1, max_length=MAX_DOCUMENT_FIELDS)]
Documents = Annotated[list[Document], Field(max_length=MAX_DOCUMENTS)]
"""The request field: each document an object of string fields, at most MAX_DOCUMENT_FIELDS;
keys are what templates look up (``title``, ``text``, ``source``...)."""

HEADING = "Documents:"


def template_takes_documents(chat_template: str | None) -> bool:
    """Whether the template reads the ``documents`` variable (else: a system message)."""
    return bool(chat_template) and "documents" in str(chat_template)


def documents_chars(documents: Sequence[dict[str, str]]) -> int:
    """Characters the documents bring into the prompt, keys included."""
    return sum(len(key) + len(value) for document in documents
               for key, value in document.items())


def documents_system_text(documents: Sequence[dict[str, str]]) -> str:
    """The documents as a system message's text, numbered from 0 in the order sent, each
    field on its own line as ``key: value``: the layout RAG chat templates use.

        Documents:

        Document: 0
        title: Tall penguins
        text: Emperor penguins are the tallest.
    """
    blocks = ["\n".join([f"Document: {number}",
                         *(f"{key}: {value}" for key, value in document.items())])
              for number, document in enumerate(documents)]
    return "\n\n".join([HEADING, *blocks])
