"""The admin API's adapter lifecycle against a live gateway and engine (max_lora_rank 8):
identity by name + digest across delete and re-upload, deletes that wait for the engines and
remove only the directories uploads created, upload intake (hostile archives refused with
400 off the event loop, nothing left behind), owners, rank limits and non-finite weights."""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import json
import shutil
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.demo_model import make_peft_adapter
from lora.targets import SUPPORTED_MODULES
from tests.live_http import engine_is_idle, poll, sse_events, wait_engines_idle
from tests.live_servers import LiveServer, running, start_engine, start_gateway
from tests.test_adapter_upload import tar_bytes

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


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
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


def upload_files(setup: Setup) -> list[str]:
    """Everything in the uploads directory, hidden staging files included."""
    return sorted(str(p.relative_to(setup.uploads)) for p in setup.uploads.rglob("*"))


def deleted(setup: Setup, name: str) -> bool:
    return admin(setup, "GET", f"/admin/adapters/{name}").status_code == 404


# ------------------------------------------------------------------ identity, delete
def _created(response: httpx.Response) -> httpx.Response | None:
    return response if response.status_code == 201 else None


def test_reupload_under_a_force_deleted_name_serves_only_the_new_weights(
        setup: Setup) -> None:
    """The attack: A's private adapter is busy, the admin force-deletes it and uploads B's
    under the same name as soon as the name is accepted; B must get B's weights."""
    want_new = reference(setup, "tb", "ref-new", setup.new)
    want_old = reference(setup, "ta", "ref-old", setup.old)
    assert want_new != want_old
    assert upload(setup, "shared", tar_dir(setup.old), "&owner=ta").status_code == 201
    with streaming(setup, "ta", "shared", max_tokens=900) as events:
        next(events)  # A's request is running on the engine
        drain = threading.Thread(target=lambda: list(events))
        drain.start()  # and runs to its end
        forced = admin(setup, "DELETE", "/admin/adapters/shared?force=true")
        assert forced.status_code in (200, 202), forced.text
        poll(lambda: _created(upload(setup, "shared", tar_dir(setup.new), "&owner=tb")),
             "the name to be accepted again", timeout_s=120, interval_s=0.2)
        assert text_of(complete(setup, "tb", "shared")) == want_new
        drain.join(120)
    wait_engines_idle(setup.engine.url)


def test_force_delete_of_a_busy_adapter_is_pending_until_its_requests_end(
        setup: Setup) -> None:
    assert upload(setup, "bot", tar_dir(setup.old), "&owner=ta").status_code == 201
    with streaming(setup, "ta", "bot", max_tokens=900) as events:
        next(events)  # A's request is running
        assert admin(setup, "DELETE", "/admin/adapters/bot").status_code == 409
        pending = admin(setup, "DELETE", "/admin/adapters/bot?force=true")
        assert pending.status_code == 202, pending.text
        assert pending.json()["status"] == "pending_delete"
        assert admin(setup, "GET", "/admin/adapters/bot").json()["status"] == "deleting"
        assert complete(setup, "ta", "bot").status_code == 404  # no new requests
        refused = upload(setup, "bot", tar_dir(setup.new), "&owner=tb")
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "adapter_deleting"
        assert (setup.uploads / "bot" / "adapter_model.safetensors").is_file()
    # A's request ends (the client went away): the delete completes by itself.
    poll(functools.partial(deleted, setup, "bot"), "the pending delete to complete")
    assert not (setup.uploads / "bot").exists()
    assert upload(setup, "bot", tar_dir(setup.new), "&owner=tb").status_code == 201
    wait_engines_idle(setup.engine.url)


