"""Slot uids that no other sandbox service on this host holds.

Each slot runs its programs as a uid of its own (``sandbox.uid_base`` and up). Two sandbox services on one host
(two replicas, ``flywheel up`` beside a test run) that picked the same uids would share more than a name: a
uid's ``RLIMIT_NPROC`` counts every process of that uid on the host, so one service's busy slot makes the
other's ``gcc`` (which forks its compiler passes) fail to fork, a false ``runtime_error``; and processes of one
uid may signal each other. So a service claims its uids: for each it takes an exclusive ``flock`` on
``<lock_dir>/uid-<uid>.lock`` and keeps the file open for its lifetime. The kernel drops the lock when the
process ends, however it ends (``kill -9`` included), so a crashed service never strands its uids.

Containers on one host that do not share a lock directory (each its own ``/run``) but share the host's user
namespace still need distinct ``uid_base`` values (docs/sandbox.md).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

LOCK_DIRS = (Path("/run/flywheel-sandbox"), Path(tempfile.gettempdir()) / "flywheel-sandbox")
"""Where the uid locks live: the first directory that can be created and written."""
SEARCH = 4096
"""How many uids from ``uid_base`` up are tried (``SandboxConfig.uid_base`` leaves that much room)."""


class UidClaim:
    """The uids this process holds, one per slot, with their lock files open.

    Raises (at construction):
        RuntimeError: fewer than ``count`` free uids in ``[base, base + SEARCH)``, or no lock directory can be
            written.
    """

    def __init__(self, base: int, count: int) -> None:
        self.dir = _lock_dir()
        self.uids: list[int] = []
        self._fds: list[int] = []
        for uid in range(base, base + SEARCH):
            if len(self.uids) == count:
                break
            fd = os.open(self.dir / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # another sandbox service holds it
                continue
            self.uids.append(uid)
            self._fds.append(fd)
        if len(self.uids) < count:
            self.release()
            raise RuntimeError(f"sandbox: only {len(self.uids)} of {count} slot uids in [{base}, {base + SEARCH}) are "
                               f"free of other sandbox services (locks in {self.dir})")

    def release(self) -> None:
        """Give the uids back (closing the lock files drops the locks)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _lock_dir() -> Path:
    for d in LOCK_DIRS:
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise RuntimeError(f"sandbox: none of {[str(d) for d in LOCK_DIRS]} can hold the slot uid locks")
