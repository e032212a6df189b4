"""Adapter upload intake against a live gateway and engine (max_lora_rank 8): hostile and
malformed archives (a gzip bomb, a bad CRC, duplicate or clashing members, a deeply nested
or non-UTF-8 config) refused with 400 off the event loop, leaving nothing behind; archives
of a "." member accepted; an owner required unless public is explicit; ranks over the
engines' max_lora_rank and non-finite weights refused, for uploads and registrations alike.
"""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.demo_model import make_peft_adapter
from tests.adapter_lifecycle_helpers import (
    ADMIN,
    Setup,
    admin,
    complete,
    deleted,
    live_setup,
    register,
    streaming,
    tar_dir,
    upload,
)
from tests.live_http import wait_engines_idle
from tests.test_adapter_upload import tar_bytes


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    with live_setup(tiny_model_dir, tmp_path_factory) as running_setup:
        yield running_setup


def upload_files(setup: Setup) -> list[str]:
    """Everything in the uploads directory, hidden staging files included."""
    return sorted(str(p.relative_to(setup.uploads)) for p in setup.uploads.rglob("*"))


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
    dotted = Path(admin(setup, "GET", "/admin/adapters/dotted").json()["path"])
    assert sorted(p.name for p in dotted.iterdir()) == sorted(
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
    for extra, param in (("&owner=ta&shared_with=tb", "shared_with"), ("&public=true&x=1", "x"),
                         ("&owner=ta&owner=tb", "owner"), ("&name=other&public=true", "name")):
        unknown = upload(setup, "not-made", tar_dir(setup.new), extra)
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == param
    assert admin(setup, "GET", "/admin/adapters/not-made").status_code == 404
    assert admin(setup, "GET", "/admin/adapters/other").status_code == 404
    # "$" of the name's pattern matches before a last newline too: the whole name must match.
    newline = upload(setup, "not-made%0A", tar_dir(setup.new), "&public=true")
    assert newline.status_code == 400 and newline.json()["error"]["param"] == "name"
    wait_engines_idle(setup.engine.url)


def test_patch_makes_an_adapter_public_only_when_told_so(setup: Setup) -> None:
    assert register(setup, "private-one", setup.new, owner="ta").status_code == 201
    cleared = admin(setup, "PATCH", "/admin/adapters/private-one", json={"owner": None})
    assert cleared.status_code == 400 and cleared.json()["error"]["param"] == "owner"
    assert complete(setup, "tb", "private-one").status_code == 404  # still ta's alone
    both = admin(setup, "PATCH", "/admin/adapters/private-one",
                 json={"owner": "tb", "public": True})
    assert both.status_code == 400
    public = admin(setup, "PATCH", "/admin/adapters/private-one", json={"public": True})
    assert public.status_code == 200 and public.json()["owner"] is None
    assert complete(setup, "tb", "private-one").status_code == 200
    # And back: public=false alone would leave every tenant its access, so it needs owner.
    alone = admin(setup, "PATCH", "/admin/adapters/private-one", json={"public": False})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "owner"
    assert complete(setup, "tb", "private-one").status_code == 200
    private = admin(setup, "PATCH", "/admin/adapters/private-one",
                    json={"public": False, "owner": "ta"})
    assert private.status_code == 200 and private.json()["owner"] == "ta"
    assert complete(setup, "tb", "private-one").status_code == 404
    wait_engines_idle(setup.engine.url)


def test_a_directory_left_in_the_uploads_never_blocks_a_name(setup: Setup) -> None:
    """What a gateway with another state store (or one stopped mid-upload, or an earlier
    run that kept its state in memory) left there is not this store's record: the name is
    the store's to give."""
    left = setup.uploads / "left-behind"
    left.mkdir(parents=True)
    (left / "adapter_config.json").write_text("{}")
    response = upload(setup, "left-behind", tar_dir(setup.new), "&owner=tb")
    assert response.status_code == 201, response.text
    assert Path(response.json()["path"]) != left.resolve()
    assert (left / "adapter_config.json").read_text() == "{}"  # not another's to remove
    assert complete(setup, "tb", "left-behind").status_code == 200
    wait_engines_idle(setup.engine.url)


def test_shares_name_existing_tenants_only(setup: Setup) -> None:
    """A share with a tenant id that does not exist would go to whoever is created under it
    later: a 400 naming shared_with, at registration and on a change."""
    refused = register(setup, "ghost-share", setup.new, owner="ta",
                       shared_with=["tb", "nosuch"])
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "shared_with" and "'nosuch'" in error["message"]
    assert admin(setup, "GET", "/admin/adapters/ghost-share").status_code == 404
    assert register(setup, "real-share", setup.new, owner="ta",
                    shared_with=["tb"]).status_code == 201
    patched = admin(setup, "PATCH", "/admin/adapters/real-share",
                    json={"shared_with": ["tb", "nosuch"]})
    assert patched.status_code == 400 and patched.json()["error"]["param"] == "shared_with"
    assert admin(setup, "GET", "/admin/adapters/real-share").json()["shared_with"] == ["tb"]
    repeated = admin(setup, "PATCH", "/admin/adapters/real-share",
                     json={"shared_with": ["tb", "ta", "tb"]})
    assert repeated.status_code == 200, repeated.text
    assert admin(setup, "GET", "/admin/adapters/real-share").json()["shared_with"] == ["tb", "ta"]
    assert complete(setup, "tb", "real-share").status_code == 200
    # The shares were ta's to give: given to tb, the adapter is tb's alone until tb shares.
    moved = admin(setup, "PATCH", "/admin/adapters/real-share", json={"owner": "tb"})
    assert moved.status_code == 200 and moved.json()["shared_with"] == []
    assert complete(setup, "ta", "real-share").status_code == 404
    shared = admin(setup, "PATCH", "/admin/adapters/real-share",
                   json={"owner": "ta", "shared_with": ["tb"]})
    assert shared.status_code == 200 and shared.json()["shared_with"] == ["tb"]
    assert complete(setup, "tb", "real-share").status_code == 200
    wait_engines_idle(setup.engine.url)


@pytest.mark.parametrize(("method", "path", "body", "param"), [
    ("POST", "/admin/adapters", r'{"name": "nul", "path": "/tmp/a\u0000b", "owner": "ta"}',
     "path"),
    ("POST", "/v1/load_lora_adapter", r'{"lora_name": "nul", "lora_path": "/tmp/a\u0000b"}',
     "lora_path"),
    ("POST", "/admin/adapters",
     r'{"name": "sur", "path": "/tmp/x", "owner": "ta", "shared_with": ["\ud800"]}',
     "shared_with.[0]"),
    ("PATCH", "/admin/tenants/ta", r'{"name": "\ud800"}', "name"),
    ("PATCH", "/admin/tenants/ta", '{"name": "' + "x" * 5000 + '"}', "name"),
    ("PATCH", "/admin/tenants/ta", '{"rpm": true}', "rpm"),
    ("PATCH", "/admin/tenants/ta", '{"tpm": 1180591620717411303424}', "tpm"),
    ("POST", "/admin/tenants", r'{"tenant_id": "tz", "name": "\udfff"}', "name"),
], ids=["nul-path", "nul-lora-path", "surrogate-share", "surrogate-name", "long-name",
        "bool-rpm", "huge-tpm", "surrogate-new-tenant"])
def test_admin_bodies_refuse_what_they_could_not_store_or_show(
        setup: Setup, method: str, path: str, body: str, param: str) -> None:
    """Raw JSON: a lone surrogate or a NUL in a JSON string is valid JSON. Each is a 400
    naming the field, nothing is stored, and the listings still answer."""
    response = httpx.request(method, setup.gateway.url + path, content=body, timeout=60.0,
                             headers={"Authorization": f"Bearer {ADMIN}",
                                      "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    for listing in ("/admin/tenants", "/admin/adapters"):
        assert admin(setup, "GET", listing).status_code == 200


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
