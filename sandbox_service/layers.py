"""The walks over a session's layers: hand changed files to a slot's uid, freeze a snapshot layer, count bytes.

Kept apart from :mod:`sandbox_service.sessions` because the run process (root, in the worker) calls
:func:`own_tree`, and the worker should import nothing heavy. No walk follows a symlink: a sandboxed program
may create one to any host path, and these walks run as root.
"""

from __future__ import annotations

import errno
import os
import stat

DIR_MODE, FILE_MODE, EXEC_MODE = 0o777, 0o666, 0o777
"""Modes of a template's (and a frozen snapshot layer's) directories, files, and files with an execute bit."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_DEPTH = 256
"""Deepest directory nesting a walk enters (it holds one descriptor per level); deeper is an error, the
session's own doing."""


def _walk(top: str):
    """``(dir_fd, name, lstat)`` of every entry under ``top`` (not ``top`` itself), a directory's entries before
    what is inside them. Never follows a symlink: each directory is opened by name relative to its parent's
    descriptor with ``O_NOFOLLOW``, and entries are ``lstat``-ed; no stack of Python frames (a run may nest
    directories deeply). Raises OSError."""
    stack = [(os.open(top, _DIR_FLAGS), None)]
    try:
        while stack:
            dfd, pending = stack[-1]
            if pending is None:
                pending = []
                with os.scandir(dfd) as it:
                    names = [e.name for e in it]
                for n in names:
                    try:
                        st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    yield dfd, n, st
                    if stat.S_ISDIR(st.st_mode):
                        pending.append(n)
                stack[-1] = (dfd, pending)
            if not pending:
                os.close(dfd)
                stack.pop()
                continue
            if len(stack) >= MAX_DEPTH:
                raise OSError(errno.ELOOP, f"directories nested deeper than {MAX_DEPTH} levels")
            stack.append((os.open(pending.pop(), _DIR_FLAGS, dir_fd=dfd), None))
    finally:
        for dfd, _ in stack:
            os.close(dfd)


def own_tree(top: str, uid: int | None) -> None:
    """Give ``top`` and everything in it to ``uid`` (lchown semantics; whiteouts and symlinks keep their mode).
    ``top`` itself becomes 0700 (like the fresh tmpfs /work of a plain run). Raises OSError."""
    if uid is None:
        return
    for dfd, n, st in _walk(top):
        if st.st_uid != uid or st.st_gid != uid:
            os.chown(n, uid, uid, dir_fd=dfd, follow_symlinks=False)
    os.chown(top, uid, uid, follow_symlinks=False)
    os.chmod(top, 0o700)


def freeze_tree(top: str) -> int:
    """Make a layer like a template: root-owned, directories 0777, files 0666 (0777 with an execute bit);
    symlinks and whiteouts (character devices 0/0) are only chowned. Returns the bytes it holds. Raises OSError."""
    total = 0
    for dfd, n, st in _walk(top):
        os.chown(n, 0, 0, dir_fd=dfd, follow_symlinks=False)
        mode = st.st_mode
        total += st.st_blocks * 512
        if stat.S_ISDIR(mode):
            os.chmod(n, DIR_MODE, dir_fd=dfd)  # a directory, and nothing runs that could swap it (see module doc)
        elif stat.S_ISREG(mode):
            os.chmod(n, EXEC_MODE if mode & 0o111 else FILE_MODE, dir_fd=dfd)
    os.chown(top, 0, 0)
    os.chmod(top, DIR_MODE)
    return total


def tree_bytes(top: str) -> int:
    """Bytes (allocated blocks) held under ``top``; symlinks not followed."""
    return sum(st.st_blocks * 512 for _, _, st in _walk(top))
