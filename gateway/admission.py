"""AdmittedRoute: the route class of the generation and tokenizer endpoints, which
authenticates the key and admits the request against its tenant's limits (RPM, concurrency,
a revoked key) before the body is read, parsed or validated.

Why before the body: parsing and validating a large body costs the event loop tens of
milliseconds (a JSON body of 8 MB: ~0.1 s to parse), paid by every request of the process.
Admitted first, a key over its limits is a 429 that costs nothing, and a body refused as
invalid still counts against its tenant's RPM, like any request refused later.

The claim admission takes is settled exactly once (Gateway.settle does nothing the second
time): by the route's own handling when the route ran (openai_api, info_api), else here, as
refused, when the body never reached it (a 400 for the body, a client that left mid-upload).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute

from gateway.access_log import record_of
from gateway.caller import authenticate, remember
from gateway.job import Claim
from gateway.service import Gateway

_CLAIM = "loragate.claim"
"""The request scope's key for its claim."""


class AdmittedRoute(APIRoute):
    """An APIRoute whose handler admits the caller first (see the module docstring); the
    route's own parameters get the claim through ``Admitted``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def admit_then_handle(request: Request) -> Response:
            gateway: Gateway = request.app.state.gateway
            principal = await authenticate(request)
            access = record_of(request)
            if access is not None:  # a refusal's access line names its tenant too
                access.tenant = principal.tenant_id
            principal, claim = await gateway.admit(principal)
            remember(request, principal)  # the route serves the tenant as admitted
            request.scope[_CLAIM] = claim
            try:
                return await handle(request)
            except BaseException:
                # Settled already when the route ran (openai_api._serve); here it never did.
                gateway.settle(claim, 0, "refused")
                raise

        return admit_then_handle


def admitted_claim(request: Request) -> Claim:
    """The claim AdmittedRoute took for this request."""
    claim = request.scope.get(_CLAIM)
    if not isinstance(claim, Claim):
        raise RuntimeError("Admitted is only available on an AdmittedRoute")
    return claim


Admitted = Annotated[Claim, Depends(admitted_claim)]
