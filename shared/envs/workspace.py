"""What an environment's sandbox use needs without a client: its workspace packed for the sandbox, and the error a
failure of the sandbox raises (:mod:`shared.envs.sandbox` talks to the service; importing this module loads no HTTP
client, so importing :mod:`shared.envs` stays cheap for the processes that never call the sandbox)."""

from __future__ import annotations

import functools
import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path


class SandboxError(Exception):
    """The sandbox failed (unreachable, HTTP 5xx, ``infra_error``, the session ended or was never made): an
    infrastructure failure, so the rollout becomes an ``error`` sample (never a 0 reward)."""


@dataclass(frozen=True)
class Workspace:
    """A directory packed once: ``archive`` (an uncompressed tar of its regular files and directories, sorted,
    with owner and times zeroed, so equal trees give equal bytes) and ``digest`` (its sha256, hex)."""

    path: str
    archive: bytes
    digest: str
    files: int


@functools.lru_cache(maxsize=32)
def pack_workspace(path: str) -> Workspace:
    """The workspace of directory ``path``, packed once per process (edit it and restart the service to change it).

    Raises:
        ValueError: ``path`` is not a directory, or holds something other than regular files and directories
            (a symlink, a device: the sandbox refuses them; the message names it).
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"workspace {path!r} is not a directory")
    buf, files = io.BytesIO(), 0
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in [*dirnames, *sorted(filenames)]:
                full = Path(dirpath) / name
                rel = full.relative_to(root).as_posix()
                if full.is_symlink() or not (full.is_file() or full.is_dir()):
                    raise ValueError(f"workspace {path!r}: {rel!r} is not a regular file or directory")
                info = tar.gettarinfo(str(full), arcname=rel)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if info.isfile():
                    files += 1
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    data = buf.getvalue()
    return Workspace(str(root), data, hashlib.sha256(data).hexdigest(), files)
