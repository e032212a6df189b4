"""Caller: the FastAPI dependency that authenticates a request to the OpenAI-style routes.

It runs before the body is validated, so a missing or wrong key is a 401 before any 400."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.auth import Principal
from gateway.service import Gateway


async def authenticate(request: Request) -> Principal:
    gateway: Gateway = request.app.state.gateway
    return await gateway.authenticate(request)


Caller = Annotated[Principal, Depends(authenticate)]
