"""Text as the OpenAI-compatible API takes it: valid Unicode only (JSON allows a lone UTF-16
surrogate, which cannot be encoded as UTF-8, so nothing downstream could use it)."""

from __future__ import annotations

import re
from typing import Annotated

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
