"""Sessions: a rollout's own copy of a workspace that lives across its executions, with snapshots and rollback.

Every file lives on one tmpfs (``sandbox.sessions_disk_mb``) that the service mounts at
``<tmp>/flywheel-sessions-<pid>-<tag>`` when it starts, *before* the workers start: a worker's mount
namespace is a private copy made when it starts, so a file system mounted later would be invisible to it,
while files created later inside one it copied are not. On it::

    templates/<digest>/          a workspace, unpacked once (read-only lower layer; root-owned, a+rw)
    templates/empty/             the lower layer of a session without a workspace
    sessions/<id>/layers/<k>/    snapshot k's changes (frozen: root-owned, a+rw, like a template)
    sessions/<id>/upper/         the changes since the newest snapshot
    sessions/<id>/work/          overlayfs's own work directory
    trash/                       what rollback and end remove, in the background

A session execution's run process mounts overlayfs on ``/work`` in its private mount namespace
(:func:`sandbox_service.run_process._make_run_dirs`) with ``lowerdir=layers/k:...:layers/1:<template>``
(relative to the session directory: the mount data is one page), ``upperdir=upper``. Starting a session,
a snapshot (rename ``upper`` to ``layers/k``, a new empty ``upper``) and a rollback (move the newer layers
and ``upper`` to the trash, a new empty ``upper``) cost a few directory operations whatever the workspace's
size; deleting template files leaves whiteouts that overlayfs honours in any layer.

Ownership: each slot runs code as its own uid, and a session's runs may land on any slot. The run process
(root) hands ``upper`` to its slot's uid before mounting (:func:`sandbox_service.layers.own_tree`, only the changed files); a
frozen layer is handed to root and made a+rw (:func:`sandbox_service.layers.freeze_tree`). Neither walk follows a symlink (a
sandboxed program may create one to any host path), and none runs while an execution of the session
does (the session's lock), so nothing can swap an entry under a walk.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_service import isolation
from sandbox_service.config import SandboxConfig
from sandbox_service.layers import DIR_MODE, freeze_tree, tree_bytes
from sandbox_service.workspaces import WorkspaceInfo

log = logging.getLogger("sandbox.sessions")

PREFIX = "flywheel-sessions-"
"""Name prefix of the sessions' tmpfs mount point in the temp directory (then the service's pid)."""
EMPTY = "empty"
REAP_INTERVAL_S = 0.5
ENDED_KEPT = 4096
"""Ended sessions remembered, so that a 404 can say why (expired, deleted, over its disk limit)."""


class SessionGone(Exception):
    """No such session (never existed, expired, deleted, ended over its disk limit); the message says which."""


class SessionsUnavailable(Exception):
    """Sessions cannot be served here (no ``namespaces`` layer: no overlay mounts); HTTP 501."""


class Full(Exception):
    """``max_sessions`` sessions are open, or a session holds ``max_snapshots``; the message says which."""


@dataclass
class Session:
    """One open session; its files live in ``dir`` (see the module doc)."""

    id: str
    dir: str
    template: str
    """The template's directory name under ``templates/`` (a digest, or ``empty``)."""
    workspace: str | None
    expires_at: float
    """Unix seconds."""
    disk_bytes: int
    layers: list[int] = field(default_factory=list)
    """Bytes of each frozen layer (layer k+1 at index k)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ended: str | None = None
    """Why it ended, once it did."""

    def wire(self) -> dict:
        """What the run process needs to mount the workspace (service-made paths, never the caller's)."""
        lower = [f"layers/{k}" for k in range(len(self.layers), 0, -1)] + [f"../../templates/{self.template}"]
        return {"dir": self.dir, "lower": ":".join(lower)}


class SessionStore:
    """The sessions' tmpfs, the templates on it, the open sessions and their reaper (one per service)."""

    def __init__(self, cfg: SandboxConfig, available: bool, why: str = "") -> None:
        self.cfg, self.available, self.why = cfg, available, why
        self.root: str | None = None
        self.templates: dict[str, WorkspaceInfo] = {}
        self.sessions: dict[str, Session] = {}
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.counters = collections.Counter()
        self._tasks: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Remove dead services' sessions, mount the tmpfs and start the reaper; call before the pool starts
        its workers. Without ``namespaces`` (or when the mount fails) nothing is mounted and every session call gets
        501 saying why. Raises OSError (its directories cannot be made)."""
        removed = remove_stale_sessions()
        if removed:
            log.info("removed the session files of %d sandbox services that are gone", removed)
        if not self.available:
            return
        root = os.path.join(tempfile.gettempdir(), f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}")
        os.mkdir(root, 0o700)
        try:
            isolation.mount("tmpfs", root, "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV,
                            f"size={self.cfg.sessions_disk_mb}m,mode=0700")
        except OSError as e:  # the service still executes; sessions answer 501 saying why
            os.rmdir(root)
            self.available, self.why = False, f"cannot mount the sessions' tmpfs on {root}: {e}"
            log.error("sandbox: no sessions: %s", self.why)
            return
        self.root = root
        for d in ("templates", "sessions", "trash", f"templates/{EMPTY}"):
            os.mkdir(os.path.join(root, d), 0o700)
        os.chmod(os.path.join(root, "templates", EMPTY), DIR_MODE)
        self._reaper = asyncio.create_task(self._reap_loop())

    async def close(self) -> None:
        """End every session, remove every file and the tmpfs (at service shutdown, after the workers stopped)."""
        if self._reaper:
            self._reaper.cancel()
        for s in list(self.sessions.values()):
            self._end(s, "the service shut down", background=False)
        if self._tasks:  # removals wait for their session's lock; one held by a stuck request must not hang here
            _, stuck = await asyncio.wait(set(self._tasks), timeout=10)
            for t in stuck:
                t.cancel()
        if self.root:
            await asyncio.to_thread(remove_sessions_dir, self.root)
            self.root = None

    # ------------------------------------------------------------------ templates

    def template_dir(self, digest: str) -> str:
        assert self.root
        return os.path.join(self.root, "templates", digest)

    def check_available(self) -> None:
        """Raise SessionsUnavailable when this service cannot hold sessions."""
        if not self.available or self.root is None:
            raise SessionsUnavailable(f"sandbox: no sessions here: {self.why}")

    # ------------------------------------------------------------------ sessions

    def open(self, workspace: str | None, ttl_s: float, disk_mb: int | None) -> Session:
        """A new session from the template ``workspace`` (None: an empty one).

        Raises:
            SessionsUnavailable: no ``namespaces`` layer.
            KeyError: the workspace is unknown (the caller PUTs it and retries).
            Full: ``max_sessions`` are open.
            OSError: its directories cannot be made (the sessions' disk is full).
        """
        self.check_available()
        assert self.root is not None
        if workspace is not None and workspace not in self.templates:
            raise KeyError(workspace)
        if len(self.sessions) >= self.cfg.max_sessions:
            raise Full(f"sandbox: {len(self.sessions)} sessions are open (sandbox.max_sessions)")
        t0 = time.perf_counter()
        sid = uuid.uuid4().hex
        d = os.path.join(self.root, "sessions", sid)
        os.mkdir(d, 0o700)
        for sub in ("upper", "work", "layers"):
            os.mkdir(os.path.join(d, sub), 0o700)
        s = Session(sid, d, workspace or EMPTY, workspace, time.time() + ttl_s,
                    (disk_mb if disk_mb is not None else self.cfg.session_disk_mb) * 2**20)
        self.sessions[sid] = s
        self.counters["sessions_started"] += 1
        self.op_seconds("start", time.perf_counter() - t0)
        return s

    def get(self, sid: str) -> Session:
        """The open session ``sid``. Raises SessionGone (saying why when it ended) or SessionsUnavailable."""
        self.check_available()
        s = self.sessions.get(sid)
        if s is None or s.ended:
            why = s.ended if s is not None else self.ended.get(sid)
            raise SessionGone(f"session {sid!r} ended: {why}" if why else f"unknown session {sid!r}")
        if time.time() >= s.expires_at:
            self.counters["sessions_expired"] += 1
            self._end(s, "expired (ttl_s)")
            raise SessionGone(f"session {sid!r} ended: expired (ttl_s)")
        return s

    async def after_run(self, s: Session) -> None:
        """After each execution (the session's lock held): end the session when its layers and changes hold
        more than its disk limit."""
        try:
            used = sum(s.layers) + await asyncio.to_thread(tree_bytes, os.path.join(s.dir, "upper"))
        except OSError as e:
            self._end(s, f"its files cannot be walked: {e}")
            return
        if used > s.disk_bytes:
            self._end(s, f"its files outgrew its disk limit ({used // 2**20} MiB > {s.disk_bytes // 2**20} MiB)")

    async def snapshot(self, s: Session) -> int:
        """Freeze the workspace's state now as snapshot k (the session's lock held); returns k.
        Raises Full at ``max_snapshots``, SessionGone (its files cannot be walked: the session is ended), OSError."""
        if len(s.layers) >= self.cfg.max_snapshots:
            raise Full(f"session {s.id!r} holds {len(s.layers)} snapshots (sandbox.max_snapshots); roll back to "
                       "an earlier one first")
        t0 = time.perf_counter()
        upper = os.path.join(s.dir, "upper")
        try:
            size = await asyncio.to_thread(freeze_tree, upper)
        except OSError as e:
            self._end(s, f"its files cannot be frozen as a snapshot: {e}")
            raise SessionGone(f"session {s.id!r} ended: its files cannot be frozen as a snapshot: {e}") from None
        k = len(s.layers) + 1
        os.rename(upper, os.path.join(s.dir, "layers", str(k)))
        os.mkdir(upper, 0o700)
        s.layers.append(size)
        self.counters["snapshots"] += 1
        self.op_seconds("snapshot", time.perf_counter() - t0)
        return k

    def rollback(self, s: Session, k: int) -> None:
        """Return the workspace to snapshot ``k`` and drop the later ones (the session's lock held).
        Raises KeyError (no snapshot ``k``), OSError."""
        if not 0 <= k <= len(s.layers):
            raise KeyError(k)
        t0 = time.perf_counter()
        doomed = [os.path.join(s.dir, "layers", str(j)) for j in range(len(s.layers), k, -1)]
        doomed.append(os.path.join(s.dir, "upper"))
        for path in doomed:
            self._trash(path)
        os.mkdir(os.path.join(s.dir, "upper"), 0o700)
        del s.layers[k:]
        self.counters["rollbacks"] += 1
        self.op_seconds("rollback", time.perf_counter() - t0)

    def delete(self, sid: str) -> None:
        """End the session now (DELETE). Raises SessionGone."""
        self._end(self.get(sid), "deleted")

    def _end(self, s: Session, why: str, background: bool = True) -> None:
        """Forget ``s`` and remove its files (moved to the trash at once; emptied in the background). An
        execution running now finishes first: the files go once it released the session's lock."""
        if s.ended:
            return
        s.ended = why
        self.sessions.pop(s.id, None)
        self.ended[s.id] = why
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        self.counters["sessions_ended"] += 1
        log.info("session %s ended: %s", s.id, why)

        async def remove() -> None:
            async with s.lock:
                self._trash(s.dir)

        if background:
            self._spawn(remove())
        elif not s.lock.locked():
            self._trash(s.dir)

    def _trash(self, path: str) -> None:
        """Move ``path`` out of the way at once (a rename) and remove it in a thread."""
        assert self.root
        dest = os.path.join(self.root, "trash", uuid.uuid4().hex)
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return
        self._spawn(asyncio.to_thread(shutil.rmtree, dest, True))

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _reap_loop(self) -> None:
        """End the sessions past their ``expires_at``."""
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.time()
            for s in [s for s in self.sessions.values() if now >= s.expires_at]:
                self.counters["sessions_expired"] += 1
                self._end(s, "expired (ttl_s)")

    def op_seconds(self, op: str, seconds: float) -> None:
        """Hook for the latency histogram (set by the API when metrics are wired)."""

    def health(self) -> dict:
        """Session counts for ``/healthz``."""
        return {"available": self.available and self.root is not None, "open": len(self.sessions),
                "max": self.cfg.max_sessions, "templates": len(self.templates),
                "counters": dict(self.counters), **({} if self.available else {"why": self.why})}


def remove_sessions_dir(root: str) -> None:
    """Empty a sessions tmpfs (its pages are freed even where a worker's namespace still holds the mount),
    unmount it and remove its mount point."""
    for entry in Path(root).iterdir() if os.path.isdir(root) else ():
        shutil.rmtree(entry, ignore_errors=True)
    try:
        isolation.umount(root)
    except OSError:
        pass
    try:
        os.rmdir(root)
    except OSError:
        pass


def remove_stale_sessions() -> int:
    """Remove the sessions tmpfs of sandbox services that are no longer running (named by their pid, e.g.
    after ``kill -9``); returns how many."""
    removed = 0
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        pid = d.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            remove_sessions_dir(str(d))
            removed += 1
    return removed
