"""Tenancy building blocks without servers: tenants, visibility, salts, tiers, key hashing,
and the upload extractor's refusals (path traversal, links, junk)."""

from __future__ import annotations

import asyncio
import io
import tarfile
import zipfile
from pathlib import Path

import pytest
from starlette.requests import Request

from engine.http.errors import ApiError
from gateway.adapter_upload import extract_archive
from gateway.auth import Principal, StateView, authenticate
from gateway.caller import turn_of
from gateway.job import tier_share
from gateway.service import Gateway
from gateway.store import MemoryStore
from gateway.tenancy import (
    KEY_PREFIX,
    AdapterRecord,
    ApiKey,
    Tenant,
    derive_cache_salt,
    hash_key,
    new_key,
)


def test_tenant_validation_and_salts() -> None:
    acme = Tenant("acme")
    assert acme.cache_salt == f"tenant:acme:{acme.uid}"
    assert Tenant("acme", shared_salt="partners").cache_salt == "shared:partners"
    assert Tenant("beta", shared_salt="partners").cache_salt == "shared:partners"
    assert Tenant("acme", uid="").cache_salt == "tenant:acme"  # a record from before uids
    for bad in ({"tenant_id": ""}, {"tenant_id": "a b"}, {"tenant_id": "a", "rpm": 0},
                {"tenant_id": "a", "tpm": -5}, {"tenant_id": "a", "priority": 101},
                {"tenant_id": "a", "uid": "not hex!"}, {"tenant_id": "a", "rpm": 10**9 + 1},
                {"tenant_id": "a", "tpm": 2**70}, {"tenant_id": "a", "max_concurrency": True},
                {"tenant_id": "a", "max_concurrency": 10**6 + 1}):
        with pytest.raises(ValueError):
            Tenant(**bad)
    assert Tenant("a", rpm=10**9, tpm=10**12, max_concurrency=10**6).tpm == 10**12


@pytest.mark.parametrize("salt", ["a/b", "", "x" * 129, "a b", "a:b", "café", "a\nb"])
def test_shared_salt_is_a_short_safe_name(salt: str) -> None:
    with pytest.raises(ValueError, match="shared_salt"):
        Tenant("acme", shared_salt=salt)


def test_a_recreated_tenant_shares_no_salt_and_owns_nothing_of_the_old_one() -> None:
    old, new = Tenant("acme"), Tenant("acme")
    assert old.uid != new.uid and len(old.uid) == 16
    assert old.cache_salt != new.cache_salt
    owned = AdapterRecord("mine", "/m", owner="acme", owner_uid=old.uid)
    assert owned.visible_to("acme", old.uid)
    assert not owned.visible_to("acme", new.uid)
    assert not AdapterRecord("legacy", "/l", owner="acme").visible_to("acme", new.uid)


def test_a_key_issued_while_its_tenant_was_deleted_is_held_by_no_later_tenant() -> None:
    """The race: a key written after its tenant's delete (another request or replica)
    stays in the store; the tenant created again under the id must not hold it."""
    async def scenario() -> list[int | str]:
        store = MemoryStore()
        old, new = Tenant("acme"), Tenant("acme")
        assert await store.swap_tenant("acme", None, old)
        assert await store.delete_tenant("acme", old.uid) == []
        assert await store.swap_tenant("acme", None, new)
        # The race: stores refuse a key whose tenant incarnation is gone (put_key); one left
        # over in a store written before that check, or a key from before uids, is what
        # held_by decides on.
        store._keys[hash_key("late")] = ApiKey(hash_key("late"), "acme", "k1", 0.0, old.uid)
        assert await store.put_key(ApiKey(hash_key("legacy"), "acme", "k2", 0.0))
        view = StateView(store)
        await view.refresh()
        outcomes: list[int | str] = []
        for key in ("late", "legacy"):
            request = Request({"type": "http", "headers": [
                (b"authorization", f"Bearer {key}".encode())]})
            try:
                principal = authenticate(request, view)
                outcomes.append(principal.tenant.uid if principal.tenant else "operator")
            except ApiError as exc:
                outcomes.append(exc.status)
        return outcomes

    late, legacy = asyncio.run(scenario())
    assert late == 401 and isinstance(legacy, str) and legacy != "operator"
    old, new = Tenant("acme"), Tenant("acme")
    assert ApiKey("h", "acme", "k", 0.0, old.uid).held_by(old)
    assert not ApiKey("h", "acme", "k", 0.0, old.uid).held_by(new)
    assert ApiKey("h", "acme", "k", 0.0).held_by(new)  # a key from before uids
    assert not ApiKey("h", "beta", "k", 0.0).held_by(new)


