"""Text as the OpenAI-compatible API takes it: valid Unicode only (JSON allows a lone UTF-16
surrogate, which cannot be encoded as UTF-8, so nothing downstream could use it)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, StrictStr

_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` unchanged, or ValueError when it holds a lone UTF-16 surrogate (JSON allows
    "\\ud800"; such a string cannot be encoded as UTF-8, so nothing downstream can use it)."""
    if not text.isascii() and _SURROGATE.search(text):
        raise ValueError("contains a lone UTF-16 surrogate: not valid Unicode text")
    return text


Text = Annotated[StrictStr, AfterValidator(valid_text)]
"""A string field that must be valid Unicode text."""


def lone_surrogate_at(body: Any) -> tuple[str, bool] | None:
    """Where the first string of a parsed JSON body holding a lone surrogate is, key or
    value: (its path as errors name fields, ``tools.[0].function.parameters``; whether it is
    a key of the object there), or None when there is none. For free-form fields (a schema,
    chat_template_kwargs) that no Text validator reads, and for keys, which none does."""
    pending: list[tuple[Any, str]] = [(body, "")]
    while pending:
        node, path = pending.pop()
        if isinstance(node, str):
            if not node.isascii() and _SURROGATE.search(node):
                return path, False
        elif isinstance(node, dict):
            children = []
            for key, item in node.items():
                if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                    return path, True
                children.append((item, f"{path}.{key}" if path else str(key)))
            pending += reversed(children)  # depth first, in the body's order
        elif isinstance(node, list):
            pending += reversed([(item, f"{path}.[{i}]") for i, item in enumerate(node)])
    return None
