"""Unpack an uploaded adapter archive (.tar, .tar.gz or .zip) into a directory, safely.

Runs on a worker thread (it is disk and CPU work) over the upload as a file on disk. Every
refusal is a ValueError naming what is wrong with the archive, so the route answers 400:

- not a tar/zip archive, or a damaged one (truncated gzip, bad zip CRC, bad headers);
- members with absolute paths or '..', links, devices and other non-regular files;
- two members with one path, or a file where another member needs a directory;
- more than MAX_MEMBERS members, or more than ``max_bytes`` unpacked. Sizes are checked from
  each member's header before its data is read, and again while copying, so a small archive
  that would unpack to gigabytes is refused without unpacking it.

A "." member (``tar -C adapter -c .``) is the archive's root. A PEFT directory packed with
its folder (adapter/...) is flattened, so both ``tar -C adapter -c .`` and ``tar -c adapter``
work.
"""

from __future__ import annotations

import gzip
import shutil
import tarfile
import uuid
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

MAX_MEMBERS = 64
"""A PEFT directory is a handful of files (config, weights, README)."""

_CHUNK = 1 << 20

MAX_DEPTH = 8
"""Directory levels a member path may have (a PEFT directory is flat)."""

_DAMAGED = (tarfile.TarError, zipfile.BadZipFile, gzip.BadGzipFile, zlib.error, EOFError)
"""What a damaged archive raises while it is read (a gzip stream cut short: EOFError)."""


class _Layout:
    """The paths the members create so far: refuses collisions and over-budget archives."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.files: set[PurePosixPath] = set()
        self.dirs: set[PurePosixPath] = set()
        self.members = 0
        self.total = 0

    def add(self, name: str, is_dir: bool, size: int) -> PurePosixPath | None:
        """The member's safe relative path (None: the archive root "."), once it is known
        not to collide and to fit the budget."""
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise ValueError(f"archive has more than {MAX_MEMBERS} members")
        self.total += size
        if self.total > self.max_bytes:
            raise ValueError(f"archive unpacks to more than {self.max_bytes} bytes (the "
                             f"largest adapter the engines can load is far smaller)")
        path = _safe_name(name)
        if not path.parts:
            if not is_dir:
                raise ValueError(f"archive member {name!r} has an unsafe path")
            return None
        for parent in list(path.parents)[:-1]:  # all but "."
            if parent in self.files:
                raise ValueError(f"archive member {name!r} is inside {str(parent)!r}, which "
                                 f"is a file")
            self.dirs.add(parent)
        if path in self.files or (not is_dir and path in self.dirs):
            raise ValueError(f"archive has two members named {str(path)!r}")
        (self.dirs if is_dir else self.files).add(path)
        return path


def _safe_name(name: str) -> PurePosixPath:
    path = PurePosixPath(name)  # normalises "./a", "a//b" and "a/./b"; "." has no parts
    if (path.is_absolute() or ".." in path.parts or not name or len(path.parts) > MAX_DEPTH
            or any(len(part.encode()) > 255 for part in path.parts)):
        raise ValueError(f"archive member {name!r} has an unsafe path")
    return path


def _copy(source: IO[bytes], target: Path, limit: int) -> None:
    """Copy at most limit bytes (the member's declared size: more means a lying header)."""
    written = 0
    with open(target, "xb") as out:  # "x": never write through something already there
        while chunk := source.read(_CHUNK):
            written += len(chunk)
            if written > limit:
                raise ValueError(f"archive member {target.name!r} is larger than its header "
                                 f"says")
            out.write(chunk)


def _tar_members(archive: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while (member := archive.next()) is not None:  # one header at a time, data unread
        yield member


def _extract_tar(upload: Path, dest: Path, layout: _Layout) -> None:
    with open(upload, "rb") as head:
        gzipped = head.read(2) == b"\x1f\x8b"
    # Plain or gzip only: "r:*" would also run the bz2 and xz decoders over the upload.
    with tarfile.open(upload, mode="r:gz" if gzipped else "r:") as archive:
        for member in _tar_members(archive):
            if not (member.isdir() or member.isfile()):
                raise ValueError(f"archive member {member.name!r} is not a regular file or "
                                 f"directory")
            path = layout.add(member.name, member.isdir(), 0 if member.isdir() else member.size)
            if path is None:
                continue
            if member.isdir():
                (dest / path).mkdir(parents=True, exist_ok=True)
                continue
            source = archive.extractfile(member)
            assert source is not None  # a regular file always has data
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            _copy(source, dest / path, member.size)


def _extract_zip(upload: Path, dest: Path, layout: _Layout) -> None:
    with zipfile.ZipFile(upload) as archive:
        infos = archive.infolist()
        for info in infos:  # every header first: nothing is written for a refused archive
            if (info.external_attr >> 16) & 0o170000 == 0o120000:
                raise ValueError(f"archive member {info.filename!r} is a symbolic link")
            layout.add(info.filename, info.is_dir(), info.file_size)
        for info in infos:
            path = _safe_name(info.filename)
            if not path.parts:
                continue
            if info.is_dir():
                (dest / path).mkdir(parents=True, exist_ok=True)
                continue
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source:  # checks the CRC at the end of the data
                _copy(source, dest / path, info.file_size)


def _flatten(dest: Path) -> None:
    """adapter/... -> ...: one top directory and nothing else is a packed folder."""
    entries = list(dest.iterdir())
    if len(entries) != 1 or not entries[0].is_dir():
        return
    inner = entries[0].rename(dest / f".flatten-{uuid.uuid4().hex}")  # may hold its own name
    for child in inner.iterdir():
        child.rename(dest / child.name)
    inner.rmdir()


def extract_archive(upload: Path, dest: Path, max_bytes: int) -> None:
    """Unpack the archive file ``upload`` into the empty directory dest (see the module
    docstring); on ValueError dest may hold part of it (the caller removes dest)."""
    if upload.stat().st_size == 0:
        raise ValueError("the upload is empty: send the adapter as a .tar, .tar.gz or .zip")
    layout = _Layout(max_bytes)
    try:
        if zipfile.is_zipfile(upload):
            _extract_zip(upload, dest, layout)
        else:
            _extract_tar(upload, dest, layout)
    except _DAMAGED as exc:
        if isinstance(exc, tarfile.ReadError) and layout.members == 0:
            raise ValueError("the upload is not a tar(.gz) or zip archive") from None
        raise ValueError("the archive is damaged (truncated or corrupt)") from None
    _flatten(dest)


def remove_tree(path: Path) -> None:
    """Remove a directory we created (staging or an upload), ignoring what is already gone."""
    shutil.rmtree(path, ignore_errors=True)