def test_engine_holding_other_weights_under_the_name_is_reloaded_or_refused(
        setup: Setup) -> None:
    want_new = reference(setup, "tb", "ref-new-2", setup.new)
    # An engine that kept an adapter the gateway no longer knows (it was unreachable when
    # that adapter was deleted): same name, the old weights.
    engine = httpx.Client(base_url=setup.engine.url, timeout=60.0)
    with engine:
        assert engine.post("/adapters", json={"name": "kept", "path": str(setup.old)}
                           ).status_code == 200
        assert upload(setup, "kept", tar_dir(setup.new), "&owner=tb").status_code == 201
        body = {"prompt_token_ids": PROMPT, "lora": "kept", "request_id": "old-user",
                "params": {"max_tokens": 900, "ignore_eos": True}}
        with engine.stream("POST", "/generate", json=body) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the connection
            assert json.loads(next(lines))["finished"] is False
            busy = complete(setup, "tb", "kept")
            assert busy.status_code == 503, busy.text
            assert busy.json()["error"]["code"] == "adapter_busy"
            assert busy.headers["retry-after"] == "1"
            engine.post("/abort", json={"request_id": "old-user"})
        poll(functools.partial(engine_is_idle, setup.engine.url), "the engine to be idle")
        assert text_of(complete(setup, "tb", "kept")) == want_new  # reloaded: new digest


def test_delete_removes_only_directories_its_upload_created(setup: Setup) -> None:
    operator_dir = shutil.copytree(setup.new, setup.root / "operator-adapter")
    # A sibling whose path starts with the uploads directory's path.
    evil = shutil.copytree(setup.new, setup.root / "uploads-evil" / "x")
    for name, path in (("by-path", operator_dir), ("evil", evil)):
        assert register(setup, name, path, owner="tb").status_code == 201
        assert admin(setup, "DELETE", f"/admin/adapters/{name}").status_code == 200
        assert (path / "adapter_model.safetensors").is_file()
    assert upload(setup, "up", tar_dir(setup.new), "&owner=tb").status_code == 201
    assert register(setup, "up-alias", setup.uploads / "up", owner="tb").status_code == 201
    assert admin(setup, "DELETE", "/admin/adapters/up-alias").status_code == 200
    assert (setup.uploads / "up" / "adapter_model.safetensors").is_file()
    assert complete(setup, "tb", "up").status_code == 200
    wait_engines_idle(setup.engine.url)
    assert admin(setup, "DELETE", "/admin/adapters/up").status_code == 200
    assert not (setup.uploads / "up").exists()  # the last record of the upload went