def test_derived_salts_never_collide() -> None:
    """No two distinct (tenant salt, requested salt) pairs give one string; a tenant's salt
    alone never equals a derived one."""
    tenant_salts = ["shared:a/b", "shared:a", "shared:a/", "tenant:x", "tenant:x/y",
                    "shared:1:a", "shared:3:a/b"]
    requested: list[str | None] = [None, "b", "/b", "b/", "y/z", "z", "1:x", "3:a/b", "a"]
    seen: dict[str | None, tuple[str, str | None]] = {}
    for salt in tenant_salts:
        for extra in requested:
            derived = derive_cache_salt(salt, extra)
            assert derived not in seen, (salt, extra, seen[derived])
            seen[derived] = (salt, extra)
    # What the unescaped f"{salt}/{requested}" let collide:
    assert derive_cache_salt("shared:a/b", None) != derive_cache_salt("shared:a", "b")
    assert derive_cache_salt("tenant:x", "y/z") != derive_cache_salt("tenant:x/y", "z")
    gateway = Gateway.__new__(Gateway)  # cache_salt reads no gateway state
    acme = Principal(Tenant("acme", shared_salt="a"))
    assert gateway.cache_salt(acme, "b") == derive_cache_salt("shared:a", "b")
    assert gateway.cache_salt(acme, None) == "shared:a"
    # The operator's salts live apart: the admin key cannot name a tenant's blocks.
    operator = Principal(None)
    assert gateway.cache_salt(operator, None) is None
    assert gateway.cache_salt(operator, "b") != gateway.cache_salt(operator, "c")
    for salt in tenant_salts:
        assert gateway.cache_salt(operator, salt) not in seen


def test_adapter_visibility() -> None:
    acme, beta = Tenant("acme"), Tenant("beta")
    public = AdapterRecord("pub", "/p")
    owned = AdapterRecord("mine", "/m", owner="acme", owner_uid=acme.uid,
                          shared_with=("beta",))
    callers = [("acme", acme.uid), ("beta", beta.uid), ("gamma", "00"), (None, "")]
    assert [public.visible_to(*c) for c in callers] == [True] * 4
    assert [owned.visible_to(*c) for c in callers] == [True, True, False, True]


def test_keys_are_random_and_stored_as_hashes() -> None:
    a, b = new_key(), new_key()
    assert a != b and a.startswith(KEY_PREFIX) and len(a) > 40
    assert hash_key(a) == hash_key(a) != hash_key(b)
    assert a not in hash_key(a)


def test_lower_tiers_get_a_smaller_share_of_the_admission_bound() -> None:
    shares = [tier_share(Principal(Tenant("t", priority=p))) for p in (-1, 0, 1)]
    assert shares == [0.75, 0.9, 1.0]
    assert tier_share(Principal(None)) == 1.0


def _tar(members: dict[str, bytes], link: str | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo(link)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            archive.addfile(info)
    return buffer.getvalue()


def _extract(data: bytes, dest: Path) -> None:
    upload = dest.parent / f"{dest.name}.upload"
    upload.write_bytes(data)
    extract_archive(upload, dest, max_bytes=1 << 20)


def test_extract_flattens_one_top_directory(tmp_path: Path) -> None:
    _extract(_tar({"bot/adapter_config.json": b"{}", "bot/w.safetensors": b"x"}), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json",
                                                          "w.safetensors"]


@pytest.mark.parametrize("data", [
    _tar({"../escape": b"x"}),
    _tar({"/abs": b"x"}),
    _tar({"ok": b"x"}, link="evil"),
    b"not an archive",
    b"",
], ids=["dotdot", "absolute", "symlink", "junk", "empty"])
def test_extract_refuses_unsafe_archives(data: bytes, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        _extract(data, tmp_path)
    assert not (tmp_path.parent / "escape").exists()


def test_extract_refuses_zip_slip(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("../../evil.txt", "x")
    with pytest.raises(ValueError, match="unsafe path"):
        _extract(buffer.getvalue(), tmp_path)


def test_two_authorization_headers_are_a_400_whichever_comes_first() -> None:
    async def scenario() -> list[tuple[int, str | None]]:
        store = MemoryStore()
        acme = Tenant("acme")
        assert await store.swap_tenant("acme", None, acme)
        assert await store.put_key(ApiKey(hash_key("good"), "acme", "k1", 0.0, acme.uid))
        view = StateView(store)
        await view.refresh()
        outcomes = []
        for first, second in (("good", "bad"), ("bad", "good")):
            request = Request({"type": "http", "headers": [
                (b"authorization", f"Bearer {first}".encode()),
                (b"authorization", f"Bearer {second}".encode())]})
            with pytest.raises(ApiError) as refused:
                authenticate(request, view)
            outcomes.append((refused.value.status, refused.value.code))
        return outcomes

    assert asyncio.run(scenario()) == [(400, "invalid_authorization")] * 2


def test_work_before_admission_is_done_in_the_tenants_turn_or_the_clients() -> None:
    """A caller without a tenant (the open mode, the operator) takes its client address's
    turn on the engine's preparing thread: one client's flood of new grammars queues behind
    itself. A tenant id takes no ':', so no address can share a tenant's turn."""
    def request(host: str) -> Request:
        return Request({"type": "http", "headers": [], "client": (host, 5000)})

    acme = Principal(Tenant("acme"), "key-hash")
    assert turn_of(acme, request("10.0.0.1")) == turn_of(acme, request("10.0.0.2")) == "acme"
    assert turn_of(Principal(None), request("10.0.0.1")) == "client:10.0.0.1"
    assert turn_of(Principal(None), request("10.0.0.1")) != turn_of(Principal(None),
                                                                  request("10.0.0.2"))
    with pytest.raises(ValueError):
        Tenant("client:10.0.0.1")
