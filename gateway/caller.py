"""Caller: the FastAPI dependency that authenticates a request to the OpenAI-style routes.

It runs before the body is validated (on the generation and tokenizer routes, before the body
is even read: gateway/admission.py), so a missing or wrong key is a 401 before any 400."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.auth import Principal
from gateway.service import Gateway

_PRINCIPAL = "loragate.principal"
"""The request scope's key for its caller, once known."""


async def authenticate(request: Request) -> Principal:
    """The request's caller, looked up once per request (AdmittedRoute looks it up before
    the route's dependencies run)."""
    principal = request.scope.get(_PRINCIPAL)
    if not isinstance(principal, Principal):
        gateway: Gateway = request.app.state.gateway
        principal = request.scope[_PRINCIPAL] = await gateway.authenticate(request)
    return principal


def remember(request: Request, principal: Principal) -> None:
    """Make ``principal`` the request's caller from now on (admission's, as of arrival)."""
    request.scope[_PRINCIPAL] = principal


Caller = Annotated[Principal, Depends(authenticate)]


def turn_of(principal: Principal, request: Request) -> str:
    """Whose turn the engine's work before admission (compiling a grammar, spelling bad
    words) is done in (GenerateRequest.tenant): the tenant's; for a caller with none (the
    open mode, the operator) its client address, so that one client's flood of new grammars
    waits behind itself, not every other client's behind it. Tenant ids take no ':'."""
    if principal.tenant_id is not None:
        return principal.tenant_id
    return f"client:{request.client.host if request.client else ''}"
