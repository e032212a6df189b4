"""Shared by the live adapter tests (test_adapter_lifecycle_live.py,
test_adapter_upload_intake_live.py): a gateway and an engine (max_lora_rank 8, uploads into
a directory of their own) with two tenants and two rank-4 adapters of the tiny model, and
the admin / completion calls the tests make against them.
"""

from __future__ import annotations

import contextlib
import io
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.demo_model import make_peft_adapter
from lora.targets import SUPPORTED_MODULES
from tests.live_http import sse_events
from tests.live_servers import LiveServer, running, start_engine, start_gateway

ADMIN = "lifecycle-admin"
PROMPT = list(range(20, 52))


@dataclass
class Setup:
    engine: LiveServer
    gateway: LiveServer
    uploads: Path
    root: Path
    old: Path
    """Rank 4, all modules: tenant A's weights."""
    new: Path
    """Rank 4, all modules, other seed: tenant B's weights under the same name later."""
    keys: dict[str, str]


def tar_dir(directory: Path, arcname: str | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(directory, arcname=arcname if arcname is not None else directory.name)
    return buffer.getvalue()


@contextlib.contextmanager
def live_setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Setup]:
    """The running gateway and engine, tenants ta and tb with a key each (a module-scoped
    fixture of each test file that uses it)."""
    root = tmp_path_factory.mktemp("lifecycle")
    old, new = (make_peft_adapter(tiny_model_dir, root / name, rank=4,
                                  target_modules=SUPPORTED_MODULES, seed=seed)
                for name, seed in (("old-weights", 11), ("new-weights", 12)))
    uploads = root / "uploads"
    engine = start_engine(tiny_model_dir, root, "--num-kv-blocks", "256",
                          "--max-lora-rank", "8", "--adapter-root", str(root))
    gateway = start_gateway(tiny_model_dir, [engine.url], root, "--admin-key", ADMIN,
                            "--adapter-upload-dir", str(uploads))
    with running(engine, gateway):
        setup = Setup(engine, gateway, uploads, root, old, new, {})
        for tenant in ("ta", "tb"):
            assert admin(setup, "POST", "/admin/tenants",
                         json={"tenant_id": tenant}).status_code == 201
            setup.keys[tenant] = admin(setup, "POST", f"/admin/tenants/{tenant}/keys"
                                       ).json()["key"]
        yield setup


def admin(setup: Setup, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, setup.gateway.url + path, timeout=60.0,
                         headers={"Authorization": f"Bearer {ADMIN}"}, **kwargs)


def upload(setup: Setup, name: str, data: bytes, query: str = "") -> httpx.Response:
    return admin(setup, "POST", f"/admin/adapters/upload?name={name}{query}", content=data)


def register(setup: Setup, name: str, path: Path, **fields: object) -> httpx.Response:
    return admin(setup, "POST", "/admin/adapters",
                 json={"name": name, "path": str(path), **fields})


def complete(setup: Setup, tenant: str, model: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(setup.gateway.url + "/v1/completions", timeout=60.0,
                      headers={"Authorization": f"Bearer {setup.keys[tenant]}"},
                      json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True})


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def reference(setup: Setup, tenant: str, name: str, path: Path) -> str:
    """Greedy output of the weights at path, loaded alone under a name of their own."""
    assert register(setup, name, path, owner=tenant).status_code == 201
    return text_of(complete(setup, tenant, name))


@contextlib.contextmanager
def streaming(setup: Setup, tenant: str, model: str, max_tokens: int) -> Iterator[Iterator[Any]]:
    """A streamed completion's SSE events; leaving the block drops the connection."""
    with httpx.Client(timeout=60.0) as client, client.stream(
            "POST", setup.gateway.url + "/v1/completions",
            headers={"Authorization": f"Bearer {setup.keys[tenant]}"},
            json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                  "temperature": 0, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        yield sse_events(response)


def deleted(setup: Setup, name: str) -> bool:
    return admin(setup, "GET", f"/admin/adapters/{name}").status_code == 404
