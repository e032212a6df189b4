"""HTTP errors in OpenAI's schema, shared by the engine server and the gateway.

Every error any of our HTTP servers returns has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``,
including FastAPI's own request-validation errors (400 here, not FastAPI's 422, as OpenAI
does), engine errors (engine/protocol.py: their status and code) and unexpected exceptions
(500, "internal error": no exception name or text).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.invalid_field import field_of
from engine.protocol import EngineError, EngineUnavailable, error_type

log = logging.getLogger(__name__)
ERROR_CODE_KEY = "loragate.error_code"
"""Where an error response's code is left in the ASGI scope (for per-code metrics)."""


class ApiError(Exception):
    """An error with an HTTP status, raised anywhere below a route and rendered by the app."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @classmethod
    def of(cls, error: EngineError, headers: dict[str, str] | None = None) -> ApiError:
        """The HTTP answer for an engine's error (its status, code and param)."""
        return cls(error.status, error.message, code=error.code, param=error.param,
                   headers=headers)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class CodedHTTPException(StarletteHTTPException):
    """An HTTP error with an error code, for code that runs where FastAPI only passes
    HTTPExceptions on (reading the body: any other exception there becomes a 400)."""

    def __init__(self, status: int, message: str, *, code: str) -> None:
        super().__init__(status, message)
        self.code = code


def error_body(status: int, message: str, *, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


NOT_AN_OBJECT = frozenset({"model_attributes_type", "model_type", "dict_type"})
"""Validation error types of a body that is not a JSON object at all (a list, a string, a
body FastAPI did not parse as JSON because of its content type)."""
NOT_AN_OBJECT_MESSAGE = ("the request body must be a JSON object, sent with Content-Type: "
                         "application/json")


TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})
"""Loc parts pydantic adds for the members of a union (with any part that is not a plain
lower-case name: "list[int]", "constrained-str", a model's class name): not fields."""


def _is_tag(part: str) -> bool:
    if part in TYPE_TAGS or not part.replace("_", "a").isalnum():
        return True
    return not part.islower() and not part.isdigit()


def _wrong_type(err: Any) -> bool:
    """A union member's "not my type": a type error, or a literal member given an object or
    array (tool_choice's "auto" given a named choice)."""
    kind = str(err.get("type", ""))
    return kind.endswith("_type") or (kind == "literal_error"
                                      and isinstance(err.get("input"), dict | list))


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    return describe_errors(exc.errors())


def describe_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) of a body's validation errors (pydantic's ``errors()``), as a 400
    says them: each field by its path once, pydantic's words where ours say it better."""
    problems: list[str] = []
    locs: list[tuple[str, ...]] = []
    # A union fails once per member: where a member took the value's type and refused its
    # content, the other members' "not my type" errors only hide that one.
    valued = {_shown(e.get("loc", ())) for e in errors if not _wrong_type(e)}
    for err in errors:
        shown = _shown(err.get("loc", ()))
        if _wrong_type(err) and any(v == shown or v.startswith((shown + ".", shown + "["))
                                    for v in valued):
            continue  # a member took the value and refused what is in it
        if err.get("type") == "json_invalid":  # loc is ("body", character offset): no param
            detail = (err.get("ctx") or {}).get("error", "JSON decode error")
            at = err.get("loc", ())[-1]
            problems.append(f"the request body is not valid JSON: {detail} (at character {at})")
            continue
        loc = tuple(str(part) for part in err.get("loc", ()) if part != "body")
        about = field_of((err.get("ctx") or {}).get("error"))
        if about is not None:
            loc = _named(loc, about)
        if not loc and err.get("type") in (*NOT_AN_OBJECT, "missing"):  # e.g. text/plain
            problems.append(NOT_AN_OBJECT_MESSAGE)
            continue
        locs.append(loc)
        message = _text_length(err) or _exact_bound(err) or str(
            err.get("msg", "invalid")).removeprefix("Value error, ")
        # Our refusals of unsupported fields already name theirs ("use_beam_search is not
        # supported: ..."): prefixed again, the name would be said twice; a nested one gets
        # its whole path in the name's place.
        unsupported = err.get("type") == "unsupported_field" and bool(loc)
        if unsupported and loc[-1:] == (shown,):  # top level: the message names it
            problem = message
        elif unsupported and message.startswith(loc[-1] + " "):
            problem = shown + message[len(loc[-1]):]
        else:
            problem = f"{shown}: {message}" if shown and about is None else message
        if problem not in problems:
            problems.append(problem)
    return "; ".join(problems) or "invalid request body", _param(locs)


def _named(loc: tuple[str, ...], about: str) -> tuple[str, ...]:
    """The location of an error whose check named its field ``about``: one on the path to
    where pydantic located it (kept with the list indices right after it: messages[0] for a
    check of one message), or a field of the model there (a check across fields); a path
    ("tools.[2].parameters") is one under the model there."""
    if "." in about:
        return (*loc, *(part.strip("[]") for part in about.split(".")))
    if about not in loc:
        return (*loc, about)
    end = len(loc) - loc[::-1].index(about)
    while end < len(loc) and loc[end].isdigit():
        end += 1
    return loc[:end]


def _text_length(err: Any) -> str | None:
    """pydantic's message for a length bound of a string whose type carries a validator
    speaks of "items"; the client sent text, and is told in characters, as pydantic tells
    it for a plain string."""
    kind, ctx, value = err.get("type"), err.get("ctx") or {}, err.get("input")
    if not isinstance(value, str) or kind not in ("too_short", "too_long"):
        return None
    bound = ctx.get("min_length") if kind == "too_short" else ctx.get("max_length")
    if not isinstance(bound, int):
        return None
    side = "at least" if kind == "too_short" else "at most"
    return f"String should have {side} {bound} character{'' if bound == 1 else 's'}"


