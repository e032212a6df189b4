"""Number fields as JSON has them, for the pydantic models of both HTTP edges (the gateway's
OpenAI API and the engine's own): pydantic's lax mode reads True as 1 (True == 1 in Python)
and "4" as 4, which neither API means."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator


def _a_number(value: Any) -> Any:
    if isinstance(value, bool | str):
        kind = "boolean" if isinstance(value, bool) else "string"
        raise ValueError(f"must be a number, not a {kind}")
    return value


Int = Annotated[int, BeforeValidator(_a_number)]
"""An integer field: a JSON number (2.0 reads as 2), never a boolean or a string."""
Float = Annotated[float, BeforeValidator(_a_number)]
"""A float field: a JSON number, never a boolean or a string."""
