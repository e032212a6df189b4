"""The refusal of a request that is about one of its fields."""

from __future__ import annotations


class InvalidField(ValueError):
    """A ValueError about one request field (by its API name): the 400 it becomes names
    ``field`` as its param, as the HTTP edge's own checks do. Raised by checks that need
    the model or several fields at once (token ids against the vocabulary, min_tokens
    against max_tokens, a constraint's compiled size)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def field_of(exc: object) -> str | None:
    """The field an exception (any object, for callers that hold one untyped) is about, if
    it says."""
    return exc.field if isinstance(exc, InvalidField) else None