BOUNDS = {"less_than": "less than", "less_than_equal": "less than or equal to",
          "greater_than": "greater than", "greater_than_equal": "greater than or equal to"}


def _exact_bound(err: Any) -> str | None:
    """pydantic's message for a number's bound, with an integer bound as it is: pydantic
    prints one past 2**53 as a float (2**64 - 1 as 18446744073709552000)."""
    words, ctx = BOUNDS.get(str(err.get("type"))), err.get("ctx") or {}
    bound = next(iter(ctx.values()), None) if len(ctx) == 1 else None
    if words is None or not isinstance(bound, int) or isinstance(bound, bool):
        return None
    return f"Input should be {words} {bound}"


def _shown(loc: tuple[Any, ...]) -> str:
    """A field's path as a client wrote it: messages[0].content (no union member tags)."""
    shown = ""
    for part in loc:
        if isinstance(part, int) or str(part).isdigit():
            shown += f"[{part}]"
        elif part != "body" and not _is_tag(str(part)):
            shown += f".{part}" if shown else str(part)
    return shown


def _param(locs: list[tuple[str, ...]]) -> str | None:
    """The field the first error is about, as OpenAI writes a param: the whole path, list
    indices in brackets as parts of their own ("messages.[0].content"). A union field fails
    once per member, each loc tagged with the member's type ("prompt.str",
    "prompt.list[int]"): the param is the path those errors share, without type tags."""
    if not locs:
        return None
    path = locs[0]
    for loc in locs[1:]:
        if loc[:1] == path[:1]:
            shared = 0
            while shared < min(len(path), len(loc)) and path[shared] == loc[shared]:
                shared += 1
            path = path[:shared]
    parts = [f"[{part}]" if part.isdigit() else part for part in path
             if part.isdigit() or not _is_tag(part)]
    return ".".join(parts) or None


def answer(request: Request, error: ApiError) -> JSONResponse:
    """The response of an error handler: the error, its code noted in the scope for the
    response metrics (ERROR_CODE_KEY)."""
    request.scope[ERROR_CODE_KEY] = error.code
    return error.response()


CLIENT_CLOSED = 499
"""nginx's status for a client that closed the connection before its answer: what the access
line and the response metrics count a request whose body never came whole as."""


REFUSED_FRAMING_KEY = "loragate.refused_framing"
"""Scope key: the (status, message, code) the HTTP protocol already answered a request whose
body it could not parse (engine/http/guarded_protocol.py) before ending the request's body."""


def _client_closed(request: Request) -> JSONResponse:
    """The answer to a request whose client left while its body was read (nobody reads it:
    it is what the access line and the metrics record, not a 400 or a crash). When the
    protocol ended the body itself, refusing its framing, that refusal is what counts."""
    refused = request.scope.get(REFUSED_FRAMING_KEY)
    if refused is not None:
        status, message, code = refused
        return answer(request, ApiError(status, message, code=code))
    return answer(request, ApiError(CLIENT_CLOSED, "the client closed the connection before "
                                    "its request body was read", code="client_closed"))


def _no_route(request: Request, openai_routes: str | None) -> str:
    """The 404 message for a path no route serves: the method and path the client sent
    (its own words, cut short), and for an OpenAI path, which ones this server has."""
    path = str(request.scope.get("path", ""))  # as sent: the URL would read "//v1/x" as a host
    shown = path if len(path) <= 120 else path[:120] + "..."
    served = f"; of the OpenAI API this server has {openai_routes}" \
        if openai_routes and path.startswith("/v1/") else ""
    return f"no such endpoint: {request.method} {shown}{served}"


def install_error_handlers(app: FastAPI, openai_routes: str | None = None) -> None:
    """Render ApiError, EngineError, validation errors, HTTP errors and crashes in OpenAI's
    schema. ``openai_routes``: the OpenAI endpoints the app serves, named in the 404 of an
    OpenAI path it does not (a client pointed here for embeddings, say)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        headers = None
        if isinstance(exc, EngineUnavailable):  # nothing ran: worth a retry, here or elsewhere
            headers = {"Retry-After": "1"}
            if exc.code == "draining":  # this server is going: reconnect elsewhere
                headers["Connection"] = "close"
        return answer(request, ApiError.of(exc, headers))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return JSONResponse(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, _: ClientDisconnect) -> JSONResponse:
        return _client_closed(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's 400 for a body it could
            return _client_closed(request)              # not read: its client left
        code = exc.code if isinstance(exc, CodedHTTPException) else None
        request.scope[ERROR_CODE_KEY] = code
        detail = str(exc.detail)
        cause = exc.__cause__
        if "integer string conversion" in str(cause):  # Python's JSON parser's bound
            detail = (f"the request body is not valid JSON here: it has an integer of more "
                      f"than {sys.get_int_max_str_digits()} digits")
        elif isinstance(cause, UnicodeDecodeError):  # FastAPI's generic "error parsing"
            detail = (f"the request body is not valid JSON: it is not UTF-8 text (byte "
                      f"{cause.start})")
        elif isinstance(cause, RecursionError):
            detail = ("the request body is not valid JSON here: its arrays and objects nest "
                      "deeper than the parser goes")
        elif exc.status_code == 404 and detail == "Not Found":  # no route: say which
            detail = _no_route(request, openai_routes)
        return JSONResponse(error_body(exc.status_code, detail, code=code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        # The details are in the log; the caller learns nothing about our internals.
        return JSONResponse(error_body(500, "internal error"), status_code=500)
