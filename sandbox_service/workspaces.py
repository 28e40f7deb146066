"""Workspace templates: a tar archive unpacked once into the sessions' tmpfs as a read-only lower layer.

``PUT /v1/workspaces/{digest}`` hands the archive (plain tar, or gzip and the other formats ``tarfile``
detects by their magic bytes) to :func:`unpack`. Every member is checked before a byte is written: only
regular files and directories, relative paths without ``..``, the unpacked size within the limit. The files
are written by the service itself (never ``tarfile.extract``), so nothing of the archive's ownership, modes,
times or special files survives: every entry is owned by root, directories are 0777 and files 0666 (0777
when the archive gave any execute bit), so the slot uid of any run can change them through the overlay.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import PurePosixPath

from sandbox_service.layers import DIR_MODE, EXEC_MODE, FILE_MODE, MAX_DEPTH

MAX_MEMBERS = 100_000
"""Most members an archive may have (a compressed archive of empty headers would otherwise fill memory)."""



class BadWorkspace(ValueError):
    """The archive cannot be a workspace; the message names the member (HTTP 422)."""


@dataclass(frozen=True)
class WorkspaceInfo:
    """What ``PUT``/``GET /v1/workspaces/{digest}`` answer."""

    digest: str
    files: int
    """Regular files."""
    bytes: int
    """Unpacked size (sum of the files' sizes)."""

    def as_json(self) -> dict:
        return {"digest": self.digest, "files": self.files, "bytes": self.bytes}


def sha256_hex(body: bytes) -> str:
    """The lowercase sha256 hex digest of ``body``."""
    return hashlib.sha256(body).hexdigest()


def _member_path(m: tarfile.TarInfo) -> PurePosixPath | None:
    """The member's normalised relative path (None for the archive's root ``.``). Raises BadWorkspace."""
    name = m.name
    if "\x00" in name or "\\" in name:
        raise BadWorkspace(f"member {name!r}: NUL or backslash in its path")
    p = PurePosixPath(name)
    if p.is_absolute():
        raise BadWorkspace(f"member {name!r}: absolute path")
    if ".." in p.parts:
        raise BadWorkspace(f"member {name!r}: '..' in its path")
    parts = [x for x in p.parts if x != "."]
    if any(len(x.encode()) > 255 for x in parts) or len(name.encode()) > 4096:
        raise BadWorkspace(f"member {name[:64]!r}: path too long")
    if len(parts) >= MAX_DEPTH:
        raise BadWorkspace(f"member {name[:64]!r}: nested deeper than {MAX_DEPTH - 1} directories")
    return PurePosixPath(*parts) if parts else None


def check_members(tar: tarfile.TarFile, max_bytes: int) -> list[tuple[PurePosixPath, tarfile.TarInfo]]:
    """Every member checked (type, path, total size), as ``(path, member)`` in archive order. Raises BadWorkspace."""
    out, total, kinds = [], 0, {}
    for i, m in enumerate(tar):
        if i >= MAX_MEMBERS:
            raise BadWorkspace(f"the archive has more than {MAX_MEMBERS} members")
        if not (m.isreg() or m.isdir()):
            kind = ("symlink" if m.issym() else "hard link" if m.islnk() else "device" if m.ischr() or m.isblk()
                    else "fifo" if m.isfifo() else f"type {m.type!r}")
            raise BadWorkspace(f"member {m.name!r}: a {kind}; only regular files and directories are accepted")
        p = _member_path(m)
        if p is None:
            if m.isreg():
                raise BadWorkspace(f"member {m.name!r}: a file cannot be the workspace's root")
            continue
        kind = "dir" if m.isdir() else "file"
        for parent in p.parents:
            if kinds.get(parent) == "file":
                raise BadWorkspace(f"member {m.name!r}: its parent {str(parent)!r} is a file")
        if kinds.get(p, kind) != kind:
            raise BadWorkspace(f"member {m.name!r}: both a file and a directory")
        kinds[p] = kind
        if m.isreg():
            total += m.size
            if total > max_bytes:
                raise BadWorkspace(f"member {m.name!r}: the workspace unpacks to more than {max_bytes} bytes")
        out.append((p, m))
    return out


def unpack(body: bytes, dest: str, max_bytes: int) -> WorkspaceInfo:
    """Unpack the archive ``body`` into the new directory ``dest`` (written under a temporary name, then renamed;
    if ``dest`` appeared meanwhile, the other copy wins). Returns its counts (``digest`` left empty).

    Raises:
        BadWorkspace: not a tar archive, or a member that may not be in a workspace (the message names it).
        OSError: the sessions' disk is full (ENOSPC) or another write failed.
    """
    try:
        tar = tarfile.open(fileobj=io.BytesIO(body), mode="r:*")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise BadWorkspace(f"the body is not a tar archive (optionally gzip-compressed): {e}") from None
    tmp = f"{dest}.partial-{uuid.uuid4().hex[:8]}"
    try:
        with tar:
            try:
                members = check_members(tar, max_bytes)
            except (tarfile.TarError, EOFError) as e:
                raise BadWorkspace(f"the archive is damaged: {e}") from None
            os.mkdir(tmp, DIR_MODE)
            os.chmod(tmp, DIR_MODE)
            files = size = 0
            for p, m in members:
                target = os.path.join(tmp, *p.parts)
                _make_parents(tmp, p)
                if m.isdir():
                    if not os.path.isdir(target):
                        os.mkdir(target)
                    os.chmod(target, DIR_MODE)
                    continue
                src = tar.extractfile(m)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    shutil.copyfileobj(src, f, 1 << 20)
                os.chmod(target, EXEC_MODE if m.mode & 0o111 else FILE_MODE)
                files += 1
                size += m.size
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isdir(dest):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return WorkspaceInfo("", files, size)


def _make_parents(root: str, p: PurePosixPath) -> None:
    """The directories above ``p`` under ``root`` (0777), for archives that list a file before its directory."""
    d = root
    for part in p.parts[:-1]:
        d = os.path.join(d, part)
        if not os.path.isdir(d):
            os.mkdir(d)
            os.chmod(d, DIR_MODE)
