"""The upload extractor (gateway/adapter_upload.py) on hostile and damaged archives: every
refusal is a ValueError (the route's 400), found from headers before data is unpacked."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from gateway.adapter_upload import MAX_MEMBERS, extract_archive

CAP = 1 << 20


def tar_bytes(members: list[tuple[str, bytes | None]], mode: str = "w:gz") -> bytes:
    """A tar of (name, data) members; data None: a directory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as archive:  # type: ignore[call-overload]
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def zip_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members:
            archive.writestr(name, data)
    return buffer.getvalue()


def extract(data: bytes, tmp_path: Path, cap: int = CAP) -> Path:
    upload = tmp_path / "upload.bin"
    upload.write_bytes(data)
    dest = tmp_path / "dest"
    dest.mkdir()
    extract_archive(upload, dest, cap)
    return dest


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_dot_member_archive_is_accepted(tmp_path: Path) -> None:
    # What `tar -C adapter -czf x.tgz .` writes: "./" first, then "./name" members.
    data = tar_bytes([("./", None), ("./adapter_config.json", b"{}"),
                      ("./adapter_model.safetensors", b"w")])
    assert files(extract(data, tmp_path)) == {"adapter_config.json": b"{}",
                                             "adapter_model.safetensors": b"w"}


def test_packed_folder_is_flattened_even_when_it_holds_its_own_name(tmp_path: Path) -> None:
    data = tar_bytes([("bot/adapter_config.json", b"{}"), ("bot/bot", b"x")])
    assert files(extract(data, tmp_path)) == {"adapter_config.json": b"{}", "bot": b"x"}


def test_zip_with_a_folder_is_accepted(tmp_path: Path) -> None:
    data = zip_bytes([("bot/adapter_config.json", b"{}"), ("bot/w", b"x")])
    assert files(extract(data, tmp_path)) == {"adapter_config.json": b"{}", "w": b"x"}


def _truncated_gzip() -> bytes:
    data = tar_bytes([("adapter_config.json", b"{}"), ("w", bytes(range(256)) * 400)])
    return data[: len(data) // 2]


def _bad_crc_zip() -> bytes:
    data = bytearray(zip_bytes([("adapter_config.json", b"{" + b"x" * 2000 + b"}")]))
    offset = 30 + len("adapter_config.json") + 5  # inside the first member's data
    data[offset] ^= 0xFF
    return bytes(data)


def _many_members() -> bytes:
    return tar_bytes([(f"f{i}", b"x") for i in range(MAX_MEMBERS + 1)])


@pytest.mark.parametrize(("data", "match"), [
    (_truncated_gzip(), "damaged"),
    (_bad_crc_zip(), "damaged"),
    (tar_bytes([("a", b"1"), ("a", b"2")]), "two members named 'a'"),
    (tar_bytes([("a", b"1"), ("a/b", b"2")]), "inside 'a', which is a file"),
    (tar_bytes([("a/", None), ("a", b"2")]), "two members named 'a'"),
    (tar_bytes([("a/b", b"1"), ("a", b"2")]), "two members named 'a'"),
    (zip_bytes([("a", b"1"), ("a/b", b"2")]), "inside 'a', which is a file"),
    (tar_bytes([(".", b"x")]), "unsafe path"),
    (tar_bytes([("/".join(["d"] * 20) + "/f", b"x")]), "unsafe path"),
    (_many_members(), f"more than {MAX_MEMBERS} members"),
    (tar_bytes([("a", b"x")], mode="w:bz2"), "not a tar"),
    (b"\x1f\x8b not really gzip", "not a tar"),
], ids=["truncated-gzip", "zip-crc", "duplicate", "file-then-child", "dir-then-file",
        "child-then-file", "zip-file-then-child", "dot-file", "too-deep", "too-many",
        "bzip2", "junk-gzip"])
def test_damaged_or_colliding_archives_are_refused(tmp_path: Path, data: bytes,
                                                   match: str) -> None:
    with pytest.raises(ValueError, match=match):
        extract(data, tmp_path)


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_archive_over_the_cap_is_refused_from_its_headers(tmp_path: Path, kind: str) -> None:
    big = bytes(64 << 20)  # compresses to ~64 KiB
    data = (tar_bytes([("adapter_config.json", b"{}"), ("w", big)]) if kind == "tar"
            else zip_bytes([("adapter_config.json", b"{}"), ("w", big)]))
    assert len(data) < 1 << 20
    with pytest.raises(ValueError, match=f"unpacks to more than {CAP} bytes"):
        extract(data, tmp_path)
    # Nothing of the big member was written (tar: the small one before it was).
    assert sum(p.stat().st_size for p in (tmp_path / "dest").rglob("*")) <= 2
