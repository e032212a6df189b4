"""Unpack an uploaded adapter archive (.tar, .tar.gz or .zip) into a directory, safely.

Refused with ValueError: anything that is not a tar or zip archive, members with absolute
paths or '..', links and device files, more than MAX_MEMBERS members, more than
MAX_UNPACKED_BYTES unpacked. A PEFT directory packed with its folder (adapter/...) is
flattened, so both `tar -C adapter -c .` and `tar -c adapter` work.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

MAX_MEMBERS = 64
MAX_UNPACKED_BYTES = 4 << 30


def _safe_name(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"archive member {name!r} has an unsafe path")
    return path


def _check_budget(count: int, total: int) -> None:
    if count > MAX_MEMBERS:
        raise ValueError(f"archive has more than {MAX_MEMBERS} members")
    if total > MAX_UNPACKED_BYTES:
        raise ValueError(f"archive unpacks to more than {MAX_UNPACKED_BYTES} bytes")


def _extract_tar(data: bytes, dest: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        members = archive.getmembers()
        _check_budget(len(members), sum(m.size for m in members))
        for member in members:
            path = _safe_name(member.name)
            if member.isdir():
                (dest / path).mkdir(parents=True, exist_ok=True)
                continue
            if not member.isfile():
                raise ValueError(f"archive member {member.name!r} is not a regular file")
            source = archive.extractfile(member)
            assert source is not None
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            with open(dest / path, "wb") as out:
                shutil.copyfileobj(source, out)


def _extract_zip(data: bytes, dest: Path) -> None:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = archive.infolist()
        _check_budget(len(infos), sum(i.file_size for i in infos))
        for info in infos:
            path = _safe_name(info.filename)
            if info.is_dir():
                (dest / path).mkdir(parents=True, exist_ok=True)
                continue
            if (info.external_attr >> 16) & 0o170000 == 0o120000:
                raise ValueError(f"archive member {info.filename!r} is a symbolic link")
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, open(dest / path, "wb") as out:
                shutil.copyfileobj(source, out)


def extract_archive(data: bytes, dest: Path) -> None:
    """Unpack data into the empty directory dest (see the module docstring)."""
    if not data:
        raise ValueError("the upload is empty: send the adapter as a .tar, .tar.gz or .zip")
    if zipfile.is_zipfile(io.BytesIO(data)):
        _extract_zip(data, dest)
    else:
        try:
            _extract_tar(data, dest)
        except tarfile.TarError:
            raise ValueError("the upload is not a tar(.gz) or zip archive") from None
    entries = [p for p in dest.iterdir() if p.name not in (".", "..")]
    if len(entries) == 1 and entries[0].is_dir():  # flatten adapter/... into dest
        inner = entries[0]
        for child in inner.iterdir():
            child.rename(dest / child.name)
        inner.rmdir()