# --------------------------------------------------------------------------- uploads
def _gzip_bomb(unpacked: int) -> bytes:
    """A tar.gz of one zero-filled member of `unpacked` bytes, ~1/1000 of that in size:
    gzip members of zeros concatenated (one gzip stream to a reader)."""
    info = tarfile.TarInfo("adapter_model.safetensors")
    info.size = unpacked
    block = gzip.compress(bytes(16 << 20), compresslevel=9)
    assert unpacked % (16 << 20) == 0
    return (gzip.compress(info.tobuf(format=tarfile.GNU_FORMAT))
            + block * (unpacked // (16 << 20)) + gzip.compress(bytes(1024)))


def _stream_gaps(setup: Setup, model: str, started: threading.Event, out: list[float]
                 ) -> None:
    """Stream a long completion, appending the time between consecutive events to out."""
    with streaming(setup, "tb", model, max_tokens=600) as events:
        last = None
        for event in events:
            now = time.monotonic()
            if last is not None:
                out.append(now - last)
            last = now
            started.set()
            if event == "[DONE]":
                break


def test_upload_unpacking_over_the_cap_is_refused_at_once_while_streams_flow(
        setup: Setup) -> None:
    bomb = _gzip_bomb(1 << 30)
    assert len(bomb) < 2 << 20
    before = upload_files(setup) if setup.uploads.exists() else []
    base = httpx.get(setup.gateway.url + "/v1/models", timeout=10.0, headers={
        "Authorization": f"Bearer {setup.keys['tb']}"}).json()["data"][0]["id"]
    gaps: list[float] = []
    started = threading.Event()
    thread = threading.Thread(target=_stream_gaps, args=(setup, base, started, gaps))
    thread.start()
    assert started.wait(60)
    sent = time.monotonic()
    refused = upload(setup, "bomb", bomb, "&owner=tb")
    took = time.monotonic() - sent
    thread.join(120)
    assert refused.status_code == 400, refused.text
    assert took < 3.0  # refused from the member's header, nothing unpacked
    assert gaps and max(gaps) < 3.0  # the concurrent stream never stalled
    assert "unpacks to more than" in refused.json()["error"]["message"]
    assert upload_files(setup) == before
    wait_engines_idle(setup.engine.url)


def _adapter_tar(setup: Setup, config: bytes) -> bytes:
    weights = (setup.new / "adapter_model.safetensors").read_bytes()
    return tar_bytes([("adapter_config.json", config), ("adapter_model.safetensors", weights)])


def _bad_crc_zip(setup: Setup) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.write(setup.new / "adapter_config.json", "adapter_config.json")
        archive.write(setup.new / "adapter_model.safetensors", "adapter_model.safetensors")
    data = bytearray(buffer.getvalue())
    data[30 + len("adapter_config.json") + 10] ^= 0xFF  # inside the first member's bytes
    return bytes(data)


@pytest.mark.parametrize("case", ["truncated-gzip", "zip-crc", "duplicate", "file-and-dir",
                                  "deep-json", "non-utf8-config"])
def test_malformed_uploads_are_400_and_leave_nothing(setup: Setup, case: str) -> None:
    good = tar_dir(setup.new)
    config = (setup.new / "adapter_config.json").read_bytes()
    data = {
        "truncated-gzip": good[: len(good) // 2],
        "zip-crc": _bad_crc_zip(setup),
        "duplicate": tar_bytes([("adapter_config.json", config),
                                ("adapter_config.json", config)]),
        "file-and-dir": tar_bytes([("adapter_config.json", config),
                                   ("adapter_config.json/x", b"x")]),
        "deep-json": _adapter_tar(setup, b"[" * 100_000 + b"]" * 100_000),
        "non-utf8-config": _adapter_tar(setup, config.replace(b"{", b'{"x": "\xff",', 1)),
    }[case]
    before = upload_files(setup) if setup.uploads.exists() else []
    response = upload(setup, f"bad-{case}", data, "&owner=tb")
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("adapter upload refused")
    assert str(setup.uploads) not in response.text
    assert deleted(setup, f"bad-{case}")
    assert upload_files(setup) == before


def test_dot_member_archive_is_accepted(setup: Setup) -> None:
    # What `tar -C adapter -czf adapter.tgz .` writes: a "." member, then "./..." members.
    response = upload(setup, "dotted", tar_dir(setup.new, arcname="."), "&owner=tb")
    assert response.status_code == 201, response.text
    assert sorted(p.name for p in (setup.uploads / "dotted").iterdir()) == sorted(
        p.name for p in setup.new.iterdir())


def test_owner_is_required_unless_public_is_explicit(setup: Setup) -> None:
    for response in (upload(setup, "nobody", tar_dir(setup.new)),
                     register(setup, "nobody", setup.new)):
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "owner"
    both = register(setup, "nobody", setup.new, owner="ta", public=True)
    assert both.status_code == 400
    assert register(setup, "everyone", setup.new, public=True).status_code == 201
    for tenant in ("ta", "tb"):
        assert complete(setup, tenant, "everyone").status_code == 200
    assert upload(setup, "everyone-up", tar_dir(setup.new), "&public=true").status_code == 201
    assert admin(setup, "GET", "/admin/adapters/everyone-up").json()["owner"] is None
    wait_engines_idle(setup.engine.url)


def test_rank_over_the_engines_max_lora_rank_is_refused(setup: Setup,
                                                        tiny_model_dir: Path) -> None:
    rank16 = make_peft_adapter(tiny_model_dir, setup.root / "rank16", rank=16,
                               target_modules=("q_proj", "v_proj"), seed=5)
    for response in (upload(setup, "rank16", tar_dir(rank16), "&owner=tb"),
                     register(setup, "rank16", rank16, owner="tb")):
        assert response.status_code == 400, response.text
        assert "rank 16 exceeds max_lora_rank 8" in response.json()["error"]["message"]
    assert deleted(setup, "rank16")


def test_non_finite_weights_are_refused(setup: Setup) -> None:
    from safetensors.torch import load_file, save_file

    poisoned = shutil.copytree(setup.new, setup.root / "poisoned")
    tensors = load_file(str(poisoned / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(poisoned / "adapter_model.safetensors"))
    response = upload(setup, "poisoned", tar_dir(poisoned), "&owner=tb")
    assert response.status_code == 400
    assert "NaN or infinite" in response.json()["error"]["message"]


# ------------------------------------------------------------------- engine startup
def test_engine_starts_without_the_bad_or_outside_adapters_of_its_adapter_dir(
        setup: Setup, tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter_dir = tmp_path / "adapters"
    adapter_dir.mkdir()
    shutil.copytree(setup.new, adapter_dir / "good")
    corrupt = shutil.copytree(setup.new, adapter_dir / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"garbage")
    outside = shutil.copytree(setup.old, tmp_path / "outside")
    (adapter_dir / "linked").symlink_to(outside, target_is_directory=True)
    engine = start_engine(tiny_model_dir, tmp_path, "--num-kv-blocks", "64",
                          "--adapter-dir", str(adapter_dir))
    try:
        engine.wait_ready()
        listed = httpx.get(engine.url + "/adapters", timeout=10.0).json()
        assert [a["name"] for a in listed] == ["good"]
        served = httpx.post(engine.url + "/generate", timeout=60.0, json={
            "prompt_token_ids": PROMPT, "lora": "good", "stream": False,
            "params": {"max_tokens": 4, "temperature": 0}})
        assert served.status_code == 200, served.text
        assert "adapter corrupt not registered" in engine.log()
    finally:
        engine.stop()


def test_parse_adapters_skips_links_that_lead_outside_the_dir(
        tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    from engine.adapter_roots import parse_adapters

    adapter_dir = tmp_path / "adapters"
    adapter_dir.mkdir()
    inside = shutil.copytree(tiny_adapters["a0"], adapter_dir / "real")
    (adapter_dir / "alias").symlink_to(inside, target_is_directory=True)  # stays inside
    (adapter_dir / "outside").symlink_to(tiny_adapters["a1"], target_is_directory=True)
    leaky = shutil.copytree(tiny_adapters["a0"], adapter_dir / "leaky")
    (leaky / "adapter_model.safetensors").unlink()
    (leaky / "adapter_model.safetensors").symlink_to(
        tiny_adapters["a1"] / "adapter_model.safetensors")
    assert parse_adapters([], str(adapter_dir)) == {"alias": str(inside.resolve()),
                                                   "real": str(inside.resolve())}


def test_vllm_runtime_adapter_endpoints_register_and_remove(setup: Setup) -> None:
    # vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, behind the admin key.
    body = {"lora_name": "vllm-style", "lora_path": str(setup.old)}
    refused = httpx.post(setup.gateway.url + "/v1/load_lora_adapter", json=body, timeout=60,
                         headers={"Authorization": f"Bearer {setup.keys['ta']}"})
    assert refused.status_code in (401, 403)
    loaded = admin(setup, "POST", "/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'vllm-style' added successfully."
    # Public (vLLM has no tenants): both tenants may use it, and it serves those weights.
    want = reference(setup, "ta", "vllm-style-ref", setup.old)
    assert text_of(complete(setup, "ta", "vllm-style")) == want
    assert text_of(complete(setup, "tb", "vllm-style")) == want
    again = admin(setup, "POST", "/v1/load_lora_adapter", json=body)
    assert again.status_code == 409
    wait_engines_idle(setup.engine.url)
    removed = admin(setup, "POST", "/v1/unload_lora_adapter",
                    json={"lora_name": "vllm-style"})
    assert removed.status_code == 200, removed.text
    assert complete(setup, "ta", "vllm-style").status_code == 404
    assert admin(setup, "POST", "/v1/unload_lora_adapter",
                 json={"lora_name": "vllm-style"}).status_code == 404
