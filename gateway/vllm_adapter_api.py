"""vLLM's runtime adapter endpoints, for clients and scripts written against vLLM's
``--enable-lora`` runtime updates: ``POST /v1/load_lora_adapter`` and ``POST
/v1/unload_lora_adapter``, behind the same admin key as /admin/ (under /v1/, yet for the
operator only). They map onto the admin API: a load is a registration of a public adapter
(vLLM has no tenants), an unload is a delete without force (which waits for the engines as
``DELETE /admin/adapters/{name}`` does). Refusals name the fields as vLLM's bodies do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import ClassVar

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import Field

from engine.http.errors import ApiError
from gateway.admin_common import NAME_PATTERN, AdapterPath, AdminGateway
from gateway.openai_fields import StrictRequest, Unsupported
from gateway.service import Gateway

VLLM_ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""vLLM's runtime adapter endpoints: under /v1/, yet for the admin key only."""
VLLM_NAMES = {"name": "lora_name", "path": "lora_path"}
"""The admin bodies' field -> vLLM's name for it."""

Register = Callable[[str, str, Gateway], Awaitable[JSONResponse]]
"""Registers a public adapter (name, path) as POST /admin/adapters does."""
Delete = Callable[[str, Gateway], Awaitable[JSONResponse]]
"""Deletes an adapter without force as DELETE /admin/adapters/{name} does."""


class VllmLoadBody(StrictRequest):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str = Field(pattern=NAME_PATTERN)
    lora_path: AdapterPath
    lora_int_id: int | None = None
    """vLLM's internal number for the adapter: loragate names adapters by name only."""
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = {
        "load_inplace": Unsupported((False,), "a registered adapter is replaced by unloading "
                                              "it, then loading the new one"),
    }


class VllmUnloadBody(StrictRequest):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: str
    lora_int_id: int | None = None
    """As in VllmLoadBody."""


def build_vllm_adapter_router(register: Register, delete: Delete) -> APIRouter:
    """The two routes over the admin API's registration and delete."""
    router = APIRouter(tags=["admin"])

    @router.post(VLLM_ADMIN_PATHS[0])
    async def vllm_load(body: VllmLoadBody, gw: AdminGateway) -> PlainTextResponse:
        with _named_as_vllm():
            await register(body.lora_name, body.lora_path, gw)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 f"successfully.")

    @router.post(VLLM_ADMIN_PATHS[1])
    async def vllm_unload(body: VllmUnloadBody, gw: AdminGateway) -> PlainTextResponse:
        try:
            with _named_as_vllm():
                response = await delete(body.lora_name, gw)
        except ApiError as exc:
            if exc.code == "adapter_in_use":  # this body takes no force: say where it is
                exc.message = exc.message.replace(
                    "pass force=true", f"DELETE /admin/adapters/{body.lora_name}?force=true "
                    "to remove it once its requests end")
            raise
        pending = response.status_code == 202
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed"
            + (" once its last request ends." if pending else " successfully."),
            status_code=response.status_code)

    return router


@contextlib.contextmanager
def _named_as_vllm() -> Iterator[None]:
    """An error about a field names it as vLLM's adapter bodies do."""
    try:
        yield
    except ApiError as exc:
        exc.param = VLLM_NAMES.get(exc.param or "", exc.param)
        raise
