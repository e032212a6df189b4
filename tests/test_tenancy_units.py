"""Tenancy building blocks without servers: tenants, visibility, salts, tiers, key hashing,
and the upload extractor's refusals (path traversal, links, junk)."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from gateway.adapter_upload import extract_archive
from gateway.auth import Principal
from gateway.service import tier_share
from gateway.tenancy import KEY_PREFIX, AdapterRecord, Tenant, hash_key, new_key


def test_tenant_validation_and_salts() -> None:
    assert Tenant("acme").cache_salt == "tenant:acme"
    assert Tenant("acme", shared_salt="partners").cache_salt == "shared:partners"
    assert Tenant("beta", shared_salt="partners").cache_salt == "shared:partners"
    for bad in ({"tenant_id": ""}, {"tenant_id": "a b"}, {"tenant_id": "a", "rpm": 0},
                {"tenant_id": "a", "tpm": -5}, {"tenant_id": "a", "priority": 101}):
        with pytest.raises(ValueError):
            Tenant(**bad)


def test_adapter_visibility() -> None:
    public = AdapterRecord("pub", "/p")
    owned = AdapterRecord("mine", "/m", owner="acme", shared_with=("beta",))
    assert [public.visible_to(t) for t in ("acme", "beta", "gamma", None)] == [True] * 4
    assert [owned.visible_to(t) for t in ("acme", "beta", "gamma", None)] == [
        True, True, False, True]


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
